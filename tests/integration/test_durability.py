"""The write-ahead log with real processes: every shard (and the broker) SIGKILLed at
once under load, restarted on the same data dirs, and every acknowledged push is
there exactly once; a torn last record is cut at restart and only it is lost."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.optim import SGD
from zps.testing import DataDirCluster, ExactSumLoad, Proc

HB = 0.1
#: 2 s of silence before a peer is dead: a loaded 2-core machine must not fake deaths.
LIVENESS = 20


def kill_all(procs: Sequence[Proc]) -> None:
    """SIGKILL every process in one go (no process gets to do anything in between)."""
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.popen.wait(10)


def restored_lsns(procs: Sequence[Proc]) -> list[tuple[int, int, int]]:
    """(partition, LSN, messages replayed) each restarted shard logged at start."""
    out = []
    for p in procs:
        m = re.search(
            r"restored partition (\d+) at epoch \d+, LSN (\d+) from .* and (\d+) logged", p.log()
        )
        if m:
            out.append((int(m.group(1)), int(m.group(2)), int(m.group(3))))
    return out


def run_crash(
    make_cluster: Callable[..., DataDirCluster],
    tmp_path: Path,
    durability: str,
    *,
    lose_primaries: bool = False,
) -> tuple[list[str], ExactSumLoad, list[Proc]]:
    """Load, SIGKILL everything, restart, let every push finish; the differences found.

    ``lose_primaries``: the primaries' data dirs are wiped before the restart, so
    everything must come back from the replicas' own logs."""
    c = make_cluster(partitions=2, replication=2)
    dirs = [tmp_path / f"data{i}" for i in range(4)]
    flags = ["--durability", durability, "--checkpoint-interval", "0", "--checkpoint-every", "150"]
    c.start_broker()
    shards = [c.start_shard(d, flags) for d in dirs]
    c.wait_healthy(30)

    async def scenario() -> tuple[list[str], ExactSumLoad, list[Proc]]:
        load = ExactSumLoad(c.address, clients=2, rows_per_partition=32, timeout=90)
        await load.setup()
        stop = asyncio.Event()
        pushing = asyncio.create_task(load.run(stop))
        # Under load, with a checkpoint or two behind the log on every shard.
        while load.total_pushes < 600 and not pushing.done():
            await asyncio.sleep(0.05)
        assert not pushing.done(), [w.errors for row in load.writers for w in row]
        primaries = {
            s["pid"]
            for s in (await asyncio.to_thread(c.status))["shards"]
            if s["role"] == "primary"
        }
        victims = [p for p in c.procs if p.alive()]
        acked_at_kill = load.total_pushes
        await asyncio.to_thread(kill_all, victims)
        if lose_primaries:
            lost = [d for d, s in zip(dirs, shards, strict=True) if s.pid in primaries]
            assert len(lost) == 2, (primaries, [s.pid for s in shards])
            for d in lost:
                shutil.rmtree(d)
        # Same data dirs; clients keep re-sending what was in flight.
        restarted = [c.start_shard(d, flags) for d in dirs]
        c.restart_broker(grace=1.0)
        await asyncio.to_thread(c.wait_healthy, 60)
        # Pushes go on after the restart, then stop.
        target = load.total_pushes + 200
        while load.total_pushes < target and not pushing.done():
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(pushing, 90)
        assert acked_at_kill >= 600
        return await load.verify(), load, restarted

    return asyncio.run(scenario())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("durability", ["fsync", "interval"])
def test_sigkill_every_process_under_load_loses_no_acknowledged_push(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path, durability: str
) -> None:
    problems, load, restarted = run_crash(make_cluster, tmp_path, durability)
    assert not problems, "\n".join(problems)
    # Both copies of each partition came back from disk, from a checkpoint and its log.
    found = restored_lsns(restarted)
    assert sorted(p for p, _, _ in found) == [0, 0, 1, 1], [p.log()[-2000:] for p in restarted]
    assert all(lsn > 150 for _, lsn, _ in found), found
    assert any(replayed > 0 for _, _, replayed in found), found
    assert load.total_pushes >= 800


@pytest.mark.timeout(240)
def test_the_replicas_own_logs_hold_every_acknowledged_push(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    """The primaries' disks are lost with the processes: what the replicas acknowledged
    is in their logs (they acknowledge only what is on disk)."""
    problems, load, restarted = run_crash(make_cluster, tmp_path, "fsync", lose_primaries=True)
    assert not problems, "\n".join(problems)
    found = restored_lsns(restarted)
    assert sorted(p for p, _, _ in found) == [0, 1], [p.log()[-2000:] for p in restarted]
    assert load.total_pushes >= 800


@pytest.mark.timeout(120)
def test_a_torn_last_record_is_cut_at_restart_and_only_it_is_lost(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "data"
    flags = ["--durability", "fsync", "--checkpoint-interval", "0"]
    c.start_broker()
    shard = c.start_shard(data, flags)
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("v", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        for k in range(1, 11):
            ps.push_dense("v", np.full(4, float(k)))  # acknowledged: on disk
        assert np.array_equal(ps.pull_dense("v"), np.full(4, -55.0))
    kill_all([shard, c.broker()])
    (segment,) = sorted((data / "partition-0").glob("wal-*.log"))
    size = segment.stat().st_size
    with open(segment, "r+b") as f:
        f.truncate(size - 5)  # the last record (push 10) torn, as by a crash mid-write
    shard2 = c.start_shard(data, flags)
    c.restart_broker(grace=1.0)
    c.wait_healthy(30)
    assert re.search(r"write-ahead log replay stopped: .*runs past the end", shard2.log())
    with zps.connect_sync(c.address, timeout=20) as ps:
        # create + 9 pushes replayed: everything but the torn record.
        assert np.array_equal(ps.pull_dense("v"), np.full(4, -45.0))
        assert ps.checksums()[0]["lsn"] == 10
        ps.push_dense("v", np.full(4, 100.0))  # and the log goes on after it
        assert np.array_equal(ps.pull_dense("v"), np.full(4, -145.0))
    assert segment.stat().st_size > size - 5
