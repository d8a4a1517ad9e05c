"""Checkpoints on disk, with real processes: written on SIGTERM and periodically,
restored at start, a corrupt newest file skipped, old files pruned."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.optim import SGD, Adagrad, Adam
from zps.testing import DataDirCluster, Proc

HB = 0.1  # heartbeat interval of every process here
#: silent heartbeats before a peer is dead: 2 s, so a loaded 2-core machine (other test
#: runs, 5+ processes) does not fake deaths; SIGKILLs are still seen at once (zmq drops
#: the route)
LIVENESS = 20


def ckpt_files(data_dir: Path) -> list[Path]:
    """Checkpoint files of a data dir, oldest first (by LSN in the name)."""
    return sorted(data_dir.glob("partition-*/ckpt-*.zps"), key=lambda p: p.name)


def parse_name(path: Path) -> tuple[int, int]:
    m = re.fullmatch(r"ckpt-(\d+)-(\d+)\.zps", path.name)
    assert m, path
    return int(m.group(1)), int(m.group(2))


def poll(condition: Callable[[], object], timeout: float, what: str) -> object:
    """Wait until ``condition()`` is truthy (files on disk, log lines): no status to ask."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def terminate(procs: Sequence[Proc], timeout: float = 20.0) -> dict[str, int]:
    """SIGTERM all at once, then collect the exit codes."""
    for p in procs:
        p.popen.send_signal(signal.SIGTERM)
    codes = {}
    for p in procs:
        try:
            codes[p.name] = p.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait(5)
            codes[p.name] = -9
    return codes


def written(proc: Proc) -> list[Path]:
    """Checkpoint paths a shard logged as written, in order."""
    return [Path(m) for m in re.findall(r"written to (\S+) in ", proc.log())]


# -- a whole cluster stopped and started again --------------------------------


def test_sigterm_everything_then_restart_restores_identical_state(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=2, replication=2)
    dirs = [tmp_path / f"data{i}" for i in range(4)]
    broker = c.start_broker()
    shards = [c.start_shard(d, ["--checkpoint-interval", "0"]) for d in dirs]
    c.wait_healthy(30)

    rng = np.random.default_rng(3)
    ids = np.arange(0, 2000, 7, dtype=np.int64)
    with zps.connect_sync(c.address, timeout=20) as ps:
        # 100k float32 = 400 KB: chunked over both partitions; Adam keeps per-element state
        ps.create_dense(
            "w", shape=(100_000,), init=zps.init.Normal(0, 0.1), optimizer=Adam(lr=0.01)
        )
        ps.create_embedding("emb", dim=8, init=zps.init.Uniform(-0.1, 0.1), optimizer=Adagrad(0.1))
        ps.create_dense("bias", shape=(3,), dtype="float64", optimizer=SGD(lr=1.0))
        for _ in range(15):
            ps.push_dense("w", rng.standard_normal(100_000).astype(np.float32))
            batch = rng.choice(ids, 64)
            ps.push_rows("emb", batch, rng.standard_normal((64, 8)).astype(np.float32))
            ps.push_dense("bias", np.ones(3))
        before = ps.checksums()
        w_before = ps.pull_dense("w")
        emb_before = ps.pull_rows("emb", ids)
        bias_before = ps.pull_dense("bias")
    assert set(before) == {0, 1} and all(v["lsn"] > 0 for v in before.values())

    codes = terminate([*shards, broker])
    assert codes == dict.fromkeys(codes, 0), f"{codes}\n{c.logs()}"
    held: dict[int, int] = {0: 0, 1: 0}
    for d, s in zip(dirs, shards, strict=True):
        files = ckpt_files(d)
        assert len(files) == 1, f"{d}: {files}\n{s.log()}"  # interval 0: only the final one
        part = int(files[0].parent.name.removeprefix("partition-"))
        held[part] += 1
        assert parse_name(files[0])[1] == before[part]["lsn"], files[0]
        assert written(s) == files, s.log()
    assert held == {0: 2, 1: 2}

    # Shards first (they reconnect until the broker is there), then the broker on the
    # same port with its default start-up grace (two liveness timeouts: 2 x 0.1 s x 20 = 4 s).
    shards2 = [c.start_shard(d, ["--checkpoint-interval", "0"]) for d in dirs]
    broker2 = c.spawn(
        "broker1",
        [sys.executable, "-m", "zps", "broker", "--bind", c.address, "--partitions", "2",
         "--replication", "2", *c.common_args()],
    )  # fmt: skip
    assert broker2.name == c.broker_name()
    c.wait_healthy(30)
    for s in shards2:
        assert re.search(r"restored partition [01] at epoch \d+, LSN \d+ from ", s.log()), s.log()
    with zps.connect_sync(c.address, timeout=20) as ps:
        after = ps.checksums()
        assert after == before
        np.testing.assert_array_equal(ps.pull_dense("w"), w_before)
        np.testing.assert_array_equal(ps.pull_rows("emb", ids), emb_before)
        np.testing.assert_array_equal(ps.pull_dense("bias"), bias_before)
        # and it goes on from there (optimizer state included: same result twice)
        ps.push_dense("bias", np.ones(3))
        np.testing.assert_array_equal(ps.pull_dense("bias"), bias_before - 1)
    status = c.status()
    assert all(p["state"] == "ok" for p in status["partitions"])


# -- a corrupt newest checkpoint -------------------------------------------------


def push_until_checkpoints(
    ps: zps.SyncClient, data_dir: Path, n_files: int, per_round: int, name: str = "w"
) -> None:
    """Push ``per_round`` messages, wait for the periodic checkpoint; until n_files exist."""
    seen = len(ckpt_files(data_dir))
    while seen < n_files:
        for _ in range(per_round):
            ps.push_dense(name, np.ones(4))
        poll(
            lambda seen=seen: len(ckpt_files(data_dir)) > seen,
            10,
            f"a new checkpoint in {data_dir}",
        )
        seen = len(ckpt_files(data_dir))


def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        mid = len(data) // 2
        data[mid : mid + 4] = bytes(b ^ 0xFF for b in data[mid : mid + 4])
    else:
        data = data[: len(data) * 2 // 3]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_newest_checkpoint_is_skipped_and_the_previous_one_restored(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path, how: str
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "data"
    flags = ["--checkpoint-interval", "0", "--checkpoint-every", "3", "--checkpoint-keep", "5"]
    broker = c.start_broker()
    shard = c.start_shard(data, flags)
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        lsn0 = ps.checksums()[0]["lsn"]  # each push after this is one LSN: w = -(lsn - lsn0)
        push_until_checkpoints(ps, data, n_files=3, per_round=3)
        assert shard.alive()
    codes = terminate([shard, broker])
    assert set(codes.values()) == {0}, c.logs()

    files = ckpt_files(data)
    assert len(files) >= 3, files
    newest, previous = files[-1], files[-2]
    epoch, lsn = parse_name(previous)
    assert lsn > lsn0
    corrupt(newest, how)

    c.start_broker(grace=1.0)
    shard2 = c.start_shard(data, flags)
    c.wait_healthy(30)
    log = shard2.log()
    assert f"checkpoint {newest} is unusable" in log, log
    # The previous checkpoint, plus whatever of the write-ahead log after it is still on
    # disk (whether the log was cut at the newest checkpoint depends on timing).
    restored = re.search(
        rf"restored partition 0 at epoch {epoch}, LSN (\d+) from {re.escape(str(previous))}", log
    )
    assert restored, log
    at = int(restored.group(1))
    assert lsn <= at <= parse_name(newest)[1], (lsn, at, newest)
    with zps.connect_sync(c.address, timeout=20) as ps:
        assert ps.checksums()[0]["lsn"] == at
        np.testing.assert_array_equal(ps.pull_dense("w"), np.full(4, -float(at - lsn0)))


# -- periodic checkpoints and pruning ---------------------------------------------


def test_checkpoints_by_update_count_while_running_and_pruned_to_keep(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "data"
    flags = ["--checkpoint-interval", "0", "--checkpoint-every", "4", "--checkpoint-keep", "2"]
    c.start_broker()
    shard = c.start_shard(data, flags)
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        assert ckpt_files(data) == []
        lsn_before = ps.checksums()[0]["lsn"]
        for _ in range(4):
            ps.push_dense("w", np.ones(4))
        # the update trigger fires while running: no SIGTERM, no interval
        first = poll(lambda: ckpt_files(data), 10, "the first periodic checkpoint")
        assert isinstance(first, list) and len(first) == 1
        # Due once 4 LSNs passed since the last checkpoint (none yet: LSN 0), the
        # table's creation among them; written at the LSN of when it was taken.
        assert 4 <= parse_name(first[0])[1] <= lsn_before + 4
        # keep writing: at least 5 checkpoints are written, only the newest 2 stay
        while len(written(shard)) < 5:
            n = len(written(shard))
            for _ in range(4):
                ps.push_dense("w", np.ones(4))
            poll(lambda n=n: len(written(shard)) > n, 10, "another periodic checkpoint")
        assert shard.alive()
        files = ckpt_files(data)
        logged = written(shard)
        assert len(files) == 2, files
        assert files == sorted(logged, key=lambda p: p.name)[-2:]
        assert not any(p.exists() for p in logged[:-2])
        assert not list(data.glob("partition-0/.ckpt-*"))  # no temporary files left


def test_checkpoint_by_interval_while_running(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "data"
    c.start_broker()
    shard = c.start_shard(data, ["--checkpoint-interval", "0.3"])
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.push_dense("w", np.ones(4))
        lsn = ps.checksums()[0]["lsn"]
        files = poll(
            lambda: [p for p in ckpt_files(data) if parse_name(p)[1] == lsn],
            10,
            f"a timed checkpoint at LSN {lsn}",
        )
        assert files
        assert shard.alive()  # written while running: no SIGTERM involved


# -- two restored copies of one partition at different LSNs -----------------------


def test_restart_prefers_the_copy_with_the_newest_checkpoint(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=2)
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    broker = c.start_broker()
    a = c.start_shard(dir_a, ["--checkpoint-interval", "0"])
    c.wait_for(lambda s: s["partitions"][0]["state"] != "unassigned", 30, "a primary")
    b = c.start_shard(dir_b, ["--checkpoint-interval", "0", "--checkpoint-every", "3"])
    c.wait_healthy(30)
    assert c.shard_pid(0) == a.pid
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        push_until_checkpoints(ps, dir_b, n_files=1, per_round=3)  # B (replica) at LSN L1
        c.kill(b.pid)  # B crashes: its newest checkpoint stays at L1
        c.wait_gone(b.pid)
        # Acknowledged by A alone: with one copy left, acks="all" is refused
        # (replication.min_in_sync), so these writes ask for acks=1.
        with zps.connect_sync(c.address, timeout=20, acks=1) as alone:
            for _ in range(10):
                alone.push_dense("w", np.ones(4))
        final = ps.checksums()[0]
        w_final = ps.pull_dense("w")
    codes = terminate([broker, a])  # the broker first: no promotion, A keeps epoch
    assert set(codes.values()) == {0}, c.logs()
    (ckpt_a,) = ckpt_files(dir_a)
    ckpt_b = ckpt_files(dir_b)[-1]
    assert parse_name(ckpt_a)[0] == parse_name(ckpt_b)[0]  # same epoch
    assert parse_name(ckpt_a)[1] == final["lsn"] > parse_name(ckpt_b)[1]

    # The stale copy happens to register first; the newer one a moment later,
    # well inside the start-up hold.
    c.start_broker(grace=5.0)
    b2 = c.start_shard(dir_b, ["--checkpoint-interval", "0"])
    c.wait_for(
        lambda s: any(x["pid"] == b2.pid for x in s["shards"]), 30, "the stale copy to register"
    )
    c.start_shard(dir_a, ["--checkpoint-interval", "0"])
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        np.testing.assert_array_equal(ps.pull_dense("w"), w_final)
        assert ps.checksums()[0] == final


# -- one shard stopped while the others go on ---------------------------------------


@pytest.mark.parametrize("victim", ["replica", "primary"])
def test_a_shard_sigtermed_alone_exits_after_its_final_checkpoint(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path, victim: str
) -> None:
    c = make_cluster(partitions=1, replication=2)
    c.start_broker()
    a = c.start_shard(tmp_path / "a", ["--checkpoint-interval", "0"])
    c.wait_for(lambda s: s["partitions"][0]["state"] != "unassigned", 30, "a primary")
    b = c.start_shard(tmp_path / "b", ["--checkpoint-interval", "0"])
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=30) as ps:
        # 48 MB: the final checkpoint takes a few heartbeat intervals to write
        ps.create_dense("big", shape=(6_000_000,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.push_dense("big", np.ones(6_000_000))
    c.wait_for(
        lambda s: c.healthy(s) and s["partitions"][0]["replicas"][0]["lag"] == 0,
        30,
        "the replica to catch up",
    )
    proc = b if victim == "replica" else a
    t0 = time.monotonic()
    proc.popen.terminate()
    try:
        code = proc.popen.wait(8)  # ~0.5 s when it works
    except subprocess.TimeoutExpired:
        code = None
        proc.popen.kill()  # don't make the teardown wait for it again
        proc.popen.wait(5)
    assert code == 0, f"still running {time.monotonic() - t0:.1f}s after SIGTERM\n{proc.log()}"
    assert len(written(proc)) == 1


# -- one process per data directory -----------------------------------------------


def test_a_second_shard_on_a_data_dir_in_use_is_refused_and_the_first_keeps_serving(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "data"
    c.start_broker()
    first = c.start_shard(data, ["--checkpoint-interval", "0"])
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        ps.push_dense("w", np.ones(4))
        second = c.start_shard(data)
        assert second.popen.wait(30) == 1, second.log()
        log = second.log()
        assert f"data directory {data} is in use by s-" in log, log
        assert f"(pid {first.pid})" in log, log
        # The first shard was not displaced: it still serves, and it is still the primary.
        ps.push_dense("w", np.ones(4))
        np.testing.assert_array_equal(ps.pull_dense("w"), np.full(4, -2.0))
        assert first.alive() and c.shard_pid(0) == first.pid
    # Its end frees the directory: a shard started there now restores the partition.
    assert terminate([first]) == {first.name: 0}
    third = c.start_shard(data)
    c.wait_healthy(30)
    assert c.shard_pid(0) == third.pid
    with zps.connect_sync(c.address, timeout=20) as ps:
        np.testing.assert_array_equal(ps.pull_dense("w"), np.full(4, -2.0))
