"""CURVE, with real processes: keys from `zps-server keygen`, settings from TOML files.

The broker and both shards' replication endpoints are CURVE servers with a ZAP
allow-list; an allowed client works, everyone else gets no answer at all.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.client.sync import SyncClient
from zps.errors import ZpsTimeoutError
from zps.ops.config import ClientConfig, Security
from zps.optim import SGD
from zps.testing import LocalCluster, Proc, free_port

NAMES = ["broker", "shard0", "shard1", "client", "stranger"]


def q(path: Path) -> str:
    """A TOML string."""
    return json.dumps(str(path))


class SecureCluster(LocalCluster):
    """Broker and shards configured by TOML files with [security]."""

    keys: Path
    allowed: Path
    admin: Security  # the allowed client's keys, for status polling

    def status_client(self, timeout: float) -> SyncClient:
        cfg = ClientConfig(
            connect_timeout=timeout, timeout=timeout, name="zps.testing", security=self.admin
        )
        return zps.connect_sync(self.address, cfg)

    def start_with_config(self, name: str, role: str, toml: str) -> Proc:
        assert self.workdir is not None
        path = self.workdir / f"{name}.toml"
        path.write_text(toml)
        return self.spawn(name, [self.python, "-m", "zps", role, "--config", str(path)])

    def shard_toml(self, key: str) -> str:
        return f"""
[shard]
broker = "{self.address}"
replication_bind = "tcp://127.0.0.1:0"
advertise_host = "127.0.0.1"

[heartbeat]
interval = {self.heartbeat_interval}
liveness = {self.liveness}

[security]
curve_secret_key_file = {q(self.keys / f"{key}.key_secret")}
curve_public_key_file = {q(self.keys / f"{key}.key")}
broker_public_key_file = {q(self.keys / "broker.key")}
allowed_clients_dir = {q(self.allowed)}
"""


def client_security(keys: Path, name: str, server: str = "broker") -> Security:
    return Security(
        curve_secret_key_file=str(keys / f"{name}.key_secret"),
        curve_public_key_file=str(keys / f"{name}.key"),
        broker_public_key_file=str(keys / f"{server}.key"),
    )


def keygen(out: Path, name: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "zps", "keygen", "--out", str(out), "--name", name, "--parents"],
        capture_output=True,
        text=True,
        timeout=60,
        env=LocalCluster().env(),
    )
    assert res.returncode == 0, res.stderr
    assert (out / f"{name}.key").is_file() and (out / f"{name}.key_secret").is_file()
    assert (out / f"{name}.key_secret").stat().st_mode & 0o077 == 0  # secret: 0600


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    """A broker and 1 partition x 2 copies, all CURVE; a stranger's keys exist too."""
    work = tmp_path_factory.mktemp("curve")
    keys, allowed = work / "keys", work / "allowed"
    for name in NAMES:
        keygen(keys, name)
    allowed.mkdir()
    for name in ["shard0", "shard1", "client"]:  # every peer the broker must admit
        shutil.copy(keys / f"{name}.key", allowed / f"{name}.key")

    c = SecureCluster(partitions=1, replication=2, liveness=20, workdir=work)  # 2 s: no fake deaths
    c.keys, c.allowed = keys, allowed
    c.admin = client_security(keys, "client")
    c.port = free_port()
    try:
        c.start_with_config(
            "broker",
            "broker",
            f"""
[broker]
bind = "{c.address}"
partitions = 1
replication = 2
startup_grace = 0

[heartbeat]
interval = {c.heartbeat_interval}
liveness = {c.liveness}

[security]
curve_secret_key_file = {q(keys / "broker.key_secret")}
curve_public_key_file = {q(keys / "broker.key")}
allowed_clients_dir = {q(allowed)}
""",
        )
        for i in range(2):
            c.start_with_config(f"shard{i}", "shard", c.shard_toml(f"shard{i}"))
        c.wait_healthy(30)  # the replica subscribed over CURVE and is in sync
        yield c
    finally:
        c.stop()


def test_allowed_client_creates_pushes_and_pulls(secure: SecureCluster) -> None:
    cfg = ClientConfig(security=secure.admin, connect_timeout=5, timeout=10)
    ids = np.array([1, 5, 5, 900])
    with zps.connect_sync(secure.address, cfg) as ps:
        ps.create_dense("d", shape=(6,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.create_embedding("e", dim=3, dtype="float64", optimizer=SGD(lr=0.5))
        ps.push_dense("d", np.arange(6.0))
        ps.push_rows("e", ids, np.ones((4, 3)))
        np.testing.assert_array_equal(ps.pull_dense("d"), -np.arange(6.0))
        np.testing.assert_array_equal(
            ps.pull_rows("e", ids), [[-0.5] * 3, [-1.0] * 3, [-1.0] * 3, [-0.5] * 3]
        )
    # the replica (reached over CURVE, at the primary's replication endpoint) caught up
    status = secure.wait_for(
        lambda s: secure.healthy(s) and s["partitions"][0]["replicas"][0]["lag"] == 0,
        10,
        "the replica to apply every write",
    )
    shards = {s["role"] for s in status["shards"]}
    assert shards == {"primary", "replica"}


@pytest.mark.parametrize(
    "who",
    ["no keys", "a key not in the allow-list", "the wrong broker key"],
)
def test_other_clients_are_refused_and_the_broker_keeps_serving(
    secure: SecureCluster, who: str
) -> None:
    security = {
        "no keys": Security(),
        "a key not in the allow-list": client_security(secure.keys, "stranger"),
        "the wrong broker key": client_security(secure.keys, "client", server="stranger"),
    }[who]
    # The client's error tells a refused handshake from no answer at all; the broker
    # logs each refusal with its reason.
    error, logged = {
        "no keys": (
            r"no answer from the broker .* without CURVE\? A broker with CURVE does not answer",
            "no CURVE key",
        ),
        "a key not in the allow-list": (
            "handshake refused: .* refused this process's key",
            "its key is in no allow-list",
        ),
        "the wrong broker key": ("handshake refused: .* failed the CURVE handshake", None),
    }[who]
    cfg = ClientConfig(security=security, connect_timeout=1.0, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(ZpsTimeoutError, match=error):
        zps.connect_sync(secure.address, cfg)
    assert time.monotonic() - t0 < 1.0 + 2.0  # within the connect timeout (+ closing)
    if logged is not None:
        broker = next(p for p in secure.procs if p.name == "broker")
        assert re.search(rf"WARNING.*the broker refused .*{logged}", broker.log()), broker.log()

    good = ClientConfig(security=secure.admin, connect_timeout=5, timeout=10)
    name = f"after-{who.replace(' ', '-')}"
    with zps.connect_sync(secure.address, good) as ps:
        ps.create_dense(name, shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.push_dense(name, np.ones(2))
        np.testing.assert_array_equal(ps.pull_dense(name), [-1.0, -1.0])
    status = secure.status()
    assert not any("stranger" in (c.get("name") or "") for c in status["clients"])


def test_a_shard_whose_key_is_not_allowed_never_joins(secure: SecureCluster) -> None:
    intruder = secure.start_with_config("intruder", "shard", secure.shard_toml("stranger"))
    try:
        # The intruder would register at once (zmq reconnects every 100 ms) if its
        # handshake were accepted; nothing to wait for but time: watch it for 1.5 s.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            status = secure.status()
            assert intruder.pid not in {s["pid"] for s in status["shards"]}, status
            assert intruder.alive(), intruder.log()
            time.sleep(0.1)
        assert len(status["shards"]) == 2
        secure.wait_healthy(5)
    finally:
        intruder.popen.kill()
        intruder.popen.wait(10)


def test_a_refused_shard_still_stops_on_sigterm(secure: SecureCluster) -> None:
    intruder = secure.start_with_config("intruder2", "shard", secure.shard_toml("stranger"))
    try:
        deadline = time.monotonic() + 20
        while "connecting to" not in intruder.log():
            assert time.monotonic() < deadline and intruder.alive(), intruder.log()
            time.sleep(0.05)
        time.sleep(1.0)  # its handshake has been refused by now (nothing observable)
        intruder.popen.terminate()
        assert intruder.popen.wait(5) == 0, intruder.log()
    finally:
        if intruder.alive():
            intruder.popen.kill()
            intruder.popen.wait(10)


def test_status_cli_with_the_client_keys_in_a_config_file(
    secure: SecureCluster, tmp_path: Path
) -> None:
    toml = tmp_path / "client.toml"
    toml.write_text(
        f"""
[worker]
broker = "{secure.address}"

[security]
curve_secret_key_file = {q(secure.keys / "client.key_secret")}
curve_public_key_file = {q(secure.keys / "client.key")}
broker_public_key_file = {q(secure.keys / "broker.key")}
"""
    )
    env = LocalCluster().env()
    env.pop("ZPS_CONFIG", None)
    ok = subprocess.run(
        [sys.executable, "-m", "zps", "status", "--json", "--config", str(toml)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["n_partitions"] == 1
    plain = subprocess.run(
        [sys.executable, "-m", "zps", "status", "--broker", secure.address, "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert plain.returncode == 1
    assert "no answer from the broker" in plain.stderr


# -- is it really encrypted? --------------------------------------------------------


class LoopbackSniffer:
    """Every packet on ``lo`` while running (an AF_PACKET socket: root only)."""

    def __init__(self) -> None:
        try:
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))
            self.sock.bind(("lo", 0))
        except (AttributeError, OSError) as e:
            pytest.skip(f"cannot capture loopback packets (AF_PACKET on lo: {e})")
        self.sock.settimeout(0.05)
        self.packets: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.packets.append(self.sock.recv(1 << 16))
            except TimeoutError:
                continue

    def __enter__(self) -> LoopbackSniffer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def on(self, ports: set[int]) -> list[bytes]:
        """Captured IPv4 TCP packets from or to one of ``ports`` (other processes on
        this machine may be talking on loopback at the same time)."""
        out = []
        for pkt in self.packets:
            ip_hdr = pkt[14:]  # lo frames carry a zeroed 14-byte Ethernet header
            if len(ip_hdr) < 20 or ip_hdr[0] >> 4 != 4 or ip_hdr[9] != socket.IPPROTO_TCP:
                continue
            tcp = ip_hdr[(ip_hdr[0] & 0x0F) * 4 :]
            if len(tcp) >= 4 and {int.from_bytes(tcp[0:2]), int.from_bytes(tcp[2:4])} & ports:
                out.append(pkt)
        return out


def cluster_ports(c: LocalCluster) -> set[int]:
    """The broker's port and every shard's replication port."""
    shards = c.status()["shards"]
    return {c.port} | {int(s["address"].rsplit(":", 1)[1]) for s in shards}


def traffic(address: str, cfg: ClientConfig, marker: str) -> None:
    with zps.connect_sync(address, cfg) as ps:
        ps.create_dense(marker, shape=(8,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.push_dense(marker, np.ones(8))
        ps.pull_dense(marker)


def test_traffic_on_the_wire_is_encrypted(secure: SecureCluster) -> None:
    """The table and op names travel in every request header: they must not show on
    loopback.  A control run against a plain cluster proves the sniffer would see them."""
    plain_marker = f"zps-plaintext-marker-{time.monotonic_ns()}".encode()
    with LocalCluster(partitions=1, shards=1) as plain:
        ports = cluster_ports(plain)
        with LoopbackSniffer() as sniff:
            traffic(plain.address, ClientConfig(timeout=10), plain_marker.decode())
    mine = sniff.on(ports)
    assert any(plain_marker in p for p in mine), "control: the marker was not captured"
    assert any(b"push_dense" in p for p in mine)

    secret_marker = f"zps-curve-marker-{time.monotonic_ns()}".encode()
    ports = cluster_ports(secure)
    assert len(ports) == 3  # broker, and both shards' replication endpoints
    with LoopbackSniffer() as sniff:
        # acks="all": the write is acknowledged only after the replica applied it, so
        # the replication stream between the shards is in the capture too
        traffic(
            secure.address, ClientConfig(security=secure.admin, timeout=10), secret_marker.decode()
        )
    mine = sniff.on(ports)
    assert len(mine) > 10
    assert not any(secret_marker in p for p in sniff.packets)
    assert not any(b"push_dense" in p or b"pull_dense" in p for p in mine)


def test_a_request_may_carry_only_its_senders_dedup_id(secure: SecureCluster) -> None:
    """Without key roles too (no allowed_shards_dir here), CURVE binds a request's dedup
    id to its sender: the broker refuses one whose 'cid' is another identity's."""
    import msgpack
    import zmq
    import zmq.auth

    from zps.ops.security import key_identity
    from zps.protocol.codec import Encoder, MsgType, Route, unpack_route

    cfg = ClientConfig(security=secure.admin, connect_timeout=5, timeout=10)
    with zps.connect_sync(secure.address, cfg) as ps:
        ps.create_dense("cid", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
        victim = ps.client.client_id
    public, secret = zmq.auth.load_certificate(str(secure.keys / "client.key_secret"))
    server, _ = zmq.auth.load_certificate(str(secure.keys / "broker.key"))
    assert public is not None and secret is not None and server is not None
    epoch = secure.status()["partitions"][0]["epoch"]
    enc = Encoder()
    op = {"op": "push_dense", "t": "cid", "chunk": 0, "g": enc.array(np.ones(2))}
    header = {"cid": victim, "seq": 10**6, "ops": [op]}
    frames = [bytes(f) for f in enc.build(Route(MsgType.REQUEST, 0, epoch, 5), header)]
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        other = key_identity(b"c-", public, b"other")
        sock.setsockopt(zmq.IDENTITY, other)
        sock.setsockopt(zmq.METADATA, b"X-Zps-Id:" + other)  # its zps id, as zps sends it
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
        sock.connect(secure.address)
        sock.send_multipart(frames)
        assert sock.poll(5000), "no answer"
        reply = sock.recv_multipart()
        assert unpack_route(reply[0]).req_id == 5
        answer = msgpack.unpackb(reply[1])
        assert answer["st"] == "BAD_REQUEST" and "'cid' must be its sender's" in answer["msg"]
    finally:
        ctx.destroy(0)
    with zps.connect_sync(secure.address, cfg) as ps:
        np.testing.assert_array_equal(ps.pull_dense("cid"), [0.0, 0.0])  # nothing applied
