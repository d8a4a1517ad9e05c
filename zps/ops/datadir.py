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

from zps.errors import ConfigError, DataDirInUseError

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


def unusable(root: Path, doing: str, error: OSError) -> ConfigError:
    """The one-line error for a data directory this process cannot use: the path,
    what failed and the system's reason (not writable, not a directory, read-only)."""
    where = f" ({error.filename})" if error.filename and Path(error.filename) != root else ""
    return ConfigError(
        f"data directory {root}: cannot {doing}: {error.strerror or error}{where}; "
        "give --data-dir a directory this user can write"
    )


def lock_data_dir(data_dir: str | os.PathLike[str], owner: str) -> DataDirLock:
    """Take ``data_dir`` for this process (creating it), or raise
    :class:`DataDirInUseError` naming the process that holds it.  ``owner`` says what
    this process is ("shard s-a", "the broker"), for the other one's error.  A directory
    that cannot be created or written raises :class:`~zps.errors.ConfigError` naming it
    and the reason (one line, no traceback: the operator's to fix)."""
    root = Path(data_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise unusable(root, "create it", e) from None
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise unusable(root, f"open {LOCK_NAME} for writing", e) from None
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
    try:
        # The directory itself must take new files (checkpoints, logs), not only LOCK.
        probe = root / f".write-test-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        probe.unlink()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner} (pid {os.getpid()})\n".encode(), 0)
    except OSError as e:
        os.close(fd)
        raise unusable(root, "write in it", e) from None
    return DataDirLock(path, fd)
