"""The client's connection to the broker: the driver of the request machinery.

One DEALER socket to the broker carries every request, so many requests are in flight at
once.  Operations for one partition queued in the same loop turn are coalesced into one
message (see :mod:`zps.core.batching`).  Every request's lifecycle (matching replies,
retries, re-sends, deadlines, dedup sequence numbers) is decided by
:class:`~zps.client.session.ClientSession`; this module only carries out what it returns:
it sends the frames, resolves the futures and ticks the session when it asks.  Background
pushes (``wait=False``) are bounded by ``max_background`` and their first error is raised
once, by the next call or by :meth:`Connection.flush`.

With a broker pair (a list of two endpoints) the client holds a DEALER to each, sends to
the one :class:`~zps.client.session.BrokerChoice` names, reads from both, and follows the
active broker: after ``failover_timeout`` of silence it introduces itself to the other
one, and messages from a broker with an older term than it has seen are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import os
import socket
import uuid
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar, assert_never, cast

import numpy as np
import zmq.asyncio

from zps import shm, transport
from zps.client.routers import RouterTable
from zps.client.session import (
    Action,
    BrokerChoice,
    ClientSession,
    ClientStats,
    Deliver,
    Fail,
    Send,
)
from zps.core.batching import MERGEABLE, merge_row_ops, plan_batches
from zps.core.routing import (
    ClusterMap,
    Resplit,
    join_resplit,
    resplit,
)
from zps.errors import (
    BadRequestError,
    BrokenError,
    ClosedError,
    ProtocolError,
    RemoteError,
    ZpsTimeoutError,
    remote_error,
)
from zps.ops import malloc
from zps.ops.config import ClientConfig, broker_endpoints
from zps.ops.security import key_identity, load_curve_keys
from zps.protocol.codec import (
    NO_COMPRESSION,
    TRAFFIC,
    Encoder,
    Message,
    MsgType,
    Route,
    VersionMismatchError,
    array_from,
    decode,
    encode,
    unpack_route,
)
from zps.protocol.messages import (
    BrokerToClient,
    Bye,
    ClientHello,
    Heartbeat,
    HelloAgain,
    MapUpdate,
    StatusRequest,
)
from zps.version import __version__

log = logging.getLogger("zps.client")

T = TypeVar("T")


@dataclass(slots=True)
class _Op:
    body: dict[str, Any]
    arrays: dict[str, np.ndarray]
    future: asyncio.Future[dict[str, Any]]
    reply_bytes: int = 0  # the array bytes the reply will carry
    partition: int = -1  # where it was last sent (an answer MOVED re-sends it)
    #: Where the caller wants the reply's arrays, in order (a pulled tensor's pieces):
    #: those that come through shared memory are copied there directly.
    into: list[np.ndarray] | None = None
    #: Its arrays are the caller's memory, for as long as the call waits: sent inline,
    #: their frames are copies (zmq may read a frame after the call ended: _transmit).
    borrowed: bool = False
    #: A background push (``wait=False``): no caller waits for its answer, which may
    #: then ride on a later reply (see ClientSession, rule 7).
    lazy: bool = False
    #: The operation's cost: the larger of its request and its reply payload (read
    #: several times per request, so computed once).
    nbytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        size = 0
        for a in self.arrays.values():
            size += a.nbytes
        self.nbytes = max(size, self.reply_bytes)


def _copy_shared(frames: list[Any], arr: np.ndarray | None, *, start: int) -> bool:
    """Replace the frames from ``start`` on that share ``arr``'s memory (None: any
    array's) with copies of their bytes; whether any did (``bytes`` frames are copies
    already)."""
    shared = False
    for i in range(start, len(frames)):
        f = frames[i]
        if (
            isinstance(f, memoryview | np.ndarray)
            and f.nbytes
            and (arr is None or np.may_share_memory(f, arr))
        ):
            frames[i] = bytes(f)
            shared = True
    return shared


def _copy_arrays(op: _Op, arr: np.ndarray) -> None:
    for key, a in op.arrays.items():
        if np.may_share_memory(a, arr):
            op.arrays[key] = a.copy()


def _bytes_of(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes, as a flat uint8 view (for :meth:`shm.Mapper.read`)."""
    return a.reshape(-1).view(np.uint8)


def _places(ops: list[_Op], header: dict[str, Any]) -> dict[int, np.ndarray] | None:
    """Where a reply's payload frames go, by frame: the i-th array of an operation's
    result to its i-th place (``_Op.into``), while the operation's call still waits for
    it.  What the reply names otherwise (or a frame of another length, see
    :meth:`shm.SharedMemory.inbound`) gets a fresh array."""
    results = header.get("res")
    if not isinstance(results, list) or len(results) != len(ops):
        return None
    into: dict[int, np.ndarray] = {}
    for op, res in zip(ops, results, strict=True):
        if op.into is None or op.future.done():  # a call cancelled or failed: not its places
            continue
        descs = res.get("a") if isinstance(res, dict) else None
        if not isinstance(descs, list):
            continue
        for desc, place in zip(descs, op.into, strict=False):
            if isinstance(desc, list) and desc and type(desc[0]) is int:
                into.setdefault(desc[0], _bytes_of(place))
    return into or None


class _Background:
    """A background call (``wait=False``): done once each of its operations is; the
    first error among them is kept for the client's next call."""

    __slots__ = ("conn", "failed", "left")

    def __init__(self, conn: Connection, n: int) -> None:
        self.conn = conn
        self.left = n
        self.failed = False

    def done(self, fut: asyncio.Future[dict[str, Any]]) -> None:
        if not self.failed and not fut.cancelled() and fut.exception() is not None:
            self.failed = True  # the call's first error, as one awaited call would raise
            if self.conn._bg_error is None:
                self.conn._bg_error = fut.exception()
        self.left -= 1
        if self.left == 0:
            self.conn._background_done(self)


#: What the session hands back for a request: its operations, or a broker call's future.
_Token = list[_Op] | asyncio.Future[dict[str, Any]]


@dataclass(slots=True)
class _ShmRequest:
    """A request with frames large enough for shared memory (:mod:`zps.shm`)."""

    token: list[_Op]
    reply_ok: bool  # its reply may come through the shard's shared memory
    #: Its payloads' regions, taken by its first sending through shared memory and
    #: named again by every re-send (freeing them while a copy of the request may still
    #: be queued for a shard would make that copy fail, and its retry the next one).
    regions: list[list[int]] = field(default_factory=list)
    #: A shard refused to open its payloads (``noshm: open`` or ``busy``): its re-sends go inline,
    #: whichever shard the client's map names (a stale map may name another).
    inline: bool = False


class Connection:
    """Lifecycle, request machinery and background pushes of a client (see the module notes)."""

    def __init__(self, address: str | Sequence[str], config: ClientConfig | None = None) -> None:
        self.addresses = broker_endpoints(address, "the broker address")
        self.address = self.addresses[0]
        self.config = config or ClientConfig()
        # Under CURVE the identity carries the key's tag: no other key may use it.
        curve = load_curve_keys(self.config.security)
        self.client_id = (
            key_identity(b"c-", curve.public, uuid.uuid4().hex[:8].encode())
            if curve is not None
            else f"c-{uuid.uuid4().hex[:16]}".encode()
        )
        self._handshakes: list[transport.HandshakeWatch] = []
        self._session: ClientSession[_Token] = ClientSession(
            self.client_id,
            timeout=self.config.timeout,
            max_backoff=self.config.heartbeat.interval,
            hello=ClientHello(socket.gethostname(), os.getpid(), self.config.name, __version__),
            acks=1 if self.config.acks == 1 else None,
        )
        self.stats: ClientStats = self._session.stats
        self._policy = TRAFFIC if self.config.compress else NO_COMPRESSION
        self._map_event = asyncio.Event()
        self._ctx: zmq.asyncio.Context | None = None
        self._io: transport.IoThreads | None = None
        self._sock: transport.Channel | None = None  # the current broker's
        self._socks: list[transport.Channel] = []
        self._choice: BrokerChoice | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._queue: dict[int, list[_Op]] = collections.defaultdict(list)
        self._wake = asyncio.Event()  # the flush task has sends held back to carry out
        self._flush_pending = False  # a flush is scheduled (call_soon) for queued operations
        # Sends the socket's queue had no room for, with their frames, in order: the flush
        # task waits for room and sends them; later sends queue behind them.
        self._blocked: collections.deque[tuple[Send, list[Any]]] = collections.deque()
        # At the session's next wake-up, ``_timer_at``.  A plain Handle when that time had
        # passed (uvloop's call_at then schedules a call_soon, which has no when()).
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        self._tick_at: float | None = None  # set when the session is due a tick
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran in
        self._closed = False
        self._started = False
        self._background: set[_Background] = set()  # background calls in flight
        self._lazy_parts: set[int] = set()  # sent lazy requests since the last flush
        self._bg_waiters: list[asyncio.Future[None]] = []  # for one of them to finish
        self._bg_error: BaseException | None = None
        self._mismatch: VersionMismatchError | None = None  # a broker of another version
        self._moved_at = -1  # the map version of the last MOVED answer (live resharding)
        # Routing brokers of the map (zps.client.routers): requests for a partition go to
        # its router while that one answers.
        self._routers = RouterTable(
            failover_timeout=self.config.failover_timeout, interval=self.config.heartbeat.interval
        )
        self._router_socks: dict[str, tuple[transport.Channel, asyncio.Task[None] | None]] = {}
        self._tg: asyncio.TaskGroup | None = None
        # Same-host shared memory for large frames (zps.shm); None when off.
        self._shm = shm.SharedMemory.create(
            self.config.shm_bytes, "client", max_frame_bytes=self.config.max_message_bytes
        )
        self._shm_reqs: dict[int, _ShmRequest] = {}  # by request id
        self._shm_done: dict[int, list[int]] = {}  # reply regions read, told per partition
        #: Primaries that cannot open this client's memory, with the time until which
        #: they get inline frames (inf: for good; see _shm_refusal).
        self._shm_refused: dict[str, float] = {}
        #: Until when replies come inline: 0 while this client can open the shards'
        #: memory, inf when it never can (its path off, or a failure for good).
        self._shm_replies_off = 0.0 if self._shm is not None else math.inf
        self._borrowing = False  # an operation of the caller's memory was ever sent

    # -- lifecycle -----------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        if self.config.tune_malloc:
            malloc.tune()
        self._ctx = transport.new_context(client=True)
        self._io = transport.IoThreads(self._ctx)  # before its first socket starts them
        keys = load_curve_keys(self.config.security)
        hb = self.config.heartbeat
        self._socks = [
            transport.dealer(
                self._ctx,
                address,
                self.client_id,
                max_message_bytes=self.config.max_message_bytes,
                curve=keys,
                server_public=keys.server_public if keys else None,
                silence=transport.reconnect_silence(hb.interval, hb.liveness),
                wait_for_release=True,
            )
            for address in self.addresses
        ]
        self._sock = self._socks[0]
        if keys is not None:
            self._handshakes = [transport.HandshakeWatch(ch.sock) for ch in self._socks]
        self._choice = BrokerChoice(
            len(self._socks),
            silence=self.config.failover_timeout,
            retry=self.config.failover_timeout / 10,
            now=self._now(),
        )
        tg = self._tg = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._tasks = [
            *(tg.create_task(self._recv_loop(i)) for i in range(len(self._socks))),
            tg.create_task(self._flush_loop()),
            tg.create_task(self._heartbeat_loop()),
        ]
        if len(self._socks) > 1:
            self._tasks.append(tg.create_task(self._pair_loop()))
        try:
            # The introduction is bounded too: a paused broker may not take it.
            async with asyncio.timeout(self.config.connect_timeout):
                await self._introduce()
        except TimeoutError:
            refused = next(filter(None, (w.failure() for w in self._handshakes)), None)
            await self.close()
            if refused is not None:
                raise ZpsTimeoutError(
                    f"handshake refused: the broker at {' or '.join(self.addresses)} {refused}"
                ) from None
            raise ZpsTimeoutError(
                f"no answer from the broker at {' or '.join(self.addresses)} within "
                f"{self.config.connect_timeout:g}s (is `zps-server broker` running there?)"
            ) from None

    async def _introduce(self) -> None:
        await self._hello()
        await self._map_event.wait()
        if self._mismatch is not None and self._session.map is None:
            await self.close()
            raise ProtocolError(
                f"the broker at {self.address} speaks zps protocol version "
                f"{self._mismatch.version}, this client (zps {__version__}) version "
                f"{self._mismatch.ours}: run releases of one protocol version"
            )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sock is not None and not self._sock.closed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await transport.send(self._sock, encode(Route(MsgType.BYE), Bye().to_wire()))
        for t in self._tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._stack.aclose()
        if self._timer is not None:
            self._timer.cancel()
        err = ClosedError("the client was closed")
        for action in self._session.close(err):
            self._resolve(action)
        for ops in self._queue.values():
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(err)
        self._queue.clear()
        for watch in self._handshakes:
            watch.close()
        for sock in self._socks:
            transport.close(sock)
        for sock, task in self._router_socks.values():
            if task is not None:
                transport.close(sock)
        self._io = None  # its threads end with the context: their ids may be reused
        if self._ctx is not None:
            transport.term(self._ctx)
        if self._shm is not None:
            self._shm.close()

    @property
    def cluster_map(self) -> ClusterMap:
        cmap = self._session.map
        if cmap is None:
            raise ClosedError("the client is not connected")
        return cmap

    # -- background pushes -------------------------------------------------------

    async def _finish(self, futures: list[asyncio.Future[dict[str, Any]]], wait: bool) -> None:
        if wait:
            if len(futures) == 1:
                await futures[0]
            else:
                await self._gather(futures)
            return
        while len(self._background) >= self.config.max_background:
            await self._background_slot()
        if futures:
            call = _Background(self, len(futures))
            self._background.add(call)
            for fut in futures:
                fut.add_done_callback(call.done)

    def _background_done(self, call: _Background) -> None:
        self._background.discard(call)
        waiters, self._bg_waiters = self._bg_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _background_slot(self) -> None:
        """Wait until a background call finishes (its own future: a cancelled waiter
        leaves the others waiting)."""
        w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._bg_waiters.append(w)
        try:
            await w
        finally:
            if w in self._bg_waiters:
                self._bg_waiters.remove(w)

    def _ask_held(self) -> None:
        """Background pushes answered only in part (their reads) may have their answer
        held by the shard for the next step's reply (ClientSession, rule 7): a request
        to each such partition (``acks``, which does nothing) has it sent now, and tells
        the shard that this client waits."""
        parts: set[int] = set()
        for _, ops, _ in self._session.in_flight():
            if isinstance(ops, list) and any(op.lazy and not op.future.done() for op in ops):
                parts.add(ops[0].partition)
        parts &= self._lazy_parts
        self._lazy_parts.clear()
        for p in parts:
            # Its answer is not needed (an older shard refuses the operation).
            self._submit(p, {"op": "acks"}, {}).add_done_callback(_ignore)

    def _raise_background(self) -> None:
        """An error of a background push is raised by the next call, once."""
        err, self._bg_error = self._bg_error, None
        if err is not None:
            raise err

    async def flush(self) -> None:
        """Wait for every background push; raise the first error among them."""
        if self._background:
            self._ask_held()
        while self._background:
            await self._background_slot()
        self._raise_background()

    # -- calls the broker answers ----------------------------------------------

    async def _broker_call(
        self, mtype: MsgType, header: dict[str, Any], forever: bool = False
    ) -> dict[str, Any]:
        """A request the broker itself answers (matched by request id)."""
        if self._closed:
            raise ClosedError("the client was closed")
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        req_id, actions = self._session.call(mtype, header, fut, self._now(), forever=forever)
        try:
            self._apply(actions)
            return await fut
        finally:  # answered, failed, or the caller gave up: the session forgets the call
            self._session.abandon(req_id, ClosedError("the call was cancelled"))

    async def status(self) -> dict[str, Any]:
        """The broker's status report (as ``zps-server status --json`` prints it)."""
        return await self._broker_call(MsgType.STATUS, StatusRequest().to_wire())

    # -- request machinery ---------------------------------------------------

    def _submit(
        self,
        partition: int,
        body: dict[str, Any],
        arrays: dict[str, np.ndarray],
        *,
        reply_bytes: int = 0,
        into: list[np.ndarray] | None = None,
        borrowed: bool = False,
        lazy: bool = False,
    ) -> asyncio.Future[dict[str, Any]]:
        if self._closed:
            raise ClosedError("the client was closed")
        loop = self._loop or asyncio.get_running_loop()
        op = _Op(
            body, arrays, loop.create_future(), reply_bytes, into=into, borrowed=borrowed, lazy=lazy
        )
        self._borrowing |= borrowed
        # Calls are cut to the message budget; what still cannot fit would be cut off
        # by a socket's MAXMSGSIZE (a disconnect, then a timeout): refuse it here.
        if op.nbytes > self.config.max_message_bytes // 2:
            raise BadRequestError(
                f"{body.get('op')} on {body.get('t')!r} needs a message of {op.nbytes} bytes; "
                f"the limit is half of client.max_message_bytes ({self.config.max_message_bytes})"
            )
        fut = op.future
        self._queue[partition].append(op)
        if not self._flush_pending:  # after the caller's turn: what it queues goes together
            self._flush_pending = True
            loop.call_soon(self._flush_soon)
        return fut

    def _buffer(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """Zeros of ``shape`` and ``dtype``, in this process's shared memory when it has
        room (sent from there with no copy: :meth:`shm.SharedMemory.buffer`), else on
        the heap."""
        if self._shm is not None and math.prod(shape) * np.dtype(dtype).itemsize > 0:
            buf = self._shm.buffer(shape, dtype)
            if buf is not None:
                return buf
        return np.zeros(shape, dtype=dtype)

    def _detach(self, arr: np.ndarray) -> None:
        """A call that sent ``arr`` (the caller's memory) as it is ended before all its
        requests were answered (an error, a cancellation): from now on the caller may
        write ``arr``, so whatever may still be sent copies the bytes it holds now.
        Requests in flight (the frames they are re-sent with, and their operations, which
        a ``MOVED`` answer splits and sends anew), sends held back and operations not yet
        sent get copies of whatever shares its memory.  (Frames zmq holds are copies
        already: see :meth:`_transmit`.)  A :meth:`_buffer` region named for them gets a
        new token: every request naming it lets its regions go (those still waited for
        name it again when re-sent), so a copy already on its way is refused rather
        than read as what the caller writes next."""
        shm_ = self._shm
        buffers: set[int] = set()  # tokens of buffer regions the detached requests named
        for req_id, token, body in self._session.in_flight():
            shared = _copy_shared(body, arr, start=1)
            for op in token if isinstance(token, list) else ():
                _copy_arrays(op, arr)
            req = self._shm_reqs.get(req_id)
            if shared and req is not None:
                buffers.update(d[6] for d in req.regions if len(d) == 8)
                if shm_ is not None:
                    shm_.free(shm.tokens(req.regions))
                req.regions = []
        if buffers and shm_ is not None:
            for req in self._shm_reqs.values():
                if any(d[6] in buffers for d in req.regions):
                    shm_.free(shm.tokens(req.regions))
                    req.regions = []
        for _, frames in self._blocked:
            _copy_shared(frames, arr, start=2)
        for ops in self._queue.values():
            for op in ops:
                _copy_arrays(op, arr)

    def _own(self, arr: np.ndarray) -> np.ndarray:
        """A copy of ``arr`` (1-D) that only this client holds, for a call that returns
        before it is sent.  One large enough for shared memory is copied into this
        process's arena: sent from there, it is not copied a second time."""
        if self._shm is not None and arr.nbytes >= self._shm.min_bytes:
            staged = self._shm.stage(arr)
            if staged is not None:
                return staged
        return arr.copy()

    async def _gather(self, futures: Iterable[Awaitable[T]]) -> list[T]:
        tasks = list(futures)
        if len(tasks) == 1:  # the common small call: no gather machinery
            return [await tasks[0]]
        for t in tasks:
            if not isinstance(t, asyncio.Future):
                return list(await asyncio.gather(*tasks))
        # Futures of operations already submitted: as asyncio.gather (done when all are,
        # or at the first failure; a cancelled caller cancels them), with one waiter.
        futs = cast(list[asyncio.Future[T]], tasks)
        failed: asyncio.Future[T] | None = None
        left = 0
        for f in futs:
            if not f.done():
                left += 1
            elif failed is None and (f.cancelled() or f.exception() is not None):
                failed = f
        if left and failed is None:
            join = _Join(futs[0].get_loop().create_future(), left)
            for f in futs:
                if not f.done():
                    f.add_done_callback(join.done)
            try:
                await join.waiter
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
            failed = join.failed
        if failed is not None:
            for f in futs:  # no "exception never retrieved" left behind
                if not f.done():
                    f.add_done_callback(_retrieve)
                elif not f.cancelled():
                    f.exception()
            failed.result()  # raises
        return [f.result() for f in futs]

    def call_deadline(self) -> float | None:
        """When the oldest request or timed broker call in flight fails unless answered
        (the loop's clock: ``time.monotonic()``'s under asyncio and uvloop); None: none
        is in flight.  Safe from any thread (see ``ClientSession.earliest_deadline``)."""
        return self._session.earliest_deadline()

    def _now(self) -> float:
        return (self._loop or asyncio.get_running_loop()).time()

    def _flush_soon(self) -> None:
        self._flush_pending = False
        self._flush()

    def _flush(self) -> None:
        """Send what is due: the session's tick, then each partition's queued operations,
        coalesced.  Runs in a loop callback, without waiting: a send the socket's queue has
        no room for is held back, with every later one, for the flush task."""
        if self._blocked:
            self._wake.set()  # the flush task sends those first, then flushes
            return
        if self._tick_at is not None:
            # The timer may fire a hair early: the session is told the time it asked for.
            now = max(self._now(), self._tick_at)
            self._tick_at = None
            self._apply(self._session.tick(now))
        queued, self._queue = self._queue, collections.defaultdict(list)
        max_bytes = min(self.config.batch_max_bytes, self.config.message_budget)
        for partition, queued_ops in queued.items():
            ops = self._merge(queued_ops)
            if len(ops) == 1:
                self._send_request(partition, ops)
                continue
            sizes = [op.nbytes for op in ops]
            limit = max_bytes
            if (
                self._shm is not None
                and min(sizes) >= self._shm.min_bytes
                and self._shm_to(partition)
            ):
                # Each payload travels through shared memory: the message is small.
                limit = self.config.message_budget
            for a, b in plan_batches(sizes, self.config.batch_max_ops, limit):
                self._send_request(partition, ops[a:b])
        # Several requests in flight: zmq's I/O thread no longer preempts this one at
        # each send and reply; a lone request's reply wakes it at once again.
        if self._io is not None:
            self._io.busy(len(self._session) > 1)

    async def _flush_loop(self) -> None:
        """Sends what a full queue held back, in order, as room comes; then flushes."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._blocked:
                send, frames = self._blocked[0]
                await self._send_waiting(send, frames)
                self._blocked.popleft()
            self._flush()

    def _merge(self, ops: list[_Op]) -> list[_Op]:
        """Row operations on one table become one operation (see batching.merge_row_ops)."""
        if len(ops) < 2:
            return ops
        keys: set[tuple[Any, ...]] = set()
        for op in ops:  # the common case: no two row operations of a kind on one table
            body = op.body
            name = body.get("op")
            if name in MERGEABLE:
                key = (name, body.get("t"), body.get("step"))
                if key in keys:
                    break
                keys.add(key)
        else:
            return ops
        out = []
        loop = asyncio.get_running_loop()
        merged = merge_row_ops(
            [(op.body, op.arrays) for op in ops],
            self.config.batch_max_ops,
            sizes=[op.nbytes for op in ops],
            max_bytes=self.config.message_budget,
        )
        for m in merged:
            if len(m.parts) == 1:
                out.append(ops[m.parts[0][0]])
                continue
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            members = [(ops[i].future, a, b) for i, a, b in m.parts]
            fut.add_done_callback(functools.partial(_split_result, members=members))
            reply = sum(ops[i].reply_bytes for i, _, _ in m.parts)
            lazy = all(ops[i].lazy for i, _, _ in m.parts)
            out.append(_Op(m.body, m.arrays, fut, reply, lazy=lazy))
        return out

    def _send_request(self, partition: int, ops: list[_Op]) -> None:
        enc = Encoder(self._policy)
        bodies = []
        for op in ops:
            op.partition = partition
            body = dict(op.body)
            for key, arr in op.arrays.items():
                body[key] = enc.array(arr)
            bodies.append(body)
        # No caller waits for its writes: background pushes beside reads (a pipelined step).
        lazy = any(op.lazy for op in ops) and all(
            op.lazy or op.body.get("op") in _READS for op in ops
        )
        if lazy and len(ops) > 1:
            self._lazy_parts.add(partition)  # its answer may be held (see _ask_held)
        actions = self._session.submit(partition, bodies, enc, ops, self._now(), lazy=lazy)
        if self._shm is not None and any(op.nbytes >= self._shm.min_bytes for op in ops):
            reply_ok = sum(op.reply_bytes for op in ops) >= self._shm.min_bytes
            for a in actions:
                if isinstance(a, Send) and a.req_id:
                    self._shm_reqs[a.req_id] = _ShmRequest(ops, reply_ok)
        self._apply(actions)

    def _apply(self, actions: list[Action[_Token]]) -> None:
        """Carry out what the session asked for, then set the timer for its next tick."""
        for action in actions:
            if isinstance(action, Send):
                self._transmit(action)
            else:
                self._resolve(action)
        self._schedule()

    def _transmit(self, send: Send) -> None:
        """Send at once, or hold the send back for the flush task (see :meth:`_flush`)."""
        assert self._sock is not None
        frames = send.frames
        if self._shm_reqs and send.req_id in self._shm_reqs:
            frames = self._shm_frames(send)
        if self._borrowing:
            ops = self._session.token(send.req_id)
            if isinstance(ops, list) and any(op.borrowed for op in ops):
                # zmq sends large frames without a copy, reading them when its I/O
                # thread gets to them: maybe after the call has ended (a timeout, a
                # cancellation) and the caller wrote its array again.
                frames = list(frames)
                _copy_shared(frames, None, start=2)
        if self._routers.routes:
            endpoint = self._routers.pick(send.frames, send.req_id)
            if endpoint:  # the partition's routing broker; never waited on
                if not transport.try_send(self._router_socks[endpoint][0], frames):
                    self._session.unsent(send.req_id, self._now())
                return
        if len(self._socks) > 1:
            # Never wait on one broker of a pair: it may be the one that died.
            if not transport.try_send(self._sock, frames):
                self._session.unsent(send.req_id, self._now())
            return
        if self._blocked:  # behind sends waiting for room: in order
            self._blocked.append((send, frames))
            return
        try:
            if not transport.send_if_room(self._sock, frames):
                self._blocked.append((send, frames))  # the flush task waits for room
                self._wake.set()
        except (ClosedError, BrokenError) as e:
            self._abandon(send, e)

    async def _send_waiting(self, send: Send, frames: list[Any]) -> None:
        assert self._sock is not None
        try:
            await transport.send(self._sock, frames)
        except (ClosedError, BrokenError) as e:
            self._abandon(send, e)

    def _abandon(self, send: Send, e: ClosedError | BrokenError) -> None:
        err = e if isinstance(e, ClosedError) else ClosedError(str(e))
        for action in self._session.abandon(send.req_id, err):
            self._resolve(action)

    def _shm_frames(self, send: Send) -> list[Any]:
        """A request's frames with its large payloads in shared memory, unless its
        partition's primary could not open them."""
        assert self._shm is not None
        req = self._shm_reqs[send.req_id]
        partition = unpack_route(send.frames[0]).partition
        to_primary = self._shm_to(partition) and not req.inline
        if 0 < self._shm_replies_off <= self._now():
            self._shm_replies_off = 0.0  # a while has passed since it could not: try again
        frames, descs = self._shm.outbound(
            send.frames,
            payloads=to_primary,
            reuse=req.regions,
            reply_ok=req.reply_ok and not self._shm_replies_off and to_primary,
            done=self._shm_done.pop(partition, ()),
        )
        if descs and not req.regions:
            req.regions = descs
        return frames

    def _shm_to(self, partition: int) -> bool:
        """Whether the partition's primary is known and has not said that it cannot
        share memory with this client (another host or user, or its path off)."""
        cmap = self._session.map
        info = cmap.partitions.get(partition) if cmap is not None else None
        primary = info.primary if info is not None else None
        if primary is None:
            return False
        until = self._shm_refused.get(primary)
        if until is None:
            return True
        if self._now() < until:
            return False
        del self._shm_refused[primary]  # it could not for a while: offer it again
        return True

    def _shm_finished(self, action: Deliver[_Token] | Fail[_Token]) -> None:
        """A request is over: the regions of its payloads may be reused."""
        assert self._shm is not None
        if isinstance(action, Deliver):
            req = self._shm_reqs.pop(action.msg.route.req_id, None)
        else:
            req_id = next((r for r, q in self._shm_reqs.items() if q.token is action.token), None)
            req = None if req_id is None else self._shm_reqs.pop(req_id)
        if req is not None:
            self._shm.free(shm.tokens(req.regions))

    def _shm_reply(self, bufs: list[Any], msg: Message) -> Message:
        """A reply whose large frames are in the shard's shared memory, copied here.  A
        region that cannot be read makes it a refusal: the session asks again (inline,
        if this client cannot open the shard's memory at all)."""
        info = msg.header.get(shm.KEY)
        descs = info.get("d") if isinstance(info, dict) else None
        tokens = [d[6] for d in descs if isinstance(d, list) and len(d) == 7] if descs else []
        if tokens:  # the shard may reuse them: told with the next request to the partition
            done = self._shm_done.setdefault(msg.route.partition, [])
            done.extend(tokens)
            del done[:-256]
        if self._shm is None:
            raise ProtocolError("a reply in shared memory, which this client did not ask for")
        # Operations that name where their arrays go (a pulled tensor's pieces), alone
        # or sharing the request with others (a pipelined push and the next pull).
        # Only while the request is unanswered (the entry goes with its answer), so a
        # late duplicate never writes into an array already handed back.
        req = self._shm_reqs.get(msg.route.req_id)
        into = _places(req.token, msg.header) if req is not None else None
        try:
            got = self._shm.inbound(bufs, msg.header, into, header_frame=False)
        except shm.ShmUnavailableError as e:
            if e.permanent:
                until = self._now() + shm.RETRY_S if e.busy else math.inf
                self._shm_replies_off = max(self._shm_replies_off, until)
            log.warning("re-sending request %d: %s", msg.route.req_id, e)
            refused: dict[str, Any] = {"st": "OVERLOADED", "msg": str(e)}
            if "acked" in msg.header:  # earlier requests' answers still count
                refused["acked"] = msg.header["acked"]
            return Message(msg.route, refused, [])
        return Message(msg.route, got.header, got.frames[2:])

    def _shm_refusal(self, msg: Message) -> None:
        """A primary could not read this client's shared memory: at all (``open``: it
        gets inline frames, and answers inline, from now on; also said on an answer to
        a request that asked for its reply this way), or these regions (``gone``: the
        next sending takes new ones)."""
        req = self._shm_reqs.get(msg.route.req_id)
        if msg.header.get("noshm") == "gone":
            if req is None or self._shm is None:
                return
            named = msg.header.get("tok")
            current = shm.tokens(req.regions)
            if isinstance(named, list) and not set(named) & set(current):
                # A refusal of an earlier sending's regions (freed since, and the
                # request sent again with new ones, which the shard may be reading now).
                return
            self._shm.free(current)
            req.regions = []
            return
        if req is not None and msg.header.get("st") == "OVERLOADED":
            # Sent again inline: to the shard that refused, or to the one a newer map
            # names, which then answers STALE_EPOCH and the map is asked for again.
            req.inline = True
        by = msg.header.get("by")  # the shard that said so (earlier releases: not told)
        if not isinstance(by, str):
            cmap = self._session.map
            info = cmap.partitions.get(msg.route.partition) if cmap is not None else None
            by = info.primary if info is not None else None
        if by is None:
            return
        now = self._now()
        if msg.header.get("noshm") == "busy":  # out of descriptors or memory: for a while
            if self._shm_refused.get(by, 0.0) <= now:
                log.warning(
                    "shard %s cannot open this client's shared memory for now (%s): "
                    "inline frames for %.0f s",
                    by,
                    msg.header.get("msg", "?"),
                    shm.RETRY_S,
                )
            self._shm_refused[by] = max(self._shm_refused.get(by, 0.0), now + shm.RETRY_S)
        elif self._shm_refused.get(by) != math.inf:
            log.info("shard %s cannot share memory with this client", by)
            self._shm_refused[by] = math.inf

    def _resolve(self, action: Deliver[_Token] | Fail[_Token]) -> None:
        partial = isinstance(action, Deliver) and action.partial
        if self._shm_reqs and not partial:  # a partial answer: the request goes on
            self._shm_finished(action)
        token = action.token
        if isinstance(action, Fail):
            if isinstance(token, list) and getattr(action.error, "code", "") == "MOVED":
                self._moved(token)
                return
            if isinstance(token, list):
                for op in token:
                    if not op.future.done():
                        op.future.set_exception(action.error)
            elif not token.done():
                token.set_exception(action.error)
        elif isinstance(token, list):
            self._deliver(token, action.msg, partial)
        elif not token.done():
            token.set_result(action.msg.header)

    def _moved(self, ops: list[_Op]) -> None:
        """Live resharding: the partition no longer holds some slots of these operations
        (nothing was applied): each is split again by the newest map and sent anew."""
        cmap = self.cluster_map
        if self._moved_at == cmap.version:  # the newer map is not here yet: ask for it
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.ensure_future(self._hello()))
        self._moved_at = cmap.version
        for op in ops:
            if op.future.done():
                continue
            plan = resplit(op.body, op.arrays, op.reply_bytes, cmap)
            if plan is None:  # not on a slot (tables, describe...): where it was going
                piece = self._submit(
                    op.partition,
                    op.body,
                    op.arrays,
                    reply_bytes=op.reply_bytes,
                    borrowed=op.borrowed,
                    lazy=op.lazy,
                )
                piece.add_done_callback(functools.partial(_pass_on, target=op.future))
                continue
            pieces = [
                self._submit(p, b, a, reply_bytes=r, borrowed=op.borrowed, lazy=op.lazy)
                for p, b, a, r in plan.pieces
            ]
            joined = asyncio.gather(*pieces)
            joined.add_done_callback(functools.partial(_join_moved, target=op.future, plan=plan))

    def _deliver(self, ops: list[_Op], msg: Message, partial: bool = False) -> None:
        """Each operation's result; a ``partial`` reply has one only for each read (the
        writes wait for the final reply)."""
        results = msg.header.get("res")
        if not isinstance(results, list) or len(results) != len(ops):
            err = ProtocolError("reply does not match the request's operations")
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(err)
            return
        for op, res in zip(ops, results, strict=True):
            if op.future.done() or (partial and res is None):
                continue
            if res is None and op.body.get("op") in _READS:
                # A read whose answer (a first part) never came: asked again (a write
                # is never sent again under a new sequence number: None is no status).
                try:
                    again = self._submit(
                        op.partition, op.body, op.arrays, reply_bytes=op.reply_bytes, into=op.into
                    )
                except ClosedError as e:
                    op.future.set_exception(e)
                    continue
                again.add_done_callback(functools.partial(_pass_on, target=op.future))
                continue
            try:
                op.future.set_result(self._result(res, msg))
            except (ProtocolError, RemoteError) as e:
                op.future.set_exception(e)

    def _schedule(self) -> None:
        """Have the flush tick the session at its next wake-up (if sooner than planned)."""
        at = self._session.next_wakeup()
        if at is None or (self._timer is not None and self._timer_at <= at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = (self._loop or asyncio.get_running_loop()).call_at(at, self._on_timer, at)
        self._timer_at = at

    def _on_timer(self, at: float) -> None:
        self._timer = None
        self._tick_at = at if self._tick_at is None else min(self._tick_at, at)
        self._flush()

    async def _hello(self) -> None:
        assert self._sock is not None
        await self._control(self._session.hello().frames)

    async def _control(self, frames: list[Any]) -> None:
        """A HELLO or heartbeat: repeated anyway, so to a broker pair it is only tried."""
        assert self._sock is not None
        if len(self._socks) > 1:
            transport.try_send(self._sock, frames)
        else:
            await transport.send(self._sock, frames)

    async def _heartbeat_loop(self) -> None:
        assert self._sock is not None
        interval = self.config.heartbeat.interval
        while True:
            await asyncio.sleep(interval)
            await self._control(encode(Route(MsgType.HEARTBEAT), Heartbeat().to_wire()))
            if self._shm is not None:  # unmap the memory of shards that are gone
                self._shm.housekeeping()
            if self._router_socks:
                self._router_beats()
            # Also a tick: deadlines are checked at least this often.
            now = self._now()
            self._tick_at = now if self._tick_at is None else min(self._tick_at, now)
            self._flush()

    def _follow_routers(self, cmap: ClusterMap) -> None:
        """Connect to the routing brokers the map lists (and drop those it no longer does)."""
        if self._tg is None or self._ctx is None or (not cmap.routers and not self._router_socks):
            return
        new, gone = self._routers.on_map(cmap, self._now())
        for endpoint in gone:
            sock, task = self._router_socks.pop(endpoint)
            if task is not None:
                task.cancel()
                transport.close(sock)
        keys = load_curve_keys(self.config.security) if new else None
        for endpoint in new:
            if endpoint in self.addresses:  # given as a broker: its socket serves both
                self._router_socks[endpoint] = (self._socks[self.addresses.index(endpoint)], None)
                continue
            sock = transport.dealer(
                self._ctx,
                endpoint,
                self.client_id,
                max_message_bytes=self.config.max_message_bytes,
                curve=keys,
                server_public=keys.server_public if keys else None,
            )
            on_frames = functools.partial(self._on_router_message, endpoint)
            task = self._tg.create_task(transport.serve(sock, on_frames, self._on_malformed))
            self._router_socks[endpoint] = (sock, task)
            self._tasks.append(task)

    def _router_beats(self) -> None:
        """Heartbeats to every routing broker (each echoes them), and fail over from one
        silent for ``failover_timeout``: what was in flight through it, or for its
        partitions, is sent again, to the broker."""
        beat = encode(Route(MsgType.HEARTBEAT), Heartbeat().to_wire())
        for sock, _ in self._router_socks.values():
            transport.try_send(sock, beat)
        now = self._now()
        down, resend = self._routers.tick(now)
        for endpoint in down:
            log.warning(
                "the routing broker at %s is silent; its requests go to the broker (%d "
                "to send again)",
                endpoint,
                len(resend),
            )
        for req_id in resend:
            self._session.unsent(req_id, now)
        if resend:
            self._schedule()

    async def _on_router_message(self, endpoint: str, frames: transport.Frames) -> None:
        if self._routers.heard(endpoint, self._now()):
            log.info("the routing broker at %s answers again", endpoint)
        bufs = [transport.frame_buffer(f) for f in frames]
        msg = decode(bufs)
        if msg.route.mtype is not MsgType.REPLY:
            return  # its heartbeat echoes
        if shm.KEY in msg.header:
            msg = self._shm_reply(bufs, msg)
        await self._dispatch(msg)

    async def _pair_loop(self) -> None:
        """Follow the active broker of the pair (see :class:`BrokerChoice`)."""
        assert self._choice is not None
        while True:
            await asyncio.sleep(self._choice.retry)
            what = self._choice.tick(self._now())
            if what == "switch":
                self._switch_to(self._choice.current, "the other one was silent")
            if what is not None:
                await self._hello()

    def _switch_to(self, index: int, why: str) -> None:
        self._sock = self._socks[index]
        self._session.switched()
        log.log(
            logging.WARNING if len(self._session) else logging.INFO,
            "switching to the broker at %s (%s); %d requests in flight",
            self.addresses[index],
            why,
            len(self._session),
        )

    async def _recv_loop(self, index: int = 0) -> None:
        await transport.serve(
            self._socks[index],
            functools.partial(self._on_message, index),
            self._on_malformed,
            fast=functools.partial(self._on_reply, index),
        )

    def _on_reply(self, index: int, frames: transport.Frames) -> bool:
        """A reply matched and its caller answered at once, in the socket's reader
        callback (see transport.serve), as :meth:`_on_message` would.  False for
        anything else, and with a broker pair or routing brokers (whose answers say
        more than the reply): :meth:`_on_message` handles it."""
        choice = self._choice
        if (choice is not None and choice.n > 1) or self._router_socks:
            return False
        bufs = [transport.frame_buffer(f) for f in frames]
        msg = decode(bufs)
        if msg.route.mtype not in _REPLIES:
            return False  # a map, a heartbeat: decoded again there (they are few)
        if shm.KEY in msg.header:
            msg = self._shm_reply(bufs, msg)
        self._on_answer(msg)
        self._apply(self._session.on_reply(msg, self._now()))
        return True

    def _on_answer(self, msg: Message) -> None:
        if self._shm_reqs and "noshm" in msg.header:
            self._shm_refusal(msg)
        if self._routers.inflight:
            if msg.header.get("part") != 1:  # a first part: the writes are still due
                self._routers.answered(msg.route.req_id)
            acked = msg.header.get("acked")
            if isinstance(acked, list):
                for item in acked:
                    if isinstance(item, list) and item and type(item[0]) is int:
                        self._routers.answered(item[0])

    async def _on_message(self, index: int, frames: transport.Frames) -> None:
        bufs = [transport.frame_buffer(f) for f in frames]
        msg = decode(bufs)
        if shm.KEY in msg.header:
            msg = self._shm_reply(bufs, msg)
        if self._router_socks and self.addresses[index] in self._router_socks:
            self._routers.heard(self.addresses[index], self._now())  # a router as broker
        choice = self._choice
        if choice is not None and choice.n > 1:
            now = self._now()
            if msg.header.get("passive") is True:
                choice.refused(index, now)  # a standby: requests are parked, not failed
                if msg.route.mtype not in _REPLIES:
                    return
            else:
                term = msg.header.get("term")
                verdict = choice.heard(index, term if isinstance(term, int) else None, now)
                if verdict is None:
                    return  # from a broker that was replaced: fenced
                if verdict:
                    self._switch_to(index, "it is the active broker now")
        await self._dispatch(msg)

    def _on_malformed(self, frames: transport.Frames, err: ProtocolError) -> None:
        if isinstance(err, VersionMismatchError):
            if self._mismatch is None:
                log.error("the broker at %s: %s", self.address, err)
            self._mismatch = err
            self._map_event.set()  # an introduction waiting for a map fails at once
            return
        log.warning("dropped a malformed message from the broker: %s", err)

    async def _dispatch(self, msg: Message) -> None:
        if msg.route.mtype in _REPLIES:
            self._on_answer(msg)
            self._apply(self._session.on_reply(msg, self._now()))
            return
        match _from_broker(msg.route.mtype, msg.header):
            case MapUpdate(m):
                new = ClusterMap.from_wire(m)
                old = self._session.map
                if old is not None and new.incarnation != old.incarnation:
                    log.info(
                        "the broker restarted; re-sending %d unanswered requests",
                        len(self._session),
                    )
                self._apply(self._session.on_map(new, self._now()))
                if old is not None and self._session.map is new:
                    self._log_lost(old, new)
                if self._session.map is not None:
                    self._map_event.set()
                    self._follow_routers(self._session.map)
            case HelloAgain():  # the broker restarted and does not know us
                await self._hello()
            case Heartbeat():
                pass
            case None:
                raise ProtocolError(f"a client does not expect {msg.route.mtype.name}")
            case unknown:
                assert_never(unknown)

    def _log_lost(self, old: ClusterMap, new: ClusterMap) -> None:
        """Say when a partition loses its last live copy (its calls wait: ClientSession,
        rule 5) and when it is served again."""
        for p, info in new.partitions.items():
            was = old.partitions.get(p)
            if info.lost and not (was is not None and was.lost):
                log.warning(
                    "partition %d has no live copy: its calls wait for a copy holding its "
                    "data (or `zps-server reset-partition`) for at most %gs each",
                    p,
                    self.config.timeout,
                )
            elif was is not None and was.lost and not info.lost:
                log.warning("partition %d has a live copy again", p)

    def _result(self, res: object, msg: Message) -> dict[str, Any]:
        if not isinstance(res, dict):
            raise ProtocolError("operation result is not a map")
        st = res.get("st")
        if st != "OK":
            raise remote_error(str(st), str(res.get("msg", "")))
        desc = res.get("a")
        if desc is not None:
            limit = self.config.max_message_bytes
            if isinstance(desc, list) and desc and isinstance(desc[0], list):
                res["arrays"] = [array_from(d, msg.payloads, max_bytes=limit) for d in desc]
            else:
                res["arrays"] = array_from(desc, msg.payloads, max_bytes=limit)
        return res


def _ignore(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


#: Operations that change nothing (a request of these and background pushes is lazy).
_READS = frozenset({"pull_rows", "pull_dense"})
#: Answers matched to a request or broker call by the session.
_REPLIES = frozenset({MsgType.REPLY, MsgType.STATUS, MsgType.CLOCK, MsgType.TASK})


def _from_broker(mtype: MsgType, header: dict[str, Any]) -> BrokerToClient | None:
    """The record of a message from the broker that is not a reply (None: not one a
    client expects)."""
    match mtype:
        case MsgType.MAP:
            return MapUpdate.parse(header)
        case MsgType.HELLO:
            return HelloAgain.parse(header)
        case MsgType.HEARTBEAT:
            return Heartbeat.parse(header)
        case _:
            return None


def _pass_on(
    piece: asyncio.Future[dict[str, Any]], *, target: asyncio.Future[dict[str, Any]]
) -> None:
    if target.done():
        return
    if piece.cancelled():
        target.cancel()
    elif (exc := piece.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(piece.result())


def _join_moved(
    joined: asyncio.Future[list[dict[str, Any]]],
    *,
    target: asyncio.Future[dict[str, Any]],
    plan: Resplit,
) -> None:
    """Hand an operation split again after ``MOVED`` the joined result of its pieces."""
    if target.done():
        return
    if joined.cancelled():
        target.cancel()
    elif (exc := joined.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(join_resplit(plan, joined.result()))


class _Join:
    """Wakes ``waiter`` once ``left`` futures are done, or at the first that failed."""

    __slots__ = ("failed", "left", "waiter")

    def __init__(self, waiter: asyncio.Future[None], left: int) -> None:
        self.waiter = waiter
        self.left = left
        self.failed: asyncio.Future[Any] | None = None

    def done(self, fut: asyncio.Future[Any]) -> None:
        self.left -= 1
        if self.failed is not None or self.waiter.done():
            _retrieve(fut)  # the caller has its answer (or gave up)
        elif fut.cancelled() or fut.exception() is not None:
            self.failed = fut
            self.waiter.set_result(None)
        elif self.left == 0:
            self.waiter.set_result(None)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's error as seen (its caller gave up on it)."""
    if not fut.cancelled():
        fut.exception()


def _split_result(
    merged: asyncio.Future[dict[str, Any]],
    *,
    members: list[tuple[asyncio.Future[dict[str, Any]], int, int]],
) -> None:
    """Hand each original operation its part of a merged operation's result."""
    if merged.cancelled():
        for fut, _, _ in members:
            fut.cancel()
        return
    exc = merged.exception()
    for fut, start, stop in members:
        if fut.done():
            continue
        if exc is not None:
            fut.set_exception(exc)
            continue
        res = merged.result()
        arrays = res.get("arrays")
        fut.set_result({**res, "arrays": arrays[start:stop]} if arrays is not None else res)
