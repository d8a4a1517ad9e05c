"""Embedding admission and eviction on one table (no processes): memory and push cost.

A stream of 10x ``--cap`` distinct ids (every id new: the worst case for a capped table)
is pushed in batches of ``--batch`` into an unbounded table, a table capped at ``--cap``
rows, and one with the cap, a TTL and admission at the second push; then 200 pushes of
``--batch`` ids that are all present.  Prints, per table: rows kept, peak bytes (values,
Adam's state, bookkeeping, index), mean time of a push of new ids (eviction included) and
of a push of present ids.

    .venv/bin/python bench/lifecycle.py --cap 100000 --batch 4096
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from zps.init import Normal
from zps.optim import Adam
from zps.protocol.specs import EmbeddingSpec
from zps.store.tables import EmbeddingTable


def run(cap: int, batch: int, dim: int, **lifecycle: Any) -> tuple[int, int, float, float]:
    table = EmbeddingTable(
        EmbeddingSpec("e", dim, "float32", Normal(0, 0.1), Adam(), 1, **lifecycle)
    )
    rng = np.random.default_rng(0)
    stream = rng.permutation(10 * cap).astype(np.int64)
    g = rng.normal(size=(batch, dim)).astype(np.float32)
    peak, n, t0 = 0, 0, time.perf_counter()
    for i in range(0, stream.size, batch):
        ids = stream[i : i + batch]
        table.push(ids, g[: ids.size])
        n += 1
        peak = max(peak, table.nbytes)
    new = (time.perf_counter() - t0) / n
    hot = stream[-cap // 2 :][:batch]
    table.push(hot, g[: hot.size])
    t0 = time.perf_counter()
    for _ in range(200):
        table.push(hot, g[: hot.size])
    return len(table), peak, new, (time.perf_counter() - t0) / 200


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=16)
    args = ap.parse_args()
    for label, kw in [
        ("unbounded", {}),
        ("max_rows", {"max_rows": args.cap}),
        ("max_rows+ttl+admit", {"max_rows": args.cap, "ttl_steps": 1000, "admit_count": 2}),
    ]:
        rows, peak, new, hot = run(args.cap, args.batch, args.dim, **kw)
        print(
            f"{label:20s} rows {rows:>8d}  peak {peak / 2**20:7.1f} MiB  "
            f"new-id push {new * 1e3:6.2f} ms  present-id push {hot * 1e3:5.2f} ms"
        )


if __name__ == "__main__":
    main()
