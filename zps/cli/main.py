"""Command lines: ``zps-server {broker,shard,status,drain,undrain,check-config,keygen,
demo,...}`` and ``zps-worker``.

``main`` functions take ``argv`` and return an exit code: 0 on success, 1 on
a runtime error, 2 on invalid arguments or configuration (``status --check`` and
``check-config`` document their own; ``zps-worker`` exits 3 when its function raised
JobFailedError, 124 when it ignored a stop request for ``worker.stop_grace`` seconds).
Settings come from flags, then the TOML file (``--config``, else ``$ZPS_CONFIG``, else
``/etc/zps/zps.toml`` if it exists), then defaults; the drivers run on uvloop until
SIGTERM or SIGINT asks them to stop gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import keyword
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

from zps.cli import jobs as jobs_cli
from zps.errors import ConfigError, JobFailedError, ZpsError
from zps.ops import logs, malloc
from zps.ops.config import (
    DEFAULT_CONFIG_PATH,
    BrokerConfig,
    Checkpoint,
    ClientConfig,
    Heartbeat,
    Metrics,
    Settings,
    ShardConfig,
    WorkerConfig,
    load_settings,
    override,
)
from zps.ops.systemd import Notifier, client_stall

log = logging.getLogger("zps")
LEVELS = ["debug", "info", "warning", "error"]


def setup_logging(level: str, environ: Mapping[str, str] = os.environ) -> None:
    # Under journald: <N> priority prefixes and no time stamp (see zps.ops.logs).
    logs.setup_logging(level, environ, sys.stderr)


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


def _settings(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    path = args.config or environ.get("ZPS_CONFIG")
    if path:
        return load_settings(path, required=True)
    return load_settings(DEFAULT_CONFIG_PATH, required=False)


def _heartbeat(args: argparse.Namespace, base: Heartbeat) -> Heartbeat:
    return override(
        base,
        interval=args.heartbeat_interval,
        liveness=args.liveness,
        max_loop_stall=getattr(args, "max_loop_stall", None),
    )


def version_line(prog: str) -> str:
    """What ``--version`` prints: the release and the wire protocol version."""
    from zps.protocol.codec import PROTOCOL_VERSION
    from zps.version import __version__

    return f"{prog} {__version__} (zps protocol {PROTOCOL_VERSION})"


def _add_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=version_line(p.prog))


def _add_broker(p: argparse.ArgumentParser) -> None:
    """``--broker`` of the commands that talk to a running cluster."""
    p.add_argument("--broker", help="broker endpoint (default: [worker] of the config)")


def _add_common(p: argparse.ArgumentParser, *, heartbeat: bool = True) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML settings file (default: $ZPS_CONFIG, else {DEFAULT_CONFIG_PATH} "
        "if it exists); flags override it",
    )
    p.add_argument("--log-level", default=None, choices=LEVELS, help="log verbosity (info)")
    if heartbeat:
        p.add_argument(
            "--heartbeat-interval",
            type=float,
            metavar="SECONDS",
            help=f"heartbeat period (default {Heartbeat.interval})",
        )
        p.add_argument(
            "--liveness",
            type=int,
            metavar="N",
            help=f"silent heartbeats before a peer is dead (default {Heartbeat.liveness})",
        )
        p.add_argument(
            "--max-loop-stall",
            type=float,
            metavar="SECONDS",
            help="a shard whose event loop is busy for longer is taken for stuck and "
            f"failed over; until then its heartbeats go on (default {Heartbeat.max_loop_stall})",
        )


def broker_config(args: argparse.Namespace, settings: Settings) -> BrokerConfig:
    base = settings.broker
    return override(
        base,
        bind=args.bind,
        partitions=args.partitions,
        replication=args.replication,
        slots=args.slots,
        startup_grace=args.startup_grace,
        data_dir=args.data_dir,
        pair_role=args.pair_role,
        peer=args.peer,
        peer_bind=args.peer_bind,
        peer_timeout=args.peer_timeout,
        follow=args.follow,
        advertise=args.advertise,
        host=args.host,
        heartbeat=_heartbeat(args, base.heartbeat),
        metrics=override(base.metrics, port=args.metrics_port, host=args.metrics_host),
    )


def shard_config(args: argparse.Namespace, settings: Settings) -> ShardConfig:
    base = settings.shard
    return override(
        base,
        broker=args.broker,
        data_dir=args.data_dir,
        name=args.name,
        replication_bind=args.replication_bind,
        advertise_host=args.advertise_host,
        host=args.host,
        zone=args.zone,
        durability=args.durability,
        durability_interval=args.durability_interval,
        heartbeat=_heartbeat(args, base.heartbeat),
        metrics=override(base.metrics, port=args.metrics_port, host=args.metrics_host),
        checkpoint=override(
            base.checkpoint,
            interval_s=args.checkpoint_interval,
            every_updates=args.checkpoint_every,
            keep=args.checkpoint_keep,
        ),
    )


async def _serve_broker(config: BrokerConfig) -> int:
    from zps.broker.broker import Broker
    from zps.broker.router import Router

    broker: Broker | Router
    if config.follow is not None:
        broker = Router(config, notifier=Notifier.from_env(os.environ))
    else:
        broker = Broker(config, notifier=Notifier.from_env(os.environ))
    _on_signals(broker.stop)
    await broker.run()
    return 0


async def _serve_shard(config: ShardConfig) -> int:
    from zps.shard.server import ShardServer

    server = ShardServer(config, notifier=Notifier.from_env(os.environ))
    _on_signals(server.stop)
    await server.run()
    return 0


#: ``zps-server status --check`` exit codes, as monitoring plugins use them.
CHECK_HEALTHY, CHECK_DEGRADED, CHECK_CRITICAL, CHECK_UNKNOWN = 0, 1, 2, 3


def check_health(report: dict[str, Any]) -> tuple[int, str]:
    """The verdict of ``status --check``: :data:`CHECK_HEALTHY` when every partition
    is ``ok`` (and, for a broker pair, both brokers answer); :data:`CHECK_DEGRADED` when
    every partition is served but some with fewer copies in sync than configured (or
    the broker is still collecting claims), or one broker of a pair does not answer its
    peer; :data:`CHECK_CRITICAL` when a partition is lost or has no shard.  (No answer
    at all is :data:`CHECK_UNKNOWN`, decided by the caller.)"""
    by_state: dict[str, list[int]] = {}
    for p in report.get("partitions", []):
        by_state.setdefault(p["state"], []).append(p["partition"])
    n = len(report.get("partitions", []))

    def listed(*states: str) -> list[str]:
        return [
            f"{s}: partition{'s' if len(by_state[s]) > 1 else ''} "
            + ", ".join(map(str, by_state[s]))
            for s in states
            if s in by_state
        ]

    pair = report.get("pair") or {}
    peer = pair.get("peer") or {}
    alone = (
        [f"broker pair: peer {peer.get('endpoint')} not answering ({pair.get('role')} "
         f"{pair.get('state')} alone)"]
        if pair and not peer.get("alive")
        else []
    )  # fmt: skip
    if "lost" in by_state or "unassigned" in by_state:
        what = [*listed("lost", "unassigned", "degraded", "holding"), *alone]
        return CHECK_CRITICAL, f"CRITICAL: {'; '.join(what)}"
    if "degraded" in by_state or "holding" in by_state or alone:
        return CHECK_DEGRADED, f"DEGRADED: {'; '.join([*listed('degraded', 'holding'), *alone])}"
    return CHECK_HEALTHY, f"OK: {n} partition{'s' if n != 1 else ''} ok" + (
        ", broker pair up" if pair else ""
    )


async def _status(broker: str, client: ClientConfig, as_json: bool, check: bool = False) -> int:
    from zps.client.client import connect

    try:
        async with connect(broker, client) as ps:
            report = await ps.status()
    except ZpsError as e:
        if not check:
            raise
        print(f"UNKNOWN: broker {broker} unreachable: {e}")
        return CHECK_UNKNOWN
    if "router" in report and "partitions" not in report:
        # A routing broker answers with its own report and the active broker's address.
        if check and not as_json:  # it owns nothing: no verdict on the cluster
            print(f"UNKNOWN: {broker} is a routing broker; ask the broker it follows")
            return CHECK_UNKNOWN
        print(json.dumps(report, indent=2, sort_keys=True, default=str) if as_json else (
            f"{report.get('msg', '')}\n"
            + "\n".join(f"  {k}: {v}" for k, v in sorted(report["router"].items()))
        ))  # fmt: skip
        return CHECK_UNKNOWN if check else 0
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    if check:
        code, verdict = check_health(report)
        if not as_json:
            print(verdict)
        return code
    if not as_json:
        print(format_status(report))
    return 0


async def _reset_partition(broker: str, client: ClientConfig, partition: int) -> int:
    from zps.client.client import connect
    from zps.protocol.codec import MsgType
    from zps.protocol.messages import StatusRequest

    request = StatusRequest(reset_partition=partition, accept_data_loss=True)
    async with connect(broker, client) as ps:
        # A STATUS call that carries the command; the report says what came of it.
        report = await ps._broker_call(MsgType.STATUS, request.to_wire())
    result = report.get("reset") or {"ok": False, "msg": "the broker did not answer the reset"}
    print(result["msg"], file=sys.stdout if result["ok"] else sys.stderr)
    return 0 if result["ok"] else 1


async def _drain(broker: str, client: ClientConfig, node: str, *, undo: bool) -> int:
    from zps.client.client import connect
    from zps.protocol.codec import MsgType
    from zps.protocol.messages import StatusRequest

    request = StatusRequest(undrain=node) if undo else StatusRequest(drain=node)
    async with connect(broker, client) as ps:
        # A STATUS call that carries the command; the report says what came of it.
        report = await ps._broker_call(MsgType.STATUS, request.to_wire())
    result = report.get("drain") or {"ok": False, "msg": "the broker did not answer"}
    print(result["msg"], file=sys.stdout if result["ok"] else sys.stderr)
    return 0 if result["ok"] else 1


async def _scale(
    broker: str,
    client: ClientConfig,
    partitions: int | None,
    *,
    cancel: bool,
    wait: float,
    max_slots: int = 0,
    piece_bytes: int = 0,
) -> int:
    """``zps-server scale``: ask the active broker to reshard (or cancel); with ``--wait``,
    poll its report until the resharding is over."""
    import asyncio
    import time

    from zps.client.client import connect
    from zps.protocol.codec import MsgType
    from zps.protocol.messages import StatusRequest

    request = StatusRequest(
        scale=partitions,
        scale_cancel=cancel,
        scale_max_slots=max_slots,
        scale_piece_bytes=piece_bytes,
    )
    async with connect(broker, client) as ps:
        report = await ps._broker_call(MsgType.STATUS, request.to_wire())
        result = report.get("scale") or {"ok": False, "msg": "the broker did not answer"}
        print(result["msg"], file=sys.stdout if result["ok"] else sys.stderr)
        if not result["ok"]:
            return 1
        deadline = time.monotonic() + wait
        while wait > 0:
            reshard = report.get("reshard") or {}
            if reshard.get("target") is None:
                print(_slot_line(report))
                return 0
            if time.monotonic() > deadline:
                print(
                    f"still resharding after {wait:g}s: {_reshard_line(reshard)}", file=sys.stderr
                )
                return 1
            await asyncio.sleep(0.5)
            report = await ps.status()
    return 0


def _slot_line(report: dict[str, Any]) -> str:
    slots = ", ".join(f"{p['partition']}: {p.get('slots', '?')}" for p in report["partitions"])
    return f"{len(report['partitions'])} partitions (slots {slots})"


def _reshard_line(r: dict[str, Any]) -> str:
    move = r.get("move")
    now = (
        f"moving {move['slots']} slots {move['source']} -> {move['dest']} ({move['stage']}, "
        f"{move.get('bytes', 0)} bytes copied)"
        if move
        else "planning"
    )
    return (
        f"to {r['target']} partitions: {now}; {r['moves_done']} moves done "
        f"({r['slots_moved']} slots, {r['bytes_moved']} bytes), longest fence "
        f"{r['max_fenced_s']}s"
        + (f"; last error: {r['last_error']}" if r.get("last_error") else "")
    )


async def _checkpoint(broker: str, client: ClientConfig, timeout: float, as_json: bool) -> int:
    from zps.client.client import connect

    async with connect(broker, client) as ps:
        report = await ps.checkpoint(timeout=timeout)
    if as_json:
        print(json.dumps({str(p): r for p, r in report.items()}, indent=2, sort_keys=True))
    else:
        for p, r in report.items():
            print(f"partition {p}: LSN {r['lsn']} (epoch {r['epoch']}) in {r['path']}")
    return 0


async def _export_online(
    broker: str,
    client: ClientConfig,
    out: str,
    tables: list[str] | None,
    since: str | None,
    values_only: bool = False,
) -> int:
    from zps.client.client import connect

    async with connect(broker, client) as ps:
        manifest = await ps.export_model(out, tables=tables, since=since, values_only=values_only)
    _print_manifest(out, manifest)
    return 0


def _print_manifest(out: str, manifest: dict[str, Any]) -> None:
    cut = ", ".join(
        f"{p}: LSN {v['lsn']} (epoch {v['epoch']})" for p, v in manifest["partitions"].items()
    )
    print(f"exported {len(manifest['tables'])} tables to {out}; partitions cut at {cut}")
    for t in manifest["tables"]:
        if t["kind"] == "embedding":
            size = f"{t['rows']} rows of dim {t['dim']}"
        else:
            size = f"shape {tuple(t['shape'])}"
        print(f"  {t['name']}: {t['kind']}, {size}, {t['dtype']}")


async def _import(broker: str, client: ClientConfig, path: str, tables: list[str] | None) -> int:
    from zps.client.client import connect

    async with connect(broker, client) as ps:
        names = await ps.import_model(path, tables=tables)
    print(f"imported {len(names)} tables from {path}: {', '.join(names)}")
    return 0


def _check_config(path: str) -> int:
    """Validate a settings file offline: every section and key, and the CURVE key files
    it names (readable, of the right kind).  0: valid; 1: the first error, naming it."""
    from zps.ops.security import load_curve_keys, load_key_roles

    try:
        settings = load_settings(path, required=True)
        for config in (settings.broker, settings.shard, settings.client):
            load_curve_keys(config.security)
            load_key_roles(config.security)
    except ConfigError as e:
        print(f"{path}: invalid: {e}", file=sys.stderr)
        return 1
    print(f"{path}: ok")
    return 0


def _keygen(out_dir: str, name: str, *, force: bool = False, parents: bool = False) -> int:
    from zps.ops.security import write_keypair

    public, secret = write_keypair(out_dir, name, force=force, parents=parents)
    print(f"wrote {public} (public: give it to peers / the allow-list directory)")
    print(f"wrote {secret} (secret: keep it on this host, mode 0600)")
    return 0


def format_status(report: dict[str, Any]) -> str:
    b = report.get("broker", {})
    lines = [
        f"broker {b.get('endpoint')}  zps {b.get('version') or '?'} (protocol "
        f"{b.get('protocol') or '?'})  pid {b.get('pid')}  up {b.get('uptime_s')}s  "
        f"map v{report.get('map_version')}  {report.get('n_partitions')} partitions x "
        f"{report.get('replication')} copies  failovers {report.get('failovers')}",
        f"  routed {b.get('routed')}  unavailable {b.get('unavailable')}  "
        f"malformed {b.get('malformed')}  stale replies {b.get('stale_replies')}",
        *_pair_lines(report.get("pair")),
        "",
        f"{'PART':>4}  {'EPOCH':>5}  {'STATE':<10}  {'PRIMARY':<16}  {'SLOTS':>5}  {'LSN':>9}  "
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
            f"{p.get('primary') or '-':<16}  {p.get('slots', '?'):>5}  {lsn:>9}  {reps or '-'}"
        )
        if p.get("awaiting"):
            held = ", ".join(
                f"{h['node']} on {h['host']} at epoch {h['epoch']}, LSN {h['lsn']}"
                for h in p.get("held_copies", [])
            )
            lines.append(
                f"      waiting for {p['awaiting']}"
                + (f"; older copies held: {held}" if held else "")
            )
    reshard = report.get("reshard") or {}
    if reshard.get("target") is not None:
        lines.append(f"RESHARDING {_reshard_line(reshard)}")
    elif reshard.get("moves_done"):
        lines.append(
            f"resharded: {reshard['moves_done']} moves ({reshard['slots_moved']} slots, "
            f"{reshard['bytes_moved']} bytes), longest fence {reshard['max_fenced_s']}s"
        )
    for warning in report.get("placement_warnings", []):
        lines.append(f"WARNING: {warning}")
    lines += [
        "",
        f"{'SHARD':<16}  {'ROLE':<8}  {'PART':>4}  {'HOST':<16}  {'PID':>7}  "
        f"{'LSN':>9}  {'SEEN':>6}  VERSION",
    ]
    for s in report.get("shards", []):
        part = "-" if s.get("partition") is None else str(s["partition"])
        seen = "-" if s.get("last_seen_s") is None else f"{s['last_seen_s']:.1f}s"
        lines.append(
            f"{s['node']:<16}  {s['role']:<8}  {part:>4}  {s['host'][:16]:<16}  "
            f"{s['pid']:>7}  {s['lsn']:>9}  {seen:>6}  {s.get('version') or '?'}"
            + ("  DRAINED" if s.get("drained") else "")
        )
    training = report.get("training") or {}
    lines += ["", *_client_lines(report.get("clients", []), training)]
    lines += _job_lines(training)
    routers = report.get("routers", [])
    if routers:
        lines += ["", f"{len(routers)} routing broker(s)"]
        for r in routers:
            parts = ",".join(str(p) for p in r.get("partitions", [])) or "none"
            lines.append(f"  {r['endpoint']}  host {r.get('host') or '?'}  partitions {parts}")
    return "\n".join(lines)


def _client_lines(clients: list[dict[str, Any]], training: dict[str, Any]) -> list[str]:
    """The connected clients (workers and tools), each worker on the step clock with
    the step it is in, under a line with the training mode."""
    clock: dict[str, int] = training.get("workers") or {}
    mode = training.get("mode")
    if mode is None:
        how = "no worker on the step clock (async mode)"
    else:
        tau = f" (staleness {training.get('staleness')})" if mode == "ssp" else ""
        how = (
            f"{mode} mode{tau}, step {training.get('committed_step')} committed, "
            f"{len(clock)} worker(s) on the step clock"
        )
    lines = [
        f"{len(clients)} client(s) connected; training: {how}",
        f"  {'CLIENT':<20}  {'NAME':<20}  {'HOST':<16}  {'PID':>7}  {'STEP':>6}  VERSION",
    ]
    for c in clients:
        step = clock.get(c["node"])
        lines.append(
            f"  {c['node']:<20}  {(c.get('name') or '-')[:20]:<20}  {c['host'][:16]:<16}  "
            f"{c['pid']:>7}  {'-' if step is None else step:>6}  {c.get('version') or '?'}"
        )
    return lines


def _job_lines(training: dict[str, Any]) -> list[str]:
    """The data-task jobs: state, epoch, tasks done of all, the current epoch's ETA,
    and the newest loss and rows/s the workers reported."""
    jobs: list[dict[str, Any]] = training.get("jobs") or []
    if not jobs:
        return []
    history: dict[str, dict[str, list[Any]]] = training.get("history") or {}
    lines = [
        "",
        f"{'JOB':<16}  {'STATE':<9}  {'EPOCH':>5}  {'TASKS DONE':>11}  {'RUNNING':>7}  "
        f"{'RETRIED':>7}  {'EPOCH ETA':>9}  {'LOSS':>8}  ROWS/S",
    ]
    for j in jobs:
        epochs = j.get("epochs") or []
        current = next((e for e in epochs if e["epoch"] == j.get("epoch")), None)
        eta = None if current is None else current.get("eta_s")
        seen = history.get(j["job"]) or {}
        loss = next((v for v in reversed(seen.get("loss") or []) if v is not None), None)
        rate = next((v for v in reversed(seen.get("rows_per_s") or []) if v is not None), None)
        epoch = f"{min(j['epoch'] + 1, j['n_epochs'])}/{j['n_epochs']}"
        lines.append(
            f"{j['job'][:16]:<16}  {j['state']:<9}  {epoch:>5}  "
            f"{str(j['done']) + '/' + str(j['total']):>11}  {j['running']:>7}  "
            f"{j['retried']:>7}  {'-' if eta is None else f'{eta:g}s':>9}  "
            f"{'-' if loss is None else f'{loss:.4g}':>8}  {'-' if rate is None else f'{rate:.4g}'}"
        )
        if j.get("failed"):
            lines.append(f"  failed: {j['failed']}")
    return lines


def _pair_lines(pair: dict[str, Any] | None) -> list[str]:
    """Both brokers of a pair, and which one is active."""
    if not pair:
        return []
    peer = pair.get("peer", {})
    alive = "up" if peer.get("alive") else "NOT ANSWERING"
    return [
        f"  pair: this broker ({pair.get('role')}) is {pair.get('state', '?').upper()} at "
        f"term {pair.get('term')}; failovers {pair.get('failovers')}",
        f"  pair: peer {peer.get('endpoint')} is {peer.get('state')} ({alive}), "
        f"term {peer.get('term')}",
    ]


def server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zps-server",
        description="zps parameter server processes",
        epilog="Every setting can also come from the TOML file; see deploy/zps.toml.",
    )
    _add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("broker", help="run the broker (routing, cluster map, heartbeats)")
    b.add_argument("--bind", help=f"endpoint to bind (default {BrokerConfig.bind})")
    b.add_argument(
        "--partitions", type=int, help=f"number of partitions (default {BrokerConfig.partitions})"
    )
    b.add_argument(
        "--replication",
        type=int,
        help="copies of each partition: a primary and N-1 hot replicas "
        f"(default {BrokerConfig.replication})",
    )
    b.add_argument(
        "--slots",
        type=int,
        help=f"hash slots, fixed for the cluster's life (default {BrokerConfig.slots})",
    )
    b.add_argument(
        "--startup-grace",
        type=float,
        metavar="SECONDS",
        help="after start, grant only claims of shards that already serve a "
        "partition for this long (default: two liveness timeouts)",
    )
    b.add_argument(
        "--data-dir",
        help="directory for the broker's state (partitions, epochs, training jobs), "
        "so a restart forgets nothing (default: none)",
    )
    b.add_argument(
        "--pair-role",
        choices=("primary", "backup"),
        help="run as one of a primary/backup broker pair (hot standby); needs --peer "
        "and --peer-bind",
    )
    b.add_argument("--peer-bind", help="pair: endpoint this broker's peer link binds")
    b.add_argument("--peer", help="pair: the other broker's peer link endpoint")
    b.add_argument(
        "--peer-timeout",
        type=float,
        metavar="SECONDS",
        help=f"pair: the peer counts as lost after this silence (default "
        f"{BrokerConfig.peer_timeout})",
    )
    b.add_argument(
        "--follow",
        metavar="PRIMARY[,BACKUP]",
        help="run a routing broker: follow the map of this broker (or pair), route "
        "pushes and pulls between clients and shards, own nothing (default: a full broker)",
    )
    b.add_argument(
        "--advertise",
        help="routing broker: its endpoint as clients and shards reach it (default: the "
        "bound port at the local address on the route to the followed broker)",
    )
    b.add_argument(
        "--host",
        help="routing broker: the host it runs on, as shards name theirs (default: the "
        "host name); partitions whose primary is on that host are routed by it",
    )
    b.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (default: none)")
    b.add_argument(
        "--metrics-host",
        help=f"address the metrics endpoint binds (default {Metrics.host}: this host only)",
    )
    _add_common(b)

    s = sub.add_parser("shard", help="run a shard (serves one partition)")
    s.add_argument(
        "--broker",
        help=f"broker endpoint, or a broker pair as PRIMARY,BACKUP (default {ShardConfig.broker})",
    )
    s.add_argument("--data-dir", help="directory for checkpoints (default: none)")
    s.add_argument(
        "--name",
        help="this shard's name in status, logs and metrics (node id s-NAME; default: "
        "the host name and the data dir's name, or the pid without a data dir)",
    )
    s.add_argument(
        "--replication-bind",
        help=f"endpoint replicas connect to (default {ShardConfig.replication_bind}: "
        "any free port)",
    )
    s.add_argument(
        "--advertise-host",
        help="host replicas use to reach this shard (default: the local address "
        "on the route to the broker)",
    )
    s.add_argument(
        "--host",
        help="host name reported for placement: copies of a partition go to distinct "
        "hosts where possible (default: the hostname)",
    )
    s.add_argument("--zone", help="zone or rack label; copies go to distinct zones too")
    s.add_argument(
        "--checkpoint-interval",
        type=float,
        metavar="SECONDS",
        help=f"seconds between checkpoints, 0 = only on shutdown "
        f"(default {Checkpoint.interval_s:g})",
    )
    s.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="UPDATES",
        help="also checkpoint after this many updates (default 0: off)",
    )
    s.add_argument(
        "--checkpoint-keep",
        type=int,
        metavar="N",
        help=f"checkpoints kept per partition (default {Checkpoint.keep})",
    )
    s.add_argument(
        "--durability",
        choices=["fsync", "interval", "none"],
        help="what an acknowledged write survives, with --data-dir: fsync = on disk "
        "before the ack, interval = on disk within --durability-interval, none = "
        f"checkpoints only (default {ShardConfig.durability})",
    )
    s.add_argument(
        "--durability-interval",
        type=float,
        metavar="SECONDS",
        help="interval mode: the longest an acknowledged write waits for fsync "
        f"(default {ShardConfig.durability_interval:g})",
    )
    s.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (default: none)")
    s.add_argument(
        "--metrics-host",
        help=f"address the metrics endpoint binds (default {Metrics.host}: this host only)",
    )
    _add_common(s)

    st = sub.add_parser("status", help="show partitions, shards and clients")
    st.add_argument(
        "--broker",
        help="broker endpoint, or a pair as PRIMARY,BACKUP (default: [worker] of the config)",
    )
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument(
        "--check",
        action="store_true",
        help="print a one-line verdict and exit 0 if every partition is ok, 1 if one "
        "is degraded (or a broker of a pair does not answer), 2 if one is lost or "
        "unassigned, 3 if the broker is unreachable or the configuration invalid",
    )
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    _add_common(st, heartbeat=False)

    r = sub.add_parser(
        "reset-partition",
        help="give a lost partition to its newest surviving copy (or an empty shard), "
        "accepting the loss of what its missing copies held",
    )
    _add_broker(r)
    r.add_argument("--partition", type=int, required=True, help="the lost partition")
    r.add_argument(
        "--accept-data-loss",
        action="store_true",
        help="required: acknowledged writes after the surviving copy are gone for good",
    )
    r.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    _add_common(r, heartbeat=False)

    for verb, what in (
        ("drain", "hand a shard's role over and keep it out of placement (maintenance)"),
        ("undrain", "let a drained shard take roles again"),
    ):
        dr = sub.add_parser(verb, help=what)
        dr.add_argument("node", metavar="NODE", help="the shard (s-NAME, or NAME)")
        _add_broker(dr)
        dr.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
        _add_common(dr, heartbeat=False)

    sc = sub.add_parser(
        "scale",
        help="change the number of partitions while training runs (live resharding), or "
        "cancel the move under way",
    )
    _add_broker(sc)
    sc_what = sc.add_mutually_exclusive_group(required=True)
    sc_what.add_argument("--partitions", type=int, help="the partition count to reach")
    sc_what.add_argument(
        "--cancel",
        action="store_true",
        help="cancel the move under way (its source serves the slots again) and stop",
    )
    sc.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for the resharding to finish (default: return at once)",
    )
    sc.add_argument(
        "--max-slots-per-move",
        type=int,
        default=0,
        help="slots fenced and copied at once (default 256 of 4096: the longest stall of "
        "a caller of those slots grows with it)",
    )
    sc.add_argument(
        "--piece-bytes",
        type=int,
        default=0,
        help="bytes per copied piece (default 8 MiB)",
    )
    sc.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    _add_common(sc, heartbeat=False)

    ck = sub.add_parser(
        "checkpoint",
        help="have every partition's primary write a checkpoint now; prints each one's LSN "
        "and file (on the primary's host)",
    )
    _add_broker(ck)
    ck.add_argument("--json", action="store_true", help="machine-readable output")
    ck.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the checkpoints"
    )
    _add_common(ck, heartbeat=False)

    ex = sub.add_parser(
        "export",
        help="write a model's values as .npy files and a JSON manifest: from a running "
        "cluster (--broker; training may go on) or offline from data dirs (--data-dir)",
    )
    _add_broker(ex)
    ex.add_argument(
        "--data-dir",
        nargs="+",
        metavar="DIR",
        help="export offline from these shards' data dirs (checkpoints and logs; the "
        "newest copy of each partition wins), with no process running",
    )
    ex.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    ex.add_argument(
        "--table", action="append", metavar="NAME", help="export only this table (repeatable)"
    )
    ex.add_argument(
        "--since",
        metavar="DIR",
        help="--broker: write a delta against this earlier export (changed and new rows, "
        "removed ids, dropped tables); zps.model.format.apply_delta applies it",
    )
    ex.add_argument(
        "--partitions",
        type=int,
        help="--data-dir: the cluster's partition count (default: the highest found + 1)",
    )
    ex.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    _add_common(ex, heartbeat=False)

    ex.add_argument(
        "--values-only",
        action="store_true",
        help="leave the optimizer state out (an import then starts it afresh)",
    )
    jobs_cli.add_parser(sub, _add_broker, _add_common)

    im = sub.add_parser(
        "import",
        help="create an export's tables in a cluster and set their values (warm start)",
    )
    _add_broker(im)
    im.add_argument("--in", dest="in_dir", required=True, metavar="DIR", help="the export")
    im.add_argument(
        "--table", action="append", metavar="NAME", help="import only this table (repeatable)"
    )
    im.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    _add_common(im, heartbeat=False)

    cc = sub.add_parser(
        "check-config",
        help="validate a settings file without starting anything (exit 0: valid, 1: not)",
    )
    cc.add_argument(
        "file",
        metavar="FILE",
        nargs="?",
        help=f"the TOML file (default: $ZPS_CONFIG, else {DEFAULT_CONFIG_PATH})",
    )

    k = sub.add_parser("keygen", help="write a CURVE key pair (NAME.key and NAME.key_secret)")
    k.add_argument("--out", default=".", help="directory to write to (default: .)")
    k.add_argument("--name", default="zps", help="file name stem (default: zps)")
    k.add_argument("--force", action="store_true", help="replace an existing key pair of that name")
    k.add_argument("--parents", action="store_true", help="create the directory (and its parents)")
    k.add_argument("--log-level", default=None, choices=LEVELS)

    d = sub.add_parser("demo", help="train a model on a whole local cluster (no arguments needed)")
    d.add_argument("--epochs", type=int, default=None, help="training epochs (default 3)")
    d.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    d.add_argument("--partitions", type=int, default=2, help="partitions (default 2)")
    d.add_argument(
        "--replication", type=int, default=2, help="copies of each partition (default 2)"
    )
    d.add_argument(
        "--mode",
        choices=["async", "sync", "ssp"],
        default="async",
        help="training mode (default async)",
    )
    d.add_argument("--staleness", type=int, default=2, help="ssp: staleness bound (default 2)")
    d.add_argument("--log-level", default=None, choices=LEVELS)
    return parser


def _admin(
    args: argparse.Namespace, *, connect_timeout: float | None = None
) -> tuple[str, ClientConfig]:
    """The broker endpoint(s) and client settings of a command that reaches a cluster
    (status, drain, scale, checkpoint, ...), with its logging set up."""
    settings = _settings(args)
    setup_logging(args.log_level or "warning")
    client = replace(
        settings.client,
        connect_timeout=args.timeout if connect_timeout is None else connect_timeout,
        timeout=args.timeout,
        name=f"zps-server {args.command}",
    )
    return args.broker or ",".join(settings.worker.endpoints), client


def server_main(argv: Sequence[str] | None = None) -> int:
    args = server_parser().parse_args(argv)
    malloc.tune()
    try:
        match args.command:
            case "broker":
                settings = _settings(args)
                setup_logging(args.log_level or "info")
                return run_async(_serve_broker(broker_config(args, settings)))
            case "shard":
                settings = _settings(args)
                setup_logging(args.log_level or "info")
                return run_async(_serve_shard(shard_config(args, settings)))
            case "status":
                try:
                    broker, client = _admin(args)
                except ConfigError as e:
                    if not args.check:
                        raise
                    print(f"UNKNOWN: invalid configuration: {e}")
                    return CHECK_UNKNOWN
                return run_async(
                    _status(
                        broker,
                        client,
                        args.json,
                        args.check,
                    )
                )
            case "reset-partition":
                broker, client = _admin(args)
                if not args.accept_data_loss:
                    print(
                        f"zps-server reset-partition: partition {args.partition} would be "
                        "served without the writes its missing copies held; say so with "
                        "--accept-data-loss",
                        file=sys.stderr,
                    )
                    return 2
                return run_async(_reset_partition(broker, client, args.partition))
            case "drain" | "undrain":
                broker, client = _admin(args)
                node = args.node if args.node.startswith("s-") else f"s-{args.node}"
                return run_async(
                    _drain(
                        broker,
                        client,
                        node,
                        undo=args.command == "undrain",
                    )
                )
            case "scale":
                broker, client = _admin(args)
                return run_async(
                    _scale(
                        broker,
                        client,
                        args.partitions,
                        cancel=args.cancel,
                        wait=args.wait,
                        max_slots=args.max_slots_per_move,
                        piece_bytes=args.piece_bytes,
                    )
                )
            case "checkpoint" | "export" | "import":
                broker, client = _admin(args, connect_timeout=min(args.timeout, 30.0))
                if args.command == "checkpoint":
                    return run_async(_checkpoint(broker, client, args.timeout, args.json))
                if args.command == "import":
                    return run_async(_import(broker, client, args.in_dir, args.table))
                if args.data_dir and args.broker:
                    print(
                        "zps-server export: give --broker or --data-dir, not both",
                        file=sys.stderr,
                    )
                    return 2
                if args.data_dir:
                    from zps.model.offline import export_data_dirs

                    if args.since:
                        print("zps-server export: --since needs --broker", file=sys.stderr)
                        return 2

                    manifest = export_data_dirs(
                        args.data_dir,
                        args.out,
                        partitions=args.partitions,
                        tables=args.table,
                        values_only=args.values_only,
                    )
                    _print_manifest(args.out, manifest)
                    return 0
                return run_async(
                    _export_online(
                        broker, client, args.out, args.table, args.since, args.values_only
                    )
                )
            case "job":
                return jobs_cli.run(args, *_admin(args))
            case "check-config":
                return _check_config(
                    args.file or os.environ.get("ZPS_CONFIG") or DEFAULT_CONFIG_PATH
                )
            case "keygen":
                setup_logging(args.log_level or "warning")
                return _keygen(args.out, args.name, force=args.force, parents=args.parents)
            case "demo":
                setup_logging(args.log_level or "warning")
                from zps.examples.demo import run_demo

                return run_demo(
                    epochs=args.epochs,
                    n_workers=args.workers,
                    n_partitions=args.partitions,
                    replication=args.replication,
                    mode=args.mode,
                    staleness=args.staleness,
                )
    except ConfigError as e:
        print(f"zps-server {args.command}: invalid configuration: {e}", file=sys.stderr)
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


def keyword_args(items: Sequence[str]) -> dict[str, Any]:
    """zps-worker's ``--arg NAME=VALUE`` items as keyword arguments: each VALUE is read
    as JSON (``0.1``, ``3``, ``true``, ``[64, 32]``, ``"3"``), and one that is not JSON
    is kept as the string it is (``--arg data=/srv/adult.csv``).  Raises
    :class:`~zps.errors.ConfigError` naming an item without ``=``, a NAME that is not
    an identifier, or a NAME given twice."""
    kwargs: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier() or keyword.iskeyword(name):
            raise ConfigError(
                f"--arg {item!r}: expected NAME=VALUE, NAME a Python identifier (lr=0.1)"
            )
        if name in kwargs:
            raise ConfigError(f"--arg {name} is given twice")
        try:
            kwargs[name] = json.loads(text)
        except ValueError:
            kwargs[name] = text
    return kwargs


def check_arguments(
    func: Callable[..., Any], target: str, args: Sequence[str], kwargs: Mapping[str, Any]
) -> None:
    """Raise :class:`~zps.errors.ConfigError` if ``func(ps, *args, **kwargs)`` cannot
    bind (a missing or unknown argument), before zps-worker connects."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return  # no signature to check (a builtin): the call says what is wrong
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as e:
        given = ", ".join(["ps", *map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        bare = signature.replace(
            parameters=[q.replace(annotation=q.empty) for q in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        hint = (
            "; zps-worker's flags (--arg) go before MODULE:FUNCTION, what follows it is ARGS"
            if "--arg" in args
            else ""
        )
        raise ConfigError(
            f"{target}{bare} cannot be called as {target}({given}): {e}{hint}"
        ) from None


#: zps-worker's exit code when its function raised JobFailedError: the job failed
#: (a task failed more often than it may), and a restart would not change that.  The
#: worker unit does not restart on it (``RestartPreventExitStatus=``).
EXIT_JOB_FAILED = 3


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zps-worker",
        description="Run FUNCTION(ps, *ARGS, **--arg) with a connected client: an async "
        "function gets zps.Client, a plain one the blocking zps.SyncClient.  Exit codes: "
        "0 done, 1 an error (its traceback is printed), 2 bad arguments or configuration, "
        f"{EXIT_JOB_FAILED} the job failed (JobFailedError), {EXIT_STOP_TIMEOUT} a stop "
        "request ignored, 130 interrupted.",
    )
    _add_version(parser)
    parser.add_argument(
        "--broker",
        help="broker endpoint, or a broker pair as PRIMARY,BACKUP (default: [worker] broker)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        help=f"seconds before an unanswered request fails (default {ClientConfig.timeout:g})",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        help=f"seconds to wait for the broker at start-up "
        f"(default {ClientConfig.connect_timeout:g})",
    )
    parser.add_argument(
        "--acks",
        choices=["all", "1"],
        help='wait for every in-sync replica ("all", default) or the primary (1)',
    )
    parser.add_argument("--name", help="a name shown by `zps-server status`")
    parser.add_argument(
        "--mode", choices=["async", "sync", "ssp"], help="training mode of the job (default async)"
    )
    parser.add_argument(
        "--staleness",
        type=int,
        metavar="TAU",
        help="ssp: how many steps a worker may run ahead of the slowest",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--stop-grace",
        type=float,
        metavar="SECONDS",
        help="after the first SIGTERM/SIGINT, how long the function has to see "
        "ps.stop_requested and return before zps-worker exits with code "
        f"{EXIT_STOP_TIMEOUT} (default {WorkerConfig.stop_grace:g})",
    )
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        dest="kwargs",
        metavar="NAME=VALUE",
        help="a keyword argument of FUNCTION (repeatable; before MODULE:FUNCTION): VALUE "
        'is read as JSON (0.1, 3, true, [64, 32], "3"); one that is not JSON is passed '
        "as the string it is",
    )
    parser.add_argument(
        "--stall-margin",
        type=float,
        metavar="SECONDS",
        help="under a systemd watchdog (WatchdogSec=): the pings stop when a client call "
        "is still in flight this long after its deadline (--timeout), or the blocking "
        "client's event loop has not turned for this long; the function's own code may "
        f"run as long as it needs (default: [worker] stall_margin, {WorkerConfig.stall_margin:g})",
    )
    parser.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (default: none)")
    parser.add_argument(
        "--metrics-host",
        help=f"address the metrics endpoint binds (default {Metrics.host}: this host only)",
    )
    _add_common(parser, heartbeat=False)
    parser.add_argument(
        "function",
        metavar="MODULE:FUNCTION",
        nargs="?",
        help="what to run (default: [worker] function)",
    )
    parser.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="positional arguments of FUNCTION, as strings (default: [worker] args)",
    )
    return parser


class _FunctionFailed(Exception):
    """The training function raised ``error`` (which keeps its traceback)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def _function_failed(target: str, error: Exception) -> int:
    """Print what the training function raised, with its whole traceback (the user's
    frames first), then one line naming it; returns the exit code."""
    traceback.print_exception(error, file=sys.stderr)
    print(f"zps-worker: {target} failed: {type(error).__name__}: {error}", file=sys.stderr)
    if isinstance(error, JobFailedError):
        return EXIT_JOB_FAILED
    if isinstance(error, ConfigError):
        return 2
    return 1


def _nothing_done(target: str, tasks_taken: Mapping[str, int]) -> None:
    """Say so when the function asked for tasks and got none (the job was finished)."""
    for job in sorted(job for job, n in tasks_taken.items() if n == 0):
        print(
            f"zps-worker: {target} found nothing to do: job {job!r} had no task left "
            f"(it is finished; `zps-server job reset {job}` or create_job(..., "
            "restart=True) runs it again)",
            file=sys.stderr,
        )


def worker_main(argv: Sequence[str] | None = None) -> int:
    args = worker_parser().parse_args(argv)
    malloc.tune()
    setup_logging(args.log_level or "info")
    run: _WorkerRun | None = None
    target = args.function or "the function"
    try:
        settings = _settings(args)
        target = args.function or settings.worker.function or target
        if not args.function and not settings.worker.function:
            raise ConfigError("no MODULE:FUNCTION given (as an argument or [worker] function)")
        func_args = list(args.args) if args.function else list(settings.worker.args)
        func_kwargs = keyword_args(args.kwargs)
        func = load_function(target)
        check_arguments(func, target, func_args, func_kwargs)
        config = override(
            settings.client,
            timeout=args.timeout,
            connect_timeout=args.connect_timeout,
            acks=None if args.acks is None else (1 if args.acks == "1" else "all"),
            name=args.name or target,
            mode=args.mode,
            staleness=args.staleness,
        )
        broker = args.broker or ",".join(settings.worker.endpoints)
        notifier = Notifier.from_env(os.environ)
        worker = override(  # checked
            settings.worker, stop_grace=args.stop_grace, stall_margin=args.stall_margin
        )
        run = _WorkerRun(target, notifier, worker_metrics(args, settings), worker.stop_grace)
        run.stall_margin = worker.stall_margin
        run.serve()  # before connecting: a taken port fails before the worker joins a job
        if inspect.iscoroutinefunction(func):
            return run_async(
                _run_async_worker(func, broker, config, func_args, func_kwargs, run, not args.quiet)
            )
        from zps.client.sync import connect_sync

        with connect_sync(broker, config) as ps:
            ps.client.progress.enabled = not args.quiet
            _stop_on_signals(ps.client, run)
            loop = ps.client.event_loop
            assert loop is not None
            background = [
                asyncio.run_coroutine_threadsafe(c, loop)
                for c in run.start(ps.client, own_loop=True)
            ]
            try:
                try:
                    result = func(ps, *func_args, **func_kwargs)
                except Exception as e:
                    raise _FunctionFailed(e) from e
                run.returned()
                notifier.stopping()
                ps.flush()
                ps.client.progress.close()
                _nothing_done(target, ps.client.tasks_taken)
            finally:
                for future in background:
                    future.cancel()
        return int(result) if isinstance(result, int) else 0
    except _FunctionFailed as failed:
        return _function_failed(target, failed.error)
    except ConfigError as e:
        print(f"zps-worker: {e}", file=sys.stderr)
        return 2
    except JobFailedError as e:
        print(f"zps-worker: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_JOB_FAILED
    except ZpsError as e:
        print(f"zps-worker: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if run is not None:
            run.stop()


def worker_metrics(args: argparse.Namespace, settings: Settings) -> Metrics:
    """The worker's metrics endpoint: ``--metrics-port``, else ``[worker] metrics_port``
    (not ``[metrics] port``, which the broker and shards share), at ``--metrics-host``,
    else ``[metrics] host`` (loopback by default)."""
    base = replace(settings.worker.metrics, port=settings.worker.metrics_port)
    return override(base, port=args.metrics_port, host=args.metrics_host)


#: zps-worker's exit code when the training function did not return within
#: ``worker.stop_grace`` seconds of the first SIGTERM/SIGINT (as timeout(1) exits).
EXIT_STOP_TIMEOUT = 124


class _WorkerRun:
    """What zps-worker runs beside the training function: systemd notifications, the
    watchdog (a thread that pings while the client is healthy), the metrics endpoint,
    and the stop grace period."""

    def __init__(self, target: str, notifier: Notifier, metrics: Metrics, grace: float) -> None:
        self.target = target
        self.notifier = notifier
        self.metrics_config = metrics
        self.grace = grace
        self.stall_margin = WorkerConfig.stall_margin  # see client_stall
        self.client: Any = None  # the connected client, once there is one
        self.server: Any = None
        self._timer: threading.Timer | None = None
        self._done = threading.Event()
        self._pinger: threading.Thread | None = None

    def serve(self) -> None:
        """Serve metrics, /healthz and /ready if a port is configured (raises
        :class:`~zps.errors.ZpsError` naming the address if it is taken)."""
        from zps.ops.metrics import MetricsServer

        self.server = MetricsServer(self.metrics_config, self._collect, ready=self._ready)
        self.server.start()

    def _collect(self) -> Any:
        from zps.ops.metrics import client_families

        client = self.client
        if client is None:
            return []
        return client_families(
            client.meter,
            requests=client.stats.requests,
            retries=client.stats.retries,
            step=client.step,
            stop_requested=client.stop_requested,
            now=time.monotonic(),
        )

    def _ready(self) -> tuple[bool, str]:
        client = self.client
        if client is None:
            return False, "connecting to the broker"
        if client.stop_requested:
            return False, "stopping: asked to stop (SIGTERM)"
        try:
            version = client.cluster_map.version
        except ZpsError:
            return False, "not connected to the broker"
        return True, f"running {self.target}, step {client.step}, map v{version}"

    def start(self, client: Any, *, own_loop: bool) -> list[Coroutine[Any, Any, None]]:
        """The client is connected: tell systemd the worker is up and start the watchdog
        thread; returns what to run on the client's event loop (the /healthz stamp, which
        the watchdog also reads).  ``own_loop``: the client's loop runs no user code (the
        blocking client), so a loop that stops turning is a stalled client."""
        self.client = client
        self.notifier.ready(f"running {self.target}")
        assert self.server is not None
        server = self.server
        began = time.monotonic()

        def stall() -> str | None:
            stamp = server.loop_stamp
            return client_stall(
                time.monotonic(),
                deadline=client.call_deadline(),
                loop_turned=(began if stamp is None else stamp) if own_loop else None,
                margin=self.stall_margin,
            )

        self._pinger = threading.Thread(
            target=self.notifier.ping_while_healthy,
            args=(stall, self._done),
            name="zps-watchdog",
            daemon=True,
        )
        self._pinger.start()
        return [server.loop_heartbeat()]

    def stop_requested(self, client: Any, signum: int) -> None:
        """The first SIGTERM/SIGINT: ask the function to stop, and start the grace period."""
        client.stop_requested = True
        self.notifier.stopping(f"stopping {self.target}")
        log.warning(
            "signal %d: finishing the current step, then stopping: %s sees ps.stop_requested "
            "and has %gs (worker.stop_grace) to return",
            signum,
            self.target,
            self.grace,
        )
        if self._timer is None:
            self._timer = threading.Timer(self.grace, self._give_up)
            self._timer.daemon = True
            self._timer.start()

    def _give_up(self) -> None:
        log.error(
            "%s did not return within %gs of the stop request (worker.stop_grace): "
            "exiting with code %d; requests still in flight are abandoned",
            self.target,
            self.grace,
            EXIT_STOP_TIMEOUT,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_STOP_TIMEOUT)

    def returned(self) -> None:
        """The function returned: the grace period is over (flushing has its own
        deadlines)."""
        if self._timer is not None:
            self._timer.cancel()

    def stop(self) -> None:
        self.returned()
        self._done.set()
        if self._pinger is not None:
            self._pinger.join(5.0)
            self._pinger = None
        if self.server is not None:
            self.server.stop()
            self.server = None


def _stop_on_signals(client: Any, run: _WorkerRun) -> None:
    """First SIGTERM/SIGINT: ask the training function to stop after its step
    (it sees ``ps.stop_requested``) within the grace period; a second one interrupts
    at once."""

    def handler(signum: int, frame: object) -> None:
        if client.stop_requested:
            raise KeyboardInterrupt
        run.stop_requested(client, signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


async def _run_async_worker(
    func: Callable[..., Any],
    broker: str,
    config: ClientConfig,
    args: list[str],
    kwargs: dict[str, Any],
    run: _WorkerRun,
    progress: bool,
) -> int:
    from zps.client.client import Client

    async with Client(broker, config) as ps:
        ps.progress.enabled = progress
        loop = asyncio.get_running_loop()
        # A task of its own, outside any task group: its exception is raised as it is.
        training = loop.create_task(func(ps, *args, **kwargs))
        interrupted = False

        def on_signal(signum: int) -> None:
            nonlocal interrupted
            if not ps.stop_requested:
                run.stop_requested(ps, signum)
            elif not interrupted:  # the second one interrupts at once
                interrupted = True
                training.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        tasks = [loop.create_task(c) for c in run.start(ps, own_loop=False)]
        try:
            try:
                result = await training
            except asyncio.CancelledError:
                if not interrupted:
                    raise
                return 130
            except Exception as e:
                raise _FunctionFailed(e) from e
            run.returned()
            run.notifier.stopping()
            await ps.flush()
            ps.progress.close()
            _nothing_done(run.target, ps.tasks_taken)
        finally:
            training.cancel()  # a no-op once it is done
            for task in tasks:
                task.cancel()
    return int(result) if isinstance(result, int) else 0
