"""The simulated network between the nodes of one run.

What zps relies on from ZeroMQ, and so what is kept: messages arrive whole or not at
all (atomicity), in the order they were sent on one pipe (a pipe: one sender to one
receiver), after a delay.  A message to a node that is down, or past a pipe's high-water
mark, is dropped, as a ROUTER drops what it cannot route and a full pipe drops what the
sender posts without waiting (zps never blocks on a peer).  A cut link holds what is sent
across it (as a TCP connection that stops moving does) and delivers it, in order, when
it heals; a cut may be one-way (``a`` cannot reach ``b``, ``b`` still reaches ``a``).
A *reset* connection (:meth:`Network.reset`) loses what was on its way both ways, as a
TCP connection that closes takes the bytes it held with it (what the receiving socket
had already taken stays readable); ZeroMQ makes the connection again at once.

What a node has not read yet counts towards its pipes' high-water marks, as ZeroMQ's
queues do: a paused node reads nothing until it resumes (then all it was sent, in the
order it arrived); a *slow* node reads one message every so often, from its pipes in
turn (ZeroMQ's fair queueing), or none at all (a peer that does not read), while its
timers run; so the pipes to it fill, and past their mark what is sent to it is dropped.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from zps.testing.sim.sched import Scheduler

#: Messages in flight on one pipe before it drops (a ZeroMQ send high-water mark).
HWM = 1000


class Network:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.handlers: dict[str, Callable[[str, Any], None]] = {}
        self.up: set[str] = set()
        self.paused: set[str] = set()
        self.cut: set[tuple[str, str]] = set()  # (from, to) pairs that drop
        self._last: dict[tuple[str, str], float] = {}  # pipe -> last arrival time
        self._inflight: dict[tuple[str, str], int] = {}
        #: What arrived at a paused or slow node and is not read yet, by pipe (in the
        #: order the node reads its pipes), each message with its order of arrival.
        self._inbox: dict[str, dict[tuple[str, str], deque[tuple[int, Any]]]] = {}
        self._arrivals = itertools.count()
        self.slow: dict[str, float] = {}  # node -> seconds it takes to read one message
        self._reading: set[str] = set()  # slow nodes with a read scheduled
        self._blocked: dict[tuple[str, str], list[Any]] = {}  # cut pipe -> held messages
        #: Pipe -> its connection's number: what was sent by one that was reset is lost.
        self._conn: dict[tuple[str, str], int] = {}
        self.dropped = 0
        self.max_inflight = 0
        #: Told of each node that resumes (the run's event loop runs what it held).
        self.on_resume: Callable[[str], None] | None = None

    def attach(self, node: str, handler: Callable[[str, Any], None]) -> None:
        self.handlers[node] = handler
        self.up.add(node)

    def detach(self, node: str) -> None:
        """The node's process is gone: its pipes and what it had not read go with it."""
        self.up.discard(node)
        self.paused.discard(node)
        self._inbox.pop(node, None)
        for pipe in [p for p in self._last if node in p]:
            del self._last[pipe]
            self._inflight.pop(pipe, None)
            self._blocked.pop(pipe, None)

    def room(self, src: str, dst: str) -> bool:
        """Whether the pipe ``src`` -> ``dst`` takes a message now (below its mark)."""
        return self._inflight.get((src, dst), 0) < HWM

    def send(self, src: str, dst: str, msg: Any) -> None:
        up = self.up
        if src not in up or dst not in up:
            self.dropped += 1
            return
        pipe = (src, dst)
        n = self._inflight.get(pipe, 0) + 1
        if n > HWM:
            self.dropped += 1
            return
        self._inflight[pipe] = n
        if n > self.max_inflight:
            self.max_inflight = n
        sched = self.sched
        t = sched.now + (0.0005 + sched.rng.random() * 0.002)
        last = self._last.get(pipe, 0.0)
        if last > t:
            t = last
        self._last[pipe] = t
        sched.at(t, functools.partial(self._arrive, pipe, self._conn.get(pipe, 0), msg))

    def _arrive(self, pipe: tuple[str, str], conn: int, msg: Any) -> None:
        src, dst = pipe
        if pipe not in self._inflight or conn != self._conn.get(pipe, 0):
            return  # a pipe of a process that is gone, or of a connection reset
        if pipe in self.cut:  # held until the link heals
            self._blocked.setdefault(pipe, []).append(msg)
            return
        if dst not in self.up:
            self._inflight[pipe] -= 1
            self.dropped += 1
            return
        if dst in self.paused or dst in self.slow:
            box = self._inbox.setdefault(dst, {})
            box.setdefault(pipe, deque()).append((next(self._arrivals), msg))
            self._read_later(dst)
            return
        self._inflight[pipe] -= 1
        self.handlers[dst](src, msg)

    def _taken(self, pipe: tuple[str, str]) -> None:
        """A message of ``pipe`` was read: it no longer counts towards the pipe's mark."""
        n = self._inflight.get(pipe)
        if n:
            self._inflight[pipe] = n - 1

    def _read_later(self, node: str) -> None:
        gap = self.slow.get(node, math.inf)
        idle = node not in self._reading and node not in self.paused
        if idle and gap < math.inf and node in self._inbox:
            self._reading.add(node)
            self.sched.after(gap, functools.partial(self._read_one, node))

    def _read_one(self, node: str) -> None:
        """A slow node reads one message, from the pipe whose turn it is."""
        self._reading.discard(node)
        box = self._inbox.get(node)
        if node in self.paused or node not in self.slow or not box:
            return
        pipe = next(iter(box))
        queue = box.pop(pipe)
        _, msg = queue.popleft()
        if queue:
            box[pipe] = queue  # its next message after the other pipes' turns
        if not box:
            del self._inbox[node]
        self._taken(pipe)
        self.handlers[node](pipe[0], msg)
        self._read_later(node)

    def _read_all(self, node: str) -> None:
        """The node reads everything waiting for it, in the order it arrived."""
        box = self._inbox.pop(node, None)
        if not box:
            return
        waiting = sorted((n, pipe, msg) for pipe, queue in box.items() for n, msg in queue)
        for _, pipe, msg in waiting:
            self._taken(pipe)
            if node in self.up:
                self.handlers[node](pipe[0], msg)

    def heal(self, pairs: set[tuple[str, str]]) -> None:
        """The links in ``pairs`` move again: what they held arrives, in order."""
        self.cut -= pairs
        for pipe in sorted(pairs):
            conn = self._conn.get(pipe, 0)
            for msg in self._blocked.pop(pipe, []):
                self.sched.at(self.sched.now, functools.partial(self._arrive, pipe, conn, msg))

    def on_the_way(self, src: str, dst: str) -> int:
        """Messages sent ``src`` -> ``dst`` that ``dst`` has not taken yet (what a reset
        of the connection loses)."""
        unread = len(self._inbox.get(dst, {}).get((src, dst), ()))
        return self._inflight.get((src, dst), 0) - unread

    def reset(self, a: str, b: str) -> int:
        """The connection between ``a`` and ``b`` closes and is made again: what either
        had sent that the other had not taken yet (on its way, or held by a cut) is lost.
        Returns how many messages were."""
        lost = 0
        for pipe in ((a, b), (b, a)):
            self._conn[pipe] = self._conn.get(pipe, 0) + 1
            n = self.on_the_way(*pipe)
            if n > 0:
                lost += n
                self._inflight[pipe] -= n
            self._blocked.pop(pipe, None)
        self.dropped += lost
        return lost

    def pause(self, node: str) -> None:
        self.paused.add(node)

    def resume(self, node: str) -> None:
        self.paused.discard(node)
        if node in self.slow:
            self._read_later(node)
        else:
            self._read_all(node)
        if self.on_resume is not None:
            self.on_resume(node)

    def slow_down(self, node: str, gap: float) -> None:
        """``node`` reads one message every ``gap`` seconds (``math.inf``: none)."""
        self.slow[node] = gap
        self._read_later(node)

    def speed_up(self, node: str) -> None:
        """``node`` reads at full speed again: at once, everything waiting for it."""
        if self.slow.pop(node, None) is not None and node not in self.paused:
            self._read_all(node)
