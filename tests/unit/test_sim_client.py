"""The default mode of the simulator: the real code everywhere (``--real-client``: the real
client, zps.connect unchanged, with the real shards and broker; zps/testing/sim realclient
and clientnet).

Every client of a run is the real async client on the run's one event loop, transport
and clock: the same seed gives the same trace (in any process); the CI's budget of seeds
of the default faults with client kills, of the broker pair's faults and of slow peers
passes every check; and every known defect, patched in, is caught within its budget of
seeds (CATCH: the stand-ins' and the real drivers' defects, and the client driver's)."""

from __future__ import annotations

import pytest

from tests.unit.simcases import Runs, assert_same_run
from zps.client.client import Client
from zps.client.connection import Connection
from zps.testing.sim import bugs, clientnet, realbugs
from zps.testing.sim.cli import MODES, main, parser
from zps.testing.sim.faults import FAULTS
from zps.testing.sim.realclient import RealClient
from zps.testing.sim.realshard import RealShard
from zps.testing.sim.world import World

pytestmark = pytest.mark.timeout(300)

#: The default faults and the client's kills.
CLIENT_FAULTS = [*FAULTS, "client"]


def test_a_run_drives_the_real_clients() -> None:
    w = World(2, faults=CLIENT_FAULTS, real_client=True)
    assert w.real_shard and w.real_broker
    assert all(isinstance(c, RealClient) for c in w.clients)
    assert all(isinstance(s, RealShard) for s in w.shards)
    r = w.run()
    assert r.ok, r.failures[:3]
    assert r.acked > 0 and r.sim_seconds > 20
    assert all(isinstance(c.client, Client) for c in [*w.clients, *w.readers])
    assert all(isinstance(c.client.connection, Connection) for c in w.clients)
    # The seams are undone at the end of the run.
    from zps.client import connection

    assert connection.transport is not clientnet


def seeds_ahead(sim: Runs) -> None:
    """The runs this module's tests ask for, handed to the pool with the session's first
    test (tests/conftest.py)."""
    sim.ahead(BUDGET, CLIENT_FAULTS, real_client=True)
    sim.ahead(PAIR_BUDGET, PAIR_FAULTS, real_client=True)
    sim.ahead(SLOW_BUDGET, SLOW_FAULTS, real_client=True)
    sim.ahead(RESHARD_REGRESSIONS, RESHARD_FAULTS, real_client=True)
    sim.ahead(RESHARD_PAIR_REGRESSIONS, RESHARD_PAIR_FAULTS, real_client=True)
    for faults, seeds in (*RESHARD_POWER_REGRESSIONS, *RESHARD_ORPHAN_REGRESSIONS):
        sim.ahead(seeds, faults, real_client=True)
    sim.ahead_catches(CATCH, real_client=True)


def test_a_seed_replays_exactly_in_any_process(sim: Runs) -> None:
    # The budget's run of the seed and one of its own, in whichever workers take them.
    runs = [
        sim.submit(5, CLIENT_FAULTS, real_client=True),
        sim.submit(5, CLIENT_FAULTS, fresh=True, real_client=True),
    ]
    a, b = (run.result() for run in runs)
    assert_same_run(a, b)
    assert a.schedule and a.acked > 0


#: Seeds of the default faults and client kills that must pass (the CI's budget of the
#: default mode, with PAIR_BUDGET and SLOW_BUDGET).
BUDGET = range(0, 60)
#: The broker pair's faults (tests/unit/test_sim.py: PAIR_FAULTS).
PAIR_FAULTS = ["failover", "kill", "power", "pause", "partition", "disk", "broker", "wipe"]
PAIR_BUDGET = range(0, 15)
#: Slow and non-reading peers and slow disks, with client kills (tests/unit/test_sim.py:
#: NAMED_ONLY_FAULTS).
SLOW_FAULTS = ["slow", "client", "kill", "power", "pause", "partition", "disk"]
SLOW_BUDGET = range(0, 15)


def test_the_real_clients_pass_every_check_on_the_budget(sim: Runs) -> None:
    results = sim.passing(BUDGET, CLIENT_FAULTS, real_client=True)
    assert any(any("kill c" in s for s in r.schedule) for r in results)


def test_the_real_pair_with_real_clients_passes_every_check_on_its_budget(sim: Runs) -> None:
    results = sim.passing(PAIR_BUDGET, PAIR_FAULTS, real_client=True)
    assert any("active broker" in line for r in results for line in r.schedule)


def test_slow_peers_with_real_clients_pass_every_check_on_their_budget(sim: Runs) -> None:
    results = sim.passing(SLOW_BUDGET, SLOW_FAULTS, real_client=True)
    assert any("reads" in line or "disk takes" in line for r in results for line in r.schedule)


#: Live resharding with broker restarts (the ``reshard`` fault needs the real clients).
RESHARD_FAULTS = ["reshard", "kill", "broker"]
#: Seeds where a broker restarted without its record after a scale routed by the
#: configured round-robin map: the shards answered MOVED for ever, the clients re-sent
#: with new deadlines for ever, and a third partition's copies became spares (fixed: the
#: claims carry the slots, zps/core/slotclaims.py; operations keep their deadline).
RESHARD_REGRESSIONS = (204, 207, 209, 211, 212, 217)


def test_live_resharding_under_broker_restarts_passes_every_check(sim: Runs) -> None:
    results = sim.passing(RESHARD_REGRESSIONS, RESHARD_FAULTS, real_client=True)
    schedules = [line for r in results for line in r.schedule]
    assert any("WITHOUT its record" in line for line in schedules)
    assert any("to 3 partitions" in line for line in schedules)


#: Live resharding under the broker pair's failovers.
RESHARD_PAIR_FAULTS = ["reshard", "failover", "kill"]
#: 306: a broker that stepped down went on with its move on its old state (its fence
#: stayed); 309: a takeover's map from an older record gave a source back the slots it
#: had released, and it acknowledged writes there; 324: a move went past its fence and
#: its "copied" record while the standby, cut off, did not hold them, and took over;
#: 331: the same scale command again replaced the record of the move in flight (its
#: fence stayed).  All acknowledged writes lost or stalled (docs/design.md).
RESHARD_PAIR_REGRESSIONS = (306, 309, 324, 331)


def test_live_resharding_under_pair_failovers_passes_every_check(sim: Runs) -> None:
    results = sim.passing(RESHARD_PAIR_REGRESSIONS, RESHARD_PAIR_FAULTS, real_client=True)
    assert any("active broker" in line for r in results for line in r.schedule)


#: A partition removed by a scale-down and created again: the shard that held the old
#: one's copy started the new one's log from nothing beside the old checkpoints, and a
#: restart after a power loss took the old checkpoint for the new history's base (a
#: synced LSN went back; acknowledged writes lost).  Seed 454 of the first mix draws
#: otherwise since the client holds back what MOVED refuses again under the same map; seed
#: 27 of it reaches the case and fails without the fix (Durability.start's checkpoint
#: drop taken out: a served partition's writes stall).
RESHARD_POWER_REGRESSIONS = (
    (["reshard", "crash-all", "power", "disk", "kill"], (27,)),
    ([*FAULTS, "client", "reshard"], (454,)),
)


#: A broker restarted without its record during a move: the move's fence stayed at its
#: source (writes to those slots stalled) until the claims' fences and imports were
#: finished by the broker itself (zps/core/slotclaims.py rule 6).  Seed 411 of the first
#: mix draws otherwise since the client's MOVED hold; seeds 1 and 242 of it reach a move
#: the claims show under way (being copied, and copied).
RESHARD_ORPHAN_REGRESSIONS = (
    (["reshard", "pause", "partition", "broker", "kill"], (1, 242)),
    ([*FAULTS, "client", "reshard"], (438,)),
)


#: Each group of seeds, and a fault its runs must show (they reach the path).
RESHARD_CASES = [
    *((faults, seeds, "to 2 partitions") for faults, seeds in RESHARD_POWER_REGRESSIONS),
    *((faults, seeds, "WITHOUT its record") for faults, seeds in RESHARD_ORPHAN_REGRESSIONS),
]


@pytest.mark.parametrize("case", range(len(RESHARD_CASES)))
def test_reshard_regression_seeds_pass_every_check(case: int, sim: Runs) -> None:
    faults, seeds, shown = RESHARD_CASES[case]
    results = sim.passing(seeds, faults, real_client=True)
    assert any(shown in line for r in results for line in r.schedule)


def test_the_reshard_fault_needs_the_real_clients() -> None:
    with pytest.raises(ValueError, match="needs the real clients"):
        World(1, faults=["reshard"], real_shard=True)


#: Every known defect (the stand-ins' and real drivers', zps.testing.sim.bugs and realbugs,
#: and the client driver's, realbugs.CLIENT_BUGS) in the default mode: the faults that
#: expose it and the seeds it must be caught within (tests/unit/simcases.py: a budget
#: starts at the first seed that catches it).  The pair's three are rare in their mixes
#: with the real code (one seed in 10-150 catches each), so a change that moves the runs
#: may move a catch out of its range: search again with
#: ``python -m zps.testing.sim --bug NAME --faults F --seeds 200``.
CATCH = {
    "client-seq-restart": ("broker", range(0, 4)),
    "shm-token-unchecked": ("slow,shm", range(20, 30)),
    "standby-without-record": ("failover,kill,power", range(3, 13)),
    "empty-shard-takes-partition": ("crash-all,broker,kill", range(2, 12)),
    "ack-before-durable": ("crash-all,power", range(3, 13)),
    "older-copy-wins": ("pause-crash", range(7, 17)),
    "wal-retry-partial": ("disk,crash-all,kill,power", range(12, 22)),
    "stale-replica-in-tracker": ("pause,idle", range(14, 24)),
    "stuck-replica-kept": ("slow", range(16, 26)),
    "pair-unfenced": ("failover,pause,partition", range(23, 35)),
    "pair-primary-first": ("failover,crash-all,broker", range(14, 24)),
    "pair-map-before-standby": ("failover,kill", range(115, 125)),
    "client-not-relinked": ("reset", range(1, 11)),
    "client-ignores-relinked": ("reset", range(1, 11)),
    "router-link-loss-unanswered": ("reset,routers", range(5, 15)),
    "wal-crc-unchecked": ("rot", range(63, 73)),
    "wal-damage-as-torn": ("rot", range(16, 26)),
    "wal-reached-forgotten": ("rot,crash-all,kill,power,pause,broker,efbig", range(640095, 640105)),
}


@pytest.mark.parametrize("bug", sorted(CATCH))
def test_each_known_defect_is_caught_in_the_default_mode(bug: str, sim: Runs) -> None:
    faults, seeds = CATCH[bug]
    sim.caught(bug, faults, seeds, real_client=True)


def test_every_bug_is_covered() -> None:
    assert set(CATCH) == set(bugs.BUGS) | set(realbugs.CLIENT_BUGS)
    assert set(realbugs.CLIENT_BUGS) == set(realbugs.CLIENT_PATCHES)


def test_the_cli_runs_the_real_code_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert MODES[parser().parse_args([]).mode] == MODES["real-client"]
    assert all(MODES["real-client"].values()) and not any(MODES["stand-in"].values())
    assert main(["--seeds", "1", "--seed", "1", "--faults", "client"]) == 0
    assert "1 seeds in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--stand-in", "--real-shard"])
    with pytest.raises(SystemExit):
        main(["--stand-in", "--bug", "client-seq-restart"])
    assert "defect of the real client: drop --stand-in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--real-shard", "--faults", "reshard,kill"])
    assert "--faults reshard needs the real clients: drop --real-shard" in capsys.readouterr().err
