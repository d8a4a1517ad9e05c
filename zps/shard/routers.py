"""The shard's links to the routing brokers of the cluster map.

A DEALER to every routing broker the map lists, for requests only (control messages
and the liveness link stay with the broker or pair, :mod:`zps.shard.links`).  A request
that came through one gets the same checks as any and is answered through it; a router
the map no longer lists is kept a minute (its replies in flight still go out, it may
come back).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from zps import transport
from zps.errors import ProtocolError
from zps.protocol.codec import MsgType, Route, encode, unpack_route
from zps.shard import admission
from zps.shard.links import greet

log = logging.getLogger("zps.shard")

Link = tuple[transport.Channel, transport.Outbound]
#: How long a router the map no longer lists is kept (seconds).
ROUTER_KEPT_S = 60.0
#: Clients whose router is remembered; past this many the record starts again.
MAX_VIA = 65536


class RouterLinks:
    """The routing brokers' links and, per client, the one its last request came by."""

    def __init__(
        self,
        *,
        connect: Callable[[str, str], Link],
        start: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        via: dict[bytes, transport.Outbound],
        on_request: Callable[[bytes, Route, list[Any]], None],
        malformed: Callable[[transport.Frames, ProtocolError], None],
        refuse: Callable[[admission.Refuse], None],
        policy: Callable[[], admission.Policy],
        epoch: Callable[[], int],
    ) -> None:
        """``connect(endpoint, name)``: a link; ``start``: run a coroutine beside the
        shard's; ``via``: the record of which router each client came by, kept here and
        read by the reply path (BrokerLinks.via); ``refuse``: count a refusal;
        ``policy``, ``epoch``: the admission policy and the partition's epoch now."""
        self._connect = connect
        self._start = start
        self._on_request = on_request
        self._malformed = malformed
        self._refuse = refuse
        self._policy = policy
        self._epoch = epoch
        #: endpoint -> link, its reply allowance, its reader
        self._links: dict[
            str, tuple[transport.Channel, transport.Outbound, asyncio.Task[None]]
        ] = {}
        #: Per client, the router link its last request came by (its replies go back
        #: there; absent: through the broker), changed in place only.
        self.via = via
        self._absent: dict[str, float] = {}  # endpoint -> since when unlisted
        #: Every endpoint a link was made to: one made again after its link was closed
        #: greets the router marked ``new_link`` from its first connection.
        self._linked: set[str] = set()
        self._beat: list[Any] | None = None  # the latest heartbeat (see beat)

    def follow(self, endpoints: set[str], now: float) -> None:
        """Keep a link to every routing broker of the map (``endpoints``)."""
        for endpoint in self._links:
            if endpoint in endpoints:
                self._absent.pop(endpoint, None)
            else:  # kept a while: its replies in flight still go out, it may come back
                self._absent.setdefault(endpoint, now)
        for endpoint in [e for e, t in self._absent.items() if now - t >= ROUTER_KEPT_S]:
            del self._absent[endpoint]
            sock, out, task = self._links.pop(endpoint)
            task.cancel()
            out.close()
            transport.close(sock)
            for client in [c for c, o in self.via.items() if o is out]:
                del self.via[client]  # in place: the broker links read this dict
        # In a fixed order (a set's varies with the hash seed): a run replays exactly.
        for endpoint in sorted(endpoints - self._links.keys()):
            sock, out = self._connect(endpoint, f"router link {endpoint}")
            greet(sock, lambda: self._beat, new_link=True, linked_before=endpoint in self._linked)
            self._linked.add(endpoint)
            on_frames = functools.partial(self._on_frames, out=out)
            task = self._start(transport.serve(sock, on_frames, self._malformed))
            self._links[endpoint] = (sock, out, task)
            log.info("connected to the routing broker at %s", endpoint)

    def forget(self, client: bytes) -> None:
        """``client``'s request came through the broker: answered through it again."""
        if self.via:
            self.via.pop(client, None)

    def beat(self, frames: list[Any]) -> None:
        """Routing brokers send nothing to a link whose connection closed until the
        shard speaks on its new one (under CURVE), and must learn that a connection was
        made again (what they posted by the one before may be lost with it): the shard
        speaks as each connection is made (the latest heartbeat again, marked
        ``new_link``: :func:`zps.shard.links.greet`), and every heartbeat goes to each
        router too."""
        self._beat = frames
        for sock, _, _ in self._links.values():
            transport.try_send(sock, frames)

    def cancel(self) -> None:
        for _, _, reader in self._links.values():
            reader.cancel()

    def close(self) -> None:
        for sock, out, _ in self._links.values():
            out.close()
            transport.close(sock)

    async def _on_frames(self, frames: transport.Frames, out: transport.Outbound) -> None:
        """A request a routing broker forwarded: the same checks as any (role, epoch,
        lease); the reply goes back through that router."""
        if len(frames) < 3:
            raise ProtocolError(f"{len(frames)} frames from a routing broker")
        source = transport.frame_bytes(frames[0])
        if not source:
            return  # a router's probe of the link (a heartbeat): nothing to answer
        try:
            route = unpack_route(transport.frame_buffer(frames[1]))
        except (KeyError, ValueError, TypeError, OverflowError) as e:
            raise ProtocolError(str(e)) from e
        policy = self._policy()
        if admission.link_full(out.held_bytes, policy):
            # That router reads too slowly for another full reply (admission rule 4).
            refusal = admission.overloaded(policy, "this routing broker")
            self._refuse(refusal)
            reply_route = Route(MsgType.REPLY, route.partition, self._epoch(), route.req_id)
            out.post([source, *encode(reply_route, refusal.header())], policy.reply_queue_bytes)
            return
        if len(self.via) > MAX_VIA:
            self.via.clear()
        self.via[source] = out
        self._on_request(source, route, frames[1:])
