"""Deterministic row initialisers and the strict parser of small wire records.

Invariant: element ``(i, j)`` of :func:`generate` depends only on
``(seed, keys[i], j)``.  A row therefore gets the same initial values on any
process (primary, replica, restarted shard), in any batch and in any order,
and a dense tensor's values do not depend on how it is chunked.  The values
come from a counter-based generator built on :func:`zps.core.hashing.mix64_pair`,
so there is no RNG state to carry around or to replicate.

:func:`parse_record` turns a ``{"kind": ..., field: value}`` dict received from
the wire into one of a family of frozen dataclasses; it is shared with
:mod:`zps.optim`.  Range checks live in each dataclass's ``__post_init__`` so
that objects built in Python and objects parsed from the wire obey the same
rules.  Every failure is a :class:`~zps.errors.BadRequestError` naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from zps.core.hashing import mix64_pair
from zps.errors import BadRequestError

__all__ = [
    "Constant",
    "Initializer",
    "Normal",
    "Uniform",
    "Zeros",
    "generate",
    "init_from_spec",
    "parse_record",
]

# Salts separate the two independent streams Box-Muller needs; changing them
# would change every initial value ever produced, so they are frozen.
_SALT_A = 0x5A17_0001
_SALT_B = 0x5A17_0002
_TWO_POW_M53 = 2.0**-53


def check_number(
    owner: str,
    field: str,
    value: float,
    *,
    lo: float | None = None,
    lo_open: bool = False,
    hi: float | None = None,
    hi_open: bool = False,
) -> float:
    """Return ``value`` as a finite float within the bounds, else raise naming the field."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequestError(f"{owner}.{field} must be a number, got {type(value).__name__}")
    x = float(value)
    if not math.isfinite(x):
        raise BadRequestError(f"{owner}.{field} must be finite, got {x}")
    if lo is not None and (x <= lo if lo_open else x < lo):
        raise BadRequestError(f"{owner}.{field} must be {'>' if lo_open else '>='} {lo}, got {x}")
    if hi is not None and (x >= hi if hi_open else x > hi):
        raise BadRequestError(f"{owner}.{field} must be {'<' if hi_open else '<='} {hi}, got {x}")
    return x


def set_field(obj: object, field: str, value: object) -> None:
    """Normalise a field of a frozen dataclass (e.g. int -> float) in ``__post_init__``."""
    object.__setattr__(obj, field, value)


@dataclass(frozen=True)
class Zeros:
    """Every element is 0."""

    kind: ClassVar[str] = "zeros"

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind}


@dataclass(frozen=True)
class Constant:
    """Every element is ``value``."""

    value: float
    kind: ClassVar[str] = "constant"

    def __post_init__(self) -> None:
        set_field(self, "value", check_number("constant", "value", self.value))

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}


@dataclass(frozen=True)
class Uniform:
    """Elements uniform in ``[low, high)``."""

    low: float = -0.01
    high: float = 0.01
    kind: ClassVar[str] = "uniform"

    def __post_init__(self) -> None:
        set_field(self, "low", check_number("uniform", "low", self.low))
        set_field(self, "high", check_number("uniform", "high", self.high))
        if self.low >= self.high:
            raise BadRequestError(
                f"uniform.low must be < high, got low={self.low} high={self.high}"
            )

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class Normal:
    """Elements normal with the given mean and standard deviation."""

    mean: float = 0.0
    std: float = 0.01
    kind: ClassVar[str] = "normal"

    def __post_init__(self) -> None:
        set_field(self, "mean", check_number("normal", "mean", self.mean))
        set_field(self, "std", check_number("normal", "std", self.std, lo=0.0))

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "mean": self.mean, "std": self.std}


Initializer = Zeros | Constant | Uniform | Normal
_INITIALIZERS: dict[str, type[Initializer]] = {
    c.kind: c for c in (Zeros, Constant, Uniform, Normal)
}

T = TypeVar("T")


def _check_type(what: str, field: str, value: object, hint: object) -> None:
    """Type-check one wire value against the dataclass annotation of its field."""
    if hint is float or hint == float | None:
        ok = (value is None and hint is not float) or (
            isinstance(value, int | float) and not isinstance(value, bool)
        )
        expected = "a number" if hint is float else "a number or null"
    elif hint is bool:
        ok, expected = isinstance(value, bool), "a boolean"
    elif hint is int:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:  # pragma: no cover - a programming error in a record class
        raise TypeError(f"unsupported field type {hint!r} for {what}.{field}")
    if not ok:
        raise BadRequestError(f"{what}.{field} must be {expected}, got {type(value).__name__}")


@functools.cache
def _layout(cls: type) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The field names of the record class ``cls`` and their annotations, resolved once
    per class (a class's annotations do not change; resolving them costs more than
    parsing a record)."""
    return tuple(f.name for f in dataclasses.fields(cls)), typing.get_type_hints(cls)


def parse_record(obj: object, what: str, kinds: Mapping[str, type[T]]) -> T:
    """Build ``kinds[obj["kind"]](**fields)`` from a wire dict, strictly.

    Every field of the dataclass must be present (the wire form is always
    complete, so a missing field means a broken or foreign sender), no other
    key may be, and each value must have the annotated type.
    """
    if not isinstance(obj, Mapping):
        raise BadRequestError(f"{what} must be a map, got {type(obj).__name__}")
    kind = obj.get("kind")
    if not isinstance(kind, str) or kind not in kinds:
        raise BadRequestError(f"{what}.kind must be one of {sorted(kinds)}, got {kind!r}")
    cls = kinds[kind]
    fields, hints = _layout(typing.cast(type, cls))
    for key in obj:
        if key != "kind" and key not in fields:
            raise BadRequestError(f"{what}: unknown field {key!r} for kind {kind!r}")
    kwargs: dict[str, object] = {}
    for name in fields:
        if name not in obj:
            raise BadRequestError(f"{what}.{name} is missing (kind {kind!r})")
        _check_type(kind, name, obj[name], hints[name])
        kwargs[name] = obj[name]
    return cls(**kwargs)


def init_from_spec(spec: object) -> Initializer:
    """Parse the wire form produced by ``Initializer.spec()``."""
    return parse_record(spec, "init", _INITIALIZERS)


def _uniform01(
    salt: int, seed: int, keys: npt.NDArray[np.int64], dim: int
) -> npt.NDArray[np.float64]:
    """Counter-based uniforms in [0, 1): element (i, j) is a hash of (salt, seed, keys[i], j)."""
    row = mix64_pair(mix64_pair(np.uint64(salt), np.uint64(seed)), keys.astype(np.uint64))
    bits = mix64_pair(row[:, None], np.arange(dim, dtype=np.uint64)[None, :])
    # The top 53 bits fill a double's mantissa exactly, so the result is < 1.
    return (bits >> np.uint64(11)).astype(np.float64) * _TWO_POW_M53


def generate(
    init: Initializer, seed: int, keys: npt.ArrayLike, dim: int, dtype: npt.DTypeLike
) -> npt.NDArray[np.floating[Any]]:
    """Initial values of the rows ``keys`` (shape ``(n, dim)``, dtype ``dtype``)."""
    k = np.asarray(keys).astype(np.int64, copy=False).reshape(-1)
    dt = np.dtype(dtype)
    shape = (k.shape[0], dim)
    match init:
        case Zeros():
            return np.zeros(shape, dtype=dt)
        case Constant(value=value):
            return np.full(shape, value, dtype=dt)
        case Uniform(low=low, high=high):
            u = _uniform01(_SALT_A, seed, k, dim)
            out = (low + (high - low) * u).astype(dt)
            # Rounding to a narrower dtype could reach `high`; keep the interval half-open.
            top = np.nextafter(np.asarray(high, dtype=dt), np.asarray(low, dtype=dt))
            np.minimum(out, top, out=out)
            return out
        case Normal(mean=mean, std=std):
            u1 = _uniform01(_SALT_A, seed, k, dim)
            u2 = _uniform01(_SALT_B, seed, k, dim)
            # Box-Muller; 1 - u1 is in (0, 1], so the log is finite.
            z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
            return (mean + std * z).astype(dt)
    raise BadRequestError(f"not an initializer: {init!r}")  # pragma: no cover
