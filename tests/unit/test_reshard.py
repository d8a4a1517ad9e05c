"""Live resharding, the pure part: the plan of slot moves, one move's state machine,
and the fencing rule shards apply (zps/core/reshard.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zps.core.reshard import (
    Move,
    MoveError,
    MoveState,
    SlotMove,
    SlotOwnership,
    Undo,
    Verdict,
    plan_moves,
    quotas,
)
from zps.core.routing import default_slot_map

# -- the plan -----------------------------------------------------------------


def check_plan(old_map: np.ndarray, new_n: int, max_slots: int = 256) -> int:
    plan = plan_moves(old_map, new_n, max_slots_per_move=max_slots)
    new_map = plan.new_slot_map
    n_slots = old_map.size
    counts = np.bincount(new_map, minlength=new_n)
    assert counts.size == new_n  # no slot on a removed partition
    assert counts.max() - counts.min() <= 1
    assert counts.sum() == n_slots
    # Every moved slot is in exactly one move, from its old owner to its new one.
    moved = [s for m in plan.moves for s in m.slots]
    assert len(moved) == len(set(moved)) == int((new_map != old_map).sum())
    for m in plan.moves:
        assert 0 < len(m.slots) <= max_slots and list(m.slots) == sorted(m.slots)
        assert m.source != m.dest
        assert all(old_map[s] == m.source and new_map[s] == m.dest for s in m.slots)
    assert [m.move_id for m in plan.moves] == list(range(len(plan.moves)))
    # The fewest moves an even map over new_n partitions allows.
    held = np.bincount(old_map, minlength=max(new_n, int(old_map.max()) + 1))
    share = quotas(held.tolist(), n_slots, new_n)
    least = sum(max(0, int(held[p]) - (share[p] if p < new_n else 0)) for p in range(held.size))
    assert plan.moved_slots == least
    return plan.moved_slots


@pytest.mark.parametrize(
    ("old", "new", "moved"),
    [(2, 4, 2048), (4, 2, 2048), (1, 3, 2730), (3, 4, 1024), (4, 3, 1024), (2, 2, 0), (4, 1, 3072)],
)
def test_plan_from_the_default_map(old: int, new: int, moved: int) -> None:
    assert check_plan(default_slot_map(4096, old), new) == moved


def test_plan_2_to_4_keeps_half_of_each_partition_and_groups_moves() -> None:
    plan = plan_moves(default_slot_map(4096, 2), 4, max_slots_per_move=512)
    assert {(m.source, m.dest) for m in plan.moves} == {(0, 2), (1, 3)}
    assert all(len(m.slots) == 512 for m in plan.moves) and len(plan.moves) == 4
    assert (plan.old_partitions, plan.new_partitions) == (2, 4)


@pytest.mark.parametrize(("old", "new"), [(2, 4), (4, 2), (1, 4), (4, 8), (8, 2), (2, 1)])
def test_plan_from_round_robin_is_round_robin(old: int, new: int) -> None:
    plan = plan_moves(default_slot_map(4096, old), new)
    assert (plan.new_slot_map == default_slot_map(4096, new)).all()


@pytest.mark.parametrize(("old", "new"), [(3, 4), (4, 3), (3, 5), (5, 6), (2, 3), (6, 4)])
def test_plan_keeps_a_dense_tensors_chunks_spread(old: int, new: int) -> None:
    # Not round-robin in the end (that would take extra moves), but any 8 consecutive
    # slots (the chunks of a 16 MiB tensor) still land on 3 partitions or more.
    new_map = plan_moves(default_slot_map(4096, old), new).new_slot_map
    spread = [len(set(new_map[start : start + 8].tolist())) for start in range(4096 - 8)]
    assert min(spread) >= 3


def test_plan_extra_slots_go_to_the_fullest_partitions() -> None:
    # 10 slots over 3 partitions: 4, 3, 3; partition 1 holds 5, so it keeps the extra one.
    old = np.array([0, 1, 1, 1, 1, 1, 2, 2, 2, 2])
    plan = plan_moves(old, 3)
    assert np.bincount(plan.new_slot_map).tolist() == [3, 4, 3]
    assert plan.moved_slots == 2


def test_plan_with_an_empty_old_partition() -> None:
    old = np.zeros(8, dtype=np.int32)  # partition 1 exists but holds nothing
    plan = plan_moves(old, 2, old_partitions=2)
    assert plan.moved_slots == 4 and plan.old_partitions == 2


@given(
    st.lists(st.integers(0, 5), min_size=8, max_size=64),
    st.integers(1, 8),
    st.integers(1, 10),
)
@settings(max_examples=200, deadline=None)
def test_plan_is_minimal_and_even_for_any_map(owners: list[int], new_n: int, cap: int) -> None:
    old = np.array(owners)
    new_n = min(new_n, old.size)
    check_plan(old, new_n, cap)


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        plan_moves(np.array([], dtype=np.int32), 1)
    with pytest.raises(ValueError, match=r"1\.\.4"):
        plan_moves(np.zeros(4, dtype=np.int32), 5)
    with pytest.raises(ValueError, match="only 1"):
        plan_moves(np.array([0, 1]), 1, old_partitions=1)
    with pytest.raises(ValueError, match="negative"):
        plan_moves(np.array([0, -1]), 1)
    with pytest.raises(ValueError, match="max_slots"):
        plan_moves(np.zeros(4, dtype=np.int32), 2, max_slots_per_move=0)


# -- one move -------------------------------------------------------------------


def new_move() -> Move:
    return Move(SlotMove(0, source=0, dest=2, slots=(0, 2, 4)), planned_version=7)


def to_cut_over(m: Move) -> None:
    m.begin_snapshot(source_epoch=1, dest_epoch=3, lsn=100)
    m.snapshot_loaded(dest_epoch=3)
    m.progress(source_lsn=140, applied_lsn=130, durable_lsn=120)
    m.fenced(fence_lsn=150, source_epoch=1)


def state(m: Move) -> MoveState:
    """The move's state, read afresh (for the type checker: transitions change it)."""
    return m.state


def test_a_move_from_plan_to_done() -> None:
    m = new_move()
    assert state(m) is MoveState.PLANNED and m.lag == 0
    m.begin_snapshot(source_epoch=1, dest_epoch=3, lsn=100)
    assert state(m) is MoveState.SNAPSHOT
    m.snapshot_loaded(dest_epoch=3)
    assert state(m) is MoveState.CATCH_UP and m.applied_lsn == 100
    m.progress(source_lsn=180, applied_lsn=150)
    assert m.lag == 30
    assert not m.ready_to_fence(max_lag=10)
    m.progress(applied_lsn=175, durable_lsn=170)
    assert m.ready_to_fence(max_lag=10)
    m.progress(source_lsn=181)
    m.fenced(fence_lsn=182, source_epoch=1)
    assert state(m) is MoveState.CUT_OVER and not m.ready_to_fence(10)
    m.progress(source_lsn=300)  # the source goes on with its other slots
    assert m.lag == 7  # only up to the fence
    m.progress(applied_lsn=182)
    assert not m.can_publish()  # applied, but not yet on every in-sync copy
    with pytest.raises(MoveError, match="holds the slots up to 170"):
        m.publish(8)
    m.progress(durable_lsn=182)
    assert m.can_publish()
    m.publish(8)
    assert state(m) is MoveState.DONE and m.published_version == 8 and not m.active


def test_transitions_out_of_order_are_refused() -> None:
    m = new_move()
    with pytest.raises(MoveError, match="planned, not snapshot"):
        m.snapshot_loaded(dest_epoch=3)
    with pytest.raises(MoveError):
        m.fenced(10, 1)
    m.begin_snapshot(1, 3, 100)
    with pytest.raises(MoveError, match="changed primary"):
        m.snapshot_loaded(dest_epoch=4)
    m.snapshot_loaded(3)
    with pytest.raises(MoveError, match="never go back"):
        m.progress(applied_lsn=99)
    with pytest.raises(MoveError, match="more than the source"):
        m.progress(applied_lsn=120)  # the source reported only 100
    m.progress(source_lsn=130, applied_lsn=120)
    with pytest.raises(MoveError, match="precede"):
        m.fenced(125, 1)
    with pytest.raises(MoveError, match="another primary"):
        m.fenced(130, 2)
    m.fenced(130, 1)
    with pytest.raises(MoveError, match="follows the fence"):
        m.progress(source_lsn=200, applied_lsn=131)
    m.progress(applied_lsn=130, durable_lsn=130)
    with pytest.raises(MoveError, match="newer map version"):
        m.publish(7)
    assert m.state is MoveState.CUT_OVER  # a refused transition changes nothing


@pytest.mark.parametrize(
    ("steps", "undo"),
    [
        (0, ()),
        (1, (Undo.DROP_AT_DEST,)),
        (2, (Undo.DROP_AT_DEST,)),
        (3, (Undo.UNFENCE_SOURCE, Undo.DROP_AT_DEST)),
    ],
)
def test_cancel_undoes_what_was_done(steps: int, undo: tuple[Undo, ...]) -> None:
    m = new_move()
    actions: list[Callable[[], None]] = [
        lambda: m.begin_snapshot(1, 3, 100),
        lambda: m.snapshot_loaded(3),
        lambda: m.fenced(100, 1),
    ]
    for act in actions[:steps]:
        act()
    assert m.cancel("operator") == undo
    assert m.state is MoveState.CANCELLED and m.reason == "operator"
    assert m.cancel("again") == undo  # idempotent
    with pytest.raises(MoveError):
        m.begin_snapshot(1, 3, 100)


def test_a_published_move_cannot_be_cancelled() -> None:
    m = new_move()
    to_cut_over(m)
    m.progress(applied_lsn=150, durable_lsn=150)
    m.publish(9)
    with pytest.raises(MoveError, match="moving the slots back"):
        m.cancel("too late")
    assert m.dest_failover(4) == () and m.source_failover(2) == ()
    assert m.state is MoveState.DONE


def test_source_failover_cancels_before_the_fence_and_not_after() -> None:
    m = new_move()
    m.begin_snapshot(1, 3, 100)
    m.snapshot_loaded(3)
    assert m.source_failover(1) == ()  # not a new epoch
    assert m.source_failover(2) == (Undo.DROP_AT_DEST,)
    assert m.state is MoveState.CANCELLED and "epoch 2" in m.reason

    m = new_move()
    to_cut_over(m)
    assert m.source_failover(2) == ()  # the fence is on the new primary too
    assert m.state is MoveState.CUT_OVER and m.source_epoch == 2
    m.progress(applied_lsn=150, durable_lsn=150)
    m.publish(8)


def test_dest_failover_before_publishing_cancels() -> None:
    m = new_move()
    to_cut_over(m)
    assert m.dest_failover(4) == (Undo.UNFENCE_SOURCE, Undo.DROP_AT_DEST)
    assert m.state is MoveState.CANCELLED


# -- the fencing rule -------------------------------------------------------------


def test_ownership_verdicts_through_a_move() -> None:
    src = SlotOwnership(owned={0, 1, 2, 3}, version=5)
    dst = SlotOwnership(owned={8, 9}, version=5)
    assert src.check([0, 1], 5) is Verdict.SERVE
    assert dst.check([0], 5) is Verdict.MOVED  # never owned it at this version
    dst.begin_import([0, 1])
    assert dst.check([0], 5) is Verdict.RETRY  # importing: not served yet
    src.fence([0, 1])
    assert src.check([0], 5) is Verdict.RETRY
    assert src.check([2, 3], 5) is Verdict.SERVE  # the other slots are unaffected
    assert src.check([1, 2], 5) is Verdict.RETRY  # one fenced slot holds the message
    src.release([0, 1], 6)
    dst.activate([0, 1], 6)
    assert src.check([0], 5) is Verdict.MOVED
    assert src.check([0], 6) is Verdict.MOVED
    assert dst.check([0, 1, 8], 6) is Verdict.SERVE
    assert dst.check([2], 7) is Verdict.RETRY  # routed by a newer map than the shard's
    with pytest.raises(MoveError):
        src.fence([0])
    with pytest.raises(MoveError):
        src.release([2], 7)
    with pytest.raises(MoveError):
        dst.begin_import([8])
    with pytest.raises(MoveError):
        dst.activate([5], 7)


def test_ownership_after_a_cancelled_move() -> None:
    src = SlotOwnership(owned={0, 1}, version=5)
    dst = SlotOwnership(owned=set(), version=5)
    dst.begin_import([1])
    src.fence([1])
    src.unfence([1])
    dst.drop_import([1])
    assert src.check([1], 5) is Verdict.SERVE
    assert dst.check([1], 5) is Verdict.MOVED


# -- a move under load: exactly once --------------------------------------------


@dataclass
class Part:
    """A partition's primary: one counter per slot, a log, a dedup record."""

    own: SlotOwnership
    values: dict[int, int] = field(default_factory=dict)
    log: list[tuple[int, int, int]] = field(default_factory=list)  # (lsn, slot, delta)
    dedup: set[tuple[int, int]] = field(default_factory=set)

    @property
    def lsn(self) -> int:
        return len(self.log)

    def request(self, key: tuple[int, int], slot: int, delta: int, version: int) -> Verdict:
        if key in self.dedup:  # the dedup lookup comes before ownership
            return Verdict.SERVE
        verdict = self.own.check([slot], version)
        if verdict is Verdict.SERVE:
            self.values[slot] = self.values.get(slot, 0) + delta
            self.log.append((self.lsn + 1, slot, delta))
            self.dedup.add(key)
        return verdict


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["write", "write", "lost", "advance", "advance", "stream"]),
            st.integers(0, 7),
            st.integers(1, 9),
        ),
        max_size=60,
    ),
    cancel_at=st.sampled_from([None, 1, 2, 3]),
    kill_source_at=st.sampled_from([None, 1, 3]),
)
# A write to a moving slot between the fence and the cut-over; an applied write whose
# acknowledgement was lost, re-sent after the cut-over.
@example(ops=[("advance", 0, 1)] * 3 + [("write", 0, 5)], cancel_at=None, kill_source_at=None)
@example(ops=[("lost", 2, 3)] + [("advance", 0, 1)] * 4, cancel_at=None, kill_source_at=None)
@settings(max_examples=300, deadline=None)
def test_a_move_under_load_loses_and_doubles_nothing(
    ops: list[tuple[str, int, int]], cancel_at: int | None, kill_source_at: int | None
) -> None:
    """Writes to 8 slots (partition 0 holds the even ones, 1 the odd ones) while the
    even slots 0 and 2 move to partition 1.  Clients route by the map they hold, retry
    RETRY, fetch the map on MOVED and re-send; some acknowledgements are lost and
    the message is re-sent as it was.  Every acknowledged write is applied once."""
    plan_map = {s: s % 2 for s in range(8)}
    version = 1
    parts = [
        Part(SlotOwnership({0, 2, 4, 6}, 1)),
        Part(SlotOwnership({1, 3, 5, 7}, 1)),
    ]
    moving = (0, 2)
    move = Move(SlotMove(0, 0, 1, moving), planned_version=1)
    dest_stage: dict[int, int] = {}  # the destination's imported slots, not yet served
    dest_applied = -1
    pending: list[tuple[tuple[int, int], int, int, int, int]] = []  # key, slot, delta, part, ver
    acked: dict[tuple[int, int], tuple[int, int]] = {}
    seq = 0
    stage = 0

    def stream(upto: int | None = None) -> None:
        nonlocal dest_applied
        end = parts[0].lsn if upto is None else upto
        for lsn, slot, delta in parts[0].log[dest_applied:end]:
            if slot in moving:
                dest_stage[slot] = dest_stage.get(slot, 0) + delta
            dest_applied = lsn
        move.progress(source_lsn=parts[0].lsn, applied_lsn=dest_applied, durable_lsn=dest_applied)

    def advance() -> None:
        nonlocal stage, version, dest_applied
        if not move.active:
            return
        stage += 1
        if stage == cancel_at:
            for undo in move.cancel("test"):
                if undo is Undo.UNFENCE_SOURCE:
                    parts[0].own.unfence(moving)
                else:
                    parts[1].own.drop_import(moving)
                    dest_stage.clear()
            return
        if stage == kill_source_at:
            # A new primary with the same log (an in-sync replica): the move
            # survives only if the fence is down already.
            for undo in move.source_failover(2):
                if undo is Undo.DROP_AT_DEST:
                    parts[1].own.drop_import(moving)
                    dest_stage.clear()
            if not move.active:
                return
        if move.state is MoveState.PLANNED:
            move.begin_snapshot(1, 1, parts[0].lsn)
            parts[1].own.begin_import(moving)
            dest_stage.update({s: parts[0].values.get(s, 0) for s in moving})
            dest_applied = parts[0].lsn
        elif move.state is MoveState.SNAPSHOT:
            move.snapshot_loaded(1)
        elif move.state is MoveState.CATCH_UP:
            parts[0].own.fence(moving)
            move.fenced(parts[0].lsn, move.source_epoch)
        elif move.state is MoveState.CUT_OVER:
            stream(move.fence_lsn)
            version += 1
            move.publish(version)
            parts[0].own.release(moving, version)
            for s in moving:
                parts[0].values.pop(s, None)
            parts[1].values.update(dest_stage)
            parts[1].own.activate(moving, version)
            for s in moving:
                plan_map[s] = 1

    def send(item: tuple[tuple[int, int], int, int, int, int], lose: bool) -> None:
        key, slot, delta, part, ver = item
        verdict = parts[part].request(key, slot, delta, ver)
        if verdict is Verdict.SERVE and not lose:
            acked[key] = (slot, delta)
        elif verdict is Verdict.MOVED:  # not applied: split again by the current map
            pending.append(((key[0], key[1] + 1000), slot, delta, plan_map[slot], version))
        else:  # RETRY, or the acknowledgement was lost: the same message again
            pending.append(item)

    for kind, slot, delta in ops:
        if kind in ("write", "lost"):
            seq += 1
            send(((0, seq), slot, delta, plan_map[slot], version), lose=kind == "lost")
        elif kind == "advance":
            advance()
        elif move.state in (MoveState.CATCH_UP, MoveState.CUT_OVER):
            stream(move.fence_lsn if move.state is MoveState.CUT_OVER else None)
        if pending and kind == "write":
            send(pending.pop(0), lose=False)
    for _ in range(5):
        advance()
    for _ in range(1000):
        if not pending:
            break
        send(pending.pop(0), lose=False)
    assert not pending
    assert move.state in (MoveState.DONE, MoveState.CANCELLED)

    expected: dict[int, int] = {}
    for slot, delta in acked.values():
        expected[slot] = expected.get(slot, 0) + delta
    served = {
        s: parts[p].values.get(s, 0) for s, p in plan_map.items() if parts[p].values.get(s, 0)
    }
    assert served == {s: v for s, v in expected.items() if v}
    assert set(plan_map[s] for s in moving) == ({1} if move.state is MoveState.DONE else {0})
