"""The transport and clock seams of the routing brokers in a simulated run (the ``routers``
fault, with ``--real-client``).

The routing broker (:class:`zps.broker.router.Router`) reaches ZeroMQ only through its
module's ``transport`` name and the clock through its ``time`` name, as the broker's
modules do (:mod:`.simtransport`); a run with routers replaces both (:func:`install`),
and this module is the router's ``transport``.  A router process is a node of the
network (:class:`RouterNode`) with its sockets:

* :func:`router`: its ROUTER at ``sim://NAME`` (the endpoint it advertises), the node's
  main socket.  Clients' DEALERs reach it as the client's identity (the tagged messages
  of :mod:`.clientnet`); a shard's DEALER to it (:func:`zps.testing.sim.shardnet.dealer`,
  ``sim://NAME``) as the shard's name.  What it sends names its peer in the first frame
  and is routed as zmq routes with ``ROUTER_MANDATORY``: only to a peer connected to it
  now (a client whose process has its DEALER to this router, a shard whose process has
  its link to it), else ``UNROUTABLE`` (the router answers the client ``NOT_PRIMARY``);
* :func:`dealer`: its DEALER to a broker it follows (``sim://broker``), the client's
  (:func:`zps.testing.sim.clientnet.dealer`): it reaches the broker's ROUTER as the
  router's identity (``r-NAME``), what the broker sends that identity comes back on it,
  and what is sent while no broker process is up waits for one;
* the rest is :mod:`.simtransport`'s (``serve``, ``try_send``, the real ``Outbound``).

Its ``os`` gives the same pid in every worker process (the HELLO carries it), so a seed
fixes the run in any process.  No CURVE, no metrics server.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from zps.errors import ClosedError
from zps.testing.sim import simtransport
from zps.testing.sim.clientnet import dealer
from zps.testing.sim.net import Network
from zps.testing.sim.simtransport import (
    CLOCK,
    PEER_LINK,
    Channel,
    Frames,
    Outbound,
    Posted,
    SimChannel,
    SimNode,
    close,
    frame_buffer,
    frame_bytes,
    new_context,
    serve,
    term,
    try_send,
)
from zps.transport.flow import QueueFull

__all__ = [
    "Channel",
    "Frames",
    "Outbound",
    "Posted",
    "RouterNode",
    "attach",
    "close",
    "dealer",
    "detach",
    "frame_buffer",
    "frame_bytes",
    "install",
    "new_context",
    "router",
    "serve",
    "term",
    "try_send",
]


class RouterNode(SimNode):
    """A router process's node: clients' messages (tagged by their DEALERs) and shards'
    (untagged, from their links) go to its ROUTER; a broker's answers to the router's
    identity go to its DEALER to that broker."""

    def _deliver(self, src: str, msg: Any) -> None:
        if type(msg) is tuple and msg and msg[0] == PEER_LINK and msg[1] == "live":
            ch = self.ports.get(f"to:{src}")
        else:
            ch = self.ports.get("main")
        if ch is not None and not ch.closed:
            ch._deliver(src, msg)


class RouterChannel(SimChannel):
    """The router's ROUTER (see the module notes): it routes only to a peer connected
    to it now."""

    def __init__(self, net: Network, name: str, *, node: SimNode) -> None:
        super().__init__(net, name, port="main", node=node)
        #: The node of each client identity heard (its process then).
        self._client_nodes: dict[bytes, SimNode | None] = {}

    def _deliver(self, src: str, msg: Any) -> None:
        if type(msg) is tuple:
            self._client_nodes[msg[2]] = simtransport._where.get("nodes", {}).get(src)
        super()._deliver(src, msg)

    def send_nowait(self, frames: Sequence[Any]) -> bool:
        if self.closed:
            raise ClosedError("socket closed")
        net, ident = self.net, frame_bytes(frames[0])
        nodes = simtransport._where.get("nodes", {})
        msg: Any
        if ident in self._client_nodes:  # a client's DEALER
            peer = self.idents[ident]
            node = nodes.get(peer)
            if node is None or node is not self._client_nodes[ident]:
                return False  # that process is gone
            port = f"to:{self.name}"
            msg = (PEER_LINK, "live", list(frames[1:]))
        else:  # a shard's link
            peer = ident.decode("utf-8", "replace")
            node = nodes.get(peer)
            port = f"link:{self.name}"
            msg = list(frames[1:])
        if node is None or not node.current or port not in node.ports or node.ports[port].closed:
            return False  # not connected to this router (ROUTER_MANDATORY: unroutable)
        if not net.room(self.name, peer):
            raise QueueFull()
        net.send(self.name, peer, msg)
        return True


def attach(net: Network, name: str) -> RouterNode:
    """The network node of the router process ``name`` (made as the process starts)."""
    return simtransport.add_node(name, RouterNode(net, name))


def detach(name: str, node: RouterNode | None) -> None:
    """The process of ``node`` is gone: its node and its sockets with it."""
    simtransport.drop_node(name, node, close_ports=True)


def router(
    ctx: object, bind: str, *, max_message_bytes: int = 0, curve: object = None
) -> tuple[RouterChannel, str]:
    """The ROUTER of the router process whose node is ``sim://NAME``."""
    if curve is not None:
        raise NotImplementedError("CURVE is not simulated")
    name = bind.removeprefix("sim://").partition("/")[0]
    node = simtransport._where["nodes"][name]
    return RouterChannel(node.net, name, node=node), bind


def install() -> simtransport.Saved:
    """Replace the routing broker's seams (see the module notes) for a run whose broker
    seams :func:`zps.testing.sim.simtransport.install` put in place; returns what
    :func:`zps.testing.sim.simtransport.uninstall` puts back."""
    from zps.broker import router as module

    saved: simtransport.Saved = []

    def put(obj: Any, attr: str, value: Any) -> None:
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    put(module, "transport", sys.modules[__name__])
    put(module, "time", CLOCK)
    put(module, "os", simtransport.FixedPid(20_000))
    return saved
