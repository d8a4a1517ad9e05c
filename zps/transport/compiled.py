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
from pathlib import Path
from typing import Any

import zmq  # first: the extension's libzmq is the one this loads

_log = logging.getLogger("zps.transport")


def load_extension(name: str) -> tuple[Any, str | None]:
    """An optional extension that drives libzmq, built by ``pip install`` where a
    compiler is found: (the module, None); (None, None) where it was not built; (None,
    why) where it was built but could not be loaded (the libzmq it is linked with is not
    in the process)."""
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError:  # pragma: no cover - depends on the build
        return None, None
    except ImportError as e:  # pragma: no cover - a libzmq that is not the one loaded
        return None, str(e)


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


def runs_on_pyzmqs_libzmq(bound: str | None, shipped: list[str] | None = None) -> bool:
    """Whether ``bound`` (an extension's ``bound()``: the file of the libzmq it runs on)
    is one pyzmq ships (``shipped``: :func:`pyzmq_libzmq` unless given)."""
    if bound is None:
        return False
    return os.path.realpath(bound) in (pyzmq_libzmq() if shipped is None else shipped)


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
    if load_error is None and runs_on_pyzmqs_libzmq(bound, shipped):
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


_zmqio, _load_error = load_extension("zps._zmqio")

#: Whether channels send and receive through ``zps._zmqio`` (built, loaded, and on the
#: libzmq pyzmq ships; see the module notes); :data:`IO_PATH`: which, in words.
COMPILED_IO, IO_PATH = _bind_io()


@functools.cache
def _log_io_path() -> None:
    """Once per process, at its first channel: which way channels send and receive."""
    _log.info("channels send and receive through %s", IO_PATH)
