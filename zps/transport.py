"""The only module that talks to ZeroMQ sockets.

It makes sockets with the options every zps socket needs, drives them from
the event loop, sends without copying large frames, and turns
``zmq.ZMQError`` into zps errors at this boundary.

A :class:`Channel` wraps a plain (blocking-API) zmq socket: the loop watches
the socket's notification descriptor, and messages are received and sent
with non-blocking calls, a whole burst per wake-up.  That costs no Future
per message (``zmq.asyncio`` creates one per send and receive).  The zmq
descriptor is edge-like: it only says "events may have changed", and any
socket operation can consume that notice; so after sending, the channel
checks ``ZMQ_EVENTS`` itself before the loop next sleeps (once per loop
iteration, however many sends came first; a receive's own reading counts), and
a burst cut short by ``DRAIN_BATCH`` re-arms the reader, so no queued message
is ever left unnoticed.  Each reading costs two system calls (zmq polls its
mailbox and checks the pid), so none is repeated while one still holds.

Where the optional extension ``zps._zmqio`` was built, a channel sends a message of
small frames, receives a whole message and reads ``ZMQ_EVENTS`` with one compiled
call each, on pyzmq's own socket through the libzmq pyzmq calls (:func:`bind_libzmq`),
where pyzmq takes a Python call, and on receipt a ``zmq.Frame``, per frame (figures:
docs/performance.md, "The compiled I/O, end to end").  Received frames are then
``bytes``, or from :data:`RECV_COPY_MAX` bytes on a buffer that holds libzmq's message
(no copy).  It decides nothing: a frame of :data:`ZERO_COPY_BYTES` or more to send, and
every error, go through pyzmq.  Off on a CURVE server's socket (its frames carry the
sender's key: :func:`sender_key`) and with ``ZPS_NO_KERNEL=1``; each process logs at
INFO which way its channels go (:data:`IO_PATH`).

An :class:`Outbound` sends from a ROUTER to many peers without ever waiting on
one of them: a message that zmq cannot queue for its peer is held in that
peer's own queue, bounded in bytes per peer and in total (see
:class:`Allowance`), and dropped once the peer's allowance is spent.  The
caller learns which happened (:class:`Posted`) and decides what the slow peer
gets instead (a client's request is refused as overloaded, a reply is lost
and the client retries).  On a DEALER (a shard's link to the broker) the one
peer is the broker and the first frame names the client a reply is for: the
allowance is then shared by everything sent to the broker, kept in order per
client.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from zps.errors import BrokenError, ClosedError, ProtocolError

try:  # the compiled send and receive, built by ``pip install`` where a compiler is found
    from zps import _zmqio  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _zmqio = None

_log = logging.getLogger("zps.transport")


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE keys of one process (see :func:`zps.ops.security.load_curve_keys`)."""

    public: bytes
    secret: bytes
    server_public: bytes | None  # the broker's, for connecting sockets
    allowed_dir: str | None  # the ZAP allow-list of client public keys, for binding sockets


#: Frames at or above this size are sent without copying.  Below it a copy costs
#: less CPU than pyzmq's zero-copy bookkeeping (a Frame, a tracker, and a wake-up of
#: its collector thread when zmq releases the buffer); from this size on the two cost
#: the same in total and the copy costs the sending thread more (figures:
#: docs/performance.md, "Figures behind the code's rules").
ZERO_COPY_BYTES = 512 * 1024
#: Received frames below this size are copied into ``bytes`` by the compiled receive
#: (cheaper than holding libzmq's message for them); larger ones are held, not copied.
RECV_COPY_MAX = 64 * 1024
#: Messages taken from a socket per wake-up, at most.
DRAIN_BATCH = 256
#: Messages queued per peer and direction before senders wait: bounds the
#: memory a flood (or a stalled peer) can pin, while leaving ample room for
#: requests in flight.
DEFAULT_HWM = 1000
#: Pause before retrying a send to a peer whose queue is full.
BACKOFF_S = 0.001
#: Pause between attempts to pass held messages on to their slow peers.
FLUSH_S = 0.002

Frames = list[Any]

# The hot paths call the Cython socket methods directly with plain ints: the
# Python wrappers (option lookup by attribute, enum flags, per-frame type
# checks) cost more than the calls themselves on small messages.
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_raw_get = zmq.backend.Socket.get
_EVENTS = int(zmq.EVENTS)
_EAGAIN = int(zmq.EAGAIN)
_EHOSTUNREACH = int(zmq.EHOSTUNREACH)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)


def new_context(client: bool = False) -> zmq.asyncio.Context:
    """A context per owner: zps never uses a process-global context.  A server's I/O
    threads (and a client's, with ``ZPS_IO_SCHED=batch``) are scheduled
    ``SCHED_BATCH`` where Linux allows it (see :func:`io_sched_batch`); a client's
    switch between the two policies as it works, by default (:class:`IoThreads`)."""
    ctx = zmq.asyncio.Context()
    batch = io_sched_batch(client)
    if batch:
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    _zero_copy_ready(batch)
    return ctx


class IoThreads:
    """The zmq I/O threads of one client's context, switched between ``SCHED_BATCH``
    while the client has several requests in flight and the default policy while it
    waits for one (``ZPS_IO_SCHED=auto``, the default; see :func:`io_sched_batch`).

    Under the default policy the I/O thread, woken by each send and each reply,
    preempts the client's own thread at once: what a lone request's caller wants (it
    waits for that one reply), and two context switches per message for a client with
    more to send and more replies to read (a training step's requests to every
    partition, a pipelined step, a tensor's chunks): such a client makes more sparse
    steps under ``SCHED_BATCH``, and a lone request is answered later under it
    (figures: docs/performance.md, the levers table).

    The context's threads are named with a prefix no live thread of the process uses
    (``ZMQ_THREAD_NAME_PREFIX``) and found by that name once they have started (they
    name themselves as they start).  ``busy(flag)`` sets the policy, one system call
    on a change and none otherwise.  Left alone: a thread that started under another
    policy than the default (a process run under ``chrt``: its policy is kept), a
    policy that cannot be set, threads that cannot be found, a libzmq without thread
    names, and a forked child (the thread ids are its parent's)."""

    _prefixes = iter(range(1 << 62))
    #: How many calls to :meth:`busy` look for the threads before giving up.
    FIND_TRIES = 64

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self._tids: list[int] = []
        self._tries = 0
        self._pid = os.getpid()
        self._name = ""
        self.batch = False
        self.switches = 0
        if not _adaptive_client():
            return
        prefix = self._free_prefix()
        try:
            ctx.set(zmq.THREAD_NAME_PREFIX, prefix)
        except zmq.ZMQError:  # a libzmq without thread names: nothing to find them by
            return
        self._name = f"{prefix}/ZMQbg/IO/"
        self._tries = self.FIND_TRIES

    @classmethod
    def _free_prefix(cls) -> int:
        """A prefix no thread of this process carries (a thread's name is at most 15
        bytes: "999/ZMQbg/IO/0" fits, so they are counted modulo 1000)."""
        used = {name.split("/", 1)[0] for _, name in _threads() if "/ZMQbg/" in name}
        prefix = 0
        for _ in range(1000):
            prefix = next(cls._prefixes) % 1000
            if str(prefix) not in used:
                break
        return prefix

    def _find(self) -> bool:
        self._tries -= 1
        tids = [tid for tid, name in _threads() if name.startswith(self._name)]
        try:
            if any(os.sched_getscheduler(t) != os.SCHED_OTHER for t in tids):
                self._tries = 0  # started under a policy of the process's own: kept
                return False
        except OSError:  # one ended meanwhile: looked for again next time
            return False
        self._tids = tids
        return bool(tids)

    def busy(self, flag: bool) -> None:
        """Whether the client has more than one request in flight."""
        if flag == self.batch or (not self._tids and (self._tries <= 0 or not self._find())):
            return
        if os.getpid() != self._pid:  # a forked child: those threads are its parent's
            self._tids, self._tries = [], 0
            return
        policy = os.SCHED_BATCH if flag else os.SCHED_OTHER
        try:
            for tid in self._tids:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:  # refused (or the thread ended): left as it is from now on
            self._tids, self._tries = [], 0
            return
        self.batch = flag
        self.switches += 1


def _threads() -> list[tuple[int, str]]:
    """(id, name) of each thread of this process (none where /proc cannot tell)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out.append((int(tid), f.read().strip()))
        except OSError:
            continue  # the thread ended
    return out


_zero_copy_pid = 0


def _zero_copy_ready(batch: bool) -> None:
    """Start pyzmq's collector of zero-copy frames now, once per process.

    pyzmq starts it at the first frame sent without a copy: it imports a module and
    opens a thread, a context and two sockets.  A server that first sends a large frame
    when its descriptors are spent (EMFILE) would fail there, inside a reader callback,
    and stop serving; started with the process, a spent limit only refuses what needs a
    new descriptor (a client's shared memory: ``noshm: busy``).  Its context's I/O
    thread gets the process's policy (``batch``: see :func:`io_sched_batch`)."""
    global _zero_copy_pid
    if _zero_copy_pid == os.getpid():
        return
    from zmq.utils.garbage import gc

    if batch and not gc.is_alive():
        gc.context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)  # before its first socket
    zmq.Frame(b"\0", copy=False)  # dropped at once: its release goes through the collector
    _zero_copy_pid = os.getpid()


def io_sched_batch(client: bool) -> bool:
    """Whether zmq's I/O threads of a server (``client`` False: the broker, a shard, a
    routing broker) or of a client run under Linux's ``SCHED_BATCH`` policy from the
    start.  ``ZPS_IO_SCHED`` in the environment: ``auto`` (the default: servers'; a
    client's switch as it works, see :class:`IoThreads`), ``servers`` (servers' only),
    ``batch`` (clients' too, always) or ``normal`` (none).

    A thread woken under ``SCHED_BATCH`` never preempts the running one.  zmq wakes
    its I/O thread for each message sent, and under the default policy that thread
    preempted the sender at once, mid-handler: two context switches per message.  A
    server's handler then runs to its end (its wait for the next message) first, and
    the I/O thread after it, or at once on an idle core.  Servers then take less time
    and CPU per one-row pull and make more pipelined sparse steps; clients make more
    sparse steps too, but answer one-row pulls later (a lone request's caller waits for
    its reply, so its send should leave at once): hence ``auto`` (figures:
    docs/performance.md, the levers table).  The cost: while every core is busy, such a
    thread waits for the running one to block or use up its time slice (a few
    milliseconds at most) instead of preempting it."""
    mode = _io_sched_mode()
    if mode == "normal" or (client and mode != "batch"):
        return False
    return _batch_allowed()


def _io_sched_mode() -> str:
    mode = os.environ.get("ZPS_IO_SCHED", "auto")
    if mode not in IO_SCHED_MODES:
        _warn_io_sched(mode)
        return "normal"
    return mode


def _adaptive_client() -> bool:
    """Whether a client switches its I/O threads' policy as it works (``auto``)."""
    return _io_sched_mode() == "auto" and _batch_allowed()


#: The values of ``ZPS_IO_SCHED``.
IO_SCHED_MODES = ("auto", "servers", "batch", "normal")


@functools.cache
def _warn_io_sched(mode: str) -> None:
    _log.warning(
        "ZPS_IO_SCHED=%r is none of %s: zmq's I/O threads keep the default policy",
        mode,
        ", ".join(IO_SCHED_MODES),
    )


@functools.cache
def _batch_allowed() -> bool:
    """libzmq sets the policy in each of its threads and aborts the process if that
    fails, so a probe thread tries ``SCHED_BATCH`` first (it may be refused where the
    call is filtered for it, or for a process under ``SCHED_IDLE`` without
    ``RLIMIT_NICE`` room), and the policy is left alone if it is."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            allowed.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="zps-sched-probe", daemon=True)
    t.start()
    t.join()
    return bool(allowed)


class Channel:
    """A zmq socket driven by the running event loop (see the module notes)."""

    def __init__(self, sock: zmq.Socket[Any], *, compiled: bool = True) -> None:
        self.sock = sock
        self.curve_server = False  # a CURVE server's ROUTER (see router)
        self.received = 0  # messages received through _recv_message
        self.reconnects = 0  # connections made again after silence (see dealer)
        # The compiled send and receive (see the module notes), with the socket's address.
        self._io = _zmqio if compiled and COMPILED_IO else None
        _log_io_path()
        self._addr = int(sock.underlying)
        self._loop = asyncio.get_running_loop()
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._fd = int(sock.FD)
        self._outbox: deque[Sequence[Any]] = deque()
        # _check saw a message queued (only recv_burst takes messages, so it still is).
        self._pollin = False
        # A send may have taken the descriptor's notice since ZMQ_EVENTS was last read;
        # one check per loop iteration (not per send) settles it.
        self._stale = False
        self._recheck = False
        # The reader's timed wait (see _wait_until): one timer for many waits.
        self._deadline = 0.0
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._timed_waiting = False
        self._timed_out = False
        # serve's synchronous handler, run in the reader callback (see serve).
        self._fast: _Fast | None = None
        self._backlog: list[Frames] = []  # taken there, left for the serving task
        self._busy = False  # the serving task is handling a burst: the callback waits
        self._failure: Exception | None = None  # raised by the fast handler: serve raises it
        self._loop.add_reader(self._fd, self._check)
        self._loop.call_soon(self._check)  # messages may be queued already

    @property
    def closed(self) -> bool:
        return bool(self.sock.closed)

    @property
    def handle(self) -> int:
        """The address of libzmq's socket, for compiled code that drives it on this
        thread (the broker's data path, :mod:`zps.broker.forward`)."""
        return self._addr

    @property
    def compiled(self) -> bool:
        """Whether this channel sends and receives through ``zps._zmqio``."""
        return self._io is not None

    def _events(self) -> int:
        """ZMQ_EVENTS (reading it also takes the descriptor's pending notice)."""
        io = self._io
        if io is not None and not self.sock.closed:
            events: int = io.events(self._addr)
            if events >= 0:
                return events
        return int(_raw_get(self.sock, _EVENTS))  # reports the failure

    def _check(self) -> None:
        if self.sock.closed:
            self._readable.set()  # wake a reader so it sees the close
            return
        try:
            events = self._events()
        except zmq.ZMQError:
            self._readable.set()
            return
        self._stale = False
        if events & _POLLIN:
            fast = self._fast
            if fast is not None and not self._busy and not self._backlog and not fast.running:
                events = self._take_fast(fast)
            else:
                self._pollin = True
                self._readable.set()
        if events & _POLLOUT:
            self._on_writable()

    def _take_fast(self, fast: _Fast) -> int:
        """Receive and handle queued messages right here, in the reader callback: no
        task wakes up for them.  A message the fast handler declines goes to the
        serving task, and so does everything after it (order is kept).  Returns the
        last ``ZMQ_EVENTS`` reading."""
        fast.running = True
        events = 0
        n = 0
        pump = fast.pump
        try:
            while True:
                got = None if pump is None else pump(DRAIN_BATCH - n)
                if got is not None:  # the compiled step forwarded what it could
                    events, k, declined = got
                    n += k
                    fast.handled += k
                    if events < 0:
                        self._readable.set()  # the serving task's receive reports it
                        return 0
                    if declined is None:
                        if n >= DRAIN_BATCH:
                            self._loop.call_soon(self._check)  # more may be queued
                            return 0
                        self._stale = False  # its last ZMQ_EVENTS reading is fresh
                        return events
                    frames = declined
                else:
                    try:
                        frames = self._recv_message()
                    except zmq.ZMQError:
                        self._readable.set()  # the serving task's receive reports it
                        return 0
                try:
                    handled = fast.handle(frames)
                except ProtocolError as e:
                    fast.on_malformed(frames, e)
                    handled = True
                except Exception as e:  # a bug: it ends serve, as in the serving task
                    self._failure = e
                    self._readable.set()
                    return 0
                if not handled:
                    self._backlog.append(frames)
                    self._readable.set()
                    return 0
                n += 1
                fast.handled += 1
                if n == DRAIN_BATCH:
                    self._loop.call_soon(self._check)  # more may be queued: others first
                    return 0
                events = self._events()
                self._stale = False
                if not events & _POLLIN:
                    return events
        finally:
            fast.running = False
            if n and fast.on_burst is not None:
                fast.on_burst()

    def _on_writable(self) -> None:
        self._writable.set()
        if self._outbox:
            self._loop.call_soon(self._flush_outbox)

    def _deferred_check(self) -> None:
        self._recheck = False
        if self._stale:  # no ZMQ_EVENTS reading since the send
            self._check()

    def _recv_message(self) -> Frames:
        io = self._io
        if io is not None and not self.sock.closed:
            got = io.recv(self._addr, RECV_COPY_MAX)
            if type(got) is list:
                self.received += 1
                return got
            if got is None:
                raise zmq.Again()
            # The first frame failed, nothing taken: pyzmq's receive reports it.
        frame = _raw_recv(self.sock, _NOBLOCK, False, False)
        frames = [frame]
        while frame.more:
            frame = _raw_recv(self.sock, _NOBLOCK, False, False)
            frames.append(frame)
        self.received += 1
        return frames

    def reconnect_when_silent(self, endpoint: str, silence: float) -> None:
        """Make the connection to ``endpoint`` again whenever ``silence`` seconds pass
        without a message received.  For a CURVE client of a server that no connection
        may take an identity in use from: a connection made while the server still held
        this identity's dead one is never heard, and only a new one is."""

        seen = -1

        def check() -> None:
            nonlocal seen
            if self.sock.closed:
                return
            if self.received == seen:
                try:
                    self.sock.disconnect(endpoint)
                    self.sock.connect(endpoint)
                    self.reconnects += 1
                except zmq.ZMQError as e:
                    _log.warning("cannot connect to %s again: %s", endpoint, e.strerror)
            seen = self.received
            self._loop.call_later(silence, check)

        self._loop.call_later(silence, check)

    async def recv_burst(self, timeout: float | None = None) -> list[Frames]:
        """Every queued message (at most DRAIN_BATCH), waiting for the first; with
        ``timeout`` (seconds), an empty list if none came by then."""
        deadline = None if timeout is None else self._loop.time() + timeout
        while True:
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            if self._backlog:  # declined by serve's fast handler: before anything queued
                burst, self._backlog = self._backlog, []
                return burst
            if self.sock.closed:
                raise ClosedError("socket closed")
            burst = []
            events = 0
            try:
                # Asking ZMQ_EVENTS before each receive is cheaper than the
                # zmq.Again a blind non-blocking receive raises at the end.  The
                # reading _check took when it woke this reader still holds.
                events = _POLLIN if self._pollin else self._events()
                self._pollin = False
                while events & _POLLIN:
                    burst.append(self._recv_message())
                    if len(burst) == DRAIN_BATCH:
                        break
                    events = self._events()
                else:
                    # The last reading is fresh (no zmq call since): it settles what
                    # any send took from the descriptor, and POLLOUT counts too.
                    self._stale = False
                    if events & _POLLOUT:
                        self._on_writable()
            except zmq.Again:
                pass
            except zmq.ZMQError as e:
                if e.errno == zmq.ENOTSOCK or self.sock.closed:
                    raise ClosedError("socket closed") from e
                raise BrokenError(f"receive failed: {e.strerror}") from e
            if burst:
                if len(burst) == DRAIN_BATCH:
                    self._readable.set()  # more may be queued: don't wait next time
                else:
                    self._readable.clear()  # EVENTS said no more; the reader re-arms
                return burst
            self._readable.clear()
            if not events & _POLLIN and not self._stale:
                pass  # EVENTS, just read, said nothing is queued: the reader re-arms
            else:
                self._check()
                if self._readable.is_set():
                    continue
            if deadline is None:
                await self._readable.wait()
            elif not await self._wait_until(deadline):
                return []

    async def _wait_until(self, deadline: float) -> bool:
        """Wait until readable (True) or until ``deadline`` (loop time; False).

        A wait only records its deadline: one timer, armed at the first, serves the
        waits after it (when it fires before the current deadline, it is armed again
        for that), so a message that arrives in time costs no timer.  (asyncio.timeout
        would make and cancel a timer per wait: docs/performance.md; and not wait_for: on Python
        3.11 it swallows a cancellation that lands as the event is set.)  Plain
        ``Event.wait``: a cancellation always propagates."""
        loop = self._loop
        self._deadline = deadline
        if self._deadline_timer is None or self._timer_at > deadline:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._timer_at = deadline
            self._deadline_timer = loop.call_at(deadline, self._on_deadline)
        self._timed_out = False
        self._timed_waiting = True
        try:
            await self._readable.wait()
        finally:
            self._timed_waiting = False
        if self._timed_out:
            self._timed_out = False
            return False
        return True

    def _on_deadline(self) -> None:
        self._deadline_timer = None
        if not self._timed_waiting:
            return  # armed again by the next timed wait
        if self._loop.time() < self._deadline:  # a later wait's deadline
            self._timer_at = self._deadline
            self._deadline_timer = self._loop.call_at(self._deadline, self._on_deadline)
            return
        self._timed_out = True
        self._readable.set()

    def send_nowait(self, frames: Sequence[Any]) -> bool:
        """Send at once; False if a ROUTER has no route to the peer; raises zmq.Again
        when the queue to that peer is full."""
        try:
            io = self._io
            if io is not None and not self.sock.closed:
                sent = io.send(self._addr, frames, ZERO_COPY_BYTES)
                if sent == 1:
                    return True
                if sent == -_EAGAIN:
                    raise zmq.Again()
                if sent == -_EHOSTUNREACH:
                    return False
                # Declined (a large frame), or another failure: pyzmq sends, or reports.
            last = len(frames) - 1
            for i, f in enumerate(frames):
                # Received frames are forwarded as they are; large buffers go
                # without a copy; small ones are copied (cheaper than tracking).
                copy = not isinstance(f, zmq.Frame) and len(f) < ZERO_COPY_BYTES
                _raw_send(self.sock, f, _NOBLOCK | _SNDMORE if i < last else _NOBLOCK, copy, False)
        except zmq.Again:
            raise
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            if e.errno == zmq.ENOTSOCK or self.sock.closed:
                raise ClosedError("socket closed") from e
            raise BrokenError(f"send failed: {e.strerror}") from e
        except OSError as e:  # the compiled send failed past a message's first frame
            raise BrokenError(f"send failed: {e.strerror}") from e
        finally:
            # The send may have consumed the descriptor's notice: ZMQ_EVENTS is read
            # again before the loop next sleeps (once however many sends came first).
            self._stale = True
            if not self._recheck and not self.sock.closed:
                try:
                    self._loop.call_soon(self._deferred_check)
                    self._recheck = True
                except RuntimeError:  # the loop is closed: check now, as nothing else will
                    self._check()
        return True

    async def send(self, frames: Sequence[Any]) -> bool:
        while True:
            try:
                return self.send_nowait(frames)
            except zmq.Again:
                # Backpressure: the peer's queue is full; wait until it drains.  A
                # ROUTER reports POLLOUT whatever one peer's queue holds, so when
                # the socket claims to be writable, back off briefly instead of
                # spinning without yielding to the loop.
                self._writable.clear()
                self._check()
                if self._writable.is_set():
                    await asyncio.sleep(BACKOFF_S)
                else:
                    await self._writable.wait()

    def post(self, frames: Sequence[Any]) -> None:
        """Send without waiting, in order: held in the channel while the peer's queue
        is full.  Delivery failures are not reported.  Unbounded: the drivers send
        through an :class:`Outbound`, which bounds what it holds in bytes."""
        self._outbox.append(frames)
        if len(self._outbox) == 1:
            self._flush_outbox()

    def _flush_outbox(self) -> None:
        while self._outbox and not self.sock.closed:
            try:
                self.send_nowait(self._outbox[0])
            except zmq.Again:
                # Retried on the next writable notice, or shortly (see send()).
                self._loop.call_later(BACKOFF_S, self._flush_outbox)
                return
            except (ClosedError, BrokenError):
                pass
            self._outbox.popleft()

    def close(self) -> None:
        self._outbox.clear()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.close(0)
        self._readable.set()


def message_bytes(frames: Sequence[Any]) -> int:
    """The size of a multipart message: the bytes of its frames."""
    n = 0
    for f in frames:
        n += len(f) if isinstance(f, bytes | bytearray | zmq.Frame) else memoryview(f).nbytes
    return n


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
        gate: ConnectionGate | None = None,
    ) -> None:
        self.ch = ch
        #: CURVE: a peer whose connection closed gets nothing until it proves its
        #: identity again (see ConnectionGate); its messages count as unroutable.
        self.gate = gate
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
        if self.gate is not None and not self.gate.may_send(peer):
            return Posted.UNROUTABLE
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
        """The connection of descriptor ``fd`` closed: its peer (returned, if one had
        proved its identity on it) gets nothing more, held or new, until it does again."""
        peer = self.gate.closed(fd) if self.gate is not None else None
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


def _common(sock: zmq.Socket[Any], max_message_bytes: int, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
    # Reconnect every 0.1-0.35 s (zmq adds up to RECONNECT_IVL of jitter): a restarted
    # broker hears from every peer well inside its start-up hold (two liveness
    # timeouts), whatever the outage lasted: a back-off longer than the hold would
    # bring shards back after it, to find their partitions lost.
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 250)


def write_keypair(out_dir: str, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600) in zmq's format."""
    import zmq.auth

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(out_dir, name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_keys(path: str) -> tuple[bytes | None, bytes | None]:
    """(public, secret) from a key file (secret is None for a public-only file)."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(path)
    return public, secret


def load_public_keys(directory: str) -> frozenset[bytes]:
    """The Z85 public keys of every ``*.key`` file in ``directory``."""
    import zmq.auth

    return frozenset(zmq.auth.load_certificates(directory))


class ConnectionGate:
    """Which peers of a CURVE server may be sent to: decisions only, no I/O.

    A ROUTER routes by identity, and the connection holding an identity can change
    (its owner's closed; under CURVE no new one takes an identity in use, but one may
    take it once it is free, whatever its key).  So a peer is sent to only while the
    connection its last accepted message came by (its descriptor, ``ZMQ_SRCFD``) is
    open: once that closes, nothing goes to the identity until a message of its own
    key is accepted again (on whatever connection holds it then)."""

    #: Peers remembered as closed at most (the oldest are forgotten past it).
    MAX_CLOSED = 65536

    def __init__(self) -> None:
        self._fd_of: dict[bytes, int] = {}
        self._peer_of: dict[int, bytes] = {}
        self._closed: dict[bytes, None] = {}  # in the order they closed

    def accepted(self, peer: bytes, fd: int | None) -> None:
        """A message from ``peer`` by connection ``fd`` was accepted (its key owns it)."""
        if fd is None:
            return
        before = self._fd_of.get(peer)
        if before != fd:
            if before is not None and self._peer_of.get(before) == peer:
                del self._peer_of[before]
            self._fd_of[peer] = fd
            self._peer_of[fd] = peer
        self._closed.pop(peer, None)

    def closed(self, fd: int) -> bytes | None:
        """Connection ``fd`` closed: the peer it held, now gated (None: none)."""
        peer = self._peer_of.pop(fd, None)
        if peer is None or self._fd_of.get(peer) != fd:
            return None
        del self._fd_of[peer]
        self._closed[peer] = None
        if len(self._closed) > self.MAX_CLOSED:
            del self._closed[next(iter(self._closed))]
        return peer

    def may_send(self, peer: bytes) -> bool:
        return peer not in self._closed

    def forget(self, peer: bytes) -> None:
        """``peer`` left for good: nothing is sent to it anyway."""
        fd = self._fd_of.pop(peer, None)
        if fd is not None and self._peer_of.get(fd) == peer:
            del self._peer_of[fd]


def sender_fd(frame: Any) -> int | None:
    """The descriptor of the connection a received frame came by (None: unknown)."""
    if not isinstance(frame, zmq.Frame):
        return None
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


_monitors = iter(range(1 << 62))
#: Told of each handshake refused: (peer address, Z85 key or None, reason).
OnRefused = Callable[[str, "bytes | None", str], None]


class _KeySet:
    """A ZAP credentials provider admitting a fixed set of Z85 public keys (any key
    when None), telling ``on_refused`` of each key it refuses."""

    def __init__(self, keys: frozenset[bytes] | None, on_refused: OnRefused | None) -> None:
        self.keys = keys
        self.on_refused = on_refused
        self.peer = "?"  # the address of the handshake being decided

    def callback(self, domain: str, key: bytes) -> bool:
        if self.keys is None or key in self.keys:
            return True
        if self.on_refused is not None:
            self.on_refused(self.peer, key, "key_not_allowed")
        return False


def start_authenticator(
    ctx: zmq.asyncio.Context,
    allowed_dir: str | None,
    *,
    keys: frozenset[bytes] | None = None,
    on_refused: OnRefused | None = None,
) -> Any:
    """ZAP for every CURVE server socket of ``ctx``: only the Z85 public ``keys`` when
    given, else only keys in ``allowed_dir`` (any valid key when None: encryption
    without an allow-list).  ``on_refused`` is told of each key refused.  A message's
    User-Id is its sender's Z85 public key (:func:`sender_key`).  Stop it with
    ``.stop()``."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    if keys is None and allowed_dir is not None:
        keys = load_public_keys(allowed_dir)
    provider = _KeySet(keys, on_refused)

    class Authenticator(AsyncioAuthenticator):
        async def handle_zap_message(self, msg: list[bytes]) -> None:
            if len(msg) > 3:
                provider.peer = msg[3].decode("utf-8", "replace")
            await super().handle_zap_message(msg)

    auth = Authenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=provider)
    return auth


def watch_handshakes(
    sock: zmq.Socket[Any],
    on_refused: OnRefused,
    on_closed: Callable[[int], Any] | None = None,
    *,
    auth: bool = False,
) -> Callable[[], None]:
    """Tell ``on_refused`` of every handshake of the CURVE server ``sock`` that failed
    before its key was known (a peer with no CURVE key, or a broken handshake:
    ``no_key``; with ``auth``, a key the ZAP handler refused too: ``key_not_allowed``,
    for a socket whose handler does not report them), and ``on_closed`` of each
    connection that closed (its descriptor).  Runs on the event loop; returns the
    function that stops watching."""
    from zmq.utils.monitor import parse_monitor_message

    events = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    if auth:
        events |= zmq.EVENT_HANDSHAKE_FAILED_AUTH
    if on_closed is not None:
        events |= zmq.EVENT_DISCONNECTED
    address = f"inproc://zps-monitor-{id(sock):x}-{next(_monitors)}"
    sock.monitor(address, events)
    monitor: zmq.Socket[Any] = zmq.Socket(sock.context, zmq.PAIR)
    monitor.connect(address)
    loop = asyncio.get_running_loop()
    fd = int(monitor.FD)

    def read() -> None:
        while int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.ZMQError, ValueError):
                return
            kind = int(event["event"])
            if kind == zmq.EVENT_DISCONNECTED:
                if on_closed is not None:
                    on_closed(int(event["value"]))
                continue
            where = event.get("endpoint", b"?")
            peer = where.decode("utf-8", "replace") if isinstance(where, bytes) else str(where)
            on_refused(
                peer,
                None,
                "key_not_allowed" if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "no_key",
            )

    loop.add_reader(fd, read)
    loop.call_soon(read)

    def stop() -> None:
        loop.remove_reader(fd)
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)

    return stop


class HandshakeWatch:
    """What became of a CURVE client socket's handshakes (a monitor on it), so a
    peer that never answers can be told from one that refused this key."""

    _FAILED: dict[int, str] = {
        zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused this process's key (it is in none of "
        "the server's allow-lists)",
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed the CURVE handshake (is "
        "security.broker_public_key_file the server's key, and CURVE on there?)",
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed the CURVE handshake (is "
        "security.broker_public_key_file the server's key, and CURVE on there?)",
    }

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED
        for event in self._FAILED:
            events |= event
        address = f"inproc://zps-monitor-{id(sock):x}-{next(_monitors)}"
        sock.monitor(address, events)
        self._sock = sock
        self._monitor: zmq.Socket[Any] = zmq.Socket(sock.context, zmq.PAIR)
        self._monitor.connect(address)
        self._last: str | None = None

    def failure(self) -> str | None:
        """How the latest handshake failed; None if it succeeded, or none ended yet."""
        from zmq.utils.monitor import parse_monitor_message

        while not self._monitor.closed:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.ZMQError, ValueError):
                break
            self._last = self._FAILED.get(int(event["event"]))
        return self._last

    def close(self) -> None:
        if not self._sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        self._monitor.close(0)


def sender_key(frame: Any) -> bytes | None:
    """The Z85 CURVE public key that authenticated the sender of a received frame (its
    ZAP User-Id); None without CURVE."""
    if not isinstance(frame, zmq.Frame):
        return None
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user.encode() if isinstance(user, str) and user else None


def _curve_server(sock: zmq.Socket[Any], keys: CurveKeys | None) -> None:
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)


#: ZMTP heartbeats of a CURVE server socket: (interval, timeout) in seconds.  A
#: connection silent for the timeout (its peer's libzmq answers pings whatever its
#: process does) is dead and closed, freeing its identity.
CURVE_SERVER_HEARTBEAT = (0.5, 1.5)
#: A CURVE client's: a longer timeout than the server's, so the server has let go of
#: a dead connection's identity before the client connects again with it.
CURVE_CLIENT_HEARTBEAT = (1.0, 4.0)
#: A CURVE client that waits for the server to let go of its identity (``dealer``'s
#: ``wait_for_release``) connects again this long after losing its connection: past a
#: server's ping and its timeout (CURVE_SERVER_HEARTBEAT), so a dead connection the
#: server still held is closed, the identity free, and the new one heard.
CURVE_CLIENT_RECONNECT = 2.5


def _heartbeats(sock: zmq.Socket[Any], ivl_timeout: tuple[float, float]) -> None:
    ivl, timeout = ivl_timeout
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(ivl * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))


def _curve_client(
    sock: zmq.Socket[Any], keys: CurveKeys | None, server_public: bytes | None
) -> None:
    if keys is not None:
        _heartbeats(sock, CURVE_CLIENT_HEARTBEAT)
        if server_public is None:
            raise BrokenError(
                "CURVE is configured but the server's public key is unknown "
                "(security.broker_public_key_file)"
            )
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


def router(
    ctx: zmq.asyncio.Context,
    bind: str,
    *,
    max_message_bytes: int,
    hwm: int = DEFAULT_HWM,
    curve: CurveKeys | None = None,
) -> tuple[Channel, str]:
    """A bound ROUTER socket and the endpoint it actually bound (port resolved)."""
    sock: zmq.Socket[Any] = zmq.Socket(ctx, zmq.ROUTER)
    _common(sock, max_message_bytes, hwm)
    _curve_server(sock, curve)
    # Unroutable sends raise instead of vanishing, so the broker can answer
    # "shard unavailable" rather than lose the request.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A peer that reconnects takes its identity back from its dead connection at once.
    # Under CURVE no connection takes an identity in use, whatever its key: a connection
    # presenting one gets nothing and is heard by no one (ZMTP heartbeats close a dead
    # connection within CURVE_SERVER_HEARTBEAT, which frees its identity; the
    # identity's owner is checked on every message, see zps.ops.security).
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0 if curve is not None else 1)
    if curve is not None:
        _heartbeats(sock, CURVE_SERVER_HEARTBEAT)
    try:
        sock.bind(bind)
    except zmq.ZMQError as e:
        sock.close(0)
        raise BrokenError(f"cannot bind {bind}: {e.strerror}") from e
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    # A CURVE server reads each sender's key off its frames (sender_key): pyzmq's.
    channel = Channel(sock, compiled=curve is None)
    channel.curve_server = curve is not None
    return channel, endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def reconnect_silence(interval: float, liveness: int) -> float:
    """How long a CURVE client hears nothing from a server that probes it every
    ``interval`` seconds (declaring it dead after ``liveness`` of them) before making
    its connection again: three liveness timeouts, at least 5 s."""
    return max(5.0, 3.0 * interval * liveness)


def dealer(
    ctx: zmq.asyncio.Context,
    connect: str,
    identity: bytes,
    *,
    max_message_bytes: int,
    hwm: int = DEFAULT_HWM,
    curve: CurveKeys | None = None,
    server_public: bytes | None = None,
    silence: float | None = None,
    wait_for_release: bool = False,
) -> Channel:
    """A DEALER connected to ``connect``.  With CURVE: ``silence`` (seconds, for a
    server that sends something at least that often): a connection silent that long is
    made again (see :meth:`Channel.reconnect_when_silent`); ``wait_for_release``: a
    lost connection is made again only after CURVE_CLIENT_RECONNECT, when the server
    has let go of the identity (messages sent meanwhile wait in the socket), rather
    than at once, when the new connection may not be heard."""
    sock = _dealer_socket(
        ctx,
        connect,
        identity,
        max_message_bytes=max_message_bytes,
        hwm=hwm,
        curve=curve,
        server_public=server_public,
        connect_later=curve is not None and wait_for_release,
    )
    ch = Channel(sock)
    if curve is not None and silence is not None:
        ch.reconnect_when_silent(connect, silence)
    return ch


def _dealer_socket(
    ctx: zmq.Context[Any],
    connect: str,
    identity: bytes,
    *,
    max_message_bytes: int,
    hwm: int = DEFAULT_HWM,
    curve: CurveKeys | None = None,
    server_public: bytes | None = None,
    connect_later: bool = False,
) -> zmq.Socket[Any]:
    """:func:`dealer`'s socket alone (for :class:`LinkThread`: no event loop)."""
    sock: zmq.Socket[Any] = zmq.Socket(ctx, zmq.DEALER)
    _common(sock, max_message_bytes, hwm)
    _curve_client(sock, curve, server_public)
    if connect_later:
        ivl = int(CURVE_CLIENT_RECONNECT * 1000)
        sock.setsockopt(zmq.RECONNECT_IVL, ivl)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, ivl)
    sock.setsockopt(zmq.IDENTITY, identity)
    try:
        sock.connect(connect)
    except zmq.ZMQError as e:
        sock.close(0)
        raise BrokenError(f"cannot connect to {connect}: {e.strerror}") from e
    return sock


#: Handles one received message; raises ProtocolError (only) for a malformed one.
Handler = Callable[[Frames], Awaitable[None]]
#: Told of each malformed message: its frames and what was wrong with it.
OnMalformed = Callable[[Frames, ProtocolError], None]
#: A compiled fast path (see :func:`serve`): ``pump(limit)`` forwards up to ``limit``
#: queued messages and returns ``(events, forwarded, declined)``, or None to leave the
#: socket to the Python fast handler this time.
Pump = Callable[[int], "tuple[int, int, Frames | None] | None"]


class _Fast:
    """serve's synchronous handler as its channel's reader callback runs it."""

    __slots__ = ("handle", "handled", "on_burst", "on_malformed", "pump", "running")

    def __init__(
        self,
        handle: Callable[[Frames], bool],
        on_malformed: OnMalformed,
        on_burst: Callable[[], Any] | None,
        pump: Pump | None = None,
    ) -> None:
        self.handle = handle
        self.pump = pump
        self.on_malformed = on_malformed
        self.on_burst = on_burst
        self.running = False
        self.handled = 0  # messages it took (serve's idle test counts them)


async def serve(
    ch: Channel,
    handle: Handler,
    on_malformed: OnMalformed,
    *,
    fast: Callable[[Frames], bool] | None = None,
    on_burst: Callable[[], Awaitable[None] | None] | None = None,
    idle: float | None = None,
    on_idle: Callable[[], Awaitable[None]] | None = None,
    pump: Pump | None = None,
) -> None:
    """The one receive-and-dispatch loop of every zps process.

    Receives bursts until ``ch`` closes (or breaks) and hands each message to ``handle``.
    The policy for malformed messages lives here and only here: a handler signals one by
    raising :class:`ProtocolError`; the message is dropped, ``on_malformed`` is told (to
    count and log it), and serving goes on.  Any other exception is a bug and propagates.

    ``on_burst`` runs after each burst is handled (a driver's per-wake-up work: publish a
    changed map, note that a peer is alive).  With ``idle`` (seconds), ``on_idle`` runs
    whenever that long passes without a message.

    ``fast``, a synchronous handler for the common messages (a request to forward, a
    reply to match), runs in the channel's reader callback: a message it handles wakes
    no task, which saves CPU and latency on each hop (figures: docs/performance.md,
    "Figures behind the code's rules").  It returns False for a message it leaves to
    ``handle``; that message and every one after it then go to this task, in order,
    and the callback takes over again once they are handled.  Messages are handled one
    at a time, in order, either way.  With ``fast``, ``on_burst`` must be synchronous.

    ``pump`` (with ``fast``), a compiled step that receives and forwards messages itself
    (the broker's, :mod:`zps.broker.forward`), runs first in the reader callback; the
    first message it declines (received, nothing of it sent) goes to ``fast`` as if just
    received, then the pump goes on.  It may return None to leave a wake-up to ``fast``.
    """
    quick = ch._fast = None if fast is None else _Fast(fast, on_malformed, on_burst, pump)
    seen = 0  # what the fast handler had taken at the last idle test
    try:
        while True:
            try:
                burst = await ch.recv_burst(idle)
            except (ClosedError, BrokenError):
                return
            if not burst:
                if quick is not None and quick.handled != seen:
                    seen = quick.handled  # messages came, to the callback: not idle
                    continue
                if on_idle is not None:
                    await on_idle()
                continue
            ch._busy = True
            try:
                for frames in burst:
                    try:
                        await handle(frames)
                    except ProtocolError as e:
                        on_malformed(frames, e)
                if on_burst is not None:
                    done = on_burst()
                    if done is not None:
                        await done
            finally:
                ch._busy = False
    finally:
        ch._fast = None


async def recv_burst(ch: Channel, timeout: float | None = None) -> list[Frames]:
    """Wait for one message, then take whatever else is already queued.

    With ``timeout`` (seconds), returns an empty list if nothing came by then.
    """
    return await ch.recv_burst(timeout)


async def send(ch: Channel, frames: Sequence[Any]) -> bool:
    """Send a multipart message (waiting only while the peer's queue is full).

    Returns False when a ROUTER has no route to the first frame's peer (it
    disconnected); raises BrokenError for other failures.
    """
    return await ch.send(frames)


def send_if_room(ch: Channel, frames: Sequence[Any]) -> bool:
    """A DEALER's send, at once if its peer's queue has room; False (nothing sent) if it
    is full.  Raises ClosedError or BrokenError as :func:`send` does.  (A ROUTER's message
    for an unknown peer is dropped unreported: use :func:`send` or :func:`try_send`.)"""
    try:
        ch.send_nowait(frames)
    except zmq.Again:
        return False
    return True


def try_send(ch: Channel, frames: Sequence[Any]) -> bool:
    """Send only if it can go at once; False if the peer's queue is full, the peer
    is unknown, or the socket is closed."""
    try:
        return ch.send_nowait(frames)
    except zmq.Again:
        return False
    except (ClosedError, BrokenError):
        return False


def close(ch: Channel) -> None:
    ch.close()


def term(ctx: zmq.asyncio.Context) -> None:
    with contextlib.suppress(zmq.ZMQError):
        ctx.destroy(0)


def libzmq_version() -> tuple[int, int, int]:
    """The version of the libzmq pyzmq uses (compiled code must bind that one)."""
    major, minor, patch = zmq.zmq_version_info()[:3]
    return major, minor, patch


def pyzmq_backend_path() -> str | None:
    """The file of pyzmq's backend module (None: not the Cython backend).  Looked up
    through its handle, libzmq's functions are the ones pyzmq's sockets run on: those
    linked into the module, or of the libzmq it depends on."""
    try:
        from zmq.backend.cython import _zmq
    except ImportError:  # pragma: no cover - another backend (CFFI on PyPy)
        return None
    return str(_zmq.__file__)


def bind_libzmq(bind: Callable[[str], Any]) -> bool:
    """Bind a compiled module to the libzmq pyzmq calls: its ``bind(path)`` opens the
    loaded library at ``path`` (no second copy) and looks the functions up through its
    handle, returning the version it bound, or False.  ``path`` is pyzmq's backend
    module (:func:`pyzmq_backend_path`), never a file found by name: another libzmq
    in the process, of any version, is not bound.  The version must be pyzmq's."""
    path = pyzmq_backend_path()
    if path is None:
        return False
    version = bind(path)
    return bool(version) and tuple(version) == libzmq_version()


def _bind_io() -> tuple[bool, str]:
    """Whether channels use ``zps._zmqio``, and the way they go, in words."""
    if _zmqio is None:
        return False, "pyzmq (zps._zmqio was not built)"
    if os.environ.get("ZPS_NO_KERNEL", "") not in ("", "0"):
        return False, "pyzmq (ZPS_NO_KERNEL=1)"
    version = ".".join(map(str, libzmq_version()))
    if bind_libzmq(_zmqio.bind):
        bound = getattr(_zmqio, "bound", None)  # None: built before bound() existed
        return True, f"zps._zmqio (pyzmq's libzmq {version}, {bound() if bound else '?'})"
    return False, f"pyzmq (pyzmq's libzmq {version} could not be bound)"


#: Whether channels send and receive through ``zps._zmqio`` (built, and bound to the
#: libzmq pyzmq calls; see the module notes); :data:`IO_PATH`: which, in words.
COMPILED_IO, IO_PATH = _bind_io()


@functools.cache
def _log_io_path() -> None:
    """Once per process, at its first channel: which way channels send and receive."""
    _log.info("channels send and receive through %s", IO_PATH)


def frame_bytes(frame: Any) -> bytes:
    """The bytes of a received frame (copies; for small control frames)."""
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


def frame_buffer(frame: Any) -> memoryview:
    """A zero-copy view of a received frame."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def local_address(endpoint: str) -> str:
    """This host's address on the route to ``endpoint``'s host (no packet is sent): what a
    process advertises for others to reach it at."""
    host = urlsplit(endpoint).hostname or "127.0.0.1"
    if host in ("*", "0.0.0.0", "localhost"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


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
