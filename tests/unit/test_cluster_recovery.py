"""The broker's recovery rules after crashes (zps/core/cluster.py rules 4 and 8): the
durable in-sync set, claims that may lack acknowledged writes, and a newer copy that
registers while an older one serves."""

from __future__ import annotations

from tests.unit.test_cluster import (
    by_node,
    claim_primary,
    part,
    primary,
    reg,
    replica,
    restarted,
    spare,
)
from zps.core.cluster import Claim, ClusterState
from zps.protocol.messages import Role


def two_copies() -> ClusterState:
    """1 partition x 2 copies: p primary, r its in-sync replica, confirmed at LSN 10."""
    cs = ClusterState(1, n_slots=16, replication=2)
    reg(cs, "p")
    reg(cs, "r")
    cs.report("p", lsn=10, epoch=1, in_sync=["r"], t=1.0)
    assert cs.members_of(0) == ("p", "r")
    return cs


def test_the_in_sync_set_is_recorded_and_shrinks_when_a_replica_leaves() -> None:
    cs = two_copies()
    assert cs.records()[0].in_sync == ("p", "r")
    cs.node_gone("r")
    assert cs.members_of(0) == ("p",) and cs.records()[0].in_sync == ("p",)
    # The primary acknowledges more writes alone; the record says only p has them.
    cs.report("p", lsn=30, epoch=1, in_sync=[], t=2.0)
    assert cs.records()[0].in_sync == ("p",)


def test_after_a_crash_only_a_member_of_the_recorded_in_sync_set_is_elected() -> None:
    """The replica died, the primary acknowledged 20 more pushes, everything crashed;
    the older copy registers first and must not win."""
    cs = two_copies()
    cs.node_gone("r")
    cs.report("p", lsn=30, epoch=1, in_sync=[], t=2.0)
    cs.node_gone("p")
    cs = restarted(cs, now=100.0, hold=1.0)
    assert reg(cs, "r", claim=claim_primary(0, 1, 10), now=100.1) == []
    assert cs.shards["r"].held == claim_primary(0, 1, 10)
    assert cs.tick(102.0) == []  # the hold ends: no member came back, nobody is elected
    assert cs.primary_of(0) is None and cs.is_lost(0)
    errors = [m for level, m in cs.notices if level == "error"]
    assert any("shard r" in m and "LSN 10: not taken" in m for m in errors)
    report = cs.status(102.0, {})["partitions"][0]
    assert "in-sync set (p)" in report["awaiting"] and report["held_copies"][0]["node"] == "r"
    # The member comes back: it serves, the older copy follows it (and only then is
    # overwritten by a snapshot: it holds nothing that was acknowledged).
    out = by_node(reg(cs, "p", claim=claim_primary(0, 1, 30), now=103.0))
    assert out["p"] == primary("p", 0, 1)
    assert out["r"] == replica("r", 0, 1, "p")


def test_the_in_sync_set_moves_to_a_promoted_copy_once_it_is_confirmed() -> None:
    cs = two_copies()
    cs.node_gone("p")
    assert cs.primary_of(0) == "r" and part(cs, 0).epoch == 2
    # Not confirmed yet (no lease, so no write): p's copy still holds everything.
    assert cs.members_of(0) == ("p", "r")
    cs.report("r", lsn=12, epoch=2, in_sync=[], t=3.0)
    assert cs.members_of(0) == ("r",)


def test_an_incomplete_copy_is_never_elected_without_the_operator() -> None:
    cs = ClusterState(1, n_slots=16)
    incomplete = Claim(0, 3, Role.PRIMARY, 40, complete=False)
    assert reg(cs, "a", claim=incomplete) == []
    assert cs.shards["a"].held == incomplete
    errors = [m for level, m in cs.notices if level == "error"]
    assert any("may lack acknowledged writes" in m for m in errors)
    # An empty shard does not get the partition either: a held copy says it had data.
    assert reg(cs, "empty") == [spare("empty")]
    assert cs.primary_of(0) is None and cs.is_lost(0)
    out = by_node(cs.reset_partition(0, now=1.0))
    assert out["a"] == primary("a", 0, 3)


def fenced_takeover(writes: int) -> tuple[ClusterState, list[str]]:
    """A broker without a record: an empty shard took partition 0, then the shard
    holding its data registers.  ``writes``: what the empty one took meanwhile."""
    cs = ClusterState(1, n_slots=16, replication=2)
    cs.lease = 0.8
    assert reg(cs, "empty") == [primary("empty", 0, 1)]
    cs.report("empty", lsn=0, epoch=1, in_sync=[], t=5.0)
    cs.report("empty", lsn=writes, epoch=1, in_sync=[], t=5.2)
    assert reg(cs, "data", claim=claim_primary(0, 4, 500), now=6.0) == []
    return cs, [m for _, m in cs.notices]


def test_a_copy_with_data_takes_over_from_a_primary_that_took_no_write() -> None:
    cs, _ = fenced_takeover(writes=0)
    assert cs.handing_over(0) == "data"
    assert part(cs, 0).primary is None  # requests wait while it is fenced
    assert cs.lease_echo("empty") == (Role.SPARE, None, 0)  # its lease is not renewed
    cs.report("empty", lsn=0, epoch=1, in_sync=[], t=5.9)  # still inside its lease
    assert cs.tick(7.0) == []
    cs.report("empty", lsn=0, epoch=1, in_sync=None, t=6.5)  # the liveness thread's: no
    assert cs.tick(7.1) == []
    cs.report("empty", lsn=0, epoch=1, in_sync=[], t=6.1)  # its loop, after the lease
    out = by_node(cs.tick(7.2))
    assert out["data"] == primary("data", 0, 4)
    assert out["empty"] == replica("empty", 0, 4, "data")  # it resynchronises
    warnings = [m for level, m in cs.notices if level == "warning"]
    assert any("data holds a newer copy" in m for m in warnings)


def test_a_copy_with_data_and_a_primary_with_writes_are_a_conflict() -> None:
    cs, _ = fenced_takeover(writes=3)
    assert cs.handing_over(0) is None and cs.primary_of(0) == "empty"
    assert cs.shards["data"].held == claim_primary(0, 4, 500)
    errors = [m for level, m in cs.notices if level == "error"]
    assert any("two copies hold writes" in m and "reset-partition" in m for m in errors)
    # Neither is overwritten: the held copy is no spare for anyone.
    assert cs.tick(8.0) == [] and cs.shards["data"].role is Role.SPARE
    assert "data" not in part(cs, 0).replicas


def test_writes_taken_while_fenced_call_the_hand_over_off() -> None:
    cs, _ = fenced_takeover(writes=0)
    cs.report("empty", lsn=2, epoch=1, in_sync=[], t=6.2)  # it wrote before its lease ran out
    assert cs.tick(7.0) == []
    assert cs.primary_of(0) == "empty" and cs.handing_over(0) is None
    assert part(cs, 0).primary == "empty"
    assert cs.lease_echo("empty") == (Role.PRIMARY, 0, 1)
    assert cs.shards["data"].held is not None
    assert any("two copies hold writes" in m for level, m in cs.notices if level == "error")


def test_a_fenced_primary_that_dies_leaves_the_newer_copy_to_the_operator() -> None:
    cs, _ = fenced_takeover(writes=0)
    cs.node_gone("empty", now=6.5)
    assert cs.handing_over(0) is None
    assert cs.primary_of(0) is None and cs.shards["data"].held is not None
    out = by_node(cs.reset_partition(0, now=7.0))
    assert out["data"] == primary("data", 0, 4)


def test_an_older_copy_after_the_hold_becomes_a_replica() -> None:
    cs = ClusterState(1, n_slots=16, replication=2)
    reg(cs, "p", claim=claim_primary(0, 3, 50))
    cs.report("p", lsn=60, epoch=3, in_sync=[], t=1.0)
    out = reg(cs, "old", claim=claim_primary(0, 2, 70), now=1.0)
    assert by_node(out)["old"] == replica("old", 0, 3, "p")
    assert cs.handing_over(0) is None


def test_a_failed_over_primary_that_comes_back_longer_just_follows() -> None:
    """The usual crash: the primary dies with writes its replica never got (so they were
    never acknowledged under acks="all"); the replica is promoted and writes on.  The old
    primary's restart claims more updates at the old epoch, which this broker gave it: it
    resynchronises as a replica, with no hand-over and no conflict."""
    cs = two_copies()
    cs.report("r", lsn=10, epoch=1, t=1.0)
    cs.node_gone("p")
    cs.report("r", lsn=25, epoch=2, in_sync=[], t=2.0)  # confirmed, and wrote on
    out = by_node(reg(cs, "p", claim=claim_primary(0, 1, 12), now=3.0))
    assert out["p"] == replica("p", 0, 2, "r")
    assert cs.handing_over(0) is None and cs.shards["p"].held is None
    assert not [m for level, m in cs.notices if level == "error"]


def test_a_promoted_copy_that_took_no_write_is_its_own_floor_after_a_power_loss() -> None:
    """Simulator seed 1015: the replica is promoted and confirmed at epoch 2 at LSN 45,
    takes no write, and every host loses power.  Its log's last record is of epoch 1, so
    it claims (1, 45): it is the floor's copy (a member, at the floor's LSN), not older."""
    cs = two_copies()
    cs.report("p", lsn=45, epoch=1, in_sync=["r"], t=2.0)
    cs.report("r", lsn=45, epoch=1, t=2.0)
    cs.node_gone("p")
    cs.report("r", lsn=45, epoch=2, in_sync=[], t=3.0)
    assert cs.floor_of(0) == (2, 45) and cs.members_of(0) == ("r",)
    cs.node_gone("r")
    cs = restarted(cs, now=10.0, hold=1.0)
    assert reg(cs, "r", claim=claim_primary(0, 1, 45), now=10.1) == [primary("r", 0, 3)]
    # Another copy at the same LSN and epoch 1 is not the floor's: it is refused.
    cs2 = restarted(cs, now=20.0, hold=1.0)
    assert reg(cs2, "p", claim=claim_primary(0, 1, 45), now=20.1) == []


def test_a_running_broker_keeps_a_lost_partition_for_its_last_in_sync_copy() -> None:
    """Rule 4 without a restart (simulator seed 264): the replica died and left the
    in-sync set, the primary acknowledged pushes alone whose heartbeats never reached the
    broker (the floor stayed at 10) and was declared dead.  The replica comes back with a
    primary's claim at the floor: it is not a member, so it is held, not elected; the
    primary's copy, which holds those pushes, takes the partition when it returns."""
    cs = two_copies()
    cs.node_gone("r")
    assert cs.members_of(0) == ("p",) and cs.floor_of(0) == (1, 10)
    cs.node_gone("p", now=5.0)
    assert cs.is_lost(0)
    assert reg(cs, "r", claim=claim_primary(0, 1, 10), now=6.0) == []
    assert cs.primary_of(0) is None and cs.shards["r"].held == claim_primary(0, 1, 10)
    errors = [m for level, m in cs.notices if level == "error"]
    assert any("shard r" in m and "last in-sync set (p)" in m for m in errors)
    out = by_node(reg(cs, "p", claim=claim_primary(0, 1, 25), now=7.0))
    assert out["p"] == primary("p", 0, 1) and cs.primary_of(0) == "p"
