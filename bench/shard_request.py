#!/usr/bin/env python3
"""A shard's CPU per request through its request path, from a request's frames to its
reply handed to the link: decode, admission, the core, the reply plan, the send.

    python bench/shard_request.py [--rounds 15] [--n 500]

A ``ShardServer`` in this process is the primary of partition 0 (a lease that never
runs out, no replicas, durability ``none``, no shared memory) with a table ``e`` of
dim 16 float32 (SGD).  Its link and replication stream are stand-ins that take the
frames and send nothing: no sockets, no other process.  Each workload sends N requests
of client ``c`` (``cid``/``seq``, ``er``/``lz`` as a pipelined client's) through the
pipeline's entry; thread CPU time, the best of the rounds, in microseconds per request:

- ``pull``: ``pull_rows`` of 64 ids;
- ``push``: ``push_rows`` of 64 ids (a 64 x 16 float32 gradient);
- ``step``: both in one message (a pipelined training step);
- ``driver``: a pull with the core's ``handle_request`` replaced by a fixed reply: what
  the pipeline and the admission rules cost alone.

Run it against another tree with ``PYTHONPATH=/path/to/tree`` (its compiled modules
built in place): the layout before the request pipeline (``ShardServer._request``)
is driven too, so the figures compare (docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if importlib.util.find_spec("zps") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import zps
import zps.shard.core as core_mod
from zps.init import Zeros
from zps.ops.config import ShardConfig
from zps.optim import SGD
from zps.protocol.codec import CompressPolicy, Encoder, MsgType, Route
from zps.protocol.messages import Role
from zps.shard.server import ShardServer
from zps.store import EmbeddingSpec

IDS = 64
DIM = 16
CLIENT = b"c"


class _Outbound:
    """The broker link's stand-in: takes every reply, sends nothing."""

    held_bytes = 0

    class ch:  # the attribute the driver reads
        closed = False

    def post(self, frames: Any, limit: Any = None) -> None:
        return None


class _Stream:
    """The replication stream's stand-in: no replicas."""

    def replicate(self, prev: int, frames: Any, *, checked: bool = False) -> None:
        return None

    def stage_room(self) -> int:
        return 0


def _server() -> tuple[ShardServer, Callable[[bytes, Route, list[Any]], None]]:
    s = ShardServer(ShardConfig(shm_bytes=0, durability="none"), node_id="s-bench")
    s.core.assign(0, 1, primary=True)
    s.session.assign(Role.PRIMARY, 0, 1, None)
    s.session.may_write = lambda now: True  # type: ignore[method-assign]
    spec = EmbeddingSpec("e", DIM, "float32", Zeros(), SGD(lr=0.1), 1)
    s.core.handle(
        Route(MsgType.REQUEST, 0, 1, 0), {"ops": [{"op": "create", "spec": spec.to_wire()}]}, []
    )
    server: Any = s
    if hasattr(server, "requests"):  # the request pipeline
        server.links.out = _Outbound()
        server.links.sock = object()
        server.requests.replicator = _Stream()
        return s, server.requests.request  # type: ignore[no-any-return]
    server._out = _Outbound()  # the layout before it: the server's own _request
    server._sock = object()
    server._stream = _Stream()
    return s, server._request  # type: ignore[no-any-return]


def _message(seq: int, ops: list[tuple[dict[str, Any], dict[str, np.ndarray]]]) -> list[Any]:
    enc = Encoder(CompressPolicy())
    wire = [{**op, **{k: enc.array(v) for k, v in arrays.items()}} for op, arrays in ops]
    header = {"ops": wire, "cid": CLIENT, "seq": seq, "er": 1, "lz": 1}
    return list(enc.build(Route(MsgType.REQUEST, 0, 1, seq), header))


def _stub_core(s: ShardServer) -> None:
    """The core's handle_request answers every request with one fixed small reply."""
    enc = Encoder(CompressPolicy())
    reply = enc.build(Route(MsgType.REPLY, 0, 1, 1), {"st": "OK", "res": [{"st": "OK"}]})
    core: Any = s.core
    if hasattr(core_mod, "Handled"):
        fixed = core_mod.Handled(reply, False)
        core.handle_request = lambda *a, **k: fixed
    else:  # results returned through attributes
        core.handle_request = lambda *a, **k: (reply, False)
        core.writes_res, core.carried = None, False


def measure(rounds: int, n: int) -> dict[str, float]:
    """Microseconds of thread CPU per request, the best of ``rounds`` rounds of ``n``."""

    async def run() -> dict[str, float]:
        ids = np.arange(IDS, dtype=np.int64)
        g = np.ones((IDS, DIM), np.float32)
        push = ({"op": "push_rows", "t": "e"}, {"ids": ids, "g": g})
        pull = ({"op": "pull_rows", "t": "e"}, {"ids": ids})
        kinds: dict[str, list[tuple[dict[str, Any], dict[str, np.ndarray]]]] = {
            "pull": [pull],
            "push": [push],
            "step": [push, pull],
            "driver": [pull],
        }
        out: dict[str, float] = {}
        seq = 1
        for name, ops in kinds.items():
            s, request = _server()
            if name == "driver":
                _stub_core(s)
            best = float("inf")
            for _ in range(rounds):
                msgs = [_message(seq + i, ops) for i in range(n)]
                seq += n
                routes = [Route(MsgType.REQUEST, 0, 1, seq + i) for i in range(n)]
                t0 = time.thread_time()
                for route, frames in zip(routes, msgs, strict=True):
                    request(CLIENT, route, frames)
                best = min(best, (time.thread_time() - t0) / n)
            out[name] = best * 1e6
        return out

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="rounds per workload (best kept)")
    ap.add_argument("--n", type=int, default=500, help="requests per round")
    a = ap.parse_args()
    got = measure(a.rounds, a.n)
    print(f"zps from {Path(zps.__file__).resolve().parent.parent}")
    print("| workload | us per request |")
    print("|---|---|")
    for name, us in got.items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
