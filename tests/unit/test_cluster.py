"""The broker's state machine: roles, lost partitions, claims after a restart."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zps.cluster import Assignment, ClusterState, Role
from zps.routing import ClusterMap


def reg(
    cs: ClusterState, node: str, *, claim: tuple[int, int] | None = None, now: float = 0.0
) -> list[Assignment]:
    return cs.register_shard(node, host="h", pid=1, address=f"tcp://{node}", now=now, claim=claim)


def test_needs_partitions_and_enough_slots() -> None:
    with pytest.raises(ValueError):
        ClusterState(0)
    with pytest.raises(ValueError):
        ClusterState(8, n_slots=4)


def test_initial_map_has_no_primaries() -> None:
    cs = ClusterState(3, n_slots=16)
    assert cs.map_version == 0 and cs.map.version == 0
    assert cs.map.n_partitions == 3
    assert all(info.primary is None and info.epoch == 0 for info in cs.map.partitions.values())
    assert sorted(set(cs.map.slot_map.tolist())) == [0, 1, 2]
    assert [cs.primary_of(p) for p in (-1, 0, 2, 3)] == [None, None, None, None]


def test_shards_fill_partitions_in_order_then_wait_as_spares() -> None:
    cs = ClusterState(2)
    assert reg(cs, "a") == [Assignment("a", Role.PRIMARY, 0, 1)]
    assert reg(cs, "b") == [Assignment("b", Role.PRIMARY, 1, 1)]
    assert reg(cs, "c") == [Assignment("c", Role.SPARE, None, 0)]
    assert cs.primary_of(0) == "a" and cs.primary_of(1) == "b"
    assert cs.shards["c"].role is Role.SPARE
    assert cs.map_version == 2  # a spare changes nothing in the map
    assert cs.map.partitions[1].primary == "b" and cs.map.partitions[1].in_sync == ("b",)


def test_death_of_a_primary_loses_its_partition() -> None:
    cs = ClusterState(2)
    reg(cs, "a")
    reg(cs, "b")
    version = cs.map_version
    old_map = cs.map
    assert cs.node_gone("a") == []
    assert cs.primary_of(0) is None and cs.is_lost(0)
    assert cs.map_version == version + 1 and cs.map.version == version + 1
    assert cs.map.partitions[0].primary is None
    assert cs.map.partitions[0].epoch == 1  # the epoch is remembered
    assert old_map.partitions[0].primary == "a"  # old maps are never edited
    assert "a" not in cs.shards
    assert not cs.is_lost(1)


def test_death_of_a_spare_or_a_stranger_changes_nothing() -> None:
    cs = ClusterState(1)
    reg(cs, "a")
    reg(cs, "spare")
    version = cs.map_version
    assert cs.node_gone("spare") == []
    assert cs.node_gone("nobody") == []
    assert cs.map_version == version
    assert "spare" not in cs.shards and cs.primary_of(0) == "a"


def test_a_lost_partition_is_not_given_to_a_fresh_shard() -> None:
    cs = ClusterState(2)
    reg(cs, "a")
    cs.node_gone("a")
    # "b" takes the never-served partition 1, "c" must wait: partition 0 holds data it lacks.
    assert reg(cs, "b") == [Assignment("b", Role.PRIMARY, 1, 1)]
    assert reg(cs, "c") == [Assignment("c", Role.SPARE, None, 0)]
    assert cs.primary_of(0) is None and cs.is_lost(0)


def test_a_shard_holding_a_lost_partition_can_claim_it_back() -> None:
    cs = ClusterState(1)
    reg(cs, "a")
    cs.node_gone("a")  # e.g. a missed heartbeat
    version = cs.map_version
    assert reg(cs, "a2", claim=(0, 1)) == [Assignment("a2", Role.PRIMARY, 0, 1)]
    assert not cs.is_lost(0) and cs.primary_of(0) == "a2"
    assert cs.map_version == version + 1


def test_claims_rebuild_the_map_after_a_broker_restart() -> None:
    cs = ClusterState(3)
    for node in "abc":
        reg(cs, node)
    assert [cs.shards[n].partition for n in "abc"] == [0, 1, 2]
    # The broker restarts: a fresh state; shards come back in another order with their claims.
    fresh = ClusterState(3)
    assert reg(fresh, "c", claim=(2, 7)) == [Assignment("c", Role.PRIMARY, 2, 7)]
    assert reg(fresh, "a", claim=(0, 4)) == [Assignment("a", Role.PRIMARY, 0, 4)]
    assert reg(fresh, "b", claim=(1, 1)) == [Assignment("b", Role.PRIMARY, 1, 1)]
    assert [fresh.map.partitions[p].epoch for p in range(3)] == [4, 1, 7]
    assert [fresh.primary_of(p) for p in range(3)] == ["a", "b", "c"]


def test_a_claim_older_than_the_known_epoch_is_refused() -> None:
    cs = ClusterState(1)
    reg(cs, "a", claim=(0, 5))
    cs.node_gone("a")
    assert reg(cs, "old", claim=(0, 4)) == [Assignment("old", Role.SPARE, None, 0)]
    assert cs.primary_of(0) is None and cs.is_lost(0)
    assert reg(cs, "new", claim=(0, 5)) == [Assignment("new", Role.PRIMARY, 0, 5)]


def test_a_claim_on_a_served_partition_is_refused() -> None:
    cs = ClusterState(2)
    reg(cs, "a")
    out = reg(cs, "b", claim=(0, 9))
    assert cs.primary_of(0) == "a" and cs.map.partitions[0].epoch == 1
    assert out == [Assignment("b", Role.PRIMARY, 1, 1)]  # falls back to a free partition


@pytest.mark.parametrize("claim", [(-1, 1), (2, 1), (99, 0)])
def test_a_claim_on_a_partition_that_does_not_exist_is_ignored(claim: tuple[int, int]) -> None:
    cs = ClusterState(2)
    assert reg(cs, "a", claim=claim) == [Assignment("a", Role.PRIMARY, 0, 1)]


def test_reregistration_keeps_a_primary_its_role() -> None:
    cs = ClusterState(2)
    reg(cs, "a")
    cs.report("a", lsn=42, stats={"ops": 3})
    version = cs.map_version
    assert reg(cs, "a", now=5.0) == [Assignment("a", Role.PRIMARY, 0, 1)]
    assert reg(cs, "a", claim=(1, 3)) == [Assignment("a", Role.PRIMARY, 0, 1)]
    assert cs.map_version == version
    assert cs.shards["a"].lsn == 42 and cs.shards["a"].registered_at == 0.0
    assert cs.primary_of(1) is None


def test_report_updates_a_known_shard_only() -> None:
    cs = ClusterState(1)
    reg(cs, "a")
    cs.report("a", lsn=7, stats={"x": 1})
    cs.report("ghost", lsn=9, stats={})
    assert cs.shards["a"].lsn == 7 and cs.shards["a"].stats == {"x": 1}
    assert "ghost" not in cs.shards


def test_status_report() -> None:
    cs = ClusterState(3, n_slots=64)
    reg(cs, "a", now=1.0)
    reg(cs, "b", now=1.0)
    reg(cs, "s", now=1.0)  # primary of partition 2
    reg(cs, "spare", now=1.0)
    cs.node_gone("b")
    cs.report("a", lsn=11, stats={"ops": 5})
    cs.register_client("w1", host="hw", pid=9, name="trainer", now=2.0)
    cs.register_client("w0", host="hw", pid=8, name="", now=2.0)
    s = cs.status(10.0, {"a": 9.5, "w1": 4.0})
    assert s["map_version"] == cs.map_version
    assert (s["n_partitions"], s["n_slots"]) == (3, 64)
    assert [(p["partition"], p["state"], p["primary"], p["lsn"]) for p in s["partitions"]] == [
        (0, "ok", "a", 11),
        (1, "lost", None, None),
        (2, "ok", "s", 0),
    ]
    assert all(p["replicas"] == [] and p["epoch"] == 1 for p in s["partitions"])
    assert [(n["node"], n["role"], n["partition"]) for n in s["shards"]] == [
        ("a", "primary", 0),
        ("s", "primary", 2),
        ("spare", "spare", None),
    ]
    a = s["shards"][0]
    assert (a["host"], a["pid"], a["address"], a["lsn"], a["stats"]) == (
        "h",
        1,
        "tcp://a",
        11,
        {"ops": 5},
    )
    assert a["last_seen_s"] == 0.5 and s["shards"][1]["last_seen_s"] is None
    assert [(c["node"], c["name"], c["last_seen_s"]) for c in s["clients"]] == [
        ("w0", "", None),
        ("w1", "trainer", 6.0),
    ]
    cs.node_gone("w1")
    assert [c["node"] for c in cs.status(10.0, {})["clients"]] == ["w0"]


def test_status_of_an_unassigned_partition() -> None:
    s = ClusterState(2).status(0.0, {})
    assert [p["state"] for p in s["partitions"]] == ["unassigned", "unassigned"]
    assert s["shards"] == [] and s["clients"] == []


# ---- never two primaries ----------------------------------------------------

N_PARTITIONS = 3
NODES = [f"n{i}" for i in range(6)]


class ClusterMachine(RuleBasedStateMachine):
    """Random register / claim / death / broker-restart sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.cs = ClusterState(N_PARTITIONS, n_slots=16)
        self.versions = [0]
        self.epochs = [0] * N_PARTITIONS
        # What each live shard process believes it serves (it survives a broker restart).
        self.serving: dict[str, tuple[int, int]] = {}
        self.was_served = [False] * N_PARTITIONS

    def _apply(self, node: str, out: list[Assignment]) -> None:
        assert len(out) == 1 and out[0].node_id == node
        a = out[0]
        if a.role is Role.PRIMARY:
            assert a.partition is not None
            self.serving[node] = (a.partition, a.epoch)
            self.was_served[a.partition] = True
        else:
            assert a.partition is None and a.epoch == 0
            self.serving.pop(node, None)

    @rule(node=st.sampled_from(NODES))
    def register(self, node: str) -> None:
        before = self.cs.shards.get(node)
        lost = [p for p in range(N_PARTITIONS) if self.cs.is_lost(p)]
        out = self.cs.register_shard(node, host="h", pid=1, address="a", now=0.0)
        if before is None:
            # A fresh shard is never handed a lost partition.
            assert out[0].partition not in lost
        self._apply(node, out)

    @precondition(lambda self: bool(self.serving))
    @rule(data=st.data())
    def reclaim(self, data: st.DataObject) -> None:
        """A serving shard re-registers with its claim (as after 'unknown node')."""
        node = data.draw(st.sampled_from(sorted(self.serving)))
        claim = self.serving[node]
        self._apply(
            node, self.cs.register_shard(node, host="h", pid=1, address="a", now=0.0, claim=claim)
        )

    @rule(
        node=st.sampled_from(NODES),
        partition=st.integers(-1, N_PARTITIONS),
        epoch=st.integers(0, 6),
    )
    def claim(self, node: str, partition: int, epoch: int) -> None:
        out = self.cs.register_shard(
            node, host="h", pid=1, address="a", now=0.0, claim=(partition, epoch)
        )
        self._apply(node, out)

    @rule(node=st.sampled_from(NODES))
    def gone(self, node: str) -> None:
        self.cs.node_gone(node)
        self.serving.pop(node, None)

    @rule()
    def broker_restart(self) -> None:
        self.cs = ClusterState(N_PARTITIONS, n_slots=16)
        self.versions = [0]
        self.epochs = [0] * N_PARTITIONS
        self.was_served = [False] * N_PARTITIONS

    @invariant()
    def at_most_one_primary_per_partition(self) -> None:
        owners: dict[int, list[str]] = {}
        for node in self.cs.shards.values():
            if node.role is Role.PRIMARY:
                assert node.partition is not None
                owners.setdefault(node.partition, []).append(node.node_id)
            else:
                assert node.partition is None
        for p in range(N_PARTITIONS):
            primary = self.cs.primary_of(p)
            assert owners.get(p, []) == ([] if primary is None else [primary])
            if primary is not None:
                assert self.cs.shards[primary].epoch == self.cs.map.partitions[p].epoch
                assert not self.cs.is_lost(p)

    @invariant()
    def epochs_and_versions_only_grow(self) -> None:
        epochs = [self.cs.map.partitions[p].epoch for p in range(N_PARTITIONS)]
        assert all(new >= old for new, old in zip(epochs, self.epochs, strict=True))
        assert self.cs.map.version == self.cs.map_version >= self.versions[-1]
        self.epochs = epochs
        self.versions.append(self.cs.map_version)

    @invariant()
    def the_map_matches_the_state(self) -> None:
        m = self.cs.map
        back = ClusterMap.from_wire(m.to_wire())
        assert dict(back.partitions) == dict(m.partitions)
        for p in range(N_PARTITIONS):
            assert m.partitions[p].primary == self.cs.primary_of(p)
            if self.cs.is_lost(p):
                assert self.was_served[p]


ClusterMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
test_cluster_machine = ClusterMachine.TestCase
