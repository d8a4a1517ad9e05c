"""Export and import with real processes: a model trained on one cluster, exported while
training goes on (each partition cut at one LSN), exported again through the command line,
read back with numpy alone, imported into a fresh cluster with identical values, exported
offline from the SIGKILLed cluster's data dirs with the same values; on-demand checkpoints
from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from zps.core.routing import split_by_partition
from zps.errors import TableConflictError
from zps.init import Normal
from zps.model.format import apply_delta
from zps.optim import SGD, Adam
from zps.testing import DataDirCluster, LocalCluster, free_port

HB = 0.1
LIVENESS = 20


def cli(c: LocalCluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zps", *args],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def read_export(path: Path) -> dict[str, Any]:
    """An export read with json and numpy only: {name: values} / {name: {id: row}}."""
    manifest = json.loads((path / "manifest.json").read_text())
    out: dict[str, Any] = {}
    for t in manifest["tables"]:
        values = np.load(path / t["files"]["values"])
        if t["kind"] == "dense":
            assert list(values.shape) == t["shape"]
            out[t["name"]] = values
        else:
            ids = np.load(path / t["files"]["ids"])
            assert ids.shape == (t["rows"],) and values.shape == (t["rows"], t["dim"])
            out[t["name"]] = dict(zip(ids.tolist(), values, strict=True))
    return out


def read_state(path: Path) -> dict[str, Any]:
    """An export's optimizer state read with json and numpy only: {name: {column:
    array}} for dense tensors, {name: {column: {id: row}}} for embedding tables."""
    manifest = json.loads((path / "manifest.json").read_text())
    out: dict[str, Any] = {}
    for t in manifest["tables"]:
        columns = {k: np.load(path / t["files"][f"state.{k}"]) for k in t.get("state", [])}
        if t["kind"] == "embedding":
            ids = np.load(path / t["files"]["ids"]).tolist()
            columns = {k: dict(zip(ids, a, strict=True)) for k, a in columns.items()}
        out[t["name"]] = columns
    return out


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert_same(a[name], b[name])


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        if isinstance(a[name], dict):
            assert sorted(a[name]) == sorted(b[name]), name
            for i in a[name]:
                np.testing.assert_array_equal(a[name][i], b[name][i])
        else:
            np.testing.assert_array_equal(a[name], b[name])


@pytest.fixture
def two_clusters(tmp_path: Path) -> Any:
    made = []

    def make(name: str, **kw: Any) -> DataDirCluster:
        work = tmp_path / name
        work.mkdir()
        c = DataDirCluster(heartbeat_interval=HB, liveness=LIVENESS, workdir=work, **kw)
        c.port = free_port()
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.mark.timeout(180)
def test_train_export_import_round_trip(two_clusters: Any, tmp_path: Path) -> None:
    a = two_clusters("a", partitions=2, replication=1)
    flags = ["--durability", "interval", "--checkpoint-interval", "0"]
    dirs = [tmp_path / f"a-data{i}" for i in range(2)]
    a.start_broker()
    shards = [a.start_shard(d, flags) for d in dirs]
    a.wait_healthy(40)
    rng = np.random.default_rng(3)
    ids = np.unique(rng.integers(0, 2**50, size=5000))
    with zps.connect_sync(a.address, timeout=30) as ps:
        ps.create_dense("m/w", shape=(200, 800), init=Normal(0, 0.1), optimizer=Adam(lr=0.01))
        ps.create_dense("m/b", shape=(5,), optimizer=SGD(lr=0.5))
        ps.create_embedding("m/e", dim=16, init=Normal(0, 0.1), optimizer=Adam(lr=0.05))
        ps.create_embedding("live", dim=4, optimizer=SGD(lr=1.0))
        for step in range(5):  # "training"
            batch = rng.choice(ids, 1000, replace=False)
            ps.push_rows("m/e", batch, rng.normal(size=(1000, 16)))
            ps.push_dense("m/w", rng.normal(size=(200, 800)))
            ps.push_dense("m/b", np.full(5, float(step)))
        # "live": every push adds -1 to all its rows, one message per partition; a cut
        # of a partition therefore has equal rows, however many pages it is read in
        live_ids = np.arange(3000, dtype=np.int64) * 104729
        ps.push_rows("live", live_ids, np.ones((3000, 4)))

    stop = threading.Event()
    pushes = [0]

    def train() -> None:
        with zps.connect_sync(a.address, timeout=30) as w:
            while not stop.is_set():
                w.push_rows("live", live_ids, np.ones((3000, 4)))
                pushes[0] += 1

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        # a small message budget: "live" is read in about 150 pages per partition
        with zps.connect_sync(a.address, timeout=30, message_budget=4096) as ps:
            while pushes[0] < 3:
                stop.wait(0.01)
            before = pushes[0]
            manifest = ps.export_model(tmp_path / "live-export", tables=["live"])
            during = pushes[0] - before
    finally:
        stop.set()
        trainer.join(30)
    assert during >= 1, "training did not go on during the export"
    live = read_export(tmp_path / "live-export")["live"]
    assert sorted(live) == sorted(live_ids.tolist())
    with zps.connect_sync(a.address, timeout=30) as ps:
        cmap = ps.cluster_map
        final = ps.pull_rows("live", live_ids)
    for p, pos in split_by_partition(live_ids, cmap):
        values = {float(live[int(i)][0]) for i in live_ids[pos]}
        assert len(values) == 1, f"partition {p}: rows of one cut differ: {sorted(values)[:5]}"
        assert values.pop() > final[pos[0], 0]  # the cut is older than the end of training
    assert set(manifest["partitions"]) == {"0", "1"}

    # the command line: an on-demand checkpoint, then an export of the quiet cluster
    r = cli(a, "checkpoint", "--broker", a.address)
    assert r.returncode == 0, r.stderr
    assert "partition 0: LSN" in r.stdout and "partition 1: LSN" in r.stdout, r.stdout
    out = tmp_path / "export"
    r = cli(a, "export", "--broker", a.address, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "exported 4 tables" in r.stdout
    exported = read_export(out)
    with zps.connect_sync(a.address, timeout=30) as ps:
        np.testing.assert_array_equal(exported["m/w"], ps.pull_dense("m/w"))
        np.testing.assert_array_equal(exported["m/b"], ps.pull_dense("m/b"))
        e_ids = np.concatenate(list(ps.table_ids("m/e")))
        assert sorted(exported["m/e"]) == sorted(e_ids.tolist())
        rows = ps.pull_rows("m/e", e_ids)
        for i, row in zip(e_ids.tolist(), rows, strict=True):
            np.testing.assert_array_equal(exported["m/e"][i], row)
    r = cli(a, "export", "--broker", a.address, "--out", str(out))
    assert r.returncode == 1 and "already holds an export" in r.stderr

    # import into a fresh cluster: identical values, specs included
    b = two_clusters("b", partitions=3, replication=1, shards=3)
    b.start()
    r = cli(b, "import", "--broker", b.address, "--in", str(out))
    assert r.returncode == 0, r.stderr
    with zps.connect_sync(b.address, timeout=30) as ps:
        assert ps.list_tables() == ["live", "m/b", "m/e", "m/w"]
        assert ps.describe("m/e")["spec"].optimizer == Adam(lr=0.05)
        assert ps.describe("m/e")["rows"] == len(exported["m/e"])
        b_out = tmp_path / "b-export"
        ps.export_model(b_out)
        # importing again into the same tables is a warm start too; a different spec conflicts
        ps.drop_table("m/b")
        ps.create_dense("m/b", shape=(6,))
        with pytest.raises(TableConflictError, match=r"'m/b'.*shape"):
            ps.import_model(out)
    assert_same(read_export(b_out), exported)
    # the optimizer state went along, row by row across another partition count
    state = read_state(out)
    assert sorted(state["m/e"]) == ["m", "step", "v"] and state["m/b"] == {}
    assert_same_state(read_state(b_out), state)

    # a delta: what changed since the export, applied to it, is a full export again
    with zps.connect_sync(a.address, timeout=30) as ps:
        touched = np.concatenate([e_ids[:40], [3, 4, 5]])  # 40 present ids, 3 new ones
        ps.push_rows("m/e", touched, np.ones((touched.size, 16)))
        ps.set_dense("m/b", np.arange(5, dtype=np.float32))
        ps.set_rows("m/e", e_ids[40:41], np.asarray([exported["m/e"][int(e_ids[40])]]))  # same
        assert ps.drop_table("live")
    delta, full2 = tmp_path / "delta", tmp_path / "full2"
    r = cli(a, "export", "--broker", a.address, "--since", str(out), "--out", str(delta))
    assert r.returncode == 0, r.stderr
    r = cli(a, "export", "--broker", a.address, "--out", str(full2))
    assert r.returncode == 0, r.stderr
    dm = json.loads((delta / "manifest.json").read_text())
    assert dm["dropped"] == ["live"] and dm["delta_of"]["path"] == str(out)
    tables = {t["name"]: t for t in dm["tables"]}
    assert sorted(tables) == ["m/b", "m/e"]  # m/w did not change
    assert tables["m/e"]["rows"] == touched.size
    apply_delta(out, delta, tmp_path / "applied")
    latest = read_export(full2)
    assert_same(read_export(tmp_path / "applied"), latest)

    # offline, from the data dirs of the SIGKILLed cluster (checkpoint + log replay)
    for proc in [*shards, a.broker()]:
        os.kill(proc.pid, signal.SIGKILL)
        proc.popen.wait(10)
    off = tmp_path / "offline"
    r = cli(a, "export", "--data-dir", *map(str, dirs), "--out", str(off))
    assert r.returncode == 0, r.stderr
    assert_same(read_export(off), latest)  # every acknowledged write, from checkpoints and logs
    assert_same_state(read_state(off), read_state(full2))  # the optimizer state too
    bare = tmp_path / "values-only"
    r = cli(a, "export", "--data-dir", *map(str, dirs), "--values-only", "--out", str(bare))
    assert r.returncode == 0, r.stderr
    assert read_state(bare) == {name: {} for name in read_export(bare)}
    assert_same(read_export(bare), latest)
    half = tmp_path / "half"
    r = cli(a, "export", "--data-dir", str(dirs[0]), "--partitions", "2", "--out", str(half))
    assert r.returncode == 1, r.stdout
    assert "no copy of partitions [1]" in r.stderr or "no copy of partitions [0]" in r.stderr


def test_torch_module_from_an_export(cluster: LocalCluster, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from zps.torch import ParameterServerModule, state_dict_from_export

    torch.manual_seed(0)
    pretrained = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Linear(3, 1))
    want = {k: v.detach().clone() for k, v in pretrained.state_dict().items()}
    with zps.connect_sync(cluster.address, timeout=30) as ps:
        # one worker uploads a pretrained module's values; another one sees them
        ParameterServerModule(pretrained, ps, "tx/a", optimizer=SGD(lr=0.1), upload=True)
        fresh = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Linear(3, 1))
        other = ParameterServerModule(fresh, ps, "tx/a", create=False)
        for k, v in fresh.state_dict().items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0)
        del other
        ps.export_model(tmp_path / "tx", tables=[f"tx/a/{k}" for k in want])
        state = state_dict_from_export(tmp_path / "tx", "tx/a")
        assert sorted(state) == sorted(want)
        # a module under another prefix loads the export onto the servers
        third = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Linear(3, 1))
        loaded = ParameterServerModule(third, ps, "tx/b", optimizer=SGD(lr=0.1))
        assert sorted(loaded.load_export(tmp_path / "tx", prefix="tx/a")) == sorted(want)
        for k, v in third.state_dict().items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0)
            np.testing.assert_array_equal(ps.pull_dense(f"tx/b/{k}"), want[k].numpy())


async def test_an_export_whose_cut_is_gone_starts_again(
    cluster: LocalCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cut can vanish under an export (a failover, or newer cuts: a shard keeps two):
    the export notices and starts again from new cuts, and the result is whole."""
    import asyncio

    ids = np.arange(4000, dtype=np.int64) * 7
    async with zps.connect(cluster.address, timeout=30) as ps:
        await ps.create_embedding("again/e", dim=8)
        await ps.set_rows("again/e", ids, np.tile(ids[:, None].astype(np.float32), (1, 8)))
    out = tmp_path / "again"
    async with (
        zps.connect(cluster.address, timeout=30, message_budget=2048) as slow,
        zps.connect(cluster.address, timeout=30) as other,
    ):
        task = asyncio.create_task(slow.export_model(out, tables=["again/e"]))
        for _ in range(500):  # until the export reads its cuts
            if any((out / "tables").glob("*/values.npy")):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the export never started writing")
        n = other.cluster_map.n_partitions
        for _ in range(2):  # two newer cuts on every partition drop the export's
            await asyncio.gather(*(other.connection.submit(p, {"op": "cut"}, {}) for p in range(n)))
        await asyncio.wait_for(task, 60)
    assert "take a new cut" in caplog.text and "starting again" in caplog.text
    got = read_export(out)["again/e"]
    assert sorted(got) == ids.tolist()
    for i in ids[::97].tolist():
        np.testing.assert_array_equal(got[i], np.full(8, float(i)))


@pytest.mark.timeout(240)
def test_exports_during_a_live_scale_hold_every_row_once(tmp_path: Path) -> None:
    """Exports taken back to back while the cluster scales from 2 to 4 partitions and
    back: each holds every row once and every chunk, with their values, whichever moves
    its cuts met (a partition added and not serving yet, a cut in a move's cut-over)."""
    ids = np.arange(30_000, dtype=np.int64) * 13
    rows = np.tile(ids[:, None].astype(np.float32), (1, 4))
    dense = np.arange(300_000, dtype=np.float32)  # five chunks
    exports = 0
    with (
        LocalCluster(partitions=2, shards=4, broker_data_dir=tmp_path / "broker") as c,
        zps.connect_sync(c.address, timeout=30) as ps,
    ):
        ps.create_embedding("moving", dim=4)
        ps.set_rows("moving", ids, rows)
        ps.create_dense("moving_w", dense.size)
        ps.set_dense("moving_w", dense)
        for target in (4, 2):
            answer = c.scale(target)
            assert answer["ok"], answer
            resharding = True
            while resharding:
                resharding = (c.status().get("reshard") or {}).get("target") is not None
                out = tmp_path / f"e{exports}"
                ps.export_model(out)
                got = read_export(out)
                assert sorted(got["moving"]) == ids.tolist()
                for i in ids[::499].tolist():
                    np.testing.assert_array_equal(got["moving"][i], np.full(4, float(i)))
                np.testing.assert_array_equal(got["moving_w"], dense)
                exports += 1
            assert c.wait_resharded(target, 120)["n_partitions"] == target
