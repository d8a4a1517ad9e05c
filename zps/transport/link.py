"""Links served by a thread of their own (:class:`LinkThread`), not by the event loop.

Rules: what the links carry goes out while the loop is held by a long step; the loop
only posts to the thread and never waits on it; a message a link cannot take now is
dropped; a thread that fails leaves its links silent and tells its owner.  What is
sent, and when, is the :class:`LinkPolicy`'s decision, made in the thread.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq
import zmq.asyncio

from zps.errors import BrokenError
from zps.transport.curve import CurveKeys
from zps.transport.sockets import _dealer_socket

_log = logging.getLogger("zps.transport")


class LinkPolicy(Protocol):
    """What a :class:`LinkThread` sends, and when; called in its thread only."""

    def posted(self, frames: list[bytes], now: float) -> list[bytes] | None:
        """The loop posted ``frames``: what to send on every link now (None: nothing)."""

    def due(self, now: float) -> float:
        """When :meth:`tick` is next wanted (a time of ``time.monotonic``)."""

    def tick(self, now: float) -> list[bytes] | None:
        """It is :meth:`due`: what to send on every link now (None: nothing)."""


class LinkThread:
    """DEALERs to ``endpoints`` (one identity, as :func:`dealer`) served by a thread of
    their own rather than by the event loop, so that what they carry goes out while the
    loop is held by a long step.  The loop posts messages (:meth:`post`, an inproc pair;
    never waits); the thread sends what ``policy`` makes of them, and what it asks for
    at its own times, on every link at once, dropping a message a link cannot take
    now.  Each message received on link ``i`` goes to ``deliver(i, frames)``, called in
    the thread (so it must be thread-safe: ``loop.call_soon_threadsafe``), in order.
    If the thread fails (the policy raised, a socket error other than the context's
    end), its links fall silent and ``on_failure(error)`` is called in the thread, so
    that the owner can stop rather than go on unheard.  With CURVE and ``silence``, a
    link that receives nothing for that long makes its connection again (as
    :meth:`Channel.reconnect_when_silent`)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoints: Sequence[str],
        identity: bytes,
        *,
        policy: LinkPolicy,
        deliver: Callable[[int, list[bytes]], object],
        max_message_bytes: int,
        curve: CurveKeys | None = None,
        server_public: bytes | None = None,
        name: str = "zps-links",
        on_failure: Callable[[BaseException], object] | None = None,
        silence: float | None = None,
    ) -> None:
        self.policy = policy
        self._endpoints = list(endpoints)
        self._silence = silence if curve is not None else None
        self._heard = [time.monotonic()] * len(self._endpoints)
        self.reconnects = 0
        self._deliver = deliver
        self._on_failure = on_failure
        self._links: list[zmq.Socket[Any]] = []
        addr = f"inproc://zps-links-{id(self):x}"
        self._inbox: zmq.Socket[Any] = zmq.Socket(ctx, zmq.PAIR)  # the thread's end
        self._outbox: zmq.Socket[Any] = zmq.Socket(ctx, zmq.PAIR)  # the loop's end
        for sock in (self._inbox, self._outbox):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 64)
        self._inbox.bind(addr)
        self._outbox.connect(addr)
        try:
            for endpoint in endpoints:
                self._links.append(
                    _dealer_socket(
                        ctx,
                        endpoint,
                        identity,
                        max_message_bytes=max_message_bytes,
                        curve=curve,
                        server_public=server_public,
                    )
                )
        except BrokenError:
            self._close_thread_sockets()
            self._outbox.close(0)
            raise
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the thread serves its links now (started, and neither stopped nor
        failed)."""
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait (blocking: from a thread other than the loop's, or after :meth:`stop`)
        at most ``timeout`` seconds until the thread has ended; whether it is not
        running then (True for one never started too)."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def post(self, frames: Sequence[Any]) -> bool:
        """Hand ``frames`` to the thread (from the loop); False if it could not take them."""
        try:
            self._outbox.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Nothing more is sent: the thread closes its sockets and ends (from the loop;
        returns once it has, or after ``timeout``).  Idempotent."""
        if self._outbox.closed:
            return
        if self._thread.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._outbox.send(_STOP_LINKS, zmq.NOBLOCK)
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: its sockets are still ours
            self._close_thread_sockets()
        self._outbox.close(0)

    def _close_thread_sockets(self) -> None:
        for sock in (*self._links, self._inbox):
            sock.close(0)

    def _send(self, frames: Sequence[Any]) -> None:
        for sock in self._links:
            # A link whose peer is away, or whose queue is full, misses this one.
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(frames, zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        for sock in self._links:
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                now = time.monotonic()
                due = self.policy.due(now)
                if self._silence is not None and self._heard:
                    due = min(due, min(self._heard) + self._silence)
                wait = None if due == math.inf else max(0, math.ceil((due - now) * 1000))
                ready = dict(poller.poll(wait))
                now = time.monotonic()
                self._reconnect_silent(now)
                if self._inbox in ready:
                    while True:
                        try:
                            frames = self._inbox.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if frames == [_STOP_LINKS]:
                            return
                        out = self.policy.posted(frames, now)
                        if out is not None:
                            self._send(out)
                for i, sock in enumerate(self._links):
                    if sock in ready:
                        self._drain(i, sock)
                if self.policy.due(now) <= now:
                    out = self.policy.tick(now)
                    if out is not None:
                        self._send(out)
        except zmq.ZMQError as e:  # the context ended under it: nothing more to send
            if e.errno != zmq.ETERM:
                self._failed(e)
        except Exception as e:  # the policy's: its links fall silent, as a dead process's do
            self._failed(e)
        finally:
            self._close_thread_sockets()

    def _reconnect_silent(self, now: float) -> None:
        silence = self._silence
        if silence is None:
            return
        for i, sock in enumerate(self._links):
            if now - self._heard[i] >= silence:
                self._heard[i] = now
                endpoint = self._endpoints[i]
                try:
                    sock.disconnect(endpoint)
                    sock.connect(endpoint)
                    self.reconnects += 1
                except zmq.ZMQError as e:
                    _log.warning("cannot connect to %s again: %s", endpoint, e.strerror)

    def _failed(self, error: BaseException) -> None:
        _log.error(
            "%s failed: nothing more is sent on its links", self._thread.name, exc_info=error
        )
        if self._on_failure is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: it is stopping
                self._on_failure(error)

    def _drain(self, i: int, sock: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._heard[i] = time.monotonic()
            try:
                self._deliver(i, frames)
            except RuntimeError:  # the loop is closed: the process is stopping
                return


_STOP_LINKS = b"stop"
