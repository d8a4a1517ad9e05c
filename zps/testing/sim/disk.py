"""Simulated disks under the real write-ahead log and checkpoint code.

The files are real (in a scratch directory, tmpfs where there is one); what is
simulated is what a machine's disk does that a healthy run never shows.  The seam is
the ``os`` name that :mod:`zps.store.wal`, :mod:`zps.shard.checkpoint` and
:mod:`zps.shard.links` (the broker term a shard keeps) and :mod:`zps.ops.durable` (the
small files written whole, and every folder's sync) call
(:func:`install` puts a :class:`SimOS` there for the run; the product code is unchanged):

* what was written but not yet ``fsync``'d / ``fdatasync``'d is lost at a crash of
  the node (:meth:`Disk.crash`), or survives in part (a torn write);
* a write may stop part-way with ENOSPC, or EFBIG (the file-size limit), the bytes
  before it in the file, as a short ``writev`` followed by a failing one leaves them;
* an fsync may fail with EIO (the kernel may have dropped the pages);
* a bit of a file may flip at rest (:meth:`Disk.rot`: the disk returns the byte so,
  without an error).

Renames, creations and truncations are taken as durable at once (the code under test
fsyncs the directory after each).

A file's modification time is the run's clock (:attr:`SimOS.clock`), not the wall
clock's: the newest checkpoint and the newest partition are picked by it
(:meth:`zps.shard.checkpoint.CheckpointStore.candidates`, ``newest_partition``), and a
seed must pick the same files in any process at any load.  A write, a truncation or a
sync through :class:`SimOS` stamps its file with the run's time; a sync of a folder
stamps the files in it that still carry a wall-clock time (made by ``open`` since).

The checkpoint module's hashing thread runs inline for the run (its ``concurrent`` name
is the second seam, :class:`InlineExecutor`): the same bytes hashed in the same order, the
same digest, and no thread to start and hand each slice to in a one-process simulation.
"""

from __future__ import annotations

import errno
import os as _os
import random
import re
import shutil
import stat as _stat
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class Disk:
    """One node's data dir and what of it is on the platter."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.synced: dict[str, int] = {}  # path -> length known durable
        self.enospc = 0  # the next N writes fail part-way with ENOSPC
        self.efbig = 0  # the next N writes fail part-way with EFBIG
        self.fsync_eio = 0  # the next N fsyncs fail with EIO
        self.slow = 0.0  # seconds a log write takes beyond the usual (a slow disk)
        self.faults: list[str] = []
        root.mkdir(parents=True, exist_ok=True)

    def crash(self, *, torn: bool) -> list[str]:
        """The machine stopped: each file keeps what was synced (and, ``torn``, a random
        part of what was not).  Returns what was cut, for the trace."""
        cut = []
        for path in sorted(p for p in self.root.rglob("*") if p.is_file()):
            st = path.stat()
            keep = self.synced.get(str(path), 0)
            if st.st_size > keep:
                if torn:
                    keep += self.rng.randrange(st.st_size - keep + 1)
                with open(path, "r+b") as f:
                    f.truncate(keep)
                # What the disk lost is no change of the file's: its times stay.
                _os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
                # A temporary file's name carries its writer's pid and object id: traced
                # without them (the trace is the same in any process).
                name = re.sub(r"\.tmp-[0-9a-f-]+$", ".tmp", path.name)
                cut.append(f"{name}:{st.st_size}->{keep}")
        return cut

    def files(self) -> int:
        """How many files the data dir holds."""
        return sum(1 for p in self.root.rglob("*") if p.is_file())

    def rot(self) -> str | None:
        """A bit of one of the files flips (drawn: a byte of all the files' bytes, the
        bit); the file's times stay.  Returns what flipped, for the trace (None: no file
        holds a byte)."""
        files = [p for p in sorted(self.root.rglob("*")) if p.is_file()]
        sizes = [p.stat().st_size for p in files]
        if not any(sizes):
            return None
        offset, bit = self.rng.randrange(sum(sizes)), self.rng.randrange(8)
        i = 0
        while offset >= sizes[i]:
            offset -= sizes[i]
            i += 1
        path = files[i]
        st = path.stat()
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0] ^ (1 << bit)
            f.seek(offset)
            f.write(bytes([byte]))
        _os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        name = re.sub(r"\.tmp-[0-9a-f-]+$", ".tmp", str(path.relative_to(self.root)))
        return f"bit {bit} of byte {offset} of {name} ({st.st_size} bytes)"

    def wipe(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self.synced.clear()


#: File times from this on are the wall clock's (the run's are 1.7e9 and a few seconds).
WALL = 1.75e9


class SimOS:
    """The ``os`` of the log and checkpoint modules for a run: every name is the real
    one except the writes and syncs, which go through the owning :class:`Disk`."""

    def __init__(self) -> None:
        self.disks: list[Disk] = []
        #: The run's time as file times (seconds since the epoch); None: the files keep
        #: the wall clock's.
        self.clock: Callable[[], float] | None = None
        self._last_ns = 0

    def _stamp(self, fd: int) -> None:
        """The file (or, for a folder, its files with a wall-clock time) now, in the
        run's time: a nanosecond after the last stamp at least, so that files stamped
        at one simulated instant keep the order they were written in."""
        if self.clock is None:
            return
        ns = self._last_ns = max(self._last_ns + 1, int(self.clock() * 1e9))
        if not _stat.S_ISDIR(_os.fstat(fd).st_mode):
            _os.utime(fd, ns=(ns, ns))
            return
        with _os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime >= WALL:
                    _os.utime(entry.name, ns=(ns, ns), dir_fd=fd)

    def __getattr__(self, name: str) -> Any:
        # Looked up once: the real function is kept as this object's attribute.
        value = getattr(_os, name)
        setattr(self, name, value)
        return value

    def _disk(self, fd: int) -> tuple[Disk | None, str]:
        try:
            path = _os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None, ""
        for d in self.disks:
            if path.startswith(str(d.root) + "/") or path == str(d.root):
                return d, path
        return None, path

    def writev(self, fd: int, buffers: Sequence[Any]) -> int:
        disk, _ = self._disk(fd)
        if disk is not None and (disk.enospc > 0 or disk.efbig > 0):
            if disk.enospc > 0:
                disk.enospc -= 1
                code, name = errno.ENOSPC, "ENOSPC"
            else:
                disk.efbig -= 1
                code, name = errno.EFBIG, "EFBIG"
            total = sum(memoryview(b).nbytes for b in buffers)
            part = disk.rng.randrange(total) if total else 0
            data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:part]
            if data:
                _os.write(fd, data)
            disk.faults.append(f"{name} after {part} of {total} bytes")
            raise OSError(code, f"{_os.strerror(code)} (simulated)")
        n = _os.writev(fd, buffers)
        if disk is not None:
            self._stamp(fd)
        return n

    def _sync(self, fd: int, real: Any) -> None:
        disk, path = self._disk(fd)
        if disk is not None and disk.fsync_eio > 0:
            disk.fsync_eio -= 1
            disk.faults.append(f"EIO on fsync of {Path(path).name}")
            if _stat.S_ISDIR(_os.fstat(fd).st_mode):
                # The files it holds were made before it failed: in the run's time
                # (one made and never written would keep a wall-clock time, newer
                # than every file of the run, and a restart picks the partition
                # whose files changed last).
                self._stamp(fd)
            raise OSError(errno.EIO, "Input/output error (simulated)")
        real(fd)
        if disk is not None:
            self._stamp(fd)
        if disk is not None and _os.path.isfile(path):
            disk.synced[path] = _os.fstat(fd).st_size

    def fsync(self, fd: int) -> None:
        self._sync(fd, _os.fsync)

    def fdatasync(self, fd: int) -> None:
        self._sync(fd, _os.fdatasync)

    def ftruncate(self, fd: int, length: int) -> None:
        _os.ftruncate(fd, length)
        disk, path = self._disk(fd)
        if disk is not None:
            self._stamp(fd)
            disk.synced[path] = min(disk.synced.get(path, 0), length)

    def replace(self, src: Any, dst: Any) -> None:
        _os.replace(src, dst)
        for d in self.disks:
            if str(src) in d.synced:
                d.synced[str(dst)] = d.synced.pop(str(src))


class _Done:
    """A call already made: its value, or the exception it raised."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._error: BaseException | None = None
        self._value: Any = None
        try:
            self._value = fn(*args)
        except BaseException as e:  # re-raised by result, as a Future does
            self._error = e

    def cancel(self) -> bool:
        return False  # done already, as a Future whose call ran

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class InlineExecutor:
    """A ``ThreadPoolExecutor`` that runs each call as it is submitted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> InlineExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Done:
        return _Done(fn, args)


#: What the checkpoint module finds under its ``concurrent`` name during a run.
_CONCURRENT = types.SimpleNamespace(
    futures=types.SimpleNamespace(ThreadPoolExecutor=InlineExecutor)
)


def install(sim_os: SimOS) -> list[tuple[Any, str, Any]]:
    """Put ``sim_os`` where the log and checkpoint modules look up ``os``, and the inline
    executor where the checkpoint module looks up ``concurrent``; returns what to put back
    (:func:`uninstall`)."""
    import zps.ops.durable as durable
    import zps.shard.checkpoint as checkpoint
    import zps.shard.links as links
    import zps.store.wal as wal

    seams = [
        (wal, "os", sim_os),
        (checkpoint, "os", sim_os),
        (links, "os", sim_os),  # the broker term a shard keeps (BrokerTerm)
        (durable, "os", sim_os),  # the small files written whole, and the folders' syncs
        (checkpoint, "concurrent", _CONCURRENT),
    ]
    saved = [(module, name, module.__dict__[name]) for module, name, _ in seams]
    for module, name, value in seams:
        setattr(module, name, value)  # the seam: a name the module looks up at each call
    return saved


def uninstall(saved: list[tuple[Any, str, Any]]) -> None:
    for module, name, real in saved:
        setattr(module, name, real)
