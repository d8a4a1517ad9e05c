"""The real broker in a simulated run (``--real-broker``), and the shards and clients
that speak its wire protocol.

:class:`RealBroker` runs :class:`zps.broker.broker.Broker` itself, unchanged, as a
process (:class:`~zps.testing.sim.aioloop.Proc`) on the run's one event loop
(:class:`~zps.testing.sim.aioloop.SimLoop`), through the transport and clock seams of
:mod:`~zps.testing.sim.simtransport`, with its data dir (the state file, written
inline) in the run's scratch directory.  A kill cancels its tasks at once and leaves
its data dir as last written (nothing is flushed on the way out); a restart without
its record removes the data dir.

:class:`WireShard` and :class:`WireClient` are the simulator's shard and client drivers
(:class:`~zps.testing.sim.nodes.SimShard`, :class:`~zps.testing.sim.simclient.SimClient`)
speaking the real frames to the broker: REGISTER, HEARTBEAT (the lease echo back),
BYE, HELLO, requests and replies, encoded by :mod:`zps.protocol` and read with the real
drivers' decoders (:func:`zps.shard.links.from_broker`,
:func:`zps.client.inbound.from_broker`).
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

from zps.broker.broker import Broker
from zps.client.inbound import from_broker as client_from_broker
from zps.core.routing import ClusterMap
from zps.ops.config import BrokerConfig, Heartbeat
from zps.protocol.codec import MsgType, Route, decode, encode, unpack_route
from zps.protocol.control import ClientHello, ShardClaim, ShardHeartbeat, ShardRegister
from zps.protocol.messages import (
    Assign,
    HelloAgain,
    LeaseEcho,
    MapUpdate,
    RegisterAgain,
)
from zps.protocol.messages import Heartbeat as Probe
from zps.shard.links import from_broker as shard_from_broker
from zps.testing.sim.aioloop import Proc, SimLoop
from zps.testing.sim.nodes import HB, HOLD, LIVE, SimShard
from zps.testing.sim.simclient import SimClient
from zps.version import __version__

#: The broker's address in a run (a name on the simulated network).
BIND = "sim://broker"

World = Any


class _Broker(Broker):
    """The real broker, its maps traced (the run's trace says what each map held)."""

    trace: Any = None

    def _map_changed(self, now: float) -> None:
        super()._map_changed(now)
        if self.trace is not None:
            cmap = self.state.map
            desc = " ".join(
                f"p{p}:{i.primary}@{i.epoch}/{','.join(i.in_sync)}{'/lost' if i.lost else ''}"
                + (f" via {i.router.removeprefix('sim://')}" if i.router else "")
                for p, i in sorted(cmap.partitions.items())
            )
            self.trace(f"map v{cmap.version} {desc}")


class RealBroker:
    """The world's broker node, running the real :class:`~zps.broker.broker.Broker`."""

    name = "broker"

    def __init__(self, world: World, n_partitions: int, replication: int, **pair: Any) -> None:
        self.w = world
        self.data_dir = world.tmp / self.name
        self.config = BrokerConfig(
            bind=f"sim://{self.name}",
            partitions=n_partitions,
            replication=replication,
            startup_grace=HOLD,
            heartbeat=Heartbeat(interval=HB, liveness=LIVE),
            data_dir=str(self.data_dir),
            **pair,
        )
        self.alive = False
        self.starts = 0
        self.broker: _Broker | None = None
        self.proc: Proc | None = None

    @property
    def loop(self) -> SimLoop:
        loop: SimLoop = self.w.loop
        return loop

    @property
    def state(self) -> Any:
        assert self.broker is not None
        return self.broker.state

    def start(self) -> None:
        w = self.w
        self.starts += 1
        self.alive = True
        w.sched.log(f"{self.name} start (record: {(self.data_dir / 'broker-state.zps').exists()})")
        b = self.broker = _Broker(self.config)
        b.trace = w.sched.log
        # A run is deterministic: the incarnation comes from the seed, not uuid4.
        b.state.incarnation = f"sim{w.seed}-{self.starts}"
        b.state.map = b.state._build_map()
        self.started(b)
        self.proc = proc = Proc(self.name)
        task = self.loop.spawn(proc, b.run())
        task.add_done_callback(self._ended)

    def started(self, b: _Broker) -> None:
        """The broker is made, not yet running (a broker of a pair sets up its side)."""

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.w.fail(f"the broker's process failed: {task.exception()!r}")

    def stop(self, *, keep_record: bool) -> None:
        """The process is gone (killed, or its machine lost power): nothing of it runs
        on; its data dir keeps what was written (removed unless ``keep_record``)."""
        self.end()
        if not keep_record:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.w.sched.log(f"{self.name} stop (record kept: {keep_record})")

    def end(self) -> None:
        """The process ends as a kill ends it (also at the end of a run, untraced): its
        descriptors close (the data dir's lock with them), nothing is flushed, and its
        tasks are cancelled and unwind at once."""
        b, proc = self.broker, self.proc
        if self.alive and b is not None and proc is not None:
            b.record.writer = None
            if b._lock is not None:
                b._lock.release()
                b._lock = None
            if b._sock is not None:
                b._sock.close()
            self.loop.kill(proc)
        self.w.net.detach(self.name)
        self.alive = False


class WireShard(SimShard):
    """:class:`~zps.testing.sim.nodes.SimShard` speaking the real frames to the broker."""

    def send(self, node: str, msg: Any) -> None:
        if node != "broker":
            super().send(node, msg)
            return
        self.w.net.send(self.name, node, self.frames(msg))

    def stamped(self, header: dict[str, Any]) -> dict[str, Any]:
        """A control message's header as sent (a shard of a pair adds its term)."""
        return header

    def frames(self, msg: Any) -> list[Any]:
        """The real frames of a message to the broker."""
        kind = msg[0]
        if kind == "reply":
            frames = [msg[1].encode(), *msg[2]]
        elif kind == "hb":
            f = msg[1]
            beat = ShardHeartbeat(
                t=f["t"],
                lsn=f["lsn"],
                epoch=f["epoch"],
                in_sync=None if f["in_sync"] is None else tuple(f["in_sync"]),
                durable=f["durable"],
            )
            frames = [b"", *encode(Route(MsgType.HEARTBEAT), self.stamped(beat.to_wire()))]
        elif kind == "register":
            claim = msg[1]
            register = ShardRegister(
                host=self.name,
                pid=self.gen,
                address=self.name,
                claim=None if claim is None else ShardClaim.parse(claim),
                lsn=self.core.lsn,
                version=__version__,
                incarnation=f"{self.name}-{msg[2]}",
                refused=msg[3],
            )
            frames = [b"", *encode(Route(MsgType.REGISTER), self.stamped(register.to_wire()))]
        elif kind == "bye":
            frames = [b"", *encode(Route(MsgType.BYE), self.stamped({}))]
        else:
            raise AssertionError(f"a shard sends no {kind!r} to the broker")
        return frames

    def on_message(self, src: str, msg: Any) -> None:
        if src != "broker":
            super().on_message(src, msg)
            return
        target = bytes(msg[0])
        if target:  # a client's request: [client, route, header, payloads...]
            super().on_message(src, ("request", target.decode(), list(msg[1:])))
            return
        route = unpack_route(msg[1])
        match shard_from_broker(route.mtype, decode(msg[1:]).header):
            case Assign() as a:
                super().on_message(src, ("assign", a))
            case MapUpdate(m):
                super().on_message(src, ("map", ClusterMap.from_wire(m)))
            case LeaseEcho(t, role, partition, epoch):
                super().on_message(src, ("echo", t, role.value, partition, epoch))
            case RegisterAgain():
                super().on_message(src, ("reregister",))
                if not self.session.leaving:
                    self._report()  # right behind it: a primary's lease from the new broker
            case _:
                super().on_message(src, ("probe",))  # hearing from the broker is all it says


class WireClient(SimClient):
    """:class:`~zps.testing.sim.simclient.SimClient` speaking the real frames to the broker."""

    def send(self, msg: Any) -> None:
        self.w.net.send(self.name, "broker", self.frames(msg))

    def frames(self, msg: Any) -> list[Any]:
        """The real frames of a message to the broker."""
        kind = msg[0]
        if kind == "request":
            frames = list(msg[1])
        elif kind == "hello":
            hello = ClientHello(host=self.name, pid=self.gen, name="sim", version=__version__)
            frames = encode(Route(MsgType.HELLO), hello.to_wire())
        elif kind == "client-hb":
            frames = encode(Route(MsgType.HEARTBEAT), Probe().to_wire())
        else:
            raise AssertionError(f"a client sends no {kind!r} to the broker")
        return frames

    def on_message(self, src: str, msg: Any) -> None:
        route = unpack_route(msg[0])
        if route.mtype is MsgType.REPLY:
            super().on_message(src, ("reply", msg, "broker"))
            return
        match client_from_broker(route.mtype, decode(msg).header):
            case MapUpdate(m):
                super().on_message(src, ("map", ClusterMap.from_wire(m)))
            case HelloAgain():
                self.send(("hello",))
            case _:
                pass
