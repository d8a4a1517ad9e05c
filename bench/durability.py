#!/usr/bin/env python3
"""What each durability mode costs: pushes per second and push latency.

    python bench/durability.py [--seconds 5] [--replication 2] [--in-flight 1,16]
                               [--modes none,interval,fsync] [--rounds 1]

For each mode, a fresh local cluster (one broker, ``partitions x replication``
shards as processes, each with its own data dir and ``--durability MODE``) takes
small ``push_rows`` (``--rows`` ids of dim ``--dim``, float32, SGD, ``acks="all"``)
from writers in a closed loop: ``--in-flight`` writers at once, each sending its
next push when the last one was acknowledged.  After a warm-up second, it counts
the pushes acknowledged in ``--seconds`` and the latency of each, and reads the
shards' write-ahead log counters (bytes, fsyncs) from their Prometheus endpoints.
With ``--rounds`` above 1 the modes take turns, round after round, so a noisy
machine shifts them all alike.

Not part of the test suite.  Every process it starts is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import zps  # noqa: E402
from zps.optim import SGD  # noqa: E402
from zps.testing import LocalCluster, Proc, free_port  # noqa: E402

WARMUP_S = 1.0


class BenchCluster(LocalCluster):
    """Shards with a data dir each, a durability mode and a metrics port."""

    mode: str = "none"
    metrics_ports: list[int]

    def start_shard(self, extra: Sequence[str] = ()) -> Proc:
        assert self.workdir is not None
        n = sum(p.name.startswith("shard") for p in self.procs)
        port = free_port()
        self.metrics_ports.append(port)
        return super().start_shard(
            [
                "--data-dir", str(self.workdir / f"data{n}"),
                "--durability", self.mode,
                "--metrics-port", str(port),
                *extra,
            ]
        )  # fmt: skip


def scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@dataclass
class Result:
    mode: str
    in_flight: int
    pushes: int
    seconds: float
    latencies: list[float]
    wal_bytes: float
    syncs: float

    def row(self) -> str:
        lat = np.array(self.latencies) * 1e3
        rate = self.pushes / self.seconds
        return (
            f"| {self.mode} | {self.in_flight} | {rate:,.0f} | {np.percentile(lat, 50):.2f} | "
            f"{np.percentile(lat, 99):.2f} | {self.wal_bytes / 1e6:.1f} | "
            f"{self.syncs / self.seconds:,.0f} |"
        )


async def load(
    address: str, in_flight: int, seconds: float, rows: int, dim: int
) -> tuple[int, float, list[float]]:
    async with zps.connect(address, timeout=60) as ps:
        await ps.create_embedding("bench", dim=dim, optimizer=SGD(lr=0.01))
        rng = np.random.default_rng(1)
        batches = [
            (np.unique(rng.integers(0, 1_000_000, rows)), rng.standard_normal((rows, dim)))
            for _ in range(64)
        ]
        batches = [(ids, g[: ids.size].astype(np.float32)) for ids, g in batches]
        latencies: list[float] = []
        pushes = 0
        start = time.monotonic()
        measure_from, end = start + WARMUP_S, start + WARMUP_S + seconds

        async def writer(w: int) -> None:
            nonlocal pushes
            k = w
            while (now := time.monotonic()) < end:
                ids, grads = batches[k % len(batches)]
                k += in_flight
                await ps.push_rows("bench", ids, grads)
                if now >= measure_from:
                    latencies.append(time.monotonic() - now)
                    pushes += 1

        await asyncio.gather(*(writer(w) for w in range(in_flight)))
        return pushes, time.monotonic() - measure_from, latencies


def run_mode(mode: str, args: argparse.Namespace, in_flight: int) -> Result:
    with tempfile.TemporaryDirectory(prefix="zps-durability-") as tmp:
        c = BenchCluster(
            partitions=args.partitions,
            shards=args.partitions * args.replication,
            replication=args.replication,
            workdir=Path(tmp),
            log_level="warning",
        )
        c.mode, c.metrics_ports = mode, []
        with c:
            before = [
                (scrape(p, "zps_shard_wal_bytes"), scrape(p, "zps_shard_wal_syncs"))
                for p in c.metrics_ports
            ]
            pushes, seconds, lat = asyncio.run(
                load(c.address, in_flight, args.seconds, args.rows, args.dim)
            )
            after = [
                (scrape(p, "zps_shard_wal_bytes"), scrape(p, "zps_shard_wal_syncs"))
                for p in c.metrics_ports
            ]
    wal = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    syncs = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    # The counters include the warm-up second: scale them to the measured span.
    span = (seconds + WARMUP_S) / seconds
    return Result(mode, in_flight, pushes, seconds, lat, wal / span, syncs / span)


def main(argv: Sequence[str] | None = None) -> int:
    from zps.testing import exit_on_sigterm

    exit_on_sigterm()  # a killed run stops its cluster too
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--replication", type=int, default=2)
    ap.add_argument("--in-flight", default="1,16", help="writers at once, comma-separated")
    ap.add_argument("--rows", type=int, default=64, help="ids per push")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--modes", default="none,interval,fsync")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    flights = [int(x) for x in args.in_flight.split(",")]
    print(
        f"{args.partitions} partitions x {args.replication} copies, push_rows of {args.rows} "
        f"ids x {args.dim} float32, acks=all, {args.seconds:g} s per run"
    )
    print(
        "| durability | in flight | pushes/s | p50 ms | p99 ms | log MB | fsyncs/s (all shards) |"
    )
    print("|---|---|---|---|---|---|---|")
    for _ in range(args.rounds):
        for in_flight in flights:
            for mode in modes:
                print(run_mode(mode, args, in_flight).row(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
