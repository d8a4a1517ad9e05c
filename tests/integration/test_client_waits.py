"""Callers wait while a partition has no live copy: every shard SIGKILLed under load and
restarted on its data dir, and the clients see no error and lose no acknowledged push; a
partition away for longer than the client's timeout fails the call with
ShardUnavailableError naming the partition and the wait."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.optim import SGD
from zps.testing import DataDirCluster, ExactSumLoad, Proc

HB = 0.1
#: 2 s of silence before a peer is dead: a loaded 2-core machine must not fake deaths
#: (a SIGKILLed shard is noticed sooner: zmq drops its route).
LIVENESS = 20
FLAGS = ["--durability", "interval", "--checkpoint-interval", "0"]


def kill_shards(c: DataDirCluster, shards: list[Proc]) -> None:
    """SIGKILL every shard in one go, then wait until the broker has dropped them all."""
    for p in shards:
        os.kill(p.pid, signal.SIGKILL)
    for p in shards:
        p.popen.wait(10)
    for p in shards:
        c.wait_gone(p.pid, 20)


@pytest.mark.timeout(180)
def test_every_shard_sigkilled_and_restarted_the_clients_see_no_error(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=2)
    dirs = [tmp_path / f"data{i}" for i in range(2)]
    c.start_broker()
    shards = [c.start_shard(d, FLAGS) for d in dirs]
    c.wait_healthy(30)

    async def scenario() -> tuple[list[str], ExactSumLoad, float | None, int]:
        # acks="all" (the default); a timeout well past the outage.
        load = ExactSumLoad(c.address, clients=2, rows_per_partition=32, timeout=60)
        await load.setup()
        stop = asyncio.Event()
        pushing = asyncio.create_task(load.run(stop))
        while load.total_pushes < 200 and not pushing.done():
            await asyncio.sleep(0.05)
        assert not pushing.done(), [w.errors for row in load.writers for w in row]
        killed_at = time.monotonic()
        acked_at_kill = load.total_pushes
        await asyncio.to_thread(kill_shards, c, shards)
        # Both copies are gone: the partition has no live copy.  The same data dirs
        # come back; the clients keep waiting meanwhile.
        for d in dirs:
            c.start_shard(d, FLAGS)
        await asyncio.to_thread(c.wait_healthy, 60)
        target = load.total_pushes + 200
        while load.total_pushes < target and not pushing.done():
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(pushing, 60)
        return await load.verify(), load, load.failover_time(0, killed_at), acked_at_kill

    problems, load, outage, acked_at_kill = asyncio.run(scenario())
    # No caller saw an error, and every acknowledged push is there exactly once.
    assert not problems, "\n".join(problems)
    assert acked_at_kill >= 200 and load.total_pushes >= acked_at_kill + 200
    # The pushes sent after the kill waited for the restarted copies (longer than the
    # broker took to notice the kill): no survivor answered them.
    assert outage is not None and outage > 0.2, outage


@pytest.mark.timeout(120)
def test_a_partition_away_longer_than_the_timeout_fails_naming_it_and_the_wait(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "data0"
    c.start_broker()
    shard = c.start_shard(data, FLAGS)
    c.wait_healthy(30)

    async def scenario() -> None:
        ids = np.arange(8, dtype=np.int64)
        async with zps.connect(c.address, timeout=2.0) as ps:
            await ps.create_embedding("w", dim=2, dtype="float64", optimizer=SGD(lr=1.0))
            await ps.push_rows("w", ids, np.ones((8, 2)))
            await asyncio.to_thread(kill_shards, c, [shard])
            start = time.monotonic()
            with pytest.raises(zps.ShardUnavailableError) as e:
                await ps.push_rows("w", ids, np.ones((8, 2)))
            waited = time.monotonic() - start
            # It waited for its deadline (the loop's timer may fire a hair early), not
            # failed at once; the error says so.
            assert 1.9 <= waited < 4.0, waited
            err = e.value
            assert err.partition == 0 and err.waited is not None and err.waited >= 2.0
            assert err.missing in ("lost", "no primary", "no live copy"), err.missing
            assert "partition 0" in str(err) and "gave up after waiting 2.0s" in str(err)
            # The copy comes back with its data: the same client is served again.
            await asyncio.to_thread(c.start_shard, data, FLAGS)
            await asyncio.to_thread(c.wait_healthy, 60)
            rows = await ps.pull_rows("w", ids)
        # The first push only (the one that failed was never applied: no copy took it).
        np.testing.assert_array_equal(rows, np.full((8, 2), -1.0))

    asyncio.run(scenario())
