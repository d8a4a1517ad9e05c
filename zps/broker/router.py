"""A routing broker (``zps-server broker --follow PRIMARY[,BACKUP]``): routes only.

It serves one ROUTER endpoint like the broker's and moves pushes and pulls between
clients and shards with the same frames and the same flow control:

* client -> router: ``[client, route, header, payloads...]``; a REQUEST goes to the
  partition's primary of the router's map as ``[shard, client, route, ...]``.
* shard -> router: ``[shard, client, route, ...]``: a reply, forwarded to the client.

It owns nothing.  The active broker of the pair is the single owner of the map and
of fencing; the router follows its map as a client does (a DEALER to each broker of
the pair, HELLO and heartbeats to the one it follows, switching after
``peer_timeout`` of silence) and announces itself in its HELLO (``router``: its
endpoint), so the broker lists it in the map and names, for each partition, the
router its requests go to (the one on its primary's host).  It takes a map only if
it is newer: a higher term, else another broker incarnation, else a higher version;
a message stamped with an older term than it has seen is dropped.

A router decides nothing: the shard that gets a request applies its own checks
(epoch, role, lease), so a router that routes by an old map can delay a request
(the client retries on ``NOT_PRIMARY``), never apply it in the wrong place.  While
the map assigns a partition no router (the broker is collecting claims after a
start), the router refuses its requests ``NOT_PRIMARY``, and the broker holds them.
A request posted to a shard's link that is then lost (a post finds it closed, the
shard goes silent, or it greets the router on a connection made again) before the reply
came back is refused ``NOT_PRIMARY`` (``bypass`` unless the link was made again), for its
client to send it again: the link may have taken it, or its reply, with it
(:mod:`zps.broker.forwarded`).

Flow control as the broker's (:class:`~zps.transport.Outbound`, the same allowances
from :class:`~zps.ops.config.BrokerConfig`): a request for a shard whose allowance is
spent is answered ``OVERLOADED``, a reply for a client whose allowance is spent is
dropped (its session re-sends).  Coordination calls (CLOCK, TASK) are refused with
``BAD_REQUEST`` naming the active broker; STATUS is answered with the router's own
report under the same refusal; a client's HEARTBEAT is echoed (clients judge a
router's silence by it) and its HELLO answered with the map.  Nothing survives a
restart, and nothing needs to.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from zps import transport
from zps.broker.following import Leader, newer
from zps.broker.forwarded import Forwarded
from zps.broker.primaries import PrimaryLinks
from zps.core.membership import SHARD_PREFIX, is_liveness
from zps.core.routing import ClusterMap
from zps.errors import ConfigError, ProtocolError
from zps.ops.config import BrokerConfig
from zps.ops.metrics import MetricsServer, gauge, labelled
from zps.ops.security import (
    REFUSAL_REASONS,
    KeyRoles,
    RefusalLog,
    identity_refusal,
    is_shard_identity,
    key_identity,
    load_curve_keys,
    load_roles,
    request_refusal,
    warn_if_exposed,
)
from zps.ops.systemd import Notifier
from zps.protocol.codec import (
    PROTOCOL_VERSION,
    MsgType,
    Route,
    VersionMismatchError,
    decode,
    encode,
    unpack_route,
)
from zps.protocol.messages import ClientHello, Heartbeat, MapUpdate, Status, StatusReply
from zps.version import __version__

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("zps.router")

#: Every router identity (on its links to the brokers) starts with this.
ROUTER_PREFIX = b"r-"
#: Shard identities bound to keys at most; past it the least recently heard goes if
#: silent this long (seconds), else a new name is refused.
MAX_BOUND = 65536
BOUND_IDLE_S = 300.0


@dataclass
class RouterStats:
    routed: int = 0
    replies: int = 0
    unavailable: int = 0
    #: Requests refused NOT_PRIMARY: no map yet, no router assigned, or no primary.
    not_routed: int = 0
    malformed: int = 0
    undeliverable: int = 0
    dropped: int = 0
    overloaded: int = 0
    version_mismatch: int = 0
    #: CLOCK, TASK and STATUS calls refused (they go to the active broker).
    refused: int = 0
    #: CURVE: messages refused for their key (see ``refusals`` by reason), dropped.
    unauthorized: int = 0
    #: Maps taken, and maps dropped as older than the one held.
    maps: int = 0
    stale_maps: int = 0
    #: Requests refused after they were posted: the shard's link was lost or made
    #: again before a reply came back (zps.broker.forwarded).
    link_lost: int = 0


def _is_heartbeat(frames: transport.Frames) -> bool:
    """A shard's heartbeat (``[shard, b"", route, header]``): shards send them to the
    routers they are linked to, which take them as the link's word, and as word of a
    connection made again when marked ``new_link`` (:func:`_new_link`)."""
    try:
        return len(frames) > 2 and unpack_route(frames[2]).mtype is MsgType.HEARTBEAT
    except ProtocolError:
        return False


def _new_link(frames: transport.Frames) -> bool:
    """Whether a shard's heartbeat is its greeting on a connection just made."""
    if len(frames) < 4:
        return False
    try:
        header = decode([transport.frame_buffer(f) for f in frames[2:]]).header
    except ProtocolError:
        return False
    return header.get("new_link") is True


def advertised(bound: str, config: BrokerConfig) -> str:
    """The endpoint clients and shards reach the router at."""
    if config.advertise:
        return config.advertise
    parts = urlsplit(bound)
    if parts.hostname in ("0.0.0.0", "*", "::", None):
        return f"tcp://{transport.local_address(config.followed[0])}:{parts.port}"
    return bound


class ShardKeys:
    """CURVE: each shard identity the routing broker has heard, bound to the key it first
    came with, least recently heard first.  Bounded: past :data:`MAX_BOUND` names the
    least recently heard is forgotten if it was silent for :data:`BOUND_IDLE_S`; never a
    live one: a new name is refused then.  No I/O, no clock (``now`` is an argument)."""

    def __init__(self) -> None:
        self._table: collections.OrderedDict[bytes, tuple[bytes, float]] = collections.OrderedDict()

    def key_of(self, ident: bytes) -> bytes | None:
        """The key ``ident`` is bound to; None if it is not."""
        bound = self._table.get(ident)
        return None if bound is None else bound[0]

    def bind(self, ident: bytes, key: bytes, now: float) -> bool:
        """Bind (or keep bound) shard identity ``ident`` to ``key``, heard at ``now``;
        False (nothing bound) when the table is full of names heard recently."""
        table = self._table
        if ident in table:
            table[ident] = (key, now)
            table.move_to_end(ident)
            return True
        if len(table) >= MAX_BOUND:
            oldest, (_, heard) = next(iter(table.items()))
            if now - heard < BOUND_IDLE_S:
                return False
            del table[oldest]
        table[ident] = (key, now)
        return True

    def __contains__(self, ident: object) -> bool:
        return ident in self._table

    def __len__(self) -> int:
        return len(self._table)


class Router:
    """The routing broker process (see the module notes)."""

    def __init__(self, config: BrokerConfig, *, notifier: Notifier | None = None) -> None:
        if config.follow is None:
            raise ValueError("a router needs broker.follow")
        self.config = config
        self.notifier = notifier or Notifier()
        self.followed = config.followed
        self.stats = RouterStats()
        self.endpoint: str | None = None  # what the ROUTER bound
        self.advertised = ""  # what the map lists
        self.node_id = b""
        self.host = config.host or socket.gethostname()
        self.map: ClusterMap | None = None
        self._stamp: tuple[int, str, int] | None = None  # the map's (term, inc, version)
        self.bound = asyncio.Event()
        self._stop = asyncio.Event()
        self._sock: transport.Channel | None = None
        self._out: transport.Outbound | None = None
        self._links: list[transport.Channel] = []
        self._leader = Leader(len(self.followed), silence=config.peer_timeout, now=0.0)
        self._listed = False  # the map lists this router
        hb = config.heartbeat
        self._quiet = hb.interval * max(2.0, hb.liveness / 2)  # see _route
        #: Which primaries' links this router hears (a primary silent as long as the
        #: followed broker may be: its partition's requests go to the broker).
        self._primaries = PrimaryLinks(self._quiet)
        #: What each shard was sent and has not answered yet.
        self._forwarded = Forwarded()
        self._started = time.monotonic()
        self._warned: set[bytes] = set()
        self._roles: KeyRoles | None = None  # CURVE: which keys may act as what
        # CURVE: shard identity -> the key it first came with (other identities carry
        # their key's tag).
        self.shard_keys = ShardKeys()
        self.refusals = RefusalLog(log, "the routing broker")
        self.metrics = MetricsServer(config.metrics, self._collect, ready=self._ready)

    def stop(self) -> None:
        self._stop.set()

    @property
    def leader(self) -> str:
        """The broker followed now (the active one, as far as the router knows)."""
        return self.followed[self._leader.current]

    # -- lifecycle -----------------------------------------------------------

    async def run(self) -> None:
        self.metrics.start()
        try:
            await self._run()
        finally:
            self.metrics.stop()

    async def _run(self) -> None:
        cfg = self.config
        ctx = transport.new_context()
        keys = load_curve_keys(cfg.security)
        # Without broker_public_key_file the router takes its own key for the broker's.
        if keys is not None and keys.server_public not in (None, keys.public):
            raise ConfigError(
                "a routing broker serves with the broker's key pair: its clients check the "
                "key of security.broker_public_key_file, and security.curve_public_key_file "
                "names another key (give the router a settings file naming the broker's "
                "key pair: docs/deploy.md, section 8)"
            )
        self._roles = roles = load_roles(cfg.security)
        auth = (
            transport.start_authenticator(
                ctx,
                keys.allowed_dir,
                keys=roles.admitted if roles else None,
                on_refused=self._handshake_refused,
            )
            if keys
            else None
        )
        self._sock, self.endpoint = transport.router(
            ctx, cfg.bind, max_message_bytes=cfg.max_message_bytes, curve=keys
        )
        unwatch = (
            transport.watch_handshakes(self._sock, self._handshake_refused, self._connection_closed)
            if keys
            else None
        )
        warn_if_exposed(cfg.bind, cfg.security, "the routing broker")
        self._out = transport.Outbound(
            self._sock,
            total_limit=cfg.queue_bytes,
            stall_timeout=cfg.stall_timeout,
            name="router",
        )
        self.advertised = advertised(self.endpoint, cfg)
        where = self.advertised.split("://", 1)[-1].encode()
        # Under CURVE its identity at the brokers carries its key's tag.
        self.node_id = (
            key_identity(ROUTER_PREFIX, keys.public, where) if keys else ROUTER_PREFIX + where
        )
        self._links = [
            transport.dealer(
                ctx,
                endpoint,
                self.node_id,
                max_message_bytes=cfg.max_message_bytes,
                curve=keys,
                server_public=(keys.server_public or keys.public) if keys else None,
            )
            for endpoint in self.followed
        ]
        self._leader = Leader(len(self._links), silence=cfg.peer_timeout, now=time.monotonic())
        log.info(
            "routing broker (pid %d) listening on %s as %s, following %s",
            os.getpid(),
            self.endpoint,
            self.advertised,
            ",".join(self.followed),
        )
        self.bound.set()
        self.notifier.ready(f"routing on {self.advertised}")
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(
                        transport.serve(self._sock, self._on_message, self._on_malformed)
                    ),
                    tg.create_task(self._tick_loop()),
                    tg.create_task(self.metrics.loop_heartbeat()),
                    tg.create_task(self.notifier.watchdog_loop()),
                ]
                for i, link in enumerate(self._links):
                    tasks.append(
                        tg.create_task(
                            transport.serve(
                                link,
                                functools.partial(self._from_leader, i),
                                self._on_bad_leader,
                            )
                        )
                    )
                await self._hello()
                await self._stop.wait()
                self.notifier.stopping()
                link = self._links[self._leader.current]
                transport.try_send(link, encode(Route(MsgType.BYE), {}))
                for t in tasks:
                    t.cancel()
        finally:
            self._out.close()
            for link in self._links:
                transport.close(link)
            if auth is not None:
                auth.stop()
            if unwatch is not None:
                unwatch()
            transport.close(self._sock)
            transport.term(ctx)
            log.info("routing broker stopped")

    # -- the followed broker ---------------------------------------------------

    async def _hello(self) -> None:
        hello = ClientHello(
            self.host, os.getpid(), "router", __version__, router=self.advertised
        ).to_wire()
        transport.try_send(self._links[self._leader.current], encode(Route(MsgType.HELLO), hello))

    async def _tick_loop(self) -> None:
        interval = self.config.heartbeat.interval
        beat = encode(Route(MsgType.HEARTBEAT), Heartbeat().to_wire())
        while True:
            await asyncio.sleep(interval)
            if self._leader.tick(time.monotonic()):
                log.warning(
                    "no word from %s; following %s",
                    self.followed[1 - self._leader.current],
                    self.leader,
                )
            if self._listed:
                transport.try_send(self._links[self._leader.current], beat)
            else:
                await self._hello()  # until the map lists this router (cold start)
            self._probe_links(beat)

    def _probe_links(self, beat: list[Any]) -> None:
        """Each tick, every shard with requests posted and unanswered is sent ``beat`` on
        its link (shards ignore what a router sends them but requests): one no longer
        connected loses them (:meth:`_link_lost`), though no new request came to find out."""
        if self._out is None:
            return
        for shard in self._forwarded.shards():
            posted = self._out.post([shard, b"", *beat], self.config.shard_queue_bytes)
            if posted is transport.Posted.UNROUTABLE:
                self._link_lost(shard, "closed")

    async def _from_leader(self, index: int, frames: transport.Frames) -> None:
        msg = decode([transport.frame_buffer(f) for f in frames])
        header = msg.header
        if header.get("passive") is True:
            return  # a standby: the other one is followed after its silence
        term = header.get("term")
        term = term if isinstance(term, int) and not isinstance(term, bool) else None
        verdict = self._leader.heard(index, term, time.monotonic())
        if verdict is None:
            return  # from a broker that was replaced
        if verdict:
            log.warning("following %s (term %s)", self.followed[index], term)
            await self._hello()
        match msg.route.mtype:
            case MsgType.MAP:
                self._on_map(ClusterMap.from_wire(MapUpdate.parse(header).map), term or 0)
            case MsgType.HELLO:  # the broker restarted and does not know this router
                # Its map is of the broker's earlier life: nothing is routed by it while
                # the new one collects the shards' claims.
                self._listed = False
                self.map = None
                self._stamp = None
                await self._hello()
            case _:
                pass  # probes

    def _on_map(self, cmap: ClusterMap, term: int) -> None:
        stamp = (term, cmap.incarnation, cmap.version)
        if not newer(self._stamp, stamp):
            self.stats.stale_maps += 1
            return
        self.map, self._stamp = cmap, stamp
        self._primaries.on_map(cmap, time.monotonic())
        self.stats.maps += 1
        listed = any(r.name == self.node_id.decode() for r in cmap.routers)
        if listed != self._listed:
            self._listed = listed
            mine = [p for p, i in cmap.partitions.items() if i.router == self.advertised]
            log.info(
                "%s the map v%d (term %d)%s",
                "listed in" if listed else "not listed in",
                cmap.version,
                term,
                f"; routing partitions {mine}" if listed else "",
            )

    def _on_bad_leader(self, frames: transport.Frames, err: ProtocolError) -> None:
        log.warning("dropped a bad message from the followed broker: %s", err)

    # -- clients and shards ----------------------------------------------------

    async def _on_message(self, frames: transport.Frames) -> None:
        if len(frames) < 2:
            raise ProtocolError(f"{len(frames)} frame(s): no envelope and route")
        ident = transport.frame_bytes(frames[0])
        if self._roles is not None and not self._authorised(ident, frames):
            return
        if ident.startswith(SHARD_PREFIX):
            self._from_shard(ident, frames)
            return
        if is_liveness(ident):
            return  # liveness links belong to the broker pair
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
        except VersionMismatchError as e:
            self._wrong_version(ident, e)
            return
        if route.mtype is MsgType.REQUEST:
            self._route(ident, route, frames)
            return
        self._from_client(ident, route, frames)

    def _authorised(self, ident: bytes, frames: transport.Frames) -> bool:
        """CURVE, as the broker's rules: the key must be allowed and own the identity, and
        a request's drop or checkpoint operations need an operator key (answered
        refused).  Refusals are counted by reason and logged once per peer and key a
        minute."""
        assert self._roles is not None
        key = transport.sender_key(frames[1])
        now = time.monotonic()
        shard = is_shard_identity(ident)
        bound = self.shard_keys.key_of(ident) if shard else None
        reason = identity_refusal(ident, key, self._roles, bound)
        if reason is None and self._sock is not None:
            self._sock.accepted(frames)  # its key owns the identity: answers go this way
        peer = ident.decode("utf-8", "replace")
        if reason is None and shard:
            assert key is not None
            if not self.shard_keys.bind(ident, key, now):
                self.stats.unauthorized += 1
                self.refusals.refused(peer, key, "wrong_role", now, "too many shard names")
                return False
        elif reason is None and len(frames) > 2:
            try:
                route = unpack_route(transport.frame_buffer(frames[1]))
            except ProtocolError:
                return True  # answered VERSION_MISMATCH, or dropped as malformed
            refused = (
                request_refusal(
                    transport.frame_buffer(frames[2]), ident, "operator" in self._roles.roles(key)
                )
                if route.mtype is MsgType.REQUEST
                else None
            )
            if refused is not None:  # counted and logged before it is answered
                self.stats.unauthorized += 1
                self.refusals.refused(peer, key, refused[0], now, refused[1])
                self._reply_error(ident, route, Status.BAD_REQUEST, refused[1])
                return False
        if reason is None:
            return True
        self.stats.unauthorized += 1
        self.refusals.refused(peer, key, reason, now)
        return False

    def _connection_closed(self, fd: int) -> None:
        """CURVE: a connection closed; its identity gets nothing until it speaks again."""
        if self._out is not None:
            self._out.connection_closed(fd)

    def _handshake_refused(self, peer: str, key: bytes | None, reason: str) -> None:
        """A handshake the ZAP handler or the socket refused: counted, logged."""
        self.stats.unauthorized += 1
        self.refusals.refused(f"a peer {peer}", key, reason, time.monotonic())

    def _route(self, ident: bytes, route: Route, frames: transport.Frames) -> None:
        assert self._out is not None
        p = route.partition
        cmap = self.map
        if cmap is not None and time.monotonic() - self._leader.last_heard > self._quiet:
            # The followed broker is silent (probes come every heartbeat interval): it
            # may be restarting, and its map is no longer to be trusted for routing.
            cmap = None
        info = cmap.partitions.get(p) if cmap is not None else None
        if (
            cmap is None
            or (info is not None and not info.router)
            or (info is not None and info.primary is None and not info.lost)
        ):
            self.stats.not_routed += 1
            why = (
                f"no map yet from {self.leader}"
                if cmap is None
                else f"partition {p} is routed by the broker at {self.leader} now"
                if info is not None and not info.router
                else f"partition {p} has no primary at the moment"
            )
            # The broker can route it (it holds what it must hold): the client may go
            # there, save while no primary serves (the broker would only hold it too).
            self._reply_error(
                ident,
                route,
                Status.NOT_PRIMARY,
                f"routing broker: {why}",
                bypass=cmap is None or (info is not None and not info.router),
            )
            return
        if info is None or info.lost:
            self.stats.unavailable += 1
            why = "no such partition" if info is None else "no copy of it is left"
            self._reply_error(
                ident, route, Status.SHARD_UNAVAILABLE, f"partition {p} has no live shard ({why})"
            )
            return
        assert info.primary is not None
        shard = info.primary.encode()
        if not self._primaries.live(info.primary, time.monotonic()):
            # Its link may be dead (nothing tells a ROUTER): not posted into it, nor
            # left waiting what was.
            self._link_lost(shard, "went silent")
            self.stats.undeliverable += 1
            self._reply_error(
                ident,
                route,
                Status.NOT_PRIMARY,
                f"the primary of partition {p} was not heard on its link to this routing "
                f"broker for {self._quiet:g}s",
                bypass=True,
            )
            return
        posted = self._out.post([shard, ident, *frames[1:]], self.config.shard_queue_bytes)
        if posted is transport.Posted.DROPPED:
            self.stats.overloaded += 1
            self._reply_error(
                ident,
                route,
                Status.OVERLOADED,
                f"the primary of partition {p} is not keeping up; retry later",
            )
            return
        if posted is transport.Posted.UNROUTABLE:
            # Not (or no longer) connected to this router: the client retries, by then
            # over a newer map or a connection the shard has made.
            self._link_lost(shard, "closed")
            self.stats.undeliverable += 1
            self._reply_error(
                ident,
                route,
                Status.NOT_PRIMARY,
                f"the primary of partition {p} is not connected to this routing broker",
                bypass=True,
            )
            return
        self._forwarded.posted(shard, ident, route)
        self.stats.routed += 1

    def _link_lost(self, shard: bytes, how: str, *, bypass: bool = True) -> None:
        """``shard``'s link closed, went silent or was made again: what was posted to it
        and not answered may be lost with it, and is refused for its clients to send
        again (:mod:`zps.broker.forwarded`); ``bypass``: to the broker for a while (not
        for a link made again: the new one serves)."""
        lost = self._forwarded.lost(shard)
        if not lost:
            return
        self.stats.link_lost += len(lost)
        name = shard.decode("utf-8", "replace")
        log.info(
            "the link of shard %s %s: %d request(s) posted to it refused", name, how, len(lost)
        )
        for client, route in lost:
            self._reply_error(
                client,
                route,
                Status.NOT_PRIMARY,
                f"the link of shard {name} (partition {route.partition}'s primary) to this "
                f"routing broker {how} after the request was posted to it: it may not have "
                "arrived",
                bypass=bypass,
            )

    def _from_shard(self, ident: bytes, frames: transport.Frames) -> None:
        assert self._out is not None
        self._primaries.heard(ident.decode("utf-8", "replace"), time.monotonic())
        target = transport.frame_bytes(frames[1])
        if not target:
            if _is_heartbeat(frames):
                # The shard's word that this connection is its (Channel.accepted).
                if self._forwarded and _new_link(frames):
                    self._link_lost(ident, "was made again", bypass=False)
                return
            if ident not in self._warned and len(self._warned) < 1024:
                self._warned.add(ident)
                log.warning(
                    "shard %s sent a control message to this routing broker: its broker "
                    "is %s (shard.broker), the router only takes replies",
                    ident.decode("utf-8", "replace"),
                    ",".join(self.followed),
                )
            return
        if target.startswith(SHARD_PREFIX) or len(frames) < 3:
            raise ProtocolError("a reply addressed to a shard, or without a route")
        # Any shard's reply is forwarded: the shard checked the request (its role, epoch
        # and lease) before answering, and the request came through this router.
        if self._forwarded:
            self._forwarded.answered(ident, target, unpack_route(frames[2]).req_id)
        posted = self._out.post([target, *frames[2:]], self.config.client_queue_bytes)
        if posted is transport.Posted.DROPPED:
            self.stats.dropped += 1
        elif posted is transport.Posted.UNROUTABLE:
            self.stats.undeliverable += 1
        else:
            self.stats.replies += 1

    def _from_client(self, ident: bytes, route: Route, frames: transport.Frames) -> None:
        match route.mtype:
            case MsgType.HEARTBEAT:
                # The client hears it is alive, and which partitions to send the broker.
                silent = self._primaries.silent(self.map, self.advertised, time.monotonic())
                self._control(ident, MsgType.HEARTBEAT, {"unroutable": silent} if silent else {})
            case MsgType.HELLO if self.map is not None:
                self._control(ident, MsgType.MAP, MapUpdate(self.map.to_wire()).to_wire())
            case MsgType.CLOCK | MsgType.TASK | MsgType.STATUS:
                self.stats.refused += 1
                refusal = StatusReply(
                    Status.BAD_REQUEST,
                    f"{self.advertised} is a routing broker (zps-server broker --follow): "
                    f"send {route.mtype.name} to the active broker, {self.leader}",
                ).to_wire()
                if route.mtype is MsgType.STATUS:
                    refusal["router"] = self.status(time.monotonic())
                self._control(ident, route.mtype, refusal, route.req_id)
            case MsgType.HELLO | MsgType.BYE:
                pass
            case _:
                raise ProtocolError(f"a client may not send {route.mtype.name}")

    def _control(
        self, ident: bytes, mtype: MsgType, header: dict[str, Any], req_id: int = 0
    ) -> None:
        self._post([ident, *encode(Route(mtype, req_id=req_id), header)])

    def _reply_error(
        self, ident: bytes, route: Route, code: Status, message: str, *, bypass: bool = False
    ) -> None:
        """Refuse a request.  ``bypass``: this router cannot route it now and the broker
        can, so the client sends the partition's requests to the broker for a while
        (:meth:`zps.client.routers.RouterTable.refused`)."""
        reply = Route(MsgType.REPLY, route.partition, route.epoch, route.req_id)
        header = StatusReply(code, message).to_wire()
        if bypass:
            header["bypass"] = True
        self._post([ident, *encode(reply, header)])

    def _post(self, frames: list[Any]) -> None:
        assert self._out is not None
        if self._out.post(frames, self.config.client_queue_bytes) is transport.Posted.DROPPED:
            self.stats.dropped += 1

    def _wrong_version(self, ident: bytes, error: VersionMismatchError) -> None:
        self.stats.version_mismatch += 1
        reply = StatusReply(
            Status.VERSION_MISMATCH,
            f"this routing broker (zps {__version__}) speaks protocol version "
            f"{PROTOCOL_VERSION}, the message was in version {error.version}",
        )
        route = Route(MsgType.REPLY, error.partition, error.epoch, error.req_id)
        self._post([ident, *encode(route, reply.to_wire())])

    def _on_malformed(self, frames: transport.Frames, err: ProtocolError) -> None:
        self.stats.malformed += 1
        node = transport.frame_bytes(frames[0]).decode("utf-8", "replace") if frames else "?"
        log.debug("dropped a malformed message from %s: %s", node, err)

    # -- reports ---------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        cmap = self.map
        out = self._out
        return {
            "endpoint": self.advertised,
            "node": self.node_id.decode(),
            "host": self.host,
            "pid": os.getpid(),
            "version": __version__,
            "following": self.leader,
            "term": self._leader.term,
            "map_version": cmap.version if cmap else None,
            "listed": self._listed,
            "partitions": sorted(
                p
                for p, i in (cmap.partitions.items() if cmap else ())
                if i.router == self.advertised
            ),
            # Its partitions whose primary it does not hear: they go to the broker.
            "unheard": self._primaries.silent(cmap, self.advertised, now),
            "uptime_s": round(now - self._started, 1),
            **vars(self.stats),
            "held_bytes": out.held_bytes if out else 0,
        }

    def _ready(self) -> tuple[bool, str]:
        if not self.bound.is_set() or self._stop.is_set():
            return False, "not listening"
        if self.map is None:
            return False, f"no map from {self.leader} yet"
        return True, f"routing by map v{self.map.version} on {self.advertised}"

    def _collect(self) -> Iterable[Metric]:
        yield labelled(
            "counter",
            "zps_router_messages",
            "Messages by outcome",
            "outcome",
            {k: float(v) for k, v in vars(self.stats).items()},
        )
        yield labelled(
            "counter",
            "zps_router_refusals",
            "CURVE peers and messages refused, by reason",
            "reason",
            {r: float(self.refusals.counts.get(r, 0)) for r in REFUSAL_REASONS},
        )
        out = self._out
        yield gauge(
            "zps_router_held_bytes",
            "Bytes held for peers slower than zmq",
            out.held_bytes if out else 0,
        )
