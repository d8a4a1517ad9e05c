"""The broker's side of training coordination: clocks, sync commits, data tasks.

Glue between :mod:`zps.core.coord` (the rules) and the broker's socket: it keeps
who is waiting for what, sends the replies, and drives sync-mode commits on
every primary.  Replies carry the request's id, so clients match them to
their calls.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from zps.core.cluster import ClusterState
from zps.core.coord import Clocks, Job, JobFailed, Mode
from zps.protocol.codec import MsgType, Route, encode

log = logging.getLogger("zps.broker")

#: The pseudo client that commits sync steps; shards answer it through the broker.
COMMIT_TARGET = b"\x00commit"

Send = Callable[[list[Any]], Awaitable[bool]]


class Training:
    def __init__(self, state: ClusterState, send: Send) -> None:
        self.state = state
        self.send = send
        self.clocks = Clocks()
        self.jobs: dict[str, Job] = {}
        self._tick_waiters: dict[str, tuple[bytes, Route]] = {}
        self._task_waiters: list[tuple[bytes, str, Route, str]] = []
        self._commit_pending: set[int] = set()

    async def _reply(self, ident: bytes, route: Route, header: dict[str, Any]) -> None:
        await self.send([ident, *encode(Route(route.mtype, req_id=route.req_id), header)])

    # -- clocks ----------------------------------------------------------------

    async def on_clock(self, ident: bytes, node: str, route: Route, h: dict[str, Any]) -> None:
        op = h.get("op")
        try:
            mode = Mode(h.get("mode", "async"))
            tau = h.get("tau", 0)
            if type(tau) is not int or tau < 0:
                raise ValueError(f"staleness must be an integer >= 0, got {tau!r}")
            match op:
                case "join":
                    step = self.clocks.join(node, mode, tau)
                    log.info("worker %s joined %s training at step %d", node, mode.value, step)
                    await self._reply(ident, route, {"st": "OK", "step": step})
                case "tick":
                    finished = h.get("finished")
                    if type(finished) is not int or finished < 0:
                        raise ValueError("tick needs 'finished', a step count")
                    self.clocks.tick(node, mode, tau, finished)
                    self._tick_waiters[node] = (ident, route)
                    await self.advance()
                case "leave":
                    self.clocks.leave(node)
                    await self._reply(ident, route, {"st": "OK"})
                    await self.advance()
                case _:
                    raise ValueError(f"unknown clock operation {op!r}")
        except ValueError as e:
            await self._reply(ident, route, {"st": "BAD_REQUEST", "msg": str(e)})

    async def advance(self) -> None:
        """Release whoever may go on; start a sync commit when a step is complete."""
        if self.clocks.mode is Mode.SYNC:
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
                await self._reply(*waiter, {"st": "OK", "step": clock.step if clock else 0})

    async def _send_commit(self, p: int) -> None:
        step = self.clocks.committing
        primary = self.state.primary_of(p)
        if step is None or primary is None:
            return  # sent again when the map names a primary
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
        await self.send([primary.encode(), COMMIT_TARGET, *encode(route, header)])

    async def on_commit_reply(self, route: Route, h: dict[str, Any]) -> None:
        step = self.clocks.committing
        if step is None or route.req_id != step or route.partition not in self._commit_pending:
            return
        res = h.get("res")
        if h.get("st") != "OK" or not isinstance(res, list) or not res or res[0].get("st") != "OK":
            if h.get("st") in ("NOT_PRIMARY", "STALE_EPOCH"):
                return  # re-sent to the new primary when the map changes
            log.error("commit of step %d on partition %d failed: %s", step, route.partition, h)
        self._commit_pending.discard(route.partition)
        if not self._commit_pending:
            await self._release(self.clocks.sync_committed(step))
            await self.advance()

    async def on_map_change(self) -> None:
        for p in sorted(self._commit_pending):
            await self._send_commit(p)

    # -- tasks -----------------------------------------------------------------

    async def on_task(self, ident: bytes, node: str, route: Route, h: dict[str, Any]) -> None:
        op, name = h.get("op"), h.get("job")
        try:
            if not isinstance(name, str) or not name:
                raise ValueError("a task request needs a job name")
            if op == "create":
                spec = tuple(
                    h.get(k, d)
                    for k, d in (
                        ("n_records", 0),
                        ("per_task", 0),
                        ("epochs", 1),
                        ("max_retries", 3),
                        ("seed", 0),
                    )
                )
                if not all(type(v) is int for v in spec):
                    raise ValueError("job settings must be integers")
                job = self.jobs.get(name)
                if job is None:
                    job = self.jobs[name] = Job(name, *spec)
                    log.info(
                        "job %s: %d records in %d tasks per epoch, %d epochs",
                        name,
                        job.n_records,
                        job.per_epoch,
                        job.epochs,
                    )
                elif job.spec() != spec:
                    raise ValueError(f"job {name!r} exists with other settings {job.spec()}")
                await self._reply(ident, route, {"st": "OK", "progress": job.progress()})
                return
            job = self.jobs.get(name)
            if job is None:
                raise ValueError(f"unknown job {name!r} (create it first)")
            task_id = h.get("task")
            match op:
                case "next" if h.get("wait", True) is False:
                    try:
                        task = job.next(node)
                    except JobFailed as e:
                        await self._reply(ident, route, {"st": "JOB_FAILED", "msg": str(e)})
                        return
                    await self._reply(
                        ident,
                        route,
                        {
                            "st": "OK",
                            "task": task.to_wire() if task else None,
                            "pending": task is None and not job.complete,
                        },
                    )
                case "next":
                    self._task_waiters.append((ident, node, route, name))
                    await self._serve_tasks()
                case "done" if type(task_id) is int:
                    ok = job.finish(node, task_id)
                    await self._reply(
                        ident,
                        route,
                        {"st": "OK" if ok else "BAD_REQUEST", "msg": "" if ok else "not your task"},
                    )
                    await self._serve_tasks()
                case "release" if type(task_id) is int:
                    job.release(node, task_id, failed=False)
                    await self._reply(ident, route, {"st": "OK"})
                    await self._serve_tasks()
                case _:
                    raise ValueError(f"unknown task operation {op!r}")
        except ValueError as e:
            await self._reply(ident, route, {"st": "BAD_REQUEST", "msg": str(e)})

    async def _serve_tasks(self) -> None:
        """Answer parked 'next' requests that can be answered now."""
        still: list[tuple[bytes, str, Route, str]] = []
        for ident, node, route, name in self._task_waiters:
            job = self.jobs[name]
            try:
                task = job.next(node)
            except JobFailed as e:
                await self._reply(ident, route, {"st": "JOB_FAILED", "msg": str(e)})
                continue
            if task is not None:
                await self._reply(ident, route, {"st": "OK", "task": task.to_wire()})
            elif job.complete:
                await self._reply(ident, route, {"st": "OK", "task": None})
            else:
                still.append((ident, node, route, name))
        self._task_waiters = still

    # -- membership --------------------------------------------------------------

    async def worker_gone(self, node: str) -> None:
        self._task_waiters = [w for w in self._task_waiters if w[1] != node]
        self._tick_waiters.pop(node, None)
        requeued = [(job.name, job.worker_gone(node)) for job in self.jobs.values()]
        for name, tasks in requeued:
            if tasks:
                log.warning(
                    "worker %s died holding tasks %s of job %s: re-queued", node, tasks, name
                )
        if node in self.clocks.workers:
            self.clocks.leave(node)
            await self.advance()
        await self._serve_tasks()

    def status(self) -> dict[str, Any]:
        c = self.clocks
        return {
            "mode": c.mode.value if c.mode else None,
            "staleness": c.tau,
            "committed_step": c.committed,
            "workers": {w: k.step for w, k in c.workers.items()},
            "jobs": [job.progress() for job in self.jobs.values()],
        }
