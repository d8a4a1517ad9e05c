"""The stages of a partition's bulk paths, one by one, in one process: wall and CPU time.

    .venv/bin/python bench/bulk_stages.py --gb 1

A partition of ``--gb`` GB (an embedding of rows x 32 float32 with Adagrad, its ids
pushed in a random order unless ``--ordered``) in a ShardCore, then each stage of a
replica's catch-up (the cut, the stream's encoding, the assembly of its chunks, its
decoding, the replica's checkpoint write, the build of its tables), of a checkpoint
(ordering, encoding, checksum, write) and of a restart (read, check, decode, load).
CPU seconds count every thread of the process (``time.process_time``); on a loaded
machine they are the figures to compare.  No sockets: ``bench/big_partition.py`` times
the whole paths between processes.  Files go to a temporary directory, removed after.
"""

from __future__ import annotations

import argparse
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
from zps.store import snapshot as sn

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

    def prefaulted() -> sn.CutSpace:
        space = sn.cut_space(core.store)
        space.prefault()
        return space

    space = stage("snapshot: cut space, prefaulted", prefaulted)
    snap = stage("snapshot: cut (the event loop's part)", ck.cut, core, space)
    del space
    parts = stage("snapshot: encode with its checksum", ck.encode_checkpoint, snap)
    del snap
    plan = sn.plan_chunks([len(p) for p in parts], sn.DEFAULT_CHUNK_BYTES)
    assembly = sn.ChunkAssembly(1, plan.total, plan.chunk_bytes, plan.count, 1 << 40)

    def assemble(into: sn.ChunkAssembly, stream: list[bytes | memoryview]) -> None:
        for seq, pieces in enumerate(plan.chunks):
            into.add(1, seq, [memoryview(stream[i]).cast("B")[a:b] for i, a, b in pieces])

    stage("replica: assemble the chunks (copies)", assemble, assembly, parts)
    del parts
    received = stage(
        "replica: check and decode the stream", ck.decode_checkpoint, assembly.stream(), copy=False
    )
    with tempfile.TemporaryDirectory(prefix="zps-bench-stages-") as tmp:
        store = ck.CheckpointStore(tmp)
        stage(
            "replica: write it as its checkpoint (fsync)",
            store.write_encoded,
            0,
            1,
            5,
            [assembly.stream()],
        )
        stage("replica: build the tables", core.build_store, received)
        del received, assembly
        space = prefaulted()
        snap = ck.cut(core, space)
        del space
        snap = stage("checkpoint: finish (order)", ck.finish, snap)
        stage("checkpoint: encode, checksum, write, fsync", store.write, snap)
        del snap
        found = stage("restart: read, check, decode the newest", store.latest)
        assert found is not None
        stage("restart: load into a core", ShardCore().load_snapshot, found.snapshot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
