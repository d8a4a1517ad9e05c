"""A client's zmq I/O thread under ZPS_IO_SCHED=auto (the default): SCHED_BATCH while
the client has several requests in flight (a step's requests to every partition, a
pipelined step), the default policy again once it waits for a lone request, so that
that reply wakes it at once; ``servers`` leaves it alone.  Real broker and shards."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

import zps
from zps.optim import SGD
from zps.testing import LocalCluster
from zps.transport.iothreads import batch_allowed

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
    reason="Linux scheduling policies",
)


@pytest.fixture(autouse=True)
def _allowed() -> None:
    if not batch_allowed():
        pytest.skip("this process may not set SCHED_BATCH")


def _policies(ps: zps.Client) -> list[int]:
    io = ps.connection.io_threads
    assert io is not None and io.thread_ids, "the client's I/O thread was not found"
    return [os.sched_getscheduler(t) for t in io.thread_ids]


async def test_batch_while_several_requests_are_in_flight(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ZPS_IO_SCHED", raising=False)
    name = f"sched-{uuid.uuid4().hex[:8]}"
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding(name, dim=4, optimizer=SGD(lr=1.0))
        ids = np.arange(64, dtype=np.int64)  # rows of both partitions: two requests
        for _ in range(3):
            await ps.pull_rows(name, ids)
            assert _policies(ps) == [os.SCHED_BATCH]
            await ps.push_rows(name, ids, np.ones((64, 4), np.float32), wait=False)
            await ps.pull_rows(name, ids[:1])  # alone in flight, or with the push
            await ps.flush()
            await ps.pull_rows(name, ids[:1])  # alone: its reply should wake us at once
            assert _policies(ps) == [os.SCHED_OTHER]
        io = ps.connection.io_threads
        assert io is not None and io.switches >= 6
        # the pushes went through whichever policy the thread had
        np.testing.assert_array_equal(await ps.pull_rows(name, ids), np.full((64, 4), -3.0))


async def test_servers_mode_leaves_a_client_alone(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZPS_IO_SCHED", "servers")
    name = f"sched-{uuid.uuid4().hex[:8]}"
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding(name, dim=4, optimizer=SGD(lr=1.0))
        await ps.pull_rows(name, np.arange(64, dtype=np.int64))
        io = ps.connection.io_threads
        assert io is not None and io.switches == 0 and not io.batch
        assert io.thread_name == "" and io.thread_ids == () and not io.looking  # not looked for
