"""Command lines: ``zps-server {broker,shard,status,demo}`` and ``zps-worker``.

``main`` functions take ``argv`` and return an exit code; they build the
config from flags, set up logging, and run the driver on (uv)loop until
SIGTERM or SIGINT asks it to stop gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

from zps.config import (
    DEFAULT_BIND,
    DEFAULT_BROKER,
    BrokerConfig,
    ClientConfig,
    Heartbeat,
    ShardConfig,
)
from zps.errors import ConfigError, ZpsError

log = logging.getLogger("zps")


def setup_logging(level: str) -> None:
    # journald stamps every line itself; elsewhere, add the time.
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format=f"{stamp}%(levelname)s %(name)s: %(message)s"
    )


def run_async(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _on_signals(stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


def _heartbeat(args: argparse.Namespace) -> Heartbeat:
    return Heartbeat(interval=args.heartbeat_interval, liveness=args.liveness)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=Heartbeat.interval,
        metavar="SECONDS",
        help="heartbeat period (default %(default)s)",
    )
    p.add_argument(
        "--liveness",
        type=int,
        default=Heartbeat.liveness,
        metavar="N",
        help="missed heartbeats before a peer is dead (default %(default)s)",
    )


async def _serve_broker(args: argparse.Namespace) -> int:
    from zps.broker import Broker

    broker = Broker(
        BrokerConfig(
            bind=args.bind,
            partitions=args.partitions,
            replication=args.replication,
            slots=args.slots,
            heartbeat=_heartbeat(args),
            startup_grace=args.startup_grace,
        )
    )
    _on_signals(broker.stop)
    await broker.run()
    return 0


async def _serve_shard(args: argparse.Namespace) -> int:
    from zps.server import ShardServer

    server = ShardServer(
        ShardConfig(
            broker=args.broker,
            heartbeat=_heartbeat(args),
            data_dir=args.data_dir,
            replication_bind=args.replication_bind,
            advertise_host=args.advertise_host,
        )
    )
    _on_signals(server.stop)
    await server.run()
    return 0


async def _status(args: argparse.Namespace) -> int:
    from zps.client import connect

    async with connect(
        args.broker, connect_timeout=args.timeout, timeout=args.timeout, name="zps-server status"
    ) as ps:
        report = await ps.status()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(format_status(report))
    return 0


def format_status(report: dict[str, Any]) -> str:
    b = report.get("broker", {})
    lines = [
        f"broker {b.get('endpoint')}  pid {b.get('pid')}  up {b.get('uptime_s')}s  "
        f"map v{report.get('map_version')}  {report.get('n_partitions')} partitions x "
        f"{report.get('replication')} copies  failovers {report.get('failovers')}",
        f"  routed {b.get('routed')}  unavailable {b.get('unavailable')}  "
        f"malformed {b.get('malformed')}  stale replies {b.get('stale_replies')}",
        "",
        f"{'PART':>4}  {'EPOCH':>5}  {'STATE':<10}  {'PRIMARY':<16}  {'LSN':>9}  "
        "REPLICAS (in sync / lag)",
    ]
    for p in report.get("partitions", []):
        lsn = "-" if p.get("lsn") is None else str(p["lsn"])
        reps = ", ".join(
            f"{r['node']} ({'in sync' if r['in_sync'] else 'catching up'}"
            f"{'' if r.get('lag') is None else ' / ' + str(r['lag'])})"
            for r in p.get("replicas", [])
        )
        lines.append(
            f"{p['partition']:>4}  {p['epoch']:>5}  {p['state']:<10}  "
            f"{p.get('primary') or '-':<16}  {lsn:>9}  {reps or '-'}"
        )
    lines += [
        "",
        f"{'SHARD':<16}  {'ROLE':<8}  {'PART':>4}  {'HOST':<16}  {'PID':>7}  "
        f"{'LSN':>9}  {'SEEN':>6}",
    ]
    for s in report.get("shards", []):
        part = "-" if s.get("partition") is None else str(s["partition"])
        seen = "-" if s.get("last_seen_s") is None else f"{s['last_seen_s']:.1f}s"
        lines.append(
            f"{s['node']:<16}  {s['role']:<8}  {part:>4}  {s['host'][:16]:<16}  "
            f"{s['pid']:>7}  {s['lsn']:>9}  {seen:>6}"
        )
    clients = report.get("clients", [])
    lines += ["", f"{len(clients)} client(s) connected"]
    for c in clients:
        lines.append(f"  {c['node']}  {c['host']} pid {c['pid']}  {c.get('name') or ''}")
    return "\n".join(lines)


def server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zps-server", description="zps parameter server processes"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("broker", help="run the broker (routing, cluster map, heartbeats)")
    b.add_argument("--bind", default=DEFAULT_BIND, help="endpoint to bind (default %(default)s)")
    b.add_argument(
        "--partitions",
        type=int,
        default=BrokerConfig.partitions,
        help="number of partitions (default %(default)s)",
    )
    b.add_argument(
        "--slots",
        type=int,
        default=BrokerConfig.slots,
        help="hash slots (fixed for the cluster's life; default %(default)s)",
    )
    b.add_argument(
        "--replication",
        type=int,
        default=BrokerConfig.replication,
        help="copies of each partition: a primary and N-1 hot replicas (default %(default)s)",
    )
    b.add_argument(
        "--startup-grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="after start, grant only claims of shards that already serve a "
        "partition for this long (default: two liveness timeouts)",
    )
    _add_common(b)

    s = sub.add_parser("shard", help="run a shard (serves one partition)")
    s.add_argument("--broker", default=DEFAULT_BROKER, help="broker endpoint (default %(default)s)")
    s.add_argument("--data-dir", default=None, help="directory for checkpoints")
    s.add_argument(
        "--replication-bind",
        default=ShardConfig.replication_bind,
        help="endpoint replicas connect to (default %(default)s: any free port)",
    )
    s.add_argument(
        "--advertise-host",
        default=None,
        help="host replicas use to reach this shard (default: the local address "
        "on the route to the broker)",
    )
    _add_common(s)

    st = sub.add_parser("status", help="show partitions, shards and clients")
    st.add_argument(
        "--broker", default=DEFAULT_BROKER, help="broker endpoint (default %(default)s)"
    )
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    st.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])

    d = sub.add_parser("demo", help="train a model on a whole local cluster (no arguments needed)")
    d.add_argument("--epochs", type=int, default=None, help="training epochs (default: model's)")
    d.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    d.add_argument("--partitions", type=int, default=2, help="partitions (default 2)")
    d.add_argument(
        "--replication", type=int, default=2, help="copies of each partition (default 2)"
    )
    d.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return parser


def server_main(argv: Sequence[str] | None = None) -> int:
    args = server_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        match args.command:
            case "broker":
                return run_async(_serve_broker(args))
            case "shard":
                return run_async(_serve_shard(args))
            case "status":
                return run_async(_status(args))
            case "demo":
                from zps.demo import run_demo

                return run_demo(
                    epochs=args.epochs,
                    n_workers=args.workers,
                    n_partitions=args.partitions,
                    replication=args.replication,
                )
    except ConfigError as e:
        print(f"zps-server: invalid configuration: {e}", file=sys.stderr)
        return 2
    except ZpsError as e:
        print(f"zps-server {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def load_function(spec: str) -> Callable[..., Any]:
    """Import ``MODULE:FUNCTION`` (the current directory is on the path)."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"expected MODULE:FUNCTION, got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {module_name!r}: {e}") from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"module {module_name!r} has no function {func_name!r}")
    return cast(Callable[..., Any], func)


def worker_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zps-worker",
        description="Run FUNCTION(ps, *ARGS) with a connected client: an async function gets "
        "zps.Client, a plain one the blocking zps.SyncClient.",
    )
    parser.add_argument("--broker", default=DEFAULT_BROKER, help="broker endpoint")
    parser.add_argument(
        "--timeout",
        type=float,
        default=ClientConfig.timeout,
        help="seconds before an unanswered request fails",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=ClientConfig.connect_timeout,
        help="seconds to wait for the broker at start-up",
    )
    parser.add_argument("--name", default="", help="a name shown by `zps-server status`")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument("function", metavar="MODULE:FUNCTION")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        func = load_function(args.function)
        config = ClientConfig(
            timeout=args.timeout,
            connect_timeout=args.connect_timeout,
            name=args.name or args.function,
        )
        if inspect.iscoroutinefunction(func):
            return run_async(_run_async_worker(func, args.broker, config, args.args))
        from zps.sync import connect_sync

        with connect_sync(args.broker, config) as ps:
            result = func(ps, *args.args)
        return int(result) if isinstance(result, int) else 0
    except ConfigError as e:
        print(f"zps-worker: {e}", file=sys.stderr)
        return 2
    except ZpsError as e:
        print(f"zps-worker: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def _run_async_worker(
    func: Callable[..., Any], broker: str, config: ClientConfig, args: list[str]
) -> int:
    from zps.client import Client

    async with Client(broker, config) as ps:
        result = await func(ps, *args)
    return int(result) if isinstance(result, int) else 0
