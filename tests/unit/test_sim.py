"""The cluster simulator (zps/testing/sim): a fixed budget of seeds over the current code,
each known defect caught when patched in, and runs replayed exactly from their seeds.

The seeds of a test run side by side in two worker processes (the machinery of the CLI's
``--jobs``), reported in seed order: each seed's run is the same in any process, so what
a test finds does not depend on which worker ran it."""

from __future__ import annotations

import pytest

from tests.unit.simcases import Runs, assert_same_run, failures
from zps.testing.sim import bugs, realbugs
from zps.testing.sim.cli import main, parser
from zps.testing.sim.faults import FAULTS
from zps.testing.sim.world import run_seed

pytestmark = pytest.mark.timeout(600)


#: Seeds (of the CI budget, or of a long run of the default faults) on which the current
#: code fails a check, with what it is (tests below keep each one as an expected failure
#: until it is fixed).
KNOWN: dict[int, str] = {}
BUDGET = range(0, 100)
#: Seeds on which the simulator found a defect, fixed since: each must pass.
#: 70 and 1032-1343: a replica whose full disk kept it acknowledging one LSN held
#: acks="all" writes for ever (a replica with no progress for the liveness timeout is
#: dropped now); 1015: a promoted copy that took no write came back from a power loss
#: at its old epoch and was refused against its own floor; 157: a shard whose log was lost
#: (EIO on fsync of the folder) restarted, replayed a record its predecessor never synced
#: and appended after it in a new segment: a power loss then took the record back and
#: every synced record after it with it (the log now syncs what it replayed first);
#: 1528: after a power loss the replica came back behind what its primary confirmed and
#: was made a spare, given to the other partition, and the primary's lost data dir then
#: held the only copy of acknowledged writes (such a copy follows its primary now);
#: 12978 (a long run): after a whole-cluster power loss the old primary was granted its
#: partition again at its epoch with LSN 43 while its replica held LSN 50 of that epoch
#: and a checkpoint at 50 of those unacknowledged records; the replica took the primary's
#: snapshot at 43 and logged on from it, but its checkpoint at 50 stayed the newest, so
#: its next restart restored the other history and replayed the new log after it (a
#: checkpoint committed now removes those named after it).
REGRESSIONS = (70, 157, 1015, 1032, 1049, 1112, 1185, 1200, 1235, 1293, 1343, 1528, 12978)

#: The broker pair (--faults failover,...): a budget of seeds that must pass, and seeds on
#: which the current code fails, kept as expected failures until it is fixed.
PAIR_FAULTS = ["failover", "kill", "power", "pause", "partition", "disk", "broker", "wipe"]
PAIR_BUDGET = range(0, 15)
KNOWN_PAIR: dict[int, str] = {}
#: Seeds of --faults KNOWN_PAIR_FAULTS on which the simulator found a pair defect, fixed
#: since: each must pass.  56, 64: a pair restarted whole took over with the primary
#: broker's record though the backup served after it (the newer record takes over now);
#: 66: a takeover started from the standby's record, a beat older than the map the active
#: broker had published, and elected a copy at the old floor over the primary that took
#: acknowledged writes since (a map goes out only once the standby holds it now).
PAIR_REGRESSIONS = (56, 64, 66)
KNOWN_PAIR_FAULTS = [
    "failover",
    "kill",
    "power",
    "pause",
    "partition",
    "disk",
    "broker",
    "crash-all",
]

#: The faults drawn only when named, slow and non-reading peers and slow disks, and
#: clients killed and started again: a budget of seeds that must pass (a peer that reads
#: slowly or not at all never holds others' writes past STALL).
NAMED_ONLY_FAULTS = ["slow", "client", "kill", "power", "pause", "partition", "disk"]
NAMED_ONLY_BUDGET = range(0, 20)

#: Seeds of the long run's pair faults (--faults LONG_PAIR_FAULTS) on which the simulator
#: failed, fixed since: each must pass.  2173: the simulated active broker renewed a
#: promoted primary's lease before its standby held the record naming the new epoch (the
#: real broker's echo waits for Pair.after_held); the standby took over with the older
#: floor and in-sync set, and gave the partition to the old primary's copy, which lacked
#: what the promoted one had acknowledged.
LONG_PAIR_FAULTS = [*KNOWN_PAIR_FAULTS, "wipe"]
LONG_PAIR_REGRESSIONS = (2173, 4094)
#: 4094: the standby, paused past the peer timeout while the active broker gave p0 to s4
#: at epoch 3, read a client's request before the beats queued for it when it resumed,
#: took over at once (its peer silent by its own clock) from its record of epoch 2 and
#: gave p0 to s0 at epoch 2: the writes s4 acknowledged at epoch 3 were lost.  Fixed by
#: BinaryStar rule 6 (a broker's own pause is not its peer's silence).
#: Seeds of LONG_PAIR_FAULTS on which the current code fails, kept as expected failures.
LONG_KNOWN_PAIR: dict[int, str] = {}

#: Each defect, the faults that expose it and the seeds it must be caught within (the rule
#: for a budget: tests/unit/simcases.py).  Those that start past seed 0 start at the first
#: seed that catches the defect with the stand-in: pair-map-before-standby at seed 149 of
#: failover,power (the stand-in pair's record one map behind loses writes in few runs, as
#: the real pair's does: test_sim_broker.PAIR_BUGS), pair-primary-first at 53,
#: pair-unfenced at 22 and older-copy-wins at 10 (of pause-crash, whose runs are the
#: longest; the real broker catches the same rule's defect at seed 7: test_sim_broker).
CATCH: dict[str, tuple[str, range]] = {
    "empty-shard-takes-partition": ("crash-all,broker,kill", range(0, 10)),
    "wal-retry-partial": ("disk,crash-all,kill,power", range(0, 30)),
    "ack-before-durable": ("crash-all,kill,partition", range(0, 10)),
    "older-copy-wins": ("pause-crash", range(10, 20)),
    "stale-replica-in-tracker": ("pause,idle", range(0, 14)),
    "standby-without-record": ("failover,kill,power", range(0, 8)),
    "pair-unfenced": ("failover,pause", range(22, 32)),
    "pair-primary-first": ("failover,power,crash-all,broker", range(53, 63)),
    "pair-map-before-standby": ("failover,power", range(149, 159)),
    "stuck-replica-kept": ("slow", range(0, 6)),
}


def seeds_ahead(sim: Runs) -> None:
    """The runs this module's tests ask for, handed to the pool with the session's first
    test (tests/conftest.py)."""
    sim.ahead(seed for seed in BUDGET if seed not in KNOWN)
    sim.ahead(REGRESSIONS)
    sim.ahead(PAIR_BUDGET, PAIR_FAULTS)
    sim.ahead(PAIR_REGRESSIONS, KNOWN_PAIR_FAULTS)
    sim.ahead(LONG_PAIR_REGRESSIONS, LONG_PAIR_FAULTS)
    sim.ahead(NAMED_ONLY_BUDGET, NAMED_ONLY_FAULTS)
    sim.ahead_catches(CATCH)


def test_the_same_seed_gives_the_same_run(sim: Runs) -> None:
    a = run_seed(5)
    b, c = sim.results([5, 6])  # in a worker process: the same run
    assert_same_run(a, b)
    assert a.acked > 0 and a.schedule  # the run did something: writes, faults
    assert c.digest != a.digest


def test_the_current_code_passes_every_check_on_the_budget(sim: Runs) -> None:
    sim.passing(seed for seed in BUDGET if seed not in KNOWN)


def test_seeds_that_found_defects_pass(sim: Runs) -> None:
    sim.passing(REGRESSIONS)


@pytest.mark.parametrize("seed", sorted(KNOWN))
def test_known_defects_stay_found(seed: int) -> None:
    r = run_seed(seed)
    if not r.ok:
        pytest.xfail(f"seed {seed}: {KNOWN[seed]}: {r.failures[0]}")
    raise AssertionError(f"seed {seed} passes now: remove it from KNOWN ({KNOWN[seed]})")


def test_the_broker_pair_passes_every_check_on_its_budget(sim: Runs) -> None:
    sim.passing(PAIR_BUDGET, PAIR_FAULTS)


def test_pair_seeds_that_found_defects_pass(sim: Runs) -> None:
    runs = [sim.submit(seed, KNOWN_PAIR_FAULTS) for seed in PAIR_REGRESSIONS]
    runs += [sim.submit(seed, LONG_PAIR_FAULTS) for seed in LONG_PAIR_REGRESSIONS]
    assert not failures(run.result() for run in runs)


@pytest.mark.parametrize("seed", sorted(KNOWN_PAIR))
def test_known_pair_defects_stay_found(seed: int) -> None:
    r = run_seed(seed, faults=KNOWN_PAIR_FAULTS)
    if not r.ok:
        pytest.xfail(f"seed {seed}: {KNOWN_PAIR[seed]}: {r.failures[0]}")
    raise AssertionError(f"seed {seed} passes now: remove it from KNOWN_PAIR")


@pytest.mark.parametrize("seed", sorted(LONG_KNOWN_PAIR))
def test_known_long_pair_defects_stay_found(seed: int) -> None:
    r = run_seed(seed, faults=LONG_PAIR_FAULTS)
    if not r.ok:
        pytest.xfail(f"seed {seed}: {LONG_KNOWN_PAIR[seed]}: {r.failures[0]}")
    raise AssertionError(f"seed {seed} passes now: remove it from LONG_KNOWN_PAIR")


@pytest.mark.parametrize("bug", sorted(CATCH))
def test_each_known_defect_is_caught_within_the_budget(bug: str, sim: Runs) -> None:
    faults, seeds = CATCH[bug]
    sim.caught(bug, faults, seeds)


def test_every_bug_is_covered_and_patches_are_undone() -> None:
    from zps.core.cluster import ClusterState

    assert set(CATCH) == set(bugs.BUGS)
    # The client driver's defects run with the real client only: their budgets are
    # tests/unit/test_sim_client.py's CLIENT_BUGS.
    assert set(realbugs.CLIENT_BUGS) == set(realbugs.CLIENT_PATCHES)
    assert not set(realbugs.CLIENT_BUGS) & set(bugs.BUGS)
    before = ClusterState.__dict__["_distrust"]
    with bugs.patched("older-copy-wins"):
        assert ClusterState.__dict__["_distrust"] is not before
    assert ClusterState.__dict__["_distrust"] is before


def test_the_cli_names_bad_input_and_prints_the_replay(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--faults", "kill,meteor"])
    assert "unknown fault meteor" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--bug", "nonsense"])
    args = ["--seeds", "1", "--seed", "25", "--faults", "disk,crash-all,kill,power", "--stand-in"]
    assert main([*args, "--bug", "wal-retry-partial"]) == 1
    out = capsys.readouterr().out
    assert "seed 25: FAILED" in out and "fault schedule" in out
    assert "--seed 25 --seeds 1 --trace --stand-in --bug wal-retry-partial --faults disk" in out
    # Side by side in worker processes: the same runs, reported in seed order.
    assert main(["--seeds", "2", "--seed", "24", "--jobs", "2", *args[4:], "--bug",
                 "wal-retry-partial", "--keep-going"]) == 1  # fmt: skip
    assert "seed 25: FAILED" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--jobs", "0"])
    assert "--jobs must be >= 1" in capsys.readouterr().err
    assert set(FAULTS) >= {"kill", "pause", "partition", "disk", "crash-all", "broker"}
    assert parser().parse_args(["--faults", "slow,client"]).faults == ["slow", "client"]
