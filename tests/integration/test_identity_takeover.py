"""Taking over another key's identity, tried against the three CURVE servers of zps
(the broker, a routing broker, a primary's replication endpoint), with real processes
and real keys.

The attack: the victim's connection closes, and at once an intruder holding another
allowed key connects presenting the victim's zps id both as its socket's routing id
and as its ``X-Zps-Id``, and stays connected.  The victim connects again and is
served again at once; the intruder receives nothing, and the server logs a WARNING
naming the intruder's key.  (Before routing ids were handles the server chose, the
intruder held the routing id and the victim was never heard again while it stayed.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import re
import shutil
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.auth

import zps
from tests.integration.test_identities import (
    HalfOpenProxy,
    KeyCluster,
    control,
    curve_dealer,
    handshake_done,
    make_cluster,
)
from zps import transport
from zps.errors import ZpsError
from zps.ops.security import key_identity
from zps.optim import SGD
from zps.protocol.codec import MsgType, unpack_route
from zps.testing import Proc, free_port
from zps.transport.sockets import ZMQ_METADATA

pytestmark = pytest.mark.timeout(180)

#: A zps socket connects again at most this long after losing its connection
#: (zps.transport.sockets: RECONNECT_IVL_MAX and zmq's jitter of up to RECONNECT_IVL).
RECONNECT_S = 0.35


class CutProxy:
    """A TCP relay to ``upstream``.  ``cut()`` closes every relayed connection on both
    sides (the client's socket connects again by itself) and holds new connections,
    unrelayed, until ``release()``: so the intruder connects first."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            while not self.open.wait(0.05):
                if self.stopped:
                    down.close()
                    return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                down.close()
                continue
            with self.lock:
                self.socks += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.open.clear()
        with self.lock:
            socks, self.socks = self.socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def release(self) -> None:
        self.open.set()

    def close(self) -> None:
        self.stopped = True
        self.open.set()
        self.listener.close()
        self.cut()


@pytest.fixture(scope="module")
def kc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyCluster]:
    """A broker and two shards (alpha: shard0's key, beta: shard1's), one partition
    of two copies."""
    c = make_cluster(tmp_path_factory.mktemp("takeover"), replication=2)
    try:
        c.start_broker_process()
        c.start_shard_process("alpha", "shard0")
        c.start_shard_process("beta", "shard1")
        c.wait_healthy(30)
        yield c
    finally:
        c.stop()


def wait_log(proc: Proc, pattern: str, timeout: float = 10.0) -> str:
    """The first line of ``proc``'s log matching ``pattern``, waiting for it."""
    deadline = time.monotonic() + timeout
    while True:
        for line in proc.log().splitlines():
            if re.search(pattern, line):
                return line
        assert time.monotonic() < deadline, f"no {pattern!r} in {proc.name}:\n{proc.log()[-3000:]}"
        time.sleep(0.05)


def refused_key(kc: KeyCluster, key: str, who: str) -> str:
    """The WARNING a server logs refusing a message of ``key`` under another's id."""
    public = re.escape(kc.public(key).decode())
    return rf"WARNING.*{who} refused \S+ \(key {public}\): the identity belongs to another key"


def test_victim_served_after_takeover_attempt_at_the_broker(kc: KeyCluster) -> None:
    proxy = CutProxy(kc.port)
    ctx = zmq.Context()
    try:
        cfg = kc.client_config(timeout=RECONNECT_S + 1.0)
        with zps.connect_sync(f"tcp://127.0.0.1:{proxy.port}", cfg) as victim:
            victim.create_dense("taken", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
            victim.push_dense("taken", np.ones(4))
            ident = victim.client.client_id
            proxy.cut()
            intruder, monitor = curve_dealer(ctx, kc, "hostile", ident, kc.address, "broker")
            handshake_done(monitor)
            intruder.send_multipart(control(MsgType.HELLO, {"host": "i", "pid": 1, "name": "i"}))
            wait_log(kc.broker(), refused_key(kc, "hostile", "the broker"))
            proxy.release()
            start = time.monotonic()
            np.testing.assert_array_equal(victim.pull_dense("taken"), -np.ones(4))
            assert time.monotonic() - start < RECONNECT_S + 1.0
            victim.push_dense("taken", np.ones(4))
            np.testing.assert_array_equal(victim.pull_dense("taken"), -2 * np.ones(4))
            # The broker probes every client each 0.1 s: none of it went to the intruder.
            assert not intruder.poll(500), "the intruder received a message meant for the victim"
        assert not re.search(
            rf"client {re.escape(ident.decode())} missed its heartbeats", kc.broker().log()
        )
    finally:
        ctx.destroy(0)
        proxy.close()


def test_a_replica_served_after_takeover_attempt_at_its_primary(kc: KeyCluster) -> None:
    """The replica's link to its primary's replication endpoint closes (the replica's
    process is killed); a shard key intrudes under its name there; the replica, started
    again, subscribes, catches up and acknowledges, and writes that wait for every copy
    complete."""
    status = kc.wait_healthy(30)
    primary = next(s for s in status["shards"] if s["role"] == "primary")
    replica = next(s for s in status["shards"] if s["role"] == "replica")
    name = replica["node"].removeprefix("s-")
    key = {"s-alpha": "shard0", "s-beta": "shard1"}
    primary_proc = kc.proc_by_pid(primary["pid"])
    with zps.connect_sync(kc.address, kc.client_config()) as ps:
        ps.create_dense("stream", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.push_dense("stream", np.ones(2))
    kc.kill(replica["pid"])
    ctx = zmq.Context()
    try:
        intruder, monitor = curve_dealer(
            ctx, kc, "rogue", replica["node"].encode(), primary["address"], key[primary["node"]]
        )
        handshake_done(monitor)
        head = {"partition": 0, "epoch": primary["epoch"]}
        intruder.send_multipart(control(MsgType.SUBSCRIBE, {**head, "lsn": 0}))
        wait_log(primary_proc, refused_key(kc, "rogue", "the replication endpoint"))
        again = kc.start_shard_process(name, key[replica["node"]])
        kc.wait_for(
            lambda s: any(
                r["node"] == replica["node"] and r["in_sync"]
                for p in s["partitions"]
                for r in p["replicas"]
            ),
            30,
            f"{replica['node']} in sync again",
        )

        async def write_all() -> None:
            async with zps.connect(kc.address, kc.client_config(), acks="all") as ps:
                await ps.push_dense("stream", np.ones(2))

        asyncio.run(asyncio.wait_for(write_all(), 10))
        assert not intruder.poll(500), "the intruder received the replica's stream"
        assert again.alive()
    finally:
        ctx.destroy(0)
    with zps.connect_sync(kc.address, kc.client_config()) as ps:
        np.testing.assert_array_equal(ps.pull_dense("stream"), [-2.0, -2.0])


def generated_ids(count: int) -> list[bytes]:
    """The routing ids libzmq would generate first for a ROUTER created after any
    number of draws from the C library's unseeded ``rand()`` (a zero byte and a 32-bit
    counter started at one draw's value, with the next draw's lowest bit on top)."""
    libc = ctypes.CDLL(None)
    libc.srand(1)  # glibc's unseeded sequence
    draws = [int(libc.rand()) for _ in range(count + 1)]
    return [
        b"\x00" + struct.pack(">I", (draws[i] | (draws[i + 1] & 1) << 31) & 0xFFFFFFFF)
        for i in range(count)
    ]


def test_a_zero_byte_id_does_not_abort_the_broker(kc: KeyCluster) -> None:
    """An allowed key presents the ids the broker's ROUTER would generate next (zero
    byte first), then connects with no id: libzmq would generate an id one of those
    connections holds, and abort.  The ZAP handler gives every connection a handle of
    its own, so nothing is generated and the broker serves on.

    Residual race: libzmq reads the ZAP reply and the peer's own metadata in either
    order and takes the id of the last one read; the ZAP reply comes ZAP_REPLY_DELAY
    later, so a peer's own id wins rarely (under load, about 1 connection in 100).  The
    broker still aborts if one of the zero-byte connections that matches the next
    generated id and the id-less connection both win it."""
    broker = kc.broker()
    ctx = zmq.Context()
    try:
        socks = []
        for ident in generated_ids(48):
            sock, monitor = curve_dealer(ctx, kc, "hostile", ident, kc.address, "broker")
            handshake_done(monitor)
            socks.append(sock)
        public, secret = zmq.auth.load_certificate(str(kc.keys / "hostile.key_secret"))
        bare = ctx.socket(zmq.DEALER)  # no routing id, no zps id
        bare.setsockopt(zmq.LINGER, 0)
        bare.curve_publickey, bare.curve_secretkey = public, secret
        bare.curve_serverkey = kc.public("broker")
        monitor = bare.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        bare.connect(kc.address)
        handshake_done(monitor)
        bare.send_multipart(control(MsgType.HEARTBEAT, {}))
        try:
            with zps.connect_sync(kc.address, kc.client_config()) as ps:
                ps.create_dense("alive", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
                ps.push_dense("alive", np.ones(2))
                np.testing.assert_array_equal(ps.pull_dense("alive"), [-1.0, -1.0])
        except ZpsError as e:
            status = broker.popen.poll()
            raise AssertionError(f"the broker serves no more (exit status {status})") from e
        assert broker.alive(), broker.log()[-3000:]
        assert not any(s.poll(0) for s in socks) and not bare.poll(0)
    finally:
        ctx.destroy(0)


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[tuple[KeyCluster, str]]:
    """A broker, a shard and a routing broker (serving with the broker's key pair, a
    client of the broker with it) routing partition 0."""
    c = make_cluster(tmp_path, replication=1)
    assert c.workdir is not None
    shutil.copy(c.keys / "broker.key", c.workdir / "clients" / "router.key")
    router = f"tcp://127.0.0.1:{free_port()}"
    try:
        c.start_broker_process()
        c.start_shard_process("solo", "shard0")
        c.start_role(
            "router",
            "broker",
            f'[broker]\nbind = "{router}"\nfollow = "{c.address}"\n{c.hb()}{c.security("broker")}',
        )
        c.wait_for(
            lambda s: c.healthy(s) and any(0 in r["partitions"] for r in s["routers"]),
            30,
            "the router to route partition 0",
        )
        yield c, router
    finally:
        c.stop()


def test_victim_served_after_takeover_attempt_at_a_routing_broker(
    routed: tuple[KeyCluster, str],
) -> None:
    """The victim is a zps DEALER (the sockets every zps client uses) speaking to the
    routing broker through the proxy; the router echoes each heartbeat of a client."""
    c, router = routed
    router_proc = next(p for p in c.procs if p.name == "router")
    proxy = CutProxy(int(router.rsplit(":", 1)[1]))
    public, secret = zmq.auth.load_certificate(str(c.keys / "client.key_secret"))
    assert public is not None and secret is not None
    ident = key_identity(b"c-", public, b"victim")
    keys = transport.CurveKeys(public, secret, c.public("broker"), None)

    async def run(intruder: zmq.Socket[Any]) -> None:
        ctx = transport.new_context()
        victim = transport.dealer(
            ctx,
            f"tcp://127.0.0.1:{proxy.port}",
            ident,
            max_message_bytes=1 << 20,
            curve=keys,
            server_public=keys.server_public,
        )

        async def echoed(within: float) -> bool:
            await transport.send(victim, control(MsgType.HEARTBEAT, {}, req_id=7))
            deadline = time.monotonic() + within
            while (left := deadline - time.monotonic()) > 0:
                for frames in await transport.recv_burst(victim, left):
                    route = unpack_route(transport.frame_buffer(frames[0]))
                    if route.mtype is MsgType.HEARTBEAT:
                        return True
            return False

        try:
            assert await echoed(10), "the router never echoed the victim"
            proxy.cut()
            monitor = intruder.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            intruder.connect(router)
            handshake_done(monitor)
            intruder.send_multipart(control(MsgType.HEARTBEAT, {}))
            await asyncio.to_thread(
                wait_log, router_proc, refused_key(c, "hostile", "the routing broker")
            )
            proxy.release()
            assert await echoed(RECONNECT_S + 1.0), "the victim was not heard again"
            assert not intruder.poll(500), "the intruder received the victim's echo"
        finally:
            transport.close(victim)
            transport.term(ctx)

    ctx = zmq.Context()
    try:
        hostile, hostile_secret = zmq.auth.load_certificate(str(c.keys / "hostile.key_secret"))
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.setsockopt(zmq.IDENTITY, ident)
        intruder.setsockopt(ZMQ_METADATA, b"X-Zps-Id:" + ident)
        intruder.curve_publickey, intruder.curve_secretkey = hostile, hostile_secret
        intruder.curve_serverkey = c.public("broker")
        asyncio.run(run(intruder))
    finally:
        ctx.destroy(0)
        proxy.close()


def test_a_replica_name_at_a_primary_belongs_to_the_key_it_registered_with(
    tmp_path: Path,
) -> None:
    """A shard key that subscribes at a primary under an assigned replica's name before
    that replica reaches the primary gets nothing and is logged there: the broker told
    the primary which key registered the name.  The replica then gets in sync."""
    c = make_cluster(tmp_path, replication=2)
    relay: HalfOpenProxy | None = None
    ctx = zmq.Context()
    try:
        c.start_broker_process()
        # alpha advertises 127.0.0.2, where nothing listens until the relay below: its
        # replica cannot reach it until then.
        alpha = c.start_role(
            "shard-alpha",
            "shard",
            f'[shard]\nbroker = "{c.address}"\nname = "alpha"\n'
            f'replication_bind = "tcp://127.0.0.1:0"\nadvertise_host = "127.0.0.2"\n'
            f"{c.hb()}{c.security('shard0')}",
        )
        c.wait_for(lambda s: s["partitions"][0]["primary"] == "s-alpha", 30, "alpha primary")
        c.start_shard_process("beta", "shard1")
        status = c.wait_for(
            lambda s: any(r["node"] == "s-beta" for r in s["partitions"][0]["replicas"]),
            30,
            "beta assigned as alpha's replica",
        )
        epoch = status["partitions"][0]["epoch"]
        address = next(s for s in status["shards"] if s["node"] == "s-alpha")["address"]
        port = int(address.rsplit(":", 1)[1])
        rogue, monitor = curve_dealer(
            ctx, c, "rogue", b"s-beta", f"tcp://127.0.0.1:{port}", "shard0"
        )
        handshake_done(monitor)
        refused = r"the replication endpoint refused s-beta .*belongs to another key"
        deadline = time.monotonic() + 20
        while not re.search(refused, alpha.log()):
            assert time.monotonic() < deadline, alpha.log()[-2000:]
            rogue.send_multipart(
                control(MsgType.SUBSCRIBE, {"partition": 0, "epoch": epoch, "lsn": 0})
            )
            if rogue.poll(300):  # a BYE: alpha has not had the map naming beta yet
                frames = rogue.recv_multipart()
                assert unpack_route(frames[0]).mtype is MsgType.BYE, "the rogue got the stream"
        relay = HalfOpenProxy(("127.0.0.1", port), listen=("127.0.0.2", port))
        c.wait_healthy(30)  # beta, through the relay: in sync
        assert not rogue.poll(0)
    finally:
        ctx.destroy(0)
        c.stop()
        if relay is not None:
            relay.close()
