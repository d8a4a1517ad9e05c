"""A shard's request handling: operations, refusals, per-op statuses and dedup."""

from __future__ import annotations

import tracemalloc
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zps.errors import _BY_CODE
from zps.init import Constant, Zeros
from zps.optim import SGD
from zps.protocol.codec import CompressPolicy, Encoder, MsgType, Route, array_from, decode
from zps.shard.core import FLOOR_OVERHEAD, OK, DedupCache, Handled, Limits, ShardCore
from zps.store import DenseSpec, EmbeddingSpec
from zps.store.snapshot import decode_snapshot, encode_snapshot

PARTITION, EPOCH = 2, 5
DENSE = DenseSpec("w", (10,), "float32", Zeros(), SGD(lr=1.0), 1, 4)  # chunks of 4, 4, 2
EMB = EmbeddingSpec("emb", 3, "float64", Constant(0.5), SGD(lr=1.0), 2)
STATUSES = {"OK", *_BY_CODE}

Op = tuple[dict[str, Any], dict[str, np.ndarray]]


@dataclass
class Reply:
    route: Route
    header: dict[str, Any]
    payloads: list[Any]

    @property
    def st(self) -> str:
        return str(self.header["st"])

    @property
    def statuses(self) -> list[str]:
        return [r["st"] for r in self.header["res"]]

    def arrays(self, i: int) -> list[np.ndarray]:
        a = self.header["res"][i]["a"]
        descs = a if a and isinstance(a[0], list) else [a]
        return [array_from(d, self.payloads, max_bytes=1 << 30) for d in descs]


def frames_for(
    ops: list[Op],
    *,
    cid: bytes | None = None,
    seq: int | None = None,
    partition: int = PARTITION,
    epoch: int = EPOCH,
    req_id: int = 77,
) -> list[Any]:
    enc = Encoder(CompressPolicy())
    wire_ops = []
    for op, arrays in ops:
        wire_ops.append({**op, **{k: enc.array(v) for k, v in arrays.items()}})
    header: dict[str, Any] = {"ops": wire_ops}
    if cid is not None:
        header["cid"] = cid
    if seq is not None:
        header["seq"] = seq
    return enc.build(Route(MsgType.REQUEST, partition, epoch, req_id), header)


def handle_frames(core: ShardCore, frames: list[Any]) -> Reply:
    msg = decode([bytes(f) for f in frames])
    out = core.handle(msg.route, msg.header, msg.payloads)
    reply = decode([bytes(f) for f in out])
    assert reply.route.mtype is MsgType.REPLY
    return Reply(reply.route, reply.header, list(reply.payloads))


def call(core: ShardCore, ops: list[Op], **kw: Any) -> Reply:
    return handle_frames(core, frames_for(ops, **kw))


def create(spec: DenseSpec | EmbeddingSpec) -> Op:
    return {"op": "create", "spec": spec.to_wire()}, {}


def pull_dense(chunks: list[int], t: str = "w") -> Op:
    return {"op": "pull_dense", "t": t, "chunks": chunks}, {}


def push_dense(chunk: int, g: np.ndarray, t: str = "w") -> Op:
    return {"op": "push_dense", "t": t, "chunk": chunk}, {"g": g}


def pull_rows(ids: list[int], t: str = "emb") -> Op:
    return {"op": "pull_rows", "t": t}, {"ids": np.array(ids, dtype=np.int64)}


def push_rows(ids: list[int], g: np.ndarray, t: str = "emb") -> Op:
    return {"op": "push_rows", "t": t}, {"ids": np.array(ids, dtype=np.int64), "g": g}


def checksum() -> Op:
    return {"op": "checksum"}, {}


def new_core(**kw: Any) -> ShardCore:
    core = ShardCore(**kw)
    core.assign(PARTITION, EPOCH)
    reply = call(core, [create(DENSE), create(EMB)])
    assert reply.statuses == ["OK", "OK"]
    return core


# ---- operations -------------------------------------------------------------


def test_create_is_idempotent_and_conflicts_are_per_op() -> None:
    core = new_core()
    other = DenseSpec("w", (11,), "float32", Zeros(), SGD(lr=1.0), 1, 4)
    reply = call(core, [create(DENSE), create(other), create(EMB)])
    assert reply.st == "OK"
    assert reply.statuses == ["OK", "TABLE_CONFLICT", "OK"]
    assert reply.header["res"][0]["created"] is False
    assert "shape" in reply.header["res"][1]["msg"]
    tables = call(core, [({"op": "tables"}, {})]).header["res"][0]["tables"]
    assert [t["name"] for t in tables] == ["emb", "w"]


def test_bad_spec_is_a_bad_request() -> None:
    core = new_core()
    reply = call(core, [({"op": "create", "spec": {"kind": "dense"}}, {})])
    assert reply.statuses == ["BAD_REQUEST"]


def test_dense_pull_and_push() -> None:
    core = new_core()
    reply = call(core, [pull_dense([0, 2])])
    a0, a2 = reply.arrays(0)
    assert a0.dtype == np.float32 and a0.shape == (4,) and a2.shape == (2,)
    assert not a0.any() and not a2.any()
    reply = call(core, [push_dense(2, np.array([1.0, -2.0], dtype=np.float32))])
    assert reply.statuses == ["OK"]
    (a2,) = call(core, [pull_dense([2])]).arrays(0)
    assert a2.tolist() == [-1.0, 2.0]  # SGD with lr 1 from zeros
    (a0,) = call(core, [pull_dense([0])]).arrays(0)
    assert not a0.any()


def test_embedding_pull_and_push() -> None:
    core = new_core()
    (rows,) = call(core, [pull_rows([5, -3, 5])]).arrays(0)
    assert rows.shape == (3, 3) and rows.dtype == np.float64
    assert (rows == 0.5).all()
    g = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    assert call(core, [push_rows([5, 9], g)]).statuses == ["OK"]
    (rows,) = call(core, [pull_rows([5, 9, -3])]).arrays(0)
    assert rows.tolist() == [[-0.5, 0.5, 0.5], [0.5, 0.5, -1.5], [0.5, 0.5, 0.5]]


def test_reply_route_echoes_the_request() -> None:
    core = new_core()
    reply = call(core, [checksum()], req_id=2**60)
    assert reply.route == Route(MsgType.REPLY, PARTITION, EPOCH, 2**60)


# ---- refusals ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("partition", "epoch", "status"),
    [
        (PARTITION + 1, EPOCH, "NOT_PRIMARY"),
        (-1, EPOCH, "NOT_PRIMARY"),
        (PARTITION, EPOCH - 1, "STALE_EPOCH"),
        (PARTITION, EPOCH + 1, "STALE_EPOCH"),
    ],
)
def test_wrong_partition_or_epoch_is_refused_and_changes_nothing(
    partition: int, epoch: int, status: str
) -> None:
    core = new_core()
    before = core.store.checksum(), core.lsn
    ops = [
        push_dense(0, np.ones(4, np.float32)),
        push_rows([1], np.ones((1, 3))),
        create(DenseSpec("x", (3,), "float32", Zeros(), SGD(), 0, 3)),
    ]
    reply = call(core, ops, cid=b"c", seq=1, partition=partition, epoch=epoch)
    assert reply.st == status and "res" not in reply.header
    assert reply.route.partition == partition and reply.route.epoch == EPOCH
    assert (core.store.checksum(), core.lsn) == before
    assert len(core.dedup) == 0
    # The refusal is not remembered: the same message at the right address is applied.
    assert call(core, ops, cid=b"c", seq=1).statuses == ["OK", "OK", "OK"]


def test_an_unassigned_shard_refuses_everything() -> None:
    core = ShardCore()
    assert call(core, [checksum()], partition=0, epoch=0).st == "NOT_PRIMARY"


def test_assign_keeps_data_for_the_same_partition_only() -> None:
    core = new_core()
    call(core, [push_dense(0, np.ones(4, np.float32))])
    before = core.store.checksum()
    core.assign(PARTITION, EPOCH + 1)  # e.g. a claim accepted after a broker restart
    assert core.store.checksum() == before and core.lsn == 3
    assert call(core, [checksum()]).st == "STALE_EPOCH"
    assert call(core, [checksum()], epoch=EPOCH + 1).statuses == ["OK"]
    core.assign(PARTITION + 1, 1)
    assert len(core.store) == 0 and core.lsn == 0 and len(core.dedup) == 0


# ---- per-op statuses --------------------------------------------------------


def test_each_op_in_a_mixed_batch_gets_its_own_status() -> None:
    core = new_core()
    ops: list[Op] = [
        push_dense(0, np.ones(4, np.float32), t="nope"),  # UNKNOWN_TABLE
        push_dense(1, np.full(4, 2.0, np.float32)),  # OK
        push_dense(2, np.ones(3, np.float32)),  # chunk 2 has 2 elements
        push_dense(9, np.ones(4, np.float32)),  # no chunk 9
        push_rows([1, 2], np.ones((2, 4))),  # dim is 3
        pull_rows([1], t="w"),  # a dense tensor
        pull_dense([0], t="emb"),  # an embedding table
        ({"op": "frobnicate"}, {}),
        ({"t": "w"}, {}),
        ({"op": "push_dense", "t": "w", "chunk": 0}, {}),  # lacks "g"
        ({"op": "push_dense", "t": "w", "chunk": "0"}, {"g": np.ones(4, np.float32)}),
        ({"op": "pull_dense", "t": "w", "chunks": 0}, {}),
        ({"op": "pull_dense", "chunks": [0]}, {}),  # no table name
        (
            {"op": "pull_rows", "t": "emb", "ids": [0, "int64", [1], 0]},
            {},
        ),  # frame 0 is op 0's 16-byte "g"
        push_rows([3], np.array([[np.nan, 0, 0]])),  # NaN gradient
        pull_rows([4]),  # OK
    ]
    reply = call(core, ops)
    assert reply.st == "OK"
    assert reply.statuses == [
        "UNKNOWN_TABLE",
        "OK",
        "SHAPE_MISMATCH",
        "BAD_REQUEST",
        "SHAPE_MISMATCH",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "OK",
    ]
    assert all(r.get("msg") for r in reply.header["res"] if r["st"] != "OK")
    # The good push was applied, none of the bad ones.
    chunks = call(core, [pull_dense([0, 1, 2])]).arrays(0)
    assert [c.tolist() for c in chunks] == [[0.0] * 4, [-2.0] * 4, [0.0] * 2]
    (row,) = call(core, [pull_rows([3])]).arrays(0)
    assert row.tolist() == [[0.5] * 3]
    assert core.lsn == 3  # two creates and the one good push


def test_frame_index_of_another_op_is_a_bad_request() -> None:
    # Op 0 names payload frame 5, which does not exist: only op 0 fails.
    core = new_core()
    reply = call(
        core,
        [({"op": "pull_rows", "t": "emb", "ids": [5, "int64", [1], 0]}, {}), pull_rows([1])],
    )
    assert reply.statuses == ["BAD_REQUEST", "OK"]


@pytest.mark.parametrize(
    "ids",
    [np.array([1, 2], dtype=np.int32), np.array([[1, 2]], dtype=np.int64), np.array([1.0, 2.0])],
)
def test_ids_must_be_a_flat_int64_array(ids: np.ndarray) -> None:
    core = new_core()
    reply = call(core, [({"op": "pull_rows", "t": "emb"}, {"ids": ids})])
    assert reply.statuses == ["BAD_REQUEST"]


def test_too_many_ids_is_a_bad_request() -> None:
    core = new_core(limits=Limits(max_ids=4))
    before = core.store.checksum()
    reply = call(
        core,
        [
            pull_rows(list(range(5))),
            push_rows(list(range(5)), np.ones((5, 3))),
            pull_rows(list(range(4))),
        ],
    )
    assert reply.statuses == ["BAD_REQUEST", "BAD_REQUEST", "OK"]
    assert "limit" in reply.header["res"][0]["msg"]
    assert len(core.store.embedding("emb")) == 0  # nothing was applied; reads store nothing
    assert core.store.checksum() == before


def test_too_large_an_array_is_a_bad_request() -> None:
    core = new_core(limits=Limits(max_array_bytes=8 * 3))
    reply = call(core, [pull_rows([1, 2, 3]), pull_rows([1, 2, 3, 4])])
    assert reply.statuses == ["OK", "BAD_REQUEST"]


# ---- malformed headers ------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        {},
        {"ops": None},
        {"ops": []},
        {"ops": "checksum"},
        {"ops": {"op": "checksum"}},
        {"ops": [{"op": "checksum"}] * 4},  # over Limits(max_ops=3)
        {"ops": [{"op": "checksum"}], "cid": "text", "seq": 1},
        {"ops": [{"op": "checksum"}], "cid": b"", "seq": 1},
        {"ops": [{"op": "checksum"}], "cid": b"x" * 65, "seq": 1},
        {"ops": [{"op": "checksum"}], "cid": b"c", "seq": "1"},
        {"ops": [{"op": "checksum"}], "cid": b"c", "seq": 1.0},
        {"ops": [{"op": "checksum"}], "cid": b"c", "seq": True},
        {"ops": [{"op": "checksum"}], "cid": b"c", "seq": None},
        {"ops": [{"op": "checksum"}], "seq": 1},
        {"ops": [{"op": "checksum"}], "cid": 7},
    ],
)
def test_malformed_headers_get_bad_request(header: dict[str, Any]) -> None:
    core = new_core(limits=Limits(max_ops=3))
    before = core.store.checksum(), core.lsn, core.stats.ops
    route = Route(MsgType.REQUEST, PARTITION, EPOCH, 1)
    out = core.handle(route, header, [])
    reply = decode(out)
    assert reply.header["st"] == "BAD_REQUEST" and reply.header["msg"]
    assert "res" not in reply.header
    assert core.stats.malformed == 1
    assert (core.store.checksum(), core.lsn, core.stats.ops) == before


def test_max_ops_is_inclusive() -> None:
    core = new_core(limits=Limits(max_ops=3))
    assert call(core, [checksum()] * 3).statuses == ["OK"] * 3


@pytest.mark.parametrize("name", [[], {}, [1, 2], {"a": 1}, None, 7, b"push_rows", 1.5])
def test_ops_with_odd_names_are_bad_requests(name: object) -> None:
    core = new_core()
    for kw in ({}, {"cid": b"c", "seq": 1}):  # with and without dedup bookkeeping
        reply = call(core, [({"op": name}, {}), checksum()], **kw)
        assert reply.statuses == ["BAD_REQUEST", "OK"]


def test_unknown_op_names_do_not_grow_the_counters() -> None:
    core = new_core()
    for i in range(50):
        call(core, [({"op": f"bogus-{i}"}, {})])
    call(core, [checksum()])
    assert set(core.stats.by_op) == {"create", "checksum"}
    assert core.stats.by_op["create"] == 2


# ---- dedup ------------------------------------------------------------------


def test_a_retried_message_is_applied_once_but_its_pulls_run_again() -> None:
    core = new_core()
    ops = [
        push_rows([1, 2], np.ones((2, 3))),
        push_dense(0, np.ones(4, np.float32)),
        pull_rows([1]),
        pull_dense([0]),
        push_rows([7], np.ones((1, 3)), t="missing"),
    ]
    frames = frames_for(ops, cid=b"client-1", seq=41)
    first = handle_frames(core, frames)
    assert first.statuses == ["OK", "OK", "OK", "OK", "UNKNOWN_TABLE"]
    after_one = core.store.checksum(), core.lsn
    second = handle_frames(core, frames)
    assert second.header["res"] == first.header["res"][:2] + second.header["res"][2:4] + [
        first.header["res"][4]
    ]
    assert second.statuses == first.statuses
    assert (core.store.checksum(), core.lsn) == after_one
    assert core.stats.duplicates == 1
    # Pulls still return data, and it is the data after the one application.
    assert second.arrays(2)[0].tolist() == [[-0.5, -0.5, -0.5]]
    assert second.arrays(3)[0].tolist() == [-1.0] * 4
    # A new seq, or another client with the same seq, is a new message.
    handle_frames(core, frames_for(ops, cid=b"client-1", seq=42))
    handle_frames(core, frames_for(ops, cid=b"client-2", seq=41))
    (row,) = call(core, [pull_rows([1])]).arrays(0)
    assert row.tolist() == [[-2.5, -2.5, -2.5]]
    assert core.stats.duplicates == 1


def split_call(
    core: ShardCore, ops: list[Op], acked: Any = None, **kw: Any
) -> tuple[Reply, Handled]:
    msg = decode([bytes(f) for f in frames_for(ops, **kw)])
    done = core.handle_request(msg.route, msg.header, msg.payloads, split=True, acked=acked)
    reply = decode([bytes(f) for f in done.reply])
    return Reply(reply.route, reply.header, list(reply.payloads)), done


def test_a_split_reply_answers_the_reads_and_keeps_the_writes_statuses() -> None:
    core = new_core()
    ops = [push_rows([1], np.ones((1, 3))), pull_rows([1]), push_dense(9, np.ones(4, np.float32))]
    carried = [[5, [{"st": "OK"}]]]
    reply, done = split_call(core, ops, acked=carried, cid=b"c", seq=1)
    # The pull sees the push before it; each write's result waits (None).
    assert reply.header["part"] == 1 and reply.header["acked"] == carried
    assert done.changed and done.carried and not done.duplicate
    res = reply.header["res"]
    assert res[0] is None and res[2] is None and res[1]["st"] == "OK"
    assert reply.arrays(1)[0].tolist() == [[-0.5, -0.5, -0.5]]
    # The writes' statuses, as the dedup record answers a re-sent copy.
    writes = done.writes_res
    assert writes is not None and writes[2] is not None
    assert writes == [{"st": "OK"}, None, writes[2]]  # None: a read's place
    assert writes[2]["st"] == "BAD_REQUEST"  # chunk 9 does not exist
    # A duplicate changes nothing: one reply.
    resent, again = split_call(core, ops, cid=b"c", seq=1)
    assert "part" not in resent.header and again.writes_res is None
    assert again.duplicate and not again.changed and not again.clean
    assert [r["st"] for r in resent.header["res"]] == ["OK", "OK", "BAD_REQUEST"]


def test_only_a_request_that_both_writes_and_reads_is_split() -> None:
    core = new_core()
    writes = split_call(core, [push_rows([1], np.ones((1, 3))), push_rows([2], np.ones((1, 3)))])
    reads = split_call(core, [pull_rows([1]), pull_rows([2])])
    one = split_call(core, [push_rows([1], np.ones((1, 3)))])
    for reply, done in (writes, reads, one):
        assert "part" not in reply.header and all(r is not None for r in reply.header["res"])
        assert done.writes_res is None and done.clean
    failed, done = split_call(core, [push_rows([1], np.ones((1, 2))), pull_rows([1])])  # bad shape
    assert "part" not in failed.header  # nothing changed: answered whole, at once
    assert not done.changed and not done.clean


def test_held_answers_ride_on_any_answered_reply_and_acks_does_nothing() -> None:
    core = new_core()
    carried = [[5, [{"st": "OK"}]]]
    lsn = core.lsn
    reply, done = split_call(core, [({"op": "acks"}, {})], acked=carried)
    assert reply.statuses == ["OK"] and reply.header["acked"] == carried and done.carried
    assert core.lsn == lsn and not done.changed  # a read: nothing to replicate
    stale, done = split_call(core, [pull_rows([1])], acked=carried, epoch=EPOCH - 1)
    assert stale.st == "STALE_EPOCH" and "acked" not in stale.header and not done.carried
    # A write's reply may wait, and be refused: it carries nothing.
    write, done = split_call(core, [push_rows([1], np.ones((1, 3)))], acked=carried)
    assert write.statuses == ["OK"] and "acked" not in write.header and not done.carried


def test_a_recorded_failure_is_answered_again_not_retried() -> None:
    core = new_core()
    op = push_dense(0, np.ones(4, np.float32), t="later")
    assert call(core, [op], cid=b"c", seq=1).statuses == ["UNKNOWN_TABLE"]
    call(core, [create(DenseSpec("later", (4,), "float32", Zeros(), SGD(lr=1.0), 0, 4))])
    assert call(core, [op], cid=b"c", seq=1).statuses == ["UNKNOWN_TABLE"]
    (values,) = call(core, [pull_dense([0], t="later")]).arrays(0)
    assert not values.any()


def test_messages_without_a_client_id_are_not_deduplicated() -> None:
    core = new_core()
    frames = frames_for([push_rows([1], np.ones((1, 3)))])
    handle_frames(core, frames)
    handle_frames(core, frames)
    (row,) = call(core, [pull_rows([1])]).arrays(0)
    assert row.tolist() == [[-1.5] * 3]
    assert core.stats.duplicates == 0 and len(core.dedup) == 0


def test_read_only_messages_are_not_recorded() -> None:
    core = new_core()
    frames = frames_for([pull_rows([1]), checksum()], cid=b"c", seq=3)
    handle_frames(core, frames)
    handle_frames(core, frames)
    assert len(core.dedup) == 0 and core.stats.duplicates == 0


def test_dedup_cache_evicts_the_oldest() -> None:
    cache = DedupCache(capacity=2)
    cache.put((b"a", 1), [{"st": "OK"}])
    cache.put((b"a", 2), [{"st": "X"}])
    cache.put((b"b", 1), [{"st": "Y"}])
    assert len(cache) == 2
    assert cache.get((b"a", 1)) is None
    assert cache.get((b"a", 2)) == [{"st": "X"}] and cache.get((b"b", 1)) == [{"st": "Y"}]


def test_an_evicted_message_is_refused_not_applied_again() -> None:
    core = new_core()
    core.dedup = DedupCache(capacity=1)
    push = [push_rows([1], np.ones((1, 3)))]
    handle_frames(core, frames_for(push, cid=b"c", seq=1))
    handle_frames(core, frames_for(push, cid=b"c", seq=2))  # evicts seq 1
    handle_frames(core, frames_for(push, cid=b"c", seq=2))  # a duplicate: skipped
    assert core.stats.duplicates == 1
    lsn = core.lsn
    again = handle_frames(core, frames_for(push, cid=b"c", seq=1))  # forgotten: refused
    assert again.statuses == ["BAD_REQUEST"]
    msg = again.header["res"][0]["msg"]
    assert "message 1 of client b'c'" in msg and "dedup record" in msg and "up to 1" in msg
    assert core.lsn == lsn and core.stats.expired == 1
    (row,) = call(core, [pull_rows([1])]).arrays(0)
    assert row.tolist() == [[-1.5] * 3]
    # Newer messages, and other clients' old seqs, are applied as usual.
    assert call(core, push, cid=b"c", seq=3).statuses == ["OK"]
    assert call(core, push, cid=b"d", seq=1).statuses == ["OK"]
    (row,) = call(core, [pull_rows([1])]).arrays(0)
    assert row.tolist() == [[-3.5] * 3]


def test_a_checkpoint_keeps_the_dedup_floors() -> None:
    from zps.shard.checkpoint import cut, decode_checkpoint, encode_checkpoint, finish

    core = new_core()
    core.dedup = DedupCache(capacity=1)
    push = [push_rows([1], np.ones((1, 3)))]
    handle_frames(core, frames_for(push, cid=b"c", seq=1))
    handle_frames(core, frames_for(push, cid=b"c", seq=2))  # evicts seq 1: floor 1
    data = b"".join(bytes(p) for p in encode_checkpoint(finish(cut(core))))
    restored = new_core()
    restored.load_snapshot(decode_checkpoint(data))
    lsn = restored.lsn
    again = handle_frames(restored, frames_for(push, cid=b"c", seq=1))
    assert again.statuses == ["BAD_REQUEST"] and restored.lsn == lsn  # not applied twice


def test_the_reads_of_an_expired_message_still_run() -> None:
    core = new_core()
    core.dedup = DedupCache(capacity=1)
    call(core, [push_rows([1], np.ones((1, 3)))], cid=b"c", seq=1)
    call(core, [push_rows([1], np.ones((1, 3)))], cid=b"c", seq=2)
    reply = call(core, [push_rows([1], np.ones((1, 3))), pull_rows([1])], cid=b"c", seq=1)
    assert reply.statuses == ["BAD_REQUEST", "OK"]
    assert reply.arrays(1)[0].tolist() == [[-1.5] * 3]


def _failing_request(n: int, tag: int) -> list[dict[str, Any]]:
    """Statuses like those of a max-size request whose operations all failed."""
    return [
        {"st": "UNKNOWN_TABLE", "msg": f"no table {tag:08d}-{i:06d}" + "x" * 270} for i in range(n)
    ]


def test_dedup_bytes_count_what_the_entries_hold() -> None:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        cache = DedupCache(max_bytes=1 << 40)
        for seq in range(20):
            cache.put((b"client-%d" % (seq % 3), seq), _failing_request(512, seq))
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # Counted from above (a status code shared by many statuses counts in each),
    # and not by much.
    assert held <= cache.nbytes <= held * 1.25, (held, cache.nbytes)


def test_small_entries_and_floors_are_counted_from_above() -> None:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        cache = DedupCache(max_bytes=1 << 40)
        for seq in range(20_000):  # a fresh client id per entry, as decoded from a header
            cache.put((bytes(bytearray(b"client-%d" % (seq % 5))), seq), [OK, OK])
        held = tracemalloc.get_traced_memory()[0] - base
        assert held <= cache.nbytes <= held * 1.5, (held, cache.nbytes)
        cache.max_bytes = 0  # everything goes, the floors last
        cache.put((b"client-0", 10**6), [OK])
        assert len(cache) == 0 and cache.floors() == [] and cache.nbytes == 0
        base = tracemalloc.get_traced_memory()[0]
        floors = [(b"client-%d" % i, 1000 + i) for i in range(20_000)]
        other = DedupCache(max_bytes=1 << 40)
        other.load([], floors)
        del floors
        held = tracemalloc.get_traced_memory()[0] - base
        assert held <= other.nbytes <= held * 1.5, (held, other.nbytes)
    finally:
        tracemalloc.stop()


def test_dedup_record_stays_within_its_byte_bound() -> None:
    bound = 2 << 20
    cache = DedupCache(max_bytes=bound)
    one = DedupCache(max_bytes=1 << 40)
    one.put((b"c", 0), _failing_request(4096, 0))
    per_entry = one.nbytes
    assert per_entry > 1 << 20  # a max-size request of failures: over a megabyte
    for seq in range(1, 40):
        cache.put((b"c", seq), _failing_request(4096, seq))
        assert cache.nbytes <= bound
    assert len(cache) == bound // per_entry and cache.evicted == 39 - len(cache)
    assert [s for _, s, _ in cache.entries()] == list(range(40 - len(cache), 40))
    assert cache.expired((b"c", 39 - len(cache))) == 39 - len(cache)
    assert cache.expired((b"c", 40 - len(cache))) is None  # still recorded
    assert cache.expired((b"c", 99)) is None and cache.expired((b"other", 1)) is None


def test_a_record_of_oks_is_kept_as_a_count() -> None:
    cache = DedupCache()
    cache.put((b"c", 1), [OK] * 4096)
    assert cache.nbytes < 1000
    assert cache.get((b"c", 1)) == [{"st": "OK"}] * 4096
    assert cache.entries() == [(b"c", 1, [{"st": "OK"}] * 4096)]
    cache.put((b"c", 2), [{"st": "OK"}, {"st": "OK", "created": True}])
    assert cache.get((b"c", 2)) == [{"st": "OK"}, {"st": "OK", "created": True}]


def test_a_replaced_entry_is_counted_once() -> None:
    cache = DedupCache()
    cache.put((b"c", 1), _failing_request(100, 1))
    size = cache.nbytes
    cache.put((b"c", 1), _failing_request(100, 1))
    assert cache.nbytes == size and len(cache) == 1


def test_floors_are_kept_per_client_and_go_last() -> None:
    cache = DedupCache(capacity=2)
    for cid, seq in [(b"a", 1), (b"a", 2), (b"b", 7), (b"a", 3), (b"b", 8)]:
        cache.put((cid, seq), [{"st": "X"}])
    # evicted: a1, a2, b7
    assert cache.floors() == [(b"a", 2), (b"b", 7)]
    assert cache.expired((b"a", 1)) == 2 and cache.expired((b"a", 3)) is None
    assert cache.expired((b"b", 5)) == 7 and cache.expired((b"b", 8)) is None
    # Under a tiny byte bound, records go first, then the least recently raised floors.
    tiny = DedupCache(max_bytes=FLOOR_OVERHEAD + 100)
    tiny.load(cache.entries(), cache.floors())
    assert tiny.nbytes <= tiny.max_bytes
    assert len(tiny) == 0 and tiny.floors() == [(b"b", 8)]


def test_floors_travel_with_snapshots() -> None:
    core = new_core(limits=Limits(dedup_bytes=4096))
    push = [push_rows([1], np.ones((1, 3)))]
    for seq in range(1, 40):
        assert call(core, push, cid=b"w", seq=seq).statuses == ["OK"]
    floor = dict(core.dedup.floors())[b"w"]
    assert floor > 1 and core.dedup.nbytes <= 4096
    enc = Encoder()
    header = encode_snapshot(enc, core.snapshot())
    msg = decode(enc.build(Route(MsgType.SNAPSHOT, PARTITION, EPOCH, core.lsn), header))
    heir = ShardCore(limits=Limits(dedup_bytes=4096))
    heir.assign(PARTITION, EPOCH)
    heir.load_snapshot(decode_snapshot(msg.header, msg.payloads, max_bytes=1 << 20))
    assert heir.dedup.floors() == core.dedup.floors()
    assert heir.dedup.entries() == core.dedup.entries()
    assert call(heir, push, cid=b"w", seq=1).statuses == ["BAD_REQUEST"]
    assert call(heir, push, cid=b"w", seq=39).statuses == ["OK"]  # recorded: answered again
    assert heir.store.checksum() == core.store.checksum()


def test_report_names_the_bytes_held() -> None:
    core = new_core()
    call(core, [push_rows([1], np.ones((1, 3)), t="nope")], cid=b"c", seq=1)
    report = core.report()
    assert report["dedup_bytes"] == core.dedup.nbytes > 0
    assert report["dedup_entries"] == 1 and report["step_bytes"] == 0 and report["expired"] == 0


# ---- lsn and counters -------------------------------------------------------


def test_lsn_counts_applied_mutations_only() -> None:
    core = ShardCore()
    core.assign(PARTITION, EPOCH)
    assert core.lsn == 0
    call(core, [create(DENSE)])
    assert core.lsn == 1
    call(core, [pull_dense([0]), checksum(), ({"op": "tables"}, {})])
    assert core.lsn == 1
    call(core, [push_dense(0, np.ones(4, np.float32)), push_dense(0, np.ones(5, np.float32))])
    assert core.lsn == 2  # the second push failed
    frames = frames_for([push_dense(1, np.ones(4, np.float32))], cid=b"c", seq=9)
    handle_frames(core, frames)
    handle_frames(core, frames)
    assert core.lsn == 3
    call(core, [checksum()], epoch=EPOCH + 1)  # refused
    assert core.lsn == 3
    assert call(core, [checksum()]).header["res"][0]["lsn"] == 3


def test_checksum_op_reports_the_store_checksum() -> None:
    core = new_core()
    res = call(core, [checksum()]).header["res"][0]
    assert res["checksum"] == core.store.checksum()


def test_report_counts_requests_ops_and_errors() -> None:
    core = new_core()
    call(core, [checksum(), ({"op": "nope"}, {})])
    call(core, [checksum()], epoch=0)
    core.handle(Route(MsgType.REQUEST, PARTITION, EPOCH, 0), {"ops": []}, [])
    r = core.report()
    assert r["requests"] == 4
    assert r["ops"] == 4  # two creates, a checksum and "nope"
    assert r["errors"] == 2  # "nope" and the refusal
    assert r["malformed"] == 1 and r["duplicates"] == 0
    assert r["tables"] == 2 and r["nbytes"] == core.store.nbytes
    assert r["bytes_in"] == 0
    call(core, [pull_rows([1, 2])])
    assert core.report()["bytes_in"] == 16


# ---- nothing raises ---------------------------------------------------------

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
op_names = st.sampled_from(
    ["create", "pull_dense", "push_dense", "pull_rows", "push_rows", "checksum", "tables"]
)
tables = st.sampled_from(["w", "emb", "x"])
descs = st.tuples(
    st.integers(-1, 3),
    st.sampled_from(["int64", "float32", "float64", "int32", "uint8"]),
    st.lists(st.integers(0, 5), max_size=3),
    st.sampled_from([0, 1]),
).map(list)
fields = st.fixed_dictionaries(
    {},
    optional={
        "op": op_names | values,
        "t": tables | values,
        "chunk": st.integers(-1, 3) | values,
        "chunks": st.lists(st.integers(-1, 3), max_size=3) | values,
        "ids": descs | values,
        "g": descs | values,
        "spec": st.sampled_from([DENSE.to_wire(), EMB.to_wire()]) | values,
    },
)
ops_strategy = st.lists(fields | values, max_size=6)
payload_strategy = st.lists(
    st.sampled_from(
        [
            np.arange(4, dtype=np.int64).tobytes(),
            np.ones(4, dtype=np.float32).tobytes(),
            np.ones(3, dtype=np.float64).tobytes(),
            np.ones((2, 3), dtype=np.float64).tobytes(),
            b"",
            b"\x01\x02\x03",
        ]
    )
    | st.binary(max_size=40),
    max_size=4,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops_strategy,
    st.fixed_dictionaries(
        {}, optional={"cid": st.binary(max_size=3) | values, "seq": st.integers(0, 3) | values}
    ),
    payload_strategy,
    st.integers(0, 2),
)
def test_random_requests_never_raise(
    ops: list[Any], extra: dict[str, Any], payloads: list[bytes], repeat: int
) -> None:
    core = new_core()
    header = {"ops": ops, **extra}
    header = msgpack.unpackb(msgpack.packb(header, use_bin_type=True), raw=False)
    route = Route(MsgType.REQUEST, PARTITION, EPOCH, 3)
    for _ in range(repeat + 1):
        reply = decode(core.handle(route, header, payloads))
        st_ = reply.header["st"]
        assert st_ in ("OK", "BAD_REQUEST")
        if st_ == "OK":
            res = reply.header["res"]
            assert len(res) == len(ops)
            # Bad input is the caller's fault, never an internal error.
            assert all(r["st"] in STATUSES and r["st"] != "INTERNAL" for r in res), res
