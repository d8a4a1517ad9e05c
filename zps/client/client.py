"""The worker-side client: ``zps.connect`` (async) and ``zps.connect_sync``.

One DEALER socket to the broker carries every request, so many requests are
in flight at once.  Each call is split by partition (ids by slot, dense
tensors by chunk); the operations for one partition queued in the same loop
turn are coalesced into one message (see :mod:`zps.core.batching`).  Every message
carries ``(client_id, seq)``: a message re-sent after a map change is applied
once.  Calls fail with a clear error rather than hang: ``ShardUnavailableError``
when a partition has no live shard, ``ZpsTimeoutError`` past the deadline.

Every request's lifecycle (matching replies, retries, re-sends, deadlines) is decided
by :class:`~zps.client.session.ClientSession`; this module only carries out what it
returns: it sends the frames, resolves the futures and ticks it when it asks.
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
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import zmq.asyncio

from zps import transport
from zps.client.session import Action, ClientSession, ClientStats, Deliver, Fail, Send
from zps.client.training import TrainingCalls
from zps.core.batching import merge_row_ops, plan_batches
from zps.core.hashing import name_hash
from zps.core.memo import IdsMemo
from zps.core.routing import (
    ClusterMap,
    chunk_partition,
    dense_chunk_elems,
    split_by_partition,
)
from zps.core.rows import put_rows, take_rows
from zps.errors import (
    BrokenError,
    ClosedError,
    ProtocolError,
    RemoteError,
    ShapeMismatchError,
    TableConflictError,
    UnknownTableError,
    ZpsTimeoutError,
    remote_error,
)
from zps.init import Initializer, Zeros
from zps.ops.config import ClientConfig
from zps.ops.security import load_curve_keys
from zps.optim import SGD, Optimizer
from zps.protocol.codec import (
    NO_COMPRESSION,
    TRAFFIC,
    Encoder,
    Message,
    MsgType,
    Route,
    array_from,
    decode,
    encode,
)
from zps.protocol.specs import DenseSpec, EmbeddingSpec, spec_from_wire

log = logging.getLogger("zps.client")

T = TypeVar("T")


@dataclass(slots=True)
class _Op:
    body: dict[str, Any]
    arrays: dict[str, np.ndarray]
    future: asyncio.Future[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


#: What the session hands back for a request: its operations, or a broker call's future.
_Token = list[_Op] | asyncio.Future[dict[str, Any]]


class Client(TrainingCalls):
    """An asyncio client; use ``async with zps.connect(address) as ps``.

    The training coordination (clock, data tasks, progress) comes from
    :class:`~zps.client.training.TrainingCalls`; this class is the key-value API and the
    driver of the request machinery (:class:`~zps.client.session.ClientSession`).
    """

    def __init__(self, address: str, config: ClientConfig | None = None) -> None:
        self.address = address
        self.config = config or ClientConfig()
        self.client_id = f"c-{uuid.uuid4().hex[:16]}".encode()
        self._session: ClientSession[_Token] = ClientSession(
            self.client_id,
            timeout=self.config.timeout,
            max_backoff=self.config.heartbeat.interval,
            hello={"host": socket.gethostname(), "pid": os.getpid(), "name": self.config.name},
            acks=1 if self.config.acks == 1 else None,
        )
        self.stats: ClientStats = self._session.stats
        self._policy = TRAFFIC if self.config.compress else NO_COMPRESSION
        self._map_event = asyncio.Event()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: transport.Channel | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._queue: dict[int, list[_Op]] = collections.defaultdict(list)
        self._wake = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None  # at the session's next wake-up
        self._tick_at: float | None = None  # set when the session is due a tick
        self._specs: dict[str, DenseSpec | EmbeddingSpec] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran in
        self._split_memo: IdsMemo[list[tuple[int, npt.NDArray[np.intp]]]] = IdsMemo(size=4)
        self._closed = False
        self._started = False
        self._init_training()
        self._background: set[asyncio.Task[Any]] = set()
        self._bg_error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------

    async def __aenter__(self) -> Client:
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
        self._sock = transport.dealer(
            self._ctx,
            self.address,
            self.client_id,
            max_message_bytes=self.config.max_message_bytes,
            curve=keys,
            server_public=keys.server_public if keys else None,
        )
        tg = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._tasks = [
            tg.create_task(self._recv_loop()),
            tg.create_task(self._flush_loop()),
            tg.create_task(self._heartbeat_loop()),
        ]
        await self._hello()
        try:
            await asyncio.wait_for(self._map_event.wait(), self.config.connect_timeout)
        except TimeoutError:
            await self.close()
            raise ZpsTimeoutError(
                f"no answer from the broker at {self.address} within "
                f"{self.config.connect_timeout:g}s (is `zps-server broker` running there?)"
            ) from None
        if self.config.mode != "async":
            reply = await self._broker_call(MsgType.CLOCK, self._clock_header("join"))
            self._step = int(reply["step"])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sock is not None and not self._sock.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    transport.send(self._sock, encode(Route(MsgType.BYE), {})), 1.0
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
        if self._sock is not None:
            transport.close(self._sock)
        if self._ctx is not None:
            transport.term(self._ctx)

    @property
    def cluster_map(self) -> ClusterMap:
        cmap = self._session.map
        if cmap is None:
            raise ClosedError("the client is not connected")
        return cmap

    # -- tables --------------------------------------------------------------

    async def create_dense(
        self,
        name: str,
        shape: int | Sequence[int],
        dtype: str = "float32",
        *,
        init: Initializer | None = None,
        optimizer: Optimizer | None = None,
        seed: int | None = None,
    ) -> None:
        """Create a dense tensor on the servers (idempotent for an identical spec)."""
        shape_t = (
            (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(d) for d in shape)
        )
        size = int(np.prod(shape_t, dtype=np.int64))
        chunk = dense_chunk_elems(size, np.dtype(dtype).itemsize, self.cluster_map.n_partitions)
        spec = DenseSpec(
            name=name,
            shape=shape_t,
            dtype=str(dtype),
            init=init or Zeros(),
            optimizer=optimizer or SGD(),
            seed=_seed(name, seed),
            chunk_elems=chunk,
        )
        await self._create(spec)

    async def create_embedding(
        self,
        name: str,
        dim: int,
        dtype: str = "float32",
        *,
        init: Initializer | None = None,
        optimizer: Optimizer | None = None,
        seed: int | None = None,
    ) -> None:
        """Create an embedding table ``id -> row[dim]`` (idempotent for an identical spec)."""
        spec = EmbeddingSpec(
            name=name,
            dim=int(dim),
            dtype=str(dtype),
            init=init or Zeros(),
            optimizer=optimizer or SGD(),
            seed=_seed(name, seed),
        )
        await self._create(spec)

    async def _create(self, spec: DenseSpec | EmbeddingSpec) -> None:
        wire = spec.to_wire()
        # Every partition keeps every spec: embedding rows live everywhere and
        # any partition can describe any table to a client that did not create it.
        results = await self._gather(
            self._submit(p, {"op": "create", "spec": wire}, {})
            for p in range(self.cluster_map.n_partitions)
        )
        del results
        self._specs[spec.name] = spec

    async def _spec(self, name: str) -> DenseSpec | EmbeddingSpec:
        spec = self._specs.get(name)
        if spec is None:
            partition = int(self.cluster_map.slot_map[name_hash(name) % self.cluster_map.n_slots])
            result = await self._submit(partition, {"op": "tables"}, {})
            for wire in result["tables"]:
                s = spec_from_wire(wire)
                self._specs.setdefault(s.name, s)
            spec = self._specs.get(name)
            if spec is None:
                raise UnknownTableError(f"unknown table {name!r}")
        return spec

    async def _dense_spec(self, name: str) -> DenseSpec:
        spec = await self._spec(name)
        if not isinstance(spec, DenseSpec):
            raise TableConflictError(f"table {name!r} is an embedding table, not a dense tensor")
        return spec

    async def _embedding_spec(self, name: str) -> EmbeddingSpec:
        spec = await self._spec(name)
        if not isinstance(spec, EmbeddingSpec):
            raise TableConflictError(f"table {name!r} is a dense tensor, not an embedding table")
        return spec

    # -- dense ---------------------------------------------------------------

    async def pull_dense(self, name: str, *, out: np.ndarray | None = None) -> np.ndarray:
        """The current value of a dense tensor: a fresh array, or written into ``out``
        (C-contiguous, writable, of the tensor's shape and dtype) and returned.

        ``out`` saves a large tensor's allocation on every pull (the model's own
        parameter buffer, say): a fresh 16 MiB array costs 4096 page faults.
        """
        spec = await self._dense_spec(name)
        if out is not None:
            if (
                not isinstance(out, np.ndarray)
                or out.shape != spec.shape
                or out.dtype != np.dtype(spec.dtype)
                or not out.flags.c_contiguous
                or not out.flags.writeable
            ):
                raise ShapeMismatchError(
                    f"out= for {name!r} must be a writable C-contiguous array of shape "
                    f"{spec.shape} and dtype {spec.dtype}"
                )
            flat = out.reshape(-1)
        else:
            flat = np.empty(spec.size, dtype=spec.dtype)
        by_part: dict[int, list[int]] = collections.defaultdict(list)
        for c in range(spec.n_chunks):
            by_part[chunk_partition(name, c, self.cluster_map)].append(c)
        futures = [
            self._submit(p, {"op": "pull_dense", "t": name, "chunks": chunks}, {})
            for p, chunks in by_part.items()
        ]
        for chunks, result in zip(by_part.values(), await self._gather(futures), strict=True):
            for c, arr in zip(chunks, result["arrays"], strict=True):
                start, stop = spec.chunk_range(c)
                if arr.shape != (stop - start,):
                    raise ProtocolError(f"chunk {c} of {name!r} came back with shape {arr.shape}")
                flat[start:stop] = arr
        return out if out is not None else flat.reshape(spec.shape)

    async def push_dense(self, name: str, grad: npt.ArrayLike, *, wait: bool = True) -> None:
        """Send a gradient; returns once every partition acknowledged its part.

        With ``wait=False`` it returns once the push is on its way (at most
        ``max_background`` are in flight); an error surfaces at a later call.
        """
        self._raise_background()
        spec = await self._dense_spec(name)
        g = _as_float(grad, spec.dtype, f"gradient for {name!r}")
        if g.shape != spec.shape:
            raise ShapeMismatchError(
                f"gradient for {name!r} has shape {g.shape}; the tensor has shape {spec.shape}"
            )
        flat = _owned(g.reshape(-1), grad, wait)
        futures = []
        for c in range(spec.n_chunks):
            start, stop = spec.chunk_range(c)
            futures.append(
                self._submit(
                    chunk_partition(name, c, self.cluster_map),
                    self._tagged({"op": "push_dense", "t": name, "chunk": c}),
                    {"g": flat[start:stop]},
                )
            )
        await self._finish(futures, wait)

    # -- embeddings ----------------------------------------------------------

    async def pull_rows(self, name: str, ids: npt.ArrayLike) -> np.ndarray:
        """Rows for ``ids``, shape ``(len(ids), dim)``, in the order of ``ids``.

        Duplicate ids are allowed and each is fetched: a batch that repeats ids
        heavily should pull ``np.unique(ids)`` and expand the result with the
        inverse (the client does not sort every batch to find out).
        """
        self._raise_background()
        spec = self._specs.get(name)
        if not isinstance(spec, EmbeddingSpec):
            spec = await self._embedding_spec(name)
        id_arr = _as_ids(ids)
        parts = self._split(id_arr)
        if len(parts) == 1:  # one partition owns every id: no gather, no scatter
            arr = (
                await self._submit(parts[0][0], {"op": "pull_rows", "t": name}, {"ids": id_arr})
            )["arrays"]
            if arr.shape != (id_arr.size, spec.dim):
                raise ProtocolError(f"pull_rows of {name!r} came back with shape {arr.shape}")
            return np.array(arr)  # writable, and not pinning the received frame
        rows = np.empty((id_arr.size, spec.dim), dtype=spec.dtype)
        results = await self._gather(
            self._submit(p, {"op": "pull_rows", "t": name}, {"ids": id_arr[pos]})
            for p, pos in parts
        )
        for (_, pos), result in zip(parts, results, strict=True):
            arr = result["arrays"]
            if arr.shape != (pos.size, spec.dim):
                raise ProtocolError(f"pull_rows of {name!r} came back with shape {arr.shape}")
            put_rows(rows, pos, arr)
        return rows

    async def push_rows(
        self, name: str, ids: npt.ArrayLike, grads: npt.ArrayLike, *, wait: bool = True
    ) -> None:
        """Send row gradients; duplicate ids' gradients are summed by the shard.

        ``wait=False``: as for :meth:`push_dense`.
        """
        self._raise_background()
        spec = self._specs.get(name)
        if not isinstance(spec, EmbeddingSpec):
            spec = await self._embedding_spec(name)
        id_arr = _as_ids(ids)
        g = _as_float(grads, spec.dtype, f"gradients for {name!r}")
        if g.shape != (id_arr.size, spec.dim):
            raise ShapeMismatchError(
                f"gradients for {name!r} have shape {g.shape}; expected "
                f"({id_arr.size}, {spec.dim}) for {id_arr.size} ids of dim {spec.dim}"
            )
        parts = self._split(id_arr)
        if len(parts) == 1:  # one partition owns every id: send the arrays as they are
            arrays = {"ids": _owned(id_arr, ids, wait), "g": _owned(g, grads, wait)}
            futures = [
                self._submit(parts[0][0], self._tagged({"op": "push_rows", "t": name}), arrays)
            ]
        else:
            futures = [
                self._submit(
                    p,
                    self._tagged({"op": "push_rows", "t": name}),
                    {"ids": id_arr[pos], "g": take_rows(g, pos)},
                )
                for p, pos in parts
            ]
        await self._finish(futures, wait)

    def _split(self, ids: npt.NDArray[np.int64]) -> list[tuple[int, npt.NDArray[np.intp]]]:
        """split_by_partition, remembering the last answers: a training step pulls
        a batch's rows and then pushes gradients for the same ids."""
        cmap = self.cluster_map
        parts = self._split_memo.get(ids, cmap)
        if parts is None:
            parts = split_by_partition(ids, cmap)
            self._split_memo.put(ids, parts, cmap)
        return parts

    # -- overlap ---------------------------------------------------------------

    def prefetch_rows(self, name: str, ids: npt.ArrayLike) -> asyncio.Task[np.ndarray]:
        """Start pulling rows now; await the task when they are needed.

        The ids are copied first: the caller may reuse its buffer at once.
        """
        own = np.array(ids, copy=True)
        return asyncio.get_running_loop().create_task(self.pull_rows(name, own))

    def prefetch_dense(self, name: str) -> asyncio.Task[np.ndarray]:
        """Start pulling a dense tensor now; await the task when it is needed."""
        return asyncio.get_running_loop().create_task(self.pull_dense(name))

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

    # -- introspection -------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """The broker's status report (as ``zps-server status --json`` prints it)."""
        return await self._broker_call(MsgType.STATUS, {})

    async def checksums(self) -> dict[int, dict[str, Any]]:
        """Per partition: checksum of all its tables and its LSN."""
        n = self.cluster_map.n_partitions
        results = await self._gather(self._submit(p, {"op": "checksum"}, {}) for p in range(n))
        return {p: {"checksum": r["checksum"], "lsn": r["lsn"]} for p, r in enumerate(results)}

    # -- request machinery ---------------------------------------------------

    def _submit(
        self, partition: int, body: dict[str, Any], arrays: dict[str, np.ndarray]
    ) -> asyncio.Future[dict[str, Any]]:
        if self._closed:
            raise ClosedError("the client was closed")
        fut: asyncio.Future[dict[str, Any]] = (
            self._loop or asyncio.get_running_loop()
        ).create_future()
        self._queue[partition].append(_Op(body, arrays, fut))
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
            for partition, queued_ops in queued.items():
                ops = self._merge(queued_ops)
                sizes = [op.nbytes for op in ops]
                for a, b in plan_batches(
                    sizes, self.config.batch_max_ops, self.config.batch_max_bytes
                ):
                    await self._send_request(partition, ops[a:b])

    def _merge(self, ops: list[_Op]) -> list[_Op]:
        """Row operations on one table become one operation (see batching.merge_row_ops)."""
        if len(ops) < 2:
            return ops
        out = []
        loop = asyncio.get_running_loop()
        for m in merge_row_ops([(op.body, op.arrays) for op in ops], self.config.batch_max_ops):
            if len(m.parts) == 1:
                out.append(ops[m.parts[0][0]])
                continue
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            members = [(ops[i].future, a, b) for i, a, b in m.parts]
            fut.add_done_callback(functools.partial(_split_result, members=members))
            out.append(_Op(m.body, m.arrays, fut))
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
        if at is None or (self._timer is not None and self._timer.when() <= at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = (self._loop or asyncio.get_running_loop()).call_at(at, self._on_timer, at)

    def _on_timer(self, at: float) -> None:
        self._timer = None
        self._tick_at = at if self._tick_at is None else min(self._tick_at, at)
        self._wake.set()

    async def _hello(self) -> None:
        assert self._sock is not None
        await transport.send(self._sock, self._session.hello().frames)

    async def _heartbeat_loop(self) -> None:
        assert self._sock is not None
        interval = self.config.heartbeat.interval
        while True:
            await asyncio.sleep(interval)
            await transport.send(self._sock, encode(Route(MsgType.HEARTBEAT), {}))
            # Also a tick: deadlines are checked at least this often.
            now = self._now()
            self._tick_at = now if self._tick_at is None else min(self._tick_at, now)
            self._wake.set()

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        await transport.serve(self._sock, self._on_message, self._on_malformed)

    async def _on_message(self, frames: transport.Frames) -> None:
        await self._dispatch(decode([transport.frame_buffer(f) for f in frames]))

    def _on_malformed(self, frames: transport.Frames, err: ProtocolError) -> None:
        log.warning("dropped a malformed message from the broker: %s", err)

    async def _dispatch(self, msg: Message) -> None:
        match msg.route.mtype:
            case MsgType.REPLY | MsgType.STATUS | MsgType.CLOCK | MsgType.TASK:
                await self._apply(self._session.on_reply(msg, self._now()))
            case MsgType.MAP:
                new = ClusterMap.from_wire(msg.header.get("map"))
                old = self._session.map
                if old is not None and new.incarnation != old.incarnation:
                    log.info(
                        "the broker restarted; re-sending %d unanswered requests",
                        len(self._session),
                    )
                await self._apply(self._session.on_map(new, self._now()))
                if self._session.map is not None:
                    self._map_event.set()
            case MsgType.HELLO:  # the broker restarted and does not know us
                await self._hello()
            case MsgType.HEARTBEAT:
                pass
            case _:
                raise ProtocolError(f"a client does not expect {msg.route.mtype.name}")

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


def _seed(name: str, seed: int | None) -> int:
    return name_hash(name) if seed is None else int(seed)


def _as_ids(ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
        return np.ascontiguousarray(ids)  # the common case, in a few checks
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ShapeMismatchError(f"ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ShapeMismatchError(f"ids must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _owned(arr: np.ndarray, given: object, wait: bool) -> np.ndarray:
    """``arr``, copied if it may be the caller's memory and the call returns before
    the message is sent (``wait=False``): the caller may reuse its buffer at once."""
    if wait or isinstance(given, list | tuple | int | float):
        return arr  # waited for, or built from Python values: nobody else holds it
    try:
        src = np.asarray(given)  # a view for numpy arrays and CPU tensors
    except Exception:
        return arr.copy()
    return arr.copy() if np.may_share_memory(arr, src) else arr


def _as_float(values: npt.ArrayLike, dtype: str, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "fiu":
        raise ShapeMismatchError(f"{what} must be numeric, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


def connect(address: str, config: ClientConfig | None = None, **options: Any) -> Client:
    """An async client; use as ``async with zps.connect(address) as ps``.

    ``options`` are :class:`~zps.ops.config.ClientConfig` fields (``timeout=5.0``).
    """
    if options:
        config = ClientConfig(**{**vars(config or ClientConfig()), **options})
    return Client(address, config)
