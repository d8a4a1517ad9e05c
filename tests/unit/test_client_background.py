"""The client's background calls (``wait=False``) and its gathering of operation futures,
driven with futures alone (no sockets): bounded in flight, the first error raised once,
flush waits for every one, and no error is left unretrieved; a reply's answers end the
routing brokers' tracking of the requests they answer."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from zps.client.background import Background
from zps.client.futures import gather
from zps.ops.config import ClientConfig


def _futures(n: int) -> list[asyncio.Future[dict[str, Any]]]:
    loop = asyncio.get_running_loop()
    return [loop.create_future() for _ in range(n)]


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_background_call_is_in_flight_until_each_operation_is_done() -> None:
    bg = Background(max_background=8)
    a, b = _futures(2)
    await bg.add([a, b])
    assert len(bg) == 1
    a.set_result({})
    await _turns()
    assert len(bg) == 1
    b.set_result({})
    await _turns()
    assert len(bg) == 0
    bg.raise_error()  # no error
    await bg.add([])  # nothing to wait for
    assert len(bg) == 0


async def test_the_first_error_is_raised_once_and_flush_waits_for_all() -> None:
    bg = Background(max_background=8)
    first, second = _futures(2)
    other = _futures(1)[0]
    await bg.add([first, second])
    await bg.add([other])
    flushing = asyncio.ensure_future(bg.drain())
    second.set_exception(ValueError("one"))
    first.set_exception(ValueError("two"))  # the same call's second error: not kept
    await _turns()
    assert not flushing.done()  # `other` is still in flight
    other.set_result({})
    with pytest.raises(ValueError, match="one"):
        await asyncio.wait_for(flushing, 5)
    bg.raise_error()  # raised once only
    await bg.drain()


async def test_background_calls_are_bounded() -> None:
    bg = Background(max_background=2)
    futs = _futures(3)
    await bg.add([futs[0]])
    await bg.add([futs[1]])
    third = asyncio.ensure_future(bg.add([futs[2]]))
    await _turns()
    assert not third.done() and len(bg) == 2
    # a cancelled waiter leaves the others waiting
    fourth = asyncio.ensure_future(bg.add(_futures(1)))
    await _turns()
    fourth.cancel()
    await _turns()
    assert not third.done()
    futs[0].set_result({})
    await asyncio.wait_for(third, 5)
    assert len(bg) == 2
    assert bg.waiting == 0


async def test_a_cancelled_operation_is_not_an_error() -> None:
    bg = Background(max_background=8)
    (fut,) = _futures(1)
    await bg.add([fut])
    fut.cancel()
    await _turns()
    assert len(bg) == 0
    bg.raise_error()


async def test_gather_keeps_order_and_leaves_no_error_unretrieved() -> None:
    futs = _futures(3)
    loop = asyncio.get_running_loop()
    for i, f in enumerate(reversed(futs)):
        loop.call_soon(f.set_result, {"i": 2 - i})
    assert [r["i"] for r in await gather(futs)] == [0, 1, 2]
    futs = _futures(2)
    futs[1].set_result({"i": 1})  # some done before the call
    loop.call_soon(futs[0].set_result, {"i": 0})
    assert [r["i"] for r in await gather(futs)] == [0, 1]

    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    for already in (True, False):
        futs = _futures(3)
        task = asyncio.ensure_future(gather(futs))
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
    futs = _futures(3)
    futs[0].set_result({})
    task = asyncio.ensure_future(gather(futs))
    await _turns()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert futs[1].cancelled() and futs[2].cancelled() and not futs[0].cancelled()
    # a cancelled operation fails the call, as asyncio.gather does
    futs = _futures(2)
    task = asyncio.ensure_future(gather(futs))
    await _turns()
    futs[1].cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_gather_of_coroutines_runs_them_at_once() -> None:
    order: list[int] = []

    async def job(i: int) -> int:
        await asyncio.sleep(0.01 * (2 - i))
        order.append(i)
        return i

    assert await gather([job(0), job(1), job(2)]) == [0, 1, 2]
    assert order == [2, 1, 0]


async def test_a_read_the_first_part_never_answered_is_asked_again_not_given_a_status() -> None:
    """A request in two parts (ClientSession, rule 7) whose first part was lost (refused
    as unreadable shared memory, or dropped): its final part has None in the read's
    place, the session names the read in ``again`` (rule 9), and the driver submits it
    again rather than answer it with a status alone."""
    from zps.client.ops import Op, deliver
    from zps.client.session import Deliver
    from zps.protocol.codec import Message, MsgType, Route

    push, pull, again = _futures(3)
    ops = [
        Op({"op": "push_rows", "t": "e"}, {}, push, lazy=True, partition=0),
        Op({"op": "pull_rows", "t": "e"}, {}, pull, partition=0),
    ]
    asked: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def submit(*args: Any, **kwargs: Any) -> asyncio.Future[dict[str, Any]]:
        asked.append((args, kwargs))
        return again

    final = {"st": "OK", "res": [{"st": "OK"}, None]}
    reply = Message(Route(MsgType.REPLY, 0, 1, 5), final, [])
    deliver(ops, Deliver(ops, reply, again=(1,)), submit=submit, max_bytes=1 << 20)
    assert push.result() == {"st": "OK"}
    assert not pull.done()  # not answered with a bare status
    [(args, kwargs)] = asked
    assert args[:2] == (0, {"op": "pull_rows", "t": "e"}) and kwargs["lazy"] is False
    again.set_result({"st": "OK", "n": 1})
    await _turns()
    assert pull.result() == {"st": "OK", "n": 1}  # the answer of the read asked again


async def test_routing_brokers_track_a_request_until_its_writes_are_answered() -> None:
    """A request sent through a routing broker stays tracked (re-sent if that router
    goes silent) until its writes are answered: not at its first part; and answers
    carried by another reply end the tracking of the requests they answer."""
    from zps.client.routerlinks import RouterLinks
    from zps.protocol.codec import Message, MsgType, Route

    links = RouterLinks(
        b"c-test",
        ClientConfig(),
        now=lambda: 0.0,
        unsent=lambda r, t: None,
        reschedule=lambda: None,
    )
    links.table.inflight.update({7: ("tcp://r:1", 0), 8: ("tcp://r:1", 0)})
    first = {"st": "OK", "res": [None, {"st": "OK"}], "part": 1, "acked": [[8, [{"st": "OK"}]]]}
    links.answered(Message(Route(MsgType.REPLY, 0, 1, 7), first, []))
    assert list(links.table.inflight) == [7]
    links.answered(Message(Route(MsgType.REPLY, 0, 1, 7), {"st": "OK", "res": []}, []))
    assert links.table.inflight == {}
