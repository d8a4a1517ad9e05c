"""The broker's side of training coordination: clocks, sync commits, data tasks.

Glue between :mod:`zps.core.coord` (the rules) and the broker's socket: it keeps
who is waiting for what, sends the replies, and drives sync-mode commits on
every primary.  Replies carry the request's id, so clients match them to
their calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zps.broker.acceptance import COMMIT_TARGET
from zps.core.brokerstate import ClockRecord, JobRecord
from zps.core.cluster import ClusterState
from zps.core.coord import Clocks, Job, JobFailed, Task
from zps.ops.metrics import labelled
from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import (
    ClockRequest,
    Mode,
    Status,
    StatusReply,
    TaskRequest,
    TrainReport,
)

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("zps.broker")

Send = Callable[[list[Any]], Awaitable[bool]]

#: After a restore, joins wait at most this long for the recorded sync workers' ticks.
RESYNC_S = 3.0

#: A primary's refusals of a commit that pass: the commit is sent again (it is applied
#: once: the shard's dedup record and step buffer answer a repeat).
_COMMIT_RETRY = frozenset(
    {Status.NOT_PRIMARY, Status.STALE_EPOCH, Status.OVERLOADED, Status.NOT_ENOUGH_REPLICAS}
)
#: How long after such a refusal the commit goes again (the broker's timer checks).
COMMIT_RETRY_S = 0.1


#: Points of a job's loss and rows/s history kept; when full, neighbours are merged in
#: pairs and each point covers twice the time from then on.
HISTORY_POINTS = 240
#: The time one point covers at first, in seconds.
HISTORY_PERIOD_S = 1.0
#: Jobs whose reports are kept; the one reported least recently goes first.
HISTORY_JOBS = 32


@dataclass
class _Span:
    """The reports of one history point: rows and seconds per worker, loss."""

    start: float
    rows: dict[str, list[float]] = field(default_factory=dict)  # worker -> [rows, secs]
    loss_sum: float = 0.0
    loss_steps: int = 0

    def add(self, node: str, r: TrainReport) -> None:
        acc = self.rows.setdefault(node, [0.0, 0.0])
        acc[0] += r.rows
        acc[1] += r.secs
        if r.loss is not None and r.steps > 0:
            self.loss_sum += r.loss * r.steps
            self.loss_steps += r.steps

    def point(self) -> tuple[float, float | None, float]:
        """(start, mean loss, rows/s: each worker's rows over its own seconds, summed)."""
        # list(): one step under the GIL, as a scrape reads this from the metrics thread
        rate = sum(rows / secs for rows, secs in list(self.rows.values()) if secs > 0)
        loss = self.loss_sum / self.loss_steps if self.loss_steps else None
        return self.start, loss, rate


@dataclass
class _JobTrend:
    period: float
    points: list[tuple[float, float | None, float]] = field(default_factory=list)
    span: _Span | None = None
    rows: float = 0.0
    steps: int = 0
    loss: float | None = None  # the mean loss of the newest point that had one
    last: float = 0.0


class TrainingReports:
    """What workers report with ``ps.report`` (a :class:`TrainReport` on their
    heartbeats), per job: totals for ``/metrics`` and a bounded history of loss and
    rows/s for the status page.  No I/O: times (Unix seconds) are given."""

    def __init__(
        self,
        points: int = HISTORY_POINTS,
        period: float = HISTORY_PERIOD_S,
        jobs: int = HISTORY_JOBS,
    ) -> None:
        if points < 2 or period <= 0 or jobs < 1:
            raise ValueError("a report history needs points >= 2, period > 0 and jobs >= 1")
        self.max_points, self.period, self.max_jobs = points, period, jobs
        self.jobs: dict[str, _JobTrend] = {}

    def add(self, node: str, report: TrainReport, now: float) -> None:
        trend = self.jobs.pop(report.job, None)
        if trend is None:
            trend = _JobTrend(self.period)
            while len(self.jobs) >= self.max_jobs:
                del self.jobs[next(iter(self.jobs))]  # the least recently reported
        self.jobs[report.job] = trend  # most recently reported last
        trend.rows += report.rows
        trend.steps += report.steps
        trend.last = now
        if trend.span is not None and now >= trend.span.start + trend.period:
            self._close(trend)
        if trend.span is None:
            trend.span = _Span(now)
        trend.span.add(node, report)

    def _close(self, trend: _JobTrend) -> None:
        assert trend.span is not None
        point = trend.span.point()
        trend.points.append(point)
        if point[1] is not None:
            trend.loss = point[1]
        trend.span = None
        if len(trend.points) >= self.max_points:
            pairs = zip(trend.points[0::2], trend.points[1::2], strict=False)
            merged = [(a[0], _mean([a[1], b[1]]), (a[2] + b[2]) / 2) for a, b in pairs]
            if len(trend.points) % 2:
                merged.append(trend.points[-1])
            trend.points = merged
            trend.period *= 2

    def history(self) -> dict[str, dict[str, Any]]:
        """Per job: ``t`` (Unix seconds each point starts), ``loss`` (None where no
        report gave one), ``rows_per_s``; the span being filled is the last point."""
        out = {}
        for job, trend in self.jobs.items():
            points = list(trend.points)
            if trend.span is not None:
                points.append(trend.span.point())
            out[job] = {
                "t": [round(p[0], 3) for p in points],
                "loss": [p[1] for p in points],
                "rows_per_s": [round(p[2], 3) for p in points],
                "period_s": trend.period,
            }
        return out

    def totals(self) -> dict[str, tuple[float, int, float | None]]:
        """Per job: rows and steps reported in all, and the loss of its newest point
        that has one (every worker's reports over that span), for metrics."""
        out = {}
        for job, t in list(self.jobs.items()):
            span = t.span
            loss = span.point()[1] if span is not None and span.loss_steps else t.loss
            out[job] = (t.rows, t.steps, loss)
        return out


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def epoch_eta(done: int, total: int, start: tuple[float, int] | None, now: float) -> float | None:
    """Seconds until an epoch's ``total`` tasks are done at the pace since ``start``
    (when, and with how many done, its first task was handed out): 0 once done, None
    before a task of it was finished since."""
    if done >= total:
        return 0.0
    if start is None or done <= start[1] or now <= start[0]:
        return None
    return (total - done) * (now - start[0]) / (done - start[1])


class Training:
    """``send_durable`` sends once the broker's state, as it is now, is on disk: task
    replies go that way, so a task handed out or reported done is never forgotten by
    a restarted broker (clocks need not: workers re-send their ticks)."""

    def __init__(self, state: ClusterState, send: Send, send_durable: Send | None = None) -> None:
        self.state = state
        self.send = send
        self.send_durable = send_durable or send
        self.clocks = Clocks()
        self.jobs: dict[str, Job] = {}
        self._tick_waiters: dict[str, tuple[bytes, Route]] = {}
        self._task_waiters: list[tuple[bytes, str, Route, str]] = []
        #: The last answer to each worker's 'next' call, by its request id: a call that
        #: comes twice (queued by zmq while the broker was down, then re-sent by the
        #: client on the new broker's map) gets the same task, not a second one that
        #: its worker would never hear of and the job would wait for forever.
        self._next_answers: dict[str, tuple[int, dict[str, Any]]] = {}
        self._commit_pending: set[int] = set()
        #: Partitions whose primary refused the commit for a passing reason, and when
        #: to send it again (see on_commit_reply).
        self._commit_retry: dict[int, float] = {}
        #: Live resharding holds new sync commits while slots are being moved.
        self.paused = False
        #: sync, after a restore: the recorded workers not heard ticking yet, and the
        #: joins held until they are (or RESYNC_S passed): a recorded committed step may
        #: be older than what the workers saw, and their ticks tell (Clocks.proven).
        self._unsynced: set[str] = set()
        self._held_joins: list[tuple[bytes, str, Route, ClockRequest]] = []
        self._resync_until = 0.0
        #: What workers report (loss, rows/s), per job; not kept across a restart.
        self.reports = TrainingReports()
        #: (job, epoch) -> (time.monotonic(), tasks done) when its first task went out.
        self._epoch_start: dict[tuple[str, int], tuple[float, int]] = {}
        self._done_seen: dict[str, int] = {}  # job -> its tasks done at the last handout

    # -- what survives a restart -------------------------------------------------

    def records(self) -> tuple[ClockRecord, tuple[JobRecord, ...]]:
        return self.clocks.to_record(), tuple(job.to_record() for job in self.jobs.values())

    def restore(self, clocks: ClockRecord, jobs: tuple[JobRecord, ...]) -> None:
        """Take over a previous broker's jobs.  Callers re-send their unanswered calls
        to a restarted broker, so parked ticks and task requests come back by
        themselves; a sync commit in progress is sent again once the start-up hold
        has ended (a primary granted during the hold may still be displaced)."""
        self.clocks = Clocks.from_record(clocks)
        self.jobs = {rec.name: Job.from_record(rec) for rec in jobs}
        if self.clocks.committing is not None:
            self._commit_pending = set(range(self.state.n_partitions))
        if self.clocks.mode is Mode.SYNC and self.clocks.workers:
            self._unsynced = set(self.clocks.workers)
            self._resync_until = time.monotonic() + RESYNC_S

    async def _reply(
        self, ident: bytes, route: Route, header: dict[str, Any], *, durable: bool = True
    ) -> None:
        """A TASK reply goes once the state is on disk (``durable``: it may change a job)."""
        send = self.send_durable if durable and route.mtype is MsgType.TASK else self.send
        await send([ident, *encode(Route(route.mtype, req_id=route.req_id), header)])

    async def _status(self, ident: bytes, route: Route, status: Status, msg: str) -> None:
        await self._reply(ident, route, StatusReply(status, msg).to_wire())

    async def bad_request(self, ident: bytes, route: Route, error: str) -> None:
        """A CLOCK or TASK request whose header its record refused."""
        await self._status(ident, route, Status.BAD_REQUEST, error)

    # -- clocks ----------------------------------------------------------------

    async def on_clock(self, ident: bytes, node: str, route: Route, req: ClockRequest) -> None:
        mode, tau = req.mode, req.tau
        try:
            match req.op:
                case "join" if self._unsynced and time.monotonic() < self._resync_until:
                    self._held_joins.append((ident, node, route, req))
                case "join":
                    step = self.clocks.join(node, mode, tau)
                    log.info("worker %s joined %s training at step %d", node, mode.value, step)
                    await self._reply(ident, route, {"st": Status.OK.value, "step": step})
                case "tick":
                    assert req.finished is not None  # ClockRequest.parse checked it
                    self.clocks.tick(node, mode, tau, req.finished)
                    self._tick_waiters[node] = (ident, route)
                    await self.advance()
                    await self._synced(node)
                case "leave":
                    self.clocks.leave(node)
                    await self._reply(ident, route, {"st": Status.OK.value})
                    await self.advance()
                    await self._synced(node)
        except ValueError as e:  # the clock's rules (e.g. another mode than the others')
            await self._status(ident, route, Status.BAD_REQUEST, str(e))

    async def _synced(self, node: str | None) -> None:
        """``node`` was heard (or gone): answer the held joins once every recorded
        worker was, or the wait is over."""
        self._unsynced.discard(node or "")
        if not self._held_joins:
            return
        if self._unsynced and time.monotonic() < self._resync_until:
            return
        self._unsynced.clear()
        held, self._held_joins = self._held_joins, []
        for ident, joiner, route, req in held:
            await self.on_clock(ident, joiner, route, req)

    async def on_timer(self) -> None:
        """Called by the broker's timer: sends refused commits again when due, and ends
        a wait for the recorded workers."""
        if self._commit_retry:
            now = time.monotonic()
            for p, due in list(self._commit_retry.items()):
                if due <= now:
                    del self._commit_retry[p]
                    if p in self._commit_pending:
                        await self._send_commit(p)
        if self._held_joins and time.monotonic() >= self._resync_until:
            await self._synced(None)

    async def advance(self) -> None:
        """Release whoever may go on; start a sync commit when a step is complete."""
        if self.clocks.mode is Mode.SYNC:
            # A tick for a step already committed (re-sent after a broker took over).
            await self._release(self.clocks.sync_released())
            if self.paused:
                return  # a slot move is being cut over: the commit waits for its end
            step = self.clocks.sync_ready()
            if step is not None:
                self._commit_pending = set(range(self.state.n_partitions))
                log.debug("committing step %d for %d workers", step, len(self.clocks.workers))
                for p in sorted(self._commit_pending):
                    await self._send_commit(p)
            return
        await self._release(self.clocks.ssp_released())

    async def _release(self, workers: list[str]) -> None:
        for w in workers:
            waiter = self._tick_waiters.pop(w, None)
            if waiter is not None:
                clock = self.clocks.workers.get(w)
                reply = {"st": Status.OK.value, "step": clock.step if clock else 0}
                await self._reply(*waiter, reply)

    async def _send_commit(self, p: int) -> None:
        step = self.clocks.committing
        primary = self.state.primary_of(p)
        if step is None or primary is None or self.state.holding(time.monotonic()):
            return  # sent again when the map names a primary (or the hold ends)
        epoch = self.state.map.partitions[p].epoch
        header = {
            "cid": b"broker",
            "seq": step,
            "ops": [
                {
                    "op": "commit",
                    "step": step,
                    "workers": [w.encode() for w in self.clocks.commit_workers],
                }
            ],
        }
        route = Route(MsgType.REQUEST, p, epoch, step)
        # Durable first: a shard must not commit a step that a restarted broker (from its
        # data dir) would not know was being committed; it would release the workers
        # into that step again, and their pushes for it would be refused.
        await self.send_durable([primary.encode(), COMMIT_TARGET, *encode(route, header)])

    async def on_commit_reply(self, route: Route, h: dict[str, Any]) -> None:
        step = self.clocks.committing
        if step is None or route.req_id != step or route.partition not in self._commit_pending:
            return
        res = h.get("res")
        first = res[0] if isinstance(res, list) and res else None
        if h.get("st") != Status.OK or not isinstance(first, dict) or first.get("st") != Status.OK:
            if h.get("st") in _COMMIT_RETRY:
                # Nothing was applied, and the refusal passes (a copy resyncing after a
                # broker takeover, a full link, a lease the new broker has yet to renew):
                # sent again shortly, and to a new primary as soon as the map changes.
                # Counting it done would release the workers and drop their gradients.
                log.info(
                    "commit of step %d on partition %d refused (%s): sending it again",
                    step,
                    route.partition,
                    h.get("msg") or h.get("st"),
                )
                self._commit_retry.setdefault(route.partition, time.monotonic() + COMMIT_RETRY_S)
                return
            log.error("commit of step %d on partition %d failed: %s", step, route.partition, h)
        self._commit_retry.pop(route.partition, None)
        self._commit_pending.discard(route.partition)
        if not self._commit_pending:
            await self._release(self.clocks.sync_committed(step))
            await self.advance()

    @property
    def commit_in_flight(self) -> bool:
        return bool(self._commit_pending) or self.clocks.committing is not None

    async def on_map_change(self) -> None:
        for p in sorted(self._commit_pending):
            await self._send_commit(p)

    # -- tasks -----------------------------------------------------------------

    async def on_task(self, ident: bytes, node: str, route: Route, req: TaskRequest) -> None:
        name = req.job
        try:
            if req.settings is not None:  # create
                await self._create(ident, route, req)
                return
            if req.op == "list":
                jobs = [self._job_progress(job) for job in self.jobs.values()]
                await self._reply(
                    ident, route, {"st": Status.OK.value, "jobs": jobs}, durable=False
                )
                return
            job = self.jobs.get(name)
            if job is None:
                raise ValueError(f"unknown job {name!r} (create it first)")
            if req.op == "next" and await self._repeated_next(ident, node, route):
                return
            match req.op:
                case "next" if not req.wait:
                    try:
                        task = job.next(node)
                    except JobFailed as e:
                        await self._status(ident, route, Status.JOB_FAILED, str(e))
                        return
                    self._handed_out(job, task)
                    await self._answer_next(
                        ident,
                        node,
                        route,
                        {
                            "st": Status.OK.value,
                            "task": task.to_wire() if task else None,
                            "pending": task is None and not job.finished,
                            "state": job.state(),
                        },
                    )
                case "next":
                    self._task_waiters.append((ident, node, route, name))
                    await self._serve_tasks()
                case "done" if req.task is not None:
                    ok = job.finish(node, req.task)
                    status = Status.OK if ok else Status.BAD_REQUEST
                    await self._status(ident, route, status, "" if ok else "not your task")
                    await self._serve_tasks()
                case "release" if req.task is not None:
                    job.release(node, req.task, failed=False)
                    await self._reply(ident, route, {"st": Status.OK.value})
                    await self._serve_tasks()
                case "show":
                    reply = {"st": Status.OK.value, "progress": self._job_progress(job)}
                    await self._reply(ident, route, reply, durable=False)
                case "cancel" | "reset":
                    if req.op == "cancel":
                        job.cancel()
                    else:
                        job.reset()
                    log.warning(
                        "job %s %s by %s",
                        name,
                        "cancelled" if req.op == "cancel" else "reset",
                        node,
                    )
                    await self._reply(
                        ident, route, {"st": Status.OK.value, "progress": job.progress()}
                    )
                    await self._serve_tasks()
                case _:
                    raise ValueError(f"unknown task operation {req.op!r}")
        except ValueError as e:
            await self._status(ident, route, Status.BAD_REQUEST, str(e))

    def _job_progress(self, job: Job) -> dict[str, Any]:
        """The job's progress and how many workers wait for one of its tasks."""
        waiting = sum(1 for w in self._task_waiters if w[3] == job.name)
        return {**job.progress(), "waiting": waiting}

    async def _create(self, ident: bytes, route: Route, req: TaskRequest) -> None:
        assert req.settings is not None
        name, spec = req.job, req.settings.astuple()
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = Job(name, *spec)
            outcome = "created"
        else:
            outcome = job.create(spec, restart=req.restart)
        if outcome in ("created", "restarted"):
            log.info(
                "job %s %s: %d records in %d tasks per epoch, %d epochs",
                name,
                outcome,
                job.n_records,
                job.per_epoch,
                job.epochs,
            )
        reply = {"st": Status.OK.value, "progress": job.progress(), "outcome": outcome}
        await self._reply(ident, route, reply)
        if outcome == "restarted":
            await self._serve_tasks()

    async def _repeated_next(self, ident: bytes, node: str, route: Route) -> bool:
        """A 'next' call already answered (answer it the same) or parked (drop it)."""
        last = self._next_answers.get(node)
        if last is not None and last[0] == route.req_id:
            await self._reply(ident, route, last[1])
            return True
        return any(w[1] == node and w[2].req_id == route.req_id for w in self._task_waiters)

    async def _answer_next(
        self, ident: bytes, node: str, route: Route, header: dict[str, Any]
    ) -> None:
        self._next_answers[node] = (route.req_id, header)
        await self._reply(ident, route, header)

    async def _serve_tasks(self) -> None:
        """Answer parked 'next' requests that can be answered now."""
        still: list[tuple[bytes, str, Route, str]] = []
        for ident, node, route, name in self._task_waiters:
            job = self.jobs[name]
            try:
                task = job.next(node)
            except JobFailed as e:
                await self._status(ident, route, Status.JOB_FAILED, str(e))
                continue
            header: dict[str, Any]
            if task is not None:
                self._handed_out(job, task)
                header = {"st": Status.OK.value, "task": task.to_wire()}
                await self._answer_next(ident, node, route, header)
            elif job.finished:
                header = {"st": Status.OK.value, "task": None, "state": job.state()}
                await self._answer_next(ident, node, route, header)
            else:
                still.append((ident, node, route, name))
        self._task_waiters = still

    def _handed_out(self, job: Job, task: Task | None) -> None:
        """Note when each epoch's first task went out (its ETA counts from there); a
        job with fewer tasks done than at its last task handed out was reset or
        restarted, and its epochs start again."""
        if task is None:
            return
        done = len(job.done)
        if done < self._done_seen.get(job.name, 0):
            for key in [k for k in self._epoch_start if k[0] == job.name]:
                del self._epoch_start[key]
        self._done_seen[job.name] = done
        if (job.name, task.epoch) not in self._epoch_start:
            in_epoch = job.progress()["epochs"][task.epoch]["done"]
            self._epoch_start[job.name, task.epoch] = (time.monotonic(), in_epoch)

    def epoch_start(self, job: str, epoch: int) -> tuple[float, int] | None:
        """What ``epoch`` of ``job``'s ETA counts from: when its first task went out
        (``time.monotonic()``) and how many of its tasks were done then; None before
        any went out."""
        return self._epoch_start.get((job, epoch))

    def on_report(self, node: str, report: TrainReport, now: float) -> None:
        """A worker's heartbeat carried what it reported (``now``: Unix seconds)."""
        self.reports.add(node, report, now)

    # -- membership --------------------------------------------------------------

    async def worker_gone(self, node: str) -> None:
        self._task_waiters = [w for w in self._task_waiters if w[1] != node]
        self._tick_waiters.pop(node, None)
        self._next_answers.pop(node, None)
        self._held_joins = [j for j in self._held_joins if j[1] != node]
        requeued = [(job.name, job.worker_gone(node)) for job in self.jobs.values()]
        for name, tasks in requeued:
            if tasks:
                log.warning(
                    "worker %s died holding tasks %s of job %s: re-queued", node, tasks, name
                )
        if node in self.clocks.workers:
            self.clocks.leave(node)
            await self.advance()
        await self._synced(node)
        await self._serve_tasks()

    def status(self) -> dict[str, Any]:
        c = self.clocks
        return {
            "mode": c.mode.value if c.mode else None,
            "staleness": c.tau,
            "committed_step": c.committed,
            "workers": {w: k.step for w, k in c.workers.items()},
            "jobs": [self._progress(job) for job in self.jobs.values()],
            "history": self.reports.history(),
        }

    def metrics(self) -> Iterable[Metric]:
        """The per-job series (``zps_job_*{job_name}``; families without a job are left
        out).  The label is not ``job``: Prometheus gives that one to the scrape job."""
        totals = self.reports.totals()
        if totals:
            yield labelled(
                "counter",
                "zps_job_rows",
                "Rows the workers reported trained (ps.report), by job",
                "job_name",
                {job: rows for job, (rows, _, _) in totals.items()},
            )
            yield labelled(
                "counter",
                "zps_job_steps",
                "Steps the workers reported (ps.report calls), by job",
                "job_name",
                {job: float(steps) for job, (_, steps, _) in totals.items()},
            )
        losses = {job: loss for job, (_, _, loss) in totals.items() if loss is not None}
        if losses:
            yield labelled(
                "gauge",
                "zps_job_loss",
                "The mean loss the workers reported (ps.report) over the newest point of "
                "the job's history (a second at first), by job",
                "job_name",
                losses,
            )
        jobs = list(self.jobs.values())
        if jobs:
            yield labelled(
                "gauge",
                "zps_job_tasks",
                "Tasks of the job, all epochs",
                "job_name",
                {job.name: float(job.total) for job in jobs},
            )
            yield labelled(
                "gauge",
                "zps_job_tasks_done",
                "Tasks of the job done, all epochs",
                "job_name",
                {job.name: float(len(job.done)) for job in jobs},
            )

    def _progress(self, job: Job) -> dict[str, Any]:
        """A job's progress, each epoch with its ETA (``eta_s``, None if unknown)."""
        now = time.monotonic()
        progress = job.progress()
        for e in progress["epochs"]:
            key = (job.name, e["epoch"])
            start = self._epoch_start.get(key)
            if start is not None and e["done"] < start[1]:  # the job was reset: a new pace
                del self._epoch_start[key]
                start = None
            eta = epoch_eta(e["done"], e["total"], start, now)
            e["eta_s"] = None if eta is None else round(eta, 1)
        return progress
