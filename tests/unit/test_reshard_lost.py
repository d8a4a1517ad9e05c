"""A live move not yet copied whose destination partition is lost: the move is cancelled
at once and the source serves its slots again (zps/broker/reshard.py, Resharder._call and
_undo), rather than holding their fence for the whole request timeout (30 s).  Found by
the simulator: seed 302451 of the long run's mix at 3eb0496, where a quarter of a served
partition's slots refused every request for 25 s after every node was back."""

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
