"""A connection whose handshake never finishes (the path died during it, or the peer
accepted and went silent) is given up after ``HANDSHAKE_S`` and made again, as a
heartbeat gives up a connection that died later: a real DEALER against a TCP listener
that accepts and never answers the ZMTP greeting."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from zps import transport
from zps.transport.sockets import HANDSHAKE_S


class SilentListener:
    """Accepts TCP connections, counts them and never sends a byte."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self.accepted = threading.Semaphore(0)
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(conn)
            self.accepted.release()

    def close(self) -> None:
        self.stopped = True
        self.listener.close()
        for conn in self.held:
            conn.close()


@pytest.mark.timeout(60)
async def test_a_handshake_that_never_finishes_is_made_again() -> None:
    silent = SilentListener()
    ctx = transport.new_context()
    dealer = transport.dealer(
        ctx, f"tcp://127.0.0.1:{silent.port}", b"c-test", max_message_bytes=1 << 20
    )
    try:
        assert silent.accepted.acquire(timeout=10), "the DEALER never connected"
        t0 = time.monotonic()
        # libzmq's own bound (30 s) would hold the dead handshake far past this wait.
        assert silent.accepted.acquire(timeout=HANDSHAKE_S + 10), (
            "the handshake that never finished was not given up and made again"
        )
        waited = time.monotonic() - t0
        assert HANDSHAKE_S - 0.5 <= waited < HANDSHAKE_S + 10, waited
    finally:
        dealer.close()
        ctx.term()
        silent.close()
