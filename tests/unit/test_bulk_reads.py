"""A partition's bulk reads: a checkpoint read in slices, the next read while the one
before is taken, a table's ids indexed while the rest of its stream arrives, and a
sender's chunk buffers used again only once acknowledged and hashed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from zps.errors import BadRequestError
from zps.init import Zeros
from zps.optim import Adagrad
from zps.protocol.specs import EmbeddingSpec
from zps.shard import snapshots as sender
from zps.shard.checkpoint import (
    CheckpointError,
    CheckpointStore,
    cut,
    encode_parts,
    read_checkpoint,
)
from zps.shard.core import ShardCore
from zps.store import checksums
from zps.store import snapshot as sn
from zps.store import snapstream as ss
from zps.store.slicereader import SliceReader


def _file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("size", [1, 4095, 4096, 3 * 4096 + 5, 10 * 4096])
def test_a_file_read_in_slices_is_the_file(tmp_path: Path, size: int) -> None:
    path, data = _file(tmp_path, size)
    with SliceReader(path) as f:
        got = b"".join(bytes(piece) for piece in f.slices(2 * 4096))
    assert got == data


def test_a_file_shorter_than_its_size_when_read_is_an_eof(tmp_path: Path) -> None:
    path, _ = _file(tmp_path, 4 * 4096)
    with SliceReader(path) as f:
        slices = f.slices(4096)
        next(slices)
        os.truncate(path, 4096 + 10)
        with pytest.raises(EOFError):
            list(slices)


def _core(rows: int, ids: np.ndarray | None = None) -> ShardCore:
    core = ShardCore()
    core.assign(0, 1)
    core.store.create(EmbeddingSpec("e", 4, "float32", Zeros(), Adagrad(), 1))
    if ids is None:
        ids = np.random.default_rng(0).permutation(rows).astype(np.int64) * 3
    core.store.embedding("e").push(ids, np.ones((ids.size, 4), np.float32))
    core.lsn = 4
    return core


def _stream(core: ShardCore) -> tuple[ss.StreamBuilder, list[bytes]]:
    parts = encode_parts(cut(core))
    data = b"".join(bytes(p) if not isinstance(p, sn.FrozenPart) else _frozen(p) for p in parts)
    hashed = checksums.CHECKSUMS[checksums.STREAM_MAGIC].new()
    hashed.update(data)
    data += hashed.digest()
    size = 1 << 13  # the ids of the tests below span chunks
    chunks = [data[a : a + size] for a in range(0, len(data), size)]
    return ss.StreamBuilder(1, len(data), size, len(chunks), 1 << 40), chunks


def _frozen(part: sn.FrozenPart) -> bytes:
    out = bytearray(len(part))
    sn.read_part(part, 0, len(part), memoryview(out))
    return bytes(out)


def test_ids_are_indexed_while_the_rows_arrive_and_the_table_takes_that_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ss, "INDEX_AHEAD_IDS", 100)
    core = _core(5000)
    builder, chunks = _stream(core)
    for seq, chunk in enumerate(chunks):
        builder.check(1, seq, [chunk])
        builder.take([chunk])
        if seq == 0:
            assert "e" not in builder.indexes  # the ids are not all here yet
    snap = builder.snapshot()
    ahead = snap.indexes["e"]
    store = sn.build_store(snap)
    table = store.embedding("e")
    assert table._index is ahead.result()
    want = core.store.embedding("e")
    ids = want._index.ids()
    assert np.array_equal(table.pull(ids), want.pull(ids))


def test_duplicate_ids_indexed_ahead_are_refused_when_the_tables_are_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ss, "INDEX_AHEAD_IDS", 100)
    core = _core(500)
    table = core.store.embedding("e")
    table._index._ids[7] = table._index._ids[3]  # a stream that names an id twice
    builder, chunks = _stream(core)
    for seq, chunk in enumerate(chunks):
        builder.check(1, seq, [chunk])
        builder.take([chunk])
    snap = builder.snapshot()
    assert snap.indexes["e"].result() is None
    with pytest.raises(BadRequestError, match="duplicates"):
        sn.build_store(snap)


def test_a_checkpoint_read_in_slices_loads_what_was_written(tmp_path: Path) -> None:
    core = _core(20000)
    store = CheckpointStore(tmp_path)
    path = store.write(cut(core))
    snap = read_checkpoint(path)
    built = sn.build_store(snap)
    want = core.store.embedding("e")
    ids = want._index.ids()
    assert np.array_equal(built.embedding("e").pull(ids), want.pull(ids))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        read_checkpoint(path)
    os.truncate(path, len(data) - 3)
    with pytest.raises(CheckpointError):
        read_checkpoint(path)


def test_a_chunk_buffer_is_used_again_only_once_acknowledged_and_hashed() -> None:
    buffers = sender._Buffers(16)
    first = buffers.take(0, -1, 16)
    second = buffers.take(1, -1, 16)
    assert not _same(first, second)
    buffers.hashed = 2
    third = buffers.take(2, -1, 16)  # hashed, not acknowledged: a new one
    assert not _same(third, first) and not _same(third, second)
    buffers.hashed = 0
    fourth = buffers.take(3, 1, 16)  # acknowledged, not hashed: a new one
    assert not any(_same(fourth, b) for b in (first, second, third))
    buffers.hashed = 1
    fifth = buffers.take(4, 1, 8)  # chunk 0 acknowledged and hashed: its buffer
    assert _same(fifth, first) and len(fifth) == 8


def _same(a: memoryview, b: memoryview) -> bool:
    return bool(
        np.frombuffer(a, np.uint8).__array_interface__["data"][0]
        == np.frombuffer(b, np.uint8).__array_interface__["data"][0]
    )
