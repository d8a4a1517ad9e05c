"""Memory during a snapshot transfer of a large partition (> 300 MB), with real
processes.  The joining copy writes each chunk into the arrays of its new tables as it
arrives (zps.store.snapshot.StreamBuilder) and keeps at most a window of chunks: no
second copy of the partition.  The primary streams a frozen version of its tables
(zps.store.mapped.freeze): it holds the pages written during the transfer, which random
pushes make most of the partition within seconds, and never more than one version.
The bounds are docs/design.md's (Replication)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.optim import Adagrad
from zps.testing import LocalCluster, free_port, scrape_metric

HB, LIVENESS = 0.1, 5
ROWS, DIM, BATCH = 1_250_000, 32, 125_000
#: Rows and Adagrad state: 320 MB.
PARTITION_BYTES = ROWS * 2 * DIM * 4
#: Room beyond the partition: chunks in flight (a few x 8 MiB), the ids, the
#: interpreter's own growth.  A whole second copy is 320 MB more.
MARGIN = 120 << 20


@pytest.fixture
def cluster(replicated_partition: LocalCluster) -> LocalCluster:
    return replicated_partition


def _kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def held(pid: int) -> int:
    """What ``pid`` holds: its private memory and every page of its memory files (the
    tables' arrays), mapped or not: a frozen version's pages are no longer mapped by
    the table once written, and its resident size alone would not count them."""
    files: dict[tuple[int, int], int] = {}  # each file once (a frozen cut holds a second fd)
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:zps-rows"):
                st = os.stat(fd)
                files[st.st_dev, st.st_ino] = st.st_blocks * 512
        except OSError:
            continue  # closed meanwhile
    return _kb(pid, "RssAnon") + sum(files.values())


class Peak:
    """The most :func:`held` was for a process, sampled every 20 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.start = pid, held(pid)
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, held(self.pid))

    def growth(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start


async def test_a_transfer_holds_no_second_copy_on_either_side(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    c = cluster
    c.start_broker()
    primary = c.start_shard(["--data-dir", str(tmp_path / "p")])
    c.wait_for(lambda s: s["partitions"][0]["primary"] is not None, 20, "a primary")
    async with zps.connect(c.address, acks=1) as ps:
        await ps.create_embedding("big", DIM, optimizer=Adagrad(lr=0.1))
        grads = np.random.default_rng(0).random((BATCH, DIM), dtype=np.float32)
        for start in range(0, ROWS, BATCH):
            await ps.push_rows("big", np.arange(start, start + BATCH), grads)
        await asyncio.sleep(1.0)  # quiet: freed buffers go back to the system
        primary_peak = Peak(primary.pid)
        rport = free_port()
        replica = c.start_shard(["--data-dir", str(tmp_path / "r"), "--metrics-port", str(rport)])
        await asyncio.to_thread(c.wait_for, lambda s: len(s["shards"]) == 2, 20, "the replica")
        replica_before = _kb(replica.pid, "VmRSS")
        # Pushes go on during the transfer: the primary copies what they write, no more.
        ones = np.ones((64, DIM), np.float32)
        rng = np.random.default_rng(1)
        wait = asyncio.create_task(asyncio.to_thread(c.wait_healthy, 120))
        while not wait.done():
            await ps.push_rows("big", rng.choice(ROWS, 64, replace=False), ones)
            await asyncio.sleep(0.01)
        wait.result()
        table_bytes = scrape_metric(rport, "zps_shard_table_bytes")
        assert table_bytes >= PARTITION_BYTES
        replica_growth = _kb(replica.pid, "VmHWM") - replica_before
        primary_growth = primary_peak.growth()
        print(
            f"partition {table_bytes / 1e6:.0f} MB; peak growth: replica "
            f"{replica_growth / 1e6:.0f} MB, primary {primary_growth / 1e6:.0f} MB"
        )
        assert replica_growth < table_bytes + MARGIN, (
            f"the joining copy grew by {replica_growth / 1e6:.0f} MB for a partition of "
            f"{table_bytes / 1e6:.0f} MB"
        )
        assert primary_growth < table_bytes + MARGIN, (
            f"the primary grew by {primary_growth / 1e6:.0f} MB while it sent a partition of "
            f"{table_bytes / 1e6:.0f} MB"
        )
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
