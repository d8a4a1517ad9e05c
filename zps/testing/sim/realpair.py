"""The real broker pair in a simulated run (``--real-broker --faults failover,...``).

:class:`RealPairBroker` is a :class:`~zps.testing.sim.realbroker.RealBroker` with
``pair_role`` set: the real :class:`~zps.broker.broker.Broker` with its real
:class:`~zps.broker.pair.Pair` (and :class:`~zps.core.bstar.BinaryStar`), unchanged,
its data dir in the run's scratch directory, its peer link (a ROUTER and a DEALER,
:func:`zps.testing.sim.simtransport.dealer`) on its node of the simulated network and
its beat loop on the run's event loop.  The primary's node is ``broker``, the backup's
``backup`` (the stand-in pair's names, so a run draws the same faults).

:class:`WirePairShard` does what the real shard's broker links do
(:class:`zps.shard.links.BrokerLinks`): control messages to both brokers, stamped with
the highest term seen (kept in its data dir: :class:`zps.shard.links.BrokerTerm`); a
control message with an older term is dropped, one at least
as new makes its broker the one followed; requests are taken (and replies sent) through
the broker followed only, a request routed by the other is refused as routed by a
broker that was replaced.

:class:`WirePairClient` does what the real client's :class:`zps.client.pair.PairFollower`
does, with the real :class:`~zps.client.session.BrokerChoice`: requests to the current
broker, a standby's PASSIVE answers parked, a fenced broker's messages dropped, a
switch re-sends what is in flight.
"""

from __future__ import annotations

from typing import Any

from zps.broker.pair import Pair
from zps.client.session import BrokerChoice
from zps.core.bstar import BinaryStar, Transition
from zps.protocol.codec import MsgType, Route, decode, encode, unpack_route
from zps.shard.admission import REPLACED
from zps.shard.links import BrokerTerm
from zps.testing.sim.pair import BROKERS, PEER_TIMEOUT, RETRY, SILENCE
from zps.testing.sim.realbroker import RealBroker, WireClient, WireShard, _Broker

World = Any


class RealPairBroker(RealBroker):
    """One broker of the pair, running the real broker with its real pair side."""

    def __init__(self, world: World, name: str, n_partitions: int, replication: int) -> None:
        self.name = name
        self.peer = BROKERS[1] if name == BROKERS[0] else BROKERS[0]
        super().__init__(
            world,
            n_partitions,
            replication,
            pair_role="primary" if name == BROKERS[0] else "backup",
            peer_bind=f"sim://{name}/peer",
            peer=f"sim://{self.peer}/peer",
            peer_timeout=PEER_TIMEOUT,
        )

    def started(self, b: _Broker) -> None:
        pair = b.pair
        assert pair is not None
        w = self.w
        # A run is deterministic: the beats' incarnation comes from the seed too.
        pair._incarnation = f"sim{w.seed}-{self.name}-{self.starts}"
        real = pair._changed
        name, log = self.name, w.sched.log

        async def changed(change: Transition, now: float) -> None:
            log(f"{name}: {change.old.value} -> {change.new.value} at term {change.term} "
                f"({change.reason})")  # fmt: skip
            await real(change, now)

        pair._changed = changed  # type: ignore[method-assign]

    @property
    def pair(self) -> Pair:
        assert self.broker is not None and self.broker.pair is not None
        return self.broker.pair

    @property
    def star(self) -> BinaryStar:
        return self.pair.star

    @property
    def active(self) -> bool:
        return self.alive and self.broker is not None and self.pair.active


class WirePairShard(WireShard):
    """A shard's broker links to the pair (see the module notes)."""

    def start(self) -> bool:
        # The highest term obeyed, kept in the data dir (BrokerLinks: BrokerTerm).
        self.fence = BrokerTerm(self.disk.root)
        self.current = BROKERS[0]
        return super().start()

    @property
    def term(self) -> int:
        return self.fence.value

    def stamped(self, header: dict[str, Any]) -> dict[str, Any]:
        return {**header, "term": self.term}  # BrokerLinks.with_term

    def send(self, node: str, msg: Any) -> None:
        if node != "broker":
            super().send(node, msg)
        elif msg[0] == "reply":  # through the broker followed only
            self.w.net.send(self.name, self.current, self.frames(msg))
        else:  # control messages: to both
            frames = self.frames(msg)
            for b in BROKERS:
                self.w.net.send(self.name, b, frames)

    def _fenced(self, src: str, header: dict[str, Any]) -> bool:
        """BrokerLinks.fenced."""
        term = header.get("term")
        if not isinstance(term, int) or isinstance(term, bool):
            return False
        if not self.fence.obey(term):
            return True
        if src != self.current:
            self.w.sched.log(f"{self.name} follows {src} (term {term})")
            self.current = src
        return False

    def on_message(self, src: str, msg: Any) -> None:
        if src not in BROKERS:
            super().on_message(src, msg)
            return
        if bytes(msg[0]):  # a client's request (BrokerLinks.on_request)
            if src != self.current:
                route = unpack_route(msg[1])
                reply = Route(MsgType.REPLY, route.partition, self.core.epoch, route.req_id)
                frames = [bytes(msg[0]), *encode(reply, REPLACED.header())]
                self.w.net.send(self.name, src, frames)
                return
            super().on_message("broker", msg)
            return
        if self._fenced(src, decode(msg[1:]).header):
            if self.fence.failed:  # BrokerLinks.on_frames: not kept, so registered again
                self.fence.failed = False
                super().on_message("broker", [b"", *encode(Route(MsgType.REGISTER), {})])
            return
        super().on_message("broker", msg)


class WirePairClient(WireClient):
    """A client of the pair (see the module notes)."""

    def start(self) -> None:
        self.choice = BrokerChoice(2, silence=SILENCE, retry=RETRY, now=self.w.sched.now)
        super().start()

    def send(self, msg: Any) -> None:
        self.w.net.send(self.name, BROKERS[self.choice.current], self.frames(msg))

    def _timer(self, gen: int) -> None:
        if self.alive and gen == self.gen:  # PairFollower.run
            what = self.choice.tick(self.w.sched.now)
            if what == "switch":
                self.session.switched()
            if what is not None:
                self.send(("hello",))
        super()._timer(gen)

    def on_message(self, src: str, msg: Any) -> None:
        """PairFollower.heard, then the client's handling."""
        index, now = BROKERS.index(src), self.w.sched.now
        m = decode(msg)
        if m.header.get("passive") is True:
            self.choice.refused(index, now)  # parked, not failed
            if m.route.mtype is not MsgType.REPLY:
                return
        else:
            term = m.header.get("term")
            verdict = self.choice.heard(index, term if isinstance(term, int) else None, now)
            if verdict is None:
                return  # a broker replaced by a newer term: fenced
            if verdict:
                self.w.sched.log(f"{self.name} switches to {src} (term {term})")
                self.session.switched()
        super().on_message(src, msg)
