"""The commands that need no cluster: ``zps-server keygen`` writes a CURVE key pair;
``zps-server check-config`` validates a settings file and the key files it names."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from zps.cli.common import LEVELS, setup_logging
from zps.errors import ConfigError
from zps.ops.config import DEFAULT_CONFIG_PATH, load_settings

COMMANDS = ("check-config", "keygen")


def add_parsers(sub: Any) -> None:
    """Register :data:`COMMANDS` on the subcommands ``sub`` of zps-server."""
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


def run(args: argparse.Namespace) -> int:
    """Carry out one of :data:`COMMANDS`; returns the exit code."""
    if args.command == "check-config":
        return _check_config(args.file or os.environ.get("ZPS_CONFIG") or DEFAULT_CONFIG_PATH)
    setup_logging(args.log_level or "warning")
    return _keygen(args.out, args.name, force=args.force, parents=args.parents)


def _check_config(path: str) -> int:
    """Validate a settings file offline: every section and key, and the CURVE key files
    it names (readable, of the right kind, the public key the one of the secret key).
    0: valid; 1: the first error, naming it."""
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
