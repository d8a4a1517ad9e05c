"""A shard whose event loop is busy with one long step is not failed over: its liveness
thread heartbeats for it (zps.shard.liveness) up to ``heartbeat.max_loop_stall``; a loop
busy for longer is taken for stuck, and the shard is failed over.  The step here is a
signal handler that holds the shard's main thread (the table growth it stands for takes
seconds only with millions of rows: see bench/index_growth.py and the README of bench).
A shard whose liveness thread fails stops, with an error, rather than serve unheard."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.init import Zeros
from zps.optim import SGD
from zps.testing import LocalCluster, free_port, scrape_metric

HB = 0.1
LIVENESS = 5  # a shard silent for 0.5 s is dead
BLOCK_S = 2.0  # how long SIGUSR1 holds a shard's event loop
ROWS = np.arange(64, dtype=np.int64)

#: Installed in every process of the cluster: SIGUSR1 holds the main thread (the event
#: loop) for ZPS_TEST_BLOCK_S seconds, as one long step of the loop would.
BLOCKER = """
import os, signal, time
_block = float(os.environ.get("ZPS_TEST_BLOCK_S") or 0)
if _block:
    signal.signal(signal.SIGUSR1, lambda *_: time.sleep(_block))
"""


@pytest.fixture
def blockable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("ZPS_TEST_BLOCK_S", str(BLOCK_S))
    return tmp_path


def _cluster(workdir: Path, replication: int, shard_args: list[str]) -> LocalCluster:
    return LocalCluster(
        partitions=1,
        shards=replication,
        replication=replication,
        heartbeat_interval=HB,
        liveness=LIVENESS,
        shard_args=shard_args,
        workdir=workdir,
    )


def _broker_log(c: LocalCluster) -> str:
    return c.broker().log()


async def _primary(c: LocalCluster) -> int:
    return await asyncio.to_thread(c.shard_pid, 0)


@pytest.fixture
def one_copy(blockable: Path) -> Iterator[tuple[LocalCluster, int]]:
    mport = free_port()
    (blockable / "c").mkdir()
    with _cluster(blockable / "c", 1, ["--metrics-port", str(mport)]) as c:
        yield c, mport


async def test_a_busy_event_loop_keeps_its_shard_and_its_partition(
    one_copy: tuple[LocalCluster, int],
) -> None:
    """One copy: before, the shard was declared dead after 0.5 s and the partition lost
    (every request failed until the shard registered again)."""
    c, mport = one_copy
    async with zps.connect(c.address, timeout=30) as ps:
        await ps.create_embedding("t", dim=4, init=Zeros(), optimizer=SGD(lr=1.0))
        await ps.push_rows("t", ROWS, np.ones((64, 4), np.float32))
        epoch = (await ps.status())["partitions"][0]["epoch"]
        c.kill(await _primary(c), signal.SIGUSR1)
        start = time.monotonic()
        await ps.push_rows("t", ROWS, np.ones((64, 4), np.float32))  # waits for the loop
        waited = time.monotonic() - start
        rows = await ps.pull_rows("t", ROWS)
        status = await ps.status()
    assert waited > BLOCK_S / 2, f"the shard's loop was not held ({waited:.2f}s)"
    assert (rows == -2.0).all()  # both pushes, once each
    assert status["partitions"][0]["epoch"] == epoch  # no failover
    assert "declared dead" not in _broker_log(c)
    assert scrape_metric(mport, "zps_shard_heartbeats_covered_total") >= 5
    gap = scrape_metric(mport, "zps_shard_event_loop_longest_gap_seconds")
    assert BLOCK_S * 0.9 < gap < BLOCK_S + 1.0


@pytest.fixture
def two_copies(blockable: Path) -> Iterator[LocalCluster]:
    (blockable / "c").mkdir()
    with _cluster(blockable / "c", 2, ["--max-loop-stall", "0.5"]) as c:
        yield c


async def test_a_loop_busy_past_max_loop_stall_is_failed_over(two_copies: LocalCluster) -> None:
    c = two_copies
    await asyncio.to_thread(c.wait_healthy, 20)
    # acks=1: the promoted copy answers alone (with "all" the write would wait for the
    # old primary to come back and catch up, after its loop is free again).
    async with zps.connect(c.address, timeout=30, acks=1) as ps:
        await ps.create_embedding("t", dim=4, init=Zeros(), optimizer=SGD(lr=1.0))
        await ps.push_rows("t", ROWS, np.ones((64, 4), np.float32))
        before = (await ps.status())["partitions"][0]
        stuck = await _primary(c)
        c.kill(stuck, signal.SIGUSR1)
        # Served by the replica, promoted while the old primary's loop is still held.
        start = time.monotonic()
        await ps.push_rows("t", ROWS, np.ones((64, 4), np.float32))
        served_in = time.monotonic() - start
        after = (await ps.status())["partitions"][0]
        rows = await ps.pull_rows("t", ROWS)
    assert served_in < BLOCK_S, f"the push waited for the stuck loop ({served_in:.2f}s)"
    assert after["epoch"] > before["epoch"] and after["primary"] != before["primary"]
    assert (rows == -2.0).all()  # both pushes, once each
    assert "declared dead" in _broker_log(c)
    await asyncio.to_thread(c.wait_healthy, 20)  # the old primary comes back as a replica


#: Installed in every process of the cluster: after SIGUSR2, the liveness policy of the
#: shard that got it raises (a fault in the liveness thread).
BREAKER = """
import os, signal
if os.environ.get("ZPS_TEST_BREAK_LINKS"):
    import zps.shard.liveness as _lv
    _broken = []
    _due = _lv.Liveness.due

    def _breaking_due(self, now):
        if _broken:
            raise RuntimeError("a fault injected into the liveness policy")
        return _due(self, now)

    _lv.Liveness.due = _breaking_due
    signal.signal(signal.SIGUSR2, lambda *_: _broken.append(True))
"""


@pytest.fixture
def breakable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BREAKER)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("ZPS_TEST_BREAK_LINKS", "1")
    (tmp_path / "c").mkdir()
    with _cluster(tmp_path / "c", 2, []) as c:
        yield c


async def test_a_shard_whose_liveness_thread_fails_stops_and_is_failed_over(
    breakable: LocalCluster,
) -> None:
    """Before, the shard went on serving with its links silent (the thread only logged
    its failure); the broker failed it over but the process stayed up, unheard."""
    c = breakable
    await asyncio.to_thread(c.wait_healthy, 20)
    async with zps.connect(c.address, timeout=30, acks="all") as ps:
        await ps.create_embedding("t", dim=4, init=Zeros(), optimizer=SGD(lr=1.0))
        await ps.push_rows("t", ROWS, np.ones((64, 4), np.float32))  # on both copies
        before = (await ps.status())["partitions"][0]
    pid = await _primary(c)
    (proc,) = [p for p in c.procs if p.pid == pid]
    c.kill(pid, signal.SIGUSR2)
    code = await asyncio.to_thread(proc.popen.wait, 10)
    # acks=1: the promoted copy is the only one left.
    async with zps.connect(c.address, timeout=30, acks=1) as ps:
        await ps.push_rows("t", ROWS, np.ones((64, 4), np.float32))
        after = (await ps.status())["partitions"][0]
        rows = await ps.pull_rows("t", ROWS)
    assert code != 0, "the shard exited as if asked to"
    assert "its liveness thread failed: a fault injected into the liveness policy" in proc.log()
    assert after["epoch"] > before["epoch"] and after["primary"] != before["primary"]
    assert (rows == -2.0).all()  # both pushes, once each
