"""The shard process: serves one partition as primary or replica.

Links:

* a DEALER to the broker: registration (claiming what it already serves, so
  a restarted broker rebuilds its map), heartbeats, requests and replies.
  Frames from the broker are ``[source, route, header, payloads...]``: an
  empty ``source`` is the broker itself, anything else a client to answer.
* a ROUTER of its own (``replication_bind``): when primary, its replicas
  subscribe here; it sends each a snapshot, then every message that changed
  state, and collects their acknowledgements.
* a DEALER to its primary, when replica.

A primary answers a write once every replica it requires has applied it
(``acks=all``; see :mod:`zps.core.replication`), and accepts requests only while
its lease from the broker runs (see :mod:`zps.broker.broker`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq.asyncio

from zps import transport
from zps.core.replication import AckTracker, StreamCheck, check_stream
from zps.core.routing import ClusterMap
from zps.errors import BrokenError, ClosedError, ProtocolError, ZpsError
from zps.ops import malloc
from zps.ops.config import ShardConfig
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
from zps.ops.systemd import Notifier
from zps.protocol.codec import Encoder, MsgType, Route, decode, encode, unpack_route
from zps.protocol.messages import Role
from zps.shard.checkpoint import CheckpointStore
from zps.shard.core import ShardCore
from zps.store.snapshot import decode_snapshot, encode_snapshot
from zps.transport import CurveKeys

log = logging.getLogger("zps.shard")

Reply = tuple[bytes, list[Any]]  # (client identity, reply frames)


@dataclass
class Follower:
    """A replica streaming from this primary."""

    snapshot_lsn: int
    acked: int = 0
    last_heard: float = 0.0


def advertise_host(broker: str) -> str:
    """The local address on the route to the broker (no packet is sent)."""
    host = urlsplit(broker).hostname or "127.0.0.1"
    if host in ("*", "0.0.0.0", "localhost"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


class ShardServer:
    def __init__(
        self, config: ShardConfig, *, node_id: str | None = None, notifier: Notifier | None = None
    ) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        self.metrics = MetricsServer(config.metrics, self._collect)
        self._latency = {k: self.metrics.request_seconds.labels(kind=k) for k in ("read", "write")}
        self.checkpoints_written = 0
        self.node_id = node_id or f"s-{uuid.uuid4().hex[:12]}"
        self.core = ShardCore()
        self.role = Role.SPARE
        self.address = ""
        self.assigned = asyncio.Event()
        hb = config.heartbeat
        self.lease = hb.interval * max(1, hb.liveness - 1)
        self._stop = asyncio.Event()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: transport.Channel | None = None
        self._repl: transport.Channel | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._last_broker = time.monotonic()
        self._broker_lost = False
        self._trim_due = False  # traffic since the last malloc.trim()
        self._lease_start = -1e9
        # primary side
        self._tracker: AckTracker[Reply] = AckTracker()
        self._followers: dict[str, Follower] = {}
        self._local_in_sync: set[str] = set()
        self._published_in_sync: set[str] = set()
        # replica side
        self._upstream: transport.Channel | None = None
        self._upstream_task: asyncio.Task[None] | None = None
        self._following: tuple[str, int] | None = None  # (primary address, epoch)
        self._in_sync_published = False
        self._resync = False
        self._synced = False
        self._replicas: set[str] = set()  # this partition's replicas, as the map says
        self._leaving = False
        self._restored = False
        self._keys: CurveKeys | None = None
        self._checkpoints = (
            CheckpointStore(config.data_dir, config.checkpoint.keep) if config.data_dir else None
        )
        self._last_checkpoint = (time.monotonic(), 0)

    def stop(self) -> None:
        self._stop.set()

    # -- lifecycle -----------------------------------------------------------

    async def run(self) -> None:
        """Serve until :meth:`stop`; sockets are closed on the way out."""
        cfg = self.config
        self._restore()
        self._ctx = transport.new_context()
        keys = self._keys = load_curve_keys(cfg.security)
        auth = transport.start_authenticator(self._ctx, keys.allowed_dir) if keys else None
        self._repl, bound = transport.router(
            self._ctx, cfg.replication_bind, max_message_bytes=cfg.max_message_bytes, curve=keys
        )
        port = urlsplit(bound).port
        self.address = f"tcp://{cfg.advertise_host or advertise_host(cfg.broker)}:{port}"
        self._sock = transport.dealer(
            self._ctx,
            cfg.broker,
            self.node_id.encode(),
            max_message_bytes=cfg.max_message_bytes,
            curve=keys,
            server_public=keys.server_public if keys else None,
        )
        log.info(
            "shard %s (pid %d) connecting to %s; replication at %s",
            self.node_id,
            os.getpid(),
            cfg.broker,
            self.address,
        )
        try:
            self.metrics.start()
            await self._register()
            self.notifier.ready(f"registering with {cfg.broker}")
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tasks = [
                    tg.create_task(self._broker_loop()),
                    tg.create_task(self._repl_loop()),
                    tg.create_task(self._heartbeat_loop()),
                    tg.create_task(self.notifier.watchdog_loop()),
                ]
                await self._stop.wait()
                self.notifier.stopping("handing over and writing a checkpoint")
                self.notifier.extend_timeout(60)
                tasks[2].cancel()  # no more heartbeats: the broker must not re-admit us
                await self._leave()
                for t in tasks:
                    t.cancel()
        finally:
            self.metrics.stop()
            if auth is not None:
                auth.stop()
            for sock in (self._sock, self._repl, self._upstream):
                if sock is not None:
                    transport.close(sock)
            transport.term(self._ctx)
            log.info("shard %s stopped", self.node_id)

    async def _leave(self) -> None:
        """Graceful stop: hand over, refuse further work, write a last checkpoint."""
        self._leaving = True  # from now on, assignments from the broker are ignored
        whole = self._whole()
        await self._to_broker(MsgType.BYE, {})  # the broker promotes a replica now
        if self.role is Role.PRIMARY:
            self._step_down()
        self._stop_following()
        self.role = Role.SPARE
        self.core.primary = False
        if whole:
            await self._checkpoint(final=True)

    def _whole(self) -> bool:
        """Whether this shard's state is a whole partition (worth a checkpoint)."""
        return self.role is Role.PRIMARY or (self.role is Role.REPLICA and self._synced)

    def _restore(self) -> None:
        """Load the newest usable checkpoint, to claim its partition when registering."""
        if self._checkpoints is None:
            return
        found = self._checkpoints.latest()
        if found is None:
            log.info("no checkpoint in %s: starting empty", self.config.data_dir)
            return
        snap = found.snapshot
        self.core.load_snapshot(snap)
        self.core.primary = False  # until the broker says so
        self._restored = True
        self._last_checkpoint = (time.monotonic(), snap.lsn)
        log.info(
            "restored partition %d at epoch %d, LSN %d from %s",
            snap.partition,
            snap.epoch,
            snap.lsn,
            found.path,
        )

    async def _checkpoint(self, *, final: bool = False) -> None:
        store, core = self._checkpoints, self.core
        if store is None or core.partition is None or core.lsn == 0:
            return
        if core.lsn == self._last_checkpoint[1] and not (final and self._restored):
            return
        if not final and not self._whole():
            return  # only a primary's state, or a replica's that follows it, is whole
        snap = core.snapshot()
        self._last_checkpoint = (time.monotonic(), snap.lsn)
        t0 = time.monotonic()
        try:
            path = await asyncio.to_thread(store.write, snap)
        except OSError as e:
            log.error(
                "checkpoint of partition %d at LSN %d failed: %s", snap.partition, snap.lsn, e
            )
            return
        self.checkpoints_written += 1
        log.info(
            "checkpoint of partition %d at LSN %d written to %s in %.2fs",
            snap.partition,
            snap.lsn,
            path,
            time.monotonic() - t0,
        )

    def _collect(self) -> Iterable[Metric]:
        s, core = self.core.stats, self.core
        yield counter("zps_shard_requests", "Request messages handled", s.requests)
        yield labelled(
            CounterMetricFamily,
            "zps_shard_ops",
            "Operations by kind",
            "op",
            {k: float(v) for k, v in s.by_op.items()},
        )
        yield counter("zps_shard_errors", "Operations answered with an error", s.errors)
        yield counter(
            "zps_shard_duplicates", "Re-sent messages answered from the dedup record", s.duplicates
        )
        yield counter("zps_shard_malformed", "Malformed messages dropped or refused", s.malformed)
        yield counter("zps_shard_bytes_in", "Payload bytes received", s.bytes_in)
        yield gauge("zps_shard_lsn", "Log sequence number of the partition", core.lsn)
        yield gauge("zps_shard_bytes", "Memory held by the partition's tables", core.store.nbytes)
        yield labelled(
            GaugeMetricFamily,
            "zps_shard_role",
            "1 for the current role",
            "role",
            {r.value: float(r is self.role) for r in Role},
        )
        yield counter("zps_shard_checkpoints", "Checkpoints written", self.checkpoints_written)
        lag = GaugeMetricFamily(
            "zps_replication_lag", "This primary's LSN minus the replica's", labels=["replica"]
        )
        for node, follower in self._followers.items():
            lag.add_metric([node], max(0, core.lsn - follower.acked))
        yield lag

    def _checkpoint_due(self, now: float) -> bool:
        c = self.config.checkpoint
        at, lsn = self._last_checkpoint
        return (c.interval_s > 0 and now - at >= c.interval_s) or (
            c.every_updates > 0 and self.core.lsn - lsn >= c.every_updates
        )

    # -- broker link ---------------------------------------------------------

    async def _to_broker(self, mtype: MsgType, header: dict[str, Any]) -> None:
        """Best effort, never blocking: control messages are repeated or asked for
        again, and a broker link that is down (or refused us) must not hang the
        shard, not even its shutdown."""
        assert self._sock is not None
        if not transport.try_send(self._sock, [b"", *encode(Route(mtype), header)]):
            log.debug("dropped a %s to the broker: its queue is full", mtype.name)

    async def _register(self) -> None:
        claim = None
        if self._restored and self.role is Role.SPARE and self.core.partition is not None:
            claim = {
                "partition": self.core.partition,
                "epoch": self.core.epoch,
                "role": Role.PRIMARY.value,
                "lsn": self.core.lsn,
                "in_sync": False,
            }
        elif self.role is not Role.SPARE and self.core.partition is not None:
            claim = {
                "partition": self.core.partition,
                "epoch": self.core.epoch,
                "role": self.role.value,
                "lsn": self.core.lsn,
                "in_sync": self._in_sync_published,
            }
        await self._to_broker(
            MsgType.REGISTER,
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "address": self.address,
                "claim": claim,
                "lsn": self.core.lsn,
                "public_key": self._keys.public.decode() if self._keys else None,
            },
        )

    async def _heartbeat(self) -> None:
        header: dict[str, Any] = {
            "t": time.monotonic(),
            "lsn": self.core.lsn,
            "epoch": self.core.epoch,
            "stats": self.core.report(),
        }
        if self.role is Role.PRIMARY:
            header["in_sync"] = sorted(self._local_in_sync)
        await self._to_broker(MsgType.HEARTBEAT, header)

    def _lease_valid(self, now: float) -> bool:
        return now - self._lease_start < self.lease

    async def _heartbeat_loop(self) -> None:
        hb = self.config.heartbeat
        handled = self.core.stats.requests
        while True:
            await asyncio.sleep(hb.interval)
            await self._heartbeat()
            if self.core.stats.requests != handled:
                handled, self._trim_due = self.core.stats.requests, True
            elif self._trim_due:  # a quiet interval after traffic: give freed buffers back
                self._trim_due = False
                malloc.trim()
            now = time.monotonic()
            silent = now - self._last_broker
            if silent > hb.interval * hb.liveness and not self._broker_lost:
                self._broker_lost = True
                log.warning(
                    "no word from the broker for %.1fs; %s",
                    silent,
                    "refusing writes until it answers"
                    if self.role is Role.PRIMARY
                    else "waiting for it",
                )
            if self.role is Role.PRIMARY:
                await self._drop_lagging(now)
            if self._checkpoints is not None and self._checkpoint_due(now):
                await self._checkpoint()
            elif self.role is Role.REPLICA and self._upstream is not None:
                await self._ack_upstream()

    async def _on_broker(self, route: Route, header: dict[str, Any]) -> None:
        match route.mtype:
            case MsgType.ASSIGN if not self._leaving:
                await self._assign(header)
            case MsgType.MAP:
                self._on_map(ClusterMap.from_wire(header.get("map")))
            case MsgType.HEARTBEAT:
                t = header.get("t")
                if (
                    isinstance(t, float)
                    and header.get("role") == self.role.value
                    and header.get("partition") == self.core.partition
                    and header.get("epoch") == self.core.epoch
                ):
                    self._lease_start = max(self._lease_start, t)
            case MsgType.REGISTER if not self._leaving:  # the broker restarted
                await self._register()
            case _:
                log.warning("unexpected %s from the broker", route.mtype.name)

    async def _assign(self, h: dict[str, Any]) -> None:
        role = Role(h["role"])
        partition, epoch = h.get("partition"), int(h.get("epoch", 0))
        if partition is not None and type(partition) is not int:
            raise ProtocolError("ASSIGN partition must be an integer")
        was = (self.role, self.core.partition, self.core.epoch)
        address = str(h.get("primary_address") or "")
        if was == (role, partition, epoch) and (
            role is not Role.REPLICA or (self._following or ("",))[0] == address
        ):
            return  # nothing changed (the broker repeats itself after a restart)
        log.info(
            "assigned: %s of partition %s at epoch %d (was %s of %s at %d)",
            role.value,
            partition,
            epoch,
            was[0].value,
            was[1],
            was[2],
        )
        if self.role is Role.PRIMARY and (role, partition, epoch) != was:
            self._step_down()
        self.role = role
        match role:
            case Role.PRIMARY:
                self._stop_following()
                self.core.assign(partition, epoch, primary=True)
                # A lease comes only from the broker's answer to a heartbeat
                # sent from now on; ask for one at once.
                await self._heartbeat()
            case Role.REPLICA:
                self.core.assign(partition, epoch, primary=False)
                address = str(h.get("primary_address") or "")
                key = h.get("primary_key")
                if address and self._following != (address, epoch):
                    await self._follow(address, epoch, key.encode() if key else None)
            case Role.SPARE:
                self._stop_following()
                self.core.assign(None, 0)
        self.assigned.set()

    def _step_down(self) -> None:
        """Stop being primary: writes still waiting for replicas get NOT_PRIMARY."""
        waiting = self._tracker.take_all()
        self._tracker = AckTracker()
        self._followers.clear()
        self._local_in_sync.clear()
        self._published_in_sync.clear()
        self._lease_start = -1e9
        for client, frames in waiting:
            route = unpack_route(frames[0])
            refusal = encode(
                Route(MsgType.REPLY, route.partition, route.epoch, route.req_id),
                {"st": "NOT_PRIMARY", "msg": "the primary stepped down"},
            )
            self._post([client, *refusal])
        if waiting:
            log.warning(
                "stepped down with %d writes unacknowledged; clients will retry", len(waiting)
            )

    def _on_map(self, cmap: ClusterMap) -> None:
        p = self.core.partition
        info = cmap.partitions.get(p) if p is not None else None
        if info is None:
            return
        published = set(info.in_sync)
        self._in_sync_published = self.node_id in published
        self._replicas = set(info.replicas)
        # Followers are checked when they subscribe; a replica missing from one
        # map (a restarted broker rebuilding it) keeps its stream, and a dead one
        # leaves the in-sync set through the broker.
        if self.role is Role.PRIMARY and info.epoch == self.core.epoch:
            # The broker dropped these (dead, or reported lagging): stop waiting.
            self._local_in_sync -= self._published_in_sync - published
            self._published_in_sync = published
            self._release(self._tracker.set_required(published | self._local_in_sync))

    # -- requests ------------------------------------------------------------

    async def _broker_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                burst = await transport.recv_burst(self._sock)
            except ClosedError:
                return
            self._last_broker = time.monotonic()
            if self._broker_lost:
                self._broker_lost = False
                log.info("the broker answers again")
            for frames in burst:
                if len(frames) < 3:
                    self.core.stats.malformed += 1
                    continue
                source = transport.frame_bytes(frames[0])
                try:
                    route = unpack_route(transport.frame_buffer(frames[1]))
                    if not source:
                        msg = decode([transport.frame_buffer(f) for f in frames[1:]])
                        await self._on_broker(route, msg.header)
                        continue
                except (ProtocolError, KeyError, ValueError, TypeError, OverflowError) as e:
                    self.core.stats.malformed += 1
                    log.warning(
                        "dropped a bad message (%s): %s", "control" if not source else "request", e
                    )
                    continue
                await self._request(source, route, frames[1:])

    async def _request(self, source: bytes, route: Route, frames: list[Any]) -> None:
        assert self._sock is not None
        bufs = [transport.frame_buffer(f) for f in frames]
        reply_route = Route(MsgType.REPLY, route.partition, self.core.epoch, route.req_id)
        try:
            msg = decode(bufs)
        except ProtocolError as e:
            self.core.stats.malformed += 1
            await transport.send(
                self._sock, [source, *encode(reply_route, {"st": "BAD_REQUEST", "msg": str(e)})]
            )
            return
        if route.mtype is not MsgType.REQUEST:
            self.core.stats.malformed += 1
            await transport.send(
                self._sock,
                [
                    source,
                    *encode(
                        reply_route,
                        {
                            "st": "BAD_REQUEST",
                            "msg": f"a shard serves REQUEST, not {route.mtype.name}",
                        },
                    ),
                ],
            )
            return
        if self.role is Role.PRIMARY and not self._lease_valid(time.monotonic()):
            await transport.send(
                self._sock,
                [
                    source,
                    *encode(
                        reply_route,
                        {
                            "st": "NOT_PRIMARY",
                            "msg": "the primary's lease from the broker has run out",
                        },
                    ),
                ],
            )
            return
        prev = self.core.lsn
        t0 = time.perf_counter()
        reply, changed = self.core.handle_request(route, msg.header, msg.payloads)
        self._latency["write" if changed else "read"].observe(time.perf_counter() - t0)
        if not changed:
            await transport.send(self._sock, [source, *reply])
            return
        await self._replicate(prev, frames)
        if msg.header.get("acks") == 1:
            await transport.send(self._sock, [source, *reply])
        else:
            self._release(self._tracker.add(self.core.lsn, (source, reply)))

    def _release(self, replies: list[Reply]) -> None:
        for client, frames in replies:
            self._post([client, *frames])

    def _post(self, frames: list[Any]) -> None:
        assert self._sock is not None
        if not self._sock.closed:
            self._sock.post(frames)

    # -- primary side of replication -----------------------------------------

    async def _replicate(self, prev: int, frames: list[Any]) -> None:
        """Stream the request (header and payload frames as received) to replicas."""
        if not self._followers:
            return
        assert self._repl is not None
        route = Route(MsgType.REPLICATE, self.core.partition or 0, self.core.epoch, 0)
        head = msgpack.packb({"prev": prev, "lsn": self.core.lsn})
        for node in list(self._followers):
            ok = await transport.send(self._repl, [node.encode(), route.pack(), head, *frames[1:]])
            if not ok:
                self._drop_follower(node, "its connection is gone")

    def _drop_follower(self, node: str, why: str) -> None:
        if self._followers.pop(node, None) is not None:
            log.warning("stopped streaming to replica %s: %s", node, why)
            if self._repl is not None:  # so it subscribes again, if it still can
                transport.try_send(
                    self._repl,
                    [node.encode(), *encode(Route(MsgType.BYE), {"msg": f"stream stopped: {why}"})],
                )
        self._local_in_sync.discard(node)

    async def _repl_loop(self) -> None:
        assert self._repl is not None
        while True:
            try:
                burst = await transport.recv_burst(self._repl)
            except ClosedError:
                return
            now = time.monotonic()
            for frames in burst:
                try:
                    node = transport.frame_bytes(frames[0]).decode()
                    msg = decode([transport.frame_buffer(f) for f in frames[1:]])
                    match msg.route.mtype:
                        case MsgType.SUBSCRIBE:
                            await self._subscribe(node, msg.header, now)
                        case MsgType.ACK:
                            await self._on_ack(node, msg.header, now)
                        case _:
                            raise ProtocolError(f"unexpected {msg.route.mtype.name}")
                except (ProtocolError, UnicodeDecodeError, ValueError, TypeError) as e:
                    self.core.stats.malformed += 1
                    log.warning("dropped a bad replication message: %s", e)

    async def _subscribe(self, node: str, h: dict[str, Any], now: float) -> None:
        assert self._repl is not None
        if (
            self.role is not Role.PRIMARY
            or h.get("partition") != self.core.partition
            or h.get("epoch") != self.core.epoch
            or node not in self._replicas  # only whom the broker made a replica here
        ):
            await transport.send(
                self._repl,
                [
                    node.encode(),
                    *encode(
                        Route(MsgType.BYE),
                        {
                            "msg": f"not the primary of partition {h.get('partition')} at epoch "
                            f"{h.get('epoch')}"
                        },
                    ),
                ],
            )
            return
        snap = self.core.snapshot()
        enc = Encoder()
        header = encode_snapshot(enc, snap)
        route = Route(MsgType.SNAPSHOT, snap.partition, snap.epoch, snap.lsn)
        self._local_in_sync.discard(node)
        self._followers[node] = Follower(snapshot_lsn=snap.lsn, last_heard=now)
        await transport.send(self._repl, [node.encode(), *enc.build(route, header)])
        log.info(
            "replica %s subscribed: snapshot at LSN %d (%d tables)",
            node,
            snap.lsn,
            len(snap.export["specs"]),
        )

    async def _on_ack(self, node: str, h: dict[str, Any], now: float) -> None:
        follower = self._followers.get(node)
        lsn = h.get("lsn")
        if follower is None or type(lsn) is not int or h.get("epoch") != self.core.epoch:
            return
        follower.acked = max(follower.acked, lsn)
        follower.last_heard = now
        if node not in self._local_in_sync and follower.acked >= follower.snapshot_lsn:
            # Caught up: it holds the snapshot and receives every message since.
            self._local_in_sync.add(node)
            self._tracker.require(node, follower.acked)
            log.info("replica %s is in sync at LSN %d", node, follower.acked)
            await self._heartbeat()  # tell the broker now, not at the next beat
        self._release(self._tracker.ack(node, lsn))

    async def _drop_lagging(self, now: float) -> None:
        """A required replica silent for the liveness timeout stops holding writes back."""
        if not len(self._tracker):
            return
        hb = self.config.heartbeat
        for node in list(self._local_in_sync):
            follower = self._followers.get(node)
            if follower is None or now - follower.last_heard > hb.interval * hb.liveness:
                log.warning("replica %s stopped acknowledging; reporting it out of sync", node)
                self._local_in_sync.discard(node)
        # The broker publishes the smaller set; _on_map then releases the writes.

    # -- replica side --------------------------------------------------------

    async def _follow(self, address: str, epoch: int, primary_key: bytes | None) -> None:
        self._stop_following()
        assert self._ctx is not None and self._tg is not None
        self._upstream = transport.dealer(
            self._ctx,
            address,
            self.node_id.encode(),
            max_message_bytes=self.config.max_message_bytes,
            curve=self._keys,
            server_public=primary_key,
        )
        self._following = (address, epoch)
        self._upstream_task = self._tg.create_task(self._upstream_loop(self._upstream))
        log.info("following the primary at %s (epoch %d)", address, epoch)

    def _stop_following(self) -> None:
        self._synced = False
        if self._upstream_task is not None:
            self._upstream_task.cancel()
            self._upstream_task = None
        if self._upstream is not None:
            transport.close(self._upstream)
            self._upstream = None
        self._following = None

    async def _ack_upstream(self) -> None:
        if self._upstream is not None:
            await transport.send(
                self._upstream,
                encode(Route(MsgType.ACK), {"lsn": self.core.lsn, "epoch": self.core.epoch}),
            )

    async def _upstream_loop(self, sock: transport.Channel) -> None:
        """Subscribe to the primary, load its snapshot, then apply its stream."""
        hb = self.config.heartbeat
        self._synced = False
        asked = 0.0
        while True:
            if not self._synced and time.monotonic() - asked > hb.interval * 2:
                # (Again) ask: the primary may not have known its role yet.
                await transport.send(
                    sock,
                    encode(
                        Route(MsgType.SUBSCRIBE),
                        {"partition": self.core.partition, "epoch": self.core.epoch},
                    ),
                )
                asked = time.monotonic()
            try:
                burst = await transport.recv_burst(sock, timeout=hb.interval)
            except (ClosedError, BrokenError):
                return
            for frames in burst:
                try:
                    msg = decode([transport.frame_buffer(f) for f in frames])
                    match msg.route.mtype:
                        case MsgType.SNAPSHOT:
                            self._synced = self._load_snapshot(msg.header, msg.payloads)
                        case MsgType.REPLICATE if self._synced:
                            self._apply_stream(msg.route, msg.header, msg.payloads)
                        case MsgType.BYE:
                            self._synced = False
                            log.info(
                                "the primary refused the subscription: %s", msg.header.get("msg")
                            )
                except (ProtocolError, ZpsError) as e:
                    log.warning("bad message from the primary: %s; resync", e)
                    self._resync = True
                if self._resync:
                    self._resync, self._synced, asked = False, False, 0.0
            if self._synced and burst:
                await self._ack_upstream()

    def _load_snapshot(self, header: dict[str, Any], payloads: Any) -> bool:
        snap = decode_snapshot(header, payloads, max_bytes=self.config.max_message_bytes)
        if snap.epoch != self.core.epoch or snap.partition != self.core.partition:
            return False
        self.core.load_snapshot(snap)
        log.info("loaded a snapshot of partition %d at LSN %d", snap.partition, snap.lsn)
        return True

    def _apply_stream(self, route: Route, head: dict[str, Any], payloads: Any) -> None:
        prev, lsn = head.get("prev"), head.get("lsn")
        if type(prev) is not int or type(lsn) is not int or not payloads:
            raise ProtocolError("replication header needs integer prev and lsn")
        verdict = check_stream(
            my_epoch=self.core.epoch,
            my_lsn=self.core.lsn,
            epoch=route.epoch,
            prev_lsn=prev,
            lsn=lsn,
        )
        if verdict is StreamCheck.DUPLICATE:
            return
        if verdict is StreamCheck.RESYNC:
            log.warning(
                "replication stream gap (at LSN %d, got %d..%d, epoch %d): resync",
                self.core.lsn,
                prev,
                lsn,
                route.epoch,
            )
            self._resync = True
            return
        try:
            header = decode([Route(MsgType.REQUEST).pack(), payloads[0]]).header
            got = self.core.apply_replicated(header, payloads[1:])
        except (ZpsError, KeyError, ValueError) as e:
            log.error("could not apply LSN %d from the primary: %s; resync", lsn, e)
            self._resync = True
            return
        if got != lsn:
            log.error("replica diverged: LSN %d after applying, primary had %d; resync", got, lsn)
            self._resync = True
