"""A shard's liveness link (``h-`` + its identity): who it speaks for, what it may send."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from zps.broker.acceptance import FromClient, FromShard, Reject, accept
from zps.core.membership import (
    LIVENESS_PREFIX,
    SHARD_PREFIX,
    is_liveness,
    liveness_identity,
    speaks_for,
)
from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import Heartbeat, ShardHeartbeat


@dataclass
class Members:
    shards: set[str] = field(default_factory=set)
    primaries: dict[int, str] = field(default_factory=dict)

    def primary_of(self, partition: int) -> str | None:
        return self.primaries.get(partition)


SHARD = b"s-host-7-0"
BEAT = liveness_identity(SHARD)


def control(mtype: MsgType, header: dict[str, Any]) -> list[Any]:
    return encode(Route(mtype), header)


def test_a_liveness_link_speaks_for_its_shard() -> None:
    assert BEAT == b"h-s-host-7-0" and BEAT.startswith(LIVENESS_PREFIX)
    assert is_liveness(BEAT) and speaks_for(BEAT) == SHARD
    # Any other identity speaks for itself, a shard's own included.
    for ident in (SHARD, b"c-0123", b"h-", b"h-c-0123", b"hs-x", b""):
        assert not is_liveness(ident)
        assert speaks_for(ident) == ident
    assert SHARD.startswith(SHARD_PREFIX)


def test_a_liveness_link_may_send_heartbeats() -> None:
    verdict = accept(BEAT, [b"", *control(MsgType.HEARTBEAT, {"t": 2.5, "lsn": 4})], Members())
    assert verdict == FromShard(Route(MsgType.HEARTBEAT), ShardHeartbeat(t=2.5, lsn=4))


@pytest.mark.parametrize(
    "mtype", [MsgType.REGISTER, MsgType.BYE, MsgType.HELLO, MsgType.STATUS, MsgType.ASSIGN]
)
def test_a_liveness_link_may_send_nothing_else(mtype: MsgType) -> None:
    verdict = accept(BEAT, [b"", *control(mtype, {"address": ""})], Members())
    assert isinstance(verdict, Reject) and verdict.counter == "malformed"


def test_a_liveness_link_carries_no_replies() -> None:
    """Replies go on the data link; one here would bypass the shard's fencing there."""
    reply = encode(Route(MsgType.REPLY, 0, 1, 3), {"st": "OK"})
    verdict = accept(BEAT, [b"c-0123", *reply], Members({SHARD.decode()}))
    assert isinstance(verdict, Reject) and verdict.counter == "malformed"
    for frames in ([b""], [Route(MsgType.HEARTBEAT).pack()]):
        verdict = accept(BEAT, frames, Members())
        assert isinstance(verdict, Reject) and verdict.counter == "malformed"


def test_an_h_identity_that_names_no_shard_is_a_client() -> None:
    verdict = accept(b"h-c-0123", control(MsgType.HEARTBEAT, {}), Members())
    assert verdict == FromClient(Route(MsgType.HEARTBEAT), Heartbeat())
