"""Identities that cannot be taken over under CURVE, with real processes and real keys.

A broker, two shards (alpha, beta: one partition, two copies) and keys by role: shard
keys (``shard0``, ``shard1`` and a ``rogue`` one), client keys (``client`` and
``hostile``, both allowed) and an ``operator`` key.  Each test is an attack by an
allowed key on another key's identity or on the cluster itself; the attack gets
nothing, is refused with a reason, and the cluster keeps serving.
"""

from __future__ import annotations

import asyncio
import math
import re
import select
import shutil
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

import zps
from tests.integration.test_curve_roles import keygen, q
from tests.integration.wire import dealer
from zps.client.sync import SyncClient
from zps.errors import BadRequestError
from zps.ops.config import ClientConfig, Security
from zps.ops.security import key_identity
from zps.optim import SGD
from zps.protocol.codec import Encoder, MsgType, Route
from zps.protocol.messages import StatusRequest
from zps.testing import LocalCluster, Proc, free_port
from zps.transport.sockets import ZMQ_METADATA

SHARD_KEYS = ["shard0", "shard1", "rogue"]
CLIENT_KEYS = ["client", "hostile"]
NAMES = ["broker", *SHARD_KEYS, *CLIENT_KEYS, "operator"]

pytestmark = pytest.mark.timeout(120)


class KeyCluster(LocalCluster):
    keys: Path
    metrics_port: int

    def public(self, key: str) -> bytes:
        public, _ = zmq.auth.load_certificate(str(self.keys / f"{key}.key"))
        assert public is not None
        return public

    def security(self, key: str) -> str:
        assert self.workdir is not None
        return f"""
[security]
curve_secret_key_file = {q(self.keys / f"{key}.key_secret")}
curve_public_key_file = {q(self.keys / f"{key}.key")}
broker_public_key_file = {q(self.keys / "broker.key")}
allowed_clients_dir = {q(self.workdir / "clients")}
allowed_shards_dir = {q(self.workdir / "shards")}
allowed_operators_dir = {q(self.workdir / "operators")}
"""

    def client_config(self, key: str = "client", timeout: float = 5.0) -> ClientConfig:
        sec = Security(
            curve_secret_key_file=str(self.keys / f"{key}.key_secret"),
            curve_public_key_file=str(self.keys / f"{key}.key"),
            broker_public_key_file=str(self.keys / "broker.key"),
        )
        return ClientConfig(
            security=sec, connect_timeout=timeout, timeout=timeout, name="zps.testing"
        )

    def status_client(self, timeout: float) -> SyncClient:
        return zps.connect_sync(self.address, self.client_config(timeout=timeout))

    def start_role(self, name: str, role: str, toml: str) -> Proc:
        assert self.workdir is not None
        path = self.workdir / f"{name}.toml"
        path.write_text(toml)
        return self.spawn(name, [self.python, "-m", "zps", role, "--config", str(path)])

    def hb(self) -> str:
        return f"[heartbeat]\ninterval = {self.heartbeat_interval}\nliveness = {self.liveness}\n"

    def start_broker_process(self, name: str = "broker") -> Proc:
        assert self.workdir is not None
        return self.start_role(
            name,
            "broker",
            f'[broker]\nbind = "{self.address}"\npartitions = 1\n'
            f"replication = {self.replication}\n"
            f"data_dir = {q(self.workdir / 'broker-data')}\n"
            f"startup_grace = 0\n[metrics]\nport = {self.metrics_port}\n"
            f"{self.hb()}{self.security('broker')}",
        )

    def start_shard_process(
        self, name: str, key: str, broker: str | None = None, data_dir: Path | None = None
    ) -> Proc:
        data = f"data_dir = {q(data_dir)}\n" if data_dir is not None else ""
        return self.start_role(
            f"shard-{name}-{key}",
            "shard",
            f'[shard]\nbroker = "{broker or self.address}"\nname = "{name}"\n{data}'
            f'replication_bind = "tcp://127.0.0.1:0"\nadvertise_host = "127.0.0.1"\n'
            f"{self.hb()}{self.security(key)}",
        )

    def refusals(self, reason: str) -> float:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as r:
            text = r.read().decode()
        m = re.search(
            rf'^zps_broker_refusals_total{{reason="{reason}"}} (\S+)$', text, re.MULTILINE
        )
        assert m is not None, text
        return float(m.group(1))


def make_cluster(work: Path, replication: int) -> KeyCluster:
    """A KeyCluster's keys and allow-lists under ``work`` (nothing started)."""
    keys = work / "keys"
    for name in NAMES:
        keygen(keys, name)
    lists = {"shards": SHARD_KEYS, "clients": CLIENT_KEYS, "operators": ["operator"]}
    for directory, members in lists.items():
        (work / directory).mkdir()
        for name in members:
            shutil.copy(keys / f"{name}.key", work / directory / f"{name}.key")
    c = KeyCluster(partitions=1, replication=replication, liveness=20, workdir=work)
    c.keys, c.port, c.metrics_port = keys, free_port(), free_port()
    return c


@pytest.fixture(scope="module")
def kc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyCluster]:
    c = make_cluster(tmp_path_factory.mktemp("identities"), replication=2)
    try:
        c.start_broker_process()
        c.start_shard_process("alpha", "shard0")
        c.start_shard_process("beta", "shard1")
        c.wait_healthy(30)
        yield c
    finally:
        c.stop()


def curve_dealer(
    ctx: zmq.Context[Any], c: KeyCluster, key: str, identity: bytes, address: str, server: str
) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """A DEALER with ``key``'s pair presenting ``identity`` both ways, as its routing id
    and as its zps id (``X-Zps-Id``), and a monitor of its handshakes (started before it
    connects)."""
    public, secret = zmq.auth.load_certificate(str(c.keys / f"{key}.key_secret"))
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(ZMQ_METADATA, b"X-Zps-Id:" + identity)
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = c.public(server)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    return sock, monitor


def handshake_done(monitor: zmq.Socket[Any], timeout: float = 10.0) -> None:
    assert monitor.poll(int(timeout * 1000)), "the handshake never succeeded"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED


def control(mtype: MsgType, header: dict[str, Any], req_id: int = 0) -> list[bytes]:
    return [Route(mtype, req_id=req_id).pack(), msgpack.packb(header)]


def broker_lines(c: KeyCluster, pattern: str) -> list[str]:
    return [x for x in c.broker().log().splitlines() if re.search(pattern, x)]


def wait_lines(c: KeyCluster, pattern: str, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        found = broker_lines(c, pattern)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_a_connected_identity_is_not_handed_to_another_key(kc: KeyCluster) -> None:
    """The attack of the issue: another allowed key connects with a working client's
    identity.  It gets nothing meant for the client, and the client keeps working."""
    with zps.connect_sync(kc.address, kc.client_config(timeout=3.0)) as victim:
        victim.create_dense("victim", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        victim.push_dense("victim", np.ones(4))
        ident = victim.client.client_id
        ctx = zmq.Context()
        try:
            thief, monitor = curve_dealer(ctx, kc, "hostile", ident, kc.address, "broker")
            handshake_done(monitor)
            thief.send_multipart(control(MsgType.HELLO, {"host": "t", "pid": 1, "name": "t"}))
            for _ in range(20):  # every pull answered, to the victim
                np.testing.assert_array_equal(victim.pull_dense("victim"), -np.ones(4))
            assert not thief.poll(500), "the thief received a message meant for the victim"
        finally:
            ctx.destroy(0)
        np.testing.assert_array_equal(victim.pull_dense("victim"), -np.ones(4))
    assert kc.healthy(kc.status())


def test_a_free_identity_gets_nothing_meant_for_its_owner(kc: KeyCluster) -> None:
    """The owner's connection closes (no goodbye: the broker still knows it and keeps
    sending to it); another key connects with the identity at once, which is free now.
    It gets nothing meant for the owner, not even the broker's probes, until the owner's
    key speaks again."""
    ident = key_identity(b"c-", kc.public("client"), b"gone")
    ctx = zmq.Context()
    try:
        owner, monitor = curve_dealer(ctx, kc, "client", ident, kc.address, "broker")
        handshake_done(monitor)
        owner.send_multipart(control(MsgType.HELLO, {"host": "o", "pid": 3, "name": "owner"}))
        assert owner.poll(5000), "the owner got no map"
        owner.close(0)
        thief, monitor = curve_dealer(ctx, kc, "hostile", ident, kc.address, "broker")
        handshake_done(monitor)
        # The broker probes every client each heartbeat interval (0.1 s), the owner
        # among them until it is declared dead (after 2 s).
        assert ident.decode() in {x["node"] for x in kc.status()["clients"]}
        assert not thief.poll(1000), "the thief received a message meant for the owner"
    finally:
        ctx.destroy(0)


def test_a_clients_identity_and_sequence_numbers_stay_its_keys(kc: KeyCluster) -> None:
    """After a client left (the broker forgot it), another key presents its identity and
    its next sequence number: refused, so the dedup record stays the client's own."""
    with zps.connect_sync(kc.address, kc.client_config()) as ps:
        ps.create_dense("seq", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
        ident = ps.client.client_id
    assert ident.startswith(key_identity(b"c-", kc.public("client"), b""))
    kc.wait_for(lambda s: ident.decode() not in {x["node"] for x in s["clients"]}, 10, "the BYE")
    epoch = kc.status()["partitions"][0]["epoch"]
    enc = Encoder()
    op = {"op": "push_dense", "t": "seq", "chunk": 0, "g": enc.array(np.ones(2))}
    header = {"cid": ident, "seq": 10**6, "ops": [op]}
    frames = [bytes(f) for f in enc.build(Route(MsgType.REQUEST, 0, epoch, 91), header)]
    ctx = zmq.Context()
    try:
        thief, monitor = curve_dealer(ctx, kc, "hostile", ident, kc.address, "broker")
        handshake_done(monitor)
        thief.send_multipart(frames)
        assert not thief.poll(1000), "the request was answered"
        assert wait_lines(kc, rf"the broker refused {ident.decode()} .*belongs to another key")
    finally:
        ctx.destroy(0)
    with zps.connect_sync(kc.address, kc.client_config()) as ps:
        np.testing.assert_array_equal(ps.pull_dense("seq"), [0.0, 0.0])  # nothing applied


def ask(kc: KeyCluster, key: str, request: StatusRequest) -> dict[str, Any]:
    async def call() -> dict[str, Any]:
        async with zps.connect(kc.address, kc.client_config(key)) as ps:
            return dict(await ps.status(request))

    return asyncio.run(call())


def test_commands_that_change_the_cluster_need_an_operator_key(kc: KeyCluster) -> None:
    status = kc.status()  # reading the status report stays open to a client key
    replica = next(s["node"] for s in status["shards"] if s["role"] == "replica")
    hostile = kc.public("hostile").decode()
    for request, field in (
        (StatusRequest(drain=replica), "drain"),
        (StatusRequest(reset_partition=0, accept_data_loss=True), "reset"),
        (StatusRequest(scale=2), "scale"),
    ):
        report = ask(kc, "hostile", request)
        assert not report[field]["ok"], report[field]
        assert report[field]["msg"].startswith("refused by role"), report[field]
    assert wait_lines(kc, rf"WARNING.*the broker refused .*key {re.escape(hostile)}.*operator")
    with zps.connect_sync(kc.address, kc.client_config("hostile")) as ps:
        ps.create_dense("keep", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
        with pytest.raises(BadRequestError, match="refused by role: the 'drop' operation"):
            ps.drop_table("keep")
        with pytest.raises(BadRequestError, match="refused by role: the 'checkpoint'"):
            ps.checkpoint(timeout=5)
        assert "keep" in ps.list_tables()
        ps.create_job("job", n_records=10, per_task=5)  # a client key creates and runs jobs
        for change in (ps.cancel_job, ps.reset_job):
            with pytest.raises(BadRequestError, match=r"refused by role: (cancel|reset) of job"):
                change("job")
        assert ps.job("job")["state"] != "cancelled"
    status = kc.status()
    assert kc.healthy(status) and not any(s.get("drained") for s in status["shards"]), status
    # An operator key gets through (the partition has a primary: nothing to reset).
    report = ask(kc, "operator", StatusRequest(reset_partition=0, accept_data_loss=True))
    assert not report["reset"]["ok"] and "nothing to reset" in report["reset"]["msg"]
    with zps.connect_sync(kc.address, kc.client_config("operator")) as ps:
        assert ps.drop_table("keep")
        assert ps.cancel_job("job")["state"] == "cancelled"


def test_refusals_are_logged_once_a_minute_per_peer_and_key_and_counted(
    kc: KeyCluster,
) -> None:
    before = kc.refusals("identity_of_another_key")
    ident = key_identity(b"c-", kc.public("client"), b"flood")
    ctx = zmq.Context()
    try:
        thief, monitor = curve_dealer(ctx, kc, "hostile", ident, kc.address, "broker")
        handshake_done(monitor)
        for _ in range(30):
            thief.send_multipart(control(MsgType.HEARTBEAT, {}))
        deadline = time.monotonic() + 10
        while kc.refusals("identity_of_another_key") < before + 30:
            assert time.monotonic() < deadline, kc.refusals("identity_of_another_key")
            time.sleep(0.05)
    finally:
        ctx.destroy(0)
    assert len(broker_lines(kc, rf"the broker refused {ident.decode()} ")) == 1
    # A peer with no CURVE key at all: refused at the handshake, logged with its reason.
    ctx = zmq.Context()
    try:
        sock = dealer(ctx, kc.address, b"c-plain")
        sock.send_multipart(control(MsgType.HELLO, {"host": "p", "pid": 1}))
        # the peer's address is unknown there: the line names the endpoint it reached
        assert wait_lines(
            kc, rf"WARNING.*the broker refused a peer connecting to {kc.address} .*no CURVE key"
        )
        assert kc.refusals("no_key") >= 1
    finally:
        ctx.destroy(0)


def test_a_replicas_identity_is_not_handed_to_another_shard_key(kc: KeyCluster) -> None:
    """A shard key reaching a primary's replication endpoint as its replica (which would
    let it acknowledge writes the replica never got) gets nothing of the stream."""
    status = kc.status()
    primary = next(s for s in status["shards"] if s["role"] == "primary")
    replica = next(s for s in status["shards"] if s["role"] == "replica")
    primary_key = "shard0" if primary["node"] == "s-alpha" else "shard1"
    ctx = zmq.Context()
    try:
        rogue, monitor = curve_dealer(
            ctx, kc, "rogue", replica["node"].encode(), primary["address"], primary_key
        )
        handshake_done(monitor)
        head = {"partition": 0, "epoch": primary["epoch"]}
        rogue.send_multipart(control(MsgType.SUBSCRIBE, {**head, "lsn": 0}))
        rogue.send_multipart(control(MsgType.ACK, {**head, "lsn": 10**9}))
        with zps.connect_sync(kc.address, kc.client_config()) as ps:
            ps.create_dense("acked", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
            for _ in range(5):
                ps.push_dense("acked", np.ones(2))
        assert not rogue.poll(500), "the rogue received the replica's stream"
    finally:
        ctx.destroy(0)
    status = kc.wait_healthy(10)
    assert {s["node"] for s in status["shards"]} == {"s-alpha", "s-beta"}
    # A client key is refused at the handshake there, and the primary logs it.
    ctx = zmq.Context()
    try:
        # (kept referenced: a collected socket would close mid-handshake)
        stranger, _ = curve_dealer(ctx, kc, "hostile", b"s-beta", primary["address"], primary_key)
        log = kc.proc_by_pid(primary["pid"])
        deadline = time.monotonic() + 10
        pattern = r"WARNING.*the replication endpoint refused .*no allow-list"
        while not re.search(pattern, log.log()):
            assert time.monotonic() < deadline, (log.name, log.log()[-2000:])
            time.sleep(0.05)
        assert not stranger.poll(0)
    finally:
        ctx.destroy(0)


def test_a_shard_name_outlives_its_key(kc: KeyCluster) -> None:
    """Once a key registered a shard name, no other shard key may take it, even after
    that shard was declared dead; its own key may."""
    first = kc.start_shard_process("delta", "rogue")
    kc.wait_for(lambda s: "s-delta" in {x["node"] for x in s["shards"]}, 20, "s-delta")
    first.popen.send_signal(signal.SIGKILL)
    first.popen.wait(10)
    kc.wait_gone(first.pid)
    usurper = kc.start_shard_process("delta", "shard1")
    try:
        deadline = time.monotonic() + 20
        while not broker_lines(kc, r"the broker refused s-delta .*belongs to another key"):
            shards = {x["node"] for x in kc.status()["shards"]}
            assert "s-delta" not in shards, "another shard key took the name"
            assert time.monotonic() < deadline, usurper.log()
            time.sleep(0.05)
        assert "s-delta" not in {x["node"] for x in kc.status()["shards"]}
    finally:
        usurper.popen.kill()
        usurper.popen.wait(10)
    again = kc.start_shard_process("delta", "rogue")
    try:
        kc.wait_for(lambda s: "s-delta" in {x["node"] for x in s["shards"]}, 20, "s-delta back")
    finally:
        again.popen.terminate()
        again.popen.wait(10)
    kc.wait_gone(again.pid)


def test_a_client_gets_its_identity_back_after_the_broker_restarts(kc: KeyCluster) -> None:
    """No connection takes an identity in use, and the legitimate one still comes back:
    the broker is killed and started again, and the same client goes on with its id.
    (A guard for the rule above: it held before identities were bound to keys too.)"""
    with zps.connect_sync(kc.address, kc.client_config(timeout=20.0)) as ps:
        ident = ps.client.client_id.decode()
        broker = kc.broker()
        broker.popen.send_signal(signal.SIGKILL)
        broker.popen.wait(10)
        kc.start_broker_process("broker2")
        kc.wait_healthy(30)
        ps.create_dense("back", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.push_dense("back", np.ones(2))
        np.testing.assert_array_equal(ps.pull_dense("back"), [-1.0, -1.0])
        assert ident in {x["node"] for x in kc.status()["clients"]}


class Zmtp:
    """The ZMTP 3 commands one direction of a connection carried, by name and time of
    relay.  Under CURVE the handshake ends with READY and every message (a ZMTP ping
    too) goes as a MESSAGE (a frame that starts with that command's name)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.greeted = False
        self.commands: list[tuple[bytes, float]] = []

    def feed(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.greeted:
            if len(buf) < 64:
                return
            del buf[:64]
            self.greeted = True
        while len(buf) >= 2:
            flags = buf[0]
            head = 9 if flags & 0x02 else 2
            if len(buf) < head:
                return
            size = int.from_bytes(buf[1:9], "big") if flags & 0x02 else buf[1]
            if len(buf) < head + size:
                return
            if size and (flags & 0x04 or buf[head : head + 8] == b"\x07MESSAGE"):
                name = bytes(buf[head + 1 : head + 1 + buf[head]])
                self.commands.append((name, time.monotonic()))
            del buf[: head + size]

    def first(self, name: bytes) -> float | None:
        return next((t for n, t in self.commands if n == name), None)


class HalfOpenProxy:
    """A TCP relay to ``upstream``: ``cut()`` closes the client side of every relayed
    connection but holds the server side open and silent, as a dead network path
    that only one end has noticed; ``freeze()`` holds both sides open and silent.
    What each connection carried each way, as ZMTP commands: ``zmtp[i]`` (the i-th
    accepted) ``["up"]`` (to ``upstream``), ``["down"]``."""

    def __init__(
        self, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0)
    ) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(listen)
        self.port = self.listener.getsockname()[1]
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.bytes: dict[socket.socket, int] = {}  # relayed, by the pair's client side
        self.held: list[socket.socket] = []
        self.lock = threading.Lock()
        self.stopped = False
        self.accepted = 0  # connections relayed so far
        self.zmtp: list[dict[str, Zmtp]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream)
            except OSError:  # nothing listens there yet: the peer connects again
                down.close()
                continue
            zmtp = {"up": Zmtp(), "down": Zmtp()}
            with self.lock:
                self.pairs.append((down, up))
                self.zmtp.append(zmtp)
                self.accepted += 1
            threading.Thread(target=self._pump, args=(down, up, zmtp), daemon=True).start()

    def _pump(self, down: socket.socket, up: socket.socket, zmtp: dict[str, Zmtp]) -> None:
        socks = [down, up]
        try:
            while not self.stopped:
                with self.lock:
                    if (down, up) not in self.pairs:
                        return  # cut: the server side is held, silent
                ready, _, _ = select.select(socks, [], [], 0.05)
                for r in ready:
                    data = r.recv(65536)
                    if not data:
                        return
                    (up if r is down else down).sendall(data)
                    zmtp["up" if r is down else "down"].feed(data)
                    with self.lock:
                        self.bytes[down] = self.bytes.get(down, 0) + len(data)
        except OSError:
            return

    def cut(self, busiest: bool = False) -> None:
        """Cut every relayed connection (``busiest``: the one that relayed the most)."""
        with self.lock:
            top = max(self.pairs, key=lambda p: self.bytes.get(p[0], 0)) if busiest else None
            cut = [top] if top is not None else self.pairs
            self.pairs = [p for p in self.pairs if p not in cut]
        for down, up in cut:
            down.close()
            self.held.append(up)

    def freeze(self) -> None:
        """Stop relaying every connection relayed so far, holding both sides open and
        silent: a path that died with neither end told.  Later connections are relayed."""
        with self.lock:
            frozen, self.pairs = self.pairs, []
        for down, up in frozen:
            self.held += [down, up]

    def close(self) -> None:
        self.stopped = True
        self.listener.close()
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for down, up in pairs:
            down.close()
            up.close()
        for up in self.held:
            up.close()


def test_a_client_whose_connection_half_died_is_heard_again(kc: KeyCluster) -> None:
    """The client's side of its connection closes while the broker still holds the
    other side: the client connects again at once, its new connection has a routing id
    of its own (no connection takes one in use), and the broker hears it there, long
    before it closes the dead one or would declare the client dead (liveness 2 s)."""
    proxy = HalfOpenProxy(("127.0.0.1", kc.port))
    try:
        cfg = kc.client_config(timeout=30.0)
        with zps.connect_sync(f"tcp://127.0.0.1:{proxy.port}", cfg) as ps:
            ps.create_dense("half", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
            ident = ps.client.client_id.decode()
            proxy.cut()
            deadline = time.monotonic() + 10
            while proxy.accepted < 2:  # its new connection (a request sent before may be lost)
                assert time.monotonic() < deadline, proxy.accepted
                time.sleep(0.01)
            start = time.monotonic()
            ps.push_dense("half", np.ones(2))
            np.testing.assert_array_equal(ps.pull_dense("half"), [-1.0, -1.0])
            assert time.monotonic() - start < 2.0
        assert not broker_lines(kc, rf"client {ident} missed its heartbeats")
    finally:
        proxy.close()


def test_a_shard_whose_data_link_half_died_serves_again(kc: KeyCluster, tmp_path: Path) -> None:
    """A shard's data link (its first connection) dies on the shard's side only, while
    its liveness link lives on: the shard connects again at once, under a new routing
    id, and speaks there as soon as the handshake is done, so the broker sends it
    everything there from then on: the first request after it is answered."""
    assert kc.workdir is not None
    for directory in ("clients", "shards", "operators"):
        shutil.copytree(kc.workdir / directory, tmp_path / directory)
    c = KeyCluster(partitions=1, replication=1, liveness=20, workdir=tmp_path)
    c.keys, c.port, c.metrics_port = kc.keys, free_port(), free_port()
    proxy = HalfOpenProxy(("127.0.0.1", c.port))
    try:
        c.start_broker_process()
        c.start_shard_process("solo", "shard0", broker=f"tcp://127.0.0.1:{proxy.port}")
        c.wait_healthy(30)
        cfg = c.client_config(timeout=3.0)
        with zps.connect_sync(c.address, cfg) as ps:
            ps.create_dense("solo", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
            ps.create_dense("big", shape=(1 << 17,), dtype="float64", optimizer=SGD(lr=1.0))
            ps.push_dense("big", np.ones(1 << 17))  # 1 MiB through the data link
            assert proxy.accepted == 2  # the data link and the liveness link
            proxy.cut(busiest=True)
            # Its new connection: the handshake is done once the broker's READY went
            # by, and the shard speaks there (a MESSAGE to the broker) at once.  The
            # broker holds the dead connection meanwhile (until its pings go unanswered
            # for 1.5 s).
            deadline = time.monotonic() + 10
            while proxy.accepted < 3 or proxy.zmtp[2]["up"].first(b"MESSAGE") is None:
                assert time.monotonic() < deadline, [z["up"].commands[:8] for z in proxy.zmtp]
                time.sleep(0.005)
            new = proxy.zmtp[2]
            ready, spoke = new["down"].first(b"READY"), new["up"].first(b"MESSAGE")
            assert ready is not None and spoke is not None
            # Not the answer to the broker's first ZMTP ping (0.5 s) or the shard's own
            # (1 s): its word, sent as the handshake succeeded.
            assert spoke - ready < 0.4, new["up"].commands
            np.testing.assert_array_equal(ps.pull_dense("solo"), [0.0, 0.0])  # the first
            assert proxy.accepted == 3
            ps.push_dense("solo", np.ones(2))
            np.testing.assert_array_equal(ps.pull_dense("solo"), [-1.0, -1.0])
        assert "s-solo" in {s["node"] for s in c.status()["shards"]}
    finally:
        proxy.close()
        c.stop()


def test_a_routing_broker_under_curve(kc: KeyCluster, tmp_path: Path) -> None:
    """A routing broker applies the broker's rules (a client key's drop is refused by
    role there too), and routes to a restarted shard again: the shard's heartbeat on its
    new link is the word that lets the router send to its identity."""
    assert kc.workdir is not None
    for directory in ("clients", "shards", "operators"):
        shutil.copytree(kc.workdir / directory, tmp_path / directory)
    # A router serves with the broker's key pair (the one its clients and shards know),
    # and is a client of the broker with it.
    shutil.copy(kc.keys / "broker.key", tmp_path / "clients" / "router.key")
    c = KeyCluster(partitions=1, replication=1, liveness=20, workdir=tmp_path)
    c.keys, c.port, c.metrics_port = kc.keys, free_port(), free_port()
    router = f"tcp://127.0.0.1:{free_port()}"
    try:
        c.start_broker_process()
        shard = c.start_shard_process("solo", "shard0", data_dir=tmp_path / "solo")
        c.start_role(
            "router",
            "broker",
            f'[broker]\nbind = "{router}"\nfollow = "{c.address}"\n{c.hb()}{c.security("broker")}',
        )

        def routed(s: dict[str, Any]) -> bool:
            return c.healthy(s) and any(0 in r["partitions"] for r in s["routers"])

        c.wait_for(routed, 30, "the router to route partition 0")
        cfg = c.client_config("hostile", timeout=20.0)
        with zps.connect_sync(c.address, cfg) as ps:
            ps.create_dense("via", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
            ps.push_dense("via", np.ones(2))
            np.testing.assert_array_equal(ps.pull_dense("via"), [-1.0, -1.0])
            # Until the router routes them (it may refuse the partition's first requests
            # with a bypass while it settles), the client's requests go to the broker.
            through_router(router, cfg, lambda: ps.pull_dense("via"))
            with pytest.raises(BadRequestError, match="refused by role: the 'drop'"):
                ps.drop_table("via")
        log = next(p for p in c.procs if p.name == "router").log()
        assert re.search(r"the routing broker refused c-\S+ .*role may not do this", log), log
        before = router_routed(router, cfg)
        shard.popen.terminate()  # a checkpoint, then the same name and key again
        assert shard.popen.wait(20) == 0, shard.log()
        c.start_shard_process("solo", "shard0", data_dir=tmp_path / "solo")
        c.wait_for(routed, 30, "the router to route partition 0 again")
        with zps.connect_sync(c.address, cfg) as ps:
            ps.push_dense("via", np.ones(2))
            np.testing.assert_array_equal(ps.pull_dense("via"), [-2.0, -2.0])
            # The map lists the router before it has heard the new shard on its link:
            # until then it sends the requests back to the broker, as at the start.
            through_router(router, cfg, lambda: ps.pull_dense("via"), past=before)
    finally:
        c.stop()


def through_router(
    endpoint: str, cfg: ClientConfig, request: Callable[[], object], past: int = 0
) -> None:
    """Make ``request`` until the routing broker at ``endpoint`` has routed more than
    ``past`` requests (20 s at most)."""
    deadline = time.monotonic() + 20
    while router_routed(endpoint, cfg) <= past:
        assert time.monotonic() < deadline, f"no request went through {endpoint}"
        request()


def router_routed(endpoint: str, cfg: ClientConfig) -> int:
    """Requests the routing broker at ``endpoint`` routed (from its own report)."""

    async def ask() -> int:
        async with zps.connect(endpoint, cfg) as ps:
            reply = await ps.status()
        return int(reply["router"]["routed"])

    return asyncio.run(ask())


def test_a_shard_name_stays_bound_across_broker_restarts(kc: KeyCluster) -> None:
    """The broker restarted from its data dir (the test above) still binds s-delta to
    the key that first registered it."""
    usurper = kc.start_shard_process("delta", "shard0")
    try:
        deadline = time.monotonic() + 20
        while not broker_lines(kc, r"the broker refused s-delta .*belongs to another key"):
            shards = {x["node"] for x in kc.status()["shards"]}
            assert "s-delta" not in shards, "another shard key took the name"
            assert time.monotonic() < deadline, usurper.log()
            time.sleep(0.05)
    finally:
        usurper.popen.kill()
        usurper.popen.wait(10)


def test_the_routers_identity_table_keeps_live_bindings() -> None:
    """The routing broker's table of shard identities is bounded, and a flood of new
    names never evicts a binding heard recently: the new name is refused instead."""
    from zps.broker import router as router_mod
    from zps.ops.config import BrokerConfig

    keys = router_mod.Router(BrokerConfig(follow="tcp://127.0.0.1:1")).shard_keys
    limit = router_mod.MAX_BOUND
    now = 1000.0
    assert keys.bind(b"s-victim", b"K" * 40, now)
    for i in range(limit - 1):
        assert keys.bind(b"s-flood-%d" % i, b"F" * 40, now)
    assert not keys.bind(b"s-one-more", b"F" * 40, now + 1)  # all live: refused
    assert keys.key_of(b"s-victim") == b"K" * 40 and keys.key_of(b"s-one-more") is None
    later = now + router_mod.BOUND_IDLE_S + 1
    assert keys.bind(b"s-victim", b"K" * 40, later)  # heard again: most recent
    assert keys.bind(b"s-one-more", b"F" * 40, later)  # the oldest idle one went
    assert b"s-victim" in keys and b"s-flood-0" not in keys and len(keys) == limit


class _Quiet:
    """A LinkPolicy that sends nothing of its own."""

    def posted(self, frames: list[bytes], now: float) -> list[bytes] | None:
        return frames

    def due(self, now: float) -> float:
        return math.inf

    def tick(self, now: float) -> list[bytes] | None:
        return None


def test_silent_curve_links_connect_again() -> None:
    """A CURVE client's link (a Channel, and a LinkThread: a shard's liveness link) that
    hears nothing for its silence makes its connection again: the server sees a second
    connection come in."""
    from zps import transport
    from zps.transport import CurveKeys

    async def run() -> None:
        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        ctx = transport.new_context()
        server_keys = CurveKeys(server_public, server_secret, None, None)
        client_keys = CurveKeys(public, secret, server_public, None)
        auth = transport.start_authenticator(ctx, None)
        server, endpoint = transport.router(
            ctx, "tcp://127.0.0.1:0", max_message_bytes=1 << 20, curve=server_keys
        )
        accepted: asyncio.Queue[int] = asyncio.Queue()
        server.sock.monitor("inproc://accepted", zmq.EVENT_ACCEPTED)
        monitor: zmq.Socket[Any] = zmq.Socket(ctx, zmq.PAIR)
        monitor.connect("inproc://accepted")
        loop = asyncio.get_running_loop()

        def read() -> None:
            while int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                monitor.recv_multipart()
                accepted.put_nowait(1)

        loop.add_reader(monitor.FD, read)
        loop.call_soon(read)
        link = transport.LinkThread(
            ctx,
            [endpoint],
            key_identity(b"c-", public, b"link"),
            policy=_Quiet(),
            deliver=lambda i, frames: None,
            max_message_bytes=1 << 20,
            curve=client_keys,
            server_public=server_public,
            silence=0.5,
        )
        channel = transport.dealer(
            ctx,
            endpoint,
            key_identity(b"c-", public, b"chan"),
            max_message_bytes=1 << 20,
            curve=client_keys,
            server_public=server_public,
            silence=0.5,
        )
        link.start()
        try:
            # Each connects, then again after its silence: the server accepts each.
            count, deadline = 0, loop.time() + 10
            while not (count >= 4 and link.reconnects and channel.reconnects):
                await asyncio.wait_for(accepted.get(), deadline - loop.time())
                count += 1
        finally:
            loop.remove_reader(monitor.FD)
            link.stop()
            transport.close(channel)
            server.sock.disable_monitor()
            monitor.close(0)
            transport.close(server)
            auth.stop()
            transport.term(ctx)

    asyncio.run(run())
