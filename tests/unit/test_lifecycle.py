"""Embedding admission and eviction (``admit_count``, ``ttl_steps``, ``max_rows``): the
rules, memory under the cap for a stream of 10x more ids, and determinism (a copy loaded
from a snapshot at any point evicts exactly what the original evicts)."""

from __future__ import annotations

import numpy as np
import pytest

from zps.errors import BadRequestError
from zps.init import Constant, Normal
from zps.optim import SGD, Adam
from zps.protocol.specs import EmbeddingSpec, spec_from_wire
from zps.store.tables import EmbeddingTable


def spec(**kw: int) -> EmbeddingSpec:
    return EmbeddingSpec("e", 4, "float32", Constant(0.5), SGD(lr=1.0), 1, **kw)


def ones(n: int) -> np.ndarray:
    return np.ones((n, 4), dtype=np.float32)


def test_specs_carry_lifecycle_fields_only_when_set() -> None:
    plain = spec()
    assert "max_rows" not in plain.to_wire() and not plain.lifecycle
    s = spec(admit_count=3, ttl_steps=10, max_rows=100)
    assert s.to_wire()["max_rows"] == 100 and s.lifecycle
    assert spec_from_wire(s.to_wire()) == s and spec_from_wire(plain.to_wire()) == plain
    with pytest.raises(BadRequestError, match="max_rows must be an integer"):
        spec(max_rows=-1)


def test_admission_counts_pushes_before_training_a_row() -> None:
    t = EmbeddingTable(spec(admit_count=3))
    t.push([5, 6], ones(2))
    t.push([5], ones(1))
    np.testing.assert_array_equal(t.pull([5, 6]), np.full((2, 4), 0.5))  # counted only
    assert t.ids_after(None, 10).size == 0 and t.copy_values()[0].size == 0
    assert len(t) == 2 and t.n_admitted() == 0
    t.push([5, 6], ones(2))  # 5's third push: trained from here on
    np.testing.assert_array_equal(t.pull([5, 6]), [[-0.5] * 4, [0.5] * 4])
    assert t.ids_after(None, 10).tolist() == [5]
    t.set_rows([6], np.zeros((1, 4)))  # a row set is admitted
    t.push([6], ones(1))
    np.testing.assert_array_equal(t.pull([6]), [[-1.0] * 4])


def test_ttl_evicts_rows_not_pushed_for_that_many_steps() -> None:
    t = EmbeddingTable(spec(ttl_steps=8))
    t.push([1], ones(1))
    for _ in range(8):
        t.push([2], ones(1))
    assert len(t) == 2  # pushed 8 steps ago: not yet
    for _ in range(2):
        t.push([2], ones(1))
    assert len(t) == 1 and t.evicted == 1
    np.testing.assert_array_equal(t.pull([1]), [[0.5] * 4])  # back to its initial value


def test_memory_stays_under_the_cap_for_a_stream_of_ten_times_more_ids() -> None:
    cap = 10_000
    s = EmbeddingSpec("e", 16, "float32", Normal(0, 0.1), Adam(), 1, max_rows=cap)
    capped, free = (
        EmbeddingTable(s),
        EmbeddingTable(EmbeddingSpec("f", 16, "float32", Normal(0, 0.1), Adam(), 1)),
    )
    rng = np.random.default_rng(0)
    stream = rng.permutation(10 * cap).astype(np.int64)
    peak_rows = peak_bytes = 0
    for i in range(0, stream.size, 500):
        batch = stream[i : i + 500]
        g = rng.normal(size=(batch.size, 16)).astype(np.float32)
        capped.push(batch, g)
        free.push(batch, g)
        peak_rows, peak_bytes = max(peak_rows, len(capped)), max(peak_bytes, capped.nbytes)
    assert peak_rows <= cap and len(free) == 10 * cap
    # rows, Adam's state, bookkeeping and index of at most `cap` rows (+ one push's rows)
    per_row = 16 * 4 * 3 + 4 + 2 * 4 + 8 + 4 * 16
    assert peak_bytes <= (cap + 500) * per_row, (peak_bytes, free.nbytes)
    assert free.nbytes > 8 * peak_bytes
    # the most recent ids are the ones kept
    kept = set(capped.ids_after(None, cap).tolist())
    assert set(stream[-cap // 2 :].tolist()) <= kept


def test_a_copy_loaded_mid_stream_evicts_exactly_like_the_original() -> None:
    s = EmbeddingSpec(
        "e", 3, "float64", Normal(0, 1), Adam(), 1, admit_count=2, ttl_steps=40, max_rows=300
    )
    a = EmbeddingTable(s)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 2000, size=60) for _ in range(120)]
    for b in batches[:50]:
        a.push(b, np.ones((b.size, 3)))
    b_copy = EmbeddingTable(s)
    b_copy.load(a.export())  # rows in id order: other positions than the original's
    assert b_copy.checksum() == a.checksum()
    for b in batches[50:]:
        a.push(b, np.ones((b.size, 3)))
        b_copy.push(b, np.ones((b.size, 3)))
        assert len(a) <= 300
    assert a.evicted > 0 and b_copy.checksum() == a.checksum()


def test_set_rows_keeps_a_capped_table_within_its_cap() -> None:
    t = EmbeddingTable(spec(max_rows=64))
    t.push(np.arange(10), ones(10))
    t.set_rows(np.arange(100, 300), np.zeros((200, 4), dtype=np.float32))
    assert len(t) <= 64


def test_admission_by_probability_is_about_right_and_the_same_on_every_copy() -> None:
    s = EmbeddingSpec("e", 2, "float32", Constant(0.0), SGD(lr=1.0), 1, admit_probability=0.25)
    assert spec_from_wire(s.to_wire()) == s
    with pytest.raises(BadRequestError, match="exclude each other"):
        EmbeddingSpec(
            "e", 2, "float32", Constant(0.0), SGD(), 1, admit_count=2, admit_probability=0.5
        )
    a = EmbeddingTable(s)
    ids = np.arange(20_000)
    a.push(ids, np.ones((ids.size, 2), dtype=np.float32))
    first = a.n_admitted() / ids.size
    assert 0.23 < first < 0.27
    b = EmbeddingTable(s)
    b.load(a.export())
    for t in (a, b):
        t.push(ids, np.ones((ids.size, 2), dtype=np.float32))  # a second chance for the rest
    assert b.checksum() == a.checksum()
    assert 0.41 < a.n_admitted() / ids.size < 0.47  # 1 - 0.75**2
    trained = a.pull(ids)[:, 0]
    assert set(np.unique(trained).tolist()) == {0.0, -1.0, -2.0}
