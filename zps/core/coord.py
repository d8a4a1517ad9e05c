"""Training coordination kept by the broker: worker clocks and data tasks.

No I/O and no clock reads; the broker driver feeds events in and sends what
comes out.

Clocks (``sync`` and ``ssp`` modes).  A worker's clock is the number of steps
it has finished.  Participants are the live workers that have ticked at
least once; a worker that dies or leaves stops being one at once, so a step
never waits for the dead.

* ``ssp(tau)``: a worker that finished step ``c`` may start step ``c + 1``
  once the slowest participant has finished at least ``c + 1 - tau`` steps.
* ``sync``: every participant pushes its step-``c`` gradients tagged with
  ``c`` (the shards buffer them per worker), then ticks.  When all
  participants have ticked ``c``, the broker commits step ``c`` on every
  primary (aggregating exactly those workers' gradients, applied once) and
  only then releases the workers into step ``c + 1``.  A step is committed
  exactly once, in order.

Tasks.  A job is a data set of ``n_records`` cut into tasks of ``per_task``
records, for ``epochs`` epochs, handed out in a shuffled order per epoch.  A
task held by a worker that dies goes back to the front of the queue; after
``max_retries`` such returns the job fails with a clear error.  A worker
asking for a task while none is free but some are still held elsewhere
waits; when every task is done the job is complete.

Job control (an operator's, see :data:`zps.protocol.messages.OPERATOR_TASK_OPS`).  A job is
in one state (:meth:`Job.state`): ``pending`` (no task handed out), ``running``,
``complete``, ``failed`` or ``cancelled``; the last three are finished.  ``cancel``
hands out no more tasks (a worker asking gets none, as for a complete job); the tasks
held go on and may still be reported done.  ``reset`` puts the job back to its start
(every task queued, no retries counted, not failed nor cancelled); the tasks held at
that moment are orphaned: their holders' reports are answered as accepted and counted
for nothing.  A ``create`` of a finished job changes nothing unless it asks for a
restart, which is a reset (with the new settings, if they differ); a restart of a job
that is not finished is a plain ``create``, so that every worker may ask for one.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from zps.core.brokerstate import ClockRecord, JobRecord
from zps.protocol.messages import Mode


@dataclass
class _Clock:
    step: int = 0  # steps finished
    waiting: bool = False  # has asked to start step ``step`` and was not yet released


class Clocks:
    """Worker clocks for one job; returns which workers may proceed."""

    def __init__(self) -> None:
        self.mode: Mode | None = None
        self.tau = 0
        self.workers: dict[str, _Clock] = {}
        self.committed = -1  # sync: the last committed step
        self.committing: int | None = None  # sync: a commit in progress
        self.commit_workers: tuple[str, ...] = ()
        #: sync: the last step a worker's tick proves committed (a tick that finishes
        #: step c comes from a worker released into c, so c - 1 was committed).  A
        #: restored record may be older than what the workers saw; joins start above it.
        self.proven = -1

    def to_record(self) -> ClockRecord:
        return ClockRecord(
            mode=self.mode,
            tau=self.tau,
            workers=tuple((w, c.step, c.waiting) for w, c in self.workers.items()),
            committed=self.committed,
            committing=self.committing,
            commit_workers=self.commit_workers,
        )

    @classmethod
    def from_record(cls, rec: ClockRecord) -> Clocks:
        """The clocks a previous broker recorded.  Waiting workers re-send their
        ticks to the new broker, which answers them; a commit in progress is
        sent again (the shards answer a repeated one from their dedup record)."""
        clocks = cls()
        clocks.mode, clocks.tau = rec.mode, rec.tau
        clocks.workers = {w: _Clock(step, waiting) for w, step, waiting in rec.workers}
        clocks.committed, clocks.committing = rec.committed, rec.committing
        clocks.commit_workers = rec.commit_workers
        return clocks

    def _adopt(self, mode: Mode, tau: int) -> None:
        """The first participant sets the job's mode; the others must agree."""
        if self.mode is None or not self.workers:
            self.mode, self.tau = mode, tau
        elif (mode, tau) != (self.mode, self.tau):
            raise ValueError(
                f"this job runs {self.mode.value} (tau {self.tau}); a worker "
                f"asked for {mode.value} (tau {tau})"
            )

    def tick(self, worker: str, mode: Mode, tau: int, finished: int) -> None:
        """``worker`` finished step ``finished - 1`` (so its clock is ``finished``)."""
        self._adopt(mode, tau)
        c = self.workers.setdefault(worker, _Clock(step=finished))
        c.step, c.waiting = max(c.step, finished), True
        self.proven = max(self.proven, finished - 2)

    def join(self, worker: str, mode: Mode, tau: int) -> int:
        """A worker joins; returns the step it starts at (sync: the open step)."""
        self._adopt(mode, tau)
        if self.mode is Mode.SYNC:
            last = self.committed if self.committing is None else self.committing
            start = max(last, self.proven) + 1
        else:
            start = min((c.step for c in self.workers.values()), default=0)
        self.workers[worker] = _Clock(step=start)
        return start

    def leave(self, worker: str) -> None:
        self.workers.pop(worker, None)

    def slowest(self) -> int:
        return min((c.step for c in self.workers.values()), default=0)

    def ssp_released(self) -> list[str]:
        """Workers allowed to start their next step now (ssp and async)."""
        floor = self.slowest()
        out = []
        for name, c in self.workers.items():
            if c.waiting and (self.mode is not Mode.SSP or floor >= c.step - self.tau):
                c.waiting = False
                out.append(name)
        return out

    def sync_ready(self) -> int | None:
        """The step to commit now, if every participant finished it."""
        if self.committing is not None or not self.workers:
            return None
        step = self.committed + 1
        if all(c.waiting and c.step >= step + 1 for c in self.workers.values()):
            self.committing = step
            self.commit_workers = tuple(sorted(self.workers))
            return step
        return None

    def sync_committed(self, step: int) -> list[str]:
        """The commit of ``step`` finished everywhere: release its workers."""
        if self.committing != step:
            return []
        self.committing, self.committed = None, step
        return self.sync_released()

    def sync_released(self) -> list[str]:
        """Waiting workers whose step is committed: release them.  Exactly that step:
        a worker already waiting on a later one (its tick re-sent to a broker that
        took over with a record a moment old) waits for that later commit."""
        out = []
        for name, c in self.workers.items():
            if c.waiting and c.step == self.committed + 1:
                c.waiting = False
                out.append(name)
        return out


@dataclass(frozen=True)
class Task:
    job: str
    task_id: int
    epoch: int
    start: int
    stop: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "task": self.task_id,
            "epoch": self.epoch,
            "start": self.start,
            "stop": self.stop,
        }


class JobFailed(Exception):
    """A task came back more often than the job allows."""


#: The settings of a job, in the order of :meth:`Job.spec`.
SPEC_FIELDS = ("n_records", "per_task", "epochs", "max_retries", "seed")


@dataclass
class Job:
    name: str
    n_records: int
    per_task: int
    epochs: int
    max_retries: int = 3
    seed: int = 0
    queue: deque[Task] = field(default_factory=deque)
    held: dict[int, tuple[str, Task]] = field(default_factory=dict)
    retries: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    failed: str | None = None
    #: Tasks held when a previous broker recorded the job: the holder may never
    #: have received one (the broker died before answering), so a holder asking
    #: for a task gets its own back first.
    unconfirmed: set[int] = field(default_factory=set)
    cancelled: bool = False
    #: (task id, worker) held when the job was reset: reports of them count for nothing.
    orphaned: set[tuple[int, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.n_records < 1 or self.per_task < 1 or self.epochs < 1 or self.max_retries < 0:
            raise ValueError("a job needs n_records, per_task, epochs >= 1 and max_retries >= 0")
        per_epoch = -(-self.n_records // self.per_task)
        for epoch in range(self.epochs):
            order = list(range(per_epoch))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            for k in order:
                start = k * self.per_task
                self.queue.append(
                    Task(
                        self.name,
                        epoch * per_epoch + k,
                        epoch,
                        start,
                        min(start + self.per_task, self.n_records),
                    )
                )
        self.total = len(self.queue)
        self.per_epoch = per_epoch

    def to_record(self) -> JobRecord:
        return JobRecord(
            name=self.name,
            n_records=self.n_records,
            per_task=self.per_task,
            epochs=self.epochs,
            max_retries=self.max_retries,
            seed=self.seed,
            queue=tuple(t.task_id for t in self.queue),
            held=tuple((tid, worker) for tid, (worker, _) in self.held.items()),
            retries=tuple(self.retries.items()),
            done=tuple(sorted(self.done)),
            failed=self.failed,
            cancelled=self.cancelled,
            orphaned=tuple(sorted(self.orphaned)),
        )

    @classmethod
    def from_record(cls, rec: JobRecord) -> Job:
        """The job as a previous broker recorded it: the tasks are rebuilt from the
        settings and put back where they were (queued in order, held, done)."""
        job = cls(rec.name, rec.n_records, rec.per_task, rec.epochs, rec.max_retries, rec.seed)
        tasks = {t.task_id: t for t in job.queue}
        if set(rec.queue) | {t for t, _ in rec.held} | set(rec.done) != set(tasks):
            raise ValueError(f"job {rec.name!r}: the recorded tasks do not match its settings")
        job.queue = deque(tasks[t] for t in rec.queue)
        job.held = {t: (worker, tasks[t]) for t, worker in rec.held}
        job.retries = dict(rec.retries)
        job.done = set(rec.done)
        job.failed = rec.failed
        job.unconfirmed = set(job.held)
        job.cancelled = rec.cancelled
        job.orphaned = set(rec.orphaned)
        return job

    def spec(self) -> tuple[int, int, int, int, int]:
        """The job's settings, named by :data:`SPEC_FIELDS`."""
        return (self.n_records, self.per_task, self.epochs, self.max_retries, self.seed)

    @property
    def complete(self) -> bool:
        return len(self.done) == self.total

    @property
    def finished(self) -> bool:
        """Complete, failed or cancelled: no task will be handed out."""
        return self.complete or self.failed is not None or self.cancelled

    def state(self) -> str:
        if self.failed is not None:
            return "failed"
        if self.cancelled:
            return "cancelled"
        if self.complete:
            return "complete"
        return "running" if self.held or self.done else "pending"

    def epoch(self) -> int:
        """The first epoch with a task not done (``epochs`` when the job is complete)."""
        missing = (i for i in range(self.total) if i not in self.done)
        first = next(missing, None)
        return self.epochs if first is None else first // self.per_epoch

    def cancel(self) -> None:
        """Hand out no more tasks; the tasks held may still be reported done."""
        self.cancelled = True

    def reset(self, spec: tuple[int, int, int, int, int] | None = None) -> None:
        """Back to the start (with ``spec``'s settings, if given): every task queued in
        the shuffled order of the settings; the tasks held now are orphaned."""
        fresh = Job(self.name, *(spec or self.spec()))
        self.orphaned |= {(tid, worker) for tid, (worker, _) in self.held.items()}
        self.n_records, self.per_task, self.epochs = fresh.n_records, fresh.per_task, fresh.epochs
        self.max_retries, self.seed = fresh.max_retries, fresh.seed
        self.queue, self.total, self.per_epoch = fresh.queue, fresh.total, fresh.per_epoch
        self.held, self.retries, self.done, self.unconfirmed = {}, {}, set(), set()
        self.failed, self.cancelled = None, False

    def next(self, worker: str) -> Task | None:
        """A task for ``worker``; None if none is free right now (see :attr:`complete`),
        or the job was cancelled."""
        if self.failed:
            raise JobFailed(self.failed)
        if self.cancelled:
            return None
        for tid in sorted(self.unconfirmed):
            held = self.held.get(tid)
            if held is not None and held[0] == worker:
                self.unconfirmed.discard(tid)
                return held[1]
        if not self.queue:
            return None
        task = self.queue.popleft()
        self.held[task.task_id] = (worker, task)
        return task

    def finish(self, worker: str, task_id: int) -> bool:
        held = self.held.get(task_id)
        if held is None or held[0] != worker:
            if (task_id, worker) in self.orphaned:  # held across a reset: counts for nothing
                self.orphaned.discard((task_id, worker))
                return True
            return task_id in self.done  # a repeated report is fine; a stranger's is not
        del self.held[task_id]
        self.unconfirmed.discard(task_id)
        self.done.add(task_id)
        return True

    def release(self, worker: str, task_id: int, *, failed: bool) -> None:
        """Put a held task back (first in line); ``failed`` counts a retry."""
        held = self.held.get(task_id)
        if held is None or held[0] != worker:
            self.orphaned.discard((task_id, worker))
            return
        del self.held[task_id]
        self.unconfirmed.discard(task_id)
        if failed:
            n = self.retries[task_id] = self.retries.get(task_id, 0) + 1
            if n > self.max_retries:
                t = held[1]
                self.failed = (
                    f"job {self.name!r}: task {task_id} (epoch {t.epoch}, records "
                    f"{t.start}-{t.stop}) failed {n} times (max_retries "
                    f"{self.max_retries})"
                )
        self.queue.appendleft(held[1])

    def worker_gone(self, worker: str) -> list[int]:
        self.orphaned = {o for o in self.orphaned if o[1] != worker}
        lost = [tid for tid, (w, _) in self.held.items() if w == worker]
        for tid in lost:
            self.release(worker, tid, failed=True)
        return lost

    def create(self, spec: tuple[int, int, int, int, int], *, restart: bool) -> str:
        """A ``create`` of this existing job: ``"exists"`` (nothing changes),
        ``"finished"`` (nothing changes: the job is complete, failed or cancelled) or
        ``"restarted"`` (a finished job reset, with ``spec``'s settings).  Other settings
        than the job's are refused unless they restart a finished job."""
        if self.finished and restart:
            self.reset(spec)
            return "restarted"
        if spec != self.spec():
            hint = " (restart=True runs it again with these)" if self.finished else ""
            differ = ", ".join(
                f"{name} {have} (asked {asked})"
                for name, have, asked in zip(SPEC_FIELDS, self.spec(), spec, strict=True)
                if have != asked
            )
            raise ValueError(f"job {self.name!r} exists with other settings: {differ}{hint}")
        return "finished" if self.finished else "exists"

    def progress(self) -> dict[str, Any]:
        epochs = []
        for e in range(self.epochs):
            ids = range(e * self.per_epoch, (e + 1) * self.per_epoch)
            done = sum(1 for i in ids if i in self.done)
            held = sum(1 for i in ids if i in self.held)
            epochs.append({"epoch": e, "done": done, "running": held, "total": self.per_epoch})
        return {
            "job": self.name,
            "state": self.state(),
            "epoch": self.epoch(),
            "n_epochs": self.epochs,
            "records": self.n_records,
            "per_task": self.per_task,
            "done": len(self.done),
            "total": self.total,
            "running": len(self.held),
            "retried": sum(self.retries.values()),
            "failed": self.failed,
            "epochs": epochs,
        }
