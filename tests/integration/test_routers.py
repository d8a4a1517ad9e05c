"""Routing brokers (``zps-server broker --follow``) with real processes: pushes and pulls
through them, a router killed and paused under load, a cold start in the wrong order and
a broker restart."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import zps
from zps.optim import SGD
from zps.testing import ExactSumLoad, LocalCluster, PairCluster, Proc, acked_after, free_port

HOSTS = ["host-a", "host-b"]


class Routers(LocalCluster):
    """A broker (or pair), shards on two named hosts and a routing broker on each host."""

    routers: dict[str, tuple[Proc, str]]

    def start_router(
        self, host: str, port: int | None = None, advertise: str | None = None
    ) -> tuple[Proc, str]:
        """A router on ``host``; ``advertise``: the endpoint clients and shards reach it
        at, when not the one it binds (the endpoint returned)."""
        endpoint = f"tcp://127.0.0.1:{port or free_port()}"
        n = sum(p.name.startswith("router") for p in self.procs)
        extra = ["--advertise", advertise] if advertise else []
        proc = self.spawn(
            f"router{n}-{host}",
            [self.python, "-m", "zps", "broker", "--follow", self.address, "--bind", endpoint,
             "--host", host, *extra, *self.common_args()],
        )  # fmt: skip
        self.routers[host] = (proc, advertise or endpoint)
        return proc, advertise or endpoint

    def routed(self, status: dict[str, Any]) -> bool:
        """Healthy, with every router listed and each partition given its host's router."""
        if not self.healthy(status):
            return False
        listed = {r["endpoint"]: r for r in status.get("routers", [])}
        want = {e for proc, e in self.routers.values() if proc.alive()}
        if set(listed) != want:
            return False
        hosts = {s["node"]: s["host"] for s in status["shards"]}
        every = want == {e for _, e in self.routers.values()}  # none of them is down
        for p in status["partitions"]:
            r = next((r for r in listed.values() if p["partition"] in r["partitions"]), None)
            if r is None or (every and r["host"] != hosts.get(p["primary"])):
                return False
        return True

    def wait_routed(self, timeout: float = 30.0) -> dict[str, Any]:
        return self.wait_for(self.routed, timeout, "every router listed and every partition routed")


class RouterCluster(Routers):
    pass


class PairRouterCluster(Routers, PairCluster):
    pass


def router_report(endpoint: str) -> dict[str, Any]:
    """A router's own report: it answers STATUS with it (refusing the call itself)."""

    async def ask() -> dict[str, Any]:
        async with zps.connect(endpoint, timeout=5.0, connect_timeout=5.0) as ps:
            reply = await ps.status()
        assert reply["st"] == "BAD_REQUEST" and "routing broker" in reply["msg"], reply
        return dict(reply["router"])

    return asyncio.run(asyncio.wait_for(ask(), 20))


@pytest.fixture
def cluster() -> Iterator[RouterCluster]:
    c = RouterCluster(partitions=2, shards=2, shard_hosts=HOSTS)
    c.routers = {}
    with c:
        for host in HOSTS:
            c.start_router(host)
        c.wait_routed()
        yield c


def run_load(
    c: Routers,
    during: Callable[[ExactSumLoad], Any] | None = None,
    seconds: float = 1.0,
    table: str = "chaos",
) -> ExactSumLoad:
    async def scenario() -> ExactSumLoad:
        load = ExactSumLoad(c.address, clients=2, timeout=30.0, table=table)
        await load.setup()
        stop = asyncio.Event()
        task = asyncio.create_task(load.run(stop))
        try:
            await asyncio.sleep(seconds)
            if during is not None:
                await during(load)
            await asyncio.sleep(seconds)
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)
        return load

    load = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert load.total_pushes > 0
    assert asyncio.run(load.verify()) == []
    return load


def test_pushes_and_pulls_go_through_the_routers(cluster: RouterCluster) -> None:
    before = cluster.status()["broker"]["routed"]
    run_load(cluster)

    async def pull_and_dense() -> None:  # a dense tensor over both partitions, via routers
        async with zps.connect(cluster.address, timeout=30.0) as ps:
            await ps.create_dense("w", shape=(300_000,), dtype="float64", optimizer=SGD(lr=1))
            for _ in range(3):
                await ps.push_dense("w", np.ones(300_000))
            got = await ps.pull_dense("w")
            assert np.array_equal(got, np.full(300_000, -3.0))

    asyncio.run(asyncio.wait_for(pull_and_dense(), 60))
    status = cluster.status()
    assert status["broker"]["routed"] == before, "the broker carried data of routed partitions"
    for host in HOSTS:
        report = router_report(cluster.routers[host][1])
        assert report["routed"] > 0 and report["replies"] > 0, report
        assert report["listed"] and len(report["partitions"]) == 1, report


def test_a_shard_linked_to_routers_stops_on_sigterm(cluster: RouterCluster) -> None:
    """A shard reads each routing broker's link in a task of its own: a graceful stop
    ends those too (they kept the shard alive until it was killed)."""
    run_load(cluster)
    shards = [p for p in cluster.procs if p.name.startswith("shard")]
    assert len(shards) == 2
    for shard in shards:
        shard.popen.terminate()
    for shard in shards:
        assert shard.popen.wait(10) == 0, shard.log()[-2000:]
        assert "stopped" in shard.log()


def test_a_router_killed_then_one_paused_under_load(cluster: RouterCluster) -> None:
    # Writers stall at most about client.failover_timeout (0.5 s) plus a retry: 5 s
    # shows a caller stuck on a dead router (its requests would wait out 30 s).
    stall = 5.0
    before = cluster.status()["broker"]["routed"]

    async def faults(load: ExactSumLoad) -> None:
        killed, _ = cluster.routers[HOSTS[0]]
        killed.popen.send_signal(signal.SIGKILL)
        await asyncio.to_thread(killed.popen.wait, 10)
        await acked_after(load, time.monotonic(), stall)
        paused, _ = cluster.routers[HOSTS[1]]
        paused.popen.send_signal(signal.SIGSTOP)
        try:
            await acked_after(load, time.monotonic(), stall)
            # The broker drops it from the map; the writers go on through the broker.
            await asyncio.to_thread(
                cluster.wait_for, lambda s: not s["routers"], 20, "no router in the map"
            )
            await acked_after(load, time.monotonic(), stall)
        finally:
            paused.popen.send_signal(signal.SIGCONT)
        # Back: it asks to be listed again, and routes again.
        await asyncio.to_thread(
            cluster.wait_for, lambda s: len(s["routers"]) == 1, 20, "the router listed again"
        )
        await acked_after(load, time.monotonic(), stall)

    run_load(cluster, faults)
    assert cluster.status()["broker"]["routed"] > before  # the fallback carried the load
    report = router_report(cluster.routers[HOSTS[1]][1])
    assert report["listed"] and len(report["partitions"]) == 2, report


def test_routers_before_the_broker_and_a_broker_restart_converge() -> None:
    c = RouterCluster(partitions=2, shards=2, shard_hosts=HOSTS)
    c.routers = {}
    try:
        c.prepare()
        for host in HOSTS:  # cold start, in the wrong order: the routers first
            c.start_router(host)
        time.sleep(0.3)
        c.start_broker()
        for _ in range(c.shards):
            c.start_shard()
        c.wait_routed()
        run_load(c, seconds=0.5)
        # The broker restarts: the shards reclaim, the routers are listed again.
        broker = c.broker()
        broker.popen.send_signal(signal.SIGKILL)
        broker.popen.wait(10)
        c.start_broker(grace=1.0)
        c.wait_routed()
        before = c.status()["broker"]["routed"]
        run_load(c, seconds=0.5, table="again")
        assert c.status()["broker"]["routed"] == before
        for host in HOSTS:
            assert router_report(c.routers[host][1])["routed"] > 0
    finally:
        c.stop()


def test_routers_follow_a_broker_pair_through_a_takeover() -> None:
    c = PairRouterCluster(partitions=2, shards=2, replication=1, shard_hosts=HOSTS)
    c.routers = {}
    with c:
        for host in HOSTS:
            c.start_router(host)
        c.wait_routed()

        async def takeover(load: ExactSumLoad) -> None:
            active = await asyncio.to_thread(c.active_broker)
            active.popen.send_signal(signal.SIGKILL)
            await asyncio.to_thread(active.popen.wait, 10)
            await acked_after(load, time.monotonic())
            # The other broker lists the routers, at its term, and they route again.
            await asyncio.to_thread(
                c.wait_for,
                lambda s: s["pair"]["term"] >= 2 and c.routed(s),
                30,
                "the routers listed by the new active broker",
            )

        run_load(c, takeover)
        status = c.status()
        assert status["broker"]["pid"] != c.procs[0].pid
        for host in HOSTS:
            report = router_report(c.routers[host][1])
            assert report["term"] >= 2 and report["following"] == c.endpoint(1), report
