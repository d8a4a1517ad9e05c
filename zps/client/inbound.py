"""What a client makes of a message from a broker: an answer the session matches to a
request or broker call (:data:`REPLIES`), or the record of one that is not
(:func:`from_broker`)."""

from __future__ import annotations

from typing import Any

from zps.protocol.codec import MsgType
from zps.protocol.messages import BrokerToClient, Heartbeat, HelloAgain, MapUpdate

#: Answers matched to a request or broker call by the session.
REPLIES = frozenset({MsgType.REPLY, MsgType.STATUS, MsgType.CLOCK, MsgType.TASK})


def from_broker(mtype: MsgType, header: dict[str, Any]) -> BrokerToClient | None:
    """The record of a message from the broker that is not a reply (None: not one a
    client expects)."""
    match mtype:
        case MsgType.MAP:
            return MapUpdate.parse(header)
        case MsgType.HELLO:
            return HelloAgain.parse(header)
        case MsgType.HEARTBEAT:
            return Heartbeat.parse(header)
        case _:
            return None
