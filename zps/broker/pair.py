"""The broker pair driver: a hot standby for the broker (Binary Star).

Two brokers run as a primary/backup pair (``broker.pair_role``); the rules are
:class:`~zps.core.bstar.BinaryStar`'s, this module does the I/O around them:

* a peer link: each broker binds a ROUTER at ``peer_bind`` and connects a
  DEALER to the other's (``peer``).  Every ``peer_timeout / 5`` seconds each
  sends a beat ``[PEER_MAGIC, {state, term, role, inc, seq, record}, record?]``
  (``record``: the held record's ``[term, map version]``, which decides who
  takes over when the pair starts whole: BinaryStar rule 5), and
  each beat is answered at once over the same connection; a beat older than
  one already heard (``inc``, ``seq``) is ignored.  The active broker adds its
  state record (:class:`~zps.core.brokerstate.BrokerState` bytes) whenever it
  changed, until the standby reports holding it, and every second anyway: the
  standby holds a copy at most one beat old.  A durable send (a map) waits for
  more: until the standby reports holding a record made after it was queued
  (:meth:`Pair.after_held`), and the record goes at once rather than at the
  next beat, so a takeover never starts from an older map than one sent out.
* admission: the passive broker drops shard messages (it only notes who the
  shards are) and answers every client message ``PASSIVE`` unless the Binary
  Star rule lets it take over: it lost its peer *and* a client is asking.
* takeover: the new active broker loads the last record it received
  (partitions, epochs, LSN floors, map version, jobs; with none from the peer,
  the one in its own data dir, where a standby also writes what it receives),
  asks every shard it has heard from to register again at once, and ends its
  start-up hold as soon as every copy the record names is back and each
  partition that held data has its primary (:func:`zps.core.recovery.claims_in`;
  the claims come within a round trip), rather than after the whole grace
  period.
* fencing: every control message the broker sends carries its term (see
  :meth:`zps.broker.persistence.BrokerRecord.control`); shards and clients obey the
  broker with the highest term they have seen and report that term back, so
  a broker that was paused and replaced learns it and goes passive.  Going
  passive drops everything it knew: it only routes again after a takeover.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from zps import transport
from zps.broker.acceptance import SHARD_PREFIX
from zps.core.brokerstate import BrokerState, BrokerStateError
from zps.core.bstar import BinaryStar, PairError, PairRole, State, Transition
from zps.errors import ProtocolError
from zps.ops.security import load_curve_keys
from zps.protocol.codec import MsgType, Route, encode, unpack_route
from zps.protocol.messages import ADMIN_CLIENT_PREFIX, Status, StatusReply

if TYPE_CHECKING:
    from zps.core.cluster import ClusterState
    from zps.ops.config import BrokerConfig

log = logging.getLogger("zps.broker.pair")

#: The first frame of every message on the peer link.
PEER_MAGIC = b"zps-peer/1"
#: The active broker re-sends its whole record at least this often (seconds).
RESEND_S = 1.0
#: Client messages and the answer a passive broker gives in their place.
_ANSWER = {
    MsgType.REQUEST: MsgType.REPLY,
    MsgType.CLOCK: MsgType.CLOCK,
    MsgType.TASK: MsgType.TASK,
    MsgType.STATUS: MsgType.STATUS,
}


def asks_to_serve(mtype: MsgType, frames: transport.Frames) -> bool:
    """Whether a client message is the demand that lets a standby take over (Binary
    Star: its peer silent *and* a client asking).  An operator's look (a status query,
    or the HELLO of a ``zps-server`` command) is not, nor is a client's heartbeat: a
    status naming only the standby during a peer-link outage must not make the pair
    change hands."""
    if mtype in (MsgType.STATUS, MsgType.HEARTBEAT):
        return False
    if mtype is MsgType.HELLO and len(frames) > 2:
        try:
            header = msgpack.unpackb(transport.frame_buffer(frames[2]), raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return True
        name = header.get("name") if isinstance(header, dict) else None
        return not (isinstance(name, str) and name.startswith(ADMIN_CLIENT_PREFIX))
    return True


class PairHost(Protocol):
    """What the pair needs of its broker."""

    @property
    def state(self) -> ClusterState: ...

    def pair_record(self, version: int) -> BrokerState:
        """The broker's state as the standby is sent it, as ``version``."""

    def load_record(self, rec: BrokerState) -> None:
        """Take over the peer's record (on a fresh state)."""

    def reset_state(self, now: float, *, hold: float) -> None:
        """Forget every node and hold for claims for ``hold`` seconds."""

    def state_changed(self) -> None:
        """The record to write in the data dir changed."""

    async def send(self, frames: list[Any]) -> bool:
        """Send at once (or hold for a slow peer), never waiting."""

    async def control(self, node: bytes, mtype: MsgType, header: dict[str, Any]) -> None:
        """Send a control message (with this broker's term)."""

    async def republish(self) -> None:
        """Send the map to every node again."""


class Pair:
    """One broker's side of the pair (see the module notes)."""

    def __init__(
        self, config: BrokerConfig, host: PairHost, *, record: BrokerState | None = None
    ) -> None:
        cfg = config
        assert cfg.pair_role is not None and cfg.peer is not None and cfg.peer_bind is not None
        self.config = config
        self.host = host
        self.role = PairRole(cfg.pair_role)
        self.peer = cfg.peer
        self.peer_bind = cfg.peer_bind
        self.timeout = cfg.peer_timeout
        self.interval = cfg.peer_timeout / 5
        #: The term this broker was last active at (its own record's term).
        self._active_term = record.term if record is not None else 0
        #: The incarnation of the active broker whose record :attr:`record` is (None:
        #: this broker's own, or restored).
        self._held_from: str | None = None
        #: The last record received from the active peer; at start, what the broker
        #: restored from its data dir (a pair restarted whole, or a primary that finds
        #: no peer, takes over with it rather than with nothing).
        self.record: BrokerState | None = record
        self.star = self._new_star()
        self.peer_endpoint: str | None = None  # what the peer socket bound
        self.bound = asyncio.Event()
        self._sent: BrokerState | None = None
        self._sent_at = 0.0
        self._version = 0  # of the last record sent: grows for as long as the process runs
        #: Durable sends waiting for the standby to hold a record of at least this version.
        self._waiting: list[tuple[int, Callable[[], object]]] = []
        self._dealer: transport.Channel | None = None
        self._shards: set[bytes] = set()  # shard identities heard while passive
        self._takeover_record: BrokerState | None = None
        self._peer_info: dict[str, Any] = {}
        # Beats carry this process's incarnation and a sequence number shared by both
        # directions of the link: a beat older than one already heard (queued while the
        # peer was down, or overtaken on the other connection) is ignored.
        self._incarnation = uuid.uuid4().hex[:12]
        self._seq = itertools.count(1)
        self._heard: tuple[str, int] = ("", 0)
        self.refused = 0
        self.refused_peers = 0  # peer-link messages from another key (CURVE)
        self._refused_keys: set[bytes | None] = set()
        self.takeovers: list[float] = []

    # -- queries -------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.star.active

    @property
    def term(self) -> int:
        return self.star.term

    @property
    def record_term(self) -> int:
        """The term the record this broker produces is stamped with: its term while
        active, after that the term it was last active at."""
        return self.star.term if self.star.active else self._active_term

    def _new_star(self) -> BinaryStar:
        """The state machine at start: it knows its record's term and order."""
        rec = self.record
        return BinaryStar(
            self.role,
            timeout=self.timeout,
            now=time.monotonic(),
            term=rec.term if rec is not None else 0,
            record=(rec.term, rec.map_version) if rec is not None else (0, 0),
        )

    def _record_order(self) -> tuple[int, int]:
        """The held record's ``(term, map version)`` (BinaryStar rule 5): the active
        broker's own state, else the record last received or restored."""
        if self.star.active:
            return self.star.term, self.host.state.map_version
        rec = self.record
        return (rec.term, rec.map_version) if rec is not None else (0, 0)

    def status(self, now: float) -> dict[str, Any]:
        """For the status report: both brokers and which one is active."""
        peer_state = self.star.peer_state
        return {
            "role": self.role.value,
            "state": self.star.state.value,
            "term": self.term,
            "failovers": self.star.failovers,
            "peer": {
                "endpoint": self.peer,
                "state": peer_state.value if peer_state is not None else "unknown",
                "term": self.star.peer_term,
                "alive": self.star.peer_alive(now) and peer_state is not None,
                "silences": self.star.peer_silences,
                **self._peer_info,
            },
            "record_version": self.record.version if self.record else None,
            "refused": self.refused,
        }

    def peer_holds_now(self) -> bool:
        """Whether the standby holds this broker's state as it is now (live resharding
        waits for it before fencing or publishing: a takeover must know the move)."""
        sent = self._sent
        if sent is None or self._peer_info.get("has_record") != sent.version:
            return False
        return self.host.pair_record(sent.version).same_content(sent)

    def peer_alive(self, now: float) -> bool:
        """Whether the peer broker was heard within the peer timeout."""
        return self.star.peer_alive(now) and self.star.peer_state is not None

    def mirrored(self) -> BrokerState | None:
        """What this broker's data dir should hold while it stands by: the peer's record."""
        return None if self.star.active else self.record

    # -- admission (called first for every message the broker receives) ------

    async def admit(self, ident: bytes, frames: transport.Frames, now: float) -> bool:
        """Whether the broker handles this message; a passive broker answers clients."""
        if ident.startswith(SHARD_PREFIX):
            await self._shard_term(frames, now)
            if not self.star.active:
                self._shards.add(ident)
            return self.star.active
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
        except (ProtocolError, ValueError, IndexError):
            return self.star.active  # malformed: the broker counts it
        if route.mtype is MsgType.BYE:
            return self.star.active
        if asks_to_serve(route.mtype, frames):
            serve, change = self.star.on_client(now)
        else:
            serve, change = self.star.active, None
        if change is not None:
            await self._changed(change, now)
        if serve:
            return True
        self.refused += 1
        answer = _ANSWER.get(route.mtype, MsgType.HEARTBEAT)
        header = {
            **StatusReply(
                Status.PASSIVE,
                f"this broker is the {self.role.value}'s standby "
                f"({self.star.state.value}); its peer {self.peer} is active",
            ).to_wire(),
            "passive": True,
            "term": self.term,
        }
        reply = encode(Route(answer, route.partition, route.epoch, route.req_id), header)
        await self.host.send([ident, *reply])
        return False

    async def _shard_term(self, frames: transport.Frames, now: float) -> None:
        """A shard's control message carries the highest term it has seen (rule 3)."""
        if len(frames) < 4 or transport.frame_bytes(frames[1]):
            return  # a reply to a client: no term
        try:
            header = msgpack.unpackb(transport.frame_buffer(frames[3]), raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return
        term = header.get("term") if isinstance(header, dict) else None
        if isinstance(term, int) and not isinstance(term, bool):
            change = self.star.on_term(term, now)
            if change is not None:
                await self._changed(change, now)

    # -- the peer link -------------------------------------------------------

    async def run(self, ctx: Any) -> None:
        """Serve the peer link until cancelled.  With CURVE keys configured, the link is
        encrypted too: both brokers of a pair use one key pair (the one clients know as
        the broker's), its public key must be in the allow-list, and a message from any
        other key is refused there."""
        keys = load_curve_keys(self.config.security)
        router, self.peer_endpoint = transport.router(
            ctx, self.peer_bind, max_message_bytes=self.config.max_message_bytes, curve=keys
        )
        dealer = transport.dealer(
            ctx,
            self.peer,
            f"peer-{self.role.value}".encode(),
            max_message_bytes=self.config.max_message_bytes,
            hwm=16,
            curve=keys,
            server_public=(keys.server_public or keys.public) if keys else None,
            # A connection that died unseen (the peer's host, or the path) answers no
            # ping: it is made again, with or without CURVE.
            heartbeats=True,
        )
        log.info(
            "broker pair: %s, peer link at %s, peer at %s (timeout %.2fs)",
            self.role.value,
            self.peer_endpoint,
            self.peer,
            self.timeout,
        )
        # Each connection to the peer is made (again) with a beat at once: the peer
        # hears this broker within a round trip, not a beat interval, later.
        dealer.on_connected = lambda: self._beat(dealer, time.monotonic())
        self._dealer = dealer
        # The peer's silence counts from now, when it can first be heard.
        self.star = self._new_star()
        self.bound.set()

        async def on_router(frames: transport.Frames) -> None:
            # Answer each beat at once over the same connection: a broker that just
            # (re)started hears its peer within a round trip, however long the peer's
            # own DEALER waits to reconnect to it.  Under CURVE only the pair's key
            # speaks here, and its beat binds the connection the answer goes by.
            if keys is not None:
                if len(frames) < 2 or transport.sender_key(frames[1]) != keys.public:
                    self._refuse_peer(frames)
                    return
                router.accepted(frames)
            await self._on_peer(frames[1:])
            echo = [frames[0], PEER_MAGIC, msgpack.packb(self._header(), use_bin_type=True)]
            transport.try_send(router, echo)

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(transport.serve(router, on_router, self._on_bad_peer))
                tg.create_task(transport.serve(dealer, self._on_peer, self._on_bad_peer))
                tg.create_task(self._beat_loop(dealer))
        finally:
            transport.close(router)
            transport.close(dealer)

    async def _beat_loop(self, dealer: transport.Channel) -> None:
        last = 0.0
        while True:
            now = time.monotonic()
            self.star.tick(now)  # BinaryStar rule 6: a gap here is this broker's own pause
            if now - last >= self.interval:
                last = now
                self._beat(dealer, now)
            if self.star.active:
                await self._end_hold(now)
            if self._waiting and not (self.star.active and self.peer_alive(now)):
                self._release(held=None)
            # After a takeover, look for the end of the hold more often than a beat.
            await asyncio.sleep(self.interval / 10 if self._takeover_record else self.interval)

    def _header(self) -> dict[str, Any]:
        state, term = self.star.beat()
        header: dict[str, Any] = {
            "state": state.value,
            "term": term,
            "role": self.role.value,
            "inc": self._incarnation,
            "seq": next(self._seq),
        }
        if not self.star.active and self.record is not None:
            header["has_record"] = self.record.version  # what the standby holds
            if self._held_from is not None:
                header["held_from"] = self._held_from  # whose record it is
        header["record"] = list(self._record_order())
        return header

    def _beat(self, dealer: transport.Channel, now: float) -> None:
        header = self._header()
        frames: list[Any] = [PEER_MAGIC]
        record: bytes | None = None
        if self.star.active:
            rec = self.host.pair_record(self._version)
            behind = self._peer_info.get("has_record") != rec.version
            if behind or not rec.same_content(self._sent) or now - self._sent_at >= RESEND_S:
                if not rec.same_content(self._sent):
                    self._version += 1
                    rec = replace(rec, version=self._version)
                record = rec.to_bytes()
                self._sent, self._sent_at = rec, now
            header["version"] = rec.version
        frames.append(msgpack.packb(header, use_bin_type=True))
        if record is not None:
            frames.append(record)
        if not transport.try_send(dealer, frames) and record is not None:
            self._sent = None  # not sent: try again next beat

    async def _on_peer(self, frames: transport.Frames) -> None:
        """``[PEER_MAGIC, header, record?]`` from the peer (either direction)."""
        if len(frames) < 2 or transport.frame_bytes(frames[0]) != PEER_MAGIC:
            raise ProtocolError("not a peer message")
        try:
            header = msgpack.unpackb(transport.frame_buffer(frames[1]), raw=False)
            state = State(header["state"])
            term = header["term"]
            if not isinstance(term, int) or isinstance(term, bool) or term < 0:
                raise ValueError(f"bad term {term!r}")
            inc, seq = str(header.get("inc", "")), header.get("seq", 0)
            if not isinstance(seq, int) or isinstance(seq, bool):
                raise ValueError(f"bad seq {seq!r}")
            order = header.get("record")
            peer_record = None if order is None else (order[0], order[1])
            if peer_record is not None and (len(order) != 2 or not all(map(_count, peer_record))):
                raise ValueError(f"bad record order {order!r}")
        except (KeyError, TypeError, ValueError, msgpack.ExtraData, msgpack.FormatError) as e:
            raise ProtocolError(f"bad peer header: {e}") from e
        if inc == self._heard[0] and seq <= self._heard[1]:
            return  # older than a beat already heard
        self._heard = (inc, seq)
        now = time.monotonic()
        if len(frames) > 2 and state is State.ACTIVE and not self.star.active:
            try:
                self.record = BrokerState.from_bytes(transport.frame_bytes(frames[2]))
            except BrokerStateError as e:
                raise ProtocolError(f"bad broker state from the peer: {e}") from e
            self._held_from = inc
            self.star.record = self._record_order()
            self.host.state_changed()  # into the data dir too
        self._peer_info = {
            "has_record": header.get("has_record"),
            "held_from": header.get("held_from"),
            "record": peer_record and list(peer_record),  # its (term, map version)
        }
        self._check_held()
        try:
            change = self.star.on_peer(state, term, now, peer_record)
        except PairError as e:
            log.error("broker pair misconfigured: %s; check broker.pair_role on both", e)
            return
        if change is not None:
            await self._changed(change, now)

    def _refuse_peer(self, frames: transport.Frames) -> None:
        """A message on the peer link from a key other than the pair's: dropped, and
        logged once per key."""
        key = transport.sender_key(frames[1]) if len(frames) > 1 else None
        self.refused_peers += 1
        if key not in self._refused_keys and len(self._refused_keys) < 64:
            self._refused_keys.add(key)
            log.warning(
                "broker pair: refused a message on the peer link from key %s: only the "
                "pair's own key speaks there",
                key.decode() if key else "(none)",
            )

    def _on_bad_peer(self, frames: transport.Frames, err: ProtocolError) -> None:
        log.warning("dropped a bad message on the peer link: %s", err)

    # -- durable sends -------------------------------------------------------

    def after_held(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` once the standby holds this broker's state as it is now: at
        once when not active or the peer is not alive (a dead peer takes nothing over;
        it stands by when it comes back and is sent the state then), else when the
        standby reports holding a record this broker sent after now.  The record goes
        out at once rather than at the next beat."""
        now = time.monotonic()
        if not (self.star.active and self.peer_alive(now)):
            callback()
            return
        sent = self._sent
        current = sent is not None and self.host.pair_record(sent.version).same_content(sent)
        need = self._version if current else self._version + 1
        self._waiting.append((need, callback))
        if not current and self._dealer is not None:
            self._beat(self._dealer, now)
        self._check_held()

    def _check_held(self) -> None:
        """Release what the standby's last report covers (a record of this process)."""
        held = self._peer_info.get("has_record")
        if self._waiting and self._peer_info.get("held_from") == self._incarnation and _count(held):
            assert isinstance(held, int)
            self._release(held=held)

    def _release(self, *, held: int | None) -> None:
        """Run the waiting sends the standby's record ``held`` covers (None: all)."""
        ready = [cb for need, cb in self._waiting if held is None or need <= held]
        self._waiting = [(n, cb) for n, cb in self._waiting if held is not None and n > held]
        for cb in ready:
            cb()

    # -- transitions ---------------------------------------------------------

    async def _changed(self, change: Transition, now: float) -> None:
        significant = change.activated or change.deactivated or change.stale
        level = logging.WARNING if significant else logging.INFO
        log.log(
            level,
            "broker pair: %s -> %s at term %d (%s)",
            change.old.value,
            change.new.value,
            change.term,
            change.reason,
        )
        if change.activated:
            self._active_term = change.term
            await self._take_over(now, stale=change.stale, alone=change.alone)
        elif change.stale:
            # BinaryStar rule 7: the record this broker took over with binds no more.
            self.host.state.record_stale()
            self.host.state_changed()
        elif change.deactivated:
            # Whatever it knew is stale now: it routes again only after a takeover.
            # Until the peer's record comes, its own last one (stamped with the term it
            # was active at) stands for it.  What waited to go out never goes.
            self.record, self._held_from = self.host.pair_record(0), None
            self.star.record = self._record_order()
            self.host.reset_state(now, hold=self.config.grace)
            self._sent = None
            self._waiting.clear()

    async def _take_over(self, now: float, *, stale: bool = False, alone: bool = False) -> None:
        b = self.host
        rec = self.record
        # Hold for the shards' claims: with the peer's record, they are asked at once
        # (below) and the hold ends when they are in (_end_hold), so it may be long.
        grace, first = self.config.grace, not self.star.failovers
        b.reset_state(now, hold=grace if first else max(grace, 10 * self.interval))
        if rec is not None:
            try:
                b.load_record(rec)
            except ValueError as e:
                log.error("cannot take over the recorded state: %s", e)
                rec = None
        if stale:
            b.state.record_stale()  # BinaryStar rule 7
        # Rule 8: a broker that heard no peer since it started holds for the whole grace
        # (the shards that are up report the terms they obeyed before a write is routed).
        self._takeover_record = None if alone else rec
        self.takeovers.append(now)
        log.warning(
            "broker pair: active at term %d with %s; asking %d shards to register",
            self.term,
            f"the recorded state v{rec.version} (map v{rec.map_version})"
            if rec
            else "no recorded state",
            len(self._shards),
        )
        for ident in sorted(self._shards):
            await b.control(ident, MsgType.REGISTER, {})
        self._shards.clear()

    async def _end_hold(self, now: float) -> None:
        """After a takeover from a record: stop holding once every copy it records is
        back (:func:`zps.core.recovery.claims_in`: the shards reclaim at once; the grace
        period is the bound).  Without a record, or having heard no peer since it
        started (BinaryStar rule 8), the broker holds for the whole grace."""
        state = self.host.state
        if self._takeover_record is not None and not state.holding(now):
            self._takeover_record = None  # the grace ran out
        if self._takeover_record is None or not state.claims_in(now):
            return
        state.hold_until = now
        self._takeover_record = None
        log.info("broker pair: every recorded copy is back; routing")
        await self.host.republish()


def _count(v: object) -> bool:
    """An int >= 0 (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
