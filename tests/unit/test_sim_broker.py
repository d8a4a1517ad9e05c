"""The real broker (zps.broker.broker.Broker, unchanged) on the simulator's event loop,
transport and clock (zps/testing/sim: aioloop, simtransport, realbroker).

A harness runs the broker alone with scripted shards speaking the real frames: they
register, are assigned, and a shard that falls silent is declared dead after the
liveness timeout of simulated time and its replica promoted, with no real sleeping.
Then whole simulated runs (``--real-broker``): a budget of seeds passes every check,
the same seed gives the same trace, and the known defects of the broker's rules are
caught with the real broker driving them."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tests.unit.simcases import Runs, assert_same_run
from zps.broker.broker import Broker
from zps.core.routing import ClusterMap
from zps.ops.config import BrokerConfig, Heartbeat
from zps.protocol.codec import MsgType, Route, decode, encode, unpack_route
from zps.protocol.control import ShardHeartbeat, ShardRegister
from zps.protocol.messages import Assign, MapUpdate, RegisterAgain, Role
from zps.shard.links import from_broker
from zps.testing.sim import simtransport
from zps.testing.sim.aioloop import Proc, SimLoop
from zps.testing.sim.checks import Result
from zps.testing.sim.cli import main
from zps.testing.sim.net import Network
from zps.testing.sim.realbroker import RealBroker
from zps.testing.sim.realpair import RealPairBroker
from zps.testing.sim.sched import Scheduler
from zps.testing.sim.world import World, run_seed

pytestmark = pytest.mark.timeout(600)

#: The product's heartbeat: every 0.2 s, a peer silent for 5 of them (1 s) is dead.
INTERVAL, LIVENESS = 0.2, 5


def seeds_ahead(sim: Runs) -> None:
    """The runs this module's tests ask for, handed to the pool with the session's first
    test (tests/conftest.py)."""
    sim.ahead(BUDGET, real_broker=True)
    sim.ahead(REAL_REGRESSIONS, real_broker=True)
    sim.ahead(PAIR_BUDGET, PAIR_FAULTS, real_broker=True)
    for mix, seeds in PAIR_SEEDS.items():
        sim.ahead(seeds, mix.split(","), real_broker=True)
    for seed, faults in REAL_PAIR_REGRESSIONS:
        sim.ahead([seed], faults, real_broker=True)
    sim.ahead_catches(BROKER_BUGS, real_broker=True)
    sim.ahead_catches(PAIR_BUGS, real_broker=True)


class Harness:
    """The real broker alone on a simulated network, loop and clock; shards are scripts."""

    def __init__(self, seed: int, data_dir: Path) -> None:
        self.sched = Scheduler(seed, trace=True)
        self.net = Network(self.sched)
        self.loop = SimLoop(self.sched, self.net.paused.__contains__)
        self.net.on_resume = self.loop.thaw
        asyncio.events._set_running_loop(self.loop)
        self.saved = simtransport.install(self.net, "broker")
        config = BrokerConfig(
            bind="sim://broker",
            partitions=1,
            replication=2,
            startup_grace=0.3,
            heartbeat=Heartbeat(interval=INTERVAL, liveness=LIVENESS),
            data_dir=str(data_dir),
        )
        self.broker = Broker(config)
        self.proc = Proc("broker")
        self.task = self.loop.spawn(self.proc, self.broker.run())

    def close(self) -> None:
        try:
            self.broker.stop()
            self.loop.settle()
            self.sched.run_until(self.sched.now + 0.1)
        finally:
            simtransport.uninstall(self.saved)
            asyncio.events._set_running_loop(None)
            self.loop.close()


class ScriptedShard:
    """A shard as the broker sees it: REGISTER, then a HEARTBEAT every interval (a
    primary's naming its partition's replicas in sync), the ASSIGNs and MAPs kept."""

    def __init__(self, h: Harness, name: str) -> None:
        self.h, self.name = h, name
        self.role, self.partition, self.epoch = Role.SPARE, None, 0
        self.replicas: list[str] = []
        self.assigned: list[tuple[float, str, int | None, int]] = []
        h.net.attach(name, self.on_message)
        h.sched.after(INTERVAL * h.sched.rng.random(), self.register)
        h.sched.after(INTERVAL * h.sched.rng.random(), self.beat)

    def register(self) -> None:
        self.send(MsgType.REGISTER, ShardRegister(host=self.name, address=self.name).to_wire())

    def send(self, mtype: MsgType, header: dict[str, Any]) -> None:
        self.h.net.send(self.name, "broker", [b"", *encode(Route(mtype), header)])

    def beat(self) -> None:
        h = self.h
        if self.name not in h.net.paused:
            primary = self.role is Role.PRIMARY
            beat = ShardHeartbeat(
                t=h.sched.now,
                epoch=self.epoch,
                in_sync=tuple(self.replicas) if primary else None,
                durable=0,
            )
            self.send(MsgType.HEARTBEAT, beat.to_wire())
        h.sched.after(INTERVAL, self.beat)

    def on_message(self, src: str, frames: list[Any]) -> None:
        route = unpack_route(frames[1])
        match from_broker(route.mtype, decode(frames[1:]).header):
            case Assign(role, partition, epoch):
                self.role, self.partition, self.epoch = role, partition, epoch
                self.assigned.append((self.h.sched.now, role.value, partition, epoch))
                self.h.sched.log(f"{self.name} assigned {role.value} p={partition} e={epoch}")
            case MapUpdate(m):
                info = ClusterMap.from_wire(m).partitions.get(self.partition or 0)
                self.replicas = list(info.replicas) if info is not None else []
            case RegisterAgain():
                self.register()
            case _:
                pass


def _run_failover(seed: int, data_dir: Path) -> tuple[Harness, dict[str, ScriptedShard], float]:
    h = Harness(seed, data_dir)
    try:
        shards = {n: ScriptedShard(h, n) for n in ("s-a", "s-b", "s-c")}
        h.sched.run_until(5.0)
        primary = next(s for s in shards.values() if s.role is Role.PRIMARY)
        paused_at = h.sched.now
        h.net.pause(primary.name)  # silent, its connection still up: only the timeout tells
        h.sched.run_until(paused_at + 25.0)
    finally:
        h.close()
    return h, shards, paused_at


def test_the_real_broker_fails_over_on_simulated_time(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    h, shards, paused_at = _run_failover(3, tmp_path / "a")
    wall = time.perf_counter() - t0
    assert not h.loop.errors and not h.task.exception()
    # Each registered as a spare; once the start-up hold (0.3 s) ended, one was made
    # the primary and one its replica.
    roles = {
        n: [a for a in s.assigned if a[1] != "spare" and a[0] < paused_at]
        for n, s in shards.items()
    }
    assert all(a[0] >= 0.3 for given in roles.values() for a in given)
    firsts = {n: given[0][1] for n, given in roles.items() if given}
    assert sorted(firsts.values()) == ["primary", "replica"]
    old = next(n for n, role in firsts.items() if role == "primary")
    replica = next(n for n, role in firsts.items() if role == "replica")
    promoted = [a for a in shards[replica].assigned if a[1] == "primary"]
    assert promoted, shards[replica].assigned
    t, _, partition, epoch = promoted[0]
    assert (partition, epoch) == (0, 2)
    # Declared dead one liveness timeout after the last heartbeat it sent (within a
    # heartbeat before the pause), on the broker's half-interval timer.
    timeout = INTERVAL * LIVENESS
    assert timeout - INTERVAL <= t - paused_at <= timeout + INTERVAL, t - paused_at
    assert old not in h.broker.state.shards
    # The spare took the replica's place.
    (spare,) = set(shards) - {old, replica}
    assert shards[spare].assigned[-1][1:] == ("replica", 0, 2)
    # 30 s of simulated time, none of it slept.
    assert h.sched.now >= 30.0 and wall < 0.2 * h.sched.now, wall


def test_the_same_seed_gives_the_same_trace(tmp_path: Path) -> None:
    a, _, _ = _run_failover(11, tmp_path / "a")
    b, _, _ = _run_failover(11, tmp_path / "b")
    c, _, _ = _run_failover(12, tmp_path / "c")
    assert a.sched.lines and a.sched.digest == b.sched.digest and a.sched.lines == b.sched.lines
    assert c.sched.digest != a.sched.digest


def test_a_paused_broker_runs_nothing_until_it_resumes(tmp_path: Path) -> None:
    h = Harness(7, tmp_path)
    heard: list[float] = []
    try:
        shards = {n: ScriptedShard(h, n) for n in ("s-a", "s-b", "s-c")}
        for shard in shards.values():
            handler = shard.on_message

            def spy(src: str, frames: list[Any], handler: Any = handler) -> None:
                heard.append(h.sched.now)
                handler(src, frames)

            h.net.handlers[shard.name] = spy
        h.sched.run_until(3.0)
        before = {n: list(s.assigned) for n, s in shards.items()}
        h.net.pause("broker")  # SIGSTOP: its timers stop too, its peers keep beating
        h.sched.run_until(5.0)
        h.net.resume("broker")
        h.sched.run_until(8.0)
    finally:
        h.close()
    assert not h.loop.errors
    # Nothing came from it while it was stopped (what it had sent before arrives within
    # the network's delay), and it came back with every node alive: its own stall is not
    # its peers' silence.
    assert not [t for t in heard if 3.01 < t < 5.0]
    assert [t for t in heard if t > 5.0]
    assert {n: s.assigned for n, s in shards.items()} == before
    assert len(h.broker.state.shards) == 3


def test_a_run_drives_the_real_broker() -> None:
    w = World(1, real_broker=True)
    (broker,) = w.brokers
    assert isinstance(broker, RealBroker)
    r = w.run()
    assert r.ok, r.failures[:3]
    assert isinstance(broker.broker, Broker) and r.acked > 0
    assert r.sim_seconds > 20


def test_a_seed_replays_exactly_in_any_process(sim: Runs) -> None:
    a = run_seed(5, real_broker=True)
    b, c = sim.results([5, 6], real_broker=True)
    assert_same_run(a, b)
    assert a.schedule and c.digest != a.digest


#: Seeds of the default faults that must pass with the real broker.
BUDGET = range(0, 15)


def test_the_real_broker_passes_every_check_on_the_budget(sim: Runs) -> None:
    sim.passing(BUDGET, real_broker=True)


#: Seeds of the default faults on which the current code fails a check with the real
#: broker, kept as expected failures until it is fixed.
REAL_KNOWN: dict[int, str] = {}

#: Seeds of the default faults on which the real broker found a defect, fixed: they must
#: pass.  166: a claim granted during the start-up hold made its shard the partition's
#: only recorded member, so the other member, at the same LSN and made its replica, was
#: not elected when the new primary died before it caught up (the partition was lost and
#: the copy made a spare, its claim forgotten); after a broker restart without its record
#: an empty shard took the partition.
REAL_REGRESSIONS = (166,)


def test_real_broker_seeds_that_found_defects_pass(sim: Runs) -> None:
    sim.passing(REAL_REGRESSIONS, real_broker=True)


@pytest.mark.parametrize("seed", sorted(REAL_KNOWN))
def test_known_real_broker_defects_stay_found(seed: int) -> None:
    r = run_seed(seed, real_broker=True)
    if not r.ok:
        pytest.xfail(f"seed {seed}: {REAL_KNOWN[seed]}: {r.failures[0]}")
    raise AssertionError(f"seed {seed} passes now: remove it from REAL_KNOWN")


#: The known defects of the broker's own rules (zps.core.cluster, run by the real broker
#: here), the faults that expose them and the seeds they must be caught within (the rule
#: for a budget: tests/unit/simcases.py; older-copy-wins is first caught at seed 7).
BROKER_BUGS = {
    "older-copy-wins": ("pause-crash", range(7, 17)),
    "empty-shard-takes-partition": ("crash-all,broker,kill", range(0, 10)),
}


@pytest.mark.parametrize("bug", sorted(BROKER_BUGS))
def test_broker_defects_are_caught_with_the_real_broker(bug: str, sim: Runs) -> None:
    faults, seeds = BROKER_BUGS[bug]
    sim.caught(bug, faults, seeds, real_broker=True)


def test_the_cli_runs_the_real_broker(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--seeds", "1", "--seed", "9", "--faults", "pause-crash", "--real-broker"]
    assert main(args) == 0
    assert main([*args, "--bug", "older-copy-wins"]) == 1
    out = capsys.readouterr().out
    assert "seed 9: FAILED" in out
    assert "--seed 9 --seeds 1 --trace --real-broker --bug older-copy-wins" in out


# -- the real broker pair (--real-broker --faults failover,...) ------------------------

#: The broker pair's faults (tests/unit/test_sim.py: PAIR_FAULTS).
PAIR_FAULTS = ["failover", "kill", "power", "pause", "partition", "disk", "broker", "wipe"]


def test_a_run_drives_the_real_pair() -> None:
    w = World(1, real_broker=True, faults=["failover"], trace=True)
    assert [type(b) for b in w.brokers] == [RealPairBroker, RealPairBroker]
    primary, backup = w.brokers
    assert isinstance(primary, RealPairBroker) and isinstance(backup, RealPairBroker)
    r = w.run()
    assert r.ok, r.failures[:3]
    assert r.acked > 0 and r.sim_seconds > 20
    # The real Pair ran both sides, and the active broker was replaced more than once:
    # killed, paused and cut off, the standby took over (its term new each time).
    assert any("kill the active broker" in s for s in r.schedule), r.schedule
    takeovers = [line for line in r.trace if "-> active at term" in line]
    assert len(takeovers) >= 3, takeovers
    assert any(line.split()[1] == "backup:" for line in takeovers)
    assert any("follows backup" in line for line in r.trace)
    # The standby wrote the record it was sent to its data dir (it takes over with it).
    assert any("start (record: True)" in line for line in r.trace)


def test_a_pair_seed_replays_exactly_in_any_process(sim: Runs) -> None:
    a = run_seed(3, faults=PAIR_FAULTS, real_broker=True)
    b, c = sim.results([3, 4], PAIR_FAULTS, real_broker=True)
    assert_same_run(a, b)
    assert a.schedule and c.digest != a.digest


#: Seeds of the pair's faults that must pass with the real pair.
PAIR_BUDGET = range(0, 10)


def test_the_real_pair_passes_every_check_on_the_budget(sim: Runs) -> None:
    sim.passing(PAIR_BUDGET, PAIR_FAULTS, real_broker=True)


#: The seeds on which the simulator found the pair's defects with the stand-in pair
#: (tests/unit/test_sim.py: PAIR_REGRESSIONS, LONG_PAIR_REGRESSIONS), run with the real
#: pair (another run: the real broker's messages and timers differ): they must pass.
PAIR_SEEDS = {
    "failover,kill,power,pause,partition,disk,broker,crash-all": (56, 64, 66),
    "failover,kill,power,pause,partition,disk,broker,crash-all,wipe": (2173, 4094),
}


@pytest.mark.parametrize("faults", sorted(PAIR_SEEDS))
def test_the_pair_regression_seeds_pass_with_the_real_pair(faults: str, sim: Runs) -> None:
    sim.passing(PAIR_SEEDS[faults], faults.split(","), real_broker=True)


LONG_PAIR_FAULTS = [*PAIR_FAULTS[:-1], "crash-all", "wipe"]

#: Seeds of the long run's pair faults (LONG_PAIR_FAULTS) on which the current code fails a
#: check with the real pair, kept as expected failures until it is fixed.  Replay: python -m
#: zps.testing.sim --seed SEED --seeds 1 --trace --real-broker --faults
#: failover,kill,power,pause,partition,disk,broker,crash-all,wipe
REAL_PAIR_KNOWN: dict[int, str] = {}

#: Seeds of the pair's faults (PAIR_FAULTS) on which the current code fails a check with
#: the real pair, kept as expected failures.  Replay: python -m zps.testing.sim --seed SEED
#: --seeds 1 --trace --real-broker --faults failover,kill,power,pause,partition,disk,broker,wipe
REAL_PAIR_KNOWN_SHORT: dict[int, str] = {}

#: Seeds on which the real pair lost acknowledged writes, fixed: they must pass.
#:
#: 231 (LONG_PAIR_FAULTS): a primary broker that starts after a whole-cluster power loss and
#: hears no peer within the peer timeout takes over with its own data dir's record when a
#: client asks (BinaryStar: no peer answered at start), though the backup, starting 1.07 s
#: after it, holds the newer one (it served at term 4 after the primary was killed): rule 5,
#: the newer record takes over, holds only for brokers that hear each other at start.  The
#: older record names s-3 in p1's in-sync set (LSN 83, killed since); it is granted p1 at
#: epoch 1 and s-1 (LSN 124, in sync at term 4) made its replica at that epoch, taking its
#: history: the writes acknowledged past LSN 83 at term 4 were lost.  Now (BinaryStar rules
#: 7 and 8) the lone takeover holds for the whole grace, the backup's record of term 4 (and
#: the shards' kept term 4) marks the record stale, its in-sync sets bind no more, and s-1's
#: newer copy takes p1 from s-3 during the hold.
#:
#: 294 (PAIR_FAULTS): as seed 231: the primary broker, restarted while the active backup
#: (term 4) is paused past the peer timeout, hears no peer and takes over at term 5 with its
#: own older record (term 3), whose in-sync set for p0 still names s-2; s-2, its log lost
#: since (EIO) and back at LSN 151, was granted p0 at epoch 1: the writes s-1 acknowledged
#: alone at term 4 were lost.  The shards report term 4: the record is stale at the takeover.
#:
#: 318 (PAIR_FAULTS): the primary broker, restarted while the active backup is cut off from
#: it and the clients, took over at term 3 with its older record and routed writes at once;
#: when the cut healed the backup read the beats it held (the first from before that
#: takeover, 'the peer restarted') and took over at term 4, its maps v20-v22 naming s-3
#: p1's primary alone in sync (releasing the writes that waited for s-4, cut off from s-3
#: since 8.24) before its own claim put s-4 back in sync (v23); when s-3's log was lost
#: (EIO) s-4 was elected at epoch 3 without them.  Now the lone takeover routes nothing
#: before its grace ends (rule 8), both takeovers know their records stale (rule 7), and a
#: replica registering after its primary's grant is in sync on its own word only if it
#: holds the primary's granted copy (recovery.says_in_sync).
#:
#: 318 (LONG_PAIR_FAULTS): with a stale record's floors dropped too, the backup taking
#: over at term 6 from its record of term 3 gave p1 to s-1 (LSN 57) while s-3, which had
#: acknowledged writes to LSN 62 at term 3, was down: a stale record's floor is a bound
#: still (recovery.unpin keeps it; recovery.distrust only stops it vouching for a claim
#: below the partition's epoch).
#:
#: 413 (LONG_PAIR_FAULTS): partition 1 was lost (no in-sync replica left) and its replica
#: made a spare, dropping its copy; after three whole-cluster power losses the writes only
#: that copy held were gone.  A lost partition's replicas are held now, never made spares
#: (recovery.hold_copies; tests/unit/test_sim_long_runs.py, seed 105879).
#:
#: 9 (failover,kill,power,disk): the broker taking over at term 3 granted a restarted
#: shard partition 0 on its claim while the other broker's assignment in flight (term 2)
#: made it a spare, its data let go: it served the partition empty.  A shard refuses a
#: grant on data it let go at another term and registers again naming it
#: (ShardSession.assign, ClusterState.register_shard's ``refused``).
#:
#: 31 (PAIR_FAULTS): the simulator's own: an empty log segment made as its folder's sync
#: failed kept a wall-clock time, and the restart took its partition for the newest.
REAL_PAIR_REGRESSIONS = [
    (9, ["failover", "kill", "power", "disk"]),
    (31, PAIR_FAULTS),
    (231, LONG_PAIR_FAULTS),
    (294, PAIR_FAULTS),
    (318, PAIR_FAULTS),
    (318, LONG_PAIR_FAULTS),
    (413, LONG_PAIR_FAULTS),
]


@pytest.fixture(scope="module")
def pair_regressions(sim: Runs) -> dict[tuple[int, int], Future[Result]]:
    """Every seed's run, submitted to the workers at once."""
    return {
        (seed, len(faults)): sim.submit(seed, faults, real_broker=True)
        for seed, faults in REAL_PAIR_REGRESSIONS
    }


@pytest.mark.parametrize(("seed", "faults"), REAL_PAIR_REGRESSIONS)
def test_real_pair_seeds_that_found_defects_pass(
    seed: int, faults: list[str], pair_regressions: dict[tuple[int, int], Future[Result]]
) -> None:
    r = pair_regressions[seed, len(faults)].result()
    assert r.ok, (seed, r.failures[:3], r.schedule)


KNOWN_PAIR_SEEDS = [(s, LONG_PAIR_FAULTS) for s in sorted(REAL_PAIR_KNOWN)] + [
    (s, PAIR_FAULTS) for s in sorted(REAL_PAIR_KNOWN_SHORT)
]


@pytest.mark.parametrize(("seed", "faults"), KNOWN_PAIR_SEEDS)
def test_known_real_pair_defects_stay_found(seed: int, faults: list[str]) -> None:
    why = {**REAL_PAIR_KNOWN, **REAL_PAIR_KNOWN_SHORT}[seed]
    r = run_seed(seed, faults=faults, real_broker=True)
    if not r.ok:
        pytest.xfail(f"seed {seed}: {why}: {r.failures[0]}")
    raise AssertionError(f"seed {seed} passes now: remove it from REAL_PAIR_KNOWN")


#: The pair's known defects in the real code paths (zps.testing.sim.realbugs, and
#: BinaryStar itself), the faults that expose them and the seeds they must be caught in
#: (the rule for a budget: tests/unit/simcases.py; each from seed 0 or from the seed it is
#: first caught at, to ten past it).  A promoted primary writes only once the broker
#: echoes its new role (ShardSession.assign ends a replica's lease), and that echo waits for
#: the standby's copy of the record: a defect that keeps the standby from holding it leaves
#: the partition unavailable rather than losing writes in most runs, so
#: standby-without-record is caught at seed 3 and pair-primary-first at seed 76.
#: pair-map-before-standby is caught at seed 14 of kills and failovers (at seed 234 of
#: power losses and failovers, 104 of pauses: with BinaryStar rules 7 and 8 and a
#: replica's own word of being in sync counting only before its primary's grant, a
#: standby's record one map behind loses writes in few runs).  pair-unfenced is caught
#: at seed 0 with cut links (at seed 43 with kills: a takeover holds until every
#: recorded copy is back).
PAIR_BUGS = {
    "standby-without-record": ("failover,kill,power", range(0, 4)),
    "pair-unfenced": ("failover,pause,partition", range(0, 20)),
    "pair-primary-first": ("failover,power,crash-all,broker", range(76, 86)),
    "pair-map-before-standby": ("failover,kill", range(14, 24)),
}


@pytest.mark.parametrize("bug", sorted(PAIR_BUGS))
def test_pair_defects_are_caught_with_the_real_pair(bug: str, sim: Runs) -> None:
    faults, seeds = PAIR_BUGS[bug]
    sim.caught(bug, faults, seeds, real_broker=True)


def test_the_cli_runs_the_real_pair(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--seeds", "1", "--seed", "3", "--faults", "failover,kill,power", "--real-broker"]
    assert main(args) == 0
    assert main([*args, "--bug", "standby-without-record"]) == 1
    out = capsys.readouterr().out
    assert "seed 3: FAILED" in out
    assert "--real-broker --bug standby-without-record --faults failover,kill,power" in out
