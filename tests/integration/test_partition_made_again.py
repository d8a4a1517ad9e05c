"""A partition removed by scaling down and made again, with real processes: a copy of
the removed partition that was down meanwhile never takes the new one.

p1's primary is SIGKILLed after hundreds of writes (its replica takes over at a new
epoch, a spare becomes the replica); the cluster scales 2 -> 1 (p1 goes); the broker is
SIGKILLed and started again on its data dir; the cluster scales 1 -> 2 (a new p1, from
spares, holding only its imports); then the broker is SIGKILLed and started without its
record while the old primary comes back on its data dir.  The hold judges the claims
alone, and the old copy claims the highest LSN.  The new p1's first epoch is past every
epoch the removed one reached (kept in the broker's record, so the first restart keeps
it), so the old copy's claim is an older history and the new p1's copies keep it.
Before, the new p1 started at epoch 1 and the old copy's claim could win the hold, its
rows those of the removed partition.  Workers push before and after; every acknowledged
push stays exact.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from zps.testing import DataDirCluster, ExactSumLoad, free_port


async def _until(cond: Any, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.timeout(240)
def test_a_copy_of_a_removed_partition_comes_back_as_a_spare(tmp_path: Path) -> None:
    broker_dir = tmp_path / "broker"
    c = DataDirCluster(
        partitions=2, replication=2, shards=0, workdir=tmp_path, broker_data_dir=broker_dir
    )
    c.port = free_port()
    dirs = {}
    try:
        c.start_broker()
        for i in range(5):
            dirs[c.start_shard(tmp_path / f"data{i}").pid] = tmp_path / f"data{i}"
        c.wait_for(lambda s: c.healthy(s) and len(s["shards"]) == 5, 60, "5 shards")

        async def scenario() -> tuple[list[str], dict[str, Any], dict[str, Any], int, int]:
            load = ExactSumLoad(c.address, clients=2, rows_per_partition=32, timeout=60)
            await load.setup()

            async def more(n: int, pushing: asyncio.Task[None]) -> None:
                mark = load.total_pushes
                await _until(lambda: load.total_pushes >= mark + n or pushing.done(), 60, "pushes")

            stop = asyncio.Event()
            pushing = asyncio.create_task(load.run(stop))
            await more(600, pushing)
            # p1's primary goes down with its copy of p1 (hundreds of writes); its
            # replica takes over (a new epoch) and a spare becomes the replica.
            s = c.status()
            victim = next(x for x in s["shards"] if x["partition"] == 1 and x["role"] == "primary")
            victim_lsn = int(s["partitions"][1]["lsn"])
            await asyncio.to_thread(c.kill, int(victim["pid"]))
            await asyncio.to_thread(
                c.wait_for,
                lambda s: c.healthy(s) and victim["node"] not in [x["node"] for x in s["shards"]],
                60,
                "a new primary and a spare in the lost primary's place",
            )
            await more(30, pushing)
            removed = c.status()["partitions"][1]["epoch"]
            answer = await asyncio.to_thread(c.scale, 1)
            assert answer["ok"], answer
            await asyncio.to_thread(c.wait_resharded, 1, 120)
            # The broker restarts on its data dir between the removal and the growth.
            await asyncio.to_thread(c.kill, c.broker().pid)
            c.start_broker(grace=2.0)
            await asyncio.to_thread(c.wait_healthy, 60)
            await more(30, pushing)
            stop.set()
            await asyncio.wait_for(pushing, 60)
            # Grown again with no load: the new p1 holds its imports only, far fewer
            # writes than the old copy's.
            answer = await asyncio.to_thread(c.scale, 2)
            assert answer["ok"], answer
            grown = await asyncio.to_thread(c.wait_resharded, 2, 120)
            assert int(grown["partitions"][1]["lsn"]) < victim_lsn, (grown, victim_lsn)
            # The broker restarts without its record, and the old primary comes back:
            # the hold judges the claims alone.  The old copy's LSN is the highest, its
            # epoch older than the new p1's.
            await asyncio.to_thread(c.kill, c.broker().pid)
            shutil.rmtree(broker_dir)
            back = c.start_shard(dirs[int(victim["pid"])])
            c.start_broker(grace=2.0)
            after = await asyncio.to_thread(
                c.wait_for,
                lambda s: (
                    c.healthy(s)
                    and len(s["partitions"]) == 2
                    and any(x["pid"] == back.pid for x in s["shards"])
                ),
                60,
                "the old copy registered",
            )
            stop = asyncio.Event()
            pushing = asyncio.create_task(load.run(stop))
            await more(100, pushing)
            stop.set()
            await asyncio.wait_for(pushing, 60)
            return await load.verify(), grown, after, removed, back.pid

        problems, grown, after, removed, back = asyncio.run(scenario())
        assert not problems, "\n".join(problems) + c.logs()
        assert grown["partitions"][1]["epoch"] > removed, (grown["partitions"][1], removed)
        assert after["partitions"][1]["epoch"] >= grown["partitions"][1]["epoch"]
        role = next(x for x in after["shards"] if x["pid"] == back)
        assert role["role"] != "primary", role
        logs = "".join(p.log() for p in c.procs if p.name.startswith("broker"))
        assert "two copies hold writes" not in logs, logs[-3000:]
    finally:
        c.stop()
