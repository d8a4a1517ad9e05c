"""A deterministic asyncio event loop on the simulator's clock.

The real drivers are asyncio code; in a run they share one :class:`SimLoop` with the
whole simulated world.  The loop has no selector and never sleeps: its time is the
scheduler's (:meth:`SimLoop.time` is ``Scheduler.now``), each timer is an event on the
scheduler's heap (at its time, in the order it was set, as every other event), and the
callbacks made ready (``call_soon``: a task's step, a future's callbacks) run in a
drain event the scheduler runs at the same simulated time.  So the scheduler and the
loop keep one clock and one order, and a seed fixes the run.

A simulated process is a :class:`Proc`: its tasks run in a context that names it
(:data:`PROC`), so every callback they schedule carries it.  While its node is paused
(``Network.paused``) the loop holds its callbacks and runs them, in the order they
came due, when it resumes (a stopped process runs nothing, its timers included); a
process that is killed has its tasks cancelled at once (:meth:`SimLoop.kill`), so none
of its code runs on at a later simulated time.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
from asyncio import events
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from zps.testing.sim.sched import Scheduler

#: The simulated process a callback belongs to (None: the simulator's own).
PROC: contextvars.ContextVar[Proc | None] = contextvars.ContextVar("zps_sim_proc", default=None)

#: Ready callbacks run per drain event; more are left to the next one, at the same time.
DRAIN_BATCH = 10_000


class Proc:
    """One simulated process on the loop: its name (its network node) and tasks."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.alive = True
        self.tasks: list[asyncio.Task[Any]] = []
        self.context = contextvars.Context()
        self.context.run(PROC.set, self)
        #: Seconds a call handed to an executor of its own takes (a log write on the
        #: process's disk); None: it runs inline, as every other off-loop call does.
        self.io_delay: Callable[[], float] | None = None


class _Task(asyncio.Task):  # type: ignore[type-arg]
    """A task of the run, hashed by the order it was created in on its loop.

    Sets of tasks iterate in the order of their hashes: a TaskGroup that ends cancels
    its tasks in its set's order, and so on.  Hashed by address (the default), that order
    is the heap's, which a process's history decides, so a seed's run could differ
    between a fresh process and one that ran other code first."""

    def __init__(self, coro: Any, *, serial: int, **kw: Any) -> None:
        self._serial = serial
        super().__init__(coro, **kw)

    def __hash__(self) -> int:
        return self._serial


class SimLoop(asyncio.BaseEventLoop):
    """The run's one event loop (see the module notes).  ``paused(node)`` says whether a
    node's process is stopped; :meth:`thaw` runs what it held once it resumes."""

    def __init__(self, sched: Scheduler, paused: Callable[[str], bool]) -> None:
        super().__init__()
        self.sched = sched
        self._paused = paused
        self._frozen: list[events.Handle] = []
        serials = itertools.count()  # per loop: a run's tasks hash the same in any process

        def task(loop: Any, coro: Any, **kw: Any) -> asyncio.Task[Any]:
            return _Task(coro, loop=loop, serial=next(serials), **kw)

        self.set_task_factory(task)
        self._drain_due = False
        #: Exceptions a callback raised (a bug in the code run): the run fails on them.
        self.errors: list[str] = []
        self.set_exception_handler(self._on_error)

    def time(self) -> float:
        return self.sched.now

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        self._check_closed()  # type: ignore[attr-defined]
        timer = events.TimerHandle(when, callback, args, self, context)
        self.sched.at(when, functools.partial(self._fire, timer))
        return timer

    def _call_soon(
        self, callback: Callable[..., object], args: Any, context: contextvars.Context | None
    ) -> events.Handle:
        handle = events.Handle(callback, args, self, context)
        self._ready.append(handle)  # type: ignore[attr-defined]
        if not self._drain_due:
            self._drain_due = True
            self.sched.at(self.sched.now, self._drain)
        return handle

    def _fire(self, timer: asyncio.TimerHandle) -> None:
        if not timer.cancelled():
            self._run(timer)

    def _run(self, handle: events.Handle) -> None:
        proc = handle._context.get(PROC)  # type: ignore[attr-defined]
        if proc is not None and not proc.alive and isinstance(handle, events.TimerHandle):
            return  # a timer of a process that is gone: nothing of it runs on
        if proc is not None and proc.alive and self._paused(proc.name):
            self._frozen.append(handle)  # the process is stopped: it runs this on resuming
            return
        handle._run()

    def _write_to_self(self) -> None:
        """``call_soon_threadsafe``: nothing to wake (no thread, no selector)."""

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., Any], *args: Any
    ) -> asyncio.Future[Any]:
        """No thread: ``func`` runs inline, its future done at once (``to_thread`` and
        the default executor); a call handed to an executor of the process's own (its
        log's writer) runs once :attr:`Proc.io_delay` has passed, at that simulated time,
        as the process's (held while it is paused, never once it is gone)."""
        fut: asyncio.Future[Any] = self.create_future()
        proc = PROC.get()
        delay = proc.io_delay if proc is not None and proc.alive and executor is not None else None
        if delay is None:
            _settle_with(fut, func, args)
        else:
            self.call_later(delay(), _settle_with, fut, func, args)
        return fut

    def _drain(self) -> None:
        self._drain_due = False
        ready: deque[events.Handle] = self._ready  # type: ignore[attr-defined]
        for _ in range(min(len(ready), DRAIN_BATCH)):
            handle = ready.popleft()
            if not handle.cancelled():
                self._run(handle)
        if ready and not self._drain_due:
            self._drain_due = True
            self.sched.at(self.sched.now, self._drain)

    def thaw(self, node: str) -> None:
        """``node`` resumed: what its process held runs now, in the order it came due."""
        if not self._frozen:
            return
        held = [h for h in self._frozen if h._context.get(PROC).name == node]  # type: ignore[attr-defined]
        if not held:
            return
        self._frozen = [h for h in self._frozen if h not in held]
        for h in held:
            self._ready.append(h)  # type: ignore[attr-defined]
        if not self._drain_due:
            self._drain_due = True
            self.sched.at(self.sched.now, self._drain)

    # -- processes -------------------------------------------------------------

    def spawn(self, proc: Proc, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as ``proc``'s main task (every task it starts is the process's too)."""
        task: asyncio.Task[Any] = self.create_task(coro, context=proc.context.copy())
        return task

    def create_task(self, coro: Any, *, name: Any = None, context: Any = None) -> Any:
        task = super().create_task(coro, name=name, context=context)
        proc = (context.get(PROC) if context is not None else None) or PROC.get()
        if proc is not None:
            proc.tasks = [t for t in proc.tasks if not t.done()]
            proc.tasks.append(task)
        return task

    def kill(self, proc: Proc) -> None:
        """``proc``'s process is gone: its tasks are cancelled now (their cleanup runs in
        the drain that follows, at this simulated time), nothing of it stays held."""
        proc.alive = False
        for task in proc.tasks:
            task.cancel()
        held = [h for h in self._frozen if h._context.get(PROC) is proc]  # type: ignore[attr-defined]
        if held:
            self._frozen = [h for h in self._frozen if h not in held]
            self._ready.extend(held)  # type: ignore[attr-defined]
        if not self._drain_due:
            self._drain_due = True
            self.sched.at(self.sched.now, self._drain)

    def settle(self) -> None:
        """Run what is ready now (a killed process's cleanup) without advancing time."""
        while self._ready:  # type: ignore[attr-defined]
            self._drain()

    def _on_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "was destroyed but it is pending" in message:
            return
        exc = context.get("exception")
        self.errors.append(f"{message}: {exc!r}" if exc is not None else message)


def _settle_with(fut: asyncio.Future[Any], func: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Run ``func(*args)`` and set ``fut`` with its value or exception (unless cancelled)."""
    if fut.cancelled():
        return
    try:
        value = func(*args)
    except BaseException as e:  # the future carries it, as an executor's does
        fut.set_exception(e)
    else:
        fut.set_result(value)
