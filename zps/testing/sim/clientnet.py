"""The transport and clock seams of the real client in a simulated run (``--real-client``).

The client's driver reaches ZeroMQ only through its modules' ``transport`` name and the
clock through their ``time`` name (the loop's clock, for its deadlines, is the run's
:class:`~zps.testing.sim.aioloop.SimLoop`'s); a run with the real client replaces both
names in :data:`TRANSPORT_MODULES` and :data:`CLOCK_MODULES` (:func:`install`), and this
module is the client's ``transport``:

* :func:`dealer`: the client's DEALER to a broker at ``sim://NAME``, a socket on the
  client process's node of the network.  What it sends reaches the broker's ROUTER as
  the client's own identity (its ``client_id``: the tagged messages the ROUTER learns a
  DEALER's identity from, as a shard's liveness link), and what the broker sends to that
  identity comes back on it.  What is sent while no broker process is up waits (as zmq
  queues it for the connection to come, up to the high-water mark) and goes, in order,
  with the first send once one is up again (the client's heartbeats send every
  interval, as zmq's reconnection tries); what the pipe held when the broker's process
  went is lost with it.  A pipe at its high-water mark takes nothing now
  (``send_if_room`` False, ``send`` waits).  ``on_connected`` runs as the socket finds
  a broker process up: at its making, and at that first send after a restart (a
  connection made again);
* :func:`send_if_room`, :func:`send`, :func:`try_send`, :func:`serve` (the one receive
  loop, :func:`zps.testing.sim.simtransport.serve`), :func:`close`, :func:`term`,
  :func:`new_context` and :class:`IoThreads` (no thread to schedule).

Three more names of :mod:`zps.client.connection` make a seed fix the run in any worker
process: ``client_identity`` numbers each client process's id (``c-NAME-N``), and
``socket`` and ``os`` give the HELLO the process's name as its host and the same pid
everywhere.  The client's links to the routing brokers of the map
(:mod:`zps.client.routerlinks`, the ``routers`` fault) are DEALERs made by :func:`dealer`
too, to ``sim://NAME`` of a router (:mod:`.routernet`).  Shared memory (``shm_bytes`` 0)
and CURVE are off.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import types
from collections import deque
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from zps.errors import ClosedError
from zps.testing.sim import simtransport
from zps.testing.sim.aioloop import PROC
from zps.testing.sim.net import HWM, Network
from zps.testing.sim.simtransport import (
    CLOCK,
    PEER_LINK,
    Frames,
    SimChannel,
    SimNode,
    close,
    frame_buffer,
    frame_bytes,
    serve,
    term,
    try_send,
)
from zps.transport.curve import HandshakeWatch, reconnect_silence
from zps.transport.flow import QueueFull

__all__ = [
    "Channel",
    "ClientNode",
    "Dealer",
    "Frames",
    "HandshakeWatch",
    "IoThreads",
    "attach",
    "close",
    "dealer",
    "detach",
    "frame_buffer",
    "frame_bytes",
    "install",
    "new_context",
    "reconnect_silence",
    "send",
    "send_if_room",
    "serve",
    "term",
    "try_send",
]


class ClientNode(SimNode):
    """A client process's node: what a broker sends to the client's identity comes to
    the DEALER connected to that broker."""

    def _deliver(self, src: str, msg: Any) -> None:
        if type(msg) is tuple and msg and msg[0] == PEER_LINK:
            ch = self.ports.get(f"to:{src}")
            if ch is not None and not ch.closed:
                ch._deliver(src, msg)


class ClientChannel(SimChannel):
    """The client's DEALER to one broker (see the module notes)."""

    def __init__(self, net: Network, name: str, *, port: str, node: SimNode) -> None:
        super().__init__(net, name, port=port, node=node)
        #: Sent while no broker process was up: they go once one is (in order).
        self._pending: deque[list[Any]] = deque()
        if simtransport.watching():
            self.handshakes = simtransport.SimHandshakes()

    def send_nowait(self, frames: Sequence[Any]) -> bool:
        if self.closed:
            raise ClosedError("socket closed")
        net, peer, pending = self.net, self.target, self._pending
        if not self.connected():
            if len(pending) >= HWM:
                raise QueueFull()
            pending.append(list(frames))  # zmq queues it for the connection to come
            return True
        while pending and net.room(self.name, peer):
            net.send(self.name, peer, (PEER_LINK, "main", self.identity, pending.popleft()))
        if pending or not net.room(self.name, peer):
            raise QueueFull()
        net.send(self.name, peer, (PEER_LINK, "main", self.identity, list(frames)))
        return True


Channel = ClientChannel
Dealer = ClientChannel


def _node() -> ClientNode:
    proc = PROC.get()
    assert proc is not None, "a socket belongs to a simulated process"
    node: ClientNode = simtransport._where["nodes"][proc.name]
    return node


def attach(net: Network, name: str) -> ClientNode:
    """The network node of the client process ``name`` (made as the process starts)."""
    return simtransport.add_node(name, ClientNode(net, name))


def detach(name: str, node: ClientNode | None) -> None:
    """The process of ``node`` is gone: its node and its sockets with it."""
    simtransport.drop_node(name, node, close_ports=True)


def new_context(client: bool = False) -> object:
    return object()


class IoThreads:
    """No I/O thread to schedule."""

    def __init__(self, ctx: object) -> None:
        pass

    def busy(self, flag: bool) -> None:
        pass


def dealer(ctx: object, endpoint: str, identity: bytes, **options: Any) -> ClientChannel:
    """The client's DEALER to the broker at ``sim://NAME`` (see the module notes)."""
    if options.get("curve") is not None:
        raise NotImplementedError("CURVE is not simulated")
    node = _node()
    target = urlsplit(endpoint).hostname or ""
    ch = ClientChannel(node.net, node.name, port=f"to:{target}", node=node)
    ch.target = target
    ch.identity = identity
    ch.connected()
    return ch


def send_if_room(ch: ClientChannel, frames: Sequence[Any]) -> bool:
    """:func:`zps.transport.send_if_room`: False (nothing sent) if the pipe is full."""
    try:
        ch.send_nowait(frames)
    except QueueFull:
        return False
    return True


async def send(ch: ClientChannel, frames: Sequence[Any]) -> bool:
    """:func:`zps.transport.send`: waits while the pipe to the broker is full."""
    while True:
        try:
            return ch.send_nowait(frames)
        except QueueFull:
            await asyncio.sleep(0.01)


class _Ids:
    """``zps.client.connection``'s ``client_identity``: ``c-NAME-N``, the Nth client made
    by the process NAME in this run."""

    def __init__(self) -> None:
        self._counts: dict[str, itertools.count[int]] = {}

    def __call__(self, public: bytes | None) -> bytes:
        proc = PROC.get()
        name = proc.name if proc is not None else "client"
        n = next(self._counts.setdefault(name, itertools.count(1)))
        return f"c-{name}-{n}".encode()


def _hostname() -> str:
    proc = PROC.get()
    return proc.name if proc is not None else "sim"


#: The client's modules whose ``transport`` name the run replaces.
TRANSPORT_MODULES = ("zps.client.connection", "zps.client.routerlinks")
#: The client's modules whose ``time`` name the run replaces.
CLOCK_MODULES = ("zps.client.connection", "zps.client.training")


def install() -> simtransport.Saved:
    """Replace the client's seams (see the module notes) for a run whose broker seams
    :func:`zps.testing.sim.simtransport.install` put in place; returns what
    :func:`zps.testing.sim.simtransport.uninstall` puts back."""
    import importlib

    from zps.client import connection

    saved: simtransport.Saved = []

    def put(obj: Any, attr: str, value: Any) -> None:
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    this = sys.modules[__name__]
    for modname in TRANSPORT_MODULES:
        put(importlib.import_module(modname), "transport", this)
    for modname in CLOCK_MODULES:
        put(importlib.import_module(modname), "time", CLOCK)
    put(connection, "client_identity", _Ids())
    put(connection, "os", simtransport.FixedPid(1))
    put(connection, "socket", types.SimpleNamespace(gethostname=_hostname))
    return saved
