"""Optimizers against straightforward per-element reference implementations."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from zps.errors import BadRequestError
from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum, Optimizer, optimizer_from_spec

Scalar = dict[str, float]


def ref_prepare(g: float, p: float, clip: float | None, wd: float) -> float:
    if clip is not None:
        g = min(max(g, -clip), clip)
    return g + wd * p


def ref_sgd(o: SGD, p: float, g: float, s: Scalar) -> float:
    g = ref_prepare(g, p, o.clip, o.weight_decay)
    return p - o.lr * g


def ref_momentum(o: Momentum, p: float, g: float, s: Scalar) -> float:
    g = ref_prepare(g, p, o.clip, o.weight_decay)
    s["velocity"] = o.momentum * s.get("velocity", 0.0) + g
    step = g + o.momentum * s["velocity"] if o.nesterov else s["velocity"]
    return p - o.lr * step


def ref_adagrad(o: Adagrad, p: float, g: float, s: Scalar) -> float:
    g = ref_prepare(g, p, o.clip, o.weight_decay)
    s["accumulator"] = s.get("accumulator", o.initial_accumulator) + g * g
    return p - o.lr * g / (math.sqrt(s["accumulator"]) + o.eps)


def ref_adam(o: Adam, p: float, g: float, s: Scalar) -> float:
    g = ref_prepare(g, p, o.clip, o.weight_decay)
    t = s["step"] = s.get("step", 0.0) + 1
    m = s["m"] = o.beta1 * s.get("m", 0.0) + (1 - o.beta1) * g
    v = s["v"] = o.beta2 * s.get("v", 0.0) + (1 - o.beta2) * g * g
    m_hat = m / (1 - math.pow(o.beta1, t))
    v_hat = v / (1 - math.pow(o.beta2, t))
    return p - o.lr * m_hat / (math.sqrt(v_hat) + o.eps)


def ref_ftrl(o: FTRL, p: float, g: float, s: Scalar) -> float:
    g = ref_prepare(g, p, o.clip, 0.0)
    z, n = s.get("z", 0.0), s.get("n", 0.0)
    sigma = (math.sqrt(n + g * g) - math.sqrt(n)) / o.alpha
    z += g - sigma * p
    n += g * g
    s["z"], s["n"] = z, n
    if abs(z) <= o.l1:
        return 0.0
    sign = 1.0 if z > 0 else -1.0
    return -(z - sign * o.l1) / ((o.beta + math.sqrt(n)) / o.alpha + o.l2)


REFERENCES: dict[type, Callable[..., float]] = {
    SGD: ref_sgd,
    Momentum: ref_momentum,
    Adagrad: ref_adagrad,
    Adam: ref_adam,
    FTRL: ref_ftrl,
}

CASES: list[Optimizer] = [
    SGD(lr=0.1),
    SGD(lr=0.05, clip=0.3, weight_decay=0.01),
    Momentum(lr=0.05, momentum=0.9),
    Momentum(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
    Adagrad(lr=0.2, initial_accumulator=0.1),
    Adagrad(lr=0.2, initial_accumulator=0.0, clip=0.5),
    Adam(lr=0.01),
    Adam(lr=0.05, beta1=0.5, beta2=0.9, clip=1.0, weight_decay=0.01),
    FTRL(alpha=0.1, beta=1.0),
    FTRL(alpha=0.5, beta=0.5, l1=0.3, l2=0.2, clip=2.0),
]


def run_reference(opt: Optimizer, p0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    ref = REFERENCES[type(opt)]
    p = p0.astype(np.float64).copy()
    states: dict[tuple[int, ...], Scalar] = {}
    for g in grads:
        for idx in np.ndindex(*p.shape):  # the reference is deliberately per element
            p[idx] = ref(opt, float(p[idx]), float(g[idx]), states.setdefault(idx, {}))
    return p


def run_vectorised(opt: Optimizer, p0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    n, dim = p0.shape
    p = p0.copy()
    state = opt.init_state(n, dim, p.dtype)
    assert {k: a.shape for k, a in state.items()} == {
        k: (n, w) for k, w in opt.state_widths(dim).items()
    }
    for g in grads:
        g_before = g.copy()
        opt.apply(p, g.astype(p.dtype), state)
        assert np.array_equal(g, g_before)
    return p


@pytest.mark.parametrize("opt", CASES, ids=repr)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_matches_reference_over_several_steps(opt: Optimizer, dtype: str) -> None:
    rng = np.random.default_rng(3)
    p0 = rng.normal(0, 1, (4, 5)).astype(dtype)
    grads = [rng.normal(0, 1, (4, 5)) for _ in range(6)]
    got = run_vectorised(opt, p0, grads)
    want = run_reference(opt, p0, grads)
    assert got.dtype == np.dtype(dtype)
    if dtype == "float64":
        rtol = 0.0 if isinstance(opt, SGD) and opt.clip is None and not opt.weight_decay else 1e-12
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-12)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_sgd_is_exact_in_float64() -> None:
    p = np.array([[1.0, -2.0, 0.25]])
    g = np.array([[0.5, 0.125, -3.0]])
    SGD(lr=0.1).apply(p, g, {})
    assert p.tolist() == [[1.0 - 0.1 * 0.5, -2.0 - 0.1 * 0.125, 0.25 - 0.1 * -3.0]]


def test_adam_step_count_is_per_row() -> None:
    """A row updated for the first time gets a full bias correction, however old others are."""
    opt = Adam(lr=0.1)
    state = opt.init_state(2, 3, np.float64)
    p = np.zeros((2, 3))
    for _ in range(5):
        rows = p[:1].copy()
        st = {k: a[:1].copy() for k, a in state.items()}
        opt.apply(rows, np.ones((1, 3)), st)
        p[:1] = rows
        for k in state:
            state[k][:1] = st[k]
    rows, st = p[1:].copy(), {k: a[1:].copy() for k, a in state.items()}
    opt.apply(rows, np.ones((1, 3)), st)
    # First Adam step with a constant gradient moves by lr (up to eps).
    np.testing.assert_allclose(rows, -0.1, rtol=1e-6)
    assert state["step"][:, 0].tolist() == [5.0, 0.0] and st["step"][0, 0] == 1.0


def test_ftrl_l1_gives_exact_zeros() -> None:
    opt = FTRL(alpha=0.1, l1=10.0)
    p = np.ones((1, 4))
    state = opt.init_state(1, 4, np.float64)
    opt.apply(p, np.full((1, 4), 0.5), state)
    assert (p == 0.0).all()


@pytest.mark.parametrize("opt", CASES, ids=repr)
def test_spec_round_trip(opt: Optimizer) -> None:
    assert optimizer_from_spec(opt.spec()) == opt


def good(kind: str, **change: Any) -> dict[str, Any]:
    defaults: dict[str, Optimizer] = {
        "sgd": SGD(),
        "momentum": Momentum(),
        "adagrad": Adagrad(),
        "adam": Adam(),
        "ftrl": FTRL(),
    }
    spec = defaults[kind].spec()
    spec.update(change)
    return {k: v for k, v in spec.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"kind": "rmsprop", "lr": 0.1}, "kind"),
        ([1, 2], "optimizer"),
        (good("sgd", lr=0.0), "lr"),
        (good("sgd", lr=-1.0), "lr"),
        (good("sgd", lr=float("inf")), "lr"),
        (good("sgd", lr="0.1"), "lr"),
        (good("sgd", lr=_DROP), "lr"),
        (good("sgd", momentum=0.9), "momentum"),
        (good("sgd", clip=0.0), "clip"),
        (good("sgd", clip=float("nan")), "clip"),
        (good("sgd", weight_decay=-0.1), "weight_decay"),
        (good("momentum", momentum=1.0), "momentum"),
        (good("momentum", nesterov=1), "nesterov"),
        (good("momentum", momentum=0.0, nesterov=True), "nesterov"),
        (good("adagrad", initial_accumulator=-1.0), "initial_accumulator"),
        (good("adagrad", eps=0.0), "eps"),
        (good("adam", beta1=1.0), "beta1"),
        (good("adam", beta2=-0.1), "beta2"),
        (good("adam", eps=-1e-8), "eps"),
        (good("ftrl", alpha=0.0), "alpha"),
        (good("ftrl", beta=-1.0), "beta"),
        (good("ftrl", l1=-1.0), "l1"),
        (good("ftrl", l2=float("inf")), "l2"),
        (good("ftrl", weight_decay=0.1), "weight_decay"),
    ],
)
def test_bad_specs_name_the_field(spec: object, field: str) -> None:
    with pytest.raises(BadRequestError, match=field):
        optimizer_from_spec(spec)


def test_clip_none_and_int_hyperparameters_from_the_wire() -> None:
    opt = optimizer_from_spec({"kind": "sgd", "lr": 1, "clip": None, "weight_decay": 0})
    assert opt == SGD(lr=1.0) and isinstance(opt.spec()["lr"], float)
