"""A routing broker that answers its clients but has no link to a partition's primary,
with real processes: the client sends that partition's requests to the broker while the
router refuses them (``bypass``), and to the router again once it routes them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.integration.test_routers import (
    HOSTS,
    RouterCluster,
    router_report,
    run_load,
)
from zps.testing import ExactSumLoad, acked_after, free_port
from zps.testing.gate import ShardGate


class Gated:
    """A cluster of two hosts, each with a shard and a router; host-a's router reached
    (by clients and shards alike) through ``gate`` at ``endpoint``."""

    def __init__(self, c: RouterCluster, gate: ShardGate, endpoint: str) -> None:
        self.c, self.gate, self.endpoint = c, gate, endpoint


@pytest.fixture
def g() -> Iterator[Gated]:
    c = RouterCluster(partitions=2, shards=2, shard_hosts=HOSTS)
    c.routers = {}
    port = free_port()
    gate = ShardGate(("127.0.0.1", port))
    try:
        with c:
            endpoint = f"tcp://127.0.0.1:{gate.port}"
            c.start_router(HOSTS[0], port=port, advertise=endpoint)
            c.start_router(HOSTS[1])
            c.wait_routed()
            yield Gated(c, gate, endpoint)
    finally:
        gate.close()


def test_a_partition_the_router_cannot_reach_goes_to_the_broker_meanwhile(g: Gated) -> None:
    """The router of host-a loses its links to the shards (they cannot connect again)
    while its clients and the broker still reach it: it refuses the requests of host-a's
    partition as ``not connected`` and marks the refusal ``bypass``, and every writer has
    pushes acknowledged within a few seconds (through the broker), where without the
    bypass the router's refusals went on until each call's 30 s deadline."""
    stall = 5.0
    before = g.c.status()["broker"]["routed"]

    async def shut(load: ExactSumLoad) -> None:
        g.gate.shut()
        await acked_after(load, time.monotonic(), stall)
        await acked_after(load, time.monotonic(), stall)

    run_load(g.c, shut)
    report = router_report(g.endpoint)
    assert g.gate.refused > 0, "no shard's link to the router was closed"
    assert report["undeliverable"] > 0, report  # it refused: not connected
    assert g.c.status()["broker"]["routed"] > before  # the broker carried them


def test_the_bypass_ends_when_the_router_routes_again(g: Gated) -> None:
    """A bypass lasts ``client.failover_timeout``: once the shards' links are back, the
    partition's requests go through its router again, not the broker."""
    before = g.c.status()["broker"]["routed"]

    async def shut_and_open(load: ExactSumLoad) -> None:
        g.gate.shut()
        await acked_after(load, time.monotonic(), 5.0)
        # Bypassed, whether a refusal or a heartbeat's echo told the clients first
        # (the acks above may be of requests the links carried before they closed).
        deadline = time.monotonic() + 10.0
        while (await asyncio.to_thread(g.c.status))["broker"]["routed"] <= before:
            assert time.monotonic() < deadline, "the clients never went to the broker"
            await asyncio.sleep(0.1)
        report = await asyncio.to_thread(router_report, g.endpoint)
        g.gate.open()  # the shards connect again
        routed = report["routed"]
        deadline = time.monotonic() + 10.0
        while True:
            report = await asyncio.to_thread(router_report, g.endpoint)
            if report["routed"] > routed + 10:
                break
            assert time.monotonic() < deadline, f"not routing again: {report}"
            await asyncio.sleep(0.1)

    run_load(g.c, shut_and_open)


def test_requests_lost_with_a_shards_link_are_sent_again(g: Gated) -> None:
    """The links from host-a's router to the shards die one way (what the router sends
    on them vanishes; the router still hears the shards): the requests it posts there
    are lost, until each shard's ZMTP heartbeats give its connection up and it connects
    again.  The shard greets the router on the new connection, and the router refuses
    what it posted before and had no reply to, so each client sends it again: every
    writer has pushes acknowledged within seconds and nothing is lost or doubled,
    where before those requests waited for their whole 30 s deadline."""

    async def hole(load: ExactSumLoad) -> None:
        g.gate.blackhole()
        # The shards give their connections up after the ZMTP heartbeat's 4 s timeout.
        await acked_after(load, time.monotonic(), 15.0, sent=True)
        await acked_after(load, time.monotonic(), 5.0, sent=True)  # and they keep going

    run_load(g.c, hole)
    assert g.gate.swallowed > 0, "nothing the router sent was dropped"
    report = router_report(g.endpoint)
    assert report["link_lost"] > 0, report
