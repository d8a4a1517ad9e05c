"""A broker restarted with its record ends its start-up hold as soon as every copy the
record names is back (zps/core/recovery.py ``claims_in``), with real processes: it
routes again well before its grace when every shard reclaims at once, and holds while
a recorded copy is away, until that copy comes back."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import zps
from zps.broker.statefile import StateFile
from zps.errors import ZpsError
from zps.optim import SGD
from zps.testing import DataDirCluster, Proc, free_port

GRACE = 20.0  # far longer than the claims take to come in
ENDED = "every recorded copy is back: the start-up hold ends"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[DataDirCluster]:
    c = DataDirCluster(
        partitions=2,
        replication=2,
        heartbeat_interval=0.1,
        liveness=10,
        workdir=tmp_path,
        broker_data_dir=tmp_path / "broker",
    )
    c.port = free_port()
    yield c
    c.stop()


def sigkill(proc: Proc) -> None:
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait(10)


def pull(c: DataDirCluster, timeout: float) -> np.ndarray:
    """The dense table, which spans both partitions."""
    with zps.connect_sync(c.address, timeout=timeout) as ps:
        return ps.pull_dense("w")


def recorded(data_dir: Path, copies: int, timeout: float) -> None:
    """Wait until the broker's record on disk names ``copies`` in-sync copies of every
    partition (the status shows the broker's state, which its record follows)."""
    deadline = time.monotonic() + timeout
    while True:
        rec = StateFile(data_dir).load()
        if rec is not None and all(len(p.in_sync) == copies for p in rec.partitions):
            return
        assert time.monotonic() < deadline, f"the record names {rec}"
        time.sleep(0.05)


def restart(c: DataDirCluster) -> tuple[Proc, float]:
    """A broker on the same port and data dir with a long grace, and when it started."""
    return c.start_broker(grace=GRACE), time.monotonic()


def test_a_restarted_broker_routes_once_every_recorded_copy_is_back(
    cluster: DataDirCluster, tmp_path: Path
) -> None:
    c = cluster
    c.start_broker()
    shards = [c.start_shard(tmp_path / f"shard{i}") for i in range(4)]
    c.wait_healthy(30)
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(1_000,), dtype="float64", optimizer=SGD(lr=1.0))
        for k in range(5):
            ps.push_dense("w", np.full(1_000, float(k + 1)))
        w = ps.pull_dense("w")
    assert w[0] == -15.0

    # Every shard stays up: they reclaim as the broker binds, and it routes at once.
    sigkill(c.broker())
    broker, t0 = restart(c)
    np.testing.assert_array_equal(pull(c, timeout=GRACE / 2), w)
    waited = time.monotonic() - t0  # the broker's start-up included
    assert waited < GRACE / 4, waited
    status = c.status()
    assert status["broker"]["holding_s"] == 0 and status["broker"]["uptime_s"] < GRACE / 2
    assert ENDED in broker.log()
    status = c.wait_healthy(30)
    recorded(tmp_path / "broker", 2, 10)  # what the restarted broker will wait for

    # A replica is away when the broker comes back: the partitions' primaries are back
    # and serve nothing while the broker holds for the missing copy.
    by_pid = {p.pid: p for p in shards}
    away = next(by_pid[s["pid"]] for s in status["shards"] if s["role"] == "replica")
    partition = next(s["partition"] for s in status["shards"] if s["pid"] == away.pid)
    sigkill(c.broker())
    sigkill(away)
    broker, t0 = restart(c)
    status = c.wait_for(
        lambda s: len(s["shards"]) == 3 and all(p["primary"] for p in s["partitions"]),
        GRACE / 2,
        "the three shards that are up to reclaim",
    )
    assert status["broker"]["holding_s"] > 0, status["broker"]
    assert status["partitions"][partition]["state"] == "degraded"
    with pytest.raises(ZpsError):
        pull(c, timeout=1.0)  # refused while the broker holds
    assert ENDED not in broker.log()
    assert c.status()["broker"]["holding_s"] > 0

    # The missing copy comes back with its data dir: the hold ends with its claim.
    index = shards.index(away)
    c.start_shard(tmp_path / f"shard{index}")
    np.testing.assert_array_equal(pull(c, timeout=GRACE), w)
    status = c.status()
    assert status["broker"]["holding_s"] == 0
    assert status["broker"]["uptime_s"] < GRACE - 5, status["broker"]
    assert ENDED in broker.log()
    c.wait_healthy(30)
