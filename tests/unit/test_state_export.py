"""Optimizer state in and out of tables, and in the export format: copies of the state
columns, sets that carry them (checked, all or nothing), and an export's state files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from zps.errors import BadRequestError, ShapeMismatchError
from zps.init import Uniform, Zeros
from zps.model.format import Export, ExportWriter, dense_state_size, state_offsets
from zps.optim import Adam
from zps.store import DenseSpec, DenseTensor, EmbeddingSpec, EmbeddingTable


def _emb() -> EmbeddingTable:
    return EmbeddingTable(EmbeddingSpec("e", 3, "float32", Uniform(-0.1, 0.1), Adam(), 5))


def test_set_rows_with_state_continues_as_the_table_it_came_from() -> None:
    src, dst = _emb(), _emb()
    ids = np.array([5, 9, 2], dtype=np.int64)
    rng = np.random.default_rng(0)
    for _ in range(3):
        src.push(ids[:2], rng.normal(size=(2, 3)).astype(np.float32))
    src.push(ids, rng.normal(size=(3, 3)).astype(np.float32))
    got_ids, rows = src.copy_values()
    dst.set_rows(got_ids, rows, src.copy_state())
    g = rng.normal(size=(3, 3)).astype(np.float32)
    src.push(ids, g)
    dst.push(ids, g)
    assert src.pull(ids).tobytes() == dst.pull(ids).tobytes()
    assert src.checksum() == dst.checksum()


def test_set_rows_refuses_bad_state_and_changes_nothing() -> None:
    t = _emb()
    ids = np.array([1, 2], dtype=np.int64)
    rows = np.ones((2, 3), dtype=np.float32)
    state = {"m": np.zeros((2, 3)), "v": np.zeros((2, 3)), "step": np.ones((2, 1))}
    with pytest.raises(
        BadRequestError, match=r"optimizer state \['m'\] given; .*\['m', 'step', 'v'\]"
    ):
        t.set_rows(ids, rows, {"m": state["m"]})
    with pytest.raises(
        ShapeMismatchError, match=r"state 'step' of shape \(2, 3\), expected \(2, 1\)"
    ):
        t.set_rows(ids, rows, {**state, "step": np.ones((2, 3))})
    with pytest.raises(BadRequestError, match="state 'v' has NaN"):
        t.set_rows(ids, rows, {**state, "v": np.full((2, 3), np.nan)})
    assert len(t) == 0


def test_set_chunk_with_state() -> None:
    spec = DenseSpec("w", (10,), "float32", Zeros(), Adam(), 1, 4)
    src, dst = DenseTensor(spec), DenseTensor(spec)
    for c in range(spec.n_chunks):
        src.push(c, np.ones(len(src.pull(c)), dtype=np.float32))
    states = src.copy_state()
    for c, values in src.copy_values().items():
        dst.set_chunk(c, values, states[c])
    assert dst.copy_state()[2]["step"].tolist() == [1.0]
    for c in range(spec.n_chunks):
        g = np.full(len(src.pull(c)), 0.5, dtype=np.float32)
        src.push(c, g)
        dst.push(c, g)
        assert src.pull(c).tobytes() == dst.pull(c).tobytes()
    with pytest.raises(ShapeMismatchError, match="state 'm'"):
        dst.set_chunk(0, np.zeros(4), {"m": np.zeros(3), "v": np.zeros(4), "step": np.zeros(1)})


def test_the_format_keeps_state_columns(tmp_path: Path) -> None:
    emb = EmbeddingSpec("e", 3, "float32", Zeros(), Adam(), 0)
    dense = DenseSpec("w", (10,), "float32", Zeros(), Adam(), 0, 4)  # chunks of 4, 4, 2
    assert state_offsets(dense, ["m", "step"]) == {"m": [0, 4, 8, 10], "step": [0, 1, 2, 3]}
    assert dense_state_size(dense, "v") == 10
    w = ExportWriter(tmp_path / "x", {"kind": "test"})
    sink = w.embedding(emb, 2, state=True)
    columns = {"m": np.ones((2, 3)), "v": np.full((2, 3), 2.0), "step": np.full((2, 1), 7.0)}
    with pytest.raises(BadRequestError, match="state columns"):
        sink.write([1, 2], np.zeros((2, 3)))
    sink.write([1, 2], np.zeros((2, 3)), columns)
    sink.close()
    values = w.dense(dense)
    for a in w.dense_state(dense).values():
        a[:] = np.arange(a.shape[0])
        a.flush()
    values.flush()
    w.finish({0: {"lsn": 1, "epoch": 1}})
    x = Export(tmp_path / "x")
    got = x.state("e")
    assert got is not None and np.asarray(got["step"]).tolist() == [[7.0], [7.0]]
    dense_state = x.state("w")
    assert dense_state is not None and np.asarray(dense_state["step"]).tolist() == [0, 1, 2]
    np.save(tmp_path / "x" / x.manifest_entry("e")["files"]["state.v"], np.zeros((3, 3), "float32"))
    with pytest.raises(BadRequestError, match=r"state 'v' of shape \(3, 3\)"):
        x.state("e")


def test_an_export_without_state_says_so(tmp_path: Path) -> None:
    w = ExportWriter(tmp_path / "x", {"kind": "test"})
    sink = w.embedding(EmbeddingSpec("e", 3, "float32", Zeros(), Adam(), 0), 1)
    sink.write([4], np.zeros((1, 3)))
    sink.close()
    w.finish({})
    assert Export(tmp_path / "x").state("e") is None
