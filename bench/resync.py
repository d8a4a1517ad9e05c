#!/usr/bin/env python3
"""How long a partition runs short of copies when its replica dies: the time until a
spare shard has loaded a snapshot of the whole partition and is in sync.

    python bench/resync.py [--rows 800000] [--dim 64] [--rounds 2]

A local cluster (one partition, 2 copies, a spare shard; heartbeats every 0.2 s, dead
after 1 s) and a table of ``--rows`` rows (float32, Adagrad: rows and state, 512 bytes a
row at dim 64).  Each round SIGKILLs the partition's replica and times, from the kill,
until the broker has dropped it and until the partition is fully replicated again (the
spare subscribed, took the primary's snapshot and loaded it); then a new spare is
started for the next round.  Meanwhile acks="all" writes to the partition are refused
(``replication.min_in_sync = 2``, the default): this is the window a larger partition
lengthens.  Wall time; the cluster's processes are stopped on the way out.
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from zps.client.sync import connect_sync  # noqa: E402
from zps.optim import Adagrad  # noqa: E402
from zps.testing import LocalCluster  # noqa: E402

BATCH = 50_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=800_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ns = ap.parse_args()
    with LocalCluster(
        partitions=1, shards=3, replication=2, heartbeat_interval=0.2, liveness=5
    ) as c:
        c.wait_healthy(60)
        with connect_sync(c.address, timeout=120) as ps:
            ps.create_embedding("e", dim=ns.dim, optimizer=Adagrad(lr=0.1))
            for a in range(0, ns.rows, BATCH):
                ids = np.arange(a, min(ns.rows, a + BATCH), dtype=np.int64)
                ps.push_rows("e", ids, np.ones((ids.size, ns.dim), np.float32))
        c.wait_healthy(120)
        mb = ns.rows * ns.dim * 4 * 2 / 1e6
        print(f"{ns.rows} rows of dim {ns.dim} (rows + Adagrad state: {mb:.0f} MB)")
        print("round  dropped by the broker (s)  in sync again (s)")
        for r in range(ns.rounds):
            replica = next(s for s in c.status()["shards"] if s["role"] == "replica")
            t0 = time.monotonic()
            c.kill(int(replica["pid"]))
            c.wait_gone(int(replica["pid"]), 30)
            t1 = time.monotonic()
            c.wait_healthy(300)
            t2 = time.monotonic()
            print(f"{r + 1:5d}  {t1 - t0:25.2f}  {t2 - t0:17.2f}")
            c.start_shard()  # the next round's spare


if __name__ == "__main__":
    main()
