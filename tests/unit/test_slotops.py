"""Live resharding on a shard, without I/O: the ownership rule, the move operations
(zps/shard/slotops.py, zps/store/slots.py), the client's re-split after MOVED
(zps/core/routing.py) and the broker's records (cluster state, state record)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from zps.core.brokerstate import BrokerState, BrokerStateError, PartitionRecord, ReshardRecord
from zps.core.cluster import ClusterState
from zps.core.routing import ClusterMap, join_resplit, resplit, split_by_partition
from zps.init import Zeros
from zps.optim import Adagrad
from zps.protocol.codec import Encoder, MsgType, Route, decode
from zps.shard.core import ShardCore
from zps.shard.slotops import SlotState
from zps.store import DenseSpec, EmbeddingSpec
from zps.store.index import IdIndex
from zps.store.slots import index_slots, slots_of_ids

N_SLOTS = 64
EMB = EmbeddingSpec("emb", 4, "float32", Zeros(), Adagrad(lr=0.1), 3)
DENSE = DenseSpec("w", (40,), "float32", Zeros(), Adagrad(lr=0.1), 1, 8)  # 5 chunks


class Shard:
    """A primary's core and a way to send it requests."""

    def __init__(self, partition: int) -> None:
        self.core = ShardCore()
        self.core.assign(partition, 1)
        self.partition = partition
        self.seq = 0

    def call(
        self, ops: list[tuple[dict[str, Any], dict[str, np.ndarray]]], seq: int | None = None
    ) -> tuple[dict[str, Any], list[Any]]:
        enc = Encoder()
        wire = [{**op, **{k: enc.array(v) for k, v in arrays.items()}} for op, arrays in ops]
        if seq is None:
            self.seq += 1
            seq = self.seq
        header = {"cid": b"c1", "seq": seq, "ops": wire}
        frames = enc.build(Route(MsgType.REQUEST, self.partition, 1, seq), header)
        msg = decode([bytes(f) for f in frames])
        out = self.core.handle(msg.route, msg.header, msg.payloads)
        reply = decode([bytes(f) for f in out])
        return reply.header, list(reply.payloads)

    def ok(self, ops: list[tuple[dict[str, Any], dict[str, np.ndarray]]]) -> dict[str, Any]:
        header, payloads = self.call(ops)
        assert header["st"] == "OK" and header["res"][0]["st"] == "OK", header
        return {"res": header["res"][0], "payloads": payloads}


def push(ids: np.ndarray, value: float = 1.0) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    g = np.full((ids.size, 4), value, dtype=np.float32)
    return {"op": "push_rows", "t": "emb"}, {"ids": ids, "g": g}


def pull(ids: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    return {"op": "pull_rows", "t": "emb"}, {"ids": ids}


def common(slots: list[int], owned: list[int]) -> dict[str, Any]:
    return {"slots": slots, "n_slots": N_SLOTS, "owned": owned, "version": 1}


def cut_slots_named(shard: Shard) -> list[int] | None:
    """The slots an export cut of ``shard`` says it was taken on (None: not named)."""
    res = shard.ok([({"op": "cut"}, {})])["res"]
    if "owned" not in res:
        return None
    mask = np.unpackbits(np.frombuffer(res["owned"], np.uint8), count=N_SLOTS)
    return np.flatnonzero(mask).tolist()


def test_a_cut_of_a_partition_no_move_involved_names_no_slots() -> None:
    shard = Shard(0)
    shard.ok([({"op": "create", "spec": EMB.to_wire()}, {})])
    assert cut_slots_named(shard) is None


def test_verdicts() -> None:
    owned = np.zeros(8, np.bool_)
    owned[:4] = True
    s = SlotState.of(owned)
    assert s.verdict(np.array([0, 1])) is None
    assert s.verdict(np.array([0, 5])) == "MOVED"
    s.fenced[1] = True
    assert s.verdict(np.array([0, 1])) == "NOT_PRIMARY"
    s.importing[5] = True
    assert s.verdict(np.array([0, 5])) == "NOT_PRIMARY"
    assert s.verdict(np.array([6])) == "MOVED"
    assert not s.take_map(owned, 9)  # a move involves it: the map waits
    s.fenced[:] = s.importing[:] = False
    assert s.take_map(~owned, 9) and s.verdict(np.array([0])) == "MOVED"


def test_a_partition_a_move_involved_takes_no_slot_from_a_map() -> None:
    # A broker of a pair that took over with an older record publishes a newer map
    # version giving the partition back slots it released: the records decide, not it.
    owned = np.zeros(8, np.bool_)
    owned[:4] = True
    s = SlotState.of(owned, 5)
    s.active = True
    s.owned[3] = False  # released by a move
    assert not s.take_map(owned, 9) and not s.owned[3] and s.version == 5
    assert s.verdict(np.array([3])) == "MOVED"
    # A map that agrees moves the version on (the claim a broker learns from).
    assert s.take_map(s.owned.copy(), 10) and s.version == 10


def test_a_move_between_two_cores_keeps_values_state_and_exactly_once() -> None:
    src, dst = Shard(0), Shard(1)
    everything = list(range(N_SLOTS))
    for shard in (src, dst):
        shard.core.slots = SlotState.of(
            np.ones(N_SLOTS, np.bool_) if shard is src else np.zeros(N_SLOTS, np.bool_)
        )
        shard.ok([({"op": "create", "spec": EMB.to_wire()}, {})])
        shard.ok([({"op": "create", "spec": DENSE.to_wire()}, {})])
    ids = np.arange(1, 2001, dtype=np.int64)
    for v in (1.0, 2.0, 3.0):
        src.ok([push(ids, v)])
    for c in range(5):
        src.ok([({"op": "push_dense", "t": "w", "chunk": c}, {"g": np.ones(8, np.float32)})])
    moving = list(range(0, N_SLOTS, 2))
    on = np.isin(slots_of_ids(ids, N_SLOTS), moving)
    # A message applied before the fence, re-sent after it: answered from the dedup
    # record, not refused and not applied again.
    header, _ = src.call([push(ids[on][:5], 100.0)], seq=1000)
    assert header["st"] == "OK"
    before = src.ok([pull(ids)])

    begun = dst.ok([({"op": "slots_import", **common(moving, [])}, {})])["res"]
    fenced = src.ok([({"op": "slots_fence", **common(moving, everything)}, {})])["res"]
    header, _ = src.call([push(ids[on][:5], 7.0)])
    assert header["st"] == "NOT_PRIMARY"  # fenced: not applied
    header, _ = src.call([push(ids[on][:5], 100.0)], seq=1000)
    assert header["st"] == "OK" and src.core.stats.duplicates == 1
    manifest = src.ok([({"op": "slots_cut", "slots": moving}, {})])["res"]
    for table in manifest["tables"]:
        read: dict[str, Any] = {"op": "slots_cut_read", "t": table["spec"]["name"]}
        extra: dict[str, Any] = {}
        if "n" in table:
            read |= {"start": 0, "count": table["n"]}
        else:
            read["chunks"] = extra["chunks"] = table["chunks"]
        got = src.ok([(read, {})])
        imp = {"op": "slots_import", **common(moving, []), "spec": table["spec"], **extra}
        enc_op = {**imp, "a": got["res"]["a"]}
        # Forward the payload frames as they are, as the broker does.
        header = {"cid": b"broker", "seq": 1 + dst.seq, "ops": [enc_op]}
        dst.seq += 1
        frames = [
            Route(MsgType.REQUEST, 1, 1, 5).pack(),
            msgpack.packb(header, use_bin_type=True),
            *got["payloads"],
        ]
        msg = decode([bytes(f) for f in frames])
        reply = decode([bytes(f) for f in dst.core.handle(msg.route, msg.header, msg.payloads)])
        assert reply.header["res"][0]["st"] == "OK", reply.header
    header, _ = dst.call([pull(ids[on])])
    assert header["st"] == "NOT_PRIMARY"  # importing: not served before the map says so
    # An export cut names the slots it was taken on: the destination's none yet.
    assert cut_slots_named(dst) == []
    activated = dst.ok([({"op": "slots_activate", **common(moving, [])}, {})])["res"]
    assert cut_slots_named(dst) == moving and cut_slots_named(src) == everything  # cut-over
    released = src.ok([({"op": "slots_release", **common(moving, everything), "drop": False}, {})])[
        "res"
    ]
    # Each side counted the requests it refused meanwhile (the broker breathes between
    # moves only then).
    assert activated["refused"] == begun["refused"] + 1
    assert released["refused"] == fenced["refused"] + 1
    header, _ = src.call([pull(ids[on][:3])])
    assert header["st"] == "MOVED"
    # An export cut holds the owned slots only, released rows still held or not.
    cut = src.ok([({"op": "cut"}, {})])["res"]
    assert [t["n"] for t in cut["tables"] if t["spec"]["name"] == "emb"] == [int((~on).sum())]
    assert cut_slots_named(src) == sorted(set(everything) - set(moving))
    assert src.ok([({"op": "slots_compact"}, {})])["res"]["dropped"] > 0

    # Values and Adagrad state moved: the same push gives the same rows on either side.
    def rows(shard: Shard, which: np.ndarray) -> np.ndarray:
        from zps.protocol.codec import array_from

        got = shard.ok([pull(which)])
        return array_from(got["res"]["a"], got["payloads"], max_bytes=1 << 30)

    from zps.protocol.codec import array_from

    want = array_from(before["res"]["a"], before["payloads"], max_bytes=1 << 30)
    np.testing.assert_array_equal(rows(dst, ids[on]), want[on])
    np.testing.assert_array_equal(rows(src, ids[~on]), want[~on])
    ref = Shard(0)
    ref.ok([({"op": "create", "spec": EMB.to_wire()}, {})])
    for v in (1.0, 2.0, 3.0):
        ref.ok([push(ids, v)])
    ref.call([push(ids[on][:5], 100.0)], seq=1000)
    for shard, mask in ((dst, on), (src, ~on)):
        shard.ok([push(ids[mask], 0.5)])
        ref_rows_mask = ids[mask]
        ref.ok([push(ref_rows_mask, 0.5)])
        np.testing.assert_array_equal(rows(shard, ids[mask]), rows(ref, ids[mask]))
    assert len(src.core.store.embedding("emb")) == int((~on).sum())


def test_resplit_joins_pieces_in_the_callers_order() -> None:
    cmap = ClusterMap(2, 16, (np.arange(16) % 4).astype(np.int32), {p: None for p in range(4)})  # type: ignore[misc]
    ids = np.arange(100, 140, dtype=np.int64)
    g = np.arange(40 * 2, dtype=np.float32).reshape(40, 2)
    plan = resplit({"op": "push_rows", "t": "e"}, {"ids": ids, "g": g}, 0, cmap)
    assert plan is not None
    assert sorted(p for p, *_ in plan.pieces) == sorted(p for p, _ in split_by_partition(ids, cmap))
    for _, _, arrays, _ in plan.pieces:
        assert np.array_equal(arrays["g"], g[np.searchsorted(ids, arrays["ids"])])
    pull_plan = resplit({"op": "pull_rows", "t": "e"}, {"ids": ids}, 40 * 8, cmap)
    assert pull_plan is not None
    results = [{"arrays": g[pos]} for pos in pull_plan.positions]
    assert np.array_equal(join_resplit(pull_plan, results)["arrays"], g)
    dense = resplit({"op": "pull_dense", "t": "w", "chunks": [0, 1, 2, 3, 4]}, {}, 0, cmap)
    assert dense is not None
    res = [{"arrays": [np.full(1, c) for c in cs]} for cs in dense.positions]
    assert [int(a[0]) for a in join_resplit(dense, res)["arrays"]] == [0, 1, 2, 3, 4]
    assert resplit({"op": "tables"}, {}, 0, cmap) is None


def test_cluster_grows_moves_and_shrinks() -> None:
    state = ClusterState(2, 16)
    for i in range(4):
        state.register_shard(f"s-{i}", host=f"h{i}", pid=i, address="", now=0.0)
    assert state.spare_count() == 2
    state.grow(4, 0.0)
    assert state.n_partitions == 4 and state.spare_count() == 0
    assert all(state.primary_of(p) for p in range(4))
    state.move_slots([1, 3], 2)
    assert state.map.slot_map[1] == 2 and state.status(0.0, {})["partitions"][2]["slots"] == 2
    with pytest.raises(ValueError, match="still hold slots"):
        state.shrink(2)
    state.move_slots([1, 3], 1)
    state.shrink(2)
    assert state.n_partitions == 2 and state.spare_count() == 2
    assert state.map.n_partitions == 2


def test_the_state_record_keeps_the_slot_map_and_the_move() -> None:
    slot_map = (np.arange(16) % 3).astype("<i4").tobytes()
    rec = BrokerState(
        1, 3, 16, 1, 7, (PartitionRecord(),) * 3, slot_map=slot_map,
        reshard=ReshardRecord(4, 0, 3, (1, 2), "copied"),
    )  # fmt: skip
    assert BrokerState.from_bytes(rec.to_bytes()) == rec
    bad = rec.to_dict()
    bad["slot_map"] = (np.arange(16) % 5).astype("<i4").tobytes()
    with pytest.raises(BrokerStateError, match="slot_map"):
        BrokerState.from_dict(bad)
    bad = rec.to_dict()
    bad["reshard"]["move"][3] = "flying"
    with pytest.raises(BrokerStateError, match="stage"):
        BrokerState.from_dict(bad)


def test_snapshots_and_checkpoints_carry_fences_and_imports() -> None:
    from zps.shard.checkpoint import decode_checkpoint, encode_checkpoint

    src = Shard(0)
    src.core.slots = SlotState.of(np.ones(N_SLOTS, np.bool_), 3)
    src.ok([({"op": "create", "spec": EMB.to_wire()}, {})])
    src.ok([({"op": "slots_fence", **common([1, 2], list(range(N_SLOTS)))}, {})])
    src.core.slots.importing[:] = False
    data = b"".join(bytes(p) for p in encode_checkpoint(src.core.snapshot()))
    copy = ShardCore()
    copy.assign(0, 1, primary=False)
    copy.load_snapshot(decode_checkpoint(data))
    assert copy.slots is not None
    assert copy.slots.fenced.tolist() == src.core.slots.fenced.tolist()
    assert copy.slots.version == 3 and bool(copy.slots.owned.all())


def test_sync_mode_gradients_move_with_their_slots() -> None:
    """Gradients buffered for an uncommitted step travel with the slots: the commit
    applies each once, at the destination for the moved rows, at the source for the rest."""
    src, dst = Shard(0), Shard(1)
    src.core.slots = SlotState.of(np.ones(N_SLOTS, np.bool_))
    dst.core.slots = SlotState.of(np.zeros(N_SLOTS, np.bool_))
    for shard in (src, dst):
        shard.ok([({"op": "create", "spec": EMB.to_wire()}, {})])
    ids = np.arange(1, 501, dtype=np.int64)
    op, arrays = push(ids, 1.0)
    src.ok([({**op, "step": 0}, arrays)])  # buffered until step 0 commits
    moving = list(range(0, N_SLOTS, 2))
    on = np.isin(slots_of_ids(ids, N_SLOTS), moving)
    src.ok([({"op": "slots_fence", **common(moving, list(range(N_SLOTS)))}, {})])
    manifest = src.ok([({"op": "slots_cut", "slots": moving}, {})])["res"]
    assert manifest["steps"] == 1
    got = src.ok([({"op": "slots_cut_read", "steps": True}, {})])
    header = {
        "cid": b"broker",
        "seq": 99,
        "ops": [
            {
                "op": "slots_import",
                **common(moving, []),
                "steps": True,
                "a": got["res"]["a"],
                "committed": manifest["committed"],
            }
        ],
    }
    frames = [
        Route(MsgType.REQUEST, 1, 1, 5).pack(),
        msgpack.packb(header, use_bin_type=True),
        *got["payloads"],
    ]
    msg = decode([bytes(f) for f in frames])
    reply = decode([bytes(f) for f in dst.core.handle(msg.route, msg.header, msg.payloads)])
    assert reply.header["res"][0]["st"] == "OK", reply.header
    dst.ok([({"op": "slots_activate", **common(moving, [])}, {})])
    src.ok([({"op": "slots_release", **common(moving, list(range(N_SLOTS)))}, {})])
    for shard in (src, dst):
        shard.ok([({"op": "commit", "step": 0, "workers": [b"c1"]}, {})])
    assert len(dst.core.store.embedding("emb")) == int(on.sum())
    assert len(src.core.store.embedding("emb")) == int((~on).sum())
    ref = Shard(0)
    ref.ok([({"op": "create", "spec": EMB.to_wire()}, {})])
    ref.ok([({**op, "step": 0}, arrays)])
    ref.ok([({"op": "commit", "step": 0, "workers": [b"c1"]}, {})])
    from zps.protocol.codec import array_from

    def rows(shard: Shard, which: np.ndarray) -> np.ndarray:
        got = shard.ok([pull(which)])
        return array_from(got["res"]["a"], got["payloads"], max_bytes=1 << 30)

    # Each row got step 0's gradient exactly once, wherever it lives now.
    for shard, mask in ((dst, on), (src, ~on)):
        np.testing.assert_array_equal(rows(shard, ids[mask]), rows(ref, ids[mask]))


def test_released_rows_are_dropped_in_steps_while_the_shard_serves() -> None:
    """``slots_compact`` with ``rows``: the drop takes many bounded steps, the shard
    serves pushes, new rows, pulls and snapshots between them, and every copy ends
    with exactly the kept rows, current (a replica that follows the steps, and one
    that joined by snapshot half-way, which the unbounded last call completes)."""
    from zps.protocol.codec import array_from
    from zps.store.slots import Compaction, chunk_slot

    src, ref = Shard(0), Shard(0)
    replica = ShardCore()
    replica.assign(0, 1, primary=False)
    late: ShardCore | None = None
    everything = list(range(N_SLOTS))

    def call(ops: list[tuple[dict[str, Any], dict[str, np.ndarray]]]) -> dict[str, Any]:
        """A request to the primary, replicated to the replicas as a shard does."""
        enc = Encoder()
        wire = [{**op, **{k: enc.array(v) for k, v in arrays.items()}} for op, arrays in ops]
        src.seq += 1
        header = {"cid": b"c1", "seq": src.seq, "ops": wire}
        msg = decode([bytes(f) for f in enc.build(Route(MsgType.REQUEST, 0, 1, 1), header)])
        reply = decode([bytes(f) for f in src.core.handle(msg.route, msg.header, msg.payloads)])
        assert reply.header["st"] == "OK" and reply.header["res"][0]["st"] == "OK", reply.header
        for copy in (replica, late):
            if copy is not None:
                copy.apply_replicated(msg.header, msg.payloads)
        return {"res": reply.header["res"][0], "payloads": list(reply.payloads)}

    src.core.slots = SlotState.of(np.ones(N_SLOTS, np.bool_))
    replica.load_snapshot(src.core.snapshot())
    for shard_call in (call, ref.ok):
        shard_call([({"op": "create", "spec": EMB.to_wire()}, {})])
        shard_call([({"op": "create", "spec": DENSE.to_wire()}, {})])
    ids = np.arange(1, 20_001, dtype=np.int64)
    moving = list(range(0, N_SLOTS, 2))
    kept = ids[~np.isin(slots_of_ids(ids, N_SLOTS), moving)]
    call([push(ids, 1.0)])
    ref.ok([push(kept, 1.0)])
    for c in range(5):
        g = {"g": np.ones(8, np.float32)}
        call([({"op": "push_dense", "t": "w", "chunk": c}, g)])
        if chunk_slot("w", c, N_SLOTS) not in moving:  # the reference: what stays
            ref.ok([({"op": "push_dense", "t": "w", "chunk": c}, g)])
    call([({"op": "slots_fence", **common(moving, everything)}, {})])
    call([({"op": "slots_release", **common(moving, everything), "drop": False}, {})])
    table = src.core.store.embedding("emb")
    assert len(table) == ids.size  # released rows still held

    rng = np.random.default_rng(3)
    fresh = np.arange(100_000, 101_000, dtype=np.int64)
    fresh = fresh[~np.isin(slots_of_ids(fresh, N_SLOTS), moving)]  # new rows, on kept slots
    budget = 1000
    steps = served = 0
    done = False
    while not done:
        res = call([({"op": "slots_compact", "rows": budget}, {})])["res"]
        steps += 1
        done = res["done"]
        if steps == 1:
            # The first step dropped no embedding row: the table is still whole.
            assert len(src.core.store.embedding("emb")) == ids.size
        if not done:
            assert src.core.slots is not None
            comp = src.core.slots.compaction
            assert isinstance(comp, Compaction) and comp.steps == steps
        # Served between steps: pushes to kept rows (copied already or not), new rows
        # on kept slots, pulls equal to the reference.
        some = rng.choice(kept, 50, replace=False)
        new = fresh[steps : steps + 1]
        for shard_call in (call, ref.ok):
            shard_call([push(some, float(steps))])
            shard_call([push(new, 2.0)])
        got, want = call([pull(some)]), ref.ok([pull(some)])
        np.testing.assert_array_equal(
            array_from(got["res"]["a"], got["payloads"], max_bytes=1 << 30),
            array_from(want["res"]["a"], want["payloads"], max_bytes=1 << 30),
        )
        served += 1
        if steps == 20:  # a replica joins by snapshot half-way
            late = ShardCore()
            late.assign(0, 1, primary=False)
            late.load_snapshot(src.core.snapshot())
    # Bounded steps: the scan, the index's fill and the copy, each a share at a time.
    assert steps > ids.size // budget and served == steps
    call([({"op": "slots_compact"}, {})])  # the last, unbounded: a no-op on the primary
    assert late is not None
    for store in (src.core.store, replica.store, late.store):
        assert store.checksum() == ref.core.store.checksum()
        assert len(store.embedding("emb")) == len(ref.core.store.embedding("emb"))


def _copy_cut(
    src: Shard, dst: Shard, cut: dict[str, Any], moving: list[int], fresh: bool = False
) -> dict[str, Any]:
    """Take the source's cut ``cut`` and import every piece at the destination, as the
    broker does (payload frames forwarded as they are; ``fresh``: the move's first
    copy); the manifest."""
    manifest: dict[str, Any] = src.ok([(cut, {})])["res"]
    for table in manifest.get("tables", []):
        read: dict[str, Any] = {"op": "slots_cut_read", "t": table["spec"]["name"]}
        extra: dict[str, Any] = {}
        if "n" in table:
            read |= {"start": 0, "count": table["n"]}
        else:
            read["chunks"] = extra["chunks"] = table["chunks"]
        got = src.ok([(read, {})])
        imp = {"op": "slots_import", **common(moving, []), "spec": table["spec"], **extra}
        if fresh:
            imp["fresh"] = True
        dst.seq += 1
        header = {"cid": b"broker", "seq": dst.seq, "ops": [{**imp, "a": got["res"]["a"]}]}
        frames = [
            Route(MsgType.REQUEST, dst.partition, 1, 5).pack(),
            msgpack.packb(header, use_bin_type=True),
            *got["payloads"],
        ]
        msg = decode([bytes(f) for f in frames])
        reply = decode([bytes(f) for f in dst.core.handle(msg.route, msg.header, msg.payloads)])
        assert reply.header["res"][0]["st"] == "OK", reply.header
    return manifest


def test_catch_up_copies_only_the_rows_written_after_the_unfenced_copy() -> None:
    """A move with catch-up: the slots are copied while the source serves them, and the
    cut taken once they are fenced holds only the rows written since (new ones too);
    the destination then holds what a never-moved table holds.  A new primary of the
    source (no list of writes) refuses the fenced cut: the move is cancelled."""
    from zps.protocol.codec import array_from

    src, dst, ref = Shard(0), Shard(1), Shard(0)
    everything = list(range(N_SLOTS))
    src.core.slots = SlotState.of(np.ones(N_SLOTS, np.bool_))
    dst.core.slots = SlotState.of(np.zeros(N_SLOTS, np.bool_))
    for shard in (src, dst, ref):
        shard.ok([({"op": "create", "spec": EMB.to_wire()}, {})])
        shard.ok([({"op": "create", "spec": DENSE.to_wire()}, {})])
    ids = np.arange(1, 3001, dtype=np.int64)
    moving = list(range(0, N_SLOTS, 2))
    on = np.isin(slots_of_ids(ids, N_SLOTS), moving)
    for shard in (src, ref):
        shard.ok([push(ids, 1.0)])
        for c in range(5):
            shard.ok([({"op": "push_dense", "t": "w", "chunk": c}, {"g": np.ones(8, np.float32)})])

    dst.ok([({"op": "slots_import", **common(moving, [])}, {})])
    track = {"op": "slots_cut", **common(moving, everything), "track": True}
    first = _copy_cut(src, dst, track, moving, fresh=True)
    assert first["rows"] == int(on.sum())
    assert len(dst.core.store.embedding("emb")) == first["rows"]
    assert dst.core.slots is not None and dst.core.slots.vacant is not None  # no lookup
    # Served during the copy: writes to 40 rows on the moving slots (twice to some),
    # 5 new rows there, and rows elsewhere, which do not move.
    written = ids[on][:40]
    new = np.arange(10_001, 10_200, dtype=np.int64)
    new = new[np.isin(slots_of_ids(new, N_SLOTS), moving)][:5]
    for shard in (src, ref):
        shard.ok([push(written, 2.0)])
        shard.ok([push(written[:10], 3.0)])
        shard.ok([push(new, 4.0)])
        shard.ok([push(ids[~on][:100], 5.0)])
        shard.ok([({"op": "push_dense", "t": "w", "chunk": 0}, {"g": np.ones(8, np.float32)})])

    # A source that failed over holds no list of writes: the fenced cut is refused.
    promoted = Shard(0)
    promoted.core.load_snapshot(src.core.snapshot())
    promoted.ok([({"op": "slots_fence", **common(moving, everything)}, {})])
    header, _ = promoted.call([({"op": "slots_cut", "slots": moving, "delta": True}, {})])
    assert header["res"][0]["st"] == "BAD_REQUEST", header

    src.ok([({"op": "slots_fence", **common(moving, everything)}, {})])
    delta = _copy_cut(src, dst, {"op": "slots_cut", "slots": moving, "delta": True}, moving)
    assert dst.core.slots.vacant is None  # the delta's rows were there already
    # Only the rows written since the first copy, on the moving slots.
    assert delta["rows"] == written.size + new.size
    dst.ok([({"op": "slots_activate", **common(moving, [])}, {})])
    src.ok([({"op": "slots_release", **common(moving, everything)}, {})])

    def rows(shard: Shard, which: np.ndarray) -> np.ndarray:
        got = shard.ok([pull(which)])
        return array_from(got["res"]["a"], got["payloads"], max_bytes=1 << 30)

    moved = np.concatenate([ids[on], new])
    for shard in (dst, ref):
        shard.ok([push(moved, 0.5)])  # the Adagrad state moved too
    np.testing.assert_array_equal(rows(dst, moved), rows(ref, moved))
    np.testing.assert_array_equal(rows(src, ids[~on]), rows(ref, ids[~on]))
    assert len(dst.core.store.embedding("emb")) == moved.size
    src_chunks = set(src.core.store.dense("w").chunks())
    dst_chunks = set(dst.core.store.dense("w").chunks())
    assert src_chunks | dst_chunks == set(range(5)) and not src_chunks & dst_chunks
    for c in dst_chunks:
        np.testing.assert_array_equal(
            dst.core.store.dense("w").pull(c), ref.core.store.dense("w").pull(c)
        )


def test_a_table_rebuilt_during_the_unfenced_copy_makes_the_move_copy_again() -> None:
    """Rows that go from the source during the first copy (a table dropped, or rows
    evicted) would stay at the destination: the fenced cut answers ``rebuilt``."""
    src = Shard(0)
    src.core.slots = SlotState.of(np.ones(N_SLOTS, np.bool_))
    src.ok([({"op": "create", "spec": EMB.to_wire()}, {})])
    src.ok([push(np.arange(1, 101, dtype=np.int64))])
    everything, moving = list(range(N_SLOTS)), list(range(0, N_SLOTS, 2))
    src.ok([({"op": "slots_cut", **common(moving, everything), "track": True}, {})])
    src.ok([({"op": "drop", "t": "emb"}, {})])
    src.ok([({"op": "slots_fence", **common(moving, everything)}, {})])
    res = src.ok([({"op": "slots_cut", "slots": moving, "delta": True}, {})])["res"]
    assert res.get("rebuilt") is True
    # Copied whole under the fence instead.
    assert src.ok([({"op": "slots_cut", "slots": moving}, {})])["res"]["rows"] == 0


def test_slots_of_an_index_are_hashed_once_and_follow_its_inserts() -> None:
    index = IdIndex()
    index.insert(np.arange(1, 1001, dtype=np.int64))
    first = index_slots(index, N_SLOTS)
    np.testing.assert_array_equal(first, slots_of_ids(index.ids(), N_SLOTS))
    index.get_or_insert(np.arange(500, 3001, dtype=np.int64))  # half new
    np.testing.assert_array_equal(index_slots(index, N_SLOTS), slots_of_ids(index.ids(), N_SLOTS))
    np.testing.assert_array_equal(index_slots(index, 128), slots_of_ids(index.ids(), 128))
    other = IdIndex()
    other.insert(np.arange(7, 20, dtype=np.int64))
    np.testing.assert_array_equal(index_slots(other, N_SLOTS), slots_of_ids(other.ids(), N_SLOTS))


def test_a_first_copy_onto_slots_holding_rows_there_merges_them() -> None:
    """Rows the destination still holds on the slots (released there, not yet dropped):
    the move's first copy (``fresh``) finds them, one row per id, the values moved."""
    from zps.protocol.codec import array_from

    src, dst = Shard(0), Shard(1)
    everything, moving = list(range(N_SLOTS)), list(range(0, N_SLOTS, 2))
    src.core.slots = SlotState.of(np.ones(N_SLOTS, np.bool_))
    dst.core.slots = SlotState.of(np.ones(N_SLOTS, np.bool_))
    ids = np.arange(1, 1001, dtype=np.int64)
    on = np.isin(slots_of_ids(ids, N_SLOTS), moving)
    for shard, v in ((src, 2.0), (dst, 9.0)):
        shard.ok([({"op": "create", "spec": EMB.to_wire()}, {})])
        shard.ok([push(ids, v)])
    dst.ok([({"op": "slots_release", **common(everything, everything), "drop": False}, {})])
    assert len(dst.core.store.embedding("emb")) == ids.size  # left for slots_compact

    dst.ok([({"op": "slots_import", **common(moving, [])}, {})])
    assert dst.core.slots is not None and dst.core.slots.vacant is None
    track = {"op": "slots_cut", **common(moving, everything), "track": True}
    _copy_cut(src, dst, track, moving, fresh=True)
    assert len(dst.core.store.embedding("emb")) == ids.size
    dst.ok([({"op": "slots_activate", **common(moving, [])}, {})])
    got = dst.ok([pull(ids[on])])
    want = src.ok([pull(ids[on])])
    np.testing.assert_array_equal(
        array_from(got["res"]["a"], got["payloads"], max_bytes=1 << 30),
        array_from(want["res"]["a"], want["payloads"], max_bytes=1 << 30),
    )


def test_imported_new_rows_go_through_the_memory_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece of new rows lands as a slice written in the kernel (mapped.write_at: no
    page faults) where the table's arrays are memory files, by numpy where one is frozen
    (a checkpoint's cut); the rows and state read back the same either way."""
    from zps.store import mapped
    from zps.store.partition import PartitionStore
    from zps.store.slots import load_rows

    if not mapped.FREEZABLE:
        pytest.skip("no memory files here")
    taken: list[bool] = []
    real = mapped.write_at

    def write_at(arr: np.ndarray, offset: int, data: memoryview) -> bool:
        taken.append(real(arr, offset, data))
        return taken[-1]

    monkeypatch.setattr(mapped, "write_at", write_at)
    spec = EmbeddingSpec("big", 32, "float32", Zeros(), Adagrad(lr=0.1), 3)
    store = PartitionStore()
    rng = np.random.default_rng(5)

    def piece(first: int, n: int) -> dict[str, np.ndarray]:
        ids = np.arange(first, first + n, dtype=np.int64)
        return {
            "ids": ids,
            "rows": rng.random((n, 32), dtype=np.float32),
            "accumulator": rng.random((n, 32), dtype=np.float32),
        }

    a = piece(1, 20_000)
    assert load_rows(store, spec.to_wire(), a, absent=True) == 20_000
    assert taken == [True, True]
    table = store.table("big")
    frozen = mapped.freeze(table._rows)
    assert frozen is not None
    try:
        b = piece(20_001, 5_000)
        load_rows(store, spec.to_wire(), b, absent=True)
    finally:
        frozen.release()
    assert taken[2] is False  # the rows' array frozen: numpy wrote them
    for p in (a, b):
        pos = table._index.lookup(p["ids"])
        assert np.array_equal(table._rows[pos], p["rows"])
        assert np.array_equal(table._state["accumulator"][pos], p["accumulator"])
