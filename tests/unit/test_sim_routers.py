"""Routing brokers (``zps-server broker --follow``, zps.broker.router unchanged) in
simulated runs: the ``routers`` fault (zps/testing/sim realrouter and routernet, with the
real clients, shards and broker).

A run with it has the shards two a host and a real router on each host, listed in the
map, which gives each partition the router on its primary's host; the real clients send
a partition's requests through its router and the real shards answer through it.  The
requests go through the routers, a budget of seeds with the routers killed, paused and
cut off passes every check, and a seed replays exactly in any process."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.unit.simcases import Runs, assert_same_run
from zps.core.cluster import ClusterState
from zps.core.nodes import Partition
from zps.testing.sim import routernet
from zps.testing.sim.cli import run_seeds
from zps.testing.sim.faults import FAULTS, NAMED
from zps.testing.sim.realrouter import RealRouter, hosts
from zps.testing.sim.world import World

pytestmark = pytest.mark.timeout(300)

#: The routers' faults with the shards' kills, pauses and cuts.
ROUTER_FAULTS = ["routers", "kill", "pause", "partition"]
#: Seeds of ROUTER_FAULTS that must pass.
BUDGET = range(0, 8)


def seeds_ahead(sim: Runs) -> None:
    """The runs this module's tests ask for, handed to the pool with the session's first
    test (tests/conftest.py)."""
    sim.ahead(BUDGET, ROUTER_FAULTS, real_client=True)


def test_the_routers_are_named_only() -> None:
    assert "routers" in NAMED and "routers" not in FAULTS
    w = World(1, real_client=True)
    shutil.rmtree(w.tmp)
    assert w.routers == [] and w.hosts == {}


def test_the_routers_fault_needs_the_real_clients() -> None:
    with pytest.raises(ValueError, match="needs the real clients"):
        World(1, faults=["routers"], real_shard=True)


def test_the_shards_run_two_a_host() -> None:
    assert hosts(["s-0", "s-1", "s-2", "s-3", "s-4"]) == {
        "s-0": "h0",
        "s-1": "h0",
        "s-2": "h1",
        "s-3": "h1",
        "s-4": "h2",
    }


def test_a_run_drives_the_real_routers(sim: Runs) -> None:
    worker = sim.submit(1, ["routers"], real_client=True)
    w = World(1, faults=["routers"], real_client=True, trace=True)
    assert [(r.name, r.host) for r in w.routers] == [("r0", "h0"), ("r1", "h1"), ("r2", "h2")]
    assert all(isinstance(r, RealRouter) for r in w.routers)
    r = w.run()
    assert r.ok, r.failures[:3]
    assert r.acked > 0
    # The map names each partition's router, and the requests went through them.
    assert any(" via r" in line for line in r.trace if " map v" in line)
    counted = [router.counted() for router in w.routers]
    assert sum(c["routed"] for c in counted) > r.acked / 2, counted
    assert sum(c["replies"] for c in counted) > 0, counted
    # The seams are undone at the end of the run.
    from zps.broker import router

    assert vars(router)["transport"] is not routernet
    # The same run in a worker process as in this one.
    assert_same_run(r, worker.result())


def test_a_seed_replays_exactly_in_any_process(sim: Runs) -> None:
    # The budget's run of the seed and one of its own, in whichever workers take them.
    runs = [
        sim.submit(3, ROUTER_FAULTS, real_client=True),
        sim.submit(3, ROUTER_FAULTS, fresh=True, real_client=True),
    ]
    a, b = (run.result() for run in runs)
    assert_same_run(a, b)
    assert a.schedule and a.acked > 0


def test_the_routers_faults_pass_every_check_on_the_budget(sim: Runs) -> None:
    results = sim.passing(BUDGET, ROUTER_FAULTS, real_client=True)
    schedules = [line for r in results for line in r.schedule]
    for shown in ("kill the router", "pause the router", "cut the router"):
        assert any(shown in line for line in schedules), shown


#: The pair's faults with the routers' and the clients' kills.
ROUTER_PAIR_FAULTS = [
    "routers",
    "failover",
    "kill",
    "power",
    "pause",
    "partition",
    "broker",
    "client",
]


def test_a_lost_partition_waits_for_its_last_in_sync_copy(
    sim: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seed 1530: s-4 and s-1 are killed and s-3 loses power within 0.2 s of each other;
    # p0 is lost, and a running broker holds it for a member of its last in-sync set
    # (zps.core.recovery.distrust) rather than grant it to the copy that claims it first.
    # (Seed 1388 drew this case until routers probed their shards' links, which changed
    # the runs' message counts.)
    (r,) = sim.passing([1530], ROUTER_PAIR_FAULTS, real_client=True)
    assert any("kill s-1" in line for line in r.schedule)
    assert any("power s-3" in line for line in r.schedule)
    # With the rule before 3569db1 (the set bound a claim only once restored from a
    # record, ``pinned``) s-1 was granted p0: acknowledged writes lost.  The rule's other
    # arm, no primary serving, is kept from applying by a stand-in primary for the call.
    real = ClusterState._distrust

    def pinned_only(part: Partition, *args: Any, **kw: Any) -> str | None:
        primary, part.primary = part.primary, part.primary or "(as if one served)"
        try:
            return real(part, *args, **kw)
        finally:
            part.primary = primary

    monkeypatch.setattr(ClusterState, "_distrust", staticmethod(pinned_only))
    (old,) = run_seeds([1530], ROUTER_PAIR_FAULTS, real_client=True)
    assert any("acknowledged writes lost" in f for f in old.failures), old.failures[:3]
