#!/usr/bin/env python3
"""The broker's Python data path: thread CPU per message of its fast path.

    python bench/broker_datapath.py [--calls 2000] [--rounds 30]

A broker built in this process (no sockets: its outbound queue is a stub that takes every
message) is handed the same message ``calls`` times per round, through
``Broker._forward`` (zps/broker/datapath.py), as the reader callback hands it what the
compiled step declines, or everything where the step is not built: a client's REQUEST
routed to its primary, a shard's reply forwarded to its client, and a REQUEST for no
such partition (refused).  Each figure is the least thread CPU time (``time.thread_time``,
so other processes on the machine do not count) per call over the rounds.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from zps import transport
from zps.broker.broker import Broker
from zps.broker.routes import RouteTable
from zps.ops.config import BrokerConfig
from zps.protocol.codec import MsgType, Route


class _Out:
    """The broker's Outbound, taking every message."""

    queues: dict[bytes, Any] = {}

    def post(self, frames: list[Any], limit: int) -> transport.Posted:
        return transport.Posted.SENT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    b = Broker(BrokerConfig(partitions=2))
    b._out = _Out()  # type: ignore[assignment]
    b.state.hold_until = 0.0
    b.routes = RouteTable([b"s-a", b"s-b"], (False, False))
    b.state.shards["s-a"] = object()  # type: ignore[assignment]  # a member, for replies
    messages = {
        "request": [b"c-1", Route(MsgType.REQUEST, 1, 1, 5).pack(), b"hdr", b"x" * 100],
        "reply": [b"s-a", b"c-1", Route(MsgType.REPLY, 1, 1, 5).pack(), b"hdr", b"x" * 100],
        "no such partition": [b"c-1", Route(MsgType.REQUEST, 5, 1, 5).pack(), b"hdr", b"x"],
    }
    for name, msg in messages.items():
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.thread_time()
            for _ in range(args.calls):
                b._forward(msg)
            best = min(best, (time.thread_time() - t0) / args.calls)
        print(f"{name:20s} {best * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
