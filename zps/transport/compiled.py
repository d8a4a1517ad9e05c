"""The binding of the optional extension ``zps._zmqio`` to the libzmq pyzmq calls.

Where ``zps._zmqio`` was built, a channel sends a message of small frames, receives a
whole message and reads ``ZMQ_EVENTS`` with one compiled call each, on pyzmq's own
socket through the libzmq pyzmq calls (:func:`bind_libzmq`), where pyzmq takes a Python
call, and on receipt a ``zmq.Frame``, per frame (figures: docs/performance.md, "The
compiled I/O, end to end").  The extension decides nothing: :class:`~zps.transport.channel.Channel`
keeps every rule (which frames go through pyzmq, what an error means).

Rules: the extension is bound to pyzmq's own libzmq and to no other copy in the process,
of whatever version, and only to the version pyzmq reports; it is off where it was not
built, could not be bound, or with ``ZPS_NO_KERNEL=1``.  Whether it is on is settled
once, at import (:data:`COMPILED_IO`), and each process logs at INFO which way its
channels go (:data:`IO_PATH`).  All code that binds ``zps._zmqio`` lives here.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import zmq

try:  # the compiled send and receive, built by ``pip install`` where a compiler is found
    from zps import _zmqio as _zmqio  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _zmqio = None

_log = logging.getLogger("zps.transport")


def libzmq_version() -> tuple[int, int, int]:
    """The version of the libzmq pyzmq uses (compiled code must bind that one)."""
    major, minor, patch = zmq.zmq_version_info()[:3]
    return major, minor, patch


def pyzmq_backend_path() -> str | None:
    """The file of pyzmq's backend module (None: not the Cython backend).  Looked up
    through its handle, libzmq's functions are the ones pyzmq's sockets run on: those
    linked into the module, or of the libzmq it depends on."""
    try:
        from zmq.backend.cython import _zmq
    except ImportError:  # pragma: no cover - another backend (CFFI on PyPy)
        return None
    return str(_zmq.__file__)


def bind_libzmq(bind: Callable[[str], Any]) -> bool:
    """Bind a compiled module to the libzmq pyzmq calls: its ``bind(path)`` opens the
    loaded library at ``path`` (no second copy) and looks the functions up through its
    handle, returning the version it bound, or False.  ``path`` is pyzmq's backend
    module (:func:`pyzmq_backend_path`), never a file found by name: another libzmq
    in the process, of any version, is not bound.  The version must be pyzmq's."""
    path = pyzmq_backend_path()
    if path is None:
        return False
    version = bind(path)
    return bool(version) and tuple(version) == libzmq_version()


def _bind_io() -> tuple[bool, str]:
    """Whether channels use ``zps._zmqio``, and the way they go, in words."""
    if _zmqio is None:
        return False, "pyzmq (zps._zmqio was not built)"
    if os.environ.get("ZPS_NO_KERNEL", "") not in ("", "0"):
        return False, "pyzmq (ZPS_NO_KERNEL=1)"
    version = ".".join(map(str, libzmq_version()))
    if bind_libzmq(_zmqio.bind):
        bound = getattr(_zmqio, "bound", None)  # None: built before bound() existed
        return True, f"zps._zmqio (pyzmq's libzmq {version}, {bound() if bound else '?'})"
    return False, f"pyzmq (pyzmq's libzmq {version} could not be bound)"


#: Whether channels send and receive through ``zps._zmqio`` (built, and bound to the
#: libzmq pyzmq calls; see the module notes); :data:`IO_PATH`: which, in words.
COMPILED_IO, IO_PATH = _bind_io()


@functools.cache
def _log_io_path() -> None:
    """Once per process, at its first channel: which way channels send and receive."""
    _log.info("channels send and receive through %s", IO_PATH)
