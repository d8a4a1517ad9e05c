"""Deterministic 64-bit mixing, vectorised over numpy arrays.

The same function places ids on slots (routing), probes the id index of an
embedding table, and seeds the per-element initialisers, so it must never
change: values computed by one process are recomputed identically by a
replica, a restarted shard, or a client.
"""

from __future__ import annotations

import zlib

import numpy as np
import numpy.typing as npt

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)

U64 = npt.NDArray[np.uint64]


def mix64(x: npt.ArrayLike) -> U64:
    """SplitMix64 finaliser of ``x`` (any integer array), as uint64."""
    z = np.asarray(x).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z ^= z >> _S30
        z *= _C1
        z ^= z >> _S27
        z *= _C2
        z ^= z >> _S31
    return z


def mix64_pair(a: npt.ArrayLike, b: npt.ArrayLike) -> U64:
    """Mix two integer arrays (broadcast) into one well-spread uint64 array."""
    with np.errstate(over="ignore"):
        return mix64(mix64(a) ^ np.asarray(b).astype(np.uint64))


def name_hash(name: str) -> int:
    """A stable (process-independent) non-negative hash of a table name."""
    return zlib.crc32(name.encode("utf-8"))


_M64 = (1 << 64) - 1


def mix64_int(x: int) -> int:
    """:func:`mix64` of one Python int (same result), without numpy's per-call cost."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)
