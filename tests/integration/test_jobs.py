"""Jobs as things to manage, with a real broker and shard: list, show, cancel, reset and
restart through ``zps-server job`` and the client, a create of a finished job, and a
cancel that answers a worker waiting for a task."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import zps
from zps.errors import BadRequestError
from zps.testing import LocalCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(partitions=1, shards=1) as c:
        yield c


def job_cli(c: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zps", "job", *args, "--broker", c.address, "--timeout", "10"],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_list_show_cancel_reset_restart(
    cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        zps.connect_sync(cluster.address, name="w1") as ps,
        zps.connect_sync(cluster.address, name="w2") as other,
    ):
        p = ps.create_job("cli", 6, 2, epochs=2)
        assert (p["state"], p["done"], p["total"]) == ("pending", 0, 6)
        held = ps.next_task("cli")
        assert held is not None

        out = job_cli(cluster, "list")
        assert out.returncode == 0, out.stderr
        header, *rows = out.stdout.splitlines()
        assert header.split() == ["NAME", "STATE", "EPOCH", "PROGRESS", "TASKS"]
        assert ["cli", "running", "1/2", "0.0%", "0/6"] in [r.split() for r in rows]
        listed = json.loads(job_cli(cluster, "list", "--json").stdout)
        assert {j["job"]: j["state"] for j in listed}["cli"] == "running"
        shown = json.loads(job_cli(cluster, "show", "cli", "--json").stdout)
        assert (shown["state"], shown["running"], shown["n_epochs"]) == ("running", 1, 2)

        out = job_cli(cluster, "cancel", "cli")
        assert out.returncode == 0, out.stderr
        assert "job cli cancelled: cancelled" in out.stdout
        assert other.next_task("cli") is None  # no more tasks for anyone
        ps.task_done(held)  # the task held goes on and counts
        assert ps.job("cli")["state"] == "cancelled" and ps.job("cli")["done"] == 1

        with caplog.at_level(logging.WARNING, logger="zps.client"):
            p = other.create_job("cli", 6, 2, epochs=2)
        assert p["state"] == "cancelled"
        assert "job 'cli' is cancelled (1 of 6 tasks done)" in caplog.text
        assert "restart=True" in caplog.text

        out = job_cli(cluster, "reset", "cli")
        assert out.returncode == 0, out.stderr
        assert ps.job("cli")["state"] == "pending" and ps.job("cli")["done"] == 0
        done = 0
        while (t := ps.next_task("cli")) is not None:
            ps.task_done(t)
            done += 1
        assert done == 6 and ps.job("cli")["state"] == "complete"

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zps.client"):
            p = other.create_job("cli", 6, 2, epochs=2)
        assert p["state"] == "complete" and "job 'cli' is complete (6 of 6" in caplog.text
        assert other.next_task("cli") is None

        p = other.create_job("cli", 6, 2, epochs=2, restart=True)
        assert (p["state"], p["done"]) == ("pending", 0)
        t = other.next_task("cli")
        assert t is not None
        # a second worker's restart of a job that runs again changes nothing
        assert ps.create_job("cli", 6, 2, epochs=2, restart=True)["running"] == 1

        # the client's own job control
        assert ps.cancel_job("cli")["state"] == "cancelled"
        assert ps.reset_job("cli")["state"] == "pending"
        other.task_done(t)  # held across the reset: accepted, counted for nothing
        assert ps.job("cli")["done"] == 0
        assert any(j["job"] == "cli" for j in ps.list_jobs())

        with pytest.raises(BadRequestError, match="unknown job 'nope'"):
            ps.job("nope")
    out = job_cli(cluster, "show", "nope")
    assert out.returncode == 1 and "unknown job 'nope'" in out.stderr
    out = job_cli(cluster, "cancel")
    assert out.returncode == 2 and "name the job" in out.stdout


def test_cancel_answers_a_worker_waiting_for_a_task(cluster: LocalCluster) -> None:
    async def main() -> None:
        async with (
            zps.connect(cluster.address, name="a") as a,
            zps.connect(cluster.address, name="b") as b,
        ):
            await a.create_job("wait", 1, 1)
            held = await a.next_task("wait")
            assert held is not None
            # b waits: the only task is held by a, who may still die and give it back
            waiting = asyncio.ensure_future(b.next_task("wait"))
            while (await a.job("wait"))["waiting"] != 1:  # b's call is parked
                assert not waiting.done()
            assert not waiting.done()
            await a.cancel_job("wait")
            assert await asyncio.wait_for(waiting, 10) is None
            await a.task_done(held)

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_job_control_survives_a_broker_restart(tmp_path: Path) -> None:
    """A cancel and a reset are answered once on the broker's disk: a restarted broker
    still has the job cancelled, and the reset job's orphaned task counts for nothing."""
    with (
        LocalCluster(partitions=1, shards=1, broker_data_dir=tmp_path / "broker") as c,
        zps.connect_sync(c.address, name="w1", timeout=20) as w1,
    ):
        w1.create_job("stopped", 4, 1)
        w1.cancel_job("stopped")
        w1.create_job("kept", 4, 1)
        held = w1.next_task("kept")
        assert held is not None
        w1.reset_job("kept")
        c.kill(c.broker().pid)
        c.start_broker(grace=0.5)
        c.wait_healthy()
        with zps.connect_sync(c.address, name="w2", timeout=20) as w2:
            assert w2.job("stopped")["state"] == "cancelled"
            assert w2.next_task("stopped") is None
            assert (w2.job("kept")["state"], w2.job("kept")["done"]) == ("pending", 0)
            w1.task_done(held)  # the orphaned task, reported to the new broker
            assert w2.job("kept")["done"] == 0
