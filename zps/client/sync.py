"""``zps.connect_sync``: the blocking facade over :class:`zps.client.client.Client`.

The async client runs on an event loop in a private thread; each method
submits a coroutine there and waits for it.  Errors are raised in the caller
exactly as the async client raises them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from zps.client.client import Client, connect
from zps.core.coord import Task
from zps.core.routing import ClusterMap
from zps.init import Initializer
from zps.ops.config import ClientConfig
from zps.optim import Optimizer

T = TypeVar("T")


#: How long an interrupted blocking call waits for its cancellation to be handled.
_CANCEL_WAIT_S = 5.0


async def _ending(coro: Coroutine[Any, Any, T], ended: threading.Event) -> T:
    try:
        return await coro
    finally:
        ended.set()


async def _next(pages: AsyncIterator[T]) -> T:
    return await anext(pages)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class SyncClient:
    """Blocking client: the methods of :class:`~zps.client.client.Client`, without ``await``."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._loop = _new_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="zps-client", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            self._call(client.start())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def client(self) -> Client:
        """The async client underneath (its methods run on :attr:`client`'s event loop)."""
        return self._client

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        ended = threading.Event()
        fut = asyncio.run_coroutine_threadsafe(_ending(coro, ended), self._loop)
        try:
            return fut.result()
        except BaseException:
            if not fut.done():
                # Interrupted here (KeyboardInterrupt, a signal handler's exception):
                # the call is cancelled in the loop's thread, and its ending (a push
                # detaching the caller's memory: Client.push_dense) has run before
                # the caller goes on.  A call cancelled before it started sets
                # nothing: the wait then ends at its bound.
                fut.cancel()
                ended.wait(_CANCEL_WAIT_S)
            raise

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._loop.is_running():
            self._loop.close()

    def close(self) -> None:
        """Close the connection and stop the client's thread; what is still in flight
        (a background push) fails, so call :meth:`flush` first.  Closing twice does
        nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._client.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def cluster_map(self) -> ClusterMap:
        """The newest cluster map the broker sent (partitions, epochs, primaries)."""
        return self._client.cluster_map

    def create_dense(
        self,
        name: str,
        shape: int | Sequence[int],
        dtype: str = "float32",
        *,
        init: Initializer | None = None,
        optimizer: Optimizer | None = None,
        seed: int | None = None,
    ) -> None:
        """Create a dense tensor on the servers (idempotent for an identical spec); see
        :meth:`Client.create_dense <zps.client.client.Client.create_dense>`."""
        self._call(
            self._client.create_dense(name, shape, dtype, init=init, optimizer=optimizer, seed=seed)
        )

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
    ) -> None:
        """See :meth:`Client.create_embedding <zps.client.client.Client.create_embedding>`."""
        self._call(
            self._client.create_embedding(
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
        )

    def pull_dense(self, name: str, *, out: np.ndarray | None = None) -> np.ndarray:
        """The current value of a dense tensor: a fresh array, or written into ``out``
        (C-contiguous, writable, of its shape and dtype) and returned."""
        return self._call(self._client.pull_dense(name, out=out))

    def gradient_buffer(self, name: str) -> np.ndarray:
        """See :meth:`zps.client.Client.gradient_buffer`."""
        return self._call(self._client.gradient_buffer(name))

    def push_dense(self, name: str, grad: npt.ArrayLike, *, wait: bool = True) -> None:
        """Send a gradient; returns once every partition acknowledged its part, or, with
        ``wait=False``, once it is on its way (an error then surfaces at a later call)."""
        self._call(self._client.push_dense(name, grad, wait=wait))

    def pull_rows(self, name: str, ids: npt.ArrayLike) -> np.ndarray:
        """Rows for ``ids``, shape ``(len(ids), dim)``, in the order of ``ids``."""
        return self._call(self._client.pull_rows(name, ids))

    def push_rows(
        self, name: str, ids: npt.ArrayLike, grads: npt.ArrayLike, *, wait: bool = True
    ) -> None:
        """Send row gradients (the shard sums those of duplicate ids); ``wait`` as for
        :meth:`push_dense`."""
        self._call(self._client.push_rows(name, ids, grads, wait=wait))

    def list_tables(self) -> list[str]:
        """Names of every table, sorted."""
        return self._call(self._client.list_tables())

    def describe(self, name: str) -> dict[str, Any]:
        """A table's spec and size (see :meth:`Client.describe
        <zps.client.client.Client.describe>`); ``UnknownTableError`` if there is none."""
        return self._call(self._client.describe(name))

    def drop_table(self, name: str, *, missing_ok: bool = False) -> bool:
        """Remove a table from every partition; True if it existed (``UnknownTableError``
        if it did not, unless ``missing_ok``)."""
        return self._call(self._client.drop_table(name, missing_ok=missing_ok))

    def set_optimizer(self, name: str, optimizer: Optimizer, *, reset_state: bool = False) -> None:
        """Give a table another optimizer (the same kind keeps its state; another kind
        only with ``reset_state``): see :meth:`Client.set_optimizer`."""
        self._call(self._client.set_optimizer(name, optimizer, reset_state=reset_state))

    def advance_step(self, table: str | None = None, steps: int = 1) -> dict[str, int]:
        """Advance the step count a learning-rate schedule follows (None: every table);
        each table's new count: see :meth:`Client.advance_step`."""
        return self._call(self._client.advance_step(table, steps))

    def set_dense(self, name: str, values: npt.ArrayLike) -> None:
        """See :meth:`Client.set_dense <zps.client.client.Client.set_dense>` (the
        optimizer state is reset)."""
        self._call(self._client.set_dense(name, values))

    def set_rows(self, name: str, ids: npt.ArrayLike, rows: npt.ArrayLike) -> None:
        """See :meth:`Client.set_rows <zps.client.client.Client.set_rows>` (the
        optimizer state of those rows is reset)."""
        self._call(self._client.set_rows(name, ids, rows))

    def table_ids(self, name: str, *, chunk: int = 65536) -> Iterator[np.ndarray]:
        """The ids an embedding table holds, in arrays of at most ``chunk`` ids (see
        :meth:`Client.table_ids <zps.client.client.Client.table_ids>`)."""
        pages = self._client.table_ids(name, chunk=chunk)
        while True:
            try:
                page = self._call(_next(pages))
            except StopAsyncIteration:
                return
            yield page

    def checkpoint(self, *, timeout: float = 300.0) -> dict[int, dict[str, Any]]:
        """Have every partition's primary write a checkpoint now and wait for it: per
        partition ``{"lsn", "epoch", "path", "time"}`` (see :meth:`Client.checkpoint
        <zps.client.client.Client.checkpoint>`)."""
        return self._call(self._client.checkpoint(timeout=timeout))

    def export_model(
        self,
        out: str | os.PathLike[str],
        *,
        tables: Sequence[str] | None = None,
        since: str | os.PathLike[str] | None = None,
        values_only: bool = False,
    ) -> dict[str, Any]:
        """See :meth:`Client.export_model <zps.client.client.Client.export_model>`."""
        return self._call(
            self._client.export_model(out, tables=tables, since=since, values_only=values_only)
        )

    def import_model(
        self, path: str | os.PathLike[str], *, tables: Sequence[str] | None = None
    ) -> list[str]:
        """Create the tables of an export (default: all) and set their values and
        optimizer state (a warm start); returns the names imported."""
        return self._call(self._client.import_model(path, tables=tables))

    def run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine of the async client on its loop; ``.result()`` waits."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def prefetch_rows(self, name: str, ids: npt.ArrayLike) -> concurrent.futures.Future[np.ndarray]:
        """Start pulling rows now (while you compute); ``.result()`` gives them.

        The ids are copied first: the caller may reuse its buffer at once.
        """
        return self.run(self._client.pull_rows(name, np.array(ids, copy=True)))

    def prefetch_dense(self, name: str) -> concurrent.futures.Future[np.ndarray]:
        """Start pulling a dense tensor now; ``.result()`` gives it."""
        return self.run(self._client.pull_dense(name))

    def flush(self) -> None:
        """Wait for every background push (``wait=False``); raise the first error."""
        self._call(self._client.flush())

    @property
    def step(self) -> int:
        """The step this worker is in (sync and ssp: as the broker counts)."""
        return self._client.step

    @property
    def stop_requested(self) -> bool:
        """True once zps-worker was asked to stop (SIGTERM): finish the step and return."""
        return self._client.stop_requested

    def report(self, *, rows: float = 0, loss: float | None = None, **extra: float) -> None:
        """Per-step metrics (rows trained, loss, more by name) for zps-worker's progress
        display and the broker's per-job loss and rows/s; returns at once."""
        self._client.report(rows=rows, loss=loss, **extra)

    def clock(self) -> int:
        """Finish the current step and wait until the training mode lets the next one
        start (sync: every live worker finished it; ssp: within ``staleness``; async: at
        once); returns the new step."""
        return self._call(self._client.clock())

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
    ) -> dict[str, Any]:
        """See :meth:`Client.create_job <zps.client.client.Client.create_job>`."""
        return self._call(
            self._client.create_job(
                job,
                n_records,
                per_task,
                epochs=epochs,
                max_retries=max_retries,
                seed=seed,
                restart=restart,
            )
        )

    def list_jobs(self) -> list[dict[str, Any]]:
        """See :meth:`Client.list_jobs <zps.client.client.Client.list_jobs>`."""
        return self._call(self._client.list_jobs())

    def job(self, name: str) -> dict[str, Any]:
        """See :meth:`Client.job <zps.client.client.Client.job>`."""
        return self._call(self._client.job(name))

    def cancel_job(self, name: str) -> dict[str, Any]:
        """See :meth:`Client.cancel_job <zps.client.client.Client.cancel_job>`."""
        return self._call(self._client.cancel_job(name))

    def reset_job(self, name: str) -> dict[str, Any]:
        """See :meth:`Client.reset_job <zps.client.client.Client.reset_job>`."""
        return self._call(self._client.reset_job(name))

    def next_task(self, job: str) -> Task | None:
        """The next data task of ``job``, None when every task of every epoch is done
        (waits while other workers still hold the last ones)."""
        return self._call(self._client.next_task(job))

    def task_done(self, task: Task) -> None:
        """Report ``task`` finished."""
        self._call(self._client.task_done(task))

    def release_task(self, task: Task) -> None:
        """Give ``task`` back unfinished (e.g. on shutdown): another worker takes it."""
        self._call(self._client.release_task(task))

    def status(self) -> dict[str, Any]:
        """The broker's status report (as ``zps-server status --json`` prints it)."""
        return self._call(self._client.status())

    def checksums(self) -> dict[int, dict[str, Any]]:
        """Per partition: a checksum of all its tables and its LSN."""
        return self._call(self._client.checksums())


def connect_sync(
    address: str | Sequence[str], config: ClientConfig | None = None, **options: Any
) -> SyncClient:
    """A connected blocking client; close it (or use ``with``) when done.  ``address``
    is the broker's endpoint or a broker pair's two (see :func:`zps.connect`)."""
    return SyncClient(connect(address, config, **options))
