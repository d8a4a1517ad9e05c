"""A broker of a pair never grants from a record older than a term some shard obeyed
(zps/core/bstar.py rules 7 and 8, zps/core/recovery.py ``unpin`` and ``says_in_sync``),
and a shard keeps the highest broker term it obeyed in its data dir
(zps/shard/links.py ``BrokerTerm``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import zps.shard.links as links
from tests.unit.test_bstar import run
from tests.unit.test_cluster import by_node, claim_primary, claim_replica, reg, restarted
from zps.core.bstar import BinaryStar, PairRole, State, Transition
from zps.core.cluster import ClusterState
from zps.protocol.messages import Role
from zps.shard.links import TERM_FILE, BrokerTerm

T = 1.0  # peer timeout


def ask(s: BinaryStar, start: float, end: float) -> tuple[bool, Transition | None]:
    """The broker runs from ``start`` to ``end`` (ticked every tenth of the timeout:
    rule 6), then a client asks it."""
    run(s, start, end)
    return s.on_client(end)


def star(role: PairRole, record: tuple[int, int], term: int | None = None) -> BinaryStar:
    return BinaryStar(role, timeout=T, now=0.0, term=record[0] if term is None else term,
                      record=record)  # fmt: skip


# -- rule 7: a stale record, known before the takeover ------------------------------


def test_a_lone_primary_takes_over_knowing_its_record_stale_when_a_shard_obeyed_newer() -> None:
    """The primary restarts with its record of term 3; the backup served at term 4 and
    is silent now; a shard that obeyed term 4 reports it before a client asks."""
    a = star(PairRole.PRIMARY, (3, 11))
    assert a.on_term(4, 0.1) is None and a.state is State.PRIMARY
    serve, t = ask(a, 0.1, 1.5)
    assert serve and t is not None and t.activated
    assert t.term == 5 and t.stale and t.alone
    assert "stale" in t.reason
    # Decided once: another report of term 4 asks for nothing more.
    assert a.on_term(4, 1.6) is None


def test_a_record_at_the_newest_term_obeyed_is_not_stale() -> None:
    a = star(PairRole.PRIMARY, (4, 11))
    assert a.on_term(4, 0.1) is None
    _, t = ask(a, 0.1, 1.5)
    assert t is not None and t.activated and not t.stale and t.alone
    # The pair heard each other: not alone.
    b = star(PairRole.PRIMARY, (4, 11))
    t = b.on_peer(State.BACKUP, 4, 0.1, (4, 11))
    assert t is not None and t.activated and not t.alone and not t.stale


def test_a_standby_cut_off_from_its_peer_takes_over_knowing_its_record_stale() -> None:
    """The backup stood by at term 1; cut off, it missed the records of the primary's
    term 3; the shards obeyed term 3 and say so."""
    b = star(PairRole.BACKUP, (1, 5))
    b.on_peer(State.ACTIVE, 1, 0.0)
    assert b.state is State.PASSIVE
    assert b.on_term(3, 0.5) is None and b.term == 3
    _, t = ask(b, 0.5, 2.0)
    assert t is not None and t.activated and t.stale and not t.alone and t.term == 4
    # With the peer's record of term 3 received, it is not.
    c = star(PairRole.BACKUP, (1, 5))
    c.on_peer(State.ACTIVE, 1, 0.0)
    c.on_term(3, 0.5)
    c.record = (3, 9)
    _, t = ask(c, 0.5, 2.0)
    assert t is not None and not t.stale


# -- rule 7: a stale record, learnt while active ---------------------------------------


def test_an_active_broker_learns_its_record_stale_from_a_shard_that_comes_back() -> None:
    """Taken over alone at term 5 from a record of term 3; a shard that obeyed term 4
    (powered off meanwhile) registers."""
    a = star(PairRole.PRIMARY, (3, 11))
    _, t = ask(a, 0.1, 1.5)
    assert t is not None and t.activated and not t.stale
    assert a.on_term(3, 1.6) is None and a.on_term(5, 1.6) is None  # its own, or older
    t = a.on_term(4, 1.7)
    assert t is not None and t.stale and not t.activated and not t.deactivated
    assert (t.old, t.new, t.term) == (State.ACTIVE, State.ACTIVE, 5) and a.active
    assert a.on_term(4, 1.8) is None  # once
    # A newer term than its own still fences it (rule 3).
    t = a.on_term(6, 1.9)
    assert t is not None and t.deactivated


def test_an_active_broker_learns_its_record_stale_from_its_peer_starting() -> None:
    """The backup starts with the record it served at term 4."""
    a = star(PairRole.PRIMARY, (3, 11))
    ask(a, 0.0, 1.5)
    t = a.on_peer(State.BACKUP, 4, 1.6, (4, 20))
    assert t is not None and t.stale and a.active and a.term == 5
    # A peer holding this broker's own record (its term) says nothing of the kind.
    b = star(PairRole.PRIMARY, (3, 11))
    ask(b, 0.0, 1.5)
    assert b.on_peer(State.PASSIVE, 5, 1.6, (5, 20)) is None


# -- what the broker does with a stale record (recovery.unpin) -----------------------


def recorded_pair() -> ClusterState:
    """A record of term 3: partition 0 served by p with r in sync, confirmed at LSN 10;
    then everything crashed and a broker restarts from that record."""
    cs = ClusterState(1, n_slots=16, replication=2)
    reg(cs, "p")
    reg(cs, "r")
    cs.report("p", lsn=10, epoch=1, in_sync=["r"], t=1.0)
    assert cs.members_of(0) == ("p", "r")
    return restarted(cs, now=100.0, hold=1.0)


def test_a_stale_records_in_sync_set_binds_no_more_and_a_newer_copy_wins_the_hold() -> None:
    """At term 4 the in-sync set became s alone (p and r dropped), and s acknowledged
    writes to LSN 30.  The stale record would grant r's copy (LSN 10) and make s its
    replica, taking its history."""
    cs = recorded_pair()
    out = by_node(reg(cs, "r", claim=claim_primary(0, 1, 10), now=100.1))
    assert out["r"].role is Role.PRIMARY
    cs.record_stale()
    assert cs.members_of(0) == () and cs.records()[0].in_sync == ()
    out = by_node(reg(cs, "s", claim=claim_primary(0, 1, 30), now=100.2))
    assert out["s"].role is Role.PRIMARY and cs.primary_of(0) == "s"
    assert out["r"].role is not Role.PRIMARY
    # Its floor is a bound still (floors only grow).
    assert cs.floor_of(0) == (1, 10)


def test_with_a_stale_record_a_claim_below_the_partitions_epoch_is_not_taken() -> None:
    """A copy that followed a primary at epoch 2 (given by the newer broker) registers;
    an older primary claim at epoch 1, above the record's floor, must not take the
    partition (the floor vouches for it only when the newer epoch was never confirmed,
    which a stale record cannot tell)."""
    cs = recorded_pair()
    cs.record_stale()
    reg(cs, "s", claim=claim_replica(0, 2, 30, in_sync=True), now=100.1)
    assert reg(cs, "p", claim=claim_primary(0, 1, 12), now=100.2) == []
    assert cs.primary_of(0) is None and cs.shards["p"].held is not None


def test_without_the_stale_mark_the_recorded_set_decides() -> None:
    """The same registrations with the record trusted: s, outside the recorded set,
    does not take the partition (this is what rule 7 changes)."""
    cs = recorded_pair()
    reg(cs, "r", claim=claim_primary(0, 1, 10), now=100.1)
    out = by_node(reg(cs, "s", claim=claim_primary(0, 1, 30), now=100.2))
    assert cs.primary_of(0) == "r"
    assert "s" not in out or out["s"].role is not Role.PRIMARY


# -- a replica's own word during the hold (recovery.says_in_sync) ----------------------


@pytest.mark.parametrize(
    ("lsn", "first", "in_sync"),
    [
        (8, "p", False),  # behind the granted copy, after it: writes may have been released
        (10, "p", True),  # holds the granted copy
        (8, "r", True),  # before any primary: no map released anything without it
    ],
)
def test_a_replica_claim_counts_in_sync_during_the_hold_only_if_no_map_left_it_out(
    lsn: int, first: str, in_sync: bool
) -> None:
    """The primary p held writes routed by the broker before this one, waiting for r;
    this broker's first map naming p alone releases them (seed 318)."""
    cs = recorded_pair()
    claims = {"p": claim_primary(0, 1, 10), "r": claim_replica(0, 1, lsn, in_sync=True)}
    for node in (first, "r" if first == "p" else "p"):
        reg(cs, node, claim=claims[node], now=100.1)
    assert cs.primary_of(0) == "p"
    assert ("r" in cs.map.partitions[0].in_sync) is in_sync


# -- the shard's kept term (BrokerTerm) -----------------------------------------------


def test_a_shard_keeps_the_highest_term_it_obeyed_across_a_restart(tmp_path: Path) -> None:
    term = BrokerTerm(tmp_path)
    assert term.value == 0
    assert term.obey(3) and term.value == 3
    assert (tmp_path / TERM_FILE).read_text() == "3\n"
    assert not term.obey(2) and term.value == 3  # an older broker: dropped
    assert term.obey(3)
    assert BrokerTerm(tmp_path).value == 3  # the next process reports it
    assert BrokerTerm(None).obey(5)  # without a data dir: in memory only
    assert not list(tmp_path.glob("*.tmp"))


def test_a_term_that_cannot_be_kept_is_not_obeyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    term = BrokerTerm(tmp_path)
    term.obey(3)

    class FailingOS:
        """The module's ``os`` seam (as the simulator's disk uses it): fsync fails."""

        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        def fsync(self, fd: int) -> None:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(links, "os", FailingOS())
    assert not term.obey(4) and term.value == 3 and term.failed
    monkeypatch.undo()
    assert BrokerTerm(tmp_path).value == 3
    assert term.obey(4) and BrokerTerm(tmp_path).value == 4
    assert sorted(os.listdir(tmp_path)) == [TERM_FILE]
