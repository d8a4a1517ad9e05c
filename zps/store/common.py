"""What both kinds of table (zps/store/embedding.py, zps/store/dense.py) share: the
checksum of an export, and the checks of a gradient, of a new spec, of an export's arrays
and of given optimizer state, each a BadRequestError (or ShapeMismatchError) naming the
table and what is wrong.  Pure: no I/O."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from zps.errors import BadRequestError, ShapeMismatchError
from zps.optim import Optimizer
from zps.protocol.specs import DenseSpec, EmbeddingSpec

__all__ = [
    "Array",
    "check_retune",
    "checksum_arrays",
    "float_grads",
    "given_state",
    "load_array",
]

Array = npt.NDArray[Any]
TableSpecT = TypeVar("TableSpecT", DenseSpec, EmbeddingSpec)


def checksum_arrays(arrays: dict[str, Array], h: Any = None) -> str:
    """sha256 over names, dtypes, shapes and bytes, in the dict's order."""
    h = hashlib.sha256() if h is None else h
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return str(h.hexdigest())


def float_grads(
    table: str, grads: object, shape: tuple[int, ...], dtype: np.dtype[Any], finite: bool = False
) -> Array:
    """Check a gradient's shape and values (not whether they are finite, when the
    caller knows: ``finite``); return it in the table's dtype."""
    g = np.asarray(grads)
    if g.shape != shape:
        raise ShapeMismatchError(
            f"table {table!r}: expected gradient of shape {shape}, got {g.shape}"
        )
    if g.size and not (np.issubdtype(g.dtype, np.floating) or np.issubdtype(g.dtype, np.integer)):
        raise BadRequestError(f"table {table!r}: gradient dtype must be numeric, got {g.dtype}")
    if g.dtype == dtype:
        if finite:  # known finite in this dtype: nothing to convert or check
            return g
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is checked below
            g = g.astype(dtype)
    # One NaN or inf would poison the rows (and their optimizer state) for every worker.
    # For a large float32/float64 gradient, the BLAS dot product g.g is one pass with
    # no temporary, cheaper than isfinite().all() or a sum (figures: docs/performance.md,
    # "Figures behind the code's rules"); only when it is not finite (a NaN or inf, or
    # huge values whose squares overflowed) does the element-wise check decide.
    if g.size > 65536 and g.dtype.kind == "f" and g.itemsize >= 4 and g.flags.c_contiguous:
        flat = g.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            finite = math.isfinite(float(np.dot(flat, flat))) or bool(np.isfinite(g).all())
    else:
        finite = bool(np.isfinite(g).all()) if g.size else True
    if not finite:
        raise BadRequestError(f"table {table!r}: gradient contains NaN or infinity")
    return g


def check_retune(old: TableSpecT, new: TableSpecT, reset: bool) -> bool:
    """Whether the state columns are made afresh for ``new`` (``old`` with another
    optimizer or step): with ``reset``, whatever the kind; another kind takes ``reset``."""
    if type(old) is not type(new) or old.name != new.name or old != _with_opt(new, old.optimizer):
        raise BadRequestError(f"table {old.name!r}: only the optimizer and step may change")
    other = type(new.optimizer) is not type(old.optimizer)
    if other and not reset:
        raise BadRequestError(
            f"table {old.name!r}: its optimizer is {old.optimizer.kind}, not "
            f"{new.optimizer.kind}; another kind takes reset_state=True (its state "
            "starts afresh)"
        )
    return reset


def _with_opt(spec: TableSpecT, opt: Optimizer) -> TableSpecT:
    return dataclasses.replace(spec, optimizer=opt)


def load_array(
    table: str,
    data: dict[str, Array],
    key: str,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    *,
    copy: bool = True,
) -> Array:
    """``data[key]`` checked to be of ``shape`` and ``dtype`` (a copy, or with ``copy``
    False the array itself)."""
    if key not in data:
        raise BadRequestError(f"table {table!r}: export lacks {key!r}")
    a = np.asarray(data[key])
    if a.shape != shape or a.dtype != dtype:
        raise BadRequestError(
            f"table {table!r}: export {key!r} has shape {a.shape} dtype {a.dtype}, "
            f"expected {shape} {dtype}"
        )
    return np.array(a, copy=True) if copy else a


def given_state(
    name: str,
    state: Mapping[str, npt.ArrayLike],
    widths: dict[str, int],
    n: int,
    dtype: np.dtype[Any],
) -> dict[str, Array]:
    """``state`` checked against the optimizer's columns (``widths``) for ``n`` rows:
    every column, no other, each ``(n, width)``, numeric and finite; copies in ``dtype``."""
    if set(state) != set(widths):
        raise BadRequestError(
            f"table {name!r}: optimizer state {sorted(state)} given; its optimizer keeps "
            f"{sorted(widths)}"
        )
    out: dict[str, Array] = {}
    for k, w in widths.items():
        a = np.asarray(state[k])
        if a.shape != (n, w):
            raise ShapeMismatchError(
                f"table {name!r}: optimizer state {k!r} of shape {a.shape}, expected {(n, w)}"
            )
        if a.size and a.dtype.kind not in "fiu":
            raise BadRequestError(f"table {name!r}: optimizer state {k!r} must be numeric")
        a = np.array(a, dtype=dtype)
        if a.size and not bool(np.isfinite(a).all()):
            raise BadRequestError(f"table {name!r}: optimizer state {k!r} has NaN or infinity")
        out[k] = a
    return out
