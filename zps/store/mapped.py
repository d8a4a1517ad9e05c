"""Row arrays that grow in place: an embedding table's rows and optimizer state, and
its id index's slot table and ids.

A table that outgrows its arrays must not copy every row into new, larger ones: the
copy itself is quick, touching the new memory is not (each page is faulted in on its
first write, dearest on a virtual machine, where a first touch costs the host a fault
too), and the shard's event loop, its requests with it, would wait all that time
(figures: docs/performance.md, "Figures behind the code's rules").

An array from :func:`empty` (of at least :data:`MIN_BYTES`) lives in anonymous memory
of its own, and :func:`grow` extends it with ``mremap``: the pages move to the larger
mapping as they are, no row is copied and no page touched; the new rows' pages are
faulted in as rows are written there, a few at a time.  Where that cannot be done (an
array that is not mapped here, or one that something else still views: a move's or an
export's arrays), :func:`grow` copies into a new array.  Huge pages are asked for
(``MADV_HUGEPAGE``), as numpy does for its own large arrays.

Such memory is a memory file (``memfd``) mapped shared, so that :func:`freeze` can give
a consistent version of an array at an instant without copying it: the array's mapping
becomes a private (copy-on-write) one of the same file, so that its writes from then on
go to pages of their own while the file keeps the frozen contents, read with
:meth:`Frozen.read_into` (no mapping: nothing of it counts twice in the process's
resident size).  :meth:`Frozen.release` copies the pages written meanwhile back into
the file and maps it shared again.  Memory while an array is frozen: the pages written
since (4 KiB each), never a copy of the array.  Rules: the owner writes the array from
one thread, the one that freezes and releases it; an array is frozen once at a time;
a frozen array is never shrunk in place (its file holds the frozen version).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.store import lowfds

__all__ = [
    "DROP_STEP",
    "MIN_BYTES",
    "Frozen",
    "drop_pages",
    "empty",
    "fill_from",
    "fillable",
    "freezable",
    "freeze",
    "frozen",
    "grow",
    "grown",
    "mapping",
    "populate",
    "read_window",
    "write_at",
]

#: Arrays smaller than this are plain numpy arrays (copying them costs nothing).
MIN_BYTES = 1 << 20
#: Whether anonymous memory can be grown in place here (mremap: Linux).
IN_PLACE = hasattr(mmap.mmap, "resize") and hasattr(mmap, "MAP_ANONYMOUS")
#: Arrays :func:`grow` extended in place, and those it copied (for tests and benches).
grown = {"in_place": 0, "copied": 0}
#: Whether arrays live in memory files that :func:`freeze` can freeze (Linux).
FREEZABLE = IN_PLACE and hasattr(os, "memfd_create") and os.path.exists("/proc/self/pagemap")

_PAGE = mmap.PAGESIZE
_names = itertools.count()
#: Held while a mapping of a memory file changes (:func:`grow`'s resize, :func:`freeze`,
#: the end of a release) and by :func:`drop_pages` for each of its steps.
_remapping = threading.Lock()
#: Bytes :func:`drop_pages` does in one step (with :data:`_remapping` held).
DROP_STEP = 64 << 20
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


class _Memory(mmap.mmap):
    """A shared mapping of a memory file (``fd``), or anonymous memory (``fd`` -1)."""

    fd: int = -1
    #: The frozen version of it, while there is one.
    frozen: Frozen | None = None


def _memory(nbytes: int) -> mmap.mmap:
    if FREEZABLE:
        name = f"zps-rows-{next(_names)}"
        try:  # every descriptor of the file numbered low (see zps.store.lowfds)
            fd = lowfds.low(lambda: os.memfd_create(name, os.MFD_CLOEXEC))
        except OSError:  # out of file descriptors, say: anonymous memory, copied to cut
            pass
        else:
            try:
                os.ftruncate(fd, nbytes)
                m = lowfds.low(lambda: _Memory(fd, nbytes, flags=mmap.MAP_SHARED))
            except BaseException:
                lowfds.release(fd)
                raise
            m.fd = fd
            weakref.finalize(m, lowfds.release, fd)
            return m
    return _Memory(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def empty(rows: int, width: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """An uninitialised ``(rows, width)`` array that :func:`grow` can extend in place."""
    dt = np.dtype(dtype)
    nbytes = rows * width * dt.itemsize
    if nbytes < MIN_BYTES or not IN_PLACE:
        return np.empty((rows, width), dt)
    m = _memory(nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            m.madvise(mmap.MADV_HUGEPAGE)
    return _view(m, rows, width, dt)


def mapping(arr: npt.NDArray[Any]) -> mmap.mmap | None:
    """The anonymous memory ``arr`` is a whole view of (from :func:`empty`), or None."""
    base: Any = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap) or base.closed or arr.nbytes != len(base):
        return None
    return base


def grow(holder: dict[str, Any], key: str, rows: int, keep: int) -> None:
    """Give ``holder[key]``, a ``(n, width)`` array, room for ``rows`` rows (more or
    fewer than ``n``), its first ``keep`` kept (the others uninitialised).

    In place when it came from :func:`empty` and nothing else views it: its reference
    is dropped from ``holder`` first, so the caller must hold none of its own.
    Otherwise (or if ``mremap`` fails) the kept rows are copied into a new array from
    :func:`empty`.  If that fails too (MemoryError), ``holder[key]`` is the array as it
    was."""
    arr = holder[key]
    width, dtype = arr.shape[1], arr.dtype
    old_rows = arr.shape[0]
    m = mapping(arr)
    if m is not None and _frozen_size(m) > rows * width * dtype.itemsize:
        m = None  # its file holds a frozen version: copied, not cut short
    if m is not None:
        holder[key] = None
        del arr  # the last view of the mapping, unless someone else holds one
        try:
            with _remapping:  # never while drop_pages works on its addresses
                m.resize(rows * width * dtype.itemsize)
        except (BufferError, OSError):  # viewed elsewhere, or no room to move it
            arr = holder[key] = _view(m, old_rows, width, dtype)  # before anything can fail
        else:
            holder[key] = _view(m, rows, width, dtype)
            grown["in_place"] += 1
            return
    new = empty(rows, width, dtype)
    new[:keep] = arr[:keep]
    holder[key] = new
    grown["copied"] += 1


def _view(m: mmap.mmap, rows: int, width: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    return np.frombuffer(m, dtype, count=rows * width).reshape(rows, width)


# -- frozen versions -----------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _address(m: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # the export that would keep ``m`` from being resized


def _remap(m: _Memory, flags: int, start: int = 0, stop: int | None = None) -> None:
    """Map bytes ``[start, stop)`` (page-aligned; ``stop`` None: the end) of ``m``'s file
    again over ``m``'s own addresses for them (same contents)."""
    stop = len(m) if stop is None else stop
    addr, size = _address(m) + start, stop - start
    got = _libc.mmap(addr, size, mmap.PROT_READ | mmap.PROT_WRITE, flags | _MAP_FIXED, m.fd, start)
    if got in (None, _MAP_FAILED) or got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map rows again: {os.strerror(err)}")


def _frozen_size(m: mmap.mmap) -> int:
    frozen = getattr(m, "frozen", None)
    return frozen.nbytes if frozen is not None else 0


class Frozen:
    """An array's contents at the instant :func:`freeze` took it: ``nbytes`` bytes of a
    memory file, read with :meth:`read_into` from any thread, until :meth:`release`."""

    def __init__(self, m: _Memory, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fd = lowfds.low(lambda: os.dup(m.fd))  # readable after the array is gone
        self._memory: weakref.ref[_Memory] = weakref.ref(m)
        self._thread = threading.get_ident()
        self.released = False
        #: Bytes ``[0, released_to)`` are released already (:meth:`release_to`).
        self.released_to = 0
        self._closer = weakref.finalize(self, lowfds.release, self.fd)

    def read_into(self, offset: int, out: memoryview) -> None:
        """Bytes ``[offset, offset + len(out))`` of the frozen version into ``out``."""
        if self.released or offset < self.released_to:
            raise ValueError("a frozen version read after its release")
        if offset < 0 or offset + len(out) > self.nbytes:
            raise ValueError(f"bytes {offset}+{len(out)} of a frozen {self.nbytes}")
        got = 0
        while got < len(out):
            n = os.preadv(self.fd, [out[got:]], offset + got)
            if n <= 0:
                raise OSError(f"a frozen version ended at {offset + got} of {self.nbytes}")
            got += n

    @contextlib.contextmanager
    def window(self, offset: int, size: int) -> Iterator[memoryview]:
        """Bytes ``[offset, offset + size)`` of the frozen version as a read-only view of
        a mapping of its file made for it (its pages mapped at once, unmapped on the way
        out: they count in the resident size only meanwhile), so that a writer or a
        checksum reads them where they are, with no copy into a buffer first."""
        if self.released or offset < self.released_to:
            raise ValueError("a frozen version read after its release")
        if offset < 0 or size < 0 or offset + size > self.nbytes:
            raise ValueError(f"bytes {offset}+{size} of a frozen {self.nbytes}")
        with _window(self.fd, offset, size) as view:
            yield view

    def release(self) -> int:
        """Make the array shared with its file again: the pages written since the
        freeze are copied into the file first.  From the thread that froze it (the
        array's writer), so that no write falls between the copy and the new mapping.
        Returns the bytes copied back."""
        return sum(self.release_steps(1 << 62))

    def release_to(self, stop: int) -> int:
        """Release bytes ``[0, stop)`` (``stop`` rounded down to a page): a reader that
        has read them gives them back before it reads on, so the pages written there
        are copied back (and held no longer) while the rest stays frozen.  From the
        thread that froze it; the bytes copied back."""
        if self.released:
            return 0
        if threading.get_ident() != self._thread:
            raise RuntimeError("a frozen version is released by the thread that froze it")
        m = self._memory()
        if m is None or m.closed or m.frozen is not self:
            return 0
        stop = min(len(m), stop - stop % _PAGE)
        if stop <= self.released_to:
            return 0
        written = _write_back(m, self.released_to, stop)
        _remap(m, mmap.MAP_SHARED, self.released_to, stop)
        self.released_to = stop
        return written

    def release_steps(self, step: int) -> Iterator[int]:
        """:meth:`release` in steps of ``step`` bytes of the array, each atomic (its
        written pages copied back, then that range mapped shared again): the writer
        runs between two steps, its writes going to the file where released and to
        private pages where not.  Yields the bytes each step copied back.  The frozen
        version is not readable once the first step is taken."""
        if self.released:
            return
        if threading.get_ident() != self._thread:
            raise RuntimeError("a frozen version is released by the thread that froze it")
        self.released = True
        try:
            pos = self.released_to
            while True:
                m = self._memory()
                if m is None or m.closed or m.frozen is not self or pos >= len(m):
                    break
                stop = min(len(m), pos + step)
                written = _write_back(m, pos, stop)
                _remap(m, mmap.MAP_SHARED, pos, stop)
                pos = stop
                yield written  # the writer may run now: this range is shared again
        finally:
            m = self._memory()
            if m is not None and m.frozen is self:
                with _remapping:  # not frozen, so drop_pages may go on: once shared
                    if not m.closed and pos < len(m):  # stopped early: all of it at once
                        _write_back(m, 0, len(m))
                        _remap(m, mmap.MAP_SHARED, 0, len(m))
                    m.frozen = None
            self._closer()


def _written_pages(addr: int, size: int) -> list[tuple[int, int]]:
    """Runs ``(first, end)`` of the pages of ``[addr, addr + size)`` that are private
    copies (written since the mapping became copy-on-write), from /proc/self/pagemap."""
    first, count = addr // _PAGE, -(-size // _PAGE)
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        raw = os.pread(f.fileno(), count * 8, first * 8)
    entries = np.frombuffer(raw, np.uint64)
    present = (entries >> np.uint64(63)) & np.uint64(1)
    swapped = (entries >> np.uint64(62)) & np.uint64(1)
    shared = (entries >> np.uint64(61)) & np.uint64(1)
    private = ((present | swapped) == 1) & (shared == 0)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], private.view(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _write_back(m: _Memory, begin: int, end: int) -> int:
    """Copy the pages of bytes ``[begin, end)`` of ``m`` written since it was frozen into
    its file; the bytes copied."""
    written = 0
    view = memoryview(m)
    try:
        for a, b in _written_pages(_address(m) + begin, end - begin):
            start, stop = begin + a * _PAGE, min(end, begin + b * _PAGE)
            piece = view[start:stop]
            while len(piece):
                n = os.pwrite(m.fd, piece, start)
                piece, start, written = piece[n:], start + n, written + n
    finally:
        view.release()
    return written


_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def populate(arr: Any, start: int, stop: int) -> None:
    """Fault in bytes ``[start, stop)`` of ``arr`` (from :func:`empty`) for writing, in
    one call: a copy into them then takes no page faults, and the call costs about half
    what the faults would.  Nothing for other arrays, or a kernel without it."""
    m = mapping(arr)
    if m is None:
        return
    first = start - start % _PAGE
    stop = min(len(m), stop)
    if stop > first:
        with contextlib.suppress(OSError, ValueError):
            m.madvise(_POPULATE_WRITE, first, stop - first)


def write_at(arr: Any, offset: int, data: memoryview) -> bool:
    """Write ``data`` at byte ``offset`` of ``arr`` (from :func:`empty`, not frozen)
    through its memory file, in the kernel: one copy, no page fault and no page-table
    entry (pages are mapped on their first access, as after :func:`drop_pages`).  False,
    writing nothing, for other arrays: the caller copies."""
    m = mapping(arr)
    if not isinstance(m, _Memory) or m.fd < 0 or m.frozen is not None:
        return False
    if offset < 0 or offset + len(data) > len(m):
        raise ValueError(f"bytes {offset}+{len(data)} of an array of {len(m)}")
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(m.fd, view, offset)
        if n <= 0:
            raise OSError(f"could not write rows at {offset} of {len(m)}")
        view, offset = view[n:], offset + n
    return True


@contextlib.contextmanager
def _window(fd: int, offset: int, size: int) -> Iterator[memoryview]:
    """Bytes ``[offset, offset + size)`` of the file ``fd`` as a read-only view of a
    mapping made for it, its pages mapped at once and unmapped on the way out."""
    if size == 0:
        yield memoryview(b"")
        return
    first = offset - offset % mmap.ALLOCATIONGRANULARITY
    m = mmap.mmap(
        fd,
        offset + size - first,
        flags=mmap.MAP_SHARED | _MAP_POPULATE,
        prot=mmap.PROT_READ,
        offset=first,
    )
    view = memoryview(m)[offset - first :]
    try:
        yield view
    finally:
        view.release()
        with contextlib.suppress(BufferError):  # a view still held: unmapped with it
            m.close()


def _writable_file(arr: Any) -> _Memory | None:
    """The memory file ``arr`` (from :func:`empty`, not frozen) is a whole view of."""
    m = mapping(arr)
    if not isinstance(m, _Memory) or m.fd < 0 or m.frozen is not None:
        return None
    return m


def fillable(arr: Any) -> bool:
    """Whether :func:`fill_from` can write ``arr``."""
    return _writable_file(arr) is not None


def fill_from(arr: Any, offset: int, src: int, src_offset: int, size: int) -> int:
    """Copy ``size`` bytes of the file ``src`` from ``src_offset`` to byte ``offset`` of
    ``arr`` (:func:`fillable`) in the kernel (``sendfile``: from the file's page cache
    into the memory file, no buffer in between, no page fault and no page-table entry,
    as :func:`write_at`); the bytes copied, fewer only where ``src`` ended.  Moves the
    memory file's offset: one caller at a time writes an array this way."""
    m = _writable_file(arr)
    if m is None:
        raise ValueError("not an array of a memory file that can be written")
    if offset < 0 or size < 0 or offset + size > len(m):
        raise ValueError(f"bytes {offset}+{size} of an array of {len(m)}")
    os.lseek(m.fd, offset, os.SEEK_SET)
    got = 0
    while got < size:
        n = os.sendfile(m.fd, src, src_offset + got, size - got)
        if n <= 0:
            break
        got += n
    return got


@contextlib.contextmanager
def read_window(arr: Any, offset: int, size: int) -> Iterator[memoryview]:
    """Bytes ``[offset, offset + size)`` of ``arr`` (from :func:`empty`, in a memory
    file) as a read-only view of a mapping of its file made for it (see
    :meth:`Frozen.window`): read where they are, with no page-table entry of the
    array's own mapping made, as a checksum of what :func:`fill_from` wrote."""
    m = mapping(arr)
    if not isinstance(m, _Memory) or m.fd < 0:
        raise ValueError("not an array of a memory file")
    if offset < 0 or size < 0 or offset + size > len(m):
        raise ValueError(f"bytes {offset}+{size} of an array of {len(m)}")
    with _window(m.fd, offset, size) as view:
        yield view


def frozen(arr: Any) -> Frozen | None:
    """The frozen version of the memory ``arr`` views, if there is one."""
    m = mapping(arr)
    return getattr(m, "frozen", None) if m is not None else None


def freezable(arr: Any) -> bool:
    """Whether :func:`freeze` would freeze ``arr`` now."""
    m = mapping(arr)
    return isinstance(m, _Memory) and m.fd >= 0 and m.frozen is None


def freeze(arr: Any) -> Frozen | None:
    """A version of ``arr`` (a whole array from :func:`empty`) that later writes to it do
    not change; None when it cannot be had (plain or anonymous memory, or frozen
    already): the caller copies it."""
    m = mapping(arr)
    if not isinstance(m, _Memory) or m.fd < 0 or m.frozen is not None:
        return None
    version = Frozen(m, len(m))
    with _remapping:  # drop_pages must not discard a private page written from now on
        _remap(m, mmap.MAP_PRIVATE)
        m.frozen = version
    return version


def drop_pages(arr: Any) -> None:
    """Drop the page-table entries of ``arr``'s mapping of its memory file (its contents
    stay in the file), from any thread: a :func:`freeze` soon after, which maps the
    whole array again and so drops every entry, then costs its caller only the pages
    touched since, not the whole array (at GBs: 0.3-0.7 s of the loop, in the page
    tables).  Pages touched again are mapped again on their first access.  Only a
    memory file mapped shared (not frozen, anonymous or plain memory, which would lose
    their contents), in steps of :data:`DROP_STEP` bytes, each with the mapping's
    changes held off."""
    m = mapping(arr)
    if not isinstance(m, _Memory) or m.fd < 0:
        return
    start = 0
    while True:
        with _remapping:
            if m.closed or m.frozen is not None or start >= len(m):
                return
            size = min(DROP_STEP, len(m) - start)
            if _libc.madvise(_address(m) + start, size, _MADV_DONTNEED) != 0:
                return  # not worth an error: the freeze then drops them itself
        start += size
