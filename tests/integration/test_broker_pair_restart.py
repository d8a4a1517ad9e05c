"""A broker pair killed whole and started again: the broker holding the newer record
takes over (BinaryStar rule 5), with real brokers and shards."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.broker.statefile import StateFile
from zps.optim import SGD
from zps.testing import PairCluster

pytestmark = pytest.mark.timeout(180)


def test_the_broker_with_the_newer_record_takes_over_a_pair_started_whole(
    tmp_path: Path,
) -> None:
    """The primary's data dir holds the state it knew while active (no partition held
    data); the backup served after it and its record knows the partitions.  Both die
    and start together with an empty shard in: the backup takes over, so the empty
    shard stays a spare and the data comes back with its holders."""
    c = PairCluster(partitions=2, replication=1, workdir=tmp_path, broker_data_dir=tmp_path / "b")
    try:
        c.start_broker()
        primary = next(p for p in c.procs if p.name == "broker-primary")
        backup = next(p for p in c.procs if p.name == "broker-backup")
        c.wait_for(
            lambda s: s["broker"]["pid"] == primary.pid and s["pair"]["peer"]["state"] == "passive",
            30,
            "the primary to serve, its standby passive",
        )
        c.kill(primary.pid)  # the backup serves alone from here
        c.wait_for(lambda s: s["broker"]["pid"] == backup.pid, 30, "the backup to serve")
        flags = ["--durability", "none", "--checkpoint-interval", "0"]
        dirs = [tmp_path / "s0", tmp_path / "s1"]
        holders = [c.start_shard(["--data-dir", str(d), *flags]) for d in dirs]
        c.wait_healthy(30)
        with zps.connect_sync(c.address, timeout=20) as ps:
            ps.create_dense("w", shape=(1000,), dtype="float64", optimizer=SGD(lr=1.0))
            for k in range(5):
                ps.push_dense("w", np.full(1000, float(k + 1)))
        file = StateFile(tmp_path / "b" / "backup")
        deadline = time.monotonic() + 20
        while not ((rec := file.load()) and all(p.known for p in rec.partitions)):
            assert time.monotonic() < deadline, "the backup never wrote its state"
            time.sleep(0.05)
        old = StateFile(tmp_path / "b" / "primary").load()
        assert old is not None and not any(p.known for p in old.partitions)
        for h in holders:  # final checkpoints, then the backup dies too
            h.popen.send_signal(signal.SIGTERM)
        for h in holders:
            assert h.popen.wait(20) == 0, h.log()[-2000:]
        c.kill(backup.pid)
        # The whole pair starts again, an empty shard first.
        primary = c.start_member("primary", grace=0.5)
        backup = c.start_member("backup", grace=0.5)
        empty = c.start_shard()
        status = c.wait_for(
            lambda s: (
                any(x["pid"] == empty.pid for x in s["shards"])
                and all(p["state"] == "lost" for p in s["partitions"])
            ),
            30,
            "the partitions to wait for their holders and the empty shard in",
        )
        assert status["broker"]["pid"] == backup.pid, (primary.log()[-2000:], status["pair"])
        assert {s["role"] for s in status["shards"]} == {"spare"}, status
        for d in dirs:
            c.start_shard(["--data-dir", str(d), *flags])
        status = c.wait_healthy(30)
        assert next(s["role"] for s in status["shards"] if s["pid"] == empty.pid) == "spare"
        with zps.connect_sync(c.address, timeout=20) as ps:
            np.testing.assert_array_equal(ps.pull_dense("w"), np.full(1000, -15.0))
    finally:
        c.stop()
