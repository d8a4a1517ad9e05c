"""``python -m zps.testing.sim``: run seeds, report failures with what replays them.

By default every part runs the real code (the real client, shards and brokers on the
simulated loop, transport, clock and disk); ``--stand-in``, ``--real-broker`` and
``--real-shard`` put the simulator's stand-ins in place of the parts they name."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import deque
from collections.abc import Generator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from typing import Any

from zps.testing.sim import bugs, realbugs
from zps.testing.sim.checks import Result
from zps.testing.sim.faults import FAULTS, NAMED, PAIR, RESET, RESHARD, ROUTERS, STORAGE
from zps.testing.sim.world import run_seed


def _faults(text: str) -> list[str]:
    names = [f for f in text.split(",") if f]
    unknown = [f for f in names if f not in NAMED]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault {', '.join(unknown)}; known: {', '.join(NAMED)}"
        )
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zps.testing.sim", description=__doc__)
    p.add_argument("--seeds", type=int, default=100, help="how many seeds to run (default 100)")
    p.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--trace", action="store_true", help="print each run's trace")
    p.add_argument(
        "--faults",
        type=_faults,
        default=list(FAULTS),
        help=f"comma-separated faults to draw from (default all: {','.join(FAULTS)}; "
        f"also {','.join(f for f in NAMED if f not in FAULTS and f not in PAIR)}; "
        f"{','.join(PAIR)} runs a broker pair)",
    )
    p.add_argument(
        "--bug",
        choices=sorted({*bugs.BUGS, *realbugs.CLIENT_BUGS}),
        help="re-introduce a known defect (those of the client's driver need the real client, "
        "the default)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--stand-in",
        dest="mode",
        action="store_const",
        const="stand-in",
        help="run the simulator's stand-ins for the broker, shards and clients (the pure cores "
        "under small drivers of the simulator's own: about three to five times the seeds a "
        "minute of the real code, for long runs)",
    )
    mode.add_argument(
        "--real-broker",
        dest="mode",
        action="store_const",
        const="real-broker",
        help="run the real broker (zps.broker.broker.Broker; with failover the real pair, "
        "zps.broker.pair.Pair) with the stand-in shards and clients",
    )
    mode.add_argument(
        "--real-shard",
        dest="mode",
        action="store_const",
        const="real-shard",
        help="run the real broker and the real shard (zps.shard.server.ShardServer) for every "
        "shard, with the stand-in clients",
    )
    mode.add_argument(
        "--real-client",
        dest="mode",
        action="store_const",
        const="real-client",
        help="run the real code everywhere: the real client (zps.connect) for every client, "
        "the real shards and brokers (the default)",
    )
    p.set_defaults(mode="real-client")
    p.add_argument("--keep-going", action="store_true", help="run every seed after a failure")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="worker processes running seeds side by side (default 1); each seed's run is "
        "the same in any of them, and results are reported in seed order",
    )
    return p


def _one(
    seed: int,
    faults: Sequence[str] | None,
    trace: bool,
    bug: str | None,
    real_broker: bool = False,
    real_shard: bool = False,
    real_client: bool = False,
) -> Result:
    real = real_broker or real_shard or real_client
    real_shard = real_shard or real_client
    stand_in_bug = bug if bug in bugs.BUGS else None
    with (
        bugs.patched(stand_in_bug),
        realbugs.patched(bug if real else None, real_shard=real_shard, real_client=real_client),
    ):
        kw: dict[str, Any] = {
            "real_broker": real_broker,
            "real_shard": real_shard,
            "real_client": real_client,
        }
        if faults is None:
            return run_seed(seed, trace=trace, **kw)
        return run_seed(seed, faults=faults, trace=trace, **kw)


def run_seeds(
    seeds: Sequence[int],
    faults: Sequence[str] | None = None,
    *,
    trace: bool = False,
    bug: str | None = None,
    jobs: int = 1,
    pool: Executor | None = None,
    real_broker: bool = False,
    real_shard: bool = False,
    real_client: bool = False,
) -> Generator[Result]:
    """The runs of ``seeds`` (``faults``: the default ones if None), in seed order: in this
    process (``jobs`` 1, no ``pool``), else side by side in ``pool`` or in a pool of ``jobs``
    worker processes, at most :data:`AHEAD` seeds submitted ahead of the one reported (a
    long run holds no more).  Unlike the command line, whose default is the real code,
    this runs the stand-ins unless told otherwise (``real_*``).  Each seed's run is the
    same in any process.  Closing the generator early cancels the seeds not yet started.
    ``real_broker``: the real broker runs (zps.testing.sim.realbroker), not the
    simulator's stand-in; ``real_shard``: the
    real shards too (zps.testing.sim.realshard); ``real_client``: the real clients too
    (zps.testing.sim.realclient)."""
    if pool is None and jobs == 1:
        for seed in seeds:
            yield _one(seed, faults, trace, bug, real_broker, real_shard, real_client)
        return
    own = pool is None
    ex = ProcessPoolExecutor(jobs) if pool is None else pool
    todo = iter(seeds)
    ahead: deque[Future[Result]] = deque()
    try:
        while True:
            for seed in itertools.islice(todo, AHEAD - len(ahead)):
                ahead.append(
                    ex.submit(_one, seed, faults, trace, bug, real_broker, real_shard, real_client)
                )
            if not ahead:
                return
            yield ahead.popleft().result()
    finally:
        for f in ahead:
            f.cancel()
        if own:
            ex.shutdown(cancel_futures=True)


#: What each mode of the command line runs of the real code (``run_seeds``' flags).
MODES: dict[str, dict[str, bool]] = {
    "stand-in": {"real_broker": False, "real_shard": False, "real_client": False},
    "real-broker": {"real_broker": True, "real_shard": False, "real_client": False},
    "real-shard": {"real_broker": True, "real_shard": True, "real_client": False},
    "real-client": {"real_broker": True, "real_shard": True, "real_client": True},
}

#: Seeds submitted to the workers ahead of the one being reported.
AHEAD = 16


def report(
    r: Result,
    bug: str | None,
    faults: Sequence[str],
    *,
    real_broker: bool = False,
    real_shard: bool = False,
    real_client: bool = False,
) -> str:
    replay = f"python -m zps.testing.sim --seed {r.seed} --seeds 1 --trace"
    if real_client:
        pass  # the default
    elif real_shard:
        replay += " --real-shard"
    elif real_broker:
        replay += " --real-broker"
    else:
        replay += " --stand-in"
    if bug:
        replay += f" --bug {bug}"
    if list(faults) != list(FAULTS):
        replay += f" --faults {','.join(faults)}"
    lines = [f"seed {r.seed}: FAILED (trace {r.digest})", *("  " + f for f in r.failures[:10])]
    lines += ["  fault schedule:", *("    " + s for s in r.schedule or ["(none)"])]
    lines.append(f"  replay: {replay}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.seeds < 1:
        parser().error("--seeds must be >= 1")
    if args.jobs < 1:
        parser().error("--jobs must be >= 1")
    mode = MODES[args.mode]
    needs_client = [f for f in args.faults if f in (*RESHARD, *ROUTERS, *RESET)]
    if needs_client and not mode["real_client"]:
        parser().error(
            f"--faults {','.join(needs_client)} needs the real clients: drop --{args.mode}, "
            "the default runs them"
        )
    needs_shard = [f for f in args.faults if f in ("shm", *STORAGE)]
    if needs_shard and not mode["real_shard"]:
        parser().error(
            f"--faults {','.join(needs_shard)} needs the real shards: drop --{args.mode}, "
            "the default runs them"
        )
    if args.bug in realbugs.CLIENT_BUGS and not mode["real_client"]:
        parser().error(
            f"--bug {args.bug} is a defect of the real client: drop --{args.mode}, "
            "the default runs it"
        )
    t0 = time.monotonic()
    failed: list[int] = []
    unavailable = 0
    n = 0
    seeds = range(args.seed, args.seed + args.seeds)
    results = run_seeds(
        seeds,
        args.faults,
        trace=args.trace,
        bug=args.bug,
        jobs=args.jobs,
        real_broker=mode["real_broker"],
        real_shard=mode["real_shard"],
        real_client=mode["real_client"],
    )
    for r in results:
        seed = r.seed
        n += 1
        unavailable += bool(r.unavailable)
        if args.trace:
            print("\n".join(r.trace))
            print(f"seed {seed}: trace {r.digest}, {r.events} events, {r.acked} acknowledged, "
                  f"{r.maybe} failed or unanswered")  # fmt: skip
        if not r.ok:
            failed.append(seed)
            print(
                report(
                    r,
                    args.bug,
                    args.faults,
                    **mode,
                ),
                flush=True,
            )
            if not args.keep_going:
                results.close()  # the seeds not started are cancelled, the pool shut down
                break
        if n % PROGRESS == 0 and n < args.seeds:
            print(_summary(n, t0, failed, unavailable), file=sys.stderr, flush=True)
    print(_summary(n, t0, failed, unavailable), file=sys.stderr)
    return 1 if failed else 0


#: Seeds between two progress lines of a long run.
PROGRESS = 1000


def _summary(n: int, t0: float, failed: list[int], unavailable: int) -> str:
    took = time.monotonic() - t0
    return (
        f"{n} seeds in {took:.1f}s ({60 * n / took:.0f} per minute): {len(failed)} failed"
        f"{' ' + str(failed) if failed else ''}; {unavailable} ended with a partition "
        "unavailable"
    )
