"""The bulk paths of a partition: tables load rows in storage order without sorting,
checkpoints keep that order and still read files held by id, a stream's checksum is
taken piece by piece as it is sent, received, written and read."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zps.errors import BadRequestError
from zps.init import Zeros
from zps.optim import Adagrad
from zps.protocol.codec import decode
from zps.protocol.messages import Role, SnapshotAck, SnapshotChunk
from zps.protocol.specs import DenseSpec, EmbeddingSpec
from zps.shard import checkpoint as ckpt
from zps.shard.checkpoint import (
    CheckpointStore,
    Digest,
    cut,
    decode_checkpoint,
    encode_checkpoint,
    finish,
)
from zps.shard.core import ShardCore
from zps.shard.snapshots import SnapshotSender, prepare
from zps.store.checksums import READABLE
from zps.store.partition import PartitionStore
from zps.store.snapshot import Snapshot, build_store, ordered, slices
from zps.store.snapstream import StreamBuilder
from zps.store.tables import EmbeddingTable


def _store(rows: int) -> PartitionStore:
    """An embedding table whose rows were created by pushes of ids in a random order
    (storage order is not id order), and a dense tensor."""
    store = PartitionStore()
    store.create(EmbeddingSpec("e", 4, "float32", Zeros(), Adagrad(), 1))
    store.create(DenseSpec("d", (10,), "float32", Zeros(), Adagrad(), 1, chunk_elems=4))
    rng = np.random.default_rng(0)
    ids = rng.permutation(rows).astype(np.int64) * 7 + 3
    for a in range(0, rows, 100):
        batch = ids[a : a + 100]
        store.embedding("e").push(batch, rng.random((batch.size, 4), dtype=np.float32))
    store.dense("d").push(1, np.ones(4, np.float32))
    return store


def _shuffled_core(rows: int) -> ShardCore:
    core = ShardCore()
    core.assign(2, 5)
    core.store = _store(rows)  # ids pushed in a random order: storage order is not id order
    core.lsn = 9
    return core


def test_a_table_loads_rows_in_storage_order_without_sorting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = _store(4000)
    table = store.embedding("e")
    ids, rows = table.copy_values()
    assert not bool(np.all(ids[1:] > ids[:-1]))  # storage order
    state = table.copy_state()
    by_id = table.export()

    def no_sort(*a: Any, **kw: Any) -> Any:
        raise AssertionError("a load sorted the ids")

    monkeypatch.setattr(np, "unique", no_sort)
    monkeypatch.setattr(np, "argsort", no_sort)
    copy = EmbeddingTable(table.spec)
    copy.load({"ids": ids, "rows": rows, **state})
    monkeypatch.undo()
    assert copy.checksum() == table.checksum()
    np.testing.assert_array_equal(copy.export()["rows"], by_id["rows"])
    twice = ids.copy()
    twice[-1] = twice[7]  # a duplicate, not next to its twin
    with pytest.raises(BadRequestError, match="'ids' has duplicates"):
        copy.load({"ids": twice, "rows": rows, **state})
    assert copy.checksum() == table.checksum()  # all or nothing


def test_a_checkpoint_keeps_storage_order_and_files_held_by_id_still_load(
    tmp_path: Path,
) -> None:
    core = _shuffled_core(3000)
    want = core.store.checksum()
    new = CheckpointStore(tmp_path / "new").write(finish(cut(core)))
    ids = decode_checkpoint(new.read_bytes()).export["tables"]["e"]["ids"]
    assert not bool(np.all(ids[1:] > ids[:-1]))  # not sorted: no second copy to sort
    # A file written before, with its rows sorted by id: the same format, read alike.
    old_snap = cut(core)
    old_snap = Snapshot(
        old_snap.partition, old_snap.epoch, old_snap.lsn, ordered(old_snap.export), []
    )
    old = CheckpointStore(tmp_path / "old").write_encoded(2, 5, 9, encode_checkpoint(old_snap))
    for path in (new, old):
        found = CheckpointStore(path.parent.parent).latest()
        assert found is not None and found.path == path
        restored = ShardCore()
        restored.load_snapshot(found.snapshot)
        assert restored.store.checksum() == want and restored.lsn == 9


@settings(max_examples=50, deadline=None)
@given(st.integers(40, 3000), st.lists(st.integers(1, 500), min_size=1, max_size=20))
def test_a_digest_fed_in_pieces_is_the_streams_checksum(total: int, cuts: list[int]) -> None:
    data = np.random.default_rng(total).integers(0, 256, total, dtype=np.uint8).tobytes()
    view, digest, pos = memoryview(data), Digest(total), 0
    for n in cuts:
        digest.feed([view[pos : pos + n]])
        pos = min(total, pos + n)
    assert digest.complete is (pos >= total - ckpt.DIGEST_BYTES)
    digest.feed([view[pos:]])  # bytes past the body (the checksum itself) are left out
    assert digest.complete
    want = ckpt.CHECKSUM.new()  # no magic: the checksum of the streams written now
    want.update(data[: -ckpt.DIGEST_BYTES])
    assert digest.digest() == want.digest()


def test_a_checkpoint_is_verified_as_it_is_read_in_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt, "_SLICE", 4096)  # many slices, hashed beside the writes
    store = CheckpointStore(tmp_path, keep=5)
    core = _shuffled_core(2000)
    good = store.write(finish(cut(core)))
    assert decode_checkpoint(good.read_bytes()).lsn == 9  # the checksum a full pass computes
    core.lsn = 10
    bad = store.write(finish(cut(core)))
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 1  # one flipped bit, in a slice of the middle
    bad.write_bytes(bytes(raw))
    found = store.latest()
    assert found is not None and found.path == good  # the corrupt one is skipped
    bad.write_bytes(bytes(raw[: len(raw) // 3]))  # truncated
    found = store.latest()
    assert found is not None and found.path == good


class _Session:
    role = Role.PRIMARY

    def subscribed(self, *a: Any, **kw: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("readable", "magic"),
    [(READABLE, b"ZPSCKPT2"), ((), b"ZPSCKPT1"), (("SHA-256", "BLAKE9"), b"ZPSCKPT1")],
)
async def test_a_snapshot_sent_in_chunks_carries_the_checksum_of_what_was_sent(
    readable: tuple[str, ...], magic: bytes
) -> None:
    """The stream ends with a checksum the replica reads: XXH3-128 if it names it, else
    SHA-256 (a replica of an earlier release names none and reads only that)."""
    core = _shuffled_core(5000)
    want = core.store.checksum()
    sent: list[list[Any]] = []

    def post(node: str, frames: list[Any]) -> bool:
        sent.append(frames)
        return True

    sender = SnapshotSender(
        _Session(),  # type: ignore[arg-type]
        core,
        post=post,
        drop=lambda node, why: pytest.fail(why),
        chunk_bytes=10_000,
        window=2,
    )
    assert sender.subscribe("r", None, readable)
    assembly: StreamBuilder | None = None
    digest: Digest | None = None
    while sender.in_progress("r"):
        await asyncio.sleep(0.001)
        while sent:
            msg = decode(sent.pop(0))
            chunk = SnapshotChunk.parse(msg.header)
            if assembly is None:
                assert bytes(msg.payloads[0])[:8] == magic
                assembly = StreamBuilder.from_header(msg.header, max_bytes=1 << 30)
                digest = Digest(assembly.total)
            assembly.check(chunk.id, chunk.seq, msg.payloads)
            assembly.take(msg.payloads)
            assert digest is not None
            digest.feed([memoryview(p) for p in msg.payloads])
            sender.acked("r", SnapshotAck(chunk.id, chunk.seq))
    assert assembly is not None and digest is not None and assembly.done
    assert sender.completed == 1 and assembly.count > 10
    assert digest.digest() == assembly.digest()
    snap = assembly.snapshot()
    assert build_store(snap).checksum() == want
    assert await ckpt.thawed(5)  # nothing stays frozen once the stream is read


def test_a_checkpoint_kept_as_it_arrives_outlives_other_checkpoints_written_meanwhile(
    tmp_path: Path,
) -> None:
    """A replica writes a snapshot to its checkpoint for as long as the transfer takes;
    a checkpoint written meanwhile prunes stale temporary files, never that one."""
    store = CheckpointStore(tmp_path, keep=5)
    core = _shuffled_core(2000)
    stale = store.folder(2) / ".ckpt-00000005-0000000000000001.zps.tmp-1"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"left by a crash")
    pieces = slices(encode_checkpoint(finish(cut(core))), 4096, memoryview(bytearray(4096)))
    pending = store.begin(2, 5, 9)
    pending.write(next(pieces))
    store.write(finish(cut(core)))  # prunes
    assert not stale.exists()
    for piece in pieces:
        pending.write(piece)
    path = pending.commit()
    assert decode_checkpoint(path.read_bytes()).lsn == 9
    assert not store.pending


async def test_cuts_that_wait_for_one_release_freeze_one_at_a_time() -> None:
    """Two cuts waiting for the same frozen version (a checkpoint and a snapshot) go one
    at a time: the second waits for the first one's release and freezes the tables too,
    never copies them on the loop into buffers sized for a frozen cut."""
    core = ShardCore()
    core.assign(2, 5)
    core.store = PartitionStore()
    core.store.create(EmbeddingSpec("e", 64, "float32", Zeros(), Adagrad(), 1))
    core.store.embedding("e").push(np.arange(8000), np.ones((8000, 64), np.float32))
    core.lsn = 9

    async def take() -> Snapshot:
        space = await prepare(core)
        return cut(core, space)  # no await in between, as the shard's cuts

    held = cut(core)
    assert held.frozen and ckpt.copied_rows(held.export) == 0
    first, second = asyncio.create_task(take()), asyncio.create_task(take())
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done()
    ckpt.release(held)
    done, waiting = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, "both cuts went ahead at the release"
    snap = done.pop().result()
    assert snap.frozen and ckpt.copied_rows(snap.export) == 0
    await asyncio.sleep(0.05)
    (later,) = waiting
    assert not later.done()  # waits for the first one's release
    ckpt.release(snap)
    other = await asyncio.wait_for(later, 5)
    assert other.frozen and ckpt.copied_rows(other.export) == 0
    ckpt.release(other)
    assert await ckpt.thawed(5)
