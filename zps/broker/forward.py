"""The broker's data path as one compiled step, where it was built.

One job: give the broker a :data:`step` that forwards the queued clients' REQUESTs and
shards' replies of its ROUTER socket without a Python call per message (see
``_forward.c``), and hands back, untouched, the first message that needs a decision
of the Python code.  Forwarding is the broker's whole data path: the compiled step
makes no Python call per message, the Python fast path (:mod:`zps.broker.datapath`)
several dozen.  Where a request goes is the route table's word
(:mod:`zps.broker.routes`): the step only reads it.

The extension drives pyzmq's own socket through the libzmq that pyzmq's backend module
loaded: its functions are looked up through that module's handle (opened without
loading another copy), so they are the ones pyzmq calls, whatever other libzmq the
process holds.  Where the extension was not built (no compiler), that libzmq cannot
be bound, or ``ZPS_NO_KERNEL=1`` is in the environment, :data:`AVAILABLE` is False and
the broker forwards in Python, with the same results.  :data:`PATH` says which, for the
broker to log at start-up.
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


def _bind() -> tuple[bool, str]:
    """Whether the step is bound, and the data path in words."""
    if _forward is None:
        return False, "python (zps.broker._forward was not built)"
    if os.environ.get("ZPS_NO_KERNEL", "") not in ("", "0"):
        return False, "python (ZPS_NO_KERNEL=1)"
    version = ".".join(map(str, transport.libzmq_version()))
    if transport.bind_libzmq(_forward.bind):
        return True, f"compiled (zps.broker._forward, on pyzmq's libzmq {version})"
    return False, f"python (pyzmq's libzmq {version} could not be bound)"


#: Whether :data:`step` is in use (the extension built and bound to pyzmq's libzmq);
#: :data:`PATH`: the data path in words ("compiled (...)" or "python (why)").
AVAILABLE, PATH = _bind()

#: ``step(sock, limit, routes, shards, last, queues, holding, now) -> (events, routed,
#: replies, declined)``: forwards what is queued on the socket at address ``sock``
#: (:attr:`transport.Channel.handle`) until nothing is left (``events``: the last ``ZMQ_EVENTS``
#: reading), ``limit`` were forwarded (``events`` 0: more may be queued), or a message
#: needs the Python path: ``declined``, its frames as bytes (nothing of it was sent).
#: ``events`` is -1 when the socket failed.  ``routes``: the route table's targets
#: (:attr:`zps.broker.routes.RouteTable.targets`: a primary's identity, or None);
#: ``shards``: the membership (names); ``last``: the failure detector's last-heard
#: times, set to ``now`` for each sender forwarded; ``queues``: the identities with
#: messages held for them; ``holding``: the broker is collecting claims.  None where
#: :data:`AVAILABLE` is False.
step = _forward.pump if AVAILABLE else None
