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
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from zps.errors import BadRequestError
from zps.init import check_number, parse_record, set_field

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "Adam",
    "Momentum",
    "Optimizer",
    "optimizer_from_spec",
]

Array = npt.NDArray[np.floating[Any]]
State = dict[str, Array]


def _spec(opt: Any) -> dict[str, Any]:
    """The wire form of an optimizer: its kind, then every field in order."""
    return {"kind": opt.kind, **{f.name: getattr(opt, f.name) for f in fields(opt)}}


def _check_common(obj: Any, *, weight_decay: bool = True) -> None:
    """Validate and normalise ``clip`` (and ``weight_decay``)."""
    if obj.clip is not None:
        set_field(obj, "clip", check_number(obj.kind, "clip", obj.clip, lo=0.0, lo_open=True))
    if weight_decay:
        wd = check_number(obj.kind, "weight_decay", obj.weight_decay, lo=0.0)
        set_field(obj, "weight_decay", wd)


def _check_lr(obj: Any, field: str = "lr") -> None:
    set_field(obj, field, check_number(obj.kind, field, getattr(obj, field), lo=0.0, lo_open=True))


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

    lr: float = 0.01
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
        param -= self.lr * g


@dataclass(frozen=True)
class Momentum:
    """Heavy-ball or Nesterov momentum, PyTorch convention (``v = m v + g``)."""

    lr: float = 0.01
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
        if self.nesterov:
            param -= self.lr * (g + self.momentum * v)
        else:
            param -= self.lr * v


@dataclass(frozen=True)
class Adagrad:
    """``a += g^2; p -= lr * g / (sqrt(a) + eps)``."""

    lr: float = 0.01
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
        u = np.multiply(g, self.lr)
        u /= t
        param -= u


@dataclass(frozen=True)
class Adam:
    """Adam with a per-row step count, so lazy sparse updates bias-correct correctly."""

    lr: float = 0.001
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
        param -= self.lr * (m / bc1) / (np.sqrt(v / bc2) + self.eps)


@dataclass(frozen=True)
class FTRL:
    """FTRL-Proximal (McMahan et al., 2013), per coordinate; L2 is the ``l2`` term."""

    alpha: float = 0.05
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    clip: float | None = None
    kind: ClassVar[str] = "ftrl"

    def __post_init__(self) -> None:
        _check_lr(self, "alpha")
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
        g2 = g * g
        sigma = (np.sqrt(n + g2) - np.sqrt(n)) / self.alpha
        z += g - sigma * param
        n += g2
        denom = (self.beta + np.sqrt(n)) / self.alpha + self.l2
        shrunk = z - np.sign(z) * self.l1
        param[...] = np.where(np.abs(z) <= self.l1, 0.0, -shrunk / denom)


Optimizer = SGD | Momentum | Adagrad | Adam | FTRL
_OPTIMIZERS: dict[str, type[Optimizer]] = {c.kind: c for c in (SGD, Momentum, Adagrad, Adam, FTRL)}


def optimizer_from_spec(spec: object) -> Optimizer:
    """Parse the wire form produced by ``Optimizer.spec()``."""
    return parse_record(spec, "optimizer", _OPTIMIZERS)
