"""A replica with a data dir catching up a partition of a few hundred MB on a slow disk,
while writes go on, with real processes: its event loop is never held for long (no
heartbeat delayed), the stream written during the transfer cannot fail it, and from
its first acknowledgement on it acknowledges continuously (its primary, at the default
liveness timeout, keeps it).

The slow disk is synthetic: the replica's interpreter loads a ``sitecustomize`` that
makes each ``fsync``/``fdatasync`` of a checkpoint file wait in proportion to the bytes
written to it since its last sync (``DISK_BPS``), as a disk that flushes that many bytes
a second would (only the replica's: the sleep releases the GIL, as a real sync does),
and each sync of its log the same at ``LOG_BPS``: fast enough for the write rate, far
slower than the replica applies the stream it held.  A checkpoint the replica keeps of
its snapshot then takes seconds to sync; the stream written meanwhile is held, and must
be applied after the snapshot without holding the loop, without a bound in memory that
a longer transfer would pass, and no faster than its log takes it: a replica that
acknowledged its snapshot and then waits for its log to take a backlog of a hundred MB
acknowledges nothing new for seconds, and is dropped as stuck."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.optim import Adagrad
from zps.testing import LocalCluster, free_port, scrape_metric

HB, LIVENESS = 0.1, 10  # the default liveness: 10 heartbeats
#: The longest the replica's loop may be held: five heartbeats (a loop held longer holds
#: the stream's reads and acknowledgements).
LOOP_BOUND_S = HB * 5
#: The longest the replica, from its first acknowledgement on, may acknowledge nothing
#: new while its primary is ahead: half the liveness timeout.
ACK_BOUND_S = HB * LIVENESS / 2
#: Writes go on this long after the replica is in sync.
AFTER_S = 3.0
ROWS, DIM, BATCH = 625_000, 32, 125_000  # rows and Adagrad state: 160 MB
#: The synthetic disk: bytes synced a second, for checkpoint files and for the log.
DISK_BPS = 8e6
LOG_BPS = 50e6
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
    base = os.path.basename(name)
    if "ckpt-" in base:
        bps = {DISK_BPS}
    elif base.startswith("wal-"):
        bps = {LOG_BPS}
    else:
        return
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    new = max(0, st.st_size - _synced.get(key, 0))
    _synced[key] = st.st_size
    time.sleep(new / bps)

def fsync(fd):
    _wait(fd)
    return _fsync(fd)

def fdatasync(fd):
    _wait(fd)
    return _fdatasync(fd)

os.fsync, os.fdatasync = fsync, fdatasync
"""


class AckWatch:
    """Samples a primary's metrics in a thread: the LSN its replica acknowledged (its LSN
    less the replica's lag) and its own, to find the longest time the replica, once it
    acknowledged its snapshot, stayed behind without acknowledging anything new (what
    a primary takes for stuck past its liveness timeout)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.samples: list[tuple[float, float, float]] = []  # (time, acked, primary LSN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> AckWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/metrics", timeout=5
                ) as r:
                    text = r.read().decode()
            except OSError:
                continue
            lsn = re.search(r"^zps_shard_lsn\{[^}]*\} (\S+)$", text, re.MULTILINE)
            lag = re.search(r"^zps_shard_replica_lag_updates\{[^}]*\} (\S+)$", text, re.MULTILINE)
            if lsn is not None and lag is not None:
                now, primary = time.monotonic(), float(lsn.group(1))
                self.samples.append((now, primary - float(lag.group(1)), primary))

    def longest_silence(self) -> tuple[float, float]:
        """The longest time, from the replica's first acknowledgement of its snapshot on,
        its acknowledged LSN stayed put while the primary was ahead; and how long after
        that first acknowledgement it began."""
        longest, began, first, since, at = 0.0, 0.0, None, None, None
        for now, acked, primary in self.samples:
            if acked <= 0:
                continue  # no acknowledgement of its snapshot yet: not watched
            first = now if first is None else first
            if acked != at:
                since, at = (now if acked < primary else None), acked
            elif since is None and acked < primary:
                since = now
            elif acked >= primary:
                since = None
            if since is not None and now - since > longest:
                longest, began = now - since, since - first
        return longest, began


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
        # nothing here checks: past 0.5 s it is killed.
        c.stop(timeout=0.5)


async def test_a_replica_syncing_its_snapshot_on_a_slow_disk_never_holds_its_loop(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = cluster
    c.start_broker()
    pport = free_port()
    primary = c.start_shard(
        [
            "--data-dir",
            str(tmp_path / "p"),
            "--checkpoint-interval",
            "0",
            "--metrics-port",
            str(pport),
        ]
    )
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
        # Writes go on for AFTER_S past the join: a replica that falls silent once in
        # sync is dropped then.
        in_sync = asyncio.create_task(asyncio.to_thread(c.wait_healthy, 150))
        rng, ones = np.random.default_rng(1), np.ones((512, DIM), np.float32)
        pushes, began, end = 0, time.monotonic(), float("inf")
        with AckWatch(pport) as watch:
            while time.monotonic() < end:
                await ps.push_rows("big", rng.choice(ROWS, 512, replace=False), ones)
                pushes += 1
                if in_sync.done() and end == float("inf"):
                    in_sync.result()
                    end = time.monotonic() + AFTER_S
                await asyncio.sleep(max(0.0, began + pushes / PUSH_RATE - time.monotonic()))
        silence, silent_from = watch.longest_silence()
        log = replica.log()
        assert re.search(r"loaded a snapshot of partition 0", log), log[-2000:]
        held = scrape_metric(rport, "zps_shard_event_loop_longest_gap_seconds")
        print(
            f"{pushes} pushes during the catch-up; the replica's loop held at most {held:.2f}s; "
            f"it acknowledged nothing new for at most {silence:.2f}s ({silent_from:.2f}s after "
            "its first acknowledgement)"
        )
        assert held < LOOP_BOUND_S, (
            f"the replica's event loop was held {held:.2f}s (bound {LOOP_BOUND_S}s) "
            "while it applied the stream held during its snapshot"
        )
        assert watch.samples, "no figures from the primary's metrics"
        assert silence < ACK_BOUND_S, (
            f"the replica acknowledged nothing new for {silence:.2f}s, {silent_from:.2f}s after "
            f"it acknowledged its snapshot (bound {ACK_BOUND_S}s; its primary drops it at "
            f"{HB * LIVENESS}s)\n{log[-1500:]}"
        )
        assert "stopped streaming to replica" not in primary.log(), primary.log()[-2000:]
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
