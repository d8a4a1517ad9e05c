"""The broker's compiled data path (zps.broker.forward): real zmq sockets.

``step`` forwards a client's REQUEST to its partition's primary and a member shard's
reply to its client with the frames intact, and returns every other message untouched
(nothing of it sent) for the Python path to decide: the rules of
zps.broker.acceptance, the route table of zps.broker.routes, and the broker's own checks
(no primary, holding, held queues, a full or gone peer).  Then a real cluster forwards
through it, and through the Python path with the compiled steps off, with the same
results.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

import zps
from zps.broker import forward, routes
from zps.broker.routes import RouteTable
from zps.optim import SGD
from zps.protocol.codec import MsgType, Route
from zps.testing import LocalCluster

needs_step = pytest.mark.skipif(forward.step is None, reason="the C extension was not built")

WAIT_MS = 5000


class Sockets:
    """A ROUTER as the broker's, a client DEALER and two shard DEALERs, on inproc."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("inproc://broker")
        self.peers: dict[bytes, zmq.Socket[Any]] = {}
        for ident in (b"c-1", b"s-a", b"s-b", b"h-s-a"):
            self.peers[ident] = self._connect(ident)
        for ident, sock in self.peers.items():  # the router learns every identity
            sock.send_multipart([b"hello"])
            got = self.router_recv()
            assert got == [ident, b"hello"]

    def _connect(self, ident: bytes) -> zmq.Socket[Any]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, ident)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect("inproc://broker")
        return sock

    def router_recv(self) -> list[bytes]:
        assert self.router.poll(WAIT_MS), "nothing reached the router"
        return self.router.recv_multipart()

    def send(self, ident: bytes, frames: list[bytes]) -> None:
        """Send from a peer and wait until the router has it queued."""
        self.peers[ident].send_multipart(frames)
        assert self.router.poll(WAIT_MS, zmq.POLLIN), "nothing reached the router"

    def got(self, ident: bytes) -> list[bytes] | None:
        """What the peer received, if anything is queued for it (inproc delivers at
        once: a message the router sent is already there)."""
        sock = self.peers[ident]
        return sock.recv_multipart() if sock.poll(0) else None

    def step(self, **kw: Any) -> tuple[int, int, int, list[bytes] | None]:
        assert forward.step is not None
        args: dict[str, Any] = {
            "limit": 256,
            "routes": [b"s-a", b"s-b"],
            "shards": {"s-a": object(), "s-b": object()},
            "last": {},
            "queues": {},
            "holding": False,
            "now": 12.5,
        }
        args.update(kw)
        return forward.step(  # type: ignore[no-any-return]
            self.router.underlying,
            args["limit"],
            args["routes"],
            args["shards"],
            args["last"],
            args["queues"],
            args["holding"],
            args["now"],
        )

    def close(self) -> None:
        self.ctx.destroy(0)


@pytest.fixture
def socks() -> Iterator[Sockets]:
    s = Sockets()
    try:
        yield s
    finally:
        s.close()


def route(p: int, mtype: MsgType = MsgType.REQUEST, req: int = 7) -> bytes:
    return Route(mtype, p, 1, req).pack()


@needs_step
def test_a_request_goes_to_its_primary_with_its_frames(socks: Sockets) -> None:
    payload = os.urandom(3000)
    socks.send(b"c-1", [route(1), b"header", payload])
    last: dict[str, float] = {}
    events, routed, replies, declined = socks.step(last=last)
    assert (routed, replies, declined) == (1, 0, None)
    assert not events & zmq.POLLIN  # nothing left queued
    assert socks.got(b"s-b") == [b"c-1", route(1), b"header", payload]
    assert socks.got(b"s-a") is None
    assert last == {"c-1": 12.5}  # the failure detector heard from the client


@needs_step
def test_a_members_reply_goes_to_its_client(socks: Sockets) -> None:
    frames = [route(0, MsgType.REPLY), b"header", *[bytes([i]) * 40 for i in range(30)]]
    socks.send(b"s-a", [b"c-1", *frames])  # 32 frames: more than the step's first array
    last: dict[str, float] = {}
    _, routed, replies, declined = socks.step(last=last)
    assert (routed, replies, declined) == (0, 1, None)
    assert socks.got(b"c-1") == frames
    assert last == {"s-a": 12.5}


@needs_step
@pytest.mark.parametrize(
    "sender, frames, kw, why",
    [
        (b"c-1", [route(0)], {}, "a route frame alone"),
        (b"c-1", [route(0)[:-1], b"h", b"x"], {}, "a short route frame"),
        (b"c-1", [b"ZQ" + route(0)[2:], b"h", b"x"], {}, "bad magic"),
        (b"c-1", [route(0)[:2] + b"\x02" + route(0)[3:], b"h", b"x"], {}, "version 2"),
        (b"c-1", [route(0, MsgType.HELLO), b"h", b"x"], {}, "a control message"),
        (b"c-1", [route(2), b"h", b"x"], {}, "no such partition"),
        (b"c-1", [route(-1), b"h", b"x"], {}, "a negative partition"),
        (b"c-1", [route(0), b"h", b"x"], {"routes": [None, b"s-b"]}, "no primary"),
        (b"c-1", [route(0), b"h", b"x"], {"holding": True}, "collecting claims"),
        (b"c-1", [route(0), b"h", b"x"], {"queues": {b"s-a": 1}}, "held for the primary"),
        (b"c-1", [route(0), b"h", b"x"], {"routes": [b"s-gone", b"s-b"]}, "unroutable"),
        (b"s-a", [b"", route(0, MsgType.HEARTBEAT), b"h"], {}, "a shard's control"),
        (b"s-a", [b"\x00commit", route(0, MsgType.REPLY), b"h"], {}, "a commit answer"),
        (b"s-a", [b"s-b", route(0, MsgType.REPLY), b"h"], {}, "a reply to a shard"),
        (b"s-a", [b"c-1", route(0, MsgType.REPLY), b"h"], {"shards": {}}, "a dead shard"),
        (b"s-a", [b"c-1", route(0, MsgType.REPLY), b"h"], {"queues": {b"c-1": 1}}, "held"),
        (b"s-a", [b"c-gone", route(0, MsgType.REPLY), b"h"], {}, "a gone client"),
        (b"h-s-a", [b"", route(0, MsgType.HEARTBEAT), b"h"], {}, "a liveness link"),
    ],
)
def test_what_needs_a_decision_comes_back_untouched(
    socks: Sockets, sender: bytes, frames: list[bytes], kw: dict[str, Any], why: str
) -> None:
    socks.send(sender, frames)
    last: dict[str, float] = {}
    events, routed, replies, declined = socks.step(last=last, **kw)
    assert (events, routed, replies) == (0, 0, 0), why
    assert declined == [sender, *frames], why
    assert last == {}, why
    for ident in socks.peers:
        assert socks.got(ident) is None, f"{why}: something reached {ident!r}"
    # Nothing half-sent is left on the router: the next request goes through whole.
    socks.send(b"c-1", [route(1), b"next", b"x"])
    assert socks.step()[1:] == (1, 0, None)
    assert socks.got(b"s-b") == [b"c-1", route(1), b"next", b"x"]


@needs_step
@pytest.mark.parametrize("holding", [False, True])
def test_the_step_forwards_exactly_where_the_route_table_says(
    socks: Sockets, holding: bool
) -> None:
    """The compiled step only consults the route table (zps.broker.routes): a request goes
    where :func:`route` names an identity, and is handed back wherever it names none."""
    table = RouteTable([b"s-a", None, b"s-b", None], (False, True, False, False))
    for p in (-1, 0, 1, 2, 3, 4):
        socks.send(b"c-1", [route(p), b"h", b"x"])
        _, routed, _, declined = socks.step(routes=table.targets, holding=holding)
        where = routes.route(table, p, holding=holding)
        if isinstance(where, bytes):
            assert (routed, declined) == (1, None), p
            assert socks.got(where) == [b"c-1", route(p), b"h", b"x"], p
        else:
            assert (routed, declined) == (0, [b"c-1", route(p), b"h", b"x"]), (p, where)
        for ident in socks.peers:
            assert socks.got(ident) is None, p


@needs_step
def test_forwarded_until_one_is_declined_then_on_after_it(socks: Sockets) -> None:
    socks.send(b"c-1", [route(0, req=1), b"h", b"1"])
    socks.send(b"c-1", [route(0, MsgType.STATUS, req=2), b"h", b"2"])
    socks.send(b"c-1", [route(1, req=3), b"h", b"3"])
    assert socks.got(b"s-a") is None
    _, routed, _, declined = socks.step()
    assert routed == 1 and declined == [b"c-1", route(0, MsgType.STATUS, req=2), b"h", b"2"]
    assert socks.got(b"s-a") == [b"c-1", route(0, req=1), b"h", b"1"]
    events, routed, _, declined = socks.step()
    assert (routed, declined) == (1, None) and not events & zmq.POLLIN
    assert socks.got(b"s-b") == [b"c-1", route(1, req=3), b"h", b"3"]


@needs_step
def test_a_limit_leaves_the_rest_queued(socks: Sockets) -> None:
    for i in range(3):
        socks.send(b"c-1", [route(0, req=i), b"h", b"x"])
    events, routed, _, declined = socks.step(limit=2)
    assert (events, routed, declined) == (0, 2, None)  # events 0: more may be queued
    events, routed, _, declined = socks.step(limit=2)
    assert routed == 1 and declined is None and not events & zmq.POLLIN
    reqs = [struct.unpack("<Q", socks.peers[b"s-a"].recv_multipart()[1][-8:])[0] for _ in range(3)]
    assert reqs == [0, 1, 2]  # in order


@needs_step
def test_nothing_queued(socks: Sockets) -> None:
    events, routed, replies, declined = socks.step()
    assert (routed, replies, declined) == (0, 0, None) and not events & zmq.POLLIN


# -- a real cluster, compiled and not -------------------------------------------------


def _train(address: str) -> tuple[dict[str, Any], np.ndarray]:
    async def run() -> tuple[dict[str, Any], np.ndarray]:
        async with zps.connect(address) as ps:
            await ps.create_embedding("fw", dim=4, optimizer=SGD(lr=1.0))
            ids = np.arange(100, dtype=np.int64)  # both partitions
            for k in range(5):
                await ps.push_rows("fw", ids, np.full((100, 4), k, np.float32))
            rows = await ps.pull_rows("fw", ids)
            return await ps.status(), rows

    import asyncio

    return asyncio.run(run())


@pytest.mark.parametrize("compiled", [True, False])
def test_a_cluster_forwards_the_same_either_way(
    compiled: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    if compiled and forward.step is None:
        pytest.skip("the C extension was not built")
    if not compiled:
        monkeypatch.setenv("ZPS_NO_KERNEL", "1")  # every process forwards in Python
    with LocalCluster(workdir=tmp_path) as c:
        status, rows = _train(c.address)
        log = c.broker().log()
    path = "compiled (zps.broker._forward" if compiled else "python (ZPS_NO_KERNEL=1)"
    assert f"data path: {path}" in log, log[-2000:]
    np.testing.assert_array_equal(rows, np.full((100, 4), -10.0, np.float32))
    broker = status["broker"]
    assert broker["data_path"] == ("compiled" if compiled else "python")
    assert broker["routed"] >= 12 and broker["replies"] >= 12  # 6 calls x 2 partitions
    if compiled:
        assert broker["forwarded_compiled"] >= 24
    else:
        assert broker["forwarded_compiled"] == 0


def test_the_extension_is_built_where_a_compiler_is() -> None:
    """CI installs with gcc: the compiled path must be there, and in use."""
    have_cc = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_config_var('CC'))"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split()
    if not have_cc or not any(
        os.access(os.path.join(d, have_cc[0]), os.X_OK)
        for d in os.environ.get("PATH", "").split(os.pathsep)
    ):
        pytest.skip("no C compiler here")
    if os.environ.get("ZPS_NO_KERNEL", "") not in ("", "0"):
        pytest.skip("ZPS_NO_KERNEL is set")
    assert forward._forward is not None, "zps.broker._forward was not built"
    assert forward.AVAILABLE, forward.PATH
