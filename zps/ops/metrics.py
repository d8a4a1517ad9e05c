"""Prometheus metrics and health checks for the broker, shards and workers.

Counters the processes keep anyway (their ``stats`` records) are read only
when Prometheus scrapes, through a collector: the hot path pays nothing for
them.  The one thing measured on the hot path is request latency, a
histogram observed once per request message (a worker's: a
:class:`~zps.ops.meter.ClientMeter`, read by :func:`client_families`).  Each process has its own
registry (no global state); ``metrics.port = 0`` serves nothing.

The HTTP endpoint (a thread of its own, so a scrape never waits for the
event loop) answers these paths, and 404 for any other:

* ``/metrics``: the exposition, in the Prometheus text format version 1.0.0 (its
  ``Content-Type`` says ``version=1.0.0``; for names of the classic character set,
  as all of zps's are, its lines are those of version 0.0.4).
* ``/healthz``: 200 while the process's event loop turns (its heartbeat task
  stamped the time less than :data:`LOOP_MAX_AGE_S` ago), else 503.
* ``/ready``: 200 when the process does its job (the driver's ``ready``
  callback: a broker serves the map, a shard holds its role, a worker is
  connected and not stopping), else 503.

Each health answer is one line of text saying why.

A process that gives a ``status`` callback (the broker) also answers:

* ``/status.json``: its status report (what ``zps-server status --json`` prints),
  built on the event loop: the HTTP thread asks the loop for it and waits at most
  :data:`STATUS_TIMEOUT_S` (then 503); one built less than :data:`STATUS_MAX_AGE_S`
  ago is served again, so any number of viewers cost the loop at most a few
  reports a second.  The loop only builds and encodes the report: sending it,
  however slowly the reader takes it, is the HTTP thread's.
* ``/``: the status page (:mod:`zps.ops.page`), rendered in the HTTP thread from
  that report; its script polls ``/status.json``.

Beside the process's own series every registry has the standard ``process_*``
series (CPU seconds, resident memory, open file descriptors, start time: read
from ``/proc`` at scrape time) and ``zps_build_info{version, protocol}``.
``prometheus_client`` is imported when a registry or a family is first made (a scrape, or
:attr:`MetricsServer.registry` read), not when a process starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Literal, cast

from zps.errors import ZpsError
from zps.ops.config import Metrics
from zps.ops.meter import LATENCY_BUCKETS, ClientMeter, LatencyHistogram
from zps.ops.page import render as render_page
from zps.protocol.codec import PROTOCOL_VERSION
from zps.version import __version__

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector

__all__ = [
    "LATENCY_BUCKETS",
    "LOOP_MAX_AGE_S",
    "STATUS_MAX_AGE_S",
    "STATUS_TIMEOUT_S",
    "LatencyHistogram",
    "MetricsServer",
    "StatusUnavailable",
    "client_families",
    "counter",
    "gauge",
    "labelled",
    "request_seconds",
]

log = logging.getLogger("zps.metrics")


class _Callback:
    """A collector (all a registry asks of one is ``collect``)."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


def counter(
    name: str, doc: str, value: float, labels: dict[str, str] | None = None
) -> CounterMetricFamily:
    from prometheus_client.core import CounterMetricFamily

    m = CounterMetricFamily(name, doc, labels=list(labels or {}))
    m.add_metric(list((labels or {}).values()), value)
    return m


def gauge(
    name: str, doc: str, value: float, labels: dict[str, str] | None = None
) -> GaugeMetricFamily:
    from prometheus_client.core import GaugeMetricFamily

    m = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    m.add_metric(list((labels or {}).values()), value)
    return m


def labelled(
    kind: Literal["counter", "gauge"],
    name: str,
    doc: str,
    label: str,
    values: dict[str, float],
) -> Metric:
    """A family of ``kind`` (``"counter"`` or ``"gauge"``) with one series per value,
    labelled ``label``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if kind not in ("counter", "gauge"):
        raise ValueError(f"a labelled family is a 'counter' or a 'gauge', not {kind!r}")
    m = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        m.add_metric([key], value)
    return m


def _build_info() -> Iterable[Metric]:
    yield gauge(
        "zps_build_info",
        "The zps release and protocol version of this process (always 1)",
        1,
        {"version": __version__, "protocol": str(PROTOCOL_VERSION)},
    )


def request_seconds(by_kind: dict[str, LatencyHistogram]) -> Metric:
    """``zps_shard_request_seconds{kind}``: a shard's time to handle one request message."""
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(
        "zps_shard_request_seconds", "Time to handle one request message", labels=["kind"]
    )
    for kind, hist in by_kind.items():
        buckets, total = hist.cumulative()
        family.add_metric([kind], buckets, total)
    return family


def client_families(
    meter: ClientMeter,
    *,
    requests: int,
    retries: int,
    step: int,
    stop_requested: bool,
    now: float,
) -> Iterable[Metric]:
    """The series of a client (``zps_client_*``) and of the worker running it
    (``zps_worker_*``): read at scrape time from the client's :class:`ClientMeter`,
    its session's request and retry counts, and its training step.  ``now`` is
    ``time.monotonic()``."""
    from prometheus_client.core import HistogramMetricFamily

    buckets, total = meter.latency()
    yield HistogramMetricFamily(
        "zps_client_request_seconds",
        "Time from sending a request message to the shards to its outcome "
        "(retries and re-sends included)",
        buckets=buckets,
        sum_value=total,
    )
    yield counter("zps_client_requests_total", "Request messages sent to the shards", requests)
    operations = meter.operations.copy()
    if operations:  # a family with no series is left out
        yield labelled(
            "counter",
            "zps_client_operations_total",
            "Operations sent to the shards, by operation (push_rows, pull_rows, ...)",
            "op",
            {k: float(v) for k, v in operations.items()},
        )
    yield counter(
        "zps_client_payload_bytes_total",
        "Array bytes of the operations sent (per operation the larger of request and reply)",
        meter.payload_bytes,
    )
    yield counter(
        "zps_client_retries_total",
        "Request messages sent again (a timeout, a new cluster map, a busy shard)",
        retries,
    )
    yield gauge(
        "zps_client_inflight_requests", "Request messages awaiting their outcome", meter.inflight
    )
    yield gauge(
        "zps_client_inflight_bytes",
        "Array bytes of the request messages awaiting their outcome",
        meter.inflight_bytes,
    )
    yield gauge(
        "zps_client_broker_calls_in_progress",
        "Calls the broker answers (clock, data tasks, status) in progress",
        meter.calls,
    )
    yield gauge("zps_worker_step", "The training step this worker is in", step)
    yield counter("zps_worker_clocks_total", "Training steps finished (clock calls)", meter.clocks)
    yield counter(
        "zps_worker_clock_wait_seconds_total",
        "Seconds spent in clock calls (waiting for the other workers)",
        meter.clock_wait_seconds,
    )
    last, waiting = meter.progress()
    yield gauge(
        "zps_worker_progress_age_seconds",
        "Seconds since the training function last made progress (0 while it waits in a call)",
        0.0 if waiting else max(0.0, now - last),
    )
    yield gauge(
        "zps_worker_stop_requested",
        "1 once the worker was asked to stop (SIGTERM), else 0",
        1 if stop_requested else 0,
    )


#: /healthz fails once the event loop has not stamped the time for this long.
LOOP_MAX_AGE_S = 5.0
#: How often the loop stamps it.
LOOP_STAMP_S = 0.5

#: How long ``/status.json`` and ``/`` wait for the event loop to build the report.
STATUS_TIMEOUT_S = 2.0
#: A status report built less than this long ago is served again.
STATUS_MAX_AGE_S = 0.5

#: A readiness verdict: ready or not, and why (one line).
Readiness = Callable[[], tuple[bool, str]]


class StatusUnavailable(Exception):
    """The status report could not be had (why, one line)."""


def _not_ready() -> tuple[bool, str]:
    return False, "starting"


class _Handler(BaseHTTPRequestHandler):
    server: _HttpServer

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        text = "text/plain; charset=utf-8"
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            code, ctype, data = 200, CONTENT_TYPE_LATEST, generate_latest(owner.registry)
        elif path in ("/healthz", "/ready"):
            ok, why = owner.healthz() if path == "/healthz" else owner.readiness()
            code, ctype = (200 if ok else 503), text
            data = f"{'ok' if ok else 'not ok'}: {why}\n".encode()
        elif path in ("/", "/status.json") and owner.serves_status:
            try:
                report = owner.status_json()
            except StatusUnavailable as e:
                code, ctype, data = 503, text, f"status unavailable: {e}\n".encode()
            else:
                if path == "/status.json":
                    code, ctype, data = 200, "application/json", report
                else:
                    try:
                        html = render_page(json.loads(report))
                    except Exception as e:  # a report the page cannot show: say so
                        log.exception("rendering the status page failed")
                        code, ctype = 500, text
                        data = f"the status page failed: {e!r} (see /status.json)\n".encode()
                    else:
                        code, ctype, data = 200, "text/html; charset=utf-8", html.encode()
        else:
            code, ctype = 404, text
            also = "/, /status.json, " if owner.serves_status else ""
            data = f"not found: try {also}/metrics, /healthz or /ready\n".encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], owner: MetricsServer) -> None:
        self.owner = owner
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class MetricsServer:
    """A registry, a scrape-time collector, health checks, and (if configured) the
    HTTP endpoint."""

    def __init__(
        self,
        config: Metrics,
        collect: Callable[[], Iterable[Metric]],
        *,
        ready: Readiness = _not_ready,
        status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self._collect = collect
        self._registry: CollectorRegistry | None = None
        self.readiness = ready
        self.loop_stamp: float | None = None
        self._server: _HttpServer | None = None
        self._thread: threading.Thread | None = None
        #: Builds the status report; called on the event loop only.
        self._status = status
        self._loop: asyncio.AbstractEventLoop | None = None
        self._status_lock = threading.Lock()
        self._status_cached: tuple[float, bytes] | None = None
        self._status_pending: concurrent.futures.Future[bytes] | None = None

    @property
    def registry(self) -> CollectorRegistry:
        """The process's own registry: its collector, ``zps_build_info`` and the
        ``process_*`` series (made on first use)."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry, ProcessCollector

            registry = CollectorRegistry(auto_describe=False)
            registry.register(cast("Collector", _Callback(self._collect)))
            registry.register(cast("Collector", _Callback(_build_info)))
            ProcessCollector(registry=registry)
            self._registry = registry
        return self._registry

    @property
    def serves_status(self) -> bool:
        """Whether ``/`` and ``/status.json`` are served (a status callback was given)."""
        return self._status is not None

    def _build_status(self, pending: concurrent.futures.Future[bytes]) -> None:
        """Run by the event loop: the report into ``pending`` (a plain callback, not a
        coroutine, so a loop that closes before running it leaves nothing un-awaited)."""
        if not pending.set_running_or_notify_cancel():
            return
        try:
            assert self._status is not None
            pending.set_result(json.dumps(self._status(), default=str).encode())
        except Exception as e:  # said by the viewer's request (status_json)
            pending.set_exception(e)

    def status_json(self, now: float | None = None) -> bytes:
        """The status report as JSON, from any thread but the event loop's: built there
        (or the one built less than :data:`STATUS_MAX_AGE_S` ago); raises
        :class:`StatusUnavailable` if the loop does not answer within
        :data:`STATUS_TIMEOUT_S`."""
        loop = self._loop
        if self._status is None or loop is None:
            raise StatusUnavailable("the event loop has not started")
        with self._status_lock:
            at = time.monotonic() if now is None else now
            cached = self._status_cached
            if cached is not None and at - cached[0] < STATUS_MAX_AGE_S:
                return cached[1]
            pending = self._status_pending
            if pending is None or pending.done():
                # One build at a time: viewers arriving meanwhile wait for the same one.
                pending = concurrent.futures.Future()
                try:
                    loop.call_soon_threadsafe(self._build_status, pending)
                except RuntimeError:  # the loop is closed
                    raise StatusUnavailable("the process is stopping") from None
                self._status_pending = pending
        try:
            data = pending.result(timeout=STATUS_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise StatusUnavailable(
                f"the event loop did not answer within {STATUS_TIMEOUT_S:g}s"
            ) from None
        except concurrent.futures.CancelledError:
            raise StatusUnavailable("the process is stopping") from None
        except Exception as e:  # a bug in the report: said once per request, not fatal
            log.exception("building the status report failed")
            raise StatusUnavailable(f"building it failed: {e!r}") from None
        with self._status_lock:
            self._status_cached = (time.monotonic(), data)
        return data

    @property
    def port(self) -> int | None:
        """The port served (the configured one, or the one picked for port 0)."""
        return None if self._server is None else int(self._server.server_address[1])

    def healthz(self, now: float | None = None) -> tuple[bool, str]:
        """Alive while the event loop stamped the time within :data:`LOOP_MAX_AGE_S`."""
        stamp = self.loop_stamp
        if stamp is None:
            return False, "the event loop has not started"
        age = (time.monotonic() if now is None else now) - stamp
        if age > LOOP_MAX_AGE_S:
            return False, f"the event loop has not turned for {age:.1f}s"
        return True, f"the event loop turned {age:.1f}s ago"

    async def loop_heartbeat(self) -> None:
        """Stamp the time every :data:`LOOP_STAMP_S` until cancelled (run it in the
        driver's task group: a blocked loop stops stamping)."""
        self._loop = asyncio.get_running_loop()
        while True:
            self.loop_stamp = time.monotonic()
            await asyncio.sleep(LOOP_STAMP_S)

    def start(self) -> None:
        """Bind and serve; raises :class:`~zps.errors.ZpsError` naming the address if
        it cannot bind (a port in use)."""
        if self.config.port <= 0:
            return
        host, port = self.config.host, self.config.port
        try:
            self._server = _HttpServer((host, port), self)
        except OSError as e:
            raise ZpsError(
                f"cannot serve metrics on {host}:{port}: {e.strerror or e} "
                "(set metrics.port / --metrics-port to a free port, or 0 for none)"
            ) from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="zps-metrics", daemon=True
        )
        self._thread.start()
        log.info(
            "metrics on http://%s:%d/metrics (also %s/healthz, /ready)",
            host,
            self.port,
            "the status page at /, /status.json, " if self.serves_status else "",
        )

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
