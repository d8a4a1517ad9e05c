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
import sys
from collections.abc import Sequence

from zps.cli import admin, data, keys, server, status, worker
from zps.cli import jobs as jobs_cli
from zps.cli.common import (
    LEVELS,
    add_broker,
    add_common,
    add_version,
    admin_target,
    at_least,
    output_closed,
    setup_logging,
)
from zps.errors import ConfigError, ZpsError
from zps.ops import malloc


def server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zps-server",
        description="zps parameter server processes",
        epilog="Every setting can also come from the TOML file; see deploy/zps.toml.",
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    server.add_parsers(sub)
    status.add_parser(sub)
    admin.add_parsers(sub)
    data.add_export_parser(sub)
    jobs_cli.add_parser(sub, add_broker, add_common)
    data.add_import_parser(sub)
    keys.add_parsers(sub)

    d = sub.add_parser("demo", help="train a model on a whole local cluster (no arguments needed)")
    d.add_argument("--epochs", type=at_least(1), default=3, help="training epochs (default 3)")
    d.add_argument("--workers", type=at_least(1), default=2, help="worker processes (default 2)")
    d.add_argument("--partitions", type=at_least(1), default=2, help="partitions (default 2)")
    d.add_argument(
        "--replication", type=at_least(1), default=2, help="copies of each partition (default 2)"
    )
    d.add_argument(
        "--mode",
        choices=["async", "sync", "ssp"],
        default="async",
        help="training mode (default async)",
    )
    d.add_argument(
        "--staleness", type=at_least(0), default=2, help="ssp: staleness bound (default 2)"
    )
    d.add_argument("--log-level", default=None, choices=LEVELS)
    for command in sub.choices.values():  # an unknown flag is told with its command's usage
        command.set_defaults(command_parser=command)
    return parser


def server_main(argv: Sequence[str] | None = None) -> int:
    args, unknown = server_parser().parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    malloc.tune()
    try:
        match args.command:
            case "broker" | "shard":
                return server.run(args)
            case "status":
                return status.run(args)
            case "reset-partition" | "drain" | "undrain" | "scale" | "checkpoint":
                return admin.run(args)
            case "export" | "import":
                return data.run(args)
            case "job":
                return jobs_cli.run(args, *admin_target(args))
            case "check-config" | "keygen":
                return keys.run(args)
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
    except BrokenPipeError:  # the reader of the output went away (``| head``)
        return output_closed()
    return 2


def worker_main(argv: Sequence[str] | None = None) -> int:
    """``zps-worker``: see :mod:`zps.cli.worker`."""
    return worker.main(argv)
