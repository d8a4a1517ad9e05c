"""The Binary Star state machine: every transition, terms and fencing."""

from __future__ import annotations

import itertools

import pytest

from zps.core.bstar import BinaryStar, PairError, PairRole, State

T = 1.0  # peer timeout


def primary(now: float = 0.0, term: int = 0) -> BinaryStar:
    return BinaryStar(PairRole.PRIMARY, timeout=T, now=now, term=term)


def backup(now: float = 0.0, term: int = 0) -> BinaryStar:
    return BinaryStar(PairRole.BACKUP, timeout=T, now=now, term=term)


def run(star: BinaryStar, start: float, end: float) -> None:
    """The broker runs from ``start`` to ``end``, its driver ticking every tenth of the
    timeout (rule 6: a broker not ticked for a timeout was paused)."""
    steps = max(1, round((end - start) / (T / 10)))
    for i in range(1, steps + 1):
        star.tick(start + (end - start) * i / steps)


def exchange(a: BinaryStar, b: BinaryStar, now: float) -> None:
    """One heartbeat each way."""
    a.on_peer(*b.beat(), now)
    b.on_peer(*a.beat(), now)


def test_start_states() -> None:
    assert primary().state is State.PRIMARY
    assert backup().state is State.BACKUP
    with pytest.raises(ValueError):
        BinaryStar(PairRole.PRIMARY, timeout=0, now=0)
    with pytest.raises(ValueError):
        BinaryStar(PairRole.PRIMARY, timeout=1, now=0, term=-1)


def test_primary_meets_backup_primary_becomes_active_backup_passive() -> None:
    a, b = primary(), backup()
    t = a.on_peer(State.BACKUP, 0, 0.1)
    assert t is not None and t.activated and t.old is State.PRIMARY
    assert a.state is State.ACTIVE and a.term == 1
    t = b.on_peer(*a.beat(), 0.1)
    assert t is not None and t.new is State.PASSIVE and not t.activated
    assert b.term == 1


def test_backup_ignores_a_starting_primary() -> None:
    b = backup()
    assert b.on_peer(State.PRIMARY, 0, 0.1) is None
    assert b.state is State.BACKUP


def test_a_pair_started_whole_the_newer_record_takes_over() -> None:
    # The backup served after the primary: its record (term 2) is newer than the
    # primary's (term 1, a higher version): the backup takes over, the primary stands by.
    a = BinaryStar(PairRole.PRIMARY, timeout=T, now=0.0, term=1, record=(1, 9))
    b = BinaryStar(PairRole.BACKUP, timeout=T, now=0.0, term=2, record=(2, 4))
    assert a.on_peer(State.BACKUP, b.term, 0.1, b.record) is None
    assert a.state is State.PRIMARY
    t = b.on_peer(State.PRIMARY, a.term, 0.1, a.record)
    assert t is not None and t.activated and b.term == 4
    t = a.on_peer(*b.beat(), 0.2, b.record)
    assert t is not None and t.new is State.PASSIVE and a.term == 4
    # Same term: the higher version wins.
    b = BinaryStar(PairRole.BACKUP, timeout=T, now=0.0, record=(3, 7))
    assert b.on_peer(State.PRIMARY, 3, 0.1, (3, 6)) is not None and b.active
    # Equal records, or a peer that does not say: the primary.
    a = BinaryStar(PairRole.PRIMARY, timeout=T, now=0.0, record=(3, 7))
    t = a.on_peer(State.BACKUP, 3, 0.1, (3, 7))
    assert t is not None and t.activated
    b = BinaryStar(PairRole.BACKUP, timeout=T, now=0.0, record=(3, 7))
    assert b.on_peer(State.PRIMARY, 3, 0.1, (3, 7)) is None
    assert b.on_peer(State.PRIMARY, 3, 0.1) is None and b.state is State.BACKUP
    for bad in ((1,), (-1, 0), (1, True), [1, 2]):
        with pytest.raises(ValueError, match="record"):
            a.on_peer(State.BACKUP, 3, 0.2, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="record"):
        BinaryStar(PairRole.PRIMARY, timeout=T, now=0.0, record=(0, -2))


def test_primary_meets_active_backup_goes_passive() -> None:
    a = primary(term=1)
    t = a.on_peer(State.ACTIVE, 2, 0.1)
    assert t is not None and t.new is State.PASSIVE
    assert a.term == 2


def test_primary_waits_for_a_passive_backup_to_take_over() -> None:
    a = primary()
    assert a.on_peer(State.PASSIVE, 2, 0.1) is None
    assert a.state is State.PRIMARY and a.term == 2


def test_passive_takes_over_when_the_peer_restarts() -> None:
    for peer in (State.PRIMARY, State.BACKUP):
        role = PairRole.BACKUP if peer is State.PRIMARY else PairRole.PRIMARY
        x = BinaryStar(role, timeout=T, now=0.0, term=3)
        x.state = State.PASSIVE
        t = x.on_peer(peer, 0, 0.1)
        assert t is not None and t.activated
        assert x.failovers == 1


def test_two_passive_brokers_the_primary_takes_over() -> None:
    a, b = primary(term=2), backup(term=2)
    a.state = b.state = State.PASSIVE
    assert b.on_peer(State.PASSIVE, 2, 0.1) is None
    t = a.on_peer(State.PASSIVE, 2, 0.1)
    assert t is not None and t.activated and a.term == 3


def test_two_active_brokers_the_higher_term_wins() -> None:
    a, b = primary(), backup()
    exchange(a, b, 0.0)
    assert a.active and b.state is State.PASSIVE
    # a is paused; b takes over when a client asks after the timeout.
    run(b, 0.0, 2.0)
    serve, t = b.on_client(2.0)
    assert serve and t is not None and t.activated and b.term == 2
    # a resumes, still believing it is active: b's beat fences it.
    t = a.on_peer(*b.beat(), 2.1)
    assert t is not None and t.deactivated and a.state is State.PASSIVE and a.term == 2
    # and b, hearing from a passive peer, stays active.
    assert b.on_peer(*a.beat(), 2.1) is None and b.active


def test_active_keeps_serving_when_the_peer_reports_a_lower_term() -> None:
    a = primary(term=3)
    a.state = State.ACTIVE
    assert a.on_peer(State.ACTIVE, 2, 0.1) is None and a.active
    for s in (State.BACKUP, State.PASSIVE):
        assert a.on_peer(s, 2, 0.2) is None and a.active


def test_equal_terms_both_active_the_primary_wins() -> None:
    # Cannot happen through activation (parity), but a forced state resolves the same way.
    b = backup(term=4)
    b.state = State.ACTIVE
    t = b.on_peer(State.ACTIVE, 4, 0.1)
    assert t is not None and t.new is State.PASSIVE
    a = primary(term=4)
    a.state = State.ACTIVE
    assert a.on_peer(State.ACTIVE, 4, 0.1) is None and a.active


def test_misconfigured_pairs_are_refused() -> None:
    with pytest.raises(PairError, match="primary"):
        primary().on_peer(State.PRIMARY, 0, 0.1)
    with pytest.raises(PairError, match="backup"):
        backup().on_peer(State.BACKUP, 0, 0.1)
    with pytest.raises(ValueError):
        primary().on_peer(State.BACKUP, -1, 0.1)


def test_clients_active_serves() -> None:
    a = primary()
    a.on_peer(State.BACKUP, 0, 0.0)
    assert a.on_client(0.1) == (True, None)


def test_backup_never_serves_on_its_own() -> None:
    b = backup()
    for now in (0.0, 10.0, 100.0):
        assert b.on_client(now) == (False, None)
    assert b.state is State.BACKUP


def test_lone_primary_serves_after_the_timeout() -> None:
    a = primary(now=0.0)
    assert a.on_client(0.5) == (False, None)
    serve, t = a.on_client(1.5)
    assert serve and t is not None and t.activated and a.term == 1
    assert a.failovers == 0  # a start, not a failover


def test_failover_needs_both_a_lost_peer_and_a_client() -> None:
    a, b = primary(), backup()
    exchange(a, b, 0.0)
    assert b.state is State.PASSIVE
    # the peer is alive: a client asking does not make the backup take over
    assert b.on_client(0.5) == (False, None)
    # the peer is lost, but nobody asks: still passive
    assert not b.peer_alive(1.5) and b.state is State.PASSIVE
    # lost and asked: take over, with a new (even) term above every term seen
    serve, t = b.on_client(1.5)
    assert serve and t is not None and t.activated and t.old is State.PASSIVE
    assert b.term == 2 and b.failovers == 1


def test_peer_heartbeats_keep_it_alive() -> None:
    a, b = primary(), backup()
    exchange(a, b, 0.0)
    for now in (0.8, 1.6, 2.4):
        b.on_peer(*a.beat(), now)
        assert b.on_client(now + 0.5) == (False, None)


def test_terms_are_disjoint_and_increasing() -> None:
    a, b = primary(), backup()
    exchange(a, b, 0.0)
    terms = [a.term]
    now = 0.0
    for _ in range(6):
        active, passive = (a, b) if a.active else (b, a)
        run(passive, now, now + 2.0)
        now += 2.0
        serve, t = passive.on_client(now)  # the active one went silent
        assert serve and t is not None
        active.on_peer(*passive.beat(), now)
        assert not active.active and passive.active
        terms.append(passive.term)
    assert terms == sorted(set(terms))
    assert all(t % 2 == 1 for t in terms[::2]) and all(t % 2 == 0 for t in terms[1::2])


def test_a_newer_term_seen_elsewhere_fences_the_active_broker() -> None:
    a = primary()
    a.on_peer(State.BACKUP, 0, 0.0)
    assert a.active and a.term == 1
    assert a.on_term(1, 0.1) is None and a.active
    t = a.on_term(4, 0.2)
    assert t is not None and t.deactivated and a.term == 4
    # a passive broker only remembers it, so its next activation is above it
    assert a.on_term(6, 0.3) is None and a.term == 6
    run(a, 0.3, 5.0)
    serve, t = a.on_client(5.0)
    assert serve and t is not None and a.term == 7


def test_a_paused_broker_fenced_on_resume_does_not_take_over_at_once() -> None:
    """Paused past its peer's timeout while the peer took over, it resumes and reads a
    newer term, then the client requests that queued up meanwhile: they must not make
    it take over again before its peer's beats could be read."""
    a = primary()
    a.on_peer(State.BACKUP, 0, 0.0)
    assert a.active
    t = a.on_term(2, 10.0)
    assert t is not None and t.deactivated
    assert a.on_client(10.01) == (False, None)
    serve, t = a.on_client(10.0 + a.timeout + 0.01)  # the peer really is silent
    assert serve and t is not None and t.activated and a.term == 3


def test_never_two_active_brokers_in_one_term() -> None:
    """Any interleaving of beats and client requests: no term is held active by both."""
    for seq in itertools.product(("a", "b", "ca", "cb", "run", "pause"), repeat=6):
        a, b = primary(), backup()
        now = 0.0
        held: dict[int, str] = {}
        for step in seq:
            if step == "run":  # both run on, hearing nothing
                run(a, now, now + 1.5)
                run(b, now, now + 1.5)
                now += 1.5
            elif step == "pause":  # both were paused
                now += 1.5
            elif step == "a":
                b.on_peer(*a.beat(), now)
            elif step == "b":
                a.on_peer(*b.beat(), now)
            elif step == "ca":
                a.on_client(now)
            else:
                b.on_client(now)
            for name, x in (("a", a), ("b", b)):
                if x.active:
                    assert held.setdefault(x.term, name) == name


def test_a_stale_passive_beat_read_after_a_pause_does_not_reactivate() -> None:
    """The primary, paused, is replaced by the backup (term 2); resumed, it is fenced by
    a shard's term 2, then reads the backup's beats queued during the pause: those sent
    while the backup was still passive (term 1) must not make it take over."""
    a = primary()
    a.on_peer(State.BACKUP, 0, 0.0)
    assert a.active and a.term == 1
    t = a.on_term(2, 10.0)
    assert t is not None and t.deactivated
    assert a.on_peer(State.PASSIVE, 1, 10.0) is None and not a.active
    assert a.on_peer(State.ACTIVE, 2, 10.01) is None and not a.active
    # Both truly passive at the term both know: the primary takes over.
    t = a.on_peer(State.PASSIVE, 2, 10.1)
    assert t is not None and t.activated and a.term == 3


def test_a_standby_paused_past_the_timeout_reads_a_client_before_its_peer() -> None:
    """Rule 6: the standby, paused past the peer timeout, resumes and reads a client's
    request before the active broker's beats queued for it: its own silence is not the
    peer's, so it does not take over; the queued beat read next keeps it standing by."""
    a, b = primary(), backup()
    exchange(a, b, 0.0)
    run(b, 0.0, 0.5)
    # paused from 0.5 to 2.5 while a stayed active (and moved on to newer records)
    assert b.on_client(2.5) == (False, None) and b.state is State.PASSIVE
    assert b.on_peer(*a.beat(), 2.5) is None and b.state is State.PASSIVE
    run(b, 2.5, 3.0)
    assert b.on_client(3.0) == (False, None) and b.failovers == 0


def test_a_paused_standby_whose_peer_is_gone_takes_over_after_its_own_timeout() -> None:
    """Rule 6: after its pause, the standby waits a whole timeout of its own running
    time for its peer; when none comes, a client's request makes it take over."""
    a, b = primary(), backup()
    exchange(a, b, 0.0)
    run(b, 0.0, 0.5)
    assert b.on_client(2.5) == (False, None)  # resumed: the peer may still speak
    run(b, 2.5, 3.4)
    assert b.on_client(3.4) == (False, None)  # not a whole timeout yet
    run(b, 3.4, 3.6)
    serve, t = b.on_client(3.6)
    assert serve and t is not None and t.activated and b.term == 2 and b.failovers == 1


def test_a_pause_of_the_standby_counts_from_any_event() -> None:
    """Rule 6 holds whichever event comes first after the pause: a newer term seen
    elsewhere (on_term) or a tick also starts the peer's timeout afresh."""
    a, b = primary(), backup()
    exchange(a, b, 0.0)
    b.tick(5.0)
    assert b.peer_alive(5.0) and not b.peer_alive(6.01)
    assert b.on_client(5.5) == (False, None)
    c = backup()
    c.on_peer(State.ACTIVE, 1, 0.0)
    assert c.on_term(1, 5.0) is None  # not newer, but the gap still counts
    assert c.on_client(5.5) == (False, None)


def test_a_peer_heard_again_after_a_silence_is_counted_once_and_own_pauses_are_not() -> None:
    """``peer_silences`` counts the peer heard again after a whole timeout unheard, not
    this broker's own pause (rule 6) nor beats within the timeout."""
    a, b = primary(), backup()
    exchange(a, b, 0.0)
    run(b, 0.0, 0.5)
    b.on_peer(*a.beat(), 0.5)
    assert b.peer_silences == 0
    run(b, 0.5, 2.0)  # running, the peer unheard for more than a timeout
    assert not b.peer_alive(2.0)
    b.on_peer(*a.beat(), 2.0)
    b.on_peer(*a.beat(), 2.1)
    assert b.peer_silences == 1 and b.peer_alive(2.1)
    # Paused from 2.1 to 5.0: the beat read on resuming is no silence of the peer's.
    b.on_peer(*a.beat(), 5.0)
    assert b.peer_silences == 1
