"""The heartbeat policy of a shard's liveness thread (zps.shard.liveness), with the time
passed in: the loop's heartbeats go out as they are; a loop two beats late gets its last
heartbeat sent again each interval with the send time of now; a loop held for
max_loop_stall gets none (the broker fails the shard over)."""

from __future__ import annotations

import math

from zps.protocol.codec import MsgType, Route, decode, encode
from zps.shard.liveness import Liveness, retimed

HB = 0.25  # exact in binary: the times below add up exactly


def _beat(t: float) -> list[bytes]:
    header = {"t": t, "lsn": 7, "epoch": 3, "in_sync": ["s-b"], "term": 2}
    return [b"", *(bytes(f) for f in encode(Route(MsgType.HEARTBEAT), header))]


def _t(frames: list[bytes] | None) -> float:
    assert frames is not None
    return float(decode(frames[1:]).header["t"])


def test_the_loops_heartbeats_go_out_as_they_are() -> None:
    p = Liveness(HB, 5, 30.0, now=0.0)
    assert p.tick(1.0) is None  # nothing to repeat before the loop's first beat
    assert p.due(1.0) == math.inf  # and no wake-up for it (the thread sleeps in its poll)
    beat = _beat(1.0)
    assert p.posted(beat, 1.0) is beat
    assert p.due(1.05) == 1.0 + 2 * HB  # a look when the loop is two beats late
    assert p.tick(1.2) is None and p.covered == 0


def test_a_late_loop_gets_its_last_heartbeat_again_each_interval() -> None:
    p = Liveness(HB, 5, 30.0, now=0.0)
    p.posted(_beat(1.0), 1.0)
    again = p.tick(1.0 + 2 * HB)
    assert _t(again) == 1.0 + 2 * HB and p.covered == 1
    header = decode(again[1:]).header  # what the loop said, but the time and in-sync set
    assert header == {"t": 1.0 + 2 * HB, "lsn": 7, "epoch": 3, "term": 2}
    assert p.due(1.6) == 1.0 + 3 * HB
    assert p.tick(1.6) is None  # not within an interval
    assert _t(p.tick(1.0 + 3 * HB)) == 1.0 + 3 * HB and p.covered == 2
    p.posted(_beat(2.5), 2.5)  # the loop is back: 1.5 s between its beats
    assert p.longest_gap == 1.5 and p.tick(2.6) is None


def test_a_loop_held_past_max_loop_stall_gets_no_heartbeats() -> None:
    p = Liveness(HB, 5, 1.0, now=0.0)
    p.posted(_beat(0.0), 0.0)
    sent = [t for t in (0.5, 0.75, 1.0, 1.25, 1.5) if p.tick(t) is not None]
    assert sent == [0.5, 0.75]  # then held for max_loop_stall: the broker decides
    assert _t(p.posted(_beat(3.0), 3.0)) == 3.0  # back: its heartbeats go out again
    assert p.tick(3.5) is not None


def test_a_broker_timeout_shorter_than_two_beats_is_covered_sooner() -> None:
    p = Liveness(HB, 2, 30.0, now=0.0)  # dead after 0.5 s
    p.posted(_beat(0.0), 0.0)
    assert p.grace == HB and p.tick(HB) is not None


def test_retimed_changes_the_send_time_and_drops_the_in_sync_set() -> None:
    """The broker replaces its in-sync set with a heartbeat's: a repeated one must not
    name a replica that restarted while the loop was held (it has nothing yet)."""
    frames = _beat(1.0)
    out = retimed(frames, 9.5)
    assert out[0] == b"" and out[1] == frames[1]
    want = {k: v for k, v in decode(frames[1:]).header.items() if k != "in_sync"}
    assert decode(out[1:]).header == {**want, "t": 9.5}
