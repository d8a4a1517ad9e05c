"""A seed's run does not depend on the process that runs it.

The suite's own process and its worker processes run the same seeds (tests/unit/
simcases.py), and a seed found failing is replayed later in yet another process: what a
process is (its pid, what it ran before) must not reach a run.  The loop's tasks hash by
their order of creation (tests/unit/test_sim_loop.py); here, the pid: every pid a real
shard could write or send is the seam's, so a run under any pid is the same run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

#: The runs of seed 5 with the real shards under each pid, in one process: the seed's
#: whole cluster loses power three times, tearing each data dir's unsynced files.
_UNDER_PIDS = """
import os, sys
from zps.testing.sim.world import run_seed
for pid in map(int, sys.argv[1:]):
    os.getpid = lambda pid=pid: pid
    r = run_seed(5, real_shard=True)
    print(r.digest, r.events, sum("loses power" in s for s in r.schedule))
"""

#: Pids of one and of seven digits (Linux's largest is 4194304).
PIDS = (7, 4194303)


@pytest.mark.timeout(180)
def test_a_real_shard_run_is_the_same_under_any_pid() -> None:
    # A process of its own: the pid is the whole process's, threads of earlier tests
    # included, so it is not changed in the suite's.
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_PIDS, *map(str, PIDS)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=150,
        check=True,
    )
    lines = done.stdout.split("\n")[: len(PIDS)]
    assert all(line.split()[2] != "0" for line in lines), lines  # power losses in the run
    assert len(set(lines)) == 1, dict(zip(PIDS, lines, strict=True))
