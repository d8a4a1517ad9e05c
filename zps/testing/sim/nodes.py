"""The nodes of a simulated cluster: the real pure cores, driven by thin sim drivers.

Each driver here stands in for one real driver and does with the core's actions what
that driver does (see docs/design.md, "Simulation"):

* :class:`SimBroker` for :class:`zps.broker.broker.Broker`: ClusterState and
  FailureDetector as built; REGISTER / HEARTBEAT (report, lease echo) / BYE handling of
  ``_from_shard``, forwarding by the broker's own rule over a route table rebuilt with
  each map (:mod:`zps.broker.routes`), ``_tick_loop`` (deaths, ``tick``) and the map
  published to every node once its record is kept (the record is written at once).
* :class:`SimShard` for :class:`zps.shard.server.ShardServer` with
  :mod:`zps.shard.primary`, :mod:`zps.shard.replica` and the writer task of
  :class:`zps.shard.durability.Durability` (``run``): ShardSession, ShardCore,
  Durability (its queue, waiters and ``_write``), the real Wal and CheckpointStore
  over a :class:`~zps.testing.sim.disk.Disk`, and ``restore`` at start-up.
* the client's, :class:`~zps.testing.sim.simclient.SimClient`, is in :mod:`.simclient`.

Messages between nodes are tuples (the control messages' fields, not their msgpack);
client requests and shard replies are the real encoded frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zps.broker.routes import NoRoute, RouteTable, refusal, route
from zps.core.cluster import Assignment as BrokerAssignment
from zps.core.cluster import Claim, ClusterState
from zps.core.membership import FailureDetector
from zps.core.replication import StreamCheck, check_stream
from zps.errors import ZpsError
from zps.init import Zeros
from zps.optim import SGD
from zps.protocol.codec import MsgType, Route, decode, encode, unpack_route
from zps.protocol.messages import Role, Status, StatusReply
from zps.protocol.ops import MUTATIONS
from zps.protocol.specs import EmbeddingSpec
from zps.shard.checkpoint import CheckpointError, CheckpointStore, finish
from zps.shard.core import ShardCore
from zps.shard.durability import RETRY_S, Durability
from zps.shard.restore import restore
from zps.shard.session import MapResult, ShardSession
from zps.store.wal import WalLost

#: The run the nodes live in (zps.testing.sim.world.World: its scheduler, network,
#: disks and checks), not imported here so that the modules form no cycle.
World = Any

HB = 0.1  # heartbeat interval (s)
LIVE = 5  # heartbeats missed before a node is declared dead
HOLD = 1.0  # the broker's start-up hold (s)
TICK = 0.025  # a client's timer (s): it ticks its session and may push
#: The longest a write may wait for replicas at a primary the broker keeps renewing (s).
STALL = 3.0
SEGMENT = 4096  # bytes per log segment: many segments, many rolls
TABLE = EmbeddingSpec("emb", 1, "float32", Zeros(), SGD(lr=1.0), 0)
#: The table's wire form, which every push carries in its create (encoded, never changed).
TABLE_WIRE = TABLE.to_wire()

Reply = tuple[str, list[Any]]  # (client, reply frames)


class SimBroker:
    name = "broker"

    def __init__(self, world: World, n_partitions: int, replication: int) -> None:
        self.w = world
        self.n_partitions = n_partitions
        self.replication = replication
        self.record: tuple[int, tuple[Any, ...]] | None = None  # its data dir
        self.gen = 0
        self.alive = False
        self.starts = 0

    # -- life ----------------------------------------------------------------

    def start(self) -> None:
        w, now = self.w, self.w.sched.now
        self.gen += 1
        self.starts += 1
        self.alive = True
        # A run is deterministic: the incarnation comes from the seed, not uuid4.
        self._reset(now, self.record, f"sim{w.seed}-{self.starts}")
        w.net.attach(self.name, self.on_message)
        w.sched.log(f"{self.name} start (record: {self.record is not None})")
        self._timer(self.gen)

    def _reset(self, now: float, record: Any, incarnation: str) -> None:
        """A fresh state (holding for claims) from ``record``: at a start or a takeover."""
        self.state = ClusterState(self.n_partitions, replication=self.replication,
                                  hold_until=now + HOLD)  # fmt: skip
        self.state.incarnation = incarnation
        self.state.map = self.state._build_map()
        self.state.lease = HB * (LIVE - 1)
        if record is not None:
            self.state.restore(*record)
        self.routes = RouteTable.of(self.state.map)
        self.detector = FailureDetector(HB, LIVE, start=now)
        self.incarnations: dict[str, int] = {}
        self.published = -1

    def stop(self, *, keep_record: bool) -> None:
        if self.alive:
            # The record as last written: every change of the state is followed, within
            # the same event, by _keep (the record is written before anything that
            # depends on it goes out), so the state at the stop is the record.
            self.record = (self.state.map_version, self.state.records())
        self.alive = False
        self.w.net.detach(self.name)
        if not keep_record:
            self.record = None
        self.w.sched.log(f"{self.name} stop (record kept: {keep_record})")

    def _timer(self, gen: int) -> None:
        if not self.alive or gen != self.gen:
            return
        if self.name not in self.w.net.paused:
            self._work(self.w.sched.now)
        self.w.sched.after(HB / 2, lambda: self._timer(gen))

    def _work(self, now: float) -> None:
        """``_tick_loop``: deaths, then the state's tick, then the map."""
        for node in self.detector.tick(now):
            self.w.sched.log(f"{self.name}: {node} declared dead")
            self._apply(self.state.node_gone(node, now))
        self._apply(self.state.tick(now))
        self._publish()

    # -- what it sends -------------------------------------------------------

    def send(self, node: str, msg: Any) -> None:
        self.w.net.send(self.name, node, msg)

    def _apply(self, assignments: list[BrokerAssignment]) -> None:
        self._keep()
        for a in assignments:
            self.w.sched.log(f"assign {a.node_id} {a.role.value} p={a.partition} e={a.epoch}")
            self.send(a.node_id, ("assign", a))

    def _keep(self) -> None:
        """The record is written (durably) before anything that depends on it goes out:
        taken from the state when the broker stops (:meth:`stop`), which is what the last
        write held; here, the notices of the change are kept."""
        for level, text in self.state.notices:
            self.w.sched.log(f"{self.name} {level}: {text[:160]}")
            self.w.notices.append((level, text))
        self.state.notices.clear()

    def _publish(self) -> None:
        self._keep()
        if self.state.map_version == self.published:
            return
        self.published = self.state.map_version
        cmap = self.state.map
        self.routes = RouteTable.of(cmap)
        desc = " ".join(
            f"p{p}:{i.primary}@{i.epoch}/{','.join(i.in_sync)}{'/lost' if i.lost else ''}"
            for p, i in sorted(cmap.partitions.items())
        )
        self.w.sched.log(f"map v{cmap.version} {desc}")
        for node in [*self.state.clients, *self.state.shards]:
            self.send(node, ("map", cmap))

    # -- what it receives ----------------------------------------------------

    def on_message(self, src: str, msg: Any) -> None:
        now = self.w.sched.now
        self.detector.seen(src, now)
        kind = msg[0]
        if kind == "request":
            self._forward(src, msg[1])
        elif kind == "reply":
            _, client, frames = msg
            self.send(client, ("reply", frames, src))
        elif kind == "hello" or kind == "client-hb":
            if src not in self.state.clients:
                self.state.register_client(src, host=src, pid=0, name="sim", now=now)
                self.send(src, ("map", self.state.map))
        elif kind == "register":
            _, claim, inc, refused = msg
            if self.incarnations.get(src) not in (None, inc) and src in self.state.shards:
                self._apply(self.state.node_gone(src, now))
            self.incarnations[src] = inc
            c = None
            if claim is not None:
                c = Claim(claim["partition"], claim["epoch"], Role(claim["role"]), claim["lsn"],
                          claim["in_sync"], claim.get("complete", True))  # fmt: skip
            self.w.sched.log(f"register {src} claim={c}")
            self._apply(self.state.register_shard(src, host=src, pid=inc, address=src,
                                                  now=now, claim=c, refused=refused))  # fmt: skip
        elif kind == "hb":
            _, f = msg
            shard = self.state.shards.get(src)
            if shard is None:
                self.send(src, ("reregister",))
                return
            self.state.report(src, lsn=f["lsn"], epoch=f["epoch"], in_sync=f["in_sync"],
                              durable=f["durable"], t=f["t"])  # fmt: skip
            self._keep()
            role, partition, epoch = self.state.lease_echo(src)
            self.send(src, ("echo", f["t"], role.value, partition, epoch))
        elif kind == "bye":
            self.detector.forget(src)
            self._apply(self.state.node_gone(src, now, planned=True))
        self._publish()

    def _forward(self, client: str, frames: list[Any]) -> None:
        """``_route``: the broker's one forwarding rule (:func:`zps.broker.routes.route`)
        over the route table of the last map; a primary the network cannot reach is
        refused as the real broker refuses a send with no connection (NOT_PRIMARY)."""
        req = unpack_route(frames[0])
        p = req.partition
        target = route(self.routes, p, holding=self.state.holding(self.w.sched.now))
        reply = Route(MsgType.REPLY, p, req.epoch, req.req_id)
        if isinstance(target, NoRoute):
            floor = self.state.floor_of(p) if target is NoRoute.LOST else None
            body = StatusReply(*refusal(target, p, floor)).to_wire()
        elif (primary := target.decode()) not in self.w.net.up:
            msg = f"the primary of partition {p} is unreachable"
            body = StatusReply(Status.NOT_PRIMARY, msg).to_wire()
        else:
            self.send(primary, ("request", client, frames))
            return
        self.send(client, ("reply", encode(reply, body), self.name))


@dataclass
class _Upstream:
    primary: str
    epoch: int


class SimShard:
    @property
    def term(self) -> int:
        """The highest broker term obeyed (a pair's shards keep one: PairShard)."""
        return 0

    def __init__(self, world: World, name: str) -> None:
        self.w = world
        self.name = name
        self.disk = world.new_disk(name)
        self.alive = False
        self.gen = 0
        self.writing = False
        self.was_durable: tuple[int | None, int] | None = None

    # -- life ----------------------------------------------------------------

    def start(self) -> bool:
        w, now = self.w, self.w.sched.now
        self.gen += 1
        self.core = ShardCore(clock=lambda: w.sched.now)
        self.session: ShardSession[Reply] = ShardSession(
            self.name, heartbeat_interval=HB, liveness=LIVE, checkpoint_every_updates=40,
            checkpoints=True, min_in_sync=w.min_in_sync, now=now,
        )  # fmt: skip
        self.dur = Durability("fsync", segment_bytes=SEGMENT)
        self.dur.on_durable = self._durable
        self.dur.on_lost = self._on_lost
        self.store = CheckpointStore(self.disk.root, keep=2)
        self.upstream: _Upstream | None = None
        self.writing = False
        self.waiting_since: dict[int, float] = {}  # LSN -> when it began to wait for replicas
        try:
            found, wal = restore(self.core, self.store, log_segment_bytes=SEGMENT)
        except CheckpointError as e:
            w.sched.log(f"{self.name} start refused: {e}")
            w.notices.append(("error", f"{self.name} start refused: {e}"))
            return False
        if self.was_durable is not None:
            p, lsn = self.was_durable
            got = (found.partition, found.lsn) if found is not None else None
            if lsn > 0 and (got is None or got[0] != p or got[1] < lsn):
                w.fail(f"{self.name} restarted with {got} (partition, LSN) where its log had "
                       f"partition {p} synced to LSN {lsn}: a synced record was lost")  # fmt: skip
        if found is not None:
            if wal is not None:
                self.dur.adopt(wal, found.partition)
            self.core.primary = False
            self.session.restore(found.partition, found.epoch, found.lsn, now,
                                 complete=found.complete)  # fmt: skip
            w.sched.log(f"{self.name} restored p{found.partition} e{found.epoch} "
                        f"lsn {found.lsn} complete={found.complete}")  # fmt: skip
        self.alive = True
        w.net.attach(self.name, self.on_message)
        self._register()
        gen = self.gen
        w.sched.after(HB * w.sched.rng.random(), lambda: self._beat(gen))
        return True

    def crash(self) -> None:
        self.alive = False
        self.w.net.detach(self.name)
        self.gen += 1
        wal = self.dur._wal
        if wal is not None:
            wal.close(sync=False)  # the process is gone: no sync on the way out

    def _register(self, refused: tuple[int | None, int] | None = None) -> None:
        claim = self.session.claim(self.core.lsn)
        self.send("broker", ("register", claim, self.gen, refused))

    def send(self, node: str, msg: Any) -> None:
        self.w.net.send(self.name, node, msg)

    def _live(self, gen: int) -> bool:
        return self.alive and gen == self.gen

    # -- timers (_heartbeat_loop, Upstream._ask) ------------------------------

    def _beat(self, gen: int) -> None:
        if not self._live(gen):
            return
        if self.name not in self.w.net.paused:
            now = self.w.sched.now
            self._report()
            tick = self.session.tick(now, requests=self.core.stats.requests, lsn=self.core.lsn)
            for node in tick.lagging:
                self._drop(node, "no acknowledgement for a liveness timeout")
            self._check_stall(now)
            if tick.checkpoint:
                self._checkpoint()
            elif tick.ack_upstream and self.upstream is not None:
                self._ack_now()
            if self.upstream is not None and self.session.subscribe_due(now):
                self._ask()
            self._pump()
        self.w.sched.after(HB, lambda: self._beat(gen))

    def _check_stall(self, now: float) -> None:
        """A write waits for replicas at most until the broker drops the silent ones: a
        primary whose lease the broker keeps renewing never holds one for STALL seconds."""
        waiting = self.session.tracker._waiting
        if not waiting:
            self.waiting_since.clear()
            return
        lsn = waiting[0][0]
        for old in [k for k in self.waiting_since if k < lsn]:
            del self.waiting_since[old]
        since = self.waiting_since.get(lsn, now)
        if now - since > STALL and self.session.may_write(now):
            required = sorted(self.session.tracker.required)
            self.w.fail(
                f"{self.name}: a write at LSN {lsn} has waited for the replicas "
                f"{now - since:.2f}s (required: {required})"
            )
            self.waiting_since[lsn] = now  # reported once per STALL

    def _report(self) -> None:
        f = self.session.heartbeat_fields(self.w.sched.now)
        f["lsn"] = self.core.lsn
        f["in_sync"] = f.get("in_sync")
        f["durable"] = min(self.dur.durable, self.core.lsn) if self.dur.waits else None
        self.send("broker", ("hb", f))

    def _ask(self) -> None:
        assert self.upstream is not None
        sub = (self.session.partition, self.session.epoch)
        self.send(self.upstream.primary, ("subscribe", *sub))
        self.session.subscribe_sent(self.w.sched.now)

    # -- the log's writer (Durability.run) -------------------------------------

    def _pump(self) -> None:
        if self.writing or not self.dur._queue or not self.alive:
            return
        self.writing = True
        gen = self.gen
        latency = 0.002 + self.w.sched.rng.random() * 0.01 + self.disk.slow
        self.w.sched.after(latency, lambda: self._write(gen))

    def _write(self, gen: int) -> None:
        if not self._live(gen):
            return
        if self.name in self.w.net.paused:
            self.w.sched.after(0.01, lambda: self._write(gen))
            return
        d = self.dur
        batch, d._queue = d._queue, []
        generation = d._generation
        try:
            lsn = d._write(batch)
        except WalLost as e:
            self.writing = False
            d._lose(d._wal.lost if d._wal and d._wal.lost else str(e))
            return
        except OSError as e:
            d.stats.errors += 1
            self.w.sched.log(f"{self.name} log write failed ({e}); retry")
            d._queue = batch[d._done :] + d._queue
            self.w.sched.after(RETRY_S, lambda: self._retry(gen))
            return
        self.writing = False
        if generation == d._generation and lsn is not None:
            d.durable = max(d.durable, lsn)
            # What this log synced (fsync mode): a restart must find it again.
            self.was_durable = (d.partition, d.durable)
        d._release()
        if d.on_durable is not None and d.waits:
            d.on_durable()
        self._pump()

    def _retry(self, gen: int) -> None:
        if self._live(gen):
            self.writing = False
            self._pump()

    def _on_lost(self, why: str) -> None:
        """ShardServer._on_log_lost: leave the role (BYE) and exit; the service
        manager starts it again."""
        self.w.sched.log(f"{self.name} log lost: {why}; leaves and exits")
        self.send("broker", ("bye",))
        refused = self.session.left()
        self._refuse(refused, "NOT_PRIMARY", "the primary stepped down")
        self.w.stop_shard(self, restart_after=1.0)

    def _durable(self) -> None:
        if self.upstream is not None and self.session.synced:
            self._ack_now()

    # -- messages ------------------------------------------------------------

    def on_message(self, src: str, msg: Any) -> None:
        kind = msg[0]
        s, now = self.session, self.w.sched.now
        if src == "broker" and s.broker_seen(now):
            pass
        if kind == "assign":
            self._assign(msg[1])
        elif kind == "echo":
            s.echoed(msg[1], msg[2], msg[3], msg[4])
        elif kind == "map":
            self._on_map(msg[1])
        elif kind == "reregister":
            if not s.leaving:
                self._register()
        elif kind == "request":
            self._request(msg[1], msg[2])
        elif kind == "subscribe":
            self._subscribe(src, msg[1], msg[2])
        elif kind == "ack":
            self._on_ack(src, msg[1], msg[2], msg[3])
        elif kind == "snapshot":
            self._on_snapshot(src, msg[1])
        elif kind == "stream":
            self._on_stream(src, msg[1], msg[2], msg[3], msg[4], msg[5])
        elif kind == "bye" and self.upstream is not None and src == self.upstream.primary:
            s.resync()
        self._pump()

    def _assign(self, a: BrokerAssignment) -> None:
        change = self.session.assign(
            a.role, a.partition, a.epoch, a.primary_address, lsn=self.core.lsn, term=self.term
        )
        if change.register_again:
            self.w.sched.log(f"{self.name} refuses primary p={a.partition} e={a.epoch}")
            self._register(refused=(a.partition, a.epoch))
            return
        if not change.changed:
            return
        self.w.sched.log(f"{self.name} assigned {a.role.value} p={a.partition} e={a.epoch}")
        self._refuse(change.refused, "NOT_PRIMARY", "the primary stepped down")
        if a.partition != change.was[1]:
            self.was_durable = None  # another partition's log from now on
        if change.stop_following:
            self.upstream = None
        if a.role is Role.PRIMARY:
            self.core.assign(a.partition, a.epoch, primary=True)
            self._log_as_primary()
            self._report()
        elif a.role is Role.REPLICA:
            self.core.assign(a.partition, a.epoch, primary=False)
            if change.follow:
                self.upstream = _Upstream(change.follow, a.epoch)
                self.session.upstream_started()
                self._ask()
        else:
            self.core.assign(None, 0)

    def _log_as_primary(self) -> None:
        d, p = self.dur, self.core.partition
        if p is None or d.continues(p, self.core.lsn):
            return
        d.start(self.store.folder(p), p, self.core.lsn)
        if self.core.lsn > 0:
            self._checkpoint()

    def _checkpoint(self) -> None:
        core = self.core
        if core.partition is None or not self.session.begin_checkpoint(self.w.sched.now, core.lsn):
            return
        snap = core.snapshot()
        self.dur.roll()
        try:
            path = self.store.write(finish(snap))
        except OSError as e:
            self.w.sched.log(f"{self.name} checkpoint failed: {e}")
            return
        oldest = self.store.oldest_lsn(snap.partition)
        self.dur.checkpointed(snap.partition, snap.lsn if oldest is None else oldest)
        self.w.sched.log(f"{self.name} checkpoint {path.name}")

    def _on_map(self, cmap: Any) -> None:
        p = self.session.partition
        info = cmap.partitions.get(p) if p is not None else None
        if info is not None:
            self._apply_waiting(
                self.session.on_map(info.epoch, set(info.in_sync), set(info.replicas))
            )

    def _apply_waiting(self, done: MapResult[Reply]) -> None:
        self._release(done.released)
        self._refuse(done.refused, "NOT_ENOUGH_REPLICAS", "too few copies in sync")

    def _release(self, replies: list[Reply]) -> None:
        for client, frames in replies:
            self._post(client, frames)

    def _post(self, client: str, frames: list[Any]) -> None:
        self.send("broker", ("reply", client, frames))

    def _refuse(self, waiting: list[Reply], status: str, why: str) -> None:
        for client, frames in waiting:
            route = unpack_route(frames[0])
            refusal = encode(Route(MsgType.REPLY, route.partition, route.epoch, route.req_id),
                             {"st": status, "msg": why})  # fmt: skip
            self._post(client, refusal)

    # -- primary side (ShardServer._request, primary.Stream) ---------------------

    def _request(self, client: str, frames: list[Any]) -> None:
        route = unpack_route(frames[0])
        reply_route = Route(MsgType.REPLY, route.partition, self.core.epoch, route.req_id)
        msg = decode(frames, route=route)
        mutates = any(op.get("op") in MUTATIONS for op in msg.header["ops"])
        refusal = None
        if not self.session.may_write(self.w.sched.now):
            refusal = {"st": "NOT_PRIMARY", "msg": "the primary's lease has run out"}
        elif mutates and not self.session.enough_in_sync():
            refusal = {"st": "NOT_ENOUGH_REPLICAS", "msg": "too few copies in sync"}
        if refusal is not None:
            self._post(client, encode(reply_route, refusal))
            return
        prev = self.core.lsn
        done = self.core.handle_request(route, msg.header, msg.payloads)
        reply, changed = done.reply, done.changed
        d = self.dur
        if not changed:
            if done.duplicate and mutates:
                lsn, epoch = self.core.lsn, self.core.epoch
                d.after(lsn, lambda: self._logged_write(lsn, epoch, (client, reply)))
            elif d.waits and d.durable < self.core.lsn and mutates:
                d.after(self.core.lsn, lambda: self._post(client, reply))
            else:
                self._post(client, reply)
            return
        lsn, epoch = self.core.lsn, self.core.epoch
        self.w.on_write_taken(self, route.partition, epoch)
        for node in sorted(self.session.followers):
            self.send(node, ("stream", epoch, prev, lsn, list(frames[1:]), self.core.last_clean))
        d.log(epoch, prev, lsn, list(frames[1:]))
        d.after(lsn, lambda: self._logged_write(lsn, epoch, (client, reply)))

    def _logged_write(self, lsn: int, epoch: int, item: Reply) -> None:
        if self.core.primary and self.core.epoch == epoch and self.session.role is Role.PRIMARY:
            self.waiting_since.setdefault(lsn, self.w.sched.now)
            self._release(self.session.add_write(lsn, item))
        else:
            self._refuse([item], "NOT_PRIMARY", "the primary stepped down")

    def _subscribe(self, node: str, partition: object, epoch: object) -> None:
        if not self.session.accepts_subscription(node, partition, epoch):
            self.send(node, ("bye",))
            return
        snap = self.core.snapshot()
        self.session.subscribed(node, snap.lsn, self.w.sched.now)
        self.send(node, ("snapshot", snap))

    def _on_ack(self, node: str, lsn: int, epoch: int, base: int) -> None:
        s = self.session
        if node not in s.followers:
            if s.accepts_subscription(node, s.partition, s.epoch):
                self.send(node, ("bye",))
            return
        if node not in s.replicas:
            self._drop(node, "no longer a replica of this partition")
            return
        result = s.acked(node, lsn, epoch, self.w.sched.now, base)
        if result.in_sync:
            self._report()
        self._release(result.released)

    def _drop(self, node: str, why: str) -> None:
        if self.session.follower_gone(node):
            self.w.sched.log(f"{self.name} drops follower {node}: {why}")
            self.send(node, ("bye",))
            self._report()
        self._apply_waiting(self.session.settle())

    # -- replica side (replica.Upstream) ----------------------------------------

    def _on_snapshot(self, src: str, snap: Any) -> None:
        up, core = self.upstream, self.core
        if up is None or src != up.primary:
            return
        ok = snap.epoch == core.epoch and snap.partition == core.partition
        if ok and snap.lsn > 0:
            try:  # _keep: the snapshot is the base of this replica's log
                self.store.write(finish(snap))
            except OSError as e:
                self.w.sched.log(f"{self.name} could not keep the snapshot: {e}")
                return
        if ok:
            core.load_snapshot(snap)
            self.dur.start(self.store.folder(snap.partition), snap.partition, snap.lsn)
        self.session.snapshot_loaded(ok, snap.lsn)
        if ok and self.session.synced:
            self._ack_now()

    def _on_stream(
        self, src: str, epoch: int, prev: int, lsn: int, payloads: list[Any], checked: bool
    ) -> None:
        up, core = self.upstream, self.core
        if up is None or src != up.primary or not self.session.synced:
            return
        verdict = check_stream(my_epoch=core.epoch, my_lsn=core.lsn, epoch=epoch,
                               prev_lsn=prev, lsn=lsn)  # fmt: skip
        if verdict is StreamCheck.DUPLICATE:
            return
        if verdict is StreamCheck.RESYNC:
            self.session.resync()
            return
        try:
            header = decode([Route(MsgType.REQUEST).pack(), payloads[0]]).header
            got = core.apply_replicated(header, payloads[1:], checked=checked)
        except (ZpsError, KeyError, ValueError):
            self.session.resync()
            return
        if got != lsn:
            self.session.resync()
            return
        self.dur.log(epoch, prev, lsn, payloads)
        self._ack_now()  # Upstream._after_burst: each message here is a burst of one

    def _ack_now(self) -> None:
        assert self.upstream is not None
        lsn = self.dur.acked_lsn(self.core.lsn)
        self.send(self.upstream.primary, ("ack", lsn, self.core.epoch, self.session.base_lsn))
