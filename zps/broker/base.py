"""The broker's counters and its one way out.

One job: count what the broker did with each message (:class:`BrokerStats`) and send
through :class:`~zps.transport.Outbound` without ever waiting on a peer
(:class:`Outlet`; see the notes of :mod:`zps.broker.broker`).  The broker's other
parts, one module each, receive the outlet's calls they use:
:mod:`~zps.broker.persistence` (the state record and durable sends),
:mod:`~zps.broker.report` (status, metrics, logged state changes),
:mod:`~zps.broker.admission` (CURVE roles, other protocol versions, malformed
messages), :mod:`~zps.broker.datapath` (forwarding), :mod:`~zps.broker.control`
(registration, heartbeats, admin commands); :class:`~zps.broker.broker.Broker`
(the process: sockets, the receive loop, the timer loop) composes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from zps import transport
from zps.core.membership import FailureDetector, is_liveness, liveness_identity, speaks_for
from zps.ops.config import BrokerConfig
from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import Status, StatusReply

#: Room a STATUS reply needs in a client's allowance (a report is a few KiB per node).
REPLY_RESERVE = 256 * 1024


@dataclass
class BrokerStats:
    routed: int = 0
    replies: int = 0
    unavailable: int = 0
    malformed: int = 0
    undeliverable: int = 0
    stale_replies: int = 0
    #: Messages not sent because their peer's allowance was spent.
    dropped: int = 0
    #: Requests refused OVERLOADED (their shard's allowance was spent).
    overloaded: int = 0
    #: Messages in another protocol version, answered VERSION_MISMATCH.
    version_mismatch: int = 0
    #: CURVE: messages refused for their key (see ``refusals`` by reason), dropped.
    unauthorized: int = 0


class Outlet:
    """The broker's one way out: every message goes through :meth:`post`.

    ``out`` is set once the socket is bound; ``detector`` is the failure detector of
    the current state (a broker of a pair gets a new one when it resets)."""

    def __init__(self, config: BrokerConfig, stats: BrokerStats, detector: FailureDetector):
        self.config = config
        self.stats = stats
        self.detector = detector
        self.out: transport.Outbound | None = None

    def post(self, frames: list[Any]) -> transport.Posted:
        """Send without waiting (see the module notes)."""
        assert self.out is not None
        ident = frames[0]
        shard = isinstance(ident, bytes) and (ident.startswith(b"s-") or is_liveness(ident))
        limit = self.config.shard_queue_bytes if shard else self.config.client_queue_bytes
        posted = self.out.post(frames, limit)
        if posted is transport.Posted.DROPPED:
            self.stats.dropped += 1
        elif posted is transport.Posted.UNROUTABLE:
            self.stats.undeliverable += 1
            if shard:
                # zmq dropped the route: that connection of the shard is gone (a killed
                # process closes both); don't wait the whole liveness timeout to fail
                # over (the detector's rule: FailureDetector.route_dropped).
                node = speaks_for(ident).decode("utf-8", "replace")
                liveness = is_liveness(ident)
                if self.detector.route_dropped(node, liveness, time.monotonic()):
                    self.probe(node, liveness=not liveness)
        elif shard and is_liveness(ident):
            self.detector.linked(speaks_for(ident).decode("utf-8", "replace"))
        return posted

    def probe(self, node: str, *, liveness: bool) -> None:
        """An empty HEARTBEAT to the shard ``node`` on its liveness link or its data
        connection: a shard takes it as a probe; sent to learn whether zmq still has a
        route to that connection (:meth:`post` reports it if not)."""
        ident = node.encode()
        target = liveness_identity(ident) if liveness else ident
        self.post([target, b"", *encode(Route(MsgType.HEARTBEAT), {})])

    def probe_dropped(self, now: float) -> None:
        """Probe again the other connection of each shard one of whose routes dropped
        lately (its close may reach zmq a little after the first's)."""
        for node, liveness in self.detector.probes(now):
            self.probe(node, liveness=liveness)

    async def send(self, frames: list[Any]) -> bool:
        """:meth:`post` for callers that only ask whether the peer is known."""
        return self.post(frames) is not transport.Posted.UNROUTABLE

    def saturated(self, ident: bytes) -> bool:
        """True when a reply to this client would be dropped: don't build it."""
        assert self.out is not None
        return self.out.held(ident) + REPLY_RESERVE > self.config.client_queue_bytes

    def refuse(self, client: bytes, route: Route, code: Status, message: str) -> None:
        """Answer a client's request ``code`` (a REPLY to its partition and epoch)."""
        reply = Route(MsgType.REPLY, route.partition, route.epoch, route.req_id)
        self.post([client, *encode(reply, StatusReply(code, message).to_wire())])

    def refuse_call(self, ident: bytes, route: Route, msg: str) -> None:
        """Answer a broker call (TASK) BAD_REQUEST, in its own message type."""
        header = StatusReply(Status.BAD_REQUEST, msg).to_wire()
        self.post([ident, *encode(Route(route.mtype, req_id=route.req_id), header)])

    def forget(self, ident: bytes) -> None:
        """A peer left: drop what is held for it (and for its liveness link)."""
        if self.out is not None:
            self.out.forget(ident)
            self.out.forget(liveness_identity(ident))
