"""CURVE roles, with real processes: shard keys and client keys apart, identities bound
to keys, dedup keyed by the authenticated sender.  A hostile but allowed client tries
each attack and gets nowhere; the cluster keeps serving."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

import zps
from tests.integration.wire import dealer
from zps.client.sync import SyncClient
from zps.ops.config import ClientConfig, Security
from zps.ops.security import key_identity
from zps.optim import SGD
from zps.protocol.codec import Encoder, MsgType, Route, unpack_route
from zps.testing import LocalCluster, free_port

NAMES = ["broker", "shard0", "shard1", "client", "hostile"]


def q(path: Path) -> str:
    return json.dumps(str(path))


def keygen(out: Path, name: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "zps", "keygen", "--out", str(out), "--name", name, "--parents"],
        capture_output=True,
        text=True,
        timeout=60,
        env=LocalCluster().env(),
    )
    assert res.returncode == 0, res.stderr


class RolesCluster(LocalCluster):
    keys: Path
    shard_dir: Path
    client_dir: Path

    def security(self, key: str) -> str:
        return f"""
[security]
curve_secret_key_file = {q(self.keys / f"{key}.key_secret")}
curve_public_key_file = {q(self.keys / f"{key}.key")}
broker_public_key_file = {q(self.keys / "broker.key")}
allowed_clients_dir = {q(self.client_dir)}
allowed_shards_dir = {q(self.shard_dir)}
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

    def start_role(self, name: str, role: str, toml: str) -> None:
        assert self.workdir is not None
        path = self.workdir / f"{name}.toml"
        path.write_text(toml)
        self.spawn(name, [self.python, "-m", "zps", role, "--config", str(path)])


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolesCluster]:
    work = tmp_path_factory.mktemp("roles")
    keys = work / "keys"
    for name in NAMES:
        keygen(keys, name)
    shard_dir, client_dir = work / "shards", work / "clients"
    shard_dir.mkdir()
    client_dir.mkdir()
    for name in ("shard0", "shard1"):
        shutil.copy(keys / f"{name}.key", shard_dir / f"{name}.key")
    for name in ("client", "hostile"):  # the hostile client is allowed, as a client
        shutil.copy(keys / f"{name}.key", client_dir / f"{name}.key")
    c = RolesCluster(partitions=1, replication=2, liveness=20, workdir=work)
    c.keys, c.shard_dir, c.client_dir = keys, shard_dir, client_dir
    c.port = free_port()
    hb = f"[heartbeat]\ninterval = {c.heartbeat_interval}\nliveness = {c.liveness}\n"
    try:
        c.start_role(
            "broker",
            "broker",
            f'[broker]\nbind = "{c.address}"\npartitions = 1\nreplication = 2\n'
            f"startup_grace = 0\n{hb}{c.security('broker')}",
        )
        for i in range(2):
            c.start_role(
                f"shard{i}",
                "shard",
                f'[shard]\nbroker = "{c.address}"\nreplication_bind = "tcp://127.0.0.1:0"\n'
                f'advertise_host = "127.0.0.1"\n{hb}{c.security(f"shard{i}")}',
            )
        c.wait_healthy(30)
        yield c
    finally:
        c.stop()


def curve_dealer(
    ctx: zmq.Context, c: RolesCluster, key: str, identity: bytes, address: str
) -> zmq.Socket:
    public, secret = zmq.auth.load_certificate(str(c.keys / f"{key}.key_secret"))
    server, _ = zmq.auth.load_certificate(str(c.keys / "broker.key"))
    return dealer(
        ctx,
        address,
        identity,
        CURVE_PUBLICKEY=public,
        CURVE_SECRETKEY=secret,
        CURVE_SERVERKEY=server,
        METADATA=b"X-Zps-Id:" + identity,  # its zps id, as zps's own sockets send it
    )


def tagged(c: RolesCluster, key: str, suffix: bytes) -> bytes:
    """A client identity as zps makes it under CURVE: carrying ``key``'s tag."""
    public, _ = zmq.auth.load_certificate(str(c.keys / f"{key}.key"))
    return key_identity(b"c-", public, suffix)


def control(mtype: MsgType, header: dict[str, Any], req_id: int = 0) -> list[bytes]:
    return [Route(mtype, req_id=req_id).pack(), msgpack.packb(header)]


def wait_log(c: RolesCluster, pattern: str, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        found = [x for x in c.broker().log().splitlines() if re.search(pattern, x)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_an_allowed_client_works(roles: RolesCluster) -> None:
    with zps.connect_sync(roles.address, roles.client_config()) as ps:
        ps.create_dense("ok", shape=(3,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.push_dense("ok", np.ones(3))
        np.testing.assert_array_equal(ps.pull_dense("ok"), -np.ones(3))


def test_a_client_key_cannot_act_as_a_shard(roles: RolesCluster) -> None:
    ctx = zmq.Context()
    try:
        sock = curve_dealer(ctx, roles, "hostile", b"s-evil", roles.address)
        register = {"host": "evil", "pid": 1, "address": "tcp://127.0.0.1:1", "claim": None}
        sock.send_multipart([b"", *control(MsgType.REGISTER, register)])
        assert wait_log(roles, r"the broker refused s-evil .*role may not do this")
        # it got no assignment, and the broker lists no such shard
        assert not sock.poll(300)
        status = roles.status()
        assert "s-evil" not in {s["node"] for s in status["shards"]}
        assert status["broker"]["unauthorized"] >= 1
        assert roles.healthy(status)
    finally:
        ctx.destroy(0)


def test_an_identity_stays_with_its_key(roles: RolesCluster) -> None:
    ctx = zmq.Context()
    try:
        victim_id = tagged(roles, "client", b"victim")
        victim = curve_dealer(ctx, roles, "client", victim_id, roles.address)
        victim.send_multipart(control(MsgType.HELLO, {"host": "v", "pid": 2, "name": "victim"}))
        assert victim.poll(5000), "the victim got no map"
        assert victim_id.decode() in {x["node"] for x in roles.status()["clients"]}
        # Another allowed key presents an identity of the victim's key (not connected
        # yet) and says goodbye on the victim's behalf: refused.
        other_id = tagged(roles, "client", b"victim2")
        thief = curve_dealer(ctx, roles, "hostile", other_id, roles.address)
        thief.send_multipart(control(MsgType.BYE, {}))
        assert wait_log(roles, rf"the broker refused {other_id.decode()} .*another key")
        assert victim_id.decode() in {x["node"] for x in roles.status()["clients"]}
    finally:
        ctx.destroy(0)


def test_a_client_key_cannot_reach_a_replication_endpoint(roles: RolesCluster) -> None:
    status = roles.status()
    primary = next(s for s in status["shards"] if s["role"] == "primary")
    # the primary's replication endpoint is a CURVE server with that shard's own key
    server_key = roles.keys / f"{roles.proc_by_pid(primary['pid']).name}.key"
    ctx = zmq.Context()
    try:
        public, secret = zmq.auth.load_certificate(str(roles.keys / "hostile.key_secret"))
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"s-fake-replica")
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = zmq.auth.load_certificate(str(server_key))[0]
        monitor = sock.get_monitor_socket()
        sock.connect(primary["address"])
        sock.send_multipart(
            control(MsgType.SUBSCRIBE, {"partition": 0, "epoch": primary["epoch"], "lsn": 0})
        )
        sock.send_multipart(
            control(MsgType.ACK, {"partition": 0, "epoch": primary["epoch"], "lsn": 10**9})
        )
        deadline = time.monotonic() + 10
        events = []
        while time.monotonic() < deadline and monitor.poll(
            int((deadline - time.monotonic()) * 1000)
        ):
            event = recv_monitor_message(monitor)["event"]
            events.append(event)
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                break
        assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events, events
        assert not sock.poll(200)
        sock.disable_monitor()
        monitor.close(0)
        assert roles.healthy(roles.status())
    finally:
        ctx.destroy(0)


def test_dedup_is_keyed_by_the_authenticated_sender(roles: RolesCluster) -> None:
    with zps.connect_sync(roles.address, roles.client_config()) as ps:
        ps.create_dense("dd", shape=(2,), dtype="float64", optimizer=SGD(lr=1.0))
        victim_cid = ps.client.client_id
    status = roles.status()
    epoch = status["partitions"][0]["epoch"]
    enc = Encoder()
    op = {"op": "push_dense", "t": "dd", "chunk": 0, "g": enc.array(np.ones(2))}
    # the hostile client claims another client's sequence numbers
    header = {"cid": victim_cid, "seq": 10**6, "ops": [op]}
    frames = [bytes(f) for f in enc.build(Route(MsgType.REQUEST, 0, epoch, 77), header)]
    ctx = zmq.Context()
    try:
        sock = curve_dealer(ctx, roles, "hostile", tagged(roles, "hostile", b"x"), roles.address)
        sock.send_multipart(frames)
        assert sock.poll(5000), "no answer"
        reply = sock.recv_multipart()
        assert unpack_route(reply[0]).req_id == 77
        answer = msgpack.unpackb(reply[1])
        assert answer["st"] == "BAD_REQUEST", answer
        assert "must be its sender's identity" in answer["msg"]
    finally:
        ctx.destroy(0)
    with zps.connect_sync(roles.address, roles.client_config()) as ps:
        np.testing.assert_array_equal(ps.pull_dense("dd"), [0.0, 0.0])  # nothing applied
        ps.push_dense("dd", np.ones(2))
        np.testing.assert_array_equal(ps.pull_dense("dd"), [-1.0, -1.0])


def test_a_routing_broker_with_a_key_other_than_the_brokers_refuses_to_start(
    roles: RolesCluster,
) -> None:
    """A router serves clients that check the broker's key: started with a shard host's
    key pair (its clients would fail the handshake and fall back to the broker), it exits 2
    naming the keys, before it binds."""
    assert roles.workdir is not None
    path = roles.workdir / "router.toml"
    path.write_text(
        f'[broker]\nfollow = "{roles.address}"\nbind = "tcp://127.0.0.1:{free_port()}"\n'
        + roles.security("shard0")
    )
    out = subprocess.run(
        [sys.executable, "-m", "zps", "broker", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=roles.env(),
    )
    assert out.returncode == 2, out
    assert "zps-server broker: invalid configuration: a routing broker serves with the " in (
        out.stderr
    )
    assert "security.curve_public_key_file names another key" in out.stderr


def test_a_shard_started_with_a_client_key_says_why_it_is_not_admitted(
    roles: RolesCluster,
) -> None:
    """The broker drops a shard whose key has no shard role (and logs it there); the
    shard, never admitted, says what to check rather than only waiting."""
    hb = f"[heartbeat]\ninterval = {roles.heartbeat_interval}\nliveness = 2\n"
    roles.start_role(
        "clientkeyed",
        "shard",
        f'[shard]\nbroker = "{roles.address}"\nreplication_bind = "tcp://127.0.0.1:0"\n'
        f'advertise_host = "127.0.0.1"\n{hb}{roles.security("client")}',
    )
    proc = next(p for p in roles.procs if p.name == "clientkeyed")
    try:
        deadline = time.monotonic() + 20
        while "never admitted: under CURVE" not in proc.log():
            assert proc.alive() and time.monotonic() < deadline, proc.log()
            time.sleep(0.1)
        assert "allowed_shards_dir" in proc.log()
    finally:
        roles.kill(proc.pid)
        proc.popen.wait(10)
        roles.procs.remove(proc)


def test_the_brokers_own_key_refused_is_named_so(roles: RolesCluster) -> None:
    """A peer presenting the broker's own key (its pair peer, a routing broker) that the
    allow-list lacks: the refusal says whose key it is and where it belongs."""
    ctx = zmq.Context()
    try:
        sock = curve_dealer(ctx, roles, "broker", b"c-peer", roles.address)
        sock.send_multipart(control(MsgType.HELLO, {"host": "p", "pid": 1}))
        assert wait_log(
            roles, r"its key is in no allow-list \(the broker's own key: its pair peer's"
        )
    finally:
        ctx.destroy(0)
