"""The client's background calls (``wait=False``) and its gathering of operation futures,
driven with futures alone (no sockets): bounded in flight, the first error raised once,
flush waits for every one, and no error is left unretrieved."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest

from zps.client.connection import Connection
from zps.ops.config import ClientConfig

_opened: list[Connection] = []


def _conn(max_background: int = 8) -> Connection:
    """A connection never started (no sockets): its background machinery alone."""
    conn = Connection("tcp://127.0.0.1:1", ClientConfig(max_background=max_background))
    _opened.append(conn)
    return conn


@pytest.fixture(autouse=True)
async def _close() -> AsyncIterator[None]:
    yield
    while _opened:
        await _opened.pop().close()


def _futures(n: int) -> list[asyncio.Future[dict[str, Any]]]:
    loop = asyncio.get_running_loop()
    return [loop.create_future() for _ in range(n)]


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_background_call_is_in_flight_until_each_operation_is_done() -> None:
    conn = _conn()
    a, b = _futures(2)
    await conn._finish([a, b], wait=False)
    assert len(conn._background) == 1
    a.set_result({})
    await _turns()
    assert len(conn._background) == 1
    b.set_result({})
    await _turns()
    assert len(conn._background) == 0
    conn._raise_background()  # no error
    await conn._finish([], wait=False)  # nothing to wait for
    assert len(conn._background) == 0


async def test_the_first_error_is_raised_once_and_flush_waits_for_all() -> None:
    conn = _conn()
    first, second = _futures(2)
    other = _futures(1)[0]
    await conn._finish([first, second], wait=False)
    await conn._finish([other], wait=False)
    flushing = asyncio.ensure_future(conn.flush())
    second.set_exception(ValueError("one"))
    first.set_exception(ValueError("two"))  # the same call's second error: not kept
    await _turns()
    assert not flushing.done()  # `other` is still in flight
    other.set_result({})
    with pytest.raises(ValueError, match="one"):
        await asyncio.wait_for(flushing, 5)
    conn._raise_background()  # raised once only
    await conn.flush()


async def test_background_calls_are_bounded() -> None:
    conn = _conn(max_background=2)
    futs = _futures(3)
    await conn._finish([futs[0]], wait=False)
    await conn._finish([futs[1]], wait=False)
    third = asyncio.ensure_future(conn._finish([futs[2]], wait=False))
    await _turns()
    assert not third.done() and len(conn._background) == 2
    # a cancelled waiter leaves the others waiting
    fourth = asyncio.ensure_future(conn._finish(_futures(1), wait=False))
    await _turns()
    fourth.cancel()
    await _turns()
    assert not third.done()
    futs[0].set_result({})
    await asyncio.wait_for(third, 5)
    assert len(conn._background) == 2
    assert conn._bg_waiters == []


async def test_a_cancelled_operation_is_not_an_error() -> None:
    conn = _conn()
    (fut,) = _futures(1)
    await conn._finish([fut], wait=False)
    fut.cancel()
    await _turns()
    assert len(conn._background) == 0
    conn._raise_background()


async def test_gather_keeps_order_and_leaves_no_error_unretrieved() -> None:
    conn = _conn()
    futs = _futures(3)
    loop = asyncio.get_running_loop()
    for i, f in enumerate(reversed(futs)):
        loop.call_soon(f.set_result, {"i": 2 - i})
    assert [r["i"] for r in await conn._gather(futs)] == [0, 1, 2]
    futs = _futures(2)
    futs[1].set_result({"i": 1})  # some done before the call
    loop.call_soon(futs[0].set_result, {"i": 0})
    assert [r["i"] for r in await conn._gather(futs)] == [0, 1]

    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    for already in (True, False):
        futs = _futures(3)
        task = asyncio.ensure_future(conn._gather(futs))
        if not already:
            await _turns()
        # the first failure ends the call at once, whatever is still pending before it
        futs[2].set_exception(KeyError("first"))
        with pytest.raises(KeyError, match="first"):
            await asyncio.wait_for(task, 5)
        futs[0].set_exception(KeyError("later"))  # after the caller has its answer
        futs[1].set_exception(KeyError("later"))
        await _turns()
        del futs, task
        gc.collect()
        await _turns()
    assert unretrieved == []


async def test_a_cancelled_gather_cancels_its_operations() -> None:
    conn = _conn()
    futs = _futures(3)
    futs[0].set_result({})
    task = asyncio.ensure_future(conn._gather(futs))
    await _turns()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert futs[1].cancelled() and futs[2].cancelled() and not futs[0].cancelled()
    # a cancelled operation fails the call, as asyncio.gather does
    futs = _futures(2)
    task = asyncio.ensure_future(conn._gather(futs))
    await _turns()
    futs[1].cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_gather_of_coroutines_runs_them_at_once() -> None:
    conn = _conn()
    order: list[int] = []

    async def job(i: int) -> int:
        await asyncio.sleep(0.01 * (2 - i))
        order.append(i)
        return i

    assert await conn._gather([job(0), job(1), job(2)]) == [0, 1, 2]
    assert order == [2, 1, 0]
