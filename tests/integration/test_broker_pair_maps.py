"""A broker pair publishes a map only once the standby holds it (a takeover starts from
the standby's copy), with real brokers and shards."""

from __future__ import annotations

import time

import pytest

import zps
from zps.testing import PairCluster

pytestmark = pytest.mark.timeout(120)


def test_a_map_reaches_clients_only_once_the_standby_holds_it() -> None:
    # Beats every 0.6 s: a record streamed only with the beats reaches the standby well
    # after a map that went out at once.
    with PairCluster(partitions=2, shards=4, replication=2, peer_timeout=3.0) as c:
        c.wait_for(
            lambda s: s["pair"]["peer"].get("record") is not None and c.healthy(s),
            60,
            "the pair whole and the cluster healthy",
        )
        with zps.connect_sync(c.address, timeout=20) as ps:
            v0 = ps.cluster_map.version
            replica = next(
                s for s in ps.status()["shards"] if s["role"] == "replica" and s["partition"] == 0
            )
            c.kill(replica["pid"])  # the map drops it from partition 0's in-sync set
            deadline = time.monotonic() + 30
            while ps.cluster_map.version == v0:
                assert time.monotonic() < deadline, "no new map after a replica died"
                time.sleep(0.001)
            seen = ps.cluster_map.version
            held = ps.status()["pair"]["peer"]["record"]
            assert held[1] >= seen, (held, seen)
