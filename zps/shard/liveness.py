"""When a shard's heartbeats go out while its event loop is held: the policy of the
thread that serves its liveness links (:class:`zps.transport.LinkThread`).

The broker declares a shard dead after ``interval * liveness`` seconds without a
heartbeat (1 s by default).  A shard's event loop can be held longer by one step that
cannot be cut, such as a table outgrowing its arrays or its index's rehash, which grows
with the table (figures: docs/performance.md, "Figures behind the code's rules"):
heartbeats sent by the loop alone would stop meanwhile, the broker would fail over a
shard that is working, and with one copy the partition would be lost until the shard
registered again.

So the liveness links (see :mod:`zps.core.membership`) are served by a thread.  The loop
still decides what a heartbeat says and when, and posts it; the thread sends it on every
link at once (:meth:`Liveness.posted`).  When the loop has missed two beats, the thread
sends its last heartbeat again every interval, with the send time ``t`` of now, until
the loop beats again (:meth:`Liveness.tick`), without the in-sync set and durable LSN
(:data:`STALE`).  The rest is still true: while the loop is held, its LSN and epoch do
not change, and a lease from its echo runs from ``t`` as always (the broker heard
from the shard then, so it promoted no other copy).  A loop held for ``max_loop_stall``
seconds is taken for stuck: the thread stops sending, and the broker fails the shard
over.  A process stopped whole (SIGSTOP) or killed sends nothing.

No sockets and no clock here: the thread passes ``now`` in.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from zps.protocol.codec import decode, encode

log = logging.getLogger("zps.shard")


class Liveness:
    """The heartbeat policy (a :class:`zps.transport.LinkPolicy`)."""

    def __init__(self, interval: float, liveness: int, max_loop_stall: float, now: float) -> None:
        self.interval = interval
        #: The loop is late once it has not beaten for this long: two beats, or less
        #: when the broker's timeout leaves no room for two.
        self.grace = interval * min(2.0, liveness / 2)
        self.max_loop_stall = max_loop_stall
        self._last: list[bytes] | None = None  # the loop's latest heartbeat
        self._loop_beat = now  # when the loop last beat
        self._sent = now  # when a heartbeat last went out
        self._stuck = False
        #: Heartbeats sent for a held loop (a metric).
        self.covered = 0
        #: The longest the loop went between two beats, in seconds (a metric).
        self.longest_gap = 0.0

    def posted(self, frames: list[bytes], now: float) -> list[bytes]:
        """The loop's heartbeat: sent as it is."""
        if self._last is not None:  # not the start (registering, loading a checkpoint)
            self.longest_gap = max(self.longest_gap, now - self._loop_beat)
        if self._stuck:
            log.warning("the event loop beats again after %.1f s", now - self._loop_beat)
        self._last, self._loop_beat, self._sent, self._stuck = frames, now, now, False
        return frames

    def due(self, now: float) -> float:
        if self._last is None:  # nothing to repeat before the loop's first beat
            return math.inf
        if now - self._loop_beat < self.grace:
            return self._loop_beat + self.grace
        return self._sent + self.interval

    def tick(self, now: float) -> list[bytes] | None:
        """The loop is late: its last heartbeat again, sent now; nothing once it is stuck."""
        held = now - self._loop_beat
        if self._last is None or held < self.grace or now - self._sent < self.interval:
            return None
        self._sent = now
        if held >= self.max_loop_stall:
            if not self._stuck:
                self._stuck = True
                log.error(
                    "the event loop has been held for %.1f s (heartbeat.max_loop_stall %g s): "
                    "heartbeats stop, and the broker will fail this shard over",
                    held,
                    self.max_loop_stall,
                )
            return None
        if held < self.grace + self.interval:  # once a hold
            log.info("the event loop is held (%.1f s so far): heartbeats sent for it", held)
        self.covered += 1
        return retimed(self._last, now)


#: What a repeated heartbeat leaves out: the broker replaces its view of the partition's
#: in-sync set (and durable LSN) with what a heartbeat reports, and the world may have
#: moved meanwhile (a replica restarted under the same name is no longer in sync).
STALE = ("in_sync", "durable")


def retimed(frames: list[bytes], now: float, **extra: Any) -> list[bytes]:
    """The heartbeat ``[b"", route, header]`` with its send time ``t`` set to ``now``, and
    without what the broker must hear only from the loop itself (:data:`STALE`); the
    header's other ``extra`` fields added."""
    msg = decode(frames[1:])
    header = {k: v for k, v in msg.header.items() if k not in STALE}
    header["t"] = now
    header.update(extra)
    return [frames[0], *(bytes(f) for f in encode(msg.route, header))]
