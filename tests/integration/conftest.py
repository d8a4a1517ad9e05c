"""Fixtures that run real brokers and shards as processes on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from zps.testing import DataDirCluster, LocalCluster, free_port


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """A broker and two shards shared by the tests of one module (tables get unique names)."""
    with LocalCluster(partitions=2, shards=2) as c:
        yield c


@pytest.fixture
def fresh_cluster() -> Iterator[LocalCluster]:
    """A cluster of its own, for tests that kill processes."""
    with LocalCluster(partitions=2, shards=2) as c:
        yield c


@pytest.fixture
def make_cluster(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., DataDirCluster]]:
    """Builds clusters whose shards may have data dirs (broker not started) in tmp_path,
    with the test module's heartbeat settings (``HB``, ``LIVENESS``) unless given; stops
    every process afterwards."""
    made: list[DataDirCluster] = []
    defaults = {
        "heartbeat_interval": getattr(request.module, "HB", 0.1),
        "liveness": getattr(request.module, "LIVENESS", 10),
        "workdir": tmp_path,
    }

    def make(**kwargs: Any) -> DataDirCluster:
        c = DataDirCluster(**{**defaults, **kwargs})
        c.port = free_port()
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def replicated_partition(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalCluster]:
    """One partition with two copies, its broker and shards not started (a test starts
    them one by one), with the test module's heartbeat settings (``HB``, ``LIVENESS``);
    afterwards its shards are killed (the final checkpoint a graceful stop writes, of a
    partition of hundreds of MB in the tests that use this, is not what they check) and
    the rest stopped."""
    c = LocalCluster(
        partitions=1,
        shards=0,
        heartbeat_interval=getattr(request.module, "HB", 0.1),
        liveness=getattr(request.module, "LIVENESS", 10),
        workdir=tmp_path,
    )
    c.port = free_port()
    c.replication = 2
    try:
        yield c
    finally:
        for p in c.procs:
            if p.name.startswith("shard") and p.alive():
                p.popen.kill()
                p.popen.wait(10)
        c.stop()
