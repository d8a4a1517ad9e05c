"""The client's request lifecycle, driven without sockets or a clock."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from zps.client.session import (
    Action,
    BrokerChoice,
    ClientSession,
    Deliver,
    Fail,
    Resubmit,
    Send,
)
from zps.core.routing import ClusterMap, PartitionInfo, split_by_partition
from zps.errors import (
    ConfigError,
    JobFailedError,
    ShardUnavailableError,
    UnknownTableError,
    ZpsTimeoutError,
)
from zps.ops.config import ShardConfig, WorkerConfig, broker_endpoints
from zps.protocol.codec import Encoder, Message, MsgType, Route, decode
from zps.protocol.messages import ClientHello

TIMEOUT = 5.0
BACKOFF_CAP = 0.5


def cmap(
    version: int = 1,
    *,
    epoch: int = 1,
    primary: str | None = "s-a",
    lost: bool = False,
    incarnation: str = "b1",
    n: int = 2,
) -> ClusterMap:
    parts = {p: PartitionInfo(epoch=epoch, primary=primary, lost=lost) for p in range(n)}
    return ClusterMap(version, 16, np.zeros(16, dtype=np.int32), parts, incarnation)


def session(m: ClusterMap | None = None, timeout: float = TIMEOUT) -> ClientSession[str]:
    s: ClientSession[str] = ClientSession(
        b"c-test", timeout=timeout, max_backoff=BACKOFF_CAP, hello=ClientHello(name="t")
    )
    assert s.on_map(m or cmap(), 0.0) == []
    return s


def submit(s: ClientSession[str], token: str, now: float = 0.0, p: int = 0) -> list[Action[str]]:
    enc = Encoder()
    desc = enc.array(np.arange(3, dtype=np.int64))
    return s.submit(p, [{"op": "pull_rows", "t": "emb", "ids": desc}], enc, token, now)


def sent(actions: list[Action[str]]) -> list[Message]:
    return [decode(a.frames) for a in actions if isinstance(a, Send)]


def only_send(actions: list[Action[str]]) -> Message:
    assert len(actions) == 1 and isinstance(actions[0], Send), actions
    return decode(actions[0].frames)


def reply(req_id: int, st: str = "OK", **header: Any) -> Message:
    return Message(Route(MsgType.REPLY, 0, 1, req_id), {"st": st, **header}, [])


def answer(mtype: MsgType, req_id: int, header: dict[str, Any]) -> Message:
    return Message(Route(mtype, req_id=req_id), header, [])


def test_a_reply_completes_the_request() -> None:
    s = session()
    msg = only_send(submit(s, "a"))
    assert msg.route.mtype is MsgType.REQUEST and msg.route.epoch == 1
    assert msg.header["cid"] == b"c-test" and msg.header["ops"][0]["op"] == "pull_rows"
    assert len(msg.payloads) == 1
    out = s.on_reply(reply(msg.route.req_id, res=[{"st": "OK"}]), 0.1)
    assert len(out) == 1 and isinstance(out[0], Deliver)
    assert out[0].token == "a" and out[0].msg.header["res"] == [{"st": "OK"}]
    assert len(s) == 0 and s.next_wakeup() is None
    assert s.stats.requests == 1 and s.stats.ops == 1 and s.stats.by_partition[0] == 1


def test_an_error_status_fails_with_the_matching_error() -> None:
    s = session()
    msg = only_send(submit(s, "a"))
    [out] = s.on_reply(reply(msg.route.req_id, "UNKNOWN_TABLE", msg="no emb"), 0.1)
    assert isinstance(out, Fail) and isinstance(out.error, UnknownTableError)
    assert "no emb" in str(out.error)


@pytest.mark.parametrize("code", ["NOT_PRIMARY", "STALE_EPOCH"])
def test_a_retry_code_parks_and_resends_at_the_backoff_time(code: str) -> None:
    s = session()
    first = only_send(submit(s, "a", now=10.0))
    out = s.on_reply(reply(first.route.req_id, code), 10.0)
    if code == "STALE_EPOCH":  # our map is out of date: ask for a new one
        assert [m.route.mtype for m in sent(out)] == [MsgType.HELLO]
    else:
        assert out == []
    assert s.next_wakeup() == pytest.approx(10.01)
    assert s.tick(10.009) == []
    again = only_send(s.tick(10.01))
    assert again.route.req_id == first.route.req_id
    assert again.header == first.header  # same seq, same body
    assert [bytes(p) for p in again.payloads] == [bytes(p) for p in first.payloads]
    assert s.stats.retries == 1
    # The second backoff is twice as long.
    assert s.on_reply(reply(first.route.req_id, "NOT_PRIMARY"), 11.0) == []
    assert s.next_wakeup() == pytest.approx(11.02)


def backoffs(s: ClientSession[str], n: int) -> list[float]:
    assert submit(s, "a", now=0.0) == []  # no primary: parked at once
    now, delays = 0.0, []
    for _ in range(n):
        wake = s.next_wakeup()
        assert wake is not None
        delays.append(round(wake - now, 6))
        now = wake
        assert s.tick(now) == []  # still no primary: parked again
    return delays


def test_the_backoff_doubles_up_to_the_cap() -> None:
    s = session(cmap(primary=None))
    assert backoffs(s, 9) == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5, 0.5]


def test_the_backoff_doubles_eight_times_at_most() -> None:
    s: ClientSession[str] = ClientSession(b"c", timeout=1e9, max_backoff=100.0)
    s.on_map(cmap(primary=None), 0.0)
    assert backoffs(s, 11) == [0.01 * 2**k for k in range(9)] + [2.56, 2.56]


def test_a_new_epoch_resends_at_once() -> None:
    s = session()
    first = only_send(submit(s, "a"))
    assert s.on_map(cmap(2), 0.1) == []  # same epoch, same primary: nothing to do
    again = only_send(s.on_map(cmap(3, epoch=2, primary="s-b"), 0.2))
    assert again.route.epoch == 2 and again.route.req_id == first.route.req_id
    assert again.header["seq"] == first.header["seq"]
    [out] = s.on_reply(reply(first.route.req_id), 0.3)
    assert isinstance(out, Deliver)


def test_a_parked_request_goes_out_with_the_next_map() -> None:
    s = session()
    first = only_send(submit(s, "a"))
    s.on_reply(reply(first.route.req_id, "NOT_PRIMARY"), 0.0)
    assert only_send(s.on_map(cmap(2), 0.001)).route.req_id == first.route.req_id
    assert s.tick(1.0) == []  # no longer parked: the old backoff timer does nothing


def test_an_older_map_is_ignored() -> None:
    s = session(cmap(5))
    submit(s, "a")
    assert s.on_map(cmap(4, epoch=9), 0.1) == []
    assert s.map is not None and s.map.version == 5


def test_a_broker_restart_resends_everything_including_broker_calls() -> None:
    s = session(cmap(5))
    req = only_send(submit(s, "a"))
    call_id, call = s.call(MsgType.TASK, {"op": "next", "job": "j"}, "t", 0.0, forever=True)
    assert only_send(call).route.req_id == call_id
    st_id, _ = s.call(MsgType.STATUS, {}, "st", 0.0)
    out = sent(s.on_map(cmap(1, incarnation="b2"), 1.0))  # versions restart at 1
    by_id = {m.route.req_id: m for m in out}
    assert set(by_id) == {req.route.req_id, call_id, st_id}
    assert by_id[call_id].route.mtype is MsgType.TASK
    assert by_id[call_id].header == {"op": "next", "job": "j"}
    assert by_id[st_id].route.mtype is MsgType.STATUS
    assert by_id[req.route.req_id].header == req.header


def test_a_lost_partition_waits_and_a_map_with_a_primary_delivers() -> None:
    """Every copy died (the map says lost), then one holding the data came back: the
    requests waited, parked and unsent, and went out at once on the map naming it."""
    s = session()
    a = only_send(submit(s, "a", p=0))
    b = only_send(submit(s, "b", p=1))
    assert s.on_map(cmap(2, lost=True), 0.1) == []  # waiting, not failed
    assert submit(s, "c", now=0.2) == []  # a new one waits too
    now = 0.2
    while now < TIMEOUT - 1.0:  # checked again at each backoff time: never sent meanwhile
        wake = s.next_wakeup()
        assert wake is not None
        now = wake
        assert s.tick(now) == []
    assert len(s) == 3
    back = sent(s.on_map(cmap(3, epoch=2, primary="s-b"), now))  # a copy is primary again
    by_id = {m.route.req_id: m for m in back}
    assert len(by_id) == 3 and all(m.route.epoch == 2 for m in back)
    assert by_id[a.route.req_id].header == a.header  # the same seq: applied once
    assert by_id[b.route.req_id].header == b.header
    done = [x for m in back for x in s.on_reply(reply(m.route.req_id), now + 0.01)]
    assert sorted(x.token for x in done if isinstance(x, Deliver)) == ["a", "b", "c"]
    assert len(s) == 0 and s.next_wakeup() is None


def no_copy(s: ClientSession[str], cause: str, now: float) -> None:
    """Make partition 0 have no copy that serves, as ``cause`` says."""
    if cause == "lost":
        s.on_map(cmap(2, lost=True), now)
    elif cause == "no primary":
        s.on_map(cmap(2, primary=None), now)
    else:  # the broker (or a shard) refuses, while the client's map names a primary
        for a in s.tick(now):
            assert isinstance(a, Send)


@pytest.mark.parametrize(
    ("cause", "missing", "says"),
    [
        ("lost", "lost", "partition 0 is lost (no copy holding its data is live)"),
        ("no primary", "no primary", "partition 0 has no primary"),
        ("SHARD_UNAVAILABLE", "no live copy", "partition 0 has no live copy (partition 0 is"),
        ("NOT_PRIMARY", "no primary", "partition 0 has no primary (not primary"),
    ],
)
def test_a_request_that_waits_for_a_copy_fails_at_its_deadline_naming_what_was_missing(
    cause: str, missing: str, says: str
) -> None:
    s = session()
    req = only_send(submit(s, "a", now=100.0))
    no_copy(s, cause, 100.0)
    refusal = {
        "SHARD_UNAVAILABLE": "partition 0 is lost: no copy at epoch 1, LSN 7 or newer is left",
        "NOT_PRIMARY": "not primary of partition 0",
    }.get(cause)
    fails: list[Fail[str]] = []
    now = 100.0
    while not fails:
        if refusal is not None:
            assert s.on_reply(reply(req.route.req_id, cause, msg=refusal), now) == []
        wake = s.next_wakeup()
        assert wake is not None and wake <= 100.0 + TIMEOUT
        now = wake
        actions = s.tick(now)
        fails = [a for a in actions if isinstance(a, Fail)]
    assert now == 100.0 + TIMEOUT
    err = fails[0].error
    assert isinstance(err, ShardUnavailableError), err
    assert err.partition == 0 and err.missing == missing and err.waited == TIMEOUT
    assert says in str(err) and "gave up after waiting 5.0s" in str(err)
    if cause == "lost":
        assert "zps-server reset-partition --partition 0 --accept-data-loss" in str(err)
    assert len(s) == 0


def test_a_request_sent_to_a_primary_that_never_answers_times_out() -> None:
    """Only a request still waiting for a copy fails as unavailable: one sent to the
    primary the new map names, which then never answers, times out."""
    s = session()
    req = only_send(submit(s, "a"))
    s.on_map(cmap(2, lost=True), 0.1)
    assert only_send(s.on_map(cmap(3, epoch=2), 0.5)).route.req_id == req.route.req_id
    [out] = s.tick(TIMEOUT)
    assert isinstance(out, Fail) and isinstance(out.error, ZpsTimeoutError)


def test_forever_waits_as_long_as_it_takes() -> None:
    """No deadline: a request of a session without a timeout, and a broker call made
    ``forever``, wait through a partition lost for a day, and are answered after."""
    s = session(timeout=math.inf)
    assert submit(s, "a") and s.on_map(cmap(2, lost=True), 0.0) == []
    call_id, _ = s.call(MsgType.CLOCK, {"op": "tick"}, "clock", 0.0, forever=True)
    now, wakes = 0.0, 0
    while now < 86_400.0:
        wake = s.next_wakeup()
        assert wake is not None  # the parked request is checked at its backoff time
        now = wake
        wakes += 1
        assert s.tick(now) == []
    assert len(s) == 2
    [again] = sent(s.on_map(cmap(3, epoch=2), now))
    [out] = s.on_reply(reply(again.route.req_id), now)
    assert isinstance(out, Deliver) and out.token == "a"
    [out] = s.on_reply(answer(MsgType.CLOCK, call_id, {"st": "OK", "step": 1}), now)
    assert isinstance(out, Deliver) and out.token == "clock"
    assert wakes <= 86_400.0 / BACKOFF_CAP + 10


def test_a_waiting_request_does_not_spin() -> None:
    """Waiting for a copy costs a check (no send) per backoff time, at most one per
    ``max_backoff`` once the backoff has grown; refused by the broker, one send each."""
    s = session(cmap(lost=True), timeout=60.0)
    assert submit(s, "a") == []
    now, wakes, last = 0.0, 0, -1.0
    while True:
        wake = s.next_wakeup()
        assert wake is not None and wake > now
        now = wake
        actions = s.tick(now)
        if any(isinstance(a, Fail) for a in actions):
            break
        assert actions == []
        wakes += 1
        if wakes > 9:  # the backoff has reached its cap
            assert now - last == pytest.approx(BACKOFF_CAP)
        last = now
    assert now == 60.0 and wakes <= 60.0 / BACKOFF_CAP + 9
    # The broker answers SHARD_UNAVAILABLE while our map names a primary.
    s = session(timeout=60.0)
    req = only_send(submit(s, "a"))
    now, sends = 0.0, 1
    while True:
        s.on_reply(reply(req.route.req_id, "SHARD_UNAVAILABLE", msg="gone"), now)
        wake = s.next_wakeup()
        assert wake is not None and wake > now
        now = wake
        actions = s.tick(now)
        if any(isinstance(a, Fail) for a in actions):
            break
        assert len(sent(actions)) == 1
        sends += 1
    assert now == 60.0 and sends <= 60.0 / BACKOFF_CAP + 9
    assert s.stats.retries == sends - 1


def test_a_background_push_waits_as_any_request_and_its_timers_stay_few() -> None:
    """A lazy request (``wait=False`` pushes beside a pull) waits for a copy as a waited
    one does; maps that keep saying lost leave no pile of timers behind."""
    s = session(cmap(lost=True), timeout=60.0)
    assert submit_step(s, "bg", lazy=True) == [] and submit(s, "a") == []
    now, version = 0.0, 2
    for _ in range(100):  # a map at each backoff time: 46 s
        assert s.on_map(cmap(version, lost=True), now) == []
        version += 1
        wake = s.next_wakeup()
        assert wake is not None
        now = wake
        assert s.tick(now) == []
        assert s.timers <= 4  # one live timer per request, and a stale one at most
    assert now < 60.0 and len(s) == 2
    out = sent(s.on_map(cmap(version, epoch=2), now))
    assert sorted(m.header.get("lz", 0) for m in out) == [0, 1]


def test_no_count_of_attempts_cuts_a_request_short_of_its_deadline() -> None:
    """Refused thousands of times (a long promotion), a request is re-sent until its
    deadline, and answered then if a primary answers."""
    s = session(timeout=2000.0)
    first = only_send(submit(s, "a"))
    req_id, now, sends = first.route.req_id, 0.0, 1
    while now < 1990.0:
        assert s.on_reply(reply(req_id, "NOT_PRIMARY"), now) == []
        wake = s.next_wakeup()
        assert wake is not None
        now = wake
        assert [m.route.req_id for m in sent(s.tick(now))] == [req_id]
        sends += 1
    assert sends > 3000
    [out] = s.on_reply(reply(req_id), now)
    assert isinstance(out, Deliver) and out.token == "a"


def test_a_partition_the_map_does_not_have_fails_at_once() -> None:
    s = session(cmap(n=2))
    [out] = submit(s, "a", p=5)
    assert isinstance(out, Fail) and isinstance(out.error, ShardUnavailableError)
    assert "partition 5 is not in the cluster map (it has 2 partitions)" in str(out.error)
    assert out.error.missing == "no such partition" and len(s) == 0
    # One the broker says it does not have, which a newer map drops (fewer partitions).
    req = only_send(submit(s, "b", p=1))
    assert s.on_reply(reply(req.route.req_id, "SHARD_UNAVAILABLE", msg="no such"), 0.0) == []
    [out] = s.on_map(cmap(2, n=1), 0.1)
    assert isinstance(out, Fail) and "partition 1 is not in the cluster map" in str(out.error)
    assert len(s) == 0


def test_the_deadline_fails_with_a_timeout_and_a_late_reply_is_ignored() -> None:
    s = session()
    msg = only_send(submit(s, "a", now=100.0))
    assert s.next_wakeup() == 100.0 + TIMEOUT
    assert s.tick(100.0 + TIMEOUT - 0.001) == []
    [out] = s.tick(100.0 + TIMEOUT)
    assert isinstance(out, Fail) and isinstance(out.error, ZpsTimeoutError)
    assert "request to partition 0 not answered within 5s" in str(out.error)
    assert s.on_reply(reply(msg.route.req_id), 200.0) == []
    assert s.next_wakeup() is None


def test_a_parked_request_still_fails_at_its_deadline() -> None:
    s = session(cmap(primary=None))
    submit(s, "a", now=0.0)
    fails: list[Fail[str]] = []
    while not fails:
        wake = s.next_wakeup()
        assert wake is not None and wake <= TIMEOUT
        fails = [a for a in s.tick(wake) if isinstance(a, Fail)]
    assert isinstance(fails[0].error, ShardUnavailableError)
    assert "partition 0 has no primary" in str(fails[0].error)


def test_a_timeout_names_the_last_refusal() -> None:
    s = session()
    msg = only_send(submit(s, "a"))
    s.on_reply(reply(msg.route.req_id, "OVERLOADED", msg="the primary is busy"), 0.0)
    [out] = s.tick(TIMEOUT)
    assert isinstance(out, Fail) and isinstance(out.error, ZpsTimeoutError)
    assert "(last refused: OVERLOADED: the primary is busy)" in str(out.error)


def test_broker_calls_time_out_unless_forever() -> None:
    s = session()
    s.call(MsgType.CLOCK, {"op": "tick"}, "clock", 0.0)
    s.call(MsgType.STATUS, {}, "status", 0.0)
    s.call(MsgType.TASK, {"op": "next"}, "forever", 0.0, forever=True)
    out = s.tick(TIMEOUT)
    msgs = {a.token: str(a.error) for a in out if isinstance(a, Fail)}
    assert msgs == {
        "clock": "the broker did not answer CLOCK within 5s",
        "status": "the broker did not answer the status request",
    }
    assert len(s) == 1 and s.next_wakeup() is None


def test_duplicate_replies_are_delivered_once() -> None:
    s = session()
    msg = only_send(submit(s, "a"))
    assert len(s.on_reply(reply(msg.route.req_id), 0.1)) == 1
    assert s.on_reply(reply(msg.route.req_id), 0.2) == []
    call_id, _ = s.call(MsgType.CLOCK, {"op": "tick"}, "c", 0.0)
    assert len(s.on_reply(answer(MsgType.CLOCK, call_id, {"st": "OK", "step": 3}), 0.1)) == 1
    assert s.on_reply(answer(MsgType.CLOCK, call_id, {"st": "OK", "step": 3}), 0.1) == []


def test_status_replies_are_matched_by_id_out_of_order() -> None:
    s = session()
    first, _ = s.call(MsgType.STATUS, {}, "first", 0.0)
    second, _ = s.call(MsgType.STATUS, {}, "second", 0.0)
    [out] = s.on_reply(answer(MsgType.STATUS, second, {"n": 2}), 0.1)
    assert isinstance(out, Deliver) and out.token == "second" and out.msg.header == {"n": 2}
    [out] = s.on_reply(answer(MsgType.STATUS, first, {"n": 1}), 0.1)
    assert isinstance(out, Deliver) and out.token == "first" and out.msg.header == {"n": 1}
    assert s.on_reply(answer(MsgType.STATUS, 0, {"n": 0}), 0.1) == []  # no id: no match


def test_broker_call_statuses() -> None:
    s = session()
    job, _ = s.call(MsgType.TASK, {"op": "next"}, "job", 0.0)
    bad, _ = s.call(MsgType.TASK, {"op": "done"}, "bad", 0.0)
    [out] = s.on_reply(answer(MsgType.TASK, job, {"st": "JOB_FAILED", "msg": "boom"}), 0.1)
    assert isinstance(out, Fail) and isinstance(out.error, JobFailedError)
    [out] = s.on_reply(answer(MsgType.TASK, bad, {"st": "BAD_REQUEST", "msg": "no"}), 0.1)
    assert isinstance(out, Fail) and "no" in str(out.error)
    ok, _ = s.call(MsgType.CLOCK, {"op": "join"}, "ok", 0.0)
    assert s.on_reply(reply(ok), 0.1) == []  # a REPLY is not the answer to a CLOCK call
    [out] = s.on_reply(answer(MsgType.CLOCK, ok, {"st": "OK", "step": 7}), 0.1)
    assert isinstance(out, Deliver) and out.msg.header["step"] == 7


def test_seqs_are_unique_and_increasing_across_retries() -> None:
    s = session()
    seqs = []
    for i in range(5):
        msg = only_send(submit(s, f"t{i}"))
        seqs.append(msg.header["seq"])
        s.on_reply(reply(msg.route.req_id, "NOT_PRIMARY"), 0.0)
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    resent = sent(s.tick(1.0))
    assert sorted(m.header["seq"] for m in resent) == seqs  # re-sends keep their seq
    msg = only_send(submit(s, "later"))
    assert msg.header["seq"] > max(seqs)


def test_abandon_and_close_fail_each_token_once() -> None:
    s = session()
    msg = only_send(submit(s, "a"))
    submit(s, "b")
    s.call(MsgType.CLOCK, {}, "c", 0.0)
    err = RuntimeError("gone")
    assert [a.token for a in s.abandon(msg.route.req_id, err)] == ["a"]
    assert s.abandon(msg.route.req_id, err) == []
    assert sorted(a.token for a in s.close(err)) == ["b", "c"]
    assert len(s) == 0 and s.next_wakeup() is None


def test_acks_one_goes_in_the_header() -> None:
    s: ClientSession[str] = ClientSession(b"c", timeout=1.0, max_backoff=1.0, acks=1)
    s.on_map(cmap(), 0.0)
    assert only_send(submit(s, "a")).header["acks"] == 1
    assert "acks" not in only_send(submit(session(), "a")).header


def submit_step(
    s: ClientSession[str], token: str, *, lazy: bool = False, now: float = 0.0
) -> list[Action[str]]:
    """A pipelined step's request: a push and the next pull, in one message."""
    enc = Encoder()
    ops = [
        {"op": "push_rows", "t": "emb", "ids": enc.array(np.arange(3)), "g": enc.array(np.ones(3))},
        {"op": "pull_rows", "t": "emb", "ids": enc.array(np.arange(3))},
    ]
    return s.submit(0, ops, enc, token, now, lazy=lazy)


def test_a_request_of_several_operations_takes_its_reply_in_two_parts() -> None:
    s = session()
    assert "er" not in only_send(submit(s, "one")).header  # one operation: one answer
    msg = only_send(submit_step(s, "a"))
    assert msg.header["er"] == 1 and "lz" not in msg.header
    assert only_send(submit_step(s, "b", lazy=True)).header["lz"] == 1
    # The reads first: delivered partial, and the request waits on for its writes.
    early = reply(msg.route.req_id, res=[None, {"st": "OK"}], part=1)
    [out] = s.on_reply(early, 0.1)
    assert isinstance(out, Deliver) and out.partial and out.token == "a"
    assert len(s) == 3 and s.stats.early_replies == 1
    # Still timed and re-sent whole (same seq and body) as any request in flight.
    resent = {m.route.req_id: m for m in sent(s.on_map(cmap(2, epoch=2), 0.2))}
    assert resent[msg.route.req_id].header == msg.header
    [final] = s.on_reply(reply(msg.route.req_id, res=[{"st": "OK"}, {"st": "OK"}]), 0.3)
    assert isinstance(final, Deliver) and not final.partial and final.token == "a"
    assert len(s) == 2
    assert s.on_reply(reply(msg.route.req_id, res=[{"st": "OK"}, {"st": "OK"}]), 0.4) == []


def test_a_failed_write_after_an_early_reply_fails_the_request() -> None:
    s = session()
    msg = only_send(submit_step(s, "a"))
    s.on_reply(reply(msg.route.req_id, res=[None, {"st": "OK"}], part=1), 0.1)
    assert s.on_reply(reply(msg.route.req_id, "NOT_PRIMARY"), 0.2) == []
    assert len(s) == 1  # parked: re-sent, not failed
    [out] = s.tick(TIMEOUT + 1)
    assert isinstance(out, Fail) and isinstance(out.error, ShardUnavailableError)
    assert "partition 0 has no primary" in str(out.error)


def test_answers_to_background_writes_ride_on_another_reply() -> None:
    s = session()
    first = only_send(submit_step(s, "a", lazy=True))
    second = only_send(submit_step(s, "b", lazy=True))
    s.on_reply(reply(first.route.req_id, res=[None, {"st": "OK"}], part=1), 0.1)
    # The second step's early reply carries the first's writes' answer (and junk).
    carried = [[first.route.req_id, [{"st": "OK"}, {"st": "OK"}]], ["x", []], [10**9, []], 7]
    early = reply(second.route.req_id, res=[None, {"st": "OK"}], part=1, acked=carried)
    out = s.on_reply(early, 0.2)
    assert [(type(a).__name__, a.token, a.partial) for a in out if isinstance(a, Deliver)] == [
        ("Deliver", "a", False),
        ("Deliver", "b", True),
    ]
    assert s.stats.carried_acks == 1 and len(s) == 1
    # A final reply may carry others too; an answer already given is not given again.
    final = reply(second.route.req_id, res=[{"st": "OK"}, {"st": "OK"}], acked=carried[:1])
    [out_b] = s.on_reply(final, 0.3)
    assert isinstance(out_b, Deliver) and out_b.token == "b" and len(s) == 0


# -- what is submitted again: after MOVED (rule 8), a read never answered (rule 9) ------


@dataclass
class Part:
    body: dict[str, Any]
    arrays: dict[str, np.ndarray]
    reply_bytes: int = 0


def submit_parts(s: ClientSession[str], token: str, parts: list[Part], p: int = 0) -> Message:
    enc = Encoder()
    ops = [{**part.body, **{k: enc.array(a) for k, a in part.arrays.items()}} for part in parts]
    return only_send(s.submit(p, ops, enc, token, 0.0, parts=parts))


def halves(version: int) -> ClusterMap:
    """Slots alternate between partitions 0 and 1 (live resharding moved half of them)."""
    parts = {p: PartitionInfo(epoch=1, primary="s-a") for p in range(2)}
    return ClusterMap(version, 16, np.arange(16, dtype=np.int32) % 2, parts, "b1")


def test_moved_resubmits_each_operation_split_by_the_newest_map() -> None:
    s = session(cmap(1))  # every slot on partition 0
    ids = np.arange(64, dtype=np.int64)
    pull = Part({"op": "pull_rows", "t": "emb"}, {"ids": ids}, 64 * 16)
    tables = Part({"op": "tables"}, {})
    msg = submit_parts(s, "a", [pull, tables])
    s.on_map(halves(2), 0.1)  # the map that moved half the slots to partition 1
    [out] = s.on_reply(reply(msg.route.req_id, "MOVED", msg="slots moved"), 0.2)
    assert isinstance(out, Resubmit) and out.token == "a" and out.partition == 0
    assert out.req_id == msg.route.req_id and len(s) == 0  # the request is over
    rows, whole = out.plans
    assert whole is None  # on no slot: whole, to the same partition
    assert rows is not None and sorted(p for p, *_ in rows.pieces) == [0, 1]
    got = np.sort(np.concatenate([a["ids"] for _, _, a, _ in rows.pieces]))
    np.testing.assert_array_equal(got, ids)  # every id once, each where the map says
    assert sum(r for *_, r in rows.pieces) == 64 * 16
    for p, _, a, _ in rows.pieces:
        assert [q for q, _ in split_by_partition(a["ids"], halves(2))] == [p]
    # A late answer to the same request is ignored.
    assert s.on_reply(reply(msg.route.req_id, "OK", res=[{}, {}]), 0.3) == []


def test_a_second_moved_under_the_same_map_asks_the_broker_for_the_map() -> None:
    s = session(halves(2))
    part = Part({"op": "push_dense", "t": "w", "chunk": 3}, {"g": np.ones(4, np.float32)})
    first = submit_parts(s, "a", [part])
    out = s.on_reply(reply(first.route.req_id, "MOVED"), 0.1)
    assert [type(a) for a in out] == [Resubmit]  # the map may be newer than the request
    second = submit_parts(s, "b", [part])
    out = s.on_reply(reply(second.route.req_id, "MOVED"), 0.2)
    assert [type(a) for a in out] == [Send, Resubmit]
    assert isinstance(out[0], Send) and decode(out[0].frames).route.mtype is MsgType.HELLO
    s.on_map(halves(3), 0.3)
    third = submit_parts(s, "c", [part])
    assert [type(a) for a in s.on_reply(reply(third.route.req_id, "MOVED"), 0.4)] == [Resubmit]


def test_moved_again_under_the_same_map_is_held_back_until_a_newer_one() -> None:
    """The first MOVED under a map version goes again at once; a second one under the
    same version is held back (``after``) 10 ms plus as long as that version has been
    answered MOVED, at most ``max_backoff``; a newer map starts again from nothing."""
    s = session(halves(2))
    part = Part({"op": "push_dense", "t": "w", "chunk": 3}, {"g": np.ones(4, np.float32)})

    def moved(token: str, now: float) -> Resubmit[str]:
        msg = submit_parts(s, token, [part])
        [out] = [a for a in s.on_reply(reply(msg.route.req_id, "MOVED"), now)
                 if isinstance(a, Resubmit)]  # fmt: skip
        return out

    assert moved("a", 1.0).after == 0.0
    assert moved("b", 1.0).after == pytest.approx(0.01)  # at the same instant: 10 ms
    assert moved("c", 1.05).after == pytest.approx(0.06)
    assert moved("d", 9.0).after == s.max_backoff  # a map that stays stale
    s.on_map(halves(3), 9.1)
    assert moved("e", 9.2).after == 0.0


def test_operations_moved_again_and_again_keep_the_first_deadline() -> None:
    # A map that keeps sending operations back (rebuilt by a broker that lost its record
    # after a resharding, say): each new request keeps the refused one's deadline, so the
    # caller's wait ends at its timeout instead of looping on MOVED for ever.
    s = session(halves(2))
    part = Part({"op": "push_dense", "t": "w", "chunk": 3}, {"g": np.ones(4, np.float32)})
    enc = Encoder()
    body = {**part.body, "g": enc.array(part.arrays["g"])}
    msg = only_send(s.submit(0, [body], enc, "a", 0.0, parts=[part]))
    now, deadline = 0.0, TIMEOUT
    for _ in range(5):
        now += TIMEOUT / 4
        [out] = [a for a in s.on_reply(reply(msg.route.req_id, "MOVED"), now)
                 if isinstance(a, Resubmit)]  # fmt: skip
        assert out.deadline == deadline
        submit(s, "other", now)  # in flight meanwhile, its deadline later than "a"'s
        enc = Encoder()
        body = {**part.body, "g": enc.array(part.arrays["g"])}
        actions = s.submit(0, [body], enc, "a", now, parts=[part], deadline=out.deadline)
        assert s.next_wakeup() == s.earliest_deadline() == deadline
        if now >= deadline:
            failed = [a for a in s.tick(now) if isinstance(a, Fail)]
            assert [f.token for f in failed] == ["a"]
            assert isinstance(failed[0].error, ZpsTimeoutError)
            return
        msg = only_send(actions)
    raise AssertionError("the operation was still waiting past its deadline")


def test_a_partition_a_restarted_broker_does_not_list_yet_is_waited_for() -> None:
    # The broker restarted without its record: its first maps have the configured 2
    # partitions until the shards' claims bring back the third (zps/core/slotclaims.py).
    s = session(cmap(n=3))
    msg = only_send(submit(s, "a", p=2))
    assert s.on_map(cmap(1, incarnation="b2", n=2), 0.1) == []  # waits: no Fail
    [again] = sent(s.on_map(cmap(2, incarnation="b2", n=3), 0.2))
    assert again.route.req_id == msg.route.req_id and again.route.partition == 2
    # Still unlisted at its deadline: it fails naming what it waited for.
    only_send(submit(s, "b", p=2))
    assert s.on_map(cmap(3, incarnation="b3", n=2), 0.3) == []
    failed = [a for a in s.tick(TIMEOUT + 0.1) if isinstance(a, Fail)]
    assert {f.token for f in failed} == {"a", "b"}
    err = failed[0].error
    assert isinstance(err, ShardUnavailableError) and "broker that restarted" in str(err)
    # A map of the same incarnation that dropped the partition fails it at once.
    s = session(cmap(n=3))
    only_send(submit(s, "c", p=2))
    [out] = s.on_map(cmap(2, n=2), 0.1)
    assert isinstance(out, Fail) and "not in the cluster map" in str(out.error)


def test_moved_without_the_parts_fails_the_request_naming_moved() -> None:
    s = session()
    msg = only_send(submit(s, "a"))
    [out] = s.on_reply(reply(msg.route.req_id, "MOVED"), 0.1)
    assert isinstance(out, Fail) and getattr(out.error, "code", "") == "MOVED"


def test_a_read_a_final_reply_has_no_answer_for_is_submitted_again() -> None:
    s = session()
    push = Part({"op": "push_rows", "t": "emb"}, {"ids": np.arange(3), "g": np.ones(3)})
    pull = Part({"op": "pull_rows", "t": "emb"}, {"ids": np.arange(3)}, 24)
    msg = submit_parts(s, "a", [push, pull])
    # The first part (the pull's answer) was lost: the final part has None in its place.
    [out] = s.on_reply(reply(msg.route.req_id, res=[{"st": "OK"}, None]), 0.1)
    assert isinstance(out, Deliver) and not out.partial and out.again == (1,)
    # A first part names nothing; nor does a final reply that answers everything.
    msg = submit_parts(s, "b", [push, pull])
    [early] = s.on_reply(reply(msg.route.req_id, res=[None, {"st": "OK"}], part=1), 0.2)
    assert isinstance(early, Deliver) and early.partial and early.again == ()
    [final] = s.on_reply(reply(msg.route.req_id, res=[{"st": "OK"}, {"st": "OK"}]), 0.3)
    assert isinstance(final, Deliver) and final.again == ()
    # A write's missing answer is never asked again (it would apply twice).
    msg = submit_parts(s, "c", [pull, push])
    [out] = s.on_reply(reply(msg.route.req_id, res=[{"st": "OK"}, None]), 0.4)
    assert isinstance(out, Deliver) and out.again == ()


# -- a broker pair --------------------------------------------------------------


def test_a_switch_resends_everything_on_the_next_map_even_the_same_incarnation() -> None:
    s = session(cmap(5))
    req = only_send(submit(s, "a"))
    call_id, _ = s.call(MsgType.CLOCK, {"op": "tick"}, "c", 0.0, forever=True)
    s.switched()
    out = sent(s.on_map(cmap(3), 0.6))  # an older version, same incarnation: still taken
    assert {m.route.req_id for m in out} == {req.route.req_id, call_id}
    assert s.map is not None and s.map.version == 3
    # only the first map after the switch: the next one is judged as usual
    assert s.on_map(cmap(2), 0.7) == []


def test_passive_parks_a_request_and_leaves_a_broker_call_waiting() -> None:
    s = session()
    req = only_send(submit(s, "a"))
    assert s.on_reply(reply(req.route.req_id, "PASSIVE", passive=True), 0.1) == []
    assert len(s) == 1
    again = sent(s.tick(1.0))
    assert [m.route.req_id for m in again] == [req.route.req_id]
    call_id, _ = s.call(MsgType.TASK, {"op": "next", "job": "j"}, "t", 1.0)
    passive = answer(MsgType.TASK, call_id, {"st": "PASSIVE", "passive": True})
    assert s.on_reply(passive, 1.1) == []
    assert len(s) == 2
    done = s.on_reply(answer(MsgType.TASK, call_id, {"st": "OK", "task": None}), 1.2)
    assert len(done) == 1 and isinstance(done[0], Deliver)


def test_unsent_parks_a_request_for_its_backoff() -> None:
    s = session()
    req = only_send(submit(s, "a"))
    s.unsent(req.route.req_id, 0.0)
    assert s.tick(0.001) == []
    assert [m.route.req_id for m in sent(s.tick(1.0))] == [req.route.req_id]
    s.unsent(12345, 1.0)  # unknown: nothing happens


def test_choice_one_endpoint_never_switches_nor_fences() -> None:
    c = BrokerChoice(1, silence=0.5, retry=0.1, now=0.0)
    assert c.tick(100.0) is None
    assert c.heard(0, None, 100.0) is False
    with pytest.raises(ValueError):
        BrokerChoice(0, silence=0.5, retry=0.1, now=0.0)


def test_choice_switches_after_silence_and_back() -> None:
    c = BrokerChoice(2, silence=0.5, retry=0.1, now=0.0)
    assert c.tick(0.3) is None
    c.heard(0, 1, 0.3)  # the active broker (term 1) speaks
    assert c.tick(0.7) is None
    assert c.tick(0.8) == "switch" and c.current == 1
    assert c.tick(1.0) is None
    assert c.tick(1.3) == "switch" and c.current == 0  # the other one is silent too
    assert c.switches == 2


def test_choice_retries_a_passive_broker_while_the_other_is_silent() -> None:
    c = BrokerChoice(2, silence=0.5, retry=0.1, now=0.0)
    assert c.tick(0.5) == "switch" and c.current == 1
    c.refused(1, 0.55)
    c.refused(0, 0.55)  # not the current one: ignored
    assert c.tick(0.6) is None
    assert c.tick(0.65) == "hello"
    assert c.tick(0.75) == "hello"
    # the standby took over: its map (term 2) keeps it current and stops the retries
    assert c.heard(1, 2, 0.8) is False
    assert c.tick(0.95) is None
    assert c.tick(1.31) == "switch"  # then silent for a whole timeout again


def test_choice_follows_a_newer_term_and_fences_an_older_one() -> None:
    c = BrokerChoice(2, silence=0.5, retry=0.1, now=0.0)
    assert c.heard(0, 1, 0.1) is False and c.term == 1
    # the other broker took over with term 2: follow it at once
    assert c.heard(1, 2, 0.2) is True and c.current == 1 and c.term == 2
    # the old one resumes from a pause, still stamping term 1: dropped
    assert c.heard(0, 1, 0.3) is None and c.current == 1
    # a reply forwarded by the old one (no term) does not switch nor keep it alive
    assert c.heard(0, None, 0.4) is False and c.current == 1
    assert c.tick(0.75) == "switch"  # nothing from broker 1 since 0.2


def test_broker_endpoints_one_a_pair_or_a_list() -> None:
    a, b = "tcp://a:5555", "tcp://b:5555"
    assert broker_endpoints(a) == (a,)
    assert broker_endpoints(f"{a}, {b}") == (a, b)
    assert broker_endpoints([a, b]) == (a, b)
    assert ShardConfig(broker=f"{a},{b}").endpoints == (a, b)
    assert ShardConfig(brokers=(a, b)).endpoints == (a, b)
    assert WorkerConfig().endpoints == (WorkerConfig.broker,)
    for bad, what in [
        ([a, b, "tcp://c:1"], "one broker endpoint or a pair"),
        ([a, a], "twice"),
        ("a:5555", "ZeroMQ endpoint"),
        (5555, "an endpoint or a list"),
        ([], "one broker endpoint or a pair"),
    ]:
        with pytest.raises(ConfigError, match=what):
            broker_endpoints(bad)
    with pytest.raises(ConfigError, match=r"shard\.brokers"):
        ShardConfig(brokers=("nope",))


def test_a_relinked_partition_re_sends_what_is_in_flight_to_it_at_once() -> None:
    """Rule 10: the broker says partition 0's primary made its data link again: the
    requests in flight to it go again, unchanged (same id, same seq); those to another
    partition and a parked one stay as they are."""
    s = session()
    first = only_send(submit(s, "a", p=0))
    only_send(submit(s, "b", p=1))
    parked = only_send(submit(s, "c", p=0))
    assert s.on_reply(reply(parked.route.req_id, "OVERLOADED", msg="busy"), 0.1) == []
    again = sent(s.relinked([0], 0.2))
    assert [m.route.req_id for m in again] == [first.route.req_id]
    assert again[0].header == first.header  # same seq: the shard applies it once
    assert s.relinked([1, 5], 0.3) != []  # partition 1's request; 5 has none
    assert s.relinked([], 0.3) == []


def test_a_connection_made_again_re_sends_everything_in_flight_and_the_calls() -> None:
    """Rule 10, this client's own connection: every request in flight and not parked,
    whatever its partition, and every broker call go again."""
    s = session()
    a = only_send(submit(s, "a", p=0))
    b = only_send(submit(s, "b", p=1))
    parked = only_send(submit(s, "c", p=0))
    assert s.on_reply(reply(parked.route.req_id, "OVERLOADED", msg="busy"), 0.1) == []
    call_id, _ = s.call(MsgType.STATUS, {}, "st", 0.1)
    again = sent(s.relinked(None, 0.2))
    assert sorted(m.route.req_id for m in again) == sorted(
        [a.route.req_id, b.route.req_id, call_id]
    )
