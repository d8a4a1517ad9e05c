"""A client's links to the routing brokers of the map (``zps-server broker --follow``).

The map names each partition's router (``PartitionInfo.router``); a request for the
partition goes there, everything else (HELLO, heartbeats, CLOCK, TASK, STATUS, and
requests for partitions without a router) to the broker pair as before.  A router
echoes every heartbeat, so a router silent for ``failover_timeout`` is *down*: its
partitions' requests go to the broker until it speaks again, and every request in
flight through it, or for a partition it routes, is re-sent (the shards' dedup
record keeps each exactly once; a reply for a request the broker carried may come
back through the router the client used last for that shard).

A router that answers but cannot route a partition now (the primary's link to it is
closed or silent, or it has no map it trusts) says so in its refusal (``bypass``), and
names the partitions whose primary it does not hear in its heartbeat echoes: that
partition's requests go to the broker for ``failover_timeout``, then one goes to the
router again.  The refused ones are re-sent by the session's rules, as for any refusal;
those still in flight through it for the partition at once, to the broker, as for a
silent router (the link that lost the primary may have lost them).

Pure bookkeeping (time is an argument); the connection owns the sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zps.core.routing import ClusterMap
from zps.errors import ProtocolError
from zps.protocol.codec import MsgType, unpack_route

#: Requests in flight remembered at most (a bound for calls that timed out).
MAX_TRACKED = 1 << 16
#: A router the map no longer lists keeps its link this long: the replies it still
#: carries arrive (it may be listed again soon: a broker that restarted or took over
#: lists the routers once they introduce themselves again).
LINGER_S = 60.0


@dataclass(slots=True)
class RouterLink:
    endpoint: str
    heard: float
    down: bool = False


class RouterTable:
    """Which router each partition's requests go to, which are down, and what is in
    flight through which (see the module notes)."""

    def __init__(self, *, failover_timeout: float, interval: float = 0.0) -> None:
        self.failover_timeout = failover_timeout
        #: A gap between ticks longer than this is this process's own stall.
        self.stall = interval + failover_timeout / 2
        self.links: dict[str, RouterLink] = {}
        self.routes: dict[int, str] = {}
        #: req_id -> (router endpoint or "" for the broker, partition)
        self.inflight: dict[int, tuple[str, int]] = {}
        self.failovers = 0
        self._last_tick: float | None = None
        self._absent: dict[str, float] = {}  # endpoint -> since when the map omits it
        #: partition -> (the router that refused it as one the broker can route, until
        #: when its requests go to the broker)
        self.bypassed: dict[int, tuple[str, float]] = {}

    def on_map(self, cmap: ClusterMap, now: float) -> tuple[list[str], list[str]]:
        """Take the map's routers: returns the endpoints to connect and to close (those
        the map has omitted for ``LINGER_S``)."""
        self.routes = {p: i.router for p, i in cmap.partitions.items() if i.router}
        wanted = {r.endpoint for r in cmap.routers} | set(self.routes.values())
        new = [e for e in sorted(wanted) if e not in self.links]
        for e in new:
            self.links[e] = RouterLink(e, heard=now)
        for e in self.links:
            if e in wanted:
                self._absent.pop(e, None)
            else:
                self._absent.setdefault(e, now)
        gone = [e for e, since in self._absent.items() if now - since >= LINGER_S]
        for e in gone:
            del self.links[e], self._absent[e]
        return new, gone

    def pick(self, frames: Sequence[Any], req_id: int, now: float) -> str:
        """The router endpoint to send a message to ("": the broker)."""
        if not self.routes or not req_id:
            return ""
        try:
            route = unpack_route(frames[0])
        except ProtocolError:
            return ""
        if route.mtype is not MsgType.REQUEST:
            return ""
        endpoint = self.routes.get(route.partition, "")
        link = self.links.get(endpoint) if endpoint else None
        if link is None or link.down:
            endpoint = ""
        elif self.bypassed:
            by = self.bypassed.get(route.partition)
            if by is not None and by[0] == endpoint and now < by[1]:
                endpoint = ""
        if len(self.inflight) >= MAX_TRACKED:
            self.inflight.clear()
        self.inflight[req_id] = (endpoint, route.partition)
        return endpoint

    def refused(
        self, endpoint: str, partition: int, req_id: int, now: float, *, bypass: bool
    ) -> tuple[bool, list[int]]:
        """The router at ``endpoint`` answered request ``req_id`` for ``partition``;
        ``bypass``: it refused it as one the broker can route.  Whether that starts a
        bypass of it for the partition, or ends one (it routed the partition's request
        again); and, as one starts, the other requests in flight through it for the
        partition, to send again: the link that carried them is gone, and them with it,
        as far as anyone knows (the shard's dedup record keeps each exactly once)."""
        if bypass:
            started = partition not in self.bypassed
            self.bypassed[partition] = (endpoint, now + self.failover_timeout)
            if not started:
                return False, []
            lost = [
                r
                for r, (e, p) in self.inflight.items()
                if e == endpoint and p == partition and r != req_id
            ]
            return True, lost
        by = self.bypassed.get(partition)
        if by is not None and by[0] == endpoint:
            del self.bypassed[partition]
            return True, []
        return False, []

    def unroutable(
        self, endpoint: str, partitions: object, now: float
    ) -> tuple[list[int], list[int]]:
        """The router at ``endpoint`` named ``partitions`` in its heartbeat echo as ones
        whose primary it does not hear: those it routes by this client's map are bypassed
        as after a refusal (:meth:`refused`).  The partitions whose bypass that starts,
        and the requests to send again."""
        if not isinstance(partitions, list):
            return [], []
        started: list[int] = []
        lost: list[int] = []
        for p in partitions:
            if type(p) is int and self.routes.get(p) == endpoint:
                new, again = self.refused(endpoint, p, 0, now, bypass=True)
                if new:
                    started.append(p)
                    lost += again
        return started, lost

    def through(self, endpoint: str) -> list[int]:
        """The requests in flight through the router at ``endpoint``."""
        return [r for r, (e, _) in self.inflight.items() if e == endpoint]

    def answered(self, req_id: int) -> None:
        if self.inflight:
            self.inflight.pop(req_id, None)

    def heard(self, endpoint: str, now: float) -> bool:
        """A message from the router: True if it was down and is back."""
        link = self.links.get(endpoint)
        if link is None:
            return False
        link.heard = now
        if link.down:
            link.down = False
            return True
        return False

    def tick(self, now: float) -> tuple[list[str], list[int]]:
        """Routers that just went down, and the requests to re-send for them.

        Called every heartbeat interval; after a much longer gap this process was
        stalled (its loop blocked, or paused), the routers' answers may be unread: every
        router gets a fresh grace period instead of being judged."""
        last, self._last_tick = self._last_tick, now
        if last is not None and now - last > self.stall:
            for link in self.links.values():
                link.heard = max(link.heard, now)
            return [], []
        down = []
        for link in self.links.values():
            if not link.down and now - link.heard >= self.failover_timeout:
                link.down = True
                down.append(link.endpoint)
        if not down:
            return [], []
        self.failovers += len(down)
        gone = set(down)
        resend = [
            req_id
            for req_id, (endpoint, partition) in self.inflight.items()
            if endpoint in gone or self.routes.get(partition) in gone
        ]
        return down, resend
