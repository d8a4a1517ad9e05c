"""Training modes, data tasks and zps-worker, with real worker processes."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.testing import LocalCluster

HERE = Path(__file__).resolve().parent


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(partitions=2, shards=2) as c:
        yield c


def worker(
    c: LocalCluster, *args: str, mode: str = "async", staleness: int = 0, name: str = "w"
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zps.worker_entry",
            "--broker",
            c.address,
            "--mode",
            mode,
            "--staleness",
            str(staleness),
            "--name",
            name,
            "--log-level",
            "warning",
            "training_jobs:" + args[0],
            *args[1:],
        ],
        cwd=HERE,
        env=c.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen[str], timeout: float = 90) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def seen_counts(c: LocalCluster, n_records: int, epochs: int) -> np.ndarray:
    with zps.connect_sync(c.address) as ps:
        return ps.pull_rows("seen", np.arange(n_records * epochs))[:, 0]


@pytest.mark.parametrize("mode", ["async", "sync", "ssp"])
def test_every_record_is_trained_once_per_epoch(cluster: LocalCluster, mode: str) -> None:
    ws = [
        worker(
            cluster, "count_records", "job", "300", "20", "2", mode=mode, staleness=1, name=f"w{i}"
        )
        for i in range(2)
    ]
    results = [finish(w) for w in ws]
    assert sum(r["tasks"] for r in results) == 2 * 15
    assert np.array_equal(seen_counts(cluster, 300, 2), np.ones(600))
    job = cluster.status()["training"]["jobs"][0]
    assert (job["done"], job["total"], job["running"]) == (30, 30, 0)
    assert [e["done"] for e in job["epochs"]] == [15, 15]


def test_a_killed_worker_s_tasks_are_requeued(cluster: LocalCluster) -> None:
    # The doomed worker's steps take 60 s: once it holds a task it is inside it
    # until killed, however fast everything else runs.
    slow = worker(cluster, "count_records", "job", "400", "20", "1", "60", name="doomed")
    other = None
    try:
        cluster.wait_for(
            lambda s: any(j["running"] for j in s["training"]["jobs"]),
            30,
            "a task to be handed out",
        )
        slow.send_signal(signal.SIGKILL)
        slow.wait(10)
        other = worker(cluster, "count_records", "job", "400", "20", "1", name="survivor")
        result = finish(other)
    finally:
        for p in (slow, other):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    counts = seen_counts(cluster, 400, 1)
    assert counts.min() >= 1, "a record was never trained"
    job = cluster.status()["training"]["jobs"][0]
    assert job["done"] == job["total"] == 20 and job["retried"] >= 1
    assert result["tasks"] >= 1


def test_a_worker_joining_mid_run_takes_tasks(cluster: LocalCluster) -> None:
    first = worker(
        cluster, "count_records", "job", "600", "20", "1", "0.01", mode="sync", name="first"
    )
    cluster.wait_for(
        lambda s: any(j["done"] >= 3 for j in s["training"]["jobs"]),
        30,
        "the first worker to finish a few tasks",
    )
    second = worker(cluster, "count_records", "job", "600", "20", "1", mode="sync", name="second")
    a, b = finish(first), finish(second)
    assert a["tasks"] >= 3 and b["tasks"] >= 1 and a["tasks"] + b["tasks"] == 30
    assert np.array_equal(seen_counts(cluster, 600, 1), np.ones(600))


def test_sync_applies_every_step_exactly_once(cluster: LocalCluster) -> None:
    ws = [worker(cluster, "sync_steps", "25", mode="sync", name=f"s{i}") for i in range(2)]
    results = [finish(w) for w in ws]
    status = cluster.status()["training"]
    committed = status["committed_step"]
    for r in results:
        steps = r["steps"]
        assert steps == list(range(steps[0], steps[0] + len(steps))), steps  # no skip, no repeat
    assert committed + 1 == max(r["steps"][-1] for r in results)
    with zps.connect_sync(cluster.address) as ps:
        # one commit per step, each applying the average gradient (1.0) once
        np.testing.assert_array_equal(ps.pull_dense("w"), np.full(4, -(committed + 1.0)))


def test_sync_completes_the_step_without_a_dead_worker(cluster: LocalCluster) -> None:
    doomed = worker(cluster, "sync_steps", "1000", "0.01", mode="sync", name="doomed")
    survivor = worker(cluster, "sync_steps", "60", mode="sync", name="survivor")
    cluster.wait_for(lambda s: s["training"]["committed_step"] >= 5, 30, "a few steps")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    result = finish(survivor, timeout=60)
    assert len(result["steps"]) == 61
    with zps.connect_sync(cluster.address) as ps:
        committed = ps.status()["training"]["committed_step"]
        np.testing.assert_array_equal(ps.pull_dense("w"), np.full(4, -(committed + 1.0)))


def test_ssp_never_lets_a_worker_run_more_than_tau_ahead(cluster: LocalCluster) -> None:
    fast = worker(cluster, "ssp_steps", "30", "0", "2", "2", mode="ssp", staleness=2, name="fast")
    slow = worker(
        cluster, "ssp_steps", "30", "0.03", "2", "2", mode="ssp", staleness=2, name="slow"
    )
    f, s = finish(fast), finish(slow)
    assert f["worst_lead"] <= 3 and s["worst_lead"] <= 3
    assert f["worst_lead"] >= 1  # the fast one really was held back at the bound


def test_sigterm_finishes_the_step_and_releases_the_task(cluster: LocalCluster) -> None:
    w = worker(cluster, "count_records", "job", "400", "40", "1", "0.02", name="term")
    cluster.wait_for(
        lambda s: any(j["running"] for j in s["training"]["jobs"]), 30, "a task to be handed out"
    )
    w.send_signal(signal.SIGTERM)
    _out, err = w.communicate(timeout=30)
    assert w.returncode == 0, err
    assert "finishing the current step" in err
    job = cluster.status()["training"]["jobs"][0]
    assert job["running"] == 0  # released, not held by a departed worker


def test_worker_progress_and_failure_exit(cluster: LocalCluster, tmp_path: Path) -> None:
    w = worker(cluster, "count_records", "job", "200", "20", "1")
    w.communicate(timeout=60)
    (tmp_path / "bad.py").write_text("def run(ps):\n    ps.create_job('j', 0, 1)\n")
    out = subprocess.run(
        [sys.executable, "-m", "zps.worker_entry", "--broker", cluster.address, "bad:run"],
        cwd=tmp_path,
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "n_records" in out.stderr


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_demo_in_each_mode_reaches_the_target_auc(mode: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zps", "demo", "--mode", mode, "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=180,
        env=LocalCluster().env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    auc = float(re.search(r"test AUC\s+([0-9.]+)", out.stdout).group(1))
    assert auc >= 0.90


def test_sync_with_two_workers_matches_a_single_worker(cluster: LocalCluster) -> None:
    from zps.examples import adult as model

    pair = [
        worker(cluster, "adult", "two", "job-two", "1", mode="sync", name=f"p{i}") for i in range(2)
    ]
    for p in pair:
        finish(p, timeout=120)
    single = worker(cluster, "adult", "one", "job-one", "1", mode="sync", name="single")
    finish(single, timeout=120)
    data = model.load_adult()
    with zps.connect_sync(cluster.address) as ps:
        two, one = model.evaluate(ps, data, "two"), model.evaluate(ps, data, "one")
    # Two sync workers average two batches per step: the same model as one
    # worker, with half the steps of twice the batch.  Stated tolerance: 0.01
    # in test log loss, 0.005 in AUC.
    assert abs(two["loss"] - one["loss"]) < 0.01, (two, one)
    assert abs(two["auc"] - one["auc"]) < 0.005, (two, one)
    assert two["auc"] >= 0.90 and one["auc"] >= 0.90
