"""A shard's data link greets its broker as each connection is made (its latest
heartbeat again), marked ``new_link`` only when a connection to that endpoint came before
it: the broker then has its clients send again what they have in flight to the shard's
partition.  A first connection carried nothing before it, so it is not marked; marked,
it had the clients send their requests twice whenever the shard's loop saw its first
handshake after its first heartbeat (the second copy answered from the dedup record).  A
routing broker's link closed and made anew by a new socket marks its first connection,
which follows one the router had.

A real DEALER against a real ROUTER on loopback (with ``ROUTER_HANDOVER``, as a broker's
without CURVE: a new connection takes the id); a connection is made again by
disconnecting and connecting the DEALER, as ``Channel.reconnect_when_silent`` does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.asyncio

from zps import transport
from zps.protocol.codec import MsgType, Route, decode, encode
from zps.shard import admission
from zps.shard.links import greet
from zps.shard.routers import ROUTER_KEPT_S, RouterLinks


@dataclass
class Peer:
    ctx: zmq.asyncio.Context
    router: zmq.asyncio.Socket
    endpoint: str

    async def greeting(self) -> dict[str, Any]:
        """The header of the next greeting the ROUTER receives."""
        frames = await asyncio.wait_for(self.router.recv_multipart(), 10)
        msg = decode(frames[2:])  # [routing id, b"", route, header]
        assert msg.route.mtype == MsgType.HEARTBEAT, msg.route
        return dict(msg.header)

    def dealer(self, identity: bytes) -> transport.Dealer:
        return transport.dealer(
            self.ctx, self.endpoint, identity, max_message_bytes=1 << 20, watch=True
        )


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.router_handover = 1
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield Peer(ctx, router, f"tcp://127.0.0.1:{port}")
    finally:
        router.close(0)
        ctx.term()


def heartbeat(**header: Any) -> list[bytes]:
    return [b"", *(bytes(f) for f in encode(Route(MsgType.HEARTBEAT), {"t": 0.0, **header}))]


def connect_again(sock: transport.Dealer, endpoint: str) -> None:
    sock.sock.disconnect(endpoint)
    sock.sock.connect(endpoint)


async def test_only_a_connection_made_again_is_marked_new_link(peer: Peer) -> None:
    beat = heartbeat(lsn=7)
    sock = peer.dealer(b"s1")
    try:
        greet(sock, lambda: beat, new_link=True)
        first = await peer.greeting()
        assert first["lsn"] == 7 and "new_link" not in first, first
        assert sock.handshakes is not None and sock.handshakes.connected == 1

        connect_again(sock, peer.endpoint)
        again = await peer.greeting()
        assert again["lsn"] == 7 and again.get("new_link") is True, again
        assert sock.handshakes.connected == 2
    finally:
        transport.close(sock)


async def test_a_greeting_asked_unmarked_is_never_marked(peer: Peer) -> None:
    beat = heartbeat()
    sock = peer.dealer(b"s2")
    try:
        greet(sock, lambda: beat)
        assert "new_link" not in await peer.greeting()
        connect_again(sock, peer.endpoint)
        assert "new_link" not in await peer.greeting()
    finally:
        transport.close(sock)


async def test_a_router_link_made_anew_marks_its_first_connection(peer: Peer) -> None:
    """The link to a routing broker closed (unlisted for ``ROUTER_KEPT_S``) and made anew,
    by a new socket: its first connection follows one the router had, so it is marked;
    the first link to a router is not."""

    def connect(endpoint: str, name: str) -> tuple[transport.Channel, transport.Outbound]:
        sock = peer.dealer(b"s3")
        return sock, transport.Outbound(sock, total_limit=1 << 20, stall_timeout=5, name=name)

    links = RouterLinks(
        connect=connect,
        start=asyncio.ensure_future,
        via={},
        on_request=lambda *a: None,
        malformed=lambda *a: None,
        refuse=lambda *a: None,
        policy=lambda: admission.Policy("s3", False, 1 << 20, 1 << 20),
        epoch=lambda: 1,
    )
    try:
        links.beat(heartbeat())  # no link yet: the latest heartbeat, for the greetings
        links.follow({peer.endpoint}, 0.0)
        first = await peer.greeting()
        assert "new_link" not in first, first
        links.follow(set(), 1.0)
        links.follow(set(), 1.0 + ROUTER_KEPT_S)  # unlisted long enough: closed
        links.follow({peer.endpoint}, 2.0 + ROUTER_KEPT_S)
        again = await peer.greeting()
        assert again.get("new_link") is True, again
    finally:
        links.cancel()
        links.close()
