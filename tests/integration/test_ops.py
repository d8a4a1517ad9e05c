"""Operating a cluster: journald log priorities, health checks, versions."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
from ops_jobs import Worker

import zps
from tests.integration.wire import raw_dealer
from zps.errors import ProtocolError
from zps.optim import SGD
from zps.protocol import codec
from zps.protocol.codec import MAGIC, PROTOCOL_VERSION, ROUTE, MsgType
from zps.testing import DataDirCluster, LocalCluster, PairCluster, Proc, free_port


def get(port: int, path: str) -> tuple[int, str]:
    """Status code and body of ``GET path`` on the metrics port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zps", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=LocalCluster().env(),
    )


def wait_log(proc: Proc, pattern: str, timeout: float = 10.0) -> list[str]:
    """Lines of ``proc``'s log matching ``pattern``, once there is one (polls the file)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in proc.log().splitlines() if re.search(pattern, line)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_journald_priorities_and_partition_state_changes() -> None:
    with LocalCluster(partitions=1, shards=2, replication=2, journal=True) as c:
        broker = c.broker()
        # every line of every process under journald carries a priority prefix
        assert wait_log(broker, r"^<6>INFO zps\.broker: broker \(pid")
        for p in c.procs:
            lines = [line for line in p.log().splitlines() if line]
            assert lines and all(re.match(r"<[2-7]>", line) for line in lines), p.log()
        assert wait_log(broker, r"^<6>INFO zps\.broker: partition 0: \w+ -> ok")

        replica = next(s["pid"] for s in c.status()["shards"] if s["role"] == "replica")
        c.kill(replica)
        c.wait_for(lambda s: s["partitions"][0]["state"] == "degraded", 20, "degraded")
        assert wait_log(broker, r"^<4>WARNING zps\.broker: partition 0: ok -> degraded")

        c.kill(c.shard_pid(0))
        c.wait_for(lambda s: s["partitions"][0]["state"] == "lost", 20, "lost")
        lost = wait_log(broker, r"partition 0: .* -> lost")
        assert len(lost) == 1 and lost[0].startswith("<3>ERROR "), lost
        # logged once: the state holds, the broker keeps ticking, no repeat
        c.status()
        assert len(wait_log(broker, r"-> lost", timeout=0)) == 1


@pytest.fixture(scope="module")
def shared() -> Iterator[LocalCluster]:
    """One partition of two copies, plain logs, shared by the tests that only look at
    it (its logs, the versions in its status)."""
    with LocalCluster(partitions=1, shards=2, replication=2) as c:
        yield c


def test_plain_logs_without_journald(shared: LocalCluster) -> None:
    c = shared
    lines = wait_log(c.broker(), r"partition 0: \w+ -> ok")
    assert lines and re.match(r"\d{4}-\d\d-\d\d ", lines[0]), lines
    assert not any(line.startswith("<") for line in c.broker().log().splitlines())


def test_status_check_exit_codes() -> None:
    with LocalCluster(partitions=2, shards=4, replication=2) as c:

        def check() -> subprocess.CompletedProcess[str]:
            return run(["status", "--check", "--broker", c.address, "--timeout", "5"])

        out = check()
        assert (out.returncode, out.stdout.strip()) == (0, "OK: 2 partitions ok"), out
        replica = next(
            s["pid"] for s in c.status()["shards"] if s["role"] == "replica" and s["partition"] == 1
        )
        c.kill(replica)
        c.wait_for(lambda s: s["partitions"][1]["state"] == "degraded", 20, "degraded")
        out = check()
        assert out.returncode == 1, out
        assert out.stdout.strip() == "DEGRADED: degraded: partition 1", out
        # --json with --check: the whole report, and the verdict as the exit code
        out = run(["status", "--check", "--json", "--broker", c.address])
        assert out.returncode == 1 and '"degraded"' in out.stdout, out

        c.kill(c.shard_pid(1))
        c.wait_for(lambda s: s["partitions"][1]["state"] == "lost", 20, "lost")
        out = check()
        assert out.returncode == 2, out
        assert out.stdout.startswith("CRITICAL: lost: partition 1"), out
        # without --check the status is a report, not a verdict
        assert run(["status", "--broker", c.address]).returncode == 0

        c.kill(c.broker().pid)
        # no answer is no verdict: UNKNOWN (3), as monitoring plugins say it
        out = run(["status", "--check", "--broker", c.address, "--timeout", "0.5"])
        assert out.returncode == 3, out
        assert out.stdout.startswith(f"UNKNOWN: broker {c.address} unreachable"), out


def test_status_check_of_a_bad_config_is_unknown(tmp_path: Path) -> None:
    bad = tmp_path / "zps.toml"
    bad.write_text("[worker]\nbrokr = 1\n")
    out = run(["status", "--check", "--config", str(bad)])
    assert out.returncode == 3, out
    assert out.stdout.startswith("UNKNOWN: invalid configuration: "), out
    assert "brokr" in out.stdout, out


def test_status_check_of_a_pair_that_lost_a_broker_is_degraded() -> None:
    with PairCluster(partitions=1, shards=1) as c:

        def check() -> subprocess.CompletedProcess[str]:
            return run(["status", "--check", "--broker", c.address, "--timeout", "5"])

        c.wait_for(lambda s: (s.get("pair") or {}).get("peer", {}).get("alive"), 20, "pair")
        out = check()
        assert (out.returncode, out.stdout.strip()) == (0, "OK: 1 partition ok, broker pair up")
        primary = next(p for p in c.procs if p.name == "broker-primary")
        c.kill(primary.pid)
        c.wait_for(
            lambda s: s["pair"]["state"] == "active" and not s["pair"]["peer"]["alive"],
            20,
            "the backup active alone",
        )
        out = check()
        assert out.returncode == 1, out
        assert out.stdout.strip() == (
            f"DEGRADED: broker pair: peer tcp://127.0.0.1:{c.ports[2]} not answering "
            "(backup active alone)"
        ), out


def test_health_endpoints_of_broker_and_shard() -> None:
    bport, sport = free_port(), free_port()
    with LocalCluster(
        partitions=1,
        shards=1,
        broker_args=["--metrics-port", str(bport)],
        shard_args=["--metrics-port", str(sport)],
    ) as c:
        for port in (bport, sport):
            code, body = get(port, "/healthz")
            assert code == 200 and body.startswith("ok: the event loop turned"), body
            until(lambda port=port: get(port, "/ready")[0] == 200, 10, "ready")  # type: ignore[misc]
            code, body = get(port, "/metrics")
            assert code == 200 and "zps_build_info" in body
            assert get(port, "/metrics?x=1")[0] == 200
            for path in ("/nope", "/metricsx", "/healthz/x", "/status.jsonx"):
                assert get(port, path)[0] == 404, path
        assert get(sport, "/")[0] == get(sport, "/status.json")[0] == 404  # the broker's page
        assert get(bport, "/")[0] == get(bport, "/status.json")[0] == 200
        assert get(bport, "/ready")[1].startswith("ok: serving map v")
        assert get(sport, "/ready")[1] == "ok: primary of partition 0 at epoch 1\n"

        # Without its broker a primary loses its lease: alive, no longer ready.
        c.kill(c.broker().pid)
        until(lambda: get(sport, "/ready")[0] == 503, 10, "the shard to be unready")
        assert "without a lease" in get(sport, "/ready")[1]
        assert get(sport, "/healthz")[0] == 200


def test_a_broker_collecting_claims_is_not_ready(tmp_path: Path) -> None:
    port = free_port()
    c = LocalCluster(partitions=1, workdir=tmp_path, broker_args=["--metrics-port", str(port)])
    c.port = free_port()
    try:
        c.start_broker(grace=60)
        until(lambda: c.broker().log().count("metrics on") == 1, 20, "the metrics endpoint")
        until(lambda: get(port, "/healthz")[0] == 200, 10, "the loop")
        code, body = get(port, "/ready")
        assert (code, body) == (503, "not ok: collecting the shards' claims after a start\n")
    finally:
        c.stop()


def test_a_metrics_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for role, extra in (
            ("broker", ["--bind", f"tcp://127.0.0.1:{free_port()}"]),
            ("shard", ["--broker", f"tcp://127.0.0.1:{free_port()}"]),
        ):
            out = run([role, *extra, "--metrics-port", str(port)], timeout=30)
            assert out.returncode == 1, out
            assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr, out.stderr
            assert "Traceback" not in out.stderr and "listening" not in out.stderr
        # a worker finds out before it connects (no broker runs at that address)
        out = subprocess.run(
            [
                *(sys.executable, "-m", "zps.worker_entry"),
                *("--broker", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(port)),
                "json:dumps",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env=LocalCluster().env(),
        )
        assert out.returncode == 1, out
        assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "no answer from the broker" not in out.stderr


@pytest.fixture
def notify_socket(tmp_path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(20)
    return sock


def test_a_shard_is_ready_for_systemd_once_the_broker_admitted_it(
    tmp_path: Path, notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = LocalCluster(partitions=1, workdir=tmp_path)
    c.port = free_port()
    try:
        with notify_socket:
            monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.getsockname())
            c.start_shard()  # no broker yet
            monkeypatch.delenv("NOTIFY_SOCKET")
            first = notify_socket.recv(4096).decode()
            assert first.startswith("STATUS=registering with"), first
            notify_socket.settimeout(1.0)  # no READY while nobody admitted it
            with pytest.raises(TimeoutError):
                notify_socket.recv(4096)
            c.start_broker()
            notify_socket.settimeout(20)
            ready = notify_socket.recv(4096).decode()
            assert ready.startswith("READY=1\nSTATUS=registered with"), ready
    finally:
        c.stop()


def test_version_flags() -> None:
    for module in ("zps", "zps.worker_entry"):
        out = subprocess.run(
            [sys.executable, "-m", module, "--version"],
            capture_output=True,
            text=True,
            timeout=30,
            env=LocalCluster().env(),
        )
        prog = "zps-server" if module == "zps" else "zps-worker"
        assert out.returncode == 0, out
        assert out.stdout.strip() == f"{prog} {zps.__version__} (zps protocol {PROTOCOL_VERSION})"


def test_status_shows_the_version_of_every_process(shared: LocalCluster) -> None:
    c = shared
    report = c.status()
    assert report["broker"]["version"] == zps.__version__
    assert report["broker"]["protocol"] == PROTOCOL_VERSION
    assert len(report["shards"]) == 2
    assert all(s["version"] == zps.__version__ for s in report["shards"]), report["shards"]
    assert report["clients"] and all(x["version"] == zps.__version__ for x in report["clients"])
    table = run(["status", "--broker", c.address]).stdout
    assert f"zps {zps.__version__} (protocol {PROTOCOL_VERSION})" in table, table
    shard_lines = [line for line in table.splitlines() if line.startswith("s-")]
    assert len(shard_lines) == 2 and all(line.endswith(zps.__version__) for line in shard_lines), (
        table
    )


def _raw_exchange(address: str, identity: bytes, frames: list[bytes]) -> list[bytes]:
    with raw_dealer(address, identity) as sock:
        sock.send_multipart(frames)
        assert sock.poll(10_000), f"no answer to {identity!r}"
        return sock.recv_multipart()


def test_a_peer_of_another_protocol_version_is_told_so(monkeypatch: pytest.MonkeyPatch) -> None:
    newer = PROTOCOL_VERSION + 1
    with LocalCluster(partitions=1, shards=1) as c:
        # Same protocol version, another release with a header key this one does not
        # know: served (the compatibility rule's first half)
        hello = {"host": "h", "pid": 1, "name": "r", "version": "999.0", "added_later": [1]}
        route = ROUTE.pack(MAGIC, PROTOCOL_VERSION, int(MsgType.HELLO), -1, 0, 41)
        reply = _raw_exchange(c.address, b"c-later-release", [route, msgpack.packb(hello)])
        magic, version, mtype, _, _, _ = ROUTE.unpack(reply[0])
        assert (magic, version) == (MAGIC, PROTOCOL_VERSION)
        assert mtype != MsgType.REPLY or msgpack.unpackb(reply[1]).get("st") != "VERSION_MISMATCH"
        assert mtype == MsgType.MAP, MsgType(mtype)

        header = msgpack.packb({"host": "h", "pid": 1, "name": "future"})
        for identity, prefix in ((b"c-future", []), (b"s-future", [b""])):
            route = ROUTE.pack(MAGIC, newer, int(MsgType.HELLO), -1, 0, 42)
            if prefix:
                route = ROUTE.pack(MAGIC, newer, int(MsgType.REGISTER), -1, 0, 42)
            reply = _raw_exchange(c.address, identity, [*prefix, route, header])
            assert reply[: len(prefix)] == prefix
            magic, version, mtype, _, _, req_id = ROUTE.unpack(reply[len(prefix)])
            assert (magic, version, mtype, req_id) == (MAGIC, PROTOCOL_VERSION, MsgType.REPLY, 42)
            answer = msgpack.unpackb(reply[len(prefix) + 1])
            assert answer["st"] == "VERSION_MISMATCH", answer
            assert f"protocol version {PROTOCOL_VERSION}" in answer["msg"]
            assert f"version {newer}" in answer["msg"]
        # a second message from the same peer is answered again but not logged again
        _raw_exchange(c.address, b"c-future", [route, header])
        warned = wait_log(c.broker(), r"WARNING zps\.broker: .* speaks protocol version")
        assert len(warned) == 2, warned
        assert any("client c-future" in w for w in warned)
        assert any("shard s-future" in w for w in warned)
        assert c.status()["broker"]["version_mismatch"] == 3
        assert c.healthy(c.status())  # the cluster carried on

        # A client of another protocol version: a clear error at once, naming both.
        monkeypatch.setattr(codec, "PROTOCOL_VERSION", newer)
        t0 = time.monotonic()
        with pytest.raises(ProtocolError) as err:
            zps.connect_sync(c.address, connect_timeout=20)
        assert time.monotonic() - t0 < 10
        assert str(err.value).startswith(
            f"the broker at {c.address} speaks zps protocol version {PROTOCOL_VERSION}, "
            f"this client (zps {zps.__version__}) version {newer}"
        ), err.value


def test_the_metrics_endpoint_binds_loopback_unless_told() -> None:
    from zps.cli.main import server_parser
    from zps.cli.server import broker_config, shard_config
    from zps.ops.config import Metrics, Settings

    parse = server_parser().parse_args
    assert broker_config(parse(["broker"]), Settings()).metrics.host == "127.0.0.1"
    assert shard_config(parse(["shard"]), Settings()).metrics.host == "127.0.0.1"
    for role in ("broker", "shard"):
        args = parse([role, "--metrics-host", "0.0.0.0", "--metrics-port", "9100"])
        config = (broker_config if role == "broker" else shard_config)(args, Settings())
        assert (config.metrics.host, config.metrics.port) == ("0.0.0.0", 9100)

    # a worker: its own port key, the shared host
    from zps.cli.worker import worker_metrics, worker_parser
    from zps.ops.config import settings_from_mapping

    wparse = worker_parser().parse_args
    assert worker_metrics(wparse(["m:f"]), Settings()) == Metrics(port=0, host="127.0.0.1")
    toml = settings_from_mapping(
        {"metrics": {"port": 9100, "host": "10.0.0.7"}, "worker": {"metrics_port": 9200}}
    )
    assert worker_metrics(wparse(["m:f"]), toml) == Metrics(port=9200, host="10.0.0.7")
    shared_only = settings_from_mapping({"metrics": {"port": 9100}})
    assert worker_metrics(wparse(["m:f"]), shared_only).port == 0  # the broker's, not its own
    flags = wparse(["--metrics-port", "9300", "--metrics-host", "::1", "m:f"])
    assert worker_metrics(flags, toml) == Metrics(port=9300, host="::1")


def test_shard_names_are_stable_and_a_restart_replaces_the_earlier_process(
    tmp_path: Path,
) -> None:
    from zps.ops.config import ShardConfig
    from zps.shard.server import shard_node_id

    data = tmp_path / "shard-a"
    # the default: host and data dir (two dirs of one name differ), else host and pid
    a = shard_node_id(ShardConfig(data_dir=str(data)), hostname="ps1.example.net", pid=7)
    assert re.fullmatch(r"s-ps1-shard-a-[0-9a-f]{4}", a), a
    assert a == shard_node_id(ShardConfig(data_dir=str(data) + "/"), hostname="ps1", pid=8)
    other = shard_node_id(
        ShardConfig(data_dir=str(tmp_path / "x" / "shard-a")), hostname="ps1", pid=7
    )
    assert other != a
    assert shard_node_id(ShardConfig(), hostname="ps1", pid=7) == "s-ps1-7"
    assert shard_node_id(ShardConfig(name="p0r1"), hostname="ps1", pid=7) == "s-p0r1"

    # a liveness timeout (10 s) far longer than a shard's start
    c = LocalCluster(partitions=1, replication=2, workdir=tmp_path, liveness=100)
    c.port = free_port()
    try:
        c.start_broker()
        first = c.start_shard(["--name", "alpha", "--data-dir", str(tmp_path / "a")])
        c.start_shard(["--name", "beta", "--data-dir", str(tmp_path / "b")])
        status = c.wait_healthy()
        assert {s["node"] for s in status["shards"]} == {"s-alpha", "s-beta"}
        assert wait_log(first, r"shard s-alpha \(pid \d+\) connecting")
        # The process hangs (its connection stays up) and a new one starts under its
        # name, well within the liveness timeout: the broker takes the new one for a
        # restart and drops the earlier at once.  (On a directory of its own: the stopped
        # process still holds its data dir, and a second process there is refused.)
        c.kill(first.pid, signal.SIGSTOP)
        again = c.start_shard(["--name", "alpha", "--data-dir", str(tmp_path / "a2")])
        status = c.wait_for(
            lambda s: c.healthy(s) and again.pid in {x["pid"] for x in s["shards"]},
            8,
            "the restarted shard to be back in sync",
        )
        assert sorted(s["node"] for s in status["shards"]) == ["s-alpha", "s-beta"]
        assert wait_log(c.broker(), r"WARNING .*shard s-alpha registered again as a new process")
        assert not wait_log(c.broker(), r"shard s-alpha .*declared dead", timeout=0)
        c.kill(first.pid)
    finally:
        c.stop()


def test_binding_every_interface_without_curve_is_warned_about(tmp_path: Path) -> None:
    for bind, warned in (
        (f"tcp://0.0.0.0:{free_port()}", True),
        (f"tcp://127.0.0.1:{free_port()}", False),
    ):
        c = LocalCluster(partitions=1, workdir=tmp_path)
        proc = c.spawn("b", [sys.executable, "-m", "zps", "broker", "--bind", bind])
        try:
            assert wait_log(proc, r"listening on"), proc.log()
            lines = [x for x in proc.log().splitlines() if "without CURVE" in x]
            assert len(lines) == int(warned), proc.log()
            if warned:
                assert "WARNING" in lines[0] and bind in lines[0]
        finally:
            c.stop()


def test_drain_hands_a_primary_over_and_undrain_brings_it_back() -> None:
    with LocalCluster(partitions=1, shards=3, replication=2) as c:
        c.wait_for(lambda s: len(s["shards"]) == 3, 20, "the spare")
        with zps.connect_sync(c.address) as ps:
            ps.create_dense("kept", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
            ps.push_dense("kept", np.ones(4))
            c.wait_for(
                lambda s: c.healthy(s) and s["partitions"][0]["replicas"][0]["lag"] == 0,
                20,
                "the replica to hold the write",
            )
            old = c.status()["partitions"][0]["primary"]
            out = run(["drain", old.removeprefix("s-"), "--broker", c.address])
            assert out.returncode == 0, out
            assert (
                out.stdout.strip()
                == f"{old} drained: it holds no role until `zps-server undrain {old}`"
            )
            status = c.wait_for(c.healthy, 20, "a new primary and a new replica")
            part = status["partitions"][0]
            assert part["primary"] != old and part["epoch"] == 2
            mine = next(s for s in status["shards"] if s["node"] == old)
            assert mine["role"] == "spare" and mine["drained"], mine
            assert "DRAINED" in run(["status", "--broker", c.address]).stdout
            # the write is still there, and writing goes on at the new primary
            np.testing.assert_array_equal(ps.pull_dense("kept"), -np.ones(4))
            ps.push_dense("kept", np.ones(4))
            np.testing.assert_array_equal(ps.pull_dense("kept"), -2 * np.ones(4))

            out = run(["drain", "s-nobody", "--broker", c.address])
            assert out.returncode == 1 and "no shard s-nobody" in out.stderr, out
            out = run(["undrain", old, "--broker", c.address])
            assert out.returncode == 0, out
            status = c.status()
            assert not next(s for s in status["shards"] if s["node"] == old)["drained"]
        assert wait_log(c.broker(), rf"WARNING zps\.broker: shard {old} drained by an operator")


def test_a_drained_replica_restarted_on_its_data_dir_stays_drained(tmp_path: Path) -> None:
    """Its copy is of the serving epoch and no spare waits, yet the shard restarted on
    its data dir gets no role back until `undrain`."""
    c = DataDirCluster(partitions=1, shards=2, replication=2, workdir=tmp_path)
    c.port = free_port()
    try:
        c.start_broker()
        a = c.start_shard(tmp_path / "a", ["--name", "a"])
        b = c.start_shard(tmp_path / "b", ["--name", "b"])
        c.wait_healthy()
        with zps.connect_sync(c.address) as ps:
            ps.create_dense("kept", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
            for _ in range(10):
                ps.push_dense("kept", np.ones(4))
        replica = next(p for p in (a, b) if p.pid != c.shard_pid(0))
        name = "s-a" if replica is a else "s-b"
        out = run(["drain", name, "--broker", c.address])
        assert out.returncode == 0, out
        c.wait_for(lambda s: s["partitions"][0]["replicas"] == [], 20, "the replica to leave")
        replica.popen.terminate()
        replica.popen.wait(20)
        again = c.start_shard(tmp_path / name[-1], ["--name", name[-1]])
        c.wait_for(lambda s: sum(x["node"] == name for x in s["shards"]) == 1, 20, "it to register")
        assert wait_log(again, r"restored partition 0"), again.log()
        status = c.status()
        mine = next(x for x in status["shards"] if x["node"] == name)
        assert (mine["role"], mine["drained"]) == ("spare", True), mine
        assert status["partitions"][0]["replicas"] == []
        assert run(["undrain", name, "--broker", c.address]).returncode == 0
        c.wait_for(c.healthy, 30, "the undrained shard back as a replica")
    finally:
        c.stop()


def test_a_worker_ignoring_the_stop_request_exits_after_the_grace_period(tmp_path: Path) -> None:
    config = tmp_path / "zps.toml"
    config.write_text("[worker]\nstop_grace = 1.5\n")
    # (job, flags, SIGTERMs, exit status): the grace period from the file or a flag;
    # blocking and async functions; as the control, functions that return when asked;
    # and a second SIGTERM, which interrupts at once
    cases = [
        ("ignore_stop", ["--config", str(config)], 1, 124),
        ("async_ignore_stop", ["--stop-grace", "1.5"], 1, 124),
        ("until_stopped", ["--stop-grace", "1.5"], 1, 0),
        ("async_until_stopped", ["--config", str(config)], 1, 0),
        ("ignore_stop", ["--stop-grace", "30"], 2, 130),
        ("async_ignore_stop", ["--stop-grace", "30"], 2, 130),
    ]
    with LocalCluster(partitions=1, shards=1) as c:
        workers = [
            Worker(c, tmp_path / f"{i}-{job}.log", job, *flags)
            for i, (job, flags, _, _) in enumerate(cases)
        ]
        exited: dict[int, float] = {}

        def watch(i: int, w: Worker) -> None:
            w.popen.wait()
            exited[i] = time.monotonic()

        try:
            for w in workers:
                w.wait_line("ready")
            sent = time.monotonic()
            for i, w in enumerate(workers):
                w.popen.send_signal(signal.SIGTERM)
                threading.Thread(target=watch, args=(i, w), daemon=True).start()
            for (_, _, signals, _), w in zip(cases, workers, strict=True):
                if signals == 2:
                    assert wait_log_file(w, "WARNING zps: signal 15"), w.log()
                    w.popen.send_signal(signal.SIGTERM)
            until(lambda: len(exited) == len(workers), 30, "every worker to exit")
            for i, ((job, _, signals, code), w) in enumerate(zip(cases, workers, strict=True)):
                log = w.log()
                assert w.popen.returncode == code, (job, signals, log)
                grace = "30" if signals == 2 else "1.5"
                assert re.search(
                    rf"WARNING zps: signal 15: finishing the current step, then stopping: "
                    rf"ops_jobs:{job} sees ps.stop_requested and has {grace}s "
                    r"\(worker.stop_grace\) to return",
                    log,
                ), log
                gave_up = (
                    f"ERROR zps: ops_jobs:{job} did not return within {grace}s of the stop "
                    "request (worker.stop_grace): exiting with code 124"
                )
                if code == 124:
                    assert gave_up in log, log
                    assert 1.5 <= exited[i] - sent < 10, exited[i] - sent
                else:
                    assert gave_up not in log, log
                    assert exited[i] - sent < 10, exited[i] - sent
        finally:
            for w in workers:
                w.stop()


def wait_log_file(w: Worker, pattern: str, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in w.log().splitlines() if re.search(pattern, line)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_an_unusable_data_dir_is_one_line_naming_it_and_why(tmp_path: Path) -> None:
    """Not a directory, or one the process may not write in: exit 2 and one line."""
    afile = tmp_path / "afile"
    afile.write_text("")
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:  # root writes anywhere, except in an immutable directory
        subprocess.run(["chattr", "+i", str(locked)], check=True)
        denied = "Operation not permitted"
    else:
        locked.chmod(0o555)
        denied = "Permission denied"
    shard = ["shard", "--broker", "tcp://127.0.0.1:1"]
    cases = [
        (shard, afile / "sub", "cannot create it: Not a directory"),
        (shard, afile, "cannot create it: File exists"),
        (shard, locked / "s", f"cannot create it: {denied}"),
        (["broker", "--bind", f"tcp://127.0.0.1:{free_port()}"], locked, "cannot open LOCK "
         f"for writing: {denied} ({locked / 'LOCK'})"),
    ]  # fmt: skip
    try:
        for args, data_dir, why in cases:
            out = subprocess.run(
                [sys.executable, "-m", "zps", *args, "--data-dir", str(data_dir)],
                capture_output=True,
                text=True,
                timeout=60,
                env=LocalCluster().env(),
            )
            assert out.returncode == 2, out
            assert out.stderr.splitlines() == [
                f"zps-server {args[0]}: invalid configuration: data directory {data_dir}: "
                f"{why}; give --data-dir a directory this user can write"
            ], out.stderr
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(locked)], check=True)


def test_the_broker_logs_a_spare_without_a_partition_and_a_status_query_at_debug() -> None:
    with LocalCluster(partitions=1, shards=2, replication=1) as c:
        c.wait_for(lambda s: any(x["role"] == "spare" for x in s["shards"]), 20, "a spare")
        spare = wait_log(c.broker(), r"assign s-\S+: spare at epoch \d+$")
        assert spare, c.broker().log()
        assert "partition None" not in c.broker().log()
        joined = len(wait_log(c.broker(), r"INFO zps\.broker: client c-\S+ joined", timeout=0))
        assert joined >= 1  # the test's own client (zps.testing) joined at info
        for _ in range(2):
            assert run(["status", "--broker", c.address]).returncode == 0
        # the broker answered each query after it logged the join: none at info
        after = wait_log(c.broker(), r"INFO zps\.broker: client c-\S+ joined", timeout=0)
        assert len(after) == joined, after


def test_an_admin_command_out_of_the_brokers_range_is_answered_at_once() -> None:
    """A STATUS command the broker cannot parse (a value past its range) is answered
    BAD_REQUEST naming the field, not dropped for the command to wait out its timeout."""
    with LocalCluster(partitions=1, shards=1) as c:
        for args, field in (
            (["scale", "--partitions", str(2**21)], "STATUS scale"),
            (["reset-partition", "--partition", str(2**40), "--accept-data-loss"], "reset"),
        ):
            began = time.monotonic()
            out = run([*args, "--broker", c.address])
            assert out.returncode == 1, out
            assert field in out.stderr and "Traceback" not in out.stderr, out
            assert time.monotonic() - began < 5, "answered, not waited out"
        assert c.status()["n_partitions"] == 1  # and the broker serves on
