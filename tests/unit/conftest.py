"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.simcases import Runs, new_pool


@pytest.fixture(scope="session")
def sim() -> Iterator[Runs]:
    """The simulator's worker processes, one pool for every simulator test of the session,
    and the runs they made."""
    pool = new_pool()
    try:
        yield Runs(pool)
    finally:
        pool.shutdown(cancel_futures=True)  # runs no test will ask for (a test failed)
