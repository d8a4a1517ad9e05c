"""The same-host shared-memory path (zps.shm) with real processes: the same bits as
inline frames, nothing left behind by SIGKILLed workers and shards, and inline
frames whenever a peer cannot read the other's memory."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import mmap
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zps import errors, shm
from zps.client.client import Client, connect
from zps.client.sync import connect_sync as zps_sync
from zps.core.routing import chunk_partition
from zps.init import Zeros
from zps.optim import SGD, Adagrad
from zps.protocol.codec import Message, MsgType, Route
from zps.protocol.specs import DenseSpec
from zps.testing import DataDirCluster, LocalCluster, free_port, scrape_metric

pytestmark = pytest.mark.skipif(shm.host_key() is None, reason="no memfd or /proc here")

ELEMS = 2 << 20  # 8 MiB of float32: 4 chunks of 2 MiB, above shm.MIN_BYTES
LR = 0.25


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _maps_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def _wait_until(cond: object, timeout: float, what: str) -> None:
    assert callable(cond)
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def no_shm_left() -> Iterator[None]:
    """No segment in /dev/shm is left by the test's processes."""
    before = _dev_shm()
    yield
    # The simulator's scratch directories (zps-sim-*) are another process's, not segments.
    left = {n for n in _dev_shm() - before if "zps" in n and not n.startswith("zps-sim-")}
    assert not left, f"left in /dev/shm: {left}"


async def _steps(ps: Client, name: str, grads: list[np.ndarray]) -> list[np.ndarray]:
    """Push each gradient and pull after it: the values seen after every push."""
    seen = []
    out = np.empty(ELEMS, np.float32)
    for g in grads:
        await ps.push_dense(name, g)
        seen.append((await ps.pull_dense(name, out=out)).copy())
    return seen


@contextlib.asynccontextmanager
async def _side_by_side(
    address: str, names: tuple[str, str], **options: Any
) -> AsyncIterator[tuple[Client, Client]]:
    """A client through shared memory (with ``options``) and one with it off, each with a
    dense table of its own (``names``: the first's, the second's)."""
    async with (
        connect(address, timeout=20, **options) as fast,
        connect(address, timeout=20, shm_bytes=0) as inline,
    ):
        assert fast.shm_path.memory is not None
        await fast.create_dense(names[0], (ELEMS,), optimizer=SGD(lr=LR))
        await inline.create_dense(names[1], (ELEMS,), optimizer=SGD(lr=LR))
        yield fast, inline


def _record_reads(ps: Client, monkeypatch: pytest.MonkeyPatch) -> list[np.ndarray | None]:
    """Where each read from a shard's shared memory goes (``into``, None: a fresh
    array), from now on, for the client ``ps``."""
    assert ps.shm_path.memory is not None
    mapper = ps.shm_path.memory.mapper
    real = mapper.read
    targets: list[np.ndarray | None] = []

    def recording(desc: list[int], into: np.ndarray | None = None) -> np.ndarray:
        targets.append(into)
        return real(desc, into)

    monkeypatch.setattr(mapper, "read", recording)
    return targets


async def _alike(
    fast: Client, inline: Client, names: tuple[str, str], grads: list[np.ndarray]
) -> list[np.ndarray]:
    """The same steps on both tables: the values seen after each, the same bits."""
    got = await _steps(fast, names[0], grads)
    want = await _steps(inline, names[1], grads)
    for x, y in zip(got, want, strict=True):
        assert x.tobytes() == y.tobytes()
    return got


def _grads(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(ELEMS, dtype=np.float32) for _ in range(n)]


@pytest.fixture
def replicated() -> Iterator[LocalCluster]:
    with LocalCluster(partitions=2, shards=4, replication=2) as c:
        yield c


@pytest.fixture(scope="module")
def _replicated_one() -> Iterator[LocalCluster]:
    with LocalCluster(partitions=1, shards=2, replication=2) as c:
        yield c


@pytest.fixture
def replicated_one(_replicated_one: LocalCluster) -> Iterator[LocalCluster]:
    """One partition, two copies, shared by the module's tests that only pause its
    processes (each continued before the test ends): a stopped primary may be failed
    over or not.  Each test starts with both copies in sync and no table; the tables it
    made are dropped after it."""
    c = _replicated_one
    assert all(p.alive() for p in c.procs), c.logs()
    c.wait_healthy(30)
    yield c
    with zps_sync(c.address, timeout=20) as ps:
        for name in ps.list_tables():
            ps.drop_table(name)


def _kill_primaries(c: LocalCluster) -> None:
    """SIGKILL both partitions' primaries and wait until they are gone."""
    for p in (0, 1):
        pid = c.shard_pid(p)
        c.kill(pid, signal.SIGKILL)
        c.wait_gone(pid)


@contextlib.asynccontextmanager
async def _after_failover(c: LocalCluster) -> AsyncIterator[tuple[Client, Client]]:
    """A client through shared memory and one with it off, each acknowledged by the
    promoted replicas alone (acks=1)."""
    async with (
        connect(c.address, timeout=20, acks=1) as fast,
        connect(c.address, timeout=20, shm_bytes=0, acks=1) as inline,
    ):
        yield fast, inline


async def test_shared_memory_gives_the_bits_of_inline_frames_through_failover(
    replicated: LocalCluster, no_shm_left: None
) -> None:
    c = replicated
    grads = _grads(6, 1)
    async with _side_by_side(c.address, ("a", "b")) as (fast, inline):
        assert inline.shm_path.memory is None
        got = await _alike(fast, inline, ("a", "b"), grads[:3])
        stats = fast.shm_path.memory.stats()
        assert stats["puts"] >= 6 and stats["reads"] >= 6  # both ways, every chunk
        assert stats["refused"] == 0 and not fast.shm_path.refused
        assert stats["live"] == 0  # every request's regions were freed once answered

        # The replicas applied the primaries' own copies: after both primaries die, the
        # promoted replicas hold the same bits, and carry on (alone: acks=1).
        _kill_primaries(c)
    async with _after_failover(c) as (fast, inline):
        out = np.empty(ELEMS, np.float32)
        a, b = await fast.pull_dense("a", out=out), await inline.pull_dense("b")
        assert a.tobytes() == b.tobytes() == got[-1].tobytes()
        got = await _alike(fast, inline, ("a", "b"), grads[3:])
        ref = np.zeros(ELEMS, np.float32)
        for g in grads:
            ref -= np.float32(LR) * g
        np.testing.assert_allclose(got[-1], ref, rtol=1e-5, atol=1e-5)


ROWS, DIM = 6_000, 32  # 4,096 of them a step: about 256 KiB of float32 rows per partition


async def _row_steps(ps: Client, name: str, steps: list[tuple[np.ndarray, np.ndarray]]) -> Any:
    """Pipelined sparse steps (each step's push leaves with the next pull): the rows
    each pull saw, then every row after the last push."""
    seen = []
    for ids, g in steps:
        seen.append(await ps.pull_rows(name, ids))
        await ps.push_rows(name, ids, g, wait=False)
    await ps.flush()
    return seen, await ps.pull_rows(name, np.arange(ROWS, dtype=np.int64))


async def test_sparse_steps_through_shared_memory_give_the_bits_of_inline_frames(
    replicated: LocalCluster, no_shm_left: None
) -> None:
    """A sparse step's rows and gradients (above shm.MIN_BYTES per partition) travel
    through shared memory both ways, pipelined, and give the bits of inline frames,
    on the primaries and on the replicas promoted after both primaries' SIGKILL."""
    c = replicated
    rng = np.random.default_rng(11)
    steps = [
        (
            rng.permutation(ROWS)[:4096].astype(np.int64),
            rng.standard_normal((4096, DIM), dtype=np.float32),
        )
        for _ in range(5)
    ]
    opt = Adagrad(lr=0.1)
    async with (
        connect(c.address, timeout=20) as fast,
        connect(c.address, timeout=20, shm_bytes=0) as inline,
    ):
        assert fast.shm_path.memory is not None and inline.shm_path.memory is None
        for ps, name in ((fast, "rows-a"), (inline, "rows-b")):
            await ps.create_embedding(name, dim=DIM, init=Zeros(), optimizer=opt)
        puts, reads = fast.shm_path.memory.stats()["puts"], fast.shm_path.memory.stats()["reads"]
        got, after = await _row_steps(fast, "rows-a", steps)
        want, after_inline = await _row_steps(inline, "rows-b", steps)
        for x, y in zip(got, want, strict=True):
            assert x.tobytes() == y.tobytes()
        assert after.tobytes() == after_inline.tobytes()
        stats = fast.shm_path.memory.stats()
        # Both ways, each partition's frame: 5 pushes out, 6 pulls back (2 partitions).
        assert stats["puts"] - puts >= 10 and stats["reads"] - reads >= 12, stats
        assert stats["refused"] == 0 and stats["live"] == 0
        _kill_primaries(c)
    async with _after_failover(c) as (fast, inline):
        every = np.arange(ROWS, dtype=np.int64)
        a, b = await fast.pull_rows("rows-a", every), await inline.pull_rows("rows-b", every)
        assert a.tobytes() == b.tobytes() == after.tobytes()


_WORKER = """
import asyncio, sys
import numpy as np
import zps

async def main(address):
    async with zps.connect(address, timeout=20) as ps:
        await ps.create_dense("w", shape=(ELEMS,), optimizer=zps.optim.SGD(lr=0.001))
        g = np.ones(ELEMS, np.float32)
        out = np.empty(ELEMS, np.float32)
        while True:
            await ps.push_dense("w", g, wait=False)
            await ps.pull_dense("w", out=out)
            print("STEP", flush=True)

asyncio.run(main(sys.argv[1]))
""".replace("ELEMS", str(ELEMS))


def _script(c: LocalCluster, source: str, *args: str) -> subprocess.Popen[str]:
    """``source`` run by this interpreter in a process of its own, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-c", source, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=c.env(),
        text=True,
    )


async def test_sigkilled_worker_and_shard_mid_transfer_leave_nothing_behind(
    replicated: LocalCluster, no_shm_left: None
) -> None:
    c = replicated
    worker = _script(c, _WORKER, c.address)
    try:
        assert worker.stdout is not None
        for _ in range(5):  # pushes and pulls in flight all the time
            line = worker.stdout.readline().strip()
            if line != "STEP":
                worker.kill()
                assert worker.stderr is not None
                raise AssertionError(f"the worker failed: {worker.stderr.read()[-2000:]}")
        primaries = [c.shard_pid(p) for p in (0, 1)]
        _wait_until(
            lambda: all(f"zps-{worker.pid}-client" in _maps_of(pid) for pid in primaries),
            10,
            "the shards to map the worker's memory",
        )
        worker.kill()
        worker.wait(10)
        # The shards let go of the dead worker's memory, so the kernel frees it.
        _wait_until(
            lambda: not any(f"zps-{worker.pid}-" in _maps_of(pid) for pid in primaries),
            10,
            "the shards to unmap a dead worker's memory",
        )
    finally:
        worker.kill()
        worker.wait(10)

    grads = _grads(4, 2)
    async with _side_by_side(c.address, ("x", "y")) as (fast, inline):
        await _steps(fast, "x", grads[:1])
        await _steps(inline, "y", grads[:1])

        # A primary SIGKILLed while pulls of its replies and pushes are in flight.
        victim = c.shard_pid(0)
        assert f"zps-{os.getpid()}-client" in _maps_of(victim)
        out = np.empty(ELEMS, np.float32)

        async def pulls() -> int:
            n = 0
            while not stop.is_set():
                await fast.pull_dense("x", out=out)
                n += 1
            return n

        stop = asyncio.Event()
        task = asyncio.create_task(pulls())
        await asyncio.sleep(0.2)
        c.kill(victim, signal.SIGKILL)
        await asyncio.to_thread(c.wait_gone, victim)
        stop.set()
        assert await asyncio.wait_for(task, 30) > 0

        # This client lets go of the dead shard's memory.
        end = time.monotonic() + 10
        while f"zps-{victim}-shard" in _maps_of(os.getpid()):
            assert time.monotonic() < end, "the client kept a dead shard's memory mapped"
            await asyncio.sleep(0.05)
    async with (
        connect(c.address, timeout=20, acks=1) as fast,
        connect(c.address, timeout=20, shm_bytes=0, acks=1) as inline,
    ):
        await _alike(fast, inline, ("x", "y"), grads[1:])


async def test_pushes_through_shared_memory_apply_exactly_once_across_a_failover(
    no_shm_left: None,
) -> None:
    """Pushes in flight when a primary is SIGKILLed are re-sent to the promoted replica,
    naming the same regions of this client's memory: each applies once."""
    with LocalCluster(partitions=2, shards=5, replication=2) as c:
        async with connect(c.address, timeout=30) as ps:
            assert ps.shm_path.memory is not None
            await ps.create_dense("e", (ELEMS,), optimizer=SGD(lr=1.0))
            ones = np.ones(ELEMS, np.float32)
            sent = 0
            midway = asyncio.Event()

            async def pushes(n: int) -> None:
                nonlocal sent
                for _ in range(n):
                    await ps.push_dense("e", ones, wait=False)
                    sent += 1
                    if sent == 8:
                        midway.set()

            await pushes(5)
            victim = c.shard_pid(0)
            task = asyncio.create_task(pushes(20))
            await asyncio.wait_for(midway.wait(), 30)
            c.kill(victim, signal.SIGKILL)
            await asyncio.wait_for(task, 60)
            await ps.flush()
            assert ps.stats.retries > 0  # some went again, to the new primary
            got = await ps.pull_dense("e")
            assert np.array_equal(got, np.full(ELEMS, -float(sent), np.float32)), (
                f"{sent} pushes; values {np.unique(got)}"
            )
            assert (
                ps.shm_path.memory.stats()["puts"] > 0 and ps.shm_path.memory.stats()["live"] == 0
            )


def test_the_log_holds_the_bytes_of_pushes_sent_through_shared_memory(tmp_path: Path) -> None:
    """Every process SIGKILLed and started again on the same data dirs: the write-ahead
    log replays the pushes with their bytes (the shard logs its own copy)."""
    c = DataDirCluster(partitions=2, shards=0, workdir=tmp_path)
    c.port = free_port()
    dirs = [tmp_path / f"data{i}" for i in range(2)]
    flags = ["--durability", "fsync", "--checkpoint-interval", "0", "--checkpoint-every", "100000"]
    try:
        c.start_broker()
        for d in dirs:
            c.start_shard(d, flags)
        c.wait_healthy(30)

        async def before() -> np.ndarray:
            async with connect(c.address, timeout=20) as ps:
                assert ps.shm_path.memory is not None
                await ps.create_dense("l", (ELEMS,), optimizer=SGD(lr=LR))
                for g in _grads(3, 6):
                    await ps.push_dense("l", g)
                assert ps.shm_path.memory.stats()["puts"] >= 6
                return await ps.pull_dense("l")

        want = asyncio.run(before())
        for p in [p for p in c.procs if p.alive()]:
            os.kill(p.pid, signal.SIGKILL)
            p.popen.wait(10)
        restarted = [c.start_shard(d, flags) for d in dirs]
        c.restart_broker(grace=1.0)
        c.wait_healthy(60)

        async def after() -> np.ndarray:
            async with connect(c.address, timeout=20, shm_bytes=0) as ps:
                return await ps.pull_dense("l")

        assert asyncio.run(after()).tobytes() == want.tobytes()
        assert all("logged" in p.log() for p in restarted), [p.log()[-800:] for p in restarted]
    finally:
        c.stop()


@pytest.fixture
def shards_without_shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    monkeypatch.setenv("ZPS_NO_SHM", "1")  # the shards' environment
    with LocalCluster(partitions=2, shards=2) as c:
        monkeypatch.delenv("ZPS_NO_SHM")
        yield c


async def test_a_shard_that_cannot_read_the_memory_gets_inline_frames(
    shards_without_shm: LocalCluster, no_shm_left: None
) -> None:
    c = shards_without_shm
    grads = _grads(3, 3)
    async with _side_by_side(c.address, ("a", "b")) as (fast, inline):
        await _alike(fast, inline, ("a", "b"), grads)
        # Each primary refused once, then got inline frames; no reply came this way.
        assert fast.shm_path.refused
        assert (
            fast.shm_path.memory.stats()["reads"] == 0 and fast.shm_path.memory.stats()["live"] == 0
        )


METRICS_PORT = free_port()


def _one_shard(metrics_port: int) -> LocalCluster:
    """One partition: every chunk on the one shard, its metrics at ``metrics_port``."""
    return LocalCluster(partitions=1, shards=1, shard_args=["--metrics-port", str(metrics_port)])


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """One shard shared by the module's tests, its metrics at METRICS_PORT."""
    with _one_shard(METRICS_PORT) as c:
        yield c


def _metric(name: str) -> float:
    return scrape_metric(METRICS_PORT, name)


async def test_a_client_of_another_host_sends_and_gets_inline_frames(
    cluster: LocalCluster,
) -> None:
    grads = _grads(2, 4)
    async with _side_by_side(cluster.address, ("h1", "h2")) as (other, inline):
        other.shm_path.memory.host = "another-boot/1"  # what a client elsewhere would say
        await _alike(other, inline, ("h1", "h2"), grads)
        assert other.shm_path.refused and other.shm_path.memory.stats()["reads"] == 0


async def test_a_shard_on_another_host_says_so_once_for_replies(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asks for large replies through shared memory, from a shard that
    cannot send them that way (another host), is told so on the answer (noshm: open,
    by that shard), and asks it no more: its next requests carry no such header."""
    async with connect(cluster.address, timeout=20) as ps:
        assert ps.shm_path.memory is not None
        ps.shm_path.memory.host = "another-boot/1"  # what a client elsewhere would say
        await ps.create_embedding("far", dim=64, init=Zeros(), optimizer=SGD(lr=LR))
        asked: list[bool] = []
        real = ps.shm_path.memory.outbound

        def recording(frames: Any, **kw: Any) -> Any:
            asked.append(bool(kw.get("reply_ok")))
            return real(frames, **kw)

        monkeypatch.setattr(ps.shm_path.memory, "outbound", recording)
        ids = np.arange(1024, dtype=np.int64)  # 256 KiB of float32 rows: above MIN_BYTES
        for _ in range(3):
            rows = await ps.pull_rows("far", ids)
            assert rows.shape == (1024, 64) and not rows.any()
        (primary,) = {s["node"] for s in (await asyncio.to_thread(cluster.status))["shards"]}
        assert asked == [True, False, False] and set(ps.shm_path.refused) == {primary}
        assert ps.shm_path.memory.stats()["reads"] == 0


async def test_a_small_dense_tensor_stays_on_the_heap_and_is_copied(cluster: LocalCluster) -> None:
    """A chunk under 1 MiB (here 384 KiB: above MIN_BYTES) keeps its values on the
    shard's heap, leaving the arena's room for dense values to large chunks: its pulls
    are copied into the arena, not lent."""
    dense, lent, sent = (
        _metric(f"zps_shard_shm_{m}")
        for m in ("dense_bytes", "lent_frames_total", "sent_frames_total")
    )
    async with connect(cluster.address, timeout=20) as ps:
        await ps.create_dense("small", (96 << 10,), optimizer=SGD(lr=LR))
        await ps.push_dense("small", np.ones(96 << 10, np.float32))  # the chunk is stored
        for _ in range(2):
            assert ((await ps.pull_dense("small")) == -LR).all()
    assert _metric("zps_shard_shm_dense_bytes") == dense
    assert _metric("zps_shard_shm_lent_frames_total") == lent
    assert _metric("zps_shard_shm_sent_frames_total") >= sent + 2


async def test_a_spent_budget_sends_the_rest_inline(cluster: LocalCluster) -> None:
    grads = _grads(2, 7)
    async with _side_by_side(cluster.address, ("s1", "s2"), shm_bytes=3 << 20) as (small, inline):
        await _alike(small, inline, ("s1", "s2"), grads)
        stats = small.shm_path.memory.stats()
        assert stats["puts"] >= 1 and stats["full"] >= 1 and stats["live"] == 0


async def test_a_reply_region_that_cannot_be_read_is_asked_for_again(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    grads = _grads(1, 5)
    async with connect(cluster.address, timeout=20) as ps:
        assert ps.shm_path.memory is not None
        await ps.create_dense("r", (ELEMS,), optimizer=SGD(lr=LR))
        await ps.push_dense("r", grads[0])
        want = (await ps.pull_dense("r")).copy()
        mapper = ps.shm_path.memory.mapper
        real = mapper.read
        failures = iter(
            [
                shm.ShmUnavailableError("reused", permanent=False),
                shm.ShmUnavailableError("cannot open", permanent=True),
            ]
        )

        def flaky(desc: list[int], into: np.ndarray | None = None) -> np.ndarray:
            err = next(failures, None)
            if err is not None:
                raise err
            return real(desc, into)

        monkeypatch.setattr(mapper, "read", flaky)
        got = await ps.pull_dense("r")  # retried, never the wrong bytes
        assert got.tobytes() == want.tobytes()
        assert ps.shm_path.replies_off == math.inf  # "cannot open": replies inline from now on
        reads = ps.shm_path.memory.stats()["reads"]
        assert (await ps.pull_dense("r")).tobytes() == want.tobytes()
        assert ps.shm_path.memory.stats()["reads"] == reads
    # The shard's side, in its metrics: pushes read, replies sent, none inline for want of room.
    assert _metric("zps_shard_shm_read_frames_total") >= 4
    assert _metric("zps_shard_shm_sent_frames_total") >= 4
    assert _metric("zps_shard_shm_full_total") == 0
    assert _metric("zps_shard_shm_bytes") >= 0


async def test_a_request_region_found_reused_is_sent_again_in_new_regions(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard refuses a push whose region's token changed before it read it, naming
    that token; the client frees that region, sends the push again in a new one, and
    it applies once."""
    (grad,) = _grads(1, 6)
    async with connect(cluster.address, timeout=20) as ps:
        assert ps.shm_path.memory is not None
        await ps.create_dense("gone", (ELEMS,), optimizer=SGD(lr=LR))
        before = (await ps.pull_dense("gone")).copy()
        arena = ps.shm_path.memory.arena
        real_put = arena.put
        spoiled: list[int] = []

        def spoil_first(data: Any, now: float | None = None) -> list[int] | None:
            got = real_put(data, now)
            if got is not None and not spoiled:  # as if reused before the shard read it
                spoiled.append(got[5])
                # Another mapping of the client's memory (opened as a peer opens it, by
                # /proc/PID/fd/FD) clears the region's token.
                pid, fd, _, offset = got[:4]
                with open(f"/proc/{pid}/fd/{fd}", "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
                    shm.region.set_token(mm, offset, 0)
            return got

        refusals: list[dict[str, Any]] = []
        real_refusal = ps.shm_path.refusal

        def seen(msg: Message) -> None:
            refusals.append(dict(msg.header))
            real_refusal(msg)

        monkeypatch.setattr(arena, "put", spoil_first)
        monkeypatch.setattr(ps.shm_path, "refusal", seen)
        await ps.push_dense("gone", grad)
        after = await ps.pull_dense("gone")
        assert ps.shm_path.memory.stats()["live"] == 0  # the spoiled region freed, the new one too
    assert [(r["noshm"], r.get("tok")) for r in refusals] == [("gone", spoiled)]
    np.testing.assert_array_equal(after, before - np.float32(LR) * grad)  # applied once


async def test_a_pulled_tensor_is_read_from_shared_memory_straight_into_its_place(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each chunk of a dense pull that comes through shared memory is copied once, into
    the result (or ``out=``), not into a fresh array and then again."""
    grads = _grads(2, 11)
    async with _side_by_side(cluster.address, ("d1", "d2")) as (fast, inline):
        for g in grads:
            await fast.push_dense("d1", g)
            await inline.push_dense("d2", g)
        targets = _record_reads(fast, monkeypatch)
        want = await inline.pull_dense("d2")
        out = np.full(ELEMS, np.nan, np.float32)
        got = await fast.pull_dense("d1", out=out)
        assert got is out and out.tobytes() == want.tobytes()
        assert len(targets) >= 2  # every chunk (both partitions) came through the memory
        assert all(t is not None and np.shares_memory(t, out) for t in targets), targets
        targets.clear()
        fresh = await fast.pull_dense("d1")
        assert fresh.tobytes() == want.tobytes() and not np.shares_memory(fresh, out)
        assert targets and all(t is not None and np.shares_memory(t, fresh) for t in targets)


async def test_a_push_that_does_not_wait_is_copied_once_into_shared_memory(
    cluster: LocalCluster,
) -> None:
    """``wait=False`` copies the gradient (the caller may reuse its buffer at once):
    into this client's arena, from where it is sent with no second copy; the regions
    are freed once the pushes are over."""
    grads = _grads(3, 13)
    async with _side_by_side(cluster.address, ("d1", "d2")) as (fast, inline):
        sm = fast.shm_path.memory
        chunks = ELEMS * 4 // (2 << 20)
        for g in grads:
            buf = g.copy()
            puts = sm.arena.puts
            await fast.push_dense("d1", buf, wait=False)
            # One region per chunk, made by the push itself: none by the sending.
            assert sm.staged_regions == chunks and sm.arena.puts == puts + chunks
            buf[:] = np.nan  # the caller's buffer, reused at once
            await fast.flush()
            await inline.push_dense("d2", g)
        got = await fast.pull_dense("d1")
        want = await inline.pull_dense("d2")
        assert got.tobytes() == want.tobytes()
        assert sm.arena.puts == 3 * chunks  # the pulls' replies came the other way
        await fast.pull_dense("d1")  # a call after the pushes were answered frees them
        assert sm.staged_regions == 0 and sm.arena.live == 0, sm.stats()


async def test_a_push_from_a_gradient_buffer_is_read_where_it_was_written(
    cluster: LocalCluster,
) -> None:
    """A gradient written into ``gradient_buffer`` is read by the shard straight from
    it: the client copies nothing (no region made by the pushes), each chunk is named
    as a slice of the buffer, and the values are the inline client's, bit for bit."""
    grads = _grads(3, 17)
    async with _side_by_side(cluster.address, ("b1", "b2")) as (fast, inline):
        sm = fast.shm_path.memory
        assert sm is not None
        buf = await fast.gradient_buffer("b1")
        assert buf.shape == (ELEMS,) and buf.dtype == np.float32 and not buf.any()
        chunks = ELEMS * 4 // (2 << 20)
        puts = sm.arena.puts
        for g in grads:
            buf[:] = g
            buffered = sm.stats()["buffered"]
            await fast.push_dense("b1", buf)
            assert sm.stats()["buffered"] == buffered + chunks
            await inline.push_dense("b2", g)
        assert sm.arena.puts == puts  # no copy of any gradient was made to send it
        got = await fast.pull_dense("b1")
        assert got.tobytes() == (await inline.pull_dense("b2")).tobytes()


async def _until(cond: object, timeout: float, what: str) -> None:
    """Poll ``cond`` while the event loop runs (the clients' replies come meanwhile)."""
    assert callable(cond)
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


BIG = 16 << 20  # 64 MiB of float32: more than the sockets' buffers hold


@pytest.mark.parametrize("stopped", ["shard", "broker"])
@pytest.mark.parametrize("shm_bytes", [256 << 20, 0], ids=["buffer", "inline"])
async def test_a_push_given_up_on_never_sends_what_the_caller_writes_after(
    replicated_one: LocalCluster, shm_bytes: int, stopped: str
) -> None:
    """A push whose caller stops waiting (cancelled while the primary, or the broker,
    is SIGSTOPped) stays in flight, and is re-sent and applied once the cluster
    answers again; the caller, its call over, writes the next gradient into the same
    array.  What is applied is the gradient of the push, never those later bytes:
    whether the request is read late from the buffer's memory (a new token: refused),
    re-sent (from a copy taken when the call ended), or still in zmq's queue when the
    call ended (sent inline: a copy, not the caller's memory)."""
    c, g = replicated_one, np.random.default_rng(19).standard_normal(BIG, dtype=np.float32)
    async with connect(c.address, timeout=20, shm_bytes=shm_bytes) as ps:
        await ps.create_dense("late", (BIG,), init=Zeros(), optimizer=SGD(lr=LR))
        await ps.create_dense("twin", (BIG,), init=Zeros(), optimizer=SGD(lr=LR))
        buf = await ps.gradient_buffer("late")
        assert (ps.shm_path.memory is not None and ps.shm_path.memory.buffer_regions > 0) == bool(
            shm_bytes
        )
        buf[:] = g
        broker = next(p for p in c.procs if p.name == "broker")
        pid = c.shard_pid(0) if stopped == "shard" else broker.pid
        c.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ps.push_dense("late", buf), 0.3)
            buf[:] = 1e6  # the caller's next gradient: never applied
        finally:
            c.kill(pid, signal.SIGCONT)
        await _until(lambda: ps.requests_in_flight == 0, 30, "the push applied")
        await ps.push_dense("twin", g)
        got = await ps.pull_dense("late")
        assert got.tobytes() == (await ps.pull_dense("twin")).tobytes()


async def test_a_push_given_up_on_lets_a_buffer_go_that_another_call_names(
    replicated_one: LocalCluster,
) -> None:
    """Two calls push the two halves of one buffer (two tensors) while the primary
    is stopped; the first is given up on and its half written again at once.  The
    buffer's region gets a new token although the second call's request still names
    it (that one is asked again and applied as it was); neither the first push's
    queued copy nor the second reads the first half's new bytes."""
    c, n = replicated_one, ELEMS
    g = np.random.default_rng(23).standard_normal(2 * n, dtype=np.float32)
    async with connect(c.address, timeout=20) as ps:
        await ps.create_dense("whole", (2 * n,))
        for name in ("a", "b", "a2", "b2"):
            await ps.create_dense(name, (n,), init=Zeros(), optimizer=SGD(lr=LR))
        buf = await ps.gradient_buffer("whole")
        buf[:] = g
        retokened = ps.shm_path.memory.stats()["retokened"]
        pid = c.shard_pid(0)
        c.kill(pid, signal.SIGSTOP)
        try:
            b = asyncio.ensure_future(ps.push_dense("b", buf[n:]))
            # Sent first, in requests of its own (not batched with the first call's).
            await _until(lambda: ps.requests_in_flight > 0, 10, "the second call sent")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ps.push_dense("a", buf[:n]), 0.3)
            assert ps.shm_path.memory.stats()["retokened"] == retokened + 1
            buf[:n] = 1e6
        finally:
            c.kill(pid, signal.SIGCONT)
        await asyncio.wait_for(b, 30)
        await _until(lambda: ps.requests_in_flight == 0, 30, "the pushes applied")
        await ps.push_dense("a2", g[:n])
        await ps.push_dense("b2", g[n:])
        for x, y in (("a", "a2"), ("b", "b2")):
            assert (await ps.pull_dense(x)).tobytes() == (await ps.pull_dense(y)).tobytes()


async def test_a_failed_push_whose_other_request_is_moved_sends_its_own_bytes(
    replicated: LocalCluster,
) -> None:
    """A push fails at once (one chunk refused: a NaN) while its other partition's
    request waits on a stopped primary; the caller then writes its buffer again.  An
    answer ``MOVED`` to the waiting request (live resharding; given here as the
    reply a shard sends) splits its operations and sends them anew: they carry the
    push's own bytes, copied when the call failed, not the caller's new ones."""
    c = replicated
    async with connect(c.address, timeout=20) as ps:
        await ps.create_dense("w", (ELEMS,), init=Zeros(), optimizer=SGD(lr=LR))
        cmap = ps.cluster_map
        spec = await ps.table_spec("w")
        assert isinstance(spec, DenseSpec)
        parts = {ch: chunk_partition("w", ch, cmap) for ch in range(spec.n_chunks)}
        assert set(parts.values()) == {0, 1}
        buf = await ps.gradient_buffer("w")
        buf[:] = 1.0
        bad = next(ch for ch, p in parts.items() if p == 0)
        buf[spec.chunk_range(bad)[0]] = np.nan  # partition 0 refuses that chunk at once
        pid = c.shard_pid(1)
        c.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(errors.BadRequestError):
                await ps.push_dense("w", buf)
            buf[:] = 1e6  # the caller's next gradient: never applied
            [(req_id, ops)] = ps.connection.requests()
            assert not any(np.may_share_memory(op.arrays["g"], buf) for op in ops)
            epoch = cmap.partitions[1].epoch
            moved = Message(Route(MsgType.REPLY, 1, epoch, req_id), {"st": "MOVED"}, [])
            await ps.connection.dispatch(moved)
        finally:
            c.kill(pid, signal.SIGCONT)
        await _until(lambda: ps.requests_in_flight == 0, 30, "the moved push applied")
        got = await ps.pull_dense("w")
        for ch, p in parts.items():
            lo, hi = spec.chunk_range(ch)
            want = 0.0 if ch == bad else -LR  # partition 0's other chunks applied at once
            assert (got[lo:hi] == np.float32(want)).all(), (ch, p, np.unique(got[lo:hi]))


class _Interrupted(Exception):
    pass


def test_an_interrupted_blocking_push_is_given_up_on_before_the_caller_goes_on(
    replicated_one: LocalCluster,
) -> None:
    """The blocking client interrupted during a push (a signal handler raising in the
    caller's thread, as Ctrl-C does) cancels the push in its loop and waits until it
    has let the caller's buffer go: what the caller writes next is never applied."""
    c = replicated_one
    g = np.random.default_rng(29).standard_normal(ELEMS, dtype=np.float32)

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    with zps_sync(c.address, timeout=20) as ps:
        ps.create_dense("sync", (ELEMS,), init=Zeros(), optimizer=SGD(lr=LR))
        ps.create_dense("twin", (ELEMS,), init=Zeros(), optimizer=SGD(lr=LR))
        buf = ps.gradient_buffer("sync")
        assert ps.client.shm_path.memory is not None and ps.client.shm_path.memory.buffer_regions
        buf[:] = g
        pid = c.shard_pid(0)
        old = signal.signal(signal.SIGUSR1, interrupt)
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
        c.kill(pid, signal.SIGSTOP)
        try:
            timer.start()
            with pytest.raises(_Interrupted):
                ps.push_dense("sync", buf)
            buf[:] = 1e6
        finally:
            timer.cancel()
            signal.signal(signal.SIGUSR1, old)
            c.kill(pid, signal.SIGCONT)
        _wait_until(lambda: ps.client.requests_in_flight == 0, 30, "the push applied")
        ps.push_dense("twin", g)
        assert ps.pull_dense("sync").tobytes() == ps.pull_dense("twin").tobytes()


async def test_a_pull_sharing_its_request_with_a_pipelined_push_lands_in_its_place(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipelined step: a push that does not wait, then the next pull, in one loop turn.
    Both go to each partition in one request, and the pull's chunks still come from
    shared memory straight into their place (the push's result has no arrays)."""
    grads = _grads(3, 12)
    async with _side_by_side(cluster.address, ("d1", "d2")) as (fast, inline):
        await fast.push_dense("d1", grads[0])
        await inline.push_dense("d2", grads[0])
        targets = _record_reads(fast, monkeypatch)
        sizes: list[int] = []
        real_sent = fast.meter.request_sent

        def sending(ops: list[str], nbytes: int, now: float) -> None:
            sizes.append(len(ops))
            real_sent(ops, nbytes, now)

        monkeypatch.setattr(fast.meter, "request_sent", sending)
        out = np.full(ELEMS, np.nan, np.float32)
        for g in grads[1:]:
            await fast.push_dense("d1", g, wait=False)
            got = await fast.pull_dense("d1", out=out)
            await inline.push_dense("d2", g)
            want = await inline.pull_dense("d2")
            assert got is out and out.tobytes() == want.tobytes()
        await fast.flush()
        assert sizes and min(sizes) >= 2, sizes  # each push shared a request with a pull
        pulled = [t for t in targets if t is not None and np.shares_memory(t, out)]
        assert len(pulled) >= 4, targets  # both partitions' chunks, in both steps
        assert all(t is None or np.shares_memory(t, out) for t in targets)


# ---- the replication stream through the primary's shared memory ---------------------


@pytest.fixture
def one_partition(tmp_path: Path) -> Iterator[LocalCluster]:
    """A broker for one partition of two copies; the test starts the shards."""
    c = LocalCluster(partitions=1, shards=0, replication=2, workdir=tmp_path)
    c.port = free_port()
    try:
        c.start_broker()
        yield c
    finally:
        c.stop()


def _pair(c: LocalCluster, ports: list[int]) -> tuple[int, int]:
    """Start two shards of one partition (metrics at ``ports``); (primary's port,
    replica's port) once both copies are in sync."""
    procs = [c.start_shard(["--metrics-port", str(p)]) for p in ports]
    c.wait_healthy(30)
    primary = c.shard_pid(0)
    by_pid = {p.pid: port for p, port in zip(procs, ports, strict=True)}
    return by_pid[primary], next(v for k, v in by_pid.items() if k != primary)


async def test_the_replication_stream_goes_through_shared_memory_with_the_same_bits(
    one_partition: LocalCluster, no_shm_left: None
) -> None:
    """A replica on its primary's host reads the pushes' large frames from the
    primary's memory; promoted, it holds the bits an inline stream gives, and every
    region of the stream is freed once acknowledged."""
    ports = [free_port(), free_port()]
    c = one_partition
    primary_port, replica_port = _pair(c, ports)
    grads = _grads(4, 21)
    async with _side_by_side(c.address, ("a", "b")) as (fast, inline):
        got = await _alike(fast, inline, ("a", "b"), grads)  # acks="all": replicas hold each
    sent = scrape_metric(primary_port, "zps_shard_replication_shm_messages_total")
    # Both tables' pushes (inline from the client or not) go to the replica this way.
    assert sent >= 2 * len(grads), sent
    # Those from the client's shared memory were read into the primary's and streamed
    # from there: each of their 2 MiB chunks, with no copy for the stream.
    chunks = ELEMS * 4 // (2 << 20)
    assert scrape_metric(primary_port, "zps_shard_shm_staged_frames_total") >= chunks * len(grads)
    assert scrape_metric(replica_port, "zps_shard_shm_read_frames_total") >= sent
    assert scrape_metric(primary_port, "zps_shard_replication_shm_bytes") == 0
    c.kill(c.shard_pid(0), signal.SIGKILL)
    async with connect(c.address, timeout=20, acks=1, shm_bytes=0) as ps:
        assert (await ps.pull_dense("a")).tobytes() == got[-1].tobytes()
        assert (await ps.pull_dense("b")).tobytes() == got[-1].tobytes()


async def test_a_replica_without_shared_memory_gets_the_stream_inline(
    one_partition: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = [free_port(), free_port()]
    c = one_partition
    c.start_shard(["--metrics-port", str(ports[0])])
    c.wait_for(lambda s: len(s["shards"]) == 1, 30, "the first shard, the primary")
    monkeypatch.setenv("ZPS_NO_SHM", "1")  # the replica's environment only
    c.start_shard(["--metrics-port", str(ports[1])])
    monkeypatch.delenv("ZPS_NO_SHM")
    c.wait_healthy(30)
    grads = _grads(3, 22)
    async with connect(c.address, timeout=20) as ps:
        await ps.create_dense("a", (ELEMS,), optimizer=SGD(lr=LR))
        got = await _steps(ps, "a", grads)
        assert ps.shm_path.memory is not None and ps.shm_path.memory.stats()["puts"] > 0
    assert scrape_metric(ports[0], "zps_shard_replication_shm_messages_total") == 0
    c.kill(c.shard_pid(0), signal.SIGKILL)
    async with connect(c.address, timeout=20, acks=1) as ps:
        assert (await ps.pull_dense("a")).tobytes() == got[-1].tobytes()


async def test_a_paused_replica_of_a_shared_memory_stream_resyncs_to_the_same_bits(
    one_partition: LocalCluster, no_shm_left: None
) -> None:
    """SIGSTOPped while the stream goes through its primary's memory: the primary drops
    it and frees its regions (what zmq still holds for it names regions freed or
    reused, which it refuses to read); continued, it resyncs and holds the primary's
    bits."""
    ports = [free_port(), free_port()]
    c = one_partition
    primary_port, _ = _pair(c, ports)
    replica = next(p for p in c.procs if p.name.startswith("shard") and p.pid != c.shard_pid(0))
    grads = _grads(3, 23)
    async with connect(c.address, timeout=30, acks=1) as ps:
        await ps.create_dense("a", (ELEMS,), optimizer=SGD(lr=LR))
        await _steps(ps, "a", grads[:1])
        c.kill(replica.pid, signal.SIGSTOP)
        try:
            for _ in range(12):
                await ps.push_dense("a", grads[1])
            # The primary gives up on it (its stall timeout) and frees its regions.
            _wait_until(
                lambda: scrape_metric(primary_port, "zps_shard_replication_shm_bytes") == 0,
                30,
                "the paused replica's regions to be freed",
            )
            for _ in range(4):
                await ps.push_dense("a", grads[2])
        finally:
            c.kill(replica.pid, signal.SIGCONT)
        c.wait_healthy(60)  # back in sync
        want = await ps.pull_dense("a")
    assert scrape_metric(primary_port, "zps_shard_replication_shm_messages_total") > 0
    c.kill(c.shard_pid(0), signal.SIGKILL)
    async with connect(c.address, timeout=20, acks=1, shm_bytes=0) as ps:
        assert (await ps.pull_dense("a")).tobytes() == want.tobytes()


async def test_pushes_that_do_not_wait_survive_the_primarys_sigkill_exactly_once(
    no_shm_left: None,
) -> None:
    """Pipelined pushes, each copied into the client's shared memory (and read by the
    primary straight into its own, for the replica), some still unanswered when the
    primary is SIGKILLed: re-sent from the client's regions to the promoted replica,
    each is applied once, bit for bit; the caller's buffer was reused after every call;
    and every region is freed once the pushes are over."""
    with LocalCluster(partitions=1, shards=3, replication=2) as c:  # a spare refills
        c.wait_healthy(30)
        grads = _grads(10, 25)
        async with connect(c.address, timeout=30) as ps:
            await ps.create_dense("a", (ELEMS,), optimizer=SGD(lr=LR))
            want = await ps.pull_dense("a")
            primary = c.shard_pid(0)
            buf = np.empty(ELEMS, np.float32)
            for i, g in enumerate(grads):
                buf[:] = g
                await ps.push_dense("a", buf, wait=False)
                buf[:] = np.nan  # the caller's buffer, reused at once
                want -= LR * g
                if i == 4:
                    c.kill(primary, signal.SIGKILL)
            await ps.flush()
            assert ps.stats.retries > 0  # some were sent again, to the promoted replica
            assert ps.shm_path.memory is not None and ps.shm_path.memory.stats()["reserved"] >= len(
                grads
            )
            got = await ps.pull_dense("a")
            assert c.shard_pid(0) != primary
            # Bit for bit; a failure names what differs (a diff of the bytes would take
            # pytest minutes).
            bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
            assert bad.size == 0, (
                f"{bad.size} of {got.size} elements differ, e.g. {bad[:4].tolist()}: got "
                f"{got[bad[:4]].tolist()}, want {want[bad[:4]].tolist()}, the pushes' "
                f"steps there {[float(LR * g[bad[0]]) for g in grads]}"
            )
            assert ps.shm_path.memory.staged_regions == 0 and ps.shm_path.memory.arena.live == 0, (
                ps.shm_path.memory.stats()
            )


async def test_a_cancelled_pull_never_writes_into_its_out_later(
    fresh_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pull_dense(out=...)`` cancelled while its shards are paused: the replies that
    come once they continue are read into fresh arrays, never into ``out``, which the
    caller owns again."""
    c = fresh_cluster
    async with connect(c.address, timeout=20) as ps:
        assert ps.shm_path.memory is not None
        await ps.create_dense("d", (ELEMS,), optimizer=SGD(lr=LR))
        await ps.push_dense("d", _grads(1, 26)[0])
        want = await ps.pull_dense("d")
        targets = _record_reads(ps, monkeypatch)
        out = np.full(ELEMS, np.nan, np.float32)
        pids = [c.shard_pid(0), c.shard_pid(1)]
        for pid in pids:
            c.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ps.pull_dense("d", out=out), 0.3)
        finally:
            for pid in pids:
                c.kill(pid, signal.SIGCONT)
        chunks = ELEMS * 4 // (2 << 20)
        deadline = time.monotonic() + 20
        while len(targets) < chunks:  # the late replies, read as they come
            assert time.monotonic() < deadline, targets
            await asyncio.sleep(0.01)
        assert all(t is None or not np.shares_memory(t, out) for t in targets)
        assert np.isnan(out).all()
        assert (await ps.pull_dense("d")).tobytes() == want.tobytes()


LEND_METRICS = free_port()


@pytest.fixture
def lending() -> Iterator[LocalCluster]:
    """One shard of its own, its metrics at LEND_METRICS: its arena's room for dense
    values unspent by other tests."""
    with _one_shard(LEND_METRICS) as c:
        yield c


def _lend_metric(name: str) -> float:
    return scrape_metric(LEND_METRICS, name)


async def test_two_workers_pulling_lent_chunks_see_whole_versions(lending: LocalCluster) -> None:
    """A pull's reply names the chunks' values in the shard's memory (no copy) and a
    push meanwhile updates a new copy.  Two workers pushing and pulling at once, each
    reading while the other's pushes are applied: every pull is one whole version (a
    chunk changed under a read would mix two), and the sum is exact."""
    steps, ones = 40, np.ones(ELEMS, np.float32)
    async with (
        connect(lending.address, timeout=20) as a,
        connect(lending.address, timeout=20) as b,
    ):
        await a.create_dense("whole", (ELEMS,), init=Zeros(), optimizer=SGD(lr=LR))

        async def worker(ps: Client) -> list[float]:
            out, seen = np.empty(ELEMS, np.float32), []
            for _ in range(steps):
                await ps.push_dense("whole", ones, wait=False)
                got = await ps.pull_dense("whole", out=out)
                assert got.min() == got.max(), "a pull mixed two versions"
                seen.append(float(got[0]))
            await ps.flush()
            return seen

        seen = await asyncio.gather(worker(a), worker(b))
        final = await a.pull_dense("whole")
    assert (final == -LR * 2 * steps).all()
    for s in seen:  # each worker's own pushes are applied in order: never a step back
        assert all(y < x for x, y in itertools.pairwise(s))
    assert _lend_metric("zps_shard_shm_lent_frames_total") >= 2 * steps * 4
    assert _lend_metric("zps_shard_shm_full_total") == 0


async def test_a_worker_that_never_says_it_is_done_pins_a_chunk_for_seconds_only(
    lending: LocalCluster,
) -> None:
    """A reader tells the shard it is done with a lent chunk in its next request to
    the partition.  One that sends none (paused, hung, its reply dropped) keeps the
    old version alive for the loan's time at most (2 s after the replicas' stall
    timeout, 2 s in this cluster: 4 s): other workers' pushes go on
    meanwhile (to a new copy), then the loan ends and the old version is freed."""
    ones = np.ones(ELEMS, np.float32)
    nbytes = ELEMS * 4
    async with (
        connect(lending.address, timeout=20) as slow,
        connect(lending.address, timeout=20) as fast,
    ):
        await fast.create_dense("pin", (ELEMS,), init=Zeros(), optimizer=SGD(lr=LR))
        await fast.push_dense("pin", ones)  # the chunks now live in the shard's arena
        assert _lend_metric("zps_shard_shm_dense_bytes") == nbytes
        expired = _lend_metric("zps_shard_shm_loans_expired_total")
        await slow.pull_dense("pin")  # lent to a worker that says nothing more
        for _ in range(3):
            await fast.push_dense("pin", ones)  # the first to a copy, then in place
        assert _lend_metric("zps_shard_shm_dense_bytes") == 2 * nbytes
        _wait_until(
            lambda: _lend_metric("zps_shard_shm_dense_bytes") == nbytes,
            10,
            "the old version freed once its loan expired",
        )
        assert _lend_metric("zps_shard_shm_loans_expired_total") == expired + 4
        got = await slow.pull_dense("pin")
        assert (got == -LR * 4).all()


_READER = """
import asyncio, os, signal, sys
import numpy as np
import zps
from zps import shm

real = shm.Mapper.read
calls = 0

def read(self, desc, into=None):
    # Stops itself between two chunks of one pull's reply: that region is read after
    # it continues, once the shard has changed it (in place, under a new token).
    global calls
    calls += 1
    if calls == PAUSE_AT:
        print("PAUSED", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return real(self, desc, into)

shm.Mapper.read = read

async def main(address, stop):
    async with zps.connect(address, timeout=30) as ps:
        out = np.empty(ELEMS, np.float32)
        pulls = 0
        while not os.path.exists(stop):
            got = await ps.pull_dense("paused", out=out)
            if got.min() != got.max():
                print("MIXED", got.min(), got.max(), flush=True)
                return
            pulls += 1
            print("PULL", got[0], flush=True)
        print("DONE", pulls, ps.shm_path.memory.stats()["refused"], flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
""".replace("ELEMS", str(ELEMS)).replace("PAUSE_AT", str(4 * 10 + 3))


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


async def test_a_reader_paused_mid_pull_gets_a_whole_version_after_it_continues(
    lending: LocalCluster, tmp_path: Path
) -> None:
    """A worker stopped (SIGSTOP) in the middle of reading a pull's lent chunks for
    longer than its loans last: they expire, the chunks get new tokens, and
    pushes then change them in place; once it continues, the region it had still to
    read is refused and the pull asked for again, never read torn or stale."""
    c, ones, stop = lending, np.ones(ELEMS, np.float32), tmp_path / "stop"
    async with connect(c.address, timeout=20) as ps:
        await ps.create_dense("paused", (ELEMS,), init=Zeros(), optimizer=SGD(lr=LR))
        await ps.push_dense("paused", ones)
        reader = _script(c, _READER, c.address, str(stop))
        try:
            assert reader.stdout is not None
            for _ in range(10):  # ten whole pulls, then it stops itself in the next
                assert reader.stdout.readline().startswith("PULL"), reader.stderr
            assert reader.stdout.readline().strip() == "PAUSED"
            _wait_until(lambda: _stopped(reader.pid), 10, "the reader stopped")
            _wait_until(
                lambda: _lend_metric("zps_shard_shm_loans_expired_total") >= 4,
                20,
                "the paused reader's loans expired",
            )
            pushes = 3
            for _ in range(pushes):  # now in place: nothing holds the chunks any more
                await asyncio.wait_for(ps.push_dense("paused", ones), 5)
            newest = -LR * (1 + pushes)
            os.kill(reader.pid, signal.SIGCONT)
            line = reader.stdout.readline()  # the pull it was in: asked for again
            assert line.split()[:2] == ["PULL", str(newest)], (line, reader.stderr)
            stop.touch()
            out, err = reader.communicate(timeout=30)
            assert "MIXED" not in out, out
            done = out.strip().splitlines()[-1].split()
            assert done[0] == "DONE" and int(done[2]) >= 1, (out, err)  # one region refused
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(reader.pid, signal.SIGCONT)
            reader.kill()
            reader.wait(10)
        assert (await ps.pull_dense("paused") == newest).all()


async def test_a_gradient_read_from_shared_memory_is_checked_as_it_is_read(
    lending: LocalCluster,
) -> None:
    """A shard checks a large gradient's values as it copies them out of a client's
    memory (one pass): a NaN or an infinity is still refused, naming what is wrong,
    and changes nothing (here one in every chunk: each chunk is an operation of its
    own); a finite one is applied."""
    chunk = 1 << 19  # elements of a 2 MiB float32 chunk
    async with connect(lending.address, timeout=20) as ps:
        assert ps.shm_path.memory is not None
        await ps.create_dense("checked", (ELEMS,), init=Zeros(), optimizer=SGD(lr=LR))
        reads = _lend_metric("zps_shard_shm_read_frames_total")
        for at, bad in ((0, np.nan), (chunk - 1, np.inf), (chunk // 2 + 3, -np.inf)):
            g = np.ones(ELEMS, np.float32)
            g[at::chunk] = bad
            with pytest.raises(errors.BadRequestError, match="NaN or infinity"):
                await ps.push_dense("checked", g)
        assert _lend_metric("zps_shard_shm_read_frames_total") > reads  # read from memory
        assert (await ps.pull_dense("checked") == 0).all()
        await ps.push_dense("checked", np.ones(ELEMS, np.float32))
        assert (await ps.pull_dense("checked") == -LR).all()


def _lowest_free_fd(pid: int) -> int:
    taken = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in itertools.count() if n not in taken)


async def test_a_shard_out_of_descriptors_gets_inline_frames_for_a_while(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard cannot open a new client's memory (its descriptors spent: EMFILE): it
    says ``busy``, the client re-sends inline (applied once) and offers shared memory
    again after shm.RETRY_S, which the shard, its descriptors back, then reads.  The
    shard's first large replies go out meanwhile: it keeps serving."""
    monkeypatch.setattr(shm, "RETRY_S", 0.5)
    (shard,) = [p for p in cluster.procs if p.name.startswith("shard")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    grads = _grads(2, 9)
    async with _side_by_side(cluster.address, ("busy", "busy-inline")) as (fast, inline):
        (primary,) = {s["node"] for s in (await asyncio.to_thread(cluster.status))["shards"]}
        # No large frame has left the shard yet: its first zero-copy sends come with its
        # descriptors spent (pyzmq's collector, which they need, was started with it).
        read = _metric("zps_shard_shm_read_frames_total")
        resource.prlimit(shard.pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(shard.pid), hard))
        try:
            await _alike(fast, inline, ("busy", "busy-inline"), grads[:1])
        finally:
            resource.prlimit(shard.pid, resource.RLIMIT_NOFILE, (soft, hard))
        until = fast.shm_path.refused[primary]
        assert until != math.inf and not fast.shm_path.to(0)  # busy, not "open"
        assert _metric("zps_shard_shm_read_frames_total") == read
        while not fast.shm_path.to(0):  # RETRY_S after the refusal
            now = asyncio.get_running_loop().time()  # the client's clock: its loop's
            assert now < until + 5, "shared memory was not offered again"
            await asyncio.sleep(0.05)
        await _alike(fast, inline, ("busy", "busy-inline"), grads[1:])
        assert _metric("zps_shard_shm_read_frames_total") > read
