"""The broker process: one ROUTER endpoint for clients and shards.

Routing reads only the 20-byte route frame; headers and array frames are
forwarded as the same zmq frames (zero-copy).  Sender identities tell the two
kinds of peer apart: shards use ``s-...``, a shard's liveness link ``h-s-...``
(its heartbeats only, counted as the shard's), clients anything else.

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
reads its peers' queues in turn (one message from each), and a shard's
heartbeats come on its liveness link, a peer queue and TCP connection apart from
its replies: a flood from any peer, the shard itself included, delays a shard's
heartbeat by at most one burst.  The systemd watchdog is pinged from the
receive path, and only while the timer loop keeps turning too.

Leases: the broker answers each shard heartbeat with the role it holds for
that shard, echoing the shard's send time on the connection the heartbeat came
by (the liveness link: never behind data queued for the shard); a primary
accepts writes only
while such an answer is younger than its lease, which is shorter than the
liveness timeout.  So a primary cut off from the broker (or paused) stops
writing before the broker can promote anyone else.

Broker pair: with ``pair_role`` set, :class:`~zps.broker.pair.Pair` admits each
message first; a passive broker handles nothing (no timers run), and every
control message an active one sends carries its term.

This module is the process: its sockets, the receive loop and the timer loop.  The
broker's jobs are parts of their own, one module each (:mod:`zps.broker.base` lists
them); :class:`Broker` composes them and hands each only what it uses (the shared
state objects and the calls it makes), never another part or the broker itself; so
do its collaborators (:class:`~zps.broker.pair.Pair`,
:class:`~zps.broker.reshard.Resharder`, :class:`~zps.broker.training.Training`),
through the calls of :class:`Broker` their Protocols name.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, assert_never

from zps import transport
from zps.broker import forward
from zps.broker.acceptance import (
    BadClientRequest,
    CommitReply,
    ForwardReply,
    FromClient,
    FromShard,
    MoveReply,
    Reject,
    RouteRequest,
    WrongVersion,
    accept,
    accept_control,
)
from zps.broker.admission import Admission
from zps.broker.base import BrokerStats, Outlet
from zps.broker.control import Control
from zps.broker.datapath import DataPath
from zps.broker.pair import Pair
from zps.broker.persistence import Record
from zps.broker.report import Report
from zps.broker.reshard import Resharder
from zps.broker.routes import RouteTable
from zps.broker.statefile import StateFile
from zps.broker.training import Training
from zps.core.brokerstate import BrokerState, ReshardRecord
from zps.core.cluster import Assignment, ClusterState
from zps.core.membership import FailureDetector, speaks_for
from zps.errors import ProtocolError
from zps.ops.config import BrokerConfig
from zps.ops.datadir import DataDirLock, lock_data_dir
from zps.ops.metrics import MetricsServer
from zps.ops.security import (
    KeyRoles,
    RefusalLog,
    load_curve_keys,
    load_roles,
    warn_if_exposed,
)
from zps.ops.systemd import Notifier, watchdog_due
from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import StatusRequest

__all__ = ["Broker", "BrokerStats"]

log = logging.getLogger("zps.broker")


class Broker:
    """The broker process (see the module notes): it composes the parts and carries
    out the calls its collaborators make."""

    def __init__(self, config: BrokerConfig, *, notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        self.state = ClusterState(
            config.partitions,
            config.slots,
            replication=config.replication,
            hold_until=time.monotonic() + config.grace,
        )
        self.state.lease = self._lease()
        self.detector = FailureDetector(
            config.heartbeat.interval, config.heartbeat.liveness, start=time.monotonic()
        )
        self.stats = BrokerStats()
        self.bound = asyncio.Event()
        self._stop = asyncio.Event()
        self._last_tick = time.monotonic()
        self._last_ping = 0.0
        self._last_beat = 0.0
        self._roles: KeyRoles | None = None
        self._sock: transport.Channel | None = None
        self.refusals = RefusalLog(log, "the broker")
        self.pair: Pair | None = None
        #: The data dir, held for this process's life (a second broker on it is refused).
        self._lock: DataDirLock | None = None
        # What the parts share: CURVE shard name -> the key it first registered with
        # (kept whatever becomes of the shard, in the data dir's state too: a name
        # outlives its key's process), and each node's zps release.
        bound_keys: dict[str, bytes] = {}
        versions: dict[str, str] = {}
        self.outlet = outlet = Outlet(config, self.stats, self.detector)
        self.training = Training(self.state, outlet.send, self._send_durable)
        self.reshard = Resharder(
            self,
            durable=config.data_dir is not None or config.pair_role is not None,
            heartbeat_interval=config.heartbeat.interval,
            liveness=config.heartbeat.liveness,
        )
        self.admission = admission = Admission(
            self.state,
            self.stats,
            self.refusals,
            bound_keys,
            post=outlet.post,
            refuse=outlet.refuse,
            refuse_call=outlet.refuse_call,
            state_changed=self.state_changed,
        )
        self.datapath = datapath = DataPath(
            self.state,
            self.detector,
            self.stats,
            RouteTable.empty(config.partitions),
            post=outlet.post,
            refuse=outlet.refuse,
            authorised=admission.authorised,
            wrong_version=admission.wrong_version,
        )
        self.record = record = Record(
            config,
            self.state,
            self.training,
            self.reshard,
            bound_keys,
            send=outlet.send,
            post=outlet.post,
            resized=self._resized,
        )
        self.report = report = Report(
            config,
            self.state,
            self.detector,
            self.training,
            self.reshard,
            self.stats,
            self.refusals,
            versions,
            bound=self.bound,
            stop=self._stop,
            record_status=record.status,
            forwarded=lambda: datapath.compiled,
        )
        self.control_plane = Control(
            self.state,
            self.detector,
            self.training,
            self.reshard,
            self.stats,
            versions,
            control=record.control,
            forget=outlet.forget,
            saturated=outlet.saturated,
            status=report.status,
            state_changed=record.state_changed,
            epoch_unrecorded=record.epoch_unrecorded,
            map_changed=self._map_changed,
            log_states=report.log_partition_states,
        )
        # The fast path, bound once: the socket's reader callback calls it directly.
        self._forward = datapath.forward
        self.metrics = MetricsServer(
            config.metrics,
            report.collect,
            ready=report.ready,
            status=lambda: self.report.status(time.monotonic()),  # the status page's report
        )
        if config.data_dir is not None:
            self._lock = lock_data_dir(config.data_dir, f"broker {config.bind}")
            record.load(StateFile(config.data_dir), self.detector)
        now = time.monotonic()
        report.reset_lists(now)  # a resharded cluster's recorded count
        datapath.routes = datapath.routes.resized(self.state.n_partitions)
        if config.pair_role is not None:
            self.pair = Pair(config, self, record=record.last)
            record.pair = report.pair = datapath.pair = self.pair

    def _share(self) -> None:
        """Hand every part the current state, failure detector and training (a broker
        of a pair gets new ones when it resets)."""
        state, detector, training = self.state, self.detector, self.training
        self.outlet.detector = detector
        self.admission.state = state
        self.datapath.state, self.datapath.detector = state, detector
        self.record.state, self.record.training = state, training
        self.report.state, self.report.detector, self.report.training = (
            state,
            detector,
            training,
        )
        cp = self.control_plane
        cp.state, cp.detector, cp.training = state, detector, training

    def _lease(self) -> float:
        """How long a primary's lease runs past the heartbeat an echo renews."""
        hb = self.config.heartbeat
        return hb.interval * (hb.liveness - 1)

    def _resized(self, now: float) -> None:
        """The partition count changed (a recorded slot map, or live resharding)."""
        self.report.resize_lists(now)
        self.datapath.routes = self.datapath.routes.resized(self.state.n_partitions)

    def _map_changed(self, now: float) -> None:
        """A new map: the per-partition lists follow its count, the route table it."""
        if len(self.report.part_states) != self.state.n_partitions:
            self._resized(now)  # live resharding added or removed some
        self.datapath.rebuild_routes()

    # -- the calls the collaborators make (PairHost, ReshardHost, Training) and the
    # -- parts' entry points other code and tests use

    @property
    def routes(self) -> RouteTable:
        """Where each partition's requests go (zps.broker.routes), rebuilt from each map."""
        return self.datapath.routes

    @routes.setter
    def routes(self, table: RouteTable) -> None:
        self.datapath.routes = table

    @property
    def out(self) -> transport.Outbound | None:
        """What the broker sends through (its socket's, once it runs): every part that
        sends is handed the same one."""
        return self.outlet.out

    @out.setter
    def out(self, out: transport.Outbound | None) -> None:
        self.outlet.out = self.admission.out = self.datapath.out = self.report.out = out

    @property
    def endpoint(self) -> str | None:
        return self.report.endpoint

    def post(self, frames: list[Any]) -> transport.Posted:
        """Send without waiting (see the module notes); the one way out of the broker."""
        return self.outlet.post(frames)

    async def send(self, frames: list[Any]) -> bool:
        return await self.outlet.send(frames)

    async def _send_durable(self, frames: list[Any]) -> bool:
        return await self.record.send_durable(frames)

    async def control(
        self,
        node: bytes,
        mtype: MsgType,
        header: dict[str, Any],
        req_id: int = 0,
        *,
        durable: bool = False,
    ) -> None:
        await self.record.control(node, mtype, header, req_id, durable=durable)

    def state_changed(self) -> None:
        self.record.state_changed()

    async def persisted(self, *, standby: bool = False) -> bool:
        return await self.record.persisted(standby=standby)

    def pair_record(self, version: int) -> BrokerState:
        return self.record.pair_record(version)

    def load_record(self, rec: BrokerState) -> None:
        self.record.load_record(rec)

    def state_record(self) -> BrokerState:
        return self.record.state_record()

    def routing(self) -> bool:
        return self.datapath.routing()

    async def apply(self, assignments: list[Assignment]) -> None:
        await self.control_plane.apply(assignments)

    async def publish_if_changed(self, before: int) -> None:
        await self.control_plane.publish_if_changed(before)

    def status(self, now: float) -> dict[str, Any]:
        return self.report.status(now)

    def reset_state(self, now: float, *, hold: float) -> None:
        """Forget every node and start holding for claims (a broker of a pair that
        takes over, or steps down)."""
        cfg = self.config
        self.state = ClusterState(
            cfg.partitions, cfg.slots, replication=cfg.replication, hold_until=now + hold
        )
        self.state.lease = self._lease()
        self.detector = FailureDetector(cfg.heartbeat.interval, cfg.heartbeat.liveness, start=now)
        self.training = Training(self.state, self.outlet.send, self._send_durable)
        self._share()
        self.datapath.routes = RouteTable.empty(cfg.partitions)
        self.control_plane.keys.clear()
        self.report.reset_lists(now)
        self.reshard.restore(None)

    async def republish(self) -> None:
        """Send the map to every node again (its version unchanged)."""
        await self.publish_if_changed(-1)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        self.metrics.start()  # first: a port in use is an error before anything is bound
        try:
            await self._run()
        finally:
            self.metrics.stop()

    async def _run(self) -> None:
        ctx = transport.new_context()
        keys = load_curve_keys(self.config.security)
        self._roles = roles = load_roles(self.config.security)
        self.admission.roles = self.datapath.roles = roles
        self.admission.own_key = keys.public if keys else None
        auth = (
            transport.start_authenticator(
                ctx,
                keys.allowed_dir,
                keys=roles.admitted if roles else None,
                on_refused=self.admission.handshake_refused,
            )
            if keys
            else None
        )
        sock, endpoint = transport.router(
            ctx, self.config.bind, max_message_bytes=self.config.max_message_bytes, curve=keys
        )
        self._sock = self.admission.sock = self.datapath.sock = sock
        self.report.endpoint = endpoint
        unwatch = (
            transport.watch_handshakes(
                sock, self.admission.handshake_refused, self.admission.connection_closed
            )
            if keys
            else None
        )
        warn_if_exposed(self.config.bind, self.config.security, "the broker")
        self.datapath.sock_addr = sock.handle
        self.out = out = transport.Outbound(
            sock,
            total_limit=self.config.queue_bytes,
            stall_timeout=self.config.stall_timeout,
            name="broker",
        )
        n = self.state.n_partitions
        log.info(
            "broker (pid %d) listening on %s: %d partitions x %d copies%s; only claims "
            "are granted for the first %.1fs",
            os.getpid(),
            self.endpoint,
            n,
            self.config.replication,
            f" (the partitions of its record: the setting's {self.config.partitions} is for "
            "a new cluster)"
            if n != self.config.partitions
            else "",
            self.config.grace,
        )
        self.bound.set()
        self.notifier.ready(f"listening on {self.endpoint}")
        self._alive()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._recv_loop()),
                    tg.create_task(self._tick_loop()),
                    tg.create_task(self.metrics.loop_heartbeat()),
                ]
                if self.pair is not None:
                    tasks.append(tg.create_task(self.pair.run(ctx)))
                tasks.append(tg.create_task(self.reshard.run()))
                writer = self.record.writer
                if writer is not None:
                    writer.changed()  # the restored record, under this version
                    tasks.append(tg.create_task(writer.run()))
                await self._stop.wait()
                self.notifier.stopping()
                for t in tasks:
                    t.cancel()
        finally:
            if self.record.writer is not None:
                self.record.writer.flush()
            out.close()
            if auth is not None:
                auth.stop()
            if unwatch is not None:
                unwatch()
            transport.close(sock)
            transport.term(ctx)
            if self._lock is not None:
                self._lock.release()
            log.info("broker stopped")

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

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        log.info(
            "data path: %s%s",
            forward.PATH,
            "; off while this broker checks CURVE roles" if self._roles is not None else "",
        )
        await transport.serve(
            self._sock,
            self._on_message,
            self.admission.on_malformed,
            fast=self.datapath.forward,
            on_burst=self._alive,
            idle=self.config.heartbeat.interval,
            on_idle=self._on_idle,
            pump=self.datapath.pump if forward.step is not None else None,
        )

    async def _on_message(self, frames: transport.Frames) -> None:
        datapath = self.datapath
        declined, datapath.declined = frames is datapath.declined, None
        if len(frames) < 2:
            raise ProtocolError(f"{len(frames)} frame(s): no envelope and route")
        now = time.monotonic()
        ident = transport.frame_bytes(frames[0])
        # A shard's liveness link (h-s-...) speaks for the shard: its heartbeats keep the
        # shard alive and its key must be the shard's; lease echoes go back on it.
        node = speaks_for(ident).decode("utf-8", "replace")
        if self._roles is not None and not self.admission.authorised(ident, node, frames):
            return
        if self.pair is not None and not await self.pair.admit(speaks_for(ident), frames, now):
            return  # a standby: answered PASSIVE, or a shard noted
        self.detector.seen(node, now)
        before = self.state.map_version
        buffers = [transport.frame_buffer(f) for f in frames[1:]]
        # The fast path left this one as a control message: that part of its verdict
        # is decided (one verdict per message).
        verdict = (accept_control if declined else accept)(ident, buffers, self.state)
        try:
            match verdict:
                case RouteRequest() | ForwardReply() | WrongVersion() | Reject():
                    datapath.data(ident, node, verdict, frames, now)
                case FromClient(route, message):
                    await self.control_plane.from_client(ident, node, route, message, now)
                case BadClientRequest(route, error) if route.mtype is MsgType.STATUS:
                    report = StatusRequest.refusal(error)
                    self.post([ident, *encode(Route(MsgType.STATUS, req_id=route.req_id), report)])
                case BadClientRequest(route, error):
                    await self.training.bad_request(ident, route, error)
                case FromShard(_, message):
                    await self.control_plane.from_shard(ident, node, message, now)
                    await self._claims_in(now)
                case MoveReply():
                    self.reshard.on_reply(verdict)
                case CommitReply(route, header):
                    await self.training.on_commit_reply(route, header)
                    self.state_changed()
                case _:
                    assert_never(verdict)
        finally:
            await self.publish_if_changed(before)

    async def _claims_in(self, now: float) -> None:
        """End the start-up hold of a broker restarted from its record as soon as every
        copy it records is back (:func:`zps.core.recovery.claims_in`; the grace bounds
        it).  A broker of a pair decides after a takeover (the pair's ``_end_hold``)."""
        if self.pair is not None or not self.state.claims_in(now):
            return
        self.state.hold_until = now
        log.info("every recorded copy is back: the start-up hold ends, routing")
        await self.apply(self.state.tick(now))
        await self.republish()  # clients re-send what the hold refused

    def _finish_orphaned_move(self, now: float) -> None:
        """A move under way when this broker's record was lost (the shards' claims show
        its fences and imports): the resharding finishes it, as a recorded one."""
        if self.reshard.record is not None:
            return
        move = self.state.take_orphaned_move(now)
        if move is None:
            return
        source, dest, slots, stage = move
        log.warning(
            "a slot move under way when the state record was lost (%d slots, %d -> %d): %s it",
            len(slots),
            source,
            dest,
            "completing" if stage == "copied" else "cancelling",
        )
        self.reshard.restore(ReshardRecord(self.state.n_partitions, source, dest, slots, stage))
        self.state_changed()

    async def _tick_loop(self) -> None:
        interval = self.config.heartbeat.interval
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            self._last_tick = now
            if self.pair is not None and not self.pair.active:
                continue  # a standby watches no one
            await self._claims_in(now)
            before = self.state.map_version
            held = self.state.holding(now - interval / 2) and not self.state.holding(now)
            # A shard one of whose connections closed lately: is the other gone too?
            self.outlet.probe_dropped(now)
            for node in self.detector.tick(now):
                kind = "shard" if node in self.state.shards else "client"
                why = (
                    "closed both its connections"
                    if self.detector.closed(node)
                    else "missed its heartbeats"
                )
                log.warning("%s %s %s; declared dead", kind, node, why)
                self.control_plane.keys.pop(node, None)
                self.control_plane.forget(node.encode())
                await self.apply(self.state.node_gone(node, now))
                if kind == "client":
                    await self.training.worker_gone(node)
                self.state_changed()
            await self.apply(self.state.tick(now))
            await self.publish_if_changed(before)
            self._finish_orphaned_move(now)
            if held:  # the start-up hold just ended: a sync commit may go out now
                await self.training.on_map_change()
            await self.training.on_timer()
            self.report.log_partition_states(now)
            if now - self._last_beat >= interval:
                self._last_beat = now
                # Shards get probes too: a failed send is the fastest sign of death.
                for node in [*self.state.clients, *self.state.shards]:
                    await self.control(node.encode(), MsgType.HEARTBEAT, {})
