"""Push/pull through a real broker and real shards against numpy references."""

from __future__ import annotations

import asyncio
import os
import uuid

import numpy as np
import pytest

import zps
from zps import errors, transport
from zps.init import generate
from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum
from zps.testing import LocalCluster

OPTIMIZERS = [
    SGD(lr=0.5),
    Momentum(lr=0.1, momentum=0.9),
    Momentum(lr=0.1, momentum=0.9, nesterov=True),
    Adagrad(lr=0.2),
    Adam(lr=0.05),
    FTRL(alpha=0.1, beta=1.0, l1=0.01, l2=0.01),
]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def reference_rows(opt, init, seed: int, dim: int, dtype: str, pushes):
    """Apply ``pushes`` [(ids, grads)] locally with the same optimizer objects."""
    rows: dict[int, np.ndarray] = {}
    state: dict[int, dict[str, np.ndarray]] = {}
    for ids, grads in pushes:
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(ids.tolist(), grads, strict=True):
            summed[i] = summed.get(i, 0) + g.astype(dtype)
        for i, g in summed.items():
            if i not in rows:
                rows[i] = generate(init, seed, np.array([i], dtype=np.int64), dim, dtype)[0]
                state[i] = {k: v[0] for k, v in opt.init_state(1, dim, dtype).items()}
            p = rows[i][None, :].copy()
            st = {k: v[None, :].copy() for k, v in state[i].items()}
            opt.apply(p, np.asarray(g, dtype=dtype)[None, :], st)
            rows[i] = p[0]
            state[i] = {k: v[0] for k, v in st.items()}
    return rows


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: repr(o)[:40])
async def test_embedding_optimizers_match_reference(cluster: LocalCluster, opt) -> None:
    name = unique("emb")
    init = zps.init.Uniform(-0.1, 0.1)
    rng = np.random.default_rng(1)
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding(name, dim=8, dtype="float64", init=init, optimizer=opt, seed=7)
        pushes = []
        for _ in range(5):
            ids = rng.integers(-50, 50, size=40).astype(np.int64)  # duplicates, negatives
            grads = rng.normal(size=(40, 8))
            await ps.push_rows(name, ids, grads)
            pushes.append((ids, grads))
        ids = np.arange(-60, 60, dtype=np.int64)
        got = await ps.pull_rows(name, ids)
    ref = reference_rows(opt, init, 7, 8, "float64", pushes)
    for k, i in enumerate(ids.tolist()):
        expected = ref.get(i)
        if expected is None:
            expected = generate(init, 7, np.array([i], dtype=np.int64), 8, "float64")[0]
        np.testing.assert_allclose(got[k], expected, rtol=1e-12, atol=1e-12)


async def test_sgd_is_exact(cluster: LocalCluster) -> None:
    name = unique("sgd")
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding(name, dim=3, dtype="float64", optimizer=SGD(lr=1.0))
        await ps.create_dense(name + "-d", shape=(5, 2), dtype="float64", optimizer=SGD(lr=1.0))
        ids = np.array([5, 5, 6, 5], dtype=np.int64)
        await ps.push_rows(name, ids, np.arange(12, dtype=np.float64).reshape(4, 3))
        await ps.push_dense(name + "-d", np.arange(10.0).reshape(5, 2))
        await ps.push_dense(name + "-d", np.ones((5, 2)))
        rows = await ps.pull_rows(name, np.array([6, 5, 7, 5]))
        dense = await ps.pull_dense(name + "-d")
    g5 = np.array([0, 1, 2]) + np.array([3, 4, 5]) + np.array([9, 10, 11])
    np.testing.assert_array_equal(rows, [-np.array([6, 7, 8.0]), -g5, [0, 0, 0], -g5])
    np.testing.assert_array_equal(dense, -(np.arange(10.0).reshape(5, 2) + 1))


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: repr(o)[:40])
async def test_dense_chunked_over_partitions_matches_reference(cluster: LocalCluster, opt) -> None:
    name = unique("dense")
    size = 700_000  # 5.6 MB of float64: several chunks, on both partitions
    init = zps.init.Normal(0.0, 0.1)
    rng = np.random.default_rng(2)
    async with zps.connect(cluster.address) as ps:
        await ps.create_dense(name, shape=(size,), dtype="float64", init=init, optimizer=opt)
        before = dict(ps.stats.by_partition)
        expected = generate(
            init, zps.core.hashing.name_hash(name), np.arange(size), 1, "float64"
        ).ravel()
        np.testing.assert_array_equal(await ps.pull_dense(name), expected)
        state = opt.init_state(1, size, "float64")
        p = expected[None, :].copy()
        for _ in range(3):
            g = rng.normal(size=size)
            await ps.push_dense(name, g)
            opt.apply(p, g[None, :], state)
        got = await ps.pull_dense(name)
        touched = {k for k, v in ps.stats.by_partition.items() if v > before.get(k, 0)}
    assert touched == {0, 1}, "a large tensor must be spread over every partition"
    np.testing.assert_allclose(got, p[0], rtol=1e-10, atol=1e-12)


async def test_pull_with_duplicate_ids_returns_one_row_per_id(cluster: LocalCluster) -> None:
    name = unique("dup")
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding(name, dim=4, init=zps.init.Uniform(-1, 1))
        ids = np.array([3, 3, 9, 3, 2**62, -1, 9], dtype=np.int64)
        rows = await ps.pull_rows(name, ids)
        again = await ps.pull_rows(name, ids[::-1])
    assert rows.shape == (7, 4) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[0], rows[3])
    np.testing.assert_array_equal(rows[2], rows[6])
    assert not np.array_equal(rows[0], rows[2])
    np.testing.assert_array_equal(again, rows[::-1])  # stable across calls


async def test_concurrent_clients_sum_exactly(cluster: LocalCluster) -> None:
    name = unique("conc")
    n_clients, n_pushes = 4, 25
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding(name, dim=2, dtype="float64", optimizer=SGD(lr=1.0))
        await ps.create_dense(name + "-d", shape=(1000,), dtype="float64", optimizer=SGD(lr=1.0))

    async def worker(k: int) -> None:
        async with zps.connect(cluster.address) as ps:
            # many requests in flight at once from one client
            await asyncio.gather(
                *(
                    ps.push_rows(name, np.arange(100, dtype=np.int64), np.full((100, 2), k + 1.0))
                    for _ in range(n_pushes)
                ),
                *(ps.push_dense(name + "-d", np.full(1000, k + 1.0)) for _ in range(n_pushes)),
            )

    await asyncio.gather(*(worker(k) for k in range(n_clients)))
    total = n_pushes * sum(k + 1.0 for k in range(n_clients))
    async with zps.connect(cluster.address) as ps:
        rows = await ps.pull_rows(name, np.arange(100))
        dense = await ps.pull_dense(name + "-d")
    np.testing.assert_array_equal(rows, np.full((100, 2), -total))
    np.testing.assert_array_equal(dense, np.full(1000, -total))


async def test_small_ops_are_coalesced(cluster: LocalCluster) -> None:
    name = unique("coal")
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding(name, dim=8, optimizer=SGD(lr=0.1))
        before = ps.stats.requests
        await asyncio.gather(*(ps.push_rows(name, [i], np.ones((1, 8))) for i in range(200)))
        sent = ps.stats.requests - before
    assert sent <= 4, f"200 one-row pushes took {sent} messages"


async def test_create_is_idempotent_and_conflicts_are_errors(cluster: LocalCluster) -> None:
    name = unique("tbl")
    async with zps.connect(cluster.address) as ps, zps.connect(cluster.address) as other:
        await ps.create_embedding(name, dim=4, optimizer=Adagrad(lr=0.1))
        await other.create_embedding(name, dim=4, optimizer=Adagrad(lr=0.1))
        with pytest.raises(errors.TableConflictError, match="dim"):
            await other.create_embedding(name, dim=5, optimizer=Adagrad(lr=0.1))
        with pytest.raises(errors.TableConflictError):
            await other.create_dense(name, shape=(4,))
        # a client that did not create the table learns its spec from the servers
        async with zps.connect(cluster.address) as third:
            assert (await third.pull_rows(name, [1])).shape == (1, 4)


def test_sync_client_facade(cluster: LocalCluster) -> None:
    name = unique("sync")
    with zps.connect_sync(cluster.address) as ps:
        ps.create_dense(
            name, shape=(3,), dtype="float64", init=zps.init.Constant(2.0), optimizer=SGD(lr=0.5)
        )
        ps.push_dense(name, np.array([1.0, 2.0, 4.0]))
        np.testing.assert_array_equal(ps.pull_dense(name), [1.5, 1.0, 0.0])
        with pytest.raises(errors.UnknownTableError, match="nope"):
            ps.pull_dense("nope")


async def test_background_pushes_and_prefetch(cluster: LocalCluster) -> None:
    name = unique("bg")
    async with zps.connect(cluster.address, max_background=4) as ps:
        await ps.create_embedding(name, dim=2, dtype="float64", optimizer=SGD(lr=1.0))
        prefetched = ps.prefetch_rows(name, [1, 2])  # starts now, awaited later
        for _ in range(50):
            await ps.push_rows(name, [1, 2], np.ones((2, 2)), wait=False)
            assert ps.in_background <= 4  # bounded in flight
        first = await prefetched
        assert first.shape == (2, 2) and np.all(first <= 0)  # some pushes may be applied
        await ps.flush()
        np.testing.assert_array_equal(await ps.pull_rows(name, [1, 2]), np.full((2, 2), -50.0))
        # an error of background work is not lost: the next call raises it, once
        with pytest.raises(errors.UnknownTableError, match="no-such-table"):
            # the spec lookup fails at once: an unknown table is a caller's error
            await ps.push_rows("no-such-table", [1], np.ones((1, 2)), wait=False)
        await ps.create_embedding(name + "-1d", dim=2, optimizer=SGD(lr=1.0))
        await ps.push_rows(name + "-1d", [1], np.full((1, 2), np.nan), wait=False)
        with pytest.raises(errors.BadRequestError, match=r"finite|NaN|nan"):
            await ps.flush()  # the shard refused it; the error surfaces here, once
        await ps.flush()
        assert (await ps.pull_rows(name, [3])).shape == (1, 2)


async def test_a_background_push_owns_its_data(cluster: LocalCluster) -> None:
    # wait=False returns before the message is sent: the caller may reuse its
    # buffers at once (as training loops do with gradient buffers) without
    # changing what the push carries.
    name = unique("own")
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding(name, dim=2, dtype="float64", optimizer=SGD(lr=1.0))
        await ps.create_dense(name + "-d", shape=(300_000,), dtype="float64", optimizer=SGD(lr=1.0))
        ids = np.array([5], dtype=np.int64)  # one id: one partition, sent as given
        grads = np.ones((1, 2))
        dense = np.ones(300_000)  # chunked: views of the caller's array
        await ps.push_rows(name, ids, grads, wait=False)
        await ps.push_dense(name + "-d", dense, wait=False)
        ids[0], grads[:], dense[:] = 6, 100.0, 100.0
        await ps.flush()
        np.testing.assert_array_equal(await ps.pull_rows(name, [5, 6]), [[-1, -1], [0, 0]])
        np.testing.assert_array_equal(await ps.pull_dense(name + "-d"), np.full(300_000, -1.0))
        # A prefetch returns at once too: the ids it was given may change meanwhile.
        ids[0] = 5
        prefetched = ps.prefetch_rows(name, ids)
        ids[0] = 6
        np.testing.assert_array_equal(await prefetched, [[-1, -1]])


async def test_pull_dense_into_a_callers_buffer(cluster: LocalCluster) -> None:
    name = unique("out")
    async with zps.connect(cluster.address) as ps:
        await ps.create_dense(name, shape=(600, 500), dtype="float32", init=zps.init.Normal())
        buf = np.zeros((600, 500), dtype=np.float32)
        got = await ps.pull_dense(name, out=buf)
        assert got is buf
        np.testing.assert_array_equal(buf, await ps.pull_dense(name))
        assert np.any(buf != 0)
        for bad in (
            np.zeros((500, 600), np.float32),
            np.zeros((600, 500), np.float64),
            np.zeros((500, 600), np.float32).T,  # right shape, not C-contiguous
        ):
            with pytest.raises(errors.ShapeMismatchError, match="out="):
                await ps.pull_dense(name, out=bad)


async def test_batches_alike_in_length_and_first_id_go_to_their_own_rows(
    cluster: LocalCluster,
) -> None:
    # The client remembers how it split recent batches by partition (a push
    # usually follows a pull of the same ids); a different batch must not reuse it.
    name = unique("memo")
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding(name, dim=1, dtype="float64", optimizer=SGD(lr=1.0))
        ids = np.arange(1, 2001, dtype=np.int64)
        await ps.push_rows(name, ids, -ids[:, None].astype(np.float64))  # row x holds x
        a = np.concatenate([[7], np.arange(100, 600)]).astype(np.int64)
        b = np.concatenate([[7], np.arange(1100, 1600)]).astype(np.int64)
        for batch in (a, b, a, b[::-1].copy()):
            rows = await ps.pull_rows(name, batch)
            np.testing.assert_array_equal(rows[:, 0], batch)
            await ps.push_rows(name, batch, np.zeros((batch.size, 1)))


def test_sync_facade_overlap(cluster: LocalCluster) -> None:
    name = unique("bgs")
    with zps.connect_sync(cluster.address) as ps:
        ps.create_dense(name, shape=(8,), dtype="float64", optimizer=SGD(lr=1.0))
        fut = ps.prefetch_dense(name)
        for _ in range(10):
            ps.push_dense(name, np.ones(8), wait=False)
        ps.flush()
        assert fut.result(timeout=10).shape == (8,)
        np.testing.assert_array_equal(ps.pull_dense(name), np.full(8, -10.0))


@pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or not transport.iothreads.batch_allowed(),
    reason="Linux's SCHED_BATCH, allowed here",
)
def test_the_servers_io_threads_run_sched_batch(cluster: LocalCluster) -> None:
    """The broker's and the shards' zmq I/O threads run under SCHED_BATCH (woken by a
    send, they do not preempt the handler that sent): zps.transport.new_context."""
    for proc in cluster.procs:
        io = []
        for t in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{t}/comm") as f:
                    if f.read().startswith("ZMQbg/IO"):
                        io.append(int(t))
            except OSError:  # a thread that ended meanwhile
                continue
        assert io, proc.name
        assert all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in io), proc.name
