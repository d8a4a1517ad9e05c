"""Binary Star: the state machine of a primary/backup broker pair.

Two brokers, one configured *primary* and one *backup*, heartbeat each other
over a peer link.  Exactly one of them is *active* (routes traffic and owns the
cluster map); the other is *passive* (receives the active one's state and
refuses client requests).  States and events follow the ZeroMQ guide's Binary
Star pattern:

* ``PRIMARY`` / ``BACKUP``: just started, waiting to learn the peer's state.
* ``ACTIVE``: serving.  ``PASSIVE``: standing by.

Rules:

1. A broker fails over (passive -> active) only when it has lost its peer (no
   heartbeat for ``timeout`` seconds) *and* a client has started asking it.  A
   backup that never heard from the primary never becomes active on its own.
2. Every activation takes a new *term*, larger than every term this broker has
   seen; the primary takes odd terms, the backup even ones, so two brokers never
   hold the same term.  The driver persists the term with the broker state and
   stamps it on everything the broker sends; shards and clients obey only the
   broker with the highest term they have seen (fencing).
3. A broker that learns of a higher term (from its peer, or from a shard or
   client that saw one) is no longer active: it goes passive and stops routing.
4. Two active brokers: the higher term wins, the other goes passive.  Two
   passive brokers (nobody serving): the primary takes over.
5. A pair started whole (both just started): the broker holding the newer
   record takes over, the other stands by.  A record is ordered by ``(term,
   version)``: the term it was produced at, then its version (the map version)
   within that term; equal records: the primary.  This is Raft's election
   restriction: of two candidates only one whose log is at least as up to date
   may lead, so nothing the newer broker acknowledged is elected away.
6. A broker's own silence is not its peer's.  When ``now`` has moved on by more than
   ``timeout`` since this broker's last event or :meth:`BinaryStar.tick` (it was
   paused: its loop, its process or its host stopped), the peer's silence counts from
   the resume: the peer expires ``timeout`` after it at the earliest.  A standby takes
   over only once it has run for a whole timeout without hearing its peer, so the
   beats queued for it while it was paused are read first, whatever order it reads a
   client's request and those beats in.
7. A record older than a term some shard obeyed is *stale*: the broker active at
   that term may have changed every in-sync set since (shards keep the highest term
   they obeyed in their data dirs and report it, :meth:`BinaryStar.on_term`).  A broker
   takes over from a stale record knowing it is (``Transition.stale``: its in-sync sets
   no longer bind, :func:`zps.core.recovery.unpin`), and an active broker that learns
   of a term between its record's and its own (a shard that obeyed it comes back, or
   its peer starts with a record of it) gets the same decision as a transition from
   active to active.
8. A takeover by a primary that heard no peer since it started (``Transition.alone``)
   cannot know whether its peer served meanwhile: the driver holds for the whole
   start-up grace, so every shard that is up reports its term before a write is routed.

No I/O and no clock: the driver passes ``now`` (seconds, monotonic) and acts on
the :class:`Transition` each event returns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class State(enum.StrEnum):
    PRIMARY = "primary"
    BACKUP = "backup"
    ACTIVE = "active"
    PASSIVE = "passive"


class PairRole(enum.StrEnum):
    """How a broker of the pair is configured."""

    PRIMARY = "primary"
    BACKUP = "backup"


@dataclass(frozen=True, slots=True)
class Transition:
    """The state changed from ``old`` to ``new``; ``term`` is the term now held.
    ``stale``: the record this broker serves from (or takes over with) is older than a
    term some shard obeyed (rule 7); ``alone``: a takeover with no peer heard since
    start (rule 8)."""

    old: State
    new: State
    term: int
    reason: str
    stale: bool = False
    alone: bool = False

    @property
    def activated(self) -> bool:
        return self.new is State.ACTIVE and self.old is not State.ACTIVE

    @property
    def deactivated(self) -> bool:
        return self.old is State.ACTIVE and self.new is not State.ACTIVE


class PairError(Exception):
    """The pair is misconfigured (two primaries, or two backups)."""


class BinaryStar:
    """One broker's side of the pair (see the module notes)."""

    def __init__(
        self,
        role: PairRole,
        *,
        timeout: float,
        now: float,
        term: int = 0,
        record: tuple[int, int] = (0, 0),
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if term < 0:
            raise ValueError(f"term must be >= 0, got {term!r}")
        self.role = role
        self.timeout = timeout
        self.state = State.PRIMARY if role is PairRole.PRIMARY else State.BACKUP
        #: The highest term this broker knows of (its own when active).
        self.term = term
        #: The peer's last reported state and term (None: never heard).
        self.peer_state: State | None = None
        self.peer_term = 0
        #: The ``(term, version)`` of the record this broker holds (rule 5); the
        #: driver keeps it current.
        self.record = _record(record)
        #: The highest term a shard reported having obeyed (rule 7).
        self.reported = 0
        self._peer_expiry = now + timeout
        self._last_run = now  # rule 6
        self.failovers = 0
        #: Times the peer was heard again after a silence of a whole timeout (this
        #: broker's own pauses not counted, rule 6).
        self.peer_silences = 0

    # -- queries -----------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.state is State.ACTIVE

    def peer_alive(self, now: float) -> bool:
        return now < self._peer_expiry

    def beat(self) -> tuple[State, int]:
        """What to tell the peer in the next heartbeat."""
        return self.state, self.term

    # -- events ------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """This broker is running at ``now`` (the driver calls it at least every beat
        interval): a gap longer than the peer timeout since its last event or tick was
        its own silence, not its peer's (rule 6)."""
        if now - self._last_run > self.timeout:
            self._peer_expiry = max(self._peer_expiry, now + self.timeout)
        self._last_run = max(self._last_run, now)

    def on_peer(
        self, state: State, term: int, now: float, record: tuple[int, int] | None = None
    ) -> Transition | None:
        """A heartbeat from the peer: it is in ``state``, knows ``term`` and holds a
        record ordered ``record`` (None: it did not say; rule 5 then picks the primary)."""
        if term < 0:
            raise ValueError(f"term must be >= 0, got {term!r}")
        self.tick(now)
        if self.peer_state is not None and not self.peer_alive(now):
            self.peer_silences += 1
        peer_record = None if record is None else _record(record)
        self.peer_state, self.peer_term = state, term
        self._peer_expiry = now + self.timeout
        if state is State.PRIMARY and self.role is PairRole.PRIMARY:
            raise PairError("both brokers of the pair are configured primary")
        if state is State.BACKUP and self.role is PairRole.BACKUP:
            raise PairError("both brokers of the pair are configured backup")
        mine, known = self.state, self.term
        if term > self.term and mine is State.ACTIVE:
            return self._to(State.PASSIVE, term, f"the peer holds a newer term {term}")
        self.term = max(self.term, term)
        change = self._on_peer_state(mine, state, term, known, peer_record)
        if change is None and peer_record is not None and mine is State.ACTIVE:
            return self._stale(peer_record[0], "its peer holds a record of term")
        return change

    def _on_peer_state(
        self,
        mine: State,
        state: State,
        term: int,
        known: int,
        peer_record: tuple[int, int] | None,
    ) -> Transition | None:
        match mine, state:
            case State.PRIMARY, State.BACKUP:
                if peer_record is not None and peer_record > self.record:
                    return None  # rule 5: the backup takes over; this one then stands by
                return self._activate("the backup is up and nobody is active")
            case State.BACKUP, State.PRIMARY if peer_record is not None and (
                self.record > peer_record
            ):
                return self._activate("the pair started whole and this broker's record is newer")
            case State.PRIMARY | State.BACKUP, State.ACTIVE:
                return self._to(State.PASSIVE, self.term, "the peer is active")
            case State.PASSIVE, State.PRIMARY | State.BACKUP:
                # The peer restarted and lost its state; this broker has it.
                return self._activate("the peer restarted")
            case State.PASSIVE, State.PASSIVE if self.role is PairRole.PRIMARY and term >= known:
                # A beat at an older term than this broker knows is stale (sent before
                # the peer took over, read late by a broker that was paused): the peer's
                # next beat, at the term it knows now, decides.
                return self._activate("both were passive")
            case State.ACTIVE, State.ACTIVE:
                # Equal terms cannot happen (parity); a lower peer term steps down there.
                if term == self.term and self.role is PairRole.BACKUP:
                    return self._to(State.PASSIVE, self.term, "both active: the primary wins")
                return None
            case _:
                return None

    def on_client(self, now: float) -> tuple[bool, Transition | None]:
        """A client asks this broker: serve it?  May take over (rules 1, 6)."""
        self.tick(now)
        match self.state:
            case State.ACTIVE:
                return True, None
            case State.PASSIVE | State.PRIMARY if not self.peer_alive(now):
                why = (
                    "the peer is silent and clients ask"
                    if self.state is State.PASSIVE
                    else "no peer answered at start and clients ask"
                )
                return True, self._activate(why)
            case _:
                return False, None

    def on_term(self, term: int, now: float) -> Transition | None:
        """A shard or client has seen ``term``: a newer one fences this broker (rule 3).

        A newer term means the peer took over: that counts as hearing from it, so a
        broker that was paused (its peer clock stale, client requests queued up
        meanwhile) does not take over again at once before its peer's beats are read."""
        self.tick(now)
        self.reported = max(self.reported, term)
        if term <= self.term:
            return self._stale(term, "a shard obeyed term") if self.active else None
        self._peer_expiry = max(self._peer_expiry, now + self.timeout)
        if self.state is State.ACTIVE:
            return self._to(State.PASSIVE, term, f"a newer term {term} is in use")
        self.term = term
        return None

    # -- internals ---------------------------------------------------------------

    def _activate(self, reason: str) -> Transition:
        parity = 1 if self.role is PairRole.PRIMARY else 0
        term = self.term + 1
        if term % 2 != parity:
            term += 1
        was_passive = self.state is State.PASSIVE
        stale = self.record[0] < self.reported
        if stale:
            reason += f"; its record (term {self.record[0]}) is stale: a shard obeyed term "
            reason += str(self.reported)
            self.record = (term, self.record[1])  # rule 7: decided once
        alone = self.state is State.PRIMARY and self.peer_state is None
        t = self._to(State.ACTIVE, term, reason, stale=stale, alone=alone)
        if was_passive:
            self.failovers += 1
        return t

    def _stale(self, term: int, why: str) -> Transition | None:
        """Rule 7 for an active broker that hears of ``term``: its record is stale if
        ``term`` lies between the record's and its own (decided once per record)."""
        if not self.record[0] < term < self.term:
            return None
        reason = f"{why} {term}, newer than its record's {self.record[0]}: the record is stale"
        self.record = (self.term, self.record[1])
        return Transition(State.ACTIVE, State.ACTIVE, self.term, reason, stale=True)

    def _to(self, state: State, term: int, reason: str, **flags: bool) -> Transition:
        old = self.state
        self.state, self.term = state, term
        return Transition(old, state, term, reason, **flags)


def _record(record: tuple[int, int]) -> tuple[int, int]:
    """A record's ``(term, version)``, checked."""
    if (
        not isinstance(record, tuple)
        or len(record) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in record)
    ):
        raise ValueError(f"a record is (term, version), two ints >= 0, got {record!r}")
    return record
