"""A reconnect storm under CURVE: the ZAP handler delays each answer on a timer of its
own, so N handshakes that arrive together complete together, not one delay apart.
Real sockets on loopback, in one process."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from zps import transport
from zps.ops.security import key_identity
from zps.transport import CurveKeys, curve

pytestmark = pytest.mark.timeout(60)

PEERS = 12
#: Long enough that answers one after another (PEERS of them) could not pass unseen.
DELAY = 0.4


def test_handshakes_arriving_together_complete_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(curve, "ZAP_REPLY_DELAY", DELAY)

    async def run() -> float:
        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        ctx = transport.new_context()
        auth = transport.start_authenticator(ctx, None)
        server, endpoint = transport.router(
            ctx,
            "tcp://127.0.0.1:0",
            max_message_bytes=1 << 20,
            curve=CurveKeys(server_public, server_secret, None, None),
        )
        loop = asyncio.get_running_loop()
        done: asyncio.Queue[float] = asyncio.Queue()
        dealers: list[transport.Dealer] = []
        try:
            start = loop.time()
            for i in range(PEERS):
                dealers.append(
                    transport.dealer(
                        ctx,
                        endpoint,
                        key_identity(b"c-", public, b"storm%d" % i),
                        max_message_bytes=1 << 20,
                        curve=CurveKeys(public, secret, server_public, None),
                        server_public=server_public,
                        on_connected=lambda: done.put_nowait(loop.time()),
                    )
                )
            times = [await asyncio.wait_for(done.get(), 30) for _ in range(PEERS)]
            return max(times) - start
        finally:
            for d in dealers:
                transport.close(d)
            transport.close(server)
            auth.stop()
            transport.term(ctx)

    took = asyncio.run(run())
    # Every handshake waited for its answer, and the answers went out together: one
    # after another they would take PEERS * DELAY (4.8 s).
    assert DELAY <= took < 3 * DELAY, took
