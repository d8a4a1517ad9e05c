"""The broker's shared state and its one way out.

One job: declare what the broker's parts share (the cluster state, the failure
detector, the counters, the outbound queues...) and send through
:class:`~zps.transport.Outbound` without ever waiting on a peer (see the notes of
:mod:`zps.broker.broker`).  The parts build on it, one module each, in this order:
:mod:`~zps.broker.persistence` (the state record and durable sends),
:mod:`~zps.broker.report` (status, metrics, logged state changes),
:mod:`~zps.broker.admission` (CURVE roles, other protocol versions, malformed
messages), :mod:`~zps.broker.datapath` (forwarding), :mod:`~zps.broker.control`
(registration, heartbeats, admin commands), and :class:`~zps.broker.broker.Broker`
(the process: sockets, the receive loop, the timer loop).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from zps import transport
from zps.broker.pair import Pair
from zps.broker.reshard import Resharder
from zps.broker.routes import RouteTable
from zps.broker.statefile import StateWriter
from zps.broker.training import Training
from zps.core.brokerstate import BrokerState
from zps.core.cluster import ClusterState
from zps.core.membership import FailureDetector, is_liveness, liveness_identity, speaks_for
from zps.ops.config import BrokerConfig
from zps.ops.datadir import DataDirLock
from zps.ops.metrics import MetricsServer
from zps.ops.security import KeyRoles, RefusalLog
from zps.ops.systemd import Notifier
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


class BrokerBase:
    """What the broker's parts share; :class:`~zps.broker.broker.Broker` sets it up."""

    config: BrokerConfig
    notifier: Notifier
    state: ClusterState
    detector: FailureDetector
    stats: BrokerStats
    endpoint: str | None
    bound: asyncio.Event
    _stop: asyncio.Event
    _sock: transport.Channel | None
    _sock_addr: int  # its zmq socket's address, for the compiled data path
    _compiled: int  # messages the compiled data path forwarded
    _out: transport.Outbound | None
    _last_tick: float
    _last_ping: float
    #: Where each partition's requests go (zps.broker.routes), rebuilt from each map.
    routes: RouteTable
    _started: float
    _last_beat: float
    _keys: dict[str, str]  # shard -> CURVE public key (for its replicas)
    _versions: dict[str, str]  # node -> zps release (from REGISTER / HELLO)
    _incarnations: dict[str, str]  # shard -> its process (from REGISTER)
    _mismatched: set[str]  # peers warned about another protocol version
    _roles: KeyRoles | None  # CURVE: which keys may act as what
    # CURVE: shard name -> the key it first registered with (kept whatever becomes
    # of the shard, in the data dir's state too: a name outlives its key's process).
    _bound_keys: dict[str, bytes]
    refusals: RefusalLog
    metrics: MetricsServer
    training: Training
    _record: BrokerState | None  # the newest state record produced
    _writer: StateWriter | None
    pair: Pair | None
    reshard: Resharder
    #: The data dir, held for this process's life (a second broker on it is refused).
    _lock: DataDirLock | None
    _part_states: list[str]  # each partition's state as last logged
    _placements: list[str | None]  # logged placement warnings

    def _lease(self) -> float:
        """How long a primary's lease runs past the heartbeat an echo renews."""
        hb = self.config.heartbeat
        return hb.interval * (hb.liveness - 1)

    def post(self, frames: list[Any]) -> transport.Posted:
        """Send without waiting (see the module notes); the one way out of the broker."""
        assert self._out is not None
        ident = frames[0]
        shard = isinstance(ident, bytes) and (ident.startswith(b"s-") or is_liveness(ident))
        limit = self.config.shard_queue_bytes if shard else self.config.client_queue_bytes
        posted = self._out.post(frames, limit)
        if posted is transport.Posted.DROPPED:
            self.stats.dropped += 1
        elif posted is transport.Posted.UNROUTABLE:
            self.stats.undeliverable += 1
            if shard:
                # zmq dropped the route: the shard's connection is gone (a killed
                # process); don't wait the whole liveness timeout to fail over.
                self.detector.suspect(
                    speaks_for(ident).decode("utf-8", "replace"),
                    time.monotonic(),
                    grace=2 * self.config.heartbeat.interval,
                )
        return posted

    async def send(self, frames: list[Any]) -> bool:
        """:meth:`post` for callers that only ask whether the peer is known."""
        return self.post(frames) is not transport.Posted.UNROUTABLE

    def _saturated(self, ident: bytes) -> bool:
        """True when a reply to this client would be dropped: don't build it."""
        assert self._out is not None
        return self._out.held(ident) + REPLY_RESERVE > self.config.client_queue_bytes

    def _refuse(self, client: bytes, route: Route, code: Status, message: str) -> None:
        reply = Route(MsgType.REPLY, route.partition, route.epoch, route.req_id)
        self.post([client, *encode(reply, StatusReply(code, message).to_wire())])

    def _refuse_call(self, ident: bytes, route: Route, msg: str) -> None:
        """Answer a broker call (TASK) BAD_REQUEST, in its own message type."""
        header = StatusReply(Status.BAD_REQUEST, msg).to_wire()
        self.post([ident, *encode(Route(route.mtype, req_id=route.req_id), header)])

    def _forget_queue(self, ident: bytes) -> None:
        """A peer left: drop what is held for it (and its recorded release)."""
        node = ident.decode("utf-8", "replace")
        self._versions.pop(node, None)
        self._incarnations.pop(node, None)
        if self._out is not None:
            self._out.forget(ident)
            self._out.forget(liveness_identity(ident))
