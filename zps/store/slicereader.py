"""A large file read once, in order, in slices: a checkpoint at a restart.

:class:`SliceReader` reads the file past the page cache (``O_DIRECT``) where the
filesystem allows it: the disk writes into the slice's buffer, with no copy out of
the page cache and no cache pages to fill and then drop (a cold gigabyte read for a
restart cost 0.3-0.4 CPU-s more through the cache: docs/performance.md, "Big
partitions").  Direct reads need the file offset, the buffer and the length aligned
(to :data:`ALIGN`): the buffers are page-aligned mappings, each slice starts at a
multiple of its size, and the last is asked for rounded up (the read stops at the end
of the file).  A filesystem that refuses direct reads (tmpfs in older kernels, some
network filesystems), or a read that comes back unaligned, makes the rest of the file
read through the page cache, as any file is elsewhere.  :meth:`slices` reads the next
slice in a thread of its own while the caller takes the current one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import mmap
import os
from collections.abc import Iterator

#: The alignment direct reads need here (offsets, buffers, lengths): a page, a multiple
#: of every block size a Linux filesystem uses on it.
ALIGN = mmap.PAGESIZE
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class SliceReader:
    """``path`` opened for reading once in order (see the module's docstring)."""

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = True) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        #: The descriptor direct reads go through (-1: none, or no longer).
        self.direct_fd = -1
        if direct and _O_DIRECT:
            with contextlib.suppress(OSError):
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT)
        if self.direct_fd < 0 and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # read once, in order: a larger read-ahead
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop_direct()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _stop_direct(self) -> None:
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1

    def read_into(self, offset: int, out: memoryview, want: int | None = None) -> int:
        """``want`` bytes (all of ``out`` if None) from ``offset`` into ``out`` (fewer only
        at the end of the file): how many.  A direct read may fill ``out`` past ``want``,
        up to a multiple of :data:`ALIGN`; it is used where ``out`` starts on a page, as
        the buffers :meth:`slices` uses do."""
        got, want = 0, len(out) if want is None else want
        while got < want:
            pos = offset + got
            if self.direct_fd >= 0 and pos % ALIGN == 0 and got % ALIGN == 0:
                ask = min(len(out) - got, -(-(want - got) // ALIGN) * ALIGN)
                try:
                    n = os.preadv(self.direct_fd, [out[got : got + ask]], pos)
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    self._stop_direct()  # not here: through the page cache
                    continue
            else:
                n = os.preadv(self.fd, [out[got:want]], pos)
            if n <= 0:
                break
            got += n
        return min(got, want)

    def slices(self, size: int) -> Iterator[memoryview]:
        """The file in slices of ``size`` bytes (a multiple of :data:`ALIGN`; the last
        shorter), each read by a thread while the caller takes the one before.  A slice
        is valid until the next is asked for; EOFError if the file ends early."""
        if size <= 0 or size % ALIGN:
            raise ValueError(f"slices of {size} bytes: a positive multiple of {ALIGN}")
        room = min(size, -(-max(self.size, 1) // ALIGN) * ALIGN)
        buffers = [mmap.mmap(-1, room), mmap.mmap(-1, room)]
        views = [memoryview(b) for b in buffers]
        offsets = range(0, self.size, size)
        try:
            with concurrent.futures.ThreadPoolExecutor(1, "zps-read") as pool:
                pending: concurrent.futures.Future[int] | None = None
                for i, offset in enumerate(offsets):
                    want = min(size, self.size - offset)
                    if pending is None:
                        pending = pool.submit(self.read_into, offset, views[i % 2], want)
                    got = pending.result()
                    pending = None
                    if got < want:
                        raise EOFError(f"the file ended at {offset + got} of {self.size} bytes")
                    nxt = offset + size
                    if nxt < self.size:  # the next slice, read while this one is taken
                        ahead = min(size, self.size - nxt)
                        pending = pool.submit(self.read_into, nxt, views[(i + 1) % 2], ahead)
                    piece = views[i % 2][:want]
                    yield piece
        finally:
            for view in views:
                with contextlib.suppress(BufferError):  # a view still held: closed with it
                    view.release()
            for buf in buffers:
                with contextlib.suppress(BufferError):
                    buf.close()

    def drop_cached(self) -> None:
        """Drop what of the file the page cache holds (a file read once)."""
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
