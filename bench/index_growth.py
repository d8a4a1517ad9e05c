#!/usr/bin/env python3
"""An embedding table that keeps growing: new ids' cost, with the compiled index on and off.

    python bench/index_growth.py [ROWS]        # default 2,200,000

Pushes of 4,096 ids never seen before (dim 32 float32, Adagrad) until a table holds
ROWS rows, as a click-through model's tables grow with every new user and item.
Printed for the compiled index insertion (``zps.store._probe``) and its numpy
fallback, taking turns in one process: the median time of an index insertion of
4,096 new ids (``IdIndex.get_or_insert``), the index's longest rehash (the capacity
doubling: the one step that grows with the table), and a table push of 4,096 new
ids, median and longest (the longest is the rows' own growth: ``_GROWTH`` times the
table, copied).  Wall time, milliseconds or microseconds as labelled; no sockets.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import time  # noqa: E402

import numpy as np  # noqa: E402

from zps.init import Zeros  # noqa: E402
from zps.ops import malloc  # noqa: E402
from zps.optim import Adagrad  # noqa: E402
from zps.protocol.specs import EmbeddingSpec  # noqa: E402
from zps.store import index, tables  # noqa: E402

malloc.tune()
BATCH = 4096


def _index(ids: np.ndarray) -> tuple[float, float]:
    idx = index.IdIndex()
    times = []
    for n in range(0, ids.shape[0], BATCH):
        t = time.perf_counter()
        idx.get_or_insert(ids[n : n + BATCH])
        times.append(time.perf_counter() - t)
    assert (idx.lookup(ids) == np.arange(ids.shape[0])).all()
    return float(np.median(times)), max(times)


def _table(ids: np.ndarray) -> tuple[float, float]:
    table = tables.EmbeddingTable(EmbeddingSpec("t", 32, "float32", Zeros(), Adagrad(0.1), 0))
    grads = np.ones((BATCH, 32), np.float32)
    times = []
    for n in range(0, ids.shape[0], BATCH):
        batch = ids[n : n + BATCH]
        t = time.perf_counter()
        table.push(batch, grads[: batch.shape[0]])
        times.append(time.perf_counter() - t)
    return float(np.median(times)), max(times)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2_200_000
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(1, rows + 1, dtype=np.int64) * 7919)
    if index._probe is None:
        sys.exit("the compiled index was not built (pip install -e . builds it)")
    print(f"{rows:,} rows, {BATCH:,} new ids a push, dim 32 float32 Adagrad")
    head = ("index", "insert p50 us", "longest ms", "push p50 us", "longest ms")
    print("{:8} {:>14} {:>11} {:>12} {:>11}".format(*head))
    for kernel in (True, False, True, False):
        index.KERNEL = kernel
        i_med, i_max = _index(ids)
        t_med, t_max = _table(ids)
        name = "compiled" if kernel else "numpy"
        cells = (name, i_med * 1e6, i_max * 1e3, t_med * 1e6, t_max * 1e3)
        print("{:8} {:14.0f} {:11.0f} {:12.0f} {:11.0f}".format(*cells))


if __name__ == "__main__":
    main()
