"""zps-worker as a real process: its watchdog under a stand-in for systemd's notify
socket, what it prints when the function fails or finds nothing to do, and its typed
keyword arguments (the functions are in worker_jobs.py)."""

from __future__ import annotations

import itertools
import json
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from zps.testing import LocalCluster

HERE = Path(__file__).resolve().parent


class Worker:
    """``zps-worker worker_jobs:JOB`` with its stdout's JSON lines read by a thread (each
    with the time it came) and, with ``watchdog_usec``, its systemd notifications
    received on a datagram socket of its own (the pings' times in :attr:`pings`)."""

    def __init__(
        self,
        c: LocalCluster,
        tmp_path: Path,
        job: str,
        *flags: str,
        args: tuple[str, ...] = (),
        watchdog_usec: int | None = None,
        name: str | None = None,
    ) -> None:
        name = name or job
        self.log_path = tmp_path / f"{name}.log"
        env = c.env()
        self.sock: socket.socket | None = None
        self.pings: list[float] = []
        if watchdog_usec is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.sock.bind(str(tmp_path / f"{name}.notify"))
            self.sock.settimeout(0.2)
            env["NOTIFY_SOCKET"] = str(tmp_path / f"{name}.notify")
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        with open(self.log_path, "w") as err:
            self.popen = subprocess.Popen(
                [
                    *(sys.executable, "-m", "zps.worker_entry", "--broker", c.address),
                    *("--quiet", *flags, "worker_jobs:" + job, *args),
                ],
                cwd=HERE,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.lines: queue.Queue[tuple[float, dict[str, Any]]] = queue.Queue()
        self._threads = [threading.Thread(target=self._read, daemon=True)]
        if self.sock is not None:
            self._threads.append(threading.Thread(target=self._receive, daemon=True))
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if line.startswith("{"):
                self.lines.put((time.monotonic(), json.loads(line)))

    def _receive(self) -> None:
        assert self.sock is not None
        while self.popen.poll() is None:
            try:
                message = self.sock.recv(4096)
            except TimeoutError:
                continue
            if message == b"WATCHDOG=1":
                self.pings.append(time.monotonic())

    def wait_line(self, key: str, timeout: float = 60) -> tuple[float, dict[str, Any]]:
        """The first JSON line with ``key``, and when it came (a bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {key!r} line from the worker: {self.log()[-3000:]}"
            try:
                at, record = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                assert self.popen.poll() is None, f"worker exited: {self.log()[-3000:]}"
                continue
            if key in record:
                return at, record

    def wait_log(self, pattern: str, timeout: float = 30) -> float:
        """When a log line matching ``pattern`` was first seen (polls the file)."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.log()):
            assert time.monotonic() < deadline, f"no {pattern!r} in {self.log()[-3000:]}"
            assert self.popen.poll() is None, f"worker exited: {self.log()[-3000:]}"
            time.sleep(0.05)
        return time.monotonic()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)
        for t in self._threads:
            t.join(5)
        if self.sock is not None:
            self.sock.close()


def test_watchdog_pings_go_on_while_the_function_computes(tmp_path: Path) -> None:
    """4 s of the function's own work without a client call (a blocking function, and
    an async one holding its event loop with nothing in flight), twice the watchdog
    timeout and twice the client's timeout plus stall margin, is no stall."""
    usec = 2_000_000  # WatchdogSec=2: pings due every second
    with LocalCluster(partitions=1, shards=1) as c:
        workers = [
            Worker(c, tmp_path, job, "--timeout", "1", "--stall-margin", "1", args=("4",),
                   watchdog_usec=usec)
            for job in ("compute", "async_compute")
        ]  # fmt: skip
        try:
            spans = [(w.wait_line("ready")[0], w.wait_line("computed")[0]) for w in workers]
            for w, (began, ended) in zip(workers, spans, strict=True):
                assert w.popen.wait(30) == 0, w.log()
                assert ended - began > 3.5  # (the lines are stamped as they are read)
                during = [began, *(t for t in w.pings if began < t < ended), ended]
                gaps = [b - a for a, b in itertools.pairwise(during)]
                # systemd would restart the unit after a gap of WatchdogSec
                assert max(gaps) < usec / 1e6, (w.popen.args, gaps)
                assert "watchdog pings withheld" not in w.log(), w.log()
        finally:
            for w in workers:
                w.stop()


def test_watchdog_pings_stop_when_a_client_call_stalls(tmp_path: Path) -> None:
    """A call still in flight past its deadline (--timeout 1) plus --stall-margin 1,
    because the client's loop is held, stops the pings, in a blocking and an async
    function alike; only systemd ends the process."""
    with LocalCluster(partitions=1, shards=1) as c:
        workers = [
            Worker(c, tmp_path, job, "--timeout", "1", "--stall-margin", "1",
                   watchdog_usec=1_000_000)
            for job in ("stall", "async_stall")
        ]  # fmt: skip
        try:
            for w in workers:
                w.wait_line("ready")
                stalled, _ = w.wait_line("stalled")
                withheld = w.wait_log(r"ERROR zps\.systemd: watchdog pings withheld: ")
                # Pinged while healthy: the first ping goes as the watchdog starts, a
                # period (0.5 s) before any check can withhold one.  (Before "stalled" is
                # no order: the line and the datagram reach two reader threads, and a
                # function that stalls at once prints it within milliseconds of a ping.)
                assert [t for t in w.pings if t < withheld], w.pings
                assert withheld - stalled < 10, w.log()
            time.sleep(2.0)  # a window in which no ping may come (an absence has no event)
            for w in workers:
                seen = w.wait_log(r"watchdog pings withheld")
                assert not [t for t in w.pings if t > seen], (w.pings, seen)
                assert w.popen.poll() is None, w.log()  # only systemd would kill it
            assert re.search(r"pings withheld: a client call is still in flight [\d.]+s after "
                             r"its deadline", workers[1].log()), workers[1].log()  # fmt: skip
        finally:
            for w in workers:
                w.stop()


@pytest.mark.parametrize(
    ("job", "frames", "last", "code"),
    [
        (
            "unknown_table",
            [r'worker_jobs\.py", line \d+, in unknown_table', r"in _pull_missing"],
            "zps-worker: worker_jobs:unknown_table failed: UnknownTableError: unknown table 'nope'",
            1,
        ),
        (
            "own_error",
            [r'worker_jobs\.py", line \d+, in own_error'],
            "zps-worker: worker_jobs:own_error failed: ValueError: bad input in own_error",
            1,
        ),
        (
            "job_failed",
            [r'worker_jobs\.py", line \d+, in job_failed'],
            "zps-worker: worker_jobs:job_failed failed: JobFailedError: task 0 of job 'j' "
            "failed 1 times (max_retries 0)",
            3,  # the unit's RestartPreventExitStatus: a failed job is not restarted
        ),
    ],
)
def test_an_exception_in_the_function_keeps_its_traceback(
    cluster: LocalCluster, tmp_path: Path, job: str, frames: list[str], last: str, code: int
) -> None:
    w = Worker(cluster, tmp_path, job)
    try:
        assert w.popen.wait(60) == code, w.log()
        log = w.log()
        assert "Traceback (most recent call last):" in log, log
        for frame in frames:
            assert re.search(frame, log), log
        assert log.rstrip().splitlines()[-1] == last, log
    finally:
        w.stop()


def test_typed_keyword_arguments(cluster: LocalCluster, tmp_path: Path) -> None:
    """--arg values are JSON, or the plain string when they are not; positional ARGS
    stay strings."""
    w = Worker(
        cluster,
        tmp_path,
        "typed",
        *("--arg", "lr=0.1", "--arg", "epochs=3", "--arg", "layers=[64, 32]"),
        *("--arg", "tag=adult-v2"),
        args=("7",),
    )
    try:
        _, record = w.wait_line("args")
        assert w.popen.wait(30) == 0, w.log()
    finally:
        w.stop()
    assert record["args"] == {
        "first": ["7", "str"],
        "lr": [0.1, "float"],
        "epochs": [3, "int"],
        "layers": [[64, 32], "list"],
        "tag": ["adult-v2", "str"],
    }


def test_arguments_the_function_does_not_take_are_refused_before_connecting(
    tmp_path: Path,
) -> None:
    # no cluster: the arguments are checked before connecting
    c = LocalCluster()
    c.port = 1  # nothing listens there
    flags = ("lr=0.1", "epochs=1", "layers=[]", "tag=x", "bogus=1")
    w = Worker(c, tmp_path, "typed", *(f for v in flags for f in ("--arg", v)), args=("7",))
    try:
        assert w.popen.wait(30) == 2, w.log()
    finally:
        w.stop()
    assert w.log().strip() == (
        "zps-worker: worker_jobs:typed(ps, first, *, lr, epochs, layers, tag) cannot be "
        "called as worker_jobs:typed(ps, '7', lr=0.1, epochs=1, layers=[], tag='x', "
        "bogus=1): got an unexpected keyword argument 'bogus'"
    ), w.log()
    assert "Traceback" not in w.log(), w.log()


def test_a_worker_that_finds_nothing_to_do_says_so(cluster: LocalCluster, tmp_path: Path) -> None:
    runs = []
    for name in ("first", "again"):
        w = Worker(cluster, tmp_path, "tasks", args=("j1",), name=name)
        try:
            _, record = w.wait_line("tasks")
            assert w.popen.wait(30) == 0, w.log()
        finally:
            w.stop()
        runs.append((record["tasks"], w.log()))
    (did, log), (again, log_again) = runs
    assert did == 2 and "nothing to do" not in log, log
    assert again == 0
    assert (
        "zps-worker: worker_jobs:tasks found nothing to do: job 'j1' had no task left" in log_again
    ), log_again
