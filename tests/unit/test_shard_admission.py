"""The shard's admission rules (zps/shard/admission.py), without sockets: every verdict
before the core runs, every reply plan after, and the held answers to background writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from zps.protocol.codec import MsgType
from zps.protocol.messages import Status
from zps.shard import admission
from zps.shard.admission import Admit, Count, HeldAcks, Policy, Refuse, ReplyPlan, Wait
from zps.shard.core import Handled

POLICY = Policy("s-a", roles=False, reply_queue_bytes=100_000, max_message_bytes=10_000)
ROLES = Policy("s-a", roles=True, reply_queue_bytes=100_000, max_message_bytes=10_000)
PUSH: dict[str, Any] = {"op": "push_rows", "t": "e"}
PULL: dict[str, Any] = {"op": "pull_rows", "t": "e"}


@dataclass
class Lease:
    """A session's answers, and which of them the rules asked."""

    lease: bool = True
    in_sync: bool = True
    required: bool = False
    asked: list[str] = field(default_factory=list)

    def may_write(self, now: float) -> bool:
        self.asked.append(f"lease@{now}")
        return self.lease

    def enough_in_sync(self) -> bool:
        self.asked.append("in_sync")
        return self.in_sync

    def short_of_copies(self) -> str:
        return "partition 0: 1 of the 2 copies"

    @property
    def replicas_required(self) -> bool:
        return self.required


def admit(
    header: dict[str, Any],
    *,
    source: bytes = b"c1",
    mtype: MsgType = MsgType.REQUEST,
    policy: Policy = POLICY,
    lease: Lease | None = None,
    held_bytes: int = 0,
    log_waits: bool = False,
) -> admission.Verdict:
    return admission.admit(
        source,
        mtype,
        header,
        writes=admission.mutates(header),
        policy=policy,
        lease=lease or Lease(),
        held_bytes=held_bytes,
        log_waits=log_waits,
        now=7.0,
    )


def refusal(verdict: admission.Verdict) -> tuple[Status, Count | None]:
    assert isinstance(verdict, Refuse), verdict
    return verdict.status, verdict.count


# -- before the core runs ---------------------------------------------------------------


def test_a_read_with_a_lease_is_admitted_whole() -> None:
    lease = Lease(in_sync=False)  # a read does not need copies in sync
    assert admit({"ops": [PULL]}, lease=lease) == Admit(False, False, False, False)
    assert lease.asked == ["lease@7.0"]  # the clock is the caller's


def test_only_a_request_is_served() -> None:
    v = admit({"ops": [PULL]}, mtype=MsgType.HELLO)
    assert refusal(v) == (Status.BAD_REQUEST, Count.MALFORMED)
    assert isinstance(v, Refuse) and "not HELLO" in v.message


def test_a_message_that_does_not_decode_is_malformed() -> None:
    v = admission.malformed("truncated header")
    assert refusal(v) == (Status.BAD_REQUEST, Count.MALFORMED)
    assert v.header() == {"st": "BAD_REQUEST", "msg": "truncated header"}


def test_with_roles_the_dedup_id_must_be_the_senders() -> None:
    forged = {"ops": [PUSH], "cid": b"someone-else", "seq": 1}
    assert refusal(admit(forged, policy=ROLES)) == (Status.BAD_REQUEST, Count.MALFORMED)
    assert isinstance(admit(forged), Admit)  # without roles any id goes
    assert isinstance(admit({**forged, "cid": b"c1"}, policy=ROLES), Admit)
    assert isinstance(admit({"ops": [PUSH]}, policy=ROLES), Admit)  # no cid: the sender's
    # The broker's own requests (a zero byte first, which no peer's identity has).
    assert isinstance(admit(forged, source=b"\0commit", policy=ROLES), Admit)


def test_a_full_link_refuses_before_the_lease_is_asked() -> None:
    lease = Lease()
    v = admit({"ops": [PULL]}, held_bytes=90_001, lease=lease)
    assert refusal(v) == (Status.OVERLOADED, Count.OVERLOADED)
    assert isinstance(v, Refuse) and "shard.reply_queue_bytes (100000)" in v.message
    assert "the broker" in v.message and lease.asked == []
    router = admission.overloaded(POLICY, "this routing broker")
    assert "this routing broker" in router.message and router.count is Count.OVERLOADED


def test_link_full_leaves_room_for_one_full_reply() -> None:
    for held, full in [(0, False), (90_000, False), (90_001, True)]:
        # Nothing held: zmq takes it; 90,000 + 10,000 fits in 100,000.
        assert admission.link_full(held, POLICY) is full
        assert isinstance(admit({"ops": [PULL]}, held_bytes=held), Refuse) is full


def test_without_a_lease_nothing_is_served() -> None:
    v = admit({"ops": [PULL]}, lease=Lease(lease=False))
    assert refusal(v) == (Status.NOT_PRIMARY, None)


def test_a_write_needs_its_copies_in_sync_unless_acks_1() -> None:
    lease = Lease(in_sync=False)
    v = admit({"ops": [PULL, PUSH]}, lease=lease)
    assert refusal(v) == (Status.NOT_ENOUGH_REPLICAS, None)
    assert isinstance(v, Refuse) and v.message == "partition 0: 1 of the 2 copies"
    assert lease.asked == ["lease@7.0", "in_sync"]
    assert admit({"ops": [PUSH], "acks": 1}, lease=lease) == Admit(True, True, False, False)


@pytest.mark.parametrize(
    ("header", "log_waits", "required", "split"),
    [
        ({"er": 1}, True, False, True),  # the log: writes wait for it
        ({"er": 1}, False, True, True),  # acks="all" with replicas required
        ({"er": 1, "acks": 1}, False, True, False),  # acks=1: replicas are not waited for
        ({"er": 1, "acks": 1}, True, True, True),  # ...the log still is
        ({"er": 1}, False, False, False),  # nothing waits: one reply
        ({}, True, True, False),  # the client did not ask
    ],
)
def test_a_reply_in_two_parts_when_the_writes_answer_waits(
    header: dict[str, Any], log_waits: bool, required: bool, split: bool
) -> None:
    v = admit({"ops": [PUSH, PULL], **header}, log_waits=log_waits, lease=Lease(required=required))
    assert isinstance(v, Admit) and v.split is split and v.mutates


def test_lazy_is_the_lz_key() -> None:
    v = admit({"ops": [PUSH], "lz": 1})
    assert isinstance(v, Admit) and v.lazy
    assert admit({"ops": [PUSH], "lz": 1}) is v  # no record made per request


def test_a_shared_memory_refusal_says_which_kind_and_who() -> None:
    busy = admission.shm_refusal("no fds", busy=True, permanent=False, token=None, policy=POLICY)
    assert busy.header() == {
        "st": "OVERLOADED",
        "msg": "shard s-a: no fds",
        "noshm": "busy",
        "by": "s-a",
    }
    assert busy.count is None
    opened = admission.shm_refusal("host", busy=False, permanent=True, token=None, policy=POLICY)
    assert opened.header()["noshm"] == "open"
    gone = admission.shm_refusal("reused", busy=False, permanent=False, token=9, policy=POLICY)
    assert gone.header()["noshm"] == "gone" and gone.header()["tok"] == [9]


def test_a_request_routed_by_a_replaced_broker_is_retried() -> None:
    assert admission.REPLACED.header()["st"] == "NOT_PRIMARY"


def test_mutates_names_only_state_changing_operations() -> None:
    assert admission.mutates({"ops": [PULL, PUSH]})
    assert not admission.mutates({"ops": [PULL, {"op": ["push_rows"]}, "push_rows", 3]})
    assert not admission.mutates({"ops": "push_rows"})


# -- after the core ran -----------------------------------------------------------------

READ = Admit(False, False, False, False)
WRITE = Admit(True, False, False, False)
WRITE_1 = Admit(True, True, False, False)
LAZY = Admit(True, False, True, True)


def done(**kw: Any) -> Handled:
    return Handled([b""], kw.pop("changed", False), **kw)


def plan(admitted: Admit, handled: Handled, size: int = 10, behind: bool = False) -> ReplyPlan:
    return admission.plan(admitted, handled, reply_bytes=size, log_behind=behind, policy=POLICY)


def test_a_read_is_answered_at_once() -> None:
    assert plan(READ, done(carried=True)) == ReplyPlan(Wait.NOW)
    assert plan(READ, done(), behind=True) == ReplyPlan(Wait.NOW)  # reads never wait


def test_a_reply_that_goes_at_once_with_nothing_else_to_do_is_the_shared_plan() -> None:
    """The driver tells admission.NOW by identity and does nothing more for it: every
    plan equal to it is it, and none that asks for more is."""
    for p in (
        plan(READ, done(carried=True)),
        plan(READ, done(duplicate=True), behind=True),
        plan(WRITE, done(carried=True)),  # a write that changed nothing, log in step
    ):
        assert p is admission.NOW
    for p in (
        plan(READ, done(), size=10**6),
        plan(WRITE, done(), behind=True),
        plan(WRITE, done(duplicate=True)),
        plan(WRITE, done(changed=True)),
    ):
        assert p is not admission.NOW and p != admission.NOW


def test_a_reply_over_the_limit_is_refused_and_gives_back_what_it_carried() -> None:
    limit = 10_000 - admission.REPLY_MARGIN
    p = plan(READ, done(carried=True), size=limit + 1)
    assert p.wait is Wait.NOW and p.give_back
    assert p.too_large is not None and "shard.max_message_bytes (10000)" in p.too_large
    assert plan(READ, done(), size=limit).too_large is None
    assert not plan(READ, done(carried=False), size=10**6).give_back


@pytest.mark.parametrize(("admitted", "wait"), [(WRITE, Wait.REPLICAS), (WRITE_1, Wait.LOG)])
def test_a_resent_write_waits_for_its_first_copy(admitted: Admit, wait: Wait) -> None:
    p = plan(admitted, done(duplicate=True, carried=True))
    assert p == ReplyPlan(wait, give_back=True)
    # A re-sent read is answered at once (reads run again).
    assert plan(READ, done(duplicate=True)) == ReplyPlan(Wait.NOW)


def test_a_write_that_changed_nothing_waits_for_a_log_behind() -> None:
    assert plan(WRITE, done(carried=True), behind=True) == ReplyPlan(Wait.LOG)
    assert plan(WRITE, done(carried=True)) == ReplyPlan(Wait.NOW)


@pytest.mark.parametrize(("admitted", "wait"), [(WRITE, Wait.REPLICAS), (WRITE_1, Wait.LOG)])
def test_a_change_is_replicated_and_answered_when_held(admitted: Admit, wait: Wait) -> None:
    assert plan(admitted, done(changed=True), size=10**9) == ReplyPlan(wait, replicate=True)


def test_a_split_change_answers_its_reads_at_once_and_holds_a_lazy_final_part() -> None:
    split = done(changed=True, writes_res=[{"st": "OK"}, None])
    assert plan(LAZY, split) == ReplyPlan(
        Wait.REPLICAS, replicate=True, first_part=True, hold_final=True
    )
    eager = Admit(True, False, True, False)
    assert plan(eager, split) == ReplyPlan(Wait.REPLICAS, replicate=True, first_part=True)
    lazy_1 = Admit(True, True, True, True)  # acks=1: nothing to hold for the replicas
    assert plan(lazy_1, split) == ReplyPlan(Wait.LOG, replicate=True, first_part=True)
    # Not split (no reads): the whole reply is the final one, never held.
    assert not plan(LAZY, done(changed=True)).hold_final


# -- held answers -------------------------------------------------------------------------


def test_held_answers_ride_on_the_next_reply() -> None:
    acks = HeldAcks(0.01)
    acks.seen(b"c", lazy=True)
    assert acks.hold(b"c", 1, [{"st": "OK"}]) is None  # held: the driver's timer runs
    assert acks.hold(b"c", 2, [{"st": "OK"}]) is None
    assert acks.carry(b"c") == [[1, [{"st": "OK"}]], [2, [{"st": "OK"}]]]
    acks.carried(b"c")
    assert acks.carry(b"c") is None and len(acks) == 0


def test_a_waiting_client_is_answered_at_once() -> None:
    acks = HeldAcks(0.01)
    acks.seen(b"c", lazy=False)  # flush(): it waits
    assert acks.waiting(b"c")
    assert acks.hold(b"c", 1, []) == [[1, []]]
    acks.seen(b"c", lazy=True)
    assert not acks.waiting(b"c") and acks.hold(b"c", 2, []) is None


def test_no_holding_and_a_full_hold_send_at_once() -> None:
    assert HeldAcks(0.0).hold(b"c", 1, []) == [[1, []]]
    acks = HeldAcks(1.0, max_held=2)
    assert acks.hold(b"c", 1, []) is None
    assert acks.hold(b"c", 2, []) == [[1, []], [2, []]]


def test_answers_given_back_go_first_and_the_timer_takes_all() -> None:
    acks = HeldAcks(1.0)
    acks.hold(b"c", 3, [])
    acks.give_back(b"c", [[1, []], [2, []]])
    acks.hold(b"d", 4, [])
    assert acks.release() == {b"c": [[1, []], [2, []], [3, []]], b"d": [[4, []]]}
    assert len(acks) == 0


def test_take_is_seen_then_carry() -> None:
    acks = HeldAcks(1.0)
    assert acks.take(b"c", lazy=False) is None and acks.waiting(b"c")
    assert acks.take(b"c", lazy=True) is None and not acks.waiting(b"c")
    acks.hold(b"c", 1, [])
    assert acks.take(b"c", lazy=True) == [[1, []]]


def test_waiting_clients_are_forgotten_past_the_bound() -> None:
    acks = HeldAcks(1.0, max_clients=2)
    for c in (b"a", b"b", b"c"):
        acks.seen(c, lazy=False)
    assert acks.waiting(b"c") and not acks.waiting(b"a")
