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
import os
import socket
import uuid
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar, assert_never

import numpy as np
import zmq.asyncio

from zps import transport
from zps.client.session import (
    Action,
    BrokerChoice,
    ClientSession,
    ClientStats,
    Deliver,
    Fail,
    Send,
)
from zps.core.batching import merge_row_ops, plan_batches
from zps.core.routing import (
    ClusterMap,
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
from zps.ops.config import ClientConfig, broker_endpoints
from zps.ops.security import load_curve_keys
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
    #: The operation's cost: the larger of its request and its reply payload (read
    #: several times per request, so computed once).
    nbytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        size = 0
        for a in self.arrays.values():
            size += a.nbytes
        self.nbytes = max(size, self.reply_bytes)


#: What the session hands back for a request: its operations, or a broker call's future.
_Token = list[_Op] | asyncio.Future[dict[str, Any]]


class Connection:
    """Lifecycle, request machinery and background pushes of a client (see the module notes)."""

    def __init__(self, address: str | Sequence[str], config: ClientConfig | None = None) -> None:
        self.addresses = broker_endpoints(address, "the broker address")
        self.address = self.addresses[0]
        self.config = config or ClientConfig()
        self.client_id = f"c-{uuid.uuid4().hex[:16]}".encode()
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
        self._sock: transport.Channel | None = None  # the current broker's
        self._socks: list[transport.Channel] = []
        self._choice: BrokerChoice | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._queue: dict[int, list[_Op]] = collections.defaultdict(list)
        self._wake = asyncio.Event()
        # At the session's next wake-up, ``_timer_at``.  A plain Handle when that time had
        # passed (uvloop's call_at then schedules a call_soon, which has no when()).
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        self._tick_at: float | None = None  # set when the session is due a tick
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran in
        self._closed = False
        self._started = False
        self._background: set[asyncio.Task[Any]] = set()
        self._bg_error: BaseException | None = None
        self._mismatch: VersionMismatchError | None = None  # a broker of another version

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
        self._ctx = transport.new_context()
        keys = load_curve_keys(self.config.security)
        self._socks = [
            transport.dealer(
                self._ctx,
                address,
                self.client_id,
                max_message_bytes=self.config.max_message_bytes,
                curve=keys,
                server_public=keys.server_public if keys else None,
            )
            for address in self.addresses
        ]
        self._sock = self._socks[0]
        self._choice = BrokerChoice(
            len(self._socks),
            silence=self.config.failover_timeout,
            retry=self.config.failover_timeout / 10,
            now=self._now(),
        )
        tg = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._tasks = [
            *(tg.create_task(self._recv_loop(i)) for i in range(len(self._socks))),
            tg.create_task(self._flush_loop()),
            tg.create_task(self._heartbeat_loop()),
        ]
        if len(self._socks) > 1:
            self._tasks.append(tg.create_task(self._pair_loop()))
        try:
            # The introduction is bounded too: a paused broker may not take it.
            await asyncio.wait_for(self._introduce(), self.config.connect_timeout)
        except TimeoutError:
            await self.close()
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
                await asyncio.wait_for(
                    transport.send(self._sock, encode(Route(MsgType.BYE), Bye().to_wire())), 1.0
                )
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
        for sock in self._socks:
            transport.close(sock)
        if self._ctx is not None:
            transport.term(self._ctx)

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
            await asyncio.wait(self._background, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.get_running_loop().create_task(self._gather(futures))
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None and self._bg_error is None:
            self._bg_error = task.exception()

    def _raise_background(self) -> None:
        """An error of a background push is raised by the next call, once."""
        err, self._bg_error = self._bg_error, None
        if err is not None:
            raise err

    async def flush(self) -> None:
        """Wait for every background push; raise the first error among them."""
        while self._background:
            await asyncio.wait(set(self._background))
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
            await self._apply(actions)
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
    ) -> asyncio.Future[dict[str, Any]]:
        if self._closed:
            raise ClosedError("the client was closed")
        op = _Op(
            body, arrays, (self._loop or asyncio.get_running_loop()).create_future(), reply_bytes
        )
        # Calls are cut to the message budget; what still cannot fit would be cut off
        # by a socket's MAXMSGSIZE (a disconnect, then a timeout): refuse it here.
        if op.nbytes > self.config.max_message_bytes // 2:
            raise BadRequestError(
                f"{body.get('op')} on {body.get('t')!r} needs a message of {op.nbytes} bytes; "
                f"the limit is half of client.max_message_bytes ({self.config.max_message_bytes})"
            )
        fut = op.future
        self._queue[partition].append(op)
        if not self._wake.is_set():
            self._wake.set()
        return fut

    async def _gather(self, futures: Iterable[Awaitable[T]]) -> list[T]:
        tasks = list(futures)
        if len(tasks) == 1:  # the common small call: no gather machinery
            return [await tasks[0]]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:  # don't leave "exception never retrieved" behind
                if isinstance(t, asyncio.Future) and t.done() and not t.cancelled():
                    t.exception()
            raise

    def _now(self) -> float:
        return (self._loop or asyncio.get_running_loop()).time()

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._tick_at is not None:
                # The timer may fire a hair early: the session is told the time it asked for.
                now = max(self._now(), self._tick_at)
                self._tick_at = None
                await self._apply(self._session.tick(now))
            queued, self._queue = self._queue, collections.defaultdict(list)
            max_bytes = min(self.config.batch_max_bytes, self.config.message_budget)
            for partition, queued_ops in queued.items():
                ops = self._merge(queued_ops)
                sizes = [op.nbytes for op in ops]
                for a, b in plan_batches(sizes, self.config.batch_max_ops, max_bytes):
                    await self._send_request(partition, ops[a:b])

    def _merge(self, ops: list[_Op]) -> list[_Op]:
        """Row operations on one table become one operation (see batching.merge_row_ops)."""
        if len(ops) < 2:
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
            out.append(_Op(m.body, m.arrays, fut, reply))
        return out

    async def _send_request(self, partition: int, ops: list[_Op]) -> None:
        enc = Encoder(self._policy)
        bodies = []
        for op in ops:
            body = dict(op.body)
            for key, arr in op.arrays.items():
                body[key] = enc.array(arr)
            bodies.append(body)
        await self._apply(self._session.submit(partition, bodies, enc, ops, self._now()))

    async def _apply(self, actions: list[Action[_Token]]) -> None:
        """Carry out what the session asked for, then set the timer for its next tick."""
        for action in actions:
            if isinstance(action, Send):
                await self._transmit(action)
            else:
                self._resolve(action)
        self._schedule()

    async def _transmit(self, send: Send) -> None:
        assert self._sock is not None
        if len(self._socks) > 1:
            # Never wait on one broker of a pair: it may be the one that died.
            if not transport.try_send(self._sock, send.frames):
                self._session.unsent(send.req_id, self._now())
            return
        try:
            await transport.send(self._sock, send.frames)
        except (ClosedError, BrokenError) as e:
            err = e if isinstance(e, ClosedError) else ClosedError(str(e))
            for action in self._session.abandon(send.req_id, err):
                self._resolve(action)

    def _resolve(self, action: Deliver[_Token] | Fail[_Token]) -> None:
        token = action.token
        if isinstance(action, Fail):
            if isinstance(token, list):
                for op in token:
                    if not op.future.done():
                        op.future.set_exception(action.error)
            elif not token.done():
                token.set_exception(action.error)
        elif isinstance(token, list):
            self._deliver(token, action.msg)
        elif not token.done():
            token.set_result(action.msg.header)

    def _deliver(self, ops: list[_Op], msg: Message) -> None:
        results = msg.header.get("res")
        if not isinstance(results, list) or len(results) != len(ops):
            err = ProtocolError("reply does not match the request's operations")
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(err)
            return
        for op, res in zip(ops, results, strict=True):
            if op.future.done():
                continue
            try:
                op.future.set_result(self._result(res, msg))
            except (ProtocolError, RemoteError) as e:
                op.future.set_exception(e)

    def _schedule(self) -> None:
        """Have the flush loop tick the session at its next wake-up (if sooner than planned)."""
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
        self._wake.set()

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
            # Also a tick: deadlines are checked at least this often.
            now = self._now()
            self._tick_at = now if self._tick_at is None else min(self._tick_at, now)
            self._wake.set()

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
            self._socks[index], functools.partial(self._on_message, index), self._on_malformed
        )

    async def _on_message(self, index: int, frames: transport.Frames) -> None:
        msg = decode([transport.frame_buffer(f) for f in frames])
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
            await self._apply(self._session.on_reply(msg, self._now()))
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
                await self._apply(self._session.on_map(new, self._now()))
                if self._session.map is not None:
                    self._map_event.set()
            case HelloAgain():  # the broker restarted and does not know us
                await self._hello()
            case Heartbeat():
                pass
            case None:
                raise ProtocolError(f"a client does not expect {msg.route.mtype.name}")
            case unknown:
                assert_never(unknown)

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
