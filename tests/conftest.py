"""Settings of the whole test session."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.unit.simcases import Runs


def cache_bytecode(environ: dict[str, str] | os._Environ[str]) -> Path | None:
    """Let the processes the tests start (brokers, shards, workers, command lines: fresh
    interpreters importing the same modules, hundreds of times) cache their bytecode where
    ``PYTHONDONTWRITEBYTECODE`` would make each compile every module of zps at every start.

    The cache is outside the source tree (``PYTHONPYCACHEPREFIX``), in a directory of this
    user's alone (mode 0700; a path owned by another user or a symlink is not used).
    Nothing changes when bytecode is written anyway or a prefix is already chosen.  Returns
    the prefix set, or None."""
    if not environ.get("PYTHONDONTWRITEBYTECODE") or environ.get("PYTHONPYCACHEPREFIX"):
        return None
    prefix = Path(tempfile.gettempdir()) / f"zps-pycache-{os.getuid()}"
    try:
        prefix.mkdir(mode=0o700, exist_ok=True)
        st = prefix.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    del environ["PYTHONDONTWRITEBYTECODE"]
    return prefix


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
