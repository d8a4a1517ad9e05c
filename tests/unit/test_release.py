"""A partition the shard lets go is released off its event loop (zps.shard.server)."""

from __future__ import annotations

import asyncio
import threading
import weakref

from zps.shard.core import ShardCore
from zps.shard.server import release_later


async def test_a_dropped_store_is_released_on_another_thread() -> None:
    core = ShardCore()
    assert core.assign(3, 1) is not None  # the empty store it started with
    held = core.store
    assert core.assign(3, 2, primary=False) is None  # the same partition: data kept
    assert core.store is held
    freed = threading.Event()
    where: list[str] = []

    def gone() -> None:
        where.append(threading.current_thread().name)
        freed.set()

    weakref.finalize(held, gone)
    del held
    release_later(core.assign(None, 0))  # made a spare: the partition is let go
    assert not freed.is_set()  # not on the loop, not before the loop's next turn
    await asyncio.sleep(0)
    assert await asyncio.to_thread(freed.wait, 10)
    assert where == ["zps-release"]


async def test_nothing_to_release() -> None:
    release_later(None)
    await asyncio.sleep(0)
    assert not any(t.name == "zps-release" for t in threading.enumerate())
