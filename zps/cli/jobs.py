"""``zps-server job list|show|cancel|reset``: the data jobs a broker keeps.

``list`` prints a table (name, state, epoch, progress, tasks done/total); ``show`` one
job's progress by epoch; ``cancel`` stops handing out a job's tasks; ``reset`` puts a
job back to its start.  ``--json`` prints what the broker answered.  Cancel and reset
are job control: with CURVE key roles on, they need the operator's key.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zps.ops.config import ClientConfig

VERBS = ("list", "show", "cancel", "reset")


def add_parser(
    sub: Any,
    add_broker: Callable[[argparse.ArgumentParser], None],
    add_common: Callable[..., None],
) -> None:
    """Register ``job`` on the subcommands ``sub`` of zps-server."""
    p = sub.add_parser(
        "job",
        help="list, show, cancel or reset the data jobs (cancel and reset: job control, "
        "an operator's)",
    )
    p.add_argument("verb", choices=VERBS, help="what to do")
    p.add_argument("name", nargs="?", metavar="NAME", help="the job (show, cancel, reset)")
    add_broker(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    add_common(p, heartbeat=False)


def run(args: argparse.Namespace, broker: str, client: ClientConfig) -> int:
    """Carry out ``zps-server job``; returns the exit code."""
    from zps.cli.common import run_async

    if args.verb != "list" and not args.name:
        print(f"zps-server job {args.verb}: name the job (zps-server job {args.verb} NAME)")
        return 2
    return run_async(_run(args.verb, args.name, broker, client, args.json))


async def _run(
    verb: str, name: str | None, broker: str, client: ClientConfig, as_json: bool
) -> int:
    from zps.client.client import connect

    async with connect(broker, client) as ps:
        if verb == "list":
            jobs = await ps.list_jobs()
            print(json.dumps(jobs, indent=2, sort_keys=True) if as_json else format_jobs(jobs))
            return 0
        assert name is not None
        if verb == "show":
            progress = await ps.job(name)
        elif verb == "cancel":
            progress = await ps.cancel_job(name)
        else:
            progress = await ps.reset_job(name)
    if as_json:
        print(json.dumps(progress, indent=2, sort_keys=True))
    elif verb == "show":
        print(format_job(progress))
    else:
        print(f"job {name} {'cancelled' if verb == 'cancel' else 'reset'}: {_summary(progress)}")
    return 0


def _epoch(p: dict[str, Any]) -> str:
    n = int(p.get("n_epochs", len(p.get("epochs", []))))
    return f"{min(int(p.get('epoch', 0)) + 1, n)}/{n}"


def _percent(p: dict[str, Any]) -> str:
    total = int(p.get("total", 0))
    return f"{100.0 * int(p.get('done', 0)) / total:.1f}%" if total else "-"


def _summary(p: dict[str, Any]) -> str:
    return (
        f"{p.get('state')}, epoch {_epoch(p)}, {p.get('done')}/{p.get('total')} tasks done "
        f"({_percent(p)}), {p.get('running', 0)} running, "
        f"{p.get('waiting', 0)} workers waiting"
    )


def format_jobs(jobs: list[dict[str, Any]]) -> str:
    """The table of ``job list``."""
    if not jobs:
        return "no jobs"
    rows = [("NAME", "STATE", "EPOCH", "PROGRESS", "TASKS")]
    for p in sorted(jobs, key=lambda j: str(j.get("job"))):
        tasks = f"{p.get('done')}/{p.get('total')}"
        rows.append((str(p.get("job")), str(p.get("state")), _epoch(p), _percent(p), tasks))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def format_job(p: dict[str, Any]) -> str:
    """One job's progress, epoch by epoch (``job show``)."""
    lines = [
        f"job {p.get('job')}: {_summary(p)}",
        f"  {p.get('records')} records, {p.get('per_task')} per task, "
        f"{p.get('retried', 0)} tasks retried",
    ]
    if p.get("failed"):
        lines.append(f"  failed: {p['failed']}")
    for e in p.get("epochs", []):
        lines.append(
            f"  epoch {int(e['epoch']) + 1}: {e['done']}/{e['total']} done, {e['running']} running"
        )
    return "\n".join(lines)
