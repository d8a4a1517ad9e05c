"""Connection resets in simulated runs: the ``reset`` fault (zps/testing/sim net,
simtransport, clientnet and shardnet, with the real clients, shards and broker).

A reset closes every connection between two processes and makes each again at once: what
the pipes held is lost both ways (what the receiver had taken stays), and each
connecting socket's ``on_connected`` runs as a new handshake (a client sends again what
was in flight there; a shard greets its broker or router as a new link).  Until another
fault strikes, every write must then succeed; the three rules that make it so are each
caught when taken out (test_sim_client's CATCH); a budget of seeds passes every check;
a seed replays exactly in any process."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.unit.simcases import Runs, assert_same_run
from zps.testing.sim import checks, simtransport
from zps.testing.sim.faults import FAULTS, NAMED
from zps.testing.sim.net import Network
from zps.testing.sim.sched import Scheduler
from zps.testing.sim.simclient import Op
from zps.testing.sim.world import World

pytestmark = pytest.mark.timeout(300)

#: Resets with the routers and the shards' and clients' kills and cuts.
RESET_FAULTS = ["reset", "routers", "kill", "partition", "client"]
#: Seeds of RESET_FAULTS that must pass.
BUDGET = range(0, 6)


def seeds_ahead(sim: Runs) -> None:
    """The runs this module's tests ask for, handed to the pool with the session's first
    test (tests/conftest.py)."""
    sim.ahead(BUDGET, RESET_FAULTS, real_client=True)
    sim.ahead(range(0, 3), ["reset"], real_client=True)


def _net() -> tuple[Network, list[tuple[str, Any]]]:
    net = Network(Scheduler(1))
    got: list[tuple[str, Any]] = []
    for name in ("a", "b", "c"):
        net.attach(name, lambda src, msg, name=name: got.append((f"{src}>{name}", msg)))
    return net, got


def test_a_reset_loses_what_was_on_its_way_both_ways_and_nothing_else() -> None:
    net, got = _net()
    net.send("a", "b", 1)
    net.send("b", "a", 2)
    net.send("a", "c", 3)  # another connection: untouched
    assert (net.on_the_way("a", "b"), net.on_the_way("b", "a")) == (1, 1)
    assert net.reset("a", "b") == 2
    assert (net.on_the_way("a", "b"), net.on_the_way("b", "a"), net.dropped) == (0, 0, 2)
    net.send("a", "b", 4)  # the connection made again carries what is sent after
    net.sched.run_until(1.0)
    assert sorted(got) == [("a>b", 4), ("a>c", 3)]
    assert net.room("a", "b") and net._inflight[("a", "b")] == 0


def test_a_reset_loses_what_a_cut_held_but_not_what_the_receiver_took() -> None:
    net, got = _net()
    net.pause("b")
    net.send("a", "b", 1)
    net.sched.run_until(0.1)  # arrived: the paused process took it, unread
    net.cut.add(("a", "b"))
    net.send("a", "b", 2)
    net.sched.run_until(0.2)  # held by the cut
    assert net.on_the_way("a", "b") == 1
    assert net.reset("a", "b") == 1
    net.heal({("a", "b")})
    net.resume("b")
    net.sched.run_until(0.3)
    assert got == [("a>b", 1)]


def test_the_reset_fault_is_named_only_and_needs_the_real_clients() -> None:
    assert "reset" in NAMED and "reset" not in FAULTS
    with pytest.raises(ValueError, match="needs the real clients"):
        World(1, faults=["reset"], real_shard=True)
    w = World(1, faults=["reset"], real_client=True)
    shutil.rmtree(w.tmp)
    assert w.only_resets_until == float("inf")


def test_a_reset_makes_the_connecting_sockets_connect_again() -> None:
    """The client's sockets count each connection made, as the product's handshake
    watch does, and run ``on_connected`` for each; the shard's data links are watched
    ones (its greeting, marked ``new_link``, goes on each)."""
    w = World(2, faults=["reset"], real_client=True, trace=True)
    seen: list[tuple[str, str, int]] = []
    real = simtransport._connected

    def connected(ch: simtransport.SimChannel) -> None:
        real(ch)
        if ch.handshakes is not None:
            seen.append((ch.name, ch.target, ch.handshakes.connected))

    simtransport._connected = connected  # type: ignore[assignment]
    try:
        r = w.run()
    finally:
        simtransport._connected = real  # type: ignore[assignment]
    assert r.ok, r.failures[:3]
    resets = [line for line in r.schedule if "reset the connections" in line]
    assert resets, r.schedule
    # Each client's and shard's first connection to the broker, then the resets' again.
    assert {(c.name, "broker", 1) for c in w.clients} <= set(seen)
    assert {(s.name, "broker", 1) for s in w.shards} <= set(seen)
    assert [s for s in seen if s[2] > 1], seen


def test_until_another_fault_every_write_must_succeed() -> None:
    """The check itself: a write that failed with only resets before it fails the run;
    one after another fault, one acknowledged or one not answered yet does not."""
    timed_out = "failed:ZpsTimeoutError"
    ops = [
        Op("c0", 0, 1, 1, submitted=1.0, deadline=4.0, outcome=timed_out, at=4.0),
        Op("c0", 0, 2, 1, submitted=1.0, deadline=4.0, outcome="acked", at=2.0),
        Op("c0", 0, 3, 1, submitted=1.0, deadline=4.0),
        Op("c1", 1, 4, 1, submitted=5.0, deadline=8.0, outcome=timed_out, at=8.0),
    ]
    failed = list(checks.failed_with_only_resets(ops, 6.0))
    assert len(failed) == 1 and "c0 request to p0 (row 1)" in failed[0], failed
    assert "only connection resets before it" in failed[0]
    assert list(checks.failed_with_only_resets(ops, 3.0)) == []


def test_a_seed_replays_exactly_in_any_process(sim: Runs) -> None:
    runs = [
        sim.submit(3, RESET_FAULTS, real_client=True),
        sim.submit(3, RESET_FAULTS, fresh=True, real_client=True),
    ]
    a, b = (run.result() for run in runs)
    assert_same_run(a, b)
    assert a.schedule and a.acked > 0


def test_the_reset_faults_pass_every_check_on_the_budget(sim: Runs) -> None:
    results = sim.passing(BUDGET, RESET_FAULTS, real_client=True)
    resets = [line for r in results for line in r.schedule if "reset the connections" in line]
    assert resets and all(r.acked > 0 for r in results)


def test_resets_alone_lose_no_call(sim: Runs) -> None:
    results = sim.passing(range(0, 3), ["reset"], real_client=True)
    resets = [line for r in results for line in r.schedule if "reset the connections" in line]
    assert any(": 0 messages lost" not in line for line in resets), resets
    assert all(r.maybe == 0 for r in results), [(r.seed, r.maybe) for r in results]
