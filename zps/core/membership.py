"""Failure detection by heartbeat, with time passed in.

A peer is alive while it has been heard from within ``interval * liveness``
seconds.  Any traffic counts as a heartbeat: drivers call :meth:`seen` for
every message.  No clock is read here; tests drive ``now`` by hand.

The detector never blames peers for its own stall: when ticks stop for longer
than half the timeout (the process was paused, or its loop blocked), the
peers' messages are still queued unread, so every peer gets a fresh grace
period instead of being declared dead.  Before its first tick, the time it
started (or, not given, the first peer heard) stands for the last tick: a
process paused in its first moments does not blame its peers either.

Liveness is measured apart from I/O: a shard keeps a second connection to each broker,
its *liveness link*, that carries only its heartbeats and the broker's lease echoes, so
neither waits behind bulk data queued on its data connection.  Its identity is the
shard's with :data:`LIVENESS_PREFIX` in front; :func:`speaks_for` maps either identity
to the node it speaks for.
"""

from __future__ import annotations

#: Every shard identity starts with this.
SHARD_PREFIX = b"s-"
#: A shard's liveness link: this, then the shard's own identity (``h-s-...``).
LIVENESS_PREFIX = b"h-"


def liveness_identity(shard_identity: bytes) -> bytes:
    """The identity of the liveness link of the shard ``shard_identity``."""
    return LIVENESS_PREFIX + shard_identity


def is_liveness(ident: bytes) -> bool:
    """Whether ``ident`` is a shard's liveness link (``h-s-...``)."""
    return ident.startswith(LIVENESS_PREFIX + SHARD_PREFIX)


def speaks_for(ident: bytes) -> bytes:
    """The identity of the node a connection speaks for: the shard's own for its
    liveness link, ``ident`` itself for any other."""
    return ident[len(LIVENESS_PREFIX) :] if is_liveness(ident) else ident


class FailureDetector:
    __slots__ = (
        "_closed",
        "_dropped",
        "_last",
        "_last_tick",
        "_linked",
        "_stalled_at",
        "interval",
        "liveness",
    )

    def __init__(self, interval: float, liveness: int, start: float | None = None) -> None:
        """``start``: when the detector starts watching (its first tick's reference for
        a stall of its own); None: the first :meth:`seen`."""
        if interval <= 0 or liveness < 1:
            raise ValueError("heartbeat interval must be > 0 and liveness >= 1")
        self.interval = interval
        self.liveness = liveness
        self._last: dict[str, float] = {}
        self._last_tick: float | None = start
        #: When this detector last found itself stalled (see :meth:`tick`).
        self._stalled_at: float | None = None
        #: Shards whose liveness link carried a message: they have two connections.
        self._linked: set[str] = set()
        #: node -> (whether the liveness link's route was dropped, when), for one drop.
        self._dropped: dict[str, tuple[bool, float]] = {}
        #: Shards found dead by their connections (:meth:`route_dropped`), until asked.
        self._closed: set[str] = set()

    @property
    def timeout(self) -> float:
        return self.interval * self.liveness

    def seen(self, node: str, now: float) -> None:
        self._last[node] = now
        if self._last_tick is None:
            self._last_tick = now

    @property
    def last_heard(self) -> dict[str, float]:
        """When each node was last heard from: :meth:`seen` writes it, and so does the
        broker's compiled data path (:mod:`zps.broker.forward`) for the senders it
        forwards."""
        return self._last

    def suspect(self, node: str, now: float, grace: float) -> None:
        """Its connection is gone: dead unless heard from within ``grace`` seconds.

        A live peer that merely reconnects says something well within that; a
        killed one is declared dead long before the full timeout.
        """
        last = self._last.get(node)
        if last is not None:
            self._last[node] = min(last, now + grace - self.timeout)

    def linked(self, node: str) -> None:
        """``node``'s liveness link carried a message: the shard has two connections to
        this process, and :meth:`route_dropped` may weigh them together."""
        self._linked.add(node)

    def route_dropped(self, node: str, liveness: bool, now: float) -> bool:
        """zmq dropped the route of a shard's data connection (``liveness`` False) or of
        its liveness link: that connection closed.  Returns whether to probe the other one
        (a send to it tells whether its route is gone too, which is then reported here).

        Rule: one connection gone, the shard gets two intervals to speak (:meth:`suspect`):
        a live shard may be making it again.  Both gone within those two intervals, it is
        dead at the next tick: a live shard closes its connections only when its broker
        has been silent for seconds (ZMTP heartbeats, a CURVE client's reconnect silence
        and the handshake bound are all 4 s or more), and a killed one has closed them all.
        Except within a timeout of this detector's own stall: a pause that long is the
        silence that makes live shards reconnect, and their old routes drop as it ends."""
        grace = 2 * self.interval
        calm = self._stalled_at is None or now - self._stalled_at > self.timeout
        both = node in self._linked and calm
        other = self._dropped.pop(node, None)
        if both and other is not None and other[0] != liveness and now - other[1] <= grace:
            self.suspect(node, now, 0.0)
            self._closed.add(node)
            return False
        self._dropped[node] = (liveness, now)
        self.suspect(node, now, grace)
        return both

    def probes(self, now: float) -> list[tuple[str, bool]]:
        """The shards with one connection's route dropped within the last two intervals,
        and whether to probe the liveness link (True) or the data connection: each tick
        asks again, as the other connection's close may reach zmq a little later."""
        grace = 2 * self.interval
        for node in [n for n, (_, t) in self._dropped.items() if now - t > grace]:
            del self._dropped[node]
        return [(node, not lv) for node, (lv, _) in self._dropped.items() if node in self._linked]

    def closed(self, node: str) -> bool:
        """Whether ``node``, declared dead, was found so by its connections (both
        closed), not by its silence; asked once."""
        if node in self._closed:
            self._closed.discard(node)
            return True
        return False

    def forget(self, node: str) -> None:
        self._last.pop(node, None)
        self._linked.discard(node)
        self._dropped.pop(node, None)
        self._closed.discard(node)

    def __contains__(self, node: object) -> bool:
        return node in self._last

    def last_seen(self, node: str) -> float | None:
        return self._last.get(node)

    def tick(self, now: float) -> list[str]:
        """Remove and return the peers silent for longer than the timeout."""
        stalled = self._last_tick is not None and now - self._last_tick > self.timeout / 2
        self._last_tick = now
        if stalled:
            self._stalled_at = now
            for node in self._last:
                self._last[node] = max(self._last[node], now)
            return []
        deadline = now - self.timeout
        dead = [node for node, last in self._last.items() if last < deadline]
        for node in dead:
            del self._last[node]
            self._linked.discard(node)
            self._dropped.pop(node, None)
        return dead
