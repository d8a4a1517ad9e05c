"""The systemd units in deploy/: what they point to exists, and the worker's restart
policy matches zps-worker's exit codes."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

from zps.cli.worker import EXIT_JOB_FAILED

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = sorted(DEPLOY.glob("*.service"))


def unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_the_source_files_a_unit_names_exist(path: Path) -> None:
    root = DEPLOY.parent
    for name in re.findall(r"\bzps/[\w/]+\.py\b", path.read_text()):
        assert (root / name).is_file(), f"{path.name} names {name}, which does not exist"


def test_the_worker_unit_does_not_restart_a_failed_job_forever() -> None:
    worker = unit(DEPLOY / "zps-worker@.service")
    service = worker["Service"]
    assert service["Restart"] == "on-failure"
    # bad arguments (2) and a failed job (3) are never restarted ...
    prevented = {int(code) for code in service["RestartPreventExitStatus"].split()}
    assert {2, EXIT_JOB_FAILED} <= prevented
    # ... and other failures only a few times within a window longer than a start
    assert int(worker["Unit"]["StartLimitBurst"]) <= 5
    interval = worker["Unit"]["StartLimitIntervalSec"]
    assert interval.endswith("min") and int(interval[:-3]) >= 10, interval
    # the per-instance flags (typed --arg values) come before the function
    assert re.search(r"\$ZPS_WORKER_OPTS \$ZPS_WORKER_FUNCTION \$ZPS_WORKER_ARGS$",
                     service["ExecStart"])  # fmt: skip


def test_the_deploy_guide_lists_every_file_of_deploy() -> None:
    guide = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    table = guide[
        guide.index("| file | installed as |") : guide.index("\n\n", guide.index("| file"))
    ]
    listed = set(re.findall(r"`deploy/([^`]+)`", table))
    files = {str(f.relative_to(DEPLOY)) for f in DEPLOY.rglob("*") if f.is_file()}
    assert files - listed == set(), "deploy/ files missing from docs/deploy.md's table"
    assert listed - files == set(), "docs/deploy.md's table names files deploy/ lacks"
