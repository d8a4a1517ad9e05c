"""The shard's metrics and readiness: what ``/metrics`` and ``/ready`` say of it.

Read from the metrics thread (:class:`~zps.ops.metrics.MetricsServer`): only counters
and gauges the event loop keeps, through :class:`Observed`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from zps import shm
from zps.ops.metrics import (
    LatencyHistogram,
    counter,
    gauge,
    labelled,
    request_seconds,
)
from zps.ops.security import REFUSAL_REASONS
from zps.protocol.messages import Role
from zps.shard.core import ShardCore
from zps.shard.durability import Durability
from zps.shard.liveness import Liveness
from zps.shard.primary import ReplicationStream, Reply
from zps.shard.session import ShardSession

if TYPE_CHECKING:
    from prometheus_client.core import Metric

#: Seconds after which a reply's shared-memory region may be reused unread.
SHM_RECLAIM_S = 2.0


@dataclass
class CheckpointStats:
    """The shard's checkpoints: how many were written and failed, how long the last
    write took, and the Unix time of the newest (written or restored)."""

    written: int = 0
    failures: int = 0
    seconds: float | None = None
    time: float | None = None


class Observed(Protocol):
    """What the metrics read of the shard (:class:`~zps.shard.server.ShardServer`)."""

    @property
    def node_id(self) -> str: ...

    @property
    def broker(self) -> str: ...

    @property
    def core(self) -> ShardCore: ...

    @property
    def session(self) -> ShardSession[Reply]: ...

    @property
    def durability(self) -> Durability: ...

    @property
    def stream(self) -> ReplicationStream | None: ...

    @property
    def shared(self) -> shm.SharedMemory | None: ...

    @property
    def beat_policy(self) -> Liveness | None: ...

    @property
    def latency(self) -> dict[str, LatencyHistogram]: ...

    @property
    def overloaded(self) -> int: ...

    @property
    def checkpoint_stats(self) -> CheckpointStats: ...

    @property
    def registered(self) -> bool: ...

    @property
    def stopping(self) -> bool: ...


def collect(shard: Observed) -> Iterable[Metric]:
    """The shard's metrics (zps_shard_*), read in the metrics thread."""
    from prometheus_client.core import GaugeMetricFamily

    s, core = shard.core.stats, shard.core
    yield counter("zps_shard_requests", "Request messages handled", s.requests)
    yield request_seconds(shard.latency)
    yield labelled(
        "counter",
        "zps_shard_ops",
        "Operations by kind",
        "op",
        {k: float(v) for k, v in s.by_op.items()},
    )
    yield counter("zps_shard_errors", "Operations answered with an error", s.errors)
    yield counter(
        "zps_shard_duplicates", "Re-sent messages answered from the dedup record", s.duplicates
    )
    yield counter("zps_shard_malformed", "Malformed messages dropped or refused", s.malformed)
    if shard.stream is not None:
        counts = shard.stream.refusals.counts
        yield labelled(
            "counter",
            "zps_shard_replication_refusals",
            "CURVE peers and messages refused at the replication endpoint, by reason",
            "reason",
            {r: float(counts.get(r, 0)) for r in REFUSAL_REASONS},
        )
    yield counter("zps_shard_receive_bytes", "Payload bytes received", s.bytes_in)
    part = {"partition": "none" if core.partition is None else str(core.partition)}
    yield gauge("zps_shard_lsn", "Log sequence number of the partition", core.lsn, part)
    yield gauge("zps_shard_table_bytes", "Memory held by the partition's tables", core.store.nbytes)
    yield gauge("zps_shard_dedup_bytes", "Memory held by the dedup record", core.dedup.nbytes)
    yield gauge("zps_shard_dedup_entries", "Messages in the dedup record", len(core.dedup))
    yield counter(
        "zps_shard_dedup_evicted", "Messages evicted from the dedup record", core.dedup.evicted
    )
    yield counter(
        "zps_shard_dedup_expired",
        "Re-sent messages older than the dedup record, refused",
        s.expired,
    )
    yield gauge(
        "zps_shard_step_buffer_bytes",
        "Memory held by sync-mode gradients waiting for their step",
        core.steps.nbytes,
    )
    roles = GaugeMetricFamily(
        "zps_shard_role",
        "1 for the current role (shard: this shard's name)",
        labels=["role", "partition", "shard"],
    )
    for r in Role:
        roles.add_metric(
            [r.value, part["partition"], shard.node_id], float(r is shard.session.role)
        )
    yield roles
    yield from _checkpoint_metrics(shard, part)
    wal = shard.durability.stats
    yield counter("zps_shard_wal_bytes", "Bytes written to the write-ahead log", wal.bytes)
    yield counter("zps_shard_wal_syncs", "fsyncs of the write-ahead log", wal.syncs)
    yield counter("zps_shard_wal_errors", "Failed writes of the write-ahead log", wal.errors)
    yield counter(
        "zps_shard_overloaded",
        "Requests refused OVERLOADED: the replies held for the broker filled their bound",
        shard.overloaded,
    )
    if shard.beat_policy is not None:
        yield counter(
            "zps_shard_heartbeats_covered",
            "Heartbeats the liveness thread sent while the event loop was held",
            shard.beat_policy.covered,
        )
        yield gauge(
            "zps_shard_event_loop_longest_gap_seconds",
            "The longest the event loop went between two heartbeats",
            shard.beat_policy.longest_gap,
        )
    if shard.shared is not None:
        shm_stats = shard.shared.stats()
        yield gauge(
            "zps_shard_shm_bytes",
            "Shared memory held by frames clients and replicas have not yet read",
            shm_stats["used"],
        )
        yield counter(
            "zps_shard_shm_sent_frames",
            "Reply and replication frames sent through shared memory",
            shm_stats["puts"],
        )
        yield counter(
            "zps_shard_shm_staged_frames",
            "Write frames read from a client's shared memory into this shard's own and "
            "streamed to replicas from there, with no copy of their own",
            shm_stats["named"] - shm_stats["lent"],
        )
        yield counter(
            "zps_shard_shm_lent_frames",
            "Pull replies that named a dense chunk's values in shared memory instead of "
            "copying them (a push meanwhile updates a new copy)",
            shm_stats["lent"],
        )
        yield counter(
            "zps_shard_shm_loans_expired",
            "Loans of dense chunks whose reader had not said it was done in time "
            f"({SHM_RECLAIM_S}s after the longest a reply may wait for the replicas): a "
            "chunk still held gets a new token, so a late read is refused and asked again",
            shm_stats["expired"],
        )
        yield gauge(
            "zps_shard_shm_dense_bytes",
            "Dense values held in shared memory (current chunks, and lent older ones)",
            shm_stats["array_bytes"],
        )
        yield counter(
            "zps_shard_shm_read_frames",
            "Request and replication frames read from peers' shared memory",
            shm_stats["reads"],
        )
        yield counter(
            "zps_shard_shm_full",
            "Reply frames sent inline because the shared memory budget was spent",
            shm_stats["full"],
        )
        yield counter(
            "zps_shard_shm_refused",
            "Requests refused because a client's shared memory could not be read",
            shm_stats["refused"],
        )
    if shard.stream is not None:
        sender = shard.stream.snapshots
        yield counter("zps_shard_snapshots_sent", "Snapshot transfers begun", sender.started)
        yield counter("zps_shard_snapshot_chunks_sent", "Snapshot chunks sent", sender.chunks_sent)
        if shard.shared is not None:
            yield counter(
                "zps_shard_replication_shm_messages",
                "Replication messages whose large frames went through shared memory",
                shard.stream.shared_messages,
            )
            yield gauge(
                "zps_shard_replication_shm_bytes",
                "Shared memory held by replication frames not yet acknowledged",
                shard.stream.shared_bytes,
            )
    lag = GaugeMetricFamily(
        "zps_shard_replica_lag_updates",
        "Updates this primary applied that the replica has not acknowledged",
        labels=["partition", "replica"],
    )
    for node, follower in shard.session.followers.items():
        lag.add_metric([part["partition"], node], max(0, core.lsn - follower.acked))
    if lag.samples:  # a family without series is noise (and no primary has none)
        yield lag


def _checkpoint_metrics(shard: Observed, part: dict[str, str]) -> Iterable[Metric]:
    yield counter("zps_shard_checkpoints", "Checkpoints written", shard.checkpoint_stats.written)
    yield counter(
        "zps_shard_checkpoint_failures",
        "Checkpoints that failed to be written",
        shard.checkpoint_stats.failures,
    )
    if shard.checkpoint_stats.seconds is not None:
        yield gauge(
            "zps_shard_checkpoint_duration_seconds",
            "Time the last checkpoint took to write, fsync and rename",
            shard.checkpoint_stats.seconds,
        )
    if shard.checkpoint_stats.time is not None:
        yield gauge(
            "zps_shard_checkpoint_last_success_timestamp_seconds",
            "Unix time of the newest checkpoint of the partition (written or restored)",
            shard.checkpoint_stats.time,
            part,
        )
        yield gauge(
            "zps_shard_checkpoint_age_seconds",
            "Seconds since the newest checkpoint of the partition",
            max(0.0, time.time() - shard.checkpoint_stats.time),
            part,
        )


def ready(shard: Observed) -> tuple[bool, str]:
    """For ``/ready`` (called from the metrics thread): the broker admitted this
    shard and it does its role: a primary holds its lease, a replica has loaded
    its primary's snapshot and follows the stream, a spare waits for a role."""
    s = shard.session
    if s.leaving or shard.stopping:
        return False, "stopping"
    if not shard.registered:
        return False, f"not registered with {shard.broker}"
    where = f"partition {s.partition} at epoch {s.epoch}"
    match s.role:
        case Role.PRIMARY if not s.may_write(time.monotonic()):
            return False, f"primary of {where} without a lease from the broker"
        case Role.REPLICA if not s.synced:
            return False, f"replica of {where}, catching up"
        case Role.SPARE:
            return True, "spare"
    return True, f"{s.role.value} of {where}"
