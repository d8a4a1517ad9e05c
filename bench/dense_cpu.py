#!/usr/bin/env python3
"""CPU per dense step of every process, with the shared-memory path on and off.

    python bench/dense_cpu.py [--seconds 5] [--pairs 2] [--workers 2] [--pipelined]
                              [--replication 1] [--ray] [--sparse] [--copy]
                              [--threads] [--untuned]

Starts a local cluster (2 partitions, ``--replication`` copies) and ``--workers``
worker processes, each pulling and pushing one 16 MiB float32 tensor (plain SGD) in a
loop, as ``bench/peers.py --only dense`` does; after a warm-up it counts the steps of
``--seconds`` and the CPU time (user + system, ``/proc/PID/stat``) the broker, the
shards and the workers spent meanwhile.  Each pair runs the path on, then off
(``ZPS_NO_SHM=1`` for every process), back to back, each on a fresh cluster.
The gradient is pushed from the client's ``gradient_buffer`` (sent with no copy on
one host), as ``bench/peers.py`` does; ``--copy`` pushes it from a plain array
instead (copied into the client's shared memory at each push).

``--ray`` adds, to each pair, Ray's actor PS doing the same steps (the dense step of
``bench/peers.py``: a PS actor and ``--workers`` worker actors), with the CPU of every
process of the Ray session (its raylet, GCS, actors), in a child process.

``--threads`` adds each thread's CPU per step (``shard0/ZMQbg/IO/0``: zmq's I/O thread;
``python``: the main thread; ticks of 10 ms, so run for some seconds).  ``--untuned``:
the workers' clients leave glibc's allocator alone (``client.tune_malloc = false``).

``--sparse``: the sparse step of ``bench/peers.py`` instead (a 1,000,000 x 32 float32
table, SGD; pull 4,096 unique Zipf ids from a pool of 64 precomputed batches, push
their gradients), each pair one run (its frames are below the shared-memory size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import zps_bench as zb  # noqa: E402  (this folder: the shared helpers)

ELEMS = 4 << 20  # 16 MiB of float32

#: A worker process: ``prepare`` (one of the two below) makes the table and the step.
HARNESS = """
import asyncio, sys, time
import numpy as np
import zps

PREPARE

async def main(address, seconds, pipelined, seed, copy, tune):
    # The client tunes the process's allocator at its start (client.tune_malloc).
    async with zps.connect(address, tune_malloc=tune) as ps:
        step, warmup = await prepare(ps, np.random.default_rng(seed), pipelined, copy)
        for _ in range(warmup):
            await step()
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        n, end, cpu = 0, time.monotonic() + seconds, time.process_time()
        while time.monotonic() < end:
            await step()
            n += 1
        await ps.flush()
        print("STEPS", n, time.process_time() - cpu, flush=True)

# On uvloop, as bench/peers.py's zps workers (and zps.connect_sync) run.
import uvloop

with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
    runner.run(
        main(
            sys.argv[1],
            float(sys.argv[2]),
            sys.argv[3] == "1",
            int(sys.argv[4]),
            sys.argv[5] == "1",
            sys.argv[6] == "1",
        )
    )
"""

DENSE = """
async def prepare(ps, rng, pipelined, copy):
    await ps.create_dense("d", shape=(ELEMS,), optimizer=zps.optim.SGD(lr=0.01))
    grad = rng.standard_normal(ELEMS, dtype=np.float32) * 1e-3
    if not copy:  # as a model's gradient, written where it is sent from
        buf = await ps.gradient_buffer("d")
        buf[:] = grad
        grad = buf
    values = np.empty(ELEMS, dtype=np.float32)

    async def step():
        await ps.pull_dense("d", out=values)
        await ps.push_dense("d", grad, wait=not pipelined)

    return step, 3
""".replace("ELEMS", str(ELEMS))

ROWS, DIM, BATCH = 1_000_000, 32, 4096

SPARSE = (
    """
def zipf_ids(rng, n=BATCH):
    # As bench/zps_bench.py: Zipf(a=1.2) draws mod ROWS, first occurrences, n unique.
    draws = np.empty(0, dtype=np.int64)
    while True:
        draws = np.concatenate([draws, rng.zipf(1.2, 4 * n).astype(np.int64) % ROWS])
        uniq, first = np.unique(draws, return_index=True)
        if uniq.size >= n:
            return uniq[np.argsort(first)][:n].copy()

async def prepare(ps, rng, pipelined, copy):
    await ps.create_embedding(
        "s", dim=DIM, init=zps.init.Uniform(-0.01, 0.01), optimizer=zps.optim.SGD(lr=0.05)
    )
    pool = [zipf_ids(rng) for _ in range(64)]
    grads = rng.standard_normal((BATCH, DIM), dtype=np.float32) * np.float32(1e-2)
    it = iter(range(1 << 62))

    async def step():
        ids = pool[next(it) % len(pool)]
        await ps.pull_rows("s", ids)
        await ps.push_rows("s", ids, grads, wait=not pipelined)

    return step, len(pool)
""".replace("ROWS", str(ROWS))
    .replace("DIM", str(DIM))
    .replace("BATCH", str(BATCH))
)


RAY = """
import os, sys, time
from pathlib import Path
import numpy as np
import ray

ELEMS, SECONDS, WORKERS = ELEMS_, float(sys.argv[1]), int(sys.argv[2])
TCK = os.sysconf("SC_CLK_TCK")

def tree(root):
    kids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d.name))
            except OSError:
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out

def cpu(pids):
    t = {}
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            t[p] = (int(f[11]) + int(f[12])) / TCK
        except OSError:
            pass
    return t

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
         object_store_memory=512 << 20, logging_level="ERROR")

@ray.remote(num_cpus=0)
class PS:
    def __init__(self):
        self.dense = np.zeros(ELEMS, np.float32)
    def pull_dense(self):
        return self.dense
    def push_dense(self, g):
        self.dense -= np.float32(0.01) * g

@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, ps, seed):
        self.ps = ps
        self.g = np.random.default_rng(seed).standard_normal(ELEMS, dtype=np.float32) * 1e-3
        self.values = np.empty(ELEMS, np.float32)
    def step(self):
        np.copyto(self.values, ray.get(self.ps.pull_dense.remote()))
        ray.get(self.ps.push_dense.remote(self.g))
    def run(self, seconds, start_at):
        for _ in range(3):
            self.step()
        while time.time() < start_at:
            time.sleep(0.001)
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.step()
            n += 1
        return n

ps = PS.remote()
ws = [Worker.remote(ps, i) for i in range(WORKERS)]
ray.get([w.run.remote(0.5, 0) for w in ws])
start_at = time.time() + 1.0
futs = [w.run.remote(SECONDS, start_at) for w in ws]
time.sleep(0.5)
pids = tree(os.getpid())
before = cpu(pids)
while time.time() < start_at:
    time.sleep(0.001)
steps = sum(ray.get(futs))
elapsed = time.time() - start_at
after = cpu(pids)
print("RESULT", steps, elapsed, sum(after[p] - before[p] for p in after if p in before), flush=True)
ray.shutdown()
""".replace("ELEMS_", str(ELEMS))


def run_ray(args: argparse.Namespace) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", RAY, str(args.seconds), str(args.workers)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"the Ray run failed: {out.stderr[-2000:]}")
    _, steps, elapsed, cpu = line.split()
    return {"steps": int(steps), "seconds": float(elapsed), "total": float(cpu) / int(steps) * 1e3}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(shm: bool, args: argparse.Namespace) -> dict[str, float]:
    from zps.testing import LocalCluster

    env = dict(os.environ)
    env.pop("ZPS_NO_SHM", None)
    if not shm:
        env["ZPS_NO_SHM"] = "1"
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the cluster's processes inherit it
    try:
        with LocalCluster(
            partitions=2, shards=2 * args.replication, replication=args.replication
        ) as c:
            wenv = {**c.env()}
            workers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        HARNESS.replace("PREPARE", SPARSE if args.sparse else DENSE),
                        c.address,
                        str(args.seconds),
                        "1" if args.pipelined else "0",
                        str(i),
                        "1" if args.copy else "0",
                        "0" if args.untuned else "1",
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=wenv,
                )
                for i in range(args.workers)
            ]
            try:
                for w in workers:
                    assert w.stdout is not None
                    line = w.stdout.readline()
                    if line.strip() != "READY":
                        raise RuntimeError(f"worker said {line!r}")
                procs = {p.name: p.pid for p in c.procs if p.alive()}
                c_names = set(procs)
                before = {n: cpu_seconds(pid) for n, pid in procs.items()}
                everyone = {**procs, **{f"worker{i}": w.pid for i, w in enumerate(workers)}}
                threads0 = {n: zb.thread_cpu(pid) for n, pid in everyone.items()}
                t0 = time.monotonic()
                for w in workers:
                    assert w.stdin is not None
                    w.stdin.write("GO\n")
                    w.stdin.flush()
                steps = 0
                worker_cpu: dict[str, float] = {}
                for i, w in enumerate(workers):
                    assert w.stdout is not None
                    _, count, used = w.stdout.readline().split()
                    steps += int(count)
                    worker_cpu[f"worker{i}"] = float(used)
                elapsed = time.monotonic() - t0
                after = {n: cpu_seconds(pid) for n, pid in procs.items() if n in c_names}
                # (a worker's threads: read once it reported, before it is told to exit)
                threads1 = {n: zb.thread_cpu(pid) for n, pid in everyone.items()}
            finally:
                for w in workers:
                    w.kill()
                    w.wait(10)
            out: dict[str, float] = {"steps": steps, "seconds": elapsed}
            for n in procs:
                out[n] = (after[n] - before[n]) / steps * 1e3
            for n, cpu in worker_cpu.items():
                out[n] = cpu / steps * 1e3
            out["total"] = sum(v for k, v in out.items() if k not in ("steps", "seconds"))
            if args.threads:
                for n in everyone:
                    for t, used in threads1[n].items():
                        delta = used - threads0[n].get(t, 0.0)
                        if delta > 0:
                            out[f"{n}/{t}"] = delta / steps * 1e3
            return out
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    from zps.testing import exit_on_sigterm

    exit_on_sigterm()  # a killed run stops its cluster too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--replication", type=int, default=1)
    ap.add_argument("--pipelined", action="store_true")
    ap.add_argument("--ray", action="store_true", help="also Ray's actor PS, in each pair")
    ap.add_argument("--sparse", action="store_true", help="the sparse step instead")
    ap.add_argument(
        "--copy", action="store_true", help="push from a plain array, not a gradient buffer"
    )
    ap.add_argument(
        "--threads",
        action="store_true",
        help="also CPU per step of each thread of every process (PROCESS/THREAD)",
    )
    ap.add_argument(
        "--untuned",
        action="store_true",
        help="workers leave glibc's allocator settings alone (client.tune_malloc = false)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    if args.sparse and args.ray:
        ap.error("--ray runs the dense step only")
    kinds = ("on",) if args.sparse else ("on", "off", "ray") if args.ray else ("on", "off")
    for i in range(args.pairs):
        for what in kinds:
            load = os.getloadavg()[0]
            r = run_ray(args) if what == "ray" else run(what == "on", args)
            r["load"] = load
            results.append({**r, "what": what})
            per = "  ".join(
                f"{k} {v:.2f}" for k, v in r.items() if k not in ("steps", "seconds", "load")
            )
            label = {"on": "zps shm on ", "off": "zps shm off", "ray": "Ray        "}[what]
            rate = r["steps"] / r["seconds"]
            moved = (
                f"{BATCH * rate / 1e6:.2f}M rows/s"
                if args.sparse
                else f"{2 * ELEMS * 4 * rate / 1e9:.2f} GB/s"
            )
            print(
                f"{'run' if args.sparse else 'pair'} {i} {'zps' if args.sparse else label}  "
                f"load {load:.1f}  {rate:.1f} steps/s  ({moved})  CPU ms per step: {per}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
