"""Full-state exports with real processes: a model trained with Adam, Adagrad and FTRL,
exported with its optimizer state (the default) and imported into a fresh cluster,
continues bit for bit as the cluster that never stopped (also once the copy it was
imported into has failed over); ``--values-only`` leaves the
state out; an export without state imports with the state reset, said in a log line."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.model.format import Export
from zps.optim import FTRL, Adagrad, Adam, Optimizer
from zps.testing import DataDirCluster, LocalCluster, free_port

OPTIMIZERS: dict[str, Optimizer] = {
    "adam": Adam(lr=0.01),
    "adagrad": Adagrad(lr=0.05),
    "ftrl": FTRL(alpha=0.1, l1=0.001, l2=0.01),
}
DIM = 4
IDS = np.arange(0, 400, dtype=np.int64) * 7919  # spread over both partitions
DENSE = 100_000  # two chunks (65536 and 34464 elements) on the two partitions


def cli(c: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zps", *args, "--broker", c.address],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def clusters() -> Iterator[tuple[LocalCluster, LocalCluster]]:
    """The original cluster (two partitions), and one to import into: one partition,
    two copies and a spare, so that the imported state is seen to be replicated."""
    with (
        LocalCluster(partitions=2, shards=2) as a,
        LocalCluster(partitions=1, shards=3, replication=2) as b,
    ):
        b.wait_healthy()
        yield a, b


def steps(ps: zps.SyncClient, seed: int, n: int) -> None:
    """``n`` steps of the same gradients for the same seed: each pushes to a random half
    of the rows (lazy updates: rows at different step counts) and to the dense tensor."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        for name in OPTIMIZERS:
            ids = rng.choice(IDS, size=IDS.size // 2, replace=False)
            grads = rng.normal(size=(ids.size, DIM)).astype(np.float32)
            ps.push_rows(f"emb_{name}", ids, grads)
            ps.push_dense(f"w_{name}", rng.normal(size=DENSE).astype(np.float32))
    ps.flush()


def model(ps: zps.SyncClient) -> dict[str, bytes]:
    out = {}
    for name in OPTIMIZERS:
        out[f"emb_{name}"] = ps.pull_rows(f"emb_{name}", IDS).tobytes()
        out[f"w_{name}"] = ps.pull_dense(f"w_{name}").tobytes()
    return out


@pytest.mark.timeout(300)
def test_adam_adagrad_ftrl_continue_bit_for_bit_after_export_and_import(
    clusters: tuple[LocalCluster, LocalCluster], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = clusters
    with zps.connect_sync(a.address) as pa:
        for name, opt in OPTIMIZERS.items():
            pa.create_embedding(f"emb_{name}", DIM, optimizer=opt, seed=3)
            pa.create_dense(f"w_{name}", DENSE, optimizer=opt, seed=4)
        steps(pa, seed=1, n=3)

        out = cli(a, "export", "--out", str(tmp_path / "full"))
        assert out.returncode == 0, out.stderr
        full = Export(tmp_path / "full")
        for name, opt in OPTIMIZERS.items():
            for table in (f"emb_{name}", f"w_{name}"):
                state = full.state(table)
                assert state is not None and sorted(state) == sorted(opt.state_widths(1))
        assert np.asarray(full.state("emb_adam")["step"]).max() == 3  # type: ignore[index]

        with zps.connect_sync(b.address) as pb:
            pb.import_model(tmp_path / "full")
            assert model(pb) == model(pa)  # the values as exported
            steps(pa, seed=2, n=2)
            steps(pb, seed=2, n=2)
            # the same gradients on both: equal bit for bit, the optimizer state as well
            assert model(pb) == model(pa)

            # the set state was replicated: the replica taking over continues the same
            primary = b.shard_pid(0)
            b.kill(primary)
            b.wait_gone(primary)
            b.wait_healthy()
            steps(pa, seed=3, n=1)
            steps(pb, seed=3, n=1)
            assert model(pb) == model(pa)

            # values only: no state files, and an import resets the state (Adam then
            # takes other steps than the cluster that kept its state)
            out = cli(a, "export", "--values-only", "--out", str(tmp_path / "values"))
            assert out.returncode == 0, out.stderr
            manifest = json.loads((tmp_path / "values" / "manifest.json").read_text())
            assert all("state" not in t for t in manifest["tables"])
            assert not list((tmp_path / "values").rglob("state-*.npy"))
            with caplog.at_level(logging.WARNING, logger="zps.export"):
                pb.import_model(tmp_path / "values")
            assert "import of 'emb_adam'" in caplog.text
            assert "carries no optimizer state; adam starts afresh" in caplog.text
            assert model(pb) == model(pa)
            steps(pa, seed=5, n=1)
            steps(pb, seed=5, n=1)
            assert model(pb)["emb_adam"] != model(pa)["emb_adam"]


@pytest.mark.timeout(180)
def test_an_export_without_state_imports_with_the_state_reset(
    clusters: tuple[LocalCluster, LocalCluster], tmp_path: Path
) -> None:
    """An export as zps wrote them before state was exported (no ``state`` in the
    manifest, no state files): the values are set and Adam starts afresh, exactly as
    a fresh row with those values would."""
    a, b = clusters
    with zps.connect_sync(a.address) as pa:
        pa.create_embedding("old", DIM, optimizer=Adam(lr=0.01), seed=5)
        rng = np.random.default_rng(9)
        pa.push_rows("old", IDS, rng.normal(size=(IDS.size, DIM)).astype(np.float32))
        pa.flush()
        pa.export_model(tmp_path / "old", tables=["old"])
    manifest_path = tmp_path / "old" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for t in manifest["tables"]:  # written the way an older zps wrote it
        for key in [k for k in t["files"] if k.startswith("state.")]:
            (tmp_path / "old" / t["files"].pop(key)).unlink()
        del t["state"]
    manifest_path.write_text(json.dumps(manifest))

    with zps.connect_sync(b.address) as pb:
        assert pb.import_model(tmp_path / "old") == ["old"]
        exported = Export(tmp_path / "old")
        ids, values = np.asarray(exported.ids("old")), np.asarray(exported.values("old"))
        np.testing.assert_array_equal(pb.pull_rows("old", ids), values)
        grads = rng.normal(size=(ids.size, DIM)).astype(np.float32)
        pb.push_rows("old", ids, grads)
        pb.flush()
        expected = values.copy()
        opt = Adam(lr=0.01)
        opt.apply(expected, grads, opt.init_state(ids.size, DIM, np.float32))
        np.testing.assert_array_equal(pb.pull_rows("old", ids), expected)


@pytest.mark.timeout(180)
def test_a_set_with_state_is_logged_and_replayed(
    clusters: tuple[LocalCluster, LocalCluster], tmp_path: Path
) -> None:
    """An import into a shard with a data dir, SIGKILLed: the offline export of its data
    dir (its log replayed, no checkpoint) has the state that was imported."""
    a, _ = clusters
    with zps.connect_sync(a.address) as pa:
        pa.create_embedding("logged", DIM, optimizer=Adagrad(lr=0.1), seed=6)
        pa.create_dense("logged_w", DENSE, optimizer=Adam(lr=0.01), seed=7)
        rng = np.random.default_rng(11)
        for _ in range(2):
            pa.push_rows("logged", IDS[::3], rng.normal(size=(IDS[::3].size, DIM)))
            pa.push_dense("logged_w", rng.normal(size=DENSE).astype(np.float32))
        pa.flush()
        pa.export_model(tmp_path / "src", tables=["logged", "logged_w"])
    work = tmp_path / "c"
    work.mkdir()
    c = DataDirCluster(partitions=1, shards=1, workdir=work)
    c.port = free_port()
    try:
        c.start_broker()
        shard = c.start_shard(
            tmp_path / "data", ["--durability", "fsync", "--checkpoint-interval", "0"]
        )
        c.wait_healthy()
        with zps.connect_sync(c.address) as pc:
            pc.import_model(tmp_path / "src")
        os.kill(shard.pid, signal.SIGKILL)
        shard.popen.wait(10)
    finally:
        c.stop()
    out = subprocess.run(
        [sys.executable, "-m", "zps", "export", "--data-dir", str(tmp_path / "data"),
         "--out", str(tmp_path / "offline")],
        env=c.env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    src, off = Export(tmp_path / "src"), Export(tmp_path / "offline")
    src_state, off_state = src.state("logged"), off.state("logged")
    assert src_state is not None and off_state is not None
    order = np.argsort(np.asarray(src.ids("logged")))
    back = np.argsort(np.asarray(off.ids("logged")))
    for k, column in src_state.items():
        np.testing.assert_array_equal(np.asarray(column)[order], np.asarray(off_state[k])[back])
    dense_src, dense_off = src.state("logged_w"), off.state("logged_w")
    assert dense_src is not None and dense_off is not None
    for k, column in dense_src.items():
        np.testing.assert_array_equal(column, dense_off[k])


@pytest.mark.timeout(240)
def test_an_offline_export_after_a_scale_down_holds_each_row_once(tmp_path: Path) -> None:
    """Scaled from 2 partitions to 1, the cluster stopped: the removed partition's copy
    stays in its data dir, and the offline export of both data dirs (no --partitions)
    equals the online export taken after the scale, state and all."""
    work = tmp_path / "c"
    work.mkdir()
    c = DataDirCluster(partitions=2, shards=2, workdir=work, broker_data_dir=tmp_path / "broker")
    c.port = free_port()
    dirs = [tmp_path / "a", tmp_path / "b"]
    try:
        c.start_broker()
        for d in dirs:
            c.start_shard(d, ["--checkpoint-interval", "0"])
        c.wait_healthy()
        with zps.connect_sync(c.address) as ps:
            ps.create_embedding("emb", DIM, optimizer=Adagrad(lr=0.1), seed=6)
            ps.create_dense("w", DENSE, optimizer=Adam(lr=0.01), seed=7)
            rng = np.random.default_rng(12)
            for _ in range(3):
                ps.push_rows("emb", IDS, rng.normal(size=(IDS.size, DIM)))
                ps.push_dense("w", rng.normal(size=DENSE).astype(np.float32))
            ps.flush()
            answer = c.scale(1)
            assert answer["ok"], answer
            c.wait_resharded(1, 120)
            ps.export_model(tmp_path / "online")
    finally:
        c.stop()
    out = subprocess.run(
        [sys.executable, "-m", "zps", "export", "--data-dir", *map(str, dirs),
         "--out", str(tmp_path / "offline")],
        env=c.env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    online, offline = Export(tmp_path / "online"), Export(tmp_path / "offline")
    assert list(offline.manifest["partitions"]) == ["0"]  # partition 1 was removed
    on_ids, off_ids = np.asarray(online.ids("emb")), np.asarray(offline.ids("emb"))
    assert sorted(on_ids.tolist()) == sorted(off_ids.tolist()) == sorted(IDS.tolist())
    a, b = np.argsort(on_ids), np.argsort(off_ids)
    np.testing.assert_array_equal(np.asarray(online.values("emb"))[a], offline.values("emb")[b])
    on_state, off_state = online.state("emb"), offline.state("emb")
    assert on_state is not None and off_state is not None
    for k, column in on_state.items():
        np.testing.assert_array_equal(np.asarray(column)[a], np.asarray(off_state[k])[b])
    np.testing.assert_array_equal(online.values("w"), offline.values("w"))
    w_on, w_off = online.state("w"), offline.state("w")
    assert w_on is not None and w_off is not None
    for k, column in w_on.items():
        np.testing.assert_array_equal(column, w_off[k])
