"""Live resharding, the pure part: which slots move, and the life of one slot move.

A cluster's ids and dense chunks hash to a fixed number of slots (4,096 by
default, :mod:`zps.core.routing`); the map of slots to partitions is the only
thing that changes when partitions are added or removed.

- :func:`plan_moves` turns the current slot map and a new partition count into
  the new map and the moves from old to new owners, moving the fewest slots that
  leave every partition of the new count with an even share (``n_slots // n`` or
  one more).  Removed partitions are always the highest-numbered ones (partition
  numbers stay ``0..n-1``).
- :class:`Move` is the state machine of one move of a set of slots from a source
  partition to a destination: ``PLANNED -> SNAPSHOT -> CATCH_UP -> CUT_OVER ->
  DONE``, or ``CANCELLED`` from any state before ``DONE``.  The map owner (the
  active broker) drives it; it is the single commit point of a move.
- :class:`SlotOwnership` is a shard's view of the slots of its partition and the
  fencing rule it applies to every request (:meth:`SlotOwnership.check`).

Fencing, in short: the source stops serving the moving slots at the fence (a
record in its replication stream, so its replicas and its log hold it) and never
serves them again unless the move is cancelled; the destination serves them only
once the broker has published the map that gives them to it, which it does only
after the destination holds everything the source applied before the fence, on
every in-sync copy.  Between the two a request for a moving slot is answered
``RETRY`` (not applied); a request routed by an older map than the shard's is
answered ``MOVED`` (not applied) and the client re-splits it by the new map.  A
re-sent message that was applied before the fence is answered from the source's
dedup record, which is looked up before ownership, so it is never applied twice.

No I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.core.routing import default_slot_map

#: Slots per move unless the caller says otherwise: a short cut-over each, and a
#: failed move loses little work (a 4,096-slot cluster: 1/16 of its data).
DEFAULT_MAX_SLOTS_PER_MOVE = 256
_GOLDEN = (5**0.5 - 1) / 2


class MoveError(ValueError):
    """A transition that the move's state does not allow."""


@dataclass(frozen=True)
class SlotMove:
    """Move ``slots`` (sorted) from partition ``source`` to partition ``dest``."""

    move_id: int
    source: int
    dest: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class ReshardPlan:
    old_partitions: int
    new_partitions: int
    #: The slot map once every move is done.
    new_slot_map: npt.NDArray[np.int32]
    moves: tuple[SlotMove, ...]

    @property
    def moved_slots(self) -> int:
        return sum(len(m.slots) for m in self.moves)


def quotas(counts: Sequence[int], n_slots: int, new_partitions: int) -> list[int]:
    """Each new partition's share: ``n_slots // n``, plus one for ``n_slots % n`` of them.

    The extra slots go to the partitions that hold the most slots now (lower
    number first among equals), which is what keeps the number of moves lowest.
    """
    base, extra = divmod(n_slots, new_partitions)
    have = [counts[p] if p < len(counts) else 0 for p in range(new_partitions)]
    favoured = sorted(range(new_partitions), key=lambda p: (-have[p], p))[:extra]
    out = [base] * new_partitions
    for p in favoured:
        out[p] += 1
    return out


def needed(slot_map: npt.NDArray[np.int32], n_partitions: int, target: int) -> list[int]:
    """The partitions a resharding step to ``target`` partitions needs served: those
    that stay, and those past the target still holding a slot (to move).  One past it
    with no slot holds no row to keep, so it goes even with no copy left (as after a
    broker restarted from a record written before the partition went, whose copies are
    spares by then)."""
    held = set(np.unique(slot_map).tolist())
    return [p for p in range(n_partitions) if p < target or p in held]


def plan_moves(
    slot_map: npt.ArrayLike,
    new_partitions: int,
    *,
    old_partitions: int | None = None,
    max_slots_per_move: int = DEFAULT_MAX_SLOTS_PER_MOVE,
) -> ReshardPlan:
    """The moves from ``slot_map`` to an even map over ``new_partitions`` partitions.

    A partition keeps up to its share of its slots (all of them go from a
    partition that is removed), and the rest go to the partitions below their
    share.  Both choices prefer where the round-robin map of the new count puts
    a slot, so from a round-robin map the result is the round-robin map again
    (2 -> 4 partitions: slot ``s`` ends on ``s % 4``) and a dense tensor's
    consecutive chunks stay spread.  The number of moved slots is the least any
    even map allows: ``sum(max(0, held - share))``.  Moves are cut into at most
    ``max_slots_per_move`` slots each, grouped by (source, destination).
    """
    current = np.asarray(slot_map, dtype=np.int64)
    if current.ndim != 1 or current.size == 0:
        raise ValueError("slot_map must be a non-empty 1-d array")
    n_slots = int(current.size)
    if int(current.min()) < 0:
        raise ValueError("slot_map names a negative partition")
    old = int(current.max()) + 1 if old_partitions is None else old_partitions
    if old < int(current.max()) + 1:
        raise ValueError(f"slot_map names partition {int(current.max())} of only {old}")
    if not 1 <= new_partitions <= n_slots:
        raise ValueError(f"new_partitions must be 1..{n_slots}, got {new_partitions}")
    if max_slots_per_move < 1:
        raise ValueError("max_slots_per_move must be >= 1")

    counts = np.bincount(current, minlength=max(old, new_partitions)).tolist()
    share = quotas(counts, n_slots, new_partitions)
    # Where the round-robin map of the new count would put each slot: kept and moved
    # slots follow it where the minimum allows, so consecutive slots (a dense
    # tensor's chunks) stay spread over the partitions.
    target = default_slot_map(n_slots, new_partitions)
    surplus: list[tuple[int, int]] = []  # (source, slot)
    for p in range(len(counts)):
        owned = np.flatnonzero(current == p)
        keep = share[p] if p < new_partitions else 0
        if owned.size > keep:
            at_home = target[owned] == p
            # Away from home, in golden-ratio order: what is kept and what moves are
            # each spread evenly over the slot range, not cut into runs.
            away = owned[~at_home]
            away = away[np.argsort((away * _GOLDEN) % 1.0, kind="stable")]
            order = np.concatenate([owned[at_home], away])
            surplus.extend((p, int(slot)) for slot in order[keep:].tolist())
    surplus.sort(key=lambda item: item[1])
    need = {p: share[p] - counts[p] for p in range(new_partitions) if share[p] > counts[p]}

    new_map = current.astype(np.int32)
    by_pair: dict[tuple[int, int], list[int]] = {}

    def assign(source: int, slot: int, dest: int) -> None:
        new_map[slot] = dest
        need[dest] -= 1
        by_pair.setdefault((source, dest), []).append(slot)

    rest = []
    for source, slot in surplus:  # first to where the round-robin map puts them
        home = int(target[slot])
        if need.get(home, 0) > 0:
            assign(source, slot, home)
        else:
            rest.append((source, slot))
    for source, slot in rest:  # then to any partition still short, lowest first
        assign(source, slot, next(p for p in sorted(need) if need[p] > 0))
    assert not any(need.values()), "surplus and deficits must match"

    moves: list[SlotMove] = []
    for (source, dest), slots in sorted(by_pair.items()):
        slots.sort()
        for start in range(0, len(slots), max_slots_per_move):
            chunk = tuple(slots[start : start + max_slots_per_move])
            moves.append(SlotMove(len(moves), source, dest, chunk))
    return ReshardPlan(old, new_partitions, new_map, tuple(moves))


# ---------------------------------------------------------------------------
# one move


class MoveState(enum.Enum):
    PLANNED = "planned"
    #: The source's primary is cutting a snapshot of the slots at ``snapshot_lsn``
    #: (rows, optimizer state, sync-mode step buffers) and sending it to the
    #: destination, which writes it to its own log and replicas as it loads it.
    SNAPSHOT = "snapshot"
    #: The destination applies the source's stream after ``snapshot_lsn``, limited
    #: to the moving slots; the source serves them as usual.
    CATCH_UP = "catch_up"
    #: The source has fenced the slots at ``fence_lsn`` (refuses them from then on);
    #: the destination finishes the stream up to ``fence_lsn``.  Requests for the
    #: slots are answered RETRY until the broker publishes or cancels.
    CUT_OVER = "cut_over"
    #: The broker published the map that gives the slots to the destination.
    DONE = "done"
    CANCELLED = "cancelled"


class Undo(enum.Enum):
    """What a cancelled move leaves to clean up."""

    #: The source serves the slots again (it had fenced them).
    UNFENCE_SOURCE = "unfence_source"
    #: The destination forgets what it imported of the slots (and logs that it did).
    DROP_AT_DEST = "drop_at_dest"


@dataclass
class Move:
    """The broker's record of one slot move; see :class:`MoveState`.

    Every method checks that the transition is allowed and raises
    :class:`MoveError` otherwise, leaving the move unchanged.
    """

    move: SlotMove
    #: The map version when the move was planned; the cut-over publishes a later one.
    planned_version: int
    state: MoveState = MoveState.PLANNED
    source_epoch: int = -1
    dest_epoch: int = -1
    snapshot_lsn: int = -1
    #: The source's LSN up to which the destination holds the slots (applied, and
    #: on every in-sync copy of the destination: ``dest_durable_lsn``).
    applied_lsn: int = -1
    dest_durable_lsn: int = -1
    #: The newest LSN the source reported.
    source_lsn: int = -1
    fence_lsn: int = -1
    published_version: int = -1
    reason: str = ""
    undo: tuple[Undo, ...] = field(default=())

    @property
    def active(self) -> bool:
        return self.state not in (MoveState.DONE, MoveState.CANCELLED)

    @property
    def lag(self) -> int:
        """Source updates the destination has yet to apply (up to the fence once there
        is one; 0 before the snapshot)."""
        if self.applied_lsn < 0:
            return 0
        upto = self.fence_lsn if self.state is MoveState.CUT_OVER else self.source_lsn
        return max(0, upto - self.applied_lsn)

    def _need(self, *states: MoveState) -> None:
        if self.state not in states:
            names = ", ".join(s.value for s in states)
            raise MoveError(f"move {self.move.move_id} is {self.state.value}, not {names}")

    # -- the happy path ------------------------------------------------------

    def begin_snapshot(self, source_epoch: int, dest_epoch: int, lsn: int) -> None:
        """The source's primary (at ``source_epoch``) cut the slots at ``lsn``."""
        self._need(MoveState.PLANNED)
        if lsn < 0 or source_epoch < 0 or dest_epoch < 0:
            raise MoveError("epochs and the snapshot LSN are >= 0")
        self.source_epoch, self.dest_epoch = source_epoch, dest_epoch
        self.snapshot_lsn = self.source_lsn = lsn
        self.state = MoveState.SNAPSHOT

    def snapshot_loaded(self, dest_epoch: int) -> None:
        """The destination's primary loaded the snapshot (and logged it)."""
        self._need(MoveState.SNAPSHOT)
        self._same_dest(dest_epoch)
        self.applied_lsn = self.snapshot_lsn
        self.state = MoveState.CATCH_UP

    def progress(
        self,
        *,
        source_lsn: int | None = None,
        applied_lsn: int | None = None,
        durable_lsn: int | None = None,
    ) -> None:
        """Reports: the source's LSN, and how far the destination applied / holds on
        every in-sync copy.  Each only ever grows; the destination never passes the
        source, nor the fence."""
        self._need(MoveState.CATCH_UP, MoveState.CUT_OVER)
        src = self.source_lsn if source_lsn is None else source_lsn
        app = self.applied_lsn if applied_lsn is None else applied_lsn
        dur = self.dest_durable_lsn if durable_lsn is None else durable_lsn
        if src < self.source_lsn or app < self.applied_lsn or dur < self.dest_durable_lsn:
            raise MoveError("LSNs of a move never go back")
        if app > max(src, self.fence_lsn) or dur > app:
            raise MoveError("the destination cannot hold more than the source applied")
        if self.state is MoveState.CUT_OVER and app > self.fence_lsn:
            raise MoveError("nothing of the slots follows the fence")
        self.source_lsn, self.applied_lsn, self.dest_durable_lsn = src, app, dur

    def ready_to_fence(self, max_lag: int) -> bool:
        """Whether the destination is close enough behind that the cut-over is short."""
        return self.state is MoveState.CATCH_UP and self.lag <= max_lag

    def fenced(self, fence_lsn: int, source_epoch: int) -> None:
        """The source fenced the slots at ``fence_lsn``, and its in-sync replicas hold
        the fence (so a promoted replica keeps refusing them)."""
        self._need(MoveState.CATCH_UP)
        if source_epoch != self.source_epoch:
            raise MoveError("the fence comes from another primary than the snapshot")
        if fence_lsn < max(self.applied_lsn, self.source_lsn):
            raise MoveError("the fence cannot precede what the source already applied")
        self.fence_lsn = self.source_lsn = fence_lsn
        self.state = MoveState.CUT_OVER

    def can_publish(self) -> bool:
        """Every in-sync copy of the destination holds the slots up to the fence."""
        return self.state is MoveState.CUT_OVER and self.dest_durable_lsn >= self.fence_lsn

    def publish(self, version: int) -> None:
        """The broker publishes ``version``, the map giving the slots to the destination."""
        self._need(MoveState.CUT_OVER)
        if not self.can_publish():
            raise MoveError(
                f"the destination holds the slots up to {self.dest_durable_lsn}, "
                f"the fence is at {self.fence_lsn}"
            )
        if version <= self.planned_version:
            raise MoveError("the cut-over publishes a newer map version")
        self.published_version = version
        self.state = MoveState.DONE

    # -- failures and cancelling ---------------------------------------------

    def cancel(self, reason: str) -> tuple[Undo, ...]:
        """Give the move up; returns what to undo.  A published move cannot be
        cancelled (moving the slots back is a new move)."""
        if self.state is MoveState.CANCELLED:
            return self.undo
        if self.state is MoveState.DONE:
            raise MoveError("a published move is undone by moving the slots back")
        undo: list[Undo] = []
        if self.state is MoveState.CUT_OVER:
            undo.append(Undo.UNFENCE_SOURCE)
        if self.state is not MoveState.PLANNED:
            undo.append(Undo.DROP_AT_DEST)
        self.state, self.reason, self.undo = MoveState.CANCELLED, reason, tuple(undo)
        return self.undo

    def source_failover(self, new_epoch: int) -> tuple[Undo, ...]:
        """The source partition got a new primary (``new_epoch``).

        Before the fence the snapshot and stream came from the old primary: the
        move is cancelled (the broker may plan it again).  After the fence the new
        primary holds the fence (a fence counts only once the in-sync replicas
        hold it) and the whole stream up to it, so the move goes on: the
        destination resumes the stream from ``applied_lsn``.
        """
        if not self.active or new_epoch <= self.source_epoch:
            return ()
        if self.state is MoveState.CUT_OVER:
            self.source_epoch = new_epoch
            return ()
        return self.cancel(f"the source failed over to epoch {new_epoch}")

    def dest_failover(self, new_epoch: int) -> tuple[Undo, ...]:
        """The destination got a new primary: before the map is published it may
        not hold what the old one imported, so the move is cancelled.  After
        publishing, the slots were on every in-sync copy: nothing to do."""
        if not self.active or new_epoch <= self.dest_epoch:
            return ()
        return self.cancel(f"the destination failed over to epoch {new_epoch}")

    def _same_dest(self, dest_epoch: int) -> None:
        if dest_epoch != self.dest_epoch:
            raise MoveError("the destination changed primary during the move")


# ---------------------------------------------------------------------------
# a shard's side: which slots it serves


class Verdict(enum.Enum):
    SERVE = "serve"
    #: Not applied; retry after a backoff (a cut-over in progress, or this shard
    #: has not yet seen the newer map the request was routed by).
    RETRY = "retry"
    #: Not applied; this partition no longer owns a slot of the request at the
    #: shard's map version: the client fetches the map and splits the call again.
    MOVED = "moved"


@dataclass
class SlotOwnership:
    """The slots one partition serves, as its shards see them (replicated state:
    fences and imports are records of the partition's stream)."""

    owned: set[int]
    #: The map version these slots match.
    version: int = 0
    #: Owned slots fenced by a cut-over in progress.
    fenced: set[int] = field(default_factory=set)
    #: Slots being imported by a move, not served until the map gives them.
    importing: set[int] = field(default_factory=set)

    def check(self, slots: Iterable[int], request_version: int) -> Verdict:
        """The verdict for a request that touches ``slots``, routed at ``request_version``.

        Called after the dedup lookup: a re-sent message already applied is
        answered from the dedup record, whatever the slots' owner is now.
        """
        wanted = set(slots)
        foreign = wanted - self.owned
        if foreign - self.importing and request_version <= self.version:
            return Verdict.MOVED
        if foreign or wanted & self.fenced:
            return Verdict.RETRY
        return Verdict.SERVE

    # -- the source's side ---------------------------------------------------

    def fence(self, slots: Iterable[int]) -> None:
        s = set(slots)
        if not s <= self.owned:
            raise MoveError("only owned slots can be fenced")
        self.fenced |= s

    def unfence(self, slots: Iterable[int]) -> None:
        self.fenced -= set(slots)

    def release(self, slots: Iterable[int], version: int) -> None:
        """The map ``version`` gave the (fenced) slots away: drop them."""
        s = set(slots)
        if not s <= self.fenced:
            raise MoveError("only fenced slots can be released")
        self.owned -= s
        self.fenced -= s
        self.version = max(self.version, version)

    # -- the destination's side ----------------------------------------------

    def begin_import(self, slots: Iterable[int]) -> None:
        s = set(slots)
        if s & self.owned:
            raise MoveError("a partition cannot import a slot it owns")
        self.importing |= s

    def activate(self, slots: Iterable[int], version: int) -> None:
        """The map ``version`` gives the imported slots to this partition."""
        s = set(slots)
        if not s <= self.importing:
            raise MoveError("only imported slots can be activated")
        self.importing -= s
        self.owned |= s
        self.version = max(self.version, version)

    def drop_import(self, slots: Iterable[int]) -> None:
        self.importing -= set(slots)


def plan_pieces(
    manifest: dict[str, Any], common: dict[str, Any], budget: int
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """A move's copy in pieces of about ``budget`` bytes: for each table of the source's
    cut (``manifest``, a ``slots_cut`` answer), the ``slots_cut_read`` of each piece and
    the ``slots_import`` it goes into at the destination (``common``: the import's
    fields).  An embedding table's rows go by ranges of rows, at least one piece even
    when empty; a dense tensor's chunks by groups, an empty group still creating the
    tensor there."""
    reads: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for table in manifest.get("tables", []):
        spec = table["spec"]
        name = spec["name"]
        base = {"op": "slots_import", **common, "spec": spec}
        if "n" in table:
            n, row = int(table["n"]), max(1, int(table["row_bytes"]))
            per = max(1, budget // row)
            for start in range(0, max(n, 1), per):
                count = min(per, n - start)
                read = {"op": "slots_cut_read", "t": name, "start": start, "count": count}
                reads.append((read, base))
        else:
            groups: list[list[int]] = []
            group: list[int] = []
            size = 0
            for c, sz in zip(table["chunks"], table["sizes"], strict=True):
                if group and size + sz > budget:
                    groups.append(group)
                    group, size = [], 0
                group.append(c)
                size += sz
            groups.append(group)
            for group in groups:
                read = {"op": "slots_cut_read", "t": name, "chunks": group}
                reads.append((read, {**base, "chunks": group}))
    return reads
