"""The event-loop-driven zmq channel, on real sockets over loopback."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import zmq

from zps import transport
from zps.testing import free_port


@pytest.mark.timeout(30)
async def test_a_full_peer_queue_makes_send_wait_without_blocking_the_loop() -> None:
    ctx = transport.new_context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    router, _ = transport.router(ctx, addr, max_message_bytes=1 << 20, hwm=4)
    dealer = transport.dealer(ctx, addr, b"c-slow", max_message_bytes=1 << 20, hwm=4)
    try:
        await transport.send(dealer, [b"hello"])  # the router learns the peer
        (hello,) = await transport.recv_burst(router)
        peer = transport.frame_bytes(hello[0])
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        tick_task = asyncio.create_task(ticker())
        n = 400  # far more than both queues (and the TCP buffers) hold for 64 KiB frames
        sends = [transport.send(router, [peer, bytes(65536)]) for _ in range(n)]
        sender: asyncio.Future[list[bool]] = asyncio.ensure_future(asyncio.gather(*sends))
        await asyncio.sleep(0.3)
        assert not sender.done(), "the peer reads nothing, so the sends must wait"
        before = ticks
        await asyncio.sleep(0.1)
        assert ticks > before, "a waiting send must not block the event loop"
        got = 0
        while got < n:  # now the peer reads; every send completes, none lost
            got += len(await transport.recv_burst(dealer, timeout=5))
        results = await asyncio.wait_for(sender, 20)
        assert all(results)
        assert got == n
        tick_task.cancel()
    finally:
        transport.close(router)
        transport.close(dealer)
        transport.term(ctx)


@pytest.mark.timeout(30)
async def test_posted_messages_arrive_in_order_after_backpressure() -> None:
    ctx = transport.new_context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    router, _ = transport.router(ctx, addr, max_message_bytes=1 << 20, hwm=4)
    dealer = transport.dealer(ctx, addr, b"c-order", max_message_bytes=1 << 20, hwm=4)
    try:
        await transport.send(dealer, [b"hello"])
        (hello,) = await transport.recv_burst(router)
        peer = transport.frame_bytes(hello[0])
        n = 400
        for i in range(n):
            router.post([peer, i.to_bytes(4, "little"), bytes(65536)])
        await asyncio.sleep(0.2)
        seen: list[int] = []
        while len(seen) < n:
            burst = await transport.recv_burst(dealer, timeout=5)
            assert burst, f"stalled after {len(seen)} messages"
            seen += [int.from_bytes(transport.frame_bytes(m[0]), "little") for m in burst]
        assert seen == list(range(n))
    finally:
        transport.close(router)
        transport.close(dealer)
        transport.term(ctx)


async def _peer(
    ctx: Any, addr: str, name: bytes, router: transport.Channel
) -> tuple[transport.Channel, bytes]:
    dealer = transport.dealer(ctx, addr, name, max_message_bytes=1 << 20, hwm=4)
    await transport.send(dealer, [b"hello"])  # the router learns the peer
    (hello,) = await transport.recv_burst(router, timeout=5)
    return dealer, transport.frame_bytes(hello[0])


@pytest.mark.timeout(30)
async def test_outbound_holds_within_the_allowance_drops_past_it_and_keeps_order() -> None:
    ctx = transport.new_context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    router, _ = transport.router(ctx, addr, max_message_bytes=1 << 20, hwm=4)
    out = transport.Outbound(router, total_limit=4 << 20, stall_timeout=60.0)
    slow, slow_id = await _peer(ctx, addr, b"c-slow", router)
    fast, fast_id = await _peer(ctx, addr, b"c-fast", router)
    try:
        limit = 1 << 20
        posted = [
            out.post([slow_id, i.to_bytes(4, "little"), bytes(65536)], limit) for i in range(400)
        ]
        # Never waits: zmq took what it could, the allowance held 1 MiB, the rest dropped.
        held = posted.count(transport.Posted.HELD)
        dropped = posted.count(transport.Posted.DROPPED)
        assert held and dropped
        assert out.held(slow_id) <= limit
        assert out.allowance.peak_peer <= limit
        assert posted.index(transport.Posted.DROPPED) > posted.index(transport.Posted.HELD)
        # Another peer is served at once, whatever the slow one holds.
        assert out.post([fast_id, b"ping"], limit) is transport.Posted.SENT
        (msg,) = await transport.recv_burst(fast, timeout=5)
        assert transport.frame_bytes(msg[0]) == b"ping"
        # The slow peer reads at last: what was sent or held arrives, in order.
        kept = [i for i, p in enumerate(posted) if p is not transport.Posted.DROPPED]
        seen: list[int] = []
        while len(seen) < len(kept):
            burst = await transport.recv_burst(slow, timeout=5)
            assert burst, f"stalled after {len(seen)} messages"
            seen += [int.from_bytes(transport.frame_bytes(m[0]), "little") for m in burst]
        assert seen == kept
        assert out.held_bytes == 0
        assert out.dropped == dropped
        # An unknown peer is reported, not held.
        assert out.post([b"c-nobody", b"x"], limit) is transport.Posted.UNROUTABLE
    finally:
        out.close()
        for ch in (router, slow, fast):
            transport.close(ch)
        transport.term(ctx)


@pytest.mark.timeout(30)
async def test_outbound_drops_what_a_stalled_peer_holds() -> None:
    ctx = transport.new_context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    router, _ = transport.router(ctx, addr, max_message_bytes=1 << 20, hwm=4)
    out = transport.Outbound(router, total_limit=4 << 20, stall_timeout=0.3)
    slow: zmq.Socket[Any] = zmq.Socket(ctx, zmq.DEALER)  # never read
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 4096)
    slow.setsockopt(zmq.IDENTITY, b"c-stalled")
    slow.connect(addr)
    slow.send(b"hello")
    (hello,) = await transport.recv_burst(router, timeout=5)
    slow_id = transport.frame_bytes(hello[0])
    try:
        # Keep offering until the kernel's buffers are full and what is held stops
        # moving; after stall_timeout without progress it is dropped.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not out.stalled and loop.time() < deadline:
            out.post([slow_id, bytes(65536)], 1 << 20)
            await asyncio.sleep(0.01)
        assert out.stalled == 1
        assert out.held_bytes == 0
        assert out.allowance.peak_peer <= 1 << 20
    finally:
        out.close()
        transport.close(router)
        slow.close(0)
        transport.term(ctx)


class _Every:
    """A LinkThread policy: what the loop posts goes out as it is, and b"tick" every
    ``period`` seconds of its own."""

    def __init__(self, period: float) -> None:
        self.period, self.next = period, float("inf")

    def posted(self, frames: list[bytes], now: float) -> list[bytes]:
        self.next = now + self.period
        return frames

    def due(self, now: float) -> float:
        return self.next

    def tick(self, now: float) -> list[bytes]:
        self.next = now + self.period
        return [b"tick"]


@pytest.mark.timeout(30)
async def test_a_link_thread_sends_and_hears_while_the_loop_is_held() -> None:
    """Two DEALERs served by a LinkThread: what the loop posts goes out on both; the
    policy's own sends go on while the loop is held (a blocking sleep); what the peers
    send comes back to the loop in order; after stop() nothing more goes out."""
    ctx = transport.new_context()
    addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    routers = [transport.router(ctx, a, max_message_bytes=1 << 20)[0] for a in addrs]
    loop = asyncio.get_running_loop()
    heard: asyncio.Queue[tuple[int, list[bytes]]] = asyncio.Queue()
    links = transport.LinkThread(
        ctx,
        addrs,
        b"h-s-test",
        policy=_Every(0.05),
        deliver=lambda i, f: loop.call_soon_threadsafe(heard.put_nowait, (i, f)),
        max_message_bytes=1 << 20,
    )
    links.start()
    assert links.running
    try:
        assert links.post([b"", b"beat"])
        for r in routers:  # the beat first (the policy's ticks may follow in the burst)
            got = await asyncio.wait_for(transport.recv_burst(r), 5)
            assert [transport.frame_bytes(f) for f in got[0]] == [b"h-s-test", b"", b"beat"]
        time.sleep(0.5)  # the loop held: only the thread can send meanwhile
        for r in routers:
            got = await asyncio.wait_for(transport.recv_burst(r), 5)
            ticks = [transport.frame_bytes(m[1]) for m in got]
            assert ticks and set(ticks) == {b"tick"}
        for n in range(3):
            await transport.send(routers[1], [b"h-s-test", b"echo %d" % n])
        got = [await asyncio.wait_for(heard.get(), 5) for _ in range(3)]
        assert got == [(1, [b"echo 0"]), (1, [b"echo 1"]), (1, [b"echo 2"])]
        links.stop()
        assert not links.running  # its thread has ended: nothing more goes out
    finally:
        links.stop()
        for r in routers:
            transport.close(r)
        transport.term(ctx)


class _Breaks(_Every):
    """As _Every, until its tick raises."""

    def tick(self, now: float) -> list[bytes]:
        raise ValueError("the policy broke")


@pytest.mark.timeout(30)
async def test_a_link_thread_that_fails_says_so_and_falls_silent() -> None:
    """The policy raises in the thread: ``on_failure`` gets the error (in the thread,
    once), the thread ends and its links send nothing more, while stop() still returns."""
    ctx = transport.new_context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    router = transport.router(ctx, addr, max_message_bytes=1 << 20)[0]
    loop = asyncio.get_running_loop()
    failed: asyncio.Future[BaseException] = loop.create_future()
    links = transport.LinkThread(
        ctx,
        [addr],
        b"h-s-test",
        policy=_Breaks(0.05),
        deliver=lambda i, f: None,
        max_message_bytes=1 << 20,
        on_failure=lambda e: loop.call_soon_threadsafe(failed.set_result, e),
    )
    links.start()
    try:
        assert links.post([b"", b"beat"])
        got = await asyncio.wait_for(transport.recv_burst(router), 5)
        assert [transport.frame_bytes(f) for f in got[0]] == [b"h-s-test", b"", b"beat"]
        error = await asyncio.wait_for(failed, 5)
        assert isinstance(error, ValueError) and str(error) == "the policy broke"
        assert await asyncio.to_thread(links.join, 5)
        assert not links.running
        links.post([b"", b"unheard"])  # no thread to send it
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(transport.recv_burst(router), 0.3)
    finally:
        links.stop()
        transport.close(router)
        transport.term(ctx)
