"""Training functions that the tests run through zps-worker (imported by name)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

import zps
from zps.optim import SGD


def count_records(
    ps: Any, job: str, n_records: str, per_task: str, epochs: str, delay: str = "0"
) -> int:
    """Train on tasks; every record trained adds 1 to its row of 'seen' (per epoch).

    The counting goes through a second, async-mode client, so it is exact in
    every mode (sync mode would average it with the other workers' steps).
    """
    ps.create_job(job, int(n_records), int(per_task), epochs=int(epochs))
    done = 0
    with zps.connect_sync(ps.client.address, mode="async") as counter:
        counter.create_embedding("seen", dim=1, dtype="float64", optimizer=SGD(lr=1.0))
        while not ps.stop_requested:
            task = ps.next_task(job)
            if task is None:
                break
            ids = np.arange(task.start, task.stop, dtype=np.int64) + task.epoch * int(n_records)
            for chunk in np.array_split(ids, max(1, ids.size // 8)):
                counter.push_rows("seen", chunk, -np.ones((chunk.size, 1)))  # +1 per training
                ps.clock()
                time.sleep(float(delay))  # the compute of a real step
            ps.task_done(task)
            done += 1
    print(json.dumps({"pid": os.getpid(), "tasks": done}), flush=True)
    return 0


def sync_steps(ps: Any, steps: str, delay: str = "0") -> int:
    """Sync mode: push 1.0 to every element each step; record the steps seen."""
    ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
    seen = [ps.step]
    for _ in range(int(steps)):
        if ps.stop_requested:
            break
        before = ps.pull_dense("w")
        ps.push_dense("w", np.ones(4))
        seen.append(ps.clock())
        after = ps.pull_dense("w")
        # every commit applies the workers' average (1.0) once
        assert after[0] <= before[0] - 1.0 + 1e-9, (before, after)
        time.sleep(float(delay))
    print(json.dumps({"pid": os.getpid(), "steps": seen}), flush=True)
    return 0


def ssp_steps(ps: Any, steps: str, delay: str, tau: str, n_workers: str = "1") -> int:
    """ssp: after each clock, the slowest worker must be within tau steps.

    Starts stepping once ``n_workers`` have joined, so a fast worker cannot
    finish before a slow one's process is up.
    """
    ps.create_dense("s", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
    deadline = time.monotonic() + 30
    while len(ps.status()["training"]["workers"]) < int(n_workers):
        assert time.monotonic() < deadline, "the other workers never joined"
        time.sleep(0.01)
    worst = 0
    for _ in range(int(steps)):
        ps.push_dense("s", np.ones(2))
        mine = ps.clock()
        others = ps.status()["training"]["workers"]
        worst = max(worst, mine - min(others.values()))
        assert mine - min(others.values()) <= int(tau) + 1, (mine, others)
        time.sleep(float(delay))
    print(json.dumps({"pid": os.getpid(), "worst_lead": worst}), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    print(zps.__version__, file=sys.stderr)


def adult(ps: Any, prefix: str, job: str, epochs: str) -> int:
    """The demo's model on Adult data tasks, under its own table prefix and job."""
    from zps.examples import adult as model

    data = model.load_adult()
    result = model.train_tasks(ps, data, job=job, prefix=prefix, epochs=int(epochs))
    print(json.dumps({"pid": os.getpid(), **result}), flush=True)
    return 0
