"""A transport channel on one end of an inproc PAIR, and the other end (blocking), for
the transport's unit tests."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import zmq

from zps import transport

Pair = tuple[transport.Channel, "zmq.Socket[Any]"]

_names = itertools.count()


@contextlib.asynccontextmanager
async def channel_pair() -> AsyncIterator[Pair]:
    ctx = transport.new_context()
    endpoint = f"inproc://pair-{next(_names)}"
    a = ctx.socket(zmq.PAIR)
    a.bind(endpoint)
    b = ctx.socket(zmq.PAIR)
    b.connect(endpoint)
    ch = transport.Channel(a)
    try:
        yield ch, b
    finally:
        ch.close()
        b.close(0)
        ctx.term()
