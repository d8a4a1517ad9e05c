"""The broker's data dir and host-aware placement, with real processes.

A broker with ``--data-dir`` remembers which partitions hold data, their epochs and
the LSN their primaries confirmed, and the training jobs: restarted, it never hands
a known partition to an empty shard (the partition waits, lost, for a copy that is
new enough, or for ``zps-server reset-partition --accept-data-loss``), and workers
carry on with their jobs.  Shards with ``--host`` labels get their partition's
copies on distinct hosts.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from zps.errors import ShardUnavailableError
from zps.optim import SGD
from zps.testing import DataDirCluster, ExactSumLoad, LocalCluster, Proc, free_port

HERE = Path(__file__).resolve().parent
HB, LIVENESS = 0.1, 10


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., DataDirCluster]]:
    """Clusters (broker not started) in tmp_path, the broker's data dir included."""
    made: list[DataDirCluster] = []

    def make(**kwargs: Any) -> DataDirCluster:
        c = DataDirCluster(
            heartbeat_interval=HB,
            liveness=LIVENESS,
            workdir=tmp_path,
            broker_data_dir=tmp_path / "broker",
            **kwargs,
        )
        c.port = free_port()
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def sigkill(c: LocalCluster, proc: Proc) -> None:
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait(10)


def sigterm(procs: Sequence[Proc], timeout: float = 20.0) -> None:
    for p in procs:
        p.popen.send_signal(signal.SIGTERM)
    for p in procs:
        assert p.popen.wait(timeout) == 0, p.log()[-2000:]


def registered(c: LocalCluster, proc: Proc) -> Callable[[dict[str, Any]], bool]:
    return lambda s: any(x["pid"] == proc.pid for x in s["shards"])


def all_lost(s: dict[str, Any]) -> bool:
    return all(p["state"] == "lost" for p in s["partitions"])


def fill(c: LocalCluster, pushes: int = 12) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tables on both partitions with exactly known values: (dense w, row ids, rows)."""
    ids = np.arange(0, 400, 3, dtype=np.int64)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(10_000,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.create_embedding("emb", dim=4, dtype="float64", optimizer=SGD(lr=1.0))
        for k in range(pushes):
            ps.push_dense("w", np.full(10_000, float(k + 1)))
            ps.push_rows("emb", ids, np.full((ids.size, 4), float(k % 3 + 1)))
        w, rows = ps.pull_dense("w"), ps.pull_rows("emb", ids)
    assert w[0] == -sum(range(1, pushes + 1))
    return w, ids, rows


def check_values(c: LocalCluster, w: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    with zps.connect_sync(c.address, timeout=20) as ps:
        np.testing.assert_array_equal(ps.pull_dense("w"), w)
        np.testing.assert_array_equal(ps.pull_rows("emb", ids), rows)


def lost_error(c: LocalCluster) -> str:
    """The error a client gets for a lost partition: ShardUnavailableError once its
    request waited its timeout (2 s) for a copy, not a ZpsTimeoutError."""
    with zps.connect_sync(c.address, timeout=2) as ps:
        start = time.monotonic()
        with pytest.raises(ShardUnavailableError) as e:
            ps.pull_dense("w")
        assert time.monotonic() - start < 5
    return str(e.value)


# -- a cold start: the broker must not hand known partitions to empty shards ------------


@pytest.mark.parametrize(
    "order", ["broker-empty-holders", "holders-broker-empty", "empty-broker-holders"]
)
def test_cold_start_never_resets_a_partition(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path, order: str
) -> None:
    c = make_cluster(partitions=2, replication=1)
    dirs = [tmp_path / "a", tmp_path / "b"]
    flags = ["--durability", "none", "--checkpoint-interval", "0"]
    broker = c.start_broker()
    holders = [c.start_shard(d, flags) for d in dirs]
    c.wait_healthy(30)
    w, ids, rows = fill(c)
    # The shards stop (each writes a final checkpoint; the broker records both
    # partitions lost at their epochs and LSNs), then the broker dies.
    sigterm(holders)
    c.wait_for(all_lost, 20, "both partitions to be lost")
    sigkill(c, broker)
    state_file = tmp_path / "broker" / "broker-state.zps"
    assert state_file.exists()

    def start_holders() -> list[Proc]:
        return [c.start_shard(d, flags) for d in dirs]

    if order == "broker-empty-holders":
        broker = c.start_broker(grace=0.5)
        c.wait_for(all_lost, 20, "the restarted broker to end its hold")
        empty = c.start_shard()
        c.wait_for(registered(c, empty), 20, "the empty shard")
        time.sleep(0.5)  # room for a wrong assignment (none must come)
        status = c.status()
        assert all_lost(status), status
        assert {s["role"] for s in status["shards"]} == {"spare"}
        assert re.search(r"partition \d", lost_error(c))
        start_holders()
    elif order == "holders-broker-empty":
        start_holders()
        time.sleep(0.3)  # they retry connecting to the broker that is not up yet
        broker = c.start_broker(grace=1.0)
        c.wait_healthy(30)
        empty = c.start_shard()
        c.wait_for(registered(c, empty), 20, "the empty shard")
    else:  # empty-broker-holders
        empty = c.start_shard()
        broker = c.start_broker(grace=0.5)
        c.wait_for(lambda s: all_lost(s) and registered(c, empty)(s), 20, "the hold to end")
        assert re.search(r"partition \d", lost_error(c))
        start_holders()
    status = c.wait_healthy(30)
    empty_role = next(s["role"] for s in status["shards"] if s["pid"] == empty.pid)
    assert empty_role == "spare", status
    check_values(c, w, ids, rows)
    log = broker.log()
    assert "restored the broker state" in log
    if order != "holders-broker-empty":
        assert re.search(r"ERROR .*partition \d is lost", log), log[-3000:]


#: Pushes the load makes before each kill of the broker and after its last restart.
PUSHES = 30


async def pushes_after(load: ExactSumLoad, mark: int, task: asyncio.Task[None]) -> None:
    """Until the load has made :data:`PUSHES` pushes past ``mark`` (within 20 s)."""
    deadline = time.monotonic() + 20
    while load.total_pushes < mark + PUSHES and not task.done():
        assert time.monotonic() < deadline, f"only {load.total_pushes - mark} pushes in 20 s"
        await asyncio.sleep(0.01)


def test_broker_sigkilled_under_load_restores_its_state(
    make_cluster: Callable[..., DataDirCluster],
) -> None:
    """Live shards re-claim what they serve; the epochs and map version go on from the
    record, exact sums hold, and an empty shard joining meanwhile stays a spare."""
    c = make_cluster(partitions=2, replication=2)
    c.start_broker()
    for _ in range(4):
        c.start_shard()
    c.wait_healthy(30)

    async def run() -> list[str]:
        load = ExactSumLoad(c.address, clients=2, timeout=60)
        await load.setup()
        stop = asyncio.Event()
        task = asyncio.create_task(load.run(stop))
        versions = []
        for round_ in range(2):
            # Writes under way when the broker dies: PUSHES more acknowledged first.
            await pushes_after(load, load.total_pushes, task)
            before = await asyncio.to_thread(c.status)
            versions.append(before["map_version"])
            await asyncio.to_thread(sigkill, c, c.broker())
            await asyncio.sleep(0.3)
            broker = c.start_broker(grace=1.0)
            after = await asyncio.to_thread(c.wait_healthy, 30)
            assert after["map_version"] > before["map_version"], (before, after)
            assert [p["epoch"] for p in after["partitions"]] >= [
                p["epoch"] for p in before["partitions"]
            ]
            assert "restored the broker state" in broker.log()
            if round_ == 0:
                c.start_shard()  # an empty shard joining the restarted broker
        await pushes_after(load, load.total_pushes, task)  # and after the last restart
        stop.set()
        await asyncio.wait_for(task, 60)
        assert load.total_pushes > 50
        return await load.verify()

    problems = asyncio.run(asyncio.wait_for(run(), 100))
    assert problems == [], problems
    # Every shard registered again with the last broker (the empty one may come last).
    status = c.wait_for(
        lambda s: len(s["shards"]) == 5 and c.healthy(s), 30, "the five shards registered"
    )
    assert sum(s["role"] == "spare" for s in status["shards"]) == 1


def test_reset_partition_takes_the_newest_surviving_copy(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "only"
    flags = ["--durability", "none", "--checkpoint-interval", "0", "--checkpoint-every", "10"]
    c.start_broker()
    shard = c.start_shard(data, flags)
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        for _ in range(12):
            ps.push_dense("w", np.ones(4))
        # One checkpoint (at LSN 10-13) lands; the next is due 10 updates after it,
        # so the three pushes below are acknowledged but in no checkpoint.
        deadline = time.monotonic() + 20
        while not list((data / "partition-0").glob("ckpt-*.zps")):
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.05)
        for _ in range(3):
            ps.push_dense("w", np.ones(4))
        lsn = ps.checksums()[0]["lsn"]
    c.wait_for(
        lambda s: s["partitions"][0]["floor"]["lsn"] == lsn, 10, "the broker to record the LSN"
    )
    sigkill(c, shard)  # its newest checkpoint is older than what it acknowledged
    c.wait_for(all_lost, 20, "the partition to be lost")
    back = c.start_shard(data, flags)
    status = c.wait_for(
        lambda s: bool(s["partitions"][0].get("held_copies")), 20, "the old copy to come back"
    )
    part = status["partitions"][0]
    assert part["state"] == "lost" and part["floor"]["lsn"] == lsn
    (held,) = part["held_copies"]
    assert held["node"] and held["lsn"] < lsn
    assert "partition 0" in lost_error(c)
    assert "LSN" in c.broker().log() and "--accept-data-loss" in c.broker().log()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "zps", "reset-partition", "--broker", c.address, *args],
            env=c.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )

    refused = cli("--partition", "0")
    assert refused.returncode == 2 and "--accept-data-loss" in refused.stderr
    wrong = cli("--partition", "7", "--accept-data-loss")
    assert wrong.returncode == 1 and "no partition 7" in wrong.stderr
    done = cli("--partition", "0", "--accept-data-loss")
    assert done.returncode == 0, done.stderr
    assert "partition 0 reset" in done.stdout
    status = c.wait_healthy(20)
    assert status["shards"][0]["pid"] == back.pid
    with zps.connect_sync(c.address, timeout=20) as ps:
        value = ps.pull_dense("w")[0]
    # The surviving checkpoint's values: some pushes, not all, and not an empty table.
    assert -15 < value < 0 and value == int(value)
    again = cli("--partition", "0", "--accept-data-loss")
    assert again.returncode == 1 and "nothing to reset" in again.stderr


# -- training jobs --------------------------------------------------------------------


def worker(c: LocalCluster, *args: str, mode: str, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zps.worker_entry",
            "--broker",
            c.address,
            "--mode",
            mode,
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


def finish(p: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    assert "unknown job" not in err
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_job_survives_a_broker_restart(
    make_cluster: Callable[..., DataDirCluster], mode: str
) -> None:
    c = make_cluster(partitions=2, replication=1)
    c.start_broker()
    c.start_shard()
    c.start_shard()
    c.wait_healthy(30)
    ws = [
        worker(c, "count_records", "job", "600", "20", "1", "0.03", mode=mode, name=f"w{i}")
        for i in range(2)
    ]
    try:
        c.wait_for(
            lambda s: any(5 <= j["done"] <= 20 for j in s["training"]["jobs"]),
            30,
            "a few tasks to be done",
        )
        sigkill(c, c.broker())
        c.start_broker(grace=0.5)
        results = [finish(w) for w in ws]
    finally:
        for w in ws:
            if w.poll() is None:
                w.kill()
                w.wait()
    assert sum(r["tasks"] for r in results) == 30
    status = c.status()
    (job,) = status["training"]["jobs"]
    assert (job["done"], job["total"], job["running"], job["retried"]) == (30, 30, 0, 0)
    with zps.connect_sync(c.address) as ps:
        seen = ps.pull_rows("seen", np.arange(600))[:, 0]
    np.testing.assert_array_equal(seen, np.ones(600))  # every record trained exactly once


def test_sync_steps_commit_exactly_once_across_a_broker_restart(
    make_cluster: Callable[..., DataDirCluster],
) -> None:
    c = make_cluster(partitions=2, replication=1)
    c.start_broker()
    c.start_shard()
    c.start_shard()
    c.wait_healthy(30)
    ws = [worker(c, "sync_steps", "40", "0.03", mode="sync", name=f"s{i}") for i in range(2)]
    try:
        c.wait_for(
            lambda s: 5 <= s["training"]["committed_step"] <= 25, 30, "a few committed steps"
        )
        sigkill(c, c.broker())
        c.start_broker(grace=0.5)
        results = [finish(w) for w in ws]
    finally:
        for w in ws:
            if w.poll() is None:
                w.kill()
                w.wait()
    committed = c.status()["training"]["committed_step"]
    for r in results:
        steps = r["steps"]
        assert steps == list(range(steps[0], steps[0] + len(steps))), steps  # no skip, no repeat
    assert committed + 1 == max(r["steps"][-1] for r in results)
    with zps.connect_sync(c.address) as ps:
        np.testing.assert_array_equal(ps.pull_dense("w"), np.full(4, -(committed + 1.0)))


# -- placement by host --------------------------------------------------------------


def hosts_by_partition(status: dict[str, Any]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for s in status["shards"]:
        if s["partition"] is not None:
            out.setdefault(s["partition"], []).append(s["host"])
    return out


def logged(proc: Proc, line: str, timeout: float = 10.0) -> None:
    """Until ``line`` is in the process's log (it logs from its timer, a tick later)."""
    deadline = time.monotonic() + timeout
    while line not in proc.log():
        assert time.monotonic() < deadline, f"not logged: {line!r}\n{proc.log()[-2000:]}"
        time.sleep(0.05)


def test_copies_land_on_distinct_hosts(tmp_path: Path) -> None:
    with LocalCluster(
        partitions=2,
        replication=2,
        shards=4,
        startup_grace=1.0,
        shard_hosts=["host-a", "host-b", "host-a", "host-b"],
        heartbeat_interval=HB,
        liveness=LIVENESS,
    ) as c:
        status = c.status()
        for p, hosts in hosts_by_partition(status).items():
            assert sorted(hosts) == ["host-a", "host-b"], (p, status["shards"])
        assert status["placement_warnings"] == []


def test_status_warns_of_copies_on_one_host_until_another_host_joins(tmp_path: Path) -> None:
    with LocalCluster(
        partitions=1,
        replication=2,
        shards=2,
        shard_hosts=["host-a"],
        heartbeat_interval=HB,
        liveness=LIVENESS,
    ) as c:
        status = c.status()
        assert hosts_by_partition(status) == {0: ["host-a", "host-a"]}
        assert status["placement_warnings"] == [
            "partition 0: 2 copies on host host-a: one host failure loses them together "
            "(no spare shard elsewhere)"
        ]
        table = subprocess.run(
            [sys.executable, "-m", "zps", "status", "--broker", c.address],
            env=c.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "WARNING: partition 0: 2 copies on host host-a" in table.stdout
        logged(c.broker(), "WARNING zps.broker: partition 0: 2 copies on host host-a")
        c.start_shard(["--host", "host-b"])
        status = c.wait_for(
            lambda s: not s["placement_warnings"] and c.healthy(s),
            30,
            "the replica to move to host-b",
        )
        assert sorted(hosts_by_partition(status)[0]) == ["host-a", "host-b"]
        assert [s["role"] for s in status["shards"] if s["partition"] is None] == ["spare"]
        logged(c.broker(), "partition 0: its copies are on distinct hosts (zones) again")
