"""Whole-row gathers and scatters of C-contiguous 2-D arrays, as void records.

One job: move rows by position about three times faster than fancy indexing.  Used by the
shard's tables and by the client when it splits and joins row requests by partition.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]


def take_rows(a: Array, pos: npt.NDArray[np.int64]) -> Array:
    """``a[pos]`` for a C-contiguous 2-D array, as one gather of whole-row records
    (about three times faster than fancy indexing).  ``pos`` must be in range."""
    rec = a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).reshape(-1)
    return rec.take(pos).view(a.dtype).reshape(pos.shape[0], a.shape[1])


def put_rows(a: Array, pos: npt.NDArray[np.int64], values: Array) -> None:
    """``a[pos] = values`` for C-contiguous 2-D arrays (``pos`` distinct and in range)."""
    rec = np.dtype((np.void, a.shape[1] * a.itemsize))
    np.put(a.view(rec).reshape(-1), pos, np.ascontiguousarray(values, dtype=a.dtype).view(rec))
