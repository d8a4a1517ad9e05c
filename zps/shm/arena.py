"""The owner's side: one process's arena, a ``memfd`` of at most its byte budget, and
the regions it hands out for the payloads it sends (see :mod:`zps.shm`)."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from zps.shm.region import HEAD_BYTES, set_token, write_head


@dataclass(slots=True)
class _Region:
    offset: int
    size: int  # head and data, rounded up to 64 bytes
    token: int
    born: float
    pinned: bool = False  # never reclaimed (see Arena.take)


def _round(n: int) -> int:
    return (n + 63) & ~63


class Arena:
    """One process's shared memory for the payloads it sends (see the module notes).

    ``put`` never blocks: it returns None when the budget has no room.  With
    ``reclaim_after`` (seconds), a region older than that may be reused for a new one
    without being freed first (its reader, if any, then finds it reused).
    """

    def __init__(self, budget: int, name: str, *, reclaim_after: float | None = None) -> None:
        if budget <= 0:
            raise ValueError(f"shared memory budget must be positive, got {budget}")
        self.budget = budget
        self.reclaim_after = reclaim_after
        self.pid = os.getpid()
        self.fd = os.memfd_create(f"zps-{self.pid}-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, budget)
            self._mm = mmap.mmap(self.fd, budget)
        except OSError:
            os.close(self.fd)
            raise
        self.inode = os.fstat(self.fd).st_ino
        self._view = np.frombuffer(self._mm, dtype=np.uint8)
        self._bytes = memoryview(self._mm)
        self._offsets: list[int] = []  # live regions by offset, sorted
        self._by_offset: dict[int, _Region] = {}
        self._by_token: dict[int, _Region] = {}
        self._tokens = itertools.count(secrets.randbits(62) | 1)
        self.used = 0
        self.touched = 0  # bytes from the start that may hold pages (see trim)
        self.puts = 0
        self.full = 0  # frames that went inline for want of room
        self.reclaimed = 0  # regions reused after reclaim_after without a free

    @property
    def live(self) -> int:
        return len(self._by_token)

    def _fit(self, size: int) -> int | None:
        """The lowest offset with ``size`` free bytes (first fit keeps the pages in use few)."""
        start = 0
        for off in self._offsets:
            if off - start >= size:
                return start
            start = off + self._by_offset[off].size
        return start if self.budget - start >= size else None

    def _reclaim(self, now: float) -> bool:
        if self.reclaim_after is None:
            return False
        old = [
            r
            for r in self._by_token.values()
            if now - r.born >= self.reclaim_after and not r.pinned
        ]
        for r in old:
            self._release(r)
        self.reclaimed += len(old)
        return bool(old)

    def put(self, data: Any, now: float | None = None) -> list[int] | None:
        """Copy ``data`` (a buffer) into a new region: ``[pid, fd, inode, offset, length,
        token]`` for a descriptor, or None when the budget has no room."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        src = src.reshape(-1).view(np.uint8)
        region = self.take(src.size, now)
        if region is not None:
            off = region[3]
            self._view[off + HEAD_BYTES : off + HEAD_BYTES + src.size] = src
        return region

    def take(
        self, length: int, now: float | None = None, *, pinned: bool = False
    ) -> list[int] | None:
        """A new region of ``length`` bytes, for the caller to write (see :meth:`data`):
        its descriptor as :meth:`put`'s, or None.  A ``pinned`` region is never
        reclaimed: only :meth:`free` gives it back."""
        size = _round(HEAD_BYTES + length)
        off = self._fit(size)
        if off is None:
            now = time.monotonic() if now is None else now
            if self._reclaim(now):
                off = self._fit(size)
            if off is None:
                self.full += 1
                return None
        token = self._next_token()
        region = _Region(off, size, token, time.monotonic() if now is None else now, pinned)
        bisect.insort(self._offsets, off)
        self._by_offset[off] = region
        self._by_token[token] = region
        self.used += size
        self.touched = max(self.touched, off + size)
        self.puts += 1
        write_head(self._mm, off, token, length)  # the token first, then the data
        return [self.pid, self.fd, self.inode, off, length, token]

    def _next_token(self) -> int:
        return next(self._tokens) & ((1 << 64) - 1) or 1

    def retoken(self, token: int) -> int | None:
        """Give region ``token`` a new token, before its owner changes its bytes in
        place: a reader told the old one finds it changed, as if the region had been
        reused (None: no such region)."""
        region = self._by_token.pop(token, None)
        if region is None:
            return None
        region.token = self._next_token()
        self._by_token[region.token] = region
        set_token(self._mm, region.offset, region.token)
        return region.token

    def data(self, offset: int, length: int) -> memoryview:
        """The data bytes of the region at ``offset`` (its head left out), writable."""
        return self._bytes[offset + HEAD_BYTES : offset + HEAD_BYTES + length]

    def free(self, token: int) -> bool:
        """The reader is done with region ``token`` (unknown tokens are ignored)."""
        region = self._by_token.get(token)
        if region is None:
            return False
        self._release(region)
        return True

    def _release(self, region: _Region) -> None:
        # Cleared before the bytes can be reused: a reader still copying finds out.
        set_token(self._mm, region.offset, 0)
        del self._by_token[region.token]
        del self._by_offset[region.offset]
        self._offsets.remove(region.offset)
        self.used -= region.size

    def trim(self) -> int:
        """Give the pages above the last region in use back to the kernel; the bytes."""
        top = 0
        if self._offsets:
            last = self._by_offset[self._offsets[-1]]
            top = last.offset + last.size
        top = -(-top // mmap.PAGESIZE) * mmap.PAGESIZE
        if top >= self.touched:
            return 0
        freed = self.touched - top
        self._mm.madvise(mmap.MADV_REMOVE, top, freed)
        self.touched = top
        return freed

    def close(self) -> None:
        self._by_token.clear()
        self._by_offset.clear()
        self._offsets.clear()
        del self._view
        with contextlib.suppress(BufferError):  # a view is alive: it goes with the process
            self._bytes.release()
            self._mm.close()
        os.close(self.fd)
