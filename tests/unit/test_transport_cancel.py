"""A receive loop ends when it is cancelled, even as a message wakes it.

Python 3.11's ``asyncio.wait_for`` returns the result instead of raising when the
cancellation lands in the same loop iteration as the wake-up; a broker whose receive
loop swallowed its stop kept serving after SIGTERM until it was killed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq

from tests.unit.channel_pair import Pair, channel_pair
from zps import transport


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    """A channel on one end of an inproc PAIR, and the other end, blocking."""
    async with channel_pair() as p:
        yield p


@pytest.mark.timeout(30)
async def test_a_cancel_that_lands_with_a_wake_up_ends_the_receive(pair: Pair) -> None:
    ch, peer = pair
    for i in range(60):
        task = asyncio.create_task(ch.recv_burst(0.5))
        await asyncio.sleep(0)  # parked in the timed wait
        await asyncio.sleep(0)
        peer.send(b"%d" % i)  # the reader callback wakes the reader at the next turn
        # The stop lands just before that wake-up, or in the turn the woken reader runs.
        for _ in range(1 + i % 2):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        got = await ch.recv_burst(5.0)  # the message stays queued for the next receive
        assert [bytes(f[0]) for f in got] == [b"%d" % i]


# ---- the timed wait: one timer for many waits ----------------------------------------


@pytest.mark.timeout(30)
async def test_a_timed_receive_returns_nothing_at_its_deadline_not_before(pair: Pair) -> None:
    ch, _ = pair
    loop = asyncio.get_running_loop()
    for timeout in (0.05, 0.2, 0.02):  # a shorter deadline after a longer one too
        t0 = loop.time()
        assert await ch.recv_burst(timeout) == []
        assert timeout - 0.002 <= loop.time() - t0 < timeout + 2.0


@pytest.mark.timeout(30)
async def test_a_wait_after_a_message_keeps_its_own_deadline(pair: Pair) -> None:
    """The timer armed for the first wait fires during the second: it is armed again
    for the second's deadline instead of ending it early."""
    ch, peer = pair
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, peer.send, b"one")
    assert [bytes(f[0]) for f in await ch.recv_burst(0.1)] == [b"one"]
    t0 = loop.time()
    assert await ch.recv_burst(0.1) == []  # its timer fired at the first deadline first
    assert loop.time() - t0 >= 0.1 - 0.002


@pytest.mark.timeout(30)
async def test_a_wake_up_without_a_message_does_not_lose_the_deadline() -> None:
    """A CURVE server's reader is woken by a message it then refuses at its edge (the
    peer's connection carries no zps id): the receive waits on for its own deadline."""
    ctx = transport.new_context()
    public, secret = zmq.curve_keypair()
    keys = transport.CurveKeys(public, secret, None, None)
    ch, endpoint = transport.router(ctx, "tcp://127.0.0.1:0", max_message_bytes=1 << 20, curve=keys)
    refused: list[str] = []
    ch.on_refused = lambda _peer, _key, reason: refused.append(reason)
    peer: zmq.Socket[Any] = zmq.Socket(ctx, zmq.DEALER)
    peer.linger = 0
    peer_public, peer_secret = zmq.curve_keypair()
    peer.curve_secretkey, peer.curve_publickey = peer_secret, peer_public
    peer.curve_serverkey = public  # no X-Zps-Id on its connection
    connected = asyncio.Event()
    watch = transport.HandshakeWatch(peer, on_connected=connected.set)
    try:
        peer.connect(endpoint)
        await asyncio.wait_for(connected.wait(), 10.0)
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, peer.send, b"no zps id")  # wakes the reader mid-wait
        t0 = loop.time()
        assert await ch.recv_burst(1.0) == []
        elapsed = loop.time() - t0
        assert refused == ["no_identity"]  # woken, received and refused in the wait
        assert 1.0 - 0.002 <= elapsed < 6.0, elapsed
    finally:
        watch.close()
        peer.close(0)
        ch.close()
        ctx.term()


@pytest.mark.timeout(30)
async def test_messages_in_time_make_no_timer_per_wait(pair: Pair) -> None:
    ch, peer = pair
    loop = asyncio.get_running_loop()
    made = 0
    real = loop.call_at

    def counting(*args: object) -> asyncio.TimerHandle:
        nonlocal made
        made += 1
        return real(*args)  # type: ignore[arg-type]

    loop.call_at = counting  # type: ignore[method-assign, assignment]
    try:
        for i in range(200):
            loop.call_soon(peer.send, b"%d" % i)  # once the reader waits
            assert len(await ch.recv_burst(5.0)) == 1
    finally:
        del loop.call_at
    assert made <= 1, made
