"""``zps.connect_sync``: the blocking facade over :class:`zps.client.client.Client`.

The async client runs on an event loop in a private thread; each method
submits a coroutine there and waits for it.  Errors are raised in the caller
exactly as the async client raises them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
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
        return self._client

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._loop.is_running():
            self._loop.close()

    def close(self) -> None:
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
    ) -> None:
        self._call(
            self._client.create_embedding(
                name, dim, dtype, init=init, optimizer=optimizer, seed=seed
            )
        )

    def pull_dense(self, name: str, *, out: np.ndarray | None = None) -> np.ndarray:
        return self._call(self._client.pull_dense(name, out=out))

    def push_dense(self, name: str, grad: npt.ArrayLike, *, wait: bool = True) -> None:
        self._call(self._client.push_dense(name, grad, wait=wait))

    def pull_rows(self, name: str, ids: npt.ArrayLike) -> np.ndarray:
        return self._call(self._client.pull_rows(name, ids))

    def push_rows(
        self, name: str, ids: npt.ArrayLike, grads: npt.ArrayLike, *, wait: bool = True
    ) -> None:
        self._call(self._client.push_rows(name, ids, grads, wait=wait))

    def run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine of the async client on its loop; ``.result()`` waits."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def prefetch_rows(self, name: str, ids: npt.ArrayLike) -> concurrent.futures.Future[np.ndarray]:
        """Start pulling rows now (while you compute); ``.result()`` gives them.

        The ids are copied first: the caller may reuse its buffer at once.
        """
        return self.run(self._client.pull_rows(name, np.array(ids, copy=True)))

    def prefetch_dense(self, name: str) -> concurrent.futures.Future[np.ndarray]:
        return self.run(self._client.pull_dense(name))

    def flush(self) -> None:
        self._call(self._client.flush())

    @property
    def step(self) -> int:
        return self._client.step

    @property
    def stop_requested(self) -> bool:
        return self._client.stop_requested

    def report(self, *, rows: float = 0, loss: float | None = None, **extra: float) -> None:
        self._client.report(rows=rows, loss=loss, **extra)

    def clock(self) -> int:
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
    ) -> dict[str, Any]:
        return self._call(
            self._client.create_job(
                job, n_records, per_task, epochs=epochs, max_retries=max_retries, seed=seed
            )
        )

    def next_task(self, job: str) -> Task | None:
        return self._call(self._client.next_task(job))

    def task_done(self, task: Task) -> None:
        self._call(self._client.task_done(task))

    def release_task(self, task: Task) -> None:
        self._call(self._client.release_task(task))

    def status(self) -> dict[str, Any]:
        return self._call(self._client.status())

    def checksums(self) -> dict[int, dict[str, Any]]:
        return self._call(self._client.checksums())


def connect_sync(
    address: str | Sequence[str], config: ClientConfig | None = None, **options: Any
) -> SyncClient:
    """A connected blocking client; close it (or use ``with``) when done.  ``address``
    is the broker's endpoint or a broker pair's two (see :func:`zps.connect`)."""
    return SyncClient(connect(address, config, **options))
