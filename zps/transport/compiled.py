"""Whether the optional extension ``zps._zmqio`` drives the channels, on pyzmq's libzmq.

Where ``zps._zmqio`` was built, a channel sends a message of small frames, receives a
whole message and reads ``ZMQ_EVENTS`` with one compiled call each, on pyzmq's own
socket, where pyzmq takes a Python call, and on receipt a ``zmq.Frame``, per frame
(figures: docs/performance.md, "The compiled I/O, end to end").  The extension decides
nothing: :class:`~zps.transport.channel.Channel` keeps every rule (which frames go
through pyzmq, what an error means).

Rules: the extension runs on pyzmq's own libzmq and on no other copy in the process.  It
is written in Cython against pyzmq's declarations and linked with the libzmq pyzmq ships
by its soname alone (setup.py), so the dynamic linker can only give it the library
``import zmq`` loaded (this module imports zmq first); :func:`io_path` checks that the file
it runs on (``_zmqio.bound()``) is the one pyzmq ships.  It is off where it was not built,
could not be loaded or is not on pyzmq's libzmq, or with ``ZPS_NO_KERNEL=1``.  Whether it
is on is settled once, at import (:data:`COMPILED_IO`), and each process logs at INFO which
way its channels go (:data:`IO_PATH`).  All code that loads ``zps._zmqio`` lives here.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq  # first: the extension's libzmq is the one this loads

_zmqio: Any
_load_error: str | None = None  # built, but it could not be loaded: why
try:  # the compiled send and receive, built by ``pip install`` where a compiler is found
    _zmqio = importlib.import_module("zps._zmqio")
except ModuleNotFoundError:  # pragma: no cover - depends on the build
    _zmqio = None
except ImportError as e:  # pragma: no cover - a libzmq that is not the one loaded
    _zmqio = None
    _load_error = str(e)

_log = logging.getLogger("zps.transport")


def libzmq_version() -> tuple[int, int, int]:
    """The version of the libzmq pyzmq uses (for the log)."""
    major, minor, patch = zmq.zmq_version_info()[:3]
    return major, minor, patch


def pyzmq_libzmq() -> list[str]:
    """The shared libzmq files pyzmq ships (``pyzmq.libs`` beside the ``zmq`` package, or
    its library directories), resolved; empty where it ships none."""
    package = Path(zmq.__file__).resolve().parent
    folders = [*map(Path, zmq.get_library_dirs()), package.parent / "pyzmq.libs"]
    return [str(f.resolve()) for folder in folders for f in sorted(folder.glob("libzmq*.so*"))]


def io_path(
    *,
    built: bool,
    load_error: str | None,
    no_kernel: bool,
    version: str,
    bound: str | None,
    shipped: list[str],
) -> tuple[bool, str]:
    """Whether channels use ``zps._zmqio``, and the way they go, in words.  ``built``:
    the extension is installed; ``load_error``: why it could not be loaded (None: it
    was); ``bound``: the libzmq file it runs on; ``shipped``: pyzmq's (:func:`pyzmq_libzmq`)."""
    if not built:
        return False, "pyzmq (zps._zmqio was not built)"
    if no_kernel:
        return False, "pyzmq (ZPS_NO_KERNEL=1)"
    if load_error is None and bound is not None and os.path.realpath(bound) in shipped:
        return True, f"zps._zmqio (pyzmq's libzmq {version}, {bound})"
    return False, f"pyzmq (pyzmq's libzmq {version} could not be bound)"


def _bind_io() -> tuple[bool, str]:
    return io_path(
        built=_zmqio is not None or _load_error is not None,
        load_error=_load_error,
        no_kernel=os.environ.get("ZPS_NO_KERNEL", "") not in ("", "0"),
        version=".".join(map(str, libzmq_version())),
        bound=_zmqio.bound() if _zmqio is not None else None,
        shipped=pyzmq_libzmq(),
    )


#: Whether channels send and receive through ``zps._zmqio`` (built, loaded, and on the
#: libzmq pyzmq ships; see the module notes); :data:`IO_PATH`: which, in words.
COMPILED_IO, IO_PATH = _bind_io()


@functools.cache
def _log_io_path() -> None:
    """Once per process, at its first channel: which way channels send and receive."""
    _log.info("channels send and receive through %s", IO_PATH)


# -- zps.broker._forward finds libzmq through pyzmq's backend module -------------------


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
