"""``zps-server status``: a cluster's report as a table, as JSON, or as a monitoring
plugin's one-line verdict and exit code (``--check``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from zps.cli.common import add_common, admin_target, run_async
from zps.errors import ConfigError, ZpsError
from zps.ops.config import ClientConfig


def add_parser(sub: Any) -> None:
    """Register ``status`` on the subcommands ``sub`` of zps-server."""
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
    add_common(st, heartbeat=False)


def run(args: argparse.Namespace) -> int:
    """Carry out ``zps-server status``; returns the exit code (see :func:`check_health`
    for ``--check``)."""
    try:
        broker, client = admin_target(args)
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
        lines.append(f"RESHARDING {reshard_line(reshard)}")
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
        f"term {peer.get('term')}; heard again after a silence {peer.get('silences', 0)} times",
    ]


def reshard_line(r: dict[str, Any]) -> str:
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
