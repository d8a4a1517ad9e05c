"""The transport and clock seams of the real broker in a simulated run.

The broker's modules reach ZeroMQ only through their ``transport`` name
(``from zps import transport``) and the clock only through their ``time`` name; a run
with the real broker replaces both names (as :mod:`.disk` replaces the ``os`` name of
the log) for its duration (:func:`install`):

* ``transport`` -> this module: :func:`router` makes a :class:`SimChannel`, the
  broker's node on the simulated :class:`~zps.testing.sim.net.Network` (whole messages,
  per-pipe order; a peer whose process is down has no route, ``UNROUTABLE``; a pipe at
  its high-water mark takes nothing now, as a full zmq queue, so the real
  :class:`~zps.transport.flow.Outbound` holds the message within its byte allowances
  and drops it past them); :func:`serve` is the one receive-and-dispatch loop with the
  real one's rules (the fast handler first, in the delivery callback while nothing is
  queued; what it declines, and all after it, handled in order by the serving task;
  ``on_idle`` after ``idle`` seconds without a message); the compiled step is never
  given (the pure Python data path runs);
* ``time`` -> :data:`CLOCK`, whose ``monotonic()`` and ``time()`` read the
  scheduler's time;
* the state file's ``asyncio`` -> :data:`INLINE`, whose ``to_thread`` runs the write
  inline (no thread in a one-process run; the file is real, in the run's scratch
  directory);
* the ``uuid`` of the pair and of the cluster state -> numbered incarnations.

A broker pair's peer link (:class:`zps.broker.pair.Pair`) is a ROUTER and a DEALER of
each broker (:func:`dealer`), on the broker's one network node: what the peer link
carries travels tagged (:data:`PEER_LINK`), and the node hands it to the socket it is
for (:class:`SimNode`).  A DEALER reaches its peer while the peer's process is up with
its peer ROUTER bound, and each time it is (again) its ``on_connected`` runs, as a
connection made; a ``sim://NAME`` endpoint is node NAME's main socket, ``sim://NAME/peer``
its peer ROUTER.

A shard's liveness link is not simulated: its heartbeats come on its one connection.

With the ``reset`` fault (:func:`install` ``watch``), the connecting sockets watch their
handshakes as the product's do (:class:`SimHandshakes`: counted as each connection is
made, none refused without CURVE), and :func:`reset` closes every connection between
two processes and makes each again: what the pipes held is lost
(:meth:`~zps.testing.sim.net.Network.reset`), and each connecting socket's
``on_connected`` runs, as a new handshake.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import os
import types
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from zps.errors import ClosedError, ProtocolError
from zps.testing.sim.aioloop import PROC
from zps.testing.sim.net import Network
from zps.testing.sim.sched import Scheduler
from zps.transport.channel import Frames, frame_buffer, frame_bytes, message_bytes
from zps.transport.flow import FLUSH_S, Allowance, Outbound, Posted, QueueFull

__all__ = [
    "CLOCK",
    "FLUSH_S",
    "INLINE",
    "Allowance",
    "Channel",
    "Frames",
    "Outbound",
    "Posted",
    "SimChannel",
    "close",
    "dealer",
    "frame_buffer",
    "frame_bytes",
    "install",
    "message_bytes",
    "new_context",
    "router",
    "serve",
    "term",
    "try_send",
    "uninstall",
]

#: Messages the serving task takes per wake-up, at most (as the real channel's burst).
DRAIN_BATCH = 256


class SimClock:
    """The clock seam: ``monotonic()`` and ``time()`` are the scheduler's time."""

    def __init__(self) -> None:
        self.sched: Scheduler | None = None

    def monotonic(self) -> float:
        assert self.sched is not None
        return self.sched.now

    def time(self) -> float:
        assert self.sched is not None
        return 1.7e9 + self.sched.now

    def perf_counter(self) -> float:
        return self.monotonic()


CLOCK = SimClock()


async def _inline(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


#: The state file's ``asyncio`` seam: asyncio itself, but ``to_thread`` runs inline.
INLINE = types.SimpleNamespace(**{n: getattr(asyncio, n) for n in asyncio.__all__})
INLINE.to_thread = _inline

#: The network the next :func:`router` binds on (set by the run), and its node's name.
_where: dict[str, Any] = {}


class FixedPid:
    """An ``os`` for a module whose process id must be the same in every process that
    runs a seed: the real module but for ``getpid``."""

    def __init__(self, pid: int) -> None:
        self._pid = pid

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def getpid(self) -> int:
        return self._pid


_N = TypeVar("_N", bound="SimNode")


def add_node(name: str, node: _N) -> _N:
    """``node`` is the network node of the process ``name`` from now on (made as the
    process starts)."""
    _where.setdefault("nodes", {})[name] = node
    return node


def drop_node(name: str, node: SimNode | None, *, close_ports: bool = False) -> None:
    """The process of ``node`` is gone: its node with it (``close_ports``: and the sockets
    it made, closed)."""
    nodes = _where.get("nodes", {})
    if node is not None and nodes.get(name) is node:
        del nodes[name]
    if node is not None and close_ports:
        for ch in list(node.ports.values()):
            ch.close()


#: The first element of what the peer link of a broker pair carries on the network:
#: ``(PEER_LINK, "router", dealer identity, frames)`` or ``(PEER_LINK, "dealer", frames)``.
PEER_LINK = "peer-link"


class SimHandshakes:
    """:class:`zps.transport.curve.HandshakeWatch` in a run: the connections made, counted
    (:func:`connected`); without CURVE none is refused."""

    __slots__ = ("connected", "on_connected")

    def __init__(self) -> None:
        self.connected = 0
        self.on_connected: Callable[[], object] | None = None

    def failure(self) -> str | None:
        return None

    def close(self) -> None:
        pass


def watching() -> bool:
    """Whether the run's connecting sockets watch their handshakes (the ``reset`` fault)."""
    return bool(_where.get("watch"))


class SimNode:
    """A broker process's sockets on its network node: the main ROUTER takes what
    shards and clients send, the peer link's sockets what is tagged for them."""

    def __init__(self, net: Network, name: str) -> None:
        self.net = net
        self.name = name
        self.ports: dict[str, SimChannel] = {}
        net.attach(name, self._deliver)

    @property
    def current(self) -> bool:
        """Whether this is the node's process now (not one that was killed)."""
        return _where.get("nodes", {}).get(self.name) is self and self.name in self.net.up

    def _deliver(self, src: str, msg: Any) -> None:
        if type(msg) is tuple and msg and msg[0] == PEER_LINK:
            ch = self.ports.get(msg[1])
            if msg[1] == "dealer" and ch is not None and getattr(ch, "target", src) != src:
                return  # for a DEALER closed since: a new one hears its own peer only
        else:
            ch = self.ports.get(f"link:{src}") or self.ports.get("main")
        if ch is not None and not ch.closed:
            ch._deliver(src, msg)


class SimChannel:
    """A socket on the simulated network (see the module notes).  The broker's ROUTER
    (``port`` "main"): what arrives is ``[sender identity, *frames]``, what is sent names
    its peer in its first frame; the peer link's ROUTER ("router") and DEALER
    ("dealer") speak with the peer broker's."""

    def __init__(
        self, net: Network, name: str, *, port: str = "main", node: SimNode | None = None
    ) -> None:
        self.net = net
        self.name = name
        self.port = port
        self.closed = False
        self.handle = 0
        self.peers = None
        self.handshakes: SimHandshakes | None = None
        self._peer: SimNode | None = None  # the process a DEALER last connected to
        self.received = 0
        self._inbox: deque[Frames] = deque()
        self._waiter: asyncio.Future[bool] | None = None
        self._serve: _Serve | None = None
        self._context = contextvars.copy_context()  # the process's: its callbacks are its own
        if node is None:
            node = SimNode(net, name)
            _where.setdefault("nodes", {})[name] = node
        self.node = node
        node.ports[port] = self
        #: The peer ROUTER: the node of each DEALER identity heard.  The DEALER: the
        #: node it connects to, its identity, and what runs as a connection is made.
        self.idents: dict[bytes, str] = {}
        self.target = ""
        self.identity = b""
        self.on_connected: Callable[[], Any] | None = None

    def _deliver(self, src: str, msg: Any) -> None:
        if self.port == "main" and type(msg) is tuple:  # from a DEALER of another identity
            _, _, ident, body = msg
            self.idents[ident] = src
            frames: Frames = [ident, *body]
        elif self.port == "main":
            frames = [src.encode(), *msg]
        elif self.port.startswith("link:"):
            frames = list(msg)
        elif self.port == "router":
            _, _, ident, body = msg
            self.idents[ident] = src
            frames = [ident, *body]
        else:
            frames = list(msg[2])
        self.received += 1
        self._context.run(self._arrive, frames)

    def _arrive(self, frames: Frames) -> None:
        s = self._serve
        if s is not None and s.fast is not None and not s.busy and not self._inbox:
            # The reader callback: the fast handler takes what it can at once.
            try:
                handled = s.fast(frames)
            except ProtocolError as e:
                s.on_malformed(frames, e)
                handled = True
            if handled:
                s.handled += 1
                if s.on_burst is not None:
                    s.on_burst()
                return
        self._inbox.append(frames)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)

    def connected(self) -> bool:
        """A DEALER's: whether the process it connects to (``target``) is up with its main
        socket; a new one (a start, a restart) is a connection made (again):
        ``on_connected`` runs (:func:`_connected`)."""
        node = _where.get("nodes", {}).get(self.target)
        if node is None or not node.current or "main" not in node.ports:
            return False
        if node is not self._peer:
            self._peer = node
            _connected(self)
        return True

    def send_nowait(self, frames: Sequence[Any]) -> bool:
        """Queue a message for its peer: False if the peer has no connection (its
        process is down), ``QueueFull`` (zmq.Again) if the pipe to it holds its high-water mark."""
        if self.closed:
            raise ClosedError("socket closed")
        net = self.net
        msg: Any
        if self.port == "dealer":
            peer = self.target
            node = _where.get("nodes", {}).get(peer)
            if node is None or not node.current or "router" not in node.ports:
                return False  # not connected: a DEALER's send finds no pipe
            msg = (PEER_LINK, "router", self.identity, list(frames))
        elif self.port == "router":
            found = self.idents.get(frame_bytes(frames[0]))
            if found is None:
                return False
            peer, msg = found, (PEER_LINK, "dealer", list(frames[1:]))
        elif self.port.startswith("link:"):
            peer = self.target
            node = _where.get("nodes", {}).get(peer)
            if node is None or not node.current or "main" not in node.ports:
                return False  # not connected
            msg = list(frames)
        elif frame_bytes(frames[0]) in self.idents:  # a DEALER of another identity
            ident = frame_bytes(frames[0])
            peer, msg = self.idents[ident], (PEER_LINK, "live", list(frames[1:]))
        else:
            peer, msg = frame_bytes(frames[0]).decode("utf-8", "replace"), list(frames[1:])
        if peer not in net.up:
            return False
        if not net.room(self.name, peer):
            raise QueueFull()
        net.send(self.name, peer, msg)
        return True

    async def wait(self, timeout: float | None) -> bool:
        """Until a message is queued (True) or ``timeout`` passes (False)."""
        if self._inbox or self.closed:
            return True
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _expire, w)
        try:
            got: bool = await w
            return got
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def accepted(self, frames: Frames) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.node.ports.get(self.port) is self:
                del self.node.ports[self.port]
            if self.port == "main" and self.node.current:
                self.net.detach(self.name)  # the process's node goes with its socket
            self._inbox.clear()
            w = self._waiter
            if w is not None and not w.done():
                w.set_result(True)


Channel = SimChannel


def _expire(w: asyncio.Future[bool]) -> None:
    if not w.done():
        w.set_result(False)


class _Serve:
    __slots__ = ("busy", "fast", "handled", "on_burst", "on_malformed")

    def __init__(
        self,
        fast: Callable[[Frames], bool] | None,
        on_malformed: Callable[[Frames, ProtocolError], None],
        on_burst: Callable[[], Any] | None,
    ) -> None:
        self.fast = fast
        self.on_malformed = on_malformed
        self.on_burst = on_burst
        self.busy = False
        self.handled = 0


def new_context() -> object:
    return object()


def term(ctx: object) -> None:
    pass


def router(
    ctx: object, bind: str, *, max_message_bytes: int = 0, curve: object = None
) -> tuple[SimChannel, str]:
    """A broker's socket: ``sim://NAME`` its node on the run's network (the node named
    at :func:`install` for any other endpoint), ``sim://NAME/peer`` its peer ROUTER."""
    if curve is not None:
        raise NotImplementedError("CURVE is not simulated")
    net = _where["net"]
    name, port = _where["name"], "main"
    if bind.startswith("sim://"):
        name, _, rest = bind.removeprefix("sim://").partition("/")
        port = "router" if rest else "main"
    node = _where.get("nodes", {}).get(name) if port != "main" else None
    if port != "main" and node is None:
        raise RuntimeError(f"{bind}: the process has no main socket on its node")
    ch = SimChannel(net, name, port=port, node=node)
    if port == "router":
        for d in _where.get("dealers", []):
            if d.target == name and not d.closed:
                _connected(d)
    return ch, bind


def dealer(
    ctx: object,
    endpoint: str,
    identity: bytes,
    *,
    max_message_bytes: int = 0,
    hwm: int = 0,
    curve: object = None,
    server_public: object = None,
    heartbeats: bool = False,
) -> SimChannel:
    """The peer link's DEALER of the broker whose process runs this, to the peer ROUTER
    at ``endpoint`` (``sim://NAME/peer``)."""
    if curve is not None:
        raise NotImplementedError("CURVE is not simulated")
    proc = PROC.get()
    assert proc is not None, "a DEALER belongs to a simulated process"
    node = _where["nodes"][proc.name]
    ch = SimChannel(_where["net"], proc.name, port="dealer", node=node)
    ch.target = endpoint.removeprefix("sim://").partition("/")[0]
    ch.identity = identity
    if watching():
        ch.handshakes = SimHandshakes()
    dealers: list[SimChannel] = _where.setdefault("dealers", [])
    dealers[:] = [d for d in dealers if not d.closed]
    dealers.append(ch)
    peer = _where["nodes"].get(ch.target)
    if peer is not None and peer.current and "router" in peer.ports:
        _connected(ch)
    return ch


def _connected(ch: SimChannel) -> None:
    """A DEALER's connection is made (again): counted, if its handshakes are watched, and
    its ``on_connected`` runs soon, as its process's (it is set after the socket is made)."""
    if ch.handshakes is not None:
        ch.handshakes.connected += 1

    def run() -> None:
        if not ch.closed and ch.on_connected is not None:
            ch.on_connected()

    asyncio.get_event_loop().call_soon(run, context=ch._context)


def reset(net: Network, a: str, b: str) -> tuple[int, list[SimChannel]]:
    """Every connection between the processes ``a`` and ``b`` closes and is made again at
    once: what was on its way either way is lost, and each connecting socket's
    ``on_connected`` runs (a new handshake).  Returns the messages lost and the sockets
    whose connection was made again."""
    lost = net.reset(a, b)
    nodes = _where.get("nodes", {})
    again = []
    for here, there in ((a, b), (b, a)):
        node = nodes.get(here)
        if node is None or not node.current:
            continue
        for port in sorted(node.ports):
            ch = node.ports[port]
            if isinstance(ch, SimChannel) and ch.target == there and not ch.closed:
                again.append(ch)
                _connected(ch)
    return lost, again


def connections(net: Network) -> list[tuple[str, str]]:
    """The pairs of processes up with a connection between them (the connecting side
    first), in a fixed order."""
    nodes = _where.get("nodes", {})
    pairs = set()
    for name in sorted(nodes):
        node = nodes[name]
        if not node.current:
            continue
        for ch in node.ports.values():
            there = getattr(ch, "target", "")
            peer = nodes.get(there) if there else None
            if not ch.closed and peer is not None and peer.current:
                pairs.add((name, there))
    return sorted(pairs)


def try_send(ch: SimChannel, frames: Sequence[Any]) -> bool:
    """:func:`zps.transport.try_send`: False if it cannot go at once."""
    try:
        return ch.send_nowait(frames)
    except (QueueFull, ClosedError):
        return False


def close(ch: SimChannel) -> None:
    ch.close()


async def serve(
    ch: SimChannel,
    handle: Callable[[Frames], Awaitable[None]],
    on_malformed: Callable[[Frames, ProtocolError], None],
    *,
    fast: Callable[[Frames], bool] | None = None,
    on_burst: Callable[[], Awaitable[None] | None] | None = None,
    idle: float | None = None,
    on_idle: Callable[[], Awaitable[None]] | None = None,
    pump: object = None,
) -> None:
    """:func:`zps.transport.serve` on a :class:`SimChannel` (see the module notes)."""
    s = ch._serve = _Serve(fast, on_malformed, on_burst)
    seen = 0
    try:
        while not ch.closed:
            if not await ch.wait(idle):
                if s.handled != seen:
                    seen = s.handled  # messages came, to the fast handler: not idle
                    continue
                if on_idle is not None:
                    await on_idle()
                continue
            if ch.closed:
                return
            box = ch._inbox
            burst = [box.popleft() for _ in range(min(len(box), DRAIN_BATCH))]
            s.busy = True
            try:
                for frames in burst:
                    try:
                        await handle(frames)
                    except ProtocolError as e:
                        on_malformed(frames, e)
                if on_burst is not None:
                    done = on_burst()
                    if done is not None:
                        await done
            finally:
                s.busy = False
    finally:
        ch._serve = None


# -- the seams -------------------------------------------------------------------

#: The broker's modules whose ``transport`` and ``time`` names the run replaces.
BROKER_MODULES = (
    "zps.broker.broker",
    "zps.broker.base",
    "zps.broker.admission",
    "zps.broker.datapath",
    "zps.broker.report",
    "zps.broker.control",
    "zps.broker.persistence",
    "zps.broker.training",
    "zps.broker.reshard",
    "zps.broker.statefile",
    "zps.broker.pair",
)
#: Other modules the broker runs whose clock is replaced too.
CLOCK_MODULES = ("zps.transport.flow", "zps.ops.metrics")

#: Modules whose ``uuid`` name the run replaces: their incarnations are numbered, so a
#: seed fixes them (a pair's beats and a new state's incarnation).
UUID_MODULES = ("zps.broker.pair", "zps.core.cluster", "zps.broker.reshard")

Saved = list[tuple[Any, str, Any]]


def install(net: Network, name: str, *, watch: bool = False) -> Saved:
    """Replace the seams (see the module notes) for a run on ``net``, the broker's node
    being ``name`` (``watch``: the connecting sockets watch their handshakes); returns
    what :func:`uninstall` puts back."""
    import importlib
    import sys

    from zps.broker import forward

    CLOCK.sched = net.sched
    _where.update(net=net, name=name, watch=watch)
    saved: Saved = []

    def put(obj: Any, attr: str, value: Any) -> None:
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    this = sys.modules[__name__]
    for modname in BROKER_MODULES:
        mod = importlib.import_module(modname)
        if hasattr(mod, "transport"):
            put(mod, "transport", this)
        if hasattr(mod, "time"):
            put(mod, "time", CLOCK)
    for modname in CLOCK_MODULES:
        put(importlib.import_module(modname), "time", CLOCK)
    statefile = importlib.import_module("zps.broker.statefile")
    put(statefile, "asyncio", INLINE)
    put(forward, "step", None)  # the pure Python data path
    ids = itertools.count(1)
    numbered = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=next(ids) << 80))
    for modname in UUID_MODULES:
        put(importlib.import_module(modname), "uuid", numbered)
    return saved


def uninstall(saved: Saved) -> None:
    for obj, attr, value in reversed(saved):
        setattr(obj, attr, value)
    _where.clear()
    CLOCK.sched = None
