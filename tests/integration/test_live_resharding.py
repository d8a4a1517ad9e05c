"""Live resharding with real processes: ``zps-server scale`` while workers push.

Every test pushes known increments (``ExactSumLoad``: SGD with lr 1, integer values in
float64) while the broker moves slots, and checks at the end that every row equals
exactly the sum of the acknowledged pushes: a push lost in a move, applied twice, or
applied on a partition that no longer owns its slot shows.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from zps.testing import ExactSumLoad, LocalCluster


async def _until(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _move_copying(c: LocalCluster) -> None:
    """Until a move of the resharding under way has copied some bytes."""
    c.wait_for(
        lambda s: (
            (s["reshard"].get("move") or {}).get("stage") == "copying"
            and (s["reshard"]["move"].get("bytes") or 0) > 0
        ),
        60,
        "a move copying",
    )


def _slots(status: dict) -> list[int]:  # type: ignore[type-arg]
    return [p["slots"] for p in status["partitions"]]


@pytest.mark.timeout(240)
def test_scale_2_to_4_and_back_under_load_keeps_exact_sums(tmp_path: Path) -> None:
    with LocalCluster(partitions=2, shards=4, broker_data_dir=tmp_path / "broker") as c:

        async def scenario() -> tuple[list[str], dict, dict, ExactSumLoad]:  # type: ignore[type-arg]
            load = ExactSumLoad(c.address, clients=2, rows_per_partition=64, timeout=60)
            await load.setup()
            stop = asyncio.Event()
            pushing = asyncio.create_task(load.run(stop))
            await _until(lambda: load.total_pushes >= 100 or pushing.done(), 30, "pushes")
            answer = await asyncio.to_thread(c.scale, 4)
            assert answer["ok"], answer
            up = await asyncio.to_thread(c.wait_resharded, 4, 120)
            mark = load.total_pushes
            await _until(lambda: load.total_pushes >= mark + 100 or pushing.done(), 30, "more")
            answer = await asyncio.to_thread(c.scale, 2)
            assert answer["ok"], answer
            down = await asyncio.to_thread(c.wait_resharded, 2, 120)
            mark = load.total_pushes
            await _until(lambda: load.total_pushes >= mark + 100 or pushing.done(), 30, "more")
            stop.set()
            await asyncio.wait_for(pushing, 60)
            return await load.verify(), up, down, load

        problems, up, down, load = asyncio.run(scenario())
        assert not problems, "\n".join(problems) + c.logs()
        assert _slots(up) == [1024] * 4
        assert _slots(down) == [2048] * 2
        assert up["reshard"]["moves_done"] == 8  # 2048 slots in moves of 256
        # The sources dropped the rows they gave away in steps (scan, index, copy: at
        # least three each), serving between them.
        assert up["reshard"]["compact_steps"] >= 2 * 3, up["reshard"]
        assert down["reshard"]["moves_done"] == 16
        assert load.total_pushes >= 300


async def _bulk(address: str, rows: int) -> None:
    """A table big enough that a move takes a while (its values are not checked)."""
    from zps.client.client import connect

    async with connect(address, timeout=60) as ps:
        await ps.create_embedding("bulk", dim=8)
        ids = np.arange(1, rows + 1, dtype=np.int64)
        for a in range(0, rows, 100_000):
            await ps.set_rows("bulk", ids[a : a + 100_000], np.ones((min(100_000, rows - a), 8)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["source", "destination"])
def test_primary_sigkilled_mid_move_keeps_exact_sums(tmp_path: Path, victim: str) -> None:
    """1 -> 2 partitions, both with a replica; the source's (or the destination's)
    primary is SIGKILLed while a move copies: its replica takes over (holding the fence,
    or the pieces imported so far), the move is cancelled and planned again or goes on
    against the new primary, and every acknowledged push is there exactly once."""
    with LocalCluster(
        partitions=1, shards=5, replication=2, broker_data_dir=tmp_path / "broker"
    ) as c:

        async def scenario() -> tuple[list[str], dict, ExactSumLoad]:  # type: ignore[type-arg]
            await _bulk(c.address, 300_000)
            load = ExactSumLoad(c.address, clients=2, rows_per_partition=64, timeout=60)
            await load.setup()
            stop = asyncio.Event()
            pushing = asyncio.create_task(load.run(stop))
            await _until(lambda: load.total_pushes >= 50 or pushing.done(), 30, "pushes")
            answer = await asyncio.to_thread(c.scale, 2, piece_bytes=8192)
            assert answer["ok"], answer
            status = await asyncio.to_thread(
                c.wait_for,
                lambda s: (
                    (s["reshard"].get("move") or {}).get("stage") == "copying"
                    and s["reshard"]["moves_done"] >= 1
                ),
                60,
                "a move copying",
            )
            part = 0 if victim == "source" else 1
            pid = next(
                s["pid"]
                for s in status["shards"]
                if s["partition"] == part and s["role"] == "primary"
            )
            await asyncio.to_thread(c.kill, pid)
            done = await asyncio.to_thread(c.wait_resharded, 2, 150)
            mark = load.total_pushes
            await _until(lambda: load.total_pushes >= mark + 50 or pushing.done(), 30, "more")
            stop.set()
            await asyncio.wait_for(pushing, 60)
            return await load.verify(), done, load

        problems, done, _load = asyncio.run(scenario())
        assert not problems, "\n".join(problems) + c.logs()
        assert _slots(done) == [2048, 2048]
        assert done["failovers"] >= 1
        # The move under way was cancelled and planned again, or (its reads from the
        # source done) finished against the promoted replica, which holds the fence.
        assert done["reshard"]["moves_done"] == 8, done["reshard"]


@pytest.mark.timeout(240)
def test_cancel_mid_move_unfences_the_source_and_drops_the_import(tmp_path: Path) -> None:
    with LocalCluster(partitions=1, shards=2, broker_data_dir=tmp_path / "broker") as c:

        async def scenario() -> tuple[list[str], dict, dict, list[int]]:  # type: ignore[type-arg]
            from zps.client.client import connect

            await _bulk(c.address, 300_000)
            load = ExactSumLoad(c.address, clients=2, rows_per_partition=64, timeout=60)
            await load.setup()
            stop = asyncio.Event()
            pushing = asyncio.create_task(load.run(stop))
            await _until(lambda: load.total_pushes >= 50 or pushing.done(), 30, "pushes")
            answer = await asyncio.to_thread(c.scale, 2, piece_bytes=8192)
            assert answer["ok"], answer
            await asyncio.to_thread(_move_copying, c)
            answer = await asyncio.to_thread(c.scale, cancel=True)
            assert answer["ok"], answer
            cancelled = await asyncio.to_thread(
                c.wait_for,
                lambda s: s["reshard"]["target"] is None,
                60,
                "the cancel",
            )
            mark = load.total_pushes
            await _until(lambda: load.total_pushes >= mark + 50 or pushing.done(), 30, "more")
            async with connect(c.address, timeout=60) as ps:
                ids = [a async for a in ps.table_ids("bulk")]
            # Scaling again finishes the job.
            answer = await asyncio.to_thread(c.scale, 2)
            assert answer["ok"], answer
            done = await asyncio.to_thread(c.wait_resharded, 2, 120)
            stop.set()
            await asyncio.wait_for(pushing, 60)
            all_ids = np.concatenate(ids).tolist()
            return await load.verify(), cancelled, done, all_ids

        problems, cancelled, done, all_ids = asyncio.run(scenario())
        assert not problems, "\n".join(problems) + c.logs()
        r = cancelled["reshard"]
        assert r["moves_cancelled"] == 1 and "move" not in r, r
        # The cancelled move's slots stay with the source; the destination forgot what
        # it had imported of them (no id on two partitions).
        done_slots = 256 * r["moves_done"]
        # (a partition added for the target that got no slot yet is removed again)
        assert _slots(cancelled) == ([4096 - done_slots, done_slots] if done_slots else [4096])
        assert len(all_ids) == len(set(all_ids)) == 300_000
        assert _slots(done) == [2048, 2048]


@pytest.mark.timeout(240)
def test_adagrad_state_moves_with_the_rows(tmp_path: Path) -> None:
    """Pushes on an Adagrad table before, during and after 2 -> 4 give exactly the values
    of a table that never moved (the accumulators travelled with the rows)."""
    from zps.client.client import connect
    from zps.optim import Adagrad
    from zps.protocol.specs import EmbeddingSpec
    from zps.store.tables import EmbeddingTable

    with LocalCluster(partitions=2, shards=4, broker_data_dir=tmp_path / "broker") as c:

        async def scenario() -> tuple[np.ndarray, np.ndarray, dict]:  # type: ignore[type-arg]
            async with connect(c.address, timeout=60) as ps:
                await ps.create_embedding("ada", dim=8, optimizer=Adagrad(lr=0.1))
                spec = await ps.table_spec("ada")
                assert isinstance(spec, EmbeddingSpec)
                ref = EmbeddingTable(spec)
                pool = np.arange(1, 20_001, dtype=np.int64)
                rng = np.random.default_rng(7)

                async def steps(n: int) -> None:
                    for _ in range(n):
                        ids = rng.choice(pool, 512, replace=False)
                        g = rng.standard_normal((512, 8)).astype(np.float32)
                        await ps.push_rows("ada", ids, g)
                        ref.push(ids, g)

                await steps(40)
                answer = await asyncio.to_thread(c.scale, 4, max_slots=128)
                assert answer["ok"], answer
                resharded = asyncio.create_task(asyncio.to_thread(c.wait_resharded, 4, 120))
                while not resharded.done():
                    await steps(5)
                done = await resharded
                await steps(40)
                return await ps.pull_rows("ada", pool), ref.pull(pool), done

        got, want, done = asyncio.run(scenario())
        assert _slots(done) == [1024] * 4
        np.testing.assert_array_equal(got, want)


@pytest.mark.timeout(240)
def test_sync_mode_commits_each_step_once_across_a_scale(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    with LocalCluster(partitions=2, shards=4, broker_data_dir=tmp_path / "broker") as c:

        def worker(name: str) -> subprocess.Popen[str]:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "zps.worker_entry",
                    "--broker",
                    c.address,
                    "--mode",
                    "sync",
                    "--name",
                    name,
                    "--log-level",
                    "warning",
                    "reshard_jobs:sync_rows",
                    "80",
                    "0.02",
                ],
                cwd=here,
                env=c.env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

        ws = [worker(f"s{i}") for i in range(2)]
        try:
            c.wait_for(lambda s: s["training"]["committed_step"] >= 10, 60, "steps")
            answer = c.scale(4, max_slots=128)
            assert answer["ok"], answer
            done = c.wait_resharded(4, 120)
            outs = [w.communicate(timeout=120) for w in ws]
        finally:
            for w in ws:
                if w.poll() is None:
                    w.kill()
                    w.wait(5)
        for w, (_, err) in zip(ws, outs, strict=True):
            assert w.returncode == 0, err[-3000:]
        results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        committed = c.status()["training"]["committed_step"]
        for r in results:
            steps = r["steps"]
            assert steps == list(range(steps[0], steps[0] + len(steps))), steps
        assert committed + 1 == max(r["steps"][-1] for r in results)
        assert _slots(done) == [1024] * 4
        assert done["reshard"]["moves_done"] == 16

        async def values() -> tuple[np.ndarray, np.ndarray]:
            from zps.client.client import connect

            async with connect(c.address, timeout=60) as ps:
                rows = await ps.pull_rows("sr", np.arange(1, 2001, dtype=np.int64))
                return rows, await ps.pull_dense("sw")

        rows, dense = asyncio.run(values())
        # One commit per step, each applying the workers' average (1.0) once.
        np.testing.assert_array_equal(rows, np.full((2000, 2), -(committed + 1.0)))
        np.testing.assert_array_equal(dense, np.full(4, -(committed + 1.0)))


async def _broker_killed_mid_move(
    c: LocalCluster,
    wait: Callable[[], dict],  # type: ignore[type-arg]
    *,
    more: int,
    lose: Path | None = None,
) -> tuple[list[str], dict]:  # type: ignore[type-arg]
    """Push exact sums while scaling 1 -> 2; SIGKILL the broker while a move copies (its
    data dir ``lose`` removed, if given), start it again, ``wait`` for its status, push
    ``more`` and verify: the problems found and that status."""
    await _bulk(c.address, 300_000)
    load = ExactSumLoad(c.address, clients=2, rows_per_partition=64, timeout=90)
    await load.setup()
    stop = asyncio.Event()
    pushing = asyncio.create_task(load.run(stop))
    await _until(lambda: load.total_pushes >= 50 or pushing.done(), 30, "pushes")
    answer = await asyncio.to_thread(c.scale, 2, piece_bytes=8192)
    assert answer["ok"], answer
    await asyncio.to_thread(_move_copying, c)
    await asyncio.to_thread(c.kill, c.broker().pid)
    if lose is not None:
        shutil.rmtree(lose)
    c.start_broker(grace=1.0)
    done = await asyncio.to_thread(wait)
    mark = load.total_pushes
    await _until(lambda: load.total_pushes >= mark + more or pushing.done(), 60, "more")
    stop.set()
    await asyncio.wait_for(pushing, 60)
    return await load.verify(), done


@pytest.mark.timeout(240)
def test_broker_sigkilled_mid_move_cancels_it_and_resumes_the_scale(tmp_path: Path) -> None:
    """The broker dies while a move copies; restarted on its data dir, it finds the move
    recorded as copying, cancels it (the source unfences, the destination drops), and
    finishes the resharding with every acknowledged push exact."""
    with LocalCluster(partitions=1, shards=2, broker_data_dir=tmp_path / "broker") as c:
        problems, done = asyncio.run(
            _broker_killed_mid_move(c, lambda: c.wait_resharded(2, 150), more=50)
        )
        assert not problems, "\n".join(problems) + c.logs()
        assert _slots(done) == [2048, 2048]
        assert done["reshard"]["moves_cancelled"] == 1, done["reshard"]
        # started again with --partitions 1, it says it serves its record's 2
        assert "listening on" in (said := c.broker().log()), said
        assert "2 partitions x 1 copies (the partitions of its record: the setting's 1" in said


@pytest.mark.timeout(240)
def test_a_broker_that_lost_its_data_dir_after_a_scale_takes_the_shards_slots(
    tmp_path: Path,
) -> None:
    """Scale 2 -> 3, then the broker is SIGKILLed and its data dir lost: started again
    with the configuration's 2 partitions and no record, it learns the 3 partitions and
    their slots from the shards' claims (zps/core/slotclaims.py), so the workers' calls
    go on being answered and every acknowledged push stays exact."""
    data = tmp_path / "broker"
    with LocalCluster(partitions=2, shards=3, broker_data_dir=data) as c:

        async def scenario() -> tuple[list[str], dict, dict]:  # type: ignore[type-arg]
            load = ExactSumLoad(c.address, clients=2, rows_per_partition=64, timeout=60)
            await load.setup()
            stop = asyncio.Event()
            pushing = asyncio.create_task(load.run(stop))
            await _until(lambda: load.total_pushes >= 50 or pushing.done(), 30, "pushes")
            answer = await asyncio.to_thread(c.scale, 3)
            assert answer["ok"], answer
            scaled = await asyncio.to_thread(c.wait_resharded, 3, 120)
            await asyncio.to_thread(c.kill, c.broker().pid)
            shutil.rmtree(data)
            c.start_broker(grace=2.0)
            back = await asyncio.to_thread(
                c.wait_for,
                lambda s: c.healthy(s) and len(s["partitions"]) == 3,
                60,
                "the broker serving the shards' 3 partitions",
            )
            mark = load.total_pushes
            await _until(lambda: load.total_pushes >= mark + 100 or pushing.done(), 60, "more")
            stop.set()
            await asyncio.wait_for(pushing, 60)
            return await load.verify(), scaled, back

        problems, scaled, back = asyncio.run(scenario())
        assert not problems, "\n".join(problems) + c.logs()
        assert _slots(back) == _slots(scaled) and sum(_slots(back)) == 4096
        assert back["map_version"] > scaled["map_version"]
        assert "the slot map is the shards'" in c.broker().log()


@pytest.mark.timeout(240)
def test_a_broker_that_lost_its_data_dir_mid_move_unfences_the_source(tmp_path: Path) -> None:
    """The broker dies while a move copies, and its data dir is lost: started again
    without a record it learns the move from the shards' claims (the source's fence, the
    destination's import) and cancels it itself, so the source's fenced slots take
    writes again without an operator; every acknowledged push stays exact."""
    data = tmp_path / "broker"
    with LocalCluster(partitions=1, shards=2, broker_data_dir=data) as c:

        def cancelled() -> dict:  # type: ignore[type-arg]
            return c.wait_for(
                lambda s: s["reshard"]["moves_cancelled"] == 1 and s["reshard"]["target"] is None,
                90,
                "the move under way cancelled by the broker without its record",
            )

        problems, done = asyncio.run(_broker_killed_mid_move(c, cancelled, more=100, lose=data))
        assert not problems, "\n".join(problems) + c.logs()
        assert _slots(done) == [4096]
        assert "a slot move under way when the state record was lost" in c.broker().log()


@pytest.mark.timeout(240)
def test_checkpoints_after_the_moves_restore_exactly(tmp_path: Path) -> None:
    """Scale 1 -> 2 on shards with data dirs, SIGTERM everything (final checkpoints),
    start again: the broker's recorded slot map and the shards' checkpoints give every
    row back once, with its exact value."""
    import signal

    from zps.client.client import connect
    from zps.testing import DataDirCluster, free_port

    c = DataDirCluster(
        partitions=1,
        workdir=tmp_path,
        broker_data_dir=tmp_path / "broker",
        heartbeat_interval=0.1,
        liveness=10,
    )
    c.port = free_port()
    dirs = [tmp_path / f"data{i}" for i in range(2)]
    flags = ["--checkpoint-interval", "0"]
    try:
        broker = c.start_broker()
        shards = [c.start_shard(d, flags) for d in dirs]
        c.wait_for(lambda s: len(s["shards"]) == 2 and c.healthy(s), 30, "a primary, a spare")
        load = ExactSumLoad(c.address, clients=2, rows_per_partition=64, timeout=60)

        async def before() -> list[str]:
            await _bulk(c.address, 50_000)
            await load.setup()
            stop = asyncio.Event()
            pushing = asyncio.create_task(load.run(stop))
            await _until(lambda: load.total_pushes >= 50 or pushing.done(), 30, "pushes")
            answer = await asyncio.to_thread(c.scale, 2)
            assert answer["ok"], answer
            await asyncio.to_thread(c.wait_resharded, 2, 120)
            stop.set()
            await asyncio.wait_for(pushing, 60)
            return await load.verify()

        assert not asyncio.run(before()), c.logs()
        for p in [*shards, broker]:
            p.popen.send_signal(signal.SIGTERM)
        for p in [*shards, broker]:
            assert p.popen.wait(30) == 0, p.log()[-3000:]
        for d in dirs:
            c.start_shard(d, flags)
        # Every shard restored and connecting first: the claims come as the broker binds.
        c.wait_connecting(60)
        c.start_broker(grace=1.0)
        after = c.wait_resharded(2, 60)

        async def check() -> tuple[list[str], list[int]]:
            async with connect(c.address, timeout=60) as ps:
                ids = [a async for a in ps.table_ids("bulk")]
            return await load.verify(), np.concatenate(ids).tolist()

        problems, ids = asyncio.run(check())
        assert not problems, "\n".join(problems) + c.logs()
        assert _slots(after) == [2048, 2048]
        assert len(ids) == len(set(ids)) == 50_000
    finally:
        c.stop()


@pytest.mark.timeout(120)
def test_scale_command_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    with LocalCluster(partitions=1, shards=2, broker_data_dir=tmp_path / "broker") as c:
        c.wait_for(lambda s: len(s["shards"]) == 2, 30, "a spare")

        def zps(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "zps", *args, "--broker", c.address],
                capture_output=True,
                text=True,
                timeout=90,
                env=c.env(),
            )

        up = zps("scale", "--partitions", "2", "--wait", "60")
        assert up.returncode == 0, up.stderr
        assert "2 partitions (slots 0: 2048, 1: 2048)" in up.stdout, up.stdout
        short = zps("scale", "--partitions", "3")
        assert short.returncode == 1
        assert "needs 1 spare shards" in short.stderr and "start 1 more" in short.stderr
        status = zps("status")
        assert status.returncode == 0 and "resharded: 8 moves" in status.stdout, status.stdout
        nothing = zps("scale", "--cancel")
        assert nothing.returncode == 1 and "no resharding is under way" in nothing.stderr


@pytest.mark.timeout(240)
def test_broker_pair_takeover_mid_move_keeps_exact_sums(tmp_path: Path) -> None:
    """The active broker of a pair is SIGKILLed while a move copies: the standby takes
    over with the mirrored record (the move recorded as copying) and cancels the move;
    no move starts while its peer is away (a silent peer may be one cut off that takes
    over with what it holds), and once the killed broker is back as its standby the
    resharding finishes; every acknowledged push is there exactly once."""
    from zps.testing import PairCluster

    c = PairCluster(partitions=1, shards=2, broker_data_dir=tmp_path / "b")
    with c:
        c.wait_for(lambda s: len(s["shards"]) == 2, 30, "a spare")

        async def scenario() -> tuple[list[str], dict]:  # type: ignore[type-arg]
            await _bulk(c.address, 300_000)
            load = ExactSumLoad(c.address, clients=2, rows_per_partition=64, timeout=90)
            await load.setup()
            stop = asyncio.Event()
            pushing = asyncio.create_task(load.run(stop))
            await _until(lambda: load.total_pushes >= 50 or pushing.done(), 30, "pushes")
            answer = await asyncio.to_thread(c.scale, 2, piece_bytes=8192)
            assert answer["ok"], answer
            await asyncio.to_thread(_move_copying, c)
            active = await asyncio.to_thread(c.active_broker)
            await asyncio.to_thread(c.kill, active.pid)
            waiting = await asyncio.to_thread(
                c.wait_for,
                lambda s: "standby broker" in s["reshard"]["last_error"],
                60,
                "the resharding waiting for the standby",
            )
            assert _slots(waiting) == [4096, 0]  # the cancelled move's slots stayed
            c.restart_broker(active)
            done = await asyncio.to_thread(c.wait_resharded, 2, 150)
            mark = load.total_pushes
            await _until(lambda: load.total_pushes >= mark + 50 or pushing.done(), 60, "more")
            stop.set()
            await asyncio.wait_for(pushing, 60)
            return await load.verify(), done

        problems, done = asyncio.run(scenario())
        assert not problems, "\n".join(problems) + c.logs()
        assert _slots(done) == [2048, 2048]
        assert done["reshard"]["moves_cancelled"] == 1, done["reshard"]
        # No fence waits for the standby: a move starts once it holds the move's record.
        assert done["reshard"]["max_fenced_s"] < 2.0, done["reshard"]
