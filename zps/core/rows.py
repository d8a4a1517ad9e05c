"""Whole-row gathers and scatters of C-contiguous 2-D arrays, and ids split by partition.

One job: move rows by position, and group ids by the partition that owns them, in as few
passes over memory as possible.  Used by the shard's tables and by the client when it
splits and joins row requests by partition.

Where the optional C kernel ``zps.core._rows`` was built (``pip install`` with a
compiler), each of :func:`take_rows`, :func:`put_rows` and :func:`split_ids` is one pass
in C; otherwise (or with ``ZPS_NO_KERNEL=1`` in the environment) numpy does the same
work with the same results: gathers and scatters of whole-row void records (about
three times faster than fancy indexing) and a vectorised hash.
"""

from __future__ import annotations

import os
import platform
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from zps.core.hashing import mix64

try:  # the compiled kernel, built by ``pip install`` where a C compiler is found
    from zps.core import _rows  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _rows = None

Array = npt.NDArray[Any]
I64 = npt.NDArray[np.int64]

#: Up to this many partitions, the numpy split makes one comparison pass per partition
#: (4,096 ids over 2 partitions: about 3x faster than a stable sort).
SPLIT_BY_MASK = 8
#: Whether the compiled kernel is in use (``ZPS_NO_KERNEL=1`` turns it off).
KERNEL = _rows is not None and os.environ.get("ZPS_NO_KERNEL", "") in ("", "0")
#: The compiled barrier (whatever ``ZPS_NO_KERNEL`` says: it is no alternative to numpy's
#: work but the only barrier there is); None without the kernel (or an older build).
_FENCE = getattr(_rows, "fence", None)
#: Whether this build has the compiled barrier (see :func:`memory_ordered`).
BARRIER = _FENCE is not None
#: The compiled byte comparison (None without the kernel, or an older build).
_SAME = getattr(_rows, "same", None)


def take_rows(a: Array, pos: npt.NDArray[np.int64]) -> Array:
    """``a[pos]`` for a C-contiguous 2-D array, as one gather of whole rows.
    ``pos`` (int64) must be in range (the kernel raises IndexError if not)."""
    if KERNEL and _kernel_ok(a, pos):
        out = np.empty((pos.shape[0], a.shape[1]), dtype=a.dtype)
        _rows.gather(a, pos, out)
        return out
    return take_rows_numpy(a, pos)


def put_rows(a: Array, pos: npt.NDArray[np.int64], values: Array) -> None:
    """``a[pos] = values`` for C-contiguous 2-D arrays (``pos`` distinct and in range)."""
    if KERNEL and _kernel_ok(a, pos):
        v = values
        if v.dtype != a.dtype or not v.flags.c_contiguous:
            v = np.ascontiguousarray(v, dtype=a.dtype)
        _rows.scatter(a, pos, v)
        return
    put_rows_numpy(a, pos, values)


def copy_finite(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8], itemsize: int) -> bool:
    """``dst[:] = src`` (bytes, the same length), and True if every float of the copy
    (``itemsize`` 4: float32, 8: float64) is known to be finite: checked as it was
    copied, in the same pass.  False: not known (a NaN or infinity, or no kernel: the
    caller checks as usual)."""
    if KERNEL and itemsize in (4, 8) and src.nbytes % itemsize == 0:
        return bool(_rows.copy_finite(dst, src, itemsize))
    dst[:] = src
    return False


#: CPUs whose stores become visible to other cores in program order, and loads likewise
#: (total store order): there, the order of Python's own steps is the order other
#: processes see, and :func:`fence` need do nothing.
TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


def memory_ordered(machine: str | None = None, *, barrier: bool | None = None) -> bool:
    """Whether :func:`fence` orders memory on this CPU (``machine``: ``platform.machine()``):
    always with the compiled kernel, which has a real barrier; without it, only on the
    CPUs of :data:`TSO_MACHINES`.  ``barrier``: whether the compiled barrier is there
    (default: :data:`BARRIER`, this build's).  ``zps.shm`` stays off where this is False."""
    if BARRIER if barrier is None else barrier:
        return True
    return (machine if machine is not None else platform.machine()).lower() in TSO_MACHINES


def fence() -> None:
    """A full memory barrier between the stores and loads before it and those after it,
    as other processes sharing the memory see them (the tokens of ``zps.shm``'s regions).
    Without the compiled kernel, nothing: correct only where :func:`memory_ordered`."""
    if _FENCE is not None:
        _FENCE()


def same_ids(a: I64, b: I64) -> bool:
    """Whether two 1-D id arrays hold the same ids.  Compiled, a ``memcmp`` that stops at
    the first difference (numpy's ``array_equal`` compares every element, then reduces:
    most comparisons of :class:`zps.core.memo.IdsMemo` are of different batches)."""
    if (
        KERNEL
        and _SAME is not None
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.flags.c_contiguous
        and b.flags.c_contiguous
    ):
        return bool(_SAME(a, b))
    return bool(np.array_equal(a, b))


def _kernel_ok(a: Array, pos: npt.NDArray[Any]) -> bool:
    return (
        pos.dtype == np.int64
        and pos.flags.c_contiguous
        and a.ndim == 2
        and a.flags.c_contiguous
        and a.shape[1] > 0
    )


def take_rows_numpy(a: Array, pos: npt.NDArray[np.int64]) -> Array:
    """:func:`take_rows` without the kernel: one numpy take of whole-row records."""
    rec = a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).reshape(-1)
    return rec.take(pos).view(a.dtype).reshape(pos.shape[0], a.shape[1])


def put_rows_numpy(a: Array, pos: npt.NDArray[np.int64], values: Array) -> None:
    """:func:`put_rows` without the kernel: one numpy put of whole-row records."""
    rec = np.dtype((np.void, a.shape[1] * a.itemsize))
    np.put(a.view(rec).reshape(-1), pos, np.ascontiguousarray(values, dtype=a.dtype).view(rec))


class Split(NamedTuple):
    """Ids grouped by the partition that owns them.

    ``order`` holds the positions of the ids, partition after partition (ascending
    within each), ``ids`` the ids in that order, and ``parts`` for each partition that
    owns any: ``(partition, start, stop)``, its run in both arrays.  So
    ``take_rows(rows, order)[start:stop]`` are that partition's rows, in one gather.
    """

    order: I64
    ids: I64
    parts: list[tuple[int, int, int]]


def split_ids(ids: I64, slot_map: npt.NDArray[np.int32], n_partitions: int) -> Split:
    """Group ``ids`` (1-D int64) by partition: ``slot_map[mix64(id) % len(slot_map)]``
    (see :mod:`zps.core.routing`); every value of ``slot_map`` must be below
    ``n_partitions``."""
    n = ids.shape[0]
    if KERNEL:
        order = np.empty(n, dtype=np.int64)
        out = np.empty(n, dtype=np.int64)
        counts = np.empty(n_partitions, dtype=np.int64)
        if slot_map.dtype != np.int32 or not slot_map.flags.c_contiguous:
            slot_map = np.ascontiguousarray(slot_map, dtype=np.int32)
        _rows.split(ids, slot_map, order, out, counts)
        return Split(order, out, _runs(counts.tolist()))
    return split_ids_numpy(ids, slot_map, n_partitions)


def split_ids_numpy(ids: I64, slot_map: npt.NDArray[np.int32], n_partitions: int) -> Split:
    """:func:`split_ids` without the kernel (the same result)."""
    n_slots = slot_map.shape[0]
    h = mix64(ids)
    h = h & np.uint64(n_slots - 1) if n_slots & (n_slots - 1) == 0 else h % np.uint64(n_slots)
    owner = slot_map[h.view(np.int64)]
    if owner.size and int(owner.max()) >= n_partitions:
        raise ValueError(f"slot_map names partitions beyond {n_partitions}")
    if n_partitions <= SPLIT_BY_MASK:
        # one comparison pass per partition beats a stable sort for a few partitions
        mine = [np.flatnonzero(owner == p) for p in range(n_partitions)]
        order = np.concatenate(mine) if n_partitions > 1 else mine[0]
        counts = [m.shape[0] for m in mine]
    else:
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=n_partitions).tolist()
    order = order.astype(np.int64, copy=False)
    return Split(order, ids[order], _runs(counts))


def _runs(counts: list[int]) -> list[tuple[int, int, int]]:
    out = []
    at = 0
    for p, c in enumerate(counts):
        if c:
            out.append((p, at, at + c))
            at += c
    return out
