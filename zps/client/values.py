"""The checks and conversions of a client call's arguments, and the cuts of its rows into
messages: pure helpers of the key-value API (:mod:`zps.client.keyvalue`) and of exports."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from zps.core.batching import row_runs
from zps.core.hashing import name_hash
from zps.core.rows import Split
from zps.errors import BadRequestError, ShapeMismatchError
from zps.protocol.specs import DenseSpec


def runs(split: Split, row_bytes: int, budget: int) -> list[tuple[int, int, int]]:
    """``(partition, start, stop)`` runs of ``split`` whose rows of ``row_bytes`` each
    stay within ``budget`` bytes (a partition's run, or a cut of it)."""
    out = []
    for p, a, b in split.parts:
        if (b - a) * row_bytes <= budget:
            out.append((p, a, b))
        else:
            out.extend((p, a + x, a + y) for x, y in row_runs(b - a, row_bytes, budget))
    return out


def chunk_bytes(spec: DenseSpec, chunk: int, itemsize: int) -> int:
    start, stop = spec.chunk_range(chunk)
    return (stop - start) * itemsize


def table_seed(name: str, seed: int | None) -> int:
    return name_hash(name) if seed is None else int(seed)


def as_ids(ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
        return np.ascontiguousarray(ids)  # the common case, in a few checks
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ShapeMismatchError(f"ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ShapeMismatchError(f"ids must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def must_copy(arr: np.ndarray, given: object, wait: bool) -> bool:
    """Whether ``arr`` may be the caller's memory while the call returns before the
    message is sent (``wait=False``): the caller may reuse its buffer at once."""
    if wait or isinstance(given, list | tuple | int | float):
        return False  # waited for, or built from Python values: nobody else holds it
    try:
        src = np.asarray(given)  # a view for numpy arrays and CPU tensors
    except Exception:
        return True
    return bool(np.may_share_memory(arr, src))


def owned(arr: np.ndarray, given: object, wait: bool) -> np.ndarray:
    """``arr``, copied if :func:`must_copy` says so."""
    return arr.copy() if must_copy(arr, given, wait) else arr


def check_finite(arr: np.ndarray, what: str) -> None:
    if arr.size and not bool(np.isfinite(arr).all()):
        raise BadRequestError(f"{what} contain NaN or infinity")


def as_float(values: npt.ArrayLike, dtype: str, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "fiu":
        raise ShapeMismatchError(f"{what} must be numeric, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)
