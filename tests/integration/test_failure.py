"""A dead shard makes clients wait for its partition until their deadline, then fail with
ShardUnavailableError, never hang."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest

import zps
from zps.optim import SGD
from zps.testing import LocalCluster


async def test_sigkilled_shard_fails_requests_at_their_deadline(
    fresh_cluster: LocalCluster,
) -> None:
    c = fresh_cluster
    async with zps.connect(c.address, timeout=3.0) as ps:
        await ps.create_embedding("t", dim=4, optimizer=SGD(lr=1.0))
        ids = np.arange(1000, dtype=np.int64)
        await ps.push_rows("t", ids, np.ones((1000, 4)))
        c.kill(c.shard_pid(0), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(zps.ShardUnavailableError, match="partition 0"):
            # keep pushing: the first call after death waits for its deadline, not longer
            for _ in range(10_000):
                await ps.push_rows("t", ids, np.ones((1000, 4)))
        elapsed = time.monotonic() - t0
        # detection is by heartbeat (1 s here), then the 3 s request timeout
        assert elapsed < 6.0, elapsed
        # the surviving partition keeps serving
        p1_ids = ids[[p == 1 for p in zps.core.routing.partitions_of_ids(ids, ps.cluster_map)]]
        rows = await ps.pull_rows("t", p1_ids)
        assert rows.shape == (p1_ids.size, 4)
        # and new requests for the dead partition wait for their deadline, then fail
        t1 = time.monotonic()
        with pytest.raises(zps.ShardUnavailableError, match=r"gave up after waiting 3\.0s"):
            await ps.pull_rows("t", ids)
        assert 3.0 <= time.monotonic() - t1 < 5.0
    # the heartbeat detector declares it dead and the map says so
    c.wait_for(
        lambda s: [p["state"] for p in s["partitions"]] == ["lost", "ok"],
        10,
        "partition 0 to be reported lost",
    )


async def test_in_flight_request_to_a_stopped_shard_fails_when_it_is_declared_dead(
    fresh_cluster: LocalCluster,
) -> None:
    c = fresh_cluster
    # Declared dead after 1 s (the liveness timeout here), well within the 4 s timeout.
    async with zps.connect(c.address, timeout=4.0) as ps:
        await ps.create_dense("d", shape=(10,), optimizer=SGD(lr=1.0))
        owner = zps.core.routing.chunk_partition("d", 0, ps.cluster_map)
        pid = c.shard_pid(owner)
        c.kill(pid, signal.SIGSTOP)  # frozen: connected, but never answers
        try:
            t0 = time.monotonic()
            with pytest.raises(zps.ShardUnavailableError):
                await asyncio.wait_for(ps.pull_dense("d"), 30)
            assert time.monotonic() - t0 < 6.0
        finally:
            c.kill(pid, signal.SIGKILL)


async def test_unanswered_request_times_out_with_a_clear_error(fresh_cluster: LocalCluster) -> None:
    c = fresh_cluster
    broker = next(p for p in c.procs if p.name == "broker")
    async with zps.connect(c.address, timeout=1.0) as ps:
        await ps.create_dense("d", shape=(10,), optimizer=SGD(lr=1.0))
        c.kill(broker.pid, signal.SIGSTOP)  # nothing gets routed any more
        try:
            t0 = time.monotonic()
            with pytest.raises(zps.ZpsTimeoutError, match="not answered within 1s"):
                await ps.pull_dense("d")
            assert time.monotonic() - t0 < 3.0
        finally:
            c.kill(broker.pid, signal.SIGCONT)
        # the broker is back: the same client works again
        assert (await ps.pull_dense("d")).shape == (10,)


async def test_sends_a_full_queue_held_back_all_arrive_in_order(
    fresh_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker that stops reading fills the client's queue to it: the client holds
    the sends back (its flush task waits for room) and, once the broker reads again,
    every one arrives; none is lost or applied twice."""
    c = fresh_cluster
    broker = next(p for p in c.procs if p.name == "broker")
    dealer = zps.transport.dealer
    # A queue of 4 messages (the default is 1000): full after the kernel's buffers.
    monkeypatch.setattr(zps.transport, "dealer", lambda *a, **k: dealer(*a, **{**k, "hwm": 4}))
    dim = 16_384  # 64 KiB a row: a message per push, the buffers fill in a few hundred
    rng = np.random.default_rng(7)
    async with zps.connect(c.address, timeout=60.0, shm_bytes=0, compress=False) as ps:
        await ps.create_embedding("held", dim=dim, optimizer=SGD(lr=1.0))
        ids = np.arange(4, dtype=np.int64)
        before = await ps.pull_rows("held", ids)
        total = np.zeros((4, dim), np.float32)
        pushes = []
        c.kill(broker.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20
            while not ps.sends_held_back or len(pushes) < 20:
                assert time.monotonic() < deadline, "the client's queue never filled"
                i = len(pushes) % 4
                g = rng.standard_normal((1, dim)).astype(np.float32)
                total[i] += g[0]
                pushes.append(asyncio.ensure_future(ps.push_rows("held", ids[i : i + 1], g)))
                await asyncio.sleep(0)  # its own loop turn: a message of its own
            for _ in range(20):  # more behind the held-back ones
                g = rng.standard_normal((1, dim)).astype(np.float32)
                total[0] += g[0]
                pushes.append(asyncio.ensure_future(ps.push_rows("held", ids[:1], g)))
                await asyncio.sleep(0)
        finally:
            c.kill(broker.pid, signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(*pushes), 30)
        assert not ps.sends_held_back
        after = await ps.pull_rows("held", ids)
    np.testing.assert_allclose(after, before - total, rtol=1e-4, atol=1e-3)


async def test_a_killed_primary_is_declared_dead_by_its_closed_connections() -> None:
    """A SIGKILLed shard's data connection and liveness link both close: the broker
    declares it dead at once, long before its liveness timeout (10 s here) and before
    the two intervals (1 s here) a single closed connection gets, and its replica takes
    over with nothing acknowledged lost.  Without the rule the log says "missed its
    heartbeats" and the failover waits for that grace."""
    with LocalCluster(
        partitions=1, shards=3, replication=2, heartbeat_interval=0.5, liveness=20
    ) as c:
        c.wait_healthy()
        async with zps.connect(c.address, timeout=20.0) as ps:
            await ps.create_embedding("t", dim=4, optimizer=SGD(lr=1.0))
            ids = np.arange(100, dtype=np.int64)
            pushed = 0
            for _ in range(5):
                await ps.push_rows("t", ids, np.ones((100, 4)))
                pushed += 1
            pid = c.shard_pid(0)
            victim = next(s["node"] for s in c.status()["shards"] if s["pid"] == pid)
            c.kill(pid, signal.SIGKILL)
            await ps.push_rows("t", ids, np.ones((100, 4)))  # the replica, promoted
            pushed += 1
            rows = await ps.pull_rows("t", ids)
        log = c.broker().log()
        assert f"shard {victim} closed both its connections; declared dead" in log, log
        np.testing.assert_array_equal(rows, np.full((100, 4), -float(pushed)))
        assert c.shard_pid(0) != pid
