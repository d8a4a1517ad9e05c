"""The routing brokers in a simulated run (the ``routers`` fault, with ``--real-client``).

:class:`RealRouter` runs :class:`zps.broker.router.Router` itself (``zps-server broker
--follow``), unchanged, as a process (:class:`~zps.testing.sim.aioloop.Proc`) on the
run's one event loop, through the seams of :mod:`.routernet` (transport, clock, pid): it
follows the broker (or the pair) as a client does, is listed in the map, and forwards
the requests of the partitions the map gives it between the real clients and the real
shards.  Each router runs on a host of the shards (``h0``, ``h1``, ...: :func:`hosts`),
so the map gives a partition the router on its primary's host.

A kill cancels its tasks at once (nothing of it survives, and nothing needs to); a
restart is a new ``Router``.  What each incarnation counted (``RouterStats``) is added
to :attr:`RealRouter.totals` as it ends, so a run can tell how much went through the
routers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from zps.broker.router import Router
from zps.ops.config import BrokerConfig, Heartbeat
from zps.testing.sim import routernet
from zps.testing.sim.aioloop import Proc, SimLoop
from zps.testing.sim.nodes import HB, LIVE
from zps.testing.sim.pair import PEER_TIMEOUT

World = Any

#: Shards per host in a run with routers (one router per host).
SHARDS_PER_HOST = 2


def hosts(shards: list[str]) -> dict[str, str]:
    """The host of each shard (by name, in order): ``SHARDS_PER_HOST`` a host."""
    return {name: f"h{i // SHARDS_PER_HOST}" for i, name in enumerate(shards)}


class RealRouter:
    """One routing broker of the run: the real ``Router`` as a simulated process on
    ``host`` (its node is ``name``, its endpoint ``sim://NAME``)."""

    def __init__(self, world: World, name: str, host: str) -> None:
        self.w = world
        self.name = name
        self.host = host
        self.alive = False
        self.starts = 0
        self.router: Router | None = None
        self.proc: Proc | None = None
        self.node: routernet.RouterNode | None = None
        #: What every incarnation that ended counted (RouterStats' fields).
        self.totals: Counter[str] = Counter()

    @property
    def loop(self) -> SimLoop:
        loop: SimLoop = self.w.loop
        return loop

    @property
    def endpoint(self) -> str:
        return f"sim://{self.name}"

    def config(self) -> BrokerConfig:
        follow = ",".join(f"sim://{b.name}" for b in self.w.brokers)
        return BrokerConfig(
            bind=self.endpoint,
            follow=follow,
            host=self.host,
            heartbeat=Heartbeat(interval=HB, liveness=LIVE),
            peer_timeout=PEER_TIMEOUT,
        )

    def counted(self) -> Counter[str]:
        """What every incarnation counted so far, the running one included."""
        out = Counter(self.totals)
        if self.alive and self.router is not None:
            out.update(vars(self.router.stats))
        return out

    # -- life --------------------------------------------------------------------

    def start(self) -> None:
        w = self.w
        self.starts += 1
        self.alive = True
        w.sched.log(f"{self.name} (router on {self.host}) starts")
        self.node = routernet.attach(w.net, self.name)
        proc = self.proc = Proc(self.name)
        router = self.router = proc.context.run(Router, self.config())
        task = self.loop.spawn(proc, router.run())
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.w.fail(f"the router {self.name}'s process failed: {task.exception()!r}")

    def stop(self) -> None:
        """The process is gone (killed, or its machine lost power)."""
        if self.alive:
            self.w.sched.log(f"{self.name} stop")
        self.end()

    def end(self) -> None:
        """The process ends as a kill ends it (also at the end of a run, untraced): its
        tasks are cancelled and unwind at once."""
        router, proc = self.router, self.proc
        if self.alive and proc is not None:
            if proc.alive:
                self.loop.kill(proc)
                self.loop.settle()
            if router is not None:
                self.totals.update(vars(router.stats))
        self.alive = False
        self.w.net.detach(self.name)
        routernet.detach(self.name, self.node)
