"""The broker's state machine: nodes, roles and the cluster map.

Rules:

1. Every change of who serves a partition bumps that partition's epoch and the
   map version; the map is only ever replaced, never edited in place.
2. A registering shard first gets back the partition it claims (after a broker
   restart the shards rebuild the map), else becomes primary of a partition
   that never had one, else waits as a spare.
3. A partition whose primary died with no copy left is *lost*: it is never
   handed to a fresh, empty shard (that would silently reset its values); it
   comes back only when a shard that holds its data claims it.

No I/O and no clock: the broker driver calls these methods with ``now`` and
sends what they return.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from zps.routing import DEFAULT_SLOTS, ClusterMap, PartitionInfo, default_slot_map


class Role(enum.StrEnum):
    PRIMARY = "primary"
    REPLICA = "replica"
    SPARE = "spare"


@dataclass
class ShardNode:
    node_id: str
    host: str
    pid: int
    address: str
    registered_at: float
    role: Role = Role.SPARE
    partition: int | None = None
    epoch: int = 0
    lsn: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClientNode:
    node_id: str
    host: str
    pid: int
    name: str
    registered_at: float


@dataclass(frozen=True)
class Assignment:
    """Tell ``node`` its role; ``partition``/``epoch`` are None/0 for a spare."""

    node_id: str
    role: Role
    partition: int | None
    epoch: int


@dataclass
class _Partition:
    epoch: int = 0
    primary: str | None = None
    lost: bool = False


class ClusterState:
    """What the broker knows; see the module rules."""

    def __init__(self, n_partitions: int, n_slots: int = DEFAULT_SLOTS) -> None:
        if n_partitions < 1:
            raise ValueError("a cluster needs at least one partition")
        if n_slots < n_partitions:
            raise ValueError("n_slots must be >= the number of partitions")
        self.n_partitions = n_partitions
        self.n_slots = n_slots
        self.slot_map = default_slot_map(n_slots, n_partitions)
        self.shards: dict[str, ShardNode] = {}
        self.clients: dict[str, ClientNode] = {}
        self._parts = [_Partition() for _ in range(n_partitions)]
        self.map_version = 0
        self.map = self._build_map()

    # -- queries -------------------------------------------------------------

    def primary_of(self, partition: int) -> str | None:
        if 0 <= partition < self.n_partitions:
            return self._parts[partition].primary
        return None

    def is_lost(self, partition: int) -> bool:
        return self._parts[partition].lost

    # -- events --------------------------------------------------------------

    def register_shard(
        self,
        node_id: str,
        *,
        host: str,
        pid: int,
        address: str,
        now: float,
        claim: tuple[int, int] | None = None,
    ) -> list[Assignment]:
        """A shard (re)joins; ``claim`` is ``(partition, epoch)`` it already serves."""
        old = self.shards.get(node_id)
        node = ShardNode(node_id, host, pid, address, now)
        if old is not None:
            node.role, node.partition, node.epoch, node.lsn = (
                old.role,
                old.partition,
                old.epoch,
                old.lsn,
            )
        self.shards[node_id] = node
        if old is not None and old.role is Role.PRIMARY:
            return [Assignment(node_id, node.role, node.partition, node.epoch)]
        if claim is not None:
            partition, epoch = claim
            if 0 <= partition < self.n_partitions:
                part = self._parts[partition]
                if part.primary is None and epoch >= part.epoch:
                    return self._make_primary(node, partition, epoch=max(epoch, part.epoch))
        for p, part in enumerate(self._parts):
            if part.primary is None and not part.lost:
                return self._make_primary(node, p, epoch=part.epoch + 1)
        node.role, node.partition, node.epoch = Role.SPARE, None, 0
        return [Assignment(node_id, Role.SPARE, None, 0)]

    def register_client(self, node_id: str, *, host: str, pid: int, name: str, now: float) -> None:
        self.clients[node_id] = ClientNode(node_id, host, pid, name, now)

    def report(self, node_id: str, *, lsn: int, stats: dict[str, Any]) -> None:
        node = self.shards.get(node_id)
        if node is not None:
            node.lsn = lsn
            node.stats = stats

    def node_gone(self, node_id: str) -> list[Assignment]:
        """A node died or left.  Returns new assignments (none yet without replicas)."""
        self.clients.pop(node_id, None)
        node = self.shards.pop(node_id, None)
        if node is None or node.role is not Role.PRIMARY or node.partition is None:
            return []
        part = self._parts[node.partition]
        if part.primary == node_id:
            part.primary = None
            part.lost = True
            self._publish()
        return []

    # -- internals -----------------------------------------------------------

    def _make_primary(self, node: ShardNode, partition: int, *, epoch: int) -> list[Assignment]:
        part = self._parts[partition]
        part.primary, part.epoch, part.lost = node.node_id, epoch, False
        node.role, node.partition, node.epoch = Role.PRIMARY, partition, epoch
        self._publish()
        return [Assignment(node.node_id, Role.PRIMARY, partition, epoch)]

    def _publish(self) -> None:
        self.map_version += 1
        self.map = self._build_map()

    def _build_map(self) -> ClusterMap:
        parts = {
            p: PartitionInfo(
                epoch=part.epoch,
                primary=part.primary,
                in_sync=(part.primary,) if part.primary else (),
            )
            for p, part in enumerate(self._parts)
        }
        return ClusterMap(self.map_version, self.n_slots, self.slot_map, parts)

    def status(self, now: float, last_seen: dict[str, float | None]) -> dict[str, Any]:
        """A plain-data report for ``zps-server status``."""

        def age(node_id: str) -> float | None:
            seen = last_seen.get(node_id)
            return None if seen is None else round(now - seen, 3)

        partitions: list[dict[str, Any]] = []
        for p, part in enumerate(self._parts):
            primary = self.shards.get(part.primary) if part.primary else None
            partitions.append(
                {
                    "partition": p,
                    "epoch": part.epoch,
                    "state": "ok" if primary else ("lost" if part.lost else "unassigned"),
                    "primary": part.primary,
                    "lsn": primary.lsn if primary else None,
                    "replicas": [],
                }
            )
        shards = [
            {
                "node": n.node_id,
                "host": n.host,
                "pid": n.pid,
                "address": n.address,
                "role": n.role.value,
                "partition": n.partition,
                "epoch": n.epoch,
                "lsn": n.lsn,
                "last_seen_s": age(n.node_id),
                "stats": n.stats,
            }
            for n in sorted(
                self.shards.values(), key=lambda n: (n.partition is None, n.partition, n.node_id)
            )
        ]
        clients = [
            {
                "node": c.node_id,
                "host": c.host,
                "pid": c.pid,
                "name": c.name,
                "last_seen_s": age(c.node_id),
            }
            for c in sorted(self.clients.values(), key=lambda c: c.node_id)
        ]
        return {
            "map_version": self.map_version,
            "n_partitions": self.n_partitions,
            "n_slots": self.n_slots,
            "partitions": partitions,
            "shards": shards,
            "clients": clients,
        }
