"""The broker's data path as one compiled step, where it was built.

One job: give the broker a :data:`step` that forwards the queued clients' REQUESTs and
shards' replies of its ROUTER socket without a Python call per message (see
``_forward.c``), and hands back, untouched, the first message that needs a decision
of the Python code.  Forwarding is the broker's whole data path: per message, its
Python fast path (``Broker._forward``) makes about 58 calls, the pump none.

The extension drives pyzmq's own socket through the libzmq that pyzmq loaded (found in
``/proc/self/maps``, opened without loading another copy).  Where the extension was
not built (no compiler), no such libzmq is found, or ``ZPS_NO_KERNEL=1`` is in the
environment, :data:`AVAILABLE` is False and the broker forwards in Python, with the
same results.
"""

from __future__ import annotations

import logging
import os

from zps import transport

try:  # the compiled step, built by ``pip install`` where a C compiler is found
    from zps.broker import _forward  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _forward = None

log = logging.getLogger("zps.broker")


def _bind() -> bool:
    if _forward is None or os.environ.get("ZPS_NO_KERNEL", "") not in ("", "0"):
        return False
    if transport.bind_libzmq(_forward.bind):
        return True
    want = transport.libzmq_version()
    log.debug("no loaded libzmq %s found: the broker forwards in Python", want)
    return False


#: Whether :data:`step` is in use (the extension built and bound to pyzmq's libzmq).
AVAILABLE = _bind()

#: ``step(sock, limit, routes, shards, last, queues, holding, now) -> (events, routed,
#: replies, declined)``: forwards what is queued on the socket at address ``sock``
#: (:attr:`transport.Channel.handle`) until nothing is left (``events``: the last ``ZMQ_EVENTS``
#: reading), ``limit`` were forwarded (``events`` 0: more may be queued), or a message
#: needs the Python path: ``declined``, its frames as bytes (nothing of it was sent).
#: ``events`` is -1 when the socket failed.  ``routes``: each partition's primary
#: identity (bytes) or None; ``shards``: the membership (names); ``last``: the failure
#: detector's last-heard times, set to ``now`` for each sender forwarded; ``queues``:
#: the identities with messages held for them; ``holding``: the broker is collecting
#: claims.  None where :data:`AVAILABLE` is False.
step = _forward.pump if AVAILABLE else None
