"""Gray failures at the broker: a peer that stops reading never freezes it.

A raw DEALER with a one-message receive queue floods the broker with STATUS
requests and reads nothing; a client process with thousands of requests in flight
is SIGSTOPped.  Meanwhile an honest client keeps pushing and pulling: it is
answered within 2 s throughout, no shard is declared dead, every acknowledged push
is there afterwards, and the bytes the broker holds for slow peers stay within
its configured bounds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from tests.integration.wire import raw_dealer
from zps.core.routing import partitions_of_ids
from zps.optim import SGD
from zps.protocol.codec import MsgType, Route, encode
from zps.testing import LocalCluster

CLIENT_QUEUE = 1 << 20
SHARD_QUEUE = 4 << 20
QUEUE = 8 << 20
WORST_S = 2.0
TABLE = "gray"
DIM = 8
N_IDS = 512

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    config = tmp_path / "zps.toml"
    config.write_text(
        "[broker]\n"
        f"client_queue_bytes = {CLIENT_QUEUE}\n"
        f"shard_queue_bytes = {SHARD_QUEUE}\n"
        f"queue_bytes = {QUEUE}\n"
        "stall_timeout = 3.0\n"
    )
    with LocalCluster(
        partitions=2, shards=2, replication=1, broker_args=["--config", str(config)]
    ) as c:
        yield c


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def epochs(status: dict[str, Any]) -> list[int]:
    return [int(p["epoch"]) for p in status["partitions"]]


def shard_deaths(c: LocalCluster) -> list[str]:
    return [
        line
        for line in c.broker().log().splitlines()
        if "declared dead" in line and " shard " in line
    ]


class Honest:
    """A client that pushes ones to every id and pulls, timing each call."""

    def __init__(self, ps: zps.Client) -> None:
        self.ps = ps
        self.ids = np.arange(N_IDS, dtype=np.int64)
        self.acked = 0
        self.worst = 0.0
        self.held_seen: list[int] = []
        self.broker: dict[str, Any] = {}
        self.ops = 0

    async def setup(self) -> None:
        await self.ps.create_embedding(TABLE, dim=DIM, optimizer=SGD(lr=1.0))
        self.base = await self.ps.pull_rows(TABLE, self.ids)
        parts = set(partitions_of_ids(self.ids, self.ps.cluster_map))
        assert parts == {0, 1}, parts

    async def _timed(self, call: Any) -> Any:
        t0 = time.monotonic()
        try:
            return await asyncio.wait_for(call, 5.0)
        finally:
            self.worst = max(self.worst, time.monotonic() - t0)
            self.ops += 1

    async def step(self) -> None:
        ones = np.ones((self.ids.size, DIM), np.float32)
        await self._timed(self.ps.push_rows(TABLE, self.ids, ones))
        self.acked += 1
        await self._timed(self.ps.pull_rows(TABLE, self.ids))
        self.broker = (await self._timed(self.ps.status()))["broker"]
        self.held_seen.append(int(self.broker["flow"]["held_bytes"]))

    async def verify(self) -> None:
        rows = await self.ps.pull_rows(TABLE, self.ids)
        np.testing.assert_array_equal(rows, self.base - float(self.acked))


def flood(address: str, n: int, sent: list[int], done: threading.Event) -> None:
    """A peer that asks for the status ``n`` times and never reads an answer."""
    with raw_dealer(address, b"c-never-reads", RCVHWM=1, RCVBUF=4096, SNDTIMEO=20_000) as sock:
        for i in range(n):
            sock.send_multipart(encode(Route(MsgType.STATUS, req_id=i + 1), {}))
            sent[0] = i + 1
        done.wait(30)  # connected and unread until the test is over


async def test_a_peer_that_never_reads_does_not_freeze_the_broker(cluster: LocalCluster) -> None:
    c = cluster
    before = c.status()
    broker_pid = c.broker().pid
    rss0 = rss_mb(broker_pid)
    async with zps.connect(c.address, timeout=30.0) as ps:
        honest = Honest(ps)
        await honest.setup()
        sent = [0]
        done = threading.Event()
        n = 20_000
        thread = threading.Thread(target=flood, args=(c.address, n, sent, done), daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 25
            t_end = None
            while time.monotonic() < deadline:
                await honest.step()
                if sent[0] >= n and t_end is None:
                    t_end = time.monotonic() + 1.5  # and a while with the flood unread
                if t_end is not None and time.monotonic() > t_end:
                    break
            assert sent[0] == n, f"the broker took only {sent[0]} of {n} requests"
            status = await ps.status()
        finally:
            done.set()
            thread.join(10)
        await honest.verify()
    flow = status["broker"]["flow"]
    rss1 = rss_mb(broker_pid)
    print(
        f"non-reading peer: {honest.ops} honest calls, worst {honest.worst:.3f}s; "
        f"broker dropped {status['broker']['dropped']} messages; held peak "
        f"{flow['peak_held_bytes']} B (bound {QUEUE}); RSS {rss0:.0f} -> {rss1:.0f} MB"
    )
    assert honest.worst < WORST_S, honest.worst
    assert not shard_deaths(c), shard_deaths(c)
    assert epochs(status) == epochs(before)
    # The peer's replies beyond its allowance were dropped, within the bounds.
    assert status["broker"]["dropped"] > 0
    assert 0 < flow["peak_peer_held_bytes"] <= SHARD_QUEUE
    assert flow["peak_held_bytes"] <= QUEUE
    assert max(honest.held_seen) <= QUEUE
    assert rss1 - rss0 < 200, (rss0, rss1)


CLIENT = textwrap.dedent(
    """
    import asyncio, sys, time
    import numpy as np
    import zmq
    import zps
    from zps import transport

    sent = 0
    _send, _send_if_room = transport.send, transport.send_if_room

    async def counted(ch, frames):
        global sent
        ok = await _send(ch, frames)
        sent += 1
        return ok

    def counted_if_room(ch, frames):
        global sent
        ok = _send_if_room(ch, frames)
        sent += ok
        return ok

    # The client's requests go out through these two (the second when the queue is full).
    transport.send, transport.send_if_room = counted, counted_if_room

    async def main() -> None:
        async with zps.connect(
            sys.argv[1], timeout=300.0, batch_max_ops=1, compress=False
        ) as ps:
            assert transport.tcp_rcvbuf() == 1 << 16, "the modest buffers were not set"
            ids = np.arange(%(n_rows)d, dtype=np.int64)
            await ps.pull_rows(%(table)r, ids)
            base = sent
            pulls = [
                asyncio.ensure_future(ps.pull_rows(%(table)r, ids))
                for _ in range(%(in_flight)d)
            ]
            t0 = time.monotonic()
            while time.monotonic() < t0 + 10:
                due = sent - base - sum(f.done() for f in pulls)
                if due >= %(due)d:
                    break
                await asyncio.sleep(0.001)
            print("in flight after %%.2fs:" %% (time.monotonic() - t0), due, flush=True)
            # Stop reading (the loop is held) while zmq's I/O thread still delivers what
            # it was handed, so thousands of replies are due to a peer that takes nothing.
            time.sleep(600)
            await asyncio.gather(*pulls)

    asyncio.run(main())
    """
)


async def test_a_stopped_client_with_thousands_in_flight_does_not_freeze_the_broker(
    cluster: LocalCluster,
) -> None:
    c = cluster
    before = c.status()
    broker_pid = c.broker().pid
    async with zps.connect(c.address, timeout=30.0) as ps:
        honest = Honest(ps)
        await honest.setup()
        await ps.push_rows(TABLE, honest.ids, np.zeros((N_IDS, DIM), np.float32))
        # 1,024 rows of 8 floats, half in each partition: two 16 KiB replies per call (inline:
        # below the shared-memory and compression thresholds), thousands more than zmq's
        # queues (1,000 messages each side) hold, and about 100 MiB in all: more than
        # the kernel's buffers take, however large a host lets them grow.
        await honest.step()
        flow0 = dict(honest.broker["flow"], dropped=honest.broker["dropped"])
        script = CLIENT % {"n_rows": 1024, "table": TABLE, "in_flight": 4000, "due": 6000}
        # A host with modest socket buffers (Linux lets a receive buffer grow to 32 MiB,
        # which would hide the replies due in the kernel rather than at the broker).
        modest = {"ZPS_TCP_RCVBUF": str(1 << 16)}
        proc = subprocess.Popen(
            [sys.executable, "-c", script, c.address],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **modest},
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
            assert line.startswith(b"in flight"), line
            due = int(line.split()[-1])
            time.sleep(0.5)  # delivery of the requests (no event to await: it reads nothing)
            os.kill(proc.pid, signal.SIGSTOP)
            # Until the broker has replies for the stopped client that zmq cannot take
            # (and for a while after): the answers to thousands of requests.  The peak
            # counters catch a hold that came and went between two status calls.
            hit: float | None = None
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                await honest.step()
                b = honest.broker
                if hit is None and (
                    b["dropped"] > flow0["dropped"]
                    or b["flow"]["held_bytes"]
                    or b["flow"]["peak_peer_held_bytes"] > flow0["peak_peer_held_bytes"]
                ):
                    hit = time.monotonic()
                if hit is not None and time.monotonic() > hit + 2.0:
                    break
            assert hit is not None, (
                f"the stopped client's replies never filled its queue ({line!r}; "
                f"broker {honest.broker})"
            )
            status = await ps.status()
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            for _ in range(5):
                await honest.step()
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
        await honest.verify()
    flow = status["broker"]["flow"]
    print(
        f"stopped client ({due} requests due): {honest.ops} honest calls, "
        f"worst {honest.worst:.3f}s; broker dropped {status['broker']['dropped']} messages; "
        f"held peak {flow['peak_held_bytes']} B (bound {QUEUE}); "
        f"broker RSS {rss_mb(broker_pid):.0f} MB"
    )
    assert honest.worst < WORST_S, honest.worst
    assert not shard_deaths(c), shard_deaths(c)
    assert epochs(c.status()) == epochs(before)
    assert flow["peak_peer_held_bytes"] <= SHARD_QUEUE
    assert flow["peak_held_bytes"] <= QUEUE
    assert max(honest.held_seen) <= QUEUE


FLOODER = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    import zps

    async def main() -> None:
        ids = np.array([int(x) for x in sys.argv[2].split(",")], dtype=np.int64)
        async with zps.connect(
            sys.argv[1], timeout=60.0, batch_max_ops=1, compress=False
        ) as ps:
            await ps.pull_rows(%(table)r, ids)  # the spec, before the shard pauses
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # the shard is paused now
            ones = np.ones((ids.size, %(dim)d), np.float32)
            pushes = asyncio.gather(*(ps.push_rows(%(table)r, ids, ones) for _ in range(%(n)d)))
            await asyncio.sleep(0.1)
            print("flooding", flush=True)
            await pushes
            print("done", flush=True)

    asyncio.run(main())
    """
)


@pytest.fixture
def slow_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """As ``cluster``, with a 3 s liveness timeout: a shard may pause 1.5 s unnoticed."""
    config = tmp_path / "zps.toml"
    config.write_text(f"[broker]\nshard_queue_bytes = {SHARD_QUEUE}\nqueue_bytes = {QUEUE}\n")
    with LocalCluster(
        partitions=2, shards=2, replication=1, liveness=30, broker_args=["--config", str(config)]
    ) as c:
        yield c


async def test_requests_for_a_paused_shard_are_refused_overloaded_not_waited_on(
    slow_cluster: LocalCluster,
) -> None:
    c = slow_cluster
    before = c.status()
    n_flood = 3000
    async with zps.connect(c.address, timeout=30.0) as ps:
        honest = Honest(ps)
        await honest.setup()
        owner = partitions_of_ids(honest.ids, ps.cluster_map)
        honest.ids = honest.ids[owner == 1]  # the honest client only needs partition 1
        honest.base = await ps.pull_rows(TABLE, honest.ids)
        p0 = np.arange(N_IDS, dtype=np.int64)[owner == 0]
        base0 = await ps.pull_rows(TABLE, p0)
        paused = c.shard_pid(0)
        script = FLOODER % {"table": TABLE, "dim": DIM, "n": n_flood}
        ids_arg = ",".join(map(str, p0.tolist()))
        proc = subprocess.Popen(
            [sys.executable, "-c", script, c.address, ids_arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
            assert line.strip() == b"ready", line
            os.kill(paused, signal.SIGSTOP)
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
            assert line.strip() == b"flooding", line
            t_end = time.monotonic() + 1.5  # half the liveness timeout
            while time.monotonic() < t_end:
                await honest.step()
            status = await ps.status()
        finally:
            os.kill(paused, signal.SIGCONT)
            try:
                out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        assert proc.returncode == 0 and out.strip() == b"done", out
        await honest.verify()
        rows0 = await ps.pull_rows(TABLE, p0)
    print(
        f"paused shard: {honest.ops} honest calls, worst {honest.worst:.3f}s; "
        f"{status['broker']['overloaded']} requests refused OVERLOADED; held peak "
        f"{status['broker']['flow']['peak_held_bytes']} B"
    )
    assert honest.worst < WORST_S, honest.worst
    assert status["broker"]["overloaded"] > 0
    assert status["broker"]["flow"]["peak_peer_held_bytes"] <= SHARD_QUEUE
    np.testing.assert_array_equal(rows0, base0 - float(n_flood))
    assert not shard_deaths(c), shard_deaths(c)
    assert epochs(c.status()) == epochs(before)


async def test_connecting_to_a_paused_broker_times_out_instead_of_hanging(
    cluster: LocalCluster,
) -> None:
    broker = next(p for p in cluster.procs if p.name == "broker")
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(zps.ZpsTimeoutError, match="no answer from the broker"):
            async with zps.connect(cluster.address, connect_timeout=1.0):
                pass
        assert time.monotonic() - started < 3.0
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    async with zps.connect(cluster.address, connect_timeout=10.0) as ps:  # serving again
        assert (await ps.status())["n_partitions"] == 2
