"""Flow control: sending from a ROUTER to many peers without ever waiting on one.

An :class:`Outbound` sends through a channel; a message that zmq cannot queue for its
peer is held in that peer's own queue, bounded in bytes per peer and in total (see
:class:`Allowance`), and dropped once the peer's allowance is spent.  The caller
learns which happened (:class:`Posted`) and decides what the slow peer gets instead
(a client's request is refused as overloaded, a reply is lost and the client
retries).  On a DEALER (a shard's link to the broker) the one peer is the broker and
the first frame names the client a reply is for: the allowance is then shared by
everything sent to the broker, kept in order per client.

Rules: a peer's messages go out in the order posted; nothing is held beyond its
allowance; a peer that makes no progress for the stall timeout loses what is held for
it; under CURVE a peer whose connection closed loses what is held for it and gets
nothing until a message of its own is accepted again (the channel sends to a zps id
only by the connection it is bound to: :class:`~zps.transport.peers.PeerTable`).
:class:`Allowance` is pure accounting (no I/O).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from zps.errors import BrokenError, ClosedError
from zps.transport.channel import Channel, frame_bytes, message_bytes

_log = logging.getLogger("zps.transport")

#: Pause between attempts to pass held messages on to their slow peers.
FLUSH_S = 0.002


class Allowance:
    """Bytes held for slow peers, bounded per peer and in total (pure accounting).

    A peer's messages are admitted while its held bytes plus the new message stay
    within the limit given for that peer and the total stays within ``total_limit``.
    ``since`` is when each peer last made progress (its queue started, or one of its
    messages went out), for :meth:`stalled`.
    """

    def __init__(self, total_limit: int) -> None:
        if total_limit < 0:
            raise ValueError(f"total_limit must be >= 0, got {total_limit}")
        self.total_limit = total_limit
        self.total = 0
        self.peak = 0  # the most held at once, in total
        self.peak_peer = 0  # the most held at once for one peer
        self._held: dict[bytes, int] = {}
        self._since: dict[bytes, float] = {}

    def held(self, peer: bytes) -> int:
        return self._held.get(peer, 0)

    @property
    def peers(self) -> int:
        return len(self._held)

    def admit(self, peer: bytes, nbytes: int, limit: int, now: float) -> bool:
        """Count ``nbytes`` more for ``peer`` if both bounds allow it."""
        held = self._held.get(peer, 0)
        if held + nbytes > limit or self.total + nbytes > self.total_limit:
            return False
        if peer not in self._held:
            self._since[peer] = now
        self._held[peer] = held + nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.total)
        self.peak_peer = max(self.peak_peer, held + nbytes)
        return True

    def release(self, peer: bytes, nbytes: int, now: float) -> None:
        """``nbytes`` of ``peer`` went out (progress: its stall clock restarts)."""
        held = self._held.get(peer, 0)
        nbytes = min(nbytes, held)
        self.total -= nbytes
        if held == nbytes:
            self._held.pop(peer, None)
            self._since.pop(peer, None)
        else:
            self._held[peer] = held - nbytes
            self._since[peer] = now

    def forget(self, peer: bytes) -> int:
        """Drop everything held for ``peer``; returns the bytes freed."""
        held = self._held.pop(peer, 0)
        self._since.pop(peer, None)
        self.total -= held
        return held

    def stalled(self, now: float, timeout: float) -> list[bytes]:
        """Peers holding bytes that made no progress for ``timeout`` seconds."""
        return [p for p, t in self._since.items() if now - t >= timeout]


#: What :meth:`Channel.send_nowait` raises when the peer's queue holds its high-water mark
#: (``zmq.Again``); a channel standing in for a real one raises it too.
QueueFull = zmq.Again


class Posted(enum.Enum):
    """What became of a message handed to :meth:`Outbound.post`."""

    SENT = "sent"  # queued in zmq for the peer
    HELD = "held"  # kept for the peer until its zmq queue has room
    DROPPED = "dropped"  # the peer's allowance is spent: not sent
    UNROUTABLE = "unroutable"  # no such peer (it disconnected)


class Outbound:
    """Sends from a ROUTER channel without ever waiting on a peer (see the module notes).

    A peer with messages held gets every new message behind them, so its messages stay
    in order.  Held messages are retried every ``FLUSH_S`` while any are held; a peer
    that makes no progress for ``stall_timeout`` seconds loses what is held for it.
    """

    def __init__(
        self,
        ch: Channel,
        *,
        total_limit: int,
        stall_timeout: float,
        name: str = "peers",
    ) -> None:
        self.ch = ch
        self.allowance = Allowance(total_limit)
        self.stall_timeout = stall_timeout
        self.dropped = 0
        self.dropped_bytes = 0
        self.stalled = 0  # peers whose held messages were dropped for making no progress
        self._queues: dict[bytes, deque[tuple[Sequence[Any], int]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._name = name

    @property
    def held_bytes(self) -> int:
        return self.allowance.total

    def held(self, peer: bytes) -> int:
        return self.allowance.held(peer)

    @property
    def queues(self) -> dict[bytes, Any]:
        """The peers with messages held for them (keys), for a compiled sender that
        must leave those peers' messages to :meth:`post` (to keep them in order)."""
        return self._queues

    def post(self, frames: Sequence[Any], limit: int) -> Posted:
        """Send ``frames`` (the first is the peer's identity) now, or hold them within
        ``limit`` bytes for that peer, or drop them; never waits."""
        peer = frame_bytes(frames[0])
        queue = self._queues.get(peer)
        if queue is None:
            try:
                return Posted.SENT if self.ch.send_nowait(frames) else Posted.UNROUTABLE
            except zmq.Again:
                pass
            except (ClosedError, BrokenError):
                return Posted.UNROUTABLE
        nbytes = message_bytes(frames)
        if not self.allowance.admit(peer, nbytes, limit, time.monotonic()):
            self.dropped += 1
            self.dropped_bytes += nbytes
            return Posted.DROPPED
        if queue is None:
            queue = self._queues[peer] = deque()
        queue.append((frames, nbytes))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)
        return Posted.HELD

    def connection_closed(self, fd: int) -> bytes | None:
        """CURVE: the connection of descriptor ``fd`` closed: the zps id bound to it
        (returned, if any) loses what is held for it and gets nothing new until a
        message of its own is accepted again (see :meth:`Channel.accepted`)."""
        peers = self.ch.peers
        peer = peers.closed(fd) if peers is not None else None
        if peer is not None:
            self.forget(peer)
        return peer

    def forget(self, peer: bytes) -> None:
        """Drop whatever is held for ``peer`` (it left or was declared dead)."""
        queue = self._queues.pop(peer, None)
        if queue is not None:
            self.dropped += len(queue)
            self.dropped_bytes += self.allowance.forget(peer)

    def _flush(self) -> None:
        self._timer = None
        now = time.monotonic()
        for peer, queue in list(self._queues.items()):
            sent = 0
            while queue:
                frames, nbytes = queue[0]
                try:
                    ok = self.ch.send_nowait(frames)
                except zmq.Again:
                    break
                except (ClosedError, BrokenError):
                    ok = False
                if not ok:  # the peer is gone: nothing held for it can be delivered
                    if sent:
                        self.allowance.release(peer, sent, now)
                        sent = 0
                    self.forget(peer)
                    break
                queue.popleft()
                sent += nbytes
            if sent and peer in self._queues:
                self.allowance.release(peer, sent, now)
                if not queue:
                    del self._queues[peer]
        for peer in self.allowance.stalled(now, self.stall_timeout):
            self.stalled += 1
            freed = self.allowance.held(peer)
            self.forget(peer)
            _log.warning(
                "%s: %s read nothing for %.1fs; dropped the %d bytes held for it",
                self._name,
                peer.decode("utf-8", "replace"),
                self.stall_timeout,
                freed,
            )
        if self._queues and not self.ch.closed:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for peer in list(self._queues):
            self.forget(peer)
