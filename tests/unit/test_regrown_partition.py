"""A partition removed by live resharding and made again (scale 2 -> 1 -> 2): its new
primary is a spare whose last role was a copy of the removed partition.  The broker's
record of that shard's LSN is of the old role; the new copy starts from nothing, so a
stale copy of the removed partition that registers later must not be taken for a newer
history of a primary that "took no write" (zps/core/cluster.py rule 8)."""

from __future__ import annotations

import numpy as np

from tests.unit.test_cluster import claim_primary, reg
from zps.core.cluster import ClusterState


def regrown() -> tuple[ClusterState, str]:
    cs = ClusterState(2, n_slots=16, replication=2)
    for name in ("a", "b", "c", "d"):
        reg(cs, name)
    old = cs.primary_of(1)
    assert old is not None
    old_replicas = list(cs._parts[1].replicas)  # the record under test
    # p1's copies confirm LSN 111; then every slot moves to p0 and p1 is removed.
    cs.report(old, lsn=111, epoch=1, in_sync=old_replicas, t=1.0)
    for r in old_replicas:
        cs.report(r, lsn=111, epoch=1, t=1.0)
    cs.move_slots([int(s) for s in np.flatnonzero(cs.slot_map == 1)], 0)
    cs.shrink(1)
    # Scaled up again at once (before the spares' next heartbeat): a spare that held the
    # removed partition becomes the new p1's primary, empty.
    cs.grow(2, now=2.0)
    new = cs.primary_of(1)
    assert new in (old, *old_replicas)
    return cs, new


def test_a_regrown_partitions_primary_is_granted_from_nothing() -> None:
    cs, _ = regrown()
    assert cs._parts[1].origin == (0, 0)
    assert cs._parts[1].granted_lsn == 0  # was 111: the old role's LSN


def test_a_copy_of_the_removed_partition_does_not_unseat_a_primary_that_took_writes() -> None:
    cs, new = regrown()
    # The new p1 took slots (imports and activations are logged: its LSN grows).
    cs.report(new, lsn=4, epoch=1, in_sync=[], t=3.0)
    # A shard that was down through it all comes back with the removed p1's copy.
    reg(cs, "e", claim=claim_primary(1, 1, 111), now=3.5)
    assert cs.handing_over(1) is None
    assert cs.primary_of(1) == new
    assert cs.shards["e"].held is not None  # kept, not overwritten, not serving
