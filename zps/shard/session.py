"""A shard's role, replication and lease state, without I/O.

:class:`ShardSession` decides; the driver (:mod:`zps.shard.server` with
:mod:`zps.shard.primary` and :mod:`zps.shard.replica`) sends, receives, logs
and keeps :class:`~zps.shard.core.ShardCore` in step.  Every event takes the
time as ``now``; nothing here sleeps or reads a clock.

Rules:

1. The lease runs from the send time of the newest heartbeat the broker echoed
   for this shard's current role, partition and epoch; a primary whose lease ran
   out refuses requests (:meth:`ShardSession.may_write`).  Stepping down forfeits
   it: a new lease comes only from a heartbeat sent after the assignment.
2. A follower is reported in sync only once it acknowledged the LSN of the
   snapshot it was sent, naming that snapshot (``base``): an acknowledgement
   from another history (a state kept from an older epoch, an earlier
   subscription) counts for nothing.  It then holds writes back
   (:class:`AckTracker`) until the broker's map drops it.  A follower that goes
   away, or that stays silent for the liveness timeout while writes wait or
   while it has not acknowledged the primary's LSN, leaves the reported set;
   the driver then drops it, so it resynchronises (snapshot and tail).
3. A replica applies the stream, and acknowledges, only after it loaded its
   primary's snapshot (``synced``); a refusal (BYE), a gap or a bad message
   clears that and makes it subscribe again at once.
4. After a graceful leave (:meth:`ShardSession.begin_leave`) assignments and the
   broker's re-registration requests are ignored.
5. A checkpoint is due after ``interval_s`` seconds or ``every_updates`` LSNs
   since the last one, and only a whole partition (a primary's, or a synced
   replica's) is written, except for the final one on leaving.
6. ``min_in_sync``: an ``acks="all"`` write needs that many copies in sync, the
   primary included, capped at the most copies the broker's map has listed for
   the partition (so a cluster without replicas is unaffected).  With fewer, the
   driver refuses such writes before applying them (:meth:`ShardSession.enough_in_sync`),
   and writes already waiting when the set shrinks are refused too
   (:attr:`MapResult.refused`): they stay applied, and a re-sent copy is
   answered from the dedup record once enough copies hold it.  Except while
   the partition is *repairing* (``repair``: the primary has a write-ahead log
   and a replica the map lists is loading its snapshot to replace a lost
   copy): then the copies in sync are enough, the primary alone included, and
   the broker's in-sync set says so (only they hold those writes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from zps.core.replication import AckTracker
from zps.protocol.messages import Role

T = TypeVar("T")
NEVER = -math.inf


@dataclass
class Follower:
    """A replica streaming from this primary."""

    snapshot_lsn: int
    acked: int = 0
    last_heard: float = 0.0
    #: Since when it has been behind with no acknowledgement moving it on, and how far
    #: it had got then (None: not behind).
    stuck_since: float | None = None
    stuck_at: int = 0
    snapshot_bytes: int = 0
    #: Once it loaded its snapshot: the highest LSN this primary had acknowledged
    #: without it, which it must acknowledge before it counts as in sync.
    catch_up_to: int | None = None


@dataclass(frozen=True)
class Assignment(Generic[T]):
    """What the driver does for an ASSIGN (see :meth:`ShardSession.assign`)."""

    changed: bool
    was: tuple[Role, int | None, int]
    refused: list[T] = field(default_factory=list)  # writes to fail: the primary stepped down
    stop_following: bool = False  # close the upstream subscription
    follow: str | None = None  # subscribe to the primary at this address
    #: Refused, nothing changed: the broker granted data this shard has let go since it
    #: last said what it holds; it registers again, so the broker hears what it holds now.
    register_again: bool = False


@dataclass(frozen=True)
class MapResult(Generic[T]):
    """What the broker's map did to the waiting writes (see :meth:`ShardSession.on_map`)."""

    released: list[T] = field(default_factory=list)  # held by every copy required: answer
    refused: list[T] = field(default_factory=list)  # too few copies left: NOT_ENOUGH_REPLICAS


@dataclass(frozen=True)
class AckResult(Generic[T]):
    released: list[T]
    in_sync: bool = False  # the follower just caught up: report it to the broker now


@dataclass(frozen=True)
class Tick:
    """The driver's work after a heartbeat (see :meth:`ShardSession.tick`)."""

    trim: bool = False  # a quiet interval after traffic: give freed memory back
    broker_lost_for: float | None = None  # the broker just went silent this long
    lagging: tuple[str, ...] = ()  # replicas just out of sync: the driver drops them
    checkpoint: bool = False
    ack_upstream: bool = False


class ShardSession(Generic[T]):
    """One shard's role and its replication, lease and housekeeping state.

    ``T`` is whatever the driver holds for a write waiting for replicas (its reply).
    """

    def __init__(
        self,
        node_id: str,
        *,
        heartbeat_interval: float,
        liveness: int,
        checkpoint_interval_s: float = 0.0,
        checkpoint_every_updates: int = 0,
        checkpoints: bool = False,
        min_in_sync: int = 1,
        repair: bool = False,
        now: float,
    ) -> None:
        if min_in_sync < 1:
            raise ValueError(f"min_in_sync must be >= 1, got {min_in_sync}")
        self.node_id = node_id
        self.min_in_sync = min_in_sync
        self.repair = repair
        self.copies = 1  # the most copies the map has listed for this partition
        self.interval = heartbeat_interval
        self.liveness = liveness
        self.lease = heartbeat_interval * max(1, liveness - 1)
        self.checkpoint_interval_s = checkpoint_interval_s
        self.checkpoint_every_updates = checkpoint_every_updates
        self.checkpoints = checkpoints  # the shard has somewhere to write them
        self.role = Role.SPARE
        self.partition: int | None = None
        self.epoch = 0
        self.leaving = False
        self.restored = False
        #: Whether the restored copy holds every write it acknowledged (see restore).
        self.complete = True
        self.restored_at: tuple[int, int] | None = None  # (LSN, epoch) restored
        #: The partition and epoch whose data this shard let go, and the broker term
        #: that had it let go (see assign).
        self.let_go: tuple[int, int, int] | None = None
        # broker link
        self.lease_start = NEVER
        self.last_broker = now
        self.broker_lost = False
        self._handled = 0
        self._trim_due = False  # traffic since the last trim
        self.last_checkpoint: tuple[float, int] = (now, 0)  # (time, LSN)
        # primary side
        self.tracker: AckTracker[T] = AckTracker()
        self.followers: dict[str, Follower] = {}
        self.local_in_sync: set[str] = set()  # caught up, as this primary sees it
        #: Loaded their snapshot and still catching up with what this primary
        #: acknowledged without them: writes wait for them, the broker is not told yet.
        self.joining: set[str] = set()
        self.published_in_sync: set[str] = set()  # in sync, as the broker's map says
        self.replicas: set[str] = set()  # this partition's replicas, as the map says
        # replica side
        self.in_sync_published = False  # the map lists this shard in sync
        self.following: tuple[str, int] | None = None  # (primary address, epoch)
        self.synced = False
        self.base_lsn = -1  # the LSN of the snapshot loaded (named in acknowledgements)
        self._asked = NEVER  # when the primary was last asked for a subscription

    # -- role ------------------------------------------------------------------

    @property
    def whole(self) -> bool:
        """Whether this shard's state is a whole partition (worth a checkpoint)."""
        return self.role is Role.PRIMARY or (self.role is Role.REPLICA and self.synced)

    def restore(
        self, partition: int, epoch: int, lsn: int, now: float, *, complete: bool = True
    ) -> None:
        """A checkpoint was loaded: claim its partition when registering.  ``complete``:
        whether the copy holds every write it acknowledged (not so for a checkpoint
        with no log after it, unless written at a clean stop); the claim says so."""
        self.partition, self.epoch = partition, epoch
        self.restored = True
        self.complete = complete
        self.restored_at = (lsn, epoch)
        self.last_checkpoint = (now, lsn)

    def unchanged_since_restore(self, lsn: int, epoch: int) -> bool:
        """Whether this copy was restored complete and has applied nothing since (at
        ``lsn`` and ``epoch``): the checkpoint it came from still holds every write
        it acknowledged."""
        return self.restored and self.complete and self.restored_at == (lsn, epoch)

    def claim(self, lsn: int) -> dict[str, Any] | None:
        """What this shard tells the broker it serves, when registering."""
        if self.partition is None:
            return None
        complete = True  # a role the broker gave: the copy it chose
        if self.restored and self.role is Role.SPARE:
            role, in_sync, complete = Role.PRIMARY, False, self.complete
        elif self.role is not Role.SPARE:
            # A replica that has not loaded its primary's snapshot holds another history.
            role = self.role
            in_sync = self.in_sync_published and (role is not Role.REPLICA or self.synced)
        else:
            return None
        claim = {
            "partition": self.partition,
            "epoch": self.epoch,
            "role": role.value,
            "lsn": lsn,
            "in_sync": in_sync,
        }
        if not complete:  # absent: complete (ShardClaim.complete)
            claim["complete"] = False
        return claim

    def assign(
        self,
        role: Role,
        partition: int | None,
        epoch: int,
        primary_address: str = "",
        *,
        lsn: int = 0,
        term: int = 0,
    ) -> Assignment[T]:
        """The broker assigned a role; a repeated assignment changes nothing.  ``lsn``:
        how far this shard holds its current partition; ``term``: the broker term of
        the assignment (0 without a pair).

        A shard that let a partition's data go (made a spare, or given another
        partition) at one broker term refuses to be that partition's primary, at the
        epoch it let go or an older one, at another term: that broker granted it on
        what the shard said it held before (a broker that took over read the shard's
        claim, then the other broker's assignment in flight made it a spare), and
        serving it now would serve the partition empty.  It registers again instead.
        The broker that let the data go knows the shard holds none (a partition it
        removed and made again starts at epoch 1); a primary of a newer epoch is a grant
        made knowing what it holds; holding the partition again as a replica ends the
        rule."""
        was = (self.role, self.partition, self.epoch)
        if was == (role, partition, epoch) and (
            role is not Role.REPLICA or (self.following or ("",))[0] == primary_address
        ):
            return Assignment(changed=False, was=was)
        if (
            role is Role.PRIMARY
            and self.let_go is not None
            and partition == self.let_go[0]
            and partition != self.partition
            and epoch <= self.let_go[1]
            and term != self.let_go[2]
        ):
            return Assignment(changed=False, was=was, register_again=True)
        if self.partition is not None and partition != self.partition and lsn > 0:
            self.let_go = (self.partition, self.epoch, term)
        elif partition is not None and self.let_go is not None and partition == self.let_go[0]:
            self.let_go = None
        refused = self.step_down() if self.role is Role.PRIMARY else []
        if partition != self.partition:
            self.copies = 1
        # A lease is for exactly one role, partition and epoch: a replica's echoes never
        # let it write once promoted (the broker's echo for the new epoch waits until its
        # record names that epoch).
        if was != (role, partition, epoch):
            self.lease_start = NEVER
        self.role, self.partition, self.epoch = role, partition, epoch
        follow = None
        if role is Role.REPLICA:
            stop = bool(primary_address) and self.following != (primary_address, epoch)
            if stop:
                self.stop_following()
                self.following, follow = (primary_address, epoch), primary_address
        else:
            stop = self.following is not None
            self.stop_following()
            if role is Role.SPARE:
                self.partition, self.epoch, self.copies = None, 0, 1
        return Assignment(True, was, refused, stop, follow)

    def step_down(self) -> list[T]:
        """Stop being primary: returns the writes still waiting, to refuse."""
        waiting = self.tracker.take_all()
        self.tracker = AckTracker()
        self.followers.clear()
        self.local_in_sync.clear()
        self.published_in_sync.clear()
        self.lease_start = NEVER
        return waiting

    def begin_leave(self) -> bool:
        """A graceful stop begins; returns whether the state is whole (see :attr:`whole`)."""
        self.leaving = True
        return self.whole

    def left(self) -> list[T]:
        """The broker was told; become a spare.  Returns the writes to refuse."""
        refused = self.step_down() if self.role is Role.PRIMARY else []
        self.stop_following()
        self.role = Role.SPARE
        return refused

    # -- broker link and lease -------------------------------------------------

    def heartbeat_fields(self, now: float) -> dict[str, Any]:
        """The session's part of a heartbeat sent at ``now``."""
        fields: dict[str, Any] = {"t": now, "epoch": self.epoch}
        if self.role is Role.PRIMARY:
            fields["in_sync"] = sorted(self.local_in_sync)
        return fields

    def echoed(self, t: object, role: object, partition: object, epoch: object) -> None:
        """The broker echoed a heartbeat sent at ``t`` for this role: the lease runs from ``t``."""
        if (
            isinstance(t, float)
            and role == self.role.value
            and partition == self.partition
            and epoch == self.epoch
        ):
            self.lease_start = max(self.lease_start, t)

    def may_write(self, now: float) -> bool:
        """False for a primary whose lease ran out (the core refuses everything else)."""
        return self.role is not Role.PRIMARY or now - self.lease_start < self.lease

    def broker_seen(self, now: float) -> bool:
        """Traffic from the broker; True if it had been reported lost."""
        self.last_broker = now
        regained, self.broker_lost = self.broker_lost, False
        return regained

    def tick(self, now: float, *, requests: int, lsn: int) -> Tick:
        """A heartbeat went out; what else is due (``requests``: handled so far)."""
        trim = False
        if requests != self._handled:
            self._handled, self._trim_due = requests, True
        elif self._trim_due:
            self._trim_due, trim = False, True
        lost_for = None
        silent = now - self.last_broker
        if silent > self.interval * self.liveness and not self.broker_lost:
            self.broker_lost, lost_for = True, silent
        lagging = self._drop_lagging(now, lsn) if self.role is Role.PRIMARY else ()
        checkpoint = self.checkpoints and self.checkpoint_due(now, lsn)
        return Tick(
            trim=trim,
            broker_lost_for=lost_for,
            lagging=lagging,
            checkpoint=checkpoint,
            ack_upstream=not checkpoint
            and self.role is Role.REPLICA
            and bool(self.following)
            and self.synced,
        )

    # -- checkpoints -----------------------------------------------------------

    def checkpoint_due(self, now: float, lsn: int) -> bool:
        at, last = self.last_checkpoint
        return (self.checkpoint_interval_s > 0 and now - at >= self.checkpoint_interval_s) or (
            self.checkpoint_every_updates > 0 and lsn - last >= self.checkpoint_every_updates
        )

    def checkpoint_kept(self, now: float, lsn: int) -> None:
        """A checkpoint of the state at ``lsn`` is on disk that :meth:`begin_checkpoint`
        did not start (a replica's snapshot, kept as one): the next is due from it, not
        at once (a second copy of the whole partition written behind the first)."""
        self.last_checkpoint = (now, lsn)

    def begin_checkpoint(self, now: float, lsn: int, *, final: bool = False) -> bool:
        """Whether to write a checkpoint of the state at ``lsn`` now (and note it if so)."""
        if self.partition is None or lsn == 0:
            return False
        if lsn == self.last_checkpoint[1] and not (final and self.restored):
            return False
        if not final and not self.whole:
            return False
        self.last_checkpoint = (now, lsn)
        return True

    # -- primary side ----------------------------------------------------------

    def on_map(self, epoch: int, in_sync: set[str], replicas: set[str]) -> MapResult[T]:
        """The broker's map for this partition; returns what it does to waiting writes."""
        self.in_sync_published = self.node_id in in_sync
        if self.partition is not None:
            self.copies = max(self.copies, 1 + len(replicas))
        if epoch != self.epoch:
            return MapResult()  # a map of another epoch says nothing of this one's replicas
        self.replicas = set(replicas)
        if self.role is not Role.PRIMARY:
            return MapResult()
        # The broker dropped these (dead, or reported lagging): stop waiting.  A
        # replica missing from one map (a restarted broker rebuilding it) keeps its
        # stream; followers are checked when they subscribe.  Writes this map releases
        # without one it must hold before it counts as in sync again: it catches up
        # to them as a rebuilt copy does (:meth:`acked`), never on its old mark.
        dropped = self.local_in_sync & (self.published_in_sync - in_sync)
        for node in dropped:
            follower = self.followers.get(node)
            if follower is not None:
                follower.catch_up_to = None
        self.local_in_sync -= dropped
        self.joining &= self.replicas
        self.published_in_sync = set(in_sync)
        return self.settle()

    def settle(self) -> MapResult[T]:
        """Waiting writes wait for exactly the published and the local in-sync replicas.

        Called on every change of either set: a replica that left both (dropped here after
        the broker had already removed it) must not hold writes back for ever.
        """
        if self.role is not Role.PRIMARY:
            return MapResult()
        required = self.published_in_sync | self.local_in_sync | self.joining
        # Too few copies left: what waits was applied here but is held by too few;
        # refuse it before a smaller required set could release it.
        enough = 1 + len(required) >= self.needed_copies or self.repairing
        refused = [] if enough else self.tracker.take_all()
        return MapResult(self.tracker.set_required(required), refused)

    @property
    def needed_copies(self) -> int:
        """Copies (this primary included) an acks="all" write needs (rule 6)."""
        return min(self.min_in_sync, self.copies)

    @property
    def repairing(self) -> bool:
        """A replica the map lists is loading its snapshot, and this primary's log holds
        what it acknowledges meanwhile (rule 6)."""
        if not self.repair:
            return False
        return any(
            node in self.replicas and node not in self.local_in_sync for node in self.followers
        )

    def enough_in_sync(self) -> bool:
        """Whether an acks="all" write may be taken now (rule 6)."""
        if self.role is not Role.PRIMARY:
            return True  # the core refuses the write anyway (NOT_PRIMARY)
        return 1 + len(self.tracker.required) >= self.needed_copies or self.repairing

    @property
    def replicas_required(self) -> bool:
        """Whether an acks="all" write waits for replicas now."""
        return bool(self.tracker.required)

    def short_of_copies(self) -> str:
        """Why an acks="all" write is refused (rule 6)."""
        return (
            f"partition {self.partition}: {1 + len(self.tracker.required)} of the "
            f"{self.needed_copies} copies acks='all' needs (replication.min_in_sync) are in sync"
        )

    def accepts_subscription(self, node: str, partition: object, epoch: object) -> bool:
        """Only the primary of that partition and epoch streams, and only to its replicas."""
        return (
            self.role is Role.PRIMARY
            and partition == self.partition
            and epoch == self.epoch
            and node in self.replicas
        )

    def subscribed(
        self, node: str, snapshot_lsn: int, now: float, *, snapshot_bytes: int = 0
    ) -> None:
        """``node`` is sent a snapshot at ``snapshot_lsn``; the stream follows it."""
        self.local_in_sync.discard(node)
        self.joining.discard(node)
        self.followers[node] = Follower(
            snapshot_lsn=snapshot_lsn, last_heard=now, snapshot_bytes=snapshot_bytes
        )

    def add_write(self, lsn: int, item: T) -> list[T]:
        """A write at ``lsn`` waits for the required replicas; returns what is released."""
        return self.tracker.add(lsn, item)

    def acked(self, node: str, lsn: int, epoch: object, now: float, base: object) -> AckResult[T]:
        """``node`` applied everything up to ``lsn`` on top of the snapshot at ``base``."""
        follower = self.followers.get(node)
        if (
            follower is None
            or node not in self.replicas  # the broker gave its place away
            or epoch != self.epoch
            or base != follower.snapshot_lsn
        ):
            return AckResult([])
        follower.acked = max(follower.acked, lsn)
        follower.last_heard = now
        caught_up = False
        if node not in self.local_in_sync and follower.acked >= follower.snapshot_lsn:
            if follower.catch_up_to is None:
                # It holds the snapshot and receives every message since: from now on
                # writes wait for it too.  Writes this primary acknowledged without it
                # (the repair window) it must hold before it may be promoted.
                follower.catch_up_to = self.tracker.released
                self.joining.add(node)
                self.tracker.require(node, follower.acked)
            if follower.acked >= follower.catch_up_to:
                self.joining.discard(node)
                self.local_in_sync.add(node)
                caught_up = True
        return AckResult(self.tracker.ack(node, lsn), caught_up)

    def follower_gone(self, node: str) -> bool:
        """Stop streaming to ``node``; True if it was a follower."""
        self.local_in_sync.discard(node)
        self.joining.discard(node)
        return self.followers.pop(node, None) is not None

    def _drop_lagging(self, now: float, lsn: int) -> tuple[str, ...]:
        """An in-sync replica that, while writes wait for it or while it has not
        acknowledged ``lsn``, is silent for the liveness timeout, or acknowledges
        without getting further for as long (its log cannot take them: a full disk),
        stops holding writes back (the broker then publishes the smaller set, and
        :meth:`on_map` releases them); the driver drops it."""
        dropped = []
        for node in sorted(self.local_in_sync | self.joining):
            follower = self.followers.get(node)
            if follower is None:
                self.local_in_sync.discard(node)
                self.joining.discard(node)
                dropped.append(node)
                continue
            timeout = self.interval * self.liveness
            behind = bool(len(self.tracker)) or follower.acked < lsn
            silent = behind and now - follower.last_heard > timeout
            if follower.acked >= lsn:
                follower.stuck_since = None
            elif follower.stuck_since is None or follower.acked > follower.stuck_at:
                follower.stuck_since, follower.stuck_at = now, follower.acked
            stuck = follower.stuck_since is not None and now - follower.stuck_since > timeout
            if silent or stuck:
                self.local_in_sync.discard(node)
                self.joining.discard(node)
                dropped.append(node)
        return tuple(dropped)

    # -- replica side ----------------------------------------------------------

    def stop_following(self) -> None:
        self.following = None
        self.synced = False
        self.base_lsn = -1

    def upstream_started(self) -> None:
        self.synced = False
        self._asked = NEVER

    def subscribe_due(self, now: float) -> bool:
        """Whether to (again) ask the primary for the stream: it may not have known
        its role yet, or it refused."""
        return not self.synced and now - self._asked > self.interval * 2

    def subscribe_sent(self, now: float) -> None:
        self._asked = now

    def snapshot_loaded(self, ok: bool, lsn: int) -> None:
        """A snapshot at ``lsn`` arrived; ``ok`` if it was this partition's at this epoch
        and loaded (acknowledgements then name it)."""
        self.synced = ok
        self.base_lsn = lsn if ok else -1

    def refused(self) -> None:
        """The primary refused the subscription (BYE): ask again when it is due."""
        self.synced = False

    def resync(self) -> None:
        """The stream broke (a gap, a bad message, a refusal): subscribe again at once."""
        self.synced = False
        self._asked = NEVER
