"""set_optimizer and learning-rate schedules with real processes: replication 2 and data
dirs; a new rate reaches every partition, another kind is refused without reset_state, a
schedule advanced by the client follows its reference through a SIGKILLed primary and a
restart of every process from the write-ahead logs, and an export and import keep its
step count."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.errors import BadRequestError
from zps.optim import FTRL, SGD, Adam, at_step
from zps.optim.schedules import Cosine, LinearWarmup, Schedule, Step
from zps.testing import DataDirCluster, LocalCluster, free_port

#: 2 s of silence before a peer is dead: a loaded 2-core machine must not fake deaths.
HB, LIVENESS = 0.1, 20
IDS = np.arange(64, dtype=np.int64)  # rows on both partitions
DIM = 4
#: Only checkpoints at shutdown: a restart after SIGKILL replays everything from the log.
FLAGS = ["--checkpoint-interval", "0"]
RESTORED = re.compile(r"restored partition \d+ at epoch \d+, LSN \d+ from .* and (\d+) logged")
SCHEDULE = LinearWarmup(Step(0.5, step_size=3, gamma=0.5), warmup_steps=2)
#: The schedule set after the failover, which a restart can only find in the logs.
LATE = Cosine(0.3, total_steps=20, min_lr=0.01)


@pytest.fixture
def dd_cluster(tmp_path: Path) -> Iterator[DataDirCluster]:
    c = DataDirCluster(
        partitions=2, replication=2, heartbeat_interval=HB, liveness=LIVENESS, workdir=tmp_path
    )
    c.port = free_port()
    try:
        yield c
    finally:
        c.stop()


def grad(step: int) -> np.ndarray:
    """Step ``step``'s gradient: a different one per row and step."""
    return np.add.outer(IDS * 0.01, np.arange(DIM) * 0.1) + (step + 1)


def kill_all(c: DataDirCluster) -> None:
    procs = [p for p in c.procs if p.alive()]
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.popen.wait(10)


@pytest.mark.timeout(300)
def test_optimizer_changes_and_a_schedule_survive_failover_restart_and_export(
    dd_cluster: DataDirCluster, tmp_path: Path
) -> None:
    c = dd_cluster
    dirs = [tmp_path / f"data{i}" for i in range(6)]  # 2 primaries, 2 replicas, 2 spares
    c.start_broker()
    for d in dirs:
        c.start_shard(d, FLAGS)
    c.wait_healthy(60)

    async def scenario() -> None:
        async with zps.connect(c.address, timeout=60) as ps:
            await ps.create_embedding("emb", dim=DIM, dtype="float64", optimizer=SGD(lr=1.0))
            await ps.create_dense("w", shape=(8,), dtype="float64", optimizer=SGD(lr=1.0))
            ones = np.ones((IDS.size, DIM))
            await ps.push_rows("emb", IDS, ones)
            await ps.push_dense("w", np.ones(8))
            # A new rate of the same kind, on every partition.
            await ps.set_optimizer("emb", SGD(lr=0.25))
            await ps.set_optimizer("w", SGD(lr=0.25))
            await ps.push_rows("emb", IDS, ones)
            await ps.push_dense("w", np.ones(8))
            assert (await ps.pull_rows("emb", IDS) == -1.25).all()
            assert (await ps.pull_dense("w") == -1.25).all()
            assert (await ps.describe("emb"))["spec"].optimizer == SGD(lr=0.25)
            # Another kind: refused, naming both, and nothing changed.
            with pytest.raises(BadRequestError, match=r"sgd.*adam.*reset_state"):
                await ps.set_optimizer("emb", Adam(lr=0.1))
            await ps.push_rows("emb", IDS, ones)
            assert (await ps.pull_rows("emb", IDS) == -1.5).all()
            # ... and with reset_state: a scheduled SGD from here on.
            await ps.set_optimizer("emb", SGD(lr=SCHEDULE), reset_state=True)
            expect = await ps.pull_rows("emb", IDS)
            assert (expect == -1.5).all()

            async def train(steps: range, sched: Schedule = SCHEDULE) -> None:
                nonlocal expect
                for step in steps:
                    g = grad(step)
                    await ps.push_rows("emb", IDS, g)
                    expect = expect - sched.value(step) * g  # SGD's arithmetic
                    counts = await ps.advance_step("emb")
                    assert counts == {"emb": step + 1}

            await train(range(5))
            assert (await ps.pull_rows("emb", IDS) == expect).all()
            # SIGKILL both primaries: the promoted replicas go on at the same step.
            old = [await asyncio.to_thread(c.shard_pid, p) for p in (0, 1)]
            for pid in old:
                c.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(
                c.wait_for,
                lambda s: c.healthy(s) and all(p["epoch"] == 2 for p in s["partitions"]),
                60,
                "both partitions promoted, the spares their new replicas",
            )
            assert (await ps.pull_rows("emb", IDS) == expect).all()
            await train(range(5, 9))
            assert (await ps.pull_rows("emb", IDS) == expect).all()
            described = await ps.describe("emb")
            assert described["spec"].step == 9 and described["spec"].optimizer == SGD(lr=SCHEDULE)
            # Another schedule, after every checkpoint written so far.
            await ps.set_optimizer("emb", SGD(lr=LATE))
            lsns = {p["partition"]: p["lsn"] for p in (await ps.describe("emb"))["partitions"]}
            await train(range(9, 11), LATE)

        # Every process SIGKILLed, then restarted on the same data dirs: the last
        # set_optimizer is in no checkpoint, so only the logs can bring it back.
        await asyncio.to_thread(kill_all, c)
        for p, lsn in lsns.items():
            written = [
                int(f.stem.rsplit("-", 1)[1])
                for f in tmp_path.glob(f"data*/partition-{p}/ckpt-*.zps")
            ]
            assert max(written, default=0) < lsn, (p, written, lsn)  # fmt: skip
        restarted = [c.start_shard(d, FLAGS) for d in dirs]
        c.restart_broker(grace=1.0)
        await asyncio.to_thread(c.wait_healthy, 90)
        replayed = [int(m.group(1)) for p in restarted if (m := RESTORED.search(p.log()))]
        assert replayed and max(replayed) > 0, c.logs()
        async with zps.connect(c.address, timeout=60) as ps:
            assert (await ps.pull_rows("emb", IDS) == expect).all()
            described = await ps.describe("emb")
            assert described["spec"].step == 11 and described["spec"].optimizer == SGD(lr=LATE)
            await train_more(ps, 11, expect, tmp_path / "export")

    asyncio.run(scenario())
    # The blocking client: the same calls.
    with zps.connect_sync(c.address, timeout=60) as ps:
        ps.set_optimizer("w", SGD(lr=Step(1.0, step_size=1, gamma=0.5)))
        assert ps.advance_step("w", steps=2) == {"w": 3}
        before = ps.pull_dense("w")
        ps.push_dense("w", np.ones(8))
        assert (ps.pull_dense("w") == before - 0.125).all()
        with pytest.raises(BadRequestError, match=r"sgd.*ftrl"):
            ps.set_optimizer("w", FTRL())


async def train_more(ps: zps.Client, step: int, expect: np.ndarray, out: Path) -> None:
    """One more step at ``step`` (the rate of the step replayed), then an export, a drop
    and an import: the step count comes back with the table."""
    g = grad(step)
    await ps.push_rows("emb", IDS, g)
    expect = expect - LATE.value(step) * g
    assert (await ps.pull_rows("emb", IDS) == expect).all()
    assert await ps.advance_step() == {"emb": step + 1, "w": 1}
    manifest = await ps.export_model(out)
    entry = next(t for t in manifest["tables"] if t["name"] == "emb")
    assert entry["step"] == step + 1 and entry["spec"]["step"] == step + 1
    await ps.drop_table("emb")
    await ps.import_model(out, tables=["emb"])
    assert (await ps.describe("emb"))["spec"].step == step + 1
    g = grad(step + 1)
    await ps.push_rows("emb", IDS, g)
    expect = expect - LATE.value(step + 1) * g
    assert (await ps.pull_rows("emb", IDS) == expect).all()


@pytest.mark.timeout(120)
async def test_scheduled_adam_continues_bit_for_bit_after_export_and_import(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Adam with a warmup and a cosine, its state and step count exported, the table
    dropped and imported: the next steps equal a local Adam that never stopped."""
    opt = Adam(lr=LinearWarmup(Cosine(0.05, total_steps=12), warmup_steps=3))
    ids = np.arange(40, dtype=np.int64)
    rng = np.random.default_rng(5)
    param = np.zeros((ids.size, DIM))
    state = opt.init_state(ids.size, DIM, np.float64)
    async with zps.connect(cluster.address, timeout=60) as ps:
        await ps.create_embedding("adam_sched", dim=DIM, dtype="float64", optimizer=opt)
        for step in range(8):
            if step == 5:
                await ps.export_model(tmp_path / "export", tables=["adam_sched"])
                await ps.drop_table("adam_sched")
                await ps.import_model(tmp_path / "export")
                assert (await ps.describe("adam_sched"))["spec"].step == 5
            g = rng.normal(size=(ids.size, DIM))
            await ps.push_rows("adam_sched", ids, g)
            at_step(opt, step).apply(param, g, state)
            await ps.advance_step("adam_sched")
        assert (await ps.pull_rows("adam_sched", ids) == param).all()


def test_the_schedules_rate_is_what_the_test_expects() -> None:
    """The reference above relies on these values (warmup 2 steps, then halving every 3)."""
    assert [SCHEDULE.value(s) for s in range(11)] == [
        0.25, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125, 0.125,
    ]  # fmt: skip
    assert Cosine(1.0, 4).value(2) == 0.5
    assert LATE.value(10) == pytest.approx(0.155) and LATE.value(25) == 0.01
