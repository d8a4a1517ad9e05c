"""A primary/backup broker pair (hot standby) with real processes, killed and paused."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from zps.broker.statefile import StateFile
from zps.errors import ZpsTimeoutError
from zps.optim import SGD
from zps.testing import ExactSumLoad, PairCluster, Proc, acked_after

HERE = Path(__file__).resolve().parent


@pytest.fixture
def pair() -> Iterator[PairCluster]:
    with PairCluster(partitions=2, shards=4, replication=2) as c:
        yield c


def whole(c: PairCluster, status: dict[str, Any]) -> bool:
    """The active broker sees its peer passive and holding its state."""
    p = status.get("pair") or {}
    peer = p.get("peer") or {}
    return (
        p.get("state") == "active"
        and peer.get("alive") is True
        and peer.get("state") == "passive"
        and peer.get("has_record") is not None
        and c.healthy(status)
    )


def status_cli(c: PairCluster, address: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`zps-server status` asking ``address`` alone."""
    return subprocess.run(
        [sys.executable, "-m", "zps", "status", "--broker", address, "--timeout", str(timeout)],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def wait_whole(c: PairCluster) -> dict[str, Any]:
    return c.wait_for(lambda s: whole(c, s), 30, "the pair to be whole")


def test_status_shows_both_brokers_and_the_active_one(pair: PairCluster) -> None:
    status = wait_whole(pair)
    p = status["pair"]
    assert p["role"] == "primary" and p["state"] == "active" and p["term"] == 1
    assert p["peer"]["endpoint"].endswith(str(pair.ports[3]))
    out = subprocess.run(
        [sys.executable, "-m", "zps", "status", "--broker", pair.address],
        env=pair.env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "this broker (primary) is ACTIVE at term 1" in out.stdout
    assert "is passive (up)" in out.stdout


def test_sigkill_of_the_active_broker_under_load_loses_nothing(pair: PairCluster) -> None:
    async def scenario() -> ExactSumLoad:
        load = ExactSumLoad(pair.address, clients=2, timeout=30.0)
        await load.setup()
        stop = asyncio.Event()
        task = asyncio.create_task(load.run(stop))
        try:
            for _ in range(3):
                await asyncio.to_thread(wait_whole, pair)
                active: Proc = await asyncio.to_thread(pair.active_broker)
                await asyncio.sleep(0.2)
                active.popen.send_signal(signal.SIGKILL)
                await asyncio.to_thread(active.popen.wait, 10)
                await acked_after(load, time.monotonic())  # the other broker serves
                pair.restart_broker(active)
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)
        return load

    load = asyncio.run(asyncio.wait_for(scenario(), 150))
    assert load.total_pushes > 0
    assert asyncio.run(load.verify()) == []
    status = wait_whole(pair)
    assert status["pair"]["term"] >= 4  # three takeovers, each at a new term


def test_a_paused_broker_is_fenced_when_it_resumes(pair: PairCluster) -> None:
    status = wait_whole(pair)
    old = pair.proc_by_pid(status["broker"]["pid"])
    old_endpoint = pair.endpoint(0 if "primary" in old.name else 1)

    async def scenario() -> ExactSumLoad:
        load = ExactSumLoad(pair.address, clients=2, timeout=30.0)
        await load.setup()
        stop = asyncio.Event()
        task = asyncio.create_task(load.run(stop))
        try:
            await asyncio.sleep(0.2)
            old.popen.send_signal(signal.SIGSTOP)
            await asyncio.to_thread(
                pair.wait_for, lambda s: s["broker"]["pid"] != old.pid, 30, "the other broker"
            )
            await acked_after(load, time.monotonic())  # it serves the writers
            old.popen.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.5)  # the resumed broker reads what queued up meanwhile
            await acked_after(load, time.monotonic())
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)
        return load

    load = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert asyncio.run(load.verify()) == []
    status = wait_whole(pair)
    assert status["broker"]["pid"] != old.pid
    assert "active -> passive" in old.log()
    # The resumed broker routes nothing: asked alone, it only answers PASSIVE.
    with pytest.raises(ZpsTimeoutError):
        zps.connect_sync(old_endpoint, connect_timeout=1.5, timeout=1.5)


def test_a_sync_job_commits_every_step_once_across_a_failover(pair: PairCluster) -> None:
    wait_whole(pair)

    def worker(name: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "zps.worker_entry",
                "--broker",
                pair.address,
                "--mode",
                "sync",
                "--name",
                name,
                "--log-level",
                "warning",
                "training_jobs:sync_steps",
                "80",
                "0.01",
            ],
            cwd=HERE,
            env=pair.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    ws = [worker(f"s{i}") for i in range(2)]
    try:
        status = pair.wait_for(
            lambda s: s["training"]["committed_step"] >= 10, 60, "a few sync steps"
        )
        pair.kill(status["broker"]["pid"])
        results = []
        for w in ws:
            out, err = w.communicate(timeout=120)
            assert w.returncode == 0, f"{err[-3000:]}\n{pair.logs()}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for w in ws:
            if w.poll() is None:
                w.kill()
                w.wait(10)
    for r in results:
        steps = r["steps"]
        assert steps == list(range(steps[0], steps[0] + len(steps))), steps  # no skip, no repeat
    with zps.connect_sync(pair.address) as ps:
        committed = ps.status()["training"]["committed_step"]
        assert committed + 1 == max(r["steps"][-1] for r in results)
        # one commit per step, each applying the average gradient (1.0) once
        np.testing.assert_array_equal(ps.pull_dense("w"), np.full(4, -(committed + 1.0)))


def test_a_pair_restarted_whole_forgets_no_partition(tmp_path: Path) -> None:
    """Each broker of a pair keeps the state in its own data dir, a standby the active
    one's: the primary, restarted alone after both died, knows the partitions that held
    data while the backup was active, and never hands them to an empty shard."""
    c = PairCluster(partitions=2, replication=1, workdir=tmp_path, broker_data_dir=tmp_path / "b")
    try:
        c.start_broker()
        primary = next(p for p in c.procs if p.name == "broker-primary")
        backup = next(p for p in c.procs if p.name == "broker-backup")
        c.wait_for(
            lambda s: s["broker"]["pid"] == primary.pid and s["pair"]["peer"]["state"] == "passive",
            30,
            "the primary to serve, its standby passive",
        )
        # The backup takes over; the primary comes back as its standby.  Its own data dir
        # holds only the empty state it knew while active.
        c.kill(primary.pid)
        c.wait_for(lambda s: s["broker"]["pid"] == backup.pid, 30, "the backup to serve")
        primary = c.restart_broker(primary)
        flags = ["--durability", "none", "--checkpoint-interval", "0"]
        dirs = [tmp_path / "s0", tmp_path / "s1"]
        holders = [c.start_shard(["--data-dir", str(d), *flags]) for d in dirs]
        wait_whole(c)
        with zps.connect_sync(c.address, timeout=20) as ps:
            ps.create_dense("w", shape=(1000,), dtype="float64", optimizer=SGD(lr=1.0))
            for k in range(5):
                ps.push_dense("w", np.full(1000, float(k + 1)))
        file = StateFile(tmp_path / "b" / "primary")
        deadline = time.monotonic() + 20
        while not ((rec := file.load()) and all(p.known for p in rec.partitions)):
            assert time.monotonic() < deadline, "the standby never wrote the active one's state"
            time.sleep(0.05)
        for h in holders:  # final checkpoints, then both brokers die
            h.popen.send_signal(signal.SIGTERM)
        for h in holders:
            assert h.popen.wait(20) == 0, h.log()[-2000:]
        for b in (backup, primary):
            c.kill(b.pid)
        # The primary alone, an empty shard first: the partitions wait, lost.
        primary = c.start_member("primary", grace=0.5)
        empty = c.start_shard()
        status = c.wait_for(
            lambda s: (
                any(x["pid"] == empty.pid for x in s["shards"])
                and all(p["state"] == "lost" for p in s["partitions"])
            ),
            30,
            "the partitions to be lost and the empty shard in",
        )
        assert status["broker"]["pid"] == primary.pid
        assert {s["role"] for s in status["shards"]} == {"spare"}, status
        assert "partition 0 is lost" in primary.log()
        for d in dirs:
            c.start_shard(["--data-dir", str(d), *flags])
        status = c.wait_healthy(30)
        assert next(s["role"] for s in status["shards"] if s["pid"] == empty.pid) == "spare"
        with zps.connect_sync(c.address, timeout=20) as ps:
            np.testing.assert_array_equal(ps.pull_dense("w"), np.full(1000, -15.0))
    finally:
        c.stop()


def test_a_status_query_never_makes_the_standby_take_over(pair: PairCluster) -> None:
    """The active broker paused (its peer link silent): an operator's `zps-server status`
    naming only the standby is answered, but does not make the standby take over; the
    first training client asking it does (Binary Star: peer silent and a client asking)."""
    status = wait_whole(pair)
    active = pair.proc_by_pid(status["broker"]["pid"])
    standby = pair.endpoint(1 if "primary" in active.name else 0)
    active.popen.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 2.0  # four peer timeouts of asking
        while time.monotonic() < deadline:
            out = status_cli(pair, standby, 0.5)
            assert "ACTIVE" not in out.stdout, out.stdout
        standby_proc = next(
            p for p in pair.procs if p.name.startswith("broker") and p is not active
        )
        assert "-> active" not in standby_proc.log(), standby_proc.log()[-2000:]
        # A training client's demand is what the standby takes over for.
        with zps.connect_sync(standby, connect_timeout=10, timeout=10) as ps:
            assert ps.cluster_map.n_partitions == 2
        assert "-> active" in standby_proc.log()
    finally:
        active.popen.send_signal(signal.SIGCONT)


def test_a_client_given_only_the_standby_is_told_so(pair: PairCluster) -> None:
    """The standby answers a client PASSIVE while the active broker serves: a client (or
    `zps-server status`) given only its address is told to give both, not that nothing
    answered."""
    status = wait_whole(pair)
    active = pair.proc_by_pid(status["broker"]["pid"])
    standby = pair.endpoint(1 if "primary" in active.name else 0)
    with pytest.raises(ZpsTimeoutError, match="it is the standby of a broker pair: give both"):
        zps.connect_sync(standby, connect_timeout=1.0, timeout=1.0)
    out = status_cli(pair, standby, 1.0)
    assert "it is the standby of a broker pair: give both" in out.stderr, out
    assert whole(pair, pair.status())  # it did not take over
