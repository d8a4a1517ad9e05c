"""Checkpoint and snapshot-stream checksums: XXH3-128 in what is written now, SHA-256 in
files and streams written before (the magic names which); both restore exactly, and a
flipped byte in either is refused with an error naming the file."""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import xxhash

from zps.init import Zeros
from zps.optim import Adagrad
from zps.protocol.specs import DenseSpec, EmbeddingSpec
from zps.shard import checkpoint as ckpt
from zps.shard.checkpoint import (
    CheckpointError,
    CheckpointStore,
    Digest,
    cut,
    decode_checkpoint,
    encode_parts,
    read_checkpoint,
)
from zps.shard.core import ShardCore
from zps.store import mapped
from zps.store.snapshot import build_store
from zps.store.snapstream import StreamBuilder, plan_chunks

ROWS, DIM = 3000, 8


def _core(lsn: int = 7, rows: int = ROWS) -> ShardCore:
    core = ShardCore()
    core.assign(2, 5)
    core.store.create(EmbeddingSpec("e", DIM, "float32", Zeros(), Adagrad(lr=0.1), 0))
    core.store.create(DenseSpec("d", (10,), "float32", Zeros(), Adagrad(), 1, chunk_elems=4))
    rng = np.random.default_rng(3)
    ids = rng.permutation(10 * rows)[:rows].astype(np.int64)
    table = core.store.embedding("e")
    data = {"ids": ids, "rows": rng.random((rows, DIM), dtype=np.float32)}
    for key, width in table._widths.items():
        data[key] = rng.random((rows, width), dtype=np.float32)
    table.load(data)
    core.lsn = lsn
    return core


def _old_layout(core: ShardCore) -> bytes:
    """A checkpoint as written before XXH3-128: ``b"ZPSCKPT1" | u64 header length |
    msgpack header | frames | sha256`` of everything before the digest."""
    parts = encode_parts(cut(core))
    body = b"".join([b"ZPSCKPT1", *(bytes(memoryview(p)) for p in parts[1:])])
    return body + hashlib.sha256(body).digest()


def _write_old(store: CheckpointStore, core: ShardCore) -> Path:
    assert core.partition is not None
    return store.write_encoded(core.partition, core.epoch, core.lsn, [_old_layout(core)])


def _restored(path: Path) -> ShardCore:
    snap = read_checkpoint(path)
    out = ShardCore()
    out.install_snapshot(snap, build_store(snap))
    return out


def test_a_checkpoint_written_now_ends_with_the_xxh3_128_of_the_rest(tmp_path: Path) -> None:
    core = _core()
    path = CheckpointStore(tmp_path).write(cut(core))
    data = path.read_bytes()
    assert data[:8] == b"ZPSCKPT2" and ckpt.DIGEST_BYTES == 16
    assert data[-16:] == xxhash.xxh3_128(data[:-16]).digest()
    restored = _restored(path)
    assert restored.store.checksum() == core.store.checksum() and restored.lsn == 7
    assert decode_checkpoint(data).lsn == 7


def test_a_checkpoint_in_the_sha256_format_still_restores_exactly(tmp_path: Path) -> None:
    core = _core()
    store = CheckpointStore(tmp_path)
    path = _write_old(store, core)
    assert path.read_bytes()[:8] == b"ZPSCKPT1"
    found = store.latest()
    assert found is not None and found.path == path
    restored = ShardCore()
    restored.install_snapshot(found.snapshot, build_store(found.snapshot))
    assert restored.store.checksum() == core.store.checksum()
    assert (restored.partition, restored.epoch, restored.lsn) == (2, 5, 7)
    assert decode_checkpoint(path.read_bytes()).lsn == 7


@pytest.mark.parametrize("fmt", ["xxh3", "sha256"])
@pytest.mark.parametrize("where", ["header", "rows", "digest"])
def test_a_flipped_byte_is_refused_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fmt: str, where: str
) -> None:
    core = _core()
    store = CheckpointStore(tmp_path, keep=5)
    older = store.write(cut(_core(lsn=3)))
    path = store.write(cut(core)) if fmt == "xxh3" else _write_old(store, core)
    data = bytearray(path.read_bytes())
    pos = {"header": 20, "rows": len(data) // 2, "digest": len(data) - 1}[where]
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))
    name = "XXH3-128" if fmt == "xxh3" else "SHA-256"
    with pytest.raises(CheckpointError, match=r"checksum mismatch|malformed") as err:
        read_checkpoint(path)
    assert str(path) in str(err.value)
    if where != "header":  # the header still decodes: the checksum is what refuses it
        assert f"{name} checksum mismatch" in str(err.value)
    with pytest.raises(CheckpointError, match=r"checksum mismatch|malformed"):
        decode_checkpoint(bytes(data))
    # A restart falls back to the older checkpoint and says which file it skipped.
    with caplog.at_level(logging.ERROR, logger="zps.checkpoint"):
        found = store.latest()
    assert found is not None and found.path == older
    assert any(str(path) in r.getMessage() for r in caplog.records)


def test_a_truncated_checkpoint_is_refused_in_either_format(tmp_path: Path) -> None:
    core = _core()
    for path in (
        CheckpointStore(tmp_path / "new").write(cut(core)),
        _write_old(CheckpointStore(tmp_path / "old"), core),
    ):
        data = path.read_bytes()
        path.write_bytes(data[:-5])
        with pytest.raises(CheckpointError, match=re.escape(str(path))):
            read_checkpoint(path)
        path.write_bytes(data[:12])
        with pytest.raises(CheckpointError, match=re.escape(str(path))):
            read_checkpoint(path)


@pytest.mark.parametrize("fmt", ["xxh3", "sha256"])
def test_a_stream_in_either_format_is_taken_and_verified_in_chunks(fmt: str) -> None:
    """A replica takes a snapshot stream from a primary of either version."""
    core = _core()
    if fmt == "xxh3":
        data = b"".join(bytes(memoryview(p)) for p in ckpt.encode_checkpoint(cut(core)))
    else:
        data = _old_layout(core)
    chunk = 4096
    plan = plan_chunks([len(data)], chunk)
    for flip in (None, len(data) // 3):
        stream = bytearray(data)
        if flip is not None:
            stream[flip] ^= 1
        view = memoryview(bytes(stream))
        builder = StreamBuilder(9, len(view), chunk, plan.count, 1 << 30)
        digest = Digest(len(view))
        for seq in range(plan.count):
            piece = view[seq * chunk : (seq + 1) * chunk]
            builder.check(9, seq, [piece])
            builder.take([piece])
            digest.feed([piece[:3], piece[3:]])  # pieces split inside the magic too
        assert digest.complete
        assert builder.checksum is not None and digest.checksum is builder.checksum
        assert builder.checksum.name == ("XXH3-128" if fmt == "xxh3" else "SHA-256")
        assert (digest.digest() == builder.digest()) is (flip is None)
        if flip is None:
            snap = builder.snapshot()
            out = ShardCore()
            out.install_snapshot(snap, build_store(snap))
            assert out.store.checksum() == core.store.checksum()


def test_a_tables_array_is_written_through_its_memory_file() -> None:
    arr = mapped.empty(mapped.MIN_BYTES // 32 + 10, 8, np.float32)
    data = np.arange(arr.size, dtype=np.float32)
    raw = memoryview(data).cast("B")
    if mapped.mapping(arr) is None or not mapped.freezable(arr):
        pytest.skip("no memory files here: arrays are copied into")
    assert mapped.write_at(arr, 0, raw[:4096])
    assert mapped.write_at(arr, 4096, raw[4096:])
    assert np.array_equal(arr.reshape(-1), data)
    arr[3, 1] = -1.0  # the mapping and the file are one memory
    assert mapped.write_at(arr, 0, raw[:128]) and arr[3, 1] == data[25]
    with pytest.raises(ValueError):
        mapped.write_at(arr, arr.nbytes - 4, raw[:8])
    assert not mapped.write_at(np.zeros((4, 8), np.float32), 0, raw[:8])
    version = mapped.freeze(arr)
    assert version is not None
    assert not mapped.write_at(arr, 0, raw[:8])  # frozen: the caller copies
    version.release()


def test_a_big_table_restored_from_chunks_owns_memory_files_and_grows(tmp_path: Path) -> None:
    """Tables' arrays of a MB and more are written through their memory files at a
    restore (and a catch-up); the restored table is exact, and is then written, frozen
    and grown like any other."""
    rows = 2 * mapped.MIN_BYTES // (DIM * 4)
    core = _core(rows=rows)
    path = CheckpointStore(tmp_path).write(cut(core))
    restored = _restored(path)
    assert restored.store.checksum() == core.store.checksum()
    own = restored.store.embedding("e")._rows
    assert own.nbytes >= mapped.MIN_BYTES
    assert mapped.mapping(own) is not None or not mapped.IN_PLACE
    for other in (restored, core):
        emb = other.store.embedding("e")
        new_ids = np.arange(10 * rows, 10 * rows + 5000, dtype=np.int64)
        emb.push(new_ids, np.ones((5000, DIM), np.float32))
        emb.push(emb.export()["ids"][:100], np.ones((100, DIM), np.float32))
    assert restored.store.checksum() == core.store.checksum()
    again = _restored(CheckpointStore(tmp_path / "again").write(cut(restored)))
    assert again.store.checksum() == core.store.checksum()


def test_a_frozen_window_shows_the_version_at_the_freeze_and_is_unmapped_after() -> None:
    arr = mapped.empty(mapped.MIN_BYTES // 32 + 3, 8, np.float32)
    if not mapped.freezable(arr):
        pytest.skip("no memory files here: cuts copy")
    arr[:] = np.arange(arr.size, dtype=np.float32).reshape(arr.shape)
    want = arr.copy()
    version = mapped.freeze(arr)
    assert version is not None
    arr[:] = -1.0  # written after the freeze: private pages, not the file
    off = 3 * 4096 + 100  # not page-aligned: the mapping starts below it
    with version.window(off, 50_000) as view:
        assert view.readonly
        assert bytes(view) == want.tobytes()[off : off + 50_000]
    with pytest.raises(ValueError):  # released on the way out
        view.tobytes()
    with pytest.raises(ValueError), version.window(version.nbytes - 4, 8):
        pass
    version.release()
    with pytest.raises(ValueError), version.window(0, 8):
        pass
    assert float(arr[0, 0]) == -1.0


def test_a_checkpoint_of_a_frozen_cut_holds_the_cut_not_later_writes(tmp_path: Path) -> None:
    rows = 2 * mapped.MIN_BYTES // (DIM * 4)
    core = _core(rows=rows)
    want = core.store.checksum()
    snap = cut(core)
    assert snap.frozen or not mapped.FREEZABLE
    emb = core.store.embedding("e")
    emb.push(emb.export()["ids"][:2000], np.ones((2000, DIM), np.float32))  # after the cut
    path = CheckpointStore(tmp_path).write(snap)
    ckpt.release(snap)
    assert _restored(path).store.checksum() == want != core.store.checksum()
