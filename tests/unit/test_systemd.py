"""The systemd notify protocol against real AF_UNIX datagram sockets (path and abstract)."""

from __future__ import annotations

import ast
import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import zps.ops.systemd
from zps.errors import ConfigError
from zps.ops.systemd import Notifier


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket standing in for systemd's notify socket."""
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(5)
        yield sock, path


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    name = f"zps-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5)
        yield sock, "@" + name


def recv(sock: socket.socket) -> bytes:
    return sock.recv(4096)


def test_without_notify_socket_everything_is_a_no_op() -> None:
    n = Notifier.from_env({})
    assert not n.enabled and n.address is None and n.watchdog_period is None
    assert n.notify("READY=1") is False
    assert n.ready() is False and n.stopping() is False
    assert n.status("x") is False and n.watchdog() is False
    assert Notifier.from_env({"NOTIFY_SOCKET": ""}).enabled is False


def test_messages_reach_a_path_socket(path_socket: tuple[socket.socket, str]) -> None:
    sock, path = path_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled and n.address == path
    assert n.ready() is True
    assert recv(sock) == b"READY=1"
    assert n.ready("serving partition 1") is True
    assert recv(sock) == b"READY=1\nSTATUS=serving partition 1"
    assert n.status("replica of p0, lsn 42") is True
    assert recv(sock) == b"STATUS=replica of p0, lsn 42"
    assert n.watchdog() is True
    assert recv(sock) == b"WATCHDOG=1"
    assert n.stopping() is True
    assert recv(sock) == b"STOPPING=1"
    assert n.stopping("checkpointing") is True
    assert recv(sock) == b"STOPPING=1\nSTATUS=checkpointing"
    assert n.extend_timeout(12.5) is True
    assert recv(sock) == b"EXTEND_TIMEOUT_USEC=12500000"
    assert n.notify("RELOADING=1\nSTATUS=x") is True
    assert recv(sock) == b"RELOADING=1\nSTATUS=x"


def test_messages_reach_an_abstract_socket(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, name = abstract_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": name})
    assert n.address == b"\0" + name[1:].encode()
    assert n.ready("up") is True
    assert recv(sock) == b"READY=1\nSTATUS=up"
    assert n.watchdog() is True
    assert recv(sock) == b"WATCHDOG=1"


def test_a_status_cannot_inject_assignments(path_socket: tuple[socket.socket, str]) -> None:
    sock, path = path_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.status("bad\nREADY=1\r\nMAINPID=1") is True
    assert recv(sock) == b"STATUS=bad READY=1 MAINPID=1"
    assert n.ready("a\nb") is True
    assert recv(sock) == b"READY=1\nSTATUS=a b"


def test_utf8_status(path_socket: tuple[socket.socket, str]) -> None:
    sock, path = path_socket
    assert Notifier.from_env({"NOTIFY_SOCKET": path}).status("état ✓") is True
    assert recv(sock) == "STATUS=état ✓".encode()


def test_a_missing_receiver_is_reported_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody")})
    assert n.ready() is False
    assert n.watchdog() is False
    assert "not sent" in caplog.text
    gone = Notifier.from_env({"NOTIFY_SOCKET": f"@zps-test-{uuid.uuid4().hex}"})
    assert gone.watchdog() is False


def test_a_closed_receiver_after_start_is_reported(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.ready() is True
    sock.close()
    assert n.stopping() is False


@pytest.mark.parametrize("value", ["relative/path", "vsock:2:1234", "notify"])
def test_an_unusable_notify_socket_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="NOTIFY_SOCKET"):
        Notifier.from_env({"NOTIFY_SOCKET": value})


@pytest.mark.parametrize(
    ("env", "period"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": ""}, None),
        ({"WATCHDOG_USEC": "10000000"}, 5.0),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "4242"}, 5.0),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "4243"}, None),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": ""}, 5.0),
        ({"WATCHDOG_USEC": "1"}, 0.5e-6),
        ({"WATCHDOG_PID": "4242"}, None),
    ],
)
def test_watchdog_period(env: dict[str, str], period: float | None) -> None:
    assert Notifier.from_env(env, pid=4242).watchdog_period == period


def test_watchdog_pid_defaults_to_this_process() -> None:
    mine = {"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_env(mine).watchdog_period == 1.5
    other = {"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier.from_env(other).watchdog_period is None


@pytest.mark.parametrize(
    "env",
    [
        {"WATCHDOG_USEC": "ten"},
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "-5"},
        {"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "me"},
    ],
)
def test_a_malformed_watchdog_is_a_config_error(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="WATCHDOG_"):
        Notifier.from_env(env, pid=1)


async def test_the_watchdog_loop_pings_until_cancelled(
    abstract_socket: tuple[socket.socket, str],
) -> None:
    sock, name = abstract_socket
    sock.setblocking(False)
    n = Notifier.from_env({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "20000"})
    assert n.watchdog_period == 0.01
    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(n.watchdog_loop())
        pings = [await asyncio.wait_for(loop.sock_recv(sock, 64), 5) for _ in range(3)]
        task.cancel()
    assert pings == [b"WATCHDOG=1"] * 3
    assert task.cancelled()


async def test_the_watchdog_loop_returns_when_no_pings_are_due(
    path_socket: tuple[socket.socket, str],
) -> None:
    _, path = path_socket
    await asyncio.wait_for(Notifier.from_env({"NOTIFY_SOCKET": path}).watchdog_loop(), 1)
    await asyncio.wait_for(Notifier.from_env({"WATCHDOG_USEC": "20000"}).watchdog_loop(), 1)


def test_the_module_reads_no_environment() -> None:
    tree = ast.parse(Path(zps.ops.systemd.__file__).read_text(encoding="utf-8"))
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"environ", "environb", "getenv", "getenvb"}
