"""The stages of a partition's bulk paths, one by one, in one process: wall and CPU time.

    .venv/bin/python bench/bulk_stages.py --gb 1

A partition of ``--gb`` GB (an embedding of rows x 32 float32 with Adagrad, its ids
pushed in a random order unless ``--ordered``) in a ShardCore, then each stage of a
replica's catch-up (the cut, which freezes the rows; the sender's reads of the chunks
and their checksum; the replica's copies of them into its tables' arrays, with its
ids indexed by a thread as soon as they are taken, its checksum and its checkpoint
write; the build of its tables, which waits for that index; the release of the
frozen version), of a checkpoint (cut, read, checksum, write, fsync) and of a restart
(read and check into the tables' arrays, the ids indexed meanwhile; build the
tables: the file the checkpoint stage wrote, which a checkpoint drops from the page
cache once synced, so from the disk).  The sender's stage reads every chunk into a
buffer of its own (held for the stages after it), where a transfer reuses a window
of them.  Peak RSS is printed at the end.
CPU seconds count every thread of the process (``time.process_time``); on a loaded
machine they are the figures to compare.  No sockets: ``bench/big_partition.py`` times
the whole paths between processes.  Files go to a temporary directory, removed after.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zps.init import Zeros
from zps.optim import Adagrad
from zps.protocol.specs import EmbeddingSpec
from zps.shard import checkpoint as ck
from zps.shard.core import ShardCore
from zps.shard.snapshots import _fill
from zps.store import snapshot as sn
from zps.store import snapstream as ss

T = TypeVar("T")
DIM = 32


def stage(name: str, f: Callable[..., T], *args: Any, **kw: Any) -> T:
    t0, c0 = time.perf_counter(), time.process_time()
    out = f(*args, **kw)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{name:<44} {wall:8.3f} {cpu:8.3f}", flush=True)
    return out


def build(rows: int, shuffle: bool) -> ShardCore:
    core = ShardCore()
    core.assign(0, 1)
    core.store.create(EmbeddingSpec("big", DIM, "float32", Zeros(), Adagrad(lr=0.1), 0))
    table = core.store.embedding("big")
    ids = np.arange(rows, dtype=np.int64)
    if shuffle:
        np.random.default_rng(0).shuffle(ids)
    data: dict[str, Any] = {
        "ids": ids,
        "rows": np.random.default_rng(1).random((rows, DIM), dtype=np.float32),
    }
    for key, width in table._widths.items():
        data[key] = np.ones((rows, width), np.float32)
    table.load(data)  # storage order: ``ids`` as given
    core.lsn = 5
    return core


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="rows + Adagrad state, GB")
    ap.add_argument("--ordered", action="store_true", help="ids in storage order ascend")
    args = ap.parse_args()
    if args.gb <= 0:
        ap.error("--gb must be positive")
    rows = int(args.gb * 1e9 / (DIM * 4 * 2))
    core = build(rows, not args.ordered)
    print(f"{rows:,} rows x {DIM} float32 + Adagrad ({args.gb:g} GB)")
    print(f"{'stage':<44} {'wall s':>8} {'cpu s':>8}")

    chunk = ss.DEFAULT_CHUNK_BYTES
    snap = stage("snapshot: cut (frozen; the event loop's part)", ck.cut, core)
    parts = stage("snapshot: encode the header", ck.encode_parts, snap)
    plan = ss.plan_chunks([*(len(p) for p in parts), ck.DIGEST_BYTES], chunk)
    last = len(parts)

    def read_chunks(parts: list[sn.Part]) -> list[memoryview]:
        out = []
        for pieces in plan.chunks:
            body = tuple(p for p in pieces if p[0] < last)
            out.append(_fill(parts, body, sum(b - a for _, a, b in body)))
        return out

    # Every chunk at once here (the sender holds a window of them): the stages are
    # timed one by one, not overlapped as the processes overlap them.
    chunks = stage("sender: read the chunks from the frozen version", read_chunks, parts)
    digest = ck.Digest(plan.total)
    stage("sender: checksum of the chunks", digest.feed, chunks)
    chunks[-1] = memoryview(bytes(chunks[-1]) + digest.digest())
    stage("snapshot: release the frozen version", ck.release, snap)
    del snap, parts
    builder = ss.StreamBuilder(1, plan.total, chunk, plan.count, 1 << 40)

    def take(builder: ss.StreamBuilder, chunks: list[memoryview]) -> None:
        for seq, data in enumerate(chunks):
            builder.check(1, seq, [data])
            builder.take([data])

    stage("replica: take the chunks into its tables' arrays, index", take, builder, chunks)
    check = ck.Digest(plan.total)
    stage("replica: checksum of the chunks", check.feed, chunks)
    assert check.digest() == builder.digest()
    with tempfile.TemporaryDirectory(prefix="zps-bench-stages-") as tmp:
        store = ck.CheckpointStore(tmp)

        def keep(chunks: list[memoryview]) -> None:
            pending = store.begin(0, 1, 5)
            for data in chunks:
                pending.write(data)
            pending.commit()

        stage("replica: write its checkpoint, fsync", keep, chunks)
        del chunks
        received = stage("replica: decode the header", builder.snapshot)
        stage("replica: build the tables (own the arrays)", sn.build_store, received)
        del received, builder
        snap = stage("checkpoint: cut (frozen)", ck.cut, core)
        stage("checkpoint: read, checksum, write, fsync", store.write, ck.finish(snap))
        stage("checkpoint: release the frozen version", ck.release, snap)
        del snap
        found = stage("restart: read, check into the arrays, index", store.latest)
        assert found is not None
        stage("restart: build the tables", sn.build_store, found.snapshot)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"peak RSS {peak:.2f} GB for a partition of {args.gb:g} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
