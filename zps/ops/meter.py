"""A client's request counters and latencies, and the progress its training function shows.

The client's event loop updates a :class:`ClientMeter` once per request message it
sends and once per outcome (a few additions and a bisection: no Prometheus objects
on the hot path); a metrics scrape reads it from another thread through
:func:`zps.ops.metrics.client_families`, which also exports how long ago the
training function last made progress (:meth:`ClientMeter.progress`).

Readers on other threads copy before they iterate: a dict is copied with
``dict.copy`` (one step under the GIL), a list with ``list(...)``; a series read
in the middle of an update is at most one request behind.

Time is ``time.monotonic()`` throughout (the caller passes it in), the same clock
on the client's loop thread and on the training function's thread.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

__all__ = ["LATENCY_BUCKETS", "ClientMeter", "LatencyHistogram"]

#: Request latency buckets (upper bounds, seconds): from tens of microseconds to seconds.
LATENCY_BUCKETS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class LatencyHistogram:
    """Latencies in fixed buckets, updated by one thread (a bisection and two additions:
    no lock and no Prometheus object on the hot path), read from any (see the module
    notes)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = buckets
        #: Observations in each bucket (not cumulative); the last is +Inf.
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative buckets as ``[(le, count), ..., ("+Inf", total)]`` and the sum."""
        counts = list(self.counts)
        total = self.sum
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out, total


class ClientMeter:
    """Counters of one client: request messages, their latency, operations by kind,
    bytes in flight, broker calls in progress, and the training step's clock."""

    def __init__(self, now: float, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        #: Time from sending each request message to its outcome.
        self.request_latency = LatencyHistogram(buckets)
        #: Operations sent, by operation (``push_rows``, ``pull_dense``, ...).
        self.operations: dict[str, int] = {}
        #: Array bytes of the operations sent (requests and their expected replies: the
        #: larger of the two per operation).
        self.payload_bytes = 0
        #: Request messages sent and not yet answered (or failed), and their bytes.
        self.inflight = 0
        self.inflight_bytes = 0
        #: Calls the broker answers (clock, data tasks, status) in progress.
        self.calls = 0
        #: Clock calls finished and the seconds spent waiting in them.
        self.clocks = 0
        self.clock_wait_seconds = 0.0
        #: When the training function last showed progress (see :meth:`progress`).
        self.last_progress = now

    # -- updates (the client's event loop, or the training function's thread) ----

    def request_sent(self, ops: Iterable[str], nbytes: int, now: float) -> None:
        """A request message carrying ``ops`` (operation names) and ``nbytes`` of arrays."""
        counts = self.operations
        for op in ops:
            counts[op] = counts.get(op, 0) + 1
        self.payload_bytes += nbytes
        self.inflight += 1
        self.inflight_bytes += nbytes
        self.last_progress = now

    def request_done(self, nbytes: int, seconds: float, now: float) -> None:
        """The outcome of a request sent ``seconds`` ago (answered or failed)."""
        self.request_latency.observe(seconds)
        self.inflight -= 1
        self.inflight_bytes -= nbytes
        self.last_progress = now

    def call_started(self, now: float) -> None:
        self.calls += 1
        self.last_progress = now

    def call_done(self, now: float) -> None:
        self.calls -= 1
        self.last_progress = now

    def clocked(self, waited: float, now: float) -> None:
        """A training step finished: its clock call waited ``waited`` seconds."""
        self.clocks += 1
        self.clock_wait_seconds += waited
        self.last_progress = now

    def stepped(self, now: float) -> None:
        """The training function reported a step (``ps.report``)."""
        self.last_progress = now

    # -- reads (any thread) --------------------------------------------------------

    def progress(self) -> tuple[float, bool]:
        """When the training function last made progress (sent a request, had one
        answered, started or finished a broker call, reported or clocked a step), and
        whether it is waiting in a call now (the cluster has it: every call has a
        deadline, or waits on other workers)."""
        return self.last_progress, self.inflight > 0 or self.calls > 0

    def latency(self) -> tuple[list[tuple[str, float]], float]:
        """The request latencies: cumulative buckets and the sum."""
        return self.request_latency.cumulative()
