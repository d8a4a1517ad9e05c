"""The broker's data path as one compiled step, where it was built.

One job: give the broker a :data:`step` that forwards the queued clients' REQUESTs and
shards' replies of its ROUTER socket without a Python call per message (see
``_forward.pyx``), and hands back, untouched, the first message that needs a decision
of the Python code.  Forwarding is the broker's whole data path: the compiled step
makes no Python call per message, the Python fast path (``Broker._forward``) several
dozen.

The extension is written in Cython against pyzmq's declarations and linked with the
libzmq pyzmq ships by its soname alone (setup.py), so it drives pyzmq's own socket on
the libzmq ``import zmq`` loaded, whatever other libzmq the process holds.  Where the
extension was not built (no compiler), could not be loaded or is not on pyzmq's libzmq
(``transport.runs_on_pyzmqs_libzmq``), or ``ZPS_NO_KERNEL=1`` is in the environment,
:data:`AVAILABLE` is False and the broker forwards in Python, with the same results.
:data:`PATH` says which, for the broker to log at start-up.
"""

from __future__ import annotations

import logging
import os

from zps import transport

# The compiled step, built by ``pip install`` where a compiler is found.
_forward, _load_error = transport.load_extension("zps.broker._forward")

log = logging.getLogger("zps.broker")


def _bind() -> tuple[bool, str]:
    """Whether the step is in use, and the data path in words."""
    if _forward is None and _load_error is None:
        return False, "python (zps.broker._forward was not built)"
    if os.environ.get("ZPS_NO_KERNEL", "") not in ("", "0"):
        return False, "python (ZPS_NO_KERNEL=1)"
    version = ".".join(map(str, transport.libzmq_version()))
    if _forward is not None and transport.runs_on_pyzmqs_libzmq(_forward.bound()):
        return True, f"compiled (zps.broker._forward, on pyzmq's libzmq {version})"
    return False, f"python (pyzmq's libzmq {version} could not be bound)"


#: Whether :data:`step` is in use (the extension built, loaded and on pyzmq's libzmq);
#: :data:`PATH`: the data path in words ("compiled (...)" or "python (why)").
AVAILABLE, PATH = _bind()

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
