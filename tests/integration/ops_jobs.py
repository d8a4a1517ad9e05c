"""Training functions the operations tests run through zps-worker (imported by name),
and :class:`Worker`, which starts one.

Each function prints one line ``{"ready": ...}`` (flushed) once it has made its first
calls, so a test waits on that line rather than on time.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zps.optim import SGD
from zps.testing import LocalCluster

HERE = Path(__file__).resolve().parent


def _warm_up(ps: Any) -> None:
    ps.create_embedding("ops", dim=4, optimizer=SGD(lr=0.1))
    for _ in range(3):
        ps.push_rows("ops", np.arange(16), np.ones((16, 4)))
        ps.pull_rows("ops", np.arange(16))
        ps.report(rows=16, loss=1.0)
        ps.clock()
    print(json.dumps({"ready": ps.step}), flush=True)


def until_stopped(ps: Any) -> int:
    """Push and pull until asked to stop, then return 0 (a well-behaved worker)."""
    _warm_up(ps)
    while not ps.stop_requested:
        ps.pull_rows("ops", np.arange(16))
        ps.report(rows=16)
        time.sleep(0.02)
    return 0


def ignore_stop(ps: Any) -> int:
    """Never looks at ``ps.stop_requested``: keeps training until killed."""
    _warm_up(ps)
    while True:
        ps.pull_rows("ops", np.arange(16))
        time.sleep(0.05)


def hang(ps: Any, seconds: str) -> int:
    """Train for ``seconds``, then hang in its own code (no client call) for good."""
    _warm_up(ps)
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        ps.pull_rows("ops", np.arange(16))
        time.sleep(0.05)
    print(json.dumps({"hanging": True}), flush=True)
    while True:
        time.sleep(1)


async def async_until_stopped(ps: Any) -> int:
    """The async-client version of :func:`until_stopped`."""
    import asyncio

    await ps.create_embedding("ops", dim=4, optimizer=SGD(lr=0.1))
    await ps.push_rows("ops", np.arange(16), np.ones((16, 4)))
    print(json.dumps({"ready": ps.step}), flush=True)
    while not ps.stop_requested:
        await ps.pull_rows("ops", np.arange(16))
        await asyncio.sleep(0.02)
    return 0


async def async_ignore_stop(ps: Any) -> int:
    """An async function that never looks at ``ps.stop_requested``."""
    import asyncio

    await ps.create_embedding("ops", dim=4, optimizer=SGD(lr=0.1))
    print(json.dumps({"ready": ps.step}), flush=True)
    while True:
        await ps.pull_rows("ops", np.arange(16))
        await asyncio.sleep(0.05)


class Worker:
    """A real zps-worker process running ``ops_jobs:JOB``; its stdout (JSON lines) is
    read by a thread, its stderr (the log) goes to a file."""

    def __init__(
        self, c: LocalCluster, log: Path, job: str, *flags: str, args: Sequence[str] = ()
    ) -> None:
        self.log_path = log
        with open(log, "w") as err:
            self.popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "zps.worker_entry",
                    "--broker",
                    c.address,
                    "--quiet",
                    *flags,
                    "ops_jobs:" + job,
                    *args,
                ],
                cwd=HERE,
                env=c.env(),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line)

    def wait_line(self, key: str, timeout: float = 30) -> dict[str, Any]:
        """The first JSON line of stdout that has ``key`` (bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {key!r} line from the worker: {self.log()[-2000:]}"
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                assert self.popen.poll() is None, f"worker exited: {self.log()[-2000:]}"
                continue
            if line.startswith("{") and key in (record := json.loads(line)):
                return dict(record)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)
