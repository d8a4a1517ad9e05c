"""What the broker tells about itself: the status report, metrics and readiness, and
each partition's change of state logged once.

One job: read the broker's state and say it; nothing here changes that state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from zps import transport
from zps.broker import forward
from zps.broker.base import BrokerStats
from zps.broker.training import Training
from zps.core.cluster import ClusterState
from zps.core.membership import FailureDetector
from zps.ops.config import BrokerConfig
from zps.ops.metrics import counter, gauge, labelled
from zps.ops.security import REFUSAL_REASONS, RefusalLog
from zps.protocol.codec import PROTOCOL_VERSION
from zps.version import __version__

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("zps.broker")


class PairStatus(Protocol):
    """What the report needs of the broker pair (:class:`~zps.broker.pair.Pair`)."""

    @property
    def active(self) -> bool: ...

    def status(self, now: float) -> dict[str, Any]: ...


class ReshardStatus(Protocol):
    """What the report needs of the resharding (:class:`~zps.broker.reshard.Resharder`)."""

    def status(self) -> dict[str, Any] | None: ...


class Report:
    """Status, metrics, readiness and state-change logs (see the module notes).

    ``state``, ``detector`` and ``training`` are the broker's current ones (a broker of
    a pair gets new ones when it resets); ``versions`` (node -> zps release) is the
    control plane's; ``bound`` and ``stop`` are the process's events; ``record_status``
    and ``forwarded`` (messages the compiled step forwarded) are read at each report;
    ``out``, ``endpoint`` and ``pair`` are set once they exist."""

    def __init__(
        self,
        config: BrokerConfig,
        state: ClusterState,
        detector: FailureDetector,
        training: Training,
        reshard: ReshardStatus,
        stats: BrokerStats,
        refusals: RefusalLog,
        versions: dict[str, str],
        *,
        bound: asyncio.Event,
        stop: asyncio.Event,
        record_status: Callable[[], dict[str, Any] | None],
        forwarded: Callable[[], int],
    ) -> None:
        self.config = config
        self.state = state
        self.detector = detector
        self.training = training
        self.reshard = reshard
        self.stats = stats
        self.refusals = refusals
        self.versions = versions
        self.bound = bound
        self.stop = stop
        self._record_status = record_status
        self._forwarded = forwarded
        self.out: transport.Outbound | None = None
        self.endpoint: str | None = None
        self.pair: PairStatus | None = None
        self.started = time.monotonic()
        self.part_states: list[str] = []  # each partition's state as last logged
        self.placements: list[str | None] = []  # logged placement warnings
        self.reset_lists(self.started)

    def reset_lists(self, now: float) -> None:
        """Each partition's state and placement as they are now, logged as known."""
        n = self.state.n_partitions
        self.part_states = [self.state.partition_state(p, now) for p in range(n)]
        self.placements = [None] * n

    def resize_lists(self, now: float) -> None:
        """The partition count changed: partitions added start as they are now."""
        n = self.state.n_partitions
        self.part_states = (
            self.part_states + [self.state.partition_state(p, now) for p in range(n)]
        )[:n]
        self.placements = (self.placements + [None] * n)[:n]

    def ready(self) -> tuple[bool, str]:
        """For ``/ready`` (called from the metrics thread): the broker serves the map."""
        if not self.bound.is_set() or self.stop.is_set():
            return False, "not listening"
        if self.pair is not None and not self.pair.active:
            return False, "the standby of a broker pair"
        if self.state.holding(time.monotonic()):
            return False, "collecting the shards' claims after a start"
        return True, f"serving map v{self.state.map_version} on {self.endpoint}"

    def flow(self) -> dict[str, Any]:
        """Flow control figures: bytes held for slow peers against their bounds."""
        out = self.out
        return {
            "held_bytes": out.held_bytes if out else 0,
            "peak_held_bytes": out.allowance.peak if out else 0,
            "peak_peer_held_bytes": out.allowance.peak_peer if out else 0,
            "held_peers": out.allowance.peers if out else 0,
            "queue_bytes": self.config.queue_bytes,
            "client_queue_bytes": self.config.client_queue_bytes,
            "shard_queue_bytes": self.config.shard_queue_bytes,
            "dropped_bytes": out.dropped_bytes if out else 0,
            "stalled_peers": out.stalled if out else 0,
        }

    def collect(self) -> Iterable[Metric]:
        yield labelled(
            "counter",
            "zps_broker_messages",
            "Messages by outcome",
            "outcome",
            {k: float(v) for k, v in vars(self.stats).items()},
        )
        flow = self.flow()
        yield gauge(
            "zps_broker_held_bytes", "Bytes held for peers slower than zmq", flow["held_bytes"]
        )
        yield gauge(
            "zps_broker_peak_held_bytes",
            "Most bytes held for peers at once",
            flow["peak_held_bytes"],
        )
        yield labelled(
            "counter",
            "zps_broker_refusals",
            "CURVE peers and messages refused, by reason",
            "reason",
            {r: float(self.refusals.counts.get(r, 0)) for r in REFUSAL_REASONS},
        )
        yield from _collect_status(self.state.status(time.monotonic(), {}))
        yield from self.training.metrics()

    def status(self, now: float) -> dict[str, Any]:
        nodes = [*self.state.shards, *self.state.clients]
        report = self.state.status(now, {n: self.detector.last_seen(n) for n in nodes})
        report["training"] = self.training.status()
        report["reshard"] = self.reshard.status()
        report["routers"] = [
            {
                **r.to_wire(),
                "partitions": [
                    p for p, i in self.state.map.partitions.items() if i.router == r.endpoint
                ],
            }
            for r in self.state.map.routers
        ]
        for entry in (*report["shards"], *report["clients"]):
            entry["version"] = self.versions.get(entry["node"]) or None
        report["broker"] = {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "uptime_s": round(now - self.started, 1),
            # The start-up hold's time left (collecting the shards' claims); 0 once over.
            "holding_s": round(max(0.0, self.state.hold_until - now), 3),
            "heartbeat_interval_s": self.config.heartbeat.interval,
            "liveness": self.config.heartbeat.liveness,
            **vars(self.stats),
            # Which code forwards requests and replies (zps.broker.forward), and how
            # many messages the compiled step forwarded.
            "data_path": "python" if forward.step is None else "compiled",
            "forwarded_compiled": self._forwarded(),
            "flow": self.flow(),
            "state": self._record_status(),
        }
        if self.pair is not None:
            report["pair"] = self.pair.status(now)
        return report

    def log_partition_states(self, now: float) -> None:
        """Log each change of a partition's state once: lost at ERROR, a copy gone
        (ok -> degraded) at WARNING, the rest (recoveries, start-up) at INFO."""
        for p, old in enumerate(self.part_states):
            new = self.state.partition_state(p, now)
            if new == old:
                continue
            self.part_states[p] = new
            stopped = new == "lost" and self.state.stopped(p)
            level = (
                logging.WARNING
                if stopped or (new == "degraded" and old == "ok")
                else logging.ERROR
                if new == "lost"
                else logging.INFO
            )
            why = {
                "lost": "its last copy was stopped; its requests wait until a shard holding "
                "it registers"
                if stopped
                else "no copy left; its requests wait until a shard holding it registers",
                "degraded": "fewer copies in sync than configured",
            }.get(new, "")
            primary = self.state.primary_of(p)
            log.log(
                level,
                "partition %d: %s -> %s%s%s",
                p,
                old,
                new,
                f" (primary {primary})" if primary and new in ("ok", "degraded") else "",
                f": {why}" if why else "",
            )
        for p, before in enumerate(self.placements):
            warning = self.state.placement_warning(p)
            if warning != before:
                self.placements[p] = warning
                if warning is not None:
                    log.warning("partition %d: %s", p, warning)
                else:
                    log.info("partition %d: its copies are on distinct hosts (zones) again", p)


def _collect_status(report: dict[str, Any]) -> Iterable[Metric]:
    from prometheus_client.core import GaugeMetricFamily

    roles: dict[str, float] = {"primary": 0, "replica": 0, "spare": 0}
    for s in report["shards"]:
        roles[s["role"]] = roles.get(s["role"], 0) + 1
    yield labelled("gauge", "zps_shards", "Registered shards by role", "role", roles)
    states: dict[str, float] = {"ok": 0, "degraded": 0, "lost": 0, "holding": 0, "unassigned": 0}
    for p in report["partitions"]:
        states[p["state"]] = states.get(p["state"], 0) + 1
    yield labelled("gauge", "zps_partitions", "Partitions by state", "state", states)
    yield gauge("zps_clients", "Connected clients", len(report["clients"]))
    yield counter(
        "zps_failovers", "Promotions of a replica after a primary died", report["failovers"]
    )
    yield gauge("zps_map_version", "Version of the cluster map", report["map_version"])
    lag = GaugeMetricFamily(
        "zps_broker_replica_lag_updates",
        "Updates the replica's last reported LSN is behind its primary's",
        labels=["partition", "replica"],
    )
    for p in report["partitions"]:
        for r in p["replicas"]:
            if r["lag"] is not None:
                lag.add_metric([str(p["partition"]), r["node"]], r["lag"])
    if lag.samples:
        yield lag
