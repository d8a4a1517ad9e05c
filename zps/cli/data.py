"""``zps-server export`` and ``zps-server import``: a model's values out of a cluster
(online, or offline from data dirs) into .npy files and a manifest, and back in."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from zps.cli.common import add_broker, add_common, admin_target, run_async
from zps.ops.config import ClientConfig


def add_export_parser(sub: Any) -> None:
    """Register ``export`` on the subcommands ``sub`` of zps-server."""
    ex = sub.add_parser(
        "export",
        help="write a model's values and optimizer state as .npy files and a JSON manifest: "
        "from a running cluster (--broker; training may go on) or offline from data dirs "
        "(--data-dir)",
    )
    add_broker(ex)
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
    add_common(ex, heartbeat=False)
    ex.add_argument(
        "--values-only",
        action="store_true",
        help="leave the optimizer state out (an import then starts it afresh)",
    )


def add_import_parser(sub: Any) -> None:
    """Register ``import`` on the subcommands ``sub`` of zps-server."""
    im = sub.add_parser(
        "import",
        help="create an export's tables in a cluster and set their values and state (warm start)",
    )
    add_broker(im)
    im.add_argument("--in", dest="in_dir", required=True, metavar="DIR", help="the export")
    im.add_argument(
        "--table", action="append", metavar="NAME", help="import only this table (repeatable)"
    )
    im.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    add_common(im, heartbeat=False)


def run(args: argparse.Namespace) -> int:
    """Carry out ``export`` or ``import``; returns the exit code."""
    broker, client = admin_target(args, connect_timeout=min(args.timeout, 30.0))
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
        _export_online(broker, client, args.out, args.table, args.since, args.values_only)
    )


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
