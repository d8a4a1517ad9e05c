"""A zmq socket driven by the running event loop: :class:`Channel`, its send and
receive, and :func:`serve`, the one receive-and-dispatch loop of every zps process.

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

Where ``zps._zmqio`` is bound (:mod:`zps.transport.compiled`), a channel sends a
message of small frames, receives a whole message and reads ``ZMQ_EVENTS`` with one
compiled call each.  Received frames are then ``bytes``, or from :data:`RECV_COPY_MAX`
bytes on a buffer that holds libzmq's message (no copy).  A frame of
:data:`ZERO_COPY_BYTES` or more to send, and every error, go through pyzmq.  Off on a
CURVE server's socket (its frames carry the sender's key:
:func:`~zps.transport.curve.sender_key`).

On a CURVE server's socket the channel is the edge between routing ids and zps ids
(:meth:`Channel.edge`): a received message's first frame becomes its sender's zps id
(a :class:`PeerId`, from the connection's ``X-Zps-Id`` metadata), and a message sent
to a zps id goes to the connection its newest accepted message came by
(:class:`~zps.transport.peers.PeerTable`; :meth:`Channel.accepted` binds it).

Rules: ``zmq.ZMQError`` becomes a zps error here (:class:`ClosedError`,
:class:`BrokenError`); a malformed message is dropped and reported by :func:`serve`
alone, and serving goes on; on a CURVE server, a message without a zps id, or under
a routing id another peer could present, is dropped and told to ``on_refused``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import zmq

from zps.errors import BrokenError, ClosedError, ProtocolError
from zps.transport.compiled import COMPILED_IO, _log_io_path, _zmqio
from zps.transport.peers import PeerTable, is_handle

_log = logging.getLogger("zps.transport")

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
#: Pause before retrying a send to a peer whose queue is full.
BACKOFF_S = 0.001

Frames = list[Any]
#: Told of each peer refused: (where it is, "at ADDRESS" or "connecting to ENDPOINT" when
#: its address is unknown; its Z85 key or None; the reason).
OnRefused = Callable[[str, "bytes | None", str], None]
#: The connection metadata property that carries a peer's zps id under CURVE.
ZPS_ID_PROPERTY = "X-Zps-Id"


class PeerId(bytes):
    """A received message's zps id on a CURVE server (the first frame, as bytes), with
    the connection it came by: its routing id (``handle``) and descriptor (``fd``)."""

    handle: bytes
    fd: int | None


def _property(frame: Any, name: Any) -> Any:
    """A received frame's metadata property ``name``; None when it has none."""
    try:
        return frame.get(name)
    except zmq.ZMQError:
        return None


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


class Channel:
    """A zmq socket driven by the running event loop (see the module notes)."""

    def __init__(self, sock: zmq.Socket[Any], *, compiled: bool = True) -> None:
        self.sock = sock
        self.curve_server = False  # a CURVE server's ROUTER (see router)
        #: CURVE server: zps ids <-> connections (see edge), and who hears of refusals.
        self.peers: PeerTable | None = None
        self.on_refused: OnRefused | None = None
        self.refused = 0  # messages refused at the edge
        self.received = 0  # messages received through _recv_message
        #: ZMQ_EVENTS readings taken (each is two system calls: see recv_burst).
        self.events_read = 0
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

    @compiled.setter
    def compiled(self, on: bool) -> None:
        """From the next message on, send and receive through ``zps._zmqio`` (where it
        is in use: see :data:`COMPILED_IO`) or through pyzmq's calls."""
        self._io = _zmqio if on and COMPILED_IO else None

    @property
    def fast_ready(self) -> bool:
        """Whether a message that arrives now is handled in the reader callback by
        :func:`serve`'s fast handler: one is set, and the serving task is neither
        handling a burst nor holding messages the fast handler left to it."""
        fast = self._fast
        return fast is not None and not fast.running and not self._busy and not self._backlog

    def _events(self) -> int:
        """ZMQ_EVENTS (reading it also takes the descriptor's pending notice)."""
        self.events_read += 1
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
                        message = self._recv_message()
                    except zmq.ZMQError:
                        self._readable.set()  # the serving task's receive reports it
                        return 0
                    if message is None:  # refused at the edge: counts as taken
                        n += 1
                        if n == DRAIN_BATCH:
                            self._loop.call_soon(self._check)
                            return 0
                        events = self._events()
                        self._stale = False
                        if not events & _POLLIN:
                            return events
                        continue
                    frames = message
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

    def _recv_message(self) -> Frames | None:
        """The next queued message; None for one refused at the edge (see edge)."""
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
        if self.peers is not None:
            return self.edge(frames)
        return frames

    def edge(self, frames: Frames) -> Frames | None:
        """A CURVE server's message as zps sees it: the first frame, libzmq's routing
        id, becomes the sender's zps id (a :class:`PeerId`), read from the connection's
        ``X-Zps-Id`` metadata; whether that key may use it is its receiver's check, and
        :meth:`accepted` then binds it.  None (dropped, told to ``on_refused``) for a
        message without a zps id (a peer of an older zps, or not zps: ``no_identity``)
        or under a routing id that is not a handle no other peer can present
        (:func:`~zps.transport.peers.is_handle`: ``identity_of_another_key``)."""
        peers = self.peers
        assert peers is not None
        if len(frames) < 2:
            return None  # no frame of the peer's: nothing to hand on
        handle = frame_bytes(frames[0])
        known = peers.known(handle)  # a connection's metadata is read once
        fd: int | None
        if known is not None:
            zid_bytes, fd = known
        else:
            meta = frames[1]
            srcfd = _property(meta, zmq.SRCFD)
            fd = srcfd if isinstance(srcfd, int) and srcfd >= 0 else None
            zid = _property(meta, ZPS_ID_PROPERTY)
            assigned = _property(meta, "Identity")
            if not zid:
                peers.seen(handle, fd)
                self._refuse(meta, "no_identity")
                return None
            if not is_handle(handle, assigned.encode() if isinstance(assigned, str) else None):
                peers.seen(handle, fd)
                self._refuse(meta, "identity_of_another_key")
                return None
            zid_bytes = zid.encode() if isinstance(zid, str) else bytes(zid)
            peers.learn(handle, zid_bytes, fd)
        sender = PeerId(zid_bytes)
        sender.handle = handle
        sender.fd = fd
        frames[0] = sender
        return frames

    def _refuse(self, meta: Any, reason: str) -> None:
        self.refused += 1
        if self.on_refused is not None:
            user = _property(meta, "User-Id")
            key = user.encode() if isinstance(user, str) and user else None
            address = _property(meta, "Peer-Address")
            where = f"at {address}" if isinstance(address, str) else "at an unknown address"
            self.on_refused(where, key, reason)

    def accepted(self, frames: Frames) -> None:
        """The message ``frames`` (as received) was accepted: its sender's key owns its
        zps id, and what is sent to that id goes by the connection it came by, until a
        newer accepted message of it comes by another.  Nothing without CURVE."""
        sender = frames[0]
        if self.peers is not None and isinstance(sender, PeerId):
            self.peers.accepted(bytes(sender), sender.handle, sender.fd)

    def reconnect_when_silent(self, endpoint: str, silence: float) -> None:
        """Make the connection to ``endpoint`` again whenever ``silence`` seconds pass
        without a message received.  For a CURVE client: a connection whose other end
        died unseen, or one the server does not hear (its own routing id won the race
        with the ZAP reply while the server still held its dead connection under it),
        is replaced by a new one, which is heard."""

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
            taken = 0  # messages received, refused ones too
            try:
                # Asking ZMQ_EVENTS before each receive is cheaper than the
                # zmq.Again a blind non-blocking receive raises at the end.  The
                # reading _check took when it woke this reader still holds.
                events = _POLLIN if self._pollin else self._events()
                self._pollin = False
                while events & _POLLIN:
                    message = self._recv_message()
                    taken += 1
                    if message is not None:
                        burst.append(message)
                    if taken == DRAIN_BATCH:
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
            if burst or taken == DRAIN_BATCH:
                if taken == DRAIN_BATCH:
                    self._readable.set()  # more may be queued: don't wait next time
                else:
                    self._readable.clear()  # EVENTS said no more; the reader re-arms
                if burst:
                    return burst
                await asyncio.sleep(0)  # all refused at the edge: others run first
                continue
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
        when the queue to that peer is full.  On a CURVE server the first frame is a
        zps id, sent to the connection it is bound to (see accepted); none: False."""
        first = frames[0]
        if self.peers is not None:
            first = self.peers.route(frame_bytes(first))
            if first is None:
                return False
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
                if i == 0:
                    f = first
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


def frame_bytes(frame: Any) -> bytes:
    """The bytes of a received frame (copies; for small control frames)."""
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


def frame_buffer(frame: Any) -> memoryview:
    """A zero-copy view of a received frame."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


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
