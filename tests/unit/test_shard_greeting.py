"""A shard's data link greets its broker as each connection is made (its latest
heartbeat again), marked ``new_link`` only when the connection is made again: the broker
then has its clients send again what they have in flight to the shard's partition.  A
first connection carried nothing before it, so it is never marked; marked, it had the
clients send their requests twice whenever the shard's loop saw its first handshake after
its first heartbeat (the second copy answered from the dedup record).  A real DEALER
against a real ROUTER on loopback, the ROUTER closed and bound again for the second
connection."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from zps import transport
from zps.protocol.codec import MsgType, Route, decode, encode
from zps.shard.links import greet


async def greeting_header(router: zmq.asyncio.Socket) -> dict[str, Any]:
    frames = await asyncio.wait_for(router.recv_multipart(), 10)
    # [routing id, b"", route, header]
    msg = decode(frames[2:])
    assert msg.route.mtype == MsgType.HEARTBEAT, msg.route
    return dict(msg.header)


async def test_only_a_connection_made_again_is_marked_new_link() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    beat = [b"", *(bytes(f) for f in encode(Route(MsgType.HEARTBEAT), {"t": 0.0, "lsn": 7}))]
    sock = transport.dealer(
        ctx, f"tcp://127.0.0.1:{port}", b"s1", max_message_bytes=1 << 20, watch=True
    )
    try:
        greet(sock, lambda: beat, new_link=True)
        first = await greeting_header(router)
        assert first["lsn"] == 7 and "new_link" not in first, first
        assert sock.handshakes is not None and sock.handshakes.connected == 1

        router.close(0)
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.bind(f"tcp://127.0.0.1:{port}")
        again = await greeting_header(router)
        assert again["lsn"] == 7 and again["new_link"] is True, again
        assert sock.handshakes.connected == 2
    finally:
        transport.close(sock)
        router.close(0)
        ctx.term()


async def test_a_greeting_asked_unmarked_is_never_marked() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    beat = [b"", *(bytes(f) for f in encode(Route(MsgType.HEARTBEAT), {"t": 0.0}))]
    sock = transport.dealer(
        ctx, f"tcp://127.0.0.1:{port}", b"s2", max_message_bytes=1 << 20, watch=True
    )
    try:
        greet(sock, lambda: beat)
        assert "new_link" not in await greeting_header(router)
        router.close(0)
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.bind(f"tcp://127.0.0.1:{port}")
        assert "new_link" not in await greeting_header(router)
    finally:
        transport.close(sock)
        router.close(0)
        ctx.term()
