"""Optimizers that shards apply to pushed gradients.

Each optimizer is a frozen dataclass of hyperparameters with no hidden state:
its per-row state (momentum buffers, accumulators, step counts) lives in
arrays the table owns, so it travels with replication and snapshots.

Contract of :meth:`apply`: ``param`` is ``(n, dim)``, ``grad`` the same shape,
each ``state[name]`` is ``(n, state_widths(dim)[name])``; ``param`` and the
state arrays are updated in place, ``grad`` is never written.  Rows are
independent, so applying to any subset of rows (a lazy, sparse update) is the
same as applying to each row alone.  Arithmetic stays in ``param``'s dtype:
hyperparameters are Python floats, which NumPy treats as weakly typed.

The learning rate (FTRL's ``alpha``) is a number or a schedule of
:mod:`zps.optim.schedules`; a scheduled optimizer is applied as
:func:`at_step` makes it at the table's step count: the same optimizer with the
schedule's rate at that step.  Hyperparameters may change while a table trains
(``set_optimizer``): the state columns depend only on the kind, so an optimizer of
the same kind takes over the state as it is.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from zps.errors import BadRequestError
from zps.init import _check_type as check_type
from zps.init import check_number, set_field
from zps.optim.schedules import Schedule, is_schedule, schedule_from_spec

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "Adam",
    "Momentum",
    "Optimizer",
    "at_step",
    "optimizer_from_spec",
    "rate_field",
]

Array = npt.NDArray[np.floating[Any]]
State = dict[str, Array]


def _spec(opt: Any) -> dict[str, Any]:
    """The wire form of an optimizer: its kind, then every field in order (a schedule
    as its own wire form)."""
    out = {"kind": opt.kind, **{f.name: getattr(opt, f.name) for f in fields(opt)}}
    rate = rate_field(opt)
    if is_schedule(out[rate]):
        out[rate] = out[rate].spec()
    return out


def _check_common(obj: Any, *, weight_decay: bool = True) -> None:
    """Validate and normalise ``clip`` (and ``weight_decay``)."""
    if obj.clip is not None:
        set_field(obj, "clip", check_number(obj.kind, "clip", obj.clip, lo=0.0, lo_open=True))
    if weight_decay:
        wd = check_number(obj.kind, "weight_decay", obj.weight_decay, lo=0.0)
        set_field(obj, "weight_decay", wd)


def _check_lr(obj: Any, field: str = "lr") -> None:
    value = getattr(obj, field)
    if is_schedule(value):
        return  # validated as it was made
    set_field(obj, field, check_number(obj.kind, field, value, lo=0.0, lo_open=True))


def _rate(obj: Any, value: float | Schedule) -> float:
    """The learning rate to apply: a number (a schedule must be evaluated first)."""
    if isinstance(value, float | int):
        return value
    raise BadRequestError(
        f"{obj.kind}: a scheduled optimizer is applied at a step: zps.optim.at_step(opt, step)"
    )


def _effective_grad(grad: Array, param: Array, clip: float | None, weight_decay: float) -> Array:
    """Clip, then add L2 decay; returns a new array whenever ``grad`` would change."""
    g = np.asarray(grad, dtype=param.dtype)
    if clip is not None:
        g = np.clip(g, -clip, clip)
    if weight_decay:
        g = g + weight_decay * param
    return g


def _full_state(n: int, widths: dict[str, int], dtype: npt.DTypeLike, fill: float) -> State:
    return {name: np.full((n, w), fill, dtype=dtype) for name, w in widths.items()}


@dataclass(frozen=True)
class SGD:
    """``p -= lr * g``."""

    lr: float | Schedule = 0.01
    clip: float | None = None
    weight_decay: float = 0.0
    kind: ClassVar[str] = "sgd"

    def __post_init__(self) -> None:
        _check_lr(self)
        _check_common(self)

    def spec(self) -> dict[str, Any]:
        return _spec(self)

    def state_widths(self, dim: int) -> dict[str, int]:
        return {}

    def init_state(self, n: int, dim: int, dtype: npt.DTypeLike) -> State:
        return {}

    def apply(self, param: Array, grad: Array, state: State) -> None:
        g = _effective_grad(grad, param, self.clip, self.weight_decay)
        param -= _rate(self, self.lr) * g


@dataclass(frozen=True)
class Momentum:
    """Heavy-ball or Nesterov momentum, PyTorch convention (``v = m v + g``)."""

    lr: float | Schedule = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    clip: float | None = None
    weight_decay: float = 0.0
    kind: ClassVar[str] = "momentum"

    def __post_init__(self) -> None:
        _check_lr(self)
        m = check_number(self.kind, "momentum", self.momentum, lo=0.0, hi=1.0, hi_open=True)
        set_field(self, "momentum", m)
        if not isinstance(self.nesterov, bool):
            raise BadRequestError("momentum.nesterov must be a boolean")
        if self.nesterov and m == 0.0:
            raise BadRequestError("momentum.nesterov requires momentum > 0")
        _check_common(self)

    def spec(self) -> dict[str, Any]:
        return _spec(self)

    def state_widths(self, dim: int) -> dict[str, int]:
        return {"velocity": dim}

    def init_state(self, n: int, dim: int, dtype: npt.DTypeLike) -> State:
        return _full_state(n, self.state_widths(dim), dtype, 0.0)

    def apply(self, param: Array, grad: Array, state: State) -> None:
        g = _effective_grad(grad, param, self.clip, self.weight_decay)
        v = state["velocity"]
        v *= self.momentum
        v += g
        lr = _rate(self, self.lr)
        if self.nesterov:
            param -= lr * (g + self.momentum * v)
        else:
            param -= lr * v


@dataclass(frozen=True)
class Adagrad:
    """``a += g^2; p -= lr * g / (sqrt(a) + eps)``."""

    lr: float | Schedule = 0.01
    initial_accumulator: float = 0.1
    eps: float = 1e-10
    clip: float | None = None
    weight_decay: float = 0.0
    kind: ClassVar[str] = "adagrad"

    def __post_init__(self) -> None:
        _check_lr(self)
        acc = check_number(self.kind, "initial_accumulator", self.initial_accumulator, lo=0.0)
        set_field(self, "initial_accumulator", acc)
        set_field(self, "eps", check_number(self.kind, "eps", self.eps, lo=0.0, lo_open=True))
        _check_common(self)

    def spec(self) -> dict[str, Any]:
        return _spec(self)

    def state_widths(self, dim: int) -> dict[str, int]:
        return {"accumulator": dim}

    def init_state(self, n: int, dim: int, dtype: npt.DTypeLike) -> State:
        return _full_state(n, self.state_widths(dim), dtype, self.initial_accumulator)

    def apply(self, param: Array, grad: Array, state: State) -> None:
        g = _effective_grad(grad, param, self.clip, self.weight_decay)
        a = state["accumulator"]
        # The same arithmetic as ``a += g*g; p -= lr*g / (sqrt(a) + eps)``, with
        # two temporaries instead of five.
        t = np.multiply(g, g)
        a += t
        np.sqrt(a, out=t)
        t += self.eps
        u = np.multiply(g, _rate(self, self.lr))
        u /= t
        param -= u


@dataclass(frozen=True)
class Adam:
    """Adam with a per-row step count, so lazy sparse updates bias-correct correctly."""

    lr: float | Schedule = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip: float | None = None
    weight_decay: float = 0.0
    kind: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        _check_lr(self)
        for field in ("beta1", "beta2"):
            b = check_number(self.kind, field, getattr(self, field), lo=0.0, hi=1.0, hi_open=True)
            set_field(self, field, b)
        set_field(self, "eps", check_number(self.kind, "eps", self.eps, lo=0.0, lo_open=True))
        _check_common(self)

    def spec(self) -> dict[str, Any]:
        return _spec(self)

    def state_widths(self, dim: int) -> dict[str, int]:
        # The step count is stored in the table's float dtype so every state array
        # shares one dtype; float32 counts exactly to 2**24, long after the bias
        # corrections below have reached 1.
        return {"m": dim, "v": dim, "step": 1}

    def init_state(self, n: int, dim: int, dtype: npt.DTypeLike) -> State:
        return _full_state(n, self.state_widths(dim), dtype, 0.0)

    def apply(self, param: Array, grad: Array, state: State) -> None:
        g = _effective_grad(grad, param, self.clip, self.weight_decay)
        m, v, t = state["m"], state["v"], state["step"]
        t += 1
        m *= self.beta1
        m += (1.0 - self.beta1) * g
        v *= self.beta2
        v += (1.0 - self.beta2) * (g * g)
        bc1 = 1.0 - np.power(self.beta1, t, dtype=param.dtype)
        bc2 = 1.0 - np.power(self.beta2, t, dtype=param.dtype)
        param -= _rate(self, self.lr) * (m / bc1) / (np.sqrt(v / bc2) + self.eps)


@dataclass(frozen=True)
class FTRL:
    """FTRL-Proximal (McMahan et al., 2013), per coordinate; L2 is the ``l2`` term."""

    alpha: float | Schedule = 0.05
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    clip: float | None = None
    kind: ClassVar[str] = "ftrl"

    def __post_init__(self) -> None:
        _check_lr(self, "alpha")
        if is_schedule(self.alpha) and not self.alpha.floor > 0.0:
            raise BadRequestError(
                "ftrl.alpha: FTRL divides by its alpha, so its schedule must stay above 0 "
                f"(this one reaches {self.alpha.floor}: give cosine a min_lr > 0; a step "
                "decay reaches 0)"
            )
        for field in ("beta", "l1", "l2"):
            set_field(self, field, check_number(self.kind, field, getattr(self, field), lo=0.0))
        _check_common(self, weight_decay=False)

    def spec(self) -> dict[str, Any]:
        return _spec(self)

    def state_widths(self, dim: int) -> dict[str, int]:
        return {"z": dim, "n": dim}

    def init_state(self, n: int, dim: int, dtype: npt.DTypeLike) -> State:
        return _full_state(n, self.state_widths(dim), dtype, 0.0)

    def apply(self, param: Array, grad: Array, state: State) -> None:
        g = _effective_grad(grad, param, self.clip, 0.0)
        z, n = state["z"], state["n"]
        alpha = _rate(self, self.alpha)
        g2 = g * g
        sigma = (np.sqrt(n + g2) - np.sqrt(n)) / alpha
        z += g - sigma * param
        n += g2
        denom = (self.beta + np.sqrt(n)) / alpha + self.l2
        shrunk = z - np.sign(z) * self.l1
        param[...] = np.where(np.abs(z) <= self.l1, 0.0, -shrunk / denom)
        # A NaN (an overflow: inf - inf) is stored as the one quiet NaN, whatever sign
        # the arithmetic gave it, as the compiled update stores it (zps/store/_kernel_update.h).
        for a in (z, param):
            bad = np.isnan(a)
            if bad.any():
                a[bad] = np.nan


Optimizer = SGD | Momentum | Adagrad | Adam | FTRL
_OPTIMIZERS: dict[str, type[Optimizer]] = {c.kind: c for c in (SGD, Momentum, Adagrad, Adam, FTRL)}


#: Each kind's field annotations, resolved once (the wire parser checks types by them).
_HINTS: dict[str, dict[str, Any]] = {k: typing.get_type_hints(c) for k, c in _OPTIMIZERS.items()}


def rate_field(opt: Optimizer | type[Optimizer]) -> str:
    """The name of the field a schedule may drive: ``lr`` (FTRL: ``alpha``)."""
    return "alpha" if opt.kind == FTRL.kind else "lr"


def at_step(opt: Optimizer, step: int) -> Optimizer:
    """The optimizer to apply at step ``step``: ``opt`` itself with a fixed rate, else a
    copy with its schedule's rate at that step (which may be 0: see
    :mod:`zps.optim.schedules`)."""
    field = rate_field(opt)
    value = getattr(opt, field)
    if not is_schedule(value):
        return opt
    out = copy.copy(opt)
    set_field(out, field, value.value(step))
    return out


def optimizer_from_spec(spec: object) -> Optimizer:
    """Parse the wire form produced by ``Optimizer.spec()``: every field present, nothing
    else, each of its type (the rate a number or a schedule's wire form)."""
    if not isinstance(spec, Mapping):
        raise BadRequestError(f"optimizer must be a map, got {type(spec).__name__}")
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind not in _OPTIMIZERS:
        raise BadRequestError(f"optimizer.kind must be one of {sorted(_OPTIMIZERS)}, got {kind!r}")
    cls = _OPTIMIZERS[kind]
    field = rate_field(cls)
    names = [f.name for f in fields(cls)]
    hints = _HINTS[kind]
    for key in spec:
        if key != "kind" and key not in names:
            raise BadRequestError(f"optimizer: unknown field {key!r} for kind {kind!r}")
    kwargs: dict[str, object] = {}
    for name in names:
        if name not in spec:
            raise BadRequestError(f"optimizer.{name} is missing (kind {kind!r})")
        value = spec[name]
        if name != field:
            check_type(kind, name, value, hints[name])
        elif isinstance(value, Mapping):
            value = schedule_from_spec(value)
        else:
            check_type(kind, name, value, float)
        kwargs[name] = value
    return cls(**kwargs)  # type: ignore[arg-type]
