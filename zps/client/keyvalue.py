"""The key-value API of the client: tables, dense tensors, embedding rows, prefetch and
table administration, over the request machinery it is given (:class:`Requests`).

Each call is split by partition (ids by slot, dense tensors by chunk); the operations for one
partition queued in the same loop turn are coalesced into one message by the connection, and
a call too large for one message is cut into several per partition, each request and each
reply within ``message_budget`` bytes (16 MiB), and its results joined in order.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from zps.client.futures import gather
from zps.client.values import (
    as_float,
    as_ids,
    check_finite,
    chunk_bytes,
    must_copy,
    owned,
    runs,
    table_seed,
)
from zps.core.batching import groups_by_bytes, split_push
from zps.core.hashing import mix64_int, name_hash
from zps.core.memo import IdsMemo
from zps.core.routing import ClusterMap, chunk_partition, dense_chunk_elems
from zps.core.rows import Split, put_rows, split_ids, take_rows
from zps.errors import (
    BadRequestError,
    ProtocolError,
    ShapeMismatchError,
    TableConflictError,
    UnknownTableError,
    ZpsTimeoutError,
)
from zps.init import Initializer, Zeros
from zps.ops.config import ClientConfig
from zps.optim import FTRL, SGD, Adagrad, Adam, Momentum, Optimizer
from zps.protocol.specs import DenseSpec, EmbeddingSpec, spec_from_wire

_M64 = (1 << 64) - 1
#: The positions of a one-id call.
_ZERO = np.zeros(1, dtype=np.int64)
_ZERO.flags.writeable = False


class Requests(Protocol):
    """What the key-value API needs of the request machinery
    (:class:`~zps.client.connection.Connection`)."""

    @property
    def config(self) -> ClientConfig: ...
    @property
    def cluster_map(self) -> ClusterMap: ...
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
    ) -> asyncio.Future[dict[str, Any]]: ...
    async def finish(self, futures: list[asyncio.Future[dict[str, Any]]], wait: bool) -> None: ...
    def raise_background(self) -> None: ...
    def detach(self, arr: np.ndarray) -> None: ...
    def own(self, arr: np.ndarray) -> np.ndarray: ...
    def buffer(self, shape: tuple[int, ...], dtype: str) -> np.ndarray: ...


class KeyValue:
    """Tables, dense tensors, embedding rows, prefetch, administration, over ``requests``;
    ``tagged`` gives a push's body the step it is for (sync mode)."""

    def __init__(
        self, requests: Requests, tagged: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> None:
        self._rq = requests
        self.config = requests.config
        self._tagged = tagged
        self._specs: dict[str, DenseSpec | EmbeddingSpec] = {}
        self._split_memo: IdsMemo[Split] = IdsMemo(size=4)
        self._row_bytes: dict[str, tuple[EmbeddingSpec, int]] = {}  # see check_row

    @property
    def cluster_map(self) -> ClusterMap:
        """The newest cluster map the broker sent."""
        return self._rq.cluster_map

    def submit(
        self,
        partition: int,
        body: dict[str, Any],
        arrays: dict[str, np.ndarray],
        *,
        reply_bytes: int = 0,
    ) -> asyncio.Future[dict[str, Any]]:
        """One operation for ``partition`` (see :meth:`Connection.submit
        <zps.client.connection.Connection.submit>`)."""
        return self._rq.submit(partition, body, arrays, reply_bytes=reply_bytes)

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
            seed=table_seed(name, seed),
            chunk_elems=chunk,
        )
        await self.create_spec(spec)

    async def create_embedding(
        self,
        name: str,
        dim: int,
        dtype: str = "float32",
        *,
        init: Initializer | None = None,
        optimizer: Optimizer | None = None,
        seed: int | None = None,
        admit_count: int = 0,
        ttl_steps: int = 0,
        max_rows: int = 0,
        admit_probability: float = 1.0,
    ) -> None:
        """Create an embedding table ``id -> row[dim]`` (idempotent for an identical spec).

        Admission and eviction (0: off), applied by the shards as part of each push, so
        replicated, logged and checkpointed like it: ``admit_count``, an id's row is
        trained from its ``admit_count``-th push on (earlier pushes are only counted;
        pulls return the initial value); ``ttl_steps``, a row not pushed during that
        many pushes of this table on its partition is evicted (a later pull returns the
        initial value); ``max_rows``, the table keeps at most about that many rows: each
        partition at most ``ceil(max_rows / partitions)`` (the spec's ``max_rows``),
        evicting the least recently pushed; ``admit_probability`` (instead of
        ``admit_count``), each push of an id not yet admitted admits it with that
        probability.  See :class:`~zps.protocol.specs.EmbeddingSpec`.
        """
        n = self.cluster_map.n_partitions
        spec = EmbeddingSpec(
            name=name,
            dim=int(dim),
            dtype=str(dtype),
            init=init or Zeros(),
            optimizer=optimizer or SGD(),
            seed=table_seed(name, seed),
            admit_count=admit_count,
            ttl_steps=ttl_steps,
            max_rows=-(-int(max_rows) // n) if max_rows > 0 else max_rows,
            admit_probability=admit_probability,
        )
        await self.create_spec(spec)

    async def create_spec(self, spec: DenseSpec | EmbeddingSpec) -> None:
        wire = spec.to_wire()
        # Every partition keeps every spec: embedding rows live everywhere and
        # any partition can describe any table to a client that did not create it.
        results = await gather(
            self._rq.submit(p, {"op": "create", "spec": wire}, {})
            for p in range(self.cluster_map.n_partitions)
        )
        del results
        self._specs[spec.name] = spec

    async def table_spec(self, name: str) -> DenseSpec | EmbeddingSpec:
        """The spec of table ``name`` (asked of a partition, then remembered);
        ``UnknownTableError`` if there is none.

        Every partition holds every table's spec (a table is created on each).  The one
        its name hashes to is asked; while that one has no primary, a partition that has
        one is asked instead, so a call to a partition that serves does not wait for
        another that does not.  Only the hashed partition's answer that it has no such
        table is final (a partition added since may not hold the spec yet)."""
        spec = self._specs.get(name)
        if spec is None:
            cmap = self.cluster_map
            home = int(cmap.slot_map[name_hash(name) % cmap.n_slots])
            serving = [
                p
                for p in (home, *range(cmap.n_partitions))
                if (info := cmap.partitions.get(p)) is not None and info.primary
            ]
            asked = serving[0] if serving else home
            spec = await self._ask_specs(asked, name)
            if spec is None and asked != home:
                spec = await self._ask_specs(home, name)
            if spec is None:
                raise UnknownTableError(f"unknown table {name!r}")
        return spec

    async def _ask_specs(self, partition: int, name: str) -> DenseSpec | EmbeddingSpec | None:
        """The specs ``partition`` holds, remembered; the one of ``name``, if among them."""
        result = await self._rq.submit(partition, {"op": "tables"}, {})
        for wire in result["tables"]:
            s = spec_from_wire(wire)
            self._specs.setdefault(s.name, s)
        return self._specs.get(name)

    async def _dense_spec(self, name: str) -> DenseSpec:
        spec = await self.table_spec(name)
        if not isinstance(spec, DenseSpec):
            raise TableConflictError(f"table {name!r} is an embedding table, not a dense tensor")
        return spec

    async def _embedding_spec(self, name: str) -> EmbeddingSpec:
        spec = await self.table_spec(name)
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
        self.check_chunks(spec)
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
        # Each message's reply stays within the budget: a partition's chunks go in
        # groups of at most that many bytes.
        itemsize = np.dtype(spec.dtype).itemsize
        groups: list[tuple[int, list[int], int]] = []
        for p, chunks in by_part.items():
            sizes = [chunk_bytes(spec, c, itemsize) for c in chunks]
            for a, b in groups_by_bytes(sizes, self.config.message_budget):
                groups.append((p, chunks[a:b], sum(sizes[a:b])))
        # Each chunk's place in the result: a reply through shared memory is copied
        # there directly (one copy instead of two for a large tensor).
        places = [[flat[slice(*spec.chunk_range(c))] for c in chunks] for _, chunks, _ in groups]
        futures = [
            self._rq.submit(
                p, {"op": "pull_dense", "t": name, "chunks": chunks}, {}, reply_bytes=n, into=into
            )
            for (p, chunks, n), into in zip(groups, places, strict=True)
        ]
        try:
            results = await gather(futures)
        except BaseException:
            for f in futures:  # no late reply of this call writes into ``out`` now
                f.cancel()
            raise
        for (_, chunks, _), into, result in zip(groups, places, results, strict=True):
            for c, arr, place in zip(chunks, result["arrays"], into, strict=True):
                if arr.shape != place.shape or arr.dtype != place.dtype:
                    raise ProtocolError(
                        f"chunk {c} of {name!r} came back as {arr.dtype}{list(arr.shape)}"
                    )
                if arr.ctypes.data != place.ctypes.data:  # not already there
                    place[:] = arr
        return out if out is not None else flat.reshape(spec.shape)

    async def gradient_buffer(self, name: str) -> np.ndarray:
        """Zeros shaped like dense tensor ``name``, for its gradient: write the gradient
        there and ``push_dense(name, buf)`` sends it with no copy on this host.

        The array is in this client's shared memory (``client.shm_bytes``; on the heap
        when that is off or full, it is sent as any array).  A shard on the same host
        reads the gradient straight from it while the push is in flight, so write it
        again only once the push has returned; a ``wait=False`` push copies it first,
        as any array.  A push that ends without its answer (an error, a timeout, a
        cancellation) never sends what is written after.  Keep the array for every
        step: its memory is given back when it is gone.
        """
        spec = await self._dense_spec(name)
        return self._rq.buffer(spec.shape, spec.dtype)

    async def push_dense(self, name: str, grad: npt.ArrayLike, *, wait: bool = True) -> None:
        """Send a gradient; returns once every partition acknowledged its part.

        With ``wait=False`` it returns once the push is on its way (at most
        ``max_background`` are in flight); an error surfaces at a later call.
        """
        self._rq.raise_background()
        spec = await self._dense_spec(name)
        self.check_chunks(spec)
        g = as_float(grad, spec.dtype, f"gradient for {name!r}")
        if g.shape != spec.shape:
            raise ShapeMismatchError(
                f"gradient for {name!r} has shape {g.shape}; the tensor has shape {spec.shape}"
            )
        flat = g.reshape(-1)
        copy = must_copy(flat, grad, wait)
        futures = []
        for c in range(spec.n_chunks):
            start, stop = spec.chunk_range(c)
            piece = self._rq.own(flat[start:stop]) if copy else flat[start:stop]
            futures.append(
                self._rq.submit(
                    chunk_partition(name, c, self.cluster_map),
                    self._tagged({"op": "push_dense", "t": name, "chunk": c}),
                    {"g": piece},
                    borrowed=not copy,
                    lazy=not wait,
                )
            )
        try:
            await self._rq.finish(futures, wait)
        except BaseException:
            if not copy:  # the caller may write ``grad`` now: nothing may read it later
                self._rq.detach(flat)
            raise

    async def _rows_of(
        self, name: str, ids: Any, values: Any, what: str
    ) -> tuple[EmbeddingSpec, npt.NDArray[np.int64], npt.NDArray[Any]]:
        """Embedding ``name``'s spec, ``ids`` as ids and ``values`` (``what``: gradients,
        rows) as an array of one row per id in the table's dtype, or a clear error."""
        spec = self._specs.get(name)
        if not isinstance(spec, EmbeddingSpec):
            spec = await self._embedding_spec(name)
        self.check_row(spec)
        id_arr = as_ids(ids)
        arr = as_float(values, spec.dtype, f"{what} for {name!r}")
        if arr.shape != (id_arr.size, spec.dim):
            raise ShapeMismatchError(
                f"{what} for {name!r} have shape {arr.shape}; expected "
                f"({id_arr.size}, {spec.dim}) for {id_arr.size} ids of dim {spec.dim}"
            )
        return spec, id_arr, arr

    def check_row(self, spec: EmbeddingSpec) -> int:
        """Calls are cut by rows: refuse, before sending anything, a table whose single
        row (with its id) this client could not send or receive.  Returns the bytes of
        a row (remembered for the spec: every row call asks)."""
        known = self._row_bytes.get(spec.name)
        if known is not None and known[0] is spec:
            return known[1]
        row_bytes = spec.dim * np.dtype(spec.dtype).itemsize
        limit = self.config.max_message_bytes // 2
        if 8 + row_bytes > limit:
            raise BadRequestError(
                f"table {spec.name!r} has rows of {8 + row_bytes} bytes; this client takes at "
                f"most {limit} (half of client.max_message_bytes) in one message"
            )
        self._row_bytes[spec.name] = (spec, row_bytes)
        return row_bytes

    def check_chunks(self, spec: DenseSpec) -> None:
        """A chunk travels whole in one message: refuse, before sending anything, a
        tensor whose chunks this client could not send or receive."""
        nbytes = min(spec.chunk_elems, spec.size) * np.dtype(spec.dtype).itemsize
        limit = self.config.max_message_bytes // 2
        if nbytes > limit:
            raise BadRequestError(
                f"dense tensor {spec.name!r} has chunks of {nbytes} bytes; this client "
                f"takes at most {limit} (half of client.max_message_bytes) in one message"
            )

    # -- embeddings ----------------------------------------------------------

    async def pull_rows(self, name: str, ids: npt.ArrayLike) -> np.ndarray:
        """Rows for ``ids``, shape ``(len(ids), dim)``, in the order of ``ids``.

        Duplicate ids are allowed and each is fetched: a batch that repeats ids
        heavily should pull ``np.unique(ids)`` and expand the result with the
        inverse (the client does not sort every batch to find out).
        """
        self._rq.raise_background()
        spec = self._specs.get(name)
        if not isinstance(spec, EmbeddingSpec):
            spec = await self._embedding_spec(name)
        row_bytes = self.check_row(spec)
        id_arr = as_ids(ids)
        split = self.split(id_arr)
        budget = self.config.message_budget
        if len(split.parts) == 1 and id_arr.size * max(row_bytes, 8) <= budget:
            # one partition owns every id, one message: no gather, no scatter
            arr = (
                await self._rq.submit(
                    split.parts[0][0],
                    {"op": "pull_rows", "t": name},
                    {"ids": id_arr},
                    reply_bytes=id_arr.size * row_bytes,
                )
            )["arrays"]
            if arr.shape != (id_arr.size, spec.dim):
                raise ProtocolError(f"pull_rows of {name!r} came back with shape {arr.shape}")
            return np.array(arr)  # writable, and not pinning the received frame
        rows = np.empty((id_arr.size, spec.dim), dtype=spec.dtype)
        # Per partition, runs of ids whose request (8 bytes an id) and reply (a row
        # an id) each stay within the budget: [start, stop) of split.ids and split.order.
        pieces = runs(split, max(row_bytes, 8), budget)
        results = await gather(
            [
                self._rq.submit(
                    p,
                    {"op": "pull_rows", "t": name},
                    {"ids": split.ids[a:b]},
                    reply_bytes=(b - a) * row_bytes,
                )
                for p, a, b in pieces
            ]
        )
        for (_, a, b), result in zip(pieces, results, strict=True):
            arr = result["arrays"]
            if arr.shape != (b - a, spec.dim):
                raise ProtocolError(f"pull_rows of {name!r} came back with shape {arr.shape}")
            put_rows(rows, split.order[a:b], arr)
        return rows

    async def push_rows(
        self, name: str, ids: npt.ArrayLike, grads: npt.ArrayLike, *, wait: bool = True
    ) -> None:
        """Send row gradients; duplicate ids' gradients are summed by the shard.

        ``wait=False``: as for :meth:`push_dense`.
        """
        self._rq.raise_background()
        _, id_arr, g = await self._rows_of(name, ids, grads, "gradients")
        split = self.split(id_arr)
        # One partition owns every id: the arrays go as they are, the caller's memory.
        borrowed = wait and len(split.parts) == 1
        budget = self.config.message_budget
        futures: list[asyncio.Future[dict[str, Any]]] = []
        # Every partition's gradients in one gather, each partition's a run of it.
        by_part = g if len(split.parts) == 1 else take_rows(g, split.order)
        for p, a, b in split.parts:
            if len(split.parts) == 1:  # one partition owns every id: the arrays as they are
                pieces = split_push(id_arr, g, budget)
                if len(pieces) == 1:
                    pieces = [(owned(id_arr, ids, wait), owned(g, grads, wait))]
            else:
                # split.ids is never written to (see _split): safe to send after return
                pieces = split_push(split.ids[a:b], by_part[a:b], budget)
            # A push too large for one message goes as several (see split_push): each
            # has its own sequence number, so each is applied exactly once.
            futures.extend(
                self._rq.submit(
                    p,
                    self._tagged({"op": "push_rows", "t": name}),
                    {"ids": i, "g": x},
                    borrowed=borrowed,
                    lazy=not wait,
                )
                for i, x in pieces
            )
        try:
            await self._rq.finish(futures, wait)
        except BaseException:
            if borrowed:  # the caller may write its arrays now: nothing may read them later
                self._rq.detach(g)
                self._rq.detach(id_arr)
            raise

    def split(self, ids: npt.NDArray[np.int64]) -> Split:
        """The ids grouped by partition (:func:`zps.core.rows.split_ids`), remembering
        the last answers: a training step pulls a batch's rows and then pushes
        gradients for the same ids.  A split's arrays are shared by the calls that get
        it: they are only read (and sent)."""
        cmap = self.cluster_map
        if ids.shape[0] == 1:  # one-row calls: in plain Python, without numpy rounds
            p = cmap.slot_list[mix64_int(int(ids[0]) & _M64) % cmap.n_slots]
            return Split(_ZERO, ids, [(p, 0, 1)])
        split = self._split_memo.get(ids, cmap)
        if split is None:
            split = split_ids(ids, cmap.slot_map, cmap.n_partitions)
            self._split_memo.put(ids, split, cmap)
        return split

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

    # -- administration --------------------------------------------------------

    async def list_tables(self) -> list[str]:
        """Names of every table, sorted (every partition is asked: each holds every spec)."""
        n = self.cluster_map.n_partitions
        results = await gather(self._rq.submit(p, {"op": "tables"}, {}) for p in range(n))
        names: set[str] = set()
        for result in results:
            for wire in result["tables"]:
                spec = spec_from_wire(wire)
                self._specs.setdefault(spec.name, spec)
                names.add(spec.name)
        return sorted(names)

    async def describe(self, name: str) -> dict[str, Any]:
        """A table's spec and size: ``{"name", "kind" ("dense" or "embedding"), "spec"
        (a DenseSpec or EmbeddingSpec), "rows", "bytes", "partitions"}``, where ``rows``
        counts stored rows (an embedding table) or stored chunks (a dense tensor),
        ``bytes`` counts values, optimizer state and index, and ``partitions`` lists
        ``{"partition", "rows", "bytes", "lsn"}`` for each partition; an embedding
        table also has ``admitted``, its rows past admission (see ``admit_count``).
        ``UnknownTableError`` if no partition has the table."""
        n = self.cluster_map.n_partitions
        futures = [self._rq.submit(p, {"op": "describe", "t": name}, {}) for p in range(n)]
        results = await gather(futures)
        spec = spec_from_wire(results[0]["spec"])
        self._specs[name] = spec
        parts = [
            {"partition": p, "rows": r["rows"], "bytes": r["bytes"], "lsn": r["lsn"]}
            for p, r in enumerate(results)
        ]
        out = {
            "name": name,
            "kind": "dense" if isinstance(spec, DenseSpec) else "embedding",
            "spec": spec,
            "rows": sum(int(r["rows"]) for r in results),
            "bytes": sum(int(r["bytes"]) for r in results),
            "partitions": parts,
        }
        if isinstance(spec, EmbeddingSpec):  # rows past admission (all, without it)
            out["admitted"] = sum(int(r.get("admitted", r["rows"])) for r in results)
        return out

    async def drop_table(self, name: str, *, missing_ok: bool = False) -> bool:
        """Remove a table (values, optimizer state, and its sync-mode gradients waiting
        for a commit) from every partition; True if it existed.  ``UnknownTableError``
        if it did not, unless ``missing_ok``.  Replicated, logged and applied once,
        like a push; its name can then be created again with any spec."""
        n = self.cluster_map.n_partitions
        results = await gather(self._rq.submit(p, {"op": "drop", "t": name}, {}) for p in range(n))
        self._specs.pop(name, None)
        self._split_memo = IdsMemo(size=4)
        dropped = any(r.get("changed") for r in results)
        if not dropped and not missing_ok:
            raise UnknownTableError(f"unknown table {name!r}: nothing to drop")
        return dropped

    async def set_optimizer(
        self, name: str, optimizer: Optimizer, *, reset_state: bool = False
    ) -> None:
        """Give table ``name`` another optimizer from its next push on: new
        hyperparameters, or a learning-rate schedule (:mod:`zps.optim.schedules`).  The
        same kind keeps its state (Adam keeps its moments and step counts); another kind
        is refused (``BadRequestError`` naming both) unless ``reset_state``, which gives
        every row and chunk the new optimizer's initial state, as in a new table, whatever
        the kind (the values stay).  Sent to every partition; replicated, logged and applied once,
        like a push; snapshots, checkpoints, ``describe`` and exports show the new
        optimizer.  A later ``create_*`` of the table must name the new optimizer."""
        if not isinstance(optimizer, SGD | Momentum | Adagrad | Adam | FTRL):
            raise BadRequestError(
                f"set_optimizer of {name!r}: optimizer must be a zps.optim optimizer, "
                f"got {type(optimizer).__name__}"
            )
        if not isinstance(reset_state, bool):
            raise BadRequestError(f"set_optimizer of {name!r}: reset_state must be a bool")
        op: dict[str, Any] = {"op": "set_optimizer", "t": name, "optimizer": optimizer.spec()}
        if reset_state:
            op["reset"] = True
        n = self.cluster_map.n_partitions
        await gather(self._rq.submit(p, dict(op), {}) for p in range(n))
        spec = self._specs.get(name)
        if spec is not None:
            self._specs[name] = dataclasses.replace(spec, optimizer=optimizer)

    async def advance_step(self, table: str | None = None, steps: int = 1) -> dict[str, int]:
        """Advance the step count of ``table`` (None: of every table) by ``steps`` (>= 1),
        on every partition; returns each table's new count by name.  A scheduled learning
        rate (:mod:`zps.optim.schedules`) is evaluated at this count: a push applied
        after this call returns uses the new step's rate.  Replicated, logged and
        applied once like a push (a retried call does not count twice), so the count,
        and the rate, are exact across failover and restarts.  Typically one worker
        advances after each training step (every worker calling it counts each call)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise BadRequestError(f"advance_step: steps must be an integer >= 1, got {steps!r}")
        if table is not None and not isinstance(table, str):
            raise BadRequestError(f"advance_step: table must be a name or None, got {table!r}")
        n = self.cluster_map.n_partitions
        results = await gather(
            self._rq.submit(p, {"op": "advance_step", "t": table, "n": steps}, {}) for p in range(n)
        )
        out: dict[str, int] = {}
        for r in results:
            for name, step in r.get("steps", {}).items():
                out[name] = max(out.get(name, 0), int(step))
        return out

    async def set_dense(self, name: str, values: npt.ArrayLike) -> None:
        """Set a dense tensor's values (an array of its shape).  Its optimizer state is
        reset to the optimizer's initial state (Adam's moments and step count, Adagrad's
        accumulator, ...), as for a new tensor: the next push starts from there.
        Replicated, logged and applied once, like a push."""
        spec = await self._dense_spec(name)
        self.check_chunks(spec)
        v = as_float(values, spec.dtype, f"values for {name!r}")
        if v.shape != spec.shape:
            raise ShapeMismatchError(
                f"values for {name!r} have shape {v.shape}; the tensor has shape {spec.shape}"
            )
        check_finite(v, f"values for {name!r}")
        flat = v.reshape(-1)
        futures = []
        for c in range(spec.n_chunks):
            start, stop = spec.chunk_range(c)
            futures.append(
                self._rq.submit(
                    chunk_partition(name, c, self.cluster_map),
                    {"op": "set_dense", "t": name, "chunk": c},
                    {"v": flat[start:stop]},
                )
            )
        await gather(futures)

    async def set_rows(self, name: str, ids: npt.ArrayLike, rows: npt.ArrayLike) -> None:
        """Set the rows of ``ids`` (distinct) to ``rows`` (shape ``(len(ids), dim)``),
        creating absent ones.  The optimizer state of exactly those rows is reset to
        the optimizer's initial state (as for a new row); every other row keeps its
        values and state.  Replicated, logged and applied once, like a push.

        A call of any size is cut into messages within the message budget; each is
        applied atomically on its partition, the call as a whole is not (an error
        part-way may leave some partitions set)."""
        spec, id_arr, v = await self._rows_of(name, ids, rows, "rows")
        check_finite(v, f"rows for {name!r}")
        uniq, counts = np.unique(id_arr, return_counts=True)
        if uniq.size != id_arr.size:
            dup = int(uniq[np.argmax(counts > 1)])
            raise BadRequestError(f"set_rows of {name!r}: id {dup} appears more than once")
        row_bytes = 8 + spec.dim * np.dtype(spec.dtype).itemsize
        split = self.split(id_arr)
        by_part = take_rows(v, split.order)
        futures = [
            self._rq.submit(
                p, {"op": "set_rows", "t": name}, {"ids": split.ids[a:b], "v": by_part[a:b]}
            )
            for p, a, b in runs(split, row_bytes, self.config.message_budget)
        ]
        await gather(futures)

    async def table_ids(self, name: str, *, chunk: int = 65536) -> AsyncIterator[np.ndarray]:
        """The ids an embedding table holds, as arrays of at most ``chunk`` ids
        (partition by partition, ascending within each).  Each array is read from the
        table as it is at that moment: ids created or dropped while iterating may or
        may not appear, every id present throughout appears exactly once."""
        spec = await self._embedding_spec(name)
        if chunk < 1:
            raise BadRequestError(f"table_ids: chunk must be >= 1, got {chunk}")
        del spec
        chunk = min(chunk, self.config.message_budget // 8)
        for p in range(self.cluster_map.n_partitions):
            after: int | None = None
            while True:
                page = await self.ids_page(name, p, after, chunk)
                if page.size:
                    yield page
                if page.size < chunk:
                    break
                after = int(page[-1])

    async def ids_page(
        self, name: str, partition: int, after: int | None, limit: int
    ) -> np.ndarray:
        """Up to ``limit`` ids of ``name`` on ``partition`` above ``after``, ascending."""
        result = await self._rq.submit(
            partition,
            {"op": "ids", "t": name, "after": after, "limit": limit},
            {},
            reply_bytes=8 * limit,
        )
        return np.array(result["arrays"])

    async def checkpoint(self, *, timeout: float = 300.0) -> dict[int, dict[str, Any]]:
        """Have every partition's primary write a checkpoint of its current state and
        wait until each is on disk; per partition ``{"lsn", "epoch", "path", "time"}``
        of a checkpoint holding at least every write acknowledged before the call
        (``path`` on the primary's host).  ``BadRequestError`` if a primary has no
        data dir; ``ZpsTimeoutError`` after ``timeout`` seconds."""
        n = self.cluster_map.n_partitions
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        ask = {"op": "checkpoint", "write": True}
        first = await gather(self._rq.submit(p, dict(ask), {}) for p in range(n))
        target = {p: int(r["lsn"]) for p, r in enumerate(first)}
        done: dict[int, dict[str, Any]] = {}
        results = first
        while True:
            for p, r in zip(sorted(set(range(n)) - set(done)), results, strict=True):
                ck = r.get("checkpoint")
                if isinstance(ck, dict) and int(ck.get("lsn", -1)) >= target[p]:
                    done[p] = dict(ck)
            todo = sorted(set(range(n)) - set(done))
            if not todo:
                return dict(sorted(done.items()))
            if loop.time() > deadline:
                raise ZpsTimeoutError(
                    f"no checkpoint of partitions {todo} within {timeout}s "
                    f"(wanted LSNs {[target[p] for p in todo]})"
                )
            await asyncio.sleep(0.1)
            # asked again each time: a primary that took over since knows no request
            results = await gather(self._rq.submit(p, dict(ask), {}) for p in todo)

    async def export_model(
        self,
        out: str | os.PathLike[str],
        *,
        tables: Sequence[str] | None = None,
        since: str | os.PathLike[str] | None = None,
        values_only: bool = False,
    ) -> dict[str, Any]:
        """Write the values of ``tables`` (default: every table) and their optimizer
        state (unless ``values_only``) into the directory ``out`` in the open format of
        :mod:`zps.model.format` (``.npy`` files and a JSON manifest), each partition cut
        at one point of its log while training goes on; returns the manifest.  With
        ``since`` (an earlier export), only what changed since it: a delta for
        :func:`zps.model.format.apply_delta`.  See :mod:`zps.client.export`."""
        from zps.client.export import export_model

        return await export_model(self, out, tables=tables, since=since, values_only=values_only)

    async def import_model(
        self, path: str | os.PathLike[str], *, tables: Sequence[str] | None = None
    ) -> list[str]:
        """Create the tables of an export (default: all of them) with their exported
        specs and set their values and optimizer state (warm start; an export without
        state starts it afresh).  Returns the names imported."""
        from zps.client.export import import_model

        return await import_model(self, path, tables=tables)

    # -- introspection -------------------------------------------------------

    async def checksums(self) -> dict[int, dict[str, Any]]:
        """Per partition: checksum of all its tables and its LSN."""
        n = self.cluster_map.n_partitions
        results = await gather(self._rq.submit(p, {"op": "checksum"}, {}) for p in range(n))
        return {p: {"checksum": r["checksum"], "lsn": r["lsn"]} for p, r in enumerate(results)}
