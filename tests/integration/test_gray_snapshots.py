"""A large partition (> 300 MB) with real processes: its checkpoints never delay a
heartbeat or a small push and hold exactly the partition, and a replica joining it
gets one snapshot, in bounded chunks, with the primary's memory bounded."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.client.client import Client
from zps.optim import Adagrad
from zps.shard.checkpoint import CheckpointStore
from zps.store.snapshot import Snapshot
from zps.store.tables import checksum_arrays
from zps.testing import LocalCluster, Proc, free_port, scrape_metric

HB = 0.1
#: A shard silent for 0.5 s is declared dead.  Building the table makes the shard grow
#: it (its arrays copied into larger ones, up to seconds on a loaded 2-core machine):
#: its liveness thread heartbeats meanwhile (zps.shard.liveness), so that costs no
#: failover.  What is asserted during checkpoints is HEARTBEAT_GAP_LIMIT, measured by
#: what the heartbeats say (the loop's own), not by their arrival.
LIVENESS = 5
#: Longest a shard's event loop may go without a heartbeat (10 heartbeat intervals).
HEARTBEAT_GAP_LIMIT = 1.0
ROWS = 1_250_000
DIM = 32
BATCH = 125_000  # rows per building push: 16 MB of gradients
#: What the partition's export holds: ids, rows and the Adagrad state.
PARTITION_BYTES = ROWS * (8 + 2 * DIM * 4)
STALL_LIMIT = 2.0  # worst latency of a small push, in seconds


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(
        partitions=1, shards=0, heartbeat_interval=HB, liveness=LIVENESS, workdir=tmp_path
    )
    c.port = free_port()
    try:
        yield c
    finally:
        c.stop()


def rss(pid: int) -> int:
    return _status_kb(pid, "VmRSS") * 1024


def peak_rss(pid: int) -> int:
    return _status_kb(pid, "VmHWM") * 1024


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def count(proc: Proc, pattern: str) -> int:
    return len(re.findall(pattern, proc.log()))


def wait_role(c: LocalCluster, proc: Proc, role: str, timeout: float) -> None:
    c.wait_for(
        lambda s: any(x["pid"] == proc.pid and x["role"] == role for x in s["shards"]),
        timeout,
        f"{proc.name} to be {role}",
    )


def wait_primary(c: LocalCluster, timeout: float = 20.0) -> None:
    c.wait_for(lambda s: s["partitions"][0]["primary"] is not None, timeout, "a primary")


async def build(ps: Client) -> None:
    """The large table: ROWS rows of DIM float32 with Adagrad state."""
    await ps.create_embedding("big", DIM, optimizer=Adagrad(lr=0.1))
    rng = np.random.default_rng(0)
    grads = rng.random((BATCH, DIM), dtype=np.float32)
    for start in range(0, ROWS, BATCH):
        await ps.push_rows("big", np.arange(start, start + BATCH), grads)


async def small_pushes(ps: Client, until: Callable[[], bool], deadline: float) -> list[float]:
    """Push one row at a time until ``until()``; the latency of each push."""
    latencies: list[float] = []
    ones = np.ones((1, DIM), np.float32)
    k = 0
    while not until():
        assert time.monotonic() < deadline, "timed out"
        t0 = time.monotonic()
        await ps.push_rows("big", np.array([k % ROWS]), ones)
        latencies.append(time.monotonic() - t0)
        k += 1
        await asyncio.sleep(0.01)
    return latencies


async def worst_heartbeat_gap(ps: Client, node: str, done: asyncio.Event) -> float:
    """The longest the request count that ``node`` reports in its heartbeats stood still,
    polled until ``done`` while pushes keep coming: a heartbeat delayed shows as a gap.
    (Any message counts as a heartbeat for the broker, so its ``last_seen_s`` would not
    show a heartbeat loop stalled under request traffic; the lease depends on it.)"""
    worst, last, changed = 0.0, None, time.monotonic()
    while not done.is_set():
        for shard in (await ps.status())["shards"]:
            if shard["node"] == node:
                now, value = time.monotonic(), (shard["stats"] or {}).get("requests")
                if value != last:
                    last, changed = value, now
                worst = max(worst, now - changed)
        await asyncio.sleep(0.05)
    return worst


async def longest_silence(ps: Client, pid: int, done: Callable[[], bool]) -> float:
    """The longest the broker went without a word from the shard with ``pid`` (its
    ``last_seen_s``), polled until ``done()``.  A replica sends the broker nothing but
    heartbeats, so for a replica this is its longest gap between heartbeats."""
    worst = 0.0
    while not done():
        for shard in (await ps.status())["shards"]:
            if shard["pid"] == pid and shard.get("last_seen_s") is not None:
                worst = max(worst, shard["last_seen_s"])
        await asyncio.sleep(0.05)
    return worst


async def test_checkpoints_of_a_large_partition_never_delay_heartbeats(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    c, data, mport = cluster, tmp_path / "data", free_port()
    c.start_broker()
    # A checkpoint every 150 writes: none while the table is built (11 writes), then
    # one every second or two under the small pushes.
    flags = ["--data-dir", str(data), "--checkpoint-interval", "0", "--checkpoint-every", "150"]
    shard = c.start_shard([*flags, "--metrics-port", str(mport)])
    wait_primary(c)
    written = r"checkpoint of partition 0 at LSN \d+ written"
    async with zps.connect(c.address, acks=1) as ps:
        await build(ps)
        assert scrape_metric(mport, "zps_shard_table_bytes") >= 300e6
        part = (await ps.status())["partitions"][0]
        epoch, node = part["epoch"], part["primary"]
        first = count(shard, written)
        done = asyncio.Event()
        watch = asyncio.create_task(worst_heartbeat_gap(ps, node, done))
        # Two more checkpoints of the whole partition while small pushes go on.
        try:
            latencies = await small_pushes(
                ps, lambda: count(shard, written) >= first + 2, time.monotonic() + 40
            )
        finally:
            done.set()
            gap = await watch
        assert gap < HEARTBEAT_GAP_LIMIT, f"no heartbeat from the shard for {gap:.2f}s"
        assert max(latencies) < STALL_LIMIT, f"a push waited {max(latencies):.2f}s"
        assert (await ps.status())["partitions"][0]["epoch"] == epoch  # no failover
        assert not re.search("shard .* declared dead", c.broker().log())
        assert "no word from the broker" not in shard.log()
        before = (await ps.checksums())[0]
        # A graceful stop writes a final checkpoint: it holds exactly what the shard held.
        shard.popen.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(shard.popen.wait, 30) == 0
    found = CheckpointStore(data).latest()
    assert found is not None
    snap = found.snapshot
    assert (snap.partition, snap.epoch, snap.lsn) == (0, epoch, before["lsn"])
    assert snap.export["tables"]["big"]["rows"].shape == (ROWS, DIM)
    assert checksum(snap) == before["checksum"]


def checksum(snap: Snapshot) -> str:
    """What :meth:`PartitionStore.checksum` gives for the partition ``snap`` holds."""
    h = hashlib.sha256()
    for wire in snap.export["specs"]:
        h.update(json.dumps(wire, sort_keys=True).encode())
        checksum_arrays(snap.export["tables"][wire["name"]], h)
    return h.hexdigest()


async def test_a_replica_joining_a_large_partition_gets_one_chunked_snapshot(
    cluster: LocalCluster,
) -> None:
    c, mport = cluster, free_port()
    c.replication = 2
    c.start_broker()
    primary = c.start_shard(["--metrics-port", str(mport)])
    wait_primary(c)
    async with zps.connect(c.address, acks=1) as ps:
        await build(ps)
        await asyncio.sleep(1.0)  # quiet: freed buffers go back to the system
        steady = rss(primary.pid)
        reset_peak(primary.pid)
        rport = free_port()
        replica = c.start_shard(["--metrics-port", str(rport)])
        in_sync = asyncio.create_task(asyncio.to_thread(c.wait_healthy, 40))
        silent = asyncio.create_task(longest_silence(ps, replica.pid, in_sync.done))
        try:
            latencies = await small_pushes(ps, in_sync.done, time.monotonic() + 45)
        finally:
            with contextlib.suppress(BaseException):
                await in_sync
        in_sync.result()
        # The replica heartbeats while it takes, decodes, keeps and loads the snapshot,
        # and its event loop is never held for long (its liveness thread would cover it).
        gap = await silent
        assert gap < HEARTBEAT_GAP_LIMIT, f"the replica was silent {gap:.2f}s"
        held = scrape_metric(rport, "zps_shard_event_loop_longest_gap_seconds")
        assert held < HEARTBEAT_GAP_LIMIT, f"the replica's event loop was held {held:.2f}s"
        growth = peak_rss(primary.pid) - steady
        assert scrape_metric(mport, "zps_shard_snapshots_sent") == 1
        chunks = scrape_metric(mport, "zps_shard_snapshot_chunks_sent")
        assert chunks >= PARTITION_BYTES / (8 << 20)  # bounded chunks, no whole-partition frame
        # One copy of the partition, plus chunks in flight and working room.
        assert growth < PARTITION_BYTES + (128 << 20), f"primary grew by {growth / 1e6:.0f} MB"
        assert max(latencies) < STALL_LIMIT, f"a push waited {max(latencies):.2f}s"
        before = (await ps.checksums())[0]
        # The replica takes over: it holds exactly the primary's state.
        await asyncio.to_thread(c.kill, primary.pid, signal.SIGKILL)
        await asyncio.to_thread(wait_role, c, replica, "primary", 20)
        after = (await ps.checksums())[0]
        assert after == before
