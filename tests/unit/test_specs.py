"""Table specs: wire round trip, chunking and strict validation."""

from __future__ import annotations

from typing import Any

import pytest

from zps.errors import BadRequestError
from zps.init import Normal, Uniform, Zeros
from zps.optim import SGD, Adam
from zps.protocol.specs import DenseSpec, EmbeddingSpec, spec_from_wire

DENSE = DenseSpec("w", (3, 5), "float32", Zeros(), SGD(lr=0.1), 7, 4)
EMB = EmbeddingSpec("emb", 16, "float64", Uniform(-0.1, 0.1), Adam(lr=0.01), 2**63 - 1)


@pytest.mark.parametrize("spec", [DENSE, EMB], ids=["dense", "embedding"])
def test_wire_round_trip(spec: DenseSpec | EmbeddingSpec) -> None:
    wire = spec.to_wire()
    assert spec_from_wire(wire) == spec
    assert spec_from_wire(spec_from_wire(wire).to_wire()) == spec


def test_wire_form_is_plain_data() -> None:
    def plain(x: object) -> bool:
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return x is None or isinstance(x, str | int | float | bool)

    assert plain(DENSE.to_wire()) and plain(EMB.to_wire())
    assert DENSE.to_wire()["kind"] == "dense" and EMB.to_wire()["kind"] == "embedding"


def test_equality_is_field_equality() -> None:
    assert DenseSpec("w", (3, 5), "float32", Zeros(), SGD(lr=0.1), 7, 4) == DENSE
    assert DenseSpec("w", [3, 5], "float32", Zeros(), SGD(lr=0.1), 7, 4) == DENSE  # type: ignore[arg-type]
    assert DenseSpec("w", (3, 5), "float32", Zeros(), SGD(lr=0.2), 7, 4) != DENSE
    assert EmbeddingSpec("emb", 16, "float64", Normal(), Adam(lr=0.01), 2**63 - 1) != EMB


def test_chunks() -> None:
    assert (DENSE.size, DENSE.n_chunks) == (15, 4)
    assert [DENSE.chunk_range(i) for i in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 15)]
    for bad in (-1, 4, 1.0):
        with pytest.raises(BadRequestError, match="chunk"):
            DENSE.chunk_range(bad)  # type: ignore[arg-type]
    scalar = DenseSpec("s", (), "float64", Zeros(), SGD(), 0, 10)
    assert (scalar.size, scalar.n_chunks, scalar.chunk_range(0)) == (1, 1, (0, 1))
    empty = DenseSpec("e", (0, 3), "float64", Zeros(), SGD(), 0, 10)
    assert (empty.size, empty.n_chunks) == (0, 0)


def dense(**change: Any) -> dict[str, Any]:
    wire = DENSE.to_wire()
    wire.update(change)
    return wire


def emb(**change: Any) -> dict[str, Any]:
    wire = EMB.to_wire()
    wire.update(change)
    return wire


def without(wire: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in wire.items() if k != key}


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ("w", "table spec"),
        (dense(kind="sparse"), "kind"),
        (without(dense(), "kind"), "kind"),
        (dense(name=""), "name"),
        (dense(name=5), "name"),
        (dense(name="x" * 201), "name"),
        (dense(shape=[3, -1]), "shape"),
        (dense(shape=[3.0]), "shape"),
        (dense(shape=[True]), "shape"),
        (dense(shape="3"), "shape"),
        (dense(shape=[2**21, 2**20]), "shape"),
        (dense(dtype="float16"), "dtype"),
        (dense(dtype="int32"), "dtype"),
        (dense(chunk_elems=0), "chunk_elems"),
        (dense(chunk_elems=1.5), "chunk_elems"),
        (dense(seed=-1), "seed"),
        (dense(seed=2**63), "seed"),
        (dense(seed="1"), "seed"),
        (dense(dim=4), "dim"),
        (without(dense(), "chunk_elems"), "chunk_elems"),
        (without(dense(), "init"), "init"),
        (dense(init={"kind": "uniform", "low": 1.0, "high": 0.0}), "low"),
        (dense(init="zeros"), "init"),
        (dense(optimizer={"kind": "sgd", "lr": -1.0, "clip": None, "weight_decay": 0.0}), "lr"),
        (without(emb(), "optimizer"), "optimizer"),
        (emb(dim=0), "dim"),
        (emb(dim=65537), "dim"),
        (emb(dim=True), "dim"),
        (emb(shape=[3]), "shape"),
        (emb(chunk_elems=3), "chunk_elems"),
    ],
)
def test_bad_wire_specs_name_the_field(wire: object, field: str) -> None:
    with pytest.raises(BadRequestError, match=field):
        spec_from_wire(wire)


def test_constructors_validate() -> None:
    with pytest.raises(BadRequestError, match="dim"):
        EmbeddingSpec("e", 0, "float32", Zeros(), SGD(), 0)
    with pytest.raises(BadRequestError, match="optimizer"):
        EmbeddingSpec("e", 4, "float32", Zeros(), "sgd", 0)  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="init"):
        DenseSpec("d", (4,), "float32", None, SGD(), 0, 4)  # type: ignore[arg-type]


def test_largest_allowed_values() -> None:
    big = spec_from_wire(dense(shape=[2**20, 2**20], chunk_elems=2**20, name="x" * 200))
    assert isinstance(big, DenseSpec) and big.n_chunks == 2**20
    assert isinstance(spec_from_wire(emb(dim=65536, seed=0)), EmbeddingSpec)
