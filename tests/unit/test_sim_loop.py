"""The simulator's event loop (zps.testing.sim.aioloop.SimLoop): what the asyncio code a
run drives may depend on is fixed by the seed, not by the process it runs in."""

from __future__ import annotations

import asyncio

import pytest

from zps.testing.sim.aioloop import Proc, SimLoop
from zps.testing.sim.sched import Scheduler


def _group_cancel_order(n: int, ballast: int) -> list[int]:
    """The order in which a TaskGroup whose one task fails cancels the ``n`` others, on a
    fresh SimLoop, after ``ballast`` objects were allocated and partly freed (a process
    with another history has another heap)."""
    junk = [[object() for _ in range(k % 7 + 1)] for k in range(ballast)]
    del junk[::2]
    sched = Scheduler(0)
    loop = SimLoop(sched, lambda node: False)
    order: list[int] = []

    async def idle(i: int) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            order.append(i)
            raise

    async def fail() -> None:
        await asyncio.sleep(1)
        raise RuntimeError("the group ends")

    async def main() -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for i in range(n):
                    tg.create_task(idle(i))
                tg.create_task(fail())
        except* RuntimeError:
            pass

    asyncio.events._set_running_loop(loop)  # as a run does (zps.testing.sim.world)
    try:
        task = loop.spawn(Proc("p"), main())
        sched.run_until(10.0)
    finally:
        asyncio.events._set_running_loop(None)
    assert task.done() and not task.cancelled() and task.exception() is None, loop.errors
    loop.close()
    del junk
    return order


def test_a_task_group_cancels_in_creation_order_whatever_the_heap() -> None:
    # A set of tasks iterates by their hashes: by address, the order would be the
    # heap's (a seed's run then differed between a fresh process and the suite's).
    for ballast in (0, 1_000, 20_000):
        assert _group_cancel_order(24, ballast) == list(range(24))


def test_tasks_hash_by_the_order_they_were_created_on_their_loop() -> None:
    hashes = []
    for _ in range(2):
        sched = Scheduler(0)
        loop = SimLoop(sched, lambda node: False)

        async def nothing() -> None:
            await asyncio.sleep(0)

        asyncio.events._set_running_loop(loop)
        try:
            tasks = [loop.create_task(nothing()) for _ in range(5)]
            sched.run_until(1.0)
        finally:
            asyncio.events._set_running_loop(None)
        assert all(t.done() for t in tasks)
        hashes.append([hash(t) for t in tasks])
        loop.close()
    assert hashes[0] == hashes[1] == sorted(hashes[0])


def test_the_scheduler_collects_garbage_at_fixed_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collections of a run come at fixed counts of its events, whichever way its
    time is cut into ``run_until`` calls: the youngest generation every COLLECT_EVERY
    events, the whole heap every FULL_EVERY collections."""
    from zps.testing.sim import sched as sched_mod

    calls: list[tuple[int, int]] = []
    sched = Scheduler(0)
    monkeypatch.setattr(
        sched_mod.gc, "collect", lambda generation=2: calls.append((sched.events, generation))
    )
    n = 5 * sched_mod.COLLECT_EVERY * sched_mod.FULL_EVERY // 2
    for i in range(n):
        sched.at(i * 0.001, lambda: None)
    for end in (1.0, 3.3, 7.77, n * 0.001):
        sched.run_until(end)
    assert sched.events == n
    every, full = sched_mod.COLLECT_EVERY, sched_mod.FULL_EVERY
    assert [g for _, g in calls] == [2 if k % full == 0 else 0 for k in range(1, n // every + 1)]
