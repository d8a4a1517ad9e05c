"""Settings of the whole test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from zps.testing.bytecode import cache_bytecode

if TYPE_CHECKING:
    from tests.unit.simcases import Runs


cache_bytecode(os.environ)


@pytest.fixture(scope="session")
def sim() -> Iterator[Runs]:
    """The simulator's worker processes, one pool for every simulator test of the session,
    and the runs they made."""
    from tests.unit.simcases import Runs, new_pool

    pool = new_pool()
    try:
        yield Runs(pool)
    finally:
        pool.shutdown(cancel_futures=True)  # runs no test will ask for (a test failed)


@pytest.fixture(scope="session", autouse=True)
def _simulator_runs_ahead(request: pytest.FixtureRequest) -> None:
    """With the session's first test, the simulator's modules (those collected) hand the
    pool every run their tests will ask for (``seeds_ahead``): the workers run them
    while the tests before them run, the integration tests' processes first (at the
    workers' lowest priority they take the CPU those leave)."""
    modules = {
        item.module
        for item in request.session.items
        if "sim" in getattr(item, "fixturenames", ())
        and callable(getattr(item.module, "seeds_ahead", None))
    }
    if not modules:
        return
    runs = request.getfixturevalue("sim")
    for module in sorted(modules, key=lambda m: m.__name__):
        module.seeds_ahead(runs)
