"""Plain zmq DEALER sockets for tests that speak zps's wire protocol directly.

These are hostile or raw peers: fake shards, clients that never read, malformed senders.
zps itself talks to zmq only through ``zps.transport``; this lives under ``tests/`` so
that the rest of the code base keeps that rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import zmq


def dealer(
    ctx: zmq.Context[Any], address: str, identity: bytes | None = None, **options: Any
) -> zmq.Socket[Any]:
    """A DEALER on ``ctx`` connected to ``address``.

    LINGER is 0; ``identity`` (if given) and each option (``RCVHWM=1``,
    ``CURVE_SERVERKEY=...``: a ``zmq`` constant's name and its value) are set before
    the connect.
    """
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


@contextlib.contextmanager
def raw_dealer(
    address: str, identity: bytes | None = None, **options: Any
) -> Iterator[zmq.Socket[Any]]:
    """``dealer`` on a context of its own; both are closed on exit."""
    ctx = zmq.Context()
    try:
        sock = dealer(ctx, address, identity, **options)
        try:
            yield sock
        finally:
            sock.close(0)
    finally:
        ctx.term()
