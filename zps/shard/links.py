"""The shard's links to the broker (or the broker pair), and the pair's fencing.

* a DEALER to each broker, the *data link*: registration (claiming what it already
  serves, so a restarted broker rebuilds its map), requests and replies.  Frames from
  the broker are ``[source, route, header, payloads...]``: an empty ``source`` is the
  broker itself, anything else a client to answer.
* a second DEALER to each, the *liveness link* (identity ``h-`` + the shard's,
  :mod:`zps.core.membership`): heartbeats and the broker's lease echoes only, so
  neither waits behind bulk data queued on the first (a lease that ran out while its
  echo sat behind seconds of data refused requests that had already crossed the link).
  Served by a thread of its own (:class:`transport.LinkThread`).  Until the broker has
  answered on it (an older broker does not), heartbeats also go on the data link.

Under CURVE a broker sends to the shard's name only over a connection that carried an
accepted message of it, so each data link speaks as soon as its connection is made
(again): its latest heartbeat, retimed (:func:`greeting`).  The liveness link needs no
such word: the broker only answers what comes on it.

With a broker pair, control messages go to both, and requests are taken (and replies
sent) only through the broker whose term is the highest seen (:meth:`BrokerLinks.fenced`:
an older broker's messages are dropped, its requests refused).  That term is kept in
the data dir (:class:`BrokerTerm`) before a message of it is obeyed, and reported in
every control message, so a broker of the pair that starts from a record older than
a term the shards obeyed learns it, after a power loss too (:mod:`zps.core.bstar`
rule 7).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq.asyncio

from zps import transport
from zps.core.membership import liveness_identity
from zps.errors import ProtocolError
from zps.ops import durable
from zps.ops.config import ShardConfig
from zps.protocol.codec import (
    PROTOCOL_VERSION,
    MsgType,
    Route,
    VersionMismatchError,
    decode,
    encode,
    unpack_route,
)
from zps.protocol.messages import (
    Assign,
    BrokerToShard,
    Heartbeat,
    LeaseEcho,
    MapUpdate,
    RegisterAgain,
)
from zps.shard import admission
from zps.shard.liveness import Liveness, retimed
from zps.transport import CurveKeys
from zps.version import __version__

log = logging.getLogger("zps.shard")

Link = tuple[transport.Channel, transport.Outbound]


#: The file in a shard's data dir holding the highest broker term it obeyed.
TERM_FILE = "broker-term"


class BrokerTerm:
    """The highest term of a broker of the pair this shard obeyed, kept in its data dir
    (``data_dir`` None: in memory only).  The file is replaced atomically and synced
    before a newer term is taken (:meth:`obey`), so what a shard reports after a power
    loss is never below a term it acted on.  Its ``os`` name is the simulator's disk
    seam (:func:`zps.testing.sim.disk.install`)."""

    def __init__(self, data_dir: str | os.PathLike[str] | None) -> None:
        self.path = None if data_dir is None else os.path.join(data_dir, TERM_FILE)
        self.value = 0
        #: A newer term could not be kept (the message was dropped): the caller asks the
        #: broker to say again what it said (the shard registers again) and clears it.
        self.failed = False
        if self.path is not None:
            try:
                with open(self.path, "rb") as f:
                    text = f.read().strip()
                self.value = int(text) if text.isdigit() else 0
            except FileNotFoundError:
                pass

    def obey(self, term: int) -> bool:
        """Whether a message of broker term ``term`` may be obeyed: not below the highest
        term kept; a newer one is kept first (False if it could not be: the message is
        dropped, :attr:`failed` set)."""
        if term < self.value:
            return False
        if term > self.value and self.path is not None:
            try:
                # Through this module's ``os``: the seam named above.
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                durable.write_atomic(self.path, f"{term}\n".encode(), fs=os)
            except OSError as e:
                log.error("cannot keep broker term %d in %s: %s", term, self.path, e)
                self.failed = True
                return False
        self.value = term
        return True


def from_broker(mtype: MsgType, header: dict[str, Any]) -> BrokerToShard | None:
    """The record of a control message from the broker (None: not one a shard expects).

    A HEARTBEAT with a role is the echo that renews the lease; without, a probe."""
    match mtype:
        case MsgType.ASSIGN:
            return Assign.parse(header)
        case MsgType.MAP:
            return MapUpdate.parse(header)
        case MsgType.HEARTBEAT if "role" in header:
            return LeaseEcho.parse(header)
        case MsgType.HEARTBEAT:
            return Heartbeat.parse(header)
        case MsgType.REGISTER:
            return RegisterAgain.parse(header)
        case _:
            return None


def greeting(beat: list[Any] | None, now: float, *, new_link: bool = False) -> list[Any] | None:
    """What a link says as its connection is made: the shard's latest heartbeat sent
    again at ``now`` without what only the loop may report
    (:func:`zps.shard.liveness.retimed`), marked ``new_link`` if asked; None before the
    first heartbeat (the shard's REGISTER, queued at start, is its first word)."""
    if beat is None:
        return None
    return retimed(beat, now, new_link=True) if new_link else retimed(beat, now)


def greet(
    sock: transport.Channel,
    beat: Callable[[], list[Any] | None],
    *,
    new_link: bool = False,
    linked_before: bool = False,
) -> None:
    """Have ``sock`` (a :class:`transport.Dealer` whose handshakes are watched: CURVE, or
    ``watch``) send :func:`greeting` of the latest heartbeat ``beat()`` as each of its
    connections is made; ``new_link``: marked so when a connection to the same endpoint
    came before it (a broker then has its clients send again what it forwarded by the
    connection before, and a routing broker answers what it posted there, which may be
    lost with it): from the socket's second connection on, or from its first when an
    earlier socket of this process reached that endpoint (``linked_before``).  A first
    connection is not marked otherwise: nothing went by one before it, and a mark would
    have the clients send again, for nothing, what they have in flight to the partition."""
    if not isinstance(sock, transport.Dealer):
        return
    dealer = sock

    def on_connected() -> None:
        watch = dealer.handshakes
        again = new_link and (linked_before or (watch is not None and watch.connected > 1))
        frames = greeting(beat(), time.monotonic(), new_link=again)
        if frames is not None:
            transport.try_send(dealer, frames)

    dealer.on_connected = on_connected


def dealer_link(
    ctx: zmq.asyncio.Context,
    config: ShardConfig,
    node_id: str,
    keys: CurveKeys | None,
    endpoint: str,
    name: str = "broker link",
    *,
    silence: float | None = None,
    watch: bool = False,
) -> Link:
    """A DEALER to ``endpoint`` (a broker, or a routing broker) with its own reply
    allowance (``shard.reply_queue_bytes``).  Its ZMTP heartbeats, with or without CURVE,
    make again a connection whose server answers no ping (a routing broker sends a
    shard's link nothing else to judge silence by); ``watch``: its connections are
    watched without CURVE too (:func:`greet`)."""
    hb = config.heartbeat
    sock = transport.dealer(
        ctx,
        endpoint,
        node_id.encode(),
        max_message_bytes=config.max_message_bytes,
        curve=keys,
        server_public=keys.server_public if keys else None,
        silence=silence,
        heartbeats=True,
        watch=watch,
    )
    out = transport.Outbound(
        sock,
        total_limit=config.reply_queue_bytes,
        stall_timeout=2 * hb.interval * hb.liveness,
        name=name,
    )
    return sock, out


class BrokerLinks:
    """The data and liveness links to every broker of the configuration."""

    def __init__(
        self,
        config: ShardConfig,
        node_id: str,
        *,
        lease: Callable[[], float],
        epoch: Callable[[], int],
        on_control: Callable[[Route, dict[str, Any]], Awaitable[None]],
        on_request: Callable[[bytes, Route, list[Any]], None],
        on_seen: Callable[[], None],
        count_malformed: Callable[[], None],
    ) -> None:
        self.config = config
        self.node_id = node_id
        self._lease = lease
        self._epoch = epoch
        self._on_control = on_control
        self._on_request = on_request
        self._on_seen = on_seen
        self._count_malformed = count_malformed
        #: Per client, the routing broker's link its last request came by: its replies
        #: go back there (zps.shard.routers keeps it; empty: every reply to the broker).
        self.via: dict[bytes, transport.Outbound] = {}
        self.keys: CurveKeys | None = None
        #: Every data link, the one followed, and the highest term seen (broker pair).
        self.links: list[Link] = []
        self.current = 0
        self._term = BrokerTerm(config.data_dir if len(config.endpoints) > 1 else None)
        #: The data link followed, and what is sent on it beyond zmq's queue (bounded in
        #: bytes: past ``reply_queue_bytes - max_message_bytes`` held, requests are refused).
        self.sock: transport.Channel | None = None
        self.out: transport.Outbound | None = None
        #: The liveness links' thread; what it hears, for the loop; and when each link
        #: was last heard from (an echo: the broker serves liveness links).
        self.liveness: transport.LinkThread | None = None
        self.beat_policy: Liveness | None = None
        self._inbox: asyncio.Queue[tuple[int, list[bytes]]] = asyncio.Queue(1024)
        self._heard_at: list[float] = []
        # Per data link: the messages it had received, and since when (see beat).
        self._data_heard: dict[int, tuple[int, float]] = {}
        #: The latest heartbeat (said again as a data link's connection is made).
        self.last_beat: list[Any] | None = None
        #: Set (in the loop) if the liveness thread fails: see _failed.
        self._dead: asyncio.Future[BaseException] | None = None
        self._version_warned = False

    # -- opening and closing ---------------------------------------------------------

    def open(self, ctx: zmq.asyncio.Context, keys: CurveKeys | None) -> None:
        """Connect to every broker (in the event loop)."""
        cfg, hb = self.config, self.config.heartbeat
        self.keys = keys
        brokers = cfg.endpoints
        silence = transport.reconnect_silence(hb.interval, hb.liveness)
        first = dealer_link(ctx, cfg, self.node_id, keys, brokers[0], silence=silence, watch=True)
        self.links = [
            first,
            *(dealer_link(ctx, cfg, self.node_id, keys, b, watch=True) for b in brokers[1:]),
        ]
        self.sock, self.out = first
        for sock, _ in self.links:
            # Marked: the broker has its clients send again what is in flight to this
            # shard's partition (what it forwarded by the connection before may be lost).
            greet(sock, lambda: self.last_beat, new_link=True)
        loop = asyncio.get_running_loop()
        self._dead = loop.create_future()
        self.beat_policy = Liveness(hb.interval, hb.liveness, hb.max_loop_stall, time.monotonic())
        # The DEALERs for heartbeats and lease echoes only, served by a thread: the
        # shard's key, its identity behind ``h-`` (the broker counts it as the shard's,
        # bound to the same key).
        self.liveness = transport.LinkThread(
            ctx,
            brokers,
            liveness_identity(self.node_id.encode()),
            policy=self.beat_policy,
            deliver=lambda link, frames: loop.call_soon_threadsafe(self._heard, link, frames),
            on_failure=lambda err: loop.call_soon_threadsafe(self._failed, err),
            max_message_bytes=cfg.max_message_bytes,
            curve=keys,
            server_public=keys.server_public if keys else None,
            name="zps-liveness",
            silence=silence,
        )
        self.liveness.start()
        self._heard_at = [float("-inf")] * len(brokers)

    def serve(self, tg: asyncio.TaskGroup) -> list[asyncio.Task[None]]:
        """The tasks that read every link and watch the liveness thread."""
        tasks = []
        for i, (sock, _) in enumerate(self.links):
            serve = transport.serve(
                sock,
                functools.partial(self.on_frames, link=i),
                self.malformed,
                fast=functools.partial(self.on_request, link=i),
                on_burst=self._on_seen,
            )
            tasks.append(tg.create_task(serve))
        tasks.append(tg.create_task(self._serve_liveness()))
        tasks.append(tg.create_task(self._watch()))
        return tasks

    def stop_liveness(self) -> None:
        """No more heartbeats (a graceful stop: the broker must not re-admit us)."""
        if self.liveness is not None:
            self.liveness.stop()

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
        # Every link: after following the other broker of a pair, self.sock is link 1,
        # and an unclosed link 0 would hang the context's term.
        for sock, out in self.links:
            out.close()
            transport.close(sock)
        self.stop_liveness()
        if self.sock is not None:
            transport.close(self.sock)

    # -- sending ---------------------------------------------------------------------

    def send(self, mtype: MsgType, header: dict[str, Any]) -> None:
        """A control message to every broker.  Best effort, never blocking: control
        messages are repeated or asked for again, and a broker link that is down (or
        refused us) must not hang the shard, not even its shutdown."""
        frames = [b"", *encode(Route(mtype), self.with_term(header))]
        for sock in self._socks():
            if not transport.try_send(sock, frames):
                log.debug("dropped a %s to the broker: its queue is full", mtype.name)

    def beat(self, frames: list[Any]) -> None:
        """A heartbeat: on every liveness link, and on a data link whose broker does not
        answer on its liveness link (not yet, an older broker, or under CURVE a data
        link quiet for a lease)."""
        self.last_beat = frames
        if self.liveness is not None:
            self.liveness.post(frames)
        now = time.monotonic()
        lease = self._lease()
        for i, sock in enumerate(self._socks()):
            if (
                i < len(self._heard_at)
                and now - self._heard_at[i] < lease
                and not self._data_link_quiet(sock, now, lease)
            ):
                continue  # the broker answers on the liveness link
            transport.try_send(sock, frames)

    def post(self, frames: list[Any]) -> None:
        """A reply to client ``frames[0]``: to the broker, or to the routing broker its
        request came by (:attr:`via`), without waiting; held within
        ``reply_queue_bytes`` while its queue is full, dropped past that (the client's
        request times out or is retried)."""
        via = self.via
        out = via.get(frames[0], self.out) if via else self.out
        if out is None:
            return  # not connected yet
        if not out.ch.closed:
            posted = out.post(frames, self.config.reply_queue_bytes)
            if posted is transport.Posted.DROPPED:
                log.warning("dropped a reply: the broker link holds %d bytes", out.held_bytes)

    def held_bytes(self) -> int:
        """Bytes held for the broker followed beyond zmq's queue."""
        return 0 if self.out is None else self.out.held_bytes

    @property
    def term(self) -> int:
        """The highest broker term obeyed (kept in the data dir: :class:`BrokerTerm`)."""
        return self._term.value

    def with_term(self, header: dict[str, Any]) -> dict[str, Any]:
        """A broker pair learns from the shards the highest term they have seen."""
        return {**header, "term": self.term} if len(self.links) > 1 else header

    def _socks(self) -> list[transport.Channel]:
        assert self.sock is not None
        return [sock for sock, _ in self.links] or [self.sock]

    # -- receiving -------------------------------------------------------------------

    def fenced(self, link: int, header: dict[str, Any]) -> bool:
        """Broker pair: drop a control message from a broker older than the highest term
        seen; one from a broker at least as new makes it the broker followed."""
        term = header.get("term")
        if len(self.links) < 2 or not isinstance(term, int) or isinstance(term, bool):
            return False
        if not self._term.obey(term):
            return True
        if link != self.current:
            log.warning("following the broker at %s (term %d)", self.config.endpoints[link], term)
            self.current = link
            self.sock, self.out = self.links[link]
        return False

    async def on_frames(self, frames: transport.Frames, link: int = 0) -> None:
        if self.on_request(frames, link):
            return
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
            msg = decode([transport.frame_buffer(f) for f in frames[1:]])
            if not self.fenced(link, msg.header):
                await self._on_control(route, msg.header)
            elif self._term.failed:
                # Its term could not be kept: the message was dropped, and the shard
                # registers again, so the broker says again what it said.
                self._term.failed = False
                await self._on_control(Route(MsgType.REGISTER), {})
        except (KeyError, ValueError, TypeError, OverflowError) as e:
            raise ProtocolError(str(e)) from e

    def on_request(self, frames: transport.Frames, link: int = 0) -> bool:
        """A client's request the broker routed here, handled at once; False for the
        broker's own control messages (the serving task's).  Run in the link's reader
        callback (see transport.serve)."""
        if len(frames) < 3:
            raise ProtocolError(f"{len(frames)} frames from the broker")
        source = transport.frame_bytes(frames[0])
        if not source:
            return False
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
        except (KeyError, ValueError, TypeError, OverflowError) as e:
            raise ProtocolError(str(e)) from e
        if link != self.current:
            # Routed by a broker of the pair that was replaced: the client retries.
            sock = self.links[link][0]
            reply_route = Route(MsgType.REPLY, route.partition, self._epoch(), route.req_id)
            refusal = admission.REPLACED.header()
            transport.try_send(sock, [source, *encode(reply_route, refusal)])
            return True
        self._on_request(source, route, frames[1:])
        return True

    def malformed(self, frames: transport.Frames, e: ProtocolError) -> None:
        self._count_malformed()
        if isinstance(e, VersionMismatchError) and frames and not transport.frame_bytes(frames[0]):
            if not self._version_warned:  # the broker answers every REGISTER this way
                self._version_warned = True
                log.error(
                    "the broker at %s speaks protocol version %d, this shard (zps %s) %d: "
                    "it cannot join until both run releases of one protocol version",
                    self.config.broker,
                    e.version,
                    __version__,
                    PROTOCOL_VERSION,
                )
            return
        if len(frames) >= 3:  # a truncated message is only counted
            source = transport.frame_bytes(frames[0])
            log.warning("dropped a bad message (%s): %s", "request" if source else "control", e)

    def _heard(self, link: int, frames: list[bytes]) -> None:
        """A message on a liveness link, from its thread (called in the loop)."""
        with contextlib.suppress(asyncio.QueueFull):  # echoes only: the next one will do
            self._inbox.put_nowait((link, frames))

    async def _serve_liveness(self) -> None:
        while True:
            link, frames = await self._inbox.get()
            try:
                await self._on_liveness_frames(frames, link)
            except ProtocolError as e:
                self.malformed(frames, e)
            self._on_seen()

    async def _on_liveness_frames(self, frames: transport.Frames, link: int) -> None:
        """A lease echo (or another control message) on a liveness link; it carries the
        broker's term like any other, so fencing is the same as on the data link."""
        if len(frames) < 3 or transport.frame_bytes(frames[0]):
            raise ProtocolError("a liveness link carries control messages only")
        self._heard_at[link] = time.monotonic()
        await self.on_frames(frames, link)

    def _data_link_quiet(self, sock: transport.Channel, now: float, lease: float) -> bool:
        """Whether the broker sent nothing on data link ``sock`` (its probes come every
        heartbeat interval) for a lease.  Under CURVE it sends nothing on a data link
        whose connection closed until the shard speaks on the new one, which it does as
        the connection is made (:func:`greet`); should that word be lost, the heartbeat
        goes there too then."""
        if self.keys is None:
            return False  # without CURVE a reconnected link is heard at once
        count, since = self._data_heard.get(id(sock), (-1, now))
        if sock.received != count:
            self._data_heard[id(sock)] = (sock.received, now)
            return False
        return now - since >= lease

    def _failed(self, error: BaseException) -> None:
        """The liveness thread failed (called in the loop)."""
        if self._dead is not None and not self._dead.done():
            self._dead.set_result(error)

    async def _watch(self) -> None:
        """A shard whose liveness thread failed is heard no more: the broker will fail it
        over, and one that went on serving would do so unheard.  It stops at once, with
        an error (its service manager starts it again, and it registers anew)."""
        assert self._dead is not None
        error = await self._dead
        log.critical("the liveness thread failed (%s): the shard stops", error)
        raise RuntimeError(f"shard {self.node_id}: its liveness thread failed: {error}")
