"""Seeds the simulator's long runs (``python -m zps.testing.sim --seeds N ...``, figures in
docs/performance.md, "The cluster simulator") failed on, each with the fault mix of its
run: fixed defects, kept as regressions (every one must pass)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tests.unit.simcases import Runs
from zps.testing.sim.world import FAULTS, Result

#: The long run's faults: every default one and the slow and client faults.
LONG_FAULTS = [*FAULTS, "slow", "client"]

#: seed -> (the faults it was drawn from, the real broker, what it found).
REGRESSIONS: dict[int, tuple[list[str], bool, str]] = {
    103931: (
        LONG_FAULTS,
        True,
        # A replica whose log could not take the stream (a full disk) was dropped by its
        # primary and subscribed again; the broker, paused meanwhile, published the
        # dropping map after the replica had caught up again, and the writes waiting for
        # it were acknowledged without it.  Its next acknowledgement, short of them, put
        # it back in sync on its old catch-up mark (ShardSession.on_map kept it), the
        # broker recorded it as holding every acknowledged write, and after a power loss
        # it was elected: the writes acknowledged past its log's LSN 106 were lost.
        "a replica the map dropped was in sync again short of the writes released without it",
    ),
    105879: (
        LONG_FAULTS,
        True,
        # min_in_sync 2.  Partition 1's replica was cut off from its primary, which dropped
        # it (and could acknowledge nothing alone); the primary was then killed and its
        # data dir wiped.  With no in-sync replica the partition was lost (right: the
        # broker cannot know the replica missed nothing), and ClusterState._failover made
        # the replica a spare, which dropped the copy holding every acknowledged write;
        # after a broker restart without its record an empty shard took the partition.  A
        # lost partition's copies are held now (reset-partition serves the newest).
        "a lost partition's replicas were made spares, dropping their copies",
    ),
}


@pytest.fixture(scope="module")
def runs(sim: Runs) -> dict[int, Future[Result]]:
    """Every seed's run, submitted to the workers at once."""
    return {
        seed: sim.submit(seed, faults, real_broker=real_broker)
        for seed, (faults, real_broker, _) in REGRESSIONS.items()
    }


@pytest.mark.parametrize("seed", sorted(REGRESSIONS))
def test_seeds_the_long_runs_failed_on_pass(seed: int, runs: dict[int, Future[Result]]) -> None:
    r = runs[seed].result()
    assert r.ok, (r.failures[:3], r.schedule)
