"""A copy the broker may not elect stays its partition's replica (zps/core/cluster.py):
found by the cluster simulator, seed 1528."""

from __future__ import annotations

from tests.unit.test_cluster import by_node, claim_primary, reg, replica, restarted
from zps.core.cluster import ClusterState


def test_a_copy_behind_what_its_primary_confirmed_follows_it_after_a_restart() -> None:
    """Both copies of a partition (acks from both) lose power; the primary comes back
    first, its replica one record behind what the primary confirmed, so it may not be
    elected.  It must stay the partition's replica: made a spare, it was given to another
    partition while this one kept a single copy of every acknowledged write (a lost data
    dir then lost them)."""
    cs = ClusterState(2, n_slots=16, replication=2)
    for node in ("a", "b", "c", "d"):
        reg(cs, node)
    p0 = cs.map.partitions[0]
    primary, follower = p0.primary, p0.replicas[0]
    assert primary is not None
    cs.report(primary, lsn=42, epoch=1, in_sync=[follower], t=1.0)
    cs = restarted(cs, now=100.0, hold=1.0)
    reg(cs, primary, claim=claim_primary(0, 1, 42), now=100.1)
    out = by_node(reg(cs, follower, claim=claim_primary(0, 1, 41), now=100.2))
    assert out[follower] == replica(follower, 0, 1, primary)
    assert cs.map.partitions[0].replicas == (follower,)
