"""Joining the futures of a client's operations: a call's results gathered (done when
all are, or at the first failure), an operation split or merged handed its part, and
no error left unretrieved."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar, cast

from zps.core.routing import Resplit, join_resplit

T = TypeVar("T")


async def gather(futures: Iterable[Awaitable[T]]) -> list[T]:
    """The results of ``futures`` in order, as :func:`asyncio.gather`; futures of
    operations already submitted are joined by one waiter."""
    tasks = list(futures)
    if len(tasks) == 1:  # the common small call: no gather machinery
        return [await tasks[0]]
    for t in tasks:
        if not isinstance(t, asyncio.Future):
            return list(await asyncio.gather(*tasks))
    # Futures of operations already submitted: as asyncio.gather (done when all are,
    # or at the first failure; a cancelled caller cancels them), with one waiter.
    futs = cast(list[asyncio.Future[T]], tasks)
    failed: asyncio.Future[T] | None = None
    left = 0
    for f in futs:
        if not f.done():
            left += 1
        elif failed is None and (f.cancelled() or f.exception() is not None):
            failed = f
    if left and failed is None:
        join = Join(futs[0].get_loop().create_future(), left)
        for f in futs:
            if not f.done():
                f.add_done_callback(join.done)
        try:
            await join.waiter
        except BaseException:
            for f in futs:
                f.cancel()
            raise
        failed = join.failed
    if failed is not None:
        for f in futs:  # no "exception never retrieved" left behind
            if not f.done():
                f.add_done_callback(retrieve)
            elif not f.cancelled():
                f.exception()
        failed.result()  # raises
    return [f.result() for f in futs]


def ignore(fut: asyncio.Future[Any]) -> None:
    """A callback: the future's outcome is not needed (its error counts as seen)."""
    if not fut.cancelled():
        fut.exception()


def pass_on(
    piece: asyncio.Future[dict[str, Any]], *, target: asyncio.Future[dict[str, Any]]
) -> None:
    if target.done():
        return
    if piece.cancelled():
        target.cancel()
    elif (exc := piece.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(piece.result())


def join_moved(
    joined: asyncio.Future[list[dict[str, Any]]],
    *,
    target: asyncio.Future[dict[str, Any]],
    plan: Resplit,
) -> None:
    """Hand an operation split again after ``MOVED`` the joined result of its pieces."""
    if target.done():
        return
    if joined.cancelled():
        target.cancel()
    elif (exc := joined.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(join_resplit(plan, joined.result()))


class Join:
    """Wakes ``waiter`` once ``left`` futures are done, or at the first that failed."""

    __slots__ = ("failed", "left", "waiter")

    def __init__(self, waiter: asyncio.Future[None], left: int) -> None:
        self.waiter = waiter
        self.left = left
        self.failed: asyncio.Future[Any] | None = None

    def done(self, fut: asyncio.Future[Any]) -> None:
        self.left -= 1
        if self.failed is not None or self.waiter.done():
            retrieve(fut)  # the caller has its answer (or gave up)
        elif fut.cancelled() or fut.exception() is not None:
            self.failed = fut
            self.waiter.set_result(None)
        elif self.left == 0:
            self.waiter.set_result(None)


def retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's error as seen (its caller gave up on it)."""
    if not fut.cancelled():
        fut.exception()


def split_result(
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
