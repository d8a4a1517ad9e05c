"""Durable small files in a data dir: a file replaced whole, or not at all.

:func:`write_atomic` writes the new bytes to a temporary file beside the old one
(``.NAME.tmp``), fsyncs it, renames it over the old one and fsyncs the folder.  When
it returns, the file holds the new bytes on disk under its name.  A crash at each step
leaves:

* while the temporary file is written or synced: the old file, whole (or none, if
  there was none), and perhaps part of the temporary one, which the next write of the
  same file truncates and replaces;
* after the rename, before the folder is synced: the old file or the new one, each
  whole (the rename is atomic; the folder's sync makes it durable);
* once it returns: the new one.

A write, fsync or rename that fails raises its OSError with the old file untouched and
the temporary one removed (where it still can be).  Writing again is a valid retry: the
new temporary file's pages are its own, unlike those of a log a failed fsync may have
dropped.  A failed fsync of the folder raises with the new file in place, its name not
known to survive a power loss.  One writer per file at a time (the temporary name is
fixed).

:func:`fsync_dir`: the names created, renamed or removed in a folder survive a crash.

The module's ``os`` name is the simulator's disk seam
(:func:`zps.testing.sim.disk.install`); a caller whose own ``os`` name is a seam passes
it as ``fs``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any


def write_atomic(
    path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644, fs: Any = None
) -> None:
    """Replace ``path`` with ``data`` (created with ``mode``), atomically and durably (see
    the module notes); ``fs``: the ``os`` to call (None: this module's)."""
    fs = os if fs is None else fs
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp")
    try:
        fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[fs.write(fd, view) :]
            fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.unlink(tmp)
        raise
    fsync_dir(folder or ".", fs=fs)


def fsync_dir(folder: str | os.PathLike[str], *, fs: Any = None) -> None:
    """Sync ``folder``: what was created, renamed or removed in it is durable."""
    fs = os if fs is None else fs
    fd = fs.open(folder, os.O_RDONLY)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)
