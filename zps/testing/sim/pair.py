"""The broker pair in the simulation (``--faults failover,...``): two brokers under the
real :class:`~zps.core.bstar.BinaryStar`, shards and clients that follow the active one.

Each driver here stands in for the pair's part of a real one (docs/design.md, "Broker
pair"), on top of the single-broker drivers of :mod:`.nodes`:

* :class:`PairBroker` for :class:`zps.broker.pair.Pair`: beats on the peer link every
  ``PEER_TIMEOUT / 5`` (the active one's carry its record, which the standby keeps and
  writes to its data dir), admission (a passive broker drops what shards send, noting
  who they are, and answers clients PASSIVE unless the Binary Star rule lets it take
  over: its peer silent and a client asking), the takeover (a fresh state from the
  last record received, every shard heard asked to register again) and the step down
  (a fresh state holding nothing; it routes again only after a takeover).  Every
  message it sends carries its term.
* :class:`PairShard` for the shard's broker links (``ShardServer._fenced`` and
  ``_with_term``): control messages to both brokers, stamped with the highest term seen;
  a broker's message with an older term is dropped, one at least as new makes that
  broker the one followed (requests are taken and replies sent through it only).
* :class:`PairClient` for :class:`zps.client.pair.PairFollower` with the real
  :class:`~zps.client.session.BrokerChoice`: requests to the current broker, PASSIVE
  answers parked, fenced messages dropped, a switch re-sends what is in flight.

A message between a broker and a node travels as ``("t", term, message)``.
"""

from __future__ import annotations

from typing import Any

from zps.client.session import BrokerChoice
from zps.core.bstar import BinaryStar, PairRole, State, Transition
from zps.protocol.codec import MsgType, Route, decode, encode, unpack_route
from zps.shard.links import BrokerTerm
from zps.testing.sim.nodes import HOLD, SimBroker, SimShard
from zps.testing.sim.simclient import SimClient

World = Any

#: The brokers of the pair: the primary, then the backup.
BROKERS = ("broker", "backup")
#: A broker's peer is dead after this long without its beat (``broker.peer_timeout``).
PEER_TIMEOUT = 0.5
#: A client introduces itself to the other broker after this long without a word from
#: the current one (``failover_timeout``), and asks a standby again this often.
SILENCE = 0.6
RETRY = 0.2


class PairBroker(SimBroker):
    def __init__(self, world: World, name: str, n_partitions: int, replication: int) -> None:
        super().__init__(world, n_partitions, replication)
        self.name = name
        self.role = PairRole.PRIMARY if name == BROKERS[0] else PairRole.BACKUP
        self.peer = BROKERS[1] if name == BROKERS[0] else BROKERS[0]
        self.heard: set[str] = set()  # shards heard while passive
        self.takeovers = 0
        self.beats = 0
        self.term = 0  # the term kept in its data dir
        #: The term the record in its data dir was produced at (the active broker's).
        self.rec_term = 0

    def start(self) -> None:
        now = self.w.sched.now
        self.star = BinaryStar(self.role, timeout=PEER_TIMEOUT, now=now, term=self.term)
        self.heard = set()
        self.peer_key: tuple[int, int] | None = None  # the record the peer says it holds
        #: The floor epoch of each partition in the record the peer says it holds.
        self.peer_floors: tuple[int, ...] | None = None
        #: Lease echoes to promoted primaries, waiting for the peer to hold their epoch.
        self.echoes: list[tuple[str, Any]] = []
        self.sent_for = -1  # the map version a beat went out of turn for
        super().start()
        self.star.record = self._record_key()

    def _record_key(self) -> tuple[int, int]:
        """The held record's ``(term, version)`` (BinaryStar rule 5): the active broker's
        own state at its term, or the record last received or restored."""
        if self.star.active:
            return self.star.term, self.state.map_version
        return (self.rec_term, self.record[0]) if self.record is not None else (0, 0)

    def stop(self, *, keep_record: bool) -> None:
        """The data dir (:attr:`record`) holds the active broker's own state, or what a
        standby last received (or restored at its start); the term is kept with it."""
        standby = self.alive and not self.star.active
        held = self.record
        if self.alive:
            self.term = self.star.term
        super().stop(keep_record=keep_record)
        if standby and keep_record:
            self.record = held
        if self.record is None:
            self.rec_term = 0

    @property
    def active(self) -> bool:
        return self.alive and self.star.active

    # -- the peer link and the transitions ---------------------------------------

    def _work(self, now: float) -> None:
        self.star.tick(now)  # BinaryStar rule 6: the gaps are its own pauses
        self.beats += 1
        if self.echoes:
            self._release_echoes()  # those whose epoch the standby holds, or a dead peer
        if self.beats % 2 == 0:  # every PEER_TIMEOUT / 5 (the timer runs every HB / 2)
            self._beat()
        if self.star.active:
            super()._work(now)

    def _beat(self, *, echo: bool = False) -> None:
        """A beat (the active broker's carries its record); ``echo``: the answer to one,
        each saying what record its sender holds (key, floors)."""
        state, term = self.star.beat()
        rec = (self.state.map_version, self.state.records()) if self.star.active else None
        held = rec if rec is not None else self.record
        floors = tuple(r.floor_epoch for r in held[1]) if held is not None else None
        msg = ("peer", state.value, term, rec, self._record_key(), floors, echo)
        self.w.net.send(self.name, self.peer, msg)

    def _on_peer(
        self,
        state: str,
        term: int,
        rec: Any,
        key: tuple[int, int] | None,
        floors: tuple[int, ...] | None,
        echo: bool,
    ) -> None:
        if rec is not None and state == State.ACTIVE.value and not self.star.active:
            self.record, self.rec_term = rec, term  # kept, and written to its data dir
            self.star.record = self._record_key()
        self.peer_key, self.peer_floors = key, floors
        self._changed(self.star.on_peer(State(state), term, self.w.sched.now, key))
        if not echo:  # each beat is answered at once, with what this broker holds now
            self._beat(echo=True)
        if self.active:
            self._publish()
        self._release_echoes()

    def _unheld(self, partition: int) -> bool:
        """Whether the standby's record may lack partition ``partition``'s confirmed epoch
        (ControlPlane: a promoted primary's echo waits until the record naming its epoch
        is durable, and in a pair held by the standby, Pair.after_held)."""
        if not (self.star.peer_alive(self.w.sched.now) and self.star.peer_state is not None):
            return False  # a dead peer takes nothing over
        floors = self.peer_floors
        held = floors[partition] if floors is not None and partition < len(floors) else 0
        return held < self.state.floor_of(partition)[0]

    def _release_echoes(self) -> None:
        if not self.active:
            self.echoes.clear()  # a broker that stepped down renews no lease
            return
        ready = [(node, msg) for node, msg in self.echoes if not self._unheld(msg[3])]
        self.echoes = [(node, msg) for node, msg in self.echoes if self._unheld(msg[3])]
        for node, msg in ready:
            self.w.net.send(self.name, node, ("t", self.star.term, msg))

    def _peer_holds(self) -> bool:
        """Pair.after_held: the standby reported holding this broker's record (of its
        term) with the map as it is now, or the peer is not alive (a dead peer takes
        nothing over)."""
        if not (self.star.peer_alive(self.w.sched.now) and self.star.peer_state is not None):
            return True
        key = self.peer_key
        return key is not None and key[0] == self.star.term and key[1] >= self.state.map_version

    def _publish(self) -> None:
        """A map goes out once the standby holds it (a takeover starts from the standby's
        record; the map's in-sync set releases acknowledged writes).  While it waits, the
        record goes to the standby at once rather than at the next beat."""
        if self.active and self.state.map_version != self.published and not self._peer_holds():
            self._keep()
            if self.sent_for != self.state.map_version:
                self.sent_for = self.state.map_version
                self._beat()
            return
        super()._publish()

    def _changed(self, change: Transition | None) -> None:
        if change is None:
            return
        w, now = self.w, self.w.sched.now
        w.sched.log(f"{self.name}: {change.old.value} -> {change.new.value} at term "
                    f"{change.term} ({change.reason})")  # fmt: skip
        if change.activated:
            self.rec_term = change.term
            self.takeovers += 1
            inc = f"sim{w.seed}-{self.name}-{self.starts}-{self.takeovers}"
            self._reset(now, self.record, inc)  # it holds for the whole HOLD (rule 8)
            if change.stale:
                self.state.record_stale()  # BinaryStar rule 7
            for shard in sorted(self.heard):
                self.send(shard, ("reregister",))
            self.heard.clear()
        elif change.stale:
            self.state.record_stale()  # BinaryStar rule 7
        elif change.deactivated:
            # What it knew is stale: it routes again only after a takeover.
            self.record = (self.state.map_version, self.state.records())
            self._reset(now, None, f"sim{w.seed}-{self.name}-passive")
            self.state.hold_until = now + HOLD

    # -- admission -----------------------------------------------------------------

    def send(self, node: str, msg: Any) -> None:
        if msg[0] == "echo" and msg[2] == "primary" and self._unheld(msg[3]):
            self.echoes.append((node, msg))  # the record goes to the standby at once
            self._beat()
            return
        term = None if msg[0] == "reply" else self.star.term  # a shard's answer: no term
        self.w.net.send(self.name, node, ("t", term, msg))

    def on_message(self, src: str, msg: Any) -> None:
        if msg[0] == "peer":
            self._on_peer(*msg[1:])
            return
        _, term, inner = msg
        now = self.w.sched.now
        if isinstance(term, int) and (term > self.star.term or src in self.w.shard_names):
            self._changed(self.star.on_term(term, now))  # a shard's: rules 3 and 7
        if src in self.w.shard_names:
            if self.star.active:
                super().on_message(src, inner)
            else:
                self.heard.add(src)
            return
        kind = inner[0]
        if kind in ("request", "hello"):  # asks to serve
            serve, change = self.star.on_client(now)
            self._changed(change)
        else:
            serve = self.star.active
        if serve:
            super().on_message(src, inner)
        elif kind == "request":
            route = unpack_route(inner[1][0])
            body = {"st": "PASSIVE", "msg": f"{self.name} is the standby", "passive": True,
                    "term": self.star.term}  # fmt: skip
            reply = encode(Route(MsgType.REPLY, route.partition, route.epoch, route.req_id), body)
            self.w.net.send(self.name, src, ("t", self.star.term, ("reply", reply, self.name)))
        elif kind == "hello":
            self.w.net.send(self.name, src, ("t", self.star.term, ("passive",)))


class PairShard(SimShard):
    def start(self) -> bool:
        # The highest term obeyed, kept in the data dir (BrokerLinks: BrokerTerm).
        self.fence = BrokerTerm(self.disk.root)
        self.current = BROKERS[0]
        return super().start()

    @property
    def term(self) -> int:
        return self.fence.value

    def send(self, node: str, msg: Any) -> None:
        if node != "broker":
            super().send(node, msg)
        elif msg[0] == "reply":  # through the broker followed only
            self.w.net.send(self.name, self.current, ("t", self.term, msg))
        else:  # control messages: to both
            for b in BROKERS:
                self.w.net.send(self.name, b, ("t", self.term, msg))

    def _fenced(self, src: str, term: int | None) -> bool:
        """ShardServer._fenced: an older broker's message is dropped; one at least as
        new makes its broker the one followed."""
        if term is None:
            return False
        if not self.fence.obey(term):
            return True
        if src != self.current:
            self.w.sched.log(f"{self.name} follows {src} (term {term})")
            self.current = src
        return False

    def on_message(self, src: str, msg: Any) -> None:
        if src in BROKERS:
            _, term, inner = msg
            if self._fenced(src, term):
                if self.fence.failed:  # BrokerLinks.on_frames: not kept, so registered again
                    self.fence.failed = False
                    super().on_message("broker", ("reregister",))
                return
            src, msg = "broker", inner
        super().on_message(src, msg)


class PairClient(SimClient):
    def start(self) -> None:
        self.choice = BrokerChoice(2, silence=SILENCE, retry=RETRY, now=self.w.sched.now)
        super().start()

    def send(self, msg: Any) -> None:
        self.w.net.send(self.name, BROKERS[self.choice.current], ("t", self.choice.term, msg))

    def _timer(self, gen: int) -> None:
        if self.alive and gen == self.gen:
            what = self.choice.tick(self.w.sched.now)
            if what == "switch":
                self.session.switched()
            if what is not None:
                self.send(("hello",))
        super()._timer(gen)

    def on_message(self, src: str, msg: Any) -> None:
        _, term, inner = msg
        index, now = BROKERS.index(src), self.w.sched.now
        passive = inner[0] == "passive"
        if inner[0] == "reply" and inner[2] == src:  # the broker's own answer
            passive = decode(inner[1]).header.get("passive") is True
        if passive:
            self.choice.refused(index, now)  # parked, not failed
            if inner[0] == "passive":
                return
        else:
            verdict = self.choice.heard(index, term, now)
            if verdict is None:
                return  # a broker replaced by a newer term: fenced
            if verdict:
                self.w.sched.log(f"{self.name} switches to {src} (term {term})")
                self.session.switched()
        super().on_message(src, inner)
