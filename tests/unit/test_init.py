"""Initialisers: determinism, distributions, and strict spec parsing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zps.errors import BadRequestError
from zps.init import Constant, Normal, Uniform, Zeros, generate, init_from_spec

ALL = [Zeros(), Constant(0.5), Uniform(-0.1, 0.3), Normal(1.0, 2.0)]


@pytest.mark.parametrize("init", ALL, ids=lambda i: i.kind)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rows_do_not_depend_on_batch_or_order(init: object, dtype: str) -> None:
    keys = np.array([5, -3, 2**62, 0, 77, -(2**63) + 1], dtype=np.int64)
    whole = generate(init, 42, keys, 7, dtype)  # type: ignore[arg-type]
    assert whole.shape == (6, 7) and whole.dtype == np.dtype(dtype)
    perm = np.array([3, 1, 5, 0, 4, 2])
    assert np.array_equal(generate(init, 42, keys[perm], 7, dtype), whole[perm])  # type: ignore[arg-type]
    for i, k in enumerate(keys):
        assert np.array_equal(generate(init, 42, np.array([k]), 7, dtype)[0], whole[i])  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 500), st.lists(st.integers(1, 100), min_size=1, max_size=8))
def test_dense_values_do_not_depend_on_chunking(start: int, sizes: list[int]) -> None:
    init = Normal(0.0, 1.0)
    stop = start + sum(sizes)
    whole = generate(init, 9, np.arange(start, stop), 1, "float64").ravel()
    bounds = np.cumsum([start, *sizes])
    parts = [
        generate(init, 9, np.arange(a, b), 1, "float64").ravel()
        for a, b in itertools.pairwise(bounds)
    ]
    assert np.array_equal(np.concatenate(parts), whole)


def test_column_j_depends_only_on_j() -> None:
    narrow = generate(Uniform(), 3, np.arange(10), 4, "float64")
    wide = generate(Uniform(), 3, np.arange(10), 9, "float64")
    assert np.array_equal(wide[:, :4], narrow)


def test_seed_and_key_change_values() -> None:
    a = generate(Uniform(), 1, np.arange(100), 8, "float64")
    b = generate(Uniform(), 2, np.arange(100), 8, "float64")
    assert not np.array_equal(a, b)
    assert np.unique(a).size == a.size


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_uniform_in_range_and_spread(dtype: str) -> None:
    x = generate(Uniform(-0.5, 0.25), 7, np.arange(100_000), 1, dtype).ravel()
    assert x.min() >= -0.5 and x.max() < 0.25
    assert abs(float(x.mean()) - (-0.125)) < 0.005
    assert abs(float(x.std()) - 0.75 / np.sqrt(12)) < 0.005


def test_normal_moments() -> None:
    x = generate(Normal(2.0, 3.0), 11, np.arange(100_000), 1, "float64").ravel()
    assert np.isfinite(x).all()
    assert abs(float(x.mean()) - 2.0) < 0.05
    assert abs(float(x.std()) - 3.0) < 0.05
    # Roughly Gaussian tails, not just the first two moments.
    assert 0.30 < float(np.mean(np.abs(x - 2.0) > 3.0)) < 0.335


def test_zeros_and_constant() -> None:
    assert not generate(Zeros(), 0, np.arange(3), 2, "float32").any()
    assert (generate(Constant(1.5), 0, np.arange(3), 2, "float64") == 1.5).all()
    assert generate(Zeros(), 0, np.array([], dtype=np.int64), 2, "float32").shape == (0, 2)


@pytest.mark.parametrize("init", ALL, ids=lambda i: i.kind)
def test_spec_round_trip(init: object) -> None:
    spec = init.spec()  # type: ignore[attr-defined]
    assert init_from_spec(spec) == init
    assert init_from_spec(dict(spec)).spec() == spec


def test_ints_are_accepted_and_normalised() -> None:
    init = init_from_spec({"kind": "uniform", "low": -1, "high": 1})
    assert init == Uniform(-1.0, 1.0) and isinstance(init.spec()["low"], float)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"kind": "gaussian"}, "kind"),
        ({"low": 0.0}, "kind"),
        ("uniform", "init"),
        ({"kind": "uniform", "low": 0.0}, "high"),
        ({"kind": "uniform", "low": 0.0, "high": 1.0, "mid": 0.5}, "mid"),
        ({"kind": "uniform", "low": "0", "high": 1.0}, "low"),
        ({"kind": "uniform", "low": 1.0, "high": 1.0}, "low"),
        ({"kind": "uniform", "low": float("-inf"), "high": 1.0}, "low"),
        ({"kind": "normal", "mean": 0.0, "std": -1.0}, "std"),
        ({"kind": "normal", "mean": float("nan"), "std": 1.0}, "mean"),
        ({"kind": "constant", "value": True}, "value"),
        ({"kind": "constant"}, "value"),
        ({"kind": "zeros", "value": 0.0}, "value"),
    ],
)
def test_bad_specs_name_the_field(spec: object, field: str) -> None:
    with pytest.raises(BadRequestError, match=field):
        init_from_spec(spec)


def test_constructor_validates_too() -> None:
    with pytest.raises(BadRequestError, match="std"):
        Normal(0.0, -0.1)
    with pytest.raises(BadRequestError, match="low"):
        Uniform(0.2, 0.1)
