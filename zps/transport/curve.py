"""CURVE: keys, their options on sockets, the ZAP handler, and who sent a frame.

Rules: a CURVE server's ROUTER admits only the allowed public keys (ZAP, through
:func:`start_authenticator`) and tells of each handshake refused; a message's sender is
the key that authenticated it (:func:`sender_key`).  The ZAP handler gives every
connection a routing id of its own choosing (:func:`zap_metadata`), a handle no peer
can name; the peer's zps id travels as connection metadata and is bound to that
handle per accepted message (:class:`~zps.transport.peers.PeerTable`).  ZMTP
heartbeats close a dead connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from zps.errors import BrokenError
from zps.transport.channel import Channel, OnRefused
from zps.transport.peers import ASSIGNED_PREFIX


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


def public_key_of(secret: bytes) -> bytes:
    """The Z85 public key of the Z85 secret key ``secret``; ValueError if ``secret`` is
    not one."""
    try:
        return zmq.curve_public(secret)
    except zmq.ZMQError as e:
        raise ValueError(f"not a Z85 CURVE secret key: {e}") from None


def load_public_keys(directory: str) -> frozenset[bytes]:
    """The Z85 public keys of every ``*.key`` file in ``directory``."""
    import zmq.auth

    return frozenset(zmq.auth.load_certificates(directory))


_monitors = iter(range(1 << 62))

#: How long the ZAP handler waits before it answers a handshake (each on a timer of
#: its own: many handshakes at once wait this long together).  libzmq sets a
#: connection's routing id from the ZAP reply's ``Identity`` and from the peer's own
#: metadata, whichever it reads last; the peer's is read just after the ZAP request is
#: sent, so a reply this much later nearly always wins (a peer whose own id wins is
#: served only under its secret ``p-`` id: zps.transport.peers.is_handle).
ZAP_REPLY_DELAY = 0.002


def zmtp_property(name: bytes, value: bytes) -> bytes:
    """A ZMTP metadata property: the name's length (1 byte), the name, the value's
    length (4 bytes, big-endian), the value."""
    if not 0 < len(name) < 256:
        raise ValueError(f"a ZMTP property name is 1-255 bytes, got {len(name)}")
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def new_handle() -> bytes:
    """A fresh routing id for one connection: ``z-`` and 32 random hex digits."""
    return ASSIGNED_PREFIX + os.urandom(16).hex().encode()


def zap_metadata(handle: bytes) -> bytes:
    """The metadata frame of a ZAP reply that sets the connection's routing id."""
    return zmtp_property(b"Identity", handle)


class _KeySet:
    """A ZAP credentials provider admitting a fixed set of Z85 public keys (any key
    when None), telling ``on_refused`` of each key it refuses."""

    def __init__(self, keys: frozenset[bytes] | None, on_refused: OnRefused | None) -> None:
        self.keys = keys
        self.on_refused = on_refused
        self.peer = "an unknown address"  # the address of the handshake being decided

    def callback(self, domain: str, key: bytes) -> bool:
        if self.keys is None or key in self.keys:
            return True
        if self.on_refused is not None:
            self.on_refused(f"at {self.peer}", key, "key_not_allowed")
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
    User-Id is its sender's Z85 public key (:func:`sender_key`); each connection
    admitted gets a fresh routing id (:func:`new_handle`).  Make it before the server
    sockets of ``ctx``.  Stop it with ``.stop()``."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    if keys is None and allowed_dir is not None:
        keys = load_public_keys(allowed_dir)
    provider = _KeySet(keys, on_refused)

    class Authenticator(AsyncioAuthenticator):
        """ZAP on a ROUTER rather than pyzmq's REP, which must answer one request
        before it may take the next: each request is answered ZAP_REPLY_DELAY after
        it came, on a timer of its own, so N handshakes arriving together are answered
        together, not one delay after another."""

        pending: set[asyncio.Task[None]] = set()
        envelope: list[bytes] = []  # the routing of the request being answered
        reader = -1

        def start(self) -> None:
            sock: zmq.Socket[Any] = self.context.socket(zmq.ROUTER, socket_class=zmq.Socket)
            sock.linger = 1
            sock.bind("inproc://zeromq.zap.01")
            self.zap_socket = sock
            loop = asyncio.get_running_loop()
            self.reader = int(sock.FD)
            loop.add_reader(self.reader, self._take)
            loop.call_soon(self._take)

        def _take(self) -> None:
            """Every request queued (the descriptor is edge-triggered: to the end)."""
            sock = self.zap_socket
            while sock is not None and not sock.closed and int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if b"" not in frames:
                    continue  # no envelope: not a ZAP request
                i = frames.index(b"")
                task = asyncio.ensure_future(self._answer(frames[: i + 1], frames[i + 1 :]))
                self.pending.add(task)
                task.add_done_callback(self.pending.discard)

        async def _answer(self, envelope: list[bytes], msg: list[bytes]) -> None:
            await asyncio.sleep(ZAP_REPLY_DELAY)
            if self.zap_socket is None or self.zap_socket.closed:
                return  # stopped meanwhile
            # pyzmq's handler decides and replies (_send_zap_reply) before its first
            # suspension (the key check is synchronous): the peer and the envelope
            # set here are this request's.
            address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
            provider.peer = address or "an unknown address"
            self.envelope = envelope
            await super().handle_zap_message(msg)

        def _send_zap_reply(
            self,
            request_id: bytes,
            status_code: bytes,
            status_text: bytes,
            user_id: str = "anonymous",
        ) -> None:
            user = user_id.encode() if isinstance(user_id, str) else user_id
            reply = [*self.envelope, b"1.0", request_id, status_code, status_text]
            if status_code == b"200":
                reply += [user, zap_metadata(new_handle())]
            else:
                reply += [b"", b""]
            self.zap_socket.send_multipart(reply)
            # A send may take the descriptor's notice of requests that came meanwhile.
            asyncio.get_running_loop().call_soon(self._take)

        def stop(self) -> None:
            for task in list(self.pending):
                task.cancel()
            if self.reader >= 0:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(self.reader)
                self.reader = -1
            super().stop()

    auth = Authenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=provider)
    return auth


def watch_handshakes(
    ch: Channel,
    on_refused: OnRefused,
    on_closed: Callable[[int], Any] | None = None,
    *,
    auth: bool = False,
) -> Callable[[], None]:
    """Tell ``on_refused`` of every handshake of the CURVE server channel ``ch`` that
    failed before its key was known (a peer with no CURVE key, or a broken handshake:
    ``no_key``; with ``auth``, a key the ZAP handler refused too: ``key_not_allowed``,
    for a socket whose handler does not report them) and of every message the channel
    refused at its edge (see :meth:`Channel.edge`), and ``on_closed`` of each
    connection that closed (its descriptor).  Runs on the event loop; returns the
    function that stops watching."""
    from zmq.utils.monitor import parse_monitor_message

    sock = ch.sock
    ch.on_refused = on_refused

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
            # The event names the endpoint the peer connected to, not the peer.
            where = event.get("endpoint", b"?")
            endpoint = where.decode("utf-8", "replace") if isinstance(where, bytes) else str(where)
            on_refused(
                f"connecting to {endpoint}",
                None,
                "key_not_allowed" if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "no_key",
            )

    loop.add_reader(fd, read)
    loop.call_soon(read)

    def stop() -> None:
        ch.on_refused = None
        loop.remove_reader(fd)
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)

    return stop


class HandshakeWatch:
    """What became of a CURVE client socket's handshakes (a monitor on it), so a
    peer that never answers can be told from one that refused this key; and, with
    ``on_connected``, a call on the event loop as each handshake succeeds (a
    connection made or made again), so the socket can speak there at once: a CURVE
    server sends to a zps id only by a connection that carried an accepted message
    of it.  Make it before the socket connects (it must see the first handshake)."""

    _FAILED: dict[int, str] = {
        zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused this process's key (it is in none of "
        "the server's allow-lists)",
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed the CURVE handshake (is "
        "security.broker_public_key_file the server's key, and CURVE on there?)",
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed the CURVE handshake (is "
        "security.broker_public_key_file the server's key, and CURVE on there?)",
    }

    def __init__(
        self, sock: zmq.Socket[Any], on_connected: Callable[[], object] | None = None
    ) -> None:
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED
        for event in self._FAILED:
            events |= event
        address = f"inproc://zps-monitor-{id(sock):x}-{next(_monitors)}"
        sock.monitor(address, events)
        self._sock = sock
        self._monitor: zmq.Socket[Any] = zmq.Socket(sock.context, zmq.PAIR)
        self._monitor.connect(address)
        self._last: str | None = None
        #: Called (on the loop) as each handshake succeeds; may be set later.
        self.on_connected = on_connected
        self.connected = 0  # handshakes that succeeded
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        with contextlib.suppress(RuntimeError):  # no running loop: failure() reads
            self._loop = asyncio.get_running_loop()
            self._fd = int(self._monitor.FD)
            self._loop.add_reader(self._fd, self._read)
            self._loop.call_soon(self._read)

    def _read(self) -> None:
        """Take every event queued (the descriptor is edge-triggered: to the end)."""
        from zmq.utils.monitor import parse_monitor_message

        while not self._monitor.closed:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.ZMQError, ValueError):
                return
            kind = int(event["event"])
            self._last = self._FAILED.get(kind)
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected += 1
                if self.on_connected is not None and not self._sock.closed:
                    self.on_connected()

    def failure(self) -> str | None:
        """How the latest handshake failed; None if it succeeded, or none ended yet."""
        self._read()
        return self._last

    def close(self) -> None:
        if self._loop is not None and not self._monitor.closed:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._fd)
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
#: A CURVE client's: a longer timeout than the server's, whose pings keep a live
#: connection from looking silent.
CURVE_CLIENT_HEARTBEAT = (1.0, 4.0)


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
