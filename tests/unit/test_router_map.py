"""Routing brokers in the map: which router each partition gets, the map on the wire,
which map a router takes, and the client's choice and failover."""

from __future__ import annotations

import numpy as np

from zps.broker.following import Leader, newer
from zps.broker.primaries import PrimaryLinks
from zps.client.routers import RouterTable
from zps.core.cluster import ClusterState
from zps.core.routing import ClusterMap
from zps.protocol.codec import MsgType, Route


def cluster(hosts: list[str]) -> ClusterState:
    state = ClusterState(len(hosts), 64, replication=1)
    state.tick(1.0)  # the start-up hold ends
    for i, host in enumerate(hosts):
        state.register_shard(f"s-{i}", host=host, pid=i, address=f"tcp://x:{i}", now=1.0)
    return state


def test_each_partition_gets_the_router_on_its_primarys_host() -> None:
    state = cluster(["a", "b", "c"])
    assert all(not i.router for i in state.map.partitions.values())
    state.register_router("r-b", endpoint="tcp://b:1", host="b", now=1.0)
    state.register_router("r-a", endpoint="tcp://a:1", host="a", now=1.0)
    m = state.map
    assert [r.name for r in m.routers] == ["r-a", "r-b"]
    hosts = {p: state.shards[i.primary or ""].host for p, i in m.partitions.items()}
    for p, info in m.partitions.items():
        if hosts[p] == "a":
            assert info.router == "tcp://a:1"
        elif hosts[p] == "b":
            assert info.router == "tcp://b:1"
        else:  # no router on host c: one of the others, in turn
            assert info.router in ("tcp://a:1", "tcp://b:1")
    version = m.version
    state.register_router("r-a", endpoint="tcp://a:1", host="a", now=2.0)  # a repeat
    assert state.map.version == version
    state.node_gone("r-a", 3.0)
    assert {i.router for i in state.map.partitions.values()} == {"tcp://b:1"}
    assert state.map.version > version


def test_no_router_is_assigned_while_holding_for_claims() -> None:
    state = ClusterState(2, 64, replication=1, hold_until=10.0)
    state.register_router("r-a", endpoint="tcp://a:1", host="a", now=1.0)
    assert state.map.routers and all(not i.router for i in state.map.partitions.values())
    state.tick(11.0)
    assert all(i.router == "tcp://a:1" for i in state.map.partitions.values())


def test_the_map_carries_its_routers_on_the_wire() -> None:
    state = cluster(["a", "b"])
    state.register_router("r-a", endpoint="tcp://a:1", host="a", now=1.0)
    back = ClusterMap.from_wire(state.map.to_wire())
    assert back.routers == state.map.routers
    assert [i.router for i in back.partitions.values()] == ["tcp://a:1", "tcp://a:1"]
    plain = cluster(["a"]).map.to_wire()
    assert "routers" not in plain and "router" not in plain["partitions"]["0"]
    assert ClusterMap.from_wire(plain).routers == ()


def test_a_router_takes_only_a_newer_map() -> None:
    assert newer(None, (0, "x", 1))
    assert newer((0, "x", 3), (0, "x", 4)) and not newer((0, "x", 4), (0, "x", 4))
    assert not newer((0, "x", 4), (0, "x", 2))
    assert newer((0, "x", 9), (0, "y", 1))  # a restarted broker: versions start again
    assert newer((1, "x", 9), (2, "y", 1)) and not newer((3, "x", 1), (2, "y", 99))


def test_a_router_follows_the_highest_term_and_fails_over_on_silence() -> None:
    lead = Leader(2, silence=0.5, now=0.0)
    assert lead.heard(0, 1, 0.1) is False
    assert lead.heard(1, 2, 0.2) is True and lead.current == 1
    assert lead.heard(0, 1, 0.3) is None  # a replaced broker
    assert not lead.tick(0.6) and lead.tick(0.8) and lead.current == 0


def request(partition: int, req_id: int) -> list[bytes]:
    return [Route(MsgType.REQUEST, partition, 1, req_id).pack(), b"h"]


def test_the_client_sends_to_the_router_and_fails_over_from_a_silent_one() -> None:
    state = cluster(["a", "b"])
    state.register_router("r-a", endpoint="tcp://a:1", host="a", now=1.0)
    state.register_router("r-b", endpoint="tcp://b:1", host="b", now=1.0)
    table = RouterTable(failover_timeout=0.5)
    new, gone = table.on_map(state.map, 0.0)
    assert new == ["tcp://a:1", "tcp://b:1"] and gone == []
    routes = {p: i.router for p, i in state.map.partitions.items()}
    assert table.pick(request(0, 1), 1, 0.0) == routes[0]
    assert table.pick(request(1, 2), 2, 0.0) == routes[1]
    assert table.pick(request(1, 3), 3, 0.0) == routes[1]
    assert table.pick([Route(MsgType.STATUS, req_id=4).pack(), b"h"], 4, 0.0) == ""
    table.answered(3)
    table.heard(routes[1], 0.4)
    assert table.tick(0.2) == ([], [])
    assert table.tick(1.5) == ([], [])  # its own stall of 1.3 s: nobody is judged
    table.heard(routes[1], 1.8)
    assert table.tick(1.7) == ([], []) and table.tick(1.9) == ([], [])
    down, resend = table.tick(2.1)
    assert down == [routes[0]] and resend == [1]
    assert table.pick(request(0, 5), 5, 0.0) == ""  # to the broker while it is down
    assert table.heard(routes[0], 2.2) and table.pick(request(0, 6), 6, 2.2) == routes[0]
    np.testing.assert_equal(sorted(table.inflight), [1, 2, 5, 6])


def test_a_partition_the_router_cannot_route_goes_to_the_broker_for_a_while() -> None:
    """A refusal marked ``bypass`` (the primary is not connected to that router) sends
    the partition's requests to the broker for ``failover_timeout``; then one goes to
    the router again, and a reply it routes ends the bypass."""
    state = cluster(["a", "b"])
    state.register_router("r-a", endpoint="tcp://a:1", host="a", now=1.0)
    state.register_router("r-b", endpoint="tcp://b:1", host="b", now=1.0)
    table = RouterTable(failover_timeout=0.5)
    table.on_map(state.map, 0.0)
    routes = {p: i.router for p, i in state.map.partitions.items()}
    for req_id, partition in ((1, 0), (2, 0), (3, 1)):
        assert table.pick(request(partition, req_id), req_id, 0.9) == routes[partition]
    # It refuses request 1: request 2, in flight through it for partition 0, is sent
    # again (its link may have lost it); request 3, of another partition, is not.
    assert table.refused(routes[0], 0, 1, 1.0, bypass=True) == (True, [2])
    assert table.refused(routes[0], 0, 2, 1.1, bypass=True) == (False, [])  # until 1.6
    assert table.pick(request(0, 2), 2, 1.1) == "" and table.pick(request(0, 1), 1, 1.5) == ""
    assert table.pick(request(1, 4), 4, 1.5) == routes[1]  # another partition: unaffected
    assert table.refused(routes[1], 1, 4, 1.5, bypass=False) == (False, [])
    assert table.pick(request(0, 5), 5, 1.6) == routes[0]  # tried again
    assert table.refused(routes[0], 0, 5, 1.7, bypass=False) == (True, [])  # routed: ended
    assert table.pick(request(0, 6), 6, 1.7) == routes[0] and not table.bypassed
    # A bypass of another router (the map moved the partition since) does not bind.
    table.refused("tcp://elsewhere:1", 0, 7, 2.0, bypass=True)
    assert table.pick(request(0, 8), 8, 2.1) == routes[0]


def test_a_connection_made_again_to_a_router_re_sends_what_went_through_it() -> None:
    """``through``: the requests in flight through one router (sent again when the
    client's connection to it is made again), not those through another or the broker,
    nor those answered."""
    state = cluster(["a", "b"])
    state.register_router("r-a", endpoint="tcp://a:1", host="a", now=1.0)
    state.register_router("r-b", endpoint="tcp://b:1", host="b", now=1.0)
    table = RouterTable(failover_timeout=0.5)
    table.on_map(state.map, 0.0)
    routes = {p: i.router for p, i in state.map.partitions.items()}
    assert routes[0] != routes[1]
    for req_id, partition in ((1, 0), (2, 1), (3, 0), (4, 0)):
        table.pick(request(partition, req_id), req_id, 0.1)
    table.pick([Route(MsgType.STATUS, req_id=5).pack(), b"h"], 5, 0.1)  # the broker's
    table.answered(3)
    assert table.through(routes[0]) == [1, 4]
    assert table.through(routes[1]) == [2]
    assert table.through("tcp://elsewhere:1") == []


def test_a_router_finds_the_primaries_it_does_not_hear() -> None:
    """A primary the map names is given a silence from then; one not heard for a silence
    has its partition listed (only the partitions this router routes); a shard the map
    no longer names primary is forgotten."""
    state = cluster(["a", "b"])
    state.register_router("r-a", endpoint="tcp://a:1", host="a", now=1.0)
    state.register_router("r-b", endpoint="tcp://b:1", host="b", now=1.0)
    cmap = state.map
    routes = {p: i.router for p, i in cmap.partitions.items()}
    primary = {p: str(i.primary) for p, i in cmap.partitions.items()}
    links = PrimaryLinks(0.5)
    links.on_map(cmap, 10.0)
    assert links.silent(cmap, routes[0], 10.4) == [] and links.live(primary[0], 10.4)
    links.heard(primary[1], 10.3)
    links.heard("s-unknown", 10.3)  # not a primary of the map: not kept
    assert links.silent(cmap, routes[0], 10.5) == [0]  # a whole silence since the map
    assert links.silent(cmap, routes[1], 10.5) == []  # heard at 10.3
    assert links.silent(cmap, routes[1], 10.8) == [1] and not links.live("s-unknown", 10.3)
    links.heard(primary[0], 10.9)
    assert links.silent(cmap, routes[0], 11.0) == [] and links.silent(None, routes[0], 11.0) == []
    links.on_map(cmap, 20.0)  # the same primaries: their times stand
    assert not links.live(primary[0], 20.0)


def test_follow_in_flags_and_toml() -> None:
    from zps.errors import ConfigError
    from zps.ops.config import BrokerConfig, settings_from_mapping

    s = settings_from_mapping({"broker": {"follow": "tcp://a:1,tcp://b:2", "host": "h1"}})
    assert s.broker.followed == ("tcp://a:1", "tcp://b:2") and s.broker.host == "h1"
    assert BrokerConfig().followed == ()
    for bad in (
        {"follow": "a:1"},
        {
            "follow": "tcp://a:1",
            "pair_role": "primary",
            "peer": "tcp://p:1",
            "peer_bind": "tcp://*:2",
        },
        {"follow": "tcp://a:1", "advertise": "nowhere"},
    ):
        try:
            BrokerConfig(**bad)  # type: ignore[arg-type]
        except ConfigError:
            continue
        raise AssertionError(f"accepted {bad}")
