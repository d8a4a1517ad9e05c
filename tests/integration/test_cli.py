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


def test_status_table_lists_jobs_and_workers() -> None:
    with (
        LocalCluster(partitions=1, shards=1) as c,
        zps.connect_sync(c.address, mode="sync", name="trainer") as ps,
    ):
        ps.create_job("adult", 100, 10, epochs=2)
        ps.task_done(ps.next_task("adult"))
        ps.clock()
        ps.next_task("adult")  # held: running
        ps.report(rows=10, loss=0.5)
        node = ps.client.client_id.decode()
        # the report reaches the broker with the worker's next heartbeat
        c.wait_for(lambda s: "adult" in s["training"]["history"], 20, "the report")
        out = run([sys.executable, "-m", "zps", "status", "--broker", c.address])
    assert out.returncode == 0, out.stderr
    assert re.search(
        r"^2 client\(s\) connected; training: sync mode, step \d+ committed, 1 worker\(s\) "
        r"on the step clock$",
        out.stdout,
        re.M,
    ), out.stdout
    assert re.search(rf"^  {node}\s+trainer\s+\S+\s+\d+\s+1\s+\S+$", out.stdout, re.M), out.stdout
    assert re.search(
        r"^JOB\s+STATE\s+EPOCH\s+TASKS DONE\s+RUNNING\s+RETRIED\s+EPOCH ETA\s+LOSS\s+ROWS/S$",
        out.stdout,
        re.M,
    ), out.stdout
    assert re.search(
        r"^adult\s+running\s+1/2\s+1/20\s+1\s+0\s+[\d.]+s\s+0\.5\s+[\d.]+$", out.stdout, re.M
    ), out.stdout


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


def _zps(*args: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "zps", *args])


def test_keygen_refuses_to_overwrite_or_to_create_directories(tmp_path: Path) -> None:
    out_dir = tmp_path / "keys"
    secret, public = out_dir / "h1.key_secret", out_dir / "h1.key"

    out = _zps("keygen", "--out", str(out_dir), "--name", "h1")
    assert out.returncode == 1 and f"directory {out_dir} does not exist" in out.stderr, out
    assert not out_dir.exists()

    out = _zps("keygen", "--out", str(out_dir), "--name", "h1", "--parents")
    assert out.returncode == 0, out.stderr
    assert secret.stat().st_mode & 0o077 == 0 and public.is_file()
    first = secret.read_bytes(), public.read_bytes()

    out = _zps("keygen", "--out", str(out_dir), "--name", "h1")
    assert out.returncode == 1, out
    assert f"{secret} exists: not overwritten" in out.stderr and "--force" in out.stderr
    assert (secret.read_bytes(), public.read_bytes()) == first
    assert sorted(p.name for p in out_dir.iterdir()) == ["h1.key", "h1.key_secret"]

    out = _zps("keygen", "--out", str(out_dir), "--name", "h1", "--force")
    assert out.returncode == 0, out.stderr
    assert secret.read_bytes() != first[0] and public.read_bytes() != first[1]
    assert secret.stat().st_mode & 0o077 == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["h1.key", "h1.key_secret"]

    out = _zps("keygen", "--out", str(out_dir), "--name", "../escape")
    assert out.returncode == 2 and "key name" in out.stderr, out


def test_check_config_validates_offline(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[shard]\nbroker = "tcp://ps-broker:5555"\n[metrics]\nport = 9100\n')
    out = _zps("check-config", str(good))
    assert (out.returncode, out.stdout.strip()) == (0, f"{good}: ok"), out
    assert _zps("check-config", str(ROOT / "deploy" / "zps.toml")).returncode == 0

    for text, named in [
        ("[shard]\nreplication_bindd = 'tcp://*:1'\n", "replication_bindd"),
        ("[metrics]\nport = -1\n", "metrics.port"),
        ("[shard]\nname = 'a b'\n", "shard.name"),
        ("[broker]\npartitions = 'four'\n", "partitions"),
        ("[sharrd]\n", "sharrd"),
        ("not toml = = \n", "not valid TOML"),
        (
            f"[security]\ncurve_secret_key_file = '{tmp_path}/none.key_secret'\n"
            f"curve_public_key_file = '{tmp_path}/none.key'\n",
            "security.curve_public_key_file",
        ),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        out = _zps("check-config", str(bad))
        assert out.returncode == 1, (text, out)
        assert out.stderr.startswith(f"{bad}: invalid: ") and named in out.stderr, (text, out)
    out = _zps("check-config", str(tmp_path / "missing.toml"))
    assert out.returncode == 1 and "does not exist" in out.stderr
