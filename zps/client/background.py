"""A client's background calls (``wait=False``): at most ``max_background`` in flight;
a call is done once each of its operations is, and the first error among them is kept
and raised once, by the client's next call or by :meth:`Background.drain`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


class _Call:
    """One background call: done once each of its operations is."""

    __slots__ = ("failed", "left", "owner")

    def __init__(self, owner: Background, n: int) -> None:
        self.owner = owner
        self.left = n
        self.failed = False

    def done(self, fut: asyncio.Future[dict[str, Any]]) -> None:
        if not self.failed and not fut.cancelled() and (exc := fut.exception()) is not None:
            self.failed = True  # the call's first error, as one awaited call would raise
            self.owner.failed(exc)
        self.left -= 1
        if self.left == 0:
            self.owner.call_done(self)


class Background:
    """The background calls in flight (see the module notes); its length is their number."""

    def __init__(self, max_background: int) -> None:
        self.max_background = max_background
        self._calls: set[_Call] = set()
        self._waiters: list[asyncio.Future[None]] = []  # for one of them to finish
        self._error: BaseException | None = None

    def __len__(self) -> int:
        return len(self._calls)

    @property
    def waiting(self) -> int:
        """How many callers wait for a call to finish."""
        return len(self._waiters)

    async def add(self, futures: Sequence[asyncio.Future[dict[str, Any]]]) -> None:
        """A call of these operations' futures, once fewer than ``max_background`` are
        in flight (nothing for none)."""
        while len(self._calls) >= self.max_background:
            await self.slot()
        if futures:
            call = _Call(self, len(futures))
            self._calls.add(call)
            for fut in futures:
                fut.add_done_callback(call.done)

    def failed(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error

    def call_done(self, call: _Call) -> None:
        self._calls.discard(call)
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def slot(self) -> None:
        """Wait until a background call finishes (its own future: a cancelled waiter
        leaves the others waiting)."""
        w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(w)
        try:
            await w
        finally:
            if w in self._waiters:
                self._waiters.remove(w)

    def raise_error(self) -> None:
        """An error of a background call is raised by the next call, once."""
        err, self._error = self._error, None
        if err is not None:
            raise err

    async def drain(self) -> None:
        """Wait for every background call; raise the first error among them."""
        while self._calls:
            await self.slot()
        self.raise_error()
