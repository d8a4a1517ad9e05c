"""A large file read once, in order, in slices: a checkpoint at a restart.

At a restart the reader fills the tables' memory files from the file in the kernel
(:func:`zps.store.mapped.fill_from`, from :attr:`SliceReader.fd`) and reads the rest
with :meth:`SliceReader.read_into`, dropping each slice from the page cache once taken
(:meth:`SliceReader.drop`); :meth:`SliceReader.slices` reads the next slice in a thread
of its own while the caller takes the current one.  The file is read through the page
cache with the kernel's read-ahead (``POSIX_FADV_SEQUENTIAL``), and each slice is
dropped from the cache once taken: a checkpoint is read once, and cached it would
take a partition's worth of memory from what the machine caches for its other work.
Direct reads (``O_DIRECT``, no page cache) cost less CPU here but came at about half
the speed of the cached reads with read-ahead on this machine's disk, and asking the
kernel to read ahead further (``POSIX_FADV_WILLNEED``) made a restart's reads slower
(docs/performance.md, "Big partitions").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Iterator


class SliceReader:
    """``path`` opened for reading once, in order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        self._advise(0, 0, "POSIX_FADV_SEQUENTIAL")  # read once, in order

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _advise(self, offset: int, length: int, advice: str) -> None:
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(self.fd, offset, length, getattr(os, advice))

    def read_into(self, offset: int, out: memoryview) -> int:
        """Bytes from ``offset`` into all of ``out`` (fewer only at the end of the file):
        how many."""
        got = 0
        while got < len(out):
            n = os.preadv(self.fd, [out[got:]], offset + got)
            if n <= 0:
                break
            got += n
        return got

    def slices(self, size: int) -> Iterator[memoryview]:
        """The file in slices of ``size`` bytes (the last shorter), each read by a thread
        while the caller takes the one before, and dropped from the page cache once
        taken.  A slice is valid until the next is asked for; EOFError if the file ends
        before the size it had when opened."""
        if size <= 0:
            raise ValueError(f"slices of {size} bytes")
        room = min(size, max(self.size, 1))
        buffers = [memoryview(bytearray(room)), memoryview(bytearray(room))]
        with concurrent.futures.ThreadPoolExecutor(1, "zps-read") as pool:
            pending: concurrent.futures.Future[int] | None = None
            for i, offset in enumerate(range(0, self.size, size)):
                want = min(size, self.size - offset)
                piece = buffers[i % 2][:want]
                got = (pending or pool.submit(self.read_into, offset, piece)).result()
                pending = None
                if got < want:
                    raise EOFError(f"the file ended at {offset + got} of {self.size} bytes")
                ahead = offset + size
                if ahead < self.size:  # the next slice, read while this one is taken
                    nxt = buffers[(i + 1) % 2][: min(size, self.size - ahead)]
                    pending = pool.submit(self.read_into, ahead, nxt)
                yield piece
                self._advise(offset, want, "POSIX_FADV_DONTNEED")  # taken: not cached

    def drop(self, offset: int, length: int) -> None:
        """Drop bytes ``[offset, offset + length)`` of the file from the page cache (taken:
        read once)."""
        self._advise(offset, length, "POSIX_FADV_DONTNEED")

    def drop_cached(self) -> None:
        """Drop what of the file the page cache holds (a file read once)."""
        self._advise(0, 0, "POSIX_FADV_DONTNEED")
