"""The only package that talks to ZeroMQ sockets.

It makes sockets with the options every zps socket needs, drives them from the event
loop, sends without copying large frames, and turns ``zmq.ZMQError`` into zps errors at
this boundary.  One job per module:

- :mod:`~zps.transport.channel`: :class:`Channel`, a socket driven by the event loop,
  its send and receive, and :func:`serve`, the one receive-and-dispatch loop;
- :mod:`~zps.transport.compiled`: the binding of the optional extension ``zps._zmqio``
  (one call per message sent or received) to pyzmq's libzmq (:data:`COMPILED_IO`,
  :data:`IO_PATH`);
- :mod:`~zps.transport.flow`: sending from a ROUTER to many peers without waiting on
  one (:class:`Outbound`, :class:`Allowance`, :class:`Posted`);
- :mod:`~zps.transport.sockets`: :func:`router` and :func:`dealer` (a :class:`Dealer`),
  with the options every zps socket needs;
- :mod:`~zps.transport.curve`: CURVE keys on sockets, the ZAP handler, a frame's
  sender (:func:`sender_key`), the routing ids the ZAP handler assigns;
- :mod:`~zps.transport.peers`: which connection stands for which zps id under CURVE
  (:class:`PeerTable`, pure);
- :mod:`~zps.transport.iothreads`: contexts (:func:`new_context`) and the scheduling of
  their I/O threads (:class:`IoThreads`);
- :mod:`~zps.transport.link`: :class:`LinkThread`, links served by a thread of their own.

Other code imports every name from here (``from zps import transport``).  The modules
read each other's names from the defining module: a test that patches a name patches
it there.
"""

from __future__ import annotations

from zps.transport.channel import (
    _EVENTS,
    _NOBLOCK,
    _POLLIN,
    _SNDMORE,
    BACKOFF_S,
    DRAIN_BATCH,
    RECV_COPY_MAX,
    ZERO_COPY_BYTES,
    Channel,
    Frames,
    Handler,
    OnMalformed,
    OnRefused,
    Pump,
    _raw_get,
    _raw_recv,
    _raw_send,
    close,
    frame_buffer,
    frame_bytes,
    message_bytes,
    recv_burst,
    send,
    send_if_room,
    serve,
    try_send,
)
from zps.transport.compiled import (
    COMPILED_IO,
    IO_PATH,
    _zmqio,
    libzmq_version,
    load_extension,
    runs_on_pyzmqs_libzmq,
)
from zps.transport.curve import (
    CURVE_CLIENT_HEARTBEAT,
    CURVE_SERVER_HEARTBEAT,
    CurveKeys,
    HandshakeWatch,
    load_keys,
    load_public_keys,
    public_key_of,
    reconnect_silence,
    sender_key,
    start_authenticator,
    watch_handshakes,
    write_keypair,
)
from zps.transport.flow import (
    FLUSH_S,
    Allowance,
    Outbound,
    Posted,
    QueueFull,
)
from zps.transport.iothreads import (
    IO_SCHED_MODES,
    IoThreads,
    batch_allowed,
    io_sched_batch,
    new_context,
    probe_batch,
    term,
    threads,
)
from zps.transport.link import (
    LinkPolicy,
    LinkThread,
)
from zps.transport.peers import PeerTable
from zps.transport.sockets import (
    DEFAULT_HWM,
    Dealer,
    dealer,
    local_address,
    router,
    tcp_rcvbuf,
)

__all__ = [
    "BACKOFF_S",
    "COMPILED_IO",
    "CURVE_CLIENT_HEARTBEAT",
    "CURVE_SERVER_HEARTBEAT",
    "DEFAULT_HWM",
    "DRAIN_BATCH",
    "FLUSH_S",
    "IO_PATH",
    "IO_SCHED_MODES",
    "RECV_COPY_MAX",
    "ZERO_COPY_BYTES",
    "_EVENTS",
    "_NOBLOCK",
    "_POLLIN",
    "_SNDMORE",
    "Allowance",
    "Channel",
    "CurveKeys",
    "Dealer",
    "Frames",
    "Handler",
    "HandshakeWatch",
    "IoThreads",
    "LinkPolicy",
    "LinkThread",
    "OnMalformed",
    "OnRefused",
    "Outbound",
    "PeerTable",
    "Posted",
    "Pump",
    "QueueFull",
    "_raw_get",
    "_raw_recv",
    "_raw_send",
    "_zmqio",
    "batch_allowed",
    "close",
    "dealer",
    "frame_buffer",
    "frame_bytes",
    "io_sched_batch",
    "libzmq_version",
    "load_extension",
    "load_keys",
    "load_public_keys",
    "local_address",
    "message_bytes",
    "new_context",
    "probe_batch",
    "public_key_of",
    "reconnect_silence",
    "recv_burst",
    "router",
    "runs_on_pyzmqs_libzmq",
    "send",
    "send_if_room",
    "sender_key",
    "serve",
    "start_authenticator",
    "tcp_rcvbuf",
    "term",
    "threads",
    "try_send",
    "watch_handshakes",
    "write_keypair",
]
