"""Allocator settings for zps processes (glibc only; elsewhere nothing happens).

glibc hands blocks of 128 KiB and more straight to ``mmap`` and, once it has
seen such a block freed, raises that limit only to the freed size and trims
the heap as soon as 2x that much is free at its top.  A zps process allocates
and frees buffers of 0.25-4 MiB for every message (zmq's receive buffers,
gathered rows, gradients), so the memory goes back to the kernel and comes
back as fresh zeroed pages a moment later: about 230 page faults per sparse
step in a client and 80 in the broker's zmq thread, some 20% of the client's
CPU time.

:func:`tune` keeps such buffers in the heap: blocks under 4 MiB come from it
and its top is trimmed only past 64 MiB free (a dense step has 16 MiB and more
in flight; an 8 MiB limit still cost 1,000 faults per step in a shard's zmq
thread).  Bigger allocations (tables, snapshots) still use ``mmap`` and return
to the kernel when freed.  The price is freed memory held by the process:
:func:`trim` hands it back, and a shard calls it once its traffic pauses.

A user's own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` wins: then
nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Mapping
from typing import Any

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 64 << 20
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


_tuned = False


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None
    return libc


def tune(environ: Mapping[str, str] = os.environ) -> bool:
    """Apply the settings above to this process; True if they were applied."""
    global _tuned
    libc = None if any(k in environ for k in _ENV) else _libc()
    if libc is None:
        return False
    _tuned = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _tuned


def trim() -> bool:
    """Return freed heap memory to the kernel (after :func:`tune`; else nothing)."""
    libc = _libc() if _tuned else None
    return bool(libc.malloc_trim(0)) if libc is not None else False
