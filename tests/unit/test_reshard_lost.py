"""Lost partitions in live resharding (zps/broker/reshard.py).

A live move not yet copied whose destination partition is lost: the move is cancelled
at once and the source serves its slots again (Resharder._call and _undo), rather than
holding their fence for the whole request timeout (30 s).  Found by the simulator: seed
302451 of the long run's mix at 3eb0496, where a quarter of a served partition's slots
refused every request for 25 s after every node was back.

A partition past the target that holds no slot and is lost goes all the same
(zps.core.reshard.needed): found by tests/integration/test_partition_made_again.py, whose
broker, SIGKILLed just after a scale-down, restarted from the record before it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from zps.broker.acceptance import MoveReply
from zps.broker.reshard import Resharder
from zps.broker.reshardstats import MoveFailed
from zps.core.brokerstate import ReshardRecord
from zps.core.cluster import ClusterState
from zps.core.reshard import needed
from zps.protocol.codec import decode


@dataclass
class _Part:
    epoch: int = 1


@dataclass
class _Map:
    partitions: dict[int, _Part] = field(default_factory=lambda: {0: _Part(), 1: _Part()})


class _State:
    """Partition 0 lost (no primary, no copy holding its data), partition 1 served."""

    n_partitions = 2
    n_slots = 16
    map_version = 23
    map = _Map()

    def __init__(self) -> None:
        self.slot_map = np.array([0] * 8 + [1] * 8, dtype=np.int32)

    def primary_of(self, p: int) -> str | None:
        return {1: "s-3"}.get(p)

    def is_lost(self, p: int) -> bool:
        return p == 0


class _Host:
    def __init__(self) -> None:
        self.state = _State()
        self.sent: list[tuple[int, str]] = []
        self.r: Resharder | None = None

    def routing(self) -> bool:
        return True

    def state_changed(self) -> None:
        pass

    async def persisted(self, *, standby: bool = False) -> bool:
        return True

    def post(self, frames: list[Any]) -> None:
        msg = decode(frames[2:4])
        op = msg.header["ops"][0]["op"]
        self.sent.append((msg.route.partition, op))
        reply = MoveReply(msg.route, {"st": "OK", "res": [{"st": "OK"}]}, [], "s-3")
        assert self.r is not None
        asyncio.get_running_loop().call_soon(self.r.on_reply, reply)


def test_a_lost_destination_cancels_the_move_and_the_source_unfences_at_once() -> None:
    """Undoing a move to lost partition 0: the source's unfence goes out and is done, the
    destination's drop fails at once (no copy to ask), and what is left to retry is that
    drop alone (the source is not asked to unfence again every retry)."""
    host = _Host()
    r = host.r = Resharder(host, durable=True, heartbeat_interval=0.1, liveness=10)  # type: ignore[arg-type]
    r.record = ReshardRecord(1, source=1, dest=0, slots=(9, 11), stage="copying")

    async def go() -> None:
        with pytest.raises(MoveFailed, match="partition 0 is lost"):
            await asyncio.wait_for(r._undo(r.record), 1.0)  # type: ignore[arg-type]

    asyncio.run(go())
    assert host.sent == [(1, "slots_unfence")]
    # The unfence is done: what is left to retry is the destination's drop.
    assert r.record is not None and (r.record.source, r.record.dest) == (-1, 0)


class _ClusterHost(_Host):
    """A real ClusterState behind the Resharder; every request answered OK (done)."""

    def __init__(self, state: ClusterState) -> None:
        super().__init__()
        self.state = state  # type: ignore[assignment]

    async def apply(self, assignments: list[Any]) -> None:
        pass

    async def publish_if_changed(self, before: int) -> None:
        pass

    def post(self, frames: list[Any]) -> None:
        msg = decode(frames[2:4])
        self.sent.append((msg.route.partition, msg.header["ops"][0]["op"]))
        ok = {"st": "OK", "res": [{"st": "OK", "done": True}]}
        primary = self.state.primary_of(msg.route.partition) or ""
        reply = MoveReply(msg.route, ok, [], primary)
        assert self.r is not None
        asyncio.get_running_loop().call_soon(self.r.on_reply, reply)


def test_a_lost_partition_past_the_target_with_no_slot_goes() -> None:
    """Scaling 2 -> 1: every slot is on p0, and p1 lost its copies (as when a broker
    restarts from a record written before p1 went, p1's copies spares by then).  p1 holds
    no row: the step removes it, instead of waiting for its primary for good."""
    cs = ClusterState(2, n_slots=16, replication=1)
    for name in ("a", "b"):
        cs.register_shard(name, host="h", pid=1, address=f"tcp://{name}", now=0.0)
    cs.move_slots(list(range(16)), 0)
    gone = cs.primary_of(1)
    assert gone is not None
    cs.node_gone(gone, 1.0)
    assert cs.is_lost(1) and cs.primary_of(0) is not None
    host = _ClusterHost(cs)
    r = host.r = Resharder(host, durable=True, heartbeat_interval=0.01, liveness=1)  # type: ignore[arg-type]
    r.record = ReshardRecord(1)
    asyncio.run(asyncio.wait_for(r._step(), 5.0))
    assert cs.n_partitions == 1
    assert r.record is None
    assert host.sent == [(0, "slots_compact"), (0, "slots_compact")]
    assert needed(cs.slot_map, 2, 1) == [0]
    assert needed(cs.slot_map, 2, 2) == [0, 1]
