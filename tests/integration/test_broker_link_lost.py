"""Requests the broker forwarded into a shard's data link that then died one way, with
real processes: the shard's ZMTP heartbeats give the connection up and it connects
again, greeting the broker (``new_link``); the broker tells its clients
(``relinked``), which send again what they have in flight to that shard's partition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.integration.test_routers import run_load
from zps.testing import ExactSumLoad, LocalCluster, acked_after
from zps.testing.gate import ShardGate


@pytest.fixture
def gated() -> Iterator[tuple[LocalCluster, ShardGate]]:
    """Two partitions, one copy each; the shards' links to the broker (data and
    liveness) go through ``gate``, the clients' straight to it."""
    c = LocalCluster(partitions=2, shards=2, replication=1)
    c.prepare()
    gate = ShardGate(("127.0.0.1", c.port))
    c.shard_args = ["--broker", f"tcp://127.0.0.1:{gate.port}"]
    try:
        with c:
            yield c, gate
    finally:
        gate.close()


def test_requests_lost_with_a_shards_data_link_are_sent_again(
    gated: tuple[LocalCluster, ShardGate],
) -> None:
    """What the broker sends by the shards' data links vanishes (their liveness links
    carry on: no failover).  Each shard gives its data connection up after the ZMTP
    heartbeat's 4 s timeout and connects again; the clients then send again the pushes
    lost with the old one: every writer has pushes acknowledged within seconds and
    nothing is lost or doubled, where before those pushes waited out their 30 s
    deadline."""
    c, gate = gated
    routed = c.status()["broker"]["routed"]

    async def hole(load: ExactSumLoad) -> None:
        gate.blackhole()
        await acked_after(load, time.monotonic(), 15.0, sent=True)
        await acked_after(load, time.monotonic(), 5.0, sent=True)  # and they keep going

    run_load(c, hole)  # type: ignore[arg-type]
    assert gate.swallowed > 0, "nothing the broker sent the shards was dropped"
    status = c.status()
    assert status["broker"]["routed"] > routed
    assert all(s["role"] == "primary" for s in status["shards"]), status["shards"]


def test_a_clients_connection_reset_under_load_loses_no_call() -> None:
    """The clients reach the broker through a relay that resets every connection at
    once, under load: the requests and replies in flight on them are lost, and each
    client connects again.  A client whose connection was made again sends again what
    it has in flight, so every writer has pushes acknowledged within seconds and nothing
    is lost or doubled, where before those calls waited out their 30 s deadline."""
    with LocalCluster(partitions=2, shards=2, replication=1) as c:
        gate = ShardGate(("127.0.0.1", c.port))
        try:

            async def scenario() -> ExactSumLoad:
                load = ExactSumLoad(f"tcp://127.0.0.1:{gate.port}", clients=2, timeout=30.0)
                await load.setup()
                stop = asyncio.Event()
                task = asyncio.create_task(load.run(stop))
                try:
                    await acked_after(load, time.monotonic(), 10.0)
                    for _ in range(3):
                        gate.reset()
                        await acked_after(load, time.monotonic(), 10.0, sent=True)
                finally:
                    stop.set()
                    await asyncio.wait_for(task, 60)
                return load

            load = asyncio.run(asyncio.wait_for(scenario(), 120))
            assert gate.resets == 3
            assert asyncio.run(load.verify()) == []
        finally:
            gate.close()
