"""What every zps-server and zps-worker command shares: logging, the event loop, the
settings (flags over the TOML file over defaults) and the flags common to commands."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any

from zps.ops import logs
from zps.ops.config import (
    DEFAULT_CONFIG_PATH,
    ClientConfig,
    Heartbeat,
    Settings,
    load_settings,
    override,
)

LEVELS = ["debug", "info", "warning", "error"]


#: The exit status of a command whose output's reader went away (``| head``): a shell's
#: status for a process ended by SIGPIPE.
BROKEN_PIPE = 128 + signal.SIGPIPE


def output_closed() -> int:
    """After a BrokenPipeError: standard output goes to /dev/null (so the interpreter's
    last flush raises nothing more); the status to exit with."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return BROKEN_PIPE


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``low`` (else a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    return parse


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


def on_signals(stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


def settings_of(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    path = args.config or environ.get("ZPS_CONFIG")
    if path:
        return load_settings(path, required=True)
    return load_settings(DEFAULT_CONFIG_PATH, required=False)


def heartbeat_of(args: argparse.Namespace, base: Heartbeat) -> Heartbeat:
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


def add_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=version_line(p.prog))


def add_broker(p: argparse.ArgumentParser) -> None:
    """``--broker`` of the commands that talk to a running cluster."""
    p.add_argument("--broker", help="broker endpoint (default: [worker] of the config)")


def add_common(p: argparse.ArgumentParser, *, heartbeat: bool = True) -> None:
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


def admin_target(
    args: argparse.Namespace, *, connect_timeout: float | None = None
) -> tuple[str, ClientConfig]:
    """The broker endpoint(s) and client settings of a command that reaches a cluster
    (status, drain, scale, checkpoint, ...), with its logging set up."""
    settings = settings_of(args)
    setup_logging(args.log_level or "warning")
    client = replace(
        settings.client,
        connect_timeout=args.timeout if connect_timeout is None else connect_timeout,
        timeout=args.timeout,
        name=f"zps-server {args.command}",
    )
    return args.broker or ",".join(settings.worker.endpoints), client
