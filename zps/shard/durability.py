"""Group commit of a partition's write-ahead log, off the event loop.

The shard logs every message that changed its partition (:meth:`Durability.log`,
on the event loop: it only queues the record, whose frames are the received
ones, not copies).  One writer task hands whatever queued up to a single worker
thread, which appends it to the log (:class:`~zps.store.wal.Wal`) and, by mode:

* ``fsync``: fsyncs once for the whole batch (group commit: every record that
  arrived while the previous batch was being written shares the next fsync).
  What waits for the log (:meth:`Durability.after`: a client's reply, a
  replica's acknowledgement) is released only when the batch holding its LSN
  is on disk: an acknowledged write survives the loss of every machine.
* ``interval``: releases a batch once it is written to the operating system,
  and fsyncs at most ``interval`` seconds after the first write not yet on
  disk.  An acknowledged write survives the loss of every process (SIGKILL,
  OOM); a crash of every machine at once loses at most the last ``interval``
  (plus one write) of acknowledged updates.
* ``none``: no log; checkpoints only.

The event loop never waits on the disk: heartbeats, leases and reads go on
while a batch is written.  Control operations (start a log at a base, begin a
new segment, drop segments a checkpoint covers) are queued with the records and
run in order by the same thread, so the log is only ever touched by one thread.

A write that fails (a full disk: ENOSPC, EFBIG) leaves no partial record (the
log truncates the segment back first) and is retried every :data:`RETRY_S`
seconds from the first record not written whole; what waits for it keeps
waiting, since it is not durable.  A failed sync is never retried: the log is
*lost* (:class:`~zps.store.wal.WalLost`: the kernel may have dropped the pages it
could not write).  From then on nothing is written and nothing waiting is
released; :attr:`Durability.on_lost` tells the shard, which leaves its role.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from zps.errors import ZpsError
from zps.shard.checkpoint import drop_checkpoints
from zps.store.wal import Buffer, Record, Wal, WalError, WalLost

log = logging.getLogger("zps.shard")

MODES = ("none", "interval", "fsync")
#: Seconds between attempts to write a batch that failed.
RETRY_S = 1.0


class LogLost(ZpsError):
    """A shard stopped because its write-ahead log was lost (a failed sync)."""


@dataclass
class DurabilityStats:
    batches: int = 0
    records: int = 0
    bytes: int = 0
    syncs: int = 0
    errors: int = 0


_Op = Callable[[], None]


class Durability:
    """The write-ahead log of the partition a shard holds, and who waits for it."""

    def __init__(
        self,
        mode: str,
        *,
        interval: float = 0.1,
        segment_bytes: int = 64 << 20,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"durability must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.interval = interval
        self.segment_bytes = segment_bytes
        self.stats = DurabilityStats()
        #: The partition whose log is open (None: no log).
        self.partition: int | None = None
        #: LSN of the last record queued, and of the last one on disk (``fsync``) or
        #: handed to the operating system (``interval``).
        self.logged = 0
        self.durable = 0
        #: Called after each batch is durable (a replica acknowledges then).
        self.on_durable: Callable[[], None] | None = None
        #: Why the log was lost (a failed sync), or None; :attr:`on_lost` is called
        #: with it once, on the event loop.
        self.lost: str | None = None
        self.on_lost: Callable[[str], None] | None = None
        self._wal: Wal | None = None  # touched only by the worker thread once running
        self._queue: list[Record | _Op] = []
        self._waiters: deque[tuple[int, Callable[[], None]]] = deque()
        self._generation = 0  # bumped when the log restarts at a new base
        self._wake = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._last_sync = time.monotonic()
        self._done = 0  # items of the batch being written that are done

    @property
    def enabled(self) -> bool:
        """Whether messages are logged (not once the log is lost)."""
        return self.mode != "none" and self.partition is not None and self.lost is None

    @property
    def waits(self) -> bool:
        """Whether acknowledgements wait for the log (a lost log releases nothing)."""
        return self.mode != "none" and self.partition is not None

    # -- the log's identity (on the event loop) -----------------------------------

    def adopt(self, wal: Wal, partition: int) -> None:
        """Use a log recovered at start-up (positioned after its last record)."""
        self._wal, self.partition = wal, partition
        self.logged = self.durable = wal.lsn

    def start(self, folder: Path, partition: int, base: int) -> None:
        """Start a new log for ``partition`` after LSN ``base``; the state at ``base``
        must be durable already (a checkpoint, or nothing at LSN 0).  Anything still
        waiting for the old log is released (its waiters check whether they still
        stand: the role or the history changed).  Not once a log was lost."""
        if self.mode == "none" or self.lost is not None:
            return

        def reset() -> None:
            if self._wal is not None:
                self._wal.close()
            if base == 0 and folder.is_dir() and drop_checkpoints(folder):
                log.warning(
                    "partition %d starts from nothing: the checkpoints of an earlier "
                    "history in %s were removed",
                    partition,
                    folder,
                )
            wal = Wal(folder, segment_bytes=self.segment_bytes)
            wal.reset(base)
            self._wal = wal

        self._generation += 1
        self.partition = partition
        self.logged = self.durable = base
        self._queue.append(reset)
        self._wake.set()
        self._release(force=True)

    def cut_after(self, folder: Path, lsn: int) -> asyncio.Future[bool]:
        """Before a checkpoint at ``lsn`` that another copy's snapshot gave is committed
        in ``folder`` (a partition's): set aside every record the log there holds after
        ``lsn``, in the writer's turn (:meth:`Wal.cut_after`).  Those records are of the
        history the snapshot replaces: after that checkpoint a restart would replay them
        and hold a mix of both.  Done (True) once they are set aside; False if that
        could not be done (a lost log, a failing disk), and the checkpoint must not be
        committed.  True at once without a log."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        if self.mode == "none" or self.lost is not None:
            done.set_result(self.lost is None)
            return done

        def settle(ok: bool) -> None:
            if not done.done():
                done.set_result(ok)

        def cut() -> None:
            try:
                wal = self._wal
                if wal is None or wal.folder != folder:
                    wal = Wal(folder, segment_bytes=self.segment_bytes)
                    aside = wal.cut_after(lsn)
                    wal.close()
                else:
                    aside = wal.cut_after(lsn)
            except BaseException:
                loop.call_soon_threadsafe(settle, False)
                raise
            if aside:
                log.warning(
                    "write-ahead log %s: %d records after LSN %d set aside (another "
                    "history, replaced by a snapshot at that LSN)",
                    folder, aside, lsn,
                )  # fmt: skip
            loop.call_soon_threadsafe(settle, True)

        self._queue.append(cut)
        self._wake.set()
        return done

    def continues(self, partition: int, lsn: int) -> bool:
        """Whether the open log ends at ``lsn`` of ``partition`` (so it can go on)."""
        return self.partition == partition and self.logged == lsn

    # -- records and waiters (on the event loop) ----------------------------------

    def log(self, epoch: int, prev: int, lsn: int, frames: Sequence[Buffer]) -> None:
        """Queue a message that took the state from ``prev`` to ``lsn``."""
        if not self.enabled:
            return
        if prev != self.logged:
            # The state no longer continues the log (never expected): stop logging
            # rather than write a log that cannot be replayed; a new one starts with
            # the next snapshot or role.
            log.error(
                "write-ahead log of partition %s: LSN %d..%d does not follow %d; "
                "logging stops until the partition is assigned again",
                self.partition, prev, lsn, self.logged,
            )  # fmt: skip
            self.partition = None
            self._release(force=True)
            return
        self._queue.append(Record(epoch, prev, lsn, list(frames)))
        self.logged = lsn
        self._wake.set()

    def after(self, lsn: int, callback: Callable[[], None]) -> None:
        """Run ``callback`` once ``lsn`` is in the log as the mode requires (at once
        without a log)."""
        if not self.waits or lsn <= self.durable:
            callback()
        else:
            self._waiters.append((lsn, callback))

    def acked_lsn(self, lsn: int) -> int:
        """What a replica at ``lsn`` may acknowledge: what its log holds."""
        return min(lsn, self.durable) if self.waits else lsn

    def roll(self) -> None:
        """A checkpoint is being cut at :attr:`logged`: begin a new segment there."""
        if self.enabled:
            self._queue.append(lambda: self._wal.roll() if self._wal else None)
            self._wake.set()

    def checkpointed(self, partition: int, lsn: int) -> None:
        """A checkpoint of ``partition`` is on disk and the oldest one kept is at
        ``lsn``: drop the segments that one covers (so every checkpoint kept, with the
        log, restores the newest state)."""
        if self.enabled and partition == self.partition:

            def truncate() -> None:
                if self._wal is not None:
                    for path in self._wal.truncate(lsn):
                        log.debug("write-ahead log: %s covered by a checkpoint", path)

            self._queue.append(truncate)
            self._wake.set()

    def _release(self, *, force: bool = False) -> None:
        while self._waiters and (force or self._waiters[0][0] <= self.durable):
            self._waiters.popleft()[1]()

    # -- the writer -----------------------------------------------------------------

    async def run(self) -> None:
        """Write batches until cancelled; the log is synced and closed on the way out."""
        if self.mode == "none":
            return
        loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="zps-wal")
        try:
            while True:
                if not self._queue:
                    timeout = None
                    if self.mode == "interval" and self._wal is not None and self._wal.dirty:
                        timeout = max(0.0, self._last_sync + self.interval - time.monotonic())
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(timeout):
                            await self._wake.wait()
                    self._wake.clear()
                batch, self._queue = self._queue, []
                generation = self._generation
                try:
                    lsn = await loop.run_in_executor(self._executor, self._write, batch)
                except WalLost as e:
                    self._lose(self._wal.lost if self._wal and self._wal.lost else str(e))
                    return
                except WalError as e:
                    # The log cannot be kept as it must be (records that could not be set
                    # aside, a disk failing under a cut): lost, as after a failed sync, so
                    # the shard leaves its role and exits, and starts again from its files.
                    self._lose(str(e))
                    return
                except OSError as e:
                    self.stats.errors += 1
                    log.error(
                        "write-ahead log of partition %s: writing failed (%s); no partial "
                        "record is left, retrying in %gs; nothing after LSN %d is "
                        "acknowledged meanwhile",
                        self.partition, e, RETRY_S, self.durable,
                    )  # fmt: skip
                    self._queue = batch[self._done :] + self._queue
                    await asyncio.sleep(RETRY_S)
                    continue
                if generation == self._generation and lsn is not None:
                    self.durable = max(self.durable, lsn)
                self._release()
                if self.on_durable is not None and self.waits:
                    self.on_durable()
        finally:
            try:
                await loop.run_in_executor(self._executor, self._close)
            except WalLost as e:  # the last sync, on the way out
                self._lose(self._wal.lost if self._wal and self._wal.lost else str(e))
            finally:
                self._executor.shutdown(wait=False)

    def _lose(self, why: str) -> None:
        """The log is lost: write nothing more, release nothing, tell the shard."""
        self.stats.errors += 1
        self.lost = why
        self._queue.clear()
        log.error(
            "write-ahead log of partition %s lost: %s; nothing after LSN %d is "
            "acknowledged by this copy",
            self.partition, why, self.durable,
        )  # fmt: skip
        if self.on_lost is not None:
            self.on_lost(why)

    def _write(self, batch: list[Record | _Op]) -> int | None:
        """In the worker thread: run the batch in order; the LSN written (synced in
        fsync mode) through, or None if no log is open.  :attr:`_done` counts the
        items done, so that a failed batch is retried from the first one not done.

        Every sync of the log counts in :attr:`stats` (a replica waits for one after
        what it applied): the batch's last, and a roll's or a new segment's on the way
        (which leave nothing for the last one to sync)."""
        first = self._wal
        seen = first.syncs if first is not None else 0
        try:
            return self._write_batch(batch)
        finally:
            if first is not None:
                self.stats.syncs += first.syncs - seen
            if self._wal is not None and self._wal is not first:
                self.stats.syncs += self._wal.syncs  # opened by this batch

    def _write_batch(self, batch: list[Record | _Op]) -> int | None:
        records: list[Record] = []
        self._done = 0
        for i, item in enumerate(batch):
            if isinstance(item, Record):
                if self._wal is not None and item.lsn > self._wal.lsn:
                    records.append(item)  # a retried batch skips what it wrote before
                continue
            if records:
                self._append(records)
                records = []
            self._done = i
            item()
            self._done = i + 1
        if records:
            self._append(records)
        wal = self._wal
        if wal is None:
            return None
        if self.mode == "fsync" or (
            wal.dirty and time.monotonic() - self._last_sync >= self.interval
        ):
            wal.sync()
            self._last_sync = time.monotonic()
        else:
            wal.flush()
        return wal.lsn

    def _append(self, records: list[Record]) -> None:
        assert self._wal is not None
        self.stats.bytes += self._wal.append(records)
        self.stats.records += len(records)
        self.stats.batches += 1

    def _close(self) -> None:
        if self._wal is not None:
            self._wal.close()
