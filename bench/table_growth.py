#!/usr/bin/env python3
"""A table growing on one shard with the default heartbeats: does the shard survive?

    python bench/table_growth.py [--rows 4000000] [--batch 4096] [--replication 1]

A local cluster (one partition, ``--replication`` copies, heartbeats every 0.2 s, dead
after 1 s: the defaults) and one client pushing gradients for ``--batch`` ids never
seen before (dim 32 float32, Adagrad) until the table holds ``--rows`` rows.  A table
that outgrows its arrays once held the shard's event loop for as long as it took to copy
every row into larger ones, later to rehash its index; rows now grow in place and a large
index is rebuilt by a thread (docs/performance.md, "A table that grows").  Printed: the
pushes that took over 0.3 s, the
longest, the primary's heartbeats sent by its liveness thread while its loop was held
and the loop's longest gap (``zps_shard_heartbeats_covered_total``,
``zps_shard_event_loop_longest_gap_seconds``), and whether the broker declared a shard
dead.  Wall time; the cluster's processes are stopped on the way out.
"""

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import zps  # noqa: E402
from zps.init import Zeros  # noqa: E402
from zps.optim import Adagrad  # noqa: E402
from zps.testing import LocalCluster, free_port, scrape_metric  # noqa: E402


async def grow(address: str, rows: int, batch: int) -> tuple[float, int]:
    async with zps.connect(address, timeout=60) as ps:
        await ps.create_embedding("t", dim=32, init=Zeros(), optimizer=Adagrad(lr=0.1))
        ids = np.random.default_rng(0).permutation(np.arange(1, rows + 1, dtype=np.int64) * 7919)
        grads = np.ones((batch, 32), np.float32)
        worst, at = 0.0, 0
        for n in range(0, rows, batch):
            chunk = ids[n : n + batch]
            start = time.monotonic()
            await ps.push_rows("t", chunk, grads[: chunk.shape[0]])
            took = time.monotonic() - start
            if took > 0.3:
                print(f"  at {n:>11,} rows: a push took {took * 1e3:,.0f} ms", flush=True)
            if took > worst:
                worst, at = took, n
        return worst, at


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--replication", type=int, default=1)
    args = p.parse_args()
    mport = free_port()
    with LocalCluster(
        partitions=1,
        shards=args.replication,
        replication=args.replication,
        heartbeat_interval=0.2,
        liveness=5,
        # (the metrics of the first copy only: one port)
        shard_args=["--metrics-port", str(mport)] if args.replication == 1 else [],
    ) as c:
        start = time.monotonic()
        try:
            worst, at = asyncio.run(grow(c.address, args.rows, args.batch))
            outcome = f"longest push {worst * 1e3:,.0f} ms at {at:,} rows"
        except zps.errors.ZpsError as e:
            outcome = f"FAILED: {type(e).__name__}: {e}"
        took = time.monotonic() - start
        log = "\n".join(proc.log() for proc in c.procs if proc.name.startswith("broker"))
        try:
            covered = scrape_metric(mport, "zps_shard_heartbeats_covered_total")
            gap = scrape_metric(mport, "zps_shard_event_loop_longest_gap_seconds")
            loop = f"{covered:.0f} heartbeats sent for a held loop, its longest gap {gap:.2f} s"
        except Exception as e:  # a shard of a release without them, or one gone
            loop = f"no liveness metrics ({type(e).__name__})"
    print(f"{args.rows:,} rows of dim 32 (Adagrad) in {took:.1f} s: {outcome}")
    print(f"primary: {loop}")
    print(f"broker: {log.count('declared dead')} shard(s) declared dead")


if __name__ == "__main__":
    main()
