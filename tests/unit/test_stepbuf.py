"""The sync-mode step buffer: its step window and its byte bound."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from zps.errors import BadRequestError, OverloadedError
from zps.init import Zeros
from zps.optim import SGD
from zps.protocol.codec import CompressPolicy, Encoder, MsgType, Route, decode
from zps.shard.core import Limits, ShardCore
from zps.store import DenseSpec, PartitionStore
from zps.store.stepbuf import ENTRY_OVERHEAD, Pending, StepBuffer

P, E = 0, 1
W = DenseSpec("w", (8,), "float32", Zeros(), SGD(lr=1.0), 0, 8)


def pending(step: int, cid: bytes = b"w1", n: int = 8, value: float = 1.0) -> Pending:
    return Pending(step, cid, "w", 0, None, np.full(n, value, dtype=np.float32))


def store() -> PartitionStore:
    s = PartitionStore()
    s.create(W)
    return s


def test_pushes_past_the_window_are_refused_naming_the_step() -> None:
    buf = StepBuffer(window=2)
    buf.add(pending(0))
    buf.add(pending(1))
    with pytest.raises(BadRequestError, match=r"step 2 is too far ahead.*committed step is -1"):
        buf.add(pending(2))
    s = store()
    assert buf.commit(s, 0, [b"w1"])
    buf.add(pending(2))  # the window moves with the committed step
    with pytest.raises(BadRequestError, match=r"step 1000000 .* at most 2 steps"):
        buf.add(pending(1_000_000))
    assert [e.step for e in buf.entries] == [1, 2]


def test_committed_steps_are_still_refused() -> None:
    buf = StepBuffer()
    buf.commit(store(), 3, [])
    with pytest.raises(BadRequestError, match="already committed"):
        buf.add(pending(3))


def test_buffered_bytes_are_counted_bounded_and_released() -> None:
    one = pending(0).nbytes
    assert one == ENTRY_OVERHEAD + 2 + 1 + 32
    buf = StepBuffer(max_bytes=3 * one)
    for cid in (b"w1", b"w2", b"w3"):
        buf.add(pending(0, cid))
    assert buf.nbytes == 3 * one
    with pytest.raises(OverloadedError, match=r"step 1 would exceed its limit of \d+"):
        buf.add(pending(1, b"w4"))
    assert buf.nbytes == 3 * one and len(buf.entries) == 3
    s = store()
    assert buf.commit(s, 0, [b"w1", b"w2", b"w3"])
    assert buf.nbytes == 0 and buf.entries == []
    # Exactly what was accepted was applied: the mean of three ones, once.
    assert s.dense("w").pull(0).tolist() == [-1.0] * 8
    buf.add(pending(1, b"w4"))
    assert buf.nbytes == one


def test_rows_count_their_ids_too() -> None:
    ids = np.arange(5, dtype=np.int64)
    entry = Pending(0, b"c", "emb", -1, ids, np.zeros((5, 4), dtype=np.float64))
    assert entry.nbytes == ENTRY_OVERHEAD + 1 + 3 + 40 + 160


def test_load_counts_what_it_loads_whatever_the_bound() -> None:
    buf = StepBuffer()
    for step in (0, 1):
        buf.add(pending(step, n=1000))
    small = StepBuffer(max_bytes=1)
    small.load(buf.export())
    assert small.nbytes == buf.nbytes > 8000 and len(small.entries) == 2
    with pytest.raises(BadRequestError, match="malformed entry"):
        small.load({"committed": 0, "entries": [[1, b"c", "w", 0, "ids", np.zeros(2)]]})


# ---- through the shard's request handling -------------------------------------


def request(
    core: ShardCore, ops: list[dict[str, Any]], arrays: list[np.ndarray | None], seq: int
) -> Any:
    enc = Encoder(CompressPolicy())
    wire = [
        {**op, "g": enc.array(a)} if a is not None else op
        for op, a in zip(ops, arrays, strict=True)
    ]
    frames = enc.build(Route(MsgType.REQUEST, P, E, seq), {"cid": b"w1", "seq": seq, "ops": wire})
    msg = decode([bytes(f) for f in frames])
    reply = decode([bytes(f) for f in core.handle(msg.route, msg.header, msg.payloads)])
    return reply.header


def test_the_shard_refuses_far_future_and_oversized_pushes_per_op() -> None:
    g = np.ones(8, dtype=np.float32)
    per_push = pending(0).nbytes
    core = ShardCore(limits=Limits(step_window=4, step_buffer_bytes=2 * per_push))
    core.assign(P, E)
    create = {"op": "create", "spec": W.to_wire()}
    assert request(core, [create], [None], 1)["res"][0]["st"] == "OK"

    def push(step: int) -> dict[str, Any]:
        return {"op": "push_dense", "t": "w", "chunk": 0, "step": step}

    lsn = core.lsn
    res = request(core, [push(0), push(9), push(1), push(2)], [g, g, g, g], 2)["res"]
    assert [r["st"] for r in res] == ["OK", "BAD_REQUEST", "OK", "OVERLOADED"]
    assert "step 9 is too far ahead" in res[1]["msg"] and "at most 4 steps" in res[1]["msg"]
    assert "step_buffer_bytes" in res[3]["msg"]
    assert core.lsn == lsn + 2 and core.report()["step_bytes"] == 2 * per_push
    commit = {"op": "commit", "step": 0, "workers": [b"w1"]}
    assert request(core, [commit], [None], 3)["res"][0]["st"] == "OK"
    assert core.steps.nbytes == per_push
    assert core.store.dense("w").pull(0).tolist() == [-1.0] * 8
    assert msgpack.packb(core.report())  # plain data for the heartbeat
