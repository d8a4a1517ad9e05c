#!/usr/bin/env python3
"""zps benchmark: zps against L, the raw pyzmq limit, in one run on loopback.

    python bench/zps_bench.py [--quick] [--json PATH] [--profile DIR]

Every workload runs twice, back to back: once through zps (``LocalCluster``:
one broker and two shards as processes) and once through L, a raw pyzmq
ROUTER/ROUTER broker process forwarding frames zero-copy to two DEALER echo
processes, with the same message sizes and pattern.  Clients are separate
processes too.  See bench/README.md for what each workload does.

Not part of the test suite.  Every process it starts is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

MiB = 1 << 20
DENSE_ELEMS = 4 * MiB  # 16 MiB of float32
SPARSE_ROWS = 1_000_000
SPARSE_DIM = 32
SPARSE_BATCH = 4096
ZIPF_A = 1.2
SMALL_DIM = 8
SMALL_ROWS = 100_000
SMALL_CHUNK = 1000
LAT_DIM = 8
N_PARTITIONS = 2
WORKLOADS = ("dense", "sparse", "small", "latency", "memory")

# L's header frame: partition, number of reply frames, bytes per reply frame.
L_HDR = struct.Struct("<III")
L_NOT_READY = b"not-ready"
# zps cuts the 16 MiB tensor into 2 MiB chunks, 4 per partition; a pull is one
# request per partition answered with 4 chunk frames, a push is 2 messages of
# 2 chunks per partition (the client's 4 MiB batch limit).  L mirrors that.
DENSE_CHUNK_BYTES = 2 * MiB
DENSE_CHUNKS_PER_PART = 4
DENSE_PUSH_CHUNKS_PER_MSG = 2


@dataclass(frozen=True)
class Sizes:
    duration: float  # seconds per throughput measurement
    small_ops: int
    small_budget: float  # seconds; an unbatched run stops early past this
    raw_one_in_flight: int
    latency_samples: int
    memory_rows: int
    profile_duration: float


FULL = Sizes(6.0, 100_000, 40.0, 20_000, 3000, 1_000_000, 8.0)
QUICK = Sizes(1.5, 10_000, 10.0, 3000, 300, 200_000, 3.0)


# ---------------------------------------------------------------------------
# small helpers


def machine() -> dict[str, Any]:
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import zps

    try:
        import uvloop

        uv = uvloop.__version__
    except ImportError:
        uv = None
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "uvloop": uv,
        "zps": zps.__version__,
        "zps_source": zps_source(),
    }


def zps_source() -> str:
    """Where the measured zps comes from: its directory, git commit, and whether it is modified."""
    where = str(Path(__import__("zps").__file__).resolve().parent)
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "zps"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return where
    if not commit:
        return where
    return f"{where} @ {commit}{' + uncommitted changes' if dirty else ''}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), in seconds."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = data.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """User + system CPU seconds of each thread of ``pid``, summed by thread name
    (``python`` for a main thread, ``ZMQbg/IO/0`` for zmq's I/O thread, ...; a client
    context's threads are named ``N/ZMQbg/...``, see zps.transport.IoThreads: counted
    without the ``N/``)."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        prefix, _, rest = name.partition("/")
        if prefix.isdigit() and rest.startswith("ZMQbg"):
            name = rest
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf(
            "SC_CLK_TCK"
        )
    return out


def proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def zipf_ids(rng: np.random.Generator, n: int = SPARSE_BATCH) -> np.ndarray:
    """``n`` unique ids: Zipf(a=1.2) draws mod 1e6, first occurrences, topped up to ``n``."""
    draws = np.empty(0, dtype=np.int64)
    while True:
        draws = np.concatenate([draws, rng.zipf(ZIPF_A, 4 * n).astype(np.int64) % SPARSE_ROWS])
        uniq, first = np.unique(draws, return_index=True)
        if uniq.size >= n:
            return uniq[np.argsort(first)][:n].copy()


def _uvloop_runner() -> asyncio.Runner:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


# ---------------------------------------------------------------------------
# child processes: a tiny line protocol on stdin/stdout
#
# The parent starts ``zps_bench.py --child ROLE JSON``.  Clients set up, print
# ``READY``, wait for ``GO`` on stdin, run, and print ``RESULT {json}``.
# Servers (L's broker and echoes) print ``READY`` and run until terminated or
# until their parent is gone.


def _emit(tag: str, payload: Any = None) -> None:
    sys.stdout.write(tag + ("" if payload is None else " " + json.dumps(payload)) + "\n")
    sys.stdout.flush()


def _wait_go() -> None:
    if sys.stdin.readline().strip() != "GO":
        raise SystemExit(0)  # the parent went away


def _socket_opts(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)


def l_broker(args: dict[str, Any]) -> None:
    """ROUTER (clients) / ROUTER (echoes), forwarding frames zero-copy; reads only the header."""
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for s in (front, back):
        _socket_opts(s)
    back.setsockopt(zmq.ROUTER_MANDATORY, 1)
    front.bind(args["front"])
    back.bind(args["back"])
    echoes = [f"e-{p}".encode() for p in range(args["partitions"])]
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    parent = os.getppid()
    _emit("READY")
    while True:
        events = dict(poller.poll(1000))
        if not events and os.getppid() != parent:
            return
        if front in events:
            for _ in range(256):
                try:
                    frames = front.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                part = L_HDR.unpack_from(frames[1].buffer)[0]
                try:
                    back.send_multipart([echoes[part], *frames], copy=False)
                except (zmq.ZMQError, IndexError):
                    front.send_multipart([frames[0], L_NOT_READY])
        if back in events:
            for _ in range(256):
                try:
                    frames = back.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                front.send_multipart(frames[1:], copy=False)


def l_echo(args: dict[str, Any]) -> None:
    """DEALER answering each request with the requested number and size of frames."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    _socket_opts(sock)
    sock.setsockopt(zmq.IDENTITY, f"e-{args['partition']}".encode())
    sock.connect(args["back"])
    reply = memoryview(np.random.default_rng(1).random(args["max_frame"] // 4 + 1).data).cast("B")
    parent = os.getppid()
    _emit("READY")
    while True:
        if not sock.poll(1000):
            if os.getppid() != parent:
                return
            continue
        frames = sock.recv_multipart(copy=False)  # [client, header, payload...]
        _, n, size = L_HDR.unpack_from(frames[1].buffer)
        out = reply[:size]
        sock.send_multipart([frames[0], frames[1], *([out] * n)], copy=False)


class LConn:
    """A raw DEALER client of L."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        _socket_opts(self.sock)
        self.sock.connect(address)
        deadline = time.monotonic() + 30
        for p in range(N_PARTITIONS):  # wait until both echoes are routable
            while True:
                self.send(p, 0, 0)
                if self.sock.poll(1000) and self.recv()[0].bytes != L_NOT_READY:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("L's echoes never became reachable")
                time.sleep(0.05)

    def send(self, part: int, n: int, size: int, *payload: Any) -> None:
        self.sock.send_multipart([L_HDR.pack(part, n, size), *payload], copy=False)

    def recv(self) -> list[Any]:
        return self.sock.recv_multipart(copy=False)


def l_client(args: dict[str, Any]) -> None:
    kind = args["kind"]
    conn = LConn(args["address"])
    rng = np.random.default_rng(args.get("seed", 0))
    result: dict[str, Any] = {}

    if kind == "dense":
        per_part = DENSE_CHUNK_BYTES * DENSE_CHUNKS_PER_PART
        grad = rng.random(per_part // 4, dtype=np.float32)
        chunks = [
            memoryview(grad[i * DENSE_CHUNK_BYTES // 4 : (i + 1) * DENSE_CHUNK_BYTES // 4])
            for i in range(DENSE_CHUNKS_PER_PART)
        ]
        k = DENSE_PUSH_CHUNKS_PER_MSG

        def step() -> None:
            for p in range(N_PARTITIONS):  # pull: one request per partition
                conn.send(p, DENSE_CHUNKS_PER_PART, DENSE_CHUNK_BYTES)
            for _ in range(N_PARTITIONS):
                conn.recv()
            for p in range(N_PARTITIONS):  # push: 4 MiB messages
                for i in range(0, DENSE_CHUNKS_PER_PART, k):
                    conn.send(p, 0, 0, *chunks[i : i + k])
            for _ in range(N_PARTITIONS * DENSE_CHUNKS_PER_PART // k):
                conn.recv()

        unit_bytes = 2 * N_PARTITIONS * per_part
        result = _timed_steps(step, args["duration"], warmup=2)
        result.pop("t0")
        result["bytes"] = result["steps"] * unit_bytes
    elif kind == "sparse":
        half = SPARSE_BATCH // N_PARTITIONS
        ids = rng.integers(0, SPARSE_ROWS, half, dtype=np.int64)
        grads = rng.random((half, SPARSE_DIM), dtype=np.float32)
        row_bytes = SPARSE_DIM * 4

        pipelined = bool(args.get("pipelined"))
        pushes_out = 0  # pipelined: push replies not yet read

        def step() -> None:
            nonlocal pushes_out
            for p in range(N_PARTITIONS):
                conn.send(p, 1, half * row_bytes, ids)
            pulled = 0
            while pulled < N_PARTITIONS:  # push replies of the last step may come first
                if L_HDR.unpack_from(conn.recv()[0].buffer)[1]:
                    pulled += 1
                else:
                    pushes_out -= 1
            for p in range(N_PARTITIONS):
                conn.send(p, 0, 0, ids, grads)
            pushes_out += N_PARTITIONS
            while pushes_out > (N_PARTITIONS if pipelined else 0):
                conn.recv()
                pushes_out -= 1

        result = _timed_steps(step, args["duration"], warmup=3)
        while pushes_out:  # the last pushes count only once acknowledged
            conn.recv()
            pushes_out -= 1
        result["elapsed"] = time.perf_counter() - result.pop("t0")
        result["rows"] = result["steps"] * 2 * SPARSE_BATCH
    elif kind == "small":
        payload = rng.random(SMALL_DIM + 2, dtype=np.float32).tobytes()[: 8 + 4 * SMALL_DIM]
        n, window = args["n"], args["window"]
        for i in range(200):  # warm-up
            conn.send(i % N_PARTITIONS, 0, 0, payload)
            conn.recv()
        _emit("READY")
        _wait_go()
        cpu0, t0 = time.process_time(), time.perf_counter()
        sent = done = 0
        while sent < min(window, n):
            conn.send(sent % N_PARTITIONS, 0, 0, payload)
            sent += 1
        while done < n:
            conn.recv()
            done += 1
            if sent < n:
                conn.send(sent % N_PARTITIONS, 0, 0, payload)
                sent += 1
        elapsed = time.perf_counter() - t0
        result = {"ops": n, "elapsed": elapsed, "cpu": time.process_time() - cpu0}
    elif kind == "latency":
        req = rng.integers(0, SMALL_ROWS, 1, dtype=np.int64).tobytes()
        samples = np.empty(args["n"], dtype=np.int64)
        for i in range(300):
            conn.send(i % N_PARTITIONS, 1, 4 * LAT_DIM, req)
            conn.recv()
        _emit("READY")
        _wait_go()
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(samples.size):
            s = time.perf_counter_ns()
            conn.send(i % N_PARTITIONS, 1, 4 * LAT_DIM, req)
            conn.recv()
            samples[i] = time.perf_counter_ns() - s
        result = _latency_result(samples, time.perf_counter() - t0, time.process_time() - cpu0)
    else:
        raise ValueError(kind)
    _emit("RESULT", result)


def _timed_steps(step: Any, duration: float, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        step()
    _emit("READY")
    _wait_go()
    cpu0, t0 = time.process_time(), time.perf_counter()
    end = t0 + duration
    steps = 0
    while time.perf_counter() < end:
        step()
        steps += 1
    return {
        "steps": steps,
        "elapsed": time.perf_counter() - t0,
        "t0": t0,
        "cpu": time.process_time() - cpu0,
    }


def _latency_result(samples: np.ndarray, elapsed: float, cpu: float) -> dict[str, Any]:
    us = samples / 1e3
    return {
        "n": int(us.size),
        "p50_us": percentile(us, 50),
        "p99_us": percentile(us, 99),
        "mean_us": float(us.mean()),
        "elapsed": elapsed,
        "cpu": cpu,
    }


async def _atimed_steps(step: Any, duration: float, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        await step()
    await _aready()
    cpu0, t0 = time.process_time(), time.perf_counter()
    end = t0 + duration
    steps = 0
    while time.perf_counter() < end:
        await step()
        steps += 1
    return {
        "steps": steps,
        "elapsed": time.perf_counter() - t0,
        "t0": t0,
        "cpu": time.process_time() - cpu0,
    }


async def _aready() -> None:
    # Wait for GO without blocking the loop, so the client keeps heartbeating.
    _emit("READY")
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if line.strip() != "GO":
        raise SystemExit(0)


async def zps_client(args: dict[str, Any]) -> None:
    import zps
    from zps.ops.config import ClientConfig

    kind = args["kind"]
    rng = np.random.default_rng(args.get("seed", 0))
    config = ClientConfig(batch_max_ops=args.get("batch_max_ops", ClientConfig.batch_max_ops))
    async with zps.connect(args["address"], config) as ps:
        if kind == "dense":
            name = "bench_dense"
            await ps.create_dense(
                name,
                shape=(DENSE_ELEMS,),
                dtype="float32",
                init=zps.init.Zeros(),
                optimizer=zps.optim.SGD(lr=0.01),
            )
            grad = rng.standard_normal(DENSE_ELEMS, dtype=np.float32) * np.float32(1e-3)
            # The gradient lives where a model's would: in the client's gradient buffer
            # (on one host the shards read it from there, with no copy to send it).
            buf = await ps.gradient_buffer(name)
            buf[:] = grad
            grad = buf

            values = np.empty(DENSE_ELEMS, dtype=np.float32)

            async def dense_step() -> None:
                await ps.pull_dense(name, out=values)  # as into a model's parameter buffer
                await ps.push_dense(name, grad)

            result = await _atimed_steps(dense_step, args["duration"], warmup=2)
            result.pop("t0")
            result["bytes"] = result["steps"] * 2 * DENSE_ELEMS * 4
        elif kind == "sparse":
            name = "bench_sparse"
            optimizer: zps.optim.Optimizer = (
                zps.optim.SGD(lr=0.05)
                if args.get("optimizer") == "sgd"
                else zps.optim.Adagrad(lr=0.05)
            )
            await ps.create_embedding(
                name,
                dim=SPARSE_DIM,
                init=zps.init.Uniform(-0.01, 0.01),
                optimizer=optimizer,
            )
            pool = [zipf_ids(rng) for _ in range(args.get("pool", 64))]
            grads = rng.standard_normal((SPARSE_BATCH, SPARSE_DIM), dtype=np.float32) * np.float32(
                1e-2
            )
            it = iter(range(1 << 62))

            wait = not args.get("pipelined")

            async def sparse_step() -> None:
                ids = pool[next(it) % len(pool)]
                await ps.pull_rows(name, ids)
                # Pipelined (async training): the push is acknowledged in the
                # background while the next step pulls.
                await ps.push_rows(name, ids, grads, wait=wait)

            result = await _atimed_steps(sparse_step, args["duration"], warmup=len(pool))
            await ps.flush()  # the last pushes count only once acknowledged
            result["elapsed"] = time.perf_counter() - result.pop("t0")
            result["rows"] = result["steps"] * 2 * SPARSE_BATCH
        elif kind == "small":
            name = "bench_small"
            await ps.create_embedding(
                name, dim=SMALL_DIM, optimizer=zps.optim.SGD(lr=0.01), init=zps.init.Zeros()
            )
            for start in range(0, SMALL_ROWS, 50_000):  # create the rows up front
                ids0 = np.arange(start, min(start + 50_000, SMALL_ROWS))
                await ps.push_rows(name, ids0, np.zeros((ids0.size, SMALL_DIM), np.float32))
            n = args["n"]
            ids = rng.integers(0, SMALL_ROWS, n, dtype=np.int64)
            grads = rng.standard_normal((n, SMALL_DIM), dtype=np.float32) * np.float32(1e-3)

            async def chunk(a: int, b: int) -> None:
                await asyncio.gather(
                    *(ps.push_rows(name, ids[i : i + 1], grads[i : i + 1]) for i in range(a, b))
                )

            await chunk(0, min(SMALL_CHUNK, n))  # warm-up
            req0 = ps.stats.requests
            await _aready()
            cpu0, t0 = time.process_time(), time.perf_counter()
            done = 0
            while done < n and time.perf_counter() - t0 < args["budget"]:
                b = min(done + SMALL_CHUNK, n)
                await chunk(done, b)
                done = b
            elapsed = time.perf_counter() - t0
            result = {
                "ops": done,
                "elapsed": elapsed,
                "cpu": time.process_time() - cpu0,
                "messages": ps.stats.requests - req0,
                "complete": done == n,
            }
        elif kind == "latency":
            name = "bench_latency"
            await ps.create_embedding(name, dim=LAT_DIM, optimizer=zps.optim.SGD(lr=0.01))
            pool = rng.integers(0, SMALL_ROWS, 1000, dtype=np.int64)
            await ps.pull_rows(name, pool)
            one = [pool[i : i + 1] for i in range(pool.size)]
            for i in range(300):
                await ps.pull_rows(name, one[i % len(one)])
            await _aready()
            samples = np.empty(args["n"], dtype=np.int64)
            cpu0, t0 = time.process_time(), time.perf_counter()
            for i in range(samples.size):
                s = time.perf_counter_ns()
                await ps.pull_rows(name, one[i % len(one)])
                samples[i] = time.perf_counter_ns() - s
            result = _latency_result(samples, time.perf_counter() - t0, time.process_time() - cpu0)
        else:
            raise ValueError(kind)
    _emit("RESULT", result)


def child_main(role: str, args: dict[str, Any]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Every benchmark process, L's and zps's clients alike, gets the allocator
    # settings the zps-server and zps-worker processes use (zps/malloc.py).
    from zps.ops import malloc

    malloc.tune()
    if role == "l_broker":
        l_broker(args)
    elif role == "l_echo":
        l_echo(args)
    elif role == "l_client":
        l_client(args)
    elif role == "zps_client":
        with _uvloop_runner() as runner:
            runner.run(zps_client(args))
    else:
        raise SystemExit(f"unknown role {role}")


# ---------------------------------------------------------------------------
# the parent: process management


class Child:
    """A child process of this script, spoken to by lines."""

    def __init__(
        self, role: str, args: dict[str, Any], logdir: Path, tag: str, script: str = __file__
    ) -> None:
        self.role, self.tag = role, tag
        self.log_path = logdir / f"{tag}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, script, "--child", role, json.dumps(args)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def line(self, timeout: float) -> str:
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.tag}: no answer within {timeout:g}s\n{self.log_tail()}")
            ready, _, _ = select.select([self.popen.stdout], [], [], left)
            if ready:
                chunk = os.read(self.popen.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"{self.tag} exited early:\n{self.log_tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def expect(self, tag: str, timeout: float) -> Any:
        while True:
            line = self.line(timeout)
            if line.split(" ", 1)[0] == tag:
                rest = line[len(tag) :].strip()
                return json.loads(rest) if rest else None

    def go(self) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(b"GO\n")
        self.popen.stdin.flush()

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-3000:]
        return ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        for f in (self.popen.stdin, self.popen.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


@dataclass
class Harness:
    sizes: Sizes
    logdir: Path
    children: list[Child] = field(default_factory=list)
    counter: collections.Counter[str] = field(default_factory=collections.Counter)
    #: The script the children run (``--child ROLE ARGS``); another benchmark
    #: importing this one passes its own.
    script: str = __file__

    def spawn(self, role: str, args: dict[str, Any]) -> Child:
        self.counter[role] += 1
        child = Child(role, args, self.logdir, f"{role}{self.counter[role]}", self.script)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        for c in reversed(self.children):
            c.stop()
        self.children.clear()

    def run_clients(
        self, role: str, arglist: list[dict[str, Any]], servers: dict[str, int], max_run: float
    ) -> dict[str, Any]:
        """Start clients, wait until all are READY, GO together, collect results and CPU use."""
        clients = [self.spawn(role, a) for a in arglist]
        try:
            for c in clients:
                c.expect("READY", 120)
            before = {k: cpu_seconds(pid) for k, pid in servers.items()}
            t0 = time.perf_counter()
            for c in clients:
                c.go()
            results = [c.expect("RESULT", max_run + 60) for c in clients]
            wall = time.perf_counter() - t0
            cpu = {k: (cpu_seconds(pid) - before[k]) / wall for k, pid in servers.items()}
            for i, r in enumerate(results):
                cpu[f"client{i}"] = r["cpu"] / r["elapsed"]
            return {"clients": results, "cpu_cores": cpu, "wall": wall}
        finally:
            for c in clients:
                c.stop()
                self.children.remove(c)


# ---------------------------------------------------------------------------
# profiling with py-spy (optional)


def summarize_collapsed(path: Path, rate: int, duration: float, top: int = 10) -> dict[str, Any]:
    """Self and inclusive time per function from py-spy's raw (collapsed) output."""
    self_t: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count_s = line.rpartition(" ")
            if not stack or not count_s.isdigit():
                continue
            count = int(count_s)
            frames = [_frame_name(f) for f in stack.split(";") if f]
            frames = [f for f in frames if not f.startswith(("process ", "thread "))]
            if not frames:
                continue
            total += count
            self_t[frames[-1]] += count
            for f in set(frames):
                incl[f] += count

    def pct(c: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(k, round(100 * v / total, 1)) for k, v in c.most_common(top)] if total else []

    return {
        "samples": total,
        "busy_pct_of_wall": round(100 * total / (rate * duration), 1) if duration else None,
        "self": pct(self_t),
        "inclusive": pct(incl),
    }


def _frame_name(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)"
    name, _, loc = frame.partition(" (")
    if not loc:
        return frame
    file = loc.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({Path(file).name})"


@contextlib.contextmanager
def py_spy(
    targets: dict[str, int], outdir: Path, duration: float, rate: int = 100, native: bool = False
) -> Iterator[Any]:
    """Record each pid for ``duration`` seconds; yields a dict filled with summaries."""
    summaries: dict[str, Any] = {}
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        for name, pid in targets.items():
            out = outdir / f"{name}.txt"
            cmd = ["py-spy", "record", "--pid", str(pid), "--rate", str(rate)]
            cmd += ["--duration", str(int(duration + 0.999)), "--format", "raw"]
            cmd += ["--native"] if native else ["--nonblocking"]
            cmd += ["--output", str(out)]
            procs[name] = (
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                out,
            )
        time.sleep(1.0)  # let py-spy attach
        yield summaries
    finally:
        for name, (p, out) in procs.items():
            try:
                p.wait(duration + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            summaries[name] = summarize_collapsed(out, rate, duration)


# ---------------------------------------------------------------------------
# the workloads


def fmt(value: float | None, unit: str) -> str:
    if value is None or value != value:
        return "-"
    if unit == "x":
        return f"{value:.2f}x"
    if unit in ("GB/s",):
        return f"{value:.3f}"
    if unit in ("us", "MB"):
        return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.1f}"


class Bench:
    def __init__(
        self, sizes: Sizes, logdir: Path, profile_dir: Path | None, native: bool = False
    ) -> None:
        self.sizes = sizes
        self.native = native
        self.h = Harness(sizes, logdir)
        self.profile_dir = profile_dir
        self.rows: list[dict[str, Any]] = []
        self.results: dict[str, Any] = {}
        self.profile: dict[str, Any] = {}
        self.l_address = ""
        self.l_servers: dict[str, int] = {}
        self.cluster: Any = None
        self.z_servers: dict[str, int] = {}

    def row(
        self, workload: str, metric: str, z: float | None, lim: float | None, unit: str
    ) -> None:
        ratio = z / lim if z is not None and lim else None
        self.rows.append(
            {
                "workload": workload,
                "metric": metric,
                "unit": unit,
                "zps": z,
                "limit": lim,
                "ratio": ratio,
            }
        )
        print(
            f"  {workload:<30} {metric:<26} {fmt(z, unit):>10} {fmt(lim, unit):>10} "
            f"{fmt(ratio, 'x'):>8}",
            flush=True,
        )

    # -- setup -----------------------------------------------------------

    def start_l(self, ipc: bool = False) -> None:
        """L's broker and echoes; ``ipc``: its links are ipc:// sockets in the log directory."""
        from zps.testing import free_port

        if ipc:
            front, back = (
                f"ipc://{self.h.logdir}/l-front.sock",
                f"ipc://{self.h.logdir}/l-back.sock",
            )
        else:
            front = f"tcp://127.0.0.1:{free_port()}"
            back = f"tcp://127.0.0.1:{free_port()}"
        broker = self.h.spawn("l_broker", {"front": front, "back": back, "partitions": 2})
        broker.expect("READY", 30)
        echoes = [
            self.h.spawn(
                "l_echo",
                {"back": back, "partition": p, "max_frame": max(DENSE_CHUNK_BYTES, 512 * 1024)},
            )
            for p in range(N_PARTITIONS)
        ]
        for e in echoes:
            e.expect("READY", 30)
        self.l_address = front
        self.l_servers = {"broker": broker.pid, **{f"echo{i}": e.pid for i, e in enumerate(echoes)}}

    def start_zps(self) -> None:
        from zps.testing import LocalCluster

        self.cluster = LocalCluster(
            partitions=N_PARTITIONS,
            shards=N_PARTITIONS,
            heartbeat_interval=0.2,
            log_level="warning",
        )
        self.cluster.start()
        self.z_servers = self._zps_pids(self.cluster)

    @staticmethod
    def _zps_pids(cluster: Any) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in cluster.procs:
            out[p.name] = p.pid
        return out

    def run_l(self, kind: str, n_clients: int = 1, **extra: Any) -> dict[str, Any]:
        args = [
            {"kind": kind, "address": self.l_address, "seed": 100 + i, **extra}
            for i in range(n_clients)
        ]
        return self.h.run_clients("l_client", args, self.l_servers, self._max_run(extra))

    def run_zps(self, kind: str, n_clients: int = 1, **extra: Any) -> dict[str, Any]:
        args = [
            {"kind": kind, "address": self.cluster.address, "seed": 200 + i, **extra}
            for i in range(n_clients)
        ]
        return self.h.run_clients("zps_client", args, self.z_servers, self._max_run(extra))

    def _max_run(self, extra: dict[str, Any]) -> float:
        return float(extra.get("duration", 0)) + float(extra.get("budget", 0)) + 120

    # -- workloads -------------------------------------------------------

    def dense(self) -> None:
        d = self.sizes.duration
        for n in (1, 2):
            lim = self.run_l("dense", n, duration=d)
            z = self.run_zps("dense", n, duration=d)
            self.results[f"dense_{n}w"] = {"zps": z, "limit": lim}
            zb, lb = _sum_rate(z, "bytes"), _sum_rate(lim, "bytes")
            zs, ls = _sum_rate(z, "steps"), _sum_rate(lim, "steps")
            label = f"dense 16 MiB, {n} worker{'s' * (n > 1)}"
            self.row(label, "steps/s (all workers)", zs, ls, "/s")
            self.row(label, "GB/s (pull+push)", zb / 1e9, lb / 1e9, "GB/s")

    def sparse(self) -> None:
        d = self.sizes.duration
        pool = 64 if self.sizes is FULL else 16
        for pipelined in (False, True):
            for n in (1, 2):
                lim = self.run_l("sparse", n, duration=d, pipelined=pipelined)
                z = self.run_zps("sparse", n, duration=d, pool=pool, pipelined=pipelined)
                key = f"sparse_{n}w" + ("_pipelined" if pipelined else "")
                self.results[key] = {"zps": z, "limit": lim}
                label = f"sparse 4096x32 Adagrad, {n}w" + (", pipe" if pipelined else "")
                zr, lr = _sum_rate(z, "rows"), _sum_rate(lim, "rows")
                self.row(label, "rows/s (pull+push)", zr, lr, "/s")

    def small(self) -> None:
        s = self.sizes
        zb = self.run_zps("small", n=s.small_ops, budget=s.small_budget)
        zu = self.run_zps("small", n=s.small_ops, budget=s.small_budget, batch_max_ops=1)
        lw = self.run_l("small", n=s.small_ops, window=SMALL_CHUNK)
        l1 = self.run_l("small", n=s.raw_one_in_flight, window=1)
        self.results["small_ops"] = {
            "zps_batched": zb,
            "zps_unbatched": zu,
            "limit_window_1000": lw,
            "limit_one_in_flight": l1,
        }
        zbr, zur = _sum_rate(zb, "ops"), _sum_rate(zu, "ops")
        lwr, l1r = _sum_rate(lw, "ops"), _sum_rate(l1, "ops")
        self.row("small ops, batched", "ops/s vs raw, window 1000", zbr, lwr, "/s")
        self.row("small ops, batched", "ops/s vs raw, 1 in flight", zbr, l1r, "/s")
        self.row("small ops, unbatched", "ops/s vs raw, window 1000", zur, lwr, "/s")
        self.row("small ops, unbatched", "ops/s vs raw, 1 in flight", zur, l1r, "/s")

    def latency(self) -> None:
        n = self.sizes.latency_samples
        lim = self.run_l("latency", n=n)
        z = self.run_zps("latency", n=n)
        self.results["latency"] = {"zps": z, "limit": lim}
        zr, lr = z["clients"][0], lim["clients"][0]
        self.row(
            "latency, pull 1 row dim 8", "p50 us (1 in flight)", zr["p50_us"], lr["p50_us"], "us"
        )
        self.row(
            "latency, pull 1 row dim 8", "p99 us (1 in flight)", zr["p99_us"], lr["p99_us"], "us"
        )

    def memory(self) -> None:
        """Shard RSS growth for rows of dim 32 with Adagrad state, on a fresh cluster."""
        import zps
        from zps.testing import LocalCluster

        n_rows = self.sizes.memory_rows
        with LocalCluster(
            partitions=N_PARTITIONS,
            shards=N_PARTITIONS,
            heartbeat_interval=0.2,
            log_level="warning",
        ) as cluster:
            shards = {p.name: p.pid for p in cluster.procs if p.name.startswith("shard")}
            with zps.connect_sync(cluster.address) as ps:
                ps.create_embedding(
                    "mem",
                    dim=SPARSE_DIM,
                    init=zps.init.Uniform(-0.01, 0.01),
                    optimizer=zps.optim.Adagrad(lr=0.05),
                )
                warm = np.arange(1000, dtype=np.int64) + 10 * n_rows
                ps.push_rows("mem", warm, np.zeros((warm.size, SPARSE_DIM), np.float32))
                time.sleep(0.3)
                before = {k: proc_status_kib(pid, "VmRSS") for k, pid in shards.items()}
                t0 = time.perf_counter()
                step = 50_000
                for start in range(0, n_rows, step):
                    ids = np.arange(start, min(start + step, n_rows))
                    # a push creates rows and their Adagrad state (a pull stores nothing)
                    ps.push_rows("mem", ids, np.zeros((ids.size, SPARSE_DIM), np.float32))
                insert_s = time.perf_counter() - t0
                time.sleep(0.5)
                after = {k: proc_status_kib(pid, "VmRSS") for k, pid in shards.items()}
                hwm = {k: proc_status_kib(pid, "VmHWM") for k, pid in shards.items()}
                status = ps.status()
        delta = sum(after[k] - before[k] for k in shards) * 1024
        per_million = delta * 1e6 / n_rows
        raw = 1e6 * SPARSE_DIM * 4 * 2
        nbytes = sum(int(s.get("stats", {}).get("nbytes", 0)) for s in status.get("shards", []))
        self.results["memory"] = {
            "rows": n_rows,
            "rss_before_kib": before,
            "rss_after_kib": after,
            "hwm_after_kib": hwm,
            "rss_delta_bytes": delta,
            "rss_per_million_rows": per_million,
            "raw_per_million_rows": raw,
            "store_nbytes_reported": nbytes,
            "store_nbytes_per_million_rows": nbytes * 1e6 / n_rows if nbytes else None,
            "insert_seconds": insert_s,
        }
        self.row(
            "memory, 1M rows dim 32 Adagrad",
            "shard RSS MB / raw MB",
            per_million / 1e6,
            raw / 1e6,
            "MB",
        )

    def profile_run(self) -> None:
        assert self.profile_dir is not None
        d = self.sizes.profile_duration
        for kind in ("dense", "sparse"):
            outdir = self.profile_dir / kind
            outdir.mkdir(parents=True, exist_ok=True)
            extra: dict[str, Any] = {"duration": d}
            if kind == "sparse":
                extra["pool"] = 16
            arg = {"kind": kind, "address": self.cluster.address, "seed": 300, **extra}
            client = self.h.spawn("zps_client", arg)
            try:
                client.expect("READY", 120)
                targets = {**self.z_servers, "worker": client.pid}
                with py_spy(targets, outdir, d, native=self.native) as summaries:
                    before = {k: cpu_seconds(p) for k, p in targets.items()}
                    t0 = time.perf_counter()
                    client.go()
                    res = client.expect("RESULT", d + 60)
                    wall = time.perf_counter() - t0
                    cpu = {k: (cpu_seconds(p) - before[k]) / wall for k, p in targets.items()}
            finally:
                client.stop()
                self.h.children.remove(client)
            self.profile[kind] = {"result": res, "cpu_cores": cpu, "py_spy": summaries}

    # -- driver ----------------------------------------------------------

    def run(self, only: set[str], do_profile: bool) -> None:
        print("  starting L (raw pyzmq broker + 2 echoes) and zps (broker + 2 shards) ...")
        self.start_l()
        self.start_zps()
        print(f"  {'workload':<30} {'metric':<26} {'zps':>10} {'limit L':>10} {'ratio':>8}")
        print("  " + "-" * 88)
        try:
            for name in WORKLOADS[:-1]:  # memory needs fresh shards, so it runs last
                if name in only:
                    getattr(self, name)()
            if do_profile:
                self.profile_run()
        finally:
            self.h.stop_all()
            if self.cluster is not None:
                self.cluster.stop()
                self.cluster = None
        if "memory" in only:
            self.memory()


def _sum_rate(res: dict[str, Any], key: str) -> float:
    return float(sum(c[key] / c["elapsed"] for c in res["clients"]))


def targets(rows: list[dict[str, Any]], results: dict[str, Any]) -> list[dict[str, Any]]:
    def find(workload: str, metric: str) -> dict[str, Any]:
        for r in rows:
            if r["workload"] == workload and r["metric"] == metric:
                return r
        return {"zps": None, "ratio": None}  # workload skipped (--only)

    out: list[tuple[str, str, float | None, float, str]] = []
    for n in (1, 2):
        r = find(f"dense 16 MiB, {n} worker{'s' * (n > 1)}", "GB/s (pull+push)")
        out.append(("dense >= 80% of L bytes/s", f"{n} worker(s)", r["ratio"], 0.8, "ratio"))
    for suffix, how in (("", "sequential"), (", pipe", "pipelined")):
        for n in (1, 2):
            r = find(f"sparse 4096x32 Adagrad, {n}w{suffix}", "rows/s (pull+push)")
            case = f"{n} worker(s), {how}"
            out.append(("sparse >= 1.5M rows/s", case, r["zps"], 1.5e6, "rows/s"))
    for metric in ("ops/s vs raw, window 1000", "ops/s vs raw, 1 in flight"):
        r = find("small ops, batched", metric)
        case = metric.split(" vs ", 1)[1]
        out.append(("small ops batched >= 10x raw unbatched", case, r["ratio"], 10, "x"))
    mem = results.get("memory")
    out.append(
        (
            "shard memory <= 1.5x raw",
            "RSS delta / raw",
            mem["rss_per_million_rows"] / mem["raw_per_million_rows"] if mem else None,
            1.5,
            "x",
        )
    )
    return [
        {
            "target": t,
            "case": c,
            "value": v,
            "threshold": th,
            "unit": u,
            "met": v is not None and (v <= th if "memory" in t else v >= th),
        }
        for t, c, v, th, u in out
        if v is not None
    ]


def main(argv: list[str] | None = None) -> int:
    from zps.testing import exit_on_sigterm

    exit_on_sigterm()  # a killed run stops its cluster too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, < 1 minute (smoke check)")
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON here")
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="afterwards, profile zps dense and sparse (1 worker) with py-spy into DIR",
    )
    ap.add_argument(
        "--native", action="store_true", help="with --profile: py-spy --native (C frames too)"
    )
    ap.add_argument(
        "--only",
        metavar="LIST",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)",
    )
    ap.add_argument("--child", nargs=2, metavar=("ROLE", "ARGS"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        child_main(ns.child[0], json.loads(ns.child[1]))
        return 0

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    sizes = QUICK if ns.quick else FULL
    only = {w.strip() for w in ns.only.split(",") if w.strip()}
    if not only <= set(WORKLOADS):
        ap.error(f"--only takes a subset of {','.join(WORKLOADS)}")
    profile_dir = Path(ns.profile).resolve() if ns.profile else None
    if profile_dir is not None:
        from shutil import which

        if which("py-spy") is None:
            ap.error("--profile needs py-spy on PATH (pip install py-spy)")
        profile_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    started = time.time()
    print(f"zps benchmark ({'quick' if ns.quick else 'full'})")
    print(
        f"  machine: {info['nproc']} cpus ({info['affinity']} usable), {info['cpu']}, "
        f"Linux {info['kernel']}"
    )
    print(
        f"  python {info['python']}, numpy {info['numpy']}, pyzmq {info['pyzmq']} "
        f"(libzmq {info['libzmq']}), uvloop {info['uvloop']}, zps {info['zps']}"
    )
    print(f"  zps from {info['zps_source']}")
    with tempfile.TemporaryDirectory(prefix="zps-bench-") as tmp:
        bench = Bench(sizes, Path(tmp), profile_dir, native=ns.native)
        try:
            bench.run(only, do_profile=profile_dir is not None)
        finally:
            bench.h.stop_all()
            if bench.cluster is not None:
                bench.cluster.stop()
    goals = targets(bench.rows, bench.results)
    print("\n  targets")
    for g in goals:
        v = g["value"]
        shown = f"{v / 1e6:.2f}M" if g["unit"] == "rows/s" else f"{v:.2f}"
        print(
            f"  {'met' if g['met'] else 'MISSED':<7} {g['target']:<40} {g['case']:<26} "
            f"{shown} (needs {'<=' if 'memory' in g['target'] else '>='} "
            f"{g['threshold']:g}{'' if g['unit'] == 'rows/s' else ' ' + g['unit']})"
        )
    _print_cpu(bench.results)
    if bench.profile:
        _print_profile(bench.profile)
    elapsed = time.time() - started
    print(f"\n  total {elapsed:.0f}s")
    if ns.json:
        doc = {
            "machine": info,
            "mode": "quick" if ns.quick else "full",
            "sizes": vars(sizes),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "seconds": elapsed,
            "table": bench.rows,
            "targets": goals,
            "results": bench.results,
            "profile": bench.profile,
        }
        Path(ns.json).write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
        print(f"  wrote {ns.json}")
    return 0


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(type(obj).__name__)


def _print_cpu(results: dict[str, Any]) -> None:
    print(
        "\n  CPU use during each run (cores busy; zps: broker, shard0, shard1 | L: broker, echoes)"
    )
    for name, res in results.items():
        for side in ("zps", "limit"):
            r = res.get(side) if isinstance(res, dict) else None
            if not r or "cpu_cores" not in r:
                continue
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items())
            print(f"  {name:<12} {side:<6} {parts}")


def _print_profile(profile: dict[str, Any]) -> None:
    for kind, p in profile.items():
        print(f"\n  py-spy profile, zps {kind} (1 worker): top self time, % of samples")
        for proc, s in p["py_spy"].items():
            cpu = p["cpu_cores"].get(proc, float("nan"))
            print(
                f"    {proc}: {s['samples']} samples, Python busy {s['busy_pct_of_wall']}% of wall,"
                f" CPU {cpu:.2f} cores"
            )
            for fn, pc in s["self"][:6]:
                print(f"      {pc:5.1f}%  {fn}")


if __name__ == "__main__":
    sys.exit(main())
