"""A shard's start-up: the newest checkpoint that verifies loaded into its core, then its
log replayed after it (:func:`restore`); the files' layout and rules are
:mod:`zps.shard.checkpoint`'s."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from zps.errors import ZpsError
from zps.protocol.codec import MsgType, Route, decode
from zps.shard.checkpoint import CheckpointError, CheckpointStore, Found
from zps.shard.core import ShardCore
from zps.store.snapshot import Snapshot, build_store
from zps.store.wal import Record, Recovery, Wal, WalError

log = logging.getLogger("zps.checkpoint")


def apply_record(core: ShardCore, rec: Record) -> int:
    """Re-run a logged message on ``core`` (as a replica applies the stream); the new LSN."""
    if not rec.frames:
        raise CheckpointError(f"logged LSN {rec.lsn} holds no message")
    header = decode([Route(MsgType.REQUEST).pack(), rec.frames[0]]).header
    return core.apply_replicated(header, rec.frames[1:])


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` loaded into the core."""

    partition: int
    epoch: int
    lsn: int
    checkpoint: Path | None  # the checkpoint it started from (None: an empty partition)
    recovery: Recovery | None  # what the log replayed (None: no log)
    #: Whether the copy holds every write it acknowledged: with a log, unless what the
    #: replay set aside shows the log went past the state (:attr:`Recovery.complete`);
    #: without one, only when the checkpoint was written at a clean stop
    #: (:meth:`CheckpointStore.mark_final`).
    complete: bool = True


def restore(
    core: ShardCore, store: CheckpointStore, *, log_segment_bytes: int | None = None
) -> tuple[Restored | None, Wal | None]:
    """Load the newest checkpoint that verifies into ``core`` and, with a log
    (``log_segment_bytes`` given), replay the log after it; returns what was
    restored and the log, open for appending after its last good record.

    Without a log, the newest checkpoint of any partition is used.  With one, the
    partition is the one whose files changed last; its log may start from an empty
    partition (a primary that never checkpointed).  A torn or corrupt tail of the
    log is cut (:meth:`~zps.store.wal.Wal.recover`).  Temporary files of
    checkpoints that never finished are removed first, and the note of a clean
    stop is consumed.
    """
    for stale in store.remove_temporary():
        log.warning("removed %s, a checkpoint that never finished", stale)
    finals = store.take_finals()
    if log_segment_bytes is None:
        found = _latest(store)
        if found is None:
            return None, None
        _load(core, found.snapshot)
        snap = found.snapshot
        final = finals.get(snap.partition) == found.path.name
        restored = Restored(snap.partition, snap.epoch, snap.lsn, found.path, None, final)
        return restored, None
    partition = store.newest_partition()
    if partition is None:
        return None, None
    found = _latest(store, partition)
    if found is not None:
        _load(core, found.snapshot)
    else:
        core.assign(partition, 0, primary=False)  # the log may start from nothing
    wal = Wal(store.folder(partition), segment_bytes=log_segment_bytes)
    try:
        recovery = wal.recover(core.lsn, core.epoch, lambda rec: apply_record(core, rec))
    except WalError as e:
        raise CheckpointError(str(e)) from e
    core.epoch = recovery.epoch
    if found is None and core.lsn == 0:
        core.assign(None, 0)
        wal.close()
        return None, None
    restored = Restored(
        partition,
        core.epoch,
        core.lsn,
        found.path if found else None,
        recovery,
        recovery.complete,
    )
    return restored, wal


def _latest(store: CheckpointStore, partition: int | None = None) -> Found | None:
    """:meth:`CheckpointStore.latest`, how long it took logged."""
    began = time.monotonic()
    found = store.latest(partition)
    if found is not None:
        took = time.monotonic() - began
        size = found.path.stat().st_size if found.path.exists() else 0
        log.info("read %s: %.0f MB in %.2fs", found.path.name, size / 1e6, took)
    return found


def _load(core: ShardCore, snap: Snapshot) -> None:
    """Load a checkpoint read by :func:`zps.shard.checkpoint.read_checkpoint` (its tables
    own its arrays)."""
    try:
        store = build_store(snap, core.dense_memory)
    except ZpsError as e:
        raise CheckpointError(f"checkpoint does not load: {e}") from e
    core.install_snapshot(snap, store)
