"""The simulated network between the nodes of one run.

What zps relies on from ZeroMQ, and so what is kept: messages arrive whole or not at
all (atomicity), in the order they were sent on one pipe (a pipe: one sender to one
receiver), after a delay.  A message to a node that is down, or past a pipe's high-water
mark, is dropped, as a ROUTER drops what it cannot route and a full pipe drops what the
sender posts without waiting (zps never blocks on a peer).  A cut link holds what is sent
across it (as a TCP connection that stops moving does) and delivers it, in order, when
it heals; a cut may be one-way (``a`` cannot reach ``b``, ``b`` still reaches ``a``).
"""

from __future__ import annotations

import functools
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
        self._held: dict[str, list[tuple[str, Any]]] = {}  # paused node -> arrived
        self._blocked: dict[tuple[str, str], list[Any]] = {}  # cut pipe -> held messages
        self.dropped = 0
        self.max_inflight = 0

    def attach(self, node: str, handler: Callable[[str, Any], None]) -> None:
        self.handlers[node] = handler
        self.up.add(node)

    def detach(self, node: str) -> None:
        """The node's process is gone: its pipes and what it had not read go with it."""
        self.up.discard(node)
        self.paused.discard(node)
        self._held.pop(node, None)
        for pipe in [p for p in self._last if node in p]:
            del self._last[pipe]
            self._inflight.pop(pipe, None)
            self._blocked.pop(pipe, None)

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
        sched.at(t, functools.partial(self._arrive, pipe, msg))

    def _arrive(self, pipe: tuple[str, str], msg: Any) -> None:
        src, dst = pipe
        if pipe not in self._inflight:
            return  # a pipe of a process that is gone
        if pipe in self.cut:  # held until the link heals
            self._blocked.setdefault(pipe, []).append(msg)
            return
        self._inflight[pipe] -= 1
        if dst not in self.up:
            self.dropped += 1
            return
        if dst in self.paused:
            self._held.setdefault(dst, []).append((src, msg))
            return
        self.handlers[dst](src, msg)

    def heal(self, pairs: set[tuple[str, str]]) -> None:
        """The links in ``pairs`` move again: what they held arrives, in order."""
        self.cut -= pairs
        for pipe in sorted(pairs):
            for msg in self._blocked.pop(pipe, []):
                self.sched.at(self.sched.now, functools.partial(self._arrive, pipe, msg))

    def pause(self, node: str) -> None:
        self.paused.add(node)

    def resume(self, node: str) -> None:
        self.paused.discard(node)
        for src, msg in self._held.pop(node, []):
            if node in self.up:
                self.handlers[node](src, msg)
