"""A replica with a data dir catching up a partition of a few hundred MB on a slow disk,
while writes go on, with real processes: its event loop is never held for long (no
heartbeat delayed), and the stream written during the transfer cannot fail it.

The slow disk is synthetic: the replica's interpreter loads a ``sitecustomize`` that
makes each ``fsync``/``fdatasync`` of a checkpoint file wait in proportion to the bytes
written to it since its last sync (``DISK_BPS``), as a disk that flushes that many bytes
a second would (only the replica's: the sleep releases the GIL, as a real sync does).
Its log syncs at full speed: a replica whose log cannot take the write rate is dropped
as stuck, by design, which is another test's subject.  A
checkpoint the replica keeps of its snapshot then takes seconds to sync; the stream
written meanwhile is held, and must be applied after the snapshot without holding the
loop, and without a bound in memory that a longer transfer would pass."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.optim import Adagrad
from zps.testing import LocalCluster, free_port, scrape_metric

HB, LIVENESS = 0.1, 20
#: The longest the replica's loop may be held: five heartbeats (a loop held longer holds
#: the stream's reads and acknowledgements).  The liveness timeout (2 s) is longer on
#: purpose: just after its catch-up a replica that held this much stream acknowledges
#: nothing new for a while (over 0.5 s on an idle machine), and a primary drops a replica
#: that acknowledges nothing new for a liveness timeout.
LOOP_BOUND_S = HB * 5
ROWS, DIM, BATCH = 625_000, 32, 125_000  # rows and Adagrad state: 160 MB
#: The synthetic disk: bytes synced a second.
DISK_BPS = 8e6
#: Writes a second during the catch-up (512 rows each: about 8 MB/s of stream), so
#: that what is held during the transfer and the sync is about 190 MB.
PUSH_RATE = 120

SLOW_DISK = f"""
import os, time
_fsync, _fdatasync, _synced = os.fsync, os.fdatasync, {{}}

def _wait(fd):
    try:
        name = os.readlink(f"/proc/self/fd/{{fd}}")
    except OSError:
        return
    if "ckpt-" not in os.path.basename(name):
        return
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    new = max(0, st.st_size - _synced.get(key, 0))
    _synced[key] = st.st_size
    time.sleep(new / {DISK_BPS})

def fsync(fd):
    _wait(fd)
    return _fsync(fd)

def fdatasync(fd):
    _wait(fd)
    return _fdatasync(fd)

os.fsync, os.fdatasync = fsync, fdatasync
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(
        partitions=1, shards=0, heartbeat_interval=HB, liveness=LIVENESS, workdir=tmp_path
    )
    c.port = free_port()
    c.replication = 2
    try:
        yield c
    finally:
        # A shard on the slowed disk would spend minutes on its final checkpoint, which
        # nothing here checks: past 2 s it is killed.
        c.stop(timeout=2.0)


async def test_a_replica_syncing_its_snapshot_on_a_slow_disk_never_holds_its_loop(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = cluster
    c.start_broker()
    primary = c.start_shard(["--data-dir", str(tmp_path / "p"), "--checkpoint-interval", "0"])
    c.wait_for(lambda s: s["partitions"][0]["primary"] is not None, 20, "a primary")
    async with zps.connect(c.address, acks=1) as ps:
        await ps.create_embedding("big", DIM, optimizer=Adagrad(lr=0.1))
        grads = np.random.default_rng(0).random((BATCH, DIM), dtype=np.float32)
        for start in range(0, ROWS, BATCH):
            await ps.push_rows("big", np.arange(start, start + BATCH), grads)
        slow = tmp_path / "slow-disk"
        slow.mkdir()
        (slow / "sitecustomize.py").write_text(SLOW_DISK)
        monkeypatch.setenv("PYTHONPATH", str(slow))  # the replica's interpreter only
        rport = free_port()
        replica = c.start_shard(
            [
                "--data-dir",
                str(tmp_path / "r"),
                "--checkpoint-interval",
                "0",
                "--metrics-port",
                str(rport),
            ]
        )
        monkeypatch.delenv("PYTHONPATH")
        # Writes of 512 random rows go on throughout, at PUSH_RATE: the replica holds
        # what they add while its snapshot arrives and syncs (about 20 s on this disk).
        in_sync = asyncio.create_task(asyncio.to_thread(c.wait_healthy, 150))
        rng, ones = np.random.default_rng(1), np.ones((512, DIM), np.float32)
        pushes, began = 0, time.monotonic()
        while not in_sync.done():
            await ps.push_rows("big", rng.choice(ROWS, 512, replace=False), ones)
            pushes += 1
            await asyncio.sleep(max(0.0, began + pushes / PUSH_RATE - time.monotonic()))
        in_sync.result()
        log = replica.log()
        assert re.search(r"loaded a snapshot of partition 0", log), log[-2000:]
        held = scrape_metric(rport, "zps_shard_event_loop_longest_gap_seconds")
        print(f"{pushes} pushes during the catch-up; the replica's loop held at most {held:.2f}s")
        assert held < LOOP_BOUND_S, (
            f"the replica's event loop was held {held:.2f}s (bound {LOOP_BOUND_S}s) "
            "while it applied the stream held during its snapshot"
        )
        assert not re.search("declared dead", c.broker().log())
        assert "resync" not in log, log[-2000:]  # one snapshot was enough
        before = (await ps.checksums())[0]
    # The copy holds exactly the primary's state.
    c.kill(primary.pid)
    c.wait_for(
        lambda s: any(x["pid"] == replica.pid and x["role"] == "primary" for x in s["shards"]),
        30,
        "the replica to take over",
    )
    async with zps.connect(c.address, acks=1) as ps:
        assert (await ps.checksums())[0] == before
