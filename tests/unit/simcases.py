"""What the simulator's tests (tests/unit/test_sim*.py) share: one pool of worker processes
for the whole session (tests/unit/conftest.py: ``sim``), the runs it made (a seed of a mode,
fault mix and defect runs once a session, whichever tests ask for it), the replay check,
and the checks of a budget of seeds and of a defect caught within one.

A seed's run is the same in any process, so a test's result does not depend on which
worker ran a seed, nor on which test asked for it first.

The rule for a defect's budget: the seeds of its fault mix from the first that catches it
to a few past it.  The seeds before that one pass with the defect in place (each run is
fixed by its seed): running them measures how rare the defect is in that mix, a figure for
docs/performance.md, and catches nothing the first catching seed does not; the seeds past
it leave room for a change that moves the catch a few seeds on.  A budget starts at seed 0
where the seeds before the catch cost little (a few runs of the stand-in)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from zps.testing.sim.checks import Result
from zps.testing.sim.cli import run_seeds

#: Worker processes running the simulator's seeds.
WORKERS = 2
#: Seeds of a defect's budget submitted ahead of the one being checked: the workers stay
#: busy, and few run past the seed that catches it.
AHEAD = 2 * WORKERS

Key = tuple[int, tuple[str, ...] | None, str | None, tuple[tuple[str, bool], ...]]


def new_pool() -> ProcessPoolExecutor:
    # Spawned, not forked: the suite's process may hold threads of earlier tests.
    return ProcessPoolExecutor(
        WORKERS, mp_context=multiprocessing.get_context("spawn"), initializer=_yield_cpu
    )


def _yield_cpu() -> None:
    """A worker runs at the lowest priority: the session starts the pool with its first
    test, and the integration tests' processes, whose heartbeats keep time, come first
    (a worker takes what CPU they leave)."""
    os.nice(19)


def run_one(
    seed: int, faults: Sequence[str] | None, bug: str | None, mode: dict[str, bool]
) -> Result:
    """The run of ``seed`` in this process (a worker's task)."""
    kw: dict[str, Any] = dict(mode)
    return next(run_seeds([seed], faults, bug=bug, **kw))


class Runs:
    """The runs of the session's pool, each (seed, faults, defect, mode) submitted once."""

    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self.pool = pool
        self._runs: dict[Key, Future[Result]] = {}

    def submit(
        self,
        seed: int,
        faults: Sequence[str] | None = None,
        *,
        bug: str | None = None,
        fresh: bool = False,
        **mode: bool,
    ) -> Future[Result]:
        """The run of ``seed`` in a worker (``fresh``: a run of its own, not the one other
        tests share)."""
        return self._submit(seed, faults, bug, mode, fresh)

    def _submit(
        self,
        seed: int,
        faults: Sequence[str] | None,
        bug: str | None,
        mode: dict[str, bool],
        fresh: bool = False,
    ) -> Future[Result]:
        key: Key = (
            seed,
            tuple(faults) if faults is not None else None,
            bug,
            tuple(sorted(mode.items())),
        )
        if fresh:
            return self.pool.submit(run_one, seed, faults, bug, mode)
        run = self._runs.get(key)
        if run is None or run.cancelled():
            run = self._runs[key] = self.pool.submit(run_one, seed, faults, bug, mode)
        return run

    def ahead(
        self, seeds: Iterable[int], faults: Sequence[str] | None = None, **mode: bool
    ) -> None:
        """Submit the runs of ``seeds`` now, for a test that asks for them later: the
        workers run them while this process runs tests of its own."""
        for seed in seeds:
            self._submit(seed, faults, None, mode)

    def ahead_catches(self, catches: Mapping[str, tuple[str, Sequence[int]]], **mode: bool) -> None:
        """Submit the first runs :meth:`caught` will ask for, for each defect of
        ``catches`` (name -> fault mix, seeds): its first seeds with the defect, and the
        first without it."""
        for bug, (faults, seeds) in sorted(catches.items()):
            mix, first = faults.split(","), list(seeds)[:2]
            for seed in first:
                self._submit(seed, mix, bug, mode)
            if first:
                self._submit(first[0], mix, None, mode)

    def results(
        self, seeds: Iterable[int], faults: Sequence[str] | None = None, **mode: bool
    ) -> list[Result]:
        """The runs of ``seeds``, in seed order, all submitted at once."""
        runs = [self._submit(seed, faults, None, mode) for seed in seeds]
        return [run.result() for run in runs]

    def passing(
        self, seeds: Iterable[int], faults: Sequence[str] | None = None, **mode: bool
    ) -> list[Result]:
        """The runs of ``seeds``, which must pass every check."""
        results = self.results(seeds, faults, **mode)
        assert not failures(results), failures(results)
        return results

    def first_failure(
        self, seeds: Sequence[int], faults: Sequence[str], bug: str, **mode: bool
    ) -> Result | None:
        """The run of the first of ``seeds`` (in order) that fails a check with ``bug``;
        the seeds after it are not run."""
        ahead: list[Future[Result]] = []
        todo = iter(seeds)
        try:
            while True:
                for seed in todo:
                    ahead.append(self._submit(seed, faults, bug, mode))
                    if len(ahead) >= AHEAD:
                        break
                if not ahead:
                    return None
                r = ahead.pop(0).result()
                if not r.ok:
                    return r
        finally:
            for run in ahead:
                run.cancel()

    def caught(self, bug: str, faults: str, seeds: range, **mode: bool) -> Result:
        """The defect ``bug`` is caught within ``seeds`` of ``faults``, and made the
        difference: the same run without it passes."""
        caught = self.first_failure(seeds, faults.split(","), bug, **mode)
        assert caught is not None, (
            f"--bug {bug} not caught in seeds {seeds} of --faults {faults} ({mode})"
        )
        clean = self._submit(caught.seed, faults.split(","), None, mode).result()
        assert clean.ok, (bug, caught.seed, clean.failures[:3])
        return caught


def failures(results: Iterable[Result]) -> dict[int, list[str]]:
    return {r.seed: r.failures[:3] + r.schedule for r in results if not r.ok}


def assert_same_run(a: Result, b: Result) -> None:
    assert (a.digest, a.failures, a.schedule, a.events) == (
        b.digest,
        b.failures,
        b.schedule,
        b.events,
    )
