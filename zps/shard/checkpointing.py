"""The shard's checkpoints, driven: restored at start, written beside the loops (one
at a time, periodically, when an operator asks, at a graceful stop), and the write-ahead
log a primary starts.  The files themselves are :mod:`zps.shard.checkpoint`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from zps.shard import snapshots
from zps.shard.checkpoint import CheckpointStore, cut, finish
from zps.shard.core import ShardCore
from zps.shard.durability import Durability
from zps.shard.metrics import CheckpointStats
from zps.shard.primary import Reply
from zps.shard.restore import restore
from zps.shard.session import ShardSession
from zps.store.snapshot import Snapshot

log = logging.getLogger("zps.shard")


def _write_checkpoint(store: CheckpointStore, snap: Snapshot) -> tuple[Path, int]:
    """The file written, and the LSN of the oldest checkpoint kept (the log is kept
    from there on)."""
    path = store.write(finish(snap))
    oldest = store.oldest_lsn(snap.partition)
    return path, snap.lsn if oldest is None else oldest


class Checkpointer:
    """A shard's checkpoints (none without a data dir: ``store`` is None)."""

    def __init__(
        self,
        core: ShardCore,
        session: ShardSession[Reply],
        durability: Durability,
        store: CheckpointStore | None,
        *,
        data_dir: str | None,
    ) -> None:
        self.core = core
        self.session = session
        self.durability = durability
        self.store = store
        self.data_dir = data_dir
        self.stats = CheckpointStats()
        self._task: asyncio.Task[Path | None] | None = None
        #: Runs a write beside the shard's loops (set once they run: see ShardServer._run).
        self._spawn: Callable[[Coroutine[Any, Any, Path | None]], asyncio.Task[Path | None]] = (
            asyncio.ensure_future
        )

    def spawn_with(
        self, spawn: Callable[[Coroutine[Any, Any, Path | None]], asyncio.Task[Path | None]]
    ) -> None:
        """Writes run as tasks of ``spawn`` (the shard's task group)."""
        self._spawn = spawn

    async def finish(self) -> None:
        """Let a periodic checkpoint under way finish."""
        if self._task is not None:
            await asyncio.wait([self._task])

    def mark_final(self) -> None:
        """After the final checkpoint of a graceful stop: note that the newest
        checkpoint holds every write this copy acknowledged (a copy restored from it
        without a log claims its partition as complete)."""
        store, core, done = self.store, self.core, self.core.checkpointed
        if store is None or core.partition is None or not done or done["lsn"] != core.lsn:
            return
        try:
            store.mark_final(core.partition, Path(done["path"]))
        except OSError as e:
            log.error("the final checkpoint %s could not be noted as final: %s", done["path"], e)

    def restore(self) -> None:
        """Load the newest usable checkpoint, to claim its partition when registering."""
        if self.store is None:
            return
        d = self.durability
        found, wal = restore(
            self.core,
            self.store,
            log_segment_bytes=None if d.mode == "none" else d.segment_bytes,
        )
        if found is None:
            log.info("no checkpoint in %s: starting empty", self.data_dir)
            return
        if wal is not None:
            d.adopt(wal, found.partition)
        self.core.primary = False  # until the broker says so
        self.session.restore(
            found.partition, found.epoch, found.lsn, time.monotonic(), complete=found.complete
        )
        replayed = found.recovery.applied if found.recovery else 0
        log.info(
            "restored partition %d at epoch %d, LSN %d from %s and %d logged messages",
            found.partition,
            found.epoch,
            found.lsn,
            found.checkpoint or "nothing",
            replayed,
        )
        if found.recovery is not None and found.recovery.cut:
            log.warning("write-ahead log replay stopped: %s", found.recovery.cut)
        if not found.complete:
            log.warning(
                "partition %d at LSN %d may lack writes this copy acknowledged (%s): "
                "claimed as incomplete",
                found.partition,
                found.lsn,
                f"the log reached LSN {found.recovery.reached}, set aside"
                if found.recovery is not None
                else "a checkpoint with no log after it, not written at a clean stop",
            )
        if found.checkpoint is not None:
            with contextlib.suppress(OSError):
                self.stats.time = Path(found.checkpoint).stat().st_mtime
            with contextlib.suppress(ValueError, IndexError):  # ckpt-EPOCH-LSN.zps
                _, epoch, lsn = Path(found.checkpoint).stem.split("-")
                self.core.checkpointed = {
                    "lsn": int(lsn),
                    "epoch": int(epoch),
                    "path": str(found.checkpoint),
                    "time": self.stats.time,
                }

    def start(self) -> None:
        """Write a checkpoint beside the loops (never inside one); one at a time."""
        if self._task is None or self._task.done():
            self._task = self._spawn(self.write())

    async def write(self, *, final: bool = False) -> Path | None:
        """The event loop only copies the partition into buffers prepared off it; the
        ordering, encoding, checksum, write, fsync and rename run in a worker thread.
        Returns the file written (None: none was)."""
        store, core = self.store, self.core
        if store is None or core.partition is None:
            return None
        space = None if final else await snapshots.prepare(core)
        if core.partition is None or not self.session.begin_checkpoint(
            time.monotonic(), core.lsn, final=final
        ):
            wanted = core.checkpoint_wanted  # asked for (op "checkpoint"): already under way?
            if wanted is not None and self.session.last_checkpoint[1] >= wanted:
                core.checkpoint_wanted = None
            return None
        began = time.monotonic()
        snap = cut(core, space)  # memory copies only, at one LSN
        cut_s = time.monotonic() - began
        if core.checkpoint_wanted is not None and snap.lsn >= core.checkpoint_wanted:
            core.checkpoint_wanted = None
        del space
        self.durability.roll()  # the log's older segments are what this checkpoint holds
        t0 = time.monotonic()
        try:
            path, oldest = await asyncio.to_thread(_write_checkpoint, store, snap)
        except OSError as e:
            self.stats.failures += 1
            log.error(
                "checkpoint of partition %d at LSN %d failed (the older ones and the log "
                "are kept): %s",
                snap.partition, snap.lsn, e,
            )  # fmt: skip
            return None
        self.stats.written += 1
        self.stats.seconds, self.stats.time = time.monotonic() - t0, time.time()
        # The log goes from the oldest checkpoint kept: each of them restores with it.
        self.durability.checkpointed(snap.partition, oldest)
        core.checkpointed = {
            "lsn": snap.lsn,
            "epoch": snap.epoch,
            "path": str(path),
            "time": self.stats.time,
        }
        log.info(
            "checkpoint of partition %d at LSN %d written to %s in %.2fs (cut in %.3fs)",
            snap.partition,
            snap.lsn,
            path,
            time.monotonic() - t0,
            cut_s,
        )
        return path

    def log_as_primary(self) -> None:
        """A primary logs its partition from its current LSN: the log it holds goes on if
        it ends there, else a new one starts (at a checkpoint of the current state)."""
        d, p, store = self.durability, self.core.partition, self.store
        if d.mode == "none" or store is None or p is None or d.continues(p, self.core.lsn):
            return
        d.start(store.folder(p), p, self.core.lsn)
        if self.core.lsn > 0:
            log.warning(
                "partition %d at LSN %d has no log ending there: starting one, and a "
                "checkpoint as its base",
                p,
                self.core.lsn,
            )
            self.start()
