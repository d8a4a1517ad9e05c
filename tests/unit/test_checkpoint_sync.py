"""A checkpoint being written is synced behind its writes, in a thread of its own: the
writer goes on while the disk writes, waits for one sync before it starts the next, and
a sync that fails fails the checkpoint (no file left, the older ones kept)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from zps.shard import checkpoint as ckpt
from zps.shard.checkpoint import CheckpointStore

PIECE = 4096


def test_syncs_run_behind_the_writes_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt, "SYNC_BYTES", 2 * PIECE)
    release = threading.Event()
    began = threading.Semaphore(0)
    writer = threading.get_ident()
    syncs: list[int] = []

    def slow_sync(fd: int) -> None:
        syncs.append(threading.get_ident())
        began.release()
        assert release.wait(10)

    monkeypatch.setattr("zps.shard.checkpoint.os.fdatasync", slow_sync)
    pending = CheckpointStore(tmp_path).begin(0, 1, 5)
    data = memoryview(b"x" * PIECE)
    for _ in range(3):  # the sync of the first two pieces starts; the writer goes on
        pending.write(data)
    assert began.acquire(timeout=10)
    done = threading.Event()

    def fourth() -> None:  # the next sync waits for the one under way
        pending.write(data)
        done.set()

    t = threading.Thread(target=fourth)
    t.start()
    assert not done.wait(0.2)
    release.set()
    t.join(10)
    assert done.is_set() and began.acquire(timeout=10)
    assert len(syncs) == 2 and writer not in syncs  # never in the writing thread
    path = pending.commit()
    assert path.read_bytes() == b"x" * 4 * PIECE


@pytest.mark.parametrize("at", ["a later write", "the commit"])
def test_a_failed_sync_behind_the_writes_fails_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    monkeypatch.setattr(ckpt, "SYNC_BYTES", 2 * PIECE)
    store = CheckpointStore(tmp_path, keep=3)
    older = store.begin(0, 1, 3)
    older.write(memoryview(b"o" * PIECE))
    kept = older.commit()

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("zps.shard.checkpoint.os.fdatasync", eio)
    data = memoryview(b"x" * PIECE)
    with pytest.raises(OSError, match="Input/output"):
        store.write_encoded(0, 1, 5, [data, data, data] if at == "the commit" else [data] * 5)
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]
    assert not store.pending


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_a_checkpoint_leaves_the_page_cache_once_synced_and_once_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt, "SYNC_BYTES", 2 * PIECE)
    advice: list[tuple[int, int, int]] = []
    synced: list[int] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, what: int) -> None:
        advice.append((offset, length, what))
        real(fd, offset, length, what)

    def fdatasync(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)

    monkeypatch.setattr("zps.shard.checkpoint.os.posix_fadvise", fadvise)
    monkeypatch.setattr("zps.shard.checkpoint.os.fdatasync", fdatasync)
    store = CheckpointStore(tmp_path)
    pending = store.begin(0, 1, 5)
    for _ in range(3):
        pending.write(memoryview(b"x" * PIECE))
    pending.commit()
    dropped = [(o, n) for o, n, what in advice if what == os.POSIX_FADV_DONTNEED]
    # What a sync behind the writes covered (at least the bytes written when it
    # started), then the whole file once the commit's fsync is done.
    assert dropped == [(0, 2 * PIECE), (0, 0)] and synced and synced[0] >= 2 * PIECE
