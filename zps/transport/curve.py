"""CURVE: keys, their options on sockets, the ZAP handler, and who sent a frame.

Rules: a CURVE server's ROUTER admits only the allowed public keys (ZAP, through
:func:`start_authenticator`) and tells of each handshake refused; a message's sender is
the key that authenticated it (:func:`sender_key`), and a peer is sent to only while the
connection its last accepted message came by is open (:class:`ConnectionGate`, pure
decisions).  ZMTP heartbeats close a dead connection, freeing its identity, and a
client's outlast a server's, so a reconnecting client finds its identity free.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from zps.errors import BrokenError


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE keys of one process (see :func:`zps.ops.security.load_curve_keys`)."""

    public: bytes
    secret: bytes
    server_public: bytes | None  # the broker's, for connecting sockets
    allowed_dir: str | None  # the ZAP allow-list of client public keys, for binding sockets


def write_keypair(out_dir: str, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600) in zmq's format."""
    import zmq.auth

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(out_dir, name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_keys(path: str) -> tuple[bytes | None, bytes | None]:
    """(public, secret) from a key file (secret is None for a public-only file)."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(path)
    return public, secret


def load_public_keys(directory: str) -> frozenset[bytes]:
    """The Z85 public keys of every ``*.key`` file in ``directory``."""
    import zmq.auth

    return frozenset(zmq.auth.load_certificates(directory))


class ConnectionGate:
    """Which peers of a CURVE server may be sent to: decisions only, no I/O.

    A ROUTER routes by identity, and the connection holding an identity can change
    (its owner's closed; under CURVE no new one takes an identity in use, but one may
    take it once it is free, whatever its key).  So a peer is sent to only while the
    connection its last accepted message came by (its descriptor, ``ZMQ_SRCFD``) is
    open: once that closes, nothing goes to the identity until a message of its own
    key is accepted again (on whatever connection holds it then)."""

    #: Peers remembered as closed at most (the oldest are forgotten past it).
    MAX_CLOSED = 65536

    def __init__(self) -> None:
        self._fd_of: dict[bytes, int] = {}
        self._peer_of: dict[int, bytes] = {}
        self._closed: dict[bytes, None] = {}  # in the order they closed

    def accepted(self, peer: bytes, fd: int | None) -> None:
        """A message from ``peer`` by connection ``fd`` was accepted (its key owns it)."""
        if fd is None:
            return
        before = self._fd_of.get(peer)
        if before != fd:
            if before is not None and self._peer_of.get(before) == peer:
                del self._peer_of[before]
            self._fd_of[peer] = fd
            self._peer_of[fd] = peer
        self._closed.pop(peer, None)

    def closed(self, fd: int) -> bytes | None:
        """Connection ``fd`` closed: the peer it held, now gated (None: none)."""
        peer = self._peer_of.pop(fd, None)
        if peer is None or self._fd_of.get(peer) != fd:
            return None
        del self._fd_of[peer]
        self._closed[peer] = None
        if len(self._closed) > self.MAX_CLOSED:
            del self._closed[next(iter(self._closed))]
        return peer

    def may_send(self, peer: bytes) -> bool:
        return peer not in self._closed

    def forget(self, peer: bytes) -> None:
        """``peer`` left for good: nothing is sent to it anyway."""
        fd = self._fd_of.pop(peer, None)
        if fd is not None and self._peer_of.get(fd) == peer:
            del self._peer_of[fd]


def sender_fd(frame: Any) -> int | None:
    """The descriptor of the connection a received frame came by (None: unknown)."""
    if not isinstance(frame, zmq.Frame):
        return None
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


_monitors = iter(range(1 << 62))
#: Told of each handshake refused: (peer address, Z85 key or None, reason).
OnRefused = Callable[[str, "bytes | None", str], None]


class _KeySet:
    """A ZAP credentials provider admitting a fixed set of Z85 public keys (any key
    when None), telling ``on_refused`` of each key it refuses."""

    def __init__(self, keys: frozenset[bytes] | None, on_refused: OnRefused | None) -> None:
        self.keys = keys
        self.on_refused = on_refused
        self.peer = "?"  # the address of the handshake being decided

    def callback(self, domain: str, key: bytes) -> bool:
        if self.keys is None or key in self.keys:
            return True
        if self.on_refused is not None:
            self.on_refused(self.peer, key, "key_not_allowed")
        return False


def start_authenticator(
    ctx: zmq.asyncio.Context,
    allowed_dir: str | None,
    *,
    keys: frozenset[bytes] | None = None,
    on_refused: OnRefused | None = None,
) -> Any:
    """ZAP for every CURVE server socket of ``ctx``: only the Z85 public ``keys`` when
    given, else only keys in ``allowed_dir`` (any valid key when None: encryption
    without an allow-list).  ``on_refused`` is told of each key refused.  A message's
    User-Id is its sender's Z85 public key (:func:`sender_key`).  Stop it with
    ``.stop()``."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    if keys is None and allowed_dir is not None:
        keys = load_public_keys(allowed_dir)
    provider = _KeySet(keys, on_refused)

    class Authenticator(AsyncioAuthenticator):
        async def handle_zap_message(self, msg: list[bytes]) -> None:
            if len(msg) > 3:
                provider.peer = msg[3].decode("utf-8", "replace")
            await super().handle_zap_message(msg)

    auth = Authenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=provider)
    return auth


def watch_handshakes(
    sock: zmq.Socket[Any],
    on_refused: OnRefused,
    on_closed: Callable[[int], Any] | None = None,
    *,
    auth: bool = False,
) -> Callable[[], None]:
    """Tell ``on_refused`` of every handshake of the CURVE server ``sock`` that failed
    before its key was known (a peer with no CURVE key, or a broken handshake:
    ``no_key``; with ``auth``, a key the ZAP handler refused too: ``key_not_allowed``,
    for a socket whose handler does not report them), and ``on_closed`` of each
    connection that closed (its descriptor).  Runs on the event loop; returns the
    function that stops watching."""
    from zmq.utils.monitor import parse_monitor_message

    events = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    if auth:
        events |= zmq.EVENT_HANDSHAKE_FAILED_AUTH
    if on_closed is not None:
        events |= zmq.EVENT_DISCONNECTED
    address = f"inproc://zps-monitor-{id(sock):x}-{next(_monitors)}"
    sock.monitor(address, events)
    monitor: zmq.Socket[Any] = zmq.Socket(sock.context, zmq.PAIR)
    monitor.connect(address)
    loop = asyncio.get_running_loop()
    fd = int(monitor.FD)

    def read() -> None:
        while int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.ZMQError, ValueError):
                return
            kind = int(event["event"])
            if kind == zmq.EVENT_DISCONNECTED:
                if on_closed is not None:
                    on_closed(int(event["value"]))
                continue
            where = event.get("endpoint", b"?")
            peer = where.decode("utf-8", "replace") if isinstance(where, bytes) else str(where)
            on_refused(
                peer,
                None,
                "key_not_allowed" if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "no_key",
            )

    loop.add_reader(fd, read)
    loop.call_soon(read)

    def stop() -> None:
        loop.remove_reader(fd)
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)

    return stop


class HandshakeWatch:
    """What became of a CURVE client socket's handshakes (a monitor on it), so a
    peer that never answers can be told from one that refused this key."""

    _FAILED: dict[int, str] = {
        zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused this process's key (it is in none of "
        "the server's allow-lists)",
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed the CURVE handshake (is "
        "security.broker_public_key_file the server's key, and CURVE on there?)",
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed the CURVE handshake (is "
        "security.broker_public_key_file the server's key, and CURVE on there?)",
    }

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED
        for event in self._FAILED:
            events |= event
        address = f"inproc://zps-monitor-{id(sock):x}-{next(_monitors)}"
        sock.monitor(address, events)
        self._sock = sock
        self._monitor: zmq.Socket[Any] = zmq.Socket(sock.context, zmq.PAIR)
        self._monitor.connect(address)
        self._last: str | None = None

    def failure(self) -> str | None:
        """How the latest handshake failed; None if it succeeded, or none ended yet."""
        from zmq.utils.monitor import parse_monitor_message

        while not self._monitor.closed:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.ZMQError, ValueError):
                break
            self._last = self._FAILED.get(int(event["event"]))
        return self._last

    def close(self) -> None:
        if not self._sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        self._monitor.close(0)


def sender_key(frame: Any) -> bytes | None:
    """The Z85 CURVE public key that authenticated the sender of a received frame (its
    ZAP User-Id); None without CURVE."""
    if not isinstance(frame, zmq.Frame):
        return None
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user.encode() if isinstance(user, str) and user else None


def _curve_server(sock: zmq.Socket[Any], keys: CurveKeys | None) -> None:
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)


#: ZMTP heartbeats of a CURVE server socket: (interval, timeout) in seconds.  A
#: connection silent for the timeout (its peer's libzmq answers pings whatever its
#: process does) is dead and closed, freeing its identity.
CURVE_SERVER_HEARTBEAT = (0.5, 1.5)
#: A CURVE client's: a longer timeout than the server's, so the server has let go of
#: a dead connection's identity before the client connects again with it.
CURVE_CLIENT_HEARTBEAT = (1.0, 4.0)
#: A CURVE client that waits for the server to let go of its identity (``dealer``'s
#: ``wait_for_release``) connects again this long after losing its connection: past a
#: server's ping and its timeout (CURVE_SERVER_HEARTBEAT), so a dead connection the
#: server still held is closed, the identity free, and the new one heard.
CURVE_CLIENT_RECONNECT = 2.5


def _heartbeats(sock: zmq.Socket[Any], ivl_timeout: tuple[float, float]) -> None:
    ivl, timeout = ivl_timeout
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(ivl * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))


def _curve_client(
    sock: zmq.Socket[Any], keys: CurveKeys | None, server_public: bytes | None
) -> None:
    if keys is not None:
        _heartbeats(sock, CURVE_CLIENT_HEARTBEAT)
        if server_public is None:
            raise BrokenError(
                "CURVE is configured but the server's public key is unknown "
                "(security.broker_public_key_file)"
            )
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


def reconnect_silence(interval: float, liveness: int) -> float:
    """How long a CURVE client hears nothing from a server that probes it every
    ``interval`` seconds (declaring it dead after ``liveness`` of them) before making
    its connection again: three liveness timeouts, at least 5 s."""
    return max(5.0, 3.0 * interval * liveness)
