"""The broker's state file: the newest :class:`~zps.core.brokerstate.BrokerState`,
replaced atomically in the broker's data dir.

``DATA_DIR/broker-state.zps`` holds an 8-byte magic, the SHA-256 of the body and
the body (the record's msgpack bytes).  A write goes to a temporary file that is
fsynced, renamed over the old one, and the directory is fsynced
(:mod:`zps.ops.durable`): a crash leaves the old record or the new one, never a
mix.  A file that fails its checksum or its record's checks is an error naming the
file, never skipped: a broker that forgot its partitions could hand one to an empty
shard.

:class:`StateWriter` keeps the file current without holding up the event loop:
the broker says *something changed*; one task builds the newest record and
writes it in a worker thread, one write at a time, so changes that arrive
during a slow write are coalesced into the next one.  LSN floors alone (news
from every shard heartbeat) are written at most every ``lsn_delay`` seconds.
A caller that must not answer before its change is on disk (a task handed out)
waits with :meth:`StateWriter.after_write`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from zps.core.brokerstate import BrokerState, BrokerStateError
from zps.errors import ConfigError
from zps.ops import durable

log = logging.getLogger("zps.broker")

MAGIC = b"ZPSBST01"
FILE_NAME = "broker-state.zps"


class StateFile:
    """One record in ``data_dir``; :meth:`write` is blocking (call it off the loop)."""

    def __init__(self, data_dir: str | Path) -> None:
        self.dir = Path(data_dir)
        self.path = self.dir / FILE_NAME

    def prepare(self) -> None:
        """Create the directory; fail now (not at the first write) if it cannot be."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        except OSError as e:
            raise ConfigError(f"broker.data_dir {self.dir}: cannot create it: {e}") from None
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise ConfigError(f"broker.data_dir {self.dir}: not writable by this user")

    def load(self) -> BrokerState | None:
        """The record on disk; None when there is none yet (a new cluster)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ConfigError(f"cannot read the broker state {self.path}: {e}") from None
        return decode(raw, str(self.path))

    def write(self, data: bytes) -> None:
        """Replace the file with ``data`` (a record's bytes), atomically and durably
        (:func:`zps.ops.durable.write_atomic`)."""
        durable.write_atomic(self.path, frame(data), mode=0o640)


def frame(data: bytes) -> bytes:
    """The file's bytes for a record's bytes: magic, checksum, record."""
    return MAGIC + hashlib.sha256(data).digest() + data


def decode(raw: bytes, where: str = "broker state") -> BrokerState:
    head = len(MAGIC) + 32
    if len(raw) < head or raw[: len(MAGIC)] != MAGIC:
        raise ConfigError(f"{where}: not a zps broker state file")
    digest, data = raw[len(MAGIC) : head], raw[head:]
    if hashlib.sha256(data).digest() != digest:
        raise ConfigError(
            f"{where}: checksum mismatch (the file is damaged); restore it from a backup, or "
            "remove it to start as a new cluster (the broker then trusts any copy a shard "
            "brings back)"
        )
    try:
        return BrokerState.from_bytes(data)
    except BrokerStateError as e:
        raise ConfigError(f"{where}: {e}") from None


class StateWriter:
    """Writes the broker's newest record whenever it changed (see the module notes)."""

    def __init__(
        self,
        file: StateFile,
        produce: Callable[[], BrokerState],
        *,
        written: BrokerState | None = None,
        lsn_delay: float = 0.5,
        min_gap: float = 0.02,
    ) -> None:
        self.file = file
        self._produce = produce
        self.written = written
        self.lsn_delay = lsn_delay
        self.min_gap = min_gap
        self.writes = 0
        self.failures = 0
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()
        self._waiters: list[Callable[[], object]] = []
        self._last_write = 0.0

    def changed(self) -> None:
        self._dirty.set()

    def after_write(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` once the state as it is now is on disk."""
        self._waiters.append(callback)
        self._urgent.set()
        self._dirty.set()

    async def run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if not self._waiters and self.written is not None:
                rec = self._produce()
                if rec.version == self.written.version:
                    await asyncio.sleep(self.min_gap)
                    continue
                if rec.floors_only_differ(self.written):
                    wait = self._last_write + self.lsn_delay - time.monotonic()
                    if wait > 0:
                        self._urgent.clear()
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(wait):
                                await self._urgent.wait()
            waiters, self._waiters = self._waiters, []
            rec = self._produce()  # the newest: covers every waiter taken above
            new = self.written is None or rec.version != self.written.version
            if new and not await self._write(rec):
                self._waiters[:0] = waiters
                continue
            for callback in waiters:
                callback()
            await asyncio.sleep(self.min_gap)

    async def _write(self, rec: BrokerState) -> bool:
        data = rec.to_bytes()
        try:
            await asyncio.to_thread(self.file.write, data)
        except OSError as e:
            self.failures += 1
            log.error("cannot write the broker state to %s: %s (retrying)", self.file.path, e)
            self._dirty.set()
            await asyncio.sleep(1.0)
            return False
        self.written = rec
        self.writes += 1
        self._last_write = time.monotonic()
        return True

    def flush(self) -> None:
        """Write the newest record now, blocking (at shutdown)."""
        rec = self._produce()
        if self.written is not None and rec.version == self.written.version:
            return
        try:
            self.file.write(rec.to_bytes())
        except OSError as e:
            log.error("cannot write the broker state to %s: %s", self.file.path, e)
            return
        self.written = rec
