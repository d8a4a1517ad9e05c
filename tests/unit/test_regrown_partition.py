"""A partition removed by live resharding and made again (scale 2 -> 1 -> 2): its new
primary is a spare, maybe one whose last role was a copy of the removed partition.  The
new copy starts from nothing, past every epoch the removed partition reached, so a stale
copy of the removed partition that registers later claims an older history: it becomes a
spare, neither taking the new partition from a primary that "took no write" nor held as
a conflict with one that did (zps/core/cluster.py rule 8).  The epochs reached are part
of the broker's record, so a broker restarted between the removal and the growth knows
them too."""

from __future__ import annotations

import numpy as np

from tests.unit.test_cluster import claim_primary, claim_replica, reg
from zps.core.brokerstate import BrokerState
from zps.core.cluster import ClusterState
from zps.protocol.messages import Role


def shrunk() -> tuple[ClusterState, str, list[str]]:
    """p1 reached epoch 3 with its copies at LSN 111; then every slot moved to p0 and
    p1 was removed."""
    cs = ClusterState(2, n_slots=16, replication=2)
    for name in ("a", "b", "c", "d"):
        reg(cs, name)
    old = cs.primary_of(1)
    assert old is not None
    old_replicas = list(cs._parts[1].replicas)
    cs._raise_epoch(1, 3)
    cs._parts[1].epoch = 3
    cs.report(old, lsn=111, epoch=3, in_sync=old_replicas, t=1.0)
    for r in old_replicas:
        cs.report(r, lsn=111, epoch=3, t=1.0)
    cs.move_slots([int(s) for s in np.flatnonzero(cs.slot_map == 1)], 0)
    cs.shrink(1)
    return cs, old, old_replicas


def regrown() -> tuple[ClusterState, str]:
    cs, _, _ = shrunk()
    assert cs.retired_epochs == {1: 3}
    # Scaled up again at once (before the spares' next heartbeat): a spare that held the
    # removed partition may become the new p1's primary, empty.
    cs.grow(2, now=2.0)
    new = cs.primary_of(1)
    assert new is not None
    return cs, new


def test_a_regrown_partitions_primary_starts_past_the_removed_ones_epochs() -> None:
    cs, _ = regrown()
    assert cs.map.partitions[1].epoch == 4
    assert cs._parts[1].origin == (4, 0)
    assert cs._parts[1].granted_lsn == 0  # not the old role's LSN (111)


def test_a_partition_never_removed_starts_at_epoch_one() -> None:
    cs = ClusterState(1, n_slots=16, replication=1)
    reg(cs, "a")
    cs.grow(2, now=1.0)
    reg(cs, "b", now=1.0)
    assert cs.map.partitions[1].epoch == 1
    assert cs._parts[1].origin == (0, 0)


def test_a_copy_of_the_removed_partition_does_not_take_one_that_took_no_write() -> None:
    cs, new = regrown()
    # A shard that was down through it all comes back with the removed p1's copy, newer
    # by LSN than anything the new p1 holds: an older history all the same.
    out = reg(cs, "e", claim=claim_primary(1, 3, 111), now=3.0)
    assert cs.handing_over(1) is None
    assert cs.primary_of(1) == new
    assert cs.shards["e"].held is None and cs.shards["e"].role is Role.SPARE
    assert [(a.role, a.partition) for a in out if a.node_id == "e"] == [(Role.SPARE, None)]
    assert not [n for n in cs.notices if n[0] == "error"], cs.notices


def test_a_copy_of_the_removed_partition_is_not_a_conflict_with_one_that_took_writes() -> None:
    cs, new = regrown()
    cs.report(new, lsn=4, epoch=4, in_sync=[], t=3.0)  # the new p1 took slots and writes
    reg(cs, "e", claim=claim_primary(1, 3, 111), now=3.5)
    assert cs.handing_over(1) is None
    assert cs.primary_of(1) == new
    assert cs.shards["e"].held is None and cs.shards["e"].role is Role.SPARE
    assert not [n for n in cs.notices if n[0] == "error"], cs.notices
    # A replica's copy of the removed partition is no replica of the new one either.
    reg(cs, "f", claim=claim_replica(1, 3, 111, in_sync=True), now=3.6)
    assert "f" not in cs.map.partitions[1].in_sync


def grown_without_spares() -> ClusterState:
    """Shrunk, its spares gone, then grown: the new p1 has no primary yet."""
    cs, _, _ = shrunk()
    for node in [n for n, s in cs.shards.items() if s.role is Role.SPARE]:
        cs.node_gone(node, 1.5)
    cs.grow(2, now=2.0)
    assert cs.primary_of(1) is None and not cs.is_lost(1)
    return cs


def test_a_copy_of_the_removed_partition_never_takes_a_new_one_without_a_primary() -> None:
    cs = grown_without_spares()
    # The removed p1's primary comes back first: a spare, then the new p1's primary from
    # nothing, past the removed one's epochs, never from its claim.
    reg(cs, "e", claim=claim_primary(1, 3, 111), now=3.0)
    assert cs.shards["e"].held is None
    assert cs.primary_of(1) == "e" and cs.map.partitions[1].epoch == 4
    assert cs._parts[1].origin == (4, 0) and cs._parts[1].granted_lsn == 0
    assert not [n for n in cs.notices if n[0] == "error"], cs.notices


def test_a_replica_of_the_removed_partition_does_not_leave_a_new_one_lost() -> None:
    cs = grown_without_spares()
    reg(cs, "f", claim=claim_replica(1, 3, 111, in_sync=True), now=3.0)
    assert not cs.is_lost(1)
    assert cs.map.partitions[1].epoch == 4 and cs.primary_of(1) == "f"
    assert not [n for n in cs.notices if n[0] == "error"], cs.notices


def test_a_partition_removed_before_it_served_leaves_no_epoch() -> None:
    cs = ClusterState(1, n_slots=16, replication=1)
    reg(cs, "a")
    cs.grow(2, now=1.0)  # no spare: p1 never served
    cs.shrink(1)
    assert cs.retired_epochs == {}


def test_the_epochs_of_removed_partitions_survive_a_broker_restart() -> None:
    cs, _, _ = shrunk()
    rec = BrokerState(
        version=1,
        n_partitions=cs.n_partitions,
        n_slots=cs.n_slots,
        replication=cs.replication,
        map_version=cs.map_version,
        partitions=cs.records(),
        retired=tuple(sorted(cs.retired_epochs.items())),
    )
    loaded = BrokerState.from_bytes(rec.to_bytes())
    assert loaded.retired == ((1, 3),)
    after = ClusterState(1, n_slots=16, replication=2)
    after.restore(loaded.map_version, loaded.partitions, retired=loaded.retired)
    assert after.retired_epochs == {1: 3}
    for name in ("a", "b"):
        reg(after, name)
    after.grow(2, now=0.0)
    reg(after, "c")
    assert after.map.partitions[1].epoch == 4
    # A record written before the field was kept reads as none.
    old = rec.to_dict()
    del old["retired"]
    assert BrokerState.from_dict(old).retired == ()
