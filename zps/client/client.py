"""The worker-side client: ``zps.connect`` (async) and ``zps.connect_sync``.

:class:`Client` is made of three parts, each given only what it needs of the others:

- :class:`~zps.client.connection.Connection`: the request machinery (one DEALER socket to
  the broker carrying every request, many in flight; coalescing, retries, re-sends on a
  new map, deadlines, background pushes, shared memory), decided by
  :class:`~zps.client.session.ClientSession`.  Every message carries ``(client_id,
  seq)``: a message re-sent after a map change is applied once.  A call waits while its
  partition has no live copy (a promotion, shards restarting) and fails with a clear
  error at its deadline rather than hang: ``ShardUnavailableError`` when its partition
  still had no copy to serve it (naming what was missing and how long it waited),
  ``ZpsTimeoutError`` when no answer came.
- :class:`~zps.client.keyvalue.KeyValue`: the key-value API (tables, dense tensors,
  embedding rows, prefetch, administration, export and import) over the connection's
  :class:`~zps.client.keyvalue.Requests`.
- :class:`~zps.client.training.TrainingCalls`: the step clock, data tasks and progress,
  over the connection's :class:`~zps.client.training.BrokerLink`.

This module joins them: each method of the client is one of a part's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from zps.client.connection import Connection
from zps.client.keyvalue import KeyValue
from zps.client.progress import Progress
from zps.client.session import ClientStats
from zps.client.shmpath import ClientShm
from zps.client.training import TrainingCalls
from zps.core.coord import Task
from zps.core.routing import ClusterMap
from zps.init import Initializer
from zps.ops.config import ClientConfig
from zps.ops.meter import ClientMeter
from zps.optim import Optimizer
from zps.protocol.messages import StatusRequest
from zps.protocol.specs import DenseSpec, EmbeddingSpec


class Client:
    """An asyncio client; use ``async with zps.connect(address) as ps``.

    The key-value API of :class:`~zps.client.keyvalue.KeyValue` and the training
    coordination (clock, data tasks, progress) of :class:`~zps.client.training.TrainingCalls`,
    over a :class:`~zps.client.connection.Connection` (see the module notes).
    """

    def __init__(self, address: str | Sequence[str], config: ClientConfig | None = None) -> None:
        #: The request machinery (its public methods are for tools and tests).
        self.connection = Connection(address, config)
        self.training = TrainingCalls(self.connection)
        self.kv = KeyValue(self.connection, self.training.tagged)
        #: Set when the worker is asked to stop (zps-worker's SIGTERM): finish
        #: the step, flush, release the task, return.
        self.stop_requested = False

    # -- lifecycle and the connection ------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect; in sync and ssp mode also join the step clock."""
        if self.connection.event_loop is not None:
            return
        await self.connection.start()
        await self.training.start()

    async def close(self) -> None:
        """Close the connection; what is still in flight fails (:meth:`flush` first).
        The progress ``report()`` recorded since the last heartbeat is sent first."""
        if self.connection.event_loop is not None and not self.connection.closed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self.training.send_reports()
        await self.connection.close()

    @property
    def address(self) -> str:
        return self.connection.address

    @property
    def addresses(self) -> tuple[str, ...]:
        return self.connection.addresses

    @property
    def config(self) -> ClientConfig:
        return self.connection.config

    @property
    def client_id(self) -> bytes:
        return self.connection.client_id

    @property
    def cluster_map(self) -> ClusterMap:
        """The newest cluster map the broker sent (partitions, epochs, primaries)."""
        return self.connection.cluster_map

    @property
    def stats(self) -> ClientStats:
        return self.connection.stats

    @property
    def meter(self) -> ClientMeter:
        return self.connection.meter

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        return self.connection.event_loop

    @property
    def shm_path(self) -> ClientShm:
        return self.connection.shm_path

    @property
    def in_background(self) -> int:
        return self.connection.in_background

    @property
    def requests_in_flight(self) -> int:
        return self.connection.requests_in_flight

    @property
    def sends_held_back(self) -> int:
        return self.connection.sends_held_back

    def call_deadline(self) -> float | None:
        return self.connection.call_deadline()

    def flush(self) -> Coroutine[Any, Any, None]:
        return self.connection.flush()

    def status(self, request: StatusRequest | None = None) -> Coroutine[Any, Any, dict[str, Any]]:
        return self.connection.status(request)

    # -- training ---------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.training.step

    @property
    def progress(self) -> Progress:
        return self.training.progress

    @property
    def tasks_taken(self) -> dict[str, int]:
        return self.training.tasks_taken

    def report(self, *, rows: float = 0, loss: float | None = None, **extra: float) -> None:
        self.training.report(rows=rows, loss=loss, **extra)

    def clock(self) -> Coroutine[Any, Any, int]:
        return self.training.clock()

    def create_job(
        self,
        job: str,
        n_records: int,
        per_task: int,
        *,
        epochs: int = 1,
        max_retries: int = 3,
        seed: int = 0,
        restart: bool = False,
    ) -> Coroutine[Any, Any, dict[str, Any]]:
        return self.training.create_job(
            job,
            n_records,
            per_task,
            epochs=epochs,
            max_retries=max_retries,
            seed=seed,
            restart=restart,
        )

    def list_jobs(self) -> Coroutine[Any, Any, list[dict[str, Any]]]:
        return self.training.list_jobs()

    def job(self, name: str) -> Coroutine[Any, Any, dict[str, Any]]:
        return self.training.job(name)

    def cancel_job(self, name: str) -> Coroutine[Any, Any, dict[str, Any]]:
        return self.training.cancel_job(name)

    def reset_job(self, name: str) -> Coroutine[Any, Any, dict[str, Any]]:
        return self.training.reset_job(name)

    def next_task(self, job: str) -> Coroutine[Any, Any, Task | None]:
        return self.training.next_task(job)

    def task_done(self, task: Task) -> Coroutine[Any, Any, None]:
        return self.training.task_done(task)

    def release_task(self, task: Task) -> Coroutine[Any, Any, None]:
        return self.training.release_task(task)

    # -- the key-value API -------------------------------------------------------

    def create_dense(
        self,
        name: str,
        shape: int | Sequence[int],
        dtype: str = "float32",
        *,
        init: Initializer | None = None,
        optimizer: Optimizer | None = None,
        seed: int | None = None,
    ) -> Coroutine[Any, Any, None]:
        return self.kv.create_dense(name, shape, dtype, init=init, optimizer=optimizer, seed=seed)

    def create_embedding(
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
    ) -> Coroutine[Any, Any, None]:
        return self.kv.create_embedding(
            name,
            dim,
            dtype,
            init=init,
            optimizer=optimizer,
            seed=seed,
            admit_count=admit_count,
            ttl_steps=ttl_steps,
            max_rows=max_rows,
            admit_probability=admit_probability,
        )

    def table_spec(self, name: str) -> Coroutine[Any, Any, DenseSpec | EmbeddingSpec]:
        return self.kv.table_spec(name)

    def pull_dense(
        self, name: str, *, out: np.ndarray | None = None
    ) -> Coroutine[Any, Any, np.ndarray]:
        return self.kv.pull_dense(name, out=out)

    def gradient_buffer(self, name: str) -> Coroutine[Any, Any, np.ndarray]:
        return self.kv.gradient_buffer(name)

    def push_dense(
        self, name: str, grad: npt.ArrayLike, *, wait: bool = True
    ) -> Coroutine[Any, Any, None]:
        return self.kv.push_dense(name, grad, wait=wait)

    def pull_rows(self, name: str, ids: npt.ArrayLike) -> Coroutine[Any, Any, np.ndarray]:
        return self.kv.pull_rows(name, ids)

    def push_rows(
        self, name: str, ids: npt.ArrayLike, grads: npt.ArrayLike, *, wait: bool = True
    ) -> Coroutine[Any, Any, None]:
        return self.kv.push_rows(name, ids, grads, wait=wait)

    def prefetch_rows(self, name: str, ids: npt.ArrayLike) -> asyncio.Task[np.ndarray]:
        return self.kv.prefetch_rows(name, ids)

    def prefetch_dense(self, name: str) -> asyncio.Task[np.ndarray]:
        return self.kv.prefetch_dense(name)

    def list_tables(self) -> Coroutine[Any, Any, list[str]]:
        return self.kv.list_tables()

    def describe(self, name: str) -> Coroutine[Any, Any, dict[str, Any]]:
        return self.kv.describe(name)

    def drop_table(self, name: str, *, missing_ok: bool = False) -> Coroutine[Any, Any, bool]:
        return self.kv.drop_table(name, missing_ok=missing_ok)

    def set_optimizer(
        self, name: str, optimizer: Optimizer, *, reset_state: bool = False
    ) -> Coroutine[Any, Any, None]:
        return self.kv.set_optimizer(name, optimizer, reset_state=reset_state)

    def advance_step(
        self, table: str | None = None, steps: int = 1
    ) -> Coroutine[Any, Any, dict[str, int]]:
        return self.kv.advance_step(table, steps)

    def set_dense(self, name: str, values: npt.ArrayLike) -> Coroutine[Any, Any, None]:
        return self.kv.set_dense(name, values)

    def set_rows(
        self, name: str, ids: npt.ArrayLike, rows: npt.ArrayLike
    ) -> Coroutine[Any, Any, None]:
        return self.kv.set_rows(name, ids, rows)

    def table_ids(self, name: str, *, chunk: int = 65536) -> AsyncIterator[np.ndarray]:
        return self.kv.table_ids(name, chunk=chunk)

    def ids_page(
        self, name: str, partition: int, after: int | None, limit: int
    ) -> Coroutine[Any, Any, np.ndarray]:
        return self.kv.ids_page(name, partition, after, limit)

    def checkpoint(
        self, *, timeout: float = 300.0
    ) -> Coroutine[Any, Any, dict[int, dict[str, Any]]]:
        return self.kv.checkpoint(timeout=timeout)

    def export_model(
        self,
        out: str | os.PathLike[str],
        *,
        tables: Sequence[str] | None = None,
        since: str | os.PathLike[str] | None = None,
        values_only: bool = False,
    ) -> Coroutine[Any, Any, dict[str, Any]]:
        return self.kv.export_model(out, tables=tables, since=since, values_only=values_only)

    def import_model(
        self, path: str | os.PathLike[str], *, tables: Sequence[str] | None = None
    ) -> Coroutine[Any, Any, list[str]]:
        return self.kv.import_model(path, tables=tables)

    def checksums(self) -> Coroutine[Any, Any, dict[int, dict[str, Any]]]:
        return self.kv.checksums()


def _documented() -> None:
    """Each method and property of :class:`Client` carries its part's docstring."""
    for name, member in vars(Client).items():
        if name.startswith("_") or getattr(member, "__doc__", None):
            continue
        for part in (KeyValue, TrainingCalls, Connection):
            doc = getattr(getattr(part, name, None), "__doc__", None)
            if doc:
                if isinstance(member, property):
                    setattr(Client, name, property(member.fget, member.fset, doc=doc))
                else:
                    member.__doc__ = doc
                break


_documented()


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
