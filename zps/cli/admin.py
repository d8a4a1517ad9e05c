"""The commands that change a running cluster: ``zps-server reset-partition``,
``drain``, ``undrain``, ``scale`` and ``checkpoint``, each one request to the active
broker whose answer says what came of it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zps.cli.common import add_broker, add_common, admin_target, at_least, run_async
from zps.cli.status import reshard_line
from zps.ops.config import ClientConfig

COMMANDS = ("reset-partition", "drain", "undrain", "scale", "checkpoint")


def add_parsers(sub: Any) -> None:
    """Register :data:`COMMANDS` on the subcommands ``sub`` of zps-server."""
    r = sub.add_parser(
        "reset-partition",
        help="give a lost partition to its newest surviving copy (or an empty shard), "
        "accepting the loss of what its missing copies held",
    )
    add_broker(r)
    r.add_argument("--partition", type=at_least(0), required=True, help="the lost partition")
    r.add_argument(
        "--accept-data-loss",
        action="store_true",
        help="required: acknowledged writes after the surviving copy are gone for good",
    )
    r.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    add_common(r, heartbeat=False)

    for verb, what in (
        ("drain", "hand a shard's role over and keep it out of placement (maintenance)"),
        ("undrain", "let a drained shard take roles again"),
    ):
        dr = sub.add_parser(verb, help=what)
        dr.add_argument("node", metavar="NODE", help="the shard (s-NAME, or NAME)")
        add_broker(dr)
        dr.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
        add_common(dr, heartbeat=False)

    sc = sub.add_parser(
        "scale",
        help="change the number of partitions while training runs (live resharding), or "
        "cancel the move under way",
    )
    add_broker(sc)
    sc_what = sc.add_mutually_exclusive_group(required=True)
    sc_what.add_argument("--partitions", type=at_least(1), help="the partition count to reach")
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
        type=at_least(0),
        default=0,
        help="slots fenced and copied at once (default 256 of 4096: the longest stall of "
        "a caller of those slots grows with it)",
    )
    sc.add_argument(
        "--piece-bytes",
        type=at_least(0),
        default=0,
        help="bytes per copied piece (default 8 MiB)",
    )
    sc.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    add_common(sc, heartbeat=False)

    ck = sub.add_parser(
        "checkpoint",
        help="have every partition's primary write a checkpoint now; prints each one's LSN "
        "and file (on the primary's host)",
    )
    add_broker(ck)
    ck.add_argument("--json", action="store_true", help="machine-readable output")
    ck.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the checkpoints"
    )
    add_common(ck, heartbeat=False)


def run(args: argparse.Namespace) -> int:
    """Carry out one of :data:`COMMANDS`; returns the exit code."""
    match args.command:
        case "reset-partition":
            broker, client = admin_target(args)
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
            broker, client = admin_target(args)
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
            broker, client = admin_target(args)
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
    broker, client = admin_target(args, connect_timeout=min(args.timeout, 30.0))
    return run_async(_checkpoint(broker, client, args.timeout, args.json))


async def _reset_partition(broker: str, client: ClientConfig, partition: int) -> int:
    from zps.client.client import connect
    from zps.protocol.messages import StatusRequest

    request = StatusRequest(reset_partition=partition, accept_data_loss=True)
    async with connect(broker, client) as ps:
        # A STATUS call that carries the command; the report says what came of it.
        report = await ps.status(request)
    result = report.get("reset") or {"ok": False, "msg": "the broker did not answer the reset"}
    print(result["msg"], file=sys.stdout if result["ok"] else sys.stderr)
    return 0 if result["ok"] else 1


async def _drain(broker: str, client: ClientConfig, node: str, *, undo: bool) -> int:
    from zps.client.client import connect
    from zps.protocol.messages import StatusRequest

    request = StatusRequest(undrain=node) if undo else StatusRequest(drain=node)
    async with connect(broker, client) as ps:
        # A STATUS call that carries the command; the report says what came of it.
        report = await ps.status(request)
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
    from zps.protocol.messages import StatusRequest

    request = StatusRequest(
        scale=partitions,
        scale_cancel=cancel,
        scale_max_slots=max_slots,
        scale_piece_bytes=piece_bytes,
    )
    async with connect(broker, client) as ps:
        report = await ps.status(request)
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
                print(f"still resharding after {wait:g}s: {reshard_line(reshard)}", file=sys.stderr)
                return 1
            await asyncio.sleep(0.5)
            report = await ps.status()
    return 0


def _slot_line(report: dict[str, Any]) -> str:
    slots = ", ".join(f"{p['partition']}: {p.get('slots', '?')}" for p in report["partitions"])
    return f"{len(report['partitions'])} partitions (slots {slots})"


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
