"""The broker process: one ROUTER endpoint for clients and shards.

Routing reads only the 20-byte route frame; headers and array frames are
forwarded as the same zmq frames (zero-copy).  Sender identities tell the two
kinds of peer apart: shards use ``s-...``, clients anything else.

* client -> broker: ``[client, route, header, payloads...]``; a REQUEST goes to
  the partition's primary as ``[shard, client, route, header, payloads...]``.
* shard -> broker: ``[shard, target, route, ...]``; a non-empty ``target`` is a
  client to forward the reply to, an empty one is a control message.

Any message counts as a heartbeat.  A shard silent past the liveness timeout
leaves the map: its in-sync replica with the highest LSN is promoted at a new
epoch, every client and shard gets the new map, and clients re-send what the
dead primary had not answered.  A partition with no copy left is answered
``SHARD_UNAVAILABLE`` at once.

Flow control: the broker never waits on one peer while serving others.  Every
message goes out through one :class:`~zps.transport.Outbound`: what zmq cannot
queue for a slow peer is held for it within a byte allowance (per client, per
shard, in total; see :class:`~zps.ops.config.BrokerConfig`), and past that the
slow peer pays: a client's replies and maps are dropped and counted (its session
retries or times out), a request for a shard whose queue is full is answered
``OVERLOADED`` at once (the client retries it with backoff), and a peer that
takes nothing for ``stall_timeout`` loses what was held for it.  zmq's ROUTER
reads its peers' queues in turn, so a flood from one peer delays a shard's
heartbeat by at most one burst.  The systemd watchdog is pinged from the
receive path, and only while the timer loop keeps turning too.

Leases: the broker answers each shard heartbeat with the role it holds for
that shard, echoing the shard's send time; a primary accepts writes only
while such an answer is younger than its lease, which is shorter than the
liveness timeout.  So a primary cut off from the broker (or paused) stops
writing before the broker can promote anyone else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, assert_never

from zps import transport
from zps.broker.acceptance import (
    BadClientRequest,
    CommitReply,
    ForwardReply,
    FromClient,
    FromShard,
    Reject,
    RouteRequest,
    accept,
)
from zps.broker.training import Training
from zps.core.cluster import Assignment, Claim, ClusterState
from zps.core.membership import FailureDetector
from zps.errors import ProtocolError
from zps.ops.config import BrokerConfig
from zps.ops.metrics import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    MetricsServer,
    counter,
    gauge,
    labelled,
)
from zps.ops.security import load_curve_keys
from zps.ops.systemd import Notifier, watchdog_due
from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import (
    Assign,
    Bye,
    ClientControl,
    ClientHello,
    ClockRequest,
    Heartbeat,
    LeaseEcho,
    MapUpdate,
    ShardClaim,
    ShardControl,
    ShardHeartbeat,
    ShardRegister,
    Status,
    StatusReply,
    StatusRequest,
    TaskRequest,
)

log = logging.getLogger("zps.broker")

#: Room a STATUS reply needs in a client's allowance (a report is a few KiB per node).
_REPLY_RESERVE = 256 * 1024


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


class Broker:
    def __init__(self, config: BrokerConfig, *, notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        self.state = ClusterState(
            config.partitions,
            config.slots,
            replication=config.replication,
            hold_until=time.monotonic() + config.grace,
        )
        self.detector = FailureDetector(config.heartbeat.interval, config.heartbeat.liveness)
        self.stats = BrokerStats()
        self.endpoint: str | None = None
        self.bound = asyncio.Event()
        self._stop = asyncio.Event()
        self._sock: transport.Channel | None = None
        self._out: transport.Outbound | None = None
        self._last_tick = time.monotonic()
        self._last_ping = 0.0
        self._routes: list[bytes | None] = [None] * config.partitions
        self._started = time.monotonic()
        self._last_beat = 0.0
        self._keys: dict[str, str] = {}  # shard -> CURVE public key (for its replicas)
        self.metrics = MetricsServer(config.metrics, self._collect)
        self.training = Training(self.state, self._send)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        ctx = transport.new_context()
        keys = load_curve_keys(self.config.security)
        auth = transport.start_authenticator(ctx, keys.allowed_dir) if keys else None
        self._sock, self.endpoint = transport.router(
            ctx, self.config.bind, max_message_bytes=self.config.max_message_bytes, curve=keys
        )
        self._out = transport.Outbound(
            self._sock,
            total_limit=self.config.queue_bytes,
            stall_timeout=self.config.stall_timeout,
            name="broker",
        )
        log.info(
            "broker (pid %d) listening on %s: %d partitions x %d copies; only claims "
            "are granted for the first %.1fs",
            os.getpid(),
            self.endpoint,
            self.config.partitions,
            self.config.replication,
            self.config.grace,
        )
        self.bound.set()
        self.metrics.start()
        self.notifier.ready(f"listening on {self.endpoint}")
        self._alive()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._recv_loop()),
                    tg.create_task(self._tick_loop()),
                ]
                await self._stop.wait()
                self.notifier.stopping()
                for t in tasks:
                    t.cancel()
        finally:
            self.metrics.stop()
            self._out.close()
            if auth is not None:
                auth.stop()
            transport.close(self._sock)
            transport.term(ctx)
            log.info("broker stopped")

    # -- sending -------------------------------------------------------------

    def _post(self, frames: list[Any]) -> transport.Posted:
        """Send without waiting (see the module notes); the one way out of the broker."""
        assert self._out is not None
        ident = frames[0]
        shard = isinstance(ident, bytes) and ident.startswith(b"s-")
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
                    ident.decode("utf-8", "replace"),
                    time.monotonic(),
                    grace=2 * self.config.heartbeat.interval,
                )
        return posted

    async def _send(self, frames: list[Any]) -> bool:
        """:meth:`_post` for callers that only ask whether the peer is known."""
        return self._post(frames) is not transport.Posted.UNROUTABLE

    def _saturated(self, ident: bytes) -> bool:
        """True when a reply to this client would be dropped: don't build it."""
        assert self._out is not None
        return self._out.held(ident) + _REPLY_RESERVE > self.config.client_queue_bytes

    def _alive(self) -> None:
        """Ping the systemd watchdog: called from the receive path, so a ping proves the
        loop reads and dispatches; withheld when the timer loop stopped turning."""
        period = self.notifier.watchdog_period
        now = time.monotonic()
        if watchdog_due(
            period,
            now,
            last_ping=self._last_ping,
            last_turn=self._last_tick,
            max_lag=max(period or 0.0, 4 * self.config.heartbeat.interval),
        ):
            self._last_ping = now
            self.notifier.watchdog()

    async def _on_idle(self) -> None:
        self._alive()

    async def _control(
        self, node: bytes, mtype: MsgType, header: dict[str, Any], req_id: int = 0
    ) -> None:
        """Broker-originated message (an answer carries its request's id); shards get the
        empty source frame."""
        prefix = [node, b""] if node.startswith(b"s-") else [node]
        await self._send([*prefix, *encode(Route(mtype, req_id=req_id), header)])

    async def _reply_error(self, client: bytes, route: Route, code: Status, message: str) -> None:
        reply = Route(MsgType.REPLY, route.partition, route.epoch, route.req_id)
        await self._send([client, *encode(reply, StatusReply(code, message).to_wire())])

    async def _apply(self, assignments: list[Assignment]) -> None:
        for a in assignments:
            log.info(
                "assign %s: %s of partition %s at epoch %d%s",
                a.node_id,
                a.role.value,
                a.partition,
                a.epoch,
                f", following {a.primary}" if a.primary else "",
            )
            await self._control(
                a.node_id.encode(),
                MsgType.ASSIGN,
                Assign(
                    role=a.role,
                    partition=a.partition,
                    epoch=a.epoch,
                    primary=a.primary,
                    primary_address=a.primary_address,
                    primary_key=self._keys.get(a.primary or "", ""),
                    n_partitions=self.state.n_partitions,
                ).to_wire(),
            )

    async def _publish_if_changed(self, before: int) -> None:
        if self.state.map_version == before:
            return
        for p in range(self.state.n_partitions):
            primary = self.state.primary_of(p)
            self._routes[p] = primary.encode() if primary else None
        wire = MapUpdate(self.state.map.to_wire()).to_wire()
        for node in [*self.state.clients, *self.state.shards]:
            await self._control(node.encode(), MsgType.MAP, wire)
        await self.training.on_map_change()

    # -- receiving -----------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        await transport.serve(
            self._sock,
            self._on_message,
            self._on_malformed,
            on_burst=self._alive,
            idle=self.config.heartbeat.interval,
            on_idle=self._on_idle,
        )

    async def _on_message(self, frames: transport.Frames) -> None:
        if len(frames) < 2:
            raise ProtocolError(f"{len(frames)} frame(s): no envelope and route")
        now = time.monotonic()
        ident = transport.frame_bytes(frames[0])
        node = ident.decode("utf-8", "replace")
        self.detector.seen(node, now)
        before = self.state.map_version
        verdict = accept(ident, [transport.frame_buffer(f) for f in frames[1:]], self.state)
        try:
            match verdict:
                case RouteRequest(route):
                    await self._route_request(ident, route, frames, now)
                case FromClient(route, message):
                    await self._from_client(ident, node, route, message, now)
                case BadClientRequest(route, error):
                    await self.training.bad_request(ident, route, error)
                case FromShard(_, message):
                    await self._from_shard(ident, node, message, now)
                case ForwardReply(target):
                    self.stats.replies += 1
                    await self._send([target, *frames[2:]])
                case CommitReply(route, header):
                    await self.training.on_commit_reply(route, header)
                case Reject(reason, counter):
                    if counter == "malformed":
                        raise ProtocolError(reason)  # counted by _on_malformed
                    if counter == "stale_replies":
                        # A shard declared dead (e.g. it was paused) answering late: its
                        # word no longer counts; the client re-sent the request elsewhere.
                        self.stats.stale_replies += 1
                case _:
                    assert_never(verdict)
        finally:
            await self._publish_if_changed(before)

    def _on_malformed(self, frames: transport.Frames, err: ProtocolError) -> None:
        self.stats.malformed += 1
        node = transport.frame_bytes(frames[0]).decode("utf-8", "replace") if frames else "?"
        log.debug("dropped a malformed message from %s: %s", node, err)

    async def _from_client(
        self, ident: bytes, node: str, route: Route, message: ClientControl, now: float
    ) -> None:
        match message:
            case ClientHello(host, pid, name):
                self.state.register_client(node, host=host, pid=pid, name=name, now=now)
                log.info("client %s joined (%s pid %s)", node, host, pid)
                await self._control(
                    ident, MsgType.MAP, MapUpdate(self.state.map.to_wire()).to_wire()
                )
            case Heartbeat():
                if node not in self.state.clients:  # the broker restarted: re-introduce
                    await self._control(ident, MsgType.HELLO, {})
            case StatusRequest():
                if self._saturated(ident):
                    self.stats.dropped += 1  # it reads nothing: spare the work
                    return
                await self._control(ident, MsgType.STATUS, self.status(now), route.req_id)
            case ClockRequest():
                await self.training.on_clock(ident, node, route, message)
            case TaskRequest():
                await self.training.on_task(ident, node, route, message)
            case Bye():
                self.detector.forget(node)
                self._forget_queue(ident)
                self.state.node_gone(node, now)
                await self.training.worker_gone(node)
            case _:
                assert_never(message)

    async def _route_request(
        self, ident: bytes, route: Route, frames: list[Any], now: float
    ) -> None:
        p = route.partition
        target = self._routes[p] if 0 <= p < len(self._routes) else None
        if self.state.holding(now) and 0 <= p < len(self._routes):
            # A claim granted now may still be displaced by a newer copy: no
            # write may land on it until the hold ends.
            target = None
        if target is None:
            if 0 <= p < len(self._routes) and self.state.holding(now):
                await self._reply_error(
                    ident,
                    route,
                    Status.NOT_PRIMARY,
                    f"partition {p}: the broker is collecting the shards' claims",
                )
                return
            self.stats.unavailable += 1
            why = (
                "no such partition"
                if not 0 <= p < len(self._routes)
                else "lost with its last copy"
                if self.state.is_lost(p)
                else "not yet assigned to a shard"
            )
            await self._reply_error(
                ident, route, Status.SHARD_UNAVAILABLE, f"partition {p} has no live shard ({why})"
            )
            return
        posted = self._post([target, ident, *frames[1:]])
        if posted is transport.Posted.DROPPED:
            # The primary's queue is full: the client retries with backoff, the
            # broker carries on with everyone else.
            self.stats.overloaded += 1
            await self._reply_error(
                ident,
                route,
                Status.OVERLOADED,
                f"the primary of partition {p} is not keeping up; retry later",
            )
            return
        self.stats.routed += 1
        if posted is transport.Posted.UNROUTABLE:
            # Its connection is gone; the heartbeat detector will promote a
            # replica (or declare the partition lost) and the client retries then.
            await self._reply_error(
                ident, route, Status.NOT_PRIMARY, f"the primary of partition {p} is unreachable"
            )

    async def _from_shard(self, ident: bytes, node: str, message: ShardControl, now: float) -> None:
        match message:
            case ShardRegister():
                claim = _claim(message.claim)
                if message.public_key is not None:  # a Z85 CURVE public key
                    self._keys[node] = message.public_key
                log.info(
                    "shard %s registered (%s pid %s, replication at %s)%s",
                    node,
                    message.host,
                    message.pid,
                    message.address,
                    f", claiming {claim.role.value} of partition {claim.partition} at "
                    f"epoch {claim.epoch}, LSN {claim.lsn}"
                    if claim
                    else "",
                )
                await self._apply(
                    self.state.register_shard(
                        node,
                        host=message.host,
                        pid=message.pid,
                        address=message.address,
                        now=now,
                        claim=claim,
                    )
                )
            case ShardHeartbeat():
                shard = self.state.shards.get(node)
                if shard is None:
                    await self._control(ident, MsgType.REGISTER, {})
                    return
                self.state.report(
                    node,
                    lsn=message.lsn,
                    stats=message.stats,
                    epoch=message.epoch,
                    in_sync=None if message.in_sync is None else list(message.in_sync),
                )
                # The echo renews the shard's lease, for exactly this role.
                echo = LeaseEcho(message.t, shard.role, shard.partition, shard.epoch)
                await self._control(ident, MsgType.HEARTBEAT, echo.to_wire())
            case Bye():
                log.info("shard %s left", node)
                self.detector.forget(node)
                self._forget_queue(ident)
                self._keys.pop(node, None)
                await self._apply(self.state.node_gone(node, now))
            case _:
                assert_never(message)

    # -- time ----------------------------------------------------------------

    async def _tick_loop(self) -> None:
        interval = self.config.heartbeat.interval
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            self._last_tick = now
            before = self.state.map_version
            for node in self.detector.tick(now):
                kind = "shard" if node in self.state.shards else "client"
                log.warning("%s %s missed its heartbeats; declared dead", kind, node)
                self._keys.pop(node, None)
                self._forget_queue(node.encode())
                await self._apply(self.state.node_gone(node, now))
                if kind == "client":
                    await self.training.worker_gone(node)
            await self._apply(self.state.tick(now))
            await self._publish_if_changed(before)
            if now - self._last_beat >= interval:
                self._last_beat = now
                # Shards get probes too: a failed send is the fastest sign of death.
                for node in [*self.state.clients, *self.state.shards]:
                    await self._control(node.encode(), MsgType.HEARTBEAT, {})

    def _forget_queue(self, ident: bytes) -> None:
        if self._out is not None:
            self._out.forget(ident)

    def flow(self) -> dict[str, Any]:
        """Flow control figures: bytes held for slow peers against their bounds."""
        out = self._out
        return {
            "held_bytes": out.held_bytes if out else 0,
            "peak_held_bytes": out.allowance.peak if out else 0,
            "peak_peer_held_bytes": out.allowance.peak_peer if out else 0,
            "held_peers": out.allowance.peers if out else 0,
            "queue_bytes": self.config.queue_bytes,
            "client_queue_bytes": self.config.client_queue_bytes,
            "shard_queue_bytes": self.config.shard_queue_bytes,
            "dropped_bytes": out.dropped_bytes if out else 0,
            "stalled_peers": out.stalled if out else 0,
        }

    def _collect(self) -> Iterable[Metric]:
        yield labelled(
            CounterMetricFamily,
            "zps_broker_messages",
            "Messages by outcome",
            "outcome",
            {k: float(v) for k, v in vars(self.stats).items()},
        )
        flow = self.flow()
        yield gauge(
            "zps_broker_held_bytes", "Bytes held for peers slower than zmq", flow["held_bytes"]
        )
        yield gauge(
            "zps_broker_held_bytes_peak",
            "Most bytes held for peers at once",
            flow["peak_held_bytes"],
        )
        yield from _collect_status(self.state.status(time.monotonic(), {}))

    def status(self, now: float) -> dict[str, Any]:
        nodes = [*self.state.shards, *self.state.clients]
        report = self.state.status(now, {n: self.detector.last_seen(n) for n in nodes})
        report["training"] = self.training.status()
        report["broker"] = {
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "uptime_s": round(now - self._started, 1),
            "heartbeat_interval_s": self.config.heartbeat.interval,
            "liveness": self.config.heartbeat.liveness,
            **vars(self.stats),
            "flow": self.flow(),
        }
        return report


def _collect_status(report: dict[str, Any]) -> Iterable[Metric]:
    roles: dict[str, float] = {"primary": 0, "replica": 0, "spare": 0}
    for s in report["shards"]:
        roles[s["role"]] = roles.get(s["role"], 0) + 1
    yield labelled(GaugeMetricFamily, "zps_shards", "Registered shards by role", "role", roles)
    states: dict[str, float] = {"ok": 0, "degraded": 0, "lost": 0, "holding": 0, "unassigned": 0}
    for p in report["partitions"]:
        states[p["state"]] = states.get(p["state"], 0) + 1
    yield labelled(GaugeMetricFamily, "zps_partitions", "Partitions by state", "state", states)
    yield gauge("zps_clients", "Connected clients", len(report["clients"]))
    yield counter(
        "zps_failovers", "Promotions of a replica after a primary died", report["failovers"]
    )
    yield gauge("zps_map_version", "Version of the cluster map", report["map_version"])
    lag = GaugeMetricFamily(
        "zps_replication_lag", "Primary LSN minus the replica's", labels=["partition", "replica"]
    )
    for p in report["partitions"]:
        for r in p["replicas"]:
            if r["lag"] is not None:
                lag.add_metric([str(p["partition"]), r["node"]], r["lag"])
    yield lag


def _claim(claim: ShardClaim | None) -> Claim | None:
    if claim is None:
        return None
    return Claim(claim.partition, claim.epoch, claim.role, claim.lsn, claim.in_sync)
