"""One owner per data directory.

A shard's or broker's data directory holds its checkpoints, write-ahead log and
state record; its name also fixes the shard's identity.  Two processes started on one
directory (a unit started twice, a copy-paste in a config) would each claim that
identity and overwrite each other's files, and the broker would take the second for
a restart of the first.  So the owner holds an exclusive ``flock`` on ``LOCK`` in the
directory for its whole life: the kernel releases it when the process ends, however it
ends (a SIGKILLed shard restarts at once), and a paused process keeps it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from zps.errors import DataDirInUseError

LOCK_NAME = "LOCK"


class DataDirLock:
    """The held lock on one data directory; :meth:`release` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_data_dir(data_dir: str | os.PathLike[str], owner: str) -> DataDirLock:
    """Take ``data_dir`` for this process (creating it), or raise
    :class:`DataDirInUseError` naming the process that holds it.  ``owner`` says what
    this process is ("shard s-a", "the broker"), for the other one's error."""
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise DataDirInUseError(
            f"data directory {root} is in use by {holder}: one process per data "
            "directory (give this one its own --data-dir)"
        ) from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{owner} (pid {os.getpid()})\n".encode(), 0)
    return DataDirLock(path, fd)
