"""serve's fast handler: messages handled in the reader callback, in order, one at a time.

The broker forwards requests and replies, the shard answers requests and the client
matches replies in their sockets' reader callbacks (no task wakes up per message).  What
must hold: every message is handled exactly once, by the fast handler or by the serving
task, in the order it came; a message the fast handler declines, and every one after it,
goes to the task; nothing is handled while the task is still handling an earlier one;
malformed messages and bugs are treated as in the task; a stopped serve handles nothing.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq

from tests.unit.channel_pair import Pair, channel_pair
from zps import transport
from zps.errors import ProtocolError


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    """A channel on one end of an inproc PAIR, and the other end, blocking."""
    async with channel_pair() as p:
        yield p


class Recorder:
    """Handlers that log (path, message) and let a test await the n-th handling.

    A message ``f...`` is taken by the fast handler, ``s...`` declined by it; ``p...``
    raises ProtocolError, ``x...`` a bug; ``w...`` makes the task wait for ``release``.
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.malformed: list[str] = []
        self.bursts = 0
        self.release = asyncio.Event()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def _note(self, path: str, frames: transport.Frames) -> str:
        text = transport.frame_bytes(frames[0]).decode()
        self.log.append((path, text))
        self._wake()
        return text

    def _wake(self) -> None:
        n = len(self.log) + len(self.malformed)
        for want, fut in self._waiters:
            if n >= want and not fut.done():
                fut.set_result(None)

    async def handled(self, n: int) -> None:
        """Until ``n`` messages were handled (or counted as malformed)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        self._wake()
        await asyncio.wait_for(fut, 10)

    def fast(self, frames: transport.Frames) -> bool:
        text = transport.frame_bytes(frames[0]).decode()
        if text.startswith("p"):
            raise ProtocolError(f"bad {text}")
        if text.startswith("x"):
            raise RuntimeError(f"bug at {text}")
        if not text.startswith("f"):
            return False
        self._note("fast", frames)
        return True

    async def slow(self, frames: transport.Frames) -> None:
        text = transport.frame_bytes(frames[0]).decode()
        if text.startswith("p"):
            raise ProtocolError(f"bad {text}")
        if text.startswith("x"):
            raise RuntimeError(f"bug at {text}")
        self._note("task", frames)
        if text.startswith("w"):
            await self.release.wait()

    def on_malformed(self, frames: transport.Frames, err: ProtocolError) -> None:
        self.malformed.append(str(err))
        self._wake()

    def on_burst(self) -> None:
        self.bursts += 1


async def parked(ch: transport.Channel) -> None:
    """Until the serving task waits for messages (it sets the fast handler, or ends its
    burst, and then parks in the same step): a message sent now reaches the callback."""
    while not ch.fast_ready:
        await asyncio.sleep(0)


def send(sock: zmq.Socket[Any], *texts: str) -> None:
    for t in texts:
        sock.send(t.encode())


@pytest.mark.timeout(30)
async def test_a_declined_message_and_all_after_it_go_to_the_task_in_order(pair: Pair) -> None:
    ch, peer = pair
    r = Recorder()
    task = asyncio.create_task(
        transport.serve(ch, r.slow, r.on_malformed, fast=r.fast, on_burst=r.on_burst)
    )
    try:
        await parked(ch)
        send(peer, "f1")
        await r.handled(1)
        send(peer, "f2", "s3", "f4", "f5")
        await r.handled(5)
        await parked(ch)
        send(peer, "f6")
        await r.handled(6)
    finally:
        task.cancel()
    assert [t for _, t in r.log] == ["f1", "f2", "s3", "f4", "f5", "f6"]
    # f4 and f5 came behind a declined message: the task took them, not the callback.
    assert r.log[0][0] == "fast" and r.log[1][0] == "fast"
    assert [p for p, _ in r.log[2:5]] == ["task", "task", "task"]
    assert r.log[5][0] == "fast"  # the callback takes over again once the task is done
    assert r.bursts >= 3


@pytest.mark.timeout(30)
async def test_nothing_is_handled_while_the_task_handles_an_earlier_message(pair: Pair) -> None:
    ch, peer = pair
    r = Recorder()
    task = asyncio.create_task(transport.serve(ch, r.slow, r.on_malformed, fast=r.fast))
    try:
        await parked(ch)
        send(peer, "w1")  # the task handles it and waits for release
        await r.handled(1)
        send(peer, "f2")
        for _ in range(20):  # many loop turns, reader callbacks included
            await asyncio.sleep(0.005)
        assert [t for _, t in r.log] == ["w1"]
        r.release.set()
        await r.handled(2)
    finally:
        task.cancel()
    assert r.log == [("task", "w1"), ("task", "f2")]


@pytest.mark.timeout(30)
async def test_a_malformed_message_is_counted_and_serving_goes_on(pair: Pair) -> None:
    ch, peer = pair
    r = Recorder()
    task = asyncio.create_task(transport.serve(ch, r.slow, r.on_malformed, fast=r.fast))
    try:
        await parked(ch)
        send(peer, "p1", "f2")
        await r.handled(2)
    finally:
        task.cancel()
    assert r.malformed == ["bad p1"]
    assert r.log == [("fast", "f2")]


@pytest.mark.timeout(30)
async def test_a_bug_in_the_fast_handler_ends_serve_with_it(pair: Pair) -> None:
    ch, peer = pair
    r = Recorder()
    task = asyncio.create_task(transport.serve(ch, r.slow, r.on_malformed, fast=r.fast))
    await parked(ch)
    send(peer, "f1", "x2", "f3")
    with pytest.raises(RuntimeError, match="bug at x2"):
        await asyncio.wait_for(task, 10)
    assert r.log == [("fast", "f1")]


@pytest.mark.timeout(30)
async def test_a_stopped_serve_handles_nothing_more(pair: Pair) -> None:
    ch, peer = pair
    r = Recorder()
    task = asyncio.create_task(transport.serve(ch, r.slow, r.on_malformed, fast=r.fast))
    await parked(ch)
    send(peer, "f1")
    await r.handled(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    send(peer, "f2")
    got = await ch.recv_burst(5)  # still queued: nobody took it
    assert [transport.frame_bytes(f[0]) for f in got] == [b"f2"]
    assert r.log == [("fast", "f1")]


@pytest.mark.timeout(30)
async def test_a_flood_is_handled_in_slices_that_let_the_loop_run(pair: Pair) -> None:
    ch, peer = pair
    r = Recorder()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    n = 3 * transport.DRAIN_BATCH + 5
    at_burst: list[int] = []  # the ticker's count at the end of each slice
    task = asyncio.create_task(
        transport.serve(
            ch, r.slow, r.on_malformed, fast=r.fast, on_burst=lambda: at_burst.append(ticks)
        )
    )
    t = asyncio.create_task(ticker())
    try:
        await parked(ch)
        send(peer, *(f"f{i}" for i in range(n)))
        await r.handled(n)
    finally:
        task.cancel()
        t.cancel()
    assert r.log == [("fast", f"f{i}") for i in range(n)]
    assert len(at_burst) >= 4  # cut at DRAIN_BATCH: one burst per slice
    # The ticker ran between the slices: the flood did not hold the loop.
    assert all(b > a for a, b in itertools.pairwise(at_burst))


@pytest.mark.timeout(30)
async def test_messages_the_callback_takes_count_against_the_idle_time(pair: Pair) -> None:
    """A replica asks its primary again after ``idle`` without a message: a stream the
    callback handles must not look like silence."""
    ch, peer = pair
    r = Recorder()
    idled = asyncio.Event()
    idle_calls = 0

    async def on_idle() -> None:
        nonlocal idle_calls
        idle_calls += 1
        idled.set()

    task = asyncio.create_task(
        transport.serve(ch, r.slow, r.on_malformed, fast=r.fast, idle=0.5, on_idle=on_idle)
    )
    try:
        await parked(ch)
        loop = asyncio.get_running_loop()
        end = loop.time() + 2.0  # four idle periods of traffic, a message every 20 ms
        i = 0
        while loop.time() < end:
            send(peer, f"f{i}")
            i += 1
            await asyncio.sleep(0.02)
        assert idle_calls == 0
        assert [text for _, text in r.log] == [f"f{k}" for k in range(i)]  # once, in order
        # The callback takes them, but for one that the serving task finds queued when
        # its idle timer wakes it (both in one loop turn): at most one an idle period.
        took = [p for p, _ in r.log]
        assert took.count("task") <= 2.0 / 0.5 + 1 and took.count("fast") >= i - 5
        await asyncio.wait_for(idled.wait(), 10)  # and silence is noticed
    finally:
        task.cancel()
