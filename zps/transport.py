"""The only module that talks to ZeroMQ sockets.

It makes sockets with the options every zps socket needs, receives in
batches (one awaited receive, then a non-blocking drain, so a busy socket
costs one Future per burst rather than per message), sends without copying
large frames, and turns ``zmq.ZMQError`` into zps errors at this boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from zps.errors import BrokenError, ClosedError

if TYPE_CHECKING:
    from zps.security import CurveKeys

#: Frames at or above this size are sent without copying.
ZERO_COPY_BYTES = 64 * 1024
#: Messages taken from a socket per wake-up, at most.
DRAIN_BATCH = 256

Frames = list[Any]


def new_context() -> zmq.asyncio.Context:
    """A context per owner: zps never uses a process-global context."""
    return zmq.asyncio.Context()


def _common(sock: zmq.asyncio.Socket, max_message_bytes: int, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)


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


def start_authenticator(ctx: zmq.asyncio.Context, allowed_dir: str | None) -> Any:
    """ZAP for every CURVE server socket of ``ctx``: only keys in ``allowed_dir``
    (any valid key when None: encryption without an allow-list).  Stop it with
    ``.stop()``."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=allowed_dir or zmq.auth.CURVE_ALLOW_ANY)
    return auth


def _curve_server(sock: zmq.asyncio.Socket, keys: CurveKeys | None) -> None:
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)


def _curve_client(
    sock: zmq.asyncio.Socket, keys: CurveKeys | None, server_public: bytes | None
) -> None:
    if keys is not None:
        if server_public is None:
            raise BrokenError(
                "CURVE is configured but the server's public key is unknown "
                "(security.broker_public_key_file)"
            )
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


def router(
    ctx: zmq.asyncio.Context,
    bind: str,
    *,
    max_message_bytes: int,
    hwm: int = 100_000,
    curve: CurveKeys | None = None,
) -> tuple[zmq.asyncio.Socket, str]:
    """A bound ROUTER socket and the endpoint it actually bound (port resolved)."""
    sock = ctx.socket(zmq.ROUTER)
    _common(sock, max_message_bytes, hwm)
    _curve_server(sock, curve)
    # Unroutable sends raise instead of vanishing, so the broker can answer
    # "shard unavailable" rather than lose the request.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    try:
        sock.bind(bind)
    except zmq.ZMQError as e:
        sock.close(0)
        raise BrokenError(f"cannot bind {bind}: {e.strerror}") from e
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return sock, endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def dealer(
    ctx: zmq.asyncio.Context,
    connect: str,
    identity: bytes,
    *,
    max_message_bytes: int,
    hwm: int = 100_000,
    curve: CurveKeys | None = None,
    server_public: bytes | None = None,
) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    _common(sock, max_message_bytes, hwm)
    _curve_client(sock, curve, server_public)
    sock.setsockopt(zmq.IDENTITY, identity)
    try:
        sock.connect(connect)
    except zmq.ZMQError as e:
        sock.close(0)
        raise BrokenError(f"cannot connect to {connect}: {e.strerror}") from e
    return sock


async def recv_burst(sock: zmq.asyncio.Socket, timeout: float | None = None) -> list[Frames]:
    """Wait for one message, then take whatever else is already queued.

    With ``timeout`` (seconds), returns an empty list if nothing came by then.
    """
    if timeout is not None:
        try:
            if not await sock.poll(timeout=int(timeout * 1000)):
                return []
        except zmq.ZMQError as e:
            raise ClosedError("socket closed") from e
    try:
        first = await sock.recv_multipart(copy=False)
    except zmq.ZMQError as e:
        if e.errno == zmq.ENOTSOCK or sock.closed:
            raise ClosedError("socket closed") from e
        raise BrokenError(f"receive failed: {e.strerror}") from e
    burst = [first]
    while len(burst) < DRAIN_BATCH:
        try:
            burst.append(await sock.recv_multipart(zmq.NOBLOCK, copy=False))
        except zmq.Again:
            break
        except zmq.ZMQError as e:
            raise BrokenError(f"receive failed: {e.strerror}") from e
    return burst


def _needs_zero_copy(frames: Sequence[Any]) -> bool:
    return any(not isinstance(f, zmq.Frame) and len(f) >= ZERO_COPY_BYTES for f in frames)


async def send(sock: zmq.asyncio.Socket, frames: Sequence[Any]) -> bool:
    """Send a multipart message.

    Returns False when a ROUTER has no route to the first frame's peer (it
    disconnected); raises BrokenError for other failures.
    """
    try:
        copy = not _needs_zero_copy(frames) and not any(isinstance(f, zmq.Frame) for f in frames)
        await sock.send_multipart(frames, copy=copy)
    except zmq.ZMQError as e:
        if e.errno == zmq.EHOSTUNREACH:
            return False
        if e.errno == zmq.ENOTSOCK or sock.closed:
            raise ClosedError("socket closed") from e
        raise BrokenError(f"send failed: {e.strerror}") from e
    return True


def close(sock: zmq.asyncio.Socket) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.close(0)


def term(ctx: zmq.asyncio.Context) -> None:
    with contextlib.suppress(zmq.ZMQError):
        ctx.destroy(0)


def frame_bytes(frame: Any) -> bytes:
    """The bytes of a received frame (copies; for small control frames)."""
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


def frame_buffer(frame: Any) -> memoryview:
    """A zero-copy view of a received frame."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def install_uvloop() -> bool:
    """Use uvloop where available (Linux); returns whether it is in use."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
