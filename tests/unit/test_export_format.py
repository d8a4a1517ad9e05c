"""The export format: written in pieces, read back with numpy alone and with Export;
unfinished and foreign directories are refused with errors naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from zps.errors import BadRequestError
from zps.init import Normal
from zps.model.format import Export, ExportWriter, apply_delta
from zps.optim import Adam
from zps.protocol.specs import DenseSpec, EmbeddingSpec

EMB = EmbeddingSpec("user/emb", 3, "float32", Normal(0, 1), Adam(), 4)
DENSE = DenseSpec("w", (2, 5), "float64", Normal(0, 1), Adam(), 4, 4)


def test_round_trip_and_plain_numpy(tmp_path: Path) -> None:
    w = ExportWriter(tmp_path / "x", {"kind": "test"})
    sink = w.embedding(EMB, 5)
    sink.write([9, 3], np.ones((2, 3)))
    sink.write([7, -1, 4], np.arange(9).reshape(3, 3))
    sink.close()
    dense = w.dense(DENSE)
    dense[:] = np.arange(10).reshape(2, 5)
    dense.flush()
    w.finish({0: {"lsn": 5, "epoch": 1}})
    e = Export(tmp_path / "x")
    assert list(e.tables) == ["user/emb", "w"] and e.entry("user/emb").spec == EMB
    assert e.ids("user/emb").tolist() == [9, 3, 7, -1, 4]
    np.testing.assert_array_equal(e.values("user/emb")[2:], np.arange(9).reshape(3, 3))
    np.testing.assert_array_equal(e.values("w"), np.arange(10).reshape(2, 5))
    # without zps: json and numpy
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    (t,) = [t for t in manifest["tables"] if t["name"] == "w"]
    assert np.load(tmp_path / "x" / t["files"]["values"]).dtype == np.float64
    assert manifest["partitions"] == {"0": {"lsn": 5, "epoch": 1}}
    with pytest.raises(BadRequestError, match="already holds an export"):
        ExportWriter(tmp_path / "x", {})
    with pytest.raises(BadRequestError, match=r"'nope' is not in the export"):
        e.values("nope")
    with pytest.raises(BadRequestError, match="dense tensor in this export"):
        e.ids("w")


def test_a_sink_checks_its_rows(tmp_path: Path) -> None:
    w = ExportWriter(tmp_path, {})
    sink = w.embedding(EMB, 2)
    with pytest.raises(BadRequestError, match=r"'user/emb'.*do not fit"):
        sink.write([1, 2, 3], np.zeros((3, 3)))
    sink.write([1], np.zeros((1, 3)))
    with pytest.raises(BadRequestError, match="1 rows arrived, 2 expected"):
        sink.close()
    sink.write([1], np.zeros((1, 3)))
    with pytest.raises(BadRequestError, match="an id appears twice"):
        sink.close()


def test_unfinished_or_foreign_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BadRequestError, match="not a finished zps export"):
        Export(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "zps-export", "version": 9}))
    with pytest.raises(BadRequestError, match="format version 9"):
        Export(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(BadRequestError, match="unreadable"):
        Export(tmp_path)


def test_apply_delta(tmp_path: Path) -> None:
    base = ExportWriter(tmp_path / "base", {})
    sink = base.embedding(EMB, 3)
    sink.write([1, 2, 3], np.arange(9).reshape(3, 3))
    sink.close()
    w = base.dense(DENSE)
    w[:] = 1.0
    w.flush()
    other = base.dense(DenseSpec("gone", (2,), "float32", Normal(0, 1), Adam(), 4, 2))
    other.flush()
    base.finish({})
    b = Export(tmp_path / "base")
    delta = ExportWriter(tmp_path / "delta", {}, base=b)
    sink = delta.embedding(EMB, 2, removed=np.array([2]))
    sink.write([3, 4], np.full((2, 3), 7.0))
    sink.close()
    delta.finish({0: {"lsn": 9, "epoch": 1}}, dropped=["gone"])
    d = Export(tmp_path / "delta")
    assert d.is_delta and d.removed("user/emb").tolist() == [2]
    apply_delta(tmp_path / "base", tmp_path / "delta", tmp_path / "out")
    out = Export(tmp_path / "out")
    assert sorted(out.tables) == ["user/emb", "w"]  # "gone" dropped, "w" unchanged
    rows = dict(zip(out.ids("user/emb").tolist(), out.values("user/emb").tolist(), strict=True))
    assert rows == {1: [0, 1, 2], 3: [7, 7, 7], 4: [7, 7, 7]}
    np.testing.assert_array_equal(out.values("w"), np.ones((2, 5)))
    with pytest.raises(BadRequestError, match="not a delta"):
        apply_delta(tmp_path / "base", tmp_path / "base", tmp_path / "again")
