"""Fixtures that run real brokers and shards as processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from zps.testing import LocalCluster


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
