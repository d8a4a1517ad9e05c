"""The worker-side client: ``zps.connect`` (async) and ``zps.connect_sync``.

One DEALER socket to the broker carries every request, so many requests are
in flight at once.  Each call is split by partition (ids by slot, dense
tensors by chunk); the operations for one partition queued in the same loop
turn are coalesced into one message (see :mod:`zps.core.batching`).  Every message
carries ``(client_id, seq)``: a message re-sent after a map change is applied
once.  Calls fail with a clear error rather than hang: ``ShardUnavailableError``
when a partition has no live shard, ``ZpsTimeoutError`` past the deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import zmq.asyncio

from zps import transport
from zps.client.progress import Progress
from zps.core.batching import merge_row_ops, plan_batches
from zps.core.coord import Task
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
    JobFailedError,
    ProtocolError,
    RemoteError,
    ShapeMismatchError,
    ShardUnavailableError,
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
#: Retries of one message across map changes before the caller sees an error.
MAX_ATTEMPTS = 1000
_RETRY_CODES = frozenset({"NOT_PRIMARY", "STALE_EPOCH"})


@dataclass(slots=True)
class _Op:
    body: dict[str, Any]
    arrays: dict[str, np.ndarray]
    future: asyncio.Future[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


@dataclass
class _Request:
    req_id: int
    partition: int
    ops: list[_Op]
    body: list[Any]  # header and payload frames, re-sent unchanged on retry
    epoch: int
    deadline: float
    attempts: int = 1
    parked: bool = False  # waiting to be re-sent (a newer map, or a short backoff)

    def fail(self, exc: BaseException) -> None:
        for op in self.ops:
            if not op.future.done():
                op.future.set_exception(exc)


@dataclass
class ClientStats:
    requests: int = 0
    ops: int = 0
    retries: int = 0
    by_partition: collections.Counter[int] = field(default_factory=collections.Counter)


class Client:
    """An asyncio client; use ``async with zps.connect(address) as ps``."""

    def __init__(self, address: str, config: ClientConfig | None = None) -> None:
        self.address = address
        self.config = config or ClientConfig()
        self.client_id = f"c-{uuid.uuid4().hex[:16]}".encode()
        self.stats = ClientStats()
        self._policy = TRAFFIC if self.config.compress else NO_COMPRESSION
        self._map: ClusterMap | None = None
        self._map_event = asyncio.Event()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: transport.Channel | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[int, _Request] = {}
        self._queue: dict[int, list[_Op]] = collections.defaultdict(list)
        self._due: list[int] = []  # parked requests whose backoff ran out
        self._wake = asyncio.Event()
        self._req_ids = itertools.count(1)
        self._seqs = itertools.count(1)
        self._specs: dict[str, DenseSpec | EmbeddingSpec] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran in
        self._split_memo: IdsMemo[list[tuple[int, npt.NDArray[np.intp]]]] = IdsMemo(size=4)
        self._status_waiters: collections.deque[asyncio.Future[dict[str, Any]]] = (
            collections.deque()
        )
        self._closed = False
        self._started = False
        self._step = 0
        #: Set when the worker is asked to stop (zps-worker's SIGTERM): finish
        #: the step, flush, release the task, return.
        self.stop_requested = False
        self.progress = Progress(name=self.config.name, enabled=False)
        self._background: set[asyncio.Task[Any]] = set()
        self._bg_error: BaseException | None = None
        self._broker_calls: dict[
            int, tuple[asyncio.Future[dict[str, Any]], MsgType, dict[str, Any]]
        ] = {}

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
        err = ClosedError("the client was closed")
        for req in self._pending.values():
            req.fail(err)
        self._pending.clear()
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
        if self._map is None:
            raise ClosedError("the client is not connected")
        return self._map

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

    # -- training modes ----------------------------------------------------------

    @property
    def step(self) -> int:
        """The step this worker is in (sync and ssp: as the broker counts)."""
        return self._step

    def report(self, *, rows: float = 0, loss: float | None = None, **extra: float) -> None:
        """Per-step metrics for the progress display (zps-worker shows them)."""
        self.progress.report(rows=rows, loss=loss, **extra)

    def _tagged(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.config.mode == "sync":
            body["step"] = self._step  # buffered by the shards until the step commits
        return body

    def _clock_header(self, op: str) -> dict[str, Any]:
        return {"op": op, "mode": self.config.mode, "tau": self.config.staleness}

    async def clock(self) -> int:
        """Finish the current step and wait until the mode lets the next one start.

        sync: returns once every live worker finished the step and its averaged
        gradients were applied; ssp: once no worker is more than ``staleness``
        steps behind; async: at once.  Background pushes are flushed first.
        """
        await self.flush()
        if self.config.mode == "async":
            self._step += 1
            return self._step
        header = self._clock_header("tick")
        header["finished"] = self._step + 1
        reply = await self._broker_call(MsgType.CLOCK, header, forever=True)
        self._step = int(reply["step"])
        return self._step

    # -- data tasks --------------------------------------------------------------

    async def create_job(
        self,
        job: str,
        n_records: int,
        per_task: int,
        *,
        epochs: int = 1,
        max_retries: int = 3,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Declare a data set of ``n_records`` cut into tasks (idempotent for the same
        settings); returns its progress."""
        reply = await self._broker_call(
            MsgType.TASK,
            {
                "op": "create",
                "job": job,
                "n_records": n_records,
                "per_task": per_task,
                "epochs": epochs,
                "max_retries": max_retries,
                "seed": seed,
            },
        )
        return dict(reply["progress"])

    async def next_task(self, job: str) -> Task | None:
        """The next task of ``job``; None when every task of every epoch is done.

        When none is free but others still hold some (one may come back if its
        worker dies), this waits; in sync and ssp mode the worker leaves the
        step clock meanwhile, so the others are not held up, and joins again
        with its next task.
        """
        reply = await self._broker_call(MsgType.TASK, {"op": "next", "job": job, "wait": False})
        if reply.get("pending"):
            if self.config.mode != "async":
                await self._broker_call(MsgType.CLOCK, self._clock_header("leave"))
            reply = await self._broker_call(MsgType.TASK, {"op": "next", "job": job}, forever=True)
            if self.config.mode != "async" and reply.get("task") is not None:
                joined = await self._broker_call(MsgType.CLOCK, self._clock_header("join"))
                self._step = int(joined["step"])
        t = reply.get("task")
        if t is None:
            return None
        return Task(t["job"], t["task"], t["epoch"], t["start"], t["stop"])

    async def task_done(self, task: Task) -> None:
        await self._broker_call(MsgType.TASK, {"op": "done", "job": task.job, "task": task.task_id})

    async def release_task(self, task: Task) -> None:
        """Give a task back unfinished (e.g. on shutdown): another worker takes it."""
        await self._broker_call(
            MsgType.TASK, {"op": "release", "job": task.job, "task": task.task_id}
        )

    async def _broker_call(
        self, mtype: MsgType, header: dict[str, Any], forever: bool = False
    ) -> dict[str, Any]:
        """A request the broker itself answers (matched by request id)."""
        assert self._sock is not None
        req_id = next(self._req_ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._broker_calls[req_id] = (fut, mtype, header)
        await transport.send(self._sock, encode(Route(mtype, req_id=req_id), header))
        limit = None if forever else self.config.timeout
        try:
            reply = await asyncio.wait_for(fut, limit)
        except TimeoutError:
            raise ZpsTimeoutError(
                f"the broker did not answer {mtype.name} within {limit:g}s"
            ) from None
        finally:
            self._broker_calls.pop(req_id, None)
        if reply.get("st") == "JOB_FAILED":
            raise JobFailedError(str(reply.get("msg", "")))
        if reply.get("st") != "OK":
            raise remote_error(str(reply.get("st")), str(reply.get("msg", "")))
        return reply

    # -- introspection -------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """The broker's status report (as ``zps-server status --json`` prints it)."""
        assert self._sock is not None
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._status_waiters.append(fut)
        await transport.send(self._sock, encode(Route(MsgType.STATUS), {}))
        try:
            return await asyncio.wait_for(fut, self.config.timeout)
        except TimeoutError:
            raise ZpsTimeoutError("the broker did not answer the status request") from None

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

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            due, self._due = self._due, []
            for req_id in due:
                req = self._pending.get(req_id)
                if req is not None and req.parked:
                    await self._resend(req)
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
        cmap = self.cluster_map
        info = cmap.partitions.get(partition)
        if info is None or info.lost:
            err = ShardUnavailableError(f"partition {partition} has no live copy")
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(err)
            return
        enc = Encoder(self._policy)
        bodies = []
        for op in ops:
            body = dict(op.body)
            for key, arr in op.arrays.items():
                body[key] = enc.array(arr)
            bodies.append(body)
        header: dict[str, Any] = {"cid": self.client_id, "seq": next(self._seqs), "ops": bodies}
        if self.config.acks == 1:
            header["acks"] = 1
        req_id = next(self._req_ids)
        frames = enc.build(Route(MsgType.REQUEST, partition, info.epoch, req_id), header)
        req = _Request(
            req_id, partition, ops, frames[1:], info.epoch, time.monotonic() + self.config.timeout
        )
        self._pending[req_id] = req
        self.stats.requests += 1
        self.stats.ops += len(ops)
        self.stats.by_partition[partition] += 1
        if info.primary is None:  # failing over: wait for the new primary
            self._park(req)
            return
        await self._transmit(req, frames)

    async def _transmit(self, req: _Request, frames: list[Any]) -> None:
        assert self._sock is not None
        try:
            await transport.send(self._sock, frames)
        except (ClosedError, BrokenError) as e:
            self._pending.pop(req.req_id, None)
            req.fail(e if isinstance(e, ClosedError) else ClosedError(str(e)))

    def _park(self, req: _Request) -> None:
        """Re-send after a short, growing backoff (or at once on a newer map)."""
        req.parked = True
        delay = min(0.01 * 2 ** min(req.attempts - 1, 8), self.config.heartbeat.interval)
        asyncio.get_running_loop().call_later(delay, self._make_due, req.req_id)

    def _make_due(self, req_id: int) -> None:
        self._due.append(req_id)
        self._wake.set()

    async def _resend(self, req: _Request) -> None:
        info = self.cluster_map.partitions.get(req.partition)
        if info is None or info.lost:
            self._pending.pop(req.req_id, None)
            req.fail(
                ShardUnavailableError(
                    f"partition {req.partition} has no live copy (its last shard died)"
                )
            )
            return
        if info.primary is None:
            req.attempts += 1
            self._park(req)
            return
        if req.attempts >= MAX_ATTEMPTS:
            self._pending.pop(req.req_id, None)
            req.fail(
                ShardUnavailableError(
                    f"partition {req.partition}: gave up after {req.attempts} attempts"
                )
            )
            return
        req.attempts += 1
        req.parked = False
        req.epoch = info.epoch
        self.stats.retries += 1
        route = Route(MsgType.REQUEST, req.partition, info.epoch, req.req_id)
        await self._transmit(req, [route.pack(), *req.body])

    async def _hello(self) -> None:
        assert self._sock is not None
        await transport.send(
            self._sock,
            encode(
                Route(MsgType.HELLO),
                {"host": socket.gethostname(), "pid": os.getpid(), "name": self.config.name},
            ),
        )

    async def _heartbeat_loop(self) -> None:
        assert self._sock is not None
        interval = self.config.heartbeat.interval
        while True:
            await asyncio.sleep(interval)
            await transport.send(self._sock, encode(Route(MsgType.HEARTBEAT), {}))
            now = time.monotonic()
            expired = [r for r in self._pending.values() if r.deadline < now]
            for req in expired:
                del self._pending[req.req_id]
                req.fail(
                    ZpsTimeoutError(
                        f"request to partition {req.partition} not answered within "
                        f"{self.config.timeout:g}s"
                    )
                )

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                burst = await transport.recv_burst(self._sock)
            except ClosedError:
                return
            for frames in burst:
                try:
                    msg = decode([transport.frame_buffer(f) for f in frames])
                    await self._dispatch(msg)
                except ProtocolError as e:
                    log.warning("dropped a malformed message from the broker: %s", e)

    async def _dispatch(self, msg: Message) -> None:
        match msg.route.mtype:
            case MsgType.REPLY:
                await self._on_reply(msg)
            case MsgType.MAP:
                await self._on_map(ClusterMap.from_wire(msg.header.get("map")))
            case MsgType.STATUS:
                if self._status_waiters:
                    fut = self._status_waiters.popleft()
                    if not fut.done():
                        fut.set_result(msg.header)
            case MsgType.CLOCK | MsgType.TASK:
                call = self._broker_calls.get(msg.route.req_id)
                if call is not None and not call[0].done():
                    call[0].set_result(msg.header)
            case MsgType.HELLO:  # the broker restarted and does not know us
                await self._hello()
            case MsgType.HEARTBEAT:
                pass
            case _:
                raise ProtocolError(f"a client does not expect {msg.route.mtype.name}")

    async def _on_map(self, new: ClusterMap) -> None:
        old = self._map
        restarted = old is not None and new.incarnation != old.incarnation
        if old is not None and not restarted and new.version < old.version:
            return
        self._map = new
        self._map_event.set()
        if restarted:
            log.info("the broker restarted; re-sending %d unanswered requests", len(self._pending))
            assert self._sock is not None
            for req_id, (_, mtype, header) in list(self._broker_calls.items()):
                await transport.send(self._sock, encode(Route(mtype, req_id=req_id), header))
        for req in list(self._pending.values()):
            info = new.partitions.get(req.partition)
            # A restarted broker may have dropped anything in flight; a new epoch
            # means a new primary.  Dedup makes re-sending safe.
            if (
                restarted
                or req.parked
                or info is None
                or info.epoch != req.epoch
                or info.primary is None
                or info.lost
            ):
                await self._resend(req)

    async def _on_reply(self, msg: Message) -> None:
        req = self._pending.get(msg.route.req_id)
        if req is None:
            return  # a late answer to a request that was already answered or timed out
        header = msg.header
        status = header.get("st")
        if status in _RETRY_CODES:
            # Failing over, or our map is out of date: try again shortly.
            self._park(req)
            if status == "STALE_EPOCH":
                await self._hello()
            return
        del self._pending[req.req_id]
        if status != "OK":
            req.fail(remote_error(str(status), str(header.get("msg", ""))))
            return
        results = header.get("res")
        if not isinstance(results, list) or len(results) != len(req.ops):
            req.fail(ProtocolError("reply does not match the request's operations"))
            return
        for op, res in zip(req.ops, results, strict=True):
            if op.future.done():
                continue
            try:
                op.future.set_result(self._result(res, msg))
            except (ProtocolError, RemoteError) as e:
                op.future.set_exception(e)

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
