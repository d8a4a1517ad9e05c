"""The event-loop-driven zmq channel, on real sockets over loopback."""

from __future__ import annotations

import asyncio

import pytest

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
