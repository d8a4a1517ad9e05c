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
and its top is trimmed only past 8 MiB free.  Bigger allocations (tables,
snapshots, 4 MiB dense batches) still use ``mmap`` and return to the kernel
when freed.  The price is memory freed inside the heap that cannot be
returned: a shard holding 1M rows of dim 32 with Adagrad grew from 1.19x to
1.28x the raw bytes (16 and 32 MiB limits cost 1.50x).  A user's own ``MALLOC_MMAP_THRESHOLD_``
or ``MALLOC_TRIM_THRESHOLD_`` wins: then nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 8 << 20
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def tune(environ: Mapping[str, str] = os.environ) -> bool:
    """Apply the settings above to this process; True if they were applied."""
    if not sys.platform.startswith("linux") or any(k in environ for k in _ENV):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
