"""A shard's administration operations: drop, set_dense, set_rows, describe, ids, export
cuts and checkpoint requests (pure: on :class:`ShardCore`, no sockets)."""

from __future__ import annotations

import numpy as np

from tests.unit.test_shardcore import (
    DENSE,
    EMB,
    EPOCH,
    PARTITION,
    call,
    create,
    frames_for,
    handle_frames,
    new_core,
    pull_dense,
    pull_rows,
    push_dense,
    push_rows,
)
from zps.init import Zeros
from zps.optim import Adam
from zps.protocol.codec import decode
from zps.shard.core import ShardCore
from zps.store import EmbeddingSpec
from zps.store.tables import EmbeddingTable


def set_rows(ids: list[int], v: np.ndarray, t: str = "emb") -> tuple[dict, dict]:
    return {"op": "set_rows", "t": t}, {"ids": np.array(ids, dtype=np.int64), "v": v}


def set_dense(chunk: int, v: np.ndarray, t: str = "w") -> tuple[dict, dict]:
    return {"op": "set_dense", "t": t, "chunk": chunk}, {"v": v}


def test_set_rows_sets_values_and_is_a_replicated_mutation() -> None:
    core = new_core()
    lsn = core.lsn
    v = np.arange(6, dtype=np.float64).reshape(2, 3)
    reply = call(core, [set_rows([7, 9], v)], cid=b"c", seq=1)
    assert reply.statuses == ["OK"]
    assert core.lsn == lsn + 1
    got = call(core, [pull_rows([9, 7, 8])]).arrays(0)[0]
    np.testing.assert_array_equal(got[:2], v[::-1])
    np.testing.assert_array_equal(got[2], [0.5, 0.5, 0.5])  # untouched: its initial value
    # a replica re-running the message arrives at the same state
    replica = new_core()
    msg = decode([bytes(f) for f in frames_for([set_rows([7, 9], v)], cid=b"c", seq=1)])
    replica.apply_replicated(msg.header, msg.payloads)
    assert replica.store.checksum() == core.store.checksum()
    # a re-sent message is answered from the dedup record, not applied again
    call(core, [push_rows([7], np.ones((1, 3)))], cid=b"c", seq=2)
    call(core, [set_rows([7, 9], v)], cid=b"c", seq=1)
    assert call(core, [pull_rows([7])]).arrays(0)[0][0, 0] == -1.0


def test_set_rows_resets_the_optimizer_state_of_those_rows_only() -> None:
    spec = EmbeddingSpec("a", 2, "float32", Zeros(), Adam(lr=0.1), 3)
    table = EmbeddingTable(spec)
    table.push([1, 2], np.ones((2, 2), dtype=np.float32))
    before = table.export()
    table.set_rows([1], np.full((1, 2), 5.0, dtype=np.float32))
    after = table.export()
    np.testing.assert_array_equal(after["rows"][0], [5.0, 5.0])
    np.testing.assert_array_equal(after["rows"][1], before["rows"][1])
    for key in after:
        if key not in ("ids", "rows"):  # Adam's moments and step count
            fresh = Adam(lr=0.1).init_state(1, 2, np.dtype("float32"))[key]
            np.testing.assert_array_equal(after[key][0], fresh[0])
            np.testing.assert_array_equal(after[key][1], before[key][1])


def test_set_rows_errors_name_what_is_wrong() -> None:
    core = new_core()
    lsn = core.lsn
    bad_shape = call(core, [set_rows([1, 2], np.zeros((2, 4)))]).header["res"][0]
    assert bad_shape["st"] == "SHAPE_MISMATCH" and "'emb'" in bad_shape["msg"]
    dup = call(core, [set_rows([1, 1], np.zeros((2, 3)))]).header["res"][0]
    assert dup["st"] == "BAD_REQUEST" and "id 1" in dup["msg"]
    nan = call(core, [set_rows([1], np.full((1, 3), np.nan))]).header["res"][0]
    assert "NaN" in nan["msg"]
    unknown = call(core, [set_rows([1], np.zeros((1, 3)), t="nope")]).header["res"][0]
    assert unknown["st"] == "UNKNOWN_TABLE" and "'nope'" in unknown["msg"]
    assert core.lsn == lsn


def test_set_dense_sets_a_chunk_and_keeps_a_lent_view() -> None:
    core = new_core()
    call(core, [push_dense(0, np.ones(4, dtype=np.float32))])
    lent = core.store.dense("w").pull(0)  # as a reply zmq has not sent yet holds it
    reply = call(core, [set_dense(0, np.arange(4, dtype=np.float32))])
    assert reply.statuses == ["OK"]
    np.testing.assert_array_equal(lent, [-1, -1, -1, -1])
    got = call(core, [pull_dense([0, 2])]).arrays(0)
    np.testing.assert_array_equal(got[0], [0, 1, 2, 3])
    wrong = call(core, [set_dense(2, np.zeros(4, dtype=np.float32))]).header["res"][0]
    assert wrong["st"] == "SHAPE_MISMATCH" and "chunk 2" in wrong["msg"]


def test_drop_removes_a_table_and_its_pending_step_gradients() -> None:
    core = new_core()
    op = {"op": "push_rows", "t": "emb", "step": 1}
    call(
        core, [(op, {"ids": np.array([1], dtype=np.int64), "g": np.ones((1, 3))})], cid=b"w", seq=1
    )
    assert core.steps.nbytes > 0
    lsn = core.lsn
    reply = call(core, [({"op": "drop", "t": "emb"}, {})], cid=b"c", seq=1)
    assert reply.header["res"][0]["changed"] is True
    assert core.lsn == lsn + 1 and "emb" not in core.store
    assert core.steps.nbytes == 0 and not core.steps.entries
    again = call(core, [({"op": "drop", "t": "emb"}, {})], cid=b"c", seq=2)
    assert again.header["res"][0]["changed"] is False and core.lsn == lsn + 1
    # the name can be created again with another spec
    other = EmbeddingSpec("emb", 5, "float32", Zeros(), Adam(), 1)
    assert call(core, [create(other)]).statuses == ["OK"]


def test_describe_and_ids_pages() -> None:
    core = new_core()
    ids = [5, -3, 12, 7, 100, 0]
    call(core, [push_rows(ids, np.zeros((6, 3)))])
    d = call(core, [({"op": "describe", "t": "emb"}, {})]).header["res"][0]
    assert d["rows"] == 6 and d["bytes"] > 6 * 3 * 8 and d["spec"] == EMB.to_wire()
    assert call(core, [({"op": "describe", "t": "w"}, {})]).header["res"][0]["spec"] == (
        DENSE.to_wire()
    )
    pages: list[int] = []
    after = None
    while True:
        r = call(core, [({"op": "ids", "t": "emb", "after": after, "limit": 4}, {})])
        page = r.arrays(0)[0].tolist()
        pages.append(len(page))
        if len(page) < 4:
            break
        after = page[-1]
    assert pages == [4, 2]
    unknown = call(core, [({"op": "describe", "t": "zz"}, {})]).header["res"][0]
    assert unknown["st"] == "UNKNOWN_TABLE" and "'zz'" in unknown["msg"]


def test_cut_is_a_consistent_copy_while_writes_go_on() -> None:
    core = new_core()
    call(core, [push_rows([1, 2, 3], np.ones((3, 3))), push_dense(1, np.ones(4, np.float32))])
    r = call(core, [({"op": "cut"}, {})]).header["res"][0]
    key, lsn = r["cut"], r["lsn"]
    tables = {t["spec"]["name"]: t for t in r["tables"]}
    assert tables["emb"]["n"] == 3 and tables["w"]["chunks"] == [1]
    call(core, [push_rows([1, 4], np.ones((2, 3))), push_dense(1, np.ones(4, np.float32))])
    assert core.lsn > lsn
    got = call(core, [({"op": "cut_read", "cut": key, "t": "emb", "start": 0, "count": 10}, {})])
    ids, rows = got.arrays(0)
    assert sorted(ids.tolist()) == [1, 2, 3]
    np.testing.assert_array_equal(rows, np.full((3, 3), -0.5))
    dense = call(core, [({"op": "cut_read", "cut": key, "t": "w", "chunks": [0, 1, 2]}, {})])
    c0, c1, c2 = dense.arrays(0)
    np.testing.assert_array_equal(c1, [-1, -1, -1, -1])  # not the second push's -2
    np.testing.assert_array_equal(c0, np.zeros(4)) and np.testing.assert_array_equal(c2, [0, 0])
    call(core, [({"op": "cut_drop", "cut": key}, {})])
    gone = call(core, [({"op": "cut_read", "cut": key, "t": "emb", "start": 0, "count": 1}, {})])
    assert gone.statuses == ["BAD_REQUEST"] and "take a new cut" in gone.header["res"][0]["msg"]


def test_cuts_are_bounded() -> None:
    core = new_core()
    keys = [call(core, [({"op": "cut"}, {})]).header["res"][0]["cut"] for _ in range(3)]
    assert len(core.cuts) == 2
    first = call(core, [({"op": "cut_read", "cut": keys[0], "t": "w", "chunks": [0]}, {})])
    assert first.statuses == ["BAD_REQUEST"]
    assert call(
        core, [({"op": "cut_read", "cut": keys[2], "t": "w", "chunks": [0]}, {})]
    ).statuses == ["OK"]


def test_checkpoint_request() -> None:
    core = new_core()
    no_dir = call(core, [({"op": "checkpoint", "write": True}, {})]).header["res"][0]
    assert no_dir["st"] == "BAD_REQUEST" and "data dir" in no_dir["msg"]
    core.checkpoint_enabled = True
    r = call(core, [({"op": "checkpoint", "write": True}, {})]).header["res"][0]
    assert r["st"] == "OK" and r["checkpoint"] is None and core.checkpoint_wanted == core.lsn
    core.checkpoint_wanted = None
    core.checkpointed = {"lsn": core.lsn, "epoch": EPOCH, "path": "x", "time": 1.0}
    r = call(core, [({"op": "checkpoint", "write": True}, {})]).header["res"][0]
    assert r["checkpoint"]["lsn"] == core.lsn and core.checkpoint_wanted is None


def test_reads_are_refused_by_a_replica() -> None:
    core = ShardCore()
    core.assign(PARTITION, EPOCH, primary=False)
    reply = handle_frames(
        core,
        frames_for([({"op": "cut"}, {})]),
    )
    assert reply.st == "NOT_PRIMARY"
