"""What a client makes of a message from a broker: an answer the session matches to a
request or broker call (:data:`REPLIES`), or the record of one that is not
(:func:`from_broker`); and what a new map says of lost partitions (:func:`lost_changes`)."""

from __future__ import annotations

from typing import Any

from zps.core.routing import ClusterMap
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


def lost_changes(old: ClusterMap, new: ClusterMap, timeout: float) -> list[str]:
    """What to say when a map ``new`` follows ``old``: each partition that lost its last
    live copy (its calls wait: ClientSession, rule 5) and each that is served again."""
    lines = []
    for p, info in new.partitions.items():
        was = old.partitions.get(p)
        if info.lost and not (was is not None and was.lost):
            lines.append(
                f"partition {p} has no live copy: its calls wait for a copy holding its "
                f"data (or `zps-server reset-partition`) for at most {timeout:g}s each"
            )
        elif was is not None and was.lost and not info.lost:
            lines.append(f"partition {p} has a live copy again")
    return lines
