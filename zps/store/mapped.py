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
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MIN_BYTES", "empty", "grow", "grown", "mapping"]

#: Arrays smaller than this are plain numpy arrays (copying them costs nothing).
MIN_BYTES = 1 << 20
#: Whether anonymous memory can be grown in place here (mremap: Linux).
IN_PLACE = hasattr(mmap.mmap, "resize") and hasattr(mmap, "MAP_ANONYMOUS")
#: Arrays :func:`grow` extended in place, and those it copied (for tests and benches).
grown = {"in_place": 0, "copied": 0}


def empty(rows: int, width: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """An uninitialised ``(rows, width)`` array that :func:`grow` can extend in place."""
    dt = np.dtype(dtype)
    nbytes = rows * width * dt.itemsize
    if nbytes < MIN_BYTES or not IN_PLACE:
        return np.empty((rows, width), dt)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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
    if m is not None:
        holder[key] = None
        del arr  # the last view of the mapping, unless someone else holds one
        try:
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
