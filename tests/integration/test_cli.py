"""The command lines, run as real processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

import zps
from zps.testing import LocalCluster, free_port

ROOT = Path(__file__).resolve().parents[2]


def run(
    args: list[str], cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=LocalCluster().env()
    )


def test_status_json_and_table(cluster: LocalCluster) -> None:
    out = run([sys.executable, "-m", "zps", "status", "--broker", cluster.address, "--json"])
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [p["partition"] for p in report["partitions"]] == [0, 1]
    assert all(p["state"] == "ok" and p["epoch"] >= 1 for p in report["partitions"])
    shard_pids = {p.pid for p in cluster.procs if p.name.startswith("shard")}
    assert {s["pid"] for s in report["shards"]} == shard_pids
    assert all(s["role"] == "primary" and s["host"] for s in report["shards"])
    assert any(c["name"] == "zps-server status" for c in report["clients"])

    # The installed console script and the source-checkout script, each under the test's own
    # interpreter (never whatever `python3` a shebang would find first on PATH).
    console_script = Path(sys.executable).with_name("zps-server")
    for argv in ([str(console_script)], [sys.executable, str(ROOT / "bin" / "zps-server")]):
        table = run([*argv, "status", "--broker", cluster.address])
        assert table.returncode == 0, table.stderr
        assert re.search(r"^\s+0\s+\d+\s+ok\s+s-", table.stdout, re.M), table.stdout
        for pid in shard_pids:
            assert str(pid) in table.stdout


def test_status_of_a_missing_broker_is_a_clear_error() -> None:
    out = run(
        [
            sys.executable,
            "-m",
            "zps",
            "status",
            "--broker",
            f"tcp://127.0.0.1:{free_port()}",
            "--timeout",
            "0.5",
        ]
    )
    assert out.returncode == 1
    assert "no answer from the broker" in out.stderr


def test_worker_runs_sync_and_async_functions(cluster: LocalCluster, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(
        textwrap.dedent("""
        import numpy as np
        import zps

        def train(ps, name, times):
            ps.create_dense(name, shape=(4,), dtype="float64",
                            optimizer=zps.optim.SGD(lr=1.0))
            for _ in range(int(times)):
                ps.push_dense(name, np.ones(4))
            print("pushed", times)

        async def atrain(ps, name):
            await ps.create_embedding(name, dim=2, dtype="float64",
                                      optimizer=zps.optim.SGD(lr=1.0))
            await ps.push_rows(name, [1, 1, 2], np.ones((3, 2)))

        def fail(ps):
            ps.pull_dense("no-such-table")
    """)
    )
    worker = [sys.executable, "-m", "zps.worker_entry", "--broker", cluster.address]
    out = run([*worker, "job:train", "cli-dense", "3"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "pushed 3" in out.stdout
    out = run([*worker, "job:atrain", "cli-emb"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    with zps.connect_sync(cluster.address) as ps:
        np.testing.assert_array_equal(ps.pull_dense("cli-dense"), [-3.0] * 4)
        np.testing.assert_array_equal(ps.pull_rows("cli-emb", [1, 2]), [[-2, -2], [-1, -1]])

    out = run([*worker, "job:fail"], cwd=tmp_path)
    assert (
        out.returncode == 1 and "UnknownTableError" in out.stderr and "no-such-table" in out.stderr
    )
    out = run([*worker, "job:missing"], cwd=tmp_path)
    assert out.returncode == 2 and "has no function 'missing'" in out.stderr
    out = run([*worker, "nomodule:f"], cwd=tmp_path)
    assert out.returncode == 2 and "cannot import module 'nomodule'" in out.stderr
    out = run([*worker, "no-colon"], cwd=tmp_path)
    assert out.returncode == 2 and "MODULE:FUNCTION" in out.stderr


def test_worker_without_a_broker_fails_clearly(tmp_path: Path) -> None:
    out = run(
        [
            sys.executable,
            "-m",
            "zps.worker_entry",
            "--broker",
            f"tcp://127.0.0.1:{free_port()}",
            "--connect-timeout",
            "0.5",
            "json:dumps",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 1
    assert "no answer from the broker" in out.stderr


def test_bad_flags_are_errors() -> None:
    out = run([sys.executable, "-m", "zps", "broker", "--partitions", "0"])
    assert out.returncode == 2 and "partitions" in out.stderr
    out = run([sys.executable, "-m", "zps", "broker", "--bind", "nonsense"])
    assert out.returncode == 2 and "bind" in out.stderr


def test_demo_trains_to_the_target_auc() -> None:
    out = run([sys.executable, "-m", "zps", "demo"], timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    auc = float(re.search(r"test AUC\s+([0-9.]+)", out.stdout).group(1))
    assert auc >= 0.90, out.stdout
