"""TOML settings through the real command lines: errors name the key and exit 2;
a valid file sets values and flags override it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zps import transport
from zps.ops.config import load_settings
from zps.testing import LocalCluster, free_port

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    e = LocalCluster().env()
    e.pop("ZPS_CONFIG", None)
    return e


def zps_cmd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zps", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
        stdin=subprocess.DEVNULL,
    )


def worker_cmd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zps.worker_entry", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
        stdin=subprocess.DEVNULL,
    )


#: In INVALID's texts: a directory holding the key pairs a.key/a.key_secret and
#: b.key/b.key_secret, written for the case.
KEYS = "{keys}"

# (file text, role, what stderr must say)
INVALID: dict[str, tuple[str, str, list[str]]] = {
    "unknown section": (
        "[brokr]\npartitions = 3\n",
        "broker",
        ["unknown section [brokr]", "did you mean [broker]?"],
    ),
    "unknown key": (
        "[broker]\npartitons = 3\n",
        "broker",
        ["unknown key 'broker.partitons'", "(did you mean 'broker.partitions'?)"],
    ),
    "unknown key of a shared section": (
        "[heartbeat]\nintervall = 0.5\n",
        "shard",
        ["unknown key 'heartbeat.intervall'", "did you mean 'heartbeat.interval'?"],
    ),
    "string for partitions": (
        '[broker]\npartitions = "3"\n',
        "broker",
        ["'broker.partitions' must be int", "'3'"],
    ),
    "replication 0": (
        "[broker]\nreplication = 0\n",
        "broker",
        ["broker.replication must be an integer >= 1, got 0"],
    ),
    "negative heartbeat interval": (
        "[heartbeat]\ninterval = -0.5\n",
        "broker",
        ["heartbeat.interval must be a positive number, got -0.5"],
    ),
    "checkpoint.keep 0": (
        "[checkpoint]\nkeep = 0\n",
        "shard",
        ["checkpoint.keep must be an integer >= 1, got 0"],
    ),
    "metrics.port 70000": (
        "[metrics]\nport = 70000\n",
        "broker",
        ["metrics.port must be <= 65535, got 70000"],
    ),
    "bool for an integer": (
        "[broker]\npartitions = true\n",
        "broker",
        ["'broker.partitions' must be int", "True"],
    ),
    "a section that is not a table": (
        "broker = 3\n",
        "broker",
        ["'broker' must be a table"],
    ),
    "invalid TOML": (
        "[broker\npartitions = 3\n",
        "broker",
        ["not valid TOML"],
    ),
    "nan heartbeat interval": (
        "[heartbeat]\ninterval = nan\n",
        "shard",
        ["heartbeat.interval must be a positive number, got nan"],
    ),
    "an answer held too long": (
        "[shard]\nack_hold_s = 5\n",
        "shard",
        ["shard.ack_hold_s must be seconds from 0 to 1, got 5"],
    ),
    "half a key pair": (
        '[security]\ncurve_secret_key_file = "/nonexistent/zps.key_secret"\n',
        "broker",
        ["security.curve_secret_key_file and security.curve_public_key_file go together"],
    ),
    "a key file that does not exist": (
        '[security]\ncurve_secret_key_file = "/nonexistent/zps.key_secret"\n'
        'curve_public_key_file = "/nonexistent/zps.key"\n',
        "broker",
        ["security.curve_public_key_file: cannot load /nonexistent/zps.key: the file does not"],
    ),
    "a public key of another key pair": (
        f'[security]\ncurve_secret_key_file = "{KEYS}/a.key_secret"\n'
        f'curve_public_key_file = "{KEYS}/b.key"\n',
        "broker",
        [
            f"security.curve_public_key_file {KEYS}/b.key is not the public key of "
            f"security.curve_secret_key_file {KEYS}/a.key_secret"
        ],
    ),
    "a worker's broker that is not an endpoint": (
        '[worker]\nbroker = "localhost:5555"\n',
        "status",
        ["worker.broker must be ZeroMQ endpoints like tcp://HOST:PORT, got 'localhost:5555'"],
    ),
    "a shard's broker pair with one bad endpoint": (
        '[shard]\nbrokers = ["tcp://a:5555", "b:5555"]\n',
        "shard",
        ["shard.brokers must be ZeroMQ endpoints like tcp://HOST:PORT, got 'b:5555'"],
    ),
}
#: errors of the loader itself name the file; range checks name only the key
NAMES_FILE = {
    "unknown section",
    "unknown key",
    "unknown key of a shared section",
    "string for partitions",
    "bool for an integer",
    "a section that is not a table",
    "invalid TOML",
}


def key_pairs(directory: Path) -> str:
    """Write the key pairs ``a`` and ``b`` in ``directory``; its path."""
    for name in ("a", "b"):
        transport.write_keypair(str(directory), name)
    return str(directory)


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_config_exits_2_naming_the_key(case: str, tmp_path: Path) -> None:
    text, role, expected = INVALID[case]
    if KEYS in text:
        keys = key_pairs(tmp_path / "keys")
        text, expected = text.replace(KEYS, keys), [e.replace(KEYS, keys) for e in expected]
    path = tmp_path / "zps.toml"
    path.write_text(text)
    extra = ["--bind", f"tcp://127.0.0.1:{free_port()}"] if role == "broker" else []
    out = zps_cmd(role, "--config", str(path), *extra)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert f"zps-server {role}: invalid configuration: " in out.stderr, out.stderr
    for needle in expected:
        assert needle in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    if case in NAMES_FILE:
        assert str(path) in out.stderr


def test_check_config_takes_a_key_pair_and_refuses_two_halves(tmp_path: Path) -> None:
    keys = key_pairs(tmp_path / "keys")
    path = tmp_path / "zps.toml"
    for public, ok in (("a.key", True), ("b.key", False)):
        path.write_text(
            f'[security]\ncurve_secret_key_file = "{keys}/a.key_secret"\n'
            f'curve_public_key_file = "{keys}/{public}"\n'
        )
        out = zps_cmd("check-config", str(path))
        if ok:
            assert (out.returncode, out.stdout.strip()) == (0, f"{path}: ok"), out.stderr
        else:
            assert out.returncode == 1, (out.stdout, out.stderr)
            assert out.stderr.strip() == (
                f"{path}: invalid: security.curve_public_key_file {keys}/b.key is not the "
                f"public key of security.curve_secret_key_file {keys}/a.key_secret: give the "
                "NAME.key and NAME.key_secret that `zps-server keygen` wrote together"
            ), out.stderr


@pytest.mark.parametrize("role", ["broker", "shard", "status"])
def test_missing_config_file_exits_2(role: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    out = zps_cmd(role, "--config", str(missing))
    assert out.returncode == 2, out.stderr
    assert f"config file {missing} does not exist" in out.stderr


def test_zps_config_variable_names_the_file_too(tmp_path: Path) -> None:
    path = tmp_path / "zps.toml"
    path.write_text("[broker]\nreplication = 0\n")
    e = env()
    e["ZPS_CONFIG"] = str(path)
    out = subprocess.run(
        [sys.executable, "-m", "zps", "broker"],
        capture_output=True,
        text=True,
        timeout=30,
        env=e,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 2
    assert "broker.replication must be an integer >= 1" in out.stderr


def test_worker_with_an_invalid_config_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "zps.toml"
    path.write_text("[client]\nacks = 2\n")
    out = worker_cmd("--config", str(path), "json:dumps")
    assert out.returncode == 2, out.stderr
    assert 'client.acks must be "all" or 1, got 2' in out.stderr
    path.write_text("[worker]\nfunction = 'x:y'\nargz = []\n")
    out = worker_cmd("--config", str(path))
    assert out.returncode == 2
    assert "unknown key 'worker.argz' (did you mean 'worker.args'?)" in out.stderr


# -- a valid file ------------------------------------------------------------------


class Broker:
    """A broker process started from a config file; stopped on exit."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log_path = log
        with open(log, "wb") as f:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "zps", "broker", *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env(),
            )

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
        try:
            return self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait(5)


@pytest.fixture
def brokers() -> Iterator[list[Broker]]:
    started: list[Broker] = []
    yield started
    for b in started:
        b.stop()


def status_json(config: Path, *extra: str) -> dict[str, Any]:
    out = zps_cmd("status", "--json", "--config", str(config), "--timeout", "10", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_valid_file_sets_values_and_flags_override_it(
    tmp_path: Path, brokers: list[Broker]
) -> None:
    port = free_port()
    config = tmp_path / "zps.toml"
    config.write_text(
        f"""
[broker]
bind = "tcp://127.0.0.1:{port}"
partitions = 3
replication = 1
startup_grace = 0

[worker]
broker = "tcp://127.0.0.1:{port}"   # `zps-server status` connects here

[heartbeat]
interval = 0.1
liveness = 4
"""
    )
    b = Broker(["--config", str(config)], tmp_path / "b1.log")
    brokers.append(b)
    report = status_json(config)
    assert report["n_partitions"] == 3
    assert [p["partition"] for p in report["partitions"]] == [0, 1, 2]
    assert report["replication"] == 1
    assert b.stop() == 0
    log = b.log_path.read_text()
    assert f"listening on tcp://127.0.0.1:{port}: 3 partitions x 1 copies" in log, log
    # grace 0 from the file; the heartbeat section reached the broker too (its default
    # grace would be 2 x 0.1 x 4 = 0.8 s if startup_grace were unset)
    assert "granted for the first 0.0s" in log, log

    # Flags beat the file: --partitions and --bind (a port the file doesn't name).
    port2 = free_port()
    b2 = Broker(
        ["--config", str(config), "--partitions", "1", "--bind", f"tcp://127.0.0.1:{port2}"],
        tmp_path / "b2.log",
    )
    brokers.append(b2)
    report = status_json(config, "--broker", f"tcp://127.0.0.1:{port2}")
    assert report["n_partitions"] == 1
    assert report["replication"] == 1  # still from the file
    assert b2.stop() == 0


def test_heartbeat_from_the_file_sets_the_default_grace(
    tmp_path: Path, brokers: list[Broker]
) -> None:
    port = free_port()
    config = tmp_path / "zps.toml"
    config.write_text(
        f'[broker]\nbind = "tcp://127.0.0.1:{port}"\n\n[heartbeat]\ninterval = 0.05\nliveness = 3\n'
    )
    b = Broker(["--config", str(config)], tmp_path / "b.log")
    brokers.append(b)
    report = status_json(config, "--broker", f"tcp://127.0.0.1:{port}")
    assert report["n_partitions"] == 2  # the default
    assert b.stop() == 0
    assert "granted for the first 0.3s" in b.log_path.read_text()  # 2 x 0.05 x 3


def test_deploy_example_loads() -> None:
    settings = load_settings(str(ROOT / "deploy" / "zps.toml"))
    assert settings.source == str(ROOT / "deploy" / "zps.toml")
    assert settings.broker.partitions == 4
    assert settings.broker.replication == 2
    assert settings.broker.bind == "tcp://*:5555"
    assert settings.shard.broker == "tcp://ps-broker:5555"
    assert settings.shard.data_dir == "/var/lib/zps"
    assert settings.shard.replication_bind == "tcp://*:5556"
    assert settings.shard.checkpoint.interval_s == 60
    assert settings.shard.checkpoint.keep == 3
    assert settings.worker.function == "mymodule:train"
    assert settings.worker.args == ()
    assert settings.client.acks == "all"
    assert settings.client.timeout == 30.0
    # shared sections reach every process that uses them
    for cfg in (settings.broker, settings.shard, settings.client):
        assert cfg.heartbeat.interval == 0.2 and cfg.heartbeat.liveness == 5
        assert not cfg.security.enabled
    assert settings.broker.metrics.port == 0


def test_deploy_example_is_accepted_by_the_command_line(tmp_path: Path) -> None:
    """The shipped file is accepted by a real process too (exit 1, not 2)."""
    out = zps_cmd("status", "--config", str(ROOT / "deploy" / "zps.toml"), "--timeout", "0.3")
    # ps-broker does not resolve here: the configuration was accepted, the connection not
    assert out.returncode == 1, out.stderr
    assert "invalid configuration" not in out.stderr


def test_a_shard_logs_the_broker_pair_it_connects_to(tmp_path: Path) -> None:
    """With ``[shard] brokers``, the start-up line names both brokers of the pair, not
    ``shard.broker``'s default."""
    a, b = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "zps.toml"
    config.write_text(
        f'[shard]\nbrokers = ["{a}", "{b}"]\nreplication_bind = "tcp://127.0.0.1:0"\n'
    )
    shard = subprocess.Popen(
        [sys.executable, "-m", "zps", "shard", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env(),
    )
    assert shard.stdout is not None
    # No broker answers: the shard keeps trying until it is stopped.  The timer ends the
    # read (EOF) should the line never come.
    timer = threading.Timer(30, shard.kill)
    timer.start()
    try:
        lines: list[str] = []
        for line in shard.stdout:
            lines.append(line)
            if ") connecting to " in line:
                break
    finally:
        timer.cancel()
        shard.kill()
        shard.wait(10)
        shard.stdout.close()
    assert lines and ") connecting to " in lines[-1], "".join(lines)
    assert f") connecting to {a}, {b}; replication at tcp://" in lines[-1], lines[-1]
