"""Snapshots in bounded chunks: planning, assembly, and the cheap consistent cut."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zps.errors import ProtocolError
from zps.init import Zeros
from zps.optim import Adagrad
from zps.protocol.specs import DenseSpec, EmbeddingSpec
from zps.shard.checkpoint import decode_checkpoint, encode_checkpoint
from zps.store.partition import PartitionStore
from zps.store.snapshot import (
    ChunkAssembly,
    Snapshot,
    chunk_count,
    cut_export,
    cut_space,
    ordered,
    plan_chunks,
)


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


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=8), st.integers(1, 97))
def test_assembly_rebuilds_the_stream(sizes: list[int], chunk_bytes: int) -> None:
    parts = _stream(sizes)
    plan = plan_chunks(sizes, chunk_bytes)
    asm = ChunkAssembly(7, plan.total, chunk_bytes, plan.count, 1 << 20)
    done = [asm.add(7, seq, _pieces(parts, c)) for seq, c in enumerate(plan.chunks)]
    assert done == [False] * (plan.count - 1) + [True]
    assert bytes(asm.stream()) == b"".join(parts)


def _assembly() -> tuple[ChunkAssembly, list[bytes], tuple[tuple[tuple[int, int, int], ...], ...]]:
    parts = _stream([100, 50, 70])
    plan = plan_chunks([100, 50, 70], 64)
    return ChunkAssembly(3, plan.total, 64, plan.count, 1 << 20), parts, plan.chunks


def test_out_of_order_repeated_and_foreign_chunks_are_refused() -> None:
    asm, parts, chunks = _assembly()
    with pytest.raises(ProtocolError, match="out of order: expected chunk 0"):
        asm.add(3, 1, _pieces(parts, chunks[1]))
    assert asm.add(3, 0, _pieces(parts, chunks[0])) is False
    with pytest.raises(ProtocolError, match="repeated"):
        asm.add(3, 0, _pieces(parts, chunks[0]))
    with pytest.raises(ProtocolError, match="out of order"):
        asm.add(3, 2, _pieces(parts, chunks[2]))
    with pytest.raises(ProtocolError, match="snapshot 4"):
        asm.add(4, 1, _pieces(parts, chunks[1]))
    with pytest.raises(ProtocolError, match="out of order"):
        asm.add(3, "1", _pieces(parts, chunks[1]))
    with pytest.raises(ProtocolError, match="incomplete"):
        asm.stream()


def test_chunks_of_the_wrong_size_are_refused() -> None:
    asm, parts, _ = _assembly()
    with pytest.raises(ProtocolError, match="has 63 bytes, expected 64"):
        asm.add(3, 0, [memoryview(parts[0])[:63]])
    with pytest.raises(ProtocolError, match="has 65 bytes"):
        asm.add(3, 0, [parts[0][:64], b"x"])
    assert asm.received == 0


def test_announced_sizes_are_bounded_and_consistent() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        ChunkAssembly(1, 1 << 21, 1 << 10, 1 << 11, 1 << 20)
    with pytest.raises(ProtocolError, match="cannot be 3 chunks"):
        ChunkAssembly(1, 100, 64, 3, 1 << 20)
    with pytest.raises(ProtocolError, match="chunk_bytes must be positive"):
        ChunkAssembly(1, 0, 0, 1, 1 << 20)
    with pytest.raises(ProtocolError, match="total must be a non-negative integer"):
        ChunkAssembly(1, -1, 64, 1, 1 << 20)
    with pytest.raises(ProtocolError, match="lacks 'count'"):
        ChunkAssembly.from_header({"id": 1, "total": 1, "chunk": 1}, max_bytes=10)
    with pytest.raises(ProtocolError, match="id must be"):
        ChunkAssembly.from_header({"id": "x", "total": 1, "chunk": 1, "count": 1}, max_bytes=10)
    empty = ChunkAssembly.from_header({"id": 1, "total": 0, "chunk": 8, "count": 1}, max_bytes=10)
    assert empty.add(1, 0, []) is True and bytes(empty.stream()) == b""
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


@pytest.mark.parametrize("copy", [True, False])
def test_chunked_checkpoint_stream_round_trips(copy: bool) -> None:
    """As a replica assembles and loads a snapshot; without copies (``copy=False``, the
    replica's way) the tables read views of the stream and own what they load."""
    store = _store(3000)
    snap = Snapshot(2, 5, 99, ordered(cut_export(store)), [(b"c", 1, [{"st": "OK"}])])
    parts = encode_checkpoint(snap)
    plan = plan_chunks([len(p) for p in parts], 1000)
    asm = ChunkAssembly(1, plan.total, 1000, plan.count, 1 << 30)
    for seq, chunk in enumerate(plan.chunks):
        asm.add(1, seq, [memoryview(parts[i]).cast("B")[a:b] for i, a, b in chunk])
    back = decode_checkpoint(asm.stream(), copy=copy)
    assert (back.partition, back.epoch, back.lsn, back.dedup) == (2, 5, 99, snap.dedup)
    views = not back.export["tables"]["e"]["rows"].flags.owndata
    assert views is not copy
    restored = PartitionStore()
    restored.load(back.export)
    asm._buf[:] = 0xFF  # the stream is gone: nothing loaded may have pointed into it
    assert restored.checksum() == store.checksum()
    e = restored.embedding("e")
    e.push(np.array([3, 10], np.int64), np.ones((2, 4), np.float32))
    store.embedding("e").push(np.array([3, 10], np.int64), np.ones((2, 4), np.float32))
    assert restored.checksum() == store.checksum()
