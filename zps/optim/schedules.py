"""Learning-rate schedules: an optimizer's ``lr`` (FTRL's ``alpha``) as a function of a
table's step count.

``Adam(lr=LinearWarmup(Cosine(1e-3, total_steps=10_000), warmup_steps=500))`` ramps the
rate up over 500 steps, then decays it along a half cosine over 10,000 more.  The shards
evaluate the schedule at the table's step count, which the client advances
(``ps.advance_step``); the count is part of the table's spec, so replicas, snapshots,
checkpoints, the write-ahead log and exports all carry it.

Rules:

1. A schedule is a frozen dataclass with a wire form (:meth:`spec`,
   :func:`schedule_from_spec`), validated like an optimizer: bad input raises
   :class:`~zps.errors.BadRequestError` naming the schedule and the field.
2. :meth:`value` is a pure function of the step, computed with IEEE-754 double
   additions, multiplications and divisions only (no ``math.cos`` or ``pow`` from the
   platform's C library, whose last bit may differ between machines), so every copy of a
   table, on any host, gets the same rate bit for bit.
3. Values lie in ``[floor, peak]``; they may reach 0 (a cosine decayed to ``min_lr=0``,
   a step decay after enough steps): a step at rate 0 changes no value (FTRL, which
   divides by its ``alpha``, takes only a schedule whose floor is above 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeGuard

from zps.errors import BadRequestError
from zps.init import check_number, set_field

__all__ = [
    "Constant",
    "Cosine",
    "LinearWarmup",
    "Schedule",
    "Step",
    "schedule_from_spec",
]

#: The largest step count a table keeps (and so a schedule is asked about).
MAX_STEPS = 2**53
#: pi, correctly rounded to a double.
_PI = 3.141592653589793


def _check_steps(owner: str, field: str, value: object, *, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"{owner}.{field} must be an integer, got {type(value).__name__}")
    if not lo <= value <= MAX_STEPS:
        raise BadRequestError(f"{owner}.{field} must be an integer in [{lo}, 2**53], got {value}")
    return value


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEPS:
        raise BadRequestError(f"a schedule's step must be an integer in [0, 2**53], got {step!r}")


def _int_power(x: float, k: int) -> float:
    """``x**k`` by repeated squaring, in double arithmetic (rule 2)."""
    result, base = 1.0, x
    while k:
        if k & 1:
            result *= base
        base *= base
        k >>= 1
    return result


def _sin_series(u: float) -> float:
    """sin(u) for |u| <= pi/4, Taylor terms to u**19 (error far below a double's ulp)."""
    u2 = u * u
    term, total = u, u
    for n in range(1, 10):
        term = -term * u2 / ((2 * n) * (2 * n + 1))
        total += term
    return total


def _cos_series(u: float) -> float:
    """cos(u) for |u| <= pi/4, Taylor terms to u**18."""
    u2 = u * u
    term, total = 1.0, 1.0
    for n in range(1, 10):
        term = -term * u2 / ((2 * n - 1) * (2 * n))
        total += term
    return total


def cos_pi(x: float) -> float:
    """cos(pi * x) for x in [0, 1], with basic arithmetic only (rule 2); within 1e-15 of
    ``math.cos(math.pi * x)``."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"cos_pi takes x in [0, 1], got {x}")
    sign = 1.0
    if x > 0.5:  # cos(pi x) = -cos(pi (1 - x))
        x, sign = 1.0 - x, -1.0
    if x <= 0.25:
        return sign * _cos_series(_PI * x)
    return sign * _sin_series(_PI * (0.5 - x))  # cos(pi x) = sin(pi (1/2 - x))


@dataclass(frozen=True)
class Constant:
    """``lr`` at every step."""

    lr: float
    kind: ClassVar[str] = "constant"

    def __post_init__(self) -> None:
        set_field(self, "lr", check_number(self.kind, "lr", self.lr, lo=0.0, lo_open=True))

    @property
    def peak(self) -> float:
        return self.lr

    @property
    def floor(self) -> float:
        return self.lr

    def value(self, step: int) -> float:
        _check_step(step)
        return self.lr

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "lr": self.lr}


@dataclass(frozen=True)
class Step:
    """``lr * gamma ** (step // step_size)``: the rate drops by ``gamma`` every
    ``step_size`` steps."""

    lr: float
    step_size: int
    gamma: float = 0.1
    kind: ClassVar[str] = "step"

    def __post_init__(self) -> None:
        set_field(self, "lr", check_number(self.kind, "lr", self.lr, lo=0.0, lo_open=True))
        set_field(self, "step_size", _check_steps(self.kind, "step_size", self.step_size, lo=1))
        gamma = check_number(self.kind, "gamma", self.gamma, lo=0.0, lo_open=True, hi=1.0)
        set_field(self, "gamma", gamma)

    @property
    def peak(self) -> float:
        return self.lr

    @property
    def floor(self) -> float:
        # gamma < 1: the rate underflows to 0 after enough steps.
        return self.lr if self.gamma == 1.0 else 0.0

    def value(self, step: int) -> float:
        _check_step(step)
        return self.lr * _int_power(self.gamma, step // self.step_size)

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "lr": self.lr, "step_size": self.step_size, "gamma": self.gamma}


@dataclass(frozen=True)
class Cosine:
    """Half a cosine from ``lr`` at step 0 down to ``min_lr`` at ``total_steps``, then
    ``min_lr``: ``min_lr + (lr - min_lr) * (1 + cos(pi * step / total_steps)) / 2``."""

    lr: float
    total_steps: int
    min_lr: float = 0.0
    kind: ClassVar[str] = "cosine"

    def __post_init__(self) -> None:
        set_field(self, "lr", check_number(self.kind, "lr", self.lr, lo=0.0, lo_open=True))
        total = _check_steps(self.kind, "total_steps", self.total_steps, lo=1)
        set_field(self, "total_steps", total)
        set_field(self, "min_lr", check_number(self.kind, "min_lr", self.min_lr, lo=0.0))
        if self.min_lr > self.lr:
            raise BadRequestError(
                f"cosine.min_lr ({self.min_lr}) must not exceed cosine.lr ({self.lr})"
            )

    @property
    def peak(self) -> float:
        return self.lr

    @property
    def floor(self) -> float:
        return self.min_lr

    def value(self, step: int) -> float:
        _check_step(step)
        if step >= self.total_steps:
            return self.min_lr
        c = cos_pi(step / self.total_steps)
        return self.min_lr + (self.lr - self.min_lr) * ((1.0 + c) * 0.5)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "lr": self.lr,
            "total_steps": self.total_steps,
            "min_lr": self.min_lr,
        }


@dataclass(frozen=True)
class LinearWarmup:
    """``warmup_steps`` steps rising linearly to ``schedule``'s first rate (step ``s <
    warmup_steps`` gets ``schedule.value(0) * (s + 1) / warmup_steps``, so the first step
    already moves), then ``schedule`` from its own step 0: step ``s`` gets
    ``schedule.value(s - warmup_steps)``."""

    schedule: Schedule
    warmup_steps: int
    kind: ClassVar[str] = "linear_warmup"

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, _SCHEDULE_TYPES):
            raise BadRequestError(
                "linear_warmup.schedule must be a zps.optim.schedules schedule, got "
                f"{type(self.schedule).__name__}"
            )
        steps = _check_steps(self.kind, "warmup_steps", self.warmup_steps, lo=1)
        set_field(self, "warmup_steps", steps)

    @property
    def peak(self) -> float:
        return self.schedule.peak

    @property
    def floor(self) -> float:
        return min(self.schedule.value(0) / self.warmup_steps, self.schedule.floor)

    def value(self, step: int) -> float:
        _check_step(step)
        if step < self.warmup_steps:
            return self.schedule.value(0) * (step + 1) / self.warmup_steps
        return self.schedule.value(step - self.warmup_steps)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "schedule": self.schedule.spec(),
            "warmup_steps": self.warmup_steps,
        }


Schedule = Constant | Step | Cosine | LinearWarmup
_SCHEDULE_TYPES = (Constant, Step, Cosine, LinearWarmup)
_SCHEDULES: dict[str, type[Schedule]] = {c.kind: c for c in _SCHEDULE_TYPES}
#: Wire field -> what it must be ("a number", "an integer" or "a schedule"), by kind.
_FIELDS: dict[str, dict[str, str]] = {
    "constant": {"lr": "a number"},
    "step": {"lr": "a number", "step_size": "an integer", "gamma": "a number"},
    "cosine": {"lr": "a number", "total_steps": "an integer", "min_lr": "a number"},
    "linear_warmup": {"schedule": "a schedule", "warmup_steps": "an integer"},
}
#: How deeply warmups may nest on the wire (a hostile spec cannot recurse for ever).
_MAX_DEPTH = 4


def is_schedule(obj: object) -> TypeGuard[Schedule]:
    return isinstance(obj, _SCHEDULE_TYPES)


def schedule_from_spec(spec: object, _depth: int = 0) -> Schedule:
    """Parse the wire form produced by ``Schedule.spec()``: every field present, nothing
    else, each of its type."""
    if not isinstance(spec, Mapping):
        raise BadRequestError(f"schedule must be a map, got {type(spec).__name__}")
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind not in _SCHEDULES:
        raise BadRequestError(f"schedule.kind must be one of {sorted(_SCHEDULES)}, got {kind!r}")
    if _depth >= _MAX_DEPTH:
        raise BadRequestError(f"schedule nests more than {_MAX_DEPTH} deep")
    expected = _FIELDS[kind]
    for key in spec:
        if key != "kind" and key not in expected:
            raise BadRequestError(f"schedule: unknown field {key!r} for kind {kind!r}")
    kwargs: dict[str, Any] = {}
    for name, what in expected.items():
        if name not in spec:
            raise BadRequestError(f"{kind}.{name} is missing")
        value = spec[name]
        if what == "a schedule":
            value = schedule_from_spec(value, _depth + 1)
        elif isinstance(value, bool) or not isinstance(
            value, int if what == "an integer" else int | float
        ):
            raise BadRequestError(f"{kind}.{name} must be {what}, got {type(value).__name__}")
        kwargs[name] = value
    return _SCHEDULES[kind](**kwargs)
