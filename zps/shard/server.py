"""The shard process: serves one partition as primary or replica.

Links:

* a DEALER to the broker: registration (claiming what it already serves, so
  a restarted broker rebuilds its map), requests and replies.
* a second DEALER to the broker, the *liveness link* (identity ``h-`` + the
  shard's, :mod:`zps.core.membership`): heartbeats and the broker's lease echoes
  only, so neither waits behind bulk data queued on the first (a lease that ran
  out while its echo sat behind seconds of data refused requests that had already
  crossed the link).  Until the broker has answered on it (an older broker does
  not), heartbeats also go on the data link.
  Frames from the broker are ``[source, route, header, payloads...]``: an
  empty ``source`` is the broker itself, anything else a client to answer.
  With a broker pair, one pair of DEALERs to each: control messages go to both, and
  requests are taken (and replies sent) only through the broker whose term
  is the highest seen (an older broker's messages are dropped or refused).
* a ROUTER of its own (``replication_bind``): when primary, its replicas
  subscribe here (:mod:`zps.shard.primary`).
* a DEALER to its primary, when replica (:mod:`zps.shard.replica`).

This module is the driver: it owns the sockets, the tasks and the clock, and
does what :class:`~zps.shard.session.ShardSession` (role, replication, lease,
housekeeping) decides.  A primary answers a write once every replica it
requires has applied it (``acks=all``; see :mod:`zps.core.replication`), and
accepts requests only while its lease from the broker runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, assert_never
from urllib.parse import urlsplit

import msgpack
import numpy as np
import zmq.asyncio

from zps import shm, transport
from zps.core.membership import liveness_identity
from zps.core.routing import ClusterMap
from zps.errors import ProtocolError
from zps.ops import malloc
from zps.ops.config import ShardConfig
from zps.ops.datadir import lock_data_dir
from zps.ops.metrics import (
    CounterMetricFamily,
    GaugeMetricFamily,
    LatencyHistogram,
    Metric,
    MetricsServer,
    counter,
    gauge,
    labelled,
    request_seconds,
)
from zps.ops.security import (
    REFUSAL_REASONS,
    load_curve_keys,
    load_key_roles,
    warn_if_exposed,
)
from zps.ops.systemd import Notifier
from zps.protocol.codec import (
    PROTOCOL_VERSION,
    Message,
    MsgType,
    Route,
    VersionMismatchError,
    decode,
    encode,
    unpack_route,
)
from zps.protocol.messages import (
    Assign,
    BrokerToShard,
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
    StatusReply,
)
from zps.shard import admission, snapshots
from zps.shard.checkpoint import CheckpointStore, cut, finish, restore
from zps.shard.core import Limits, ShardCore
from zps.shard.durability import Durability, LogLost
from zps.shard.liveness import Liveness
from zps.shard.primary import REPLICATION_HWM, ReplicationStream, Reply
from zps.shard.replica import Upstream
from zps.shard.session import MapResult, ShardSession
from zps.shard.slotops import SlotState
from zps.store.snapshot import Snapshot
from zps.transport import CurveKeys
from zps.version import __version__

log = logging.getLogger("zps.shard")


#: Seconds after which a reply's shared-memory region may be reused unread.
SHM_RECLAIM_S = 2.0


class _HeldAck(list[Any]):
    """The final reply to a request whose writes are all background pushes (``lz``):
    once released, held for the client's next reply that goes at once to carry
    (``acked``)."""

    __slots__ = ("req_id", "res")

    def __init__(self, frames: list[Any], req_id: int, res: list[dict[str, Any] | None]) -> None:
        super().__init__(frames)
        self.req_id = req_id
        self.res = res


def _from_broker(mtype: MsgType, header: dict[str, Any]) -> BrokerToShard | None:
    """The record of a control message from the broker (None: not one a shard expects).

    A HEARTBEAT with a role is the echo that renews the lease; without, a probe."""
    match mtype:
        case MsgType.ASSIGN:
            return Assign.parse(header)
        case MsgType.MAP:
            return MapUpdate.parse(header)
        case MsgType.HEARTBEAT if "role" in header:
            return LeaseEcho.parse(header)
        case MsgType.HEARTBEAT:
            return Heartbeat.parse(header)
        case MsgType.REGISTER:
            return RegisterAgain.parse(header)
        case _:
            return None


#: Dense chunks of this size and more keep their values in the shard's arena, lent to
#: pulls rather than copied (within a quarter of ``shard.shm_bytes``); smaller ones
#: (small tensors, a tensor's last chunk) stay on the heap and leave that room to the
#: large chunks, whose copy is what lending saves.
LEND_MIN_BYTES = 1 << 20


def _told_no_shm(reply: list[Any], node_id: str) -> list[Any]:
    """``reply`` with ``noshm: open`` (and this shard, ``by``) in its header."""
    header = msgpack.unpackb(reply[1], raw=False)
    header["noshm"], header["by"] = "open", node_id
    return [reply[0], msgpack.packb(header, use_bin_type=True), *reply[2:]]


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


def _write_checkpoint(store: CheckpointStore, snap: Snapshot) -> tuple[Path, int]:
    """The file written, and the LSN of the oldest checkpoint kept (the log is kept
    from there on)."""
    path = store.write(finish(snap))
    oldest = store.oldest_lsn(snap.partition)
    return path, snap.lsn if oldest is None else oldest


class ShardServer:
    def __init__(
        self, config: ShardConfig, *, node_id: str | None = None, notifier: Notifier | None = None
    ) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        self.metrics = MetricsServer(config.metrics, self._collect, ready=self._ready)
        #: Time to handle a request, by kind (read, write): zps_shard_request_seconds.
        self._latency = {k: LatencyHistogram() for k in ("read", "write")}
        self.checkpoints_written = 0
        self.checkpoint_failures = 0
        self._checkpoint_seconds: float | None = None  # the last write took
        self._checkpoint_time: float | None = None  # Unix time of the newest checkpoint
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
        #: What the admission rules take from the configuration (roles: see _run).
        self._policy = admission.Policy(
            self.node_id, False, config.reply_queue_bytes, config.max_message_bytes
        )
        self._version_warned = False
        self._stop = asyncio.Event()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: transport.Channel | None = None
        #: Broker pair: every broker link, the one followed, and the highest term seen.
        self._links: list[tuple[transport.Channel, transport.Outbound]] = []
        self._current = 0
        self._term = 0
        #: The liveness link to each broker (heartbeats and lease echoes), served by a
        #: thread of its own (zps.shard.liveness); what it hears, for the loop; and
        #: when each link was last heard from (an echo: the broker serves liveness links).
        self._liveness: transport.LinkThread | None = None
        self._beat_policy: Liveness | None = None
        self._beat_inbox: asyncio.Queue[tuple[int, list[bytes]]] = asyncio.Queue(1024)
        self._beat_heard: list[float] = []
        # Per data link: the messages it had received, and since when (see _report).
        self._data_heard: dict[int, tuple[int, float]] = {}
        #: Set (in the loop) if the liveness thread fails: see _links_failed.
        self._links_dead: asyncio.Future[BaseException] | None = None
        # Everything to the broker but heartbeats goes through _out, bounded in bytes:
        # past ``reply_queue_bytes - max_message_bytes`` held, requests are refused.
        self._out: transport.Outbound | None = None
        #: Released answers to clients' background writes, waiting to ride on the next
        #: reply to the same client (at most ``ack_hold_s``).
        self._acks = admission.HeldAcks(config.ack_hold_s)
        self._held_timer: asyncio.TimerHandle | None = None
        self.overloaded = 0  # requests refused OVERLOADED (the broker link was full)
        self._stream: ReplicationStream | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._upstream: Upstream | None = None
        self._upstream_task: asyncio.Task[None] | None = None
        self._keys: CurveKeys | None = None
        self._checkpoints = CheckpointStore(config.data_dir, ckpt.keep) if config.data_dir else None
        self.durability = Durability(
            config.durability if config.data_dir else "none",
            interval=config.durability_interval,
            segment_bytes=config.wal_segment_bytes,
        )
        self._checkpointing: asyncio.Task[Path | None] | None = None
        #: Why this copy's write-ahead log was lost (it then leaves and exits), or None.
        self._log_lost: str | None = None
        self.durability.on_lost = self._on_log_lost
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
        #: Routing brokers of the map (endpoint -> link, its reply allowance, its reader)
        #: and, per client, the router link its last request came by (its replies go
        #: back there; absent: through the broker).
        self._routers: dict[
            str, tuple[transport.Channel, transport.Outbound, asyncio.Task[None]]
        ] = {}
        self._via: dict[bytes, transport.Outbound] = {}
        self._router_absent: dict[str, float] = {}  # endpoint -> since when unlisted
        self.core.checkpoint_enabled = self._checkpoints is not None

    @property
    def role(self) -> Role:
        return self.session.role

    @property
    def lease(self) -> float:
        return self.session.lease

    def stop(self) -> None:
        self._stop.set()

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
        self._restore()
        self._ctx = transport.new_context()
        keys = self._keys = load_curve_keys(cfg.security)
        roles = load_key_roles(cfg.security)
        # CURVE roles: a request's dedup id must be its sender's.
        self._policy = dataclasses.replace(self._policy, roles=roles is not None)
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
            release=self._release,
            settle=self._settle,
            report=self._report,
            queue_bytes=cfg.replication.follower_queue_bytes,
            stall_timeout=2 * hb.interval * hb.liveness,
            shared=self._shm,
        )
        port = urlsplit(bound).port
        brokers = cfg.endpoints
        self.address = f"tcp://{cfg.advertise_host or transport.local_address(brokers[0])}:{port}"
        self._sock = transport.dealer(
            self._ctx,
            brokers[0],
            self.node_id.encode(),
            max_message_bytes=cfg.max_message_bytes,
            curve=keys,
            server_public=keys.server_public if keys else None,
            silence=transport.reconnect_silence(cfg.heartbeat.interval, cfg.heartbeat.liveness),
        )
        self._out = transport.Outbound(
            self._sock,
            total_limit=cfg.reply_queue_bytes,
            stall_timeout=2 * hb.interval * hb.liveness,
            name="broker link",
        )
        self._links = [(self._sock, self._out), *(self._link(b) for b in brokers[1:])]
        loop = asyncio.get_running_loop()
        self._links_dead = loop.create_future()
        self._beat_policy = Liveness(hb.interval, hb.liveness, hb.max_loop_stall, time.monotonic())
        # The DEALERs for heartbeats and lease echoes only, served by a thread: the
        # shard's key, its identity behind ``h-`` (the broker counts it as the shard's,
        # bound to the same key).
        self._liveness = transport.LinkThread(
            self._ctx,
            brokers,
            liveness_identity(self.node_id.encode()),
            policy=self._beat_policy,
            deliver=lambda link, frames: loop.call_soon_threadsafe(self._heard, link, frames),
            on_failure=lambda err: loop.call_soon_threadsafe(self._links_failed, err),
            max_message_bytes=cfg.max_message_bytes,
            curve=self._keys,
            server_public=self._keys.server_public if self._keys else None,
            name="zps-liveness",
            silence=transport.reconnect_silence(cfg.heartbeat.interval, cfg.heartbeat.liveness),
        )
        self._liveness.start()
        self._beat_heard = [float("-inf")] * len(brokers)
        log.info(
            "shard %s (pid %d) connecting to %s; replication at %s",
            self.node_id,
            os.getpid(),
            cfg.broker,
            self.address,
        )
        try:
            await self._register()
            self.notifier.status(f"registering with {cfg.broker}")
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tasks = [
                    tg.create_task(
                        transport.serve(
                            self._sock,
                            self._on_broker_frames,
                            self._malformed,
                            fast=self._on_broker_request,
                            on_burst=self._broker_seen,
                        )
                    ),
                    tg.create_task(self._stream.serve()),
                    tg.create_task(self._heartbeat_loop()),
                    tg.create_task(self.notifier.watchdog_loop()),
                    tg.create_task(self.durability.run()),
                    tg.create_task(self.metrics.loop_heartbeat()),
                ]
                for i, (sock, _) in enumerate(self._links[1:], 1):
                    on_frames = functools.partial(self._on_broker_frames, link=i)
                    serve = transport.serve(
                        sock,
                        on_frames,
                        self._malformed,
                        fast=functools.partial(self._on_broker_request, link=i),
                        on_burst=self._broker_seen,
                    )
                    tasks.append(tg.create_task(serve))
                tasks.append(tg.create_task(self._serve_liveness()))
                tasks.append(tg.create_task(self._watch_links()))
                await self._stop.wait()
                self.notifier.stopping("handing over and writing a checkpoint")
                self.notifier.extend_timeout(60)
                tasks[2].cancel()  # no more heartbeats: the broker must not re-admit us
                self._liveness.stop()
                await self._leave()
                for t in tasks:
                    t.cancel()
                for _, _, reader in self._routers.values():  # made as routers came
                    reader.cancel()
        finally:
            if self._out is not None:
                self._out.close()
            # Every link: after following the other broker of a pair, self._sock is
            # link 1, and an unclosed link 0 would hang the context's term below.
            for sock, out in self._links:
                out.close()
                transport.close(sock)
            if self._liveness is not None:
                self._liveness.stop()
            for sock, out, _ in self._routers.values():
                out.close()
                transport.close(sock)
            if auth is not None:
                auth.stop()
            self._close_upstream()
            for sock in (self._sock, repl):
                if sock is not None:
                    transport.close(sock)
            transport.term(self._ctx)
            log.info("shard %s stopped", self.node_id)

    async def _leave(self) -> None:
        """Graceful stop: hand over, refuse further work, write a last checkpoint."""
        whole = self.session.begin_leave()  # from now on, assignments are ignored
        await self._to_broker(MsgType.BYE, Bye().to_wire())  # the broker promotes a replica now
        self._refuse(self.session.left())
        self._close_upstream()
        self.core.primary = False
        if whole:
            if self._checkpointing is not None:  # let a periodic one finish first
                await asyncio.wait([self._checkpointing])
            await self._checkpoint(final=True)
            self._mark_final()
        elif self.session.unchanged_since_restore(self.core.lsn, self.core.epoch):
            self._mark_final()  # restored whole, never changed: its checkpoint still is

    def _mark_final(self) -> None:
        """After the final checkpoint of a graceful stop: note that the newest
        checkpoint holds every write this copy acknowledged (a copy restored from it
        without a log claims its partition as complete)."""
        store, core, done = self._checkpoints, self.core, self.core.checkpointed
        if store is None or core.partition is None or not done or done["lsn"] != core.lsn:
            return
        try:
            store.mark_final(core.partition, Path(done["path"]))
        except OSError as e:
            log.error("the final checkpoint %s could not be noted as final: %s", done["path"], e)

    def _restore(self) -> None:
        """Load the newest usable checkpoint, to claim its partition when registering."""
        if self._checkpoints is None:
            return
        d = self.durability
        found, wal = restore(
            self.core,
            self._checkpoints,
            log_segment_bytes=None if d.mode == "none" else d.segment_bytes,
        )
        if found is None:
            log.info("no checkpoint in %s: starting empty", self.config.data_dir)
            return
        if wal is not None:
            d.adopt(wal, found.partition)
        self.core.primary = False  # until the broker says so
        self.session.restore(
            found.partition, found.epoch, found.lsn, time.monotonic(), complete=found.complete
        )
        replayed = found.recovery.applied if found.recovery else 0
        log.info(
            "restored partition %d at epoch %d, LSN %d from %s and %d logged messages",
            found.partition,
            found.epoch,
            found.lsn,
            found.checkpoint or "nothing",
            replayed,
        )
        if found.recovery is not None and found.recovery.cut:
            log.warning("write-ahead log replay stopped: %s", found.recovery.cut)
        if not found.complete:
            log.warning(
                "partition %d at LSN %d may lack writes this copy acknowledged (%s): "
                "claimed as incomplete",
                found.partition,
                found.lsn,
                f"the log reached LSN {found.recovery.reached}, set aside"
                if found.recovery is not None
                else "a checkpoint with no log after it, not written at a clean stop",
            )
        if found.checkpoint is not None:
            with contextlib.suppress(OSError):
                self._checkpoint_time = Path(found.checkpoint).stat().st_mtime
            with contextlib.suppress(ValueError, IndexError):  # ckpt-EPOCH-LSN.zps
                _, epoch, lsn = Path(found.checkpoint).stem.split("-")
                self.core.checkpointed = {
                    "lsn": int(lsn),
                    "epoch": int(epoch),
                    "path": str(found.checkpoint),
                    "time": self._checkpoint_time,
                }

    def _start_checkpoint(self) -> None:
        """Write a checkpoint beside the loops (never inside one); one at a time."""
        if self._checkpointing is None or self._checkpointing.done():
            assert self._tg is not None
            self._checkpointing = self._tg.create_task(self._checkpoint())

    async def _checkpoint(self, *, final: bool = False) -> Path | None:
        """The event loop only copies the partition into buffers prepared off it; the
        ordering, encoding, checksum, write, fsync and rename run in a worker thread.
        Returns the file written (None: none was)."""
        store, core = self._checkpoints, self.core
        if store is None or core.partition is None:
            return None
        space = None if final else await snapshots.prepare(core)
        if core.partition is None or not self.session.begin_checkpoint(
            time.monotonic(), core.lsn, final=final
        ):
            wanted = core.checkpoint_wanted  # asked for (op "checkpoint"): already under way?
            if wanted is not None and self.session.last_checkpoint[1] >= wanted:
                core.checkpoint_wanted = None
            return None
        snap = cut(core, space)  # memory copies only, at one LSN
        if core.checkpoint_wanted is not None and snap.lsn >= core.checkpoint_wanted:
            core.checkpoint_wanted = None
        del space
        self.durability.roll()  # the log's older segments are what this checkpoint holds
        t0 = time.monotonic()
        try:
            path, oldest = await asyncio.to_thread(_write_checkpoint, store, snap)
        except OSError as e:
            self.checkpoint_failures += 1
            log.error(
                "checkpoint of partition %d at LSN %d failed (the older ones and the log "
                "are kept): %s",
                snap.partition, snap.lsn, e,
            )  # fmt: skip
            return None
        self.checkpoints_written += 1
        self._checkpoint_seconds, self._checkpoint_time = time.monotonic() - t0, time.time()
        # The log goes from the oldest checkpoint kept: each of them restores with it.
        self.durability.checkpointed(snap.partition, oldest)
        core.checkpointed = {
            "lsn": snap.lsn,
            "epoch": snap.epoch,
            "path": str(path),
            "time": self._checkpoint_time,
        }
        log.info(
            "checkpoint of partition %d at LSN %d written to %s in %.2fs",
            snap.partition,
            snap.lsn,
            path,
            time.monotonic() - t0,
        )
        return path

    def _collect(self) -> Iterable[Metric]:
        s, core = self.core.stats, self.core
        yield counter("zps_shard_requests", "Request messages handled", s.requests)
        yield request_seconds(self._latency)
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
        if self._stream is not None:
            counts = self._stream.refusals.counts
            yield labelled(
                CounterMetricFamily,
                "zps_shard_replication_refusals",
                "CURVE peers and messages refused at the replication endpoint, by reason",
                "reason",
                {r: float(counts.get(r, 0)) for r in REFUSAL_REASONS},
            )
        yield counter("zps_shard_receive_bytes", "Payload bytes received", s.bytes_in)
        part = {"partition": "none" if core.partition is None else str(core.partition)}
        yield gauge("zps_shard_lsn", "Log sequence number of the partition", core.lsn, part)
        yield gauge(
            "zps_shard_table_bytes", "Memory held by the partition's tables", core.store.nbytes
        )
        yield gauge("zps_shard_dedup_bytes", "Memory held by the dedup record", core.dedup.nbytes)
        yield gauge("zps_shard_dedup_entries", "Messages in the dedup record", len(core.dedup))
        yield counter(
            "zps_shard_dedup_evicted", "Messages evicted from the dedup record", core.dedup.evicted
        )
        yield counter(
            "zps_shard_dedup_expired",
            "Re-sent messages older than the dedup record, refused",
            s.expired,
        )
        yield gauge(
            "zps_shard_step_buffer_bytes",
            "Memory held by sync-mode gradients waiting for their step",
            core.steps.nbytes,
        )
        roles = GaugeMetricFamily(
            "zps_shard_role",
            "1 for the current role (shard: this shard's name)",
            labels=["role", "partition", "shard"],
        )
        for r in Role:
            roles.add_metric([r.value, part["partition"], self.node_id], float(r is self.role))
        yield roles
        yield from self._checkpoint_metrics(part)
        wal = self.durability.stats
        yield counter("zps_shard_wal_bytes", "Bytes written to the write-ahead log", wal.bytes)
        yield counter("zps_shard_wal_syncs", "fsyncs of the write-ahead log", wal.syncs)
        yield counter("zps_shard_wal_errors", "Failed writes of the write-ahead log", wal.errors)
        yield counter(
            "zps_shard_overloaded",
            "Requests refused OVERLOADED: the replies held for the broker filled their bound",
            self.overloaded,
        )
        if self._beat_policy is not None:
            yield counter(
                "zps_shard_heartbeats_covered",
                "Heartbeats the liveness thread sent while the event loop was held",
                self._beat_policy.covered,
            )
            yield gauge(
                "zps_shard_event_loop_longest_gap_seconds",
                "The longest the event loop went between two heartbeats",
                self._beat_policy.longest_gap,
            )
        if self._shm is not None:
            shm_stats = self._shm.stats()
            yield gauge(
                "zps_shard_shm_bytes",
                "Shared memory held by frames clients and replicas have not yet read",
                shm_stats["used"],
            )
            yield counter(
                "zps_shard_shm_sent_frames",
                "Reply and replication frames sent through shared memory",
                shm_stats["puts"],
            )
            yield counter(
                "zps_shard_shm_staged_frames",
                "Write frames read from a client's shared memory into this shard's own and "
                "streamed to replicas from there, with no copy of their own",
                shm_stats["named"] - shm_stats["lent"],
            )
            yield counter(
                "zps_shard_shm_lent_frames",
                "Pull replies that named a dense chunk's values in shared memory instead of "
                "copying them (a push meanwhile updates a new copy)",
                shm_stats["lent"],
            )
            yield counter(
                "zps_shard_shm_loans_expired",
                "Loans of dense chunks whose reader had not said it was done in time "
                f"({SHM_RECLAIM_S}s after the longest a reply may wait for the replicas): a "
                "chunk still held gets a new token, so a late read is refused and asked again",
                shm_stats["expired"],
            )
            yield gauge(
                "zps_shard_shm_dense_bytes",
                "Dense values held in shared memory (current chunks, and lent older ones)",
                shm_stats["array_bytes"],
            )
            yield counter(
                "zps_shard_shm_read_frames",
                "Request and replication frames read from peers' shared memory",
                shm_stats["reads"],
            )
            yield counter(
                "zps_shard_shm_full",
                "Reply frames sent inline because the shared memory budget was spent",
                shm_stats["full"],
            )
            yield counter(
                "zps_shard_shm_refused",
                "Requests refused because a client's shared memory could not be read",
                shm_stats["refused"],
            )
        if self._stream is not None:
            sender = self._stream.snapshots
            yield counter("zps_shard_snapshots_sent", "Snapshot transfers begun", sender.started)
            yield counter(
                "zps_shard_snapshot_chunks_sent", "Snapshot chunks sent", sender.chunks_sent
            )
            if self._shm is not None:
                yield counter(
                    "zps_shard_replication_shm_messages",
                    "Replication messages whose large frames went through shared memory",
                    self._stream.shared_messages,
                )
                yield gauge(
                    "zps_shard_replication_shm_bytes",
                    "Shared memory held by replication frames not yet acknowledged",
                    self._stream.shared_bytes,
                )
        lag = GaugeMetricFamily(
            "zps_shard_replica_lag_updates",
            "Updates this primary applied that the replica has not acknowledged",
            labels=["partition", "replica"],
        )
        for node, follower in self.session.followers.items():
            lag.add_metric([part["partition"], node], max(0, core.lsn - follower.acked))
        if lag.samples:  # a family without series is noise (and no primary has none)
            yield lag

    def _checkpoint_metrics(self, part: dict[str, str]) -> Iterable[Metric]:
        yield counter("zps_shard_checkpoints", "Checkpoints written", self.checkpoints_written)
        yield counter(
            "zps_shard_checkpoint_failures",
            "Checkpoints that failed to be written",
            self.checkpoint_failures,
        )
        if self._checkpoint_seconds is not None:
            yield gauge(
                "zps_shard_checkpoint_duration_seconds",
                "Time the last checkpoint took to write, fsync and rename",
                self._checkpoint_seconds,
            )
        if self._checkpoint_time is not None:
            yield gauge(
                "zps_shard_checkpoint_last_success_timestamp_seconds",
                "Unix time of the newest checkpoint of the partition (written or restored)",
                self._checkpoint_time,
                part,
            )
            yield gauge(
                "zps_shard_checkpoint_age_seconds",
                "Seconds since the newest checkpoint of the partition",
                max(0.0, time.time() - self._checkpoint_time),
                part,
            )

    def _ready(self) -> tuple[bool, str]:
        """For ``/ready`` (called from the metrics thread): the broker admitted this
        shard and it does its role: a primary holds its lease, a replica has loaded
        its primary's snapshot and follows the stream, a spare waits for a role."""
        s = self.session
        if s.leaving or self._stop.is_set():
            return False, "stopping"
        if not self.registered:
            return False, f"not registered with {self.config.broker}"
        where = f"partition {s.partition} at epoch {s.epoch}"
        match s.role:
            case Role.PRIMARY if not s.may_write(time.monotonic()):
                return False, f"primary of {where} without a lease from the broker"
            case Role.REPLICA if not s.synced:
                return False, f"replica of {where}, catching up"
            case Role.SPARE:
                return True, "spare"
        return True, f"{s.role.value} of {where}"

    # -- broker link ---------------------------------------------------------

    async def _to_broker(self, mtype: MsgType, header: dict[str, Any]) -> None:
        """Best effort, never blocking: control messages are repeated or asked for
        again, and a broker link that is down (or refused us) must not hang the
        shard, not even its shutdown."""
        assert self._sock is not None
        frames = [b"", *encode(Route(mtype), self._with_term(header))]
        for sock in self._broker_socks():
            if not transport.try_send(sock, frames):
                log.debug("dropped a %s to the broker: its queue is full", mtype.name)

    def _link(
        self, endpoint: str, name: str = "broker link"
    ) -> tuple[transport.Channel, transport.Outbound]:
        """A DEALER to the other broker of a pair (or to a routing broker), with its own
        reply allowance."""
        assert self._ctx is not None
        cfg, keys, hb = self.config, self._keys, self.config.heartbeat
        sock = transport.dealer(
            self._ctx,
            endpoint,
            self.node_id.encode(),
            max_message_bytes=cfg.max_message_bytes,
            curve=keys,
            server_public=keys.server_public if keys else None,
        )
        out = transport.Outbound(
            sock,
            total_limit=cfg.reply_queue_bytes,
            stall_timeout=2 * hb.interval * hb.liveness,
            name=name,
        )
        return sock, out

    def _links_failed(self, error: BaseException) -> None:
        """The liveness thread failed (called in the loop)."""
        if self._links_dead is not None and not self._links_dead.done():
            self._links_dead.set_result(error)

    async def _watch_links(self) -> None:
        """A shard whose liveness thread failed is heard no more: the broker will fail it
        over, and one that went on serving would do so unheard.  It stops at once, with
        an error (its service manager starts it again, and it registers anew)."""
        assert self._links_dead is not None
        error = await self._links_dead
        log.critical("the liveness thread failed (%s): the shard stops", error)
        raise RuntimeError(f"shard {self.node_id}: its liveness thread failed: {error}")

    def _heard(self, link: int, frames: list[bytes]) -> None:
        """A message on a liveness link, from its thread (called in the loop)."""
        with contextlib.suppress(asyncio.QueueFull):  # echoes only: the next one will do
            self._beat_inbox.put_nowait((link, frames))

    async def _serve_liveness(self) -> None:
        while True:
            link, frames = await self._beat_inbox.get()
            try:
                await self._on_liveness_frames(frames, link)
            except ProtocolError as e:
                self._malformed(frames, e)
            self._broker_seen()

    async def _on_liveness_frames(self, frames: transport.Frames, link: int) -> None:
        """A lease echo (or another control message) on a liveness link; it carries the
        broker's term like any other, so fencing is the same as on the data link."""
        if len(frames) < 3 or transport.frame_bytes(frames[0]):
            raise ProtocolError("a liveness link carries control messages only")
        self._beat_heard[link] = time.monotonic()
        await self._on_broker_frames(frames, link)

    def _data_link_quiet(self, sock: transport.Channel, now: float) -> bool:
        """Whether the broker sent nothing on data link ``sock`` (its probes come every
        heartbeat interval) for a lease.  Under CURVE it sends nothing on a data link
        whose connection closed until the shard speaks on the new one: the heartbeat
        goes there too then."""
        if self._keys is None:
            return False  # without CURVE a reconnected link is heard at once
        count, since = self._data_heard.get(id(sock), (-1, now))
        if sock.received != count:
            self._data_heard[id(sock)] = (sock.received, now)
            return False
        return now - since >= self.session.lease

    def _broker_socks(self) -> list[transport.Channel]:
        assert self._sock is not None
        return [sock for sock, _ in self._links] or [self._sock]

    def _with_term(self, header: dict[str, Any]) -> dict[str, Any]:
        """A broker pair learns from the shards the highest term they have seen."""
        return {**header, "term": self._term} if len(self._links) > 1 else header

    def _fenced(self, link: int, header: dict[str, Any]) -> bool:
        """Broker pair: drop a control message from a broker older than the highest term
        seen; one from a broker at least as new makes it the broker followed."""
        term = header.get("term")
        if len(self._links) < 2 or not isinstance(term, int) or isinstance(term, bool):
            return False
        if term < self._term:
            return True
        if link != self._current:
            log.warning("following the broker at %s (term %d)", self.config.endpoints[link], term)
            self._current = link
            self._sock, self._out = self._links[link]
        self._term = term
        return False

    async def _register(self) -> None:
        claim = self.session.claim(self.core.lsn)
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
        )
        await self._to_broker(MsgType.REGISTER, register.to_wire())

    async def _heartbeat(self) -> None:
        self._report()

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
        frames = [b"", *encode(Route(MsgType.HEARTBEAT), self._with_term(beat.to_wire()))]
        if self._liveness is not None:
            self._liveness.post(frames)  # on every liveness link
        now = time.monotonic()
        for i, sock in enumerate(self._broker_socks()):
            if (
                i < len(self._beat_heard)
                and now - self._beat_heard[i] < self.session.lease
                and not self._data_link_quiet(sock, now)
            ):
                continue  # the broker answers on the liveness link
            transport.try_send(sock, frames)  # not yet (or an older broker): both
        # Routing brokers send nothing to a link whose connection closed until the shard
        # speaks on its new one (under CURVE): the heartbeat is that word, taken as such.
        for sock, _, _ in self._routers.values() if self._keys is not None else ():
            transport.try_send(sock, frames)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat.interval)
            await self._heartbeat()
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
                    "no word from the broker for %.1fs; %s",
                    tick.broker_lost_for,
                    "refusing writes until it answers"
                    if self.role is Role.PRIMARY
                    else "waiting for it",
                )
            if tick.lagging and self._stream is not None:
                for node in tick.lagging:
                    self._stream.drop(node, "no acknowledgement for a liveness timeout")
            if self._stream is not None:
                self._stream.expire_shared(time.monotonic())
            if self.core.checkpoint_wanted is not None and not tick.checkpoint:
                self._start_checkpoint()  # an operator's "zps-server checkpoint"
            if tick.checkpoint:
                self._start_checkpoint()
            elif tick.ack_upstream and self._upstream is not None:
                await self._upstream.ack()

    def _broker_seen(self) -> None:
        if self.session.broker_seen(time.monotonic()):
            log.info("the broker answers again")

    async def _on_broker(self, route: Route, header: dict[str, Any]) -> None:
        match _from_broker(route.mtype, header):
            case Assign() as assign if not self.session.leaving:
                await self._assign(assign)
            case MapUpdate(m):
                self._on_map(ClusterMap.from_wire(m))
            case LeaseEcho(t, role, partition, epoch):
                self.session.echoed(t, role.value, partition, epoch)
            case Heartbeat():
                pass  # a probe: hearing from the broker is all it says
            case RegisterAgain() if not self.session.leaving:  # the broker restarted
                await self._register()
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
            self.notifier.ready(f"registered with {self.config.broker}: {role.value}")
        change = self.session.assign(role, partition, epoch, address)
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
        self._refuse(change.refused)
        if change.stop_following:
            self._close_upstream()
        match role:
            case Role.PRIMARY:
                self.core.assign(partition, epoch, primary=True)
                self._log_as_primary()
                # A lease comes only from the broker's answer to a heartbeat
                # sent from now on; ask for one at once.
                await self._heartbeat()
            case Role.REPLICA:
                self.core.assign(partition, epoch, primary=False)
                if change.follow:
                    key = a.primary_key
                    self._follow(change.follow, epoch, key.encode() if key else None)
            case Role.SPARE:
                self.core.assign(None, 0)
        self.assigned.set()

    def _refuse(
        self, waiting: list[Reply], status: Status = Status.NOT_PRIMARY, why: str = ""
    ) -> None:
        """Writes still waiting for replicas get ``status``: NOT_PRIMARY when the
        primary stepped down, NOT_ENOUGH_REPLICAS when too few copies are in sync."""
        for client, frames in waiting:
            route = unpack_route(frames[0])
            refusal = encode(
                Route(MsgType.REPLY, route.partition, route.epoch, route.req_id),
                StatusReply(status, why or "the primary stepped down").to_wire(),
            )
            self._post([client, *refusal])
        if waiting and status is not Status.NOT_PRIMARY:
            log.warning("refused %d waiting writes: %s", len(waiting), why)
        elif waiting:
            log.warning(
                "stepped down with %d writes unacknowledged; clients will retry", len(waiting)
            )

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
        self._follow_routers(cmap)

    def _follow_routers(self, cmap: ClusterMap) -> None:
        """Keep a DEALER to every routing broker the map lists, for requests only
        (control and the liveness link stay with the broker pair); a request that came
        through one is answered through it."""
        if self._ctx is None or self._tg is None:
            return
        wanted = {r.endpoint for r in cmap.routers}
        now = time.monotonic()
        for endpoint in self._routers:
            if endpoint in wanted:
                self._router_absent.pop(endpoint, None)
            else:  # kept a while: its replies in flight still go out, it may come back
                self._router_absent.setdefault(endpoint, now)
        for endpoint in [e for e, t in self._router_absent.items() if now - t >= 60.0]:
            del self._router_absent[endpoint]
            sock, out, task = self._routers.pop(endpoint)
            task.cancel()
            out.close()
            transport.close(sock)
            self._via = {c: o for c, o in self._via.items() if o is not out}
        for endpoint in wanted - self._routers.keys():
            sock, out = self._link(endpoint, f"router link {endpoint}")
            on_frames = functools.partial(self._on_router_frames, out=out)
            task = self._tg.create_task(transport.serve(sock, on_frames, self._malformed))
            self._routers[endpoint] = (sock, out, task)
            log.info("connected to the routing broker at %s", endpoint)

    async def _on_router_frames(self, frames: transport.Frames, out: transport.Outbound) -> None:
        """A request a routing broker forwarded: the same checks as any (role, epoch,
        lease); the reply goes back through that router."""
        if len(frames) < 3:
            raise ProtocolError(f"{len(frames)} frames from a routing broker")
        source = transport.frame_bytes(frames[0])
        if not source:
            return  # routers send no control messages
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
        except (KeyError, ValueError, TypeError, OverflowError) as e:
            raise ProtocolError(str(e)) from e
        if admission.link_full(out.held_bytes, self._policy):
            # That router reads too slowly for another full reply (admission rule 4).
            self.overloaded += 1
            refusal = admission.overloaded(self._policy, "this routing broker")
            reply_route = Route(MsgType.REPLY, route.partition, self.core.epoch, route.req_id)
            out.post(
                [source, *encode(reply_route, refusal.header())], self._policy.reply_queue_bytes
            )
            return
        if len(self._via) > 65536:
            self._via.clear()
        self._via[source] = out
        self._request(source, route, frames[1:])

    def _settle(self) -> None:
        self._apply_waiting(self.session.settle())

    def _apply_waiting(self, done: MapResult[Reply]) -> None:
        """Answer the writes now held by every copy required; refuse those held by too few."""
        self._release(done.released)
        self._refuse(done.refused, Status.NOT_ENOUGH_REPLICAS, self.session.short_of_copies())

    # -- requests ------------------------------------------------------------

    def _malformed(self, frames: transport.Frames, e: ProtocolError) -> None:
        self.core.stats.malformed += 1
        if isinstance(e, VersionMismatchError) and frames and not transport.frame_bytes(frames[0]):
            if not self._version_warned:  # the broker answers every REGISTER this way
                self._version_warned = True
                log.error(
                    "the broker at %s speaks protocol version %d, this shard (zps %s) %d: "
                    "it cannot join until both run releases of one protocol version",
                    self.config.broker,
                    e.version,
                    __version__,
                    PROTOCOL_VERSION,
                )
            return
        if len(frames) >= 3:  # a truncated message is only counted
            source = transport.frame_bytes(frames[0])
            log.warning("dropped a bad message (%s): %s", "request" if source else "control", e)

    async def _on_broker_frames(self, frames: transport.Frames, link: int = 0) -> None:
        if self._on_broker_request(frames, link):
            return
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
            msg = decode([transport.frame_buffer(f) for f in frames[1:]])
            if not self._fenced(link, msg.header):
                await self._on_broker(route, msg.header)
        except (KeyError, ValueError, TypeError, OverflowError) as e:
            raise ProtocolError(str(e)) from e

    def _on_broker_request(self, frames: transport.Frames, link: int = 0) -> bool:
        """A client's request the broker routed here, handled at once; False for the
        broker's own control messages (the serving task's).  Run in the link's reader
        callback (see transport.serve)."""
        if len(frames) < 3:
            raise ProtocolError(f"{len(frames)} frames from the broker")
        source = transport.frame_bytes(frames[0])
        if not source:
            return False
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
        except (KeyError, ValueError, TypeError, OverflowError) as e:
            raise ProtocolError(str(e)) from e
        if link != self._current:
            # Routed by a broker of the pair that was replaced: the client retries.
            sock = self._links[link][0]
            reply_route = Route(MsgType.REPLY, route.partition, self.core.epoch, route.req_id)
            refusal = admission.REPLACED.header()
            transport.try_send(sock, [source, *encode(reply_route, refusal)])
            return True
        if self._via:
            self._via.pop(source, None)  # answered through the broker again
        self._request(source, route, frames[1:])
        return True

    def _request(self, source: bytes, route: Route, frames: list[Any]) -> None:
        """Carry out the admission rules (zps.shard.admission) for a client's request."""
        assert self._sock is not None and self._stream is not None
        bufs = [transport.frame_buffer(f) for f in frames]
        reply_route = Route(MsgType.REPLY, route.partition, self.core.epoch, route.req_id)
        shm_reply = no_shm_reply = False
        finite: dict[int, str] = {}
        writes = False
        verdict: admission.Verdict
        try:
            msg = decode(bufs, route=route)
            writes = admission.mutates(msg.header)
            if shm.KEY in msg.header:
                # Payloads in the client's shared memory: copied here first, so what is
                # applied, logged and replicated is this process's own (a write's into
                # this process's arena, when followers read the stream from there).
                # Only a write's header frame is logged and replicated (only MUTATIONS
                # change the state, and mutates() tests those names): a read's stays as
                # it came, naming the client's memory.
                grads = admission.grad_frames(msg.header) if writes else {}
                got = (self._shm or shm.OFF).inbound(
                    bufs,
                    msg.header,
                    stage=self._stream.stage_room() if writes else 0,
                    reader=source,
                    check={i: admission.FLOAT_SIZES[d] for i, d in grads.items()},
                    header_frame=writes,
                )
                frames = bufs = got.frames
                msg = Message(msg.route, got.header, bufs[2:])  # the header read once
                shm_reply, no_shm_reply = got.reply_ok, got.reply_refused
                finite = {i: grads[i] for i in got.finite}
        except shm.ShmUnavailableError as e:
            verdict = admission.shm_refusal(
                str(e), busy=e.busy, permanent=e.permanent, token=e.token, policy=self._policy
            )
        except ProtocolError as e:
            verdict = admission.malformed(str(e))
        else:
            assert self._out is not None
            verdict = admission.admit(
                source,
                route.mtype,
                msg.header,
                writes=writes,
                policy=self._policy,
                lease=self.session,
                link_full=admission.link_full(self._out.held_bytes, self._policy),
                log_waits=self.durability.waits,
                now=time.monotonic(),
            )
        if isinstance(verdict, admission.Refuse):
            if verdict.count is admission.Count.MALFORMED:
                self.core.stats.malformed += 1
            elif verdict.count is admission.Count.OVERLOADED:
                self.overloaded += 1
            self._post([source, *encode(reply_route, verdict.header())])
            return
        prev = self.core.lsn
        t0 = time.perf_counter()
        acks = self._acks
        acks.seen(source, verdict.lazy)
        held = acks.carry(source)
        done = self.core.handle_request(
            route, msg.header, msg.payloads, finite, split=verdict.split, acked=held
        )
        reply = done.reply
        if done.carried:
            acks.carried(source)  # they ride on this reply
        self._latency["write" if done.changed else "read"].observe(time.perf_counter() - t0)
        if shm_reply and self._shm is not None and self._shm.wants(reply):
            # The client copies the large frames; dense values are lent, not copied.
            reply = self._shm.outbound(reply, lend_to=source)[0]
        elif no_shm_reply:
            # A client on another host (or this shard's path off): told once, so that
            # it stops asking (and stops sending payloads this way to this shard).
            reply = _told_no_shm(reply, self.node_id)
        d = self.durability
        todo = admission.plan(
            verdict,
            done,
            reply_bytes=0 if done.changed else transport.message_bytes(reply),
            log_behind=d.waits and d.durable < self.core.lsn,
            policy=self._policy,
        )
        if todo.too_large is not None:
            self.core.stats.errors += 1
            reply = encode(reply_route, StatusReply(Status.BAD_REQUEST, todo.too_large).to_wire())
        if todo.give_back and held:
            acks.give_back(source, held)
        if todo.replicate:
            self._stream.replicate(prev, frames, checked=done.clean)
            d.log(self.core.epoch, prev, self.core.lsn, bufs[1:])
        if todo.first_part:
            # Reads see what the primary applied, as any other client's reads do: only
            # the writes' acknowledgement waits.
            self._post([source, *reply])
            assert done.writes_res is not None
            reply = encode(reply_route, {"st": "OK", "res": done.writes_res})
            if todo.hold_final:
                reply = _HeldAck(reply, route.req_id, done.writes_res)
        lsn, epoch = self.core.lsn, self.core.epoch
        match todo.wait:
            case admission.Wait.NOW:
                self._post([source, *reply])
            case admission.Wait.LOG:
                d.after(lsn, lambda: self._post([source, *reply]))
            case admission.Wait.REPLICAS:
                d.after(lsn, lambda: self._logged_write(lsn, epoch, (source, reply)))

    def _logged_write(self, lsn: int, epoch: int, item: Reply) -> None:
        """A write is in the log (as the durability mode requires): it now waits for the
        replicas, unless the primary stepped down meanwhile."""
        if self.core.primary and self.core.epoch == epoch and self.role is Role.PRIMARY:
            self._release(self.session.add_write(lsn, item))
        else:
            self._refuse([item])

    def _log_as_primary(self) -> None:
        """A primary logs its partition from its current LSN: the log it holds goes on if
        it ends there, else a new one starts (at a checkpoint of the current state)."""
        d, p, store = self.durability, self.core.partition, self._checkpoints
        if d.mode == "none" or store is None or p is None or d.continues(p, self.core.lsn):
            return
        d.start(store.folder(p), p, self.core.lsn)
        if self.core.lsn > 0:
            log.warning(
                "partition %d at LSN %d has no log ending there: starting one, and a "
                "checkpoint as its base",
                p,
                self.core.lsn,
            )
            self._start_checkpoint()

    def _release(self, replies: list[Reply]) -> None:
        for client, frames in replies:
            if isinstance(frames, _HeldAck):
                self._hold(client, frames)
            else:
                self._post([client, *frames])

    def _hold(self, client: bytes, ack: _HeldAck) -> None:
        """The answer to background writes, now held by the replicas: carried by the
        client's next reply that goes at once, or sent on its own after
        ``shard.ack_hold_s`` (admission.HeldAcks)."""
        now = self._acks.hold(client, ack.req_id, ack.res)
        if now is not None:
            self._send_held(client, now)
        elif self._held_timer is None:
            loop = asyncio.get_running_loop()
            self._held_timer = loop.call_later(self._acks.hold_s, self._flush_held)

    def _flush_held(self) -> None:
        self._held_timer = None
        for client, acks in self._acks.release().items():
            self._send_held(client, acks)

    def _send_held(self, client: bytes, acks: list[list[Any]]) -> None:
        if self._sock is None or self._out is None:
            return  # closing: the clients re-send, and are answered from the record
        (req_id, res), rest = acks[0], acks[1:]
        header: dict[str, Any] = {"st": "OK", "res": res}
        if rest:
            header["acked"] = rest
        p = self.core.partition or 0
        self._post([client, *encode(Route(MsgType.REPLY, p, self.core.epoch, req_id), header)])

    def _post(self, frames: list[Any]) -> None:
        """Send to the broker without waiting; held within ``reply_queue_bytes`` while its
        queue is full, dropped past that (the client's request times out or is retried)."""
        assert self._sock is not None and self._out is not None
        out = self._via.get(frames[0], self._out) if self._via else self._out
        if not out.ch.closed:
            posted = out.post(frames, self.config.reply_queue_bytes)
            if posted is transport.Posted.DROPPED:
                log.warning("dropped a reply: the broker link holds %d bytes", self._out.held_bytes)

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
            checkpoints=self._checkpoints,
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
