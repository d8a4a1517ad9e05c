"""How a channel reads ZMQ_EVENTS: once per loop iteration after sends, never again while
a reading still holds, and never at the cost of a message left unnoticed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq

from zps import transport
from zps.testing import free_port


async def _pair(
    name: bytes,
) -> tuple[Any, transport.Channel, transport.Channel]:
    ctx = transport.new_context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    router, _ = transport.router(ctx, addr, max_message_bytes=1 << 20)
    dealer = transport.dealer(ctx, addr, name, max_message_bytes=1 << 20)
    return ctx, router, dealer


@pytest.mark.timeout(30)
async def test_a_round_trip_reads_zmq_events_at_most_eight_times() -> None:
    # Each reading is two system calls (zmq polls its mailbox and checks the pid); a
    # check after every send and a second reading before every wait took 12.
    ctx, router, dealer = await _pair(b"c-echo")

    async def echo(frames: transport.Frames) -> None:
        transport.try_send(router, frames)

    server = asyncio.create_task(transport.serve(router, echo, lambda f, e: None))
    try:
        for _ in range(50):  # connected, and every socket settled
            await transport.send(dealer, [b"ping"])
            assert await transport.recv_burst(dealer, timeout=5)
        before = router.events_read + dealer.events_read
        n = 500
        for _ in range(n):
            await transport.send(dealer, [b"ping"])
            burst = await transport.recv_burst(dealer, timeout=5)
            assert len(burst) == 1
        reads = router.events_read + dealer.events_read - before
        # Each end reads at least once for the message it receives.
        assert 2 * n <= reads <= 8 * n, f"{reads / n:.1f} ZMQ_EVENTS readings per round trip"
    finally:
        server.cancel()
        transport.close(router)
        transport.close(dealer)
        transport.term(ctx)


@pytest.mark.timeout(30)
async def test_messages_arriving_while_a_channel_only_sends_are_all_received() -> None:
    # A send may take the descriptor's notice of a message that arrived meanwhile; the
    # channel must still see that message without any further traffic.
    ctx, router, dealer = await _pair(b"c-busy")
    got = 0
    done = asyncio.Event()
    n = 400

    async def count(frames: transport.Frames) -> None:
        nonlocal got
        if transport.frame_bytes(frames[1]) == b"req":
            got += 1
            if got == n:
                done.set()

    server = asyncio.create_task(transport.serve(router, count, lambda f, e: None))
    try:

        async def chatter() -> None:  # the router sends all the while (once it knows the peer)
            while not done.is_set():
                for _ in range(20):
                    transport.try_send(router, [b"c-busy", b"noise"])
                await asyncio.sleep(0)

        async def drain() -> None:
            while not done.is_set():
                await transport.recv_burst(dealer, timeout=0.1)

        tasks = [asyncio.create_task(chatter()), asyncio.create_task(drain())]
        for _ in range(n):
            await transport.send(dealer, [b"req"])
            await asyncio.sleep(0)
        # The last request arrives with nothing sent to the router after it: only the
        # channel's own readings can notice it.
        await asyncio.wait_for(done.wait(), 10)
        assert got == n
        for t in tasks:
            t.cancel()
    finally:
        server.cancel()
        transport.close(router)
        transport.close(dealer)
        transport.term(ctx)


@pytest.mark.timeout(30)
async def test_sockets_ask_for_the_receive_buffer_zps_tcp_rcvbuf_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ZPS_TCP_RCVBUF", str(1 << 16))
    ctx, router, dealer = await _pair(b"c-buf")
    try:
        assert router.sock.getsockopt(zmq.RCVBUF) == 1 << 16
        assert dealer.sock.getsockopt(zmq.RCVBUF) == 1 << 16
    finally:
        transport.close(router)
        transport.close(dealer)
        transport.term(ctx)
    monkeypatch.setenv("ZPS_TCP_RCVBUF", "64k")
    with pytest.raises(ValueError, match="ZPS_TCP_RCVBUF='64k' is not a positive number"):
        transport.tcp_rcvbuf()
    assert transport.tcp_rcvbuf({}) is None  # unset: the kernel's own
