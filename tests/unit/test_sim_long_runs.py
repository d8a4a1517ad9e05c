"""Seeds the simulator's long runs (``python -m zps.testing.sim --seeds N ...``, figures in
docs/performance.md, "The cluster simulator") failed on, each with the fault mix of its
run: fixed defects, kept as regressions (every one must pass), and known ones, kept as
expected failures until they are fixed (each must still fail)."""

from __future__ import annotations

import pytest

from zps.testing.sim.world import run_seed

#: The long run's faults: every default one and the slow and client faults.
LONG_FAULTS = [
    "kill",
    "power",
    "wipe",
    "pause",
    "partition",
    "disk",
    "crash-all",
    "broker",
    "pause-crash",
    "slow",
    "client",
]

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
}


@pytest.mark.parametrize("seed", sorted(REGRESSIONS))
def test_seeds_the_long_runs_failed_on_pass(seed: int) -> None:
    faults, real_broker, _ = REGRESSIONS[seed]
    r = run_seed(seed, faults=faults, real_broker=real_broker)
    assert r.ok, (r.failures[:3], r.schedule)


#: seed -> (the faults it was drawn from, the real broker, what it finds), not fixed yet.
KNOWN: dict[int, tuple[list[str], bool, str]] = {
    105879: (
        LONG_FAULTS,
        True,
        # min_in_sync 2.  Partition 1's replica s-0 is cut off from its primary s-4, which
        # drops it (the map names s-4 alone; it can acknowledge nothing alone), then s-4 is
        # killed and its data dir wiped.  With no in-sync replica the partition is lost,
        # and ClusterState._failover demotes s-0 to a spare: the copy holding every
        # acknowledged write drops its partition.  After a broker restart without its
        # record an empty shard takes the partition (and reset-partition would too: it
        # hands a lost partition to its newest held copy, and none is held).  The rule to
        # make: a lost partition's replicas keep their copies (held, as a claim not taken
        # is), for reset-partition and a broker rebuilding from claims to find.
        "a lost partition's replicas are made spares, dropping the copy that held "
        "every acknowledged write",
    ),
}


@pytest.mark.parametrize("seed", sorted(KNOWN))
def test_known_defects_the_long_runs_found_stay_found(seed: int) -> None:
    faults, real_broker, why = KNOWN[seed]
    r = run_seed(seed, faults=faults, real_broker=real_broker)
    if not r.ok:
        pytest.xfail(f"seed {seed}: {why}: {r.failures[0]}")
    raise AssertionError(f"seed {seed} passes now: move it to REGRESSIONS")
