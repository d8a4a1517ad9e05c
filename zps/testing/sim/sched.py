"""The simulator's one scheduler: a heap of (time, seq, event) and the seeded random source.

Simulated time advances only from event to event: a simulated second costs what its
events cost to run.  Every random choice of a run comes from :attr:`Scheduler.rng`, and
events at one time run in the order they were scheduled, so a seed fixes the run.

The garbage collector is a source of order too: a finalizer (a frozen cut released when
its snapshot goes, a socket closed) runs when a collection finds its object, and the
interpreter collects after a count of allocations that depends on all the process ran
before.  While a scheduler runs, automatic collection is off (:func:`quiet_gc`) and it
collects every :data:`COLLECT_EVERY` events instead, at the same points in any process:
the youngest generation each time (``gc.collect(0)``: young only in every CPython), the
whole heap every :data:`FULL_EVERY` times (a full collection walks every object the
process holds, the modules' included).  What is in which generation follows from the
run's own events, the heap being collected whole before it starts; garbage that survived
into an older generation (a snapshot whose finalizer releases a frozen cut, say) is found
at the next full collection, up to ``COLLECT_EVERY * FULL_EVERY`` events later, at the
same point in every process.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import heapq
import itertools
import random
from collections.abc import Callable, Iterator

#: Events between two collections of the garbage collector's youngest generation while a
#: run is under way.
COLLECT_EVERY = 2000
#: Collections between two of the whole heap (one every 10,000 events).
FULL_EVERY = 5

#: An event on the heap: (time, sequence number, what to run).  Plain tuples: the
#: heap compares them natively, and (time, seq) is unique, so ``fn`` is never compared.
_Event = tuple[float, int, Callable[[], None]]


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
        #: A prefix cut from every trace line (the run's scratch directory, whose name
        #: is not the seed's): a path in a message must not change the trace's hash.
        self.redact = "\0"

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t if t > self.now else self.now, next(self._seq), fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def log(self, line: str) -> None:
        """A line of the trace: hashed always (the determinism check), kept with --trace."""
        if self.redact in line:
            line = line.replace(self.redact, "")
        text = f"{self.now:10.4f} {line}"
        self._hash.update(text.encode())
        if self.trace_on:
            self.lines.append(text)

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()[:16]

    def run_until(self, end: float) -> None:
        heap, pop = self._heap, heapq.heappop
        n, due = 0, COLLECT_EVERY - self.events % COLLECT_EVERY
        while heap and heap[0][0] <= end:
            t, _, fn = pop(heap)
            self.now = t
            n += 1
            fn()
            if n == due:
                k = (self.events + n) // COLLECT_EVERY
                gc.collect(2 if k % FULL_EVERY == 0 else 0)
                due += COLLECT_EVERY
        self.events += n
        self.now = max(self.now, end)


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """No automatic collection while a run is under way (see the module notes); what the
    process left before is collected first."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
