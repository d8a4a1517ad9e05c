"""The sockets: a bound :func:`router` and a connected :func:`dealer`, each wrapped in a
:class:`~zps.transport.channel.Channel`, with the options every zps socket needs.

Rules: every socket lingers for nothing, bounds its messages' size and its queues
(:data:`DEFAULT_HWM`), keeps TCP alive, gives up a handshake after
:data:`HANDSHAKE_S` and reconnects within a broker's start-up hold (:func:`_common`),
and asks the kernel for the receive buffer ``ZPS_TCP_RCVBUF`` names, if set
(:func:`tcp_rcvbuf`); a ROUTER reports an unroutable send rather than drop it; a
failure to bind or connect is a :class:`BrokenError` naming the endpoint.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from zps.errors import BrokenError
from zps.transport.channel import ZPS_ID_PROPERTY, Channel
from zps.transport.curve import (
    CURVE_CLIENT_HEARTBEAT,
    CURVE_SERVER_HEARTBEAT,
    CurveKeys,
    HandshakeWatch,
    _curve_client,
    _curve_server,
    _heartbeats,
)
from zps.transport.peers import SECRET_PREFIX, PeerTable

#: Messages queued per peer and direction before senders wait: bounds the
#: memory a flood (or a stalled peer) can pin, while leaving ample room for
#: requests in flight.
DEFAULT_HWM = 1000
#: A DEALER's ZMTP heartbeats (interval, timeout: seconds), with CURVE or with
#: ``dealer(heartbeats=True)``.
CLIENT_HEARTBEAT = CURVE_CLIENT_HEARTBEAT
#: A connection whose handshake (the ZMTP greeting, CURVE's HELLO to READY, the ZAP
#: check) has not finished within this many seconds is closed, and a connecting socket
#: makes it again: a path that died during the handshake is given up as a heartbeat
#: gives up one that died later (libzmq's own bound is 30 s).
HANDSHAKE_S = 5.0


def tcp_rcvbuf(environ: Mapping[str, str] = os.environ) -> int | None:
    """The kernel receive buffer (bytes, ``ZMQ_RCVBUF``) every zps socket asks for:
    ``ZPS_TCP_RCVBUF`` in the environment, a positive integer; unset or empty, the
    kernel's own (Linux grows a buffer up to ``net.ipv4.tcp_rmem``'s maximum).  A host
    that must bound the memory its connections pin, or keep replies queued where zps
    bounds them (the broker's flow control) rather than in the kernel, sets it."""
    raw = environ.get("ZPS_TCP_RCVBUF", "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"ZPS_TCP_RCVBUF={raw!r} is not a positive number of bytes")
    return value


def _common(sock: zmq.Socket[Any], max_message_bytes: int, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    rcvbuf = tcp_rcvbuf()
    if rcvbuf is not None:
        sock.setsockopt(zmq.RCVBUF, rcvbuf)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
    # Reconnect every 0.1-0.35 s (zmq adds up to RECONNECT_IVL of jitter): a restarted
    # broker hears from every peer well inside its start-up hold (two liveness
    # timeouts), whatever the outage lasted: a back-off longer than the hold would
    # bring shards back after it, to find their partitions lost.
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 250)


def router(
    ctx: zmq.asyncio.Context,
    bind: str,
    *,
    max_message_bytes: int,
    hwm: int = DEFAULT_HWM,
    curve: CurveKeys | None = None,
) -> tuple[Channel, str]:
    """A bound ROUTER socket and the endpoint it actually bound (port resolved)."""
    sock: zmq.Socket[Any] = zmq.Socket(ctx, zmq.ROUTER)
    _common(sock, max_message_bytes, hwm)
    _curve_server(sock, curve)
    # Unroutable sends raise instead of vanishing, so the broker can answer
    # "shard unavailable" rather than lose the request.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A peer that reconnects takes its identity back from its dead connection at once.
    # Under CURVE a routing id is a handle no other peer can name (the ZAP handler's, or
    # the peer's secret one: see the channel's edge), and no connection takes one in use.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0 if curve is not None else 1)
    if curve is not None:
        _heartbeats(sock, CURVE_SERVER_HEARTBEAT)
    try:
        sock.bind(bind)
    except zmq.ZMQError as e:
        sock.close(0)
        raise BrokenError(f"cannot bind {bind}: {e.strerror}") from e
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    # A CURVE server reads each sender's key and zps id off its frames' metadata
    # (sender_key, Channel.edge): pyzmq's frames, never the compiled I/O.
    channel = Channel(sock, compiled=curve is None)
    channel.curve_server = curve is not None
    if curve is not None:
        channel.peers = PeerTable()
    return channel, endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


class Dealer(Channel):
    """A connected DEALER's channel.  Under CURVE (or asked to) its handshakes are watched
    (:attr:`handshakes`): ``on_connected`` (settable any time) is called on the loop
    each time a connection is made or made again, for the socket to speak there at
    once (see :func:`dealer`)."""

    handshakes: HandshakeWatch | None = None

    @property
    def on_connected(self) -> Callable[[], object] | None:
        return None if self.handshakes is None else self.handshakes.on_connected

    @on_connected.setter
    def on_connected(self, call: Callable[[], object] | None) -> None:
        if self.handshakes is not None:
            self.handshakes.on_connected = call

    def close(self) -> None:
        if self.handshakes is not None:
            self.handshakes.close()
        super().close()


def dealer(
    ctx: zmq.asyncio.Context,
    connect: str,
    identity: bytes,
    *,
    max_message_bytes: int,
    hwm: int = DEFAULT_HWM,
    curve: CurveKeys | None = None,
    server_public: bytes | None = None,
    silence: float | None = None,
    on_connected: Callable[[], object] | None = None,
    heartbeats: bool = False,
    watch: bool = False,
) -> Dealer:
    """A DEALER connected to ``connect`` as zps id ``identity``.  With CURVE the
    socket's routing id is a secret and ``identity`` goes as connection metadata
    (:func:`_zps_id`); ``silence`` (seconds, for a server that sends something at least
    that often): a connection silent that long is made again (see
    :meth:`Channel.reconnect_when_silent`).  ``heartbeats``: ZMTP heartbeats without CURVE
    too (a CURVE client always has them): a connection whose peer answers no ping within
    the timeout (:data:`CLIENT_HEARTBEAT`) is closed and made again, so a connection that
    died on the far side only, or on the path between, is noticed.

    Rule: under CURVE the server cannot send to ``identity`` over a new connection
    until a message of it came by that connection and was accepted.  A DEALER whose
    server must reach it unasked (requests forwarded to a shard, a broker's probes and
    maps) speaks as each connection is made: ``on_connected`` (also settable later as
    :attr:`Dealer.on_connected`) sends a message the server accepts, such as its
    heartbeat.  Without CURVE a connection is reachable at once; ``watch`` calls
    ``on_connected`` as each connection is made all the same (a server that must learn
    that a connection was made again: what it sent by the one before may be lost)."""
    sock = _dealer_socket(
        ctx,
        connect,
        identity,
        max_message_bytes=max_message_bytes,
        hwm=hwm,
        curve=curve,
        server_public=server_public,
        connected=False,
        heartbeats=heartbeats,
    )
    ch = Dealer(sock)
    if curve is not None or watch:  # watched before it connects: the first one counts too
        ch.handshakes = HandshakeWatch(sock, on_connected)
    try:
        _connect(sock, connect)
    except BrokenError:
        ch.close()
        raise
    if curve is not None and silence is not None:
        ch.reconnect_when_silent(connect, silence)
    return ch


def _dealer_socket(
    ctx: zmq.Context[Any],
    connect: str,
    identity: bytes,
    *,
    max_message_bytes: int,
    hwm: int = DEFAULT_HWM,
    curve: CurveKeys | None = None,
    server_public: bytes | None = None,
    connected: bool = True,
    heartbeats: bool = False,
) -> zmq.Socket[Any]:
    """:func:`dealer`'s socket alone (for :class:`LinkThread`: no event loop); not
    connected yet unless ``connected``."""
    sock: zmq.Socket[Any] = zmq.Socket(ctx, zmq.DEALER)
    _common(sock, max_message_bytes, hwm)
    if heartbeats:  # before it connects: a connection takes the options as it is made
        _heartbeats(sock, CLIENT_HEARTBEAT)
    try:
        _curve_client(sock, curve, server_public)
        if curve is None:
            sock.setsockopt(zmq.IDENTITY, identity)
        else:
            _zps_id(sock, identity)
    except BrokenError:
        sock.close(0)
        raise
    if connected:
        _connect(sock, connect)
    return sock


def _connect(sock: zmq.Socket[Any], endpoint: str) -> None:
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(0)
        raise BrokenError(f"cannot connect to {endpoint}: {e.strerror}") from e


#: libzmq's ZMQ_METADATA: connection metadata a socket sends with its handshake.
#: Numbered in the draft API, handled by every libzmq build from 4.3.
ZMQ_METADATA = 95


def _zps_id(sock: zmq.Socket[Any], identity: bytes) -> None:
    """CURVE: the socket's routing id is a secret of its own (``p-`` and 32 random hex
    digits, never logged or shown: no other peer can present it), and its zps id
    ``identity`` goes with each connection as ``X-Zps-Id`` metadata."""
    sock.setsockopt(zmq.IDENTITY, SECRET_PREFIX + os.urandom(16).hex().encode())
    try:
        sock.setsockopt(ZMQ_METADATA, f"{ZPS_ID_PROPERTY}:".encode() + identity)
    except zmq.ZMQError as e:
        raise BrokenError(
            f"this libzmq ({zmq.zmq_version()}) refuses connection metadata "
            f"(ZMQ_METADATA, option {ZMQ_METADATA}), which zps needs under CURVE to send "
            f"its id {identity.decode('utf-8', 'replace')}: {e.strerror}"
        ) from e


def local_address(endpoint: str) -> str:
    """This host's address on the route to ``endpoint``'s host (no packet is sent): what a
    process advertises for others to reach it at."""
    host = urlsplit(endpoint).hostname or "127.0.0.1"
    if host in ("*", "0.0.0.0", "localhost"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()
