"""The broker's state machine: nodes, roles, replicas and the cluster map.

Rules:

1. Every change of who serves a partition bumps that partition's epoch when a
   *different* shard becomes primary; the map version bumps on any change and
   the map is only ever replaced, never edited in place.
2. A registering shard first gets back what it claims (after a broker restart
   the shards rebuild the map), else fills a partition without a primary, else
   a partition short of replicas, else waits as a spare.
3. After a broker (re)start, for ``hold`` seconds only claims are granted:
   every surviving shard gets the chance to reclaim its role before anything
   is promoted or handed to an empty shard.
4. When a primary dies, the in-sync replica with the highest reported LSN is
   promoted at epoch + 1; the other replicas must catch up again from it.
   With no in-sync replica the partition is *lost*: it is never handed to a
   fresh, empty shard (that would silently reset its values).
5. The in-sync set of a partition comes from its primary's reports (it sees
   the acknowledgements) and shrinks when the broker loses a replica.
6. Never two primaries for one partition.

No I/O and no clock: the broker driver calls these methods with ``now`` and
sends what they return.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from zps.core.routing import DEFAULT_SLOTS, ClusterMap, PartitionInfo, default_slot_map
from zps.protocol.messages import Role


@dataclass(frozen=True)
class Claim:
    """What a shard says it already serves when it (re)registers."""

    partition: int
    epoch: int
    role: Role
    lsn: int = 0
    in_sync: bool = False


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
    """Tell ``node_id`` its role; a replica also learns whom to follow."""

    node_id: str
    role: Role
    partition: int | None
    epoch: int
    primary: str | None = None
    primary_address: str = ""


@dataclass
class _Partition:
    epoch: int = 0
    primary: str | None = None
    replicas: list[str] = field(default_factory=list)
    in_sync: set[str] = field(default_factory=set)
    lost: bool = False


class ClusterState:
    """What the broker knows; see the module rules."""

    def __init__(
        self,
        n_partitions: int,
        n_slots: int = DEFAULT_SLOTS,
        *,
        replication: int = 1,
        hold_until: float = 0.0,
    ) -> None:
        if n_partitions < 1:
            raise ValueError("a cluster needs at least one partition")
        if n_slots < n_partitions:
            raise ValueError("n_slots must be >= the number of partitions")
        if replication < 1:
            raise ValueError("replication must be >= 1 (1 = no replicas)")
        self.n_partitions = n_partitions
        self.n_slots = n_slots
        self.replication = replication
        self.hold_until = hold_until
        self._holding = hold_until > 0
        self.incarnation = uuid.uuid4().hex[:12]
        self.slot_map = default_slot_map(n_slots, n_partitions)
        self.shards: dict[str, ShardNode] = {}
        self.clients: dict[str, ClientNode] = {}
        self._parts = [_Partition() for _ in range(n_partitions)]
        self.map_version = 0
        self.failovers = 0
        self.map = self._build_map()

    # -- queries -------------------------------------------------------------

    def primary_of(self, partition: int) -> str | None:
        if 0 <= partition < self.n_partitions:
            return self._parts[partition].primary
        return None

    def is_lost(self, partition: int) -> bool:
        return self._parts[partition].lost

    def holding(self, now: float) -> bool:
        return now < self.hold_until

    def assignment_of(self, node_id: str) -> Assignment | None:
        return self._assignment(node_id) if node_id in self.shards else None

    def _assignment(self, node_id: str) -> Assignment:
        node = self.shards[node_id]
        if node.role is Role.REPLICA and node.partition is not None:
            primary = self._parts[node.partition].primary
            address = self.shards[primary].address if primary in self.shards else ""
            return Assignment(node_id, node.role, node.partition, node.epoch, primary, address)
        return Assignment(node_id, node.role, node.partition, node.epoch)

    # -- events --------------------------------------------------------------

    def register_shard(
        self,
        node_id: str,
        *,
        host: str,
        pid: int,
        address: str,
        now: float,
        claim: Claim | None = None,
    ) -> list[Assignment]:
        """A shard (re)joins; returns the assignments to send (its own among them)."""
        old = self.shards.get(node_id)
        if old is not None:  # it re-sent REGISTER: tell it again what it is
            old.host, old.pid, old.address = host, pid, address
            return [self._assignment(node_id)]
        node = ShardNode(node_id, host, pid, address, now)
        self.shards[node_id] = node
        out: list[Assignment] = []
        if claim is not None and 0 <= claim.partition < self.n_partitions:
            out += self._grant(node, claim, now)
        if node.role is Role.SPARE:
            out.append(Assignment(node_id, Role.SPARE, None, 0))
        return _merge(out + self._fill(now))

    def _grant(self, node: ShardNode, claim: Claim, now: float) -> list[Assignment]:
        part = self._parts[claim.partition]
        node.lsn = claim.lsn
        if claim.role is Role.PRIMARY:
            out: list[Assignment] = []
            current = self.shards.get(part.primary) if part.primary else None
            if (
                current is not None
                and self.holding(now)
                and (claim.epoch, claim.lsn) > (current.epoch, current.lsn)
            ):
                # A newer copy than the one granted earlier in the hold (a later
                # epoch, or the same epoch and more updates): it wins.
                out = self._demote(current.node_id, claim.partition)
                part.primary = None
            if part.primary is None and claim.epoch >= part.epoch:
                return out + self._make_primary(node, claim.partition, claim.epoch)
            return out
        if (
            claim.role is Role.REPLICA
            and not part.lost
            and claim.epoch >= part.epoch
            and (part.primary is None or claim.epoch == part.epoch)
            and (len(part.replicas) < self.replication - 1)
        ):
            raised = self._raise_epoch(claim.partition, claim.epoch)
            node.role, node.partition, node.epoch = Role.REPLICA, claim.partition, claim.epoch
            part.replicas.append(node.node_id)
            if claim.in_sync and self.holding(now):
                # After a restart only the replica itself can say it was in sync.
                part.in_sync.add(node.node_id)
            self._publish()
            return [*raised, self._assignment(node.node_id)]
        return []

    def _raise_epoch(self, partition: int, epoch: int) -> list[Assignment]:
        """The partition moves to ``epoch``: replicas of older epochs must resync."""
        part = self._parts[partition]
        part.epoch = max(part.epoch, epoch)
        out = []
        for r in part.replicas:
            node = self.shards[r]
            if node.epoch < part.epoch:
                node.epoch = part.epoch
                part.in_sync.discard(r)
                out.append(self._assignment(r))
        return out

    def _demote(self, node_id: str, partition: int) -> list[Assignment]:
        node = self.shards[node_id]
        node.role, node.partition, node.epoch = Role.SPARE, None, 0
        return [Assignment(node_id, Role.SPARE, None, 0)]

    def register_client(self, node_id: str, *, host: str, pid: int, name: str, now: float) -> None:
        self.clients[node_id] = ClientNode(node_id, host, pid, name, now)

    def report(
        self,
        node_id: str,
        *,
        lsn: int,
        stats: dict[str, Any] | None = None,
        epoch: int | None = None,
        in_sync: list[str] | None = None,
    ) -> bool:
        """A shard's heartbeat; a primary also reports its in-sync replicas.

        Returns True when the map changed.
        """
        node = self.shards.get(node_id)
        if node is None:
            return False
        node.lsn = lsn
        if stats is not None:
            node.stats = stats
        if (
            in_sync is None
            or node.role is not Role.PRIMARY
            or node.partition is None
            or epoch != node.epoch
        ):
            return False
        part = self._parts[node.partition]
        reported = {r for r in in_sync if r in part.replicas}
        if reported == part.in_sync:
            return False
        part.in_sync = reported
        self._publish()
        return True

    def node_gone(self, node_id: str, now: float = 0.0) -> list[Assignment]:
        """A node died or left; returns the assignments that follow (promotions)."""
        self.clients.pop(node_id, None)
        node = self.shards.pop(node_id, None)
        if node is None or node.partition is None:
            return self._fill(now) if node is not None else []
        part = self._parts[node.partition]
        out: list[Assignment] = []
        if part.primary == node_id and self.holding(now):
            part.primary = None  # decided when the hold ends: a replica may still claim
            self._publish()
            out += [self._assignment(r) for r in part.replicas]
        elif part.primary == node_id:
            out += self._failover(node.partition)
        elif node_id in part.replicas:
            part.replicas.remove(node_id)
            part.in_sync.discard(node_id)
            self._publish()
        return _merge(out + self._fill(now))

    def tick(self, now: float) -> list[Assignment]:
        """Time passes: ends the start-up hold (then fills what is still empty)."""
        if self._holding and not self.holding(now):
            self._holding = False
            return _merge(self._fill(now))
        return []

    # -- internals -----------------------------------------------------------

    def _failover(self, p: int) -> list[Assignment]:
        part = self._parts[p]
        part.primary = None
        candidates = [r for r in part.replicas if r in part.in_sync and r in self.shards]
        if not candidates:
            part.lost = True
            out = [a for r in list(part.replicas) for a in self._demote(r, p)]
            part.replicas, part.in_sync = [], set()
            self._publish()
            return out
        best = max(candidates, key=lambda r: (self.shards[r].lsn, r))
        part.replicas.remove(best)
        self.failovers += 1
        out = self._make_primary(self.shards[best], p, part.epoch + 1)
        # The others may hold writes the new primary lacks (or lack ones it has):
        # they resynchronise from it at the new epoch.
        part.in_sync = set()
        for r in part.replicas:
            self.shards[r].epoch = part.epoch
            out.append(self._assignment(r))
        self._publish()
        return out

    def _make_primary(self, node: ShardNode, partition: int, epoch: int) -> list[Assignment]:
        part = self._parts[partition]
        if node.node_id in part.replicas:
            part.replicas.remove(node.node_id)
        part.in_sync.discard(node.node_id)
        part.primary, part.lost = node.node_id, False
        self._raise_epoch(partition, epoch)
        part.epoch = epoch
        node.role, node.partition, node.epoch = Role.PRIMARY, partition, epoch
        self._publish()
        out = [Assignment(node.node_id, Role.PRIMARY, partition, epoch)]
        # Replicas that were waiting for a primary (after a restart) follow it now.
        out += [self._assignment(r) for r in part.replicas]
        return out

    def _spares(self) -> list[ShardNode]:
        return sorted(
            (n for n in self.shards.values() if n.role is Role.SPARE),
            key=lambda n: (n.registered_at, n.node_id),
        )

    def _fill(self, now: float) -> list[Assignment]:
        """Give empty partitions a primary and short ones replicas, from the spares."""
        if self.holding(now):
            return []
        out: list[Assignment] = []
        for p, part in enumerate(self._parts):
            if part.primary is None and not part.lost:
                if part.replicas:  # after a restart or a death in the hold: promote
                    out += self._failover(p)
                elif part.epoch > 0:  # it held data and no copy is left
                    part.lost = True
                    self._publish()
                elif spares := self._spares():
                    out += self._make_primary(spares[0], p, 1)
        spares = self._spares()
        for p, part in enumerate(self._parts):
            while part.primary is not None and len(part.replicas) < self.replication - 1 and spares:
                node = spares.pop(0)
                node.role, node.partition, node.epoch = Role.REPLICA, p, part.epoch
                part.replicas.append(node.node_id)
                self._publish()
                out.append(self._assignment(node.node_id))
        return out

    def _publish(self) -> None:
        self.map_version += 1
        self.map = self._build_map()

    def _build_map(self) -> ClusterMap:
        parts = {
            p: PartitionInfo(
                epoch=part.epoch,
                primary=part.primary,
                replicas=tuple(part.replicas),
                in_sync=tuple(sorted(part.in_sync)),
                lost=part.lost,
            )
            for p, part in enumerate(self._parts)
        }
        return ClusterMap(self.map_version, self.n_slots, self.slot_map, parts, self.incarnation)

    def status(self, now: float, last_seen: dict[str, float | None]) -> dict[str, Any]:
        """A plain-data report for ``zps-server status``."""

        def age(node_id: str) -> float | None:
            seen = last_seen.get(node_id)
            return None if seen is None else round(now - seen, 3)

        partitions: list[dict[str, Any]] = []
        for p, part in enumerate(self._parts):
            primary = self.shards.get(part.primary) if part.primary else None
            head = primary.lsn if primary else None
            replicas = []
            for r in part.replicas:
                rnode = self.shards.get(r)
                lsn = rnode.lsn if rnode else None
                replicas.append(
                    {
                        "node": r,
                        "in_sync": r in part.in_sync,
                        "lsn": lsn,
                        "lag": None if head is None or lsn is None else max(0, head - lsn),
                    }
                )
            state = (
                "ok"
                if primary
                else "lost"
                if part.lost
                else "holding"
                if self.holding(now)
                else "unassigned"
            )
            if primary and len(part.in_sync) < self.replication - 1:
                state = "degraded"
            partitions.append(
                {
                    "partition": p,
                    "epoch": part.epoch,
                    "state": state,
                    "primary": part.primary,
                    "lsn": head,
                    "replicas": replicas,
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
                self.shards.values(),
                key=lambda n: (
                    n.partition is None,
                    n.partition or 0,
                    n.role != Role.PRIMARY,
                    n.node_id,
                ),
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
            "incarnation": self.incarnation,
            "n_partitions": self.n_partitions,
            "replication": self.replication,
            "n_slots": self.n_slots,
            "failovers": self.failovers,
            "partitions": partitions,
            "shards": shards,
            "clients": clients,
        }


def _merge(assignments: list[Assignment]) -> list[Assignment]:
    """The last assignment per node wins (one message each)."""
    last: dict[str, Assignment] = {}
    for a in assignments:
        last.pop(a.node_id, None)
        last[a.node_id] = a
    return list(last.values())
