"""A checkpoint and a replica's snapshot of a large partition (> 300 MB) that want a cut
at the same time, with real processes: one cut at a time holds a frozen version, the
other waits for it to be released and then freezes too, and neither holds the primary's
event loop for longer than a step (docs/design.md, Replication).  Two cuts that waited
for the same release must not both go ahead: the second would find the tables frozen by
the first and copy them on the loop, into memory it had not touched (figures:
docs/performance.md, Big partitions)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.client.client import Client
from zps.optim import Adagrad
from zps.testing import LocalCluster, Proc, free_port, scrape_metric

HB, LIVENESS = 0.1, 10
#: The broker's liveness timeout (1 s).
TIMEOUT = HB * LIVENESS
#: The longest a cut or a step of a release may hold the primary's loop, well under the
#: liveness timeout.
STEP_LIMIT = 0.5
ROWS, DIM, BATCH = 1_250_000, 32, 50_000
#: Checkpoints back to back under the pushes: one every this many writes.
EVERY = 40
#: What the primary logs of each cut and of each release's longest step.
CUT = re.compile(r"\(cut in (\d+\.\d+)s\)")
STEP = re.compile(r"longest step (\d+\.\d+)s\)")
HELD = re.compile(r"the event loop is held \((\d+\.\d) s so far\)")
WRITTEN = r"checkpoint of partition 0 at LSN \d+ written"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(replicated_partition: LocalCluster) -> LocalCluster:
    return replicated_partition


async def build(ps: Client) -> None:
    """ROWS rows of DIM float32 with Adagrad state: 320 MB."""
    await ps.create_embedding("big", DIM, optimizer=Adagrad(lr=0.1))
    grads = np.random.default_rng(0).random((BATCH, DIM), dtype=np.float32)
    for start in range(0, ROWS, BATCH):
        await ps.push_rows("big", np.arange(start, start + BATCH), grads)


async def pushes(ps: Client, done: asyncio.Event) -> int:
    """Pushes of 256 random rows until ``done``: each writes pages all over the tables."""
    rng = np.random.default_rng(1)
    grads = np.ones((256, DIM), np.float32)
    n = 0
    while not done.is_set():
        await ps.push_rows("big", rng.integers(0, ROWS, 256), grads)
        n += 1
        await asyncio.sleep(0.005)
    return n


def holds(proc: Proc, since: int) -> list[float]:
    """The loop holds the shard's liveness thread reported after ``since`` characters of
    its log (each at its first report, past two heartbeat intervals)."""
    return [float(m) for m in HELD.findall(proc.log()[since:])]


async def test_a_checkpoint_and_a_snapshot_overlapping_never_hold_the_loop(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    c, mport = cluster, free_port()
    c.start_broker()
    flags = ["--data-dir", str(tmp_path / "p"), "--checkpoint-interval", "0"]
    primary = c.start_shard(
        [*flags, "--checkpoint-every", str(EVERY), "--metrics-port", str(mport)]
    )
    c.wait_for(lambda s: s["partitions"][0]["primary"] is not None, 20, "a primary")
    async with zps.connect(c.address, acks=1) as ps:
        await build(ps)
        epoch = (await ps.status())["partitions"][0]["epoch"]
        since, first = len(primary.log()), len(re.findall(WRITTEN, primary.log()))
        done = asyncio.Event()
        writer = asyncio.create_task(pushes(ps, done))
        try:
            # Checkpoints run back to back under the pushes; the replica's SUBSCRIBE
            # waits for one to be released, as the next checkpoint does.
            replica = c.start_shard(["--data-dir", str(tmp_path / "r")])
            await asyncio.to_thread(c.wait_healthy, 90)
            deadline = time.monotonic() + 60
            while len(re.findall(WRITTEN, primary.log())) < first + 3:  # one after the join
                assert time.monotonic() < deadline, "no checkpoint after the replica joined"
                await asyncio.sleep(0.1)
        finally:
            done.set()
            written = await writer
        assert written > 0 and replica.popen.poll() is None
        log = primary.log()[since:]
        assert "subscribed: snapshot" in log
        cuts = [float(x) for x in CUT.findall(log)]
        steps = [float(x) for x in STEP.findall(log)]
        assert len(cuts) >= 4, log  # the snapshot's and the checkpoints'
        gap = scrape_metric(mport, "zps_shard_event_loop_longest_gap_seconds")
        assert max(cuts + steps) < STEP_LIMIT, (
            f"a cut or a release's step held the primary's loop: cuts {cuts}, longest steps "
            f"{steps} (liveness timeout {TIMEOUT:.1f}s; longest gap between heartbeats "
            f"{gap:.2f}s, holds reported {holds(primary, since)})"
        )
        assert "copied on the loop" not in log
        assert (await ps.status())["partitions"][0]["epoch"] == epoch  # no failover
