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

The pieces it drives, each given only the callables it needs: :mod:`~zps.client.ops`
(an operation, merged, copied, its result read), :mod:`~zps.client.futures` (a call's
futures joined), :mod:`~zps.client.background` (background calls),
:mod:`~zps.client.timer` (the session's wake-ups), :mod:`~zps.client.shmpath` (shared
memory), :mod:`~zps.client.routerlinks` (routing brokers), :mod:`~zps.client.pair` (a
broker pair).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Coroutine, Sequence
from typing import Any, Self, assert_never

import numpy as np
import zmq.asyncio

from zps import shm, transport
from zps.client.background import Background
from zps.client.futures import gather, ignore
from zps.client.inbound import REPLIES, from_broker, lost_changes
from zps.client.ops import Op, Resubmits, Token, copy_everywhere, copy_shared, deliver, fail, merge
from zps.client.pair import PairFollower, no_answer
from zps.client.routerlinks import RouterLinks
from zps.client.session import (
    Action,
    BrokerChoice,
    ClientSession,
    ClientStats,
    Deliver,
    Fail,
    Resubmit,
    Send,
)
from zps.client.shmpath import ClientShm
from zps.client.timer import SessionTimer
from zps.core.batching import plan_batches
from zps.core.routing import ClusterMap
from zps.errors import (
    BadRequestError,
    BrokenError,
    ClosedError,
    ProtocolError,
    ZpsTimeoutError,
)
from zps.ops import malloc
from zps.ops.config import ClientConfig, broker_endpoints
from zps.ops.meter import ClientMeter
from zps.ops.security import client_identity, load_curve_keys
from zps.protocol.codec import (
    NO_COMPRESSION,
    TRAFFIC,
    Encoder,
    Message,
    MsgType,
    Route,
    VersionMismatchError,
    decode,
    encode,
)
from zps.protocol.messages import (
    Bye,
    ClientHello,
    Heartbeat,
    HelloAgain,
    MapUpdate,
    StatusRequest,
)
from zps.protocol.ops import READS
from zps.version import __version__

log = logging.getLogger("zps.client")


class Connection:
    """Lifecycle, request machinery and background pushes of a client (see the module notes)."""

    def __init__(self, address: str | Sequence[str], config: ClientConfig | None = None) -> None:
        self.addresses = broker_endpoints(address, "the broker address")
        self.address = self.addresses[0]
        self.config = config or ClientConfig()
        curve = load_curve_keys(self.config.security)
        self.client_id = client_identity(curve.public if curve is not None else None)
        self._handshakes: list[transport.HandshakeWatch] = []
        self._session: ClientSession[Token] = ClientSession(
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
        self._socks: list[transport.Dealer] = []
        self._pair: PairFollower | None = None  # with a broker pair
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._queue: dict[int, list[Op]] = collections.defaultdict(list)
        self._wake = asyncio.Event()  # the flush task has sends held back to carry out
        self._flush_pending = False  # a flush is scheduled (call_soon) for queued operations
        # Sends the socket's queue had no room for, with their frames, in order: the flush
        # task waits for room and sends them; later sends queue behind them.
        self._blocked: collections.deque[tuple[Send, list[Any]]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran in
        self._timer = SessionTimer(self._get_loop, self._session.next_wakeup, self._flush)
        self._closed = False
        self._started = False
        self._background = Background(self.config.max_background)
        self._lazy_parts: set[int] = set()  # sent lazy requests since the last flush
        self._mismatch: VersionMismatchError | None = None  # a broker of another version
        self._passive = False  # the one broker given answered as a pair's standby
        # Routing brokers of the map (zps.client.routers): requests for a partition go to
        # its router while that one answers.
        self._links = RouterLinks(
            self.client_id,
            self.config,
            now=self._now,
            unsent=self._session.unsent,
            reschedule=self._timer.schedule,
        )
        self._tg: asyncio.TaskGroup | None = None
        # Same-host shared memory for large frames (zps.shm); its memory None when off.
        self._shm = ClientShm(
            shm.SharedMemory.create(
                self.config.shm_bytes, "client", max_frame_bytes=self.config.max_message_bytes
            ),
            now=self._now,
            primary_of=self._primary_of,
        )
        self._resubmits = Resubmits(self.submit, lambda t, f: self._get_loop().call_later(t, f))
        self._borrowing = False  # an operation of the caller's memory was ever sent
        #: Requests, their outcomes and latency, broker calls, steps (zps-worker's metrics).
        self.meter = ClientMeter(time.monotonic())

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
                watch=True,
            )
            for address in self.addresses
        ]
        self._sock = self._socks[0]
        if keys is not None:  # a refused CURVE handshake is named if the introduction fails
            self._handshakes = [ch.handshakes for ch in self._socks if ch.handshakes]
        for ch in self._socks:
            # Under CURVE the broker sends to this client (maps, probes) over a new
            # connection only once the client spoke there: it does at once.
            ch.on_connected = functools.partial(self._greet, ch)
        if len(self._socks) > 1:
            choice = BrokerChoice(
                len(self._socks),
                silence=self.config.failover_timeout,
                retry=self.config.failover_timeout / 10,
                now=self._now(),
            )
            self._pair = PairFollower(
                choice,
                self.addresses,
                now=self._now,
                use=self._use_broker,
                hello=self._hello,
                in_flight=self._session.__len__,
            )
        tg = self._tg = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._tasks = [
            *(tg.create_task(self._recv_loop(i)) for i in range(len(self._socks))),
            tg.create_task(self._flush_loop()),
            tg.create_task(self._heartbeat_loop()),
        ]
        if self._pair is not None:
            self._tasks.append(tg.create_task(self._pair.run()))
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
                no_answer(
                    self.addresses,
                    self.config.connect_timeout,
                    passive=self._passive,
                    keyed=self.config.security.enabled,
                )
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
        self._timer.cancel()
        err = ClosedError("the client was closed")
        self._resubmits.fail(err)
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
        self._links.close()
        self._io = None  # its threads end with the context: their ids may be reused
        if self._ctx is not None:
            transport.term(self._ctx)
        self._shm.close()

    @property
    def shm_path(self) -> ClientShm:
        """This client's side of the shared-memory path (its ``memory`` None: off): its
        statistics, and the shards that refused it."""
        return self._shm

    @property
    def in_background(self) -> int:
        """How many background calls (``wait=False``) are in flight."""
        return len(self._background)

    @property
    def requests_in_flight(self) -> int:
        """How many requests are sent and not answered yet (broker calls aside)."""
        return sum(1 for _ in self._session.in_flight())

    @property
    def sends_held_back(self) -> int:
        """How many sends wait for room in the socket's queue (see :meth:`_flush`)."""
        return len(self._blocked)

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the client runs on (None before :meth:`start`)."""
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def io_threads(self) -> transport.IoThreads | None:
        """zmq's I/O threads of this client and their scheduling policy (None: closed)."""
        return self._io

    @property
    def channels(self) -> tuple[transport.Channel, ...]:
        """The channels to the brokers, one per address, in the order given (empty
        before :meth:`start`): for tools that inspect or switch a channel's I/O path."""
        return tuple(self._socks)

    def requests(self) -> list[tuple[int, list[Op]]]:
        """The requests sent and not answered yet: each one's id and its operations."""
        return [(r, ops) for r, ops, _ in self._session.in_flight() if isinstance(ops, list)]

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` for as long as the client: cancelled by :meth:`close`."""
        assert self._tg is not None, "the client is not started"
        self._tasks.append(self._tg.create_task(coro))

    @property
    def cluster_map(self) -> ClusterMap:
        cmap = self._session.map
        if cmap is None:
            raise ClosedError("the client is not connected")
        return cmap

    # -- background pushes -------------------------------------------------------

    async def finish(self, futures: list[asyncio.Future[dict[str, Any]]], wait: bool) -> None:
        """Wait for a call's operations, or (``wait`` False) count it in the background."""
        if wait:
            if len(futures) == 1:
                await futures[0]
            else:
                await gather(futures)
            return
        await self._background.add(futures)

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
            self.submit(p, {"op": "acks"}, {}).add_done_callback(ignore)

    def raise_background(self) -> None:
        """An error of a background push is raised by the next call, once."""
        self._background.raise_error()

    async def flush(self) -> None:
        """Wait for every background push; raise the first error among them."""
        if self._background:
            self._ask_held()
        await self._background.drain()

    # -- calls the broker answers ----------------------------------------------

    async def broker_call(
        self, mtype: MsgType, header: dict[str, Any], forever: bool = False
    ) -> dict[str, Any]:
        """A call the broker itself answers (CLOCK, TASK, STATUS; matched by request id),
        bounded by the client's timeout unless ``forever``; its header as answered."""
        if self._closed:
            raise ClosedError("the client was closed")
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        req_id, actions = self._session.call(mtype, header, fut, self._now(), forever=forever)
        self.meter.call_started(time.monotonic())
        try:
            self._apply(actions)
            return await fut
        finally:  # answered, failed, or the caller gave up: the session forgets the call
            self._session.abandon(req_id, ClosedError("the call was cancelled"))
            self.meter.call_done(time.monotonic())

    async def status(self, request: StatusRequest | None = None) -> dict[str, Any]:
        """The broker's status report (as ``zps-server status --json`` prints it); with a
        ``request`` carrying an operator's command (a drain, a scale, a partition reset),
        the report also says what came of it."""
        return await self.broker_call(MsgType.STATUS, (request or StatusRequest()).to_wire())

    # -- request machinery ---------------------------------------------------

    def submit(
        self,
        partition: int,
        body: dict[str, Any],
        arrays: dict[str, np.ndarray],
        *,
        reply_bytes: int = 0,
        into: list[np.ndarray] | None = None,
        borrowed: bool = False,
        lazy: bool = False,
        deadline: float | None = None,
    ) -> asyncio.Future[dict[str, Any]]:
        """Queue one operation for ``partition`` (``body`` its header entry, ``arrays`` its
        payloads, ``reply_bytes`` those of its answer; ``into``: where a pull's chunks go;
        ``borrowed``: the arrays are the caller's memory; ``lazy``: a background push;
        ``deadline``: an operation submitted again keeps its first request's) and return
        the future of its result; sent with the others of this loop turn."""
        if self._closed:
            raise ClosedError("the client was closed")
        loop = self._loop or asyncio.get_running_loop()
        op = Op(
            body,
            arrays,
            loop.create_future(),
            reply_bytes,
            into=into,
            borrowed=borrowed,
            lazy=lazy,
            deadline=deadline,
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

    def buffer(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """Zeros of ``shape`` and ``dtype``, in this process's shared memory when it has
        room (sent from there with no copy: :meth:`shm.SharedMemory.buffer`), else on
        the heap."""
        buf = self._shm.buffer(shape, dtype)
        return buf if buf is not None else np.zeros(shape, dtype=dtype)

    def detach(self, arr: np.ndarray) -> None:
        """A call that sent ``arr`` (the caller's memory) as it is ended before all its
        requests were answered (an error, a cancellation): from now on the caller may
        write ``arr``, so whatever may still be sent copies the bytes it holds now
        (:func:`~zps.client.ops.copy_everywhere`; frames zmq holds are copies already:
        see :meth:`_transmit`).  A :meth:`buffer` region named for them gets a new token:
        every request naming it lets its regions go (those still waited for name it
        again when re-sent), so a copy already on its way is refused rather than read as
        what the caller writes next."""
        in_flight = self._session.in_flight()
        copied = copy_everywhere(arr, in_flight, self._blocked, self._queue.values())
        self._shm.detach(copied)

    def own(self, arr: np.ndarray) -> np.ndarray:
        """A copy of ``arr`` (1-D) that only this client holds, for a call that returns
        before it is sent.  One large enough for shared memory is copied into this
        process's arena: sent from there, it is not copied a second time."""
        staged = self._shm.stage(arr)
        return staged if staged is not None else arr.copy()

    gather = staticmethod(gather)  # a call's results in order

    def call_deadline(self) -> float | None:
        """When the oldest request or timed broker call in flight fails unless answered
        (the loop's clock: ``time.monotonic()``'s under asyncio and uvloop); None: none
        is in flight.  Safe from any thread (see ``ClientSession.earliest_deadline``)."""
        return self._session.earliest_deadline()

    def _now(self) -> float:
        return self._get_loop().time()

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop or asyncio.get_running_loop()

    def _primary_of(self, partition: int) -> str | None:
        """The primary the client's map names for ``partition`` (None: none known)."""
        cmap = self._session.map
        info = cmap.partitions.get(partition) if cmap is not None else None
        return info.primary if info is not None else None

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
        tick = self._timer.take(self._now())
        if tick is not None:
            self._apply(self._session.tick(tick))
        queued, self._queue = self._queue, collections.defaultdict(list)
        max_bytes = min(self.config.batch_max_bytes, self.config.message_budget)
        for partition, queued_ops in queued.items():
            ops = merge(
                queued_ops,
                max_ops=self.config.batch_max_ops,
                max_bytes=self.config.message_budget,
            )
            if len(ops) == 1:
                self._send_request(partition, ops)
                continue
            sizes = [op.nbytes for op in ops]
            limit = max_bytes
            if self._shm.large(min(sizes)) and self._shm.to(partition):
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

    def _send_request(self, partition: int, ops: list[Op]) -> None:
        now = time.monotonic()
        nbytes = 0
        for op in ops:
            nbytes += op.nbytes
        self.meter.request_sent([op.body["op"] for op in ops], nbytes, now)
        # One reply (or failure) settles every operation of a message together.
        ops[0].future.add_done_callback(functools.partial(self._request_done, nbytes, now))
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
            op.lazy or op.body.get("op") in READS for op in ops
        )
        if lazy and len(ops) > 1:
            self._lazy_parts.add(partition)  # its answer may be held (see _ask_held)
        deadlines = [op.deadline for op in ops if op.deadline is not None]
        actions = self._session.submit(
            partition,
            bodies,
            enc,
            ops,
            self._now(),
            lazy=lazy,
            parts=ops,
            deadline=min(deadlines) if deadlines else None,
        )
        self._shm.track(ops, actions)
        self._apply(actions)

    def _request_done(self, nbytes: int, sent: float, _: object) -> None:
        now = time.monotonic()
        self.meter.request_done(nbytes, now - sent, now)

    def _apply(self, actions: list[Action[Token]]) -> None:
        """Carry out what the session asked for, then set the timer for its next tick."""
        for action in actions:
            if isinstance(action, Send):
                self._transmit(action)
            else:
                self._resolve(action)
        self._timer.schedule()

    def _transmit(self, send: Send) -> None:
        """Send at once, or hold the send back for the flush task (see :meth:`_flush`)."""
        assert self._sock is not None
        frames = send.frames
        if self._shm.requests and send.req_id in self._shm.requests:
            frames = self._shm.frames(send)
        if self._borrowing:
            ops = self._session.token(send.req_id)
            if isinstance(ops, list) and any(op.borrowed for op in ops):
                # zmq sends large frames without a copy, reading them when its I/O
                # thread gets to them: maybe after the call has ended (a timeout, a
                # cancellation) and the caller wrote its array again.
                frames = list(frames)
                copy_shared(frames, None, start=2)
        if self._links.send(frames, send.frames, send.req_id):
            return  # through the partition's routing broker; never waited on
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

    def _resolve(self, action: Deliver[Token] | Fail[Token] | Resubmit[Token]) -> None:
        partial = isinstance(action, Deliver) and action.partial
        if self._shm.requests and not partial:  # a partial answer: the request goes on
            self._shm.finished(action)
        token = action.token
        if isinstance(action, Resubmit):
            assert isinstance(token, list)
            self._resubmits.resubmit(token, action)
        elif isinstance(action, Fail):
            fail(token, action.error)
        elif isinstance(token, list):
            deliver(token, action, submit=self.submit, max_bytes=self.config.max_message_bytes)
        elif not token.done():
            token.set_result(action.msg.header)

    async def _hello(self) -> None:
        assert self._sock is not None
        await self.control(self._session.hello().frames)

    async def control(self, frames: list[Any]) -> None:
        """A HELLO or heartbeat: repeated anyway, so to a broker pair it is only tried."""
        assert self._sock is not None
        if len(self._socks) > 1:
            transport.try_send(self._sock, frames)
        else:
            await transport.send(self._sock, frames)

    def _greet(self, ch: transport.Dealer) -> None:
        """A connection to a broker was made (again): a heartbeat there at once, if it
        is the broker followed (a standby must not hear from clients); made again, what
        is in flight is sent again (ClientSession, rule 10)."""
        if ch is self._sock and not self._closed:
            transport.try_send(ch, encode(Route(MsgType.HEARTBEAT), Heartbeat().to_wire()))
            if ch.handshakes is not None and ch.handshakes.connected > 1:
                self._apply(self._session.relinked(None, self._now()))

    async def _heartbeat_loop(self) -> None:
        assert self._sock is not None
        interval = self.config.heartbeat.interval
        while True:
            await asyncio.sleep(interval)
            await self.control(encode(Route(MsgType.HEARTBEAT), Heartbeat().to_wire()))
            self._shm.housekeeping()
            if self._links:
                self._links.beats()
            # Also a tick: deadlines are checked at least this often.
            self._timer.due(self._now())
            self._flush()

    def _follow_routers(self, cmap: ClusterMap) -> None:
        """Connect to the routing brokers the map lists (and drop those it no longer does)."""
        if self._tg is None or self._ctx is None:
            return
        self._tasks += self._links.follow(
            cmap,
            ctx=self._ctx,
            tg=self._tg,
            brokers=dict(zip(self.addresses, self._socks, strict=True)),
            on_reply=self._on_router_reply,
            on_malformed=self._on_malformed,
        )

    async def _on_router_reply(self, bufs: list[Any], msg: Message) -> None:
        if shm.KEY in msg.header:
            msg = self._shm.reply(bufs, msg)
        await self.dispatch(msg)

    def _use_broker(self, index: int) -> None:
        """Send to broker ``index`` of the pair from now on."""
        self._sock = self._socks[index]
        self._session.switched()

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
        if self._pair is not None or self._links:
            return False
        bufs = [transport.frame_buffer(f) for f in frames]
        msg = decode(bufs)
        if msg.route.mtype not in REPLIES:
            return False  # a map, a heartbeat: decoded again there (they are few)
        if shm.KEY in msg.header:
            msg = self._shm.reply(bufs, msg)
        self._on_answer(msg)
        self._apply(self._session.on_reply(msg, self._now()))
        return True

    def _on_answer(self, msg: Message) -> None:
        if self._shm.requests and "noshm" in msg.header:
            self._shm.refusal(msg)
        self._links.answered(msg)

    async def _on_message(self, index: int, frames: transport.Frames) -> None:
        bufs = [transport.frame_buffer(f) for f in frames]
        msg = decode(bufs)
        if shm.KEY in msg.header:
            msg = self._shm.reply(bufs, msg)
        if self._links:
            self._links.heard_broker(self.addresses[index])  # a router as broker
        if self._pair is not None and not self._pair.heard(index, msg):
            return
        self._passive = msg.header.get("passive") is True  # a standby of a pair, alone
        await self.dispatch(msg)

    def _on_malformed(self, frames: transport.Frames, err: ProtocolError) -> None:
        if isinstance(err, VersionMismatchError):
            if self._mismatch is None:
                log.error("the broker at %s: %s", self.address, err)
            self._mismatch = err
            self._map_event.set()  # an introduction waiting for a map fails at once
            return
        log.warning("dropped a malformed message from the broker: %s", err)

    async def dispatch(self, msg: Message) -> None:
        """Handle a message from the broker (a reply, a map, ...), as received."""
        if msg.route.mtype in REPLIES:
            self._on_answer(msg)
            self._apply(self._session.on_reply(msg, self._now()))
            return
        match from_broker(msg.route.mtype, msg.header):
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
                    self._resubmits.new_map()
                if self._session.map is not None:
                    self._map_event.set()
                    self._follow_routers(self._session.map)
            case HelloAgain():  # the broker restarted and does not know us
                await self._hello()
            case Heartbeat(relinked=partitions):
                self._apply(self._session.relinked(partitions, self._now()))
            case None:
                raise ProtocolError(f"a client does not expect {msg.route.mtype.name}")
            case unknown:
                assert_never(unknown)

    def _log_lost(self, old: ClusterMap, new: ClusterMap) -> None:
        """Say when a partition loses its last live copy (its calls wait: ClientSession,
        rule 5) and when it is served again."""
        for line in lost_changes(old, new, self.config.timeout):
            log.warning("%s", line)
