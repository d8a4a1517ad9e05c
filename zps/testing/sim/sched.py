"""The simulator's one scheduler: a heap of (time, seq, event) and the seeded random source.

Simulated time advances only from event to event: a simulated second costs what its
events cost to run.  Every random choice of a run comes from :attr:`Scheduler.rng`, and
events at one time run in the order they were scheduled, so a seed fixes the run.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True)
class _Event:
    t: float
    seq: int
    fn: Callable[[], None] = field(compare=False)
    what: str = field(compare=False, default="")


class Scheduler:
    def __init__(self, seed: int, *, trace: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self._heap: list[_Event] = []
        self._seq = itertools.count()
        self.trace_on = trace
        self.lines: list[str] = []
        self._hash = hashlib.sha256()
        self.events = 0

    def at(self, t: float, fn: Callable[[], None], what: str = "") -> None:
        heapq.heappush(self._heap, _Event(max(t, self.now), next(self._seq), fn, what))

    def after(self, dt: float, fn: Callable[[], None], what: str = "") -> None:
        self.at(self.now + dt, fn, what)

    def log(self, line: str) -> None:
        """A line of the trace: hashed always (the determinism check), kept with --trace."""
        text = f"{self.now:10.4f} {line}"
        self._hash.update(text.encode())
        if self.trace_on:
            self.lines.append(text)

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()[:16]

    def run_until(self, end: float) -> None:
        while self._heap and self._heap[0].t <= end:
            ev = heapq.heappop(self._heap)
            self.now = ev.t
            self.events += 1
            ev.fn()
        self.now = max(self.now, end)
