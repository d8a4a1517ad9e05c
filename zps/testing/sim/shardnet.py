"""The transport and clock seams of the real shard in a simulated run (``--real-shard``).

The shard's modules reach ZeroMQ only through their ``transport`` name and the clock
through their ``time`` name, as the broker's do (:mod:`.simtransport`); a run with the
real shard replaces both names in :data:`TRANSPORT_MODULES` and :data:`CLOCK_MODULES`
(:func:`install`), and this module is the shard's ``transport``:

* :func:`router`: the replication ROUTER (``replication_bind``), the ``router`` socket of
  the shard's node on the network; a replica's DEALER reaches it while the shard's
  process is up (the same tagged messages as a broker pair's peer link);
* :func:`dealer`: to ``sim://NAME`` (a broker), the *data link*: what it sends reaches the
  broker's main ROUTER as the shard's own identity, and what the broker sends to that
  identity comes back on it; to ``tcp://NAME:PORT`` (a primary's advertised address),
  a replica's DEALER to the primary's replication ROUTER;
* :class:`LinkThread`: the *liveness links*, one per broker, as the identity ``h-`` +
  the shard's: what the loop posts goes out at once (through the real
  :class:`~zps.shard.liveness.Liveness` policy), and the broker's answers, sent to that
  identity, come back on it to the loop.  There is no thread: a step of the simulated
  loop takes no simulated time, so the loop is never held and the policy's repeats for
  a held loop never fall due (a paused process sends nothing, as a stopped one).

The rest is :mod:`.simtransport`'s (``serve``, ``try_send``, the real ``Outbound``).
Threads the shard would start run inline: ``asyncio.to_thread`` and ``run_in_executor``
on the run's loop (:meth:`~zps.testing.sim.aioloop.SimLoop.run_in_executor`; the log's
writer after the process's disk latency), the thread that drops a partition's memory
(``zps.shard.server``'s ``threading``: :data:`INLINE_THREADS`).  Shared memory is off
(``shard.shm_bytes`` 0) and so is CURVE.  The shard's ``ShardCore`` reads the run's clock
(``zps.shard.server``'s ``ShardCore`` name), its incarnation is numbered (its ``uuid``)
and its pid is the same in every process (the ``os`` of :data:`PID_MODULES`): it goes in
the shard's REGISTER and in its data dir's ``LOCK`` (``zps.ops.datadir``), a file a power
loss may tear at a point drawn from its length.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import types
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from zps.testing.sim import simtransport
from zps.testing.sim.aioloop import PROC
from zps.testing.sim.net import Network
from zps.testing.sim.simtransport import (
    CLOCK,
    FLUSH_S,
    PEER_LINK,
    Allowance,
    Channel,
    Frames,
    Outbound,
    Posted,
    SimChannel,
    SimNode,
    close,
    frame_buffer,
    frame_bytes,
    message_bytes,
    new_context,
    serve,
    term,
    try_send,
)
from zps.transport.curve import reconnect_silence
from zps.transport.flow import QueueFull

__all__ = [
    "FLUSH_S",
    "Allowance",
    "Channel",
    "Dealer",
    "Frames",
    "LinkThread",
    "Outbound",
    "Posted",
    "close",
    "dealer",
    "frame_buffer",
    "frame_bytes",
    "install",
    "local_address",
    "message_bytes",
    "new_context",
    "reconnect_silence",
    "router",
    "send",
    "sender_key",
    "serve",
    "term",
    "try_send",
]


class Dealer(SimChannel):
    """A data link whose handshakes are watched (``watch``, in a run with the ``reset``
    fault): each connection made, to a broker or router process up (the first, one to a
    process started again, one made again after a reset), counts and runs its
    ``on_connected``; without the fault no socket is one."""

    def __init__(self, net: Network, name: str, *, port: str, node: SimNode) -> None:
        super().__init__(net, name, port=port, node=node)
        self.handshakes = simtransport.SimHandshakes()

    def send_nowait(self, frames: Sequence[Any]) -> bool:
        self.connected()
        return super().send_nowait(frames)


def _node() -> SimNode:
    proc = PROC.get()
    assert proc is not None, "a socket belongs to a simulated process"
    node: SimNode = simtransport._where["nodes"][proc.name]
    return node


def attach(name: str) -> SimNode:
    """The network node of the shard process ``name`` (made as the process starts)."""
    return simtransport.add_node(name, SimNode(simtransport._where["net"], name))


def detach(name: str, node: SimNode | None) -> None:
    """The process of ``node`` is gone: its node with it."""
    simtransport.drop_node(name, node)


def router(
    ctx: object, bind: str, *, max_message_bytes: int = 0, hwm: int = 0, curve: object = None
) -> tuple[SimChannel, str]:
    """The replication ROUTER of the shard whose process runs this."""
    if curve is not None:
        raise NotImplementedError("CURVE is not simulated")
    node = _node()
    ch = SimChannel(node.net, node.name, port="router", node=node)
    ch.curve_server = False  # type: ignore[attr-defined]
    return ch, bind


def dealer(ctx: object, endpoint: str, identity: bytes, **options: Any) -> SimChannel:
    """A data link to the broker at ``sim://NAME``, or a replica's DEALER to the primary
    at ``tcp://NAME:PORT`` (see the module notes)."""
    if options.get("curve") is not None:
        raise NotImplementedError("CURVE is not simulated")
    where = urlsplit(endpoint)
    target = where.hostname or ""
    if where.scheme == "sim":
        node = _node()
        watched = options.get("watch") and simtransport.watching()
        cls = Dealer if watched else SimChannel
        ch = cls(node.net, node.name, port=f"link:{target}", node=node)
        ch.target = target
        ch.identity = identity
        if isinstance(ch, Dealer):
            ch.connected()
        return ch
    return simtransport.dealer(ctx, f"sim://{target}/peer", identity)


async def send(ch: SimChannel, frames: Sequence[Any]) -> bool:
    """:func:`zps.transport.send`: waits while the pipe to the peer is full; False if the
    peer has no connection."""
    while True:
        try:
            return ch.send_nowait(frames)
        except QueueFull:
            await asyncio.sleep(0.01)


def sender_key(frame: Any) -> bytes | None:
    return None


def local_address(endpoint: str) -> str:
    return "sim"


class LinkThread:
    """:class:`zps.transport.LinkThread` in a run (see the module notes)."""

    def __init__(
        self,
        ctx: object,
        endpoints: Sequence[str],
        identity: bytes,
        *,
        policy: Any,
        deliver: Callable[[int, list[bytes]], object],
        max_message_bytes: int = 0,
        curve: object = None,
        server_public: object = None,
        name: str = "",
        on_failure: Callable[[BaseException], object] | None = None,
        silence: float | None = None,
    ) -> None:
        self.policy = policy
        self.node = _node()
        self.targets = [urlsplit(e).hostname or "" for e in endpoints]
        self.identity = identity
        self._deliver_to = deliver
        self._context = contextvars.copy_context()
        self.closed = False
        self.node.ports["live"] = self  # type: ignore[assignment]

    def start(self) -> None:
        pass

    @property
    def running(self) -> bool:
        return not self.closed

    def join(self, timeout: float | None = None) -> bool:
        return True

    def post(self, frames: Sequence[Any]) -> bool:
        if self.closed:
            return False
        out = self.policy.posted(list(frames), CLOCK.monotonic())
        if out is not None:
            net, name = self.node.net, self.node.name
            nodes = simtransport._where.get("nodes", {})
            for target in self.targets:
                peer = nodes.get(target)
                if peer is None or not peer.current or "main" not in peer.ports:
                    continue  # not connected: dropped
                if net.room(name, target):
                    net.send(name, target, (PEER_LINK, "main", self.identity, list(out)))
        return True

    def _deliver(self, src: str, msg: Any) -> None:
        if src in self.targets:
            self._context.run(self._deliver_to, self.targets.index(src), list(msg[2]))

    def stop(self, timeout: float = 5.0) -> None:
        if not self.closed:
            self.closed = True
            if self.node.ports.get("live") is self:  # type: ignore[comparison-overlap]
                del self.node.ports["live"]


class _Threading:
    """``zps.shard.server``'s ``threading``: a thread's target runs as it starts."""

    class Thread:
        def __init__(self, target: Callable[[], object], **kwargs: Any) -> None:
            self._target = target

        def start(self) -> None:
            self._target()


INLINE_THREADS = _Threading()


#: The pid of every simulated shard process: one constant, as long as a real process's
#: commonly is (five digits), so a shard's ``LOCK`` is as long as a real shard's.
PID = 10_000


#: The shard's modules whose ``os`` name the run replaces (``simtransport.FixedPid``): the
#: pid the shard sends, and the one it writes in its data dir's ``LOCK``.
PID_MODULES = ("zps.shard.server", "zps.ops.datadir")
#: The shard's modules whose ``transport`` name the run replaces.
TRANSPORT_MODULES = (
    "zps.shard.server",
    "zps.shard.links",
    "zps.shard.primary",
    "zps.shard.replica",
    "zps.shard.routers",
)
#: The shard's modules whose ``time`` name the run replaces (the broker's are
#: :data:`zps.testing.sim.simtransport.CLOCK_MODULES`, already replaced).
CLOCK_MODULES = (
    "zps.shard.server",
    "zps.shard.links",
    "zps.shard.primary",
    "zps.shard.replica",
    "zps.shard.durability",
    "zps.shard.checkpointing",
    "zps.shard.snapshots",
    "zps.shard.checkpoint",
    "zps.shard.metrics",
)


def install() -> simtransport.Saved:
    """Replace the shard's seams (see the module notes) for a run whose broker seams
    :func:`zps.testing.sim.simtransport.install` put in place; returns what
    :func:`zps.testing.sim.simtransport.uninstall` puts back."""
    import importlib
    import sys

    from zps.shard import core, pipeline, server

    saved: simtransport.Saved = []

    def put(obj: Any, attr: str, value: Any) -> None:
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    this = sys.modules[__name__]
    for modname in TRANSPORT_MODULES:
        put(importlib.import_module(modname), "transport", this)
    for modname in CLOCK_MODULES:
        put(importlib.import_module(modname), "time", CLOCK)
    put(pipeline, "monotonic", CLOCK.monotonic)
    put(pipeline, "perf_counter", CLOCK.perf_counter)
    put(server, "ShardCore", functools.partial(core.ShardCore, clock=CLOCK.monotonic))
    ids = itertools.count(1)
    put(server, "uuid", types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=next(ids) << 80)))
    for modname in PID_MODULES:
        put(importlib.import_module(modname), "os", simtransport.FixedPid(PID))
    put(server, "threading", INLINE_THREADS)
    return saved
