"""A client's links to the routing brokers its map lists: a DEALER to each (the broker's
own socket when one is also given as a broker), heartbeats, requests sent through the
partition's router, and failover to the broker from a router that is silent, or that
refuses a partition as one the broker can route.  What to do is decided by
:class:`~zps.client.routers.RouterTable`; this module carries it out.

It needs the client's identity and settings, its clock, the session's ``unsent`` (a
request to send again), the timer's ``schedule``, and where a router's reply goes:
nothing else of the connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import zmq.asyncio

from zps import transport
from zps.client.routers import RouterTable
from zps.core.routing import ClusterMap
from zps.errors import ProtocolError
from zps.ops.config import ClientConfig
from zps.ops.security import load_curve_keys
from zps.protocol.codec import Message, MsgType, Route, decode, encode
from zps.protocol.messages import Heartbeat

log = logging.getLogger("zps.client")

#: Where a router's reply goes: its frames' buffers and the decoded message.
OnReply = Callable[[list[Any], Message], Awaitable[None]]
#: A message that could not be decoded: its frames and the error.
OnMalformed = Callable[[transport.Frames, ProtocolError], None]


class RouterLinks:
    """The links (see the module notes); true while any is open."""

    def __init__(
        self,
        client_id: bytes,
        config: ClientConfig,
        *,
        now: Callable[[], float],
        unsent: Callable[[int, float], None],
        reschedule: Callable[[], None],
    ) -> None:
        self.client_id = client_id
        self.config = config
        self._now = now
        self._unsent = unsent
        self._reschedule = reschedule
        self.table = RouterTable(
            failover_timeout=config.failover_timeout, interval=config.heartbeat.interval
        )
        #: By endpoint: the socket, and the task reading it (None: a broker's socket).
        self.socks: dict[str, tuple[transport.Channel, asyncio.Task[None] | None]] = {}

    def __bool__(self) -> bool:
        return bool(self.socks)

    def follow(
        self,
        cmap: ClusterMap,
        *,
        ctx: zmq.asyncio.Context,
        tg: asyncio.TaskGroup,
        brokers: Mapping[str, transport.Channel],
        on_reply: OnReply,
        on_malformed: OnMalformed,
    ) -> list[asyncio.Task[None]]:
        """Connect to the routing brokers the map lists (and drop those it no longer
        does), ``brokers`` (by endpoint) the sockets of the brokers; the tasks reading
        the new sockets."""
        tasks: list[asyncio.Task[None]] = []
        if not cmap.routers and not self.socks:
            return tasks
        new, gone = self.table.on_map(cmap, self._now())
        for endpoint in gone:
            sock, task = self.socks.pop(endpoint)
            if task is not None:
                task.cancel()
                transport.close(sock)
        keys = load_curve_keys(self.config.security) if new else None
        for endpoint in new:
            if endpoint in brokers:  # given as a broker: its socket serves both
                self.socks[endpoint] = (brokers[endpoint], None)
                continue
            sock = transport.dealer(
                ctx,
                endpoint,
                self.client_id,
                max_message_bytes=self.config.max_message_bytes,
                curve=keys,
                server_public=keys.server_public if keys else None,
                watch=True,
            )
            sock.on_connected = functools.partial(self._connected, endpoint, sock)
            on_frames = functools.partial(self._on_message, endpoint, on_reply)
            task = tg.create_task(transport.serve(sock, on_frames, on_malformed))
            self.socks[endpoint] = (sock, task)
            tasks.append(task)
        return tasks

    def send(self, frames: list[Any], routed: list[Any], req_id: int) -> bool:
        """Send ``frames`` (a request first sent as ``routed``) through its partition's
        routing broker, never waiting; False: it goes to the broker."""
        if not self.table.routes:
            return False
        endpoint = self.table.pick(routed, req_id, self._now())
        if not endpoint:
            return False
        if not transport.try_send(self.socks[endpoint][0], frames):
            self._unsent(req_id, self._now())
        return True

    def beats(self) -> None:
        """Heartbeats to every routing broker (each echoes them), and fail over from one
        silent for ``failover_timeout``: what was in flight through it, or for its
        partitions, is sent again, to the broker."""
        beat = encode(Route(MsgType.HEARTBEAT), Heartbeat().to_wire())
        for sock, _ in self.socks.values():
            transport.try_send(sock, beat)
        now = self._now()
        down, resend = self.table.tick(now)
        for endpoint in down:
            log.warning(
                "the routing broker at %s is silent; its requests go to the broker (%d "
                "to send again)",
                endpoint,
                len(resend),
            )
        self._send_again(resend, now)

    def _connected(self, endpoint: str, sock: transport.Dealer) -> None:
        """A connection to the router at ``endpoint`` was made: made again, what is in
        flight through it is sent again (the one before may have taken it, or its reply,
        with it; the shards' dedup record keeps each once)."""
        if sock.handshakes is not None and sock.handshakes.connected > 1:
            self._send_again(self.table.through(endpoint), self._now())

    def heard_broker(self, endpoint: str) -> None:
        """A message from a broker: if it is a router too, it is alive."""
        if endpoint in self.socks:
            self.table.heard(endpoint, self._now())

    def answered(self, msg: Message) -> None:
        """A reply: the requests it answers (its own unless a first part, and those of
        its ``acked``) are no longer tracked for re-sending."""
        if not self.table.inflight:
            return
        if msg.header.get("part") != 1:  # a first part: the writes are still due
            self.table.answered(msg.route.req_id)
        acked = msg.header.get("acked")
        if isinstance(acked, list):
            for item in acked:
                if isinstance(item, list) and item and type(item[0]) is int:
                    self.table.answered(item[0])

    async def _on_message(self, endpoint: str, on_reply: OnReply, frames: transport.Frames) -> None:
        if self.table.heard(endpoint, self._now()):
            log.info("the routing broker at %s answers again", endpoint)
        bufs = [transport.frame_buffer(f) for f in frames]
        msg = decode(bufs)
        if msg.route.mtype is MsgType.HEARTBEAT:  # its echo: which primaries it hears
            if "unroutable" in msg.header:
                now = self._now()
                started, lost = self.table.unroutable(endpoint, msg.header["unroutable"], now)
                for p in started:
                    log.warning(
                        "the routing broker at %s does not hear the primary of partition "
                        "%d; its requests go to the broker",
                        endpoint,
                        p,
                    )
                self._send_again(lost, now)
            return
        if msg.route.mtype is not MsgType.REPLY:
            return
        self._bypass(endpoint, msg)
        await on_reply(bufs, msg)

    def _send_again(self, req_ids: list[int], now: float) -> None:
        for req_id in req_ids:
            self._unsent(req_id, now)
        if req_ids:
            self._reschedule()

    def _bypass(self, endpoint: str, msg: Message) -> None:
        """A reply from the router at ``endpoint``: a refusal marked ``bypass`` sends its
        partition's requests to the broker for a while (:meth:`RouterTable.refused`)."""
        bypass = msg.header.get("bypass") is True
        if not bypass and not self.table.bypassed:
            return
        p, now = msg.route.partition, self._now()
        changed, lost = self.table.refused(endpoint, p, msg.route.req_id, now, bypass=bypass)
        if not changed:
            return
        if bypass:
            log.warning(
                "the routing broker at %s cannot route partition %d now (%s); its requests "
                "go to the broker (%d to send again)",
                endpoint,
                p,
                msg.header.get("msg", ""),
                len(lost),
            )
            self._send_again(lost, now)
        else:
            log.info("the routing broker at %s routes partition %d again", endpoint, p)

    def close(self) -> None:
        for sock, task in self.socks.values():
            if task is not None:
                transport.close(sock)
