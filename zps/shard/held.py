"""The stream a replica holds while its snapshot arrives and loads, in LSN order.

Every write the primary makes from the snapshot's LSN on follows at once, while the
snapshot's chunks go at the pace the replica acknowledges them: the replica keeps
what arrives meanwhile, and applies it once its tables are loaded.  How much that is
grows with the transfer's length and the write rate (tens of MB a second under
pushes of 512 rows: a 3 GB transfer of half a minute is past a few hundred MB), so a
bound in memory alone would fail a transfer under load.  Here the first
``memory_bytes`` are kept in memory; past that, each message is appended to a spool
file (unlinked at once: nothing outlives the process), written by one worker thread
in arrival order, and from then on every later message goes there too until the
spool is read back to its end.  The spool is bounded by ``spool_bytes`` (the disk,
in practice); a transfer fails only past it, or on a write error.

Rules: messages come out (:meth:`HeldStream.take`) in the order they went in; the
event loop never waits on the spool's disk (writes and reads run in its thread);
:meth:`HeldStream.take` returns at most about ``max_bytes`` at a time, so the caller
applies the backlog in bounded steps.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import struct
import tempfile
from pathlib import Path
from typing import IO, Any

import msgpack

from zps.errors import ProtocolError
from zps.protocol.codec import Route, decode
from zps.protocol.messages import Replicate

Held = tuple[Route, Replicate, Any]

_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<Q")


class HeldStreamFull(Exception):
    """The held stream passed its spool's bound, or the spool could not be written."""


class HeldStream:
    """Stream messages kept until a snapshot is loaded: in memory, then spooled."""

    def __init__(self, memory_bytes: int, spool_bytes: int, folder: Path | None = None) -> None:
        self.memory_bytes = memory_bytes
        self.spool_bytes = spool_bytes
        self.folder = folder
        self._memory: collections.deque[tuple[Held, int]] = collections.deque()
        self.memory_held = 0  # bytes of payload in memory
        #: Spooled and not yet read back: messages and bytes (as written).
        self.spooled = 0
        self.spooled_bytes = 0
        self._spool: IO[bytes] | None = None
        self._write_at = 0  # where the next record goes (the writer thread's)
        self._read_at = 0  # where the next read starts
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._failed: BaseException | None = None
        #: The most bytes ever held at once, and the bytes that went through the spool.
        self.peak_bytes = 0
        self.total_spooled_bytes = 0

    def __len__(self) -> int:
        return len(self._memory) + self.spooled

    @property
    def held_bytes(self) -> int:
        return self.memory_held + self.spooled_bytes

    def add(self, route: Route, header: Replicate, payloads: Any) -> None:
        """Keep a message (after every one before it); HeldStreamFull past the bound."""
        if self._failed is not None:
            raise HeldStreamFull(f"the held stream could not be spooled: {self._failed}")
        size = sum(len(p) for p in payloads)
        if self.spooled == 0 and self.memory_held + size <= self.memory_bytes:
            self._memory.append(((route, header, payloads), size))
            self.memory_held += size
        else:
            frames = [route.pack(), _packed(header), *payloads]
            record = sum(_LEN.size + len(f) for f in frames) + _COUNT.size
            if self.spooled_bytes + record > self.spool_bytes:
                raise HeldStreamFull(
                    f"stream held during the snapshot passed {self.spool_bytes} bytes"
                )
            self._spool_pool().submit(self._append, frames)
            self.spooled += 1
            self.spooled_bytes += record
            self.total_spooled_bytes += record
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    async def take(self, max_bytes: int) -> list[Held]:
        """The next messages, in order, about ``max_bytes`` of them (at least one while
        any is held); [] when nothing is held."""
        out: list[Held] = []
        taken = 0
        while self._memory and (not out or taken < max_bytes):
            held, size = self._memory.popleft()
            self.memory_held -= size
            out.append(held)
            taken += size
        if out or not self.spooled:
            return out
        raws = await asyncio.get_running_loop().run_in_executor(
            self._spool_pool(), self._read, max_bytes
        )
        if self._failed is not None:
            raise HeldStreamFull(f"the held stream could not be read back: {self._failed}")
        for frames, record in raws:
            msg = decode(frames)
            out.append((msg.route, Replicate.parse(msg.header), msg.payloads))
            self.spooled -= 1
            self.spooled_bytes -= record
        return out

    def close(self) -> None:
        """Drop what is held (the spool file goes with it)."""
        self._memory.clear()
        self.memory_held = self.spooled = self.spooled_bytes = 0
        writer, spool = self._writer, self._spool
        self._writer = None
        if writer is not None:
            writer.submit(_close, spool)
            writer.shutdown(wait=False)

    # -- the spool's thread ------------------------------------------------------

    def _spool_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="zps-held-stream"
            )
        return self._writer

    def _append(self, frames: list[Any]) -> None:
        if self._failed is not None:
            return
        try:
            if self._spool is None:
                self._spool = tempfile.TemporaryFile(  # noqa: SIM115  # closed by close()
                    prefix=".zps-held-", dir=self.folder
                )
            head = _COUNT.pack(len(frames)) + b"".join(_LEN.pack(len(f)) for f in frames)
            os.pwrite(self._spool.fileno(), head, self._write_at)
            pos = self._write_at + len(head)
            for f in frames:
                view = memoryview(f).cast("B")
                while len(view):
                    n = os.pwrite(self._spool.fileno(), view, pos)
                    view, pos = view[n:], pos + n
            self._write_at = pos
        except BaseException as e:  # the disk is full, say: the transfer fails
            self._failed = e

    def _read(self, max_bytes: int) -> list[tuple[list[bytes], int]]:
        """Records from where the last read stopped, about ``max_bytes`` of them."""
        out: list[tuple[list[bytes], int]] = []
        if self._failed is not None or self._spool is None:
            return out
        fd, taken = self._spool.fileno(), 0
        try:
            while self._read_at < self._write_at and (not out or taken < max_bytes):
                (count,) = _COUNT.unpack(_read_exact(fd, _COUNT.size, self._read_at))
                lens = struct.unpack(f"<{count}Q", _read_exact(fd, 8 * count, self._read_at + 4))
                pos = self._read_at + _COUNT.size + 8 * count
                frames = []
                for n in lens:
                    frames.append(_read_exact(fd, n, pos))
                    pos += n
                out.append((frames, pos - self._read_at))
                taken += pos - self._read_at
                self._read_at = pos
        except (OSError, ProtocolError, struct.error) as e:
            self._failed = e
        return out


def _packed(header: Replicate) -> bytes:
    return msgpack.packb(header.to_wire())  # type: ignore[no-any-return]


def _read_exact(fd: int, n: int, pos: int) -> bytes:
    got = os.pread(fd, n, pos)
    if len(got) != n:
        raise OSError(f"the held stream's spool ended at {pos + len(got)}")
    return got


def _close(spool: IO[bytes] | None) -> None:
    if spool is not None:
        with contextlib.suppress(OSError):
            spool.close()
