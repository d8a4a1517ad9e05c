"""Chaos run: kill primaries under load, measure failover, check exact sums.

    python bench/chaos.py [--kills 10] [--json out.json]

Starts a local cluster (2 partitions x 2 copies, plus a spare) with the
default heartbeat settings (200 ms x 5), runs two clients pushing
integer-valued gradients (zps.testing.ExactSumLoad), SIGKILLs the primary of
a random partition at random moments, starts a replacement shard each time,
and reports the failover time: from the kill to the first acknowledged push
(sent after the kill) to that partition.  At the end every row must equal
exactly minus the sum of the acknowledged pushes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zps.testing import ExactSumLoad, LocalCluster


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def chaos(kills: int, seed: int, interval: float, liveness: int) -> dict[str, object]:
    rng = random.Random(seed)
    cluster = LocalCluster(
        partitions=2,
        shards=5,
        replication=2,
        heartbeat_interval=interval,
        liveness=liveness,
        log_level="warning",
    )
    await asyncio.to_thread(cluster.start, 60)
    try:
        load = ExactSumLoad(cluster.address, clients=2)
        await load.setup()
        stop = asyncio.Event()
        writers = asyncio.create_task(load.run(stop))
        events = []
        try:
            for _ in range(kills):
                await asyncio.sleep(rng.uniform(0.3, 1.0))
                partition = rng.randrange(2)
                pid = await asyncio.to_thread(cluster.shard_pid, partition)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                events.append((partition, killed_at))
                await asyncio.to_thread(cluster.wait_gone, pid, 30)
                cluster.start_shard()
                await asyncio.to_thread(cluster.wait_healthy, 60)
            await asyncio.sleep(0.5)
        finally:
            stop.set()
            await writers
        problems = await load.verify()
        times = [load.failover_time(p, t) for p, t in events]
        measured = [t for t in times if t is not None]
        return {
            "kills": kills,
            "heartbeat_interval_s": interval,
            "liveness": liveness,
            "acknowledged_pushes": load.total_pushes,
            "failover_s": measured,
            "failover_p50_s": percentile(measured, 50) if measured else None,
            "failover_p99_s": percentile(measured, 99) if measured else None,
            "failover_max_s": max(measured) if measured else None,
            "failovers_seen_by_broker": (await asyncio.to_thread(cluster.status))["failovers"],
            "exact_sum": not problems,
            "problems": problems,
        }
    finally:
        await asyncio.to_thread(cluster.stop)


def main() -> int:
    from zps.testing import exit_on_sigterm

    exit_on_sigterm()  # a killed run stops its cluster too
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--heartbeat-interval", type=float, default=0.2)
    ap.add_argument("--liveness", type=int, default=5)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    r = asyncio.run(chaos(args.kills, args.seed, args.heartbeat_interval, args.liveness))
    print(
        f"zps chaos: {r['kills']} primary kills under load, heartbeat "
        f"{r['heartbeat_interval_s']}s x {r['liveness']} (nproc {os.cpu_count()})"
    )
    print(f"{'metric':<34} {'value':>10}")
    for label, key in [
        ("failover p50 (s)", "failover_p50_s"),
        ("failover p99 (s)", "failover_p99_s"),
        ("failover max (s)", "failover_max_s"),
    ]:
        v = r[key]
        print(f"{label:<34} {v if v is None else f'{v:.3f}':>10}")
    print(f"{'acknowledged pushes':<34} {r['acknowledged_pushes']:>10}")
    print(f"{'failovers counted by the broker':<34} {r['failovers_seen_by_broker']:>10}")
    print(f"{'exact sum (nothing lost/doubled)':<34} {'yes' if r['exact_sum'] else 'NO':>10}")
    for p in r["problems"]:  # type: ignore[attr-defined]
        print("  ", p)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return 0 if r["exact_sum"] else 1


if __name__ == "__main__":
    sys.exit(main())
