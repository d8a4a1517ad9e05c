"""The worker-side client: ``zps.connect`` (async) and ``zps.connect_sync``.

One DEALER socket to the broker carries every request, so many requests are
in flight at once.  Each call is split by partition (ids by slot, dense
tensors by chunk); the operations for one partition queued in the same loop
turn are coalesced into one message (see :mod:`zps.core.batching`), and a call too
large for one message is cut into several per partition, each request and each
reply within ``message_budget`` bytes (16 MiB), and its results joined in order.
Every message carries ``(client_id, seq)``: a message re-sent after a map change
is applied once.  Calls fail with a clear error rather than hang: ``ShardUnavailableError``
when a partition has no live shard, ``ZpsTimeoutError`` past the deadline.

This module is the key-value API (tables, dense tensors, embedding rows, prefetch); the
request machinery is :class:`~zps.client.connection.Connection` and the training calls
are :class:`~zps.client.training.TrainingCalls`.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.client.training import TrainingCalls
from zps.core.batching import groups_by_bytes, row_runs, split_push
from zps.core.hashing import name_hash
from zps.core.memo import IdsMemo
from zps.core.routing import (
    chunk_partition,
    dense_chunk_elems,
    split_by_partition,
)
from zps.core.rows import put_rows, take_rows
from zps.errors import (
    BadRequestError,
    ProtocolError,
    ShapeMismatchError,
    TableConflictError,
    UnknownTableError,
)
from zps.init import Initializer, Zeros
from zps.ops.config import ClientConfig
from zps.optim import SGD, Optimizer
from zps.protocol.specs import DenseSpec, EmbeddingSpec, spec_from_wire


class Client(TrainingCalls):
    """An asyncio client; use ``async with zps.connect(address) as ps``.

    The key-value API over :class:`~zps.client.connection.Connection`, with the training
    coordination (clock, data tasks, progress) of :class:`~zps.client.training.TrainingCalls`.
    """

    def __init__(self, address: str | Sequence[str], config: ClientConfig | None = None) -> None:
        super().__init__(address, config)
        self._specs: dict[str, DenseSpec | EmbeddingSpec] = {}
        self._split_memo: IdsMemo[list[tuple[int, npt.NDArray[np.intp]]]] = IdsMemo(size=4)

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
        self._check_chunks(spec)
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
            sizes = [_chunk_bytes(spec, c, itemsize) for c in chunks]
            for a, b in groups_by_bytes(sizes, self.config.message_budget):
                groups.append((p, chunks[a:b], sum(sizes[a:b])))
        futures = [
            self._submit(p, {"op": "pull_dense", "t": name, "chunks": chunks}, {}, reply_bytes=n)
            for p, chunks, n in groups
        ]
        for (_, chunks, _), result in zip(groups, await self._gather(futures), strict=True):
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
        self._check_chunks(spec)
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

    def _check_row(self, spec: EmbeddingSpec) -> None:
        """Calls are cut by rows: refuse, before sending anything, a table whose single
        row (with its id) this client could not send or receive."""
        nbytes = 8 + spec.dim * np.dtype(spec.dtype).itemsize
        limit = self.config.max_message_bytes // 2
        if nbytes > limit:
            raise BadRequestError(
                f"table {spec.name!r} has rows of {nbytes} bytes; this client takes at "
                f"most {limit} (half of client.max_message_bytes) in one message"
            )

    def _check_chunks(self, spec: DenseSpec) -> None:
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
        self._raise_background()
        spec = self._specs.get(name)
        if not isinstance(spec, EmbeddingSpec):
            spec = await self._embedding_spec(name)
        self._check_row(spec)
        id_arr = _as_ids(ids)
        parts = self._split(id_arr)
        row_bytes = spec.dim * np.dtype(spec.dtype).itemsize
        budget = self.config.message_budget
        if len(parts) == 1 and id_arr.size * max(row_bytes, 8) <= budget:
            # one partition owns every id, one message: no gather, no scatter
            arr = (
                await self._submit(
                    parts[0][0],
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
        # an id) each stay within the budget.
        pieces = [
            (p, pos[a:b])
            for p, pos in parts
            for a, b in row_runs(pos.size, max(row_bytes, 8), budget)
        ]
        results = await self._gather(
            self._submit(
                p,
                {"op": "pull_rows", "t": name},
                {"ids": id_arr[pos]},
                reply_bytes=pos.size * row_bytes,
            )
            for p, pos in pieces
        )
        for (_, pos), result in zip(pieces, results, strict=True):
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
        self._check_row(spec)
        id_arr = _as_ids(ids)
        g = _as_float(grads, spec.dtype, f"gradients for {name!r}")
        if g.shape != (id_arr.size, spec.dim):
            raise ShapeMismatchError(
                f"gradients for {name!r} have shape {g.shape}; expected "
                f"({id_arr.size}, {spec.dim}) for {id_arr.size} ids of dim {spec.dim}"
            )
        parts = self._split(id_arr)
        budget = self.config.message_budget
        futures: list[asyncio.Future[dict[str, Any]]] = []
        for p, pos in parts:
            if len(parts) == 1:  # one partition owns every id: the arrays as they are
                pieces = split_push(id_arr, g, budget)
                if len(pieces) == 1:
                    pieces = [(_owned(id_arr, ids, wait), _owned(g, grads, wait))]
            else:
                pieces = split_push(id_arr[pos], take_rows(g, pos), budget)
            # A push too large for one message goes as several (see split_push): each
            # has its own sequence number, so each is applied exactly once.
            futures.extend(
                self._submit(p, self._tagged({"op": "push_rows", "t": name}), {"ids": i, "g": x})
                for i, x in pieces
            )
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

    # -- introspection -------------------------------------------------------

    async def checksums(self) -> dict[int, dict[str, Any]]:
        """Per partition: checksum of all its tables and its LSN."""
        n = self.cluster_map.n_partitions
        results = await self._gather(self._submit(p, {"op": "checksum"}, {}) for p in range(n))
        return {p: {"checksum": r["checksum"], "lsn": r["lsn"]} for p, r in enumerate(results)}


def _chunk_bytes(spec: DenseSpec, chunk: int, itemsize: int) -> int:
    start, stop = spec.chunk_range(chunk)
    return (stop - start) * itemsize


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


def connect(
    address: str | Sequence[str], config: ClientConfig | None = None, **options: Any
) -> Client:
    """An async client; use as ``async with zps.connect(address) as ps``.

    ``address`` is the broker's endpoint, or a broker pair's two endpoints (a list, or
    ``"tcp://a:5555,tcp://b:5555"``): the client follows whichever is active.

    ``options`` are :class:`~zps.ops.config.ClientConfig` fields (``timeout=5.0``).
    """
    if options:
        config = ClientConfig(**{**vars(config or ClientConfig()), **options})
    return Client(address, config)
