"""One simulated run: the cluster, the fault schedule drawn from the seed, the checks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zps.protocol.messages import Role
from zps.testing.sim import checks, clientnet, routernet, shardnet, shmnet, simtransport
from zps.testing.sim import disk as simdisk
from zps.testing.sim.aioloop import SimLoop
from zps.testing.sim.checks import Result
from zps.testing.sim.faults import FAULTS, NAMED, RESET, STORAGE
from zps.testing.sim.net import HWM, Network
from zps.testing.sim.nodes import HB, HOLD, LIVE, TICK, SimBroker, SimShard
from zps.testing.sim.pair import BROKERS, PEER_TIMEOUT, PairBroker, PairClient, PairShard
from zps.testing.sim.realbroker import RealBroker, WireClient, WireShard
from zps.testing.sim.realclient import RealClient
from zps.testing.sim.realpair import RealPairBroker, WirePairClient, WirePairShard
from zps.testing.sim.realrouter import RealRouter, hosts
from zps.testing.sim.realshard import RealShard
from zps.testing.sim.sched import Scheduler, quiet_gc
from zps.testing.sim.simclient import Op, SimClient

#: The brokers of a pair: the stand-in's, or the real ones (--real-broker).
PAIRED = (PairBroker, RealPairBroker)
#: Bounds on what any queue may hold (the "queues bounded" check).
QUEUE_BOUND = 2000


class World:
    def __init__(
        self,
        seed: int,
        *,
        faults: Iterable[str] = FAULTS,
        trace: bool = False,
        n_shards: int = 5,
        n_partitions: int = 2,
        replication: int = 2,
        n_clients: int = 2,
        rows: int = 6,
        duration: float = 12.0,
        timeout: float = 3.0,
        real_broker: bool = False,
        real_shard: bool = False,
        real_client: bool = False,
    ) -> None:
        self.seed = seed
        self.faults = set(faults)
        unknown = self.faults - set(NAMED)
        if unknown:
            known = ", ".join(NAMED)
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {known}")
        if "reshard" in self.faults:
            if not real_client:
                raise ValueError("the reshard fault needs the real clients (real_client; "
                                 "the stand-ins send each row to a fixed partition)")  # fmt: skip
            # Spares for the third partition's copies (and the partitions' shards).
            n_shards = max(n_shards, 2 * 3)
        if "routers" in self.faults and not real_client:
            raise ValueError("the routers fault needs the real clients (real_client; "
                             "the stand-ins have no links to routing brokers)")  # fmt: skip
        if self.faults & set(STORAGE) and not (real_shard or real_client):
            raise ValueError("the efbig and rot faults need the real shards (real_shard; "
                             "the stand-ins keep no files)")  # fmt: skip
        if "reset" in self.faults and not real_client:
            raise ValueError("the reset fault needs the real clients (real_client; the "
                             "stand-ins do not send again what a connection lost)")  # fmt: skip
        if "shm" in self.faults and not (real_shard or real_client):
            raise ValueError("the shm fault needs the real shards (real_shard; the "
                             "stand-ins have no shared memory)")  # fmt: skip
        self.sched = Scheduler(seed, trace=trace)
        self.net = Network(self.sched)
        self.n_partitions = n_partitions
        self.rows = rows
        self.duration = duration
        self.timeout = timeout
        #: acks="all" needs every copy (2) or the primary alone while a replica is out
        #: of sync (1, the default): drawn per seed.
        self.min_in_sync = replication if self.sched.rng.random() < 0.5 else 1
        self.ops: list[Op] = []
        self.notices: list[tuple[str, str]] = []
        self.failures: list[str] = []
        self.schedule: list[str] = []
        self.acks: dict[tuple[int, int], set[str]] = {}
        self.pair = "failover" in self.faults
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        self.tmp = Path(tempfile.mkdtemp(prefix="zps-sim-", dir=base))
        self.sched.redact = f"{self.tmp}/"
        self.os = simdisk.SimOS()
        self.os.clock = lambda: 1.7e9 + self.sched.now  # file times in the run's time
        #: The real broker (zps.testing.sim.realbroker) on the run's one event loop, and
        #: the real shards (zps.testing.sim.realshard), which need it, and the real
        #: clients (zps.testing.sim.realclient), which need both.
        self.real_client = real_client
        self.real_shard = real_shard = real_shard or real_client
        self.real_broker = real_broker = real_broker or real_shard
        self.loop: SimLoop | None = None
        self.client_cls: type[SimClient] | type[RealClient] = SimClient
        #: The id of each row (the real client routes ids by the map's slots).
        self.row_ids: list[int] | None = None
        self.brokers: list[SimBroker | RealBroker]
        shard_cls: type[SimShard] | type[RealShard]
        prefix = "s"
        if real_broker and self.pair:
            self.brokers = [RealPairBroker(self, n, n_partitions, replication) for n in BROKERS]
            shard_cls = WirePairShard
            self.client_cls = WirePairClient
            prefix = "s-"
        elif real_broker:
            self.brokers = [RealBroker(self, n_partitions, replication)]
            shard_cls = WireShard
            self.client_cls = WireClient
            prefix = "s-"  # the broker tells shards from clients by their identity
        elif self.pair:
            self.brokers = [PairBroker(self, name, n_partitions, replication) for name in BROKERS]
            shard_cls = PairShard
            self.client_cls = PairClient
        else:
            self.brokers = [SimBroker(self, n_partitions, replication)]
            shard_cls = SimShard
        self.broker = self.brokers[0]
        if real_shard:
            shard_cls = RealShard
        if real_client:
            self.client_cls = RealClient
        self.shards: list[Any] = [shard_cls(self, f"{prefix}{i}") for i in range(n_shards)]
        self.shard_names = {s.name for s in self.shards}
        #: With ``routers``: each shard's host (two a host) and a routing broker on each
        #: host (zps.testing.sim.realrouter); else each shard is its own host, no router.
        self.hosts: dict[str, str] = {}
        self.routers: list[RealRouter] = []
        if "routers" in self.faults:
            self.hosts = hosts([s.name for s in self.shards])
            self.routers = [
                RealRouter(self, f"r{i}", host)
                for i, host in enumerate(sorted(set(self.hosts.values())))
            ]
        self.clients: list[Any] = [
            self.client_cls(self, f"c{i}", timeout=timeout) for i in range(n_clients)
        ]
        # A data dir lost with min_in_sync 1 may hold the only copy of acknowledged writes.
        self.wipes_left = 1 if self.min_in_sync > 1 else 0
        self.quiet_until = 0.0
        #: When the first fault other than a connection reset struck: until then a
        #: write must succeed (the product makes a reset connection again at once and
        #: sends again what it lost).
        self.only_resets_until = math.inf
        self.readers: list[Any] = []
        #: A primary took a write while repairing (the real shard's
        #: ``write_while_repairing``: acknowledged once the copies in sync hold it, the
        #: primary alone included), so a data dir may hold the only copy of acknowledged
        #: writes whatever min_in_sync says: no wipe from then on (--real-client).
        self.written_alone = False
        #: With ``shm``: what the shared-memory path does in this run (drawn last, so
        #: the draws before it are those of a run without it).
        self.shm = shmnet.ShmDraw.draw(self.sched.rng) if "shm" in self.faults else None
        self.shm_os: shmnet.ShmOS | None = None

    def shm_host(self, name: str) -> str:
        """The host key of process ``name`` (:mod:`.shmnet`)."""
        return self.hosts.get(name, shmnet.ONE_HOST)

    def new_disk(self, name: str) -> simdisk.Disk:
        d = simdisk.Disk(self.tmp / name, self.sched.rng)
        self.os.disks.append(d)
        return d

    # -- the checks --------------------------------------------------------------

    def fail(self, what: str) -> None:
        self.sched.log(f"CHECK FAILED: {what}")
        self.failures.append(f"t={self.sched.now:.3f} {what}")

    def on_outcome(self, op: Op) -> None:
        if op.at > op.deadline + TICK:
            self.fail(f"{op.client} request to p{op.partition} answered at {op.at:.3f}, "
                      f"after its deadline {op.deadline:.3f}")  # fmt: skip
        self.sched.log(f"{op.client} p{op.partition} row {op.row} +{op.grad}: {op.outcome} "
                       f"by {op.shard}@{op.epoch}")  # fmt: skip
        if op.outcome == "acked" and op.row >= 0:
            self.acks.setdefault((op.partition, op.epoch), set()).add(op.shard)

    def on_write_taken(self, shard: SimShard, partition: int, epoch: int) -> None:
        """``shard`` took a write of ``partition`` at ``epoch`` (to acknowledge once its
        copies hold it): no other shard may, at this moment, be a primary of it that
        could do the same (a role of that partition and a lease that has not run out)."""
        now = self.sched.now
        if self.real_client and shard.session.repairing:
            self.written_alone = True
        for other in self.shards:
            s = other.session if other.alive else None
            if (
                other is not shard
                and s is not None
                and s.role is Role.PRIMARY
                and s.partition == partition
                and s.may_write(now)
            ):
                self.fail(
                    f"two primaries of p{partition} take writes at once: {shard.name} "
                    f"(epoch {epoch}) and {other.name} (epoch {s.epoch})"
                )

    def check_queues(self) -> None:
        sizes: dict[str, int] = {"net": self.net.max_inflight}
        for s in self.shards:
            if s.alive:
                sizes[f"{s.name}.tracker"] = len(s.session.tracker)
                sizes[f"{s.name}.log-queue"] = len(s.dur._queue)
                sizes[f"{s.name}.log-waiters"] = len(s.dur._waiters)
        for c in self.clients:
            if c.alive:
                sizes[f"{c.name}.in-flight"] = len(c.session)
        for what, n in sizes.items():
            if n > (HWM if what == "net" else QUEUE_BOUND):
                self.fail(f"queue {what} holds {n}")
        if self.sched.now < self.end:
            self.sched.after(0.5, self.check_queues)

    # -- faults ------------------------------------------------------------------

    def stop_shard(self, shard: SimShard, *, restart_after: float, power: bool = False,
                   wipe: bool = False) -> None:  # fmt: skip
        if not shard.alive:
            return
        shard.crash()
        if power:
            cut = shard.disk.crash(torn=self.sched.rng.random() < 0.5)
            self.sched.log(f"{shard.name} power loss: {cut}")
        if wipe:
            shard.disk.wipe()
            shard.was_durable = None
        gen = shard.gen
        self.sched.after(restart_after, lambda: self._restart(shard, gen))

    def _restart(self, shard: SimShard, gen: int) -> None:
        if shard.gen == gen and not shard.alive:
            self.sched.log(f"{shard.name} restarts")
            if not shard.start():
                self.sched.after(1.0, lambda: self._restart(shard, shard.gen))

    def draw_schedule(self) -> None:
        rng = self.sched.rng
        kinds = sorted(self.faults)
        if not kinds:
            return
        t = 1.5
        while True:
            t += rng.expovariate(1 / 1.2)
            if t > self.duration - 1:
                break
            weights = [3 if k == "crash-all" else 1 for k in kinds]
            kind = rng.choices(kinds, weights)[0]
            self.sched.at(t, functools.partial(self.inject, kind))

    def note(self, text: str) -> None:
        line = f"t={self.sched.now:.3f} {text}"
        self.schedule.append(line)
        self.sched.log(f"FAULT {text}")

    def inject(self, kind: str) -> None:
        rng = self.sched.rng
        if self.sched.now < self.quiet_until:
            # A broker without its record rebuilds the map from the shards' claims
            # (docs/design.md, "Broker restart"): nothing else fails meanwhile.
            return
        if kind not in RESET:
            self.only_resets_until = min(self.only_resets_until, self.sched.now)
        shard = rng.choice(self.shards)
        back = rng.uniform(0.2, 3.0)
        no_wipe = self.wipes_left <= 0 or self.written_alone
        if kind in ("kill", "power") or (kind == "wipe" and no_wipe):
            if not shard.alive:
                return
            self.note(f"{kind if kind != 'wipe' else 'kill'} {shard.name}, back in {back:.2f}s")
            self.stop_shard(shard, restart_after=back, power=kind == "power")
        elif kind == "wipe":
            if not shard.alive:
                return
            self.wipes_left -= 1
            self.note(f"kill {shard.name} and wipe its data dir, back in {back:.2f}s")
            self.stop_shard(shard, restart_after=back, wipe=True)
        elif kind == "rot":
            # On a copy with more than its LOCK file: a log, a checkpoint, its state.
            held = [s for s in self.shards if s.alive and s.disk.files() > 1]
            if not held or no_wipe:
                return
            shard = rng.choice(held)
            self.wipes_left -= 1
            if rng.random() < 0.5:
                self.stop_shard(shard, restart_after=back)
                how = f"kill {shard.name}, back in {back:.2f}s,"
            else:  # found as every copy starts again, competing for its partition
                self.inject("crash-all")
                how = f"while every process is down, on {shard.name}"
            flipped = shard.disk.rot()
            shard.was_durable = None  # its log may end before the flipped bit now
            self.note(f"{how} flip {flipped}")
        elif kind == "efbig":
            for target in rng.sample(self.shards, rng.randint(1, 3)):
                n = rng.randint(1, 3)
                target.disk.efbig += n
                self.note(f"{target.name}: next {n} log writes fail part-way with EFBIG")
        elif kind == "pause":
            node = rng.choice([s.name for s in self.shards] + [b.name for b in self.brokers])
            if node not in self.net.up or node in self.net.paused:
                return
            length = rng.uniform(HB * LIVE + 0.1, 2.0)
            self.note(f"pause {node} for {length:.2f}s")
            self.net.pause(node)
            self.sched.after(length, lambda: self.net.resume(node))
        elif kind == "partition":
            names = [s.name for s in self.shards] + [b.name for b in self.brokers]
            names += [c.name for c in self.clients]
            a, b = rng.sample(names, 2)
            one_way = rng.random() < 0.5
            pairs = {(a, b)} if one_way else {(a, b), (b, a)}
            pairs -= self.net.cut
            length = rng.uniform(0.2, 3.0)
            self.note(f"cut {a} {'->' if one_way else '<->'} {b} for {length:.2f}s")
            self.net.cut |= pairs
            self.sched.after(length, lambda: self._heal(pairs))
        elif kind == "disk":
            for target in rng.sample(self.shards, rng.randint(1, 3)):
                if rng.random() < 0.7:
                    n = rng.randint(1, 3)
                    target.disk.enospc += n
                    self.note(f"{target.name}: next {n} log writes fail part-way with ENOSPC")
                else:
                    target.disk.fsync_eio += 1
                    self.note(f"{target.name}: next fsync fails with EIO")
        elif kind == "pause-crash":
            # A copy falls behind (paused past the liveness timeout), catches up again,
            # and the whole cluster loses power while it does.
            length = rng.uniform(HB * LIVE + 0.1, 1.5)
            node = shard.name
            if node not in self.net.up or node in self.net.paused:
                return
            self.note(f"pause {node} for {length:.2f}s, then the whole cluster loses power")
            self.net.pause(node)
            self.sched.after(length, lambda: self.net.resume(node))
            self.sched.after(
                length + rng.uniform(0.05, 1.5), functools.partial(self.inject, "crash-all")
            )
        elif kind == "idle":
            length = rng.uniform(1.0, 3.0)
            self.note(f"the clients stop pushing for {length:.2f}s")
            for c in self.clients:
                c.idle_until = self.sched.now + length
        elif kind == "crash-all":
            self.note("whole cluster loses power")
            for br in self.brokers:
                br.stop(keep_record=True)
            for s in self.shards:
                self.stop_shard(s, restart_after=rng.uniform(0.1, 3.0), power=True)
            for br in self.brokers:
                self.sched.after(rng.uniform(0.1, 1.5), functools.partial(self._start, br))
            for r in self.routers:  # on the shards' hosts
                r.stop()
                back = rng.uniform(0.1, 3.0)
                self.sched.after(back, functools.partial(self._router_back, r, r.starts))
        elif kind == "failover":
            self._failover()
        elif kind == "reshard":
            self._reshard()
        elif kind == "slow":
            self._slow()
        elif kind == "routers":
            self._router_fault()
        elif kind == "shm":
            self._shm_fault()
        elif kind == "reset":
            self._reset()
        elif kind == "client":
            client = rng.choice(self.clients)
            if not client.alive:
                return
            self.note(f"kill {client.name}, back in {back:.2f}s")
            client.crash()
            self.sched.after(back, functools.partial(self._client_back, client))
        elif kind == "broker":
            if not self.broker.alive:
                return
            keep = rng.random() < 0.7 or not self._shards_settled()
            if not keep:
                self.quiet_until = self.sched.now + back + HOLD + 2.0
            self.note(f"broker restarts {'with' if keep else 'WITHOUT'} its record in {back:.2f}s")
            self.broker.stop(keep_record=keep)
            self.sched.after(back, self._broker_back)

    def _shm_fault(self) -> None:
        """Every region of one process's arena (a shard's or a client's) not yet said
        read is reused now: its readers find it so, as a reader slower than the owner's
        reclaim time does, and the message is sent again."""
        rng = self.sched.rng
        procs = [p for p in [*self.shards, *self.clients] if p.alive and shmnet.memory_of(p)]
        if not procs:
            return
        target = rng.choice(procs)
        n = shmnet.reuse_all(shmnet.memory_of(target))
        self.note(f"{target.name}: {n} regions of its shared memory reused at once")

    def _reset(self) -> None:
        """Every connection between two processes closes and is made again at once: two
        with messages on their way, if any are."""
        net = self.net
        pairs = simtransport.connections(net)
        if not pairs:
            return
        busy = [(a, b) for a, b in pairs if net.on_the_way(a, b) or net.on_the_way(b, a)]
        a, b = self.sched.rng.choice(busy or pairs)
        lost, again = simtransport.reset(net, a, b)
        self.note(f"reset the connections {a} <-> {b}: {lost} messages lost, "
                  f"{len(again)} made again")  # fmt: skip

    def _shards_settled(self) -> bool:
        """Whether every shard is up and nothing that keeps its claim from the broker is
        under way: none paused, reading slowly or not at all, cut off from a broker, nor
        with a disk fault still to strike or a slow disk.  A broker restarts without its
        record only then: it has only the shards' claims (docs/design.md, "Broker
        restart"), so a copy it does not hear from during its hold (a shard that reads
        nothing for longer), or one that fails meanwhile, lets an older copy take the
        partition first, and the newer one that comes back is held as a conflict for the
        operator.  Cuts between shards, or towards clients and routers, carry no claim."""
        names = {s.name for s in self.shards}
        others = names | {c.name for c in [*self.clients, *self.readers]}
        others |= {r.name for r in self.routers}
        net = self.net
        return (
            all(s.alive for s in self.shards)
            and not names & (net.paused | set(net.slow))
            and not any(
                (a in names and b not in others) or (b in names and a not in others)
                for a, b in net.cut
            )
            and not any(
                s.disk.enospc or s.disk.efbig or s.disk.fsync_eio or s.disk.slow
                for s in self.shards
            )
        )

    def _router_fault(self) -> None:
        """A routing broker is killed (back in 0.2-3 s), paused past the liveness
        timeout, or cut off (one way or both) from a client, a shard or a broker."""
        rng = self.sched.rng
        r = rng.choice(self.routers)
        how = rng.choice(("kill", "pause", "partition"))
        if how == "kill":
            if not r.alive:
                return
            back = rng.uniform(0.2, 3.0)
            self.note(f"kill the router {r.name}, back in {back:.2f}s")
            r.stop()
            self.sched.after(back, functools.partial(self._router_back, r, r.starts))
        elif how == "pause":
            if r.name not in self.net.up or r.name in self.net.paused:
                return
            length = rng.uniform(HB * LIVE + 0.1, 2.0)
            self.note(f"pause the router {r.name} for {length:.2f}s")
            self.net.pause(r.name)
            self.sched.after(length, functools.partial(self.net.resume, r.name))
        else:
            others = [c.name for c in self.clients] + [s.name for s in self.shards]
            other = rng.choice(others + [b.name for b in self.brokers])
            way = rng.choice(("->", "<-", "<->"))
            pairs = {(r.name, other)} if way == "->" else {(other, r.name)}
            if way == "<->":
                pairs.add((r.name, other))
            pairs -= self.net.cut
            length = rng.uniform(0.2, 3.0)
            self.note(f"cut the router {r.name} {way} {other} for {length:.2f}s")
            self.net.cut |= pairs
            self.sched.after(length, lambda: self._heal(pairs))

    def _router_back(self, router: RealRouter, starts: int) -> None:
        """A router killed (after start number ``starts``) starts again, unless it did."""
        if router.starts == starts and not router.alive:
            router.start()

    def _reshard(self) -> None:
        """The operator asks the serving broker to scale to 1, 2 or 3 partitions (as
        ``zps-server scale --partitions N`` does), or, while a scaling is under way, to
        cancel it; the broker's process takes the command when it runs (held while it is
        paused), and the answer goes to the trace."""
        rng = self.sched.rng
        b = self.serving()
        if not isinstance(b, RealBroker) or not b.alive or b.broker is None or b.proc is None:
            return
        broker = b.broker
        under_way = broker.reshard.record is not None
        if under_way and rng.random() < 0.3:
            self.note(f"cancel the scaling under way at {b.name}")
            command = broker.reshard.cancel
        else:
            current = broker.state.n_partitions
            target = rng.choice([n for n in (1, 2, 3) if n != current])
            self.note(f"scale {b.name}'s cluster from {current} to {target} partitions")
            command = functools.partial(self._scale, broker, target)

        def take() -> None:
            if b.broker is broker and b.alive:
                answer = command()
                self.sched.log(f"{b.name} answers the operator: {answer.get('msg')}")

        assert self.loop is not None
        self.loop.call_soon(take, context=b.proc.context.copy())

    def _scale(self, broker: Any, target: int) -> dict[str, Any]:
        answer: dict[str, Any] = broker.reshard.request(target, self.sched.now)
        return answer

    def _failover(self) -> None:
        """The active broker of the pair is killed (back with its data dir), paused past
        the peer timeout, or cut off from its peer and the clients (not the shards)."""
        rng = self.sched.rng
        active = [b for b in self.brokers if isinstance(b, PAIRED) and b.active]
        if not active:
            return
        b = max(active, key=lambda b: b.star.term)
        how = rng.choice(("kill", "pause", "isolate"))
        length = rng.uniform(PEER_TIMEOUT + 0.2, 2.5)
        if how == "kill":
            self.note(f"kill the active broker {b.name}, back in {length:.2f}s")
            b.stop(keep_record=True)
            self.sched.after(length, functools.partial(self._start, b))
        elif how == "pause":
            if b.name in self.net.paused:
                return
            self.note(f"pause the active broker {b.name} for {length:.2f}s")
            self.net.pause(b.name)
            self.sched.after(length, lambda: self.net.resume(b.name))
        else:
            others = [b.peer] + [c.name for c in self.clients]
            pairs = {(b.name, x) for x in others} | {(x, b.name) for x in others}
            pairs -= self.net.cut
            self.note(f"cut the active broker {b.name} off from its peer and the clients "
                      f"for {length:.2f}s")  # fmt: skip
            self.net.cut |= pairs
            self.sched.after(length, lambda: self._heal(pairs))

    def _slow(self) -> None:
        """A shard or client reads slowly (one message every 10-300 ms) or not at all for
        a while (up to 5 s, past STALL), its timers running; or a shard's disk takes
        50-500 ms a log write."""
        rng = self.sched.rng
        how = rng.choice(("slow", "deaf", "disk"))
        # Longer than STALL at times: a peer that does not read must be dropped first.
        length = rng.uniform(0.5, 3.0) if how != "deaf" else rng.uniform(1.0, 5.0)
        if how == "disk":
            shard = rng.choice(self.shards)
            if shard.disk.slow:
                return
            shard.disk.slow = rng.uniform(0.05, 0.5)
            self.note(f"{shard.name}'s disk takes {shard.disk.slow:.3f}s a log write "
                      f"for {length:.2f}s")  # fmt: skip
            self.sched.after(length, functools.partial(setattr, shard.disk, "slow", 0.0))
            return
        node = rng.choice([s.name for s in self.shards] + [c.name for c in self.clients])
        if node in self.net.slow:
            return
        gap = rng.uniform(0.01, 0.3) if how == "slow" else math.inf
        what = f"reads a message every {gap:.3f}s" if how == "slow" else "reads nothing"
        self.note(f"{node} {what} for {length:.2f}s")
        self.net.slow_down(node, gap)
        self.sched.after(length, functools.partial(self.net.speed_up, node))

    def serving(self) -> SimBroker | RealBroker:
        """The broker whose map counts: the active one of the pair with the newest term."""
        active = [b for b in self.brokers if isinstance(b, PAIRED) and b.active]
        return max(active, key=lambda b: b.star.term) if active else self.broker

    def _start(self, broker: SimBroker | RealBroker) -> None:
        if not broker.alive:
            broker.start()

    def _client_back(self, client: SimClient) -> None:
        if not client.alive:
            client.start()

    def _broker_back(self) -> None:
        for b in self.brokers:
            self._start(b)

    def _heal(self, pairs: set[tuple[str, str]]) -> None:
        self.net.heal(pairs)

    # -- the run -----------------------------------------------------------------

    def run(self) -> Result:
        with quiet_gc():
            return self._run_quietly()

    def _run_quietly(self) -> Result:
        saved = simdisk.install(self.os)
        logging.disable(logging.CRITICAL)  # the nodes' logs: the trace says what happened
        seams = self._real_broker_seams() if self.real_broker else None
        try:
            return self._run()
        finally:
            if seams is not None:
                self._end_loop(seams)
            simdisk.uninstall(saved)
            logging.disable(logging.NOTSET)
            for s in self.shards:
                wal = getattr(getattr(s, "dur", None), "_wal", None)
                if wal is not None and wal._fd is not None:
                    self.os.close(wal._fd)
                    wal._fd = None
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _real_broker_seams(self) -> simtransport.Saved:
        """The run's one event loop, on the scheduler's clock, and the real broker's
        transport and clock seams (zps.testing.sim.simtransport)."""
        net = self.net
        loop = self.loop = SimLoop(self.sched, net.paused.__contains__)
        net.on_resume = loop.thaw
        asyncio.events._set_running_loop(loop)
        seams = simtransport.install(net, RealBroker.name, watch="reset" in self.faults)
        if self.real_shard:
            seams += shardnet.install()
        if self.real_client:
            seams += clientnet.install()
        if self.routers:
            seams += routernet.install()
        if self.shm is not None:
            saved, self.shm_os = shmnet.install(self.seed, self.shm, self.shm_host)
            seams += saved
        return seams

    def _end_loop(self, seams: simtransport.Saved) -> None:
        loop = self.loop
        assert loop is not None
        try:
            for c in [*self.clients, *self.readers]:
                if isinstance(c, RealClient):
                    c.end()
            for r in self.routers:
                r.end()
            for s in self.shards:
                if isinstance(s, RealShard):
                    s.end()
            for b in self.brokers:
                if isinstance(b, RealBroker):
                    b.end()
            loop.settle()
            # What the run left unreachable (a killed process's coroutines) is finalized
            # now, through the seams, not by the next run's first collection without them;
            # so is a task still pending (its cleanup waits on what a dead process never
            # gets), which a failed run's report may keep reachable for a while.
            gc.collect()
            for task in asyncio.all_tasks(loop):
                coro: Any = task.get_coro()
                # RuntimeError: it awaited again in its cleanup; nothing more of it runs.
                with contextlib.suppress(RuntimeError):
                    coro.close()
        finally:
            if self.shm_os is not None:
                shmnet.close_all([*self.shards, *self.clients, *self.readers])
                self.shm_os.end()
            simtransport.uninstall(seams)
            asyncio.events._set_running_loop(None)
            loop.close()

    def _run(self) -> Result:
        sched = self.sched
        settle = self.timeout + 6.0
        self.end = self.duration + settle + self.timeout + 2.0
        for b in self.brokers:
            b.start()
        for r in self.routers:
            r.start()
        for s in self.shards:
            sched.after(sched.rng.uniform(0, 0.3), functools.partial(self._restart, s, s.gen))
        for c in self.clients:
            c.start()
            c.pushing = True
        self.draw_schedule()
        sched.after(0.5, self.check_queues)
        sched.run_until(self.duration)
        # Heal: every fault ends, every node runs again; the clients stop pushing.
        sched.log("HEAL")
        self.net.heal(set(self.net.cut))
        for node in sorted(self.net.paused):  # a set: in a fixed order, not the hash seed's
            self.net.resume(node)
        for node in sorted(self.net.slow):
            self.net.speed_up(node)
        for s in self.shards:
            s.disk.enospc = s.disk.efbig = s.disk.fsync_eio = 0
            s.disk.slow = 0.0
        for c in self.clients:
            c.pushing = False
            self._client_back(c)
        self._broker_back()
        for r in self.routers:
            self._router_back(r, r.starts)
        for s in self.shards:
            if not s.alive:
                s.start()
        sched.run_until(self.duration + settle)
        reader = self.client_cls(self, "reader", timeout=self.timeout)
        self.readers.append(reader)
        reader.start()
        reads: list[Op] = []
        probes: list[Op] = []

        def read() -> None:
            for p in range(self.n_partitions):
                rows = [r for r in range(self.rows) if r % self.n_partitions == p]
                reads.append(reader.read(p, rows))
                if "reshard" not in self.faults:
                    probes.append(reader.probe(p))
            if "reshard" in self.faults:
                # The partitions are the final map's (scaled to 1, 2 or 3).
                probes.extend(reader.probe(p) for p in sorted(self.serving().state.map.partitions))

        sched.after(0.2, read)
        sched.run_until(self.end)
        for r in self.routers:
            counted = r.counted()
            sched.log(f"{r.name} routed {counted['routed']} requests, {counted['replies']} "
                      f"replies, refused {counted['not_routed']} not routed and "
                      f"{counted['undeliverable']} undeliverable")  # fmt: skip
        return self._verdict(reads, probes)

    def _copies_differ(self) -> list[str]:
        """The real shards' copies at the end: each replica the final map has in sync
        with its partition's primary, at the primary's LSN, holds the same tables (specs,
        values, optimizer state)."""
        real = {s.name: s for s in self.shards if isinstance(s, RealShard) and s.alive}
        copies = {
            name: (s.server.core.partition, s.server.core.lsn, s.server.core.store)
            for name, s in real.items()
            if s.server is not None
        }
        cmap = self.serving().state.map
        return checks.copies_differ(cmap, copies)

    def _verdict(self, reads: list[Op], probes: list[Op]) -> Result:
        now = self.sched.now
        for error in self.loop.errors if self.loop is not None else []:
            self.fail(f"a callback of the event loop raised: {error}")
        ops = self.ops
        for what in checks.stalled(self.serving().state.map, probes):
            self.fail(what)
        for what in checks.failed_with_only_resets(ops, self.only_resets_until):
            self.fail(what)
        for what in checks.unanswered(ops, now):
            self.fail(what)
        for what in self._copies_differ():
            self.fail(what)
        acked, maybe = checks.sums(ops, self.rows)
        unavailable = []
        for op in reads:
            if op.outcome != "acked":
                unavailable.append(op.partition)
                self.sched.log(f"final read of p{op.partition}: {op.outcome}")
                continue
            for what in checks.misread(op, acked, maybe):
                self.fail(what)
        return Result(
            self.seed, self.failures, self.schedule, self.sched.digest, self.sched.events,
            sum(1 for o in ops if o.outcome == "acked"),
            sum(1 for o in ops if o.outcome != "acked"), unavailable, now,
            self.sched.lines,
        )  # fmt: skip


def run_seed(seed: int, **kw: Any) -> Result:
    return World(seed, **kw).run()
