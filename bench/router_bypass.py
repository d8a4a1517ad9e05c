"""A routing broker cut off from a partition's primary: what it costs callers.

Two hosts, each with a shard (the primary of one of two partitions) and a routing
broker; clients push integer gradients with SGD(lr=1) (zps.testing.ExactSumLoad:
every row must end exactly at minus the sum of the acknowledged pushes), each push
touching both partitions.  Host a's router is reached through a relay
(zps.testing.gate.ShardGate) that, at each fault, closes the shards' connections
to it and every one they make again, while the clients and the broker still reach
it: the router can no longer route host a's partition.  The clients send that
partition's requests to the broker until the relay opens again (design.md, "Routing
brokers"); requests in flight through the cut link are sent again.

Per fault it measures the caller stall: for each writer, the longest time it went
without an acknowledged push from the fault until ``--hold`` seconds after it (the
fault's figure is the worst writer's); then the relay opens and the next fault waits
until the router hears the primary again.  It prints a table of p50/p99/max over the
faults, the caller errors and the exact-sum verdict.

    .venv/bin/python bench/router_bypass.py --faults 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from typing import Any

import numpy as np

import zps
from zps.testing import ExactSumLoad, LocalCluster, free_port
from zps.testing.gate import ShardGate

HOSTS = ["host-a", "host-b"]


def worst_gap(load: ExactSumLoad, t0: float, t1: float) -> float:
    """The longest time a writer went without an ack in [t0, t1]."""
    worst = 0.0
    for row in load.writers:
        for w in row:
            times = [t0, *sorted(ack for _, ack in w.acks if t0 < ack <= t1), t1]
            worst = max([worst, *(b - a for a, b in itertools.pairwise(times))])
    return worst


async def router_report(endpoint: str) -> dict[str, Any]:
    """A router's own report (it answers STATUS with it, refusing the call itself)."""
    async with zps.connect(endpoint, timeout=5.0, connect_timeout=5.0) as ps:
        reply = await ps.status()
    return dict(reply["router"])


async def wait_heard(endpoint: str, timeout: float = 30.0) -> None:
    """Until the router lists a partition and hears each one's primary."""
    deadline = time.monotonic() + timeout
    while True:
        report = await router_report(endpoint)
        if report["partitions"] and not report["unheard"]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router does not hear its primaries: {report}")
        await asyncio.sleep(0.05)


async def run(args: argparse.Namespace) -> int:
    cluster = LocalCluster(
        partitions=2,
        shards=2,
        shard_hosts=HOSTS,
        heartbeat_interval=args.heartbeat,
        log_level="warning",
    )
    port = free_port()
    gate = ShardGate(("127.0.0.1", port))
    gated = f"tcp://127.0.0.1:{gate.port}"
    await asyncio.to_thread(cluster.start, 60)
    stalls: list[float] = []
    try:
        for host, bind, advertise in (
            (HOSTS[0], f"tcp://127.0.0.1:{port}", gated),
            (HOSTS[1], f"tcp://127.0.0.1:{free_port()}", None),
        ):
            extra = ["--advertise", advertise] if advertise else []
            cluster.spawn(
                f"router-{host}",
                [cluster.python, "-m", "zps", "broker", "--follow", cluster.address,
                 "--bind", bind, "--host", host, *extra, *cluster.common_args()],
            )  # fmt: skip
        await wait_heard(gated)
        load = ExactSumLoad(cluster.address, clients=args.clients, timeout=30.0)
        await load.setup()
        stop = asyncio.Event()
        task = asyncio.create_task(load.run(stop))
        try:
            for i in range(args.faults):
                await wait_heard(gated)
                await asyncio.sleep(0.3)  # load flows through the router
                t0 = time.monotonic()
                gate.shut()
                await asyncio.sleep(args.hold)
                stall = worst_gap(load, t0, time.monotonic())
                gate.open()
                stalls.append(stall)
                print(f"fault {i + 1:>2}: worst caller stalled {stall:.3f}s", flush=True)
        finally:
            stop.set()
            await task
        report = await router_report(gated)
        problems = await load.verify()
        errors = sum(len(w.errors) for row in load.writers for w in row)
        arr = np.array(stalls)
        print()
        print(
            f"{'faults':>6}  {'p50 s':>6}  {'p99 s':>6}  {'max s':>6}  {'errors':>6}  "
            f"{'pushes':>7}  {'refused':>7}  exact sums"
        )
        print(
            f"{len(arr):>6}  {np.percentile(arr, 50):>6.3f}  {np.percentile(arr, 99):>6.3f}  "
            f"{arr.max():>6.3f}  {errors:>6}  {load.total_pushes:>7}  "
            f"{report['undeliverable']:>7}  {'ok' if not problems else 'WRONG'}"
        )
        print(f"(refused: requests the cut-off router refused, its report's undeliverable; "
              f"shard connections the relay closed: {gate.refused})")  # fmt: skip
        for p in problems[:10]:
            print("  ", p)
        return 0 if not problems else 1
    except BaseException:
        print(cluster.logs()[-8000:], file=sys.stderr)
        raise
    finally:
        cluster.stop()
        gate.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--hold", type=float, default=3.0, help="seconds each cut lasts")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--heartbeat", type=float, default=0.2, help="heartbeat interval (s)")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
