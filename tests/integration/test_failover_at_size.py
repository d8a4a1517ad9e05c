"""Failover of a large partition (> 300 MB) in the default configuration (replication
2, acks="all", min_in_sync 2, one spare), with real processes: writes go on while the
spare that replaces the lost copy loads its snapshot, acknowledged on the promoted
primary's log (``replication.write_while_repairing``), and nothing acknowledged is lost.
The stall it replaces grew with the partition (a snapshot loads at a few hundred MB/s);
its figures are bench/big_partition.py's."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from zps.optim import Adagrad
from zps.testing import DataDirCluster, ExactSumLoad, free_port

HB, LIVENESS = 0.1, 5
ROWS, DIM, BATCH = 1_250_000, 32, 125_000  # 330 MB of rows and Adagrad state


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[DataDirCluster]:
    c = DataDirCluster(
        partitions=1, replication=2, heartbeat_interval=HB, liveness=LIVENESS, workdir=tmp_path
    )
    c.port = free_port()
    try:
        yield c
    finally:
        c.stop()


def replica_state(status: dict[str, Any]) -> tuple[str | None, bool]:
    """(the partition's replica, whether it is in sync)."""
    replicas = status["partitions"][0]["replicas"]
    if not replicas:
        return None, False
    return replicas[0]["node"], bool(replicas[0]["in_sync"])


async def test_writes_go_on_while_a_large_partitions_new_copy_loads(
    cluster: DataDirCluster, tmp_path: Path
) -> None:
    c = cluster
    c.start_broker()
    dirs = [tmp_path / name for name in ("a", "b", "spare")]
    procs = [c.start_shard(d) for d in dirs]
    c.wait_for(lambda s: c.healthy(s) and len(s["shards"]) == 3, 60, "2 copies in sync and a spare")
    async with zps.connect(c.address, timeout=60) as ps:
        await ps.create_embedding("big", DIM, optimizer=Adagrad(lr=0.1))
        grads = np.random.default_rng(0).random((BATCH, DIM), dtype=np.float32)
        for start in range(0, ROWS, BATCH):
            await ps.push_rows("big", np.arange(start, start + BATCH), grads)
    c.wait_for(lambda s: replica_state(s)[1], 60, "the replica in sync with the large table")
    status = c.status()
    primary = next(p for p in procs if p.pid == next(
        s["pid"] for s in status["shards"] if s["node"] == status["partitions"][0]["primary"]
    ))  # fmt: skip

    load = ExactSumLoad(c.address, clients=1, timeout=60)
    await load.setup()
    stop = asyncio.Event()
    task = asyncio.create_task(load.run(stop))
    try:
        await asyncio.sleep(0.5)
        killed_at = time.monotonic()
        primary.popen.send_signal(signal.SIGKILL)
        # Watch the spare that replaces the lost copy: while it is listed and not in
        # sync, the partition has one copy in sync.  Remember the last moment seen so.
        loading_seen_at = None
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "the new copy never caught up"
            s = await asyncio.to_thread(c.status)
            node, synced = replica_state(s)
            if s["partitions"][0]["epoch"] > status["partitions"][0]["epoch"] and node:
                if synced:
                    break
                loading_seen_at = time.monotonic()
            await asyncio.sleep(0.05)
        assert loading_seen_at is not None, "the new copy was never seen loading"
        # The rebuilt copy is in sync: it holds every write the primary acknowledged
        # alone meanwhile, so it may take over at once (with the killed shard back as
        # the spare) without losing one.
        # Whichever shard registered first became the primary: it comes back on its
        # own data directory.
        back = c.start_shard(dirs[procs.index(primary)])
        await asyncio.to_thread(
            c.wait_for,
            lambda x: any(y["pid"] == back.pid and y["role"] == "spare" for y in x["shards"]),
            60,
            "the killed shard back as the spare",
        )
        s = await asyncio.to_thread(c.status)
        serving = s["partitions"][0]["primary"]
        pid = next(x["pid"] for x in s["shards"] if x["node"] == serving)
        second = next(p for p in procs if p.pid == pid)
        second.popen.send_signal(signal.SIGKILL)
        await asyncio.to_thread(
            c.wait_for,
            lambda x: (
                x["partitions"][0]["epoch"] > s["partitions"][0]["epoch"]
                and x["partitions"][0]["primary"] is not None
            ),
            60,
            "the rebuilt copy to take over",
        )
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    acks = [ack for row in load.writers for w in row for _, ack in w.acks]
    during = [a for a in acks if killed_at < a < loading_seen_at]
    # Acknowledged while the new copy was still loading: the write did not wait for it.
    assert during, (
        f"no push acknowledged between the kill and {loading_seen_at - killed_at:.2f}s "
        "after it, while the new copy loaded"
    )
    gaps = np.diff(sorted([killed_at, *acks]))
    print(f"longest gap between acknowledgements around the kill: {gaps.max():.3f}s")
    assert await load.verify() == []
