"""Storage faults with real processes: a shard whose disk fills up (a file-size limit
set on the running process: writes past it fail with EFBIG; and, where a tmpfs can be
mounted, a real full filesystem: ENOSPC) and frees again loses no acknowledged push
across a SIGKILL; a primary whose fsync fails leaves and exits, and no acknowledged
push is lost; a flipped bit in the newest checkpoint of a stopped shard is survived
from the previous checkpoint and the log (kept from the oldest); without a log, only
a clean stop's checkpoint is claimed complete."""

from __future__ import annotations

import contextlib
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from zps.optim import SGD
from zps.store.wal import parse_records
from zps.testing import DataDirCluster, Proc

HB = 0.1
LIVENESS = 20
DIM = 4096  # a push's record is about 32 KiB: larger than the room left on the disk


def wait_log(proc: Proc, pattern: str, timeout: float = 30.0) -> re.Match[str]:
    """Until ``proc``'s log has a line matching ``pattern``."""
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, proc.log())
        if m:
            return m
        assert proc.alive(), proc.log()[-3000:]
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{proc.log()[-3000:]}"
        time.sleep(0.05)


def kill(*procs: Proc) -> None:
    for p in procs:
        p.popen.send_signal(signal.SIGKILL)
    for p in procs:
        p.popen.wait(10)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("durability", ["fsync", "interval"])
def test_pushes_acknowledged_while_the_disk_fills_and_frees_survive_a_sigkill(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path, durability: str
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "data"
    flags = ["--durability", durability, "--checkpoint-interval", "0"]
    c.start_broker()
    shard = c.start_shard(data, flags)
    c.wait_healthy(30)
    acked: list[int] = []  # the pushes acknowledged, in order
    with zps.connect_sync(c.address, timeout=60) as ps:
        ps.create_dense("v", shape=(DIM,), dtype="float64", optimizer=SGD(lr=1.0))
        for k in range(1, 21):
            ps.push_dense("v", np.full(DIM, float(k)))
            acked.append(k)
        (segment,) = sorted((data / "partition-0").glob("wal-*.log"))
        # The disk fills up: 10 KB are left, less than one push's record.
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.prlimit(shard.pid, resource.RLIMIT_FSIZE, (segment.stat().st_size + 10_000, hard))

        def more() -> None:
            for k in range(21, 41):
                ps.push_dense("v", np.full(DIM, float(k)))
                acked.append(k)

        pusher = threading.Thread(target=more, daemon=True)
        pusher.start()
        # A write failed (twice: it is retried) and nothing more was acknowledged.
        wait_log(shard, r"(?s)writing failed.*writing failed")
        assert acked == list(range(1, 21))
        # The disk has room again: the waiting pushes are written and acknowledged.
        resource.prlimit(shard.pid, resource.RLIMIT_FSIZE, (hard, hard))
        pusher.join(60)
        assert not pusher.is_alive() and acked == list(range(1, 41))
    kill(shard, c.broker())
    shard2 = c.start_shard(data, flags)
    c.restart_broker(grace=1.0)
    c.wait_healthy(60)
    assert "write-ahead log replay stopped" not in shard2.log(), shard2.log()[-3000:]
    with zps.connect_sync(c.address, timeout=20) as ps:
        # Every acknowledged push, each once: the create and 40 pushes.
        assert np.array_equal(ps.pull_dense("v"), np.full(DIM, -float(sum(acked))))
        assert ps.checksums()[0]["lsn"] == 41


@pytest.mark.timeout(180)
def test_a_flipped_bit_in_the_newest_checkpoint_restores_from_the_previous_and_the_log(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "data"
    flags = ["--durability", "interval", "--checkpoint-interval", "0"]
    c.start_broker()
    shard = c.start_shard(data, flags)
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("v", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        for k in range(1, 41):
            ps.push_dense("v", np.full(4, float(k)))
            if k in (10, 20, 30):
                ps.checkpoint()  # at LSN 11, 21, 31: each drops what it may of the log
        lsn = ps.checksums()[0]["lsn"]
    assert lsn == 41
    kill(shard, c.broker())
    folder = data / "partition-0"
    checkpoints = sorted(folder.glob("ckpt-*.zps"))
    assert [int(p.stem.split("-")[2]) for p in checkpoints] == [11, 21, 31]
    newest = checkpoints[-1]
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0x04  # one flipped bit
    newest.write_bytes(bytes(raw))
    shard2 = c.start_shard(data, flags)
    c.restart_broker(grace=1.0)
    c.wait_healthy(60)
    log = shard2.log()
    assert f"checkpoint {newest} is unusable" in log
    m = re.search(r"restored partition 0 at epoch \d+, LSN (\d+) from (\S+) and (\d+) logged", log)
    assert m is not None, log[-3000:]
    assert int(m.group(1)) == lsn and m.group(2) == str(checkpoints[-2]) and int(m.group(3)) > 0
    with zps.connect_sync(c.address, timeout=20) as ps:
        assert np.array_equal(ps.pull_dense("v"), np.full(4, -float(sum(range(1, 41)))))
        assert ps.checksums()[0]["lsn"] == lsn


def test_a_copy_whose_last_logged_push_rotted_waits_for_the_copy_that_holds_it(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    """1 partition x 2 copies (acks="all", min_in_sync 2): the whole cluster is
    SIGKILLed, and a bit of the primary's last log record (a synced, acknowledged push)
    flips at rest.  The damaged copy comes back first: it cuts its log there, says it
    may lack acknowledged writes, and is not given the partition; the copy that holds
    the push is, when it comes back, and every acknowledged push is there."""
    c = make_cluster(partitions=1, replication=2, broker_data_dir=tmp_path / "broker")
    flags = ["--durability", "fsync", "--checkpoint-interval", "0"]
    c.start_broker()
    a = c.start_shard(tmp_path / "a", flags)
    c.wait_for(lambda s: s["partitions"][0]["primary"] is not None, 20, "a primary")
    b = c.start_shard(tmp_path / "b", flags)
    status = c.wait_healthy(30)
    primary_node = status["partitions"][0]["primary"]
    pid = next(s["pid"] for s in status["shards"] if s["node"] == primary_node)
    primary, other = (a, b) if a.pid == pid else (b, a)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("v", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        for k in range(1, 11):
            ps.push_dense("v", np.full(4, float(k)))
        lsn = ps.checksums()[0]["lsn"]
    kill(primary, other, c.broker())
    data = tmp_path / ("a" if primary is a else "b")
    (segment,) = sorted((data / "partition-0").glob("wal-*.log"))[-1:]
    raw = bytearray(segment.read_bytes())
    records = parse_records(bytes(raw)).records
    assert records[-1][0].lsn == lsn and records[-1][1] == len(raw)
    start = records[-2][1]  # where the last record begins
    raw[start + (len(raw) - start) // 2] ^= 0x08  # one bit of its body
    segment.write_bytes(bytes(raw))

    damaged = c.start_shard(data, flags)
    broker = c.start_broker(grace=0.5)
    wait_log(damaged, rf"partition 0 at LSN {lsn - 1} may lack writes this copy acknowledged")
    c.wait_for(
        lambda s: s["partitions"][0]["primary"] is None and s["broker"]["holding_s"] == 0,
        20,
        "the hold to end without a primary",
    )
    assert re.search(r"CRC mismatch", damaged.log()), damaged.log()[-3000:]
    assert list((data / "partition-0").glob("wal-*.log.cut-*")), "the damaged record was kept"
    healthy = c.start_shard(tmp_path / ("b" if primary is a else "a"), flags)
    status = c.wait_for(
        lambda s: (
            s["partitions"][0]["state"] == "ok"
            and s["partitions"][0]["primary"] == node_of(s, healthy)
        ),
        30,
        "the copy holding every push to serve, the damaged one in sync behind it",
    )
    assert status["partitions"][0]["replicas"][0]["node"] == node_of(status, damaged)
    with zps.connect_sync(c.address, timeout=20) as ps:
        assert np.array_equal(ps.pull_dense("v"), np.full(4, -float(sum(range(1, 11)))))
        assert ps.checksums()[0]["lsn"] == lsn
    assert broker.alive()


def node_of(status: dict[str, Any], proc: Proc) -> str:
    return str(next((s["node"] for s in status["shards"] if s["pid"] == proc.pid), ""))


#: Runs a shard with ``os.fdatasync`` failing (EIO) once the file FAIL_SYNC exists in its
#: data dir: a disk that starts failing under a running shard.
_FAILING_DISK = """
import errno, os, runpy, sys
args = sys.argv[3:]
trigger = os.path.join(args[args.index("--data-dir") + 1], "FAIL_SYNC")
real = os.fdatasync
def fdatasync(fd):
    if os.path.exists(trigger):
        raise OSError(errno.EIO, "Input/output error")
    real(fd)
os.fdatasync = fdatasync
sys.argv = ["zps", *args]
runpy.run_module("zps", run_name="__main__", alter_sys=True)
"""


@pytest.mark.timeout(180)
def test_a_failed_fsync_makes_the_primary_leave_and_no_acknowledged_push_is_lost(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=2)
    c.start_broker()
    script = tmp_path / "failing_disk.py"
    script.write_text(_FAILING_DISK)
    wrapper = tmp_path / "python-failing-disk"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(0o755)
    c.python = str(wrapper)  # shards only: the broker is started
    # Two copies and a spare, which becomes the new replica (acks="all" needs two).
    dirs = [tmp_path / f"data{i}" for i in range(3)]
    flags = ["--durability", "fsync", "--checkpoint-interval", "0"]
    shards = [c.start_shard(d, flags) for d in dirs]
    c.wait_for(lambda s: c.healthy(s) and len(s["shards"]) == 3, 30, "two copies and a spare")
    pid = c.shard_pid(0)
    primary = next(i for i, s in enumerate(shards) if s.pid == pid)
    acked = 0
    with zps.connect_sync(c.address, timeout=60) as ps:
        ps.create_dense("v", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        for k in range(1, 21):
            ps.push_dense("v", np.full(4, float(k)))
            acked += k
        (dirs[primary] / "FAIL_SYNC").touch()  # the primary's disk fails its next fsync
        for k in range(21, 41):
            ps.push_dense("v", np.full(4, float(k)))  # acknowledged by the promoted replica
            acked += k
        # The primary acknowledged nothing more: it left, and exited for a restart.
        assert shards[primary].popen.wait(30) == 1
        log = shards[primary].log()
        assert "write-ahead log of partition 0 lost" in log and "fdatasync failed" in log
        assert "stopped: the write-ahead log was lost" in log
        assert c.shard_pid(0) != pid
        # Every acknowledged push, each once (the one in flight answered by the replica).
        assert np.array_equal(ps.pull_dense("v"), np.full(4, -float(acked)))
        # Restarted on a disk that works again, the shard rejoins as a replica.
        (dirs[primary] / "FAIL_SYNC").unlink()
        c.start_shard(dirs[primary], flags)
        c.wait_healthy(60)
        assert np.array_equal(ps.pull_dense("v"), np.full(4, -float(acked)))


@pytest.mark.timeout(120)
def test_without_a_log_only_a_checkpoint_written_at_a_clean_stop_is_claimed_complete(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = tmp_path / "data"
    flags = ["--durability", "none", "--checkpoint-interval", "0"]
    c.start_broker()
    shard = c.start_shard(data, flags)
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("v", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
        for k in range(1, 6):
            ps.push_dense("v", np.full(4, float(k)))
    shard.popen.send_signal(signal.SIGTERM)  # hands over, then its final checkpoint
    assert shard.popen.wait(30) == 0
    assert (data / "partition-0" / "FINAL").exists()
    kill(c.broker())
    shard2 = c.start_shard(data, flags)
    c.restart_broker(grace=1.0)
    c.wait_healthy(60)
    assert "restored partition 0 at epoch 1, LSN 6" in shard2.log()
    assert "claimed as incomplete" not in shard2.log()
    assert not (data / "partition-0" / "FINAL").exists()  # consumed before serving
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.push_dense("v", np.full(4, 100.0))  # acknowledged, in memory only
    kill(shard2)
    shard3 = c.start_shard(data, flags)
    wait_log(shard3, r"partition 0 at LSN 6 may lack writes this copy acknowledged")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (skipped where this user cannot mount one)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=16m", "zps-test", str(mnt)]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=10, check=False)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs: {e}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10, check=False)


def fill(folder: Path) -> Path:
    """Fill the filesystem of ``folder`` to the last byte; returns the filler file."""
    filler = folder / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError:
                break
        while len(chunk) > 1:  # the last partial MiB
            chunk = chunk[: len(chunk) // 2]
            with contextlib.suppress(OSError):
                f.write(chunk)
    return filler


@pytest.mark.timeout(180)
def test_a_real_full_disk_filled_and_freed_under_acknowledged_pushes_loses_none(
    make_cluster: Callable[..., DataDirCluster], small_disk: Path
) -> None:
    c = make_cluster(partitions=1, replication=1)
    data = small_disk / "data"
    flags = ["--durability", "fsync", "--checkpoint-interval", "0"]
    c.start_broker()
    shard = c.start_shard(data, flags)
    c.wait_healthy(30)
    acked: list[int] = []
    try:
        with zps.connect_sync(c.address, timeout=60) as ps:
            ps.create_dense("v", shape=(DIM,), dtype="float64", optimizer=SGD(lr=1.0))
            for k in range(1, 21):
                ps.push_dense("v", np.full(DIM, float(k)))
                acked.append(k)
            filler = fill(small_disk)  # ENOSPC from here on

            def more() -> None:
                for k in range(21, 41):
                    ps.push_dense("v", np.full(DIM, float(k)))
                    acked.append(k)

            pusher = threading.Thread(target=more, daemon=True)
            pusher.start()
            wait_log(shard, r"(?s)writing failed \(\[Errno 28\].*writing failed")
            assert acked == list(range(1, 21))
            filler.unlink()  # the disk has room again
            pusher.join(60)
            assert not pusher.is_alive() and acked == list(range(1, 41))
        kill(shard, c.broker())
        shard2 = c.start_shard(data, flags)
        c.restart_broker(grace=1.0)
        c.wait_healthy(60)
        assert "write-ahead log replay stopped" not in shard2.log(), shard2.log()[-3000:]
        with zps.connect_sync(c.address, timeout=20) as ps:
            assert np.array_equal(ps.pull_dense("v"), np.full(DIM, -float(sum(acked))))
            assert ps.checksums()[0]["lsn"] == 41
    finally:
        c.stop()  # before the filesystem goes
