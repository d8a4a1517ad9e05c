"""The Prometheus endpoints of a running broker and shard."""

from __future__ import annotations

import urllib.request

import numpy as np

import zps
from zps.optim import SGD
from zps.testing import LocalCluster, free_port


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the scrape")


def test_broker_and_shard_export_metrics() -> None:
    broker_port, shard_port = free_port(), free_port()
    with LocalCluster(
        partitions=1, shards=2, replication=2, broker_args=["--metrics-port", str(broker_port)]
    ) as c:
        # one more shard, a spare, with its own endpoint
        c.shard_args = ["--metrics-port", str(shard_port)]
        c.start_shard()
        c.wait_for(lambda s: len(s["shards"]) == 3, 20, "the spare to register")
        with zps.connect_sync(c.address) as ps:
            ps.create_embedding("m", dim=4, optimizer=SGD(lr=0.1))
            for _ in range(5):
                ps.push_rows("m", np.arange(10), np.ones((10, 4)))
            ps.pull_rows("m", np.arange(10))
        broker = scrape(broker_port)
        assert value(broker, 'zps_broker_messages_total{outcome="routed"}') >= 7
        assert value(broker, 'zps_shards{role="primary"}') == 1
        assert value(broker, 'zps_shards{role="replica"}') == 1
        assert value(broker, 'zps_partitions{state="ok"}') == 1
        assert "zps_replication_lag{" in broker
        shard = scrape(shard_port)
        assert value(shard, 'zps_shard_role{role="spare"}') == 1
        assert "zps_request_seconds_bucket" in shard
        # kill the primary: the spare becomes a replica, the broker counts a failover
        c.kill(c.shard_pid(0))
        c.wait_for(lambda s: s["failovers"] == 1 and c.healthy(s), 20, "failover and refill")
        assert value(scrape(broker_port), "zps_failovers_total") == 1
        shard = scrape(shard_port)
        assert value(shard, 'zps_shard_role{role="replica"}') == 1
        assert value(shard, "zps_shard_lsn") >= 6
