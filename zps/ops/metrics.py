"""Prometheus metrics for the broker and shards.

Counters the processes keep anyway (their ``stats`` records) are read only
when Prometheus scrapes, through a collector: the hot path pays nothing for
them.  The one thing measured on the hot path is request latency, a
histogram observed once per request message.  Each process has its own
registry (no global state); ``metrics.port = 0`` serves nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zps.ops.config import Metrics

__all__ = [
    "LATENCY_BUCKETS",
    "CounterMetricFamily",
    "GaugeMetricFamily",
    "Metric",
    "MetricsServer",
    "counter",
    "gauge",
    "labelled",
]

log = logging.getLogger("zps.metrics")

#: Request latency buckets: from tens of microseconds to seconds.
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


class _Callback(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


def counter(
    name: str, doc: str, value: float, labels: dict[str, str] | None = None
) -> CounterMetricFamily:
    m = CounterMetricFamily(name, doc, labels=list(labels or {}))
    m.add_metric(list((labels or {}).values()), value)
    return m


def gauge(
    name: str, doc: str, value: float, labels: dict[str, str] | None = None
) -> GaugeMetricFamily:
    m = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    m.add_metric(list((labels or {}).values()), value)
    return m


def labelled(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    doc: str,
    label: str,
    values: dict[str, float],
) -> Metric:
    m = kind(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        m.add_metric([key], value)
    return m


class MetricsServer:
    """A registry, a scrape-time collector, and (if configured) the HTTP endpoint."""

    def __init__(self, config: Metrics, collect: Callable[[], Iterable[Metric]]) -> None:
        self.config = config
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Callback(collect))
        self.request_seconds = Histogram(
            "zps_request_seconds",
            "Time to handle one request message",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._server: Any = None

    def start(self) -> None:
        if self.config.port <= 0:
            return
        self._server, _ = start_http_server(
            self.config.port, self.config.host, registry=self.registry
        )
        log.info("metrics on http://%s:%d/metrics", self.config.host, self.config.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
