"""Snapshots in bounded chunks: planning, building tables from chunks as they come,
and the consistent cut (a copy, or a frozen version)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zps.errors import ProtocolError
from zps.init import Zeros
from zps.optim import Adagrad
from zps.protocol.specs import DenseSpec, EmbeddingSpec
from zps.shard.checkpoint import encode_checkpoint
from zps.store import mapped
from zps.store.partition import PartitionStore
from zps.store.snapshot import (
    FrozenArray,
    Snapshot,
    build_store,
    cut_export,
    cut_space,
    freeze_export,
    ordered,
    read_part,
)
from zps.store.snapstream import StreamBuilder, chunk_count, plan_chunks


def _stream(sizes: list[int]) -> list[bytes]:
    rng = np.random.default_rng(len(sizes))
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def _pieces(parts: list[bytes], chunk: tuple[tuple[int, int, int], ...]) -> list[memoryview]:
    return [memoryview(parts[i])[a:b] for i, a, b in chunk]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=8), st.integers(1, 97))
def test_plan_covers_the_stream_in_bounded_chunks(sizes: list[int], chunk_bytes: int) -> None:
    parts = _stream(sizes)
    plan = plan_chunks(sizes, chunk_bytes)
    assert plan.total == sum(sizes)
    assert plan.count == chunk_count(plan.total, chunk_bytes)
    joined = b"".join(bytes(p) for c in plan.chunks for p in _pieces(parts, c))
    assert joined == b"".join(parts)
    lengths = [sum(b - a for _, a, b in c) for c in plan.chunks]
    assert all(n == chunk_bytes for n in lengths[:-1])  # every chunk full but the last
    assert 0 <= lengths[-1] <= chunk_bytes
    assert all(b > a for c in plan.chunks for _, a, b in c)  # no empty pieces


def _snapshot_stream(rows: int = 300) -> tuple[PartitionStore, Snapshot, list[Any]]:
    store = _store(rows)
    snap = Snapshot(2, 5, 99, ordered(cut_export(store)), [(b"c", 1, [{"st": "OK"}])])
    return store, snap, encode_checkpoint(snap)


def _feed(builder: StreamBuilder, parts: list[Any], chunk_bytes: int) -> None:
    plan = plan_chunks([len(p) for p in parts], chunk_bytes)
    for seq, c in enumerate(plan.chunks):
        pieces = [bytearray(b - a) for _, a, b in c]  # as the sender reads them
        for (i, a, b), piece in zip(c, pieces, strict=True):
            read_part(parts[i], a, b, memoryview(piece))
        assert builder.check(builder.snapshot_id, seq, pieces) is (seq == plan.count - 1)
        builder.take(pieces)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5000))
def test_a_stream_in_chunks_of_any_size_builds_the_partition(chunk_bytes: int) -> None:
    store, snap, parts = _snapshot_stream()
    total = sum(len(p) for p in parts)
    builder = StreamBuilder(7, total, chunk_bytes, chunk_count(total, chunk_bytes), 1 << 20)
    _feed(builder, parts, chunk_bytes)
    assert builder.digest() == bytes(parts[-1])
    back = builder.snapshot()
    assert (back.partition, back.epoch, back.lsn, back.dedup) == (2, 5, 99, snap.dedup)
    assert build_store(back).checksum() == store.checksum()


def _builder() -> tuple[StreamBuilder, list[bytes], tuple[tuple[tuple[int, int, int], ...], ...]]:
    parts = _stream([100, 50, 70])
    plan = plan_chunks([100, 50, 70], 64)
    return StreamBuilder(3, plan.total, 64, plan.count, 1 << 20), parts, plan.chunks


def test_out_of_order_repeated_and_foreign_chunks_are_refused() -> None:
    asm, parts, chunks = _builder()
    with pytest.raises(ProtocolError, match="out of order: expected chunk 0"):
        asm.check(3, 1, _pieces(parts, chunks[1]))
    assert asm.check(3, 0, _pieces(parts, chunks[0])) is False
    with pytest.raises(ProtocolError, match="repeated"):
        asm.check(3, 0, _pieces(parts, chunks[0]))
    with pytest.raises(ProtocolError, match="out of order"):
        asm.check(3, 2, _pieces(parts, chunks[2]))
    with pytest.raises(ProtocolError, match="snapshot 4"):
        asm.check(4, 1, _pieces(parts, chunks[1]))
    with pytest.raises(ProtocolError, match="out of order"):
        asm.check(3, "1", _pieces(parts, chunks[1]))
    with pytest.raises(ProtocolError, match="incomplete"):
        asm.snapshot()


def test_chunks_of_the_wrong_size_are_refused() -> None:
    asm, parts, _ = _builder()
    with pytest.raises(ProtocolError, match="has 63 bytes, expected 64"):
        asm.check(3, 0, [memoryview(parts[0])[:63]])
    with pytest.raises(ProtocolError, match="has 65 bytes"):
        asm.check(3, 0, [parts[0][:64], b"x"])
    assert asm.received == 0


def test_a_stream_that_is_not_one_is_refused_as_it_arrives() -> None:
    asm, parts, chunks = _builder()
    asm.check(3, 0, _pieces(parts, chunks[0]))
    with pytest.raises(ProtocolError, match="bad magic"):
        asm.take(_pieces(parts, chunks[0]))
    _, _, stream = _snapshot_stream()
    raw = bytearray(b"".join(bytes(p) for p in stream))
    raw[16] ^= 0xFF  # the header's first byte: no longer a map
    asm = StreamBuilder(1, len(raw), len(raw), 1, 1 << 20)
    asm.check(1, 0, [raw])
    with pytest.raises(ProtocolError, match="header"):
        asm.take([raw])


def test_announced_sizes_are_bounded_and_consistent() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        StreamBuilder(1, 1 << 21, 1 << 10, 1 << 11, 1 << 20)
    with pytest.raises(ProtocolError, match="cannot be 3 chunks"):
        StreamBuilder(1, 100, 64, 3, 1 << 20)
    with pytest.raises(ProtocolError, match="chunk_bytes must be positive"):
        StreamBuilder(1, 0, 0, 1, 1 << 20)
    with pytest.raises(ProtocolError, match="total must be a non-negative integer"):
        StreamBuilder(1, -1, 64, 1, 1 << 20)
    with pytest.raises(ProtocolError, match="too short"):
        StreamBuilder(1, 10, 64, 1, 1 << 20)
    with pytest.raises(ProtocolError, match="lacks 'count'"):
        StreamBuilder.from_header({"id": 1, "total": 1, "chunk": 1}, max_bytes=10)
    with pytest.raises(ProtocolError, match="id must be"):
        StreamBuilder.from_header({"id": "x", "total": 1, "chunk": 1, "count": 1}, max_bytes=10)
    with pytest.raises(ValueError, match="positive"):
        plan_chunks([1], 0)


def _store(rows: int) -> PartitionStore:
    store = PartitionStore()
    store.create(EmbeddingSpec("e", 4, "float32", Zeros(), Adagrad(), 1))
    store.create(DenseSpec("d", (10,), "float32", Zeros(), Adagrad(), 1, chunk_elems=4))
    rng = np.random.default_rng(0)
    ids = rng.permutation(rows).astype(np.int64) * 7 + 3
    store.embedding("e").push(ids, rng.random((rows, 4), dtype=np.float32))
    store.dense("d").push(1, np.ones(4, np.float32))
    return store


@pytest.mark.parametrize("prefault", [True, False])
def test_cut_equals_export(prefault: bool) -> None:
    store = _store(5000)
    space = cut_space(store)
    if prefault:
        space.prefault()
    cut = cut_export(store, space if prefault else None)
    store.embedding("e").push(np.array([3], np.int64), np.ones((1, 4), np.float32))  # after
    want = _store(5000).export()
    got = ordered(cut)
    assert got["specs"] == want["specs"]
    for name, arrays in want["tables"].items():
        assert list(got["tables"][name]) == list(arrays)
        for key, arr in arrays.items():
            np.testing.assert_array_equal(got["tables"][name][key], arr)


def test_cut_with_rows_added_after_sizing_falls_back_to_copies() -> None:
    store = _store(100)
    space = cut_space(store)  # room for 100 rows plus slack
    store.embedding("e").push(np.arange(10_000, 12_000, dtype=np.int64), np.ones((2000, 4), "f4"))
    got = ordered(cut_export(store, space))
    want = store.export()
    for key, arr in want["tables"]["e"].items():
        np.testing.assert_array_equal(got["tables"]["e"][key], arr)


def test_a_built_partition_owns_the_arrays_the_chunks_were_written_into() -> None:
    """A replica's tables take the arrays its chunks filled (no second copy), and the
    tables grow and change as any table does."""
    store, _, parts = _snapshot_stream(70_000)  # rows of 1 MiB and more: mapped memory
    total = sum(len(p) for p in parts)
    builder = StreamBuilder(1, total, 1 << 16, chunk_count(total, 1 << 16), 1 << 30)
    _feed(builder, parts, 1 << 16)
    snap = builder.snapshot()
    rows = snap.export["tables"]["e"]["rows"]
    assert mapped.mapping(rows) is not None
    restored = build_store(snap)
    assert restored.embedding("e")._rows is rows
    del rows
    assert restored.checksum() == store.checksum()
    more = np.arange(10**6, 10**6 + 100_000, dtype=np.int64)
    for s in (store, restored):
        s.embedding("e").push(more, np.ones((more.size, 4), np.float32))
    assert restored.checksum() == store.checksum()


def test_a_frozen_cut_is_the_partition_at_its_instant_and_costs_no_copy() -> None:
    store = _store(70_000)
    want = store.checksum()
    table = store.embedding("e")
    export, versions = freeze_export(store)
    assert versions and all(isinstance(export["tables"]["e"][k], FrozenArray) for k in table._state)
    snap = Snapshot(2, 5, 99, export, [], frozen=versions)
    later = np.arange(70_000, dtype=np.int64) * 7 + 3  # every row written after the cut
    table.push(later, np.ones((later.size, 4), np.float32))
    table.push(np.arange(10**6, 10**6 + 50_000, dtype=np.int64), np.ones((50_000, 4), "f4"))
    after = store.checksum()
    parts = encode_checkpoint(snap)
    total = sum(len(p) for p in parts)
    builder = StreamBuilder(1, total, 1 << 20, chunk_count(total, 1 << 20), 1 << 30)
    _feed(builder, parts, 1 << 20)
    assert build_store(builder.snapshot()).checksum() == want
    for version in versions:
        version.release()
    assert mapped.frozen(table._rows) is None
    assert store.checksum() == after  # the writes made while frozen are all there
    table.push(later, np.ones((later.size, 4), np.float32))  # and it goes on
    assert store.checksum() != after


def test_a_frozen_version_released_in_steps_keeps_every_write_made_between_them() -> None:
    rows = 300_000  # 36 MiB of (rows, 32) float32: three steps of 16 MiB
    holder = {"a": mapped.empty(rows, 32, np.float32)}
    holder["a"][:] = 1.0
    version = mapped.freeze(holder["a"])
    assert version is not None
    rng = np.random.default_rng(0)
    holder["a"][rng.choice(rows, 512, replace=False)] += 1.0  # written while frozen
    want = holder["a"].copy()
    steps = 0
    for _ in version.release_steps(16 << 20):
        steps += 1
        idx = rng.choice(rows, 512, replace=False)  # the writer runs between two steps
        holder["a"][idx] += 1.0
        want[idx] += 1.0
    assert steps == 3 and mapped.frozen(holder["a"]) is None
    np.testing.assert_array_equal(holder["a"], want)
    again = mapped.freeze(holder["a"])  # shared again: it freezes again
    assert again is not None
    again.release()
