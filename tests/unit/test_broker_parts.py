"""The broker is a composition of parts (zps/broker/broker.py), each given only what it
uses: no part inherits from another or takes the broker, and a broker of a pair that
resets hands every part its new state (no sockets)."""

from __future__ import annotations

import inspect
import time
from typing import Any

from zps import transport
from zps.broker.admission import Admission
from zps.broker.base import Outlet
from zps.broker.broker import Broker
from zps.broker.control import Control
from zps.broker.datapath import DataPath
from zps.broker.persistence import Record
from zps.broker.report import Report
from zps.broker.routes import RouteTable
from zps.ops.config import BrokerConfig
from zps.protocol.codec import MsgType, Route

PARTS = (Outlet, Record, Report, Admission, DataPath, Control)


class _Out:
    """The broker's Outbound, recording what it is given."""

    queues: dict[bytes, Any] = {}

    def __init__(self) -> None:
        self.sent: list[list[Any]] = []

    def post(self, frames: list[Any], limit: int) -> transport.Posted:
        self.sent.append(frames)
        return transport.Posted.SENT


def test_no_part_inherits_or_takes_the_broker() -> None:
    for part in PARTS:
        assert part.__mro__ == (part, object), part
        for name, param in inspect.signature(part).parameters.items():
            annotation = str(param.annotation)
            assert "Broker " not in f"{annotation} " and "Broker]" not in annotation, (
                f"{part.__name__}({name}: {annotation})"
            )


def test_a_reset_hands_every_part_the_new_state() -> None:
    """After reset_state (a pair's takeover or step-down) the data path forwards by the
    new state: a request during the new start-up hold is refused, not routed."""
    b = Broker(BrokerConfig(partitions=2))
    out = _Out()
    b.out = out  # type: ignore[assignment]
    request = [b"c-1", Route(MsgType.REQUEST, 1, 1, 5).pack(), b"hdr"]
    b.state.hold_until = 0.0
    b.routes = RouteTable([None, b"s-a"], (False, False))
    assert b.datapath.forward(request) is True
    assert out.sent[-1][0] == b"s-a" and b.stats.routed == 1

    old = b.state
    b.reset_state(time.monotonic(), hold=60.0)
    assert b.state is not old
    parts: list[Any] = [b.outlet, b.admission, b.datapath, b.record, b.report, b.control_plane]
    for part in parts:
        for shared in ("state", "detector", "training"):
            if hasattr(part, shared):
                assert getattr(part, shared) is getattr(b, shared), (type(part).__name__, shared)
    b.routes = RouteTable([None, b"s-a"], (False, False))
    assert b.datapath.forward(request) is True
    assert out.sent[-1][0] == b"c-1", "routed by the old state, past the new hold"
    assert b.stats.routed == 1


class _Pair:
    """The broker pair as the record sees it: the standby holds what it is sent once
    :meth:`hold` is called."""

    active, term, record_term = True, 1, 1

    def __init__(self) -> None:
        self.waiting: list[Any] = []

    def mirrored(self) -> None:
        return None

    def after_held(self, callback: Any) -> None:
        self.waiting.append(callback)

    def hold(self) -> None:
        waiting, self.waiting = self.waiting, []
        for cb in waiting:
            cb()

    def peer_holds_now(self) -> bool:
        return not self.waiting

    def peer_alive(self, now: float) -> bool:
        return True


def test_without_a_data_dir_a_pairs_promoted_primary_waits_for_the_standby() -> None:
    """A pair without data dirs: the standby's copy is the record a takeover starts
    from, so a promoted primary's lease echoes wait until the standby holds its epoch
    (without, a takeover from the older copy could elect the old primary's)."""
    b = Broker(BrokerConfig(partitions=2))
    record = b.record
    floors = {0: 3, 1: 1}
    b.state.floor_of = lambda p: (floors[p], 0)  # type: ignore[method-assign]
    assert record.writer is None and not record.epoch_unrecorded(0)  # a single broker
    pair = _Pair()
    record.pair = pair
    assert record.epoch_unrecorded(0) and record.epoch_unrecorded(0)  # until held
    pair.hold()
    assert not record.epoch_unrecorded(0) and record.epoch_unrecorded(1)
    pair.hold()
    floors[0] = 4  # promoted again
    assert record.epoch_unrecorded(0) and not record.epoch_unrecorded(1)
    pair.hold()
    assert not record.epoch_unrecorded(0)
