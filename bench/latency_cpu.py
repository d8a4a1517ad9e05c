#!/usr/bin/env python3
"""Where a one-row pull's time goes: CPU per request of every process and thread.

    python bench/latency_cpu.py [--seconds 5] [--rounds 2]

Starts a local cluster (2 partitions x 1 copy) and pulls one row (dim 8) in a
loop from this process (uvloop, one request in flight), as ``bench/peers.py
--only latency`` does; meanwhile it reads the CPU time (user + system,
``/proc/PID/task/TID/stat``) of each thread of the client, the broker and the
shards (one holds the row), and prints it per request with the p50.  For scale, the same is
measured for raw pyzmq: a DEALER in this process and a ROUTER echoing in a child
process, blocking calls, one small message in flight (one hop each way, no
broker): what one hop's sending and receiving costs a Python thread with zmq
alone.  A zps pull crosses four hops (client -> broker -> shard -> broker ->
client) and three Python processes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import zmq  # noqa: E402
import zps_bench as zb  # noqa: E402  (this folder: the shared helpers)

from zps.client.client import connect  # noqa: E402
from zps.optim import SGD  # noqa: E402
from zps.testing import LocalCluster, free_port  # noqa: E402


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s zmq I/O threads, and of the rest ("python")."""
    out: dict[str, float] = {}
    for name, used in zb.thread_cpu(pid).items():
        kind = "zmq I/O" if name.startswith("ZMQbg/IO") else "python"
        out[kind] = out.get(kind, 0.0) + used
    return out


def per_request(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {k: (after[k] - before.get(k, 0.0)) / n * 1e6 for k in after}


async def zps_round(seconds: float) -> tuple[float, dict[str, dict[str, float]], int]:
    with LocalCluster(partitions=2, shards=2) as c:
        async with connect(c.address) as ps:
            await ps.create_embedding("t", dim=8, optimizer=SGD(lr=0.1))
            ids = np.array([5], np.int64)
            for _ in range(500):
                await ps.pull_rows("t", ids)
            pids = {"client": os.getpid(), "broker": c.broker().pid}
            for s in sorted(c.status()["shards"], key=lambda s: s["partition"]):
                pids[f"shard{s['partition']}"] = s["pid"]  # one holds the row, one idles
            before = {k: thread_cpu(p) for k, p in pids.items()}
            lat = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t = time.perf_counter()
                await ps.pull_rows("t", ids)
                lat.append(time.perf_counter() - t)
            after = {k: thread_cpu(p) for k, p in pids.items()}
    n = len(lat)
    lat.sort()
    return lat[n // 2] * 1e6, {k: per_request(before[k], after[k], n) for k in pids}, n


def _echo(port: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(f"tcp://127.0.0.1:{port}")
    while True:
        s.send_multipart(s.recv_multipart(copy=False), copy=False)


def raw_round(seconds: float) -> tuple[float, dict[str, dict[str, float]], int]:
    port = free_port()
    child = mp.get_context("spawn").Process(target=_echo, args=(port,), daemon=True)
    child.start()
    assert child.pid is not None
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(f"tcp://127.0.0.1:{port}")
    msg = [b"h" * 40, b"x" * 64]
    try:
        for _ in range(2000):
            d.send_multipart(msg)
            d.recv_multipart()
        pids = {"sender": os.getpid(), "echo": child.pid}
        before = {k: thread_cpu(p) for k, p in pids.items()}
        lat = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            d.send_multipart(msg)
            d.recv_multipart()
            lat.append(time.perf_counter() - t)
        after = {k: thread_cpu(p) for k, p in pids.items()}
    finally:
        d.close(0)
        ctx.term()
        child.kill()
        child.join(5)
    n = len(lat)
    lat.sort()
    return lat[n // 2] * 1e6, {k: per_request(before[k], after[k], n) for k in pids}, n


def _row(name: str, p50: float, cpu: dict[str, dict[str, float]], n: int) -> None:
    parts = "  ".join(
        f"{k} {v.get('python', 0):.0f} / {v.get('zmq I/O', 0):.0f}" for k, v in cpu.items()
    )
    total = sum(sum(v.values()) for v in cpu.values())
    print(f"{name:<22}{n:>9}{p50:>8.0f}   {parts}  all {total:.0f}")


def main() -> None:
    from zps.testing import exit_on_sigterm

    exit_on_sigterm()  # a killed run stops its cluster too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ns = ap.parse_args()
    try:
        import uvloop

        runner: Any = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    print(f"load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} cpus")
    print(f"{'run':<22}{'requests':>9}{'p50 us':>8}   CPU us per request (python / zmq I/O thread)")
    with runner:
        for r in range(ns.rounds):
            _row(f"zps one-row pull {r + 1}", *runner.run(zps_round(ns.seconds)))
            _row(f"raw pyzmq echo {r + 1}", *raw_round(ns.seconds))
    print(
        "\nA zps pull is four hops through three Python processes (the broker forwards two"
        "\nmessages); the raw echo is one hop each way between two.  The python column of"
        "\nthe echo is what a thread spends to send and receive one message with zmq alone."
    )


if __name__ == "__main__":
    main()
