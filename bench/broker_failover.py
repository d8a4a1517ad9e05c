"""Broker failover under load: what a fault of the active broker of a pair costs callers.

A broker pair (primary and backup, see zps.broker.pair) in front of shards, and
clients pushing integer gradients with SGD(lr=1) (zps.testing.ExactSumLoad), so
every row must end exactly at minus the sum of the acknowledged pushes.  Each
fault SIGKILLs (or SIGSTOPs) whichever broker is active; the killed one is
started again (the stopped one continued) once the other serves, and the next
fault waits until the pair is whole again (the standby holds the state).

Per fault it measures the caller stall: for each writer, the longest time it
went without an acknowledged push from the fault until the other broker serves
it (replies already on their way at the fault do not hide the gap after them);
the fault's figure is the worst writer's.
It prints a table of p50/p99/max over the faults, the caller errors and the
exact-sum verdict.

    .venv/bin/python bench/broker_failover.py --faults 12 --fault kill
    .venv/bin/python bench/broker_failover.py --faults 12 --fault stop
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
import time
from typing import Any

import numpy as np

from zps.testing import ExactSumLoad, PairCluster, Proc


def pair_whole(cluster: PairCluster, status: dict[str, Any]) -> bool:
    """Both brokers up: the active one sees a passive peer holding its state."""
    pair = status.get("pair") or {}
    peer = pair.get("peer") or {}
    return (
        pair.get("state") == "active"
        and peer.get("alive") is True
        and peer.get("state") == "passive"
        and peer.get("has_record") is not None
        and cluster.healthy(status)
    )


async def wait_acked_after(load: ExactSumLoad, t0: float, timeout: float) -> None:
    """Until every writer has an ack of a push after ``t0``."""
    deadline = time.monotonic() + timeout
    while True:
        if all(any(ack > t0 for _, ack in w.acks) for row in load.writers for w in row):
            return
        errors = [e for row in load.writers for w in row for e in w.errors]
        if errors:
            raise RuntimeError(f"a caller saw an error: {errors[0]!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"writers still stalled {timeout}s after the fault")
        await asyncio.sleep(0.01)


def worst_gap(load: ExactSumLoad, t0: float, t1: float) -> float:
    """The longest time a writer went without an ack in [t0, t1]."""
    worst = 0.0
    for row in load.writers:
        for w in row:
            times = [t0, *sorted(ack for _, ack in w.acks if t0 < ack <= t1)]
            worst = max([worst, *(b - a for a, b in itertools.pairwise(times))])
    return worst


async def one_fault(cluster: PairCluster, load: ExactSumLoad, kind: str) -> float:
    await asyncio.to_thread(cluster.wait_for, lambda s: pair_whole(cluster, s), 30, "the pair")
    active: Proc = await asyncio.to_thread(cluster.active_broker)
    await asyncio.sleep(0.3)  # load flows through the active broker
    t0 = time.monotonic()
    active.popen.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    await asyncio.to_thread(
        cluster.wait_for, lambda s: s["broker"]["pid"] != active.pid, 30, "the other broker"
    )
    served = time.monotonic()
    await wait_acked_after(load, served, 30)
    stall = worst_gap(load, t0, time.monotonic())
    if kind == "kill":
        await asyncio.to_thread(active.popen.wait, 10)
        cluster.restart_broker(active)
    else:
        active.popen.send_signal(signal.SIGCONT)
    return stall


async def run(args: argparse.Namespace) -> int:
    cluster = PairCluster(
        partitions=args.partitions,
        shards=args.partitions * args.replication,
        replication=args.replication,
        heartbeat_interval=args.heartbeat,
        liveness=5,
        peer_timeout=args.peer_timeout,
        log_level="warning",
    )
    await asyncio.to_thread(cluster.start, 60)
    stalls: list[float] = []
    try:
        load = ExactSumLoad(cluster.address, clients=args.clients, timeout=30.0)
        await load.setup()
        stop = asyncio.Event()
        task = asyncio.create_task(load.run(stop))
        try:
            for i in range(args.faults):
                kind = args.fault if args.fault != "mix" else ("kill", "stop")[i % 2]
                stall = await one_fault(cluster, load, kind)
                stalls.append(stall)
                print(f"fault {i + 1:>2} ({kind}): worst caller stalled {stall:.3f}s", flush=True)
        finally:
            stop.set()
            await task
        problems = await load.verify()
        errors = sum(len(w.errors) for row in load.writers for w in row)
        arr = np.array(stalls)
        print()
        print(
            f"{'faults':>6}  {'p50 s':>6}  {'p99 s':>6}  {'max s':>6}  {'errors':>6}  "
            f"{'pushes':>7}  exact sums"
        )
        print(
            f"{len(arr):>6}  {np.percentile(arr, 50):>6.3f}  {np.percentile(arr, 99):>6.3f}  "
            f"{arr.max():>6.3f}  {errors:>6}  {load.total_pushes:>7}  "
            f"{'ok' if not problems else 'WRONG'}"
        )
        for p in problems[:10]:
            print("  ", p)
        return 0 if not problems else 1
    except BaseException:
        print(cluster.logs()[-8000:], file=sys.stderr)
        raise
    finally:
        cluster.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--fault", choices=("kill", "stop", "mix"), default="mix")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--replication", type=int, default=2)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--heartbeat", type=float, default=0.2, help="heartbeat interval (s)")
    ap.add_argument("--peer-timeout", type=float, default=0.5, help="broker peer timeout (s)")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
