"""Live resharding: how long moving the rows takes, and how long callers stall.

Loads ``--rows`` rows of ``--dim`` float32 into a local cluster of ``--from``
partitions (one shard each, plus spares for the new ones), starts a probe that
pulls and pushes ``--probe-ids`` random ids in a loop (one pull and one push per
turn, each timed), runs ``zps-server scale --partitions --to``, and reports:

- the time from the scale command to the last move published, the bytes the
  broker copied, the moves and the longest fence (slots refused while copied);
- the probe's worst and 99th-percentile call before the moves, during them, and
  during the end of the resharding (the sources dropping the rows they gave away)
  (the worst caller stall);
- the CPU seconds of the broker and each shard during the moves (/proc).

    .venv/bin/python bench/reshard.py --rows 8000000 --dim 32 --from 1 --to 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zps.client.client import connect
from zps.optim import SGD
from zps.testing import LocalCluster


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load_rows(address: str, rows: int, dim: int) -> float:
    t0 = time.monotonic()
    async with connect(address, timeout=600) as ps:
        await ps.create_embedding("bench", dim=dim, optimizer=SGD(lr=0.01))
        step = 250_000
        for a in range(0, rows, step):
            ids = np.arange(a + 1, min(rows, a + step) + 1, dtype=np.int64)
            await ps.set_rows("bench", ids, np.full((ids.size, dim), 0.5, dtype=np.float32))
    return time.monotonic() - t0


async def probe(address: str, rows: int, dim: int, n: int, stop: asyncio.Event, out: list) -> None:  # type: ignore[type-arg]
    rng = np.random.default_rng(1)
    async with connect(address, timeout=600, name="bench-probe") as ps:
        while not stop.is_set():
            ids = rng.integers(1, rows + 1, size=n, dtype=np.int64)
            t0 = time.monotonic()
            await ps.pull_rows("bench", ids)
            t1 = time.monotonic()
            await ps.push_rows("bench", ids, np.ones((n, dim), dtype=np.float32))
            t2 = time.monotonic()
            out.append((t0, t1 - t0, t2 - t1))


def summary(calls: list, since: float, until: float) -> dict:  # type: ignore[type-arg]
    lat = [max(p, q) for t, p, q in calls if since <= t <= until]
    if not lat:
        return {"calls": 0}
    arr = np.array(lat)
    return {
        "calls": len(lat),
        "max_s": round(float(arr.max()), 4),
        "p99_s": round(float(np.percentile(arr, 99)), 4),
        "median_s": round(float(np.median(arr)), 5),
    }


def main() -> int:
    from zps.testing import exit_on_sigterm

    exit_on_sigterm()  # a killed run stops its cluster too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--from", dest="old", type=int, default=1)
    ap.add_argument("--to", dest="new", type=int, default=2)
    ap.add_argument("--max-slots-per-move", type=int, default=0)
    ap.add_argument("--piece-bytes", type=int, default=0)
    ap.add_argument("--probe-ids", type=int, default=64)
    ap.add_argument("--workdir", help="keep the processes' logs here")
    args = ap.parse_args()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="zps-bench-reshard-") as tmp:
        c = LocalCluster(
            partitions=args.old,
            shards=max(args.old, args.new),
            broker_data_dir=Path(tmp) / "broker",
            # Loading 8M rows blocks a shard for seconds at a time (its table grows by
            # copying): a generous liveness, so no shard is declared dead meanwhile.
            heartbeat_interval=0.5,
            liveness=60,
            log_level="info",
            workdir=Path(args.workdir) if args.workdir else None,
        )
        with c:
            loaded = asyncio.run(load_rows(c.address, args.rows, args.dim))
            nbytes = args.rows * (args.dim * 4 + 8)
            print(
                f"loaded {args.rows} rows x {args.dim} float32 ({nbytes / 1e9:.2f} GB with ids) "
                f"in {loaded:.1f}s",
                flush=True,
            )

            async def run() -> dict:  # type: ignore[type-arg]
                calls: list = []  # type: ignore[type-arg]
                stop = asyncio.Event()
                prober = asyncio.create_task(
                    probe(c.address, args.rows, args.dim, args.probe_ids, stop, calls)
                )
                await asyncio.sleep(3.0)
                before_end = time.monotonic()
                pids = {p.name: p.pid for p in c.procs}
                cpu0 = {n: cpu_seconds(pid) for n, pid in pids.items()}
                t0 = time.monotonic()
                answer = await asyncio.to_thread(
                    c.scale,
                    args.new,
                    max_slots=args.max_slots_per_move,
                    piece_bytes=args.piece_bytes,
                )
                assert answer["ok"], answer
                marks: dict[str, float] = {}

                def resharded(s: dict) -> bool:  # type: ignore[type-arg]
                    r = s.get("reshard") or {}
                    counts = [p["slots"] for p in s["partitions"]]
                    if (
                        "moved" not in marks
                        and len(counts) == args.new
                        and max(counts) - min(counts) <= 1
                        and "move" not in r
                    ):
                        marks["moved"] = time.monotonic()  # the last move is published
                    return (
                        r.get("target") is None
                        and s["n_partitions"] == args.new
                        and all(p["state"] in ("ok", "degraded") for p in s["partitions"])
                    )

                status = await asyncio.to_thread(c.wait_for, resharded, 3600, "resharding")
                took = time.monotonic() - t0
                moved = marks.get("moved", t0 + took)
                cpu1 = {n: cpu_seconds(pid) for n, pid in pids.items()}
                await asyncio.sleep(2.0)
                stop.set()
                await prober
                r = status["reshard"]
                return {
                    "command": " ".join(sys.argv),
                    "rows": args.rows,
                    "dim": args.dim,
                    "from": args.old,
                    "to": args.new,
                    "seconds": round(took, 2),
                    "bytes_moved": r["bytes_moved"],
                    "gb_per_s": round(r["bytes_moved"] / took / 1e9, 3),
                    "moves": r["moves_done"],
                    "max_fenced_s": r["max_fenced_s"],
                    "slots": [p["slots"] for p in status["partitions"]],
                    "probe_before": summary(calls, 0, before_end),
                    "probe_during": summary(calls, t0, t0 + took),
                    "probe_moves": summary(calls, t0, moved),
                    "probe_end": summary(calls, moved, t0 + took),
                    "end_s": round(t0 + took - moved, 2),
                    # Calls slower than 0.2 s: (start after the scale command, seconds).
                    "slow_calls": [
                        (round(t - t0, 2), round(max(p, q), 3))
                        for t, p, q in calls
                        if t >= t0 and max(p, q) > 0.2
                    ],
                    "compact_steps": r.get("compact_steps"),
                    "broker_log": [
                        line[line.find("moved ") if "moved " in line else 0 :]
                        for line in c.broker().log().splitlines()
                        if "moved " in line or "gave away" in line
                    ],
                    "cpu_s": {n: round(cpu1[n] - cpu0[n], 2) for n in pids},
                    "loadavg": os.getloadavg(),
                }

            result = asyncio.run(run())
            print(json.dumps(result, indent=2), flush=True)
            if os.environ.get("ZPS_BENCH_LOGS"):
                print(c.broker().log(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
