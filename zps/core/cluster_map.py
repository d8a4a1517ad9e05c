"""What the broker's state machine publishes and records, as pure functions of its
partitions: the cluster map (with each partition's routing broker) and the record of
each partition that survives a broker restart (rule 4 of :mod:`zps.core.cluster`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from zps.core.brokerstate import PartitionRecord
from zps.core.nodes import Partition, ShardNode
from zps.core.routing import ClusterMap, PartitionInfo, RouterInfo


def routers_of(
    parts: Sequence[Partition],
    shards: Mapping[str, ShardNode],
    routers: Mapping[str, RouterInfo],
    *,
    holding: bool,
) -> list[str]:
    """Each partition's router endpoint: a router on its primary's host (the hop to the
    shard stays inside the host), else the routers in turn; none while holding
    (requests then go to the broker, which holds them) or without routers."""
    out = [""] * len(parts)
    if not routers or holding:
        return out
    ordered = [routers[n] for n in sorted(routers)]
    by_host: dict[str, RouterInfo] = {}
    for r in ordered:
        by_host.setdefault(r.host, r)
    spread = 0
    for p, part in enumerate(parts):
        node = shards.get(part.primary) if part.primary else None
        local = by_host.get(node.host) if node is not None and node.host else None
        if local is None:
            local = ordered[spread % len(ordered)]
            spread += 1
        out[p] = local.endpoint
    return out


def build_map(
    parts: Sequence[Partition],
    shards: Mapping[str, ShardNode],
    routers: Mapping[str, RouterInfo],
    *,
    holding: bool,
    version: int,
    n_slots: int,
    slot_map: npt.NDArray[np.int32],
    incarnation: str,
) -> ClusterMap:
    """The map of ``version``: a partition whose primary is fenced by a contender
    (rule 8) names no primary."""
    endpoints = routers_of(parts, shards, routers, holding=holding)
    infos = {
        p: PartitionInfo(
            epoch=part.epoch,
            primary=None if part.contender is not None else part.primary,
            replicas=tuple(part.replicas),
            in_sync=tuple(sorted(part.in_sync)),
            lost=part.lost,
            router=endpoints[p],
        )
        for p, part in enumerate(parts)
    }
    return ClusterMap(
        version,
        n_slots,
        slot_map,
        infos,
        incarnation,
        tuple(routers[n] for n in sorted(routers)),
    )


def records(
    parts: Sequence[Partition], shards: Mapping[str, ShardNode]
) -> tuple[PartitionRecord, ...]:
    """Each partition's epoch, floor, hosts and in-sync set, for the broker's record."""
    out = []
    for part in parts:
        nodes = [n for n in (part.primary, *part.replicas) if n is not None and n in shards]
        hosts = tuple(sorted({shards[n].host for n in nodes})) or part.hosts
        out.append(
            PartitionRecord(part.epoch, part.floor_epoch, part.floor_lsn, hosts, part.members)
        )
    return tuple(out)


def restore(parts: Sequence[Partition], recorded: Sequence[PartitionRecord]) -> None:
    """Give each partition what a previous broker recorded: a recorded in-sync set pins
    its members (only they may be elected after the restart)."""
    for part, rec in zip(parts, recorded, strict=True):
        part.epoch, part.floor_epoch, part.floor_lsn = rec.epoch, rec.floor_epoch, rec.floor_lsn
        part.hosts, part.members = rec.hosts, rec.in_sync
        part.pinned = bool(rec.in_sync)
