"""The broker's state machine: fill order, replicas, promotion, the start-up hold, claims."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from zps.core.cluster import Assignment, Claim, ClusterState, ShardNode
from zps.core.routing import ClusterMap, PartitionInfo
from zps.protocol.messages import Role


def reg(
    cs: ClusterState, node: str, *, claim: Claim | None = None, now: float = 0.0
) -> list[Assignment]:
    return cs.register_shard(node, host="h", pid=1, address=f"tcp://{node}", now=now, claim=claim)


def primary(node: str, partition: int, epoch: int) -> Assignment:
    return Assignment(node, Role.PRIMARY, partition, epoch)


def replica(node: str, partition: int, epoch: int, of: str | None) -> Assignment:
    return Assignment(node, Role.REPLICA, partition, epoch, of, f"tcp://{of}" if of else "")


def spare(node: str) -> Assignment:
    return Assignment(node, Role.SPARE, None, 0)


def claim_primary(partition: int, epoch: int, lsn: int = 0) -> Claim:
    return Claim(partition, epoch, Role.PRIMARY, lsn)


def claim_replica(partition: int, epoch: int, lsn: int = 0, in_sync: bool = False) -> Claim:
    return Claim(partition, epoch, Role.REPLICA, lsn, in_sync)


def by_node(out: list[Assignment]) -> dict[str, Assignment]:
    """The assignment each node ends up with (the last one sent to it wins)."""
    return {a.node_id: a for a in out}


def part(cs: ClusterState, p: int) -> PartitionInfo:
    return cs.map.partitions[p]


def full_cluster(n_partitions: int, replication: int, *names: str) -> ClusterState:
    cs = ClusterState(n_partitions, n_slots=64, replication=replication)
    for name in names:
        reg(cs, name)
    return cs


# ---- construction -----------------------------------------------------------


def test_needs_partitions_enough_slots_and_a_replication_of_one_or_more() -> None:
    with pytest.raises(ValueError):
        ClusterState(0)
    with pytest.raises(ValueError):
        ClusterState(8, n_slots=4)
    with pytest.raises(ValueError):
        ClusterState(2, replication=0)


def test_initial_map_has_no_primaries() -> None:
    cs = ClusterState(3, n_slots=16, replication=2)
    assert cs.map_version == 0 and cs.map.version == 0
    assert cs.map.n_partitions == 3
    assert all(info == PartitionInfo() for info in cs.map.partitions.values())
    assert sorted(set(cs.map.slot_map.tolist())) == [0, 1, 2]
    assert [cs.primary_of(p) for p in (-1, 0, 2, 3)] == [None, None, None, None]
    assert cs.assignment_of("nobody") is None


# ---- filling ----------------------------------------------------------------


def test_primaries_first_then_replicas_up_to_the_replication_then_spares() -> None:
    cs = ClusterState(2, n_slots=16, replication=3)
    assert reg(cs, "a") == [primary("a", 0, 1)]
    assert reg(cs, "b") == [primary("b", 1, 1)]
    assert reg(cs, "c") == [replica("c", 0, 1, "a")]
    assert reg(cs, "d") == [replica("d", 0, 1, "a")]
    assert reg(cs, "e") == [replica("e", 1, 1, "b")]
    assert reg(cs, "f") == [replica("f", 1, 1, "b")]
    assert cs.map_version == 6
    assert reg(cs, "g") == [spare("g")]
    assert reg(cs, "h") == [spare("h")]
    assert cs.map_version == 6  # a spare changes nothing in the map
    assert part(cs, 0) == PartitionInfo(1, "a", ("c", "d"), ())
    assert part(cs, 1) == PartitionInfo(1, "b", ("e", "f"), ())
    assert [cs.shards[n].role for n in "abcdefgh"] == [Role.PRIMARY] * 2 + [Role.REPLICA] * 4 + [
        Role.SPARE
    ] * 2


def test_without_replication_every_extra_shard_is_a_spare() -> None:
    cs = ClusterState(1, n_slots=16)
    assert reg(cs, "a") == [primary("a", 0, 1)]
    assert reg(cs, "b") == [spare("b")]
    assert part(cs, 0).replicas == ()


def test_a_replica_assignment_names_its_primary_and_where_to_reach_it() -> None:
    cs = full_cluster(1, 2, "p", "r")
    a = cs.assignment_of("r")
    assert a == Assignment("r", Role.REPLICA, 0, 1, "p", "tcp://p")
    assert cs.assignment_of("p") == primary("p", 0, 1)
    # The primary re-registers from another address: replicas are pointed there.
    cs.register_shard("p", host="h2", pid=2, address="tcp://elsewhere", now=1.0)
    assert cs.assignment_of("r") == Assignment("r", Role.REPLICA, 0, 1, "p", "tcp://elsewhere")


# ---- failover ---------------------------------------------------------------


def test_primary_death_promotes_the_in_sync_replica_with_the_highest_lsn() -> None:
    cs = full_cluster(1, 4, "p", "r1", "r2", "r3")
    assert cs.report("p", lsn=10, epoch=1, in_sync=["r1", "r2"])
    cs.report("r1", lsn=8)
    cs.report("r2", lsn=9)
    cs.report("r3", lsn=10)  # the most data, but not confirmed in sync: never promoted
    old_map, version = cs.map, cs.map_version
    out = cs.node_gone("p", 5.0)
    assert len(out) == len(by_node(out))  # one assignment per node
    assert by_node(out) == {
        "r2": primary("r2", 0, 2),
        "r1": replica("r1", 0, 2, "r2"),
        "r3": replica("r3", 0, 2, "r2"),
    }
    # The others resynchronise from the new primary: none is in sync with it yet.
    assert part(cs, 0) == PartitionInfo(2, "r2", ("r1", "r3"), ())
    assert cs.failovers == 1
    assert [cs.shards[n].epoch for n in ("r1", "r2", "r3")] == [2, 2, 2]
    assert cs.map_version > version and cs.map.version == cs.map_version
    assert old_map.partitions[0] == PartitionInfo(1, "p", ("r1", "r2", "r3"), ("r1", "r2"))
    assert "p" not in cs.shards


def test_equal_lsns_are_broken_the_same_way_every_time() -> None:
    winners = set()
    for order in (("r1", "r2"), ("r2", "r1")):
        cs = full_cluster(1, 3, "p", *order)
        cs.report("p", lsn=4, epoch=1, in_sync=["r1", "r2"])
        cs.report("r1", lsn=4)
        cs.report("r2", lsn=4)
        cs.node_gone("p", 1.0)
        winners.add(cs.primary_of(0))
    assert len(winners) == 1


def test_primary_death_without_an_in_sync_replica_loses_the_partition() -> None:
    cs = full_cluster(2, 2, "a", "b", "c", "d")  # a, b primaries; c, d their replicas
    cs.report("a", lsn=3, epoch=1, in_sync=[])
    old = cs.map
    out = cs.node_gone("a", 1.0)
    # The replica is not made a spare: it keeps its copy (held), told nothing.
    assert out == []
    assert cs.is_lost(0) and cs.primary_of(0) is None
    assert part(cs, 0) == PartitionInfo(1, None, (), (), lost=True)
    assert old.partitions[0].lost is False  # old maps are never edited
    assert cs.shards["c"].held == Claim(0, 1, Role.REPLICA, 0)
    assert cs.failovers == 0
    assert not cs.is_lost(1)
    # Neither the held replica nor a fresh shard gets the lost partition on its own.
    assert reg(cs, "e", now=2.0) == [spare("e")]
    assert cs.is_lost(0) and cs.primary_of(0) is None
    assert cs.status(3.0, {})["partitions"][0]["state"] == "lost"


def test_a_lost_partitions_replica_keeps_its_copy_for_reset_partition() -> None:
    """With no in-sync replica left the partition is lost, but its replicas' copies are
    held, never made spares (which drops them): under min_in_sync 2 a replica the primary
    dropped holds every acknowledged write.  reset-partition serves the newest of them,
    not an empty spare; a copy at the floor coming back releases the older ones."""
    cs = full_cluster(1, 3, "p", "r1", "r2", "s")  # s: a spare
    cs.report("p", lsn=9, epoch=1, in_sync=[])
    cs.report("r1", lsn=7)
    cs.report("r2", lsn=8)
    assert cs.node_gone("p", 1.0) == []
    assert cs.is_lost(0) and cs.shards["s"].role is Role.SPARE
    held = {n: cs.shards[n].held for n in ("r1", "r2")}
    assert held == {"r1": Claim(0, 1, Role.REPLICA, 7), "r2": Claim(0, 1, Role.REPLICA, 8)}
    out = by_node(cs.reset_partition(0, 2.0))
    assert out["r2"] == primary("r2", 0, 2)  # the newest held copy, not the spare
    assert out["r1"] == replica("r1", 0, 2, "r2")  # older: released, and it follows r2
    assert cs.primary_of(0) == "r2" and cs.shards["r1"].held is None


def test_a_replica_claim_of_a_lost_partition_is_held_not_made_a_spare() -> None:
    cs = full_cluster(1, 2, "p", "r")
    cs.report("p", lsn=9, epoch=1, in_sync=[])
    cs.node_gone("p", 1.0)
    cs.node_gone("r", 1.5)  # the held replica restarts: it claims its copy again
    assert reg(cs, "r", claim=claim_replica(0, 1, lsn=6), now=2.0) == []
    assert cs.shards["r"].held == claim_replica(0, 1, lsn=6)
    assert cs.is_lost(0)


def test_a_lost_partition_is_never_given_to_a_fresh_spare() -> None:
    cs = ClusterState(2, n_slots=16)
    reg(cs, "a")
    cs.node_gone("a")
    # "b" takes the never-served partition 1, "c" must wait: partition 0 holds data it lacks.
    assert reg(cs, "b") == [primary("b", 1, 1)]
    assert reg(cs, "c") == [spare("c")]
    cs.node_gone("b")  # partition 1 is lost too now
    assert cs.node_gone("c") == []
    assert reg(cs, "d") == [spare("d")]
    assert cs.is_lost(0) and cs.is_lost(1)
    assert [part(cs, p).epoch for p in (0, 1)] == [1, 1]  # the epochs are remembered


def test_a_spare_refills_a_partition_after_a_replica_dies() -> None:
    cs = full_cluster(2, 2, "a", "b", "c", "d", "s")  # s is a spare
    cs.report("a", lsn=1, epoch=1, in_sync=["c"])
    version = cs.map_version
    out = cs.node_gone("c", 1.0)
    assert out == [replica("s", 0, 1, "a")]
    assert part(cs, 0) == PartitionInfo(1, "a", ("s",), ())  # the dead one left in_sync
    assert cs.map_version > version


def test_a_spare_refills_a_partition_after_its_primary_dies() -> None:
    cs = full_cluster(1, 2, "p", "r", "s")
    cs.report("p", lsn=5, epoch=1, in_sync=["r"])
    out = cs.node_gone("p", 1.0)
    assert by_node(out) == {"r": primary("r", 0, 2), "s": replica("s", 0, 2, "r")}
    assert part(cs, 0) == PartitionInfo(2, "r", ("s",), ())


def test_the_death_of_a_spare_a_client_or_a_stranger_changes_nothing() -> None:
    cs = full_cluster(1, 1, "a", "spare")
    cs.register_client("w", host="h", pid=3, name="trainer", now=0.0)
    version, cmap = cs.map_version, cs.map
    assert cs.node_gone("spare") == []
    assert cs.node_gone("nobody") == []
    assert cs.node_gone("nobody", 99.0) == []
    assert cs.node_gone("w") == []
    assert cs.map_version == version and cs.map is cmap
    assert "spare" not in cs.shards and "w" not in cs.clients
    assert cs.primary_of(0) == "a"
    assert cs.node_gone("a") == [] and cs.node_gone("a") == []  # twice is harmless


# ---- reports ----------------------------------------------------------------


def test_in_sync_comes_only_from_the_current_primary_at_its_epoch() -> None:
    cs = full_cluster(2, 3, "a", "b", "c", "d", "e", "f")  # p0: a + c, d; p1: b + e, f
    version = cs.map_version
    assert not cs.report("c", lsn=1, epoch=1, in_sync=["d"])  # a replica can't say it
    assert not cs.report("a", lsn=5, epoch=0, in_sync=["c"])  # another epoch
    assert not cs.report("a", lsn=5, epoch=2, in_sync=["c"])
    assert not cs.report("a", lsn=5, in_sync=["c"])  # no epoch
    assert not cs.report("ghost", lsn=5, epoch=1, in_sync=["c"])
    assert cs.map_version == version and part(cs, 0).in_sync == ()
    assert cs.shards["a"].lsn == 5  # the LSN counts all the same
    # Only replicas of the primary's own partition are taken.
    assert cs.report("a", lsn=6, epoch=1, in_sync=["c", "e", "a", "b", "ghost"])
    assert part(cs, 0).in_sync == ("c",) and part(cs, 1).in_sync == ()
    assert cs.map_version == version + 1
    assert not cs.report("a", lsn=7, epoch=1, in_sync=["c"])  # nothing new
    assert not cs.report("a", lsn=7, epoch=1)  # no in_sync: keeps the set
    assert cs.map_version == version + 1 and part(cs, 0).in_sync == ("c",)
    assert cs.report("a", lsn=8, epoch=1, in_sync=["d", "c"])
    assert part(cs, 0).in_sync == ("c", "d")
    assert cs.report("a", lsn=9, epoch=1, in_sync=[])
    assert part(cs, 0).in_sync == ()


def test_report_updates_lsn_and_stats_of_a_known_shard_only() -> None:
    cs = full_cluster(1, 1, "a")
    assert not cs.report("a", lsn=7, stats={"x": 1})
    assert not cs.report("ghost", lsn=9, stats={})
    assert cs.shards["a"].lsn == 7 and cs.shards["a"].stats == {"x": 1}
    cs.report("a", lsn=8)  # no stats: the last ones stay
    assert cs.shards["a"].lsn == 8 and cs.shards["a"].stats == {"x": 1}
    assert "ghost" not in cs.shards


def test_an_old_primarys_report_does_not_touch_the_new_primarys_replicas() -> None:
    cs = full_cluster(1, 3, "p", "r1", "r2")
    cs.report("p", lsn=3, epoch=1, in_sync=["r1", "r2"])
    cs.report("r1", lsn=3)
    cs.node_gone("p")
    new = cs.primary_of(0)
    other = ({"r1", "r2"} - {new}).pop()
    assert not cs.report(other, lsn=3, epoch=1, in_sync=[other])  # now a replica
    assert part(cs, 0).in_sync == ()
    assert cs.report(new, lsn=3, epoch=2, in_sync=[other])
    assert part(cs, 0).in_sync == (other,)


# ---- re-registration --------------------------------------------------------


def test_reregistration_returns_the_current_assignment_and_changes_nothing() -> None:
    cs = full_cluster(2, 2, "a", "b", "r", "s", "t")  # r, s replicas; t spare
    cs.report("a", lsn=42, stats={"ops": 3}, epoch=1, in_sync=["r"])
    version, cmap = cs.map_version, cs.map
    assert reg(cs, "a", now=5.0) == [primary("a", 0, 1)]
    assert reg(cs, "a", claim=claim_primary(1, 3), now=5.0) == [primary("a", 0, 1)]
    assert reg(cs, "r", claim=claim_primary(0, 9), now=5.0) == [replica("r", 0, 1, "a")]
    assert reg(cs, "t", claim=claim_replica(1, 1), now=5.0) == [spare("t")]
    assert cs.map_version == version and cs.map is cmap
    assert cs.shards["a"].lsn == 42 and cs.shards["a"].registered_at == 0.0
    assert cs.primary_of(1) == "b"


# ---- start-up hold and claims -----------------------------------------------


def test_during_the_hold_plain_shards_wait_as_spares() -> None:
    cs = ClusterState(2, n_slots=16, replication=2, hold_until=10.0)
    assert cs.holding(9.9) and not cs.holding(10.0)
    assert reg(cs, "a", now=1.0) == [spare("a")]
    assert reg(cs, "b", now=2.0) == [spare("b")]
    assert reg(cs, "c", now=3.0) == [spare("c")]
    assert cs.map_version == 0 and all(info.primary is None for info in cs.map.partitions.values())
    assert [p["state"] for p in cs.status(5.0, {})["partitions"]] == ["holding", "holding"]
    assert cs.tick(5.0) == []
    assert cs.node_gone("nobody", 6.0) == []
    out = cs.tick(10.0)
    assert by_node(out) == {
        "a": primary("a", 0, 1),
        "b": primary("b", 1, 1),
        "c": replica("c", 0, 1, "a"),
    }
    assert cs.tick(11.0) == []  # the hold ends once
    assert [p["state"] for p in cs.status(11.0, {})["partitions"]] == ["degraded", "degraded"]


def test_a_shard_registering_after_the_hold_is_placed_at_once() -> None:
    cs = ClusterState(1, n_slots=16, hold_until=10.0)
    assert reg(cs, "a", now=12.0) == [primary("a", 0, 1)]  # even before tick() noticed


def test_claims_rebuild_the_map_during_the_hold() -> None:
    cs = ClusterState(3, n_slots=16, replication=2, hold_until=10.0)
    # Shards come back in any order with their claims.
    assert reg(cs, "c", claim=claim_primary(2, 7, lsn=30), now=1.0) == [primary("c", 2, 7)]
    assert reg(cs, "rc", claim=claim_replica(2, 7, lsn=30, in_sync=True), now=1.0) == [
        replica("rc", 2, 7, "c")
    ]
    # A replica whose primary is not back (yet) waits for it.
    reg(cs, "ra", claim=claim_replica(0, 4, lsn=12, in_sync=True), now=2.0)
    assert cs.assignment_of("ra") == replica("ra", 0, 4, None)
    assert reg(cs, "a", claim=claim_primary(0, 4, lsn=12), now=3.0) == [
        primary("a", 0, 4),
        replica("ra", 0, 4, "a"),
    ]
    assert reg(cs, "s", now=4.0) == [spare("s")]  # no claim: waits
    assert [part(cs, p) for p in range(3)] == [
        PartitionInfo(4, "a", ("ra",), ("ra",)),
        PartitionInfo(0, None, (), ()),
        PartitionInfo(7, "c", ("rc",), ("rc",)),
    ]
    assert cs.shards["a"].lsn == 12  # the claim's LSN is what the broker knows
    assert [p["state"] for p in cs.status(5.0, {})["partitions"]] == ["ok", "holding", "ok"]
    # The hold ends: the never-served partition goes to the waiting spare.
    assert cs.tick(10.0) == [primary("s", 1, 1)]


def test_after_the_hold_a_claimed_in_sync_replica_replaces_a_primary_that_never_came_back() -> None:
    cs = ClusterState(2, n_slots=16, replication=3, hold_until=10.0)
    reg(cs, "r1", claim=claim_replica(0, 3, lsn=5, in_sync=True), now=1.0)
    reg(cs, "r2", claim=claim_replica(0, 3, lsn=7, in_sync=True), now=1.0)
    reg(cs, "r3", claim=claim_replica(0, 3, lsn=9, in_sync=False), now=1.0)
    reg(cs, "s", now=2.0)
    reg(cs, "t", now=2.0)
    assert part(cs, 0) == PartitionInfo(3, None, ("r1", "r2"), ("r1", "r2"))
    assert cs.assignment_of("r3") == spare("r3")  # two replicas already: no room
    assert cs.tick(9.0) == []
    out = by_node(cs.tick(10.0))
    assert out["r2"] == primary("r2", 0, 4)  # in sync and the most data
    assert out["r1"] == replica("r1", 0, 4, "r2")
    # The spares fill the never-served partition 1, then the missing replica slots.
    assert out["r3"] == primary("r3", 1, 1)
    assert out["s"] == replica("s", 0, 4, "r2") and out["t"] == replica("t", 1, 1, "r3")
    assert part(cs, 0) == PartitionInfo(4, "r2", ("r1", "s"), ())
    assert cs.failovers == 1
    assert cs.is_lost(0) is False


def test_after_the_hold_a_partition_with_only_out_of_sync_replicas_is_lost() -> None:
    cs = ClusterState(1, n_slots=16, replication=2, hold_until=10.0)
    reg(cs, "r", claim=claim_replica(0, 2, lsn=5, in_sync=False), now=1.0)
    reg(cs, "s", now=1.0)
    assert part(cs, 0) == PartitionInfo(2, None, ("r",), ())
    assert cs.tick(10.0) == []  # r keeps its copy, held (no role): reset-partition's choice
    assert cs.shards["r"].held == Claim(0, 2, Role.REPLICA, 5)
    assert part(cs, 0) == PartitionInfo(2, None, (), (), lost=True)
    assert cs.shards["s"].role is Role.SPARE  # a lost partition goes to no fresh shard


def test_an_in_sync_claim_counts_only_during_the_hold() -> None:
    cs = full_cluster(1, 2, "p")
    assert reg(cs, "r", claim=claim_replica(0, 1, lsn=9, in_sync=True), now=1.0) == [
        replica("r", 0, 1, "p")
    ]
    assert part(cs, 0).in_sync == ()  # only the primary can say so now
    assert cs.report("p", lsn=9, epoch=1, in_sync=["r"])
    assert part(cs, 0).in_sync == ("r",)


def test_a_newer_primary_claim_wins_over_an_older_granted_one() -> None:
    cs = ClusterState(1, n_slots=16, replication=2, hold_until=10.0)
    assert reg(cs, "old", claim=claim_primary(0, 3), now=1.0) == [primary("old", 0, 3)]
    version = cs.map_version
    out = reg(cs, "new", claim=claim_primary(0, 5), now=2.0)
    assert by_node(out) == {"old": spare("old"), "new": primary("new", 0, 5)}
    assert cs.primary_of(0) == "new" and part(cs, 0).epoch == 5
    assert cs.shards["old"].role is Role.SPARE and cs.shards["old"].partition is None
    assert cs.map_version > version
    # After the hold the demoted shard follows the winner.
    assert cs.tick(10.0) == [replica("old", 0, 5, "new")]


def test_an_older_or_equal_primary_claim_on_a_served_partition_is_refused() -> None:
    cs = ClusterState(2, n_slots=16, hold_until=10.0)
    reg(cs, "a", claim=claim_primary(0, 5), now=1.0)
    version = cs.map_version
    assert reg(cs, "old", claim=claim_primary(0, 4), now=2.0) == [spare("old")]
    assert reg(cs, "same", claim=claim_primary(0, 5), now=2.0) == [spare("same")]
    assert cs.primary_of(0) == "a" and part(cs, 0).epoch == 5
    assert cs.map_version == version
    # After the hold the waiting spares are placed first, in registration order.
    out = reg(cs, "b", claim=claim_primary(0, 5), now=11.0)
    assert by_node(out) == {"b": spare("b"), "old": primary("old", 1, 1)}


def test_a_claim_older_than_the_known_epoch_is_refused_even_on_a_lost_partition() -> None:
    cs = ClusterState(1, n_slots=16)
    reg(cs, "a", claim=claim_primary(0, 5))
    cs.node_gone("a")
    assert cs.is_lost(0)
    # The older copy is kept where it is (not made a spare) in case an operator wants it.
    assert reg(cs, "old", claim=claim_primary(0, 4)) == []
    assert cs.primary_of(0) is None and cs.is_lost(0)
    assert cs.shards["old"].held == claim_primary(0, 4)
    # The shard that holds the data at the known epoch may claim it back; the older
    # copy is let go.
    assert reg(cs, "back", claim=claim_primary(0, 5)) == [primary("back", 0, 5), spare("old")]
    assert not cs.is_lost(0) and part(cs, 0).epoch == 5


def test_replica_claims_need_the_partitions_epoch_and_room() -> None:
    cs = ClusterState(1, n_slots=16, replication=2, hold_until=10.0)
    reg(cs, "p", claim=claim_primary(0, 4), now=1.0)
    assert reg(cs, "older", claim=claim_replica(0, 3, in_sync=True), now=1.0) == [spare("older")]
    assert reg(cs, "newer", claim=claim_replica(0, 5, in_sync=True), now=1.0) == [spare("newer")]
    assert reg(cs, "ok", claim=claim_replica(0, 4, in_sync=True), now=1.0) == [
        replica("ok", 0, 4, "p")
    ]
    assert reg(cs, "full", claim=claim_replica(0, 4, in_sync=True), now=1.0) == [spare("full")]
    assert part(cs, 0) == PartitionInfo(4, "p", ("ok",), ("ok",))


@pytest.mark.parametrize(
    "claim",
    [claim_primary(-1, 1), claim_primary(2, 1), claim_replica(99, 0), claim_replica(-5, 3)],
)
def test_a_claim_on_a_partition_that_does_not_exist_is_ignored(claim: Claim) -> None:
    cs = ClusterState(2, n_slots=16)
    assert reg(cs, "a", claim=claim) == [primary("a", 0, 1)]
    held = ClusterState(2, n_slots=16, hold_until=5.0)
    assert reg(held, "a", claim=claim, now=1.0) == [spare("a")]
    assert held.map_version == 0


def test_a_spare_claim_is_a_plain_registration() -> None:
    cs = ClusterState(1, n_slots=16)
    assert reg(cs, "a", claim=Claim(0, 3, Role.SPARE)) == [primary("a", 0, 1)]


# ---- the map ----------------------------------------------------------------


def test_every_change_makes_a_new_map_with_a_higher_version() -> None:
    cs = ClusterState(2, n_slots=16, replication=2)
    maps = [cs.map]

    def changed() -> None:
        assert cs.map is not maps[-1]
        assert cs.map.version == cs.map_version > maps[-1].version
        back = ClusterMap.from_wire(cs.map.to_wire())
        assert dict(back.partitions) == dict(cs.map.partitions)
        assert back.incarnation == cs.incarnation
        maps.append(cs.map)

    def unchanged() -> None:
        assert cs.map is maps[-1] and cs.map_version == maps[-1].version

    reg(cs, "a")
    changed()
    reg(cs, "b")
    changed()
    reg(cs, "c")
    changed()
    reg(cs, "d")
    changed()
    reg(cs, "s")
    unchanged()
    cs.report("a", lsn=1, epoch=1, in_sync=["c"])
    changed()
    cs.report("a", lsn=2, epoch=1, in_sync=["c"])
    unchanged()
    cs.node_gone("a")
    changed()
    cs.node_gone("b")
    changed()
    cs.node_gone("d")  # a replica demoted to spare when partition 1 was lost
    unchanged()
    # The snapshots taken along the way were never edited.
    assert [m.partitions[0].primary for m in maps] == [None] + ["a"] * 5 + ["c", "c"]
    assert [m.partitions[0].replicas for m in maps][-3:] == [("c",), ("s",), ("s",)]
    assert [m.partitions[1].lost for m in maps] == [False] * 7 + [True]


def test_two_states_have_different_incarnations() -> None:
    assert ClusterState(1).incarnation != ClusterState(1).incarnation


# ---- status -----------------------------------------------------------------


def test_status_report() -> None:
    cs = full_cluster(2, 3, "a", "b", "c", "d", "e", "f", "g")  # p0: a + c, d; p1: b + e, f
    cs.report("a", lsn=10, stats={"ops": 5}, epoch=1, in_sync=["c", "d"])
    cs.report("c", lsn=10)
    cs.report("d", lsn=7)
    cs.report("b", lsn=4, epoch=1, in_sync=["e"])
    cs.report("e", lsn=4)
    cs.report("f", lsn=1)
    cs.register_client("w1", host="hw", pid=9, name="trainer", now=2.0)
    cs.register_client("w0", host="hw", pid=8, name="", now=2.0)
    s = cs.status(10.0, {"a": 9.5, "w1": 4.0})
    assert s["map_version"] == cs.map_version and s["incarnation"] == cs.incarnation
    assert (s["n_partitions"], s["n_slots"], s["replication"], s["failovers"]) == (2, 64, 3, 0)
    p0, p1 = s["partitions"]
    assert (p0["partition"], p0["epoch"], p0["state"], p0["primary"], p0["lsn"]) == (
        0,
        1,
        "ok",
        "a",
        10,
    )
    assert p0["replicas"] == [
        {"node": "c", "in_sync": True, "lsn": 10, "lag": 0},
        {"node": "d", "in_sync": True, "lsn": 7, "lag": 3},
    ]
    assert (p1["state"], p1["lsn"]) == ("degraded", 4)  # one in-sync replica of two
    assert p1["replicas"] == [
        {"node": "e", "in_sync": True, "lsn": 4, "lag": 0},
        {"node": "f", "in_sync": False, "lsn": 1, "lag": 3},
    ]
    assert [(n["node"], n["role"], n["partition"]) for n in s["shards"]] == [
        ("a", "primary", 0),
        ("c", "replica", 0),
        ("d", "replica", 0),
        ("b", "primary", 1),
        ("e", "replica", 1),
        ("f", "replica", 1),
        ("g", "spare", None),
    ]
    a = s["shards"][0]
    assert (a["host"], a["pid"], a["address"], a["epoch"], a["lsn"], a["stats"]) == (
        "h",
        1,
        "tcp://a",
        1,
        10,
        {"ops": 5},
    )
    assert a["last_seen_s"] == 0.5 and s["shards"][1]["last_seen_s"] is None
    assert [(c["node"], c["name"], c["last_seen_s"]) for c in s["clients"]] == [
        ("w0", "", None),
        ("w1", "trainer", 6.0),
    ]
    # The primary of partition 0 dies: "c" (LSN 10) takes over; "g" fills in.
    cs.node_gone("a", 11.0)
    cs.node_gone("w1", 11.0)
    s = cs.status(12.0, {})
    p0 = s["partitions"][0]
    assert (p0["epoch"], p0["state"], p0["primary"], p0["lsn"]) == (2, "degraded", "c", 10)
    assert p0["replicas"] == [
        {"node": "d", "in_sync": False, "lsn": 7, "lag": 3},
        {"node": "g", "in_sync": False, "lsn": 0, "lag": 10},
    ]
    assert s["failovers"] == 1
    assert [c["node"] for c in s["clients"]] == ["w0"]


def test_status_of_unassigned_holding_and_lost_partitions() -> None:
    s = ClusterState(2, n_slots=16).status(0.0, {})
    assert [p["state"] for p in s["partitions"]] == ["unassigned", "unassigned"]
    assert all(p["primary"] is None and p["lsn"] is None for p in s["partitions"])
    assert s["shards"] == [] and s["clients"] == []
    cs = ClusterState(2, n_slots=16, hold_until=10.0)
    reg(cs, "r", claim=claim_primary(0, 2), now=1.0)
    assert [p["state"] for p in cs.status(1.0, {})["partitions"]] == ["ok", "holding"]
    cs.node_gone("r", 2.0)
    # a death in the hold is decided when the hold ends (a replica may still claim)
    assert [p["state"] for p in cs.status(3.0, {})["partitions"]] == ["holding", "holding"]
    cs.tick(11.0)
    assert [p["state"] for p in cs.status(11.0, {})["partitions"]] == ["lost", "unassigned"]


# ---- known bugs (see the reasons) -------------------------------------------


def test_a_replica_in_sync_only_at_an_older_epoch_is_not_promoted() -> None:
    cs = ClusterState(1, n_slots=16, replication=3, hold_until=10.0)
    reg(cs, "stale", claim=claim_replica(0, 1, lsn=100, in_sync=True), now=1.0)
    reg(cs, "fresh", claim=claim_replica(0, 2, lsn=90, in_sync=True), now=1.0)
    cs.tick(10.0)
    assert cs.primary_of(0) == "fresh"


def test_replicas_of_an_older_epoch_do_not_stay_in_sync_with_a_newer_primary() -> None:
    cs = ClusterState(1, n_slots=16, replication=2, hold_until=10.0)
    reg(cs, "r", claim=claim_replica(0, 1, lsn=100, in_sync=True), now=1.0)
    out = reg(cs, "p", claim=claim_primary(0, 2, lsn=90), now=1.0)
    a = by_node(out).get("r", cs.assignment_of("r"))
    assert a is not None
    # Either it follows the new primary at the new epoch (out of sync) or it is let go.
    assert a.epoch == 2 or a.role is Role.SPARE
    assert part(cs, 0).in_sync == ()


def test_replicas_of_a_partition_lost_at_the_end_of_the_hold_keep_their_copies() -> None:
    cs = ClusterState(2, n_slots=16, replication=2, hold_until=10.0)
    reg(cs, "r", claim=claim_replica(0, 1, lsn=5, in_sync=False), now=1.0)
    cs.tick(10.0)
    assert cs.is_lost(0)
    assert cs.primary_of(1) is None  # r does not give its copy up for another partition
    assert cs.shards["r"].held == claim_replica(0, 1, lsn=5)


def test_a_lost_partition_never_keeps_replicas() -> None:
    cs = ClusterState(1, n_slots=16, replication=2, hold_until=10.0)
    reg(cs, "p", claim=claim_primary(0, 2, lsn=9), now=1.0)
    cs.node_gone("p", 2.0)  # dies again before its replica is back: lost at once
    reg(cs, "r", claim=claim_replica(0, 2, lsn=9, in_sync=True), now=3.0)
    cs.tick(10.0)
    info = part(cs, 0)
    assert not (info.lost and info.replicas)


def test_tick_sends_one_assignment_per_node() -> None:
    cs = ClusterState(1, n_slots=16, replication=3, hold_until=10.0)
    reg(cs, "r1", claim=claim_replica(0, 1, lsn=5, in_sync=True), now=1.0)
    reg(cs, "r2", claim=claim_replica(0, 1, lsn=7, in_sync=True), now=1.0)
    out = cs.tick(10.0)
    assert by_node(out)["r1"] == replica("r1", 0, 2, "r2")  # the last one is right
    assert len(out) == len(by_node(out))


# ---- random sequences -------------------------------------------------------

N_PARTITIONS = 3
NODES = [f"n{i}" for i in range(8)]
HOLD = 10.0


def _view(a: Assignment | None) -> tuple[object, ...] | None:
    return None if a is None else (a.role, a.partition, a.epoch, a.primary)


class Sim:
    """Drives a ClusterState with events and checks every step.

    ``beliefs`` is what each shard process was last told (or claimed): it survives
    the broker's restarts and the broker declaring the process dead, so such a
    process can come back with a claim.
    """

    def __init__(self, replication: int, hold: bool) -> None:
        self.now = 0.0
        self.replication = replication
        self.cs = ClusterState(
            N_PARTITIONS, n_slots=16, replication=replication, hold_until=HOLD if hold else 0.0
        )
        self.beliefs: dict[str, Assignment] = {}
        self.lsn: dict[str, int] = {}
        self.promotions = 0

    # -- events ----------------------------------------------------------------

    def register(self, node: str, claim: Claim | None) -> None:
        cs = self.cs
        known = cs.assignment_of(node)
        version = cs.map_version

        def event() -> list[Assignment]:
            return cs.register_shard(
                node, host="h", pid=1, address=f"tcp://{node}", now=self.now, claim=claim
            )

        if known is not None:  # a re-registration: it is told what it is, nothing changes
            held = cs.shards[node].held is not None
            assert event() == ([] if held else [known]) and cs.map_version == version
            return
        lost = {p for p in range(N_PARTITIONS) if cs.is_lost(p)}
        self._step(event, node, claim)
        a = cs.assignment_of(node)
        assert a is not None
        if claim is None or claim.role is Role.SPARE:
            assert a.partition not in lost  # a fresh shard never gets a lost partition

    def returning(self) -> list[str]:
        """Live processes the broker does not know (after a restart or a missed beat)."""
        return sorted(n for n in self.beliefs if n not in self.cs.shards)

    def reclaim(self, node: str, in_sync: bool) -> None:
        b = self.beliefs[node]
        claim = None
        if b.partition is not None:
            claim = Claim(b.partition, b.epoch, b.role, self.lsn.get(node, 0), in_sync)
        self.register(node, claim)

    def report(self, node: str, lsn_step: int, in_sync: list[str] | None, epoch_skew: int) -> None:
        cs = self.cs
        shard = cs.shards[node]
        self.lsn[node] = self.lsn.get(node, 0) + lsn_step
        epoch = shard.epoch + epoch_skew
        before = cs.map
        changed = cs.report(node, lsn=self.lsn[node], epoch=epoch, in_sync=in_sync)
        assert changed == (cs.map is not before) and shard.lsn == self.lsn[node]
        if shard.role is Role.PRIMARY and in_sync is not None and epoch == shard.epoch:
            info = cs.map.partitions[partition_of(shard)]
            assert set(info.in_sync) == set(in_sync) & set(info.replicas)
        else:
            assert not changed

    def gone(self, node: str, crashed: bool) -> None:
        """The broker loses ``node``: it crashed, or (still alive) missed its heartbeats."""
        self._step(lambda: self.cs.node_gone(node, self.now))
        assert node not in self.cs.shards
        if crashed:
            self.beliefs.pop(node, None)
            self.lsn.pop(node, None)

    def tick(self, dt: float) -> None:
        self.now += dt
        self._step(lambda: self.cs.tick(self.now))

    def broker_restart(self) -> None:
        """A new broker that loads what the old one recorded (as from its data dir)."""
        old = self.cs
        self.cs = ClusterState(
            N_PARTITIONS, n_slots=16, replication=self.replication, hold_until=self.now + HOLD
        )
        self.cs.restore(old.map_version, old.records())

    # -- checks ----------------------------------------------------------------

    def _step(
        self,
        event: Callable[[], list[Assignment]],
        claimant: str | None = None,
        claim: Claim | None = None,
    ) -> None:
        """Run ``event`` and check what changed."""
        cs = self.cs
        before = dict(cs.map.partitions)
        old_map, old_version = cs.map, cs.map_version
        lsn = {n: s.lsn for n, s in cs.shards.items()}
        # Rule 8: a fenced primary (the map names none) may serve again, or hand over.
        fenced = {p: (cs.primary_of(p), cs.handing_over(p)) for p in range(N_PARTITIONS)}
        out = event()
        for a in out:
            assert a.node_id in cs.shards, f"assignment for a dead node {a.node_id}"
            self.beliefs[a.node_id] = a
        for node, a in by_node(out).items():
            held = cs.shards[node].held
            if held is not None and a.role is Role.REPLICA and a.partition == held.partition:
                continue  # made a replica, then its partition was lost: it keeps its copy
            assert a == cs.assignment_of(node)  # the last one sent is the truth
        if claimant in cs.shards and claimant not in by_node(out):
            shard = cs.shards[claimant]
            assert claim is not None
            if shard.held is not None:
                # A copy the partition may not be given (rule 4), or newer than the
                # serving primary's origin (rule 8): kept, and the shard keeps
                # believing what it claimed until it is told otherwise.
                assert shard.held == claim and shard.role is Role.SPARE
                assert cs.primary_of(claim.partition) is None or (
                    claim.epoch,
                    claim.lsn,
                ) > cs.origin_of(claim.partition)
                self.beliefs[claimant] = Assignment(
                    claimant, claim.role, claim.partition, claim.epoch
                )
            else:
                # A replica claim granted with no primary to follow yet: it keeps what it has.
                assert shard.role is Role.REPLICA
                assert shard.partition is not None and cs.primary_of(shard.partition) is None
                self.beliefs[claimant] = Assignment(
                    claimant, Role.REPLICA, claim.partition, claim.epoch
                )
        if dict(cs.map.partitions) != dict(old_map.partitions):
            assert cs.map_version > old_version
        if cs.map_version != old_version:
            assert cs.map is not old_map and cs.map.version > old_map.version
        else:
            assert cs.map is old_map
        for p in range(N_PARTITIONS):
            was, now = before[p], cs.map.partitions[p]
            assert now.epoch >= was.epoch  # epochs never go back
            if now.primary is None or now.primary == was.primary:
                continue
            claimed = (
                claimant == now.primary
                and claim is not None
                and claim.role is Role.PRIMARY
                and claim.partition == p
            )
            promoted = now.primary in was.in_sync
            fresh = was.epoch == 0 and was.primary is None and now.epoch == 1 and not was.lost
            handed = fenced[p][1] is not None and now.primary in fenced[p]
            assert claimed or promoted or fresh or handed, (p, was, now)
            if promoted and not claimed:
                self.promotions += 1
                assert now.epoch == was.epoch + 1
                # ... and it had the most data of the in-sync replicas still alive.
                rivals = [r for r in was.in_sync if r in cs.shards]
                assert all(lsn[now.primary] >= lsn[r] for r in rivals)
                assert now.in_sync == ()  # the others must catch up with it first
            if was.lost:
                assert claimed  # a lost partition goes to no fresh shard

    def check(self) -> None:
        """Invariants of the state between events."""
        cs = self.cs
        seen: set[str] = set()
        for p in range(N_PARTITIONS):
            info = cs.map.partitions[p]
            serving = None if cs.handing_over(p) else cs.primary_of(p)
            assert info.primary == serving and info.lost == cs.is_lost(p)
            members = [*([info.primary] if info.primary else []), *info.replicas]
            assert len(set(members)) == len(members) and not seen & set(members)
            seen |= set(members)  # a node serves at most one partition, in one role
            assert set(info.in_sync) <= set(info.replicas)
            assert len(info.replicas) <= cs.replication - 1
            if info.primary is not None:
                shard = cs.shards[info.primary]  # alive
                assert (shard.role, shard.partition, shard.epoch) == (Role.PRIMARY, p, info.epoch)
                assert not info.lost
            for r in info.replicas:
                assert (cs.shards[r].role, cs.shards[r].partition) == (Role.REPLICA, p)
        for shard in cs.shards.values():
            if shard.role is Role.PRIMARY:  # never two primaries: each one is the map's
                assert shard.partition is not None
                assert cs.primary_of(shard.partition) == shard.node_id
            elif shard.role is Role.REPLICA:
                assert shard.partition is not None
                assert shard.node_id in cs.map.partitions[shard.partition].replicas
            else:
                assert shard.partition is None and shard.node_id not in seen
            # Every shard was told its current role (one holding an old copy keeps it).
            if shard.held is None:
                assert _view(self.beliefs.get(shard.node_id)) == _view(
                    cs.assignment_of(shard.node_id)
                )
        m = cs.map
        assert m.version == cs.map_version
        assert dict(ClusterMap.from_wire(m.to_wire()).partitions) == dict(m.partitions)


def partition_of(shard: ShardNode) -> int:
    assert shard.partition is not None
    return shard.partition


claims = st.builds(
    Claim,
    partition=st.integers(-1, N_PARTITIONS),
    epoch=st.integers(0, 6),
    role=st.sampled_from(list(Role)),
    lsn=st.integers(0, 50),
    in_sync=st.booleans(),
)


class ClusterMachine(RuleBasedStateMachine):
    """Random registrations (with and without claims), reports, deaths, ticks, restarts."""

    sim: Sim

    @initialize(replication=st.integers(1, 3), hold=st.booleans())
    def start(self, replication: int, hold: bool) -> None:
        self.sim = Sim(replication, hold)

    @rule(node=st.sampled_from(NODES), claim=st.none() | claims)
    def register(self, node: str, claim: Claim | None) -> None:
        self.sim.register(node, claim)

    @precondition(lambda self: bool(self.sim.returning()))
    @rule(data=st.data(), in_sync=st.booleans())
    def reclaim(self, data: st.DataObject, in_sync: bool) -> None:
        self.sim.reclaim(data.draw(st.sampled_from(self.sim.returning())), in_sync)

    @precondition(lambda self: bool(self.sim.cs.shards))
    @rule(
        data=st.data(),
        lsn_step=st.integers(0, 5),
        in_sync=st.none() | st.lists(st.sampled_from(NODES), max_size=4),
        epoch_skew=st.sampled_from([0, 0, -1, 1]),
    )
    def report(
        self, data: st.DataObject, lsn_step: int, in_sync: list[str] | None, epoch_skew: int
    ) -> None:
        node = data.draw(st.sampled_from(sorted(self.sim.cs.shards)))
        self.sim.report(node, lsn_step, in_sync, epoch_skew)

    @precondition(lambda self: bool(primaries(self.sim.cs)))
    @rule(data=st.data())
    def primary_reports_in_sync(self, data: st.DataObject) -> None:
        """The usual heartbeat of a primary: some of its replicas caught up."""
        node = data.draw(st.sampled_from(primaries(self.sim.cs)))
        replicas = sorted(
            self.sim.cs.map.partitions[partition_of(self.sim.cs.shards[node])].replicas
        )
        in_sync = data.draw(st.lists(st.sampled_from(replicas), unique=True)) if replicas else []
        self.sim.report(node, 1, in_sync, 0)

    @rule(node=st.sampled_from(NODES), crashed=st.booleans())
    def gone(self, node: str, crashed: bool) -> None:
        self.sim.gone(node, crashed)

    @rule(dt=st.sampled_from([0.5, 3.0, 11.0]))
    def tick(self, dt: float) -> None:
        self.sim.tick(dt)

    @rule()
    def broker_restart(self) -> None:
        self.sim.broker_restart()

    @invariant()
    def consistent(self) -> None:
        self.sim.check()


def primaries(cs: ClusterState) -> list[str]:
    return sorted(n for n, s in cs.shards.items() if s.role is Role.PRIMARY)


ClusterMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
test_cluster_machine = ClusterMachine.TestCase


def random_claim(rng: random.Random) -> Claim:
    return Claim(
        rng.randint(-1, N_PARTITIONS),
        rng.randint(0, 6),
        rng.choice(list(Role)),
        rng.randint(0, 50),
        rng.random() < 0.5,
    )


def random_walk(rng: random.Random, sim: Sim, steps: int) -> None:
    for _ in range(steps):
        cs = sim.cs
        x = rng.random()
        if x < 0.25:
            sim.register(rng.choice(NODES), random_claim(rng) if rng.random() < 0.3 else None)
        elif x < 0.35 and sim.returning():
            sim.reclaim(rng.choice(sim.returning()), rng.random() < 0.7)
        elif x < 0.6 and primaries(cs):
            node = rng.choice(primaries(cs))
            replicas = list(cs.map.partitions[partition_of(cs.shards[node])].replicas)
            in_sync = rng.sample(replicas, rng.randint(0, len(replicas)))
            if rng.random() < 0.1:
                in_sync.append(rng.choice(NODES))
            sim.report(node, rng.randint(0, 3), in_sync, 0 if rng.random() < 0.9 else -1)
        elif x < 0.7 and cs.shards:
            node = rng.choice(sorted(cs.shards))
            sim.report(node, rng.randint(0, 3), None if rng.random() < 0.7 else [node], 0)
        elif x < 0.85:
            pool = primaries(cs) if rng.random() < 0.4 and primaries(cs) else NODES
            sim.gone(rng.choice(pool), crashed=rng.random() < 0.5)
        elif x < 0.97:
            sim.tick(rng.choice([0.5, 3.0, 11.0]))
        else:
            sim.broker_restart()
        sim.check()


def test_random_sequences_keep_the_invariants() -> None:
    rng = random.Random(20240611)
    promotions = 0
    for i in range(150):
        sim = Sim(replication=1 + i % 3, hold=i % 2 == 0)
        random_walk(rng, sim, 60)
        promotions += sim.promotions
    assert promotions > 20  # the walk does reach failovers


# ---- what survives a restart: floors, held copies, the operator's reset ----------------


def hb(cs: ClusterState, node: str, lsn: int) -> None:
    """A heartbeat of ``node`` at its current epoch."""
    cs.report(node, lsn=lsn, epoch=cs.shards[node].epoch, in_sync=None)


def restarted(cs: ClusterState, now: float, hold: float = 5.0) -> ClusterState:
    """A new broker that loads what ``cs`` recorded."""
    new = ClusterState(
        cs.n_partitions, n_slots=cs.n_slots, replication=cs.replication, hold_until=now + hold
    )
    new.restore(cs.map_version, cs.records())
    return new


def test_a_primary_heartbeat_raises_the_floor_and_the_record_keeps_it() -> None:
    cs = ClusterState(2, n_slots=16)
    reg(cs, "a")
    reg(cs, "b")
    assert cs.floor_of(1) == (0, 0)  # assigned, not yet confirmed
    hb(cs, "a", 10)
    hb(cs, "a", 7)  # never lowered
    hb(cs, "b", 0)
    assert cs.floor_of(0) == (1, 10) and cs.floor_of(1) == (1, 0)
    rec = cs.records()
    assert [(r.epoch, r.floor_epoch, r.floor_lsn, r.hosts) for r in rec] == [
        (1, 1, 10, ("h",)),
        (1, 1, 0, ("h",)),
    ]
    # A heartbeat from another epoch (a stale primary) does not count.
    cs.report("a", lsn=99, epoch=0, in_sync=None)
    assert cs.floor_of(0) == (1, 10)


def test_after_a_restart_an_empty_shard_never_gets_a_known_partition() -> None:
    cs = ClusterState(1, n_slots=16)
    reg(cs, "a")
    hb(cs, "a", 50)
    cs = restarted(cs, now=100.0, hold=3.0)
    assert cs.partition_state(0, 101.0) == "holding"
    assert cs.tick(104.0) == []
    assert cs.is_lost(0) and cs.partition_state(0, 104.0) == "lost"
    assert any("partition 0 is lost" in m for level, m in cs.notices if level == "error")
    assert reg(cs, "empty", now=105.0) == [spare("empty")]
    assert cs.primary_of(0) is None
    # The copy that held it comes back: it gets its partition, the empty shard
    # (replication 1) stays spare.
    assert by_node(reg(cs, "a", claim=claim_primary(0, 1, 50), now=106.0)) == {
        "a": primary("a", 0, 1)
    }
    assert not cs.is_lost(0)


def test_an_older_copy_is_held_until_a_newer_one_or_the_operator() -> None:
    cs = ClusterState(1, n_slots=16, replication=2)
    reg(cs, "a")
    hb(cs, "a", 80)
    cs = restarted(cs, now=10.0, hold=1.0)
    cs.tick(12.0)
    assert reg(cs, "stale", claim=claim_primary(0, 1, 60), now=13.0) == []
    assert cs.shards["stale"].held == claim_primary(0, 1, 60)
    assert cs.primary_of(0) is None and cs.is_lost(0)
    errors = [m for level, m in cs.notices if level == "error"]
    assert any("LSN 60" in m and "LSN 80" in m and "--accept-data-loss" in m for m in errors)
    report = cs.status(13.0, {})["partitions"][0]
    assert report["state"] == "lost" and report["floor"] == {"epoch": 1, "lsn": 80}
    assert report["held_copies"] == [{"node": "stale", "host": "h", "epoch": 1, "lsn": 60}]
    # The stale copy is no spare: another partition's shortage does not take it.
    assert reg(cs, "empty", now=14.0) == [spare("empty")]
    assert cs.shards["stale"].role is Role.SPARE and cs.shards["stale"].held is not None
    # The operator accepts the loss: the newest held copy serves it at a new epoch
    # (keeping its data), the empty shard becomes its replica.
    out = by_node(cs.reset_partition(0, now=15.0))
    assert out["stale"] == primary("stale", 0, 2)
    assert out["empty"] == replica("empty", 0, 2, "stale")
    assert not cs.is_lost(0) and cs.shards["stale"].held is None


def test_reset_without_any_copy_gives_the_partition_to_an_empty_shard() -> None:
    cs = ClusterState(1, n_slots=16)
    reg(cs, "a")
    cs.node_gone("a")
    assert cs.is_lost(0)
    with pytest.raises(ValueError, match="no partition 3"):
        cs.reset_partition(3, now=1.0)
    assert cs.reset_partition(0, now=1.0) == []  # no shard yet: the next one takes it
    assert reg(cs, "fresh", now=2.0) == [primary("fresh", 0, 2)]
    with pytest.raises(ValueError, match="served by fresh"):
        cs.reset_partition(0, now=3.0)


def test_reset_is_refused_during_the_hold() -> None:
    cs = ClusterState(1, n_slots=16, hold_until=10.0)
    with pytest.raises(ValueError, match="collecting"):
        cs.reset_partition(0, now=1.0)


def test_an_unconfirmed_promotion_does_not_strand_the_older_copies() -> None:
    """Everything stopped at once: the broker promoted a replica that was already
    leaving, so no primary ever confirmed the new epoch; the copies at the confirmed
    epoch and LSN may take the partition back (at a newer epoch)."""
    cs = ClusterState(1, n_slots=16, replication=2)
    reg(cs, "a")
    reg(cs, "b")
    cs.report("a", lsn=30, epoch=1, in_sync=["b"])
    cs.report("b", lsn=30, epoch=1)
    cs.node_gone("a")  # b is promoted at epoch 2 ...
    assert cs.primary_of(0) == "b" and part(cs, 0).epoch == 2
    cs.node_gone("b")  # ... and leaves before it ever said so
    assert cs.is_lost(0) and cs.floor_of(0) == (1, 30)
    cs = restarted(cs, now=10.0, hold=1.0)
    out = reg(cs, "a", claim=claim_primary(0, 1, 30), now=10.5)
    assert out == [primary("a", 0, 3)]


def test_a_confirmed_newer_epoch_refuses_the_old_history() -> None:
    cs = ClusterState(1, n_slots=16, replication=2)
    reg(cs, "a")
    reg(cs, "b")
    cs.report("a", lsn=30, epoch=1, in_sync=["b"])
    cs.report("b", lsn=25, epoch=1)
    cs.node_gone("a")
    hb(cs, "b", 26)  # b wrote at epoch 2
    cs.node_gone("b")
    assert cs.floor_of(0) == (2, 26)
    assert reg(cs, "a", claim=claim_primary(0, 1, 30)) == []  # longer, but another history
    # b's copy is trusted; a's older one is let go and, replication 2, follows it.
    out = reg(cs, "b", claim=claim_primary(0, 2, 26))
    assert out == [primary("b", 0, 2), replica("a", 0, 2, "b")]


def test_restore_refuses_another_shape() -> None:
    cs = ClusterState(2, n_slots=16)
    with pytest.raises(ValueError, match="1 partitions"):
        cs.restore(3, ClusterState(1, n_slots=16).records())


# ---- placement by host and zone ----------------------------------------------------------


def reg_on(
    cs: ClusterState, node: str, host: str, zone: str = "", now: float = 0.0
) -> list[Assignment]:
    return cs.register_shard(node, host=host, pid=1, address=f"tcp://{node}", now=now, zone=zone)


def hosts_of(cs: ClusterState, p: int) -> list[str]:
    info = part(cs, p)
    return [cs.shards[n].host for n in (info.primary, *info.replicas) if n is not None]


def test_replicas_go_to_another_host_when_a_spare_there_exists() -> None:
    cs = ClusterState(2, n_slots=16, replication=2, hold_until=1.0)
    for node, host in [("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B")]:
        reg_on(cs, node, host)
    cs.tick(2.0)
    for p in (0, 1):
        assert sorted(hosts_of(cs, p)) == ["A", "B"]
    assert cs.status(2.0, {})["placement_warnings"] == []


def test_the_partition_with_fewer_good_choices_picks_first() -> None:
    # Primaries on A and C; spares on C and B: p0 (on A) can take either, p1 (on C)
    # only B. Registration order alone would give B to p0 and C to p1.
    cs = ClusterState(2, n_slots=16, replication=2, hold_until=1.0)
    for node, host in [("a", "A"), ("c", "C"), ("sb", "B"), ("sc", "C")]:
        reg_on(cs, node, host)
    cs.tick(2.0)
    assert sorted(hosts_of(cs, 0)) == ["A", "C"] and sorted(hosts_of(cs, 1)) == ["B", "C"]


def test_zones_are_kept_apart_too() -> None:
    cs = ClusterState(1, n_slots=16, replication=2, hold_until=1.0)
    reg_on(cs, "p", "h1", "z1", now=0.1)
    reg_on(cs, "same-zone", "h2", "z1", now=0.2)
    reg_on(cs, "other-zone", "h3", "z2", now=0.3)
    cs.tick(2.0)
    assert part(cs, 0).replicas == ("other-zone",)


def test_copies_share_a_host_only_without_a_choice_and_status_says_so() -> None:
    cs = ClusterState(1, n_slots=16, replication=2)
    reg_on(cs, "a1", "A")
    reg_on(cs, "a2", "A")
    assert hosts_of(cs, 0) == ["A", "A"]
    report = cs.status(0.0, {})
    assert report["partitions"][0]["placement"].startswith("2 copies on host A")
    assert report["placement_warnings"] == [f"partition 0: {report['partitions'][0]['placement']}"]
    # A shard on another host turns up: it becomes an extra replica, and the one
    # sharing A leaves once the new one is in sync.
    cs.report("a1", lsn=5, epoch=1, in_sync=["a2"])
    reg_on(cs, "b", "B", now=1.0)
    out = cs.tick(1.0)
    assert out == [replica("b", 0, 1, "a1")] and part(cs, 0).replicas == ("a2", "b")
    assert cs.tick(1.1) == []  # not before b is in sync
    cs.report("a1", lsn=6, epoch=1, in_sync=["a2", "b"])
    assert cs.tick(1.2) == [spare("a2")]
    assert part(cs, 0).replicas == ("b",) and part(cs, 0).in_sync == ("b",)
    assert cs.status(1.2, {})["placement_warnings"] == []
    assert cs.tick(1.3) == []


def test_the_floor_follows_what_the_primary_s_log_holds() -> None:
    cs = ClusterState(1, n_slots=16)
    reg(cs, "a")
    cs.report("a", lsn=100, epoch=1, durable=97)  # 98..100 applied, not yet logged
    assert cs.floor_of(0) == (1, 97)
    cs.report("a", lsn=120, epoch=1, durable=130)  # never past what it applied
    assert cs.floor_of(0) == (1, 120)


# ---- the start-up hold: every copy that holds the acknowledged writes stays electable ----


def two_members(hold: float = 1.0) -> ClusterState:
    """1 partition x 2 copies, a primary and b its in-sync replica, confirmed at LSN 94,
    then a broker restart from the record (both members), holding until 101."""
    cs = ClusterState(1, n_slots=16, replication=2)
    reg(cs, "a")
    reg(cs, "b")
    cs.report("a", lsn=94, epoch=1, in_sync=["b"], t=1.0)
    assert cs.members_of(0) == ("a", "b")
    return restarted(cs, now=100.0, hold=hold)


def test_a_member_that_follows_a_claim_granted_in_the_hold_is_elected_if_it_dies() -> None:
    """Seed 166 of the cluster simulator (real broker): after a whole-cluster power loss
    b's claim was granted first, which made b the members alone; a, the other member at
    the same LSN, was made b's replica, out of sync, so when b died before a caught up
    nothing could be elected: the partition was lost and a made a spare (its copy, the
    last one holding the acknowledged writes, given away)."""
    cs = two_members()
    assert reg(cs, "b", claim=claim_primary(0, 1, 94), now=100.2) == [primary("b", 0, 1)]
    assert cs.members_of(0) == ("b",)  # b may write alone once it serves
    assert reg(cs, "a", claim=claim_primary(0, 1, 94), now=100.3) == [replica("a", 0, 1, "b")]
    # No write is routed during the hold: a holds every acknowledged write.
    assert part(cs, 0).in_sync == ("a",) and cs.members_of(0) == ("b", "a")
    cs.report("b", lsn=94, epoch=1, in_sync=[], t=100.4)  # not caught up yet
    assert part(cs, 0).in_sync == ("a",)
    cs.node_gone("b", now=100.5)
    assert cs.tick(101.0) == [primary("a", 0, 2)]
    assert not cs.is_lost(0) and cs.records()[0].in_sync == ("b", "a")
    # Confirmed at its epoch, a is the members alone (b's copy is gone).
    cs.report("a", lsn=94, epoch=2, in_sync=[], t=101.2)
    assert cs.members_of(0) == ("a",)


def test_a_recorded_member_that_comes_after_a_dead_claim_in_the_hold_takes_the_partition() -> None:
    cs = two_members()
    reg(cs, "b", claim=claim_primary(0, 1, 94), now=100.2)
    cs.node_gone("b", now=100.3)
    assert reg(cs, "a", claim=claim_primary(0, 1, 94), now=100.4) == [primary("a", 0, 1)]


def test_after_the_hold_the_members_are_the_granted_primary_s_alone() -> None:
    """Once writes are routed the granted primary may have acknowledged some alone: the
    other recorded member follows it out of sync and is not elected."""
    cs = two_members()
    reg(cs, "b", claim=claim_primary(0, 1, 94), now=100.2)
    assert cs.tick(101.0) == []
    cs.report("b", lsn=99, epoch=1, in_sync=[], t=101.1)
    assert reg(cs, "a", claim=claim_primary(0, 1, 94), now=101.2) == [replica("a", 0, 1, "b")]
    assert part(cs, 0).in_sync == () and cs.members_of(0) == ("b",)
    cs.node_gone("b", now=101.3)
    assert cs.is_lost(0) and cs.primary_of(0) is None
    # After the hold a report replaces the in-sync set, as always.
    cs = two_members()
    reg(cs, "b", claim=claim_primary(0, 1, 94), now=100.2)
    reg(cs, "a", claim=claim_primary(0, 1, 94), now=100.3)
    cs.tick(101.0)
    cs.report("b", lsn=94, epoch=1, in_sync=[], t=101.1)
    assert part(cs, 0).in_sync == () and cs.members_of(0) == ("b",)


def test_without_a_record_only_a_copy_as_new_as_the_granted_one_is_in_sync() -> None:
    cs = ClusterState(1, n_slots=16, replication=3, hold_until=10.0)
    reg(cs, "a", claim=claim_primary(0, 1, 50), now=1.0)
    reg(cs, "b", claim=claim_primary(0, 1, 40), now=2.0)  # may lack writes a acknowledged
    reg(cs, "c", claim=claim_primary(0, 1, 50), now=3.0)
    assert part(cs, 0).replicas == ("b", "c") and part(cs, 0).in_sync == ("c",)
    cs.node_gone("a", now=4.0)
    out = by_node(cs.tick(10.0))
    assert out["c"] == primary("c", 0, 2) and out["b"] == replica("b", 0, 2, "c")


def test_a_primary_that_refused_its_role_is_gone_for_that_partition() -> None:
    # A shard granted p0 on its claim let the data go before the grant arrived (another
    # broker's assignment in flight made it a spare); it refuses and registers again.
    cs = full_cluster(1, 2, "a", "b")
    cs.report("a", lsn=10, epoch=1, in_sync=["b"])
    assert cs.primary_of(0) == "a"
    out = cs.register_shard("a", host="h", pid=1, address="tcp://a", now=5.0, refused=(0, 1))
    assert cs.primary_of(0) == "b" and part(cs, 0).epoch == 2  # its replica took over
    assert spare("a") in out or replica("a", 0, 2, "b") in out
    assert cs.shards["a"].role is not Role.PRIMARY


def test_a_refusal_of_an_older_role_changes_nothing() -> None:
    cs = full_cluster(1, 2, "a", "b")
    version = cs.map_version
    # Late: "a" is primary at epoch 1, the refusal names epoch 0 (or another partition).
    assert cs.register_shard("a", host="h", pid=1, address="tcp://a", now=5.0, refused=(0, 0)) == [
        primary("a", 0, 1)
    ]
    assert reg(cs, "a", now=5.0) == [primary("a", 0, 1)]  # sent again without it: the same
    assert cs.primary_of(0) == "a" and cs.map_version == version
