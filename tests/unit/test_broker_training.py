"""The broker's task calls answer a repeated request the same (no sockets).

A client's call can reach a restarted broker twice: zmq queued the original while the
broker was down and delivers it on reconnect, and the client re-sends it on the new
broker's map.  A second 'next' must not hand the worker a second task it never hears
of: the job would wait for that task forever.
"""

from __future__ import annotations

import asyncio
from typing import Any

from zps.broker.training import Training
from zps.core.cluster import ClusterState
from zps.protocol.codec import MsgType, Route, decode
from zps.protocol.messages import JobSettings, TaskRequest

CREATE = TaskRequest("create", "job", JobSettings(n_records=4, per_task=1))


def next_(wait: bool = False) -> TaskRequest:
    return TaskRequest("next", "job", wait=wait)


def run(
    calls: list[tuple[str, int, TaskRequest]], replies: list[dict[str, Any]] | None = None
) -> tuple[Training, list[tuple[int, Any]]]:
    """Feed TASK calls (node, request id, request); returns the training state and the
    (request id, task id or None) of every answer to a 'next'.  Every reply's header
    goes to ``replies`` too."""
    answers: list[tuple[int, Any]] = []

    async def send(frames: list[Any]) -> bool:
        msg = decode(frames[1:])
        if replies is not None:
            replies.append(msg.header)
        if "task" in msg.header:
            task = msg.header["task"]
            answers.append((msg.route.req_id, task["task"] if task else None))
        return True

    t = Training(ClusterState(1), send)

    async def scenario() -> None:
        for node, req_id, req in calls:
            await t.on_task(node.encode(), node, Route(MsgType.TASK, req_id=req_id), req)

    asyncio.run(scenario())
    return t, answers


def test_a_next_call_that_comes_twice_gets_the_same_task() -> None:
    t, answers = run([("w", 1, CREATE), ("w", 2, next_()), ("w", 2, next_()), ("w", 3, next_())])
    (a, b, c) = answers
    assert a == b and a[0] == 2  # the repeat: the same task again
    assert c[0] == 3 and c[1] != a[1]  # a new call: the next task
    assert sorted(tid for tid, (w, _) in t.jobs["job"].held.items()) == sorted([a[1], c[1]])


def test_a_parked_next_call_that_comes_twice_waits_once() -> None:
    one = TaskRequest("create", "job", JobSettings(n_records=1, per_task=1))
    calls = [("a", 1, one), ("a", 2, next_()), ("b", 1, next_(wait=True))]
    calls += [("b", 1, next_(wait=True)), ("a", 3, TaskRequest("release", "job", task=0))]
    calls += [("a", 4, TaskRequest("show", "job"))]
    replies: list[dict[str, Any]] = []
    t, answers = run(calls, replies)
    assert answers == [(2, 0), (1, 0)]  # b got the released task once
    assert {tid: w for tid, (w, _) in t.jobs["job"].held.items()} == {0: "b"}
    assert replies[-1]["progress"]["waiting"] == 0  # no call of b's left parked


def test_a_restored_broker_holds_sync_joins_until_the_recorded_workers_tick() -> None:
    """The record says step 1 is the last committed; worker a's re-sent tick says it
    finished step 7.  A join that came first is answered only then, at step 7."""
    from zps.core.brokerstate import ClockRecord
    from zps.protocol.messages import ClockRequest, Mode

    replies: list[tuple[bytes, dict[str, Any]]] = []

    async def send(frames: list[Any]) -> bool:  # replies only: no shard, so no commits
        replies.append((frames[0], decode(frames[1:]).header))
        return True

    async def scenario() -> None:
        t = Training(ClusterState(1), send)
        rec = ClockRecord(Mode.SYNC, 0, (("a", 2, False),), 1, None, ("a",))
        t.restore(rec, ())
        join = ClockRequest("join", Mode.SYNC)
        await t.on_clock(b"b", "b", Route(MsgType.CLOCK, req_id=1), join)
        assert replies == []  # held: a has not been heard yet
        tick = ClockRequest("tick", Mode.SYNC, finished=8)
        await t.on_clock(b"a", "a", Route(MsgType.CLOCK, req_id=9), tick)
        assert (b"b", {"st": "OK", "step": 7}) in replies

    asyncio.run(scenario())


class _OnePrimary:
    """The cluster state a sync commit needs: partition 0's primary is s-a, at epoch 1."""

    n_partitions = 1

    class map:  # stands for ClusterState.map
        partitions = {0: type("Info", (), {"epoch": 1})()}

    def primary_of(self, partition: int) -> str | None:
        return "s-a"

    def holding(self, now: float) -> bool:
        return False


def test_a_commit_refused_for_a_passing_reason_is_sent_again_not_counted_done(
    monkeypatch: Any,
) -> None:
    """A primary that refuses a commit (NOT_ENOUGH_REPLICAS: its replica is resyncing
    after a broker takeover) applied nothing.  Counting that as done released the workers
    into the next step, and the step's gradients were dropped with the buffer."""
    from zps.broker import training as training_mod
    from zps.protocol.messages import ClockRequest, Mode

    commits: list[int] = []  # the step of each commit sent to the shard
    released: list[tuple[bytes, int]] = []  # (worker, step) of each tick answered
    clock = [100.0]
    monkeypatch.setattr(training_mod.time, "monotonic", lambda: clock[0])

    async def send(frames: list[Any]) -> bool:
        if frames[0] == b"s-a":
            commits.append(decode(frames[2:]).header["ops"][0]["step"])
        else:
            released.append((frames[0], decode(frames[1:]).header["step"]))
        return True

    async def scenario() -> None:
        t = Training(_OnePrimary(), send)  # type: ignore[arg-type]
        tick = ClockRequest("tick", Mode.SYNC, finished=1)
        for w in ("a", "b"):
            await t.on_clock(w.encode(), w, Route(MsgType.CLOCK, req_id=1), tick)
        assert commits == [0] and released == []
        refused = {"st": "NOT_ENOUGH_REPLICAS", "msg": "1 of the 2 copies are in sync"}
        await t.on_commit_reply(Route(MsgType.REPLY, 0, 1, 0), refused)
        assert released == [] and t.commit_in_flight  # not done: nothing was applied
        await t.on_timer()
        assert commits == [0]  # not yet due
        clock[0] += training_mod.COMMIT_RETRY_S
        await t.on_timer()
        assert commits == [0, 0]  # sent again
        ok = {"st": "OK", "res": [{"st": "OK", "changed": True, "committed": 0}]}
        await t.on_commit_reply(Route(MsgType.REPLY, 0, 1, 0), ok)
        assert sorted(released) == [(b"a", 1), (b"b", 1)]
        assert not t.commit_in_flight

    asyncio.run(scenario())
