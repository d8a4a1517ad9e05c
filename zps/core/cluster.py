"""The broker's state machine: nodes, roles, replicas and the cluster map.

Rules:

1. Every change of who serves a partition bumps that partition's epoch when a *different* shard
   becomes primary; the map version bumps on any change and the map is only ever replaced, never
   edited in place.
2. A registering shard first gets back what it claims (after a broker restart the shards rebuild
   the map), else fills a partition without a primary, else a partition short of replicas, else
   waits as a spare.  A shard an operator drained gets nothing, claim or not, until undrained;
   its copy of a lost partition is held, as a claim not taken is, so an operator's
   `reset-partition` may still give it that partition rather than lose its data.
3. After a broker (re)start, for ``hold`` seconds only claims are granted: every surviving shard
   gets the chance to reclaim its role before anything is promoted or handed to an empty shard.
   The driver ends it early once every copy the record names is back (:meth:`claims_in`).
4. When a primary dies, the in-sync replica with the highest reported LSN is promoted at the
   next epoch; the other replicas must catch up again from it. With no in-sync replica the
   partition is *lost*: it is never handed to a fresh, empty shard (that would silently reset
   its values), nor to a copy older than its *floor*, the newest (epoch, LSN) a primary
   confirmed by heartbeat, nor to a copy outside its last in-sync set (*members*: the primary
   and the replicas it counted, which hold every acknowledged write), nor to a copy that says it
   may lack acknowledged writes (``complete`` false); only :meth:`ClusterState.reset_partition`
   (an operator accepting the loss) lifts that, with the newest copy held: a lost partition's
   replicas keep their copies, held like a claim not taken, never made spares.  Floors, epochs
   and members survive a broker restart (:meth:`ClusterState.records` / ``restore``); the
   driver publishes a map only once the record holding it is durable, so a replica leaves the
   recorded set before its primary acknowledges a write without it.
5. The in-sync set of a partition comes from its primary's reports (it sees the
   acknowledgements) and shrinks when the broker loses a replica.  During the start-up hold (no
   write is routed) it also takes the copies that say so themselves: a replica that was in sync
   (:func:`zps.core.recovery.says_in_sync`) and a copy that could have been granted the partition
   (:func:`zps.core.recovery.vouches`) following the one granted at its epoch; a report drops no
   member of the broker's record then.
6. Never two primaries for one partition.
7. Never two copies of a partition on one host (or one zone) while a spare elsewhere could hold
   one; a copy placed together for want of a spare is moved when one turns up (a well-placed
   replica is added first and the other dropped once it is in sync); ``status`` warns.
8. A copy that registers with a newer history (epoch, LSN) than the one the serving primary's
   line was granted from (a claim, or nothing; a failover keeps it), of an epoch this broker
   never gave that shard, while the partition has no recorded in-sync set (whose members hold
   every acknowledged write: a newer member only holds unacknowledged ones), takes the partition
   over only if that primary took no write since: the primary is first *fenced* (the map names
   no primary, its lease is no longer renewed) until a heartbeat it sent after its lease ran out
   shows its final LSN.  If it took writes, both histories hold writes the other lacks: neither
   is overwritten (the newer copy is held) and an error names both copies and the operator's
   choices.  A partition with a held copy is never handed to an empty shard.  A partition
   removed by scaling down and made again is granted the epoch after the highest its removed
   incarnation reached (kept in the record), so a copy of the removed one claims an older
   history, never a newer one.
9. A broker that restored no record, or a record found stale, takes the slot map, and the
   partition count, from the slots the shards claim during the hold; one without a record
   also finishes the moves the claims show under way (:mod:`zps.core.slotclaims`).

No I/O and no clock: the broker driver calls these methods with ``now``, sends what they return.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.core import cluster_map, recovery
from zps.core.brokerstate import PartitionRecord
from zps.core.clusterbase import ClusterBase
from zps.core.nodes import Assignment, Claim, ClientNode, ShardNode, merge
from zps.core.routing import DEFAULT_SLOTS, RouterInfo
from zps.core.slotclaims import Orphan, SlotClaims
from zps.protocol.messages import Role

__all__ = ["Assignment", "Claim", "ClientNode", "ClusterState", "ShardNode"]


class ClusterState(ClusterBase):
    """What the broker knows; see the module rules."""

    def __init__(
        self,
        n_partitions: int,
        n_slots: int = DEFAULT_SLOTS,
        *,
        replication: int = 1,
        hold_until: float = 0.0,
    ) -> None:
        super().__init__(
            n_partitions,
            n_slots,
            replication=replication,
            hold_until=hold_until,
            incarnation=uuid.uuid4().hex[:12],
        )
        #: The slots claimed in the hold, while no record was restored (rule 9).
        self.slot_claims: SlotClaims | None = SlotClaims(n_slots, n_partitions)
        self._recorded_version = 0
        self._orphans: list[Orphan] | None = None

    # -- what survives a restart -----------------------------------------------

    def records(self) -> tuple[PartitionRecord, ...]:
        """Each partition's epoch, floor and hosts, for the broker's state record."""
        return cluster_map.records(self._parts, self.shards)

    def restore(
        self,
        map_version: int,
        partitions: tuple[PartitionRecord, ...],
        slot_map: npt.NDArray[np.int32] | None = None,
        retired: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Take over what a previous broker recorded (before any shard registers).

        A partition that held data keeps its epoch and floor: after the start-up
        hold it is lost unless a copy at least as new as its floor came back.  A
        recorded ``slot_map`` (live resharding) brings its partition count with it,
        and ``retired`` the epochs partitions removed meanwhile had reached.
        """
        for p, epoch in retired:
            self.retired_epochs[p] = max(self.retired_epochs.get(p, 0), epoch)
        self.slot_claims = None  # the record's map counts, not the shards' (rule 9)
        self._recorded_version = map_version
        if slot_map is not None:
            if slot_map.shape != (self.n_slots,):
                raise ValueError(f"the recorded slot map is not of {self.n_slots} slots")
            self.slot_map = slot_map.astype(np.int32)
            self._resize(len(partitions))
        if len(partitions) != self.n_partitions:
            raise ValueError(
                f"the recorded state has {len(partitions)} partitions, this broker "
                f"{self.n_partitions}"
            )
        cluster_map.restore(self._parts, partitions)
        for part in self._parts:
            part.recorded = part.members
        self.map_version = max(self.map_version, map_version)
        self._publish()

    def record_stale(self) -> None:
        """The record restored is older than a term some shard obeyed (recovery.unpin);
        the slots claimed in the hold newer than its map count (rule 9)."""
        self.stale = True
        recovery.unpin(self._parts)
        if self.slot_claims is None:
            self.slot_claims = SlotClaims(
                self.n_slots, self.n_partitions, base=self.slot_map, floor=self._recorded_version
            )
            for node in self.shards.values():  # claims taken before it was found stale
                if node.claimed is not None:
                    self._learn_slots(node.node_id, node.claimed)

    # -- live resharding (zps/broker/reshard.py drives it) ---------------------

    def spare_count(self) -> int:
        return len(self._spares())

    def grow(self, n: int, now: float) -> list[Assignment]:
        """Add empty partitions up to ``n`` (they hold no slot until moves give them
        some); spares become their primaries (and replicas) as for any empty one."""
        if n <= self.n_partitions:
            return []
        self._resize(n)
        self._publish()
        return merge(self._fill(now))

    def shrink(self, n: int) -> list[Assignment]:
        """Remove the partitions from ``n`` up, which must hold no slot: their shards
        become spares."""
        if n >= self.n_partitions:
            return []
        if int(self.slot_map.max()) >= n:
            raise ValueError(f"partitions {n} and up still hold slots")
        out: list[Assignment] = []
        for p in range(n, self.n_partitions):
            part = self._parts[p]
            for node in [part.primary, *part.replicas]:
                if node is not None and node in self.shards:
                    out += self._demote(node, p)
        self._resize(n)
        self._publish()
        return merge(out)

    def move_slots(self, slots: Sequence[int], dest: int) -> None:
        """The cut-over of a move: ``slots`` belong to ``dest`` from the next map."""
        if not 0 <= dest < self.n_partitions:
            raise ValueError(f"no partition {dest}")
        new = self.slot_map.copy()
        new[np.asarray(slots, dtype=np.int64)] = dest
        self.slot_map = new
        self._publish()

    # -- events ----------------------------------------------------------------

    def register_shard(
        self,
        node_id: str,
        *,
        host: str,
        pid: int,
        address: str,
        now: float,
        claim: Claim | None = None,
        zone: str = "",
        refused: tuple[int, int] | None = None,
    ) -> list[Assignment]:
        """A shard (re)joins; returns the assignments to send (its own among them).

        ``refused``: the primary's role (partition, epoch) it refused, having let that
        partition's data go since the claim it was granted on (another broker's
        assignment in flight made it a spare): if that is still its role here, it is
        gone for that partition (its replicas may take over), and joins as what it
        holds now.  A REGISTER without it sent again changes nothing."""
        old = self.shards.get(node_id)
        gone: list[Assignment] = []
        if (
            refused is not None
            and old is not None
            and old.held is None
            and old.role is Role.PRIMARY
            and (old.partition, old.epoch) == refused
        ):
            gone = self.node_gone(node_id, now)
            old = None
        if old is not None:  # it re-sent REGISTER: tell it again what it is
            old.host, old.pid, old.address, old.zone = host, pid, address, zone
            return [] if old.held is not None else [self._assignment(node_id)]
        node = ShardNode(node_id, host, pid, address, now, zone=zone)
        self.shards[node_id] = node
        if claim is not None and claim.slots is not None:
            node.claimed = claim
            if self.holding(now):
                self._learn_slots(node_id, claim)
                if self.slot_claims is not None and self.slot_claims.base is None:
                    self.slot_claims.note_moves(claim.partition, claim.fenced, claim.importing)
        out: list[Assignment] = []
        if (
            claim is not None
            and 0 <= claim.partition < self.n_partitions
            and claim.epoch > self.retired(claim.partition)
        ):
            # (A claim at or below a removed partition's epochs is a copy of that one,
            # whose rows all moved away before it went: a spare.)
            if node_id not in self.drained:
                out += self._grant(node, claim, now)
            elif self._parts[claim.partition].lost:
                node.held = claim  # a drained copy gets no role, but is never dropped
        if node.role is Role.SPARE and node.held is None:
            out.append(Assignment(node_id, Role.SPARE, None, 0))
        return merge(gone + out + self._fill(now))

    def _grant(self, node: ShardNode, claim: Claim, now: float) -> list[Assignment]:
        part = self._parts[claim.partition]
        node.lsn = claim.lsn
        vouched = False
        if claim.role is Role.PRIMARY:
            epoch = recovery.claim_epoch(part, claim)
            why_not = self._distrust(part, claim, node.node_id, self.holding(now), self.stale)
            current = self.shards.get(part.primary) if part.primary else None
            newer = current is not None and recovery.unseen_newer(part, claim, node.node_id)
            if why_not is None and current is not None and newer:
                if self.holding(now):
                    # A newer copy than the one granted earlier in the hold (no write is routed
                    # during the hold): it wins.
                    out = self._demote(current.node_id, claim.partition)
                    part.primary = None
                    return out + self._make_primary(node, claim.partition, epoch, claim)
                node.held = claim
                return self._contend(node, claim)
            if why_not is None and part.primary is None:
                return self._make_primary(node, claim.partition, epoch, claim)
            if why_not is not None and part.primary is None:
                node.held = claim
                self.notices.append(("error", recovery.not_taken(node, claim, why_not)))
            if current is None or newer or claim.epoch != part.epoch:
                return []
            # A copy of the serving primary's epoch, no newer, follows it (even one that may not be
            # elected: a spare elsewhere would leave a single copy); recovery.vouches: the hold.
            vouched = why_not is None and recovery.vouches(part, claim)
        if (
            not part.lost
            and claim.epoch >= part.epoch
            and (part.primary is None or claim.epoch == part.epoch)
            and (len(part.replicas) < self.replication - 1)
        ):
            raised = self._raise_epoch(claim.partition, claim.epoch)
            node.role, node.partition, node.epoch = Role.REPLICA, claim.partition, claim.epoch
            part.replicas.append(node.node_id)
            own = vouched or (claim.role is Role.REPLICA and recovery.says_in_sync(part, claim))
            if own and self.holding(now):
                # After a restart only the copy itself can say it was in sync.
                part.in_sync.add(node.node_id)
            self._publish()
            return [*raised, self._assignment(node.node_id)]
        if part.lost and claim.role is Role.REPLICA:
            node.held = claim  # kept for reset-partition (see _failover), never a spare
        return []

    _distrust = staticmethod(recovery.distrust)

    def take_orphaned_move(self, now: float) -> Orphan | None:
        """Rule 9: after the hold of a broker that restored no record, the next move the
        shards' claims show under way (:mod:`zps.core.slotclaims` rule 6), once each."""
        if self.holding(now) or self.slot_claims is None or self.slot_claims.base is not None:
            return None
        if self._orphans is None:
            self._orphans = self.slot_claims.orphans(self.slot_map)
        return self._orphans.pop(0) if self._orphans else None

    def _learn_slots(self, node_id: str, claim: Claim) -> None:
        """Rule 9: the slots ``claim`` says its copy serves shape the map."""
        if self.slot_claims is None or claim.slots is None:
            return
        served = [p.primary is not None or bool(p.replicas) for p in self._parts]
        notice, learned = self.slot_claims.take(
            node_id, claim.partition, claim.slots, claim.slot_version, self.slot_map, served
        )
        if notice is not None:
            self.notices.append(notice)
        if learned is not None:
            self.slot_map = learned.slot_map
            self._resize(learned.partitions)
            self.map_version = max(self.map_version, learned.version)
            self._publish()

    def _contend(self, node: ShardNode, claim: Claim) -> list[Assignment]:
        """A newer copy than the serving primary's origin came back (rule 8)."""
        p = claim.partition
        part = self._parts[p]
        current = self.shards[part.primary] if part.primary else None
        assert current is not None
        if part.contender is not None and part.contender in self.shards:
            self.notices.append(("info", recovery.waits_behind(p, node, part.contender)))
            return []
        if current.lsn > part.granted_lsn:
            self._conflict(p, node, claim, current.lsn)
            return []
        part.contender = node.node_id
        part.fence_after = (current.lease_t or float("-inf")) + self.lease
        current.fenced, current.final_lsn = True, None
        self.notices.append(("info", recovery.fencing(p, node, claim, current, part)))
        self._publish()
        return []

    def _conflict(self, p: int, node: ShardNode, claim: Claim, lsn: int) -> None:
        self.notices.append(("error", recovery.conflict(p, node, claim, self._parts[p], lsn)))

    def _settle(self, now: float) -> list[Assignment]:
        """Finish the hand-overs whose fenced primary reported its final LSN."""
        out: list[Assignment] = []
        for p, part in enumerate(self._parts):
            if part.contender is None:
                continue
            contender = self.shards.get(part.contender)
            current = self.shards.get(part.primary) if part.primary else None
            if contender is None or contender.held is None or current is None:
                # One of them left: the hand-over is off (a dead primary fails over).
                part.contender = None
                if current is not None:
                    current.fenced = False
                self._publish()
                continue
            if current.final_lsn is None:
                continue
            claim = contender.held
            part.contender = None
            current.fenced = False
            if current.final_lsn > part.granted_lsn:
                self._conflict(p, contender, claim, current.final_lsn)
                self._publish()
                continue
            self.notices.append(("warning", recovery.handed_over(p, contender, claim, current)))
            out += self._demote(current.node_id, p)
            part.primary = None
            # Past the fenced primary's epoch: nothing it sent can count any more.
            out += self._make_primary(contender, p, max(claim.epoch, part.epoch + 1), claim)
            out += self._fill(now)
        return out

    def register_client(self, node_id: str, *, host: str, pid: int, name: str, now: float) -> None:
        self.clients[node_id] = ClientNode(node_id, host, pid, name, now)

    def register_router(
        self, node_id: str, *, endpoint: str, host: str, now: float, pid: int = 0
    ) -> None:
        """A routing broker announced itself: listed in the map from now on (and watched
        like a client)."""
        self.register_client(node_id, host=host, pid=pid, name="router", now=now)
        info = RouterInfo(node_id, endpoint, host)
        if self.routers.get(node_id) != info:
            self.routers[node_id] = info
            self._publish()

    def report(
        self,
        node_id: str,
        *,
        lsn: int,
        stats: dict[str, Any] | None = None,
        epoch: int | None = None,
        in_sync: list[str] | None = None,
        durable: int | None = None,
        t: float | None = None,
    ) -> bool:
        """A shard's heartbeat (sent at ``t`` by the shard's clock); a primary also
        reports its in-sync replicas, and raises its partition's floor to what its
        log holds (``durable``; without a log, to ``lsn``: a restart would bring back
        less than it acknowledged).  A fenced primary's first heartbeat from its
        event loop (it carries ``in_sync``) sent after its lease ran out gives its
        final LSN (rule 8).

        Returns True when the map changed.
        """
        node = self.shards.get(node_id)
        if node is None:
            return False
        node.lsn = lsn
        if stats is not None:
            node.stats = stats
        if node.role is Role.PRIMARY and node.partition is not None and epoch == node.epoch:
            p = self._parts[node.partition]
            if not node.fenced:
                node.lease_t = t
            elif (
                node.final_lsn is None
                and in_sync is not None
                and t is not None
                and t >= p.fence_after
            ):
                node.final_lsn = lsn
            if p.primary == node_id and epoch == p.epoch:
                p.confirm(epoch, lsn, durable)
        if (
            in_sync is None
            or node.role is not Role.PRIMARY
            or node.partition is None
            or epoch != node.epoch
        ):
            return False
        part = self._parts[node.partition]
        reported = recovery.reported_in_sync(part, in_sync, holding=self._holding)
        if reported == part.in_sync:
            return False
        part.in_sync = reported
        self._publish()
        return True

    def node_gone(
        self, node_id: str, now: float = 0.0, *, planned: bool = False
    ) -> list[Assignment]:
        """A node died or left (``planned``: it said goodbye, a stop an operator asked
        for); returns the assignments that follow (promotions)."""
        for part in self._parts:
            if recovery.call_off(part, node_id, self.shards):
                self._publish()
        self.clients.pop(node_id, None)
        if self.routers.pop(node_id, None) is not None:
            self._publish()
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
            out += self._failover(node.partition, stopped=node_id if planned else None)
        elif node_id in part.replicas:
            part.replicas.remove(node_id)
            part.in_sync.discard(node_id)
            self._publish()
        return merge(out + self._fill(now))

    def tick(self, now: float) -> list[Assignment]:
        """Time passes: ends the start-up hold (then fills what is still empty)."""
        if self._holding and not self.holding(now):
            self._holding = False
            if self.routers:
                self._publish()  # the partitions' routers, withheld during the hold
            return merge(self._fill(now))
        if self.holding(now):
            return []
        return merge(self._settle(now) + self._rebalance())

    # -- operator --------------------------------------------------------------

    def drain(self, node_id: str, now: float) -> list[Assignment]:
        """An operator takes a shard out of service without stopping it: a primary hands
        its partition to its best in-sync replica (at a new epoch), a replica leaves its
        partition (a spare takes its place), and the shard gets no role until
        :meth:`undrain`.  Raises ValueError, changing nothing, for an unknown shard, during
        the start-up hold, or for a primary with no in-sync replica to hand over to."""
        node = self.shards.get(node_id)
        if node is None:
            raise ValueError(f"no shard {node_id} is registered")
        if self.holding(now):
            raise ValueError("the broker is still collecting the shards' claims; ask again")
        out: list[Assignment] = []
        p = node.partition
        if p is not None and node.role is Role.PRIMARY:
            part = self._parts[p]
            if not any(r in part.in_sync and r in self.shards for r in part.replicas):
                raise ValueError(
                    f"{node_id} is the primary of partition {p} and no replica is in sync to "
                    "take it over; add a spare and wait for it to catch up, or stop the shard"
                )
            self.drained.add(node_id)
            out += self._failover(p)
            out += self._demote(node_id, p)
        elif p is not None and node.role is Role.REPLICA:
            self.drained.add(node_id)
            part = self._parts[p]
            part.replicas.remove(node_id)
            part.in_sync.discard(node_id)
            out += self._demote(node_id, p)
            self._publish()
        else:
            self.drained.add(node_id)
        return merge(out + self._fill(now))

    def undrain(self, node_id: str, now: float) -> list[Assignment]:
        """Let a drained shard take roles again (it is a spare until placed)."""
        if node_id not in self.drained:
            raise ValueError(f"{node_id} is not drained")
        self.drained.discard(node_id)
        return merge(self._fill(now))

    def reset_partition(self, p: int, now: float) -> list[Assignment]:
        """An operator accepts losing what the missing copies of ``p`` held: the
        newest copy that came back (or, with none, an empty spare) takes it at a
        new epoch.  Raises ValueError when there is nothing to reset."""
        if not 0 <= p < self.n_partitions:
            raise ValueError(f"no partition {p} (this cluster has {self.n_partitions})")
        part = self._parts[p]
        if part.primary is not None:
            raise ValueError(f"partition {p} is served by {part.primary}: nothing to reset")
        if self.holding(now):
            raise ValueError(
                f"partition {p}: the broker is still collecting the shards' claims; "
                "ask again when the start-up hold has ended"
            )
        self.notices.append(
            (
                "error",
                f"partition {p}: an operator accepted the loss of the writes after the "
                f"best copy that came back (the last confirmed copy was at epoch "
                f"{part.floor_epoch}, LSN {part.floor_lsn})",
            )
        )
        part.lost, part.released = False, True
        self._publish()
        return merge(self._take_over(p) + self._fill(now))
