"""A channel's compiled send and receive (``zps._zmqio``), on real sockets over loopback:
the same bytes, in the same order, with the same errors as pyzmq's frame-by-frame path,
and every case it does not take (large frames, many frames, odd objects, failures)
left to pyzmq."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import zmq

from zps import transport
from zps.broker import forward
from zps.errors import ClosedError
from zps.testing import free_port
from zps.transport.compiled import io_path, pyzmq_libzmq

needs_io = pytest.mark.skipif(not transport.COMPILED_IO, reason="zps._zmqio is not in use")

MAX = 1 << 24


class Pair:
    def __init__(self, ctx: Any, router: transport.Channel, dealer: transport.Channel) -> None:
        self.ctx, self.router, self.dealer = ctx, router, dealer

    async def peer(self) -> bytes:
        """The dealer's identity, as the router knows it (after a hello)."""
        assert transport.send_if_room(self.dealer, [b"hello"])
        (hello,) = await transport.recv_burst(self.router, timeout=5)
        return transport.frame_bytes(hello[0])


async def _pair(compiled_router: bool = True, compiled_dealer: bool = True) -> Pair:
    ctx = transport.new_context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    router, _ = transport.router(ctx, addr, max_message_bytes=MAX)
    dealer = transport.dealer(ctx, addr, b"c-test", max_message_bytes=MAX)
    if not compiled_router:
        router.compiled = False
    if not compiled_dealer:
        dealer.compiled = False
    assert (router.compiled, dealer.compiled) == (compiled_router, compiled_dealer)
    return Pair(ctx, router, dealer)


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await _pair()
    yield p
    transport.close(p.router)
    transport.close(p.dealer)
    transport.term(p.ctx)


async def _recv_all(ch: transport.Channel, n: int) -> list[list[Any]]:
    got: list[list[Any]] = []
    while len(got) < n:
        burst = await transport.recv_burst(ch, timeout=5)
        assert burst, f"only {len(got)} of {n} messages arrived"
        got.extend(burst)
    return got


def _messages() -> list[list[Any]]:
    """Frames of every shape the compiled path takes or hands to pyzmq."""
    rng = np.random.default_rng(3)
    big = rng.integers(0, 255, transport.ZERO_COPY_BYTES + 8, dtype=np.uint8)
    return [
        [b"route", b"header"],
        [b""],  # one empty frame
        [b"a", b"", b"c"],
        [bytes(range(256)) * 64],  # 16 KiB: copied on both sides
        [b"h", rng.integers(0, 255, transport.RECV_COPY_MAX - 1, dtype=np.uint8)],
        [b"h", rng.integers(0, 255, transport.RECV_COPY_MAX, dtype=np.uint8)],  # held
        [b"h", memoryview(bytes(range(100)))[10:90]],
        [b"h", np.arange(1000, dtype=np.float32)],
        [b"h", big],  # past ZERO_COPY_BYTES: pyzmq sends it, without a copy
        [bytes([i]) for i in range(64)],  # as many frames as one compiled send takes
        [bytes([i]) for i in range(65)],  # more: pyzmq
    ]


def _as_bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames]


@needs_io
@pytest.mark.timeout(30)
@pytest.mark.parametrize("compiled", [(True, True), (True, False), (False, True)])
async def test_every_message_arrives_whole_and_in_order_on_either_path(
    compiled: tuple[bool, bool],
) -> None:
    """A compiled sender to a pyzmq receiver, and the reverse, and both compiled: the
    same frames arrive, in order, both ways."""
    p = await _pair(*compiled)
    try:
        peer = await p.peer()
        msgs = _messages()
        for m in msgs:
            assert transport.send_if_room(p.dealer, m)
        got = await _recv_all(p.router, len(msgs))
        assert [_as_bytes(g[1:]) for g in got] == [_as_bytes(m) for m in msgs]
        assert all(transport.frame_bytes(g[0]) == peer for g in got)
        for m in msgs:  # and back, addressed by the router
            assert await transport.send(p.router, [peer, *m])
        back = await _recv_all(p.dealer, len(msgs))
        assert [_as_bytes(g) for g in back] == [_as_bytes(m) for m in msgs]
    finally:
        transport.close(p.router)
        transport.close(p.dealer)
        transport.term(p.ctx)


@needs_io
@pytest.mark.timeout(30)
async def test_small_frames_arrive_as_bytes_and_large_ones_are_held_not_copied(
    pair: Pair,
) -> None:
    assert pair.router.compiled and pair.dealer.compiled
    await pair.peer()
    large = np.arange(transport.RECV_COPY_MAX // 4, dtype=np.float32)
    assert transport.send_if_room(pair.dealer, [b"small", large])
    ((ident, small, held),) = await _recv_all(pair.router, 1)
    assert type(small) is bytes and small == b"small"
    assert type(held) is not bytes and len(held) == large.nbytes
    view = transport.frame_buffer(held)
    assert view.readonly, "a received frame must not be writable"
    assert np.array_equal(np.frombuffer(view, np.float32), large)
    # Held frames stay whole while later messages come, and once forwarded.
    for i in range(20):
        assert transport.send_if_room(pair.dealer, [b"more", bytes([i]) * 100])
    await _recv_all(pair.router, 20)
    peer = transport.frame_bytes(ident)
    assert await transport.send(pair.router, [peer, held])
    ((echoed,),) = await _recv_all(pair.dealer, 1)
    assert np.array_equal(np.frombuffer(transport.frame_buffer(echoed), np.float32), large)
    del view
    assert transport.message_bytes([small, held]) == 5 + large.nbytes


@needs_io
@pytest.mark.timeout(30)
async def test_an_unknown_peer_is_reported_and_a_full_queue_waits_as_before(pair: Pair) -> None:
    assert not transport.try_send(pair.router, [b"nobody", b"x"])
    assert pair.router.send_nowait([b"nobody", b"x"]) is False  # EHOSTUNREACH, no raise
    peer = await pair.peer()
    # The dealer never reads: the router's queue to it fills, and then sends say so.
    refused = 0
    for _ in range(10_000):
        try:
            pair.router.send_nowait([peer, bytes(60_000)])
        except zmq.Again:
            refused += 1
            break
    assert refused == 1, "a peer that never reads must fill its queue"
    assert transport.try_send(pair.router, [peer, b"x"]) is False


@needs_io
@pytest.mark.timeout(30)
async def test_a_closed_channel_raises_and_is_never_handed_to_the_compiled_path(
    pair: Pair,
) -> None:
    await pair.peer()
    transport.close(pair.dealer)
    with pytest.raises(ClosedError):
        pair.dealer.send_nowait([b"x"])
    with pytest.raises(ClosedError):
        await transport.recv_burst(pair.dealer, timeout=1)


@needs_io
def test_the_compiled_calls_decline_what_they_do_not_take() -> None:
    """Called directly: nothing sent for a message it declines, and an empty socket
    reads as None."""
    from zps import _zmqio  # type: ignore[attr-defined]

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://zmqio-decline")
        b.connect("inproc://zmqio-decline")
        sock = a.underlying
        assert _zmqio.recv(b.underlying, 1024) is None
        assert _zmqio.send(sock, [], 1024) == 0
        assert _zmqio.send(sock, [b"x"] * 65, 1024) == 0
        assert _zmqio.send(sock, [b"x", "not a buffer"], 1024) == 0
        assert _zmqio.send(sock, [b"x", bytes(1024)], 1024) == 0  # at the limit: declined
        assert _zmqio.send(sock, [b"x", np.zeros((4, 4))[:, 1]], 1024) == 0  # not contiguous
        assert _zmqio.recv(b.underlying, 1024) is None, "a declined message sent nothing"
        assert _zmqio.send(sock, [b"x", bytes(1023)], 1024) == 1
        assert _zmqio.recv(b.underlying, 1024) == [b"x", bytes(1023)]
        assert _zmqio.events(b.underlying) & zmq.POLLOUT
        with pytest.raises(TypeError):
            _zmqio.Frame()
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


@pytest.mark.timeout(30)
async def test_a_curve_server_reads_frames_through_pyzmq(tmp_path: Any) -> None:
    """A CURVE server's frames carry the sender's key (transport.sender_key): its
    channel receives through pyzmq."""
    public, secret = zmq.curve_keypair()
    keys = transport.CurveKeys(public, secret, None, None)
    ctx = transport.new_context()
    router, _ = transport.router(
        ctx, f"tcp://127.0.0.1:{free_port()}", max_message_bytes=MAX, curve=keys
    )
    try:
        assert not router.compiled
    finally:
        transport.close(router)
        transport.term(ctx)


def test_the_extension_is_built_and_bound_where_a_compiler_is() -> None:
    """``pip install`` builds it where a C compiler is found (CI's machines have one):
    then it must be bound to pyzmq's libzmq, and ``ZPS_NO_KERNEL=1`` turns it off."""
    if os.environ.get("ZPS_NO_KERNEL", "") not in ("", "0"):
        pytest.skip("ZPS_NO_KERNEL is set")
    assert transport._zmqio is not None, "zps._zmqio was not built"
    assert transport.COMPILED_IO, transport.IO_PATH
    off = subprocess.run(
        [sys.executable, "-c", "from zps import transport; print(transport.COMPILED_IO)"],
        env={**os.environ, "ZPS_NO_KERNEL": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert off.stdout.strip() == "False", off.stderr


_LOADED_ALONE = """
import importlib.util, sys
import zmq  # pyzmq loads its libzmq; nothing of zps is imported


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


io = load("zps._zmqio", sys.argv[1])
fwd = load("zps.broker._forward", sys.argv[2])
ours = ("zps._zmqio", "zps.broker._forward")
zps = [m for m in sys.modules if m.split(".")[0] == "zps" and m not in ours]
assert not zps, f"zps code was imported: {zps}"
ctx = zmq.Context()
# The send and receive, on a pair of pyzmq's sockets.
a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
a.bind("inproc://alone")
b.connect("inproc://alone")
assert io.send(a.underlying, [b"to", b"pyzmq"], 1024) == 1
assert b.recv_multipart() == [b"to", b"pyzmq"]
b.send_multipart([b"from", b"pyzmq"])
assert a.poll(5000, zmq.POLLIN)
assert io.recv(a.underlying, 1024) == [b"from", b"pyzmq"]
# The broker's step, on pyzmq's ROUTER: a client's message it declines (received), and a
# shard's reply it forwards to that client (sent).
router = ctx.socket(zmq.ROUTER)
router.bind("inproc://broker")
client, shard = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
client.setsockopt(zmq.IDENTITY, b"c-1")
shard.setsockopt(zmq.IDENTITY, b"s-a")
client.connect("inproc://broker")
shard.connect("inproc://broker")
client.send_multipart([b"not a route", b"x"])
assert router.poll(5000, zmq.POLLIN)
got = fwd.pump(router.underlying, 10, [], {}, {}, {}, False, 1.0)
assert got[1:] == (0, 0, [b"c-1", b"not a route", b"x"]), got
shard.send_multipart([b"c-1", b"reply"])
assert router.poll(5000, zmq.POLLIN)
last = {}
got = fwd.pump(router.underlying, 10, [], {"s-a": 0}, last, {}, False, 1.0)
assert got[1:] == (0, 1, None) and last == {"s-a": 1.0}, (got, last)
assert client.poll(5000, zmq.POLLIN)
assert client.recv_multipart() == [b"reply"]
for s in (a, b, router, client, shard):
    s.close(0)
ctx.term()
with open("/proc/self/maps") as maps:
    for line in maps:
        if "libzmq" in line:
            print("MAPPED", line.split(None, 5)[5].strip())
print("BOUND", io.bound())
print("BOUND", fwd.bound())
"""


@pytest.mark.timeout(60)
def test_the_extensions_run_on_pyzmqs_libzmq_with_nothing_to_bind() -> None:
    """Loaded on their own after ``import zmq`` (no zps code runs, nothing is bound), the
    send and receive and the broker's step drive sockets pyzmq made, both ways: the
    dynamic linker gave them the libzmq pyzmq loaded.  The process maps one libzmq, the
    file pyzmq ships."""
    if transport._zmqio is None or forward._forward is None:
        pytest.skip("zps._zmqio or zps.broker._forward was not built")
    run = subprocess.run(
        [sys.executable, "-c", _LOADED_ALONE, transport._zmqio.__file__, forward._forward.__file__],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, (run.returncode, run.stderr)
    lines = run.stdout.splitlines()
    mapped = {
        os.path.realpath(line.split(" ", 1)[1]) for line in lines if line.startswith("MAPPED")
    }
    bound = {os.path.realpath(line.split(" ", 1)[1]) for line in lines if line.startswith("BOUND")}
    shipped = pyzmq_libzmq()
    assert len(mapped) == 1, f"more than one libzmq in the process: {mapped}"
    assert mapped == bound, (mapped, bound)
    assert mapped <= set(shipped), (mapped, shipped)


def test_which_way_channels_go_is_decided_from_the_build_the_load_and_the_library() -> None:
    """Every way of the decision, and the INFO line's words for each."""
    shipped = ["/site/pyzmq.libs/libzmq-abc.so.5"]
    on = dict(built=True, load_error=None, no_kernel=False, version="4.3.5", shipped=shipped)
    path = io_path
    assert path(**on, bound=shipped[0]) == (
        True,
        f"zps._zmqio (pyzmq's libzmq 4.3.5, {shipped[0]})",
    )
    assert path(**{**on, "built": False}, bound=None) == (
        False,
        "pyzmq (zps._zmqio was not built)",
    )
    assert path(**{**on, "no_kernel": True}, bound=shipped[0]) == (
        False,
        "pyzmq (ZPS_NO_KERNEL=1)",
    )
    unbound = (False, "pyzmq (pyzmq's libzmq 4.3.5 could not be bound)")
    assert path(**{**on, "load_error": "libzmq-abc.so.5: cannot open"}, bound=None) == unbound
    assert path(**on, bound="/usr/lib/libzmq.so.5") == unbound  # another libzmq
    assert path(**on, bound=None) == unbound


_ANOTHER_LIBZMQ = """
import asyncio, ctypes, logging, sys
import zmq  # pyzmq loads its libzmq
ctypes.CDLL(sys.argv[1])  # then a second libzmq of the same version, before zps binds
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
from zps import transport
from zps.broker import forward
from zps.testing import free_port


async def main() -> None:
    ctx = transport.new_context()
    ch = transport.dealer(ctx, f"tcp://127.0.0.1:{free_port()}", b"c-x", max_message_bytes=1024)
    transport.close(ch)
    transport.term(ctx)


asyncio.run(main())
print("BOUND", transport._zmqio.bound())
print("BOUND", forward._forward.bound())
print("PATH", forward.PATH)
"""


@pytest.mark.timeout(60)
def test_the_libzmq_bound_is_pyzmqs_with_another_copy_loaded(tmp_path: Any) -> None:
    """A copy of pyzmq's libzmq under another name, loaded into the process first: the
    compiled send and receive and the broker's step (linked by pyzmq's soname) still run
    on the libzmq pyzmq's sockets run on, and the process says at INFO which path its
    channels take (a broker logs its own at start: test_broker_forward.py)."""
    from zps import _zmqio  # type: ignore[attr-defined]

    if os.environ.get("ZPS_NO_KERNEL", "") not in ("", "0") or not transport.COMPILED_IO:
        pytest.skip("zps._zmqio is not in use")
    ours = _zmqio.bound()
    assert ours is not None
    src = os.path.realpath(ours)
    copy = tmp_path / "libzmq.so.5"
    shutil.copyfile(src, copy)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{tmp_path}:{os.path.dirname(src)}"}
    run = subprocess.run(
        [sys.executable, "-c", _ANOTHER_LIBZMQ, str(copy)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    bound = [line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("BOUND")]
    assert len(bound) == 2
    for path in bound:
        assert os.path.realpath(path) == src, (path, run.stdout)
    assert "zps.transport: channels send and receive through zps._zmqio" in run.stdout
    assert "PATH compiled (zps.broker._forward" in run.stdout
