"""Big partitions: what a partition of N GB costs on every bulk path.

    .venv/bin/python bench/big_partition.py --gb 1 [--kills 10] [--json out.json]

One partition holding an embedding of ``rows x 32`` float32 with Adagrad (rows and
state: 256 bytes a row, ``--gb`` GB), replication 2, one spare, every shard with a
data dir under a temporary directory (default durability), default heartbeats (0.2 s
x 5).  A writer pushes 512 random rows (acks="all") in a loop throughout, and a
small exact-sum load (zps.testing.ExactSumLoad) checks that nothing acknowledged is
lost or doubled.  It measures, in this order:

- **failover** (``--kills`` times): SIGKILL the primary; the longest gap between two
  acknowledgements of the writer around the kill (from the last one before it until
  the new copy is in sync), the time from the kill until the spare that replaces the
  lost copy is in sync, and that spare's catch-up alone (from the moment the broker
  lists it until it is in sync); then the killed shard is started again on its data
  dir as the next spare.  Each kill's time and the two acknowledgements around its
  longest gap are printed in the logs' clock (UTC), to be read against ``--workdir``'s
  logs.  Peak memory (private memory and tables' memory files) of the
  primary and of the joining copy during the
  catch-up (sampled every 20 ms, /proc);
- **checkpoint**: ``checkpoint()`` of the partition (the client call), against the
  file's size;
- **restart**: SIGTERM the replica, start it again on its data dir; until its log says
  it restored the partition (process start included), against the checkpoint's size,
  and the checkpoint's read alone (the shard's log line).  The processes cache their
  bytecode (:func:`zps.testing.bytecode.cache_bytecode`), as an installed zps has it:
  a start measures the imports, not compiling them;
- **reshard**: ``zps-server scale --partitions 2`` (the spare becomes the new
  partition's primary); until the last move is published, against the bytes moved.

Prints one table (path, bytes, seconds, GB/s; 1 GB = 10^9 bytes) and the stall
percentiles.  Every process is stopped on the way out (Ctrl-C and SIGTERM too); with
``--workdir`` the logs are kept there (``DIR/logs``), and with ``--keep-data`` the data dirs
too: about 10x the partition on disk (each shard keeps 3 checkpoints and its log), which the
caller removes.  Memory, at
the peak of a catch-up: the primary its partition and the pages written meanwhile
(cuts are frozen versions, not copies), the joining copy its tables and a window of
chunks, the restarted shard its partition, the writer's client its pushes: it
refuses to start (exit status 2) when MemAvailable is below 4x the partition, unless
``--force``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zps.client.client import connect
from zps.optim import Adagrad
from zps.testing import DataDirCluster, ExactSumLoad, Proc, exit_on_sigterm, free_port
from zps.testing.bytecode import cache_bytecode

TABLE = "big"
PUSH_IDS = 512
FILL_BATCH = 131_072
#: A restarted shard's log line for its checkpoint's read (zps.shard.restore).
READ_LINE = re.compile(r"read ckpt-\S+: \d+ MB in ([0-9.]+)s")


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def held_mb(pid: int) -> float:
    """What ``pid`` holds (MB): its private memory and every page of its tables' memory
    files, mapped or not (a frozen cut's pages stop being mapped by the table once
    written, so its resident size alone would miss them)."""
    files: dict[tuple[int, int], int] = {}  # each file once (a frozen cut holds a second fd)
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith("/memfd:zps-rows"):
                    st = os.stat(fd)
                    files[st.st_dev, st.st_ino] = st.st_blocks * 512
    except OSError:
        return 0.0
    return rss_mb(pid, "RssAnon") + sum(files.values()) / 2**20


def wall(t: float) -> str:
    """A ``time.monotonic()`` instant as the time of day the logs use (UTC, ms)."""
    at = time.time() - (time.monotonic() - t)
    return time.strftime("%H:%M:%S", time.gmtime(at)) + f",{int(at % 1 * 1000):03d}"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


class Sampler:
    """The peak of what some processes hold (MB, :func:`held_mb`), sampled every 20 ms
    in a thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = {name: held_mb(pid) for name, pid in pids.items()}
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], held_mb(pid))

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._thread.join()
        return {n: {"start_mb": self.start[n], "peak_mb": self.peak[n]} for n in self.pids}


@dataclass
class Writer:
    """Pushes of PUSH_IDS random rows, acks="all", one at a time; each ack's time."""

    rows: int
    dim: int
    acks: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def run(self, address: str, stop: asyncio.Event) -> None:
        rng = np.random.default_rng(7)
        grads = np.full((PUSH_IDS, self.dim), 0.01, dtype=np.float32)
        async with connect(address, timeout=60, name="bench-writer") as ps:
            while not stop.is_set():
                ids = rng.choice(self.rows, PUSH_IDS, replace=False).astype(np.int64)
                try:
                    await ps.push_rows(TABLE, ids, grads)
                except Exception as e:  # counted: the run reports every caller error
                    self.errors.append(repr(e))
                    await asyncio.sleep(0.05)
                    continue
                self.acks.append(time.monotonic())

    def worst_gap(self, t_kill: float, t_end: float) -> tuple[float, float, float]:
        """The longest time between two acknowledgements, from the last one before
        ``t_kill`` to the first one after ``t_end``: (seconds, its first, its last)."""
        acks = self.acks
        before = [a for a in acks if a <= t_kill]
        times = [before[-1] if before else t_kill]
        times += [a for a in acks if a > t_kill and a <= t_end]
        after = [a for a in acks if a > t_end]
        if after:
            times.append(after[0])
        if len(times) < 2:
            return t_end - times[0], times[0], t_end
        i = int(np.diff(times).argmax())
        return times[i + 1] - times[i], times[i], times[i + 1]


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, logs: Path) -> None:
        self.args = args
        self.root = root
        logs.mkdir(parents=True, exist_ok=True)
        self.c = DataDirCluster(
            partitions=1,
            replication=2,
            heartbeat_interval=args.heartbeat,
            liveness=args.liveness,
            workdir=logs,
            broker_data_dir=root / "broker",
            log_level="info",
        )
        self.c.port = free_port()
        self.dirs: dict[int, Path] = {}  # pid -> data dir
        self.rows = int(args.gb * 1e9 / (args.dim * 4 * 2))
        self.partition_bytes = self.rows * args.dim * 4 * 2
        self.results: list[dict[str, Any]] = []

    def start_shard(self, data_dir: Path) -> Proc:
        extra = []
        if self.args.checkpoint_interval is not None:
            extra = ["--checkpoint-interval", str(self.args.checkpoint_interval)]
        p = self.c.start_shard(data_dir, extra)
        self.dirs[p.pid] = data_dir
        return p

    def status(self) -> dict[str, Any]:
        return self.c.status(timeout=10)

    def shards_by_role(self, s: dict[str, Any]) -> dict[str, int]:
        return {x["role"]: int(x["pid"]) for x in s["shards"]}

    def whole(self, s: dict[str, Any]) -> bool:
        return self.c.healthy(s) and len(s["shards"]) >= 3

    def row(self, path: str, nbytes: int, seconds: float, **extra: Any) -> None:
        r = {"path": path, "bytes": nbytes, "seconds": round(seconds, 3)}
        r["gb_per_s"] = round(nbytes / seconds / 1e9, 3) if seconds > 0 else None
        r.update(extra)
        self.results.append(r)
        print(f"  {path}: {nbytes / 1e9:.3f} GB in {seconds:.2f}s", flush=True)

    async def fill(self) -> float:
        t0 = time.monotonic()
        dim = self.args.dim
        async with connect(self.c.address, timeout=600) as ps:
            await ps.create_embedding(TABLE, dim, optimizer=Adagrad(lr=0.1))
            grads = np.random.default_rng(0).random((FILL_BATCH, dim), dtype=np.float32)
            for a in range(0, self.rows, FILL_BATCH):
                ids = np.arange(a, min(self.rows, a + FILL_BATCH), dtype=np.int64)
                await ps.push_rows(TABLE, ids, grads[: ids.size])
        return time.monotonic() - t0

    async def wait(self, cond: Any, timeout: float, what: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.c.wait_for, cond, timeout, what)

    async def one_kill(self, k: int, writer: Writer) -> dict[str, Any]:
        s = await self.wait(self.whole, 600, "2 copies in sync and a spare")
        roles = self.shards_by_role(s)
        primary, replica, spare = roles["primary"], roles["replica"], roles["spare"]
        epoch = s["partitions"][0]["epoch"]
        await asyncio.sleep(0.5)  # the writer flows
        sampler = Sampler({"primary": replica, "joining": spare})
        proc = self.c.proc_by_pid(primary)
        t_kill = time.monotonic()
        proc.popen.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.popen.wait, 10)
        t_listed = None
        deadline = time.monotonic() + 1800
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError("the new copy never caught up")
            s = await asyncio.to_thread(self.status)
            p = s["partitions"][0]
            if p["epoch"] > epoch and p["replicas"]:
                if p["replicas"][0]["in_sync"]:
                    t_sync = time.monotonic()
                    break
                t_listed = t_listed or time.monotonic()
            await asyncio.sleep(0.02)
        memory = sampler.stop()
        await asyncio.sleep(0.3)  # an ack after the catch-up ends the last gap
        stall, gap_from, gap_to = writer.worst_gap(t_kill, t_sync)
        catch_up = t_sync - (t_listed or t_kill)
        print(
            f"kill {k + 1} at {wall(t_kill)} (pid {primary}): the longest gap between acks "
            f"from {wall(gap_from)} to {wall(gap_to)}",
            flush=True,
        )
        print(
            f"kill {k + 1}: longest gap between acks {stall:.3f}s, in sync after "
            f"{t_sync - t_kill:.2f}s (catch-up {catch_up:.2f}s), peak memory primary "
            f"{memory['primary']['peak_mb']:.0f} MB, joining {memory['joining']['peak_mb']:.0f} MB",
            flush=True,
        )
        # The killed shard, started again on its data dir, is the next spare.
        self.start_shard(self.dirs[primary])
        return {
            "killed_at": wall(t_kill),
            "gap": [wall(gap_from), wall(gap_to)],
            "stall_s": stall,
            "in_sync_s": t_sync - t_kill,
            "catch_up_s": catch_up,
            "memory": memory,
        }

    async def kills(self, writer: Writer) -> list[dict[str, Any]]:
        out = []
        for k in range(self.args.kills):
            out.append(await self.one_kill(k, writer))
        await self.wait(self.whole, 600, "2 copies in sync and a spare")
        return out

    async def checkpoint(self) -> None:
        async with connect(self.c.address, timeout=600) as ps:
            t0 = time.monotonic()
            report = await ps.checkpoint(timeout=600)
            took = time.monotonic() - t0
        path = Path(report[0]["path"])
        self.row("checkpoint (client call)", path.stat().st_size, took, file=str(path))

    async def restart(self) -> None:
        s = await self.wait(self.whole, 600, "2 copies in sync and a spare")
        pid = self.shards_by_role(s)["replica"]
        proc, data_dir = self.c.proc_by_pid(pid), self.dirs[pid]
        t0 = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.popen.wait, 300)
        stopped = time.monotonic() - t0
        ckpts = sorted(
            (data_dir / "partition-0").glob("ckpt-*.zps"), key=lambda p: p.stat().st_mtime
        )
        nbytes = ckpts[-1].stat().st_size if ckpts else 0
        t1 = time.monotonic()
        new = self.start_shard(data_dir)
        while "restored partition" not in new.log():
            if not new.alive() or time.monotonic() - t1 > 600:
                raise RuntimeError(f"the restarted shard did not restore:\n{new.log()[-3000:]}")
            await asyncio.sleep(0.02)
        restored = time.monotonic() - t1
        await self.wait(lambda s: any(x["pid"] == new.pid for x in s["shards"]), 600, "registered")
        registered = time.monotonic() - t1
        read = READ_LINE.search(new.log())
        self.row(
            "restart from the data dir (start to restored)",
            nbytes,
            restored,
            stop_s=round(stopped, 3),
            registered_s=round(registered, 3),
            read_s=float(read.group(1)) if read else None,
        )
        if read:
            print(f"    of which the checkpoint's read (the shard's log): {read.group(1)}s")

    async def reshard(self) -> None:
        await self.wait(self.whole, 600, "2 copies in sync and a spare")
        t0 = time.monotonic()
        answer = await asyncio.to_thread(self.c.scale, 2, timeout=60)
        if not answer["ok"]:
            raise RuntimeError(f"scale refused: {answer}")
        marks: dict[str, float] = {}

        def moved(s: dict[str, Any]) -> bool:
            r = s.get("reshard") or {}
            counts = [p["slots"] for p in s["partitions"]]
            if len(counts) == 2 and max(counts) - min(counts) <= 1 and "move" not in r:
                marks.setdefault("moved", time.monotonic())
                marks["bytes"] = r.get("bytes_moved", 0)
                return True
            return False

        await self.wait(moved, 3600, "the moves")
        took = marks["moved"] - t0
        self.row("reshard 1 -> 2 (bytes moved)", int(marks["bytes"]), took)

    async def run(self) -> dict[str, Any]:
        c, args = self.c, self.args
        c.start_broker()
        for name in ("a", "b", "spare"):
            self.start_shard(self.root / name)
        await self.wait(self.whole, 60, "2 copies in sync and a spare")
        filled = await self.fill()
        await self.wait(self.whole, 600, "the replica in sync with the table")
        print(
            f"{self.rows:,} rows x {args.dim} float32 + Adagrad state: "
            f"{self.partition_bytes / 1e9:.2f} GB, filled in {filled:.1f}s",
            flush=True,
        )
        exact = ExactSumLoad(c.address, clients=1, timeout=60)
        await exact.setup()
        writer = Writer(self.rows, args.dim)
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(writer.run(c.address, stop)),
            asyncio.create_task(exact.run(stop)),
        ]
        try:
            kills = await self.kills(writer) if args.kills else []
            for k in kills:
                self.row(
                    "catch-up of a new copy (listed to in sync)",
                    self.partition_bytes,
                    k["catch_up_s"],
                )
            if "checkpoint" not in args.skip:
                await self.checkpoint()
            if "restart" not in args.skip:
                await self.restart()
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        problems = await exact.verify()
        if "reshard" not in args.skip:
            await self.reshard()
        return {
            "command": " ".join(sys.argv),
            "rows": self.rows,
            "dim": args.dim,
            "partition_bytes": self.partition_bytes,
            "fill_s": round(filled, 1),
            "kills": kills,
            "paths": self.results,
            "writer_pushes": len(writer.acks),
            "writer_errors": writer.errors[:20],
            "writer_error_count": len(writer.errors),
            "exact_sum_problems": problems,
            "loadavg": os.getloadavg(),
        }


def report(r: dict[str, Any]) -> None:
    print()
    print(f"partition: {r['rows']:,} rows x {r['dim']} float32 + Adagrad, "
          f"{r['partition_bytes'] / 1e9:.2f} GB; load average {r['loadavg'][0]:.1f}")  # fmt: skip
    print(f"{'path':<58} {'bytes':>15} {'seconds':>8} {'GB/s':>6}")
    rows: dict[str, list[dict[str, Any]]] = {}
    for p in r["paths"]:
        rows.setdefault(p["path"], []).append(p)
    for path, ps in rows.items():
        secs = [p["seconds"] for p in ps]
        s = float(np.median(secs))
        label = path if len(ps) == 1 else f"{path} (median of {len(ps)})"
        print(f"{label:<58} {ps[0]['bytes']:>15,} {s:>8.2f} {ps[0]['bytes'] / s / 1e9:>6.3f}")
    kills = r["kills"]
    if kills:
        stalls = [k["stall_s"] for k in kills]
        syncs = [k["in_sync_s"] for k in kills]
        print()
        print(f"{'after a primary SIGKILL':<40} {'p50 s':>7} {'p99 s':>7} {'max s':>7}")
        for label, vals in (
            ("longest gap between acks", stalls),
            ("kill to the new copy in sync", syncs),
        ):
            p50, p99 = percentile(vals, 50), percentile(vals, 99)
            print(f"{label:<40} {p50:>7.3f} {p99:>7.3f} {max(vals):>7.3f}")
        pri = max(k["memory"]["primary"]["peak_mb"] for k in kills)
        pri0 = min(k["memory"]["primary"]["start_mb"] for k in kills)
        join = max(k["memory"]["joining"]["peak_mb"] for k in kills)
        print(f"peak memory during a catch-up: primary {pri:.0f} MB (at the kill {pri0:.0f} MB), "
              f"joining copy {join:.0f} MB")  # fmt: skip
    verdict = "ok" if not r["exact_sum_problems"] else r["exact_sum_problems"]
    print(f"writer: {r['writer_pushes']} pushes acknowledged, {r['writer_error_count']} errors; "
          f"exact sums: {verdict}")  # fmt: skip


def available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main() -> int:
    # An installed zps starts from the bytecode pip wrote; without this, where the
    # environment sets PYTHONDONTWRITEBYTECODE, a restarted shard's start would include
    # compiling every module of zps.
    cache_bytecode(os.environ)
    exit_on_sigterm()  # a killed run stops its cluster too (see stop() below)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="rows + Adagrad state, GB")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--heartbeat", type=float, default=0.2, help="heartbeat interval (s)")
    ap.add_argument("--liveness", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma-separated: checkpoint,restart,reshard")
    ap.add_argument(
        "--checkpoint-interval",
        type=float,
        help="the shards' seconds between checkpoints (default: theirs; 0: only on shutdown, "
        "so a promoted primary never writes one while it cuts a snapshot: a cut fewer)",
    )
    ap.add_argument(
        "--force", action="store_true", help="run even when the memory it needs looks unavailable"
    )
    ap.add_argument("--workdir", help="keep the logs here (DIR/logs)")
    ap.add_argument(
        "--keep-data",
        action="store_true",
        help="with --workdir, keep the data dirs there too (about 10x the partition)",
    )
    ap.add_argument("--json", help="also write every figure here")
    args = ap.parse_args()
    if args.gb <= 0 or args.kills < 0:
        ap.error("--gb must be positive and --kills at least 0")
    # At the peak of a catch-up: the primary's partition and what is written during
    # the transfer, the joining copy's tables, the restarted shard's partition, and
    # room for the page cache of the checkpoints: about 4x the partition.
    need = 4 * args.gb * 1e9
    available = available_bytes()
    if available is not None and need > available and not args.force:
        print(
            f"a partition of {args.gb:g} GB needs about {need / 1e9:.0f} GB of memory at the "
            f"peak of a catch-up; {available / 1e9:.0f} GB available (MemAvailable).  Pass "
            "--force to run anyway",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="zps-bench-big-") as tmp:
        # The data dirs (about 10x the partition) stay only with --keep-data.
        logs = Path(args.workdir or tmp) / "logs"
        root = Path(args.workdir) if args.workdir and args.keep_data else Path(tmp)
        bench = Bench(args, root, logs)

        def stop(*_: object) -> None:
            # The cluster first: the threads polling it then fail at once, and the
            # event loop can unwind (it waits for them).
            bench.c.stop(timeout=30)
            sys.exit(128 + signal.SIGTERM)

        signal.signal(signal.SIGTERM, stop)
        try:
            result = asyncio.run(bench.run())
        except BaseException:
            print(bench.c.logs()[-6000:], file=sys.stderr)
            raise
        finally:
            bench.c.stop(timeout=60)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = not result["exact_sum_problems"] and not result["writer_error_count"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
