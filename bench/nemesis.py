"""Nemesis run: a random mix of faults under load for a set time, then exact sums.

    python bench/nemesis.py [--seconds 60] [--seed 1] [--kinds kill,pause,flood]
                            [--big-mb 300] [--dense] [--json out.json]

Starts a local cluster (2 partitions x 2 copies plus a spare shard, each shard
with its own data directory) and a few writer clients, each a separate process
(this file with ``--writer``).  Every writer pushes, to each partition, a known
increment to a fixed set of rows plus a one-off "ledger" row per push (SGD with
lr=1, float64: every value is exact), and logs each push before sending it and
its outcome (acknowledged, or the error type) after.  Meanwhile faults are
injected at random (the schedule is reproducible with ``--seed``):

``kill``
    SIGKILL a shard (primary, replica or spare), only while every partition
    is fully replicated, then restart it on its data directory or start a fresh
    shard, so that the cluster keeps its copies.
``pause``
    SIGSTOP any process (a shard, the broker, a writer) for 0.2-3 s, then
    SIGCONT it.
``flood``
    A peer that never reads: a raw DEALER with a receive queue of one message
    sends STATUS requests to the broker as fast as it can for 1-3 s, then
    disconnects.
``checkpoint``
    (only with ``--big-mb``) one partition is made that large and every shard
    checkpoints every ``--checkpoint-interval`` seconds; the count is the
    checkpoints written during the run.

With ``--dense``, each writer also pushes a 2 MiB float64 dense tensor of its own
(chunks of 1 MiB and more: they travel through shared memory, client to primary and
primary to replica): push ``k``'s gradient is 1 everywhere plus ``DENSE_MARK`` at
offset ``k`` of every block of ``DENSE_BLOCK`` elements, so each block tells how many
pushes it received and, at offset ``k``, how many times push ``k`` was applied,
whatever chunk it is in.

At the end every process is resumed, the writers stop, and every ledger row is
read back: an acknowledged push must be applied exactly once ("lost" when it
is missing, "doubled" when applied twice); a push that failed or was cut off
may or may not be applied ("applied, unacknowledged" is allowed).  The shared
rows must equal minus the sum of the increments of the applied pushes.  The
exit status is 1 when anything acknowledged was lost or doubled (or the
sums disagree), 2 when the final check could not be made.  Every process is
stopped on the way out, on Ctrl-C too, and every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

KINDS = ("kill", "pause", "flood", "checkpoint")
TABLE = "nemesis"
BIG_TABLE = "nemesis-big"
DIM = 4
SHARED_ROWS = 16
LEDGER_BASE = 1 << 40  # ledger ids: far from the shared rows
LEDGER_SPAN = 1 << 32  # per writer process
DENSE_TABLE = "nemesis-dense-{}"  # one per writer process
DENSE_ELEMS = 1 << 18  # float64: 2 MiB, a chunk of 1 MiB per partition
DENSE_BLOCK = 4096  # elements: every chunk holds whole blocks, so every marker
DENSE_MARK = float(1 << 30)  # far above any count of pushes: both read back exactly
DENSE = -1  # the "partition" of a dense push in the logs


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


# --------------------------------------------------------------------------
# Writer process
# --------------------------------------------------------------------------


def shared_ids(client: int, partition: int, cmap: Any) -> np.ndarray:
    from zps.core.routing import partitions_of_ids

    candidates = np.arange(1, 200_000, dtype=np.int64)
    owner = partitions_of_ids(candidates, cmap)
    mine: np.ndarray = candidates[owner == partition]
    return np.asarray(mine[client * SHARED_ROWS : (client + 1) * SHARED_ROWS], dtype=np.int64)


class LedgerIds:
    """Fresh ledger row ids on one partition, one per push, never reused."""

    def __init__(self, client: int, partition: int, cmap: Any) -> None:
        self.next = LEDGER_BASE + client * LEDGER_SPAN
        self.partition = partition
        self.cmap = cmap
        self.pool: list[int] = []

    def take(self) -> int:
        from zps.core.routing import partitions_of_ids

        while not self.pool:
            block = np.arange(self.next, self.next + 4096, dtype=np.int64)
            self.next += 4096
            owner = partitions_of_ids(block, self.cmap)
            self.pool = [int(i) for i in block[owner == self.partition]][::-1]
        return self.pool.pop()


async def writer_main(args: argparse.Namespace) -> int:
    """One writer process: push to every partition until SIGTERM or the deadline."""
    import zps

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    deadline = args.until  # wall clock: a safety net if the coordinator vanished

    async def watchdog() -> None:
        while not stop.is_set():
            if os.getppid() != parent or time.time() > deadline:
                stop.set()
            await asyncio.sleep(0.2)

    out = open(args.log, "a", buffering=1)  # noqa: SIM115 - closed below
    c = args.client

    def record(*fields: object) -> None:
        out.write(" ".join(str(f) for f in fields) + "\n")

    async def logged(p: int, k: int, lid: int, value: int, push: Any) -> None:
        """Log push ``k`` to ``p`` before it is sent (``push``, a coroutine) and its
        outcome after; a closed or broken client is raised (the writer reconnects)."""
        sent = time.monotonic()
        record("S", p, k, lid, value, f"{sent:.6f}")
        try:
            await push
        except Exception as e:  # the outcome of this push is unknown
            record("E", p, k, type(e).__name__, f"{time.monotonic():.6f}")
            if type(e).__name__ in ("ClosedError", "BrokenError"):
                raise
            await asyncio.sleep(0.05)
            return
        record("A", p, k, f"{sent:.6f}", f"{time.monotonic():.6f}")

    async def run_partition(ps: Any, p: int, state: dict[str, Any]) -> None:
        rows = state["shared"][p]
        ledger: LedgerIds = state["ledger"][p]
        while not stop.is_set():
            k = state["k"][p]
            state["k"][p] += 1
            value = float(k % 7 + 1)
            lid = ledger.take()
            ids = np.concatenate([rows, np.array([lid], dtype=np.int64)])
            grads = np.full((ids.size, DIM), value)
            grads[-1] = (1.0, value, 0.0, 0.0)
            await logged(p, k, lid, int(value), ps.push_rows(TABLE, ids, grads))

    async def run_dense(ps: Any, state: dict[str, Any]) -> None:
        """Dense pushes, each marked at its own offset of every block (module notes)."""
        name = DENSE_TABLE.format(c)
        while not stop.is_set() and state["k"][DENSE] < DENSE_BLOCK:
            k = state["k"][DENSE]
            state["k"][DENSE] += 1
            grad = np.ones(DENSE_ELEMS)
            grad[k::DENSE_BLOCK] += DENSE_MARK
            await logged(DENSE, k, k, 1, ps.push_dense(name, grad))

    dog = asyncio.create_task(watchdog())
    state: dict[str, Any] = {"k": collections.Counter()}
    try:
        while not stop.is_set():
            ps = zps.connect(
                args.address,
                timeout=args.timeout,
                connect_timeout=min(args.timeout, 10.0),
                name=f"nemesis-writer-{c}",
            )
            try:
                # Bounded here too: the client's start-up may wait on a frozen broker.
                await asyncio.wait_for(ps.start(), min(args.timeout, 10.0) + 2.0)
                if "shared" not in state:
                    cmap = ps.cluster_map
                    n = cmap.n_partitions
                    state["shared"] = [shared_ids(c, p, cmap) for p in range(n)]
                    state["ledger"] = [LedgerIds(c, p, cmap) for p in range(n)]
                await asyncio.gather(
                    *(run_partition(ps, p, state) for p in range(len(state["shared"]))),
                    *([run_dense(ps, state)] if args.dense else []),
                )
            except Exception as e:  # reconnect: a closed client, a failed connect
                record("X", type(e).__name__, f"{time.monotonic():.6f}")
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ps.close(), 3.0)
    finally:
        record("END", f"{time.monotonic():.6f}")
        out.close()
        dog.cancel()
    return 0


# --------------------------------------------------------------------------
# Coordinator
# --------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    target: str
    start: float
    end: float
    detail: str = ""


@dataclass
class Push:
    client: int
    partition: int
    k: int
    lid: int
    value: int
    sent: float
    acked: float | None = None
    error: str | None = None


@dataclass
class Run:
    seconds: float
    seed: int
    kinds: list[str]
    faults: list[Fault] = field(default_factory=list)
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    checkpoints: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


class Nemesis:
    def __init__(self, args: argparse.Namespace) -> None:
        from zps.testing import LocalCluster

        self.args = args
        self.rng = random.Random(args.seed)
        kinds = [k for k in args.kinds.split(",") if k]
        for k in kinds:
            if k not in KINDS:
                raise SystemExit(f"--kinds: unknown fault kind {k!r} (known: {', '.join(KINDS)})")
        if "checkpoint" in kinds and args.big_mb <= 0:
            raise SystemExit("--kinds checkpoint needs --big-mb N (the size of the big partition)")
        if args.big_mb > 0 and "checkpoint" not in kinds:
            kinds.append("checkpoint")
        self.run = Run(args.seconds, args.seed, kinds)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if args.workdir:
            self.root = Path(args.workdir)
            self.root.mkdir(parents=True, exist_ok=True)
            if any(self.root.iterdir()):
                # Its shards would load an earlier run's checkpoints and logs, and every
                # push of this run would then look applied twice.
                raise SystemExit(f"--workdir {self.root} is not empty: give an empty directory")
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="zps-nemesis-")
            self.root = Path(self._tmp.name)
        shard_args = []
        if args.big_mb > 0:
            shard_args = ["--checkpoint-interval", str(args.checkpoint_interval)]
        self.cluster = LocalCluster(
            partitions=2,
            shards=0,
            replication=2,
            heartbeat_interval=args.heartbeat_interval,
            liveness=args.liveness,
            log_level=args.log_level,
            shard_args=shard_args,
            workdir=self.root,
        )
        self.data_dirs: dict[int, Path] = {}  # shard pid -> its data directory
        self._fresh_dirs = 0  # data directories made so far
        self.writers: list[Any] = []  # Proc
        self.t0 = 0.0
        self._monitor: Any = None  # a zps client for status calls

    # -- processes ---------------------------------------------------------

    def start_shard(self, data_dir: Path | None = None) -> None:
        if data_dir is None:  # a fresh one: never a live (or killed) shard's directory
            data_dir = self.root / f"data{self._fresh_dirs}"
            self._fresh_dirs += 1
        proc = self.cluster.start_shard(["--data-dir", str(data_dir)])
        self.data_dirs[proc.pid] = data_dir

    def start_cluster(self) -> None:
        from zps.testing import free_port

        self.cluster.port = free_port()
        self.cluster.start_broker()
        for _ in range(5):  # 2 partitions x 2 copies, plus a spare
            self.start_shard()

    def start_writers(self) -> None:
        until = time.time() + self.args.seconds + 120
        for c in range(self.args.clients):
            self.writers.append(
                self.cluster.spawn(
                    f"writer{c}",
                    [
                        self.cluster.python,
                        str(Path(__file__).resolve()),
                        "--writer",
                        "--address",
                        self.cluster.address,
                        "--client",
                        str(c),
                        "--log",
                        str(self.root / f"writer{c}.pushes"),
                        "--timeout",
                        str(self.args.client_timeout),
                        "--until",
                        str(until),
                        *(["--dense"] if self.args.dense else []),
                    ],
                )
            )

    def stop_writers(self) -> None:
        for w in self.writers:
            if w.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGCONT)
                    os.kill(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.args.client_timeout + 5
        for w in self.writers:
            try:
                w.popen.wait(max(0.1, deadline - time.monotonic()))
            except Exception:
                self.run.notes.append(f"{w.name} did not stop within its timeout: killed")
                w.popen.kill()
                w.popen.wait(5)

    def resume_all(self) -> None:
        for p in self.cluster.procs:
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)

    def shutdown(self) -> None:
        self.resume_all()
        with contextlib.suppress(Exception):
            self.stop_writers()
        self.cluster.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- faults ------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def status(self) -> dict[str, Any] | None:
        """The broker's status, or None when it does not answer within 3 s.

        One client is kept for these calls and every call is bounded here: a
        client's own start-up or a call to a frozen broker may not be.
        """
        import zps

        try:
            if self._monitor is None:
                client = zps.connect(
                    self.cluster.address, timeout=2.0, connect_timeout=2.0, name="nemesis"
                )
                await asyncio.wait_for(client.start(), 3.0)
                self._monitor = client
            return dict(await asyncio.wait_for(self._monitor.status(), 3.0))
        except Exception:
            await self.drop_monitor()
            return None

    async def drop_monitor(self) -> None:
        client, self._monitor = self._monitor, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 3.0)

    async def wait_status(self, condition: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = await self.status()
            if s is not None and condition(s):
                return True
            await asyncio.sleep(0.1)
        return False

    async def wait_healthy(self, timeout: float) -> bool:
        return await self.wait_status(self.cluster.healthy, timeout)

    async def fault_kill(self) -> None:
        # Never kill while a copy is missing: losing both copies loses writes by design.
        if not await self.wait_healthy(10):
            self.run.skipped["kill (cluster not fully replicated)"] += 1
            return
        s = await self.status()
        if s is None:
            self.run.skipped["kill (no status)"] += 1
            return
        mine = {p.pid for p in self.cluster.procs if p.alive()}
        shards = [x for x in s["shards"] if int(x["pid"]) in mine]
        if not shards:
            self.run.skipped["kill (no shard)"] += 1
            return
        victim = self.rng.choice(shards)
        pid = int(victim["pid"])
        restart = self.rng.random() < 0.5
        start = self.now()
        os.kill(pid, signal.SIGKILL)
        proc = self.cluster.proc_by_pid(pid)
        await asyncio.to_thread(proc.popen.wait, 10)
        # Until the broker has noticed, its status still counts the dead copy.
        if not await self.wait_status(lambda st: all(x["pid"] != pid for x in st["shards"]), 30):
            self.run.notes.append(f"the broker still listed killed {proc.name} after 30 s")
        data_dir = self.data_dirs.pop(pid, None)
        self.start_shard(data_dir if restart else None)
        what = victim["role"]
        if victim["partition"] is not None:
            what += f" of partition {victim['partition']}"
        how = "restarted on its data dir" if restart else "replaced by a fresh shard"
        self.run.faults.append(Fault("kill", proc.name, start, self.now(), f"{what}; {how}"))

    async def fault_pause(self) -> None:
        # A kind of process first (shard, broker, writer), so that each gets its share.
        procs = [p for p in self.cluster.procs if p.alive()]
        groups: dict[str, list[Any]] = collections.defaultdict(list)
        for p in procs:
            groups[p.name.rstrip("0123456789")].append(p)
        victim = self.rng.choice(groups[self.rng.choice(sorted(groups))])
        length = self.rng.uniform(0.2, 3.0)
        role = ""
        if victim.name.startswith("shard"):
            s = await self.status()
            for x in (s or {}).get("shards", []):
                if int(x["pid"]) == victim.pid:
                    role = x["role"]
                    if x["partition"] is not None:
                        role += f" of partition {x['partition']}"
        start = self.now()
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(length)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGCONT)
        self.run.faults.append(
            Fault("pause", victim.name, start, self.now(), f"{length:.2f}s {role}".strip())
        )

    def _flood(self, length: float) -> int:
        import zmq

        from zps.protocol.codec import MsgType, Route, encode

        ctx = zmq.Context()
        sent = 0
        try:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.setsockopt(zmq.SNDHWM, 1000)
            s.connect(self.cluster.address)
            frames = encode(Route(MsgType.STATUS), {})
            end = time.monotonic() + length
            while time.monotonic() < end:
                try:
                    s.send_multipart(frames, zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    s.poll(10, zmq.POLLOUT)
            s.close(0)
        finally:
            ctx.term()
        return sent

    async def fault_flood(self) -> None:
        length = self.rng.uniform(1.0, 3.0)
        start = self.now()
        sent = await asyncio.to_thread(self._flood, length)
        self.run.faults.append(
            Fault("flood", "broker", start, self.now(), f"{sent} STATUS requests unread")
        )

    async def watch_checkpoints(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for d in list(self.data_dirs.values()):
                with contextlib.suppress(OSError):
                    for f in d.glob("partition-*/ckpt-*.zps"):
                        self.run.checkpoints.add(str(f))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def make_big(self) -> None:
        """Fill partition 0 with about ``--big-mb`` MB of rows (dim 64, float32)."""
        import zps
        from zps.core.routing import partitions_of_ids
        from zps.optim import SGD

        dim = 64
        rows = int(self.args.big_mb * (1 << 20) / (dim * 4))
        async with zps.connect(self.cluster.address, timeout=120) as ps:
            await ps.create_embedding(BIG_TABLE, dim=dim, optimizer=SGD(lr=1.0))
            rng = np.random.default_rng(0)
            done, nxt = 0, 0
            while done < rows:  # rows exist once written; random values do not compress
                block = np.arange(nxt, nxt + 40_000, dtype=np.int64)
                nxt += 40_000
                ids = block[partitions_of_ids(block, ps.cluster_map) == 0][: rows - done]
                grads = rng.standard_normal((ids.size, dim), dtype=np.float32)
                give_up = time.monotonic() + 60
                while True:  # checkpoints run meanwhile: a shard may be declared dead
                    try:
                        await ps.push_rows(BIG_TABLE, ids, grads)
                        break
                    except Exception as e:
                        self.run.skipped[f"fill of partition 0: {type(e).__name__}"] += 1
                        if time.monotonic() > give_up:
                            raise RuntimeError(
                                f"filling partition 0 failed for 60 s: {e!r}"
                            ) from None
                        await asyncio.sleep(0.5)
                done += ids.size
            status = await ps.status()
        held = [
            x["stats"].get("nbytes", 0)
            for x in status["shards"]
            if x["partition"] == 0 and x["role"] == "primary"
        ]
        self.run.notes.append(f"partition 0 holds {sum(held) / 2**20:.0f} MB of table data")

    async def wait_writers_acked(self, timeout: float) -> None:
        """Until every writer has had a push acknowledged (faults start after)."""
        deadline = time.monotonic() + timeout
        waiting = set(range(self.args.clients))
        while waiting and time.monotonic() < deadline:
            for c in list(waiting):
                with contextlib.suppress(OSError):
                    if "\nA " in (self.root / f"writer{c}.pushes").read_text():
                        waiting.discard(c)
            await asyncio.sleep(0.1)
        if waiting:
            self.run.notes.append(f"writers {sorted(waiting)} had no ack after {timeout:g} s")

    async def inject(self, deadline: float) -> None:
        events = [k for k in self.run.kinds if k != "checkpoint"]
        actions = {"kill": self.fault_kill, "pause": self.fault_pause, "flood": self.fault_flood}
        while events and time.monotonic() < deadline:
            await asyncio.sleep(self.rng.uniform(0.2, 1.0))
            if time.monotonic() >= deadline:
                break
            await actions[self.rng.choice(events)]()

    # -- the run -------------------------------------------------------------

    async def main(self) -> dict[str, Any]:
        import zps
        from zps.optim import SGD

        self.start_cluster()
        if not await self.wait_healthy(60):
            raise RuntimeError(f"the cluster did not start within 60 s\n{self.cluster.logs()}")

        async def create() -> None:
            async with zps.connect(self.cluster.address, timeout=30) as ps:
                await ps.create_embedding(TABLE, dim=DIM, dtype="float64", optimizer=SGD(lr=1.0))
                for c in range(self.args.clients if self.args.dense else 0):
                    await ps.create_dense(
                        DENSE_TABLE.format(c),
                        shape=(DENSE_ELEMS,),
                        dtype="float64",
                        optimizer=SGD(lr=1.0),
                    )

        await asyncio.wait_for(create(), 60)
        if self.args.big_mb > 0:
            await asyncio.wait_for(self.make_big(), 60 + self.args.big_mb)
        self.start_writers()
        await self.wait_writers_acked(30)
        self.t0 = time.monotonic()
        stop = asyncio.Event()
        watcher = asyncio.create_task(self.watch_checkpoints(stop))
        try:
            # Each fault is bounded (pause <= 3 s, flood <= 3 s, kill waits <= 20 s).
            await asyncio.wait_for(
                self.inject(time.monotonic() + self.args.seconds), self.args.seconds + 60
            )
            await asyncio.sleep(max(0.0, self.args.seconds - self.now()))
        finally:
            stop.set()
            await watcher
        ended = self.now()
        self.resume_all()
        await asyncio.to_thread(self.stop_writers)
        if not await self.wait_healthy(60):
            self.run.notes.append("the cluster was not fully replicated 60 s after the run")
        await self.drop_monitor()
        pushes = self.read_logs()
        verdict = await asyncio.wait_for(self.verify(pushes), 120)
        return self.report(pushes, verdict, ended)

    def read_logs(self) -> list[Push]:
        pushes: dict[tuple[int, int, int], Push] = {}
        self.errors: collections.Counter[str] = collections.Counter()
        self.ends: dict[int, float] = {}
        for c in range(self.args.clients):
            path = self.root / f"writer{c}.pushes"
            if not path.exists():
                self.run.notes.append(f"writer {c} wrote no log")
                continue
            for line in path.read_text().splitlines():
                f = line.split()
                if not f:
                    continue
                try:
                    if f[0] == "S":
                        p, k = int(f[1]), int(f[2])
                        pushes[(c, p, k)] = Push(c, p, k, int(f[3]), int(f[4]), float(f[5]))
                    elif f[0] == "A":
                        pushes[(c, int(f[1]), int(f[2]))].acked = float(f[4])
                    elif f[0] == "E":
                        pushes[(c, int(f[1]), int(f[2]))].error = f[3]
                        self.errors[f[3]] += 1
                    elif f[0] == "X":
                        self.errors[f"{f[1]} (reconnect)"] += 1
                    elif f[0] == "END":
                        self.ends[c] = float(f[1])
                except (IndexError, ValueError, KeyError):
                    pass  # a line cut off by a kill
        return list(pushes.values())

    async def verify(self, pushes: list[Push]) -> dict[str, Any]:
        import zps

        v: dict[str, Any] = {
            "checked": False,
            "lost": 0,
            "doubled": 0,
            "applied_unacknowledged": 0,
            "unacknowledged_not_applied": 0,
            "bad_ledger_rows": 0,
            "shared_row_mismatches": 0,
            "problems": [],
        }
        try:
            async with zps.connect(self.cluster.address, timeout=30, connect_timeout=10) as ps:
                cmap = ps.cluster_map
                unreadable = []
                checks = [
                    (
                        f"writer {c}'s dense tensor",
                        functools.partial(self._verify_dense, ps, c),
                        [p for p in pushes if p.partition == DENSE and p.client == c],
                    )
                    for c in range(self.args.clients if self.args.dense else 0)
                ] + [
                    (
                        f"partition {part}",
                        functools.partial(self._verify_partition, ps, part),
                        [p for p in pushes if p.partition == part],
                    )
                    for part in range(cmap.n_partitions)
                ]
                for what, check, mine in checks:
                    try:
                        await check(mine, v)
                    except Exception as e:
                        unreadable.append(what)
                        acked = sum(p.acked is not None for p in mine)
                        v["problems"].append(
                            f"{what} could not be read ({e!r}): "
                            f"{acked} acknowledged writes unchecked"
                        )
                v["checked"] = not unreadable
        except Exception as e:
            v["problems"].append(f"the final check failed: {e!r}")
        return v

    async def _verify_dense(self, ps: Any, c: int, pushes: list[Push], v: dict[str, Any]) -> None:
        """Each block of writer ``c``'s tensor: how many times each push was applied (the
        marks at its offset) and how many pushes it got (the rest), which must agree."""
        values = await ps.pull_dense(DENSE_TABLE.format(c))
        neg = -values.reshape(-1, DENSE_BLOCK)  # a row per block
        times = np.floor(neg / DENSE_MARK)
        counts = neg - times * DENSE_MARK
        pushed = {p.k: p for p in pushes}
        bad = [
            b
            for b in range(neg.shape[0])
            if not np.all(counts[b] == counts[b, 0]) or counts[b, 0] != times[b].sum()
        ]
        if bad:
            v["bad_ledger_rows"] += len(bad)
            v["problems"].append(
                f"writer {c}'s dense tensor: blocks {bad[:5]} disagree with their marks"
            )
        for k in range(DENSE_BLOCK):
            applied = set(times[:, k].tolist())
            push = pushed.get(k)
            if push is None:
                if applied != {0.0}:
                    v["doubled"] += 1
                    v["problems"].append(f"writer {c}: dense push {k}, never sent, applied")
                continue
            if max(applied) > 1:
                v["doubled"] += 1
                v["problems"].append(f"applied {sorted(applied)} times (by block): {push}")
            elif push.acked is not None and applied != {1.0}:
                v["lost"] += 1  # all of it, or the chunk of some partition
                v["problems"].append(f"acknowledged, applied {sorted(applied)} by block: {push}")
            elif push.acked is None and 1.0 in applied:
                # A failed call may be applied on one partition and not on the other.
                v["applied_unacknowledged"] += 1
            elif push.acked is None:
                v["unacknowledged_not_applied"] += 1

    async def _verify_partition(
        self, ps: Any, part: int, pushes: list[Push], v: dict[str, Any]
    ) -> None:
        lids = np.array([p.lid for p in pushes], dtype=np.int64)
        rows = np.zeros((lids.size, DIM))
        for i in range(0, lids.size, 20_000):
            rows[i : i + 20_000] = await ps.pull_rows(TABLE, lids[i : i + 20_000])
        applied_sum: collections.Counter[int] = collections.Counter()
        for push, row in zip(pushes, rows, strict=True):
            count = float(-row[0])
            if count != round(count) or row[1] != -push.value * count:
                v["bad_ledger_rows"] += 1
                v["problems"].append(f"ledger row of {push}: {row.tolist()}")
                continue
            n = round(count)
            applied_sum[push.client] += n * push.value
            if n > 1:
                v["doubled"] += 1
                if len(v["problems"]) < 20:
                    v["problems"].append(f"applied {n} times: {push}")
            elif push.acked is not None and n == 0:
                v["lost"] += 1
                if len(v["problems"]) < 20:
                    v["problems"].append(f"acknowledged, missing: {push}")
            elif push.acked is None and n == 1:
                v["applied_unacknowledged"] += 1
            elif push.acked is None:
                v["unacknowledged_not_applied"] += 1
        for c in range(self.args.clients):
            ids = shared_ids(c, part, ps.cluster_map)
            got = await ps.pull_rows(TABLE, ids)
            want = -float(applied_sum[c])
            if not np.array_equal(got, np.full_like(got, want)):
                v["shared_row_mismatches"] += 1
                v["problems"].append(
                    f"writer {c} partition {part}: shared rows {np.unique(got)[:5]}, "
                    f"the applied pushes sum to {want}"
                )

    def report(self, pushes: list[Push], v: dict[str, Any], ended: float) -> dict[str, Any]:
        t0 = self.t0
        latencies = [p.acked - p.sent for p in pushes if p.acked is not None]
        own_pauses: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for f in self.run.faults:
            if f.kind == "pause":
                own_pauses[f.target].append((f.start + t0, f.end + t0))
        stalls = []  # (gap, writer, from, to)
        by_writer: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
        for p in pushes:
            if p.acked is not None:
                by_writer[(p.client, p.partition)].append(p.acked)
        for c in range(self.args.clients):
            for part in range(2):
                acks = sorted(by_writer.get((c, part), []))
                edges = [t0, *acks, min(self.ends.get(c, t0 + ended), t0 + ended)]
                for a, b in itertools.pairwise(edges):
                    if b - a > 0:
                        stalls.append((b - a, f"writer{c}", part, a, b))
        stalls.sort(reverse=True)

        def overlaps(a: float, b: float, kind: str, target: str | None = None) -> bool:
            return any(
                f.kind == kind
                and f.start + t0 < b
                and f.end + t0 + 0.05 > a
                and (target is None or f.target == target)
                for f in self.run.faults
            )

        longest = stalls[0] if stalls else None
        not_own = next(
            (s for s in stalls if not overlaps(s[3], s[4], "pause", s[1])),
            None,
        )
        stall_by_kind: dict[str, float] = {}
        for gap, writer, _part, a, b in stalls:
            for kind in ("kill", "pause", "flood"):
                if kind not in stall_by_kind and overlaps(a, b, kind):
                    if kind == "pause" and overlaps(a, b, "pause", writer):
                        continue
                    stall_by_kind[kind] = round(gap, 3)
        if "checkpoint" in self.run.kinds and longest:
            stall_by_kind["checkpoint (whole run)"] = round(longest[0], 3)
        top_stalls = [
            {
                "stall_s": round(gap, 3),
                "writer": writer,
                "partition": part,
                "from_s": round(a - t0, 2),
                "to_s": round(b - t0, 2),
                "faults": [
                    f"{f.kind} {f.target} {f.detail} at {f.start:.1f}-{f.end:.1f}s"
                    for f in self.run.faults
                    if f.start + t0 < b and f.end + t0 + 2.0 > a
                ],
            }
            for gap, writer, part, a, b in stalls[:5]
        ]
        counts = collections.Counter(f.kind for f in self.run.faults)
        if "checkpoint" in self.run.kinds:
            counts["checkpoint"] = len(self.run.checkpoints)
        ok = v["checked"] and not (
            v["lost"] or v["doubled"] or v["bad_ledger_rows"] or v["shared_row_mismatches"]
        )
        return {
            "seconds": self.run.seconds,
            "seed": self.run.seed,
            "kinds": self.run.kinds,
            "clients": self.args.clients,
            "heartbeat_interval_s": self.args.heartbeat_interval,
            "liveness": self.args.liveness,
            "big_mb": self.args.big_mb,
            "dense": self.args.dense,
            "dense_acknowledged": sum(p.acked is not None for p in pushes if p.partition == DENSE),
            "faults_by_kind": dict(counts),
            "skipped": dict(self.run.skipped),
            "faults": [vars(f) for f in self.run.faults],
            "longest_stall_s": round(longest[0], 3) if longest else None,
            "longest_stall_at": (
                f"{longest[1]} partition {longest[2]}, "
                f"t={longest[3] - t0:.1f}-{longest[4] - t0:.1f}s"
                if longest
                else None
            ),
            "top_stalls": top_stalls,
            "longest_stall_not_own_pause_s": round(not_own[0], 3) if not_own else None,
            "longest_stall_during_kind_s": stall_by_kind,
            "write_latency_p50_s": percentile(latencies, 50),
            "write_latency_p99_s": percentile(latencies, 99),
            "write_latency_max_s": max(latencies) if latencies else None,
            "pushes_sent": len(pushes),
            "acknowledged": len(latencies),
            "errors_by_type": dict(self.errors),
            **{k: v[k] for k in v if k != "problems"},
            "problems": v["problems"],
            "notes": self.run.notes,
            "ok": ok,
        }


def print_table(r: dict[str, Any]) -> None:
    def fmt(x: Any) -> str:
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.3f}"
        return str(x)

    print(
        f"zps nemesis: {r['seconds']:g}s, seed {r['seed']}, kinds {','.join(r['kinds'])}, "
        f"{r['clients']} writer processes, heartbeat {r['heartbeat_interval_s']}s x "
        f"{r['liveness']} (nproc {os.cpu_count()})"
    )
    rows: list[tuple[str, Any]] = []
    for kind in r["kinds"]:
        rows.append((f"faults: {kind}", r["faults_by_kind"].get(kind, 0)))
    for why, n in r["skipped"].items():
        rows.append((f"skipped: {why}", n))
    rows += [
        ("longest stall, any writer (s)", r["longest_stall_s"]),
        ("  not during its own pause (s)", r["longest_stall_not_own_pause_s"]),
    ]
    for kind, gap in r["longest_stall_during_kind_s"].items():
        rows.append((f"  longest stall during {kind} (s)", gap))
    rows += [
        ("write latency p50 (s)", r["write_latency_p50_s"]),
        ("write latency p99 (s)", r["write_latency_p99_s"]),
        ("write latency max (s)", r["write_latency_max_s"]),
        ("pushes sent", r["pushes_sent"]),
        ("acknowledged writes", r["acknowledged"]),
        ("  of them dense (2 MiB, shared memory)", r["dense_acknowledged"]),
        ("lost (acknowledged, missing)", r["lost"] if r["checked"] else "unchecked"),
        ("doubled (applied twice)", r["doubled"] if r["checked"] else "unchecked"),
        ("applied, unacknowledged (allowed)", r["applied_unacknowledged"]),
        ("unacknowledged, not applied", r["unacknowledged_not_applied"]),
        ("shared-row sum mismatches", r["shared_row_mismatches"]),
    ]
    for name, n in sorted(r["errors_by_type"].items()):
        rows.append((f"errors: {name}", n))
    if not r["errors_by_type"]:
        rows.append(("errors", 0))
    print(f"{'metric':<46} {'value':>10}")
    for label, value in rows:
        print(f"{label:<46} {fmt(value):>10}")
    print(f"{'verdict':<46} {'ok' if r['ok'] else 'FAILED':>10}")
    for p in r["problems"][:20]:
        print("  ", p)
    for n in r["notes"]:
        print("  note:", n)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the fault phase")
    ap.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    ap.add_argument(
        "--kinds",
        default="kill,pause,flood",
        help=f"comma-separated fault kinds out of {','.join(KINDS)} (default kill,pause,flood)",
    )
    ap.add_argument(
        "--big-mb",
        type=float,
        default=0.0,
        help="make partition 0 this large and checkpoint often (costs about 3x this in RAM)",
    )
    ap.add_argument("--checkpoint-interval", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=3, help="writer processes")
    ap.add_argument(
        "--dense",
        action="store_true",
        help="each writer also pushes a 2 MiB dense tensor (through shared memory)",
    )
    ap.add_argument("--client-timeout", type=float, default=10.0, help="per-request timeout")
    ap.add_argument("--heartbeat-interval", type=float, default=0.2)
    ap.add_argument("--liveness", type=int, default=5)
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--workdir", help="keep the logs and data here (default: a temporary dir)")
    ap.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="of the broker and shards (their logs are in --workdir)",
    )
    # Writer process mode (started by the coordinator).
    ap.add_argument("--writer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--client", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.writer and (args.seconds <= 0 or args.clients < 1):
        ap.error("--seconds must be > 0 and --clients >= 1")
    return args


def main() -> int:
    args = parse_args()
    if args.writer:
        return asyncio.run(writer_main(args))
    nemesis = Nemesis(args)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # Also where SIGINT was ignored at start (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A hard bound on the whole run: setup, faults, the final check.
    bound = args.seconds + 300 + (args.big_mb / 2 if args.big_mb > 0 else 0)
    timer = threading.Timer(bound, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.daemon = True
    timer.start()
    try:
        r = asyncio.run(asyncio.wait_for(nemesis.main(), bound))
    except KeyboardInterrupt:
        print("zps nemesis: interrupted; stopping every process", file=sys.stderr)
        return 130
    except Exception as e:  # set-up failed or a bound expired: nothing was checked
        print(f"zps nemesis: the run failed before the check: {e!r}", file=sys.stderr)
        return 2
    finally:
        timer.cancel()
        nemesis.shutdown()
    print_table(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2, default=str))
    if not r["checked"]:
        return 2
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
