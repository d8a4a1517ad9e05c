"""Training functions that tests/integration/test_worker.py runs through zps-worker
(imported by name).  Each prints JSON lines (flushed) at the points a test waits for."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np

from zps.optim import SGD


def _say(**record: Any) -> None:
    print(json.dumps(record), flush=True)


def _warm_up(ps: Any) -> None:
    ps.create_embedding("w", dim=4, optimizer=SGD(lr=0.1))
    for _ in range(3):
        ps.push_rows("w", np.arange(16), np.ones((16, 4)))
        ps.pull_rows("w", np.arange(16))


def compute(ps: Any, seconds: str) -> int:
    """Compute (here: sleep) for ``seconds`` without a client call, as loading data or
    evaluating does, then make one more call."""
    _warm_up(ps)
    _say(ready=True)
    time.sleep(float(seconds))
    ps.pull_rows("w", np.arange(16))
    _say(computed=True)
    return 0


async def async_compute(ps: Any, seconds: str) -> int:
    """:func:`compute` as an async function whose computing holds its event loop (with
    no call in flight)."""
    await ps.create_embedding("w", dim=4, optimizer=SGD(lr=0.1))
    await ps.push_rows("w", np.arange(16), np.ones((16, 4)))
    await ps.flush()
    _say(ready=True)
    time.sleep(float(seconds))
    await ps.pull_rows("w", np.arange(16))
    _say(computed=True)
    return 0


async def _stall(client: Any) -> None:
    """Hold the client's event loop with a call in flight: the client stalls."""
    while True:
        pending = asyncio.ensure_future(client.pull_rows("w", np.arange(16)))
        while not pending.done() and client.call_deadline() is None:
            await asyncio.sleep(0)  # until it is sent (or answered)
        if client.call_deadline() is not None:
            break
        await pending  # answered already: try again
    _say(stalled=True)
    time.sleep(3600)


def stall(ps: Any) -> int:
    """A blocking function whose client stalls (its loop held with a call in flight)."""
    _warm_up(ps)
    _say(ready=True)
    ps.run(_stall(ps.client)).result()
    return 0


async def async_stall(ps: Any) -> int:
    """The async version of :func:`stall`."""
    await ps.create_embedding("w", dim=4, optimizer=SGD(lr=0.1))
    _say(ready=True)
    await _stall(ps)
    return 0


def unknown_table(ps: Any) -> int:
    """A zps error raised in user code (a table that does not exist)."""
    _warm_up(ps)
    return _pull_missing(ps)


def _pull_missing(ps: Any) -> int:
    ps.pull_rows("nope", np.arange(4))
    return 0


def own_error(ps: Any) -> int:
    """An exception of the function's own."""
    raise ValueError("bad input in own_error")


def typed(ps: Any, first: str, *, lr: float, epochs: int, layers: list[int], tag: str) -> int:
    """Print the arguments it got, with their types."""
    got = {"first": first, "lr": lr, "epochs": epochs, "layers": layers, "tag": tag}
    _say(args={k: [v, type(v).__name__] for k, v in got.items()})
    return 0


def tasks(ps: Any, job: str) -> int:
    """Work through the data tasks of ``job`` (4 records, 2 per task)."""
    ps.create_job(job, 4, 2)
    done = 0
    while (task := ps.next_task(job)) is not None:
        ps.task_done(task)
        done += 1
    _say(tasks=done)
    return 0


def job_failed(ps: Any) -> int:
    """The job failed (as next_task raises it once a task failed too often)."""
    from zps.errors import JobFailedError

    raise JobFailedError("task 0 of job 'j' failed 1 times (max_retries 0)")
