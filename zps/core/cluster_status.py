"""The broker's status report (``zps-server status``, ``/status.json``) as plain data,
built from its records of partitions, shards and clients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

from zps.core import placement
from zps.core.nodes import ClientNode, Partition, ShardNode
from zps.protocol.messages import Role


def report(
    parts: Sequence[Partition],
    shards: Mapping[str, ShardNode],
    clients: Mapping[str, ClientNode],
    *,
    now: float,
    last_seen: Mapping[str, float | None],
    states: Sequence[str],
    slots: Sequence[int],
    drained: Set[str],
    header: dict[str, Any],
) -> dict[str, Any]:
    """The report: ``header`` (the map's version and shape), then every partition
    (``states`` and ``slots`` by partition), shard and client."""

    def age(node_id: str) -> float | None:
        seen = last_seen.get(node_id)
        return None if seen is None else round(now - seen, 3)

    partitions: list[dict[str, Any]] = []
    for p, part in enumerate(parts):
        primary = shards.get(part.primary) if part.primary else None
        head = primary.lsn if primary else None
        replicas = []
        for r in part.replicas:
            rnode = shards.get(r)
            lsn = rnode.lsn if rnode else None
            replicas.append(
                {
                    "node": r,
                    "in_sync": r in part.in_sync,
                    "lsn": lsn,
                    "lag": None if head is None or lsn is None else max(0, head - lsn),
                }
            )
        state = states[p]
        entry: dict[str, Any] = {
            "partition": p,
            "slots": slots[p],
            "epoch": part.epoch,
            "state": state,
            "primary": part.primary,
            "lsn": head,
            "replicas": replicas,
            "floor": {"epoch": part.floor_epoch, "lsn": part.floor_lsn},
            "in_sync_set": list(part.members),
            "placement": placement.warning(
                [shards[n] for n in (part.primary, *part.replicas) if n is not None and n in shards]
            ),
        }
        if part.contender is not None:
            entry["handing_over_to"] = part.contender
        held = [
            {"node": n.node_id, "host": n.host, "epoch": n.held.epoch, "lsn": n.held.lsn}
            for n in shards.values()
            if n.held is not None and n.held.partition == p
        ]
        if held or part.lost:
            entry["held_copies"] = held
        if part.lost:
            entry["awaiting"] = (
                f"a copy at epoch {part.floor_epoch}, LSN {part.floor_lsn} or newer"
                + (f" from its in-sync set ({', '.join(part.members)})" if part.members else "")
                + (f" (last on {', '.join(part.hosts)})" if part.hosts else "")
            )
        partitions.append(entry)
    warnings = [
        f"partition {e['partition']}: {e['placement']}" for e in partitions if e["placement"]
    ]
    shard_rows = [
        {
            "node": n.node_id,
            "host": n.host,
            "pid": n.pid,
            "address": n.address,
            "zone": n.zone,
            "role": n.role.value,
            "partition": n.partition,
            "epoch": n.epoch,
            "lsn": n.lsn,
            "last_seen_s": age(n.node_id),
            "stats": n.stats,
            "drained": n.node_id in drained,
        }
        for n in sorted(
            shards.values(),
            key=lambda n: (
                n.partition is None,
                n.partition or 0,
                n.role != Role.PRIMARY,
                n.node_id,
            ),
        )
    ]
    client_rows = [
        {
            "node": c.node_id,
            "host": c.host,
            "pid": c.pid,
            "name": c.name,
            "last_seen_s": age(c.node_id),
        }
        for c in sorted(clients.values(), key=lambda c: c.node_id)
    ]
    return {
        **header,
        "partitions": partitions,
        "placement_warnings": warnings,
        "shards": shard_rows,
        "clients": client_rows,
    }


def partition_state(
    part: Partition, shards: Mapping[str, ShardNode], replication: int, holding: bool
) -> str:
    """``ok`` (a primary and every replica in sync), ``degraded`` (a primary, fewer
    copies in sync), ``lost`` (no copy left), ``holding`` (collecting claims after a
    start) or ``unassigned`` (no shard yet)."""
    if part.primary is not None and part.primary in shards:
        return "degraded" if len(part.in_sync) < replication - 1 else "ok"
    if part.lost:
        return "lost"
    return "holding" if holding else "unassigned"
