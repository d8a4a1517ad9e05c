"""Pipelined row steps through a real broker and shards, with the compiled row routing
and with the numpy fallback: rows come back in the caller's order, every background push
is applied exactly once, and a push owns its data once ``push_rows`` returns."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import zps
from zps.core import rows
from zps.optim import SGD
from zps.testing import LocalCluster

KERNELS = [False, True] if rows._rows is not None else [False]


@pytest.mark.parametrize("kernel", KERNELS)
async def test_pipelined_steps_apply_every_push_once(
    cluster: LocalCluster, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rows, "KERNEL", kernel)
    name = f"steps-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(3)
    expected = np.zeros((5000, 4))  # row x, SGD lr=1 from zeros: minus its gradients' sum
    async with zps.connect(cluster.address, max_background=3) as ps:
        await ps.create_embedding(name, dim=4, dtype="float64", optimizer=SGD(lr=1.0))
        pool = [rng.permutation(5000)[:n].astype(np.int64) for n in (1, 7, 300, 2000, 2000)]
        grads = np.empty((2000, 4))  # reused by every step, as a training loop does
        for step in range(40):
            ids = pool[step % len(pool)]
            got = await ps.pull_rows(name, ids)
            assert got.shape == (ids.size, 4)
            # what every push issued before this pull could have done, at most
            assert np.all(got <= 0) and np.all(got >= expected[ids])
            grads[: ids.size] = rng.integers(1, 4, (ids.size, 4))
            await ps.push_rows(name, ids, grads[: ids.size], wait=False)
            np.subtract.at(expected, ids, grads[: ids.size])
            grads[:] = 1e9  # the push sent what it was given, not this
        await ps.flush()
        for ids in pool:
            np.testing.assert_array_equal(await ps.pull_rows(name, ids), expected[ids])
        # one pull of every row, its order shuffled: each row lands where its id is
        everything = rng.permutation(5000).astype(np.int64)
        np.testing.assert_array_equal(await ps.pull_rows(name, everything), expected[everything])
