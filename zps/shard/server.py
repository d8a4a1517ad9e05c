"""The shard process: serves one partition as primary or replica.

Its parts, each a module of one job:

* :mod:`zps.shard.links`: the links to the broker (or the broker pair, and its fencing):
  registration, control messages, requests and replies, and the liveness links.
* :mod:`zps.shard.routers`: the links to the routing brokers of the map.
* :mod:`zps.shard.pipeline`: a client's request from its frames to its reply, carrying
  out :mod:`zps.shard.admission`'s rules.
* :mod:`zps.shard.primary`: when primary, the stream its replicas subscribe to at its
  own ROUTER (``replication_bind``); :mod:`zps.shard.replica`: when replica, the
  subscription to its primary.
* :mod:`zps.shard.checkpointing`: checkpoints restored and written, the log started.
* :mod:`zps.shard.metrics`: ``/metrics`` and ``/ready``.

This module is the process: its lifecycle (start, serve, graceful stop), the heartbeat
loop, and what the broker assigns; it owns the sockets' context, the tasks and the clock,
and does what :class:`~zps.shard.session.ShardSession` (role, replication, lease,
housekeeping) decides.  A primary answers a write once every replica it requires has
applied it (``acks=all``; see :mod:`zps.core.replication`), and accepts requests only
while its lease from the broker runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from typing import Any, assert_never
from urllib.parse import urlsplit

import numpy as np
import zmq.asyncio

from zps import shm, transport
from zps.core.routing import ClusterMap
from zps.ops import malloc
from zps.ops.config import ShardConfig
from zps.ops.datadir import lock_data_dir
from zps.ops.metrics import LatencyHistogram, MetricsServer
from zps.ops.security import load_curve_keys, load_key_roles, warn_if_exposed
from zps.ops.systemd import Notifier
from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import (
    Assign,
    Bye,
    Heartbeat,
    LeaseEcho,
    MapUpdate,
    RegisterAgain,
    Role,
    ShardClaim,
    ShardHeartbeat,
    ShardRegister,
    Status,
)
from zps.shard import admission, metrics
from zps.shard.checkpoint import CheckpointStore
from zps.shard.checkpointing import Checkpointer
from zps.shard.core import Limits, ShardCore
from zps.shard.durability import Durability, LogLost
from zps.shard.links import BrokerLinks, dealer_link, from_broker
from zps.shard.liveness import Liveness
from zps.shard.metrics import SHM_RECLAIM_S, CheckpointStats
from zps.shard.pipeline import RequestPipeline
from zps.shard.primary import REPLICATION_HWM, ReplicationStream, Reply
from zps.shard.replica import Upstream
from zps.shard.routers import RouterLinks
from zps.shard.session import MapResult, ShardSession
from zps.shard.slotops import SlotState
from zps.transport import CurveKeys
from zps.version import __version__

__all__ = ["LEND_MIN_BYTES", "SHM_RECLAIM_S", "ShardServer", "shard_node_id"]

log = logging.getLogger("zps.shard")

#: Dense chunks of this size and more keep their values in the shard's arena, lent to
#: pulls rather than copied (within a quarter of ``shard.shm_bytes``); smaller ones
#: (small tensors, a tensor's last chunk) stay on the heap and leave that room to the
#: large chunks, whose copy is what lending saves.
LEND_MIN_BYTES = 1 << 20


def release_later(store: object) -> None:
    """Let go of ``store`` (a partition's store, or None) on a thread of its own.

    Rule: the memory of a partition the shard no longer holds is released off the
    loop.  Unmapping GBs of table memory takes time in proportion to it (0.5 s and more
    for 3 GB), during which the loop would read no request and post no heartbeat.  The
    thread starts on the loop's next turn, once the caller's own references are gone, so
    that it drops the last one."""
    if store is None:
        return
    box = [store]
    del store
    thread = threading.Thread(target=box.clear, name="zps-release", daemon=True)
    asyncio.get_running_loop().call_soon(thread.start)


def shard_node_id(config: ShardConfig, *, hostname: str, pid: int) -> str:
    """``s-NAME``: the configured name, else the host and the data dir (its name and a
    short hash of its whole path, so two dirs of one name differ), else the host and
    the pid.  Stable across restarts with a data dir: status, logs and metrics keep
    naming the same shard."""
    if config.name:
        return f"s-{config.name}"
    host = (config.host or hostname).split(".")[0]
    if config.data_dir:
        path = os.path.abspath(config.data_dir)
        digest = hashlib.blake2s(path.encode(), digest_size=2).hexdigest()
        tail = f"{os.path.basename(path.rstrip(os.sep)) or 'data'}-{digest}"
    else:
        tail = str(pid)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{host}-{tail}").strip("-._")
    return f"s-{name[-60:]}"


class ShardServer:
    """One shard process: :meth:`run` serves until :meth:`stop`."""

    def __init__(
        self, config: ShardConfig, *, node_id: str | None = None, notifier: Notifier | None = None
    ) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        self.metrics = MetricsServer(
            config.metrics, lambda: metrics.collect(self), ready=lambda: metrics.ready(self)
        )
        self.node_id = node_id or shard_node_id(
            config, hostname=socket.gethostname(), pid=os.getpid()
        )
        #: This process, as opposed to an earlier one of the same name.
        self.incarnation = uuid.uuid4().hex[:12]
        self.core = ShardCore(limits=Limits(**dataclasses.asdict(config.limits)))
        hb, ckpt = config.heartbeat, config.checkpoint
        self.session: ShardSession[Reply] = ShardSession(
            self.node_id,
            heartbeat_interval=hb.interval,
            liveness=hb.liveness,
            checkpoint_interval_s=ckpt.interval_s,
            checkpoint_every_updates=ckpt.every_updates,
            checkpoints=bool(config.data_dir),
            min_in_sync=config.replication.min_in_sync,
            repair=config.replication.write_while_repairing
            and bool(config.data_dir)
            and config.durability != "none",
            now=time.monotonic(),
        )
        self.address = ""
        self.assigned = asyncio.Event()
        #: The broker accepted the registration (it answered with an assignment).
        self.registered = False
        self._stop = asyncio.Event()
        self._ctx: zmq.asyncio.Context | None = None
        self._keys: CurveKeys | None = None
        self._tg: asyncio.TaskGroup | None = None
        self.durability = Durability(
            config.durability if config.data_dir else "none",
            interval=config.durability_interval,
            segment_bytes=config.wal_segment_bytes,
        )
        #: Why this copy's write-ahead log was lost (it then leaves and exits), or None.
        self._log_lost: str | None = None
        self.durability.on_lost = self._on_log_lost
        self.checkpoints = Checkpointer(
            self.core,
            self.session,
            self.durability,
            CheckpointStore(config.data_dir, ckpt.keep) if config.data_dir else None,
            data_dir=config.data_dir,
        )
        self.core.checkpoint_enabled = self.checkpoints.store is not None
        #: Same-host shared memory for large frames (zps.shm); None when off.
        self._shm = shm.SharedMemory.create(
            config.shm_bytes,
            "shard",
            reclaim_after=SHM_RECLAIM_S,
            max_frame_bytes=config.max_message_bytes,
            # A reply lending a chunk may wait for the replicas (up to their stall
            # timeout) before it is sent: its loan must outlast that wait.
            loan_after=SHM_RECLAIM_S + 2 * config.heartbeat.interval * config.heartbeat.liveness,
        )
        if self._shm is not None:
            # Large dense chunks live in the arena: a pull's reply lends them (named,
            # not copied) and a push meanwhile updates a copy (DenseTensor.push).
            self.core.dense_memory = self._dense_memory
        self.links = BrokerLinks(
            config,
            self.node_id,
            lease=lambda: self.session.lease,
            epoch=lambda: self.core.epoch,
            on_control=self._on_broker,
            on_request=self._on_broker_request,
            on_seen=self._broker_seen,
            count_malformed=self._count_malformed,
        )
        self.requests = RequestPipeline(
            self.core,
            self.session,
            self.durability,
            # CURVE roles (a request's dedup id must be its sender's) are set in _run.
            policy=admission.Policy(
                self.node_id, False, config.reply_queue_bytes, config.max_message_bytes
            ),
            hold_s=config.ack_hold_s,
            post=self.links.post,
            shared=self._shm,
        )
        self.requests.held_bytes = self.links.held_bytes
        self.routers = RouterLinks(
            connect=self._router_link,
            start=self._start_task,
            via=self.links.via,
            on_request=self.requests.request,
            malformed=self.links.malformed,
            refuse=self.requests.count,
            policy=lambda: self.requests.policy,
            epoch=lambda: self.core.epoch,
        )
        self._stream: ReplicationStream | None = None
        self._upstream: Upstream | None = None
        self._upstream_task: asyncio.Task[None] | None = None

    @property
    def role(self) -> Role:
        return self.session.role

    @property
    def lease(self) -> float:
        return self.session.lease

    def stop(self) -> None:
        self._stop.set()

    # -- what the metrics read (zps.shard.metrics.Observed) --------------------------

    @property
    def broker(self) -> str:
        return ", ".join(self.config.endpoints)

    @property
    def stream(self) -> ReplicationStream | None:
        return self._stream

    @property
    def shared(self) -> shm.SharedMemory | None:
        return self._shm

    @property
    def beat_policy(self) -> Liveness | None:
        return self.links.beat_policy

    @property
    def latency(self) -> dict[str, LatencyHistogram]:
        return self.requests.latency

    @property
    def overloaded(self) -> int:
        """Requests refused OVERLOADED: the replies held for a link filled their bound."""
        return self.requests.overloaded

    @property
    def checkpoint_stats(self) -> CheckpointStats:
        return self.checkpoints.stats

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- lifecycle -----------------------------------------------------------

    async def run(self) -> None:
        """Serve until :meth:`stop`; sockets are closed on the way out."""
        # Before anything is read from it: a second process on this data dir is refused.
        lock = lock_data_dir(self.config.data_dir, self.node_id) if self.config.data_dir else None
        try:
            self.metrics.start()  # a port in use is an error before anything is bound
            try:
                await self._run()
            finally:
                self.metrics.stop()
        finally:
            if lock is not None:
                lock.release()
        if self._log_lost is not None:
            raise LogLost(
                f"stopped: the write-ahead log was lost ({self._log_lost}); start the "
                "shard again to restore its partition and resync from its replicas"
            )

    def _on_log_lost(self, why: str) -> None:
        """The log may not hold what this copy wrote (a failed sync): it acknowledges
        nothing more (the log releases nothing), hands its role over as at a graceful
        stop (a replica takes the partition; a final checkpoint of the state in memory
        is written if the disk takes it) and exits with status 1, for its service
        manager to start it again."""
        self._log_lost = why
        log.error(
            "partition %s: this copy's write-ahead log is lost (%s): it acknowledges "
            "nothing more, leaves its role to the replicas and exits with status 1",
            self.core.partition, why,
        )  # fmt: skip
        self.stop()

    async def _run(self) -> None:
        cfg = self.config
        self.checkpoints.restore()
        self._ctx = transport.new_context()
        keys = self._keys = load_curve_keys(cfg.security)
        roles = load_key_roles(cfg.security)
        self.requests.policy = dataclasses.replace(self.requests.policy, roles=roles is not None)
        # With roles only shards may reach the replication endpoint.
        auth = (
            transport.start_authenticator(
                self._ctx, keys.allowed_dir, keys=roles.shards if roles else None
            )
            if keys
            else None
        )
        repl, bound = transport.router(
            self._ctx,
            cfg.replication_bind,
            max_message_bytes=cfg.max_message_bytes,
            hwm=REPLICATION_HWM,
            curve=keys,
        )
        warn_if_exposed(cfg.replication_bind, cfg.security, "the replication endpoint")
        hb = cfg.heartbeat
        self._stream = ReplicationStream(
            self.session,
            self.core,
            repl,
            release=self.requests.release,
            settle=self._settle,
            report=self._report,
            queue_bytes=cfg.replication.follower_queue_bytes,
            stall_timeout=2 * hb.interval * hb.liveness,
            shared=self._shm,
        )
        self.requests.replicator = self._stream
        port = urlsplit(bound).port
        brokers = cfg.endpoints
        self.address = f"tcp://{cfg.advertise_host or transport.local_address(brokers[0])}:{port}"
        self.links.open(self._ctx, keys)
        log.info(
            "shard %s (pid %d) connecting to %s; replication at %s",
            self.node_id,
            os.getpid(),
            ", ".join(brokers),
            self.address,
        )
        try:
            self._register()
            self.notifier.status(f"registering with {', '.join(brokers)}")
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self.checkpoints.spawn_with(tg.create_task)
                beats = tg.create_task(self._heartbeat_loop())
                tasks = [
                    beats,
                    tg.create_task(self._stream.serve()),
                    tg.create_task(self.notifier.watchdog_loop()),
                    tg.create_task(self.durability.run()),
                    tg.create_task(self.metrics.loop_heartbeat()),
                    *self.links.serve(tg),
                ]
                await self._stop.wait()
                self.notifier.stopping("handing over and writing a checkpoint")
                self.notifier.extend_timeout(60)
                beats.cancel()  # no more heartbeats: the broker must not re-admit us
                self.links.stop_liveness()
                await self._leave()
                for t in tasks:
                    t.cancel()
                self.routers.cancel()  # made as routers came
        finally:
            self.links.close()
            self.routers.close()
            if auth is not None:
                auth.stop()
            self._close_upstream()
            transport.close(repl)
            transport.term(self._ctx)
            log.info("shard %s stopped", self.node_id)

    def _start_task(self, coro: Any) -> asyncio.Task[None]:
        assert self._tg is not None
        return self._tg.create_task(coro)

    async def _leave(self) -> None:
        """Graceful stop: hand over, refuse further work, write a last checkpoint."""
        whole = self.session.begin_leave()  # from now on, assignments are ignored
        self.links.send(MsgType.BYE, Bye().to_wire())  # the broker promotes a replica now
        self.requests.refuse(self.session.left())
        self._close_upstream()
        self.core.primary = False
        if whole:
            await self.checkpoints.finish()  # let a periodic one finish first
            await self.checkpoints.write(final=True)
            self.checkpoints.mark_final()
        elif self.session.unchanged_since_restore(self.core.lsn, self.core.epoch):
            self.checkpoints.mark_final()  # restored whole, never changed: its checkpoint still is

    # -- the broker ----------------------------------------------------------

    def _register(self, refused: tuple[int, int] | None = None) -> None:
        claim = self.session.claim(self.core.lsn)
        slots = self.core.slots
        if claim is not None and slots is not None and claim["partition"] == self.core.partition:
            # The slots it serves: a broker without its record learns the slot map from them.
            claim["slots"] = np.packbits(slots.owned).tobytes()
            claim["slot_version"] = slots.version
            for key, mask in (("fenced", slots.fenced), ("importing", slots.importing)):
                if mask.any():  # a move under way: a broker without its record cancels it
                    claim[key] = np.packbits(mask).tobytes()
        register = ShardRegister(
            host=self.config.host or socket.gethostname(),
            pid=os.getpid(),
            address=self.address,
            claim=None if claim is None else ShardClaim.parse(claim),
            lsn=self.core.lsn,
            public_key=self._keys.public.decode() if self._keys else None,
            version=__version__,
            incarnation=self.incarnation,
            zone=self.config.zone,
            refused=refused,
        )
        self.links.send(MsgType.REGISTER, register.to_wire())

    def _report(self) -> None:
        """A heartbeat now (a primary's carries its in-sync set); never waits."""
        fields = self.session.heartbeat_fields(time.monotonic())
        in_sync = fields.get("in_sync")
        beat = ShardHeartbeat(
            t=fields["t"],
            lsn=self.core.lsn,
            epoch=fields["epoch"],
            stats=self.core.report(),
            in_sync=None if in_sync is None else tuple(in_sync),
            durable=min(self.durability.durable, self.core.lsn) if self.durability.waits else None,
        )
        frames = [b"", *encode(Route(MsgType.HEARTBEAT), self.links.with_term(beat.to_wire()))]
        self.links.beat(frames)
        self.routers.beat(frames)  # each router judges its link to this shard by them

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat.interval)
            self._report()
            tick = self.session.tick(
                time.monotonic(), requests=self.core.stats.requests, lsn=self.core.lsn
            )
            if tick.trim:  # a quiet interval after traffic: give freed buffers back
                malloc.trim()
                if self._shm is not None:
                    self._shm.trim()
            if self._shm is not None:  # unmap the memory of clients that are gone
                self._shm.housekeeping()
            if tick.broker_lost_for is not None:
                log.warning(
                    "no word from the broker for %.1fs; %s%s",
                    tick.broker_lost_for,
                    "refusing writes until it answers"
                    if self.role is Role.PRIMARY
                    else "waiting for it",
                    ""
                    if self.registered or not self.config.security.enabled
                    else " (never admitted: under CURVE the broker drops a shard whose key "
                    "is not in its allowed_shards_dir, and logs why)",
                )
            if tick.lagging and self._stream is not None:
                for node in tick.lagging:
                    self._stream.drop(node, "no acknowledgement for a liveness timeout")
            if self._stream is not None:
                self._stream.expire_shared(time.monotonic())
            if self.core.checkpoint_wanted is not None and not tick.checkpoint:
                self.checkpoints.start()  # an operator's "zps-server checkpoint"
            if tick.checkpoint:
                self.checkpoints.start()
            elif tick.ack_upstream and self._upstream is not None:
                await self._upstream.ack()

    def _broker_seen(self) -> None:
        if self.session.broker_seen(time.monotonic()):
            log.info("the broker answers again")

    def _count_malformed(self) -> None:
        self.core.stats.malformed += 1

    async def _on_broker(self, route: Route, header: dict[str, Any]) -> None:
        match from_broker(route.mtype, header):
            case Assign() as assign if not self.session.leaving:
                await self._assign(assign)
            case MapUpdate(m, keys):
                if keys and self._stream is not None:
                    self._stream.bind_keys(keys)
                self._on_map(ClusterMap.from_wire(m))
            case LeaseEcho(t, role, partition, epoch):
                self.session.echoed(t, role.value, partition, epoch)
            case Heartbeat():
                pass  # a probe: hearing from the broker is all it says
            case RegisterAgain() if not self.session.leaving:  # the broker restarted
                self._register()
                self._report()  # right behind it: a primary's lease from the new broker
            case Assign() | RegisterAgain() | None:
                log.warning("unexpected %s from the broker", route.mtype.name)
            case unknown:
                assert_never(unknown)

    async def _assign(self, a: Assign) -> None:
        role, partition, epoch, address = a.role, a.partition, a.epoch, a.primary_address
        if not self.registered:
            # systemd hears READY only now: the broker has admitted this shard.
            self.registered = True
            self.notifier.ready(f"registered with {self.broker}: {role.value}")
            # Its first heartbeat at once: the liveness thread repeats the latest one
            # while the loop is held, and has none before it (this assignment may drop
            # a restored partition of GBs).
            self._report()
        change = self.session.assign(
            role, partition, epoch, address, lsn=self.core.lsn, term=self.links.term
        )
        if change.register_again and partition is not None:
            log.warning(
                "refused to be primary of partition %s at epoch %d: its data was let go "
                "since this shard last said what it holds; registering again",
                partition,
                epoch,
            )
            self._register(refused=(partition, epoch))
            return
        if not change.changed:
            return  # nothing changed (the broker repeats itself after a restart)
        was = change.was
        log.info(
            "assigned: %s of partition %s at epoch %d (was %s of %s at %d)",
            role.value,
            partition,
            epoch,
            was[0].value,
            was[1],
            was[2],
        )
        self.requests.refuse(change.refused)
        if change.stop_following:
            self._close_upstream()
        match role:
            case Role.PRIMARY:
                release_later(self.core.assign(partition, epoch, primary=True))
                self.checkpoints.log_as_primary()
                # A lease comes only from the broker's answer to a heartbeat
                # sent from now on; ask for one at once.
                self._report()
            case Role.REPLICA:
                release_later(self.core.assign(partition, epoch, primary=False))
                if change.follow:
                    key = a.primary_key
                    self._follow(change.follow, epoch, key.encode() if key else None)
            case Role.SPARE:
                release_later(self.core.assign(None, 0))
        self.assigned.set()

    def _on_map(self, cmap: ClusterMap) -> None:
        p = self.session.partition
        info = cmap.partitions.get(p) if p is not None else None
        if info is not None and p == self.core.partition:
            # The slots this partition serves, while no move involves it (live
            # resharding: fences and imports are records of its stream).
            owned = cmap.slot_map == p
            if self.core.slots is None:
                self.core.slots = SlotState.of(owned, cmap.version)
            else:
                self.core.slots.take_map(owned, cmap.version)
        if info is not None:
            self._apply_waiting(
                self.session.on_map(info.epoch, set(info.in_sync), set(info.replicas))
            )
        if self._ctx is not None and self._tg is not None:
            self.routers.follow({r.endpoint for r in cmap.routers}, time.monotonic())

    def _settle(self) -> None:
        self._apply_waiting(self.session.settle())

    def _apply_waiting(self, done: MapResult[Reply]) -> None:
        """Answer the writes now held by every copy required; refuse those held by too few."""
        self.requests.release(done.released)
        self.requests.refuse(
            done.refused, Status.NOT_ENOUGH_REPLICAS, self.session.short_of_copies()
        )

    # -- requests and replies ------------------------------------------------

    def _on_broker_request(self, source: bytes, route: Route, frames: list[Any]) -> None:
        """A client's request routed by the broker followed."""
        self.routers.forget(source)  # answered through the broker again
        self.requests.request(source, route, frames)

    def _router_link(
        self, endpoint: str, name: str
    ) -> tuple[transport.Channel, transport.Outbound]:
        assert self._ctx is not None
        return dealer_link(
            self._ctx, self.config, self.node_id, self._keys, endpoint, name, watch=True
        )

    def _dense_memory(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray | None:
        """A dense chunk's place in the arena, for one large enough to be lent (None:
        the heap)."""
        sm = self._shm
        if sm is None or math.prod(shape) * dtype.itemsize < max(sm.min_bytes, LEND_MIN_BYTES):
            return None
        try:
            return sm.reserve_array(shape, dtype)
        except OSError as e:  # the arena could not be made (memfd, mmap): the heap
            log.warning("a dense chunk on the heap: shared memory failed (%s)", e)
            return None

    # -- replica side --------------------------------------------------------

    def _follow(self, address: str, epoch: int, primary_key: bytes | None) -> None:
        """Subscribe to the primary at ``address`` (the session already follows it)."""
        self._close_upstream()
        assert self._ctx is not None and self._tg is not None
        channel = transport.dealer(
            self._ctx,
            address,
            self.node_id.encode(),
            max_message_bytes=self.config.max_message_bytes,
            curve=self._keys,
            server_public=primary_key,
        )
        self._upstream = Upstream(
            self.session,
            self.core,
            channel,
            interval=self.config.heartbeat.interval,
            max_message_bytes=self.config.max_message_bytes,
            durability=self.durability,
            checkpoints=self.checkpoints.store,
            shared=self._shm,
        )
        self._upstream_task = self._tg.create_task(self._upstream.run())
        log.info("following the primary at %s (epoch %d)", address, epoch)

    def _close_upstream(self) -> None:
        if self._upstream_task is not None:
            self._upstream_task.cancel()
            self._upstream_task = None
        if self._upstream is not None:
            transport.close(self._upstream.channel)
            self._upstream = None
