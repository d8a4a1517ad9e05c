"""Learning-rate schedules: values at given steps, the wire round trip, bad input named,
and optimizers that take a schedule for their rate."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from zps.errors import BadRequestError
from zps.init import Zeros
from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum, at_step, optimizer_from_spec
from zps.optim.schedules import (
    Constant,
    Cosine,
    LinearWarmup,
    Schedule,
    Step,
    cos_pi,
    schedule_from_spec,
)
from zps.protocol.specs import EmbeddingSpec, spec_from_wire

SCHEDULES: list[Schedule] = [
    Constant(0.1),
    Step(1.0, step_size=10, gamma=0.5),
    Cosine(1e-3, total_steps=10_000),
    Cosine(0.5, total_steps=7, min_lr=0.01),
    LinearWarmup(Cosine(1e-3, 10_000), warmup_steps=500),
    LinearWarmup(Step(0.2, 3), warmup_steps=4),
    LinearWarmup(LinearWarmup(Constant(1.0), 2), warmup_steps=3),
]


def test_constant_and_step() -> None:
    assert [Constant(0.1).value(s) for s in (0, 1, 10**9)] == [0.1] * 3
    s = Step(1.0, step_size=10, gamma=0.5)
    assert [s.value(t) for t in (0, 9, 10, 19, 20, 35)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.125]
    assert Step(0.3, 1, gamma=0.1).value(3) == 0.3 * (0.1 * 0.1 * 0.1)


def test_cosine_follows_the_half_cosine_then_stays_at_min_lr() -> None:
    c = Cosine(1.0, total_steps=100, min_lr=0.1)
    assert c.value(0) == 1.0
    assert c.value(50) == pytest.approx(0.55, abs=1e-15)
    assert c.value(100) == c.value(10**6) == 0.1
    for step in range(0, 100, 7):
        ref = 0.1 + 0.9 * (1 + math.cos(math.pi * step / 100)) / 2
        assert c.value(step) == pytest.approx(ref, rel=1e-15, abs=1e-16)
    values = [c.value(s) for s in range(101)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_cos_pi_is_within_1e_15_of_the_platform_cosine() -> None:
    xs = np.linspace(0.0, 1.0, 10_001)
    for x in xs.tolist():
        ref = math.cos(math.pi * x)
        assert abs(cos_pi(x) - ref) <= 1e-15, x
    assert cos_pi(0.0) == 1.0 and cos_pi(1.0) == -1.0 and cos_pi(0.5) == 0.0
    with pytest.raises(ValueError, match="x in"):
        cos_pi(1.5)


def test_linear_warmup_ramps_to_the_first_rate_then_runs_the_schedule() -> None:
    w = LinearWarmup(Step(0.2, step_size=3, gamma=0.5), warmup_steps=4)
    assert [w.value(s) for s in range(4)] == [0.05, 0.1, 0.2 * 3 / 4, 0.2]
    assert [w.value(s) for s in range(4, 11)] == [0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.05]
    warm_cos = LinearWarmup(Cosine(1e-3, total_steps=10_000), warmup_steps=500)
    assert warm_cos.value(499) == 1e-3
    assert warm_cos.value(500 + 5_000) == pytest.approx(5e-4, rel=1e-12)
    assert warm_cos.peak == 1e-3


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_wire_round_trip(schedule: Schedule) -> None:
    assert schedule_from_spec(schedule.spec()) == schedule
    for opt in (SGD(lr=schedule), Momentum(lr=schedule), Adagrad(lr=schedule), Adam(lr=schedule)):
        assert optimizer_from_spec(opt.spec()) == opt
    if schedule.floor > 0:
        ftrl = FTRL(alpha=schedule, l1=0.1)
        assert optimizer_from_spec(ftrl.spec()) == ftrl
    else:  # FTRL divides by its alpha
        with pytest.raises(BadRequestError, match=r"ftrl\.alpha: FTRL divides by its alpha"):
            FTRL(alpha=schedule)
    spec = EmbeddingSpec("e", 4, "float32", Zeros(), Adam(lr=schedule), 1)
    assert spec_from_wire(spec.to_wire()) == spec


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: Constant(0.0), "constant.lr must be > 0"),
        (lambda: Constant("x"), "constant.lr must be a number"),
        (lambda: Step(1.0, step_size=0), "step.step_size must be an integer in [1"),
        (lambda: Step(1.0, step_size=2.5), "step.step_size must be an integer"),
        (lambda: Step(1.0, 2, gamma=1.5), "step.gamma must be <= 1.0"),
        (lambda: Cosine(1.0, total_steps=-1), "cosine.total_steps"),
        (lambda: Cosine(0.1, 10, min_lr=0.2), "cosine.min_lr (0.2) must not exceed"),
        (lambda: Cosine(math.inf, 10), "cosine.lr must be finite"),
        (lambda: LinearWarmup(0.1, 10), "linear_warmup.schedule must be"),  # type: ignore[arg-type]
        (lambda: LinearWarmup(Constant(0.1), 0), "linear_warmup.warmup_steps"),
    ],
)
def test_bad_input_is_named(make: Any, needle: str) -> None:
    with pytest.raises(BadRequestError) as e:
        make()
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("wire", "needle"),
    [
        ({"kind": "exp", "lr": 1.0}, "schedule.kind must be one of"),
        ({"kind": "step", "lr": 1.0, "step_size": 2}, "step.gamma is missing"),
        ({"kind": "constant", "lr": 1.0, "x": 1}, "unknown field 'x'"),
        (
            {"kind": "step", "lr": 1.0, "step_size": 2.0, "gamma": 0.5},
            "step.step_size must be an integer",
        ),
        ({"kind": "constant", "lr": True}, "constant.lr must be a number"),
        ([1], "schedule must be a map"),
    ],
)
def test_bad_wire_forms_are_named(wire: Any, needle: str) -> None:
    with pytest.raises(BadRequestError) as e:
        schedule_from_spec(wire)
    assert needle in str(e.value)


def test_nesting_on_the_wire_is_bounded() -> None:
    wire: dict[str, Any] = Constant(1.0).spec()
    for _ in range(6):
        wire = {"kind": "linear_warmup", "schedule": wire, "warmup_steps": 1}
    with pytest.raises(BadRequestError, match="nests more than"):
        schedule_from_spec(wire)


def test_an_optimizer_with_a_bad_schedule_on_the_wire_names_it() -> None:
    wire = {**Adam().spec(), "lr": {"kind": "cosine", "lr": 1.0}}
    with pytest.raises(BadRequestError, match=r"cosine\.total_steps is missing"):
        optimizer_from_spec(wire)
    wire = {**Adam(lr=Constant(0.1)).spec(), "beta1": "x"}
    with pytest.raises(BadRequestError, match="beta1 must be a number"):
        optimizer_from_spec(wire)


def test_floor_is_the_lowest_rate_a_schedule_reaches() -> None:
    assert Constant(0.1).floor == 0.1 and Step(1.0, 2, gamma=1.0).floor == 1.0
    assert Step(1.0, 1, gamma=0.5).floor == 0.0 and Step(1.0, 1, gamma=0.5).value(2000) == 0.0
    assert Cosine(1.0, 10, min_lr=0.2).floor == 0.2
    assert LinearWarmup(Constant(1.0), 4).floor == 0.25
    for schedule in SCHEDULES:
        values = [schedule.value(s) for s in range(0, 30_000, 7)]
        assert schedule.floor <= min(values) and max(values) <= schedule.peak


def test_at_step_fixes_the_rate_and_apply_needs_it() -> None:
    opt = Adam(lr=Step(0.1, step_size=2), beta1=0.8)
    assert at_step(opt, 3) == Adam(lr=0.1 * 0.1, beta1=0.8)
    assert at_step(Adam(lr=0.1), 5) == Adam(lr=0.1)
    assert at_step(FTRL(alpha=Constant(0.3)), 9).alpha == 0.3
    # A cosine decayed to 0 gives rate 0: a step that moves nothing.
    zero = at_step(SGD(lr=Cosine(1.0, 2)), 2)
    p = np.ones((1, 2))
    zero.apply(p, np.ones((1, 2)), {})
    assert p.tolist() == [[1.0, 1.0]]
    with pytest.raises(BadRequestError, match="at_step"):
        opt.apply(np.ones((1, 2)), np.ones((1, 2)), opt.init_state(1, 2, np.float64))


def test_a_spec_step_is_progress_not_identity() -> None:
    import dataclasses

    spec = EmbeddingSpec("e", 4, "float32", Zeros(), SGD(lr=Step(1.0, 5)), 1)
    later = dataclasses.replace(spec, step=12)
    assert later == spec and "step" not in spec.to_wire() and later.to_wire()["step"] == 12
    assert spec_from_wire(later.to_wire()).step == 12
    with pytest.raises(BadRequestError, match="step must be an integer in"):
        dataclasses.replace(spec, step=-1)
