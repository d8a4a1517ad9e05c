"""The training coordination calls of the client: the step clock, data tasks, progress.

A part of :class:`zps.client.client.Client` beside its connection, given only what it
needs of it (:class:`BrokerLink`): every call here is a broker call (CLOCK or TASK) made
through the request machinery, so it is matched by request id, re-sent after a broker
restart and bounded by the client's timeout unless it waits on other workers
(``forever``).  The step (``_step``) changes only from a broker's answer, or locally in
async mode where there is no shared clock.

The connection's :class:`~zps.ops.meter.ClientMeter` counts every request message,
outcome and broker call; this part counts the steps in it: zps-worker exports it as
metrics (with how long ago the function last made progress).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from zps.client.progress import Progress
from zps.core.coord import Task
from zps.ops.config import ClientConfig
from zps.ops.meter import ClientMeter
from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import Heartbeat, TrainReport

log = logging.getLogger("zps.client")


class _Reports:
    """What ``report()`` recorded since the last :meth:`take` (any thread may add)."""

    def __init__(self, now: float) -> None:
        self._lock = threading.Lock()
        self._since = now
        self._rows = 0.0
        self._steps = 0
        self._loss_sum = 0.0
        self._losses = 0

    def add(self, rows: float, loss: float | None) -> None:
        with self._lock:
            self._rows += rows
            self._steps += 1
            if loss is not None:
                self._loss_sum += loss
                self._losses += 1

    def take(self, job: str | None, now: float) -> TrainReport | None:
        """The reports since the last take, for ``job`` (None: nothing, or no job)."""
        with self._lock:
            rows, steps, since = self._rows, self._steps, self._since
            loss = self._loss_sum / self._losses if self._losses else None
            self._since, self._rows, self._steps = now, 0.0, 0
            self._loss_sum, self._losses = 0.0, 0
        if job is None or steps == 0:
            return None
        return TrainReport(job, float(rows), max(0.0, now - since), steps, loss)


class BrokerLink(Protocol):
    """What the training calls need of the connection."""

    @property
    def config(self) -> ClientConfig: ...
    @property
    def meter(self) -> ClientMeter: ...
    async def broker_call(
        self, mtype: MsgType, header: dict[str, Any], forever: bool = False
    ) -> dict[str, Any]: ...
    async def flush(self) -> None: ...
    async def control(self, frames: list[Any]) -> None: ...
    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...


class TrainingCalls:
    """Sync/ssp/async step clock, data tasks and per-step metrics."""

    #: Set when the worker is asked to stop (zps-worker's SIGTERM): finish
    #: the step, flush, release the task, return.
    stop_requested: bool

    def __init__(self, link: BrokerLink) -> None:
        self._link = link
        self.config = link.config
        self.meter = link.meter
        self._broker_call = link.broker_call
        self._step = 0
        self.stop_requested = False
        self.progress = Progress(name=self.config.name, enabled=False)
        self._reports = _Reports(time.monotonic())
        #: The job reports are for: that of the last task handed out, else the last created.
        self._report_job: str | None = None
        #: The tasks :meth:`next_task` handed this client, per job it asked (0: none:
        #: the job had nothing left; zps-worker says so).
        self.tasks_taken: dict[str, int] = {}

    async def start(self) -> None:
        """Once connected: report progress; in sync and ssp mode join the step clock."""
        self._link.spawn(self._report_loop())
        if self.config.mode != "async":
            reply = await self._broker_call(MsgType.CLOCK, self._clock_header("join"))
            self._step = int(reply["step"])

    # -- training modes ------------------------------------------------------

    @property
    def step(self) -> int:
        """The step this worker is in (sync and ssp: as the broker counts)."""
        return self._step

    def report(self, *, rows: float = 0, loss: float | None = None, **extra: float) -> None:
        """Per-step metrics for the progress display (zps-worker shows them); also
        progress in the worker's metrics."""
        self.meter.stepped(time.monotonic())
        self.progress.report(rows=rows, loss=loss, **extra)
        if loss is not None and not math.isfinite(loss):
            loss = None  # a diverged step is not plotted
        self._reports.add(float(rows), loss)

    async def _report_loop(self) -> None:
        """Every heartbeat interval, what ``report()`` recorded goes to the broker on a
        heartbeat (for its status page and per-job series); a lost one is not re-sent."""
        interval = self.config.heartbeat.interval
        while True:
            await asyncio.sleep(interval)
            await self.send_reports()

    async def send_reports(self) -> None:
        """What ``report()`` recorded since the last heartbeat, sent now (the client's
        close sends the last of them, so a job's rows and steps count every report)."""
        train = self._reports.take(self._report_job, time.monotonic())
        if train is not None:
            await self._link.control(encode(Route(MsgType.HEARTBEAT), Heartbeat(train).to_wire()))

    def tagged(self, body: dict[str, Any]) -> dict[str, Any]:
        """A push's ``body``, in sync mode with the step its gradient is for."""
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
        began = time.monotonic()
        await self._link.flush()
        if self.config.mode != "async":
            header = self._clock_header("tick")
            header["finished"] = self._step + 1
            reply = await self._broker_call(MsgType.CLOCK, header, forever=True)
            self._step = int(reply["step"])
        else:
            self._step += 1
        now = time.monotonic()
        self.meter.clocked(now - began, now)
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
        restart: bool = False,
    ) -> dict[str, Any]:
        """Declare a data set of ``n_records`` cut into tasks (idempotent for the same
        settings); returns its progress, whose ``state`` says where the job is.

        A job that is finished (``complete``, ``failed`` or ``cancelled``) is left as it
        is, and this says so in a warning: :meth:`next_task` will hand out nothing.
        ``restart=True`` runs a finished job again from the start (with these settings);
        on a job not finished it changes nothing, so every worker may pass it.  With
        CURVE key roles on, a restart needs the operator's key.
        """
        header: dict[str, Any] = {
            "op": "create",
            "job": job,
            "n_records": n_records,
            "per_task": per_task,
            "epochs": epochs,
            "max_retries": max_retries,
            "seed": seed,
        }
        if restart:
            header["restart"] = True
        reply = await self._broker_call(MsgType.TASK, header)
        self._report_job = job
        progress = dict(reply["progress"])
        if reply.get("outcome") == "finished":
            log.warning(
                "job %r is %s (%d of %d tasks done): no task will be handed out; "
                "create_job(..., restart=True) or `zps-server job reset %s` runs it again",
                job,
                progress.get("state"),
                progress.get("done", 0),
                progress.get("total", 0),
                job,
            )
        return progress

    async def list_jobs(self) -> list[dict[str, Any]]:
        """Every job's progress (``job``, ``state``, ``epoch``, ``done``, ``total``, ...)."""
        reply = await self._broker_call(MsgType.TASK, {"op": "list"})
        return [dict(j) for j in reply["jobs"]]

    async def job(self, name: str) -> dict[str, Any]:
        """The progress of the job ``name`` (:class:`BadRequestError` if there is none)."""
        reply = await self._broker_call(MsgType.TASK, {"op": "show", "job": name})
        return dict(reply["progress"])

    async def cancel_job(self, name: str) -> dict[str, Any]:
        """Cancel the job ``name``: no more tasks are handed out (a worker's
        :meth:`next_task` returns None); tasks held may still be reported done.
        Returns its progress.  With CURVE key roles on, this needs the operator's key."""
        reply = await self._broker_call(MsgType.TASK, {"op": "cancel", "job": name})
        return dict(reply["progress"])

    async def reset_job(self, name: str) -> dict[str, Any]:
        """Put the job ``name`` back to its start (every task to do again, not failed nor
        cancelled); reports of tasks held now count for nothing.  Returns its progress.
        With CURVE key roles on, this needs the operator's key."""
        reply = await self._broker_call(MsgType.TASK, {"op": "reset", "job": name})
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
        taken = self.tasks_taken.get(job, 0)
        self.tasks_taken[job] = taken if t is None else taken + 1
        if t is None:
            if reply.get("state") in ("cancelled", "failed"):
                log.warning("job %r is %s: no more tasks", job, reply["state"])
            return None
        self._report_job = t["job"]
        return Task(t["job"], t["task"], t["epoch"], t["start"], t["stop"])

    async def task_done(self, task: Task) -> None:
        await self._broker_call(MsgType.TASK, {"op": "done", "job": task.job, "task": task.task_id})

    async def release_task(self, task: Task) -> None:
        """Give a task back unfinished (e.g. on shutdown): another worker takes it."""
        await self._broker_call(
            MsgType.TASK, {"op": "release", "job": task.job, "task": task.task_id}
        )
