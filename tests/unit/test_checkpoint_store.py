"""Checkpoint files under storage faults: a failed write leaves nothing behind, temporary
files of unfinished checkpoints go at start-up, the log is kept from the oldest
checkpoint, and a copy restored from a checkpoint alone says whether it is complete."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_shardcore import call, new_core, push_dense
from zps.protocol.messages import ShardClaim
from zps.shard.checkpoint import CheckpointStore, cut, decode_checkpoint, finish
from zps.shard.core import ShardCore
from zps.shard.restore import restore
from zps.shard.session import ShardSession


def pushed(core: ShardCore, times: int) -> ShardCore:
    for _ in range(times):
        assert call(core, [push_dense(0, np.ones(4, dtype=np.float32))]).statuses == ["OK"]
    return core


def test_a_failed_checkpoint_write_leaves_no_file_and_keeps_the_older_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    core = pushed(new_core(), 1)
    first = store.write(finish(cut(core)))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("zps.shard.checkpoint.os.fsync", full)
    with pytest.raises(OSError, match="No space"):
        store.write(finish(cut(pushed(core, 1))))
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]
    assert decode_checkpoint(first.read_bytes()).lsn == first_lsn(first)


def first_lsn(path: Path) -> int:
    return int(path.stem.split("-")[2])


def test_temporary_files_of_unfinished_checkpoints_are_removed_at_start_up(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path)
    path = store.write(finish(cut(pushed(new_core(), 2))))
    stale = path.parent / f".{path.name}.tmp-4242"  # a crash mid-write
    stale.write_bytes(b"half a checkpoint")
    restored, _ = restore(new_core(), store)
    assert restored is not None and restored.checkpoint == path
    assert not stale.exists()


def test_the_oldest_checkpoint_kept_names_where_the_log_must_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    core = new_core()
    lsns = []
    for _ in range(5):
        lsns.append(store.write(finish(cut(pushed(core, 1)))))
    assert store.oldest_lsn(core.partition or 0) == first_lsn(lsns[2])
    assert store.oldest_lsn(99) is None


def test_a_checkpoint_alone_is_complete_only_when_written_at_a_clean_stop(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path)
    core = pushed(new_core(), 3)
    path = store.write(finish(cut(core)))
    # Written periodically: acknowledged writes may have followed it.
    restored, wal = restore(new_core(), store)
    assert restored is not None and wal is None and not restored.complete
    # Written at a clean stop: complete, once; the note is consumed by the start-up.
    store.mark_final(core.partition or 0, path)
    restored, _ = restore(new_core(), store)
    assert restored is not None and restored.complete
    restored, _ = restore(new_core(), store)
    assert restored is not None and not restored.complete
    # A note naming another checkpoint (the final one did not verify) counts for nothing.
    store.mark_final(core.partition or 0, path.with_name("ckpt-00000009-0000000000000099.zps"))
    restored, _ = restore(new_core(), store)
    assert restored is not None and not restored.complete


def test_the_claim_of_a_restored_copy_says_whether_it_is_complete() -> None:
    session: ShardSession[object] = ShardSession("s1", heartbeat_interval=0.1, liveness=10, now=0.0)
    assert session.claim(0) is None
    session.restore(2, 5, 40, 0.0, complete=False)
    claim = session.claim(40)
    assert claim is not None and claim["complete"] is False
    assert claim["partition"] == 2 and claim["lsn"] == 40
    assert ShardClaim.parse(claim).complete is False  # as the broker reads it
    session.restore(2, 5, 40, 0.0)
    claim = session.claim(40)
    assert claim is not None and claim.get("complete", True) is True


def test_a_restored_copy_that_applied_nothing_is_still_complete_at_the_next_stop() -> None:
    session: ShardSession[object] = ShardSession("s1", heartbeat_interval=0.1, liveness=10, now=0.0)
    session.restore(2, 5, 40, 0.0)
    assert session.unchanged_since_restore(40, 5)
    assert not session.unchanged_since_restore(41, 5)  # it applied a write since
    assert not session.unchanged_since_restore(40, 6)  # another history
    session.restore(2, 5, 40, 0.0, complete=False)
    assert not session.unchanged_since_restore(40, 5)  # never known to be complete
