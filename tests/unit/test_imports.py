"""What a process imports at start: the package's top-level names are loaded on first use,
so a broker, a shard or a worker does not pay for the client it never uses."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import zps


def imported_after(code: str) -> set[str]:
    """The zps modules a fresh interpreter holds after running ``code``."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_import_zps_loads_no_client() -> None:
    mods = imported_after("import zps")
    assert "zps.client" not in mods
    assert "numpy" not in mods


@pytest.mark.parametrize("role", ["zps.broker.broker", "zps.shard.server"])
def test_server_process_imports_no_client(role: str) -> None:
    mods = imported_after(f"import zps.cli.main, {role}")
    assert not {m for m in mods if m == "zps.client" or m.startswith("zps.client.")}


def test_top_level_names_load_on_first_use() -> None:
    from zps import Client, SyncClient, ZpsError, errors, init, optim

    assert zps.connect.__module__ == "zps.client.client"
    assert zps.connect_sync.__module__ == "zps.client.sync"
    assert Client.__name__ == "Client" and SyncClient.__name__ == "SyncClient"
    assert ZpsError is errors.ZpsError and zps.ZpsTimeoutError is errors.ZpsTimeoutError
    assert init.__name__ == "zps.init" and optim.SGD.__module__ == "zps.optim"
    assert set(zps.__all__) <= set(dir(zps))


def test_unknown_top_level_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'conect'"):
        _ = zps.conect  # type: ignore[attr-defined]


def test_test_processes_cache_their_bytecode_outside_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zps.testing.bytecode import cache_bytecode

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    prefix = cache_bytecode(env)
    assert prefix is not None and prefix.parent == tmp_path
    assert env == {"PYTHONPYCACHEPREFIX": str(prefix)}
    assert stat.S_IMODE(prefix.stat().st_mode) == 0o700
    chosen = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/elsewhere"}
    assert cache_bytecode(chosen) is None and chosen["PYTHONPYCACHEPREFIX"] == "/elsewhere"
    assert cache_bytecode({}) is None
    prefix.chmod(0o777)  # a directory others may write to is not used
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    assert cache_bytecode(env) is None and env == {"PYTHONDONTWRITEBYTECODE": "1"}


@pytest.mark.parametrize("role", ["zps.broker.broker", "zps.broker.router", "zps.shard.server"])
def test_a_server_imports_prometheus_only_for_its_metrics(role: str) -> None:
    mods = imported_after(f"import zps.cli.main, {role}")
    assert not {m for m in mods if m.split(".")[0] == "prometheus_client"}
    served = imported_after(
        "from zps.ops.config import Metrics\n"
        "from zps.ops.metrics import MetricsServer, counter\n"
        "server = MetricsServer(Metrics(), lambda: [counter('zps_x', 'x', 1.0)])\n"
        "assert b'zps_x_total 1.0' in __import__('prometheus_client').generate_latest("
        "server.registry)"
    )
    assert "prometheus_client" in served
