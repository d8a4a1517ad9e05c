#!/usr/bin/env python3
"""zps side by side with Ray's actor PS, a torch.distributed.rpc PS and L, in one run.

    python bench/peers.py [--quick] [--systems ray,torch,l,zps] [--zps seq,pipe,rep2]
                          [--only dense,sparse,latency,memory] [--rounds N] [--json PATH]

The same workloads go through every system, on loopback, one after the other:

* dense: one 16 MiB float32 tensor (plain SGD); a step pulls it and pushes a
  same-size gradient.  GB/s counts the pulled plus the pushed bytes.  Each system
  pulls into a buffer of its own and pushes a gradient already in memory: Ray's and
  torch's from a numpy array, zps's from the client's ``gradient_buffer`` (where a
  zps user's model writes its gradient; the shards read it there, no copy made to
  send it).
* sparse: a 1,000,000 x 32 float32 table (plain SGD); a step pulls 4,096 unique
  Zipf ids (precomputed) and pushes their gradients.  rows/s counts the 4,096
  rows of a step once.
* latency: p50 of a pull of one row (dim 8), one request in flight.
* memory (zps only): shard RSS growth for 1M rows of dim 32 with Adagrad
  state, against the raw bytes of rows plus state.

Two worker processes for dense and sparse, timing inside the workers.  The
peers: Ray (one actor holds the tables; the workers are actors calling it) and
torch.distributed.rpc (rank 0 holds the tables; ranks 1 and 2 call it).  L is
the raw brokered pyzmq path of bench/zps_bench.py (a Python ROUTER/ROUTER
broker forwarding frames zero-copy to two echo processes).  zps runs in three
configurations: 2 partitions x 1 copy with sequential pushes, 2 x 1 with
pipelined pushes (``wait=False``), and 2 x 2 (replication 2, acks="all") with
pipelined pushes.  The peers run their sparse step both ways too, and each zps
row is compared with the peer's row of the same kind (sequential/pipelined).
zps moves the dense chunks through same-host shared memory (zps/shm.py), as Ray
does through its object store; ``ZPS_NO_SHM=1`` in the environment sends them
inline over the sockets instead (every zps process started here inherits it).

The peers are not zps dependencies; install them with

    pip install -e '.[peers]'      # ray 2.60.0
    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

A peer that is not installed is skipped with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import zps_bench as zb  # noqa: E402

LR = 0.05
LAT_ROWS = 100_000
SYSTEMS = ("ray", "torch", "l", "zps")
WORKLOADS = ("dense", "sparse", "latency", "memory")
N_WORKERS = 2
INSTALL = {
    "ray": "pip install -e '.[peers]'  (or: pip install ray==2.60.0)",
    "torch": "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
}


@dataclass(frozen=True)
class ZpsConfig:
    key: str
    label: str
    replication: int
    pipelined: bool


ZPS_CONFIGS = (
    ZpsConfig("seq", "zps 2x1, sequential", 1, False),
    ZpsConfig("pipe", "zps 2x1, pipelined", 1, True),
    ZpsConfig("rep2", "zps 2x2 acks=all, pipelined", 2, True),
)


# ---------------------------------------------------------------------------
# the peers' worker loops (shared by Ray and torch): ``pull``/``push`` are the
# peer's calls; ``wait`` waits for an asynchronous push.


def ipc_cluster(**kwargs: Any) -> Any:
    """A LocalCluster whose broker binds an ipc:// socket: clients and shards reach
    it without TCP (replication between shards stays on TCP)."""
    from zps.testing import LocalCluster

    class IpcCluster(LocalCluster):
        @property
        def address(self) -> str:
            return f"ipc://{self.workdir}/broker.sock"

    return IpcCluster(**kwargs)


def sparse_pool(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [zb.zipf_ids(rng) for _ in range(n)]


def grads_for(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    return rng.standard_normal((zb.SPARSE_BATCH, zb.SPARSE_DIM), dtype=np.float32) * np.float32(
        1e-2
    )


# ---------------------------------------------------------------------------
# Ray: one actor holds the tables; two worker actors call it.


def ray_main(args: dict[str, Any]) -> None:
    """Runs in a child process: starts a local Ray, runs every workload, prints RESULT."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), str(HERE), os.environ.get("PYTHONPATH")])
    )
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=512 * 1024 * 1024,
        logging_level="ERROR",
    )
    try:
        _ray_run(ray, args)
    finally:
        ray.shutdown()


def _ray_run(ray: Any, args: dict[str, Any]) -> None:
    @ray.remote(num_cpus=0)
    class PS:
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.table = rng.uniform(-0.01, 0.01, (zb.SPARSE_ROWS, zb.SPARSE_DIM)).astype(
                np.float32
            )
            self.lat = rng.uniform(-0.01, 0.01, (LAT_ROWS, zb.LAT_DIM)).astype(np.float32)
            self.dense = np.zeros(zb.DENSE_ELEMS, np.float32)

        def pull(self, ids: np.ndarray) -> np.ndarray:
            return self.table[ids]

        def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
            self.table[ids] -= np.float32(LR) * grads  # ids are unique

        def pull_dense(self) -> np.ndarray:
            return self.dense

        def push_dense(self, grad: np.ndarray) -> None:
            self.dense -= np.float32(LR) * grad

        def pull_lat(self, ids: np.ndarray) -> np.ndarray:
            return self.lat[ids]

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, ps: Any, seed: int, pool: int) -> None:
            self.ps = ps
            self.pool = sparse_pool(seed, pool)
            self.grads = grads_for(seed)
            rng = np.random.default_rng(seed + 2)
            self.dense_grad = rng.standard_normal(zb.DENSE_ELEMS, dtype=np.float32) * np.float32(
                1e-3
            )
            self.values = np.empty(zb.DENSE_ELEMS, np.float32)  # the model's parameters
            self.lat_ids = [rng.integers(0, LAT_ROWS, 1, dtype=np.int64) for _ in range(1000)]
            self.pending: Any = None
            self.i = 0

        def _step(self, kind: str) -> None:
            ps = self.ps
            if kind == "dense":
                # ray.get gives a read-only view of the object store: the values
                # go into the worker's own buffer, as zps's pull_dense(out=) does.
                np.copyto(self.values, ray.get(ps.pull_dense.remote()))
                ray.get(ps.push_dense.remote(self.dense_grad))
            elif kind in ("sparse", "sparse_pipe"):
                ids = self.pool[self.i % len(self.pool)]
                self.i += 1
                ray.get(ps.pull.remote(ids))
                if kind == "sparse":
                    ray.get(ps.push.remote(ids, self.grads))
                else:
                    if self.pending is not None:
                        ray.get(self.pending)
                    self.pending = ps.push.remote(ids, self.grads)
            else:
                raise ValueError(kind)

        def warm(self, kind: str, steps: int) -> None:
            for _ in range(steps):
                self._step(kind)
            if self.pending is not None:
                ray.get(self.pending)
                self.pending = None

        def run(self, kind: str, duration: float, start_at: float) -> dict[str, Any]:
            while time.time() < start_at:
                time.sleep(0.001)
            if kind == "latency":
                samples = np.empty(int(duration), dtype=np.int64)
                for i in range(samples.size):
                    s = time.perf_counter_ns()
                    ray.get(self.ps.pull_lat.remote(self.lat_ids[i % len(self.lat_ids)]))
                    samples[i] = time.perf_counter_ns() - s
                return zb._latency_result(samples, 0.0, 0.0)
            t0 = time.perf_counter()
            end = t0 + duration
            steps = 0
            while time.perf_counter() < end:
                self._step(kind)
                steps += 1
            if self.pending is not None:
                ray.get(self.pending)
                self.pending = None
            return {"steps": steps, "elapsed": time.perf_counter() - t0}

    ps = PS.remote()
    workers = [Worker.remote(ps, 500 + i, args["pool"]) for i in range(N_WORKERS)]
    out: dict[str, Any] = {}
    for kind in args["kinds"]:
        if kind == "latency":
            w = workers[:1]
            ray.get(w[0].run.remote("latency", 300, 0.0))  # warm-up
            runs = ray.get([w[0].run.remote("latency", args["latency_samples"], 0.0)])
        else:
            ray.get([w.warm.remote(kind, 3 if kind == "dense" else args["pool"]) for w in workers])
            start_at = time.time() + 0.5
            runs = ray.get([w.run.remote(kind, args["duration"], start_at) for w in workers])
        out[kind] = runs
    zb._emit("RESULT", out)


# ---------------------------------------------------------------------------
# torch.distributed.rpc: rank 0 holds the tables; ranks 1 and 2 call it.
# Every rank runs this script as __main__, so the functions below resolve by
# name in all of them.

_T: dict[str, Any] = {}


def t_pull(ids: Any) -> Any:
    return _T["table"][ids]


def t_push(ids: Any, grads: Any) -> None:
    _T["table"].index_add_(0, ids, grads, alpha=-LR)


def t_pull_dense() -> Any:
    return _T["dense"]


def t_push_dense(grad: Any) -> None:
    _T["dense"].add_(grad, alpha=-LR)


def t_pull_lat(ids: Any) -> Any:
    return _T["lat"][ids]


def _torch_init(args: dict[str, Any], rank: int) -> Any:
    import torch
    from torch.distributed import rpc

    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=8,
        init_method=f"tcp://127.0.0.1:{args['port']}",
        rpc_timeout=120,
    )
    rpc.init_rpc(
        "ps" if rank == 0 else f"w{rank}",
        rank=rank,
        world_size=N_WORKERS + 1,
        rpc_backend_options=opts,
    )
    return rpc


def torch_ps(args: dict[str, Any]) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    _T["table"] = torch.rand(zb.SPARSE_ROWS, zb.SPARSE_DIM, generator=g) * 0.02 - 0.01
    _T["lat"] = torch.rand(LAT_ROWS, zb.LAT_DIM, generator=g) * 0.02 - 0.01
    _T["dense"] = torch.zeros(zb.DENSE_ELEMS)
    rpc = _torch_init(args, 0)
    zb._emit("READY")
    rpc.shutdown()  # waits for the workers to finish


def torch_worker(args: dict[str, Any]) -> None:
    import torch

    rank = args["rank"]
    seed = 500 + rank
    pool = [torch.from_numpy(ids) for ids in sparse_pool(seed, args["pool"])]
    grads = torch.from_numpy(grads_for(seed))
    rng = np.random.default_rng(seed + 2)
    dense_grad = torch.from_numpy(
        rng.standard_normal(zb.DENSE_ELEMS, dtype=np.float32) * np.float32(1e-3)
    )
    lat_ids = [torch.from_numpy(rng.integers(0, LAT_ROWS, 1, dtype=np.int64)) for _ in range(1000)]
    rpc = _torch_init(args, rank)
    state: dict[str, Any] = {"i": 0, "pending": None}

    def step(kind: str) -> None:
        if kind == "dense":
            rpc.rpc_sync("ps", t_pull_dense)
            rpc.rpc_sync("ps", t_push_dense, args=(dense_grad,))
            return
        ids = pool[state["i"] % len(pool)]
        state["i"] += 1
        rpc.rpc_sync("ps", t_pull, args=(ids,))
        if kind == "sparse":
            rpc.rpc_sync("ps", t_push, args=(ids, grads))
        else:
            if state["pending"] is not None:
                state["pending"].wait()
            state["pending"] = rpc.rpc_async("ps", t_push, args=(ids, grads))

    try:
        for kind in args["kinds"]:
            if kind == "latency":
                if rank != 1:  # one client in flight
                    zb._emit("READY")
                    zb._wait_go()
                    zb._emit("RESULT", {"skipped": True})
                    continue
                for i in range(300):
                    rpc.rpc_sync("ps", t_pull_lat, args=(lat_ids[i % len(lat_ids)],))
                zb._emit("READY")
                zb._wait_go()
                samples = np.empty(args["latency_samples"], dtype=np.int64)
                for i in range(samples.size):
                    s = time.perf_counter_ns()
                    rpc.rpc_sync("ps", t_pull_lat, args=(lat_ids[i % len(lat_ids)],))
                    samples[i] = time.perf_counter_ns() - s
                zb._emit("RESULT", zb._latency_result(samples, 0.0, 0.0))
                continue
            res = zb._timed_steps(
                lambda k=kind: step(k),
                args["duration"],
                warmup=3 if kind == "dense" else args["pool"],
            )
            if state["pending"] is not None:
                state["pending"].wait()
                state["pending"] = None
            res["elapsed"] = time.perf_counter() - res.pop("t0")
            zb._emit("RESULT", res)
    finally:
        rpc.shutdown()


def child_main(role: str, args: dict[str, Any]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if role == "ray":
        ray_main(args)
    elif role == "torch_ps":
        torch_ps(args)
    elif role == "torch_worker":
        torch_worker(args)
    else:
        raise SystemExit(f"unknown role {role}")


# ---------------------------------------------------------------------------
# the parent


@dataclass
class Row:
    system: str
    mode: str  # "seq" or "pipe": which peer row a zps row is compared with
    dense_gbs: float | None = None
    sparse_rows: float | None = None
    p50_us: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _rate(clients: list[dict[str, Any]], per_step: float) -> float:
    return float(sum(c["steps"] * per_step / c["elapsed"] for c in clients))


DENSE_STEP_BYTES = 2 * zb.DENSE_ELEMS * 4  # pulled + pushed


class Peers:
    def __init__(self, sizes: zb.Sizes, logdir: Path, only: set[str], ipc: bool = False) -> None:
        self.sizes = sizes
        self.ipc = ipc
        self.only = only
        self.logdir = logdir
        self.pool = 64 if sizes is zb.FULL else 16
        self.rows: list[Row] = []
        self.results: dict[str, Any] = {}
        self.bench = zb.Bench(sizes, logdir, None)  # L, zps clients, memory
        self.own = zb.Harness(sizes, logdir, script=str(Path(__file__).resolve()))

    def kinds(self) -> list[str]:
        out = []
        if "dense" in self.only:
            out.append("dense")
        if "sparse" in self.only:
            out += ["sparse", "sparse_pipe"]
        if "latency" in self.only:
            out.append("latency")
        return out

    def add_peer_rows(
        self, name: str, res: dict[str, Any], full: dict[str, Any] | None = None
    ) -> None:
        dense = _rate(res["dense"], DENSE_STEP_BYTES) / 1e9 if "dense" in res else None
        lat = res["latency"][0]["p50_us"] if "latency" in res else None
        for kind, mode in (("sparse", "seq"), ("sparse_pipe", "pipe")):
            rows = _rate(res[kind], zb.SPARSE_BATCH) if kind in res else None
            self.rows.append(Row(name, mode, dense, rows, lat))
        if "sparse" not in self.only:
            self.rows.append(Row(name, "seq", dense, None, lat))
        self.results[name] = full if full is not None else res

    def ray(self) -> None:
        if importlib.util.find_spec("ray") is None:
            print(f"  ray is not installed; skipping its rows ({INSTALL['ray']})", flush=True)
            return
        print("  Ray actor PS ...", flush=True)
        args = {
            "kinds": self.kinds(),
            "duration": self.sizes.duration,
            "pool": self.pool,
            "latency_samples": self.sizes.latency_samples,
        }
        child = self.own.spawn("ray", args)
        try:
            res = child.expect("RESULT", 900)
        finally:
            child.stop()
            self.own.children.remove(child)
        self.add_peer_rows("Ray actor PS", res)

    def torch(self) -> None:
        if importlib.util.find_spec("torch") is None:
            print(f"  torch is not installed; skipping its rows ({INSTALL['torch']})", flush=True)
            return
        from zps.testing import free_port

        print("  torch.distributed.rpc PS ...", flush=True)
        args = {
            "kinds": self.kinds(),
            "duration": self.sizes.duration,
            "pool": self.pool,
            "latency_samples": self.sizes.latency_samples,
            "port": free_port(),
        }
        ps = self.own.spawn("torch_ps", {**args, "rank": 0})
        workers = [self.own.spawn("torch_worker", {**args, "rank": r + 1}) for r in range(2)]
        res: dict[str, Any] = {}
        try:
            ps.expect("READY", 300)
            for kind in args["kinds"]:
                for w in workers:
                    w.expect("READY", 300)
                for w in workers:
                    w.go()
                got = [w.expect("RESULT", self.sizes.duration + 300) for w in workers]
                res[kind] = [g for g in got if not g.get("skipped")]
        finally:
            for c in (*workers, ps):
                c.stop()
                self.own.children.remove(c)
        self.add_peer_rows("torch RPC PS", res)

    def l_path(self) -> None:
        print("  L (raw brokered pyzmq) ...", flush=True)
        b, d = self.bench, self.sizes.duration
        b.start_l(ipc=self.ipc)
        res: dict[str, Any] = {}
        try:
            if "dense" in self.only:
                res["dense"] = b.run_l("dense", N_WORKERS, duration=d)
            if "sparse" in self.only:
                for kind, pipe in (("sparse", False), ("sparse_pipe", True)):
                    res[kind] = b.run_l("sparse", N_WORKERS, duration=d, pipelined=pipe)
            if "latency" in self.only:
                res["latency"] = b.run_l("latency", n=self.sizes.latency_samples)
        finally:
            b.h.stop_all()
        self.add_peer_rows(
            "L (raw brokered pyzmq)", {k: v["clients"] for k, v in res.items()}, full=res
        )

    def zps(self, configs: list[ZpsConfig]) -> None:
        from zps.testing import LocalCluster

        b, d = self.bench, self.sizes.duration
        for cfg in configs:
            print(f"  {cfg.label} ...", flush=True)
            cluster = (ipc_cluster if self.ipc else LocalCluster)(
                partitions=zb.N_PARTITIONS,
                shards=zb.N_PARTITIONS * cfg.replication,
                replication=cfg.replication,
                heartbeat_interval=0.2,
                log_level="warning",
            )
            cluster.start(timeout=60)
            servers = {p.name: p.pid for p in cluster.procs}
            res: dict[str, Any] = {}

            try:
                if "dense" in self.only:
                    res["dense"] = self._run_zps(cluster, servers, "dense", N_WORKERS, duration=d)
                if "sparse" in self.only:
                    res["sparse"] = self._run_zps(
                        cluster,
                        servers,
                        "sparse",
                        N_WORKERS,
                        duration=d,
                        pool=self.pool,
                        pipelined=cfg.pipelined,
                        optimizer="sgd",
                    )
                if "latency" in self.only:
                    res["latency"] = self._run_zps(
                        cluster, servers, "latency", 1, n=self.sizes.latency_samples
                    )
            finally:
                b.h.stop_all()
                cluster.stop()
            row = Row(cfg.label, "pipe" if cfg.pipelined else "seq")
            if "dense" in res:
                row.dense_gbs = _rate(res["dense"]["clients"], DENSE_STEP_BYTES) / 1e9
            if "sparse" in res:
                row.sparse_rows = _rate(res["sparse"]["clients"], zb.SPARSE_BATCH)
            if "latency" in res:
                row.p50_us = res["latency"]["clients"][0]["p50_us"]
            row.extra = {k: v.get("cpu_cores") for k, v in res.items()}
            self.rows.append(row)
            self.results[cfg.label] = res

    def _run_zps(
        self, cluster: Any, servers: dict[str, int], kind: str, n_clients: int, **extra: Any
    ) -> dict[str, Any]:
        args = [
            {"kind": kind, "address": cluster.address, "seed": 200 + i, **extra}
            for i in range(n_clients)
        ]
        return self.bench.h.run_clients("zps_client", args, servers, self.sizes.duration + 180)

    def memory(self) -> None:
        print("  zps shard memory ...", flush=True)
        with contextlib.redirect_stdout(io.StringIO()):
            self.bench.memory()
        self.results["memory"] = self.bench.results["memory"]


def _peer(rows: list[Row], prefix: str, mode: str) -> Row | None:
    cands = [r for r in rows if r.system.startswith(prefix)]
    for r in cands:
        if r.mode == mode:
            return r
    return cands[0] if cands else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _pair(r: Row, p: Row | None) -> str:
    """``r``'s dense and sparse ratios to peer row ``p``."""
    if p is None or p is r:
        return f"{'':>12}"
    return f"{_ratio(r.dense_gbs, p.dense_gbs):>6}{_ratio(r.sparse_rows, p.sparse_rows):>7}"


def best_of(rounds: list[list[Row]]) -> list[Row]:
    """One row per (system, mode): the highest rates and the lowest p50 over the rounds
    (the rounds ran one after the other, so each system's best ran at the lightest load)."""
    out: dict[tuple[str, str], Row] = {}
    for rows in rounds:
        for r in rows:
            key = (r.system, r.mode)
            b = out.get(key)
            if b is None:
                out[key] = Row(r.system, r.mode, r.dense_gbs, r.sparse_rows, r.p50_us, r.note)
                continue
            b.dense_gbs = _best(b.dense_gbs, r.dense_gbs, max)
            b.sparse_rows = _best(b.sparse_rows, r.sparse_rows, max)
            b.p50_us = _best(b.p50_us, r.p50_us, min)
    return list(out.values())


def _best(a: float | None, b: float | None, pick: Any) -> float | None:
    return b if a is None else a if b is None else float(pick(a, b))


def table(rows: list[Row]) -> list[str]:
    out = [
        f"  {'system':<30} {'sparse':<5} {'dense':>6} {'sparse':>7} {'p50':>6}"
        f"  {'vs Ray':>12}  {'vs torch':>12}  {'vs L':>18}",
        f"  {'':<30} {'push':<5} {'GB/s':>6} {'Mrows/s':>7} {'us':>6}"
        f"  {'dense sparse':>12}  {'dense sparse':>12}  {'dense sparse p50':>18}",
        "  " + "-" * 108,
    ]
    for r in rows:
        ray = _peer(rows, "Ray", r.mode)
        tor = _peer(rows, "torch", r.mode)
        lim = _peer(rows, "L ", r.mode)

        p50 = (
            f"{_ratio(r.p50_us, lim.p50_us):>6}" if lim is not None and lim is not r else f"{'':>6}"
        )
        dense = f"{r.dense_gbs:.2f}" if r.dense_gbs is not None else "-"
        sparse = f"{r.sparse_rows / 1e6:.2f}" if r.sparse_rows is not None else "-"
        lat = f"{r.p50_us:.0f}" if r.p50_us is not None else "-"
        out.append(
            f"  {r.system:<30} {r.mode:<5} {dense:>6} {sparse:>7} {lat:>6}"
            f"  {_pair(r, ray)}  {_pair(r, tor)}  {_pair(r, lim)}{p50}"
        )
    return out


def targets(rows: list[Row], mem: dict[str, Any] | None) -> list[str]:
    """The goals, each as met/MISSED with the ratio it was judged on."""
    out: list[str] = []

    def line(ok: bool, goal: str, value: float) -> None:
        out.append(f"  {'met' if ok else 'MISSED':<7} {goal:<58} {value:.2f}x")

    for r in rows:
        if not r.system.startswith("zps"):
            continue
        ray = _peer(rows, "Ray", r.mode)
        lim = _peer(rows, "L ", r.mode)
        two = "2x2" in r.system
        if ray is not None and r.sparse_rows is not None and ray.sparse_rows:
            need = 1.5 if two else 3.0
            v = r.sparse_rows / ray.sparse_rows
            line(v >= need, f"{r.system}: sparse >= {need:g}x Ray", v)
        if ray is not None and r.dense_gbs is not None and ray.dense_gbs:
            v = r.dense_gbs / ray.dense_gbs
            line(v >= 1.2, f"{r.system}: dense >= 1.2x Ray", v)
        if lim is not None and r.p50_us is not None and lim.p50_us:
            v = r.p50_us / lim.p50_us
            line(v <= 2.0, f"{r.system}: pull of one row p50 <= 2x L", v)
    if mem:
        v = mem["rss_per_million_rows"] / mem["raw_per_million_rows"]
        line(v <= 1.5, "shard memory <= 1.5x raw rows + optimizer state", v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (smoke check, ~2 minutes)")
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        metavar="LIST",
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)",
    )
    ap.add_argument(
        "--zps",
        default=",".join(c.key for c in ZPS_CONFIGS),
        metavar="LIST",
        help="zps configurations: seq (2x1 sequential), pipe (2x1 pipelined), "
        "rep2 (2x2 acks=all pipelined); default: all",
    )
    ap.add_argument(
        "--only",
        default=",".join(WORKLOADS),
        metavar="LIST",
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)",
    )
    ap.add_argument(
        "--ipc",
        action="store_true",
        help="L and zps over ipc:// sockets instead of TCP loopback (zps replication stays TCP)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="run every system N times in turn and report each one's best (a shared machine)",
    )
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON here")
    ap.add_argument("--child", nargs=2, metavar=("ROLE", "ARGS"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        child_main(ns.child[0], json.loads(ns.child[1]))
        return 0

    def subset(value: str, allowed: tuple[str, ...], flag: str) -> set[str]:
        got = {w.strip() for w in value.split(",") if w.strip()}
        if not got <= set(allowed):
            ap.error(f"{flag} takes a subset of {','.join(allowed)}, got {value!r}")
        return got

    systems = subset(ns.systems, SYSTEMS, "--systems")
    zkeys = subset(ns.zps, tuple(c.key for c in ZPS_CONFIGS), "--zps")
    only = subset(ns.only, WORKLOADS, "--only")
    if ns.rounds < 1:
        ap.error("--rounds takes a positive integer")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = zb.QUICK if ns.quick else zb.FULL
    info = zb.machine()
    started = time.time()
    print(
        f"zps against its peers ({'quick' if ns.quick else 'full'}, {sizes.duration:g} s a run, "
        f"L and zps over {'ipc://' if ns.ipc else 'TCP loopback'})"
    )
    print(
        f"  machine: {info['nproc']} cpus ({info['affinity']} usable), {info['cpu']}, "
        f"Linux {info['kernel']}, python {info['python']}"
    )
    print(f"  zps from {info['zps_source']}")
    versions = {}
    for mod in ("ray", "torch"):
        if mod in systems and importlib.util.find_spec(mod) is not None:
            versions[mod] = __import__(mod).__version__
    if versions:
        print("  " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    rounds: list[list[Row]] = []
    with tempfile.TemporaryDirectory(prefix="zps-peers-") as tmp:
        for rnd in range(ns.rounds):
            if ns.rounds > 1:
                print(f"  round {rnd + 1} of {ns.rounds}", flush=True)
            p = Peers(sizes, Path(tmp), only, ipc=ns.ipc)
            try:
                if only - {"memory"}:
                    if "ray" in systems:
                        p.ray()
                    if "torch" in systems:
                        p.torch()
                    if "l" in systems:
                        p.l_path()
                    if "zps" in systems:
                        p.zps([c for c in ZPS_CONFIGS if c.key in zkeys])
                if "zps" in systems and "memory" in only and rnd == ns.rounds - 1:
                    p.memory()
            finally:
                p.own.stop_all()
                p.bench.h.stop_all()
            rounds.append(p.rows)
            if ns.rounds > 1:
                for line in table(p.rows):
                    print(line)
    rows = best_of(rounds)
    print()
    if ns.rounds > 1:
        print(f"  best of {ns.rounds} rounds (highest rates, lowest p50, per system):")
    for line in table(rows):
        print(line)
    print(
        "\n  dense: pull + push bytes per second; sparse: rows per second, each row of a step"
        " counted once;\n  p50: pull of one row (dim 8), one request in flight.  Ratios: zps"
        " rows against the peer's row\n  with the same push mode (seq: the push is acknowledged"
        " before the next pull; pipe: it is not)."
    )
    mem = p.results.get("memory")
    if mem:
        rss = mem["rss_per_million_rows"] / 1e6
        print(
            f"\n  zps shard memory, 1M rows dim 32 Adagrad: RSS {rss:.0f}"
            f" MB, raw rows+state {mem['raw_per_million_rows'] / 1e6:.0f} MB,"
            f" {mem['rss_per_million_rows'] / mem['raw_per_million_rows']:.2f}x"
        )
    goals = targets(rows, mem)
    if goals:
        print("\n  targets")
        for line in goals:
            print(line)
    print(f"\n  total {time.time() - started:.0f}s")
    if ns.json:
        doc = {
            "machine": info,
            "versions": versions,
            "mode": "quick" if ns.quick else "full",
            "transport": "ipc" if ns.ipc else "tcp",
            "rows": [vars(r) for r in rows],
            "rounds": [[vars(r) for r in rr] for rr in rounds],
            "results": p.results,
        }
        Path(ns.json).write_text(json.dumps(doc, indent=2, default=zb._json_default) + "\n")
        print(f"  wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
