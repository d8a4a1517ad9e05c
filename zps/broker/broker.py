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
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, assert_never

import numpy as np

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
)
from zps.broker.pair import Pair
from zps.broker.reshard import Resharder
from zps.broker.statefile import StateFile, StateWriter
from zps.broker.training import Training
from zps.core.brokerstate import BrokerState
from zps.core.cluster import Assignment, Claim, ClusterState
from zps.core.membership import FailureDetector, is_liveness, liveness_identity, speaks_for
from zps.core.routing import default_slot_map
from zps.errors import ConfigError, ProtocolError
from zps.ops.config import BrokerConfig
from zps.ops.datadir import DataDirLock, lock_data_dir
from zps.ops.metrics import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    MetricsServer,
    counter,
    gauge,
    labelled,
)
from zps.ops.security import (
    ADMIN_FIELDS,
    REFUSAL_REASONS,
    KeyRoles,
    RefusalLog,
    identity_refusal,
    is_shard_identity,
    load_curve_keys,
    load_roles,
    refused_by_role,
    request_refusal,
    warn_if_exposed,
)
from zps.ops.systemd import Notifier, watchdog_due
from zps.protocol.codec import (
    PROTOCOL_VERSION,
    MsgType,
    Route,
    VersionMismatchError,
    decode,
    encode,
    unpack_route,
)
from zps.protocol.messages import (
    ADMIN_CLIENT_PREFIX,
    Assign,
    Bye,
    ClientControl,
    ClientHello,
    ClockRequest,
    Heartbeat,
    LeaseEcho,
    MapUpdate,
    Role,
    ShardClaim,
    ShardControl,
    ShardHeartbeat,
    ShardRegister,
    Status,
    StatusReply,
    StatusRequest,
    TaskRequest,
)
from zps.version import __version__

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
    #: Messages in another protocol version, answered VERSION_MISMATCH.
    version_mismatch: int = 0
    #: CURVE: messages refused for their key (see ``refusals`` by reason), dropped.
    unauthorized: int = 0


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
        self.state.lease = self._lease()
        self.detector = FailureDetector(
            config.heartbeat.interval, config.heartbeat.liveness, start=time.monotonic()
        )
        self.stats = BrokerStats()
        self.endpoint: str | None = None
        self.bound = asyncio.Event()
        self._stop = asyncio.Event()
        self._sock: transport.Channel | None = None
        self._sock_addr = 0  # its zmq socket's address, for the compiled data path
        self._compiled = 0  # messages the compiled data path forwarded
        self._out: transport.Outbound | None = None
        self._last_tick = time.monotonic()
        self._last_ping = 0.0
        self._routes: list[bytes | None] = [None] * config.partitions
        self._started = time.monotonic()
        self._last_beat = 0.0
        self._keys: dict[str, str] = {}  # shard -> CURVE public key (for its replicas)
        self._versions: dict[str, str] = {}  # node -> zps release (from REGISTER / HELLO)
        self._incarnations: dict[str, str] = {}  # shard -> its process (from REGISTER)
        self._mismatched: set[str] = set()  # peers warned about another protocol version
        self._roles: KeyRoles | None = None  # CURVE: which keys may act as what
        # CURVE: shard name -> the key it first registered with (kept whatever becomes
        # of the shard, in the data dir's state too: a name outlives its key's process).
        self._bound_keys: dict[str, bytes] = {}
        self.refusals = RefusalLog(log, "the broker")
        self.metrics = MetricsServer(
            config.metrics,
            self._collect,
            ready=self._ready,
            status=lambda: self.status(time.monotonic()),  # the status page's report
        )
        self.training = Training(self.state, self._send, self._send_durable)
        self._record: BrokerState | None = None  # the newest state record produced
        self._writer: StateWriter | None = None
        self.pair: Pair | None = None
        self.reshard = Resharder(self)
        #: The data dir, held for this process's life (a second broker on it is refused).
        self._lock: DataDirLock | None = None
        if config.data_dir is not None:
            self._lock = lock_data_dir(config.data_dir, f"broker {config.bind}")
            self._load_state(StateFile(config.data_dir))
        now = time.monotonic()
        n = self.state.n_partitions  # a resharded cluster's recorded count
        self._part_states = [self.state.partition_state(p, now) for p in range(n)]
        self._placements: list[str | None] = [None] * n  # logged warnings
        self._routes = (self._routes + [None] * n)[:n]
        if config.pair_role is not None:
            self.pair = Pair(self)

    # -- the state that survives a restart ------------------------------------------

    def state_record(self) -> BrokerState:
        """The broker's state as one record: the one place it is built (for the state
        file, and for anything that mirrors this broker).  The version grows only
        when the content changed.  A standby of a pair records its active peer's
        state (the last record received), so either broker restarts knowing it."""
        last = self._record
        version = (last.version if last else 0) + 1
        mirrored = self.pair.mirrored() if self.pair is not None else None
        if mirrored is not None:
            rec = replace(mirrored, version=version)
        else:
            clocks, jobs = self.training.records()
            rec = BrokerState(
                version=version,
                n_partitions=self.state.n_partitions,
                n_slots=self.state.n_slots,
                replication=self.state.replication,
                map_version=self.state.map_version,
                partitions=self.state.records(),
                clocks=clocks,
                jobs=jobs,
                **self.reshard_record(),
                shard_keys=tuple(sorted((n, k.decode()) for n, k in self._bound_keys.items())),
            )
        if last is not None and rec.same_content(last):
            return last
        self._record = rec
        return rec

    def reshard_record(self) -> dict[str, Any]:
        """The slot map (when not round-robin over the configured partitions) and the
        resharding under way, for the state record."""
        state = self.state
        default = state.n_partitions == self.config.partitions and bool(
            (state.slot_map == default_slot_map(state.n_slots, state.n_partitions)).all()
        )
        return {
            "slot_map": b"" if default else state.slot_map.astype("<i4").tobytes(),
            "reshard": self.reshard.record,
        }

    def restore_slots(self, rec: BrokerState) -> None:
        """A recorded slot map (it brings its partition count) and resharding."""
        if rec.slot_map:
            slot_map = np.frombuffer(rec.slot_map, dtype="<i4").astype(np.int32)
            self.state.restore(rec.map_version, rec.partitions, slot_map)
            if hasattr(self, "_placements"):  # not at start: __init__ sizes them next
                self._resize_lists(time.monotonic())
        else:
            self.state.restore(rec.map_version, rec.partitions)
        self.reshard.restore(rec.reshard)

    def _resize_lists(self, now: float) -> None:
        n = self.state.n_partitions
        self._routes = (self._routes + [None] * n)[:n]
        self._part_states = (
            self._part_states + [self.state.partition_state(p, now) for p in range(n)]
        )[:n]
        self._placements = (self._placements + [None] * n)[:n]

    def apply_state(self, rec: BrokerState) -> None:
        """Take over a recorded state (at start, before any node is known)."""
        if rec.slot_map and rec.n_slots == self.config.slots:
            pass  # resharded: the record's partition count stands
        elif (rec.n_partitions, rec.n_slots) != (self.config.partitions, self.config.slots):
            raise ConfigError(
                f"the broker state (version {rec.version}) is of a cluster of "
                f"{rec.n_partitions} partitions and {rec.n_slots} slots; this broker was "
                f"given {self.config.partitions} partitions and {self.config.slots} slots"
            )
        self.restore_slots(rec)
        self.training.restore(rec.clocks, rec.jobs)
        self._bound_keys = {node: key.encode() for node, key in rec.shard_keys}
        self._record = rec
        # The recorded workers are watched like any peer: one that never speaks to
        # this broker is declared dead (its tasks re-queued, its clock dropped).
        now = time.monotonic()
        for worker in {w for w, _, _ in rec.clocks.workers} | {
            w for job in rec.jobs for _, w in job.held
        }:
            self.detector.seen(worker, now)

    def _load_state(self, file: StateFile) -> None:
        file.prepare()
        rec = file.load()
        if rec is None:
            log.info("no broker state in %s yet: a new cluster", file.dir)
        else:
            self.apply_state(rec)
            known = [p for p, r in enumerate(rec.partitions) if r.known]
            log.info(
                "restored the broker state (version %d) from %s: %d of %d partitions hold "
                "data (epochs %s), %d job(s)%s",
                rec.version,
                file.path,
                len(known),
                rec.n_partitions,
                ",".join(str(r.epoch) for r in rec.partitions),
                len(rec.jobs),
                f", sync step {rec.clocks.committing} committing"
                if rec.clocks.committing is not None
                else "",
            )
        self._writer = StateWriter(file, self.state_record, written=rec)

    def _state_changed(self) -> None:
        if self._writer is not None:
            self._writer.changed()

    def _epoch_unrecorded(self, p: int) -> bool:
        """Whether partition ``p``'s confirmed epoch is newer than the one on disk (its
        new primary's lease echoes wait for the record; none without a data dir)."""
        written = self._writer.written if self._writer is not None else None
        if self._writer is None:
            return False
        if written is None or p >= len(written.partitions):
            return True
        return written.partitions[p].floor_epoch < self.state.floor_of(p)[0]

    def _lease(self) -> float:
        """How long a primary's lease runs past the heartbeat an echo renews."""
        hb = self.config.heartbeat
        return hb.interval * (hb.liveness - 1)

    def reset_state(self, now: float, *, hold: float) -> None:
        """Forget every node and start holding for claims (a broker of a pair that
        takes over, or steps down)."""
        cfg = self.config
        self.state = ClusterState(
            cfg.partitions, cfg.slots, replication=cfg.replication, hold_until=now + hold
        )
        self.state.lease = self._lease()
        self.detector = FailureDetector(cfg.heartbeat.interval, cfg.heartbeat.liveness, start=now)
        self.training = Training(self.state, self._send, self._send_durable)
        self._routes = [None] * cfg.partitions
        self._keys.clear()
        self._part_states = [self.state.partition_state(p, now) for p in range(cfg.partitions)]
        self._placements = [None] * cfg.partitions
        self.reshard.restore(None)

    async def republish(self) -> None:
        """Send the map to every node again (its version unchanged)."""
        await self._publish_if_changed(-1)

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
            ctx, self.config.bind, max_message_bytes=self.config.max_message_bytes, curve=keys
        )
        unwatch = (
            transport.watch_handshakes(
                self._sock.sock, self._handshake_refused, self._connection_closed
            )
            if keys
            else None
        )
        warn_if_exposed(self.config.bind, self.config.security, "the broker")
        self._sock_addr = self._sock.handle
        self._out = transport.Outbound(
            self._sock,
            total_limit=self.config.queue_bytes,
            stall_timeout=self.config.stall_timeout,
            name="broker",
            gate=transport.ConnectionGate() if keys else None,
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
                if self._writer is not None:
                    self._writer.changed()  # the restored record, under this version
                    tasks.append(tg.create_task(self._writer.run()))
                await self._stop.wait()
                self.notifier.stopping()
                for t in tasks:
                    t.cancel()
        finally:
            if self._writer is not None:
                self._writer.flush()
            self._out.close()
            if auth is not None:
                auth.stop()
            if unwatch is not None:
                unwatch()
            transport.close(self._sock)
            transport.term(ctx)
            if self._lock is not None:
                self._lock.release()
            log.info("broker stopped")

    # -- sending -------------------------------------------------------------

    def _post(self, frames: list[Any]) -> transport.Posted:
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

    async def _send_durable(self, frames: list[Any]) -> bool:
        """:meth:`_send` once the state as it is now is in the data dir (at once
        without one)."""
        if self._writer is None:
            return await self._send(frames)
        self._writer.after_write(lambda: self._post(frames))
        return True

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
        self,
        node: bytes,
        mtype: MsgType,
        header: dict[str, Any],
        req_id: int = 0,
        *,
        durable: bool = False,
    ) -> None:
        """Broker-originated message (an answer carries its request's id); shards (and
        their liveness links) get the empty source frame.  ``durable``: sent once the
        state as it is now is in the data dir."""
        prefix = [node, b""] if node.startswith(b"s-") or is_liveness(node) else [node]
        if self.pair is not None:  # fencing: shards and clients obey the highest term
            header = {**header, "term": self.pair.term}
        frames = [*prefix, *encode(Route(mtype, req_id=req_id), header)]
        await (self._send_durable if durable else self._send)(frames)

    async def _reply_error(self, client: bytes, route: Route, code: Status, message: str) -> None:
        self._refuse(client, route, code, message)

    def _refuse(self, client: bytes, route: Route, code: Status, message: str) -> None:
        reply = Route(MsgType.REPLY, route.partition, route.epoch, route.req_id)
        self._post([client, *encode(reply, StatusReply(code, message).to_wire())])

    async def _apply(self, assignments: list[Assignment]) -> None:
        for a in assignments:
            log.info(
                "assign %s: %s at epoch %d%s",
                a.node_id,
                a.role.value
                if a.partition is None
                else f"{a.role.value} of partition {a.partition}",
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
        self._log_notices()
        if self.state.map_version == before:
            return
        self._state_changed()
        if len(self._routes) != self.state.n_partitions:
            self._resize_lists(time.monotonic())  # live resharding added or removed some
        for p in range(self.state.n_partitions):
            primary = self.state.map.partitions[p].primary  # none while handing over
            self._routes[p] = primary.encode() if primary else None
        # A map goes out once the record holding it is durable: a primary releases the
        # writes that waited for a replica only when a map drops that replica from the
        # in-sync set, and a restart must not elect the dropped copy.
        wire = MapUpdate(self.state.map.to_wire()).to_wire()
        for node in [*self.state.clients, *self.state.shards]:
            await self._control(node.encode(), MsgType.MAP, wire, durable=True)
        self._log_partition_states(time.monotonic())
        await self.training.on_map_change()

    def _log_notices(self) -> None:
        levels = {"error": logging.ERROR, "warning": logging.WARNING}
        for level, message in self.state.notices:
            log.log(levels.get(level, logging.INFO), "%s", message)
        self.state.notices.clear()

    def _log_partition_states(self, now: float) -> None:
        """Log each change of a partition's state once: lost at ERROR, a copy gone
        (ok -> degraded) at WARNING, the rest (recoveries, start-up) at INFO."""
        for p, old in enumerate(self._part_states):
            new = self.state.partition_state(p, now)
            if new == old:
                continue
            self._part_states[p] = new
            stopped = new == "lost" and self.state.stopped(p)
            level = (
                logging.WARNING
                if stopped or (new == "degraded" and old == "ok")
                else logging.ERROR
                if new == "lost"
                else logging.INFO
            )
            why = {
                "lost": "its last copy was stopped; its requests wait until a shard holding "
                "it registers"
                if stopped
                else "no copy left; its requests wait until a shard holding it registers",
                "degraded": "fewer copies in sync than configured",
            }.get(new, "")
            primary = self.state.primary_of(p)
            log.log(
                level,
                "partition %d: %s -> %s%s%s",
                p,
                old,
                new,
                f" (primary {primary})" if primary and new in ("ok", "degraded") else "",
                f": {why}" if why else "",
            )
        for p, before in enumerate(self._placements):
            warning = self.state.placement_warning(p)
            if warning != before:
                self._placements[p] = warning
                if warning is not None:
                    log.warning("partition %d: %s", p, warning)
                else:
                    log.info("partition %d: its copies are on distinct hosts (zones) again", p)

    # -- receiving -----------------------------------------------------------

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
            self._on_malformed,
            fast=self._forward,
            on_burst=self._alive,
            idle=self.config.heartbeat.interval,
            on_idle=self._on_idle,
            pump=self._pump if forward.step is not None else None,
        )

    def _pump(self, limit: int) -> tuple[int, int, transport.Frames | None] | None:
        """The data path as one compiled step (:mod:`zps.broker.forward`): what
        :meth:`_forward` does for a request or a reply that needs no decision of its
        own, for every such message queued; the first other one comes back, for
        :meth:`_forward` (or :meth:`_on_message`).  None (the Python path) while this
        broker checks CURVE roles or is not a pair's active one."""
        pair = self.pair
        if self._roles is not None or (pair is not None and not pair.star.active):
            return None
        if self._sock is None or self._sock.closed:
            return None  # never hand compiled code a closed socket's address
        step = forward.step
        assert step is not None and self._out is not None
        now = time.monotonic()
        events, routed, replies, declined = step(
            self._sock_addr,
            limit,
            self._routes,
            self.state.shards,
            self.detector.last_heard,
            self._out.queues,
            self.state.holding(now),
            now,
        )
        if routed or replies:
            self.stats.routed += routed
            self.stats.replies += replies
            self._compiled += routed + replies
        return events, routed + replies, declined

    async def _on_message(self, frames: transport.Frames) -> None:
        if len(frames) < 2:
            raise ProtocolError(f"{len(frames)} frame(s): no envelope and route")
        now = time.monotonic()
        ident = transport.frame_bytes(frames[0])
        # A shard's liveness link (h-s-...) speaks for the shard: its heartbeats keep the
        # shard alive and its key must be the shard's; lease echoes go back on it.
        node = speaks_for(ident).decode("utf-8", "replace")
        if self._roles is not None and not self._authorised(ident, node, frames):
            return
        if self.pair is not None and not await self.pair.admit(speaks_for(ident), frames, now):
            return  # a standby: answered PASSIVE, or a shard noted
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
                case MoveReply():
                    self.reshard.on_reply(verdict)
                case CommitReply(route, header):
                    await self.training.on_commit_reply(route, header)
                    self._state_changed()
                case WrongVersion(error):
                    self._wrong_version(ident, node, error)
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

    def _forward(self, frames: transport.Frames) -> bool:
        """The data path, run in the socket's reader callback (see transport.serve): a
        client's REQUEST routed to its primary, a shard's reply forwarded to its client,
        exactly as :meth:`_on_message` would.  False for anything else, or when this
        broker is not a pair's active one: :meth:`_on_message` handles it."""
        if len(frames) < 3:
            return False
        pair = self.pair
        if pair is not None and not pair.star.active:
            return False  # admit() answers, or takes over: not here
        ident = transport.frame_bytes(frames[0])
        if ident.startswith(b"s-"):
            if not len(frames[1]):
                return False  # a shard's control message
        elif is_liveness(ident):
            return False
        node = ident.decode("utf-8", "replace")
        if self._roles is not None and not self._authorised(ident, node, frames):
            return True  # dropped (or refused), counted
        now = time.monotonic()
        verdict = accept(ident, [transport.frame_buffer(f) for f in frames[1:]], self.state)
        match verdict:
            case RouteRequest(route):
                self.detector.seen(node, now)
                self._route_now(ident, route, frames, now)
            case ForwardReply(target):
                self.detector.seen(node, now)
                self.stats.replies += 1
                self._post([target, *frames[2:]])
            case _:
                return False  # _on_message takes it from the start (accept again)
        return True

    def _authorised(self, ident: bytes, node: str, frames: transport.Frames) -> bool:
        """CURVE: the sender's key must be allowed, own the identity (a shard name is
        bound to the key it first came with, any other identity carries its key's tag:
        zps.ops.security) and, for a command that changes the cluster, be an operator's.
        Anything else is dropped (a command refused with an answer), counted by reason
        and logged once per peer and key a minute."""
        assert self._roles is not None
        key = transport.sender_key(frames[1])
        shard = is_shard_identity(ident)
        owner = self._bound_keys.get(node) if shard else None
        reason = identity_refusal(ident, key, self._roles, owner)
        if reason is None and shard and owner is None:
            assert key is not None
            self._bind(node, key)
        if reason is None and not shard:
            refused = self._command_refusal(ident, frames, "operator" in self._roles.roles(key))
            if refused is not None:
                self.stats.unauthorized += 1
                self.refusals.refused(node, key, refused[0], time.monotonic(), refused[1])
                return False
        if reason is None:
            assert self._out is not None and self._out.gate is not None
            self._out.gate.accepted(ident, transport.sender_fd(frames[1]))
            return True
        self.stats.unauthorized += 1
        self.refusals.refused(node, key, reason, time.monotonic())
        return False

    def _connection_closed(self, fd: int) -> None:
        """CURVE: a connection closed; its identity gets nothing until it speaks again
        (whatever connection holds the identity next may be another key's)."""
        if self._out is not None:
            self._out.connection_closed(fd)

    def _bind(self, node: str, key: bytes) -> None:
        """Bind shard name ``node`` to ``key``.  The table is bounded: past its bound a
        name no shard of the membership holds is forgotten (never a live one)."""
        if len(self._bound_keys) >= _MAX_BOUND_NAMES:
            idle = next((n for n in self._bound_keys if n not in self.state.shards), None)
            if idle is not None:
                del self._bound_keys[idle]
        self._bound_keys[node] = key
        self._state_changed()

    def _command_refusal(
        self, ident: bytes, frames: transport.Frames, operator: bool
    ) -> tuple[str, str] | None:
        """Why a client's message is refused (``(reason, what)``), answered at once, or
        None: a REQUEST whose dedup id is not its sender's or, from a key that is not an
        operator's, with drop or checkpoint operations (zps.ops.security.request_refusal);
        from such a key, a STATUS request's commands and a TASK request that changes a job
        (``TaskRequest.operator_only``).  The status report stays open."""
        if len(frames) < 3:
            return None
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
        except ProtocolError:
            return None
        if route.mtype is MsgType.REQUEST:
            refused = request_refusal(transport.frame_buffer(frames[2]), ident, operator)
            if refused is not None:
                self._refuse(ident, route, Status.BAD_REQUEST, refused[1])
            return refused
        if route.mtype not in (MsgType.STATUS, MsgType.TASK) or operator:
            return None
        try:
            header = decode([transport.frame_buffer(f) for f in frames[1:]]).header
            task = TaskRequest.parse(header) if route.mtype is MsgType.TASK else None
        except ProtocolError:
            return None  # answered BAD_REQUEST, or dropped as malformed, by the usual path
        if task is not None:
            if not task.operator_only:
                return None
            what = f"{'a restart' if task.op == 'create' else task.op} of job {task.job!r}"
            msg = refused_by_role(what)
            self._refuse_call(ident, route, msg)
            return "wrong_role", msg
        asked = [f for f in ADMIN_FIELDS if header.get(f) is not None and header[f] is not False]
        if not asked:
            return None
        msg = refused_by_role(", ".join(asked))
        report: dict[str, Any] = {"st": Status.BAD_REQUEST.value, "msg": msg, "refused": "role"}
        for command in ("reset", "drain", "scale"):
            report[command] = {"ok": False, "msg": msg}
        self._post([ident, *encode(Route(MsgType.STATUS, req_id=route.req_id), report)])
        return "wrong_role", msg

    def _refuse_call(self, ident: bytes, route: Route, msg: str) -> None:
        """Answer a broker call (TASK) BAD_REQUEST, in its own message type."""
        header = StatusReply(Status.BAD_REQUEST, msg).to_wire()
        self._post([ident, *encode(Route(route.mtype, req_id=route.req_id), header)])

    def _handshake_refused(self, peer: str, key: bytes | None, reason: str) -> None:
        """A handshake the ZAP handler or the socket refused: counted, logged."""
        self.stats.unauthorized += 1
        self.refusals.refused(f"a peer at {peer}", key, reason, time.monotonic())

    def _wrong_version(self, ident: bytes, node: str, error: VersionMismatchError) -> None:
        """Answer VERSION_MISMATCH (in this protocol version); warn once per peer."""
        self.stats.version_mismatch += 1
        if node not in self._mismatched:
            if len(self._mismatched) >= 4096:
                self._mismatched.clear()
            self._mismatched.add(node)
            log.warning(
                "%s %s speaks protocol version %d, this broker %d (zps %s): answered "
                "VERSION_MISMATCH; see the compatibility rule in docs/design.md",
                "shard" if ident.startswith(b"s-") or is_liveness(ident) else "client",
                node,
                error.version,
                PROTOCOL_VERSION,
                __version__,
            )
        reply = StatusReply(
            Status.VERSION_MISMATCH,
            f"this broker (zps {__version__}) speaks protocol version {PROTOCOL_VERSION}, "
            f"the message was in version {error.version}",
        )
        route = Route(MsgType.REPLY, error.partition, error.epoch, error.req_id)
        prefix = [ident, b""] if ident.startswith(b"s-") or is_liveness(ident) else [ident]
        self._post([*prefix, *encode(route, reply.to_wire())])

    def _on_malformed(self, frames: transport.Frames, err: ProtocolError) -> None:
        self.stats.malformed += 1
        node = transport.frame_bytes(frames[0]).decode("utf-8", "replace") if frames else "?"
        log.debug("dropped a malformed message from %s: %s", node, err)

    async def _from_client(
        self, ident: bytes, node: str, route: Route, message: ClientControl, now: float
    ) -> None:
        match message:
            case ClientHello(host, pid, name, version, router) if router:
                # A routing broker (zps/broker/router.py): listed in the map, which it
                # follows like a client.
                if node not in self.state.routers:
                    log.info("router %s joined at %s (%s pid %s)", node, router, host, pid)
                self.state.register_router(node, endpoint=router, host=host, now=now, pid=pid)
                self._versions[node] = version
                await self._control(
                    ident, MsgType.MAP, MapUpdate(self.state.map.to_wire()).to_wire()
                )
            case ClientHello(host, pid, name, version):
                self.state.register_client(node, host=host, pid=pid, name=name, now=now)
                self._versions[node] = version
                # An admin command (status, drain, ...) connects for one query: debug only.
                log.log(
                    logging.DEBUG if (name or "").startswith(ADMIN_CLIENT_PREFIX) else logging.INFO,
                    "client %s joined (%s pid %s)",
                    node,
                    host,
                    pid,
                )
                await self._control(
                    ident, MsgType.MAP, MapUpdate(self.state.map.to_wire()).to_wire()
                )
            case Heartbeat(train):
                if node not in self.state.clients:  # the broker restarted: re-introduce
                    await self._control(ident, MsgType.HELLO, {})
                if train is not None:  # what ps.report recorded: the status page plots it
                    self.training.on_report(node, train, time.time())
            case StatusRequest(reset, accept_loss, drain, undrain):
                result = None if reset is None else await self._reset(reset, accept_loss, now)
                drained = (
                    None
                    if drain is None and undrain is None
                    else await self._drain(drain or undrain or "", now, undo=drain is None)
                )
                if self._saturated(ident):
                    self.stats.dropped += 1  # it reads nothing: spare the work
                    return
                report = self.status(now)
                if result is not None:
                    report["reset"] = result
                if drained is not None:
                    report["drain"] = drained
                if message.scale is not None or message.scale_cancel:
                    report["scale"] = (
                        self.reshard.cancel()
                        if message.scale_cancel
                        else self.reshard.request(
                            message.scale or 0,
                            now,
                            max_slots=message.scale_max_slots,
                            piece_bytes=message.scale_piece_bytes,
                        )
                    )
                    report["reshard"] = self.reshard.status()
                await self._control(ident, MsgType.STATUS, report, route.req_id)
            case ClockRequest():
                await self.training.on_clock(ident, node, route, message)
                self._state_changed()
            case TaskRequest():
                await self.training.on_task(ident, node, route, message)
                self._state_changed()
            case Bye():
                self.detector.forget(node)
                self._forget_queue(ident)
                self.state.node_gone(node, now)
                await self.training.worker_gone(node)
                self._state_changed()
            case _:
                assert_never(message)

    async def _route_request(
        self, ident: bytes, route: Route, frames: list[Any], now: float
    ) -> None:
        self._route_now(ident, route, frames, now)

    def _route_now(self, ident: bytes, route: Route, frames: list[Any], now: float) -> None:
        p = route.partition
        target = self._routes[p] if 0 <= p < len(self._routes) else None
        if self.state.holding(now) and 0 <= p < len(self._routes):
            # A claim granted now may still be displaced by a newer copy: no
            # write may land on it until the hold ends.
            target = None
        if target is None:
            if 0 <= p < len(self._routes) and self.state.holding(now):
                self._refuse(
                    ident,
                    route,
                    Status.NOT_PRIMARY,
                    f"partition {p}: the broker is collecting the shards' claims",
                )
                return
            self.stats.unavailable += 1
            if 0 <= p < len(self._routes) and self.state.is_lost(p):
                floor = self.state.floor_of(p)
                message = (
                    f"partition {p} is lost: no copy at epoch {floor[0]}, LSN {floor[1]} or "
                    "newer is left; it is unavailable until a shard holding one registers "
                    f"(or an operator runs zps-server reset-partition --partition {p} "
                    "--accept-data-loss)"
                )
            else:
                why = (
                    "no such partition"
                    if not 0 <= p < len(self._routes)
                    else "not yet assigned to a shard"
                )
                message = f"partition {p} has no live shard ({why})"
            self._refuse(ident, route, Status.SHARD_UNAVAILABLE, message)
            return
        posted = self._post([target, ident, *frames[1:]])
        if posted is transport.Posted.DROPPED:
            # The primary's queue is full: the client retries with backoff, the
            # broker carries on with everyone else.
            self.stats.overloaded += 1
            self._refuse(
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
            self._refuse(
                ident, route, Status.NOT_PRIMARY, f"the primary of partition {p} is unreachable"
            )

    async def _from_shard(self, ident: bytes, node: str, message: ShardControl, now: float) -> None:
        match message:
            case ShardRegister():
                claim = _claim(message.claim)
                earlier = self._incarnations.get(node)
                if (
                    earlier
                    and message.incarnation
                    and earlier != message.incarnation
                    and node in self.state.shards
                ):
                    # A restarted shard (names are stable): its earlier process is gone,
                    # with whatever it held; the new one is admitted afresh.
                    log.warning(
                        "shard %s registered again as a new process (%s pid %s): the "
                        "earlier one is gone (two live shards must not share a name)",
                        node,
                        message.host,
                        message.pid,
                    )
                    self._forget_queue(ident)
                    self._keys.pop(node, None)
                    await self._apply(self.state.node_gone(node, now))
                self._incarnations[node] = message.incarnation
                if message.public_key is not None:  # a Z85 CURVE public key
                    self._keys[node] = message.public_key
                self._versions[node] = message.version
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
                        zone=message.zone,
                    )
                )
            case ShardHeartbeat():
                shard = self.state.shards.get(node)
                if shard is None:
                    await self._control(ident, MsgType.REGISTER, {})
                    return
                p = shard.partition
                self.state.report(
                    node,
                    lsn=message.lsn,
                    stats=message.stats,
                    epoch=message.epoch,
                    in_sync=None if message.in_sync is None else list(message.in_sync),
                    durable=message.durable,
                    t=message.t,
                )
                if shard.role is Role.PRIMARY:
                    self._state_changed()  # its LSN raises its partition's floor
                # The echo renews the shard's lease, for exactly this role (nothing while
                # it is fenced); it goes back on the connection the heartbeat came by (the
                # shard's liveness link, so it never waits behind data queued for the
                # shard).  Until the record names a promoted primary's epoch (and so it as
                # the partition's in-sync set), its echoes wait for the record: it takes
                # no write before that is durable.
                role, partition, epoch = self.state.lease_echo(node)
                echo = LeaseEcho(message.t, role, partition, epoch)
                unrecorded = p is not None and role is Role.PRIMARY and self._epoch_unrecorded(p)
                await self._control(ident, MsgType.HEARTBEAT, echo.to_wire(), durable=unrecorded)
            case Bye():
                log.info("shard %s left", node)
                self.detector.forget(node)
                self._forget_queue(ident)
                self._keys.pop(node, None)
                await self._apply(self.state.node_gone(node, now, planned=True))
            case _:
                assert_never(message)

    # -- time ----------------------------------------------------------------

    async def _tick_loop(self) -> None:
        interval = self.config.heartbeat.interval
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            self._last_tick = now
            if self.pair is not None and not self.pair.active:
                continue  # a standby watches no one
            before = self.state.map_version
            held = self.state.holding(now - interval / 2) and not self.state.holding(now)
            for node in self.detector.tick(now):
                kind = "shard" if node in self.state.shards else "client"
                log.warning("%s %s missed its heartbeats; declared dead", kind, node)
                self._keys.pop(node, None)
                self._forget_queue(node.encode())
                await self._apply(self.state.node_gone(node, now))
                if kind == "client":
                    await self.training.worker_gone(node)
                self._state_changed()
            await self._apply(self.state.tick(now))
            await self._publish_if_changed(before)
            if held:  # the start-up hold just ended: a sync commit may go out now
                await self.training.on_map_change()
            await self.training.on_timer()
            self._log_partition_states(now)
            if now - self._last_beat >= interval:
                self._last_beat = now
                # Shards get probes too: a failed send is the fastest sign of death.
                for node in [*self.state.clients, *self.state.shards]:
                    await self._control(node.encode(), MsgType.HEARTBEAT, {})

    def _ready(self) -> tuple[bool, str]:
        """For ``/ready`` (called from the metrics thread): the broker serves the map."""
        if not self.bound.is_set() or self._stop.is_set():
            return False, "not listening"
        if self.pair is not None and not self.pair.active:
            return False, "the standby of a broker pair"
        if self.state.holding(time.monotonic()):
            return False, "collecting the shards' claims after a start"
        return True, f"serving map v{self.state.map_version} on {self.endpoint}"

    def _state_status(self) -> dict[str, Any] | None:
        w = self._writer
        if w is None:
            return None
        return {
            "path": str(w.file.path),
            "version": w.written.version if w.written else None,
            "writes": w.writes,
            "write_failures": w.failures,
        }

    async def _drain(self, node: str, now: float, *, undo: bool) -> dict[str, Any]:
        """An operator's drain / undrain: answered in the status report."""
        try:
            out = self.state.undrain(node, now) if undo else self.state.drain(node, now)
        except ValueError as e:
            return {"ok": False, "msg": str(e)}
        log.warning("shard %s %s by an operator", node, "undrained" if undo else "drained")
        await self._apply(out)
        self._state_changed()
        return {
            "ok": True,
            "msg": f"{node} undrained: it may take roles again"
            if undo
            else f"{node} drained: it holds no role until `zps-server undrain {node}`",
        }

    async def _reset(self, p: int, accept_loss: bool, now: float) -> dict[str, Any]:
        """An operator's reset-partition: answered in the status report."""
        if not accept_loss:
            return {"ok": False, "msg": "reset-partition needs accept_data_loss"}
        try:
            out = self.state.reset_partition(p, now)
        except ValueError as e:
            return {"ok": False, "msg": str(e)}
        await self._apply(out)
        self._state_changed()
        primary = self.state.primary_of(p)
        return {
            "ok": True,
            "msg": f"partition {p} reset: "
            + (
                f"served by {primary} at epoch {self.state.map.partitions[p].epoch}"
                if primary
                else "the next shard to register takes it"
            ),
        }

    def _forget_queue(self, ident: bytes) -> None:
        """A peer left: drop what is held for it (and its recorded release)."""
        node = ident.decode("utf-8", "replace")
        self._versions.pop(node, None)
        self._incarnations.pop(node, None)
        if self._out is not None:
            self._out.forget(ident)
            self._out.forget(liveness_identity(ident))

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
            "zps_broker_peak_held_bytes",
            "Most bytes held for peers at once",
            flow["peak_held_bytes"],
        )
        yield labelled(
            CounterMetricFamily,
            "zps_broker_refusals",
            "CURVE peers and messages refused, by reason",
            "reason",
            {r: float(self.refusals.counts.get(r, 0)) for r in REFUSAL_REASONS},
        )
        yield from _collect_status(self.state.status(time.monotonic(), {}))
        yield from self.training.metrics()

    def status(self, now: float) -> dict[str, Any]:
        nodes = [*self.state.shards, *self.state.clients]
        report = self.state.status(now, {n: self.detector.last_seen(n) for n in nodes})
        report["training"] = self.training.status()
        report["reshard"] = self.reshard.status()
        report["routers"] = [
            {
                **r.to_wire(),
                "partitions": [
                    p for p, i in self.state.map.partitions.items() if i.router == r.endpoint
                ],
            }
            for r in self.state.map.routers
        ]
        for entry in (*report["shards"], *report["clients"]):
            entry["version"] = self._versions.get(entry["node"]) or None
        report["broker"] = {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "uptime_s": round(now - self._started, 1),
            "heartbeat_interval_s": self.config.heartbeat.interval,
            "liveness": self.config.heartbeat.liveness,
            **vars(self.stats),
            # Which code forwards requests and replies (zps.broker.forward), and how
            # many messages the compiled step forwarded.
            "data_path": "python" if forward.step is None else "compiled",
            "forwarded_compiled": self._compiled,
            "flow": self.flow(),
            "state": self._state_status(),
        }
        if self.pair is not None:
            report["pair"] = self.pair.status(now)
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
        "zps_broker_replica_lag_updates",
        "Updates the replica's last reported LSN is behind its primary's",
        labels=["partition", "replica"],
    )
    for p in report["partitions"]:
        for r in p["replicas"]:
            if r["lag"] is not None:
                lag.add_metric([str(p["partition"]), r["node"]], r["lag"])
    if lag.samples:
        yield lag


#: Shard names bound to keys at most (past it a name no live shard holds is forgotten).
_MAX_BOUND_NAMES = 65536


def _claim(claim: ShardClaim | None) -> Claim | None:
    if claim is None:
        return None
    return Claim(claim.partition, claim.epoch, claim.role, claim.lsn, claim.in_sync, claim.complete)
