"""Draining a shard: its role is handed over and it is kept out of placement."""

from __future__ import annotations

import pytest

from zps.core.cluster import ClusterState
from zps.core.nodes import Claim
from zps.protocol.messages import Role, StatusRequest


def cluster(n_shards: int, replication: int = 2) -> ClusterState:
    state = ClusterState(1, 16, replication=replication)
    for i in range(n_shards):
        state.register_shard(f"s-{i}", host=f"h{i}", pid=i, address=f"tcp://h{i}:1", now=0.0)
    return state


def in_sync(state: ClusterState) -> None:
    """The primary reports every replica in sync."""
    primary = state.primary_of(0)
    assert primary is not None
    node = state.shards[primary]
    replicas = [n for n, s in state.shards.items() if s.role is Role.REPLICA]
    state.report(primary, lsn=5, epoch=node.epoch, in_sync=replicas)


def roles(state: ClusterState) -> dict[str, str]:
    return {n: s.role.value for n, s in state.shards.items()}


def test_draining_a_primary_hands_its_partition_to_an_in_sync_replica() -> None:
    state = cluster(3)
    assert roles(state) == {"s-0": "primary", "s-1": "replica", "s-2": "spare"}
    in_sync(state)
    out = state.drain("s-0", now=1.0)
    assert roles(state) == {"s-0": "spare", "s-1": "primary", "s-2": "replica"}
    assert state.shards["s-1"].epoch == 2  # a new epoch fences the old primary
    assert {(a.node_id, a.role) for a in out} >= {
        ("s-0", Role.SPARE),
        ("s-1", Role.PRIMARY),
        ("s-2", Role.REPLICA),
    }
    assert next(s for s in state.status(1.0, {})["shards"] if s["node"] == "s-0")["drained"]
    # While drained it is never placed, not even when a copy is short.
    state.node_gone("s-2", now=2.0)
    assert roles(state) == {"s-0": "spare", "s-1": "primary"}
    assert state.partition_state(0, 2.0) == "degraded"
    state.tick(3.0)
    assert state.shards["s-0"].role is Role.SPARE
    out = state.undrain("s-0", now=4.0)
    assert roles(state) == {"s-0": "replica", "s-1": "primary"}
    assert [(a.node_id, a.role) for a in out] == [("s-0", Role.REPLICA)]


def test_draining_a_replica_or_a_spare() -> None:
    state = cluster(3)
    in_sync(state)
    state.drain("s-1", now=1.0)
    assert roles(state) == {"s-0": "primary", "s-1": "spare", "s-2": "replica"}
    state.drain("s-2", now=1.0)
    assert roles(state) == {"s-0": "primary", "s-1": "spare", "s-2": "spare"}
    assert state.drained == {"s-1", "s-2"}
    # the drained set is kept by name: a shard that comes back is still drained
    state.node_gone("s-1", now=2.0)
    state.register_shard("s-1", host="h1", pid=99, address="tcp://h1:2", now=2.0)
    assert roles(state)["s-1"] == "spare"
    state.undrain("s-1", now=3.0)
    assert roles(state)["s-1"] == "replica"


def test_what_cannot_be_drained_changes_nothing() -> None:
    state = cluster(2)  # the replica is not in sync yet
    before = roles(state)
    with pytest.raises(ValueError, match="no replica is in sync"):
        state.drain("s-0", now=1.0)
    with pytest.raises(ValueError, match="no shard s-9"):
        state.drain("s-9", now=1.0)
    with pytest.raises(ValueError, match="not drained"):
        state.undrain("s-1", now=1.0)
    assert roles(state) == before and not state.drained
    held = ClusterState(1, 16, replication=2, hold_until=10.0)
    held.register_shard("s-0", host="h", pid=1, address="a", now=0.0)
    with pytest.raises(ValueError, match="collecting"):
        held.drain("s-0", now=1.0)


def test_drain_requests_round_trip() -> None:
    for request in (StatusRequest(drain="s-a"), StatusRequest(undrain="s-b"), StatusRequest()):
        assert StatusRequest.parse(request.to_wire()) == request
    assert StatusRequest().to_wire() == {}


def test_a_drained_shard_that_restarts_with_its_copy_stays_drained() -> None:
    """Its claim (a replica of the serving epoch, with no spare to take its place) is not
    granted: it stays a spare until undrained, then is placed again."""
    state = cluster(2)
    in_sync(state)
    epoch = state.shards["s-1"].epoch
    state.drain("s-1", now=1.0)
    assert roles(state) == {"s-0": "primary", "s-1": "spare"}
    state.node_gone("s-1", now=2.0)
    claim = Claim(0, epoch, Role.REPLICA, 5, complete=True)
    out = state.register_shard("s-1", host="h1", pid=99, address="tcp://h1:2", now=3.0, claim=claim)
    assert roles(state) == {"s-0": "primary", "s-1": "spare"}
    assert [(a.node_id, a.role) for a in out] == [("s-1", Role.SPARE)]
    assert state.partition_state(0, 3.0) == "degraded"
    state.undrain("s-1", now=4.0)
    assert roles(state)["s-1"] == "replica"


def test_a_drained_shards_copy_of_a_lost_partition_is_held() -> None:
    state = cluster(2, replication=1)
    state.drain("s-1", now=1.0)
    state.node_gone("s-0", now=2.0)  # the only copy: partition 0 is lost
    assert state.partition_state(0, 2.0) == "lost"
    state.node_gone("s-1", now=2.0)
    claim = Claim(0, 1, Role.REPLICA, 5, complete=True)
    state.register_shard("s-1", host="h1", pid=99, address="tcp://h1:2", now=3.0, claim=claim)
    assert state.shards["s-1"].held == claim and state.shards["s-1"].role is Role.SPARE
