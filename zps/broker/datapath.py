"""The broker's data path: a client's REQUEST to its partition's primary, a shard's
reply to its client.

One job, one rule: where a REQUEST goes, or why nowhere, is :func:`zps.broker.routes.route`
over the :class:`~zps.broker.routes.RouteTable` rebuilt from each map
(:meth:`DataPath.rebuild_routes`).  Three ways forward, and each only consults it:

* the compiled step (:mod:`zps.broker.forward`), first in the socket's reader callback:
  it forwards what the table names a primary for, and hands back, untouched, whatever
  needs a decision (a control message, no primary, the hold, a peer with messages
  held for it, a full or gone queue);
* the fast path (:meth:`DataPath.forward`), in the same callback, for what the
  step handed back (or every message, where it is not built): the data message's
  verdict (:func:`zps.broker.acceptance.accept_data`) is carried out at once; a control
  message is left to the serving task, marked so that it gets its verdict there once
  (:func:`~zps.broker.acceptance.accept_control`);
* the serving task, for data messages queued behind a control message (order is kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from zps import transport
from zps.broker import forward
from zps.broker.acceptance import (
    DataVerdict,
    ForwardReply,
    Reject,
    RouteRequest,
    WrongVersion,
    accept_data,
)
from zps.broker.base import BrokerStats
from zps.broker.routes import NoRoute, RouteTable, refusal, route
from zps.core.bstar import BinaryStar
from zps.core.cluster import ClusterState
from zps.core.membership import FailureDetector
from zps.errors import ProtocolError
from zps.ops.security import KeyRoles
from zps.protocol.codec import Route, VersionMismatchError
from zps.protocol.messages import Status


class PairStar(Protocol):
    """What the data path needs of the broker pair (:class:`~zps.broker.pair.Pair`):
    its Binary Star state, read once per message."""

    @property
    def star(self) -> BinaryStar: ...


class DataPath:
    """Forwarding (see the module notes).

    ``state`` and ``detector`` are the broker's current ones (a broker of a pair gets
    new ones when it resets); ``post``, ``refuse``, ``authorised`` and
    ``wrong_version`` are bound once, as attributes; ``sock``, ``out`` and ``roles``
    are set once the socket is bound, ``pair`` once the pair exists."""

    def __init__(
        self,
        state: ClusterState,
        detector: FailureDetector,
        stats: BrokerStats,
        routes: RouteTable,
        *,
        post: Callable[[list[Any]], transport.Posted],
        refuse: Callable[[bytes, Route, Status, str], None],
        authorised: Callable[[bytes, str, transport.Frames], bool],
        wrong_version: Callable[[bytes, str, VersionMismatchError], None],
    ) -> None:
        self.state = state
        self.detector = detector
        self.stats = stats
        #: Where each partition's requests go (zps.broker.routes), rebuilt from each map.
        self.routes = routes
        self._post = post
        self._refuse = refuse
        self._authorised = authorised
        self._wrong_version = wrong_version
        self.sock: transport.Channel | None = None
        self.sock_addr = 0  # its zmq socket's address, for the compiled step
        self.out: transport.Outbound | None = None
        self.roles: KeyRoles | None = None
        self.pair: PairStar | None = None
        #: Messages the compiled step forwarded.
        self.compiled = 0
        #: The message the fast path left to the serving task (a control message).
        self.declined: transport.Frames | None = None

    def routing(self) -> bool:
        """Whether this broker routes now: a pair's active one (or alone), not holding
        for the shards' claims."""
        if self.pair is not None and not self.pair.star.active:
            return False
        return not self.state.holding(time.monotonic())

    def rebuild_routes(self) -> None:
        """The route table of the current map (on each map change)."""
        self.routes = RouteTable.of(self.state.map)

    def pump(self, limit: int) -> tuple[int, int, transport.Frames | None] | None:
        """The data path as one compiled step (:mod:`zps.broker.forward`) over the route
        table, for every message queued; the first it declines comes back, for
        :meth:`forward`.  None (the Python path) while this broker checks CURVE roles
        or is not a pair's active one."""
        pair = self.pair
        if self.roles is not None or (pair is not None and not pair.star.active):
            return None
        if self.sock is None or self.sock.closed:
            return None  # never hand compiled code a closed socket's address
        step = forward.step
        assert step is not None and self.out is not None
        now = time.monotonic()
        events, routed, replies, declined = step(
            self.sock_addr,
            limit,
            self.routes.targets,
            self.state.shards,
            self.detector.last_heard,
            self.out.queues,
            self.state.holding(now),
            now,
        )
        if routed or replies:
            self.stats.routed += routed
            self.stats.replies += replies
            self.compiled += routed + replies
        return events, routed + replies, declined

    def forward(self, frames: transport.Frames) -> bool:
        """The fast path, run in the socket's reader callback (see transport.serve): a
        data message's verdict carried out.  False (for the serving task) for a control
        message, marked as such, or for anything while this broker is not a pair's
        active one."""
        if len(frames) < 3:
            return False
        pair = self.pair
        if pair is not None and not pair.star.active:
            return False  # admit() answers, or takes over: not here
        ident = transport.frame_bytes(frames[0])
        heads = [transport.frame_buffer(frames[1]), transport.frame_buffer(frames[2])]
        verdict = accept_data(ident, heads, self.state)
        if verdict is None:
            self.declined = frames
            return False
        node = ident.decode("utf-8", "replace")
        if self.roles is not None and not self._authorised(ident, node, frames):
            return True  # dropped (or refused), counted
        now = time.monotonic()
        self.detector.seen(node, now)
        self.data(ident, node, verdict, frames, now)
        return True

    def data(
        self, ident: bytes, node: str, verdict: DataVerdict, frames: transport.Frames, now: float
    ) -> None:
        """Carry out a data message's verdict (from the fast path or the serving task)."""
        match verdict:
            case RouteRequest(route):
                self._route(ident, route, frames, now)
            case ForwardReply(target):
                self.stats.replies += 1
                self._post([target, *frames[2:]])
            case WrongVersion(error):
                self._wrong_version(ident, node, error)
            case Reject(reason, counter):
                if counter == "malformed":
                    raise ProtocolError(reason)  # counted by _on_malformed
                if counter == "stale_replies":
                    # A shard declared dead (e.g. it was paused) answering late: its
                    # word no longer counts; the client re-sent the request elsewhere.
                    self.stats.stale_replies += 1

    def _route(self, ident: bytes, req: Route, frames: list[Any], now: float) -> None:
        """A REQUEST to the primary the route table names, or refused saying why."""
        p = req.partition
        target = route(self.routes, p, holding=self.state.holding(now))
        if isinstance(target, NoRoute):
            if target is not NoRoute.HOLDING:
                self.stats.unavailable += 1
            floor = self.state.floor_of(p) if target is NoRoute.LOST else None
            self._refuse(ident, req, *refusal(target, p, floor))
            return
        posted = self._post([target, ident, *frames[1:]])
        if posted is transport.Posted.DROPPED:
            # The primary's queue is full: the client retries with backoff, the
            # broker carries on with everyone else.
            self.stats.overloaded += 1
            self._refuse(
                ident,
                req,
                Status.OVERLOADED,
                f"the primary of partition {p} is not keeping up; retry later",
            )
            return
        self.stats.routed += 1
        if posted is transport.Posted.UNROUTABLE:
            # Its connection is gone; the heartbeat detector will promote a
            # replica (or declare the partition lost) and the client retries then.
            self._refuse(
                ident, req, Status.NOT_PRIMARY, f"the primary of partition {p} is unreachable"
            )
