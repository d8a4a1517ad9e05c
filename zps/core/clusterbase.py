"""The broker's cluster state and what each rule of :mod:`zps.core.cluster` does to it:
promotions, losses, the placement of copies, the map published after every change, and the
queries the broker's parts make.  :class:`zps.core.cluster.ClusterState` adds the events
(registrations, reports, deaths, time) and commands (operator, resharding) that decide when.

No I/O and no clock.
"""

from __future__ import annotations

from typing import Any

from zps.core import cluster_map, cluster_status, placement, recovery
from zps.core.nodes import Assignment, Claim, ClientNode, Partition, ShardNode
from zps.core.routing import ClusterMap, RouterInfo, default_slot_map
from zps.protocol.messages import Role


class ClusterBase:
    """The state and its changes; the rules are :mod:`zps.core.cluster`'s."""

    def __init__(
        self,
        n_partitions: int,
        n_slots: int,
        *,
        replication: int,
        hold_until: float,
        incarnation: str,
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
        self.stale = False  # the record restored is stale (ClusterState.record_stale)
        self.incarnation = incarnation
        self.slot_map = default_slot_map(n_slots, n_partitions)
        self.shards: dict[str, ShardNode] = {}
        self.clients: dict[str, ClientNode] = {}
        #: Routing brokers (``zps-server broker --follow``), as clients; see ``routers_of``.
        self.routers: dict[str, RouterInfo] = {}
        self._parts = [Partition() for _ in range(n_partitions)]
        #: The highest epoch each partition number reached before it was removed
        #: (scaling down), kept for good: made again, a partition's first epoch is past
        #: it (see ``_fresh``).
        self.retired_epochs: dict[int, int] = {}
        self.map_version = 0
        self.failovers = 0
        #: (level, message) for the driver to log: "error" for what an operator must see.
        self.notices: list[tuple[str, str]] = []
        #: Shards an operator drained: given no role until undrained (kept by name, so
        #: across a restart of the shard; not across one of the broker).
        self.drained: set[str] = set()
        #: How long a primary's lease runs past the heartbeat it renews (the driver sets
        #: it from its heartbeat settings).
        self.lease = 0.8
        self.map = self._build_map()

    def _resize(self, n: int) -> None:
        for p in range(n, len(self._parts)):  # removed: made again, it starts past this
            if self._parts[p].epoch > 0:
                self.retired_epochs[p] = max(self.retired_epochs.get(p, 0), self._parts[p].epoch)
        while len(self._parts) < n:
            self._parts.append(Partition())
        del self._parts[n:]
        self.n_partitions = n

    # -- queries ---------------------------------------------------------------

    def primary_of(self, partition: int) -> str | None:
        if 0 <= partition < self.n_partitions:
            return self._parts[partition].primary
        return None

    def floor_of(self, partition: int) -> tuple[int, int]:
        """The (epoch, LSN) a copy must reach to be trusted with ``partition``."""
        return self._parts[partition].floor

    def is_lost(self, partition: int) -> bool:
        return self._parts[partition].lost

    def stopped(self, partition: int) -> bool:
        """Lost because its last copy was stopped on purpose (no error)."""
        part = self._parts[partition]
        return part.lost and part.stopped

    def handing_over(self, partition: int) -> str | None:
        """The newer copy ``partition`` is being handed to (rule 8): the map names no
        primary meanwhile."""
        return self._parts[partition].contender

    def origin_of(self, partition: int) -> tuple[int, int]:
        """The (epoch, LSN) of the copy the serving primary was granted from."""
        return self._parts[partition].origin

    def members_of(self, partition: int) -> tuple[str, ...]:
        """The copies holding every acknowledged write of ``partition`` (rule 4)."""
        return self._parts[partition].members

    def lease_echo(self, node_id: str) -> tuple[Role, int | None, int]:
        """The role, partition and epoch a lease echo to ``node_id`` renews: nothing
        it holds while it is fenced (rule 8)."""
        node = self.shards[node_id]
        if node.fenced:
            return Role.SPARE, None, 0
        return node.role, node.partition, node.epoch

    def holding(self, now: float) -> bool:
        return now < self.hold_until

    def claims_in(self, now: float) -> bool:
        """Whether the start-up hold may end now (:func:`recovery.claims_in`)."""
        return self.holding(now) and recovery.claims_in(self._parts, self.shards, self.stale)

    def partition_state(self, partition: int, now: float) -> str:
        """See :func:`zps.core.cluster_status.partition_state`."""
        return cluster_status.partition_state(
            self._parts[partition], self.shards, self.replication, self.holding(now)
        )

    def assignment_of(self, node_id: str) -> Assignment | None:
        return self._assignment(node_id) if node_id in self.shards else None

    def _assignment(self, node_id: str) -> Assignment:
        node = self.shards[node_id]
        if node.role is Role.REPLICA and node.partition is not None:
            primary = self._parts[node.partition].primary
            address = self.shards[primary].address if primary in self.shards else ""
            return Assignment(node_id, node.role, node.partition, node.epoch, primary, address)
        return Assignment(node_id, node.role, node.partition, node.epoch)

    # -- changes of role -------------------------------------------------------

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

    def _failover(self, p: int, *, stopped: str | None = None) -> list[Assignment]:
        """Promote the best in-sync replica of ``p``; with none it is lost (``stopped``:
        its last copy was stopped on purpose, which is no error)."""
        part = self._parts[p]
        part.primary = None
        best = recovery.elect(part, self.shards)
        if best is None:
            self._lose(p, stopped=stopped)
            recovery.hold_copies(p, part, self.shards)  # never spares: no assignment
            self._publish()
            return []
        part.replicas.remove(best)
        self.failovers += 1
        out = self._make_primary(self.shards[best], p, part.epoch + 1, keep_origin=True)
        # The others may hold writes the new primary lacks (or lack ones it has): they
        # resynchronise from it at the new epoch.
        part.in_sync = set()
        for r in part.replicas:
            self.shards[r].epoch = part.epoch
            out.append(self._assignment(r))
        self._publish()
        return out

    def _lose(self, p: int, *, stopped: str | None = None) -> None:
        part = self._parts[p]
        if part.lost:
            return
        part.lost, part.stopped = True, stopped is not None
        level = "error" if stopped is None else "warning"
        self.notices.append((level, recovery.lost(p, part, stopped)))

    def _make_primary(
        self,
        node: ShardNode,
        partition: int,
        epoch: int,
        claim: Claim | None = None,
        *,
        keep_origin: bool = False,
    ) -> list[Assignment]:
        """``node`` serves ``partition`` at ``epoch``, from its claimed copy (else from
        what it holds; ``keep_origin``: a promoted in-sync replica, which holds what
        its primary's line holds)."""
        part = self._parts[partition]
        if claim is not None:
            part.seen.add((claim.epoch, node.node_id))
        if not keep_origin:
            part.origin = (claim.epoch, claim.lsn) if claim else (0, 0)
            # Without a claim the copy starts from nothing: the LSN the broker last heard
            # from the shard is of a role it left (a spare's old partition), not of this one.
            part.granted_lsn = node.lsn if claim is not None else 0
        if node.node_id in part.replicas:
            part.replicas.remove(node.node_id)
        part.in_sync.discard(node.node_id)
        part.primary, part.lost, part.released = node.node_id, False, False
        self._raise_epoch(partition, epoch)
        part.epoch = epoch
        node.role, node.partition, node.epoch = Role.PRIMARY, partition, epoch
        node.held = None
        self._publish()
        out = [Assignment(node.node_id, Role.PRIMARY, partition, epoch)]
        # Replicas that were waiting for a primary (after a restart) follow it now.
        out += [self._assignment(r) for r in part.replicas]
        # Older copies kept in case an operator wanted them: no longer needed.  A newer one is
        # kept (rule 8: it is compared once the partition serves).
        for other in self.shards.values():
            held = other.held
            if held is None or held.partition != partition or other is node:
                continue
            if (held.epoch, held.lsn) <= part.origin or part.released:
                other.held = None
                out.append(Assignment(other.node_id, Role.SPARE, None, 0))
        return out

    def _held(self, p: int) -> bool:
        return any(n.held is not None and n.held.partition == p for n in self.shards.values())

    def _spares(self) -> list[ShardNode]:
        free = [n for n in self.shards.values() if n.role is Role.SPARE and n.held is None]
        free = [n for n in free if n.node_id not in self.drained]
        return sorted(free, key=lambda n: (n.registered_at, n.node_id))

    def _copies(self, p: int) -> list[ShardNode]:
        part = self._parts[p]
        return [self.shards[n] for n in (part.primary, *part.replicas) if n in self.shards]

    def _fill(self, now: float) -> list[Assignment]:
        """Give empty partitions a primary and short ones replicas, from the spares."""
        if self.holding(now):
            return []
        out: list[Assignment] = []
        for p, part in enumerate(self._parts):
            if part.primary is None and not part.lost:
                if part.replicas:  # after a restart or a death in the hold: promote
                    out += self._failover(p)
                elif part.released:  # an operator accepted the loss
                    out += self._take_over(p)
                elif part.epoch > 0 or self._held(p):  # it held data, no copy serves
                    self._lose(p)
                    self._publish()
                elif spares := self._spares():
                    out += self._fresh(spares[0], p)
        out += self._place_replicas(self._spares())
        return out

    def retired(self, p: int) -> int:
        """The highest epoch an earlier, removed partition ``p`` reached (0: none): a
        claim of ``p`` at that epoch or below is a copy of the removed one."""
        return self.retired_epochs.get(p, 0)

    def _fresh(self, node: ShardNode, p: int) -> list[Assignment]:
        """``node`` (a spare) serves partition ``p``, which never held data, from
        nothing.  A partition removed (scaling down) and made again starts past every
        epoch its earlier incarnation reached, its line's origin with it: a copy of
        that incarnation (its rows all moved away before it went) then claims an older
        history, never a newer one (rule 8), and becomes a spare instead of contending
        for the new one."""
        retired = self.retired_epochs.get(p)
        if retired is None:
            return self._make_primary(node, p, 1)
        out = self._make_primary(node, p, retired + 1)
        self._parts[p].origin = (retired + 1, 0)
        return out

    def _place_replicas(self, spares: list[ShardNode]) -> list[Assignment]:
        """Fill short replica sets from ``spares``, copies on distinct hosts (zones)
        where the spares allow: the partition with the fewest good choices first,
        each taking the good spare the other partitions want least."""
        out: list[Assignment] = []
        while spares:
            short = [
                p
                for p, part in enumerate(self._parts)
                if part.primary is not None and len(part.replicas) < self.replication - 1
            ]
            if not short:
                break
            p, node = placement.pick_replica({p: self._copies(p) for p in short}, spares)
            spares.remove(node)
            out.append(self._add_replica(node, p))
        return out

    def _add_replica(self, node: ShardNode, p: int) -> Assignment:
        part = self._parts[p]
        node.role, node.partition, node.epoch = Role.REPLICA, p, part.epoch
        part.replicas.append(node.node_id)
        self._publish()
        return self._assignment(node.node_id)

    def _rebalance(self) -> list[Assignment]:
        """Move copies that share a host (zone) to a spare elsewhere: the spare
        becomes an extra replica; the clashing one leaves once the spare is in sync."""
        out: list[Assignment] = []
        for p, part in enumerate(self._parts):
            if part.primary is None or part.primary not in self.shards:
                continue
            for r in list(part.replicas):
                copies = {c.node_id: c for c in self._copies(p)}
                extra = len(part.replicas) > self.replication - 1
                step = placement.rebalance_step(
                    r, copies, extra, sorted(part.in_sync), self.replication - 1, self._spares()
                )
                if step is None:
                    continue
                if step[1] is None:
                    # The extra replica added for this is in sync: the clashing one leaves.
                    part.replicas.remove(r)
                    part.in_sync.discard(r)
                    self._publish()
                    out += self._demote(r, p)
                else:
                    out.append(self._add_replica(step[1], p))
        return out

    def _take_over(self, p: int) -> list[Assignment]:
        """A released partition goes to its newest held copy, else to a spare."""
        part = self._parts[p]
        held = [
            (n.held.epoch, n.held.lsn, n.node_id)
            for n in self.shards.values()
            if n.held is not None and n.held.partition == p
        ]
        if held:
            node = self.shards[max(held)[2]]
            assert node.held is not None
            epoch = max(part.epoch + 1, node.held.epoch)
            return self._make_primary(node, p, epoch, node.held)
        if spares := self._spares():
            return self._make_primary(spares[0], p, max(part.epoch, self.retired(p)) + 1)
        return []  # the first spare to register takes it

    def _publish(self) -> None:
        for part in self._parts:
            part.refresh_members()
            for n in (part.primary, *part.replicas):
                if n is not None and n in self.shards:
                    part.seen.add((self.shards[n].epoch, n))
        self.map_version += 1
        self.map = self._build_map()

    def _build_map(self) -> ClusterMap:
        return cluster_map.build_map(
            self._parts,
            self.shards,
            self.routers,
            holding=self._holding,
            version=self.map_version,
            n_slots=self.n_slots,
            slot_map=self.slot_map,
            incarnation=self.incarnation,
        )

    def status(self, now: float, last_seen: dict[str, float | None]) -> dict[str, Any]:
        """A plain-data report for ``zps-server status``."""
        return cluster_status.report(
            self._parts,
            self.shards,
            self.clients,
            now=now,
            last_seen=last_seen,
            states=[self.partition_state(p, now) for p in range(self.n_partitions)],
            slots=[int((self.slot_map == p).sum()) for p in range(self.n_partitions)],
            drained=self.drained,
            header={
                "map_version": self.map_version,
                "incarnation": self.incarnation,
                "n_partitions": self.n_partitions,
                "replication": self.replication,
                "n_slots": self.n_slots,
                "failovers": self.failovers,
            },
        )

    def placement_warning(self, p: int) -> str | None:
        """Copies of ``p`` sharing a host (or a zone), or None."""
        return placement.warning(self._copies(p))
