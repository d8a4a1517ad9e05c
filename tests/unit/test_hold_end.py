"""When a broker restarted from its record may end its start-up hold before the grace
runs out (zps/core/recovery.py ``claims_in``): every member of every recorded in-sync
set back, and every partition that held data served; never without a record, with a
stale one, or for a partition with no recorded set."""

from __future__ import annotations

from tests.unit.test_cluster import claim_primary, claim_replica, part, reg, restarted
from zps.core.cluster import ClusterState
from zps.core.routing import PartitionInfo

T = 100.0  # the restart
GRACE = 20.0


def cluster() -> ClusterState:
    """2 partitions x 2 copies, each confirmed with its replica in sync: a serves 0 (b
    follows), c serves 1 (d follows)."""
    cs = ClusterState(2, n_slots=16, replication=2)
    for n in ("a", "c", "b", "d"):
        reg(cs, n)
    assert (cs.primary_of(0), cs.primary_of(1)) == ("a", "c")
    assert part(cs, 0).replicas == ("b",) and part(cs, 1).replicas == ("d",)
    cs.report("a", lsn=10, epoch=1, in_sync=["b"], t=1.0)
    cs.report("c", lsn=20, epoch=1, in_sync=["d"], t=1.0)
    assert cs.members_of(0) == ("a", "b") and cs.members_of(1) == ("c", "d")
    return cs


def back(cs: ClusterState, *nodes: str, now: float = T + 0.1) -> None:
    """Each of ``nodes`` re-registers with what it held in ``cluster()``."""
    claims = {
        "a": claim_primary(0, 1, 10),
        "b": claim_replica(0, 1, 10, in_sync=True),
        "c": claim_primary(1, 1, 20),
        "d": claim_replica(1, 1, 20, in_sync=True),
    }
    for n in nodes:
        reg(cs, n, claim=claims[n], now=now)


def test_the_hold_may_end_once_every_recorded_copy_is_back() -> None:
    cs = restarted(cluster(), now=T, hold=GRACE)
    assert not cs.claims_in(T)
    for n in ("a", "b", "c"):
        back(cs, n)
        assert not cs.claims_in(T + 0.1), n  # d, a member of partition 1's set, is away
    back(cs, "d")
    assert cs.claims_in(T + 0.1)
    assert not cs.claims_in(T + GRACE)  # not holding any more: nothing to end


def test_a_primary_back_is_not_enough_while_a_recorded_replica_is_away() -> None:
    """A recorded set of 2, 1 claimed: the hold waits for the second (the grace bounds
    it), which would rejoin the in-sync set at once rather than resynchronise."""
    cs = restarted(cluster(), now=T, hold=GRACE)
    back(cs, "a", "c", "d")
    assert cs.primary_of(0) == "a" and cs.primary_of(1) == "c"
    assert not cs.claims_in(T + 0.1)
    back(cs, "b", now=T + 0.5)
    assert cs.claims_in(T + 0.5)
    assert part(cs, 0).in_sync == ("b",)  # rejoined in sync, as only the hold allows


def test_every_member_back_but_no_primary_granted_waits_for_the_grace() -> None:
    """Both copies of partition 0 came back as replicas: its election is decided when
    the grace ends."""
    cs = restarted(cluster(), now=T, hold=GRACE)
    back(cs, "b", "c", "d")
    reg(cs, "a", claim=claim_replica(0, 1, 10, in_sync=True), now=T + 0.1)
    assert cs.primary_of(0) is None
    assert not cs.claims_in(T + 0.1)


def test_a_member_that_came_back_empty_has_said_its_last_word() -> None:
    """b's disk was wiped: it registers with nothing; a serves partition 0 and holds
    every acknowledged write, so nothing still to come could change who serves."""
    cs = restarted(cluster(), now=T, hold=GRACE)
    back(cs, "a", "c", "d")
    reg(cs, "b", now=T + 0.1)
    assert cs.claims_in(T + 0.1)


def test_a_member_that_died_during_the_hold_is_waited_for_again() -> None:
    cs = restarted(cluster(), now=T, hold=GRACE)
    back(cs, "a", "b", "c", "d")
    cs.node_gone("b", T + 0.2)
    assert not cs.claims_in(T + 0.2)


def test_a_lost_partition_waits_for_the_whole_grace() -> None:
    """Partition 0's primary died with no replica in sync: its record names a alone, and
    b's copy (out of sync) may not serve it; the hold waits for a."""
    cs = cluster()
    cs.report("a", lsn=30, epoch=1, in_sync=[], t=2.0)
    cs.node_gone("a")
    assert cs.is_lost(0) and cs.members_of(0) == ("a",)
    cs = restarted(cs, now=T, hold=GRACE)
    back(cs, "b", "c", "d")
    assert not cs.claims_in(T + 0.1)
    reg(cs, "a", claim=claim_primary(0, 1, 30), now=T + 0.2)
    assert cs.primary_of(0) == "a" and cs.claims_in(T + 0.2)


def test_never_early_without_a_record() -> None:
    cs = ClusterState(2, n_slots=16, replication=2, hold_until=T + GRACE)
    back(cs, "a", "b", "c", "d")
    assert cs.primary_of(0) == "a" and cs.primary_of(1) == "c"
    assert not cs.claims_in(T + 0.1)


def test_never_early_with_a_record_of_a_cluster_that_held_no_data() -> None:
    cs = restarted(ClusterState(2, n_slots=16, replication=2), now=T, hold=GRACE)
    reg(cs, "a", now=T + 0.1)
    assert not cs.claims_in(T + 0.1)


def test_never_early_for_a_partition_with_no_recorded_set() -> None:
    """Partition 1 was assigned but its primary never confirmed (no write): no set
    names its copies, so the newest claim may still be on its way."""
    cs = ClusterState(2, n_slots=16, replication=2)
    for n in ("a", "c", "b", "d"):
        reg(cs, n)
    cs.report("a", lsn=10, epoch=1, in_sync=["b"], t=1.0)
    assert cs.members_of(1) == ()
    cs = restarted(cs, now=T, hold=GRACE)
    back(cs, "a", "b")
    reg(cs, "c", claim=claim_primary(1, 1, 0), now=T + 0.1)
    reg(cs, "d", claim=claim_replica(1, 1, 0), now=T + 0.1)
    assert cs.primary_of(1) == "c"
    assert not cs.claims_in(T + 0.1)


def test_never_early_with_a_stale_record() -> None:
    """A shard obeyed a newer broker since the record was made (BinaryStar rule 7): no
    recorded set binds, so a newer copy may still be on its way."""
    cs = restarted(cluster(), now=T, hold=GRACE)
    back(cs, "a", "b", "c", "d")
    assert cs.claims_in(T + 0.1)
    cs.record_stale()
    assert not cs.claims_in(T + 0.1)


def test_ending_early_changes_nothing_but_when_routing_starts() -> None:
    """The same claims, the hold ended as they are in or when the grace runs out: the
    same partitions, primaries, replicas, in-sync sets and members."""

    def end(early: bool) -> dict[int, PartitionInfo]:
        cs = restarted(cluster(), now=T, hold=GRACE)
        back(cs, "d", "b", "a", "c")
        now = T + 0.1 if early else T + GRACE
        assert cs.claims_in(T + 0.1)
        if early:
            cs.hold_until = now
        cs.tick(now)
        assert not cs.holding(now)
        assert cs.members_of(0) == ("a", "b") and cs.members_of(1) == ("c", "d")
        return {p: part(cs, p) for p in (0, 1)}

    assert end(early=True) == end(early=False)
