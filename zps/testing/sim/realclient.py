"""The real client in a simulated run (``--real-client``, which implies ``--real-shard``).

:class:`RealClient` runs the real async client, :class:`zps.client.client.Client`
(``zps.connect``) unchanged, as a process (:class:`~zps.testing.sim.aioloop.Proc`) on the
run's one event loop: its connection (:mod:`zps.client.connection`: the DEALER, the
receive, flush and heartbeat loops, the session's timer, HELLO again, maps, retries,
re-sends and deadlines) and its key-value calls (:mod:`zps.client.keyvalue`: the table
created, ids split by slot, rows pushed and pulled), through the seams of
:mod:`.clientnet`.  Its work is the stand-in's (:class:`~zps.testing.sim.simclient.SimClient`):
every 25 ms, while fewer than four of its pushes are unanswered, it pushes (with
probability 0.6) an integer gradient to a random row of the ``emb`` table, one
``push_rows`` call a push; each call's outcome goes to ``World.on_outcome`` (acknowledged,
or failed: maybe applied).  A kill cancels the process's tasks at once (what it had in
flight is maybe applied); a restart is a new process with a new client (a new client id).

The world's rows are ids chosen by the run's slot map: row ``r`` is the smallest id not
taken by a lower row whose slot the map gives partition ``r % partitions``, as the
stand-in routes row ``r``; once the ``reshard`` fault moves slots, the client routes each
row's id by the map it holds, as any worker's does.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np

from zps.client.client import Client
from zps.client.session import ClientSession
from zps.client.values import table_seed
from zps.core.hashing import mix64_int
from zps.core.routing import ClusterMap
from zps.init import Zeros
from zps.ops.config import ClientConfig, Heartbeat
from zps.optim import SGD
from zps.protocol.specs import EmbeddingSpec
from zps.testing.sim import clientnet
from zps.testing.sim.aioloop import Proc, SimLoop
from zps.testing.sim.nodes import HB, LIVE, TICK
from zps.testing.sim.simclient import Op

World = Any

_M64 = (1 << 64) - 1
#: The world's table, as ``create_embedding`` makes it.
SPEC = EmbeddingSpec("emb", 1, "float32", Zeros(), SGD(lr=1.0), table_seed("emb", None))
#: Pushes a client has unanswered at most before it pushes again (as the stand-in's).
IN_FLIGHT = 4


def partition_of(cmap: ClusterMap, key: int) -> int:
    """The partition ``cmap`` routes id ``key`` to (the client's own rule)."""
    return int(cmap.slot_list[mix64_int(key & _M64) % cmap.n_slots])


def row_ids(cmap: ClusterMap, rows: int) -> list[int]:
    """The id of each of the world's rows (see the module notes)."""
    ids: list[int] = []
    key = 0
    for r in range(rows):
        while partition_of(cmap, key) != r % cmap.n_partitions:
            key += 1
        ids.append(key)
        key += 1
    return ids


class RealClient:
    """One client of the run: the real ``zps.connect`` client as a simulated process."""

    def __init__(self, world: World, name: str, *, timeout: float, reader: bool = False) -> None:
        self.w = world
        self.name = name
        self.timeout = timeout
        self.alive = False
        self.gen = 0
        self.pushing = False
        self.idle_until = 0.0
        self.client: Client | None = None
        self.proc: Proc | None = None
        self.node: clientnet.ClientNode | None = None
        #: Set once the client is connected.
        self.ready: asyncio.Event | None = None
        self._pending: list[Op] = []  # pushes, reads and probes not answered yet

    @property
    def loop(self) -> SimLoop:
        loop: SimLoop = self.w.loop
        return loop

    @property
    def session(self) -> ClientSession[Any]:
        """The client's session (its requests in flight: the "queues bounded" check)."""
        assert self.client is not None
        session: ClientSession[Any] = self.client.connection._session
        return session

    def config(self) -> ClientConfig:
        return ClientConfig(
            timeout=self.timeout,
            connect_timeout=self.timeout,
            name="sim",
            shm_bytes=self.w.shm.budget if self.w.shm is not None else 0,
            tune_malloc=False,
            heartbeat=Heartbeat(interval=HB, liveness=LIVE),
        )

    def addresses(self) -> list[str]:
        w = self.w
        return [f"sim://{b.name}" for b in w.brokers] if w.pair else ["sim://broker"]

    # -- life --------------------------------------------------------------------

    def start(self) -> None:
        self.gen += 1
        self.alive = True
        self.node = clientnet.attach(self.w.net, self.name)
        proc = self.proc = Proc(self.name)
        self.ready = proc.context.run(asyncio.Event)
        self.client = proc.context.run(Client, self.addresses(), self.config())
        self.loop.spawn(proc, self._main(self.gen))

    def crash(self) -> None:
        """The process is gone: its tasks are cancelled and unwind now; what it had
        in flight is maybe applied."""
        self.alive = False
        self.gen += 1
        now = self.w.sched.now
        for op in self._pending:
            if op.outcome == "":
                op.outcome, op.at = "lost-client", now
        self._pending = []
        proc = self.proc
        if proc is not None and proc.alive:
            self.loop.kill(proc)
            self.loop.settle()
        self.w.net.detach(self.name)
        clientnet.detach(self.name, self.node)

    def end(self) -> None:
        """The end of the run: the process ends as a kill ends it."""
        if self.alive:
            self.crash()

    async def _main(self, gen: int) -> None:
        client, w = self.client, self.w
        assert client is not None and self.ready is not None
        while True:
            try:
                await client.start()
                break
            except Exception as e:  # no broker answered in time: a new client, later
                w.sched.log(f"{self.name} connect failed: {type(e).__name__}")
                await asyncio.sleep(0.5)
                if gen != self.gen:
                    return
                client = self.client = Client(self.addresses(), self.config())
        if w.row_ids is None:
            w.row_ids = row_ids(client.cluster_map, w.rows)
        self.ready.set()
        if not self.pushing:
            return  # the reader: its calls ask for the table's spec
        while True:
            try:
                await client.create_embedding(
                    SPEC.name, SPEC.dim, init=SPEC.init, optimizer=SPEC.optimizer
                )
                break
            except Exception as e:  # a partition without a copy: again, later
                w.sched.log(f"{self.name} create failed: {type(e).__name__}")
                await asyncio.sleep(0.2)
        while True:
            await asyncio.sleep(TICK)
            if (
                self.pushing
                and w.sched.now >= self.idle_until
                and sum(1 for op in self._pending if op.row >= 0) < IN_FLIGHT
                and w.sched.rng.random() < 0.6
            ):
                self.push()

    # -- the calls -----------------------------------------------------------------

    def _op(self, partition: int, row: int, grad: int, rows: list[int] | None = None) -> Op:
        now = self.w.sched.now
        op = Op(self.name, partition, row, grad, now, now + self.timeout, rows=rows or [])
        self._pending.append(op)
        return op

    def _call(self, op: Op, call: Any) -> None:
        """Run ``call`` (a coroutine function of the client) as the process's, and
        report its outcome as ``op``'s."""
        assert self.proc is not None
        self.loop.create_task(self._run(op, call, self.gen), context=self.proc.context.copy())

    async def _run(self, op: Op, call: Any, gen: int) -> None:
        w = self.w
        try:
            values = await call()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            outcome = f"failed:{type(e).__name__}"
            values = None
        else:
            outcome = "acked"
        if gen != self.gen or op.outcome != "":
            return
        self._pending.remove(op)
        op.outcome, op.at, op.values = outcome, w.sched.now, values
        client = self.client
        assert client is not None
        info = client.cluster_map.partitions.get(op.partition)
        if info is not None and info.primary is not None:
            op.shard, op.epoch = info.primary, info.epoch
        w.on_outcome(op)

    def push(self) -> None:
        rng, w = self.w.sched.rng, self.w
        row = rng.randrange(w.rows)
        grad = rng.randint(1, 5)
        op = self._op(row % w.n_partitions, row, grad)
        w.ops.append(op)
        self._push(op, w.row_ids[row], float(-grad))

    def _push(self, op: Op, key: int, grad: float) -> None:
        client = self.client
        assert client is not None
        ids = np.array([key], dtype=np.int64)
        grads = np.array([[grad]], dtype=np.float32)
        self._call(op, functools.partial(client.push_rows, "emb", ids, grads))

    def probe(self, p: int) -> Op:
        """A write of nothing (a gradient of 0) to ``p``: whether it takes writes."""
        op = self._op(p, p, 0)
        op.deadline += self.timeout  # the reader connects first

        async def call() -> None:
            await self._when_ready(op)
            await self._client_call("push_rows", [self._key_in(p)], [[0.0]])

        self._call(op, call)
        return op

    def read(self, p: int, rows: list[int]) -> Op:
        """The values of ``rows`` (all of partition ``p``)."""
        op = self._op(p, -1, 0, rows)
        op.deadline += self.timeout  # the reader connects first

        async def call() -> list[float]:
            await self._when_ready(op)
            keys = [self.w.row_ids[r] for r in rows]
            values = await self._client_call("pull_rows", keys)
            return [float(v) for v in np.asarray(values).reshape(-1)]

        self._call(op, call)
        return op

    def _key_in(self, p: int) -> int:
        """An id the client's map routes to partition ``p`` (row ``p``'s while the map
        is the run's first: the world's rows are chosen so)."""
        client, rows = self.client, self.w.row_ids
        assert client is not None and rows is not None
        ids: list[int] = list(rows)
        cmap = client.cluster_map
        if p < len(ids) and partition_of(cmap, ids[p]) == p:
            return ids[p]
        if p not in cmap.partitions or p not in cmap.slot_list:
            return ids[p % len(ids)]  # no slot of it: where the map sends the row
        key = 0
        while partition_of(cmap, key) != p:
            key += 1
        return key

    async def _when_ready(self, op: Op) -> None:
        """Wait until the client is connected; the call's deadline starts then.  The
        reader knows the table's spec, as the worker that made the table does: its
        calls ask no partition for it (``KeyValue.table_spec`` asks the one the name
        hashes to, which may have no copy while the partition called has one)."""
        assert self.ready is not None and self.client is not None
        async with asyncio.timeout(self.timeout):
            await self.ready.wait()
        self.client.kv._specs.setdefault("emb", SPEC)
        op.submitted, op.deadline = self.w.sched.now, self.w.sched.now + self.timeout

    async def _client_call(self, name: str, *args: Any) -> Any:
        client = self.client
        assert client is not None
        if name == "push_rows":
            ids, grads = args
            return await client.push_rows(
                "emb", np.array(ids, dtype=np.int64), np.array(grads, dtype=np.float32)
            )
        return await client.pull_rows("emb", np.array(args[0], dtype=np.int64))
