#!/usr/bin/env python3
"""A worker's own cost per pipelined sparse step: main-thread CPU, Python function calls.

    python bench/worker_cpu.py [--blocks 10] [--steps 300] [--profile 1000] [--latency 2000]
    python bench/worker_cpu.py --against DIR [--rounds 3]     # side by side with another tree
    python bench/worker_cpu.py --micro      # the row routing alone: kernel against numpy

Starts 2 partitions x 1 copy (``zps.testing.LocalCluster``), then a worker does the
sparse step of ``bench/peers.py`` pipelined: pull 4,096 unique Zipf ids of a 1M x 32
float32 SGD table, push their gradients with ``wait=False``.  It prints the main thread's
CPU per step (``time.thread_time``) of each block of ``--steps`` steps, best and median;
with ``--profile N`` the Python function calls per step under cProfile over N steps; with
``--latency N`` the p50 of N pulls of one row (dim 8).  The worker uses the allocator
settings of ``zps-worker`` (``zps.ops.malloc.tune``).

``--against DIR`` runs two workers at the same time against one cluster, this tree's and
the zps of checkout ``DIR`` (say ``git worktree add /tmp/before HEAD~1``), each on its own
table, ``--rounds`` times with a fresh cluster each (which starts first alternates): on a
shared machine whose load moves by the minute, both see the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def zipf_ids(rng: np.random.Generator, n: int = 4096) -> np.ndarray:
    """As ``bench/zps_bench.py``: unique Zipf(1.2) ids mod 1e6, in order of first draw."""
    draws = np.empty(0, dtype=np.int64)
    while True:
        draws = np.concatenate([draws, rng.zipf(1.2, 4 * n).astype(np.int64) % 1_000_000])
        uniq, first = np.unique(draws, return_index=True)
        if uniq.size >= n:
            return uniq[np.argsort(first)][:n].copy()


async def worker(ns: argparse.Namespace, address: str) -> dict[str, Any]:
    import zps

    rng = np.random.default_rng(200)
    out: dict[str, Any] = {"zps": str(Path(zps.__file__).parent)}
    async with zps.connect(address) as ps:
        name = ns.table
        await ps.create_embedding(
            name, dim=32, init=zps.init.Uniform(-0.01, 0.01), optimizer=zps.optim.SGD(lr=0.05)
        )
        pool = [zipf_ids(rng) for _ in range(64)]
        grads = rng.standard_normal((4096, 32), dtype=np.float32) * np.float32(1e-2)
        at = 0

        async def step() -> None:
            nonlocal at
            ids = pool[at % len(pool)]
            at += 1
            await ps.pull_rows(name, ids)
            await ps.push_rows(name, ids, grads, wait=False)

        for _ in range(200):
            await step()
        await ps.flush()
        cpu, faults = [], resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(ns.blocks):
            c0 = time.thread_time()
            for _ in range(ns.steps):
                await step()
            await ps.flush()
            cpu.append((time.thread_time() - c0) / ns.steps * 1e3)
        out["cpu_ms"] = sorted(cpu)
        out["faults_per_step"] = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults) / (
            ns.blocks * ns.steps
        )
        if ns.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(ns.profile):
                await step()
            await ps.flush()
            prof.disable()
            out["calls_per_step"] = pstats.Stats(prof).total_calls / ns.profile  # type: ignore[attr-defined]
        if ns.latency:
            lat = name + "_one"
            await ps.create_embedding(lat, dim=8, optimizer=zps.optim.SGD(lr=0.01))
            ids = rng.integers(0, 100_000, 1000, dtype=np.int64)
            await ps.pull_rows(lat, ids)
            one = [ids[i : i + 1] for i in range(ids.size)]
            for i in range(300):
                await ps.pull_rows(lat, one[i % 1000])
            samples = np.empty(ns.latency, dtype=np.int64)
            for i in range(samples.size):
                t = time.perf_counter_ns()
                await ps.pull_rows(lat, one[i % 1000])
                samples[i] = time.perf_counter_ns() - t
            out["p50_us"] = float(np.percentile(samples, 50) / 1e3)
    out["load"] = os.getloadavg()[0]
    return out


def run_worker(ns: argparse.Namespace, address: str) -> dict[str, Any]:
    from zps.ops import malloc

    malloc.tune()  # as zps-worker and the bench clients do
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        return runner.run(worker(ns, address))


def micro() -> None:
    """The row routing alone, kernel against numpy: best of 15 x 500 calls each."""
    import timeit

    from zps.core import rows
    from zps.core.routing import ClusterMap, PartitionInfo, default_slot_map, split_by_partition
    from zps.ops import malloc

    malloc.tune()  # as in a worker: gathered rows reuse the heap, no fresh pages

    rng = np.random.default_rng(0)
    cmap = ClusterMap(1, 4096, default_slot_map(4096, 2), {0: PartitionInfo(), 1: PartitionInfo()})
    ids = zipf_ids(rng)
    g = rng.standard_normal((4096, 32), dtype=np.float32)
    split = rows.split_ids_numpy(ids, cmap.slot_map, 2)
    _, a, b = split.parts[0]
    pos, part = split.order[a:b], np.ascontiguousarray(g[split.order[a:b]])
    out = np.empty_like(g)

    cases = {
        "split 4,096 ids over 2 partitions": {
            "kernel": lambda: rows.split_ids(ids, cmap.slot_map, 2),
            "numpy": lambda: rows.split_ids_numpy(ids, cmap.slot_map, 2),
            "routing.split_by_partition": lambda: split_by_partition(ids, cmap),
        },
        "gather 4,096 rows of 128 B (push: every partition's gradients)": {
            "kernel": lambda: rows.take_rows(g, split.order),
            "numpy": lambda: rows.take_rows_numpy(g, split.order),
        },
        f"scatter {pos.size:,} rows of 128 B (pull: one partition's reply)": {
            "kernel": lambda: rows.put_rows(out, pos, part),
            "numpy": lambda: rows.put_rows_numpy(out, pos, part),
        },
    }
    for what, variants in cases.items():
        if not rows.KERNEL:
            del variants["kernel"]
        # the variants take turns, 15 rounds of 500 calls: each sees the same load
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(15):
            for key, f in variants.items():
                best[key] = min(best[key], timeit.timeit(f, number=500) / 500 * 1e6)
        print(f"{what}: " + ", ".join(f"{k} {v:.1f} us" for k, v in best.items()))


def line(label: str, d: dict[str, Any]) -> str:
    cpu = d["cpu_ms"]
    med = cpu[len(cpu) // 2]
    text = f"{label}: main-thread CPU per step best {cpu[0]:.3f} ms, median {med:.3f} ms"
    if "calls_per_step" in d:
        text += f"; {d['calls_per_step']:.0f} calls per step"
    if "p50_us" in d:
        text += f"; one-row pull p50 {d['p50_us']:.0f} us"
    return text + f" (load {d['load']:.1f}; {d['zps']})"


def main() -> int:
    from zps.testing import exit_on_sigterm

    exit_on_sigterm()  # a killed run stops its cluster too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", type=int, default=0, help="steps under cProfile")
    ap.add_argument("--latency", type=int, default=0, help="one-row pulls to time")
    ap.add_argument("--against", default="", help="another checkout, run side by side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print JSON lines")
    ap.add_argument("--micro", action="store_true", help="the row routing alone, no cluster")
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)  # a worker of --against
    ap.add_argument("--table", default="worker_cpu", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.address:
        print(json.dumps(run_worker(ns, ns.address)))
        return 0
    sys.path.insert(0, str(ROOT))
    if ns.micro:
        micro()
        return 0
    from zps.testing import LocalCluster

    trees = [str(ROOT)] + ([str(Path(ns.against).resolve())] if ns.against else [])
    args = [f"--{k}={getattr(ns, k)}" for k in ("blocks", "steps", "profile", "latency")]
    for r in range(ns.rounds if ns.against else 1):
        with LocalCluster(
            partitions=2, shards=2, heartbeat_interval=0.2, log_level="warning"
        ) as cluster:
            procs = []
            for i in range(len(trees)):
                tree = trees[(i + r) % len(trees)]
                env = {**os.environ, "PYTHONPATH": tree}
                cmd = [sys.executable, __file__, *args, "--address", cluster.address]
                cmd += ["--table", f"worker_cpu_{(i + r) % len(trees)}"]
                procs.append(
                    (tree, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
                )
            results = {tree: json.loads(p.communicate(timeout=1200)[0]) for tree, p in procs}
        for tree in trees:
            label = "this tree" if tree == trees[0] else "against"
            d = results[tree]
            print(
                json.dumps({"round": r, "tree": tree, **d}) if ns.json else f"{r} {line(label, d)}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
