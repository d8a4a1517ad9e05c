#!/usr/bin/env python3
"""A channel's send and receive of one message: pyzmq frame by frame against one compiled call.

    python bench/transport_io.py [--messages 20000] [--client-steps 800] [--rounds 4]

Part 1, one process: a DEALER pair over TCP loopback; each message is sent, then received
by the other socket once it has arrived, and the sending and the receiving thread CPU
(``time.thread_time``) are summed apart: pyzmq's way (``transport.Channel``'s path with the
extension off: one Cython call per frame, a ``zmq.Frame`` per received frame) and
``zps._zmqio``'s (one call per message), for the message shapes of a sparse step (a
request's route, header and 16 KiB of ids; a reply whose rows are in shared memory) and a
single small frame.  The receive
includes the ``ZMQ_EVENTS`` reading that finds the message.

Part 2, ``--client-steps N`` (0: skipped): a local cluster (2 partitions x 1 copy) and one
client in this process doing the sequential sparse step of ``bench/peers.py`` (pull 4,096
Zipf ids of a 1M x 32 SGD table, push their gradients and wait), N steps with the client's
channel compiled and N with it on pyzmq, alternately, ``--rounds`` times: the client's
thread CPU and wall time per step.  (The cluster's own processes use the extension
throughout; ``ZPS_NO_KERNEL=1`` in the environment turns it off everywhere.)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import zmq  # noqa: E402
import zps_bench as zb  # noqa: E402

from zps import transport  # noqa: E402

SHAPES = {
    "request: 5 B, 20 B, 100 B, 16 KiB": [5, 20, 100, 16384],
    "reply: 20 B, 120 B": [20, 120],
    "one frame of 64 B": [64],
}


def messages(n: int) -> None:
    """Part 1: thread CPU per message sent and received, both ways."""
    io: Any = transport._zmqio if transport.COMPILED_IO else None
    if io is None:
        print("zps._zmqio is not in use here (not built, or ZPS_NO_KERNEL=1): pyzmq only")
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    a.bind("tcp://127.0.0.1:*")
    b.connect(a.getsockopt(zmq.LAST_ENDPOINT).decode())
    b.send(b"hello")
    a.recv()
    raw_send, raw_recv, raw_get = transport._raw_send, transport._raw_recv, transport._raw_get
    nb, more, events = transport._NOBLOCK, transport._SNDMORE, transport._EVENTS

    def py_send(frames: list[bytes]) -> None:
        last = len(frames) - 1
        for i, f in enumerate(frames):
            raw_send(a, f, nb | more if i < last else nb, True, False)

    def py_recv() -> list[Any]:
        assert raw_get(b, events) & transport._POLLIN
        frame = raw_recv(b, nb, False, False)
        got = [frame]
        while frame.more:
            frame = raw_recv(b, nb, False, False)
            got.append(frame)
        return [transport.frame_buffer(f) for f in got]

    def c_send(frames: list[bytes]) -> None:
        assert io.send(a.underlying, frames, transport.ZERO_COPY_BYTES) == 1

    def c_recv() -> list[Any]:
        assert io.events(b.underlying) & transport._POLLIN
        got: list[Any] = io.recv(b.underlying, transport.RECV_COPY_MAX)
        return got

    ways: list[tuple[str, Callable[[list[bytes]], None], Callable[[], list[Any]]]] = [
        ("pyzmq", py_send, py_recv)
    ]
    if io is not None:
        ways.append(("compiled", c_send, c_recv))
    print(f"{'message':36} {'path':9} {'send us':>8} {'receive us':>11}")
    for label, sizes in SHAPES.items():
        frames = [bytes(s) for s in sizes]
        results: dict[str, tuple[float, float]] = {}
        for _ in range(2):  # two turns each, the best kept
            for name, send, recv in ways:
                ts = tr = 0.0
                for _ in range(n):
                    t0 = time.thread_time()
                    send(frames)
                    t1 = time.thread_time()
                    b.poll(1000)  # (arrived: the receive below finds it at once)
                    t1b = time.thread_time()
                    got = recv()
                    t2 = time.thread_time()
                    ts += t1 - t0
                    tr += t2 - t1b
                assert len(got) == len(frames)
                best = results.get(name, (1e9, 1e9))
                results[name] = (min(best[0], ts / n * 1e6), min(best[1], tr / n * 1e6))
        for name, (s_us, r_us) in results.items():
            print(f"{label:36} {name:9} {s_us:8.2f} {r_us:11.2f}")
    a.close(0)
    b.close(0)
    ctx.term()


async def client(address: str, steps: int, rounds: int) -> None:
    import zps

    async with zps.connect(address) as ps:
        await ps.create_embedding(
            "s", dim=32, init=zps.init.Uniform(-0.01, 0.01), optimizer=zps.optim.SGD(lr=0.05)
        )
        rng = np.random.default_rng(0)
        pool = [zb.zipf_ids(rng) for _ in range(16)]
        grads = rng.standard_normal((4096, 32), dtype=np.float32) * np.float32(1e-2)
        channels = ps.connection.channels
        compiled = [ch.compiled for ch in channels]

        async def run(n: int) -> tuple[float, float]:
            t0, w0 = time.thread_time(), time.perf_counter()
            for i in range(n):
                ids = pool[i % len(pool)]
                await ps.pull_rows("s", ids)
                await ps.push_rows("s", ids, grads)
            return (time.thread_time() - t0) / n * 1e6, (time.perf_counter() - w0) / n * 1e6

        await run(100)
        print(f"\n{'round':6} {'path':9} {'client CPU us/step':>19} {'wall us/step':>13}")
        for r in range(rounds):
            for name, paths in (("compiled", compiled), ("pyzmq", [False] * len(channels))):
                for ch, on in zip(channels, paths, strict=True):
                    ch.compiled = on
                cpu, wall = await run(steps)
                print(f"{r + 1:<6} {name:9} {cpu:19.0f} {wall:13.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--client-steps", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=4)
    ns = ap.parse_args()
    messages(ns.messages)
    if ns.client_steps and transport.COMPILED_IO:
        import uvloop

        from zps.testing import LocalCluster

        with (
            LocalCluster(partitions=2, shards=2, replication=1) as c,
            asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
        ):
            runner.run(client(c.address, ns.client_steps, ns.rounds))


if __name__ == "__main__":
    main()
