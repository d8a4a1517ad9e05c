"""Same-host shared memory in a simulated run (the ``shm`` fault).

zps's shared-memory path (:mod:`zps.shm`) reaches the operating system through the
``os`` names of :mod:`zps.shm.arena` (the owner's memory file) and :mod:`zps.shm.mapper`
(a reader opening ``/proc/PID/fd/FD``), the clock through the ``time`` names of those two
and of :mod:`zps.shm.memory`, the host through :mod:`zps.shm.memory`'s ``host_key`` and a
region's first token through the arena's ``secrets``.  A run with ``shm`` replaces them
(:func:`install`) and turns the path on in the real shards and clients:

* every simulated process (:class:`~zps.testing.sim.aioloop.Proc`: one per start) has a
  pid of its own, and its arena is a real memory file of this process, known to a peer by
  that pid and its descriptor.  A reader opens it (a duplicate of the descriptor) while
  the owner's process is alive, and gets ``ENOENT`` once it was killed, as
  ``/proc/PID/fd/FD`` goes with a process; a mapping made before stays readable, as the
  kernel keeps a memory file while something maps it;
* inode numbers are numbered per run, and each arena's first token is drawn from the
  run's own generator, so a seed replays exactly;
* the host key is the process's simulated host: a shard's own host when routers place
  the shards two a host (``routers``), else one host for the whole run; so clients and
  shards exchange their frames through memory, and with ``routers`` only a host's two
  shards do (their replication stream);
* what the path does is drawn per seed (:class:`ShmDraw`): every payload frame goes
  through memory (the product's threshold is 192 KiB, beyond any frame of a run), an
  arena's budget may be small enough to fill (frames then go inline), and a shard
  reclaims a region unread after a time drawn from 0.3-2 s (the product's 2 s), so a
  reader paused or slow past it finds the region reused and the request is sent again.

Not simulated: a region reused *while* a reader copies it (the run is one thread, so
the token's check after a copy never fails here; the check before it does).
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import re
import types
from dataclasses import dataclass
from typing import Any

from zps.testing.sim.aioloop import PROC, Proc
from zps.testing.sim.simtransport import CLOCK, Saved

#: The host key of every process a run places on no host of its own.
ONE_HOST = "sim-host"
#: The first pid of a run's processes (five digits, as a real process's commonly is).
FIRST_PID = 20_000
_PROC_FD = re.compile(r"/proc/(\d+)/fd/(\d+)$")


@dataclass(frozen=True)
class ShmDraw:
    """What the path does in one run (drawn from its seed)."""

    #: Bytes of each process's arena.
    budget: int
    #: Seconds after which a shard reuses a region its reader has not said it read.
    reclaim_s: float
    #: Payload frames of at least this many bytes go through memory.
    min_bytes: int = 1

    @classmethod
    def draw(cls, rng: random.Random) -> ShmDraw:
        budget = rng.choice((2 << 10, 8 << 10, 1 << 20))
        return cls(budget=budget, reclaim_s=round(rng.uniform(0.3, 2.0), 3))


class ShmOS:
    """The ``os`` of :mod:`zps.shm.arena` and :mod:`zps.shm.mapper` in a run (see the
    module notes); the real ``os`` for everything else."""

    def __init__(self, seed: int, host_of: Any) -> None:
        self._host_of = host_of
        self._pids: dict[Proc, int] = {}
        self._procs: dict[int, Proc] = {}
        self._next_pid = itertools.count(FIRST_PID)
        self._inodes = itertools.count(1)
        #: Each arena's file: its descriptor here -> (owner's pid, its inode).
        self._files: dict[int, tuple[int, int]] = {}
        #: Descriptors a reader opened (duplicates) -> the inode of their file.
        self._opened: dict[int, int] = {}
        #: The arenas' first tokens.
        self.tokens = random.Random(seed ^ 0x5EED5)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    # -- the processes ---------------------------------------------------------------

    def _proc(self) -> Proc:
        proc = PROC.get()
        assert proc is not None, "shared memory belongs to a simulated process"
        return proc

    def getpid(self) -> int:
        proc = self._proc()
        pid = self._pids.get(proc)
        if pid is None:
            pid = self._pids[proc] = next(self._next_pid)
            self._procs[pid] = proc
        return pid

    def host(self) -> str:
        """The host key of the calling process."""
        return str(self._host_of(self._proc().name))

    # -- the owner's memory file ---------------------------------------------------------

    def memfd_create(self, name: str, flags: int = 0) -> int:
        fd = os.memfd_create(name, flags)
        self._files[fd] = (self.getpid(), next(self._inodes))
        return fd

    def fstat(self, fd: int) -> Any:
        st = os.fstat(fd)
        inode = self._files[fd][1] if fd in self._files else self._opened.get(fd)
        if inode is None:
            return st
        return types.SimpleNamespace(st_ino=inode, st_mode=st.st_mode, st_size=st.st_size)

    def close(self, fd: int) -> None:
        self._opened.pop(fd, None)
        self._files.pop(fd, None)
        os.close(fd)

    # -- a reader's /proc/PID/fd/FD --------------------------------------------------------

    def _lookup(self, path: str) -> tuple[int, int]:
        """The descriptor here and inode of the memory file ``path`` names, while its
        owner's process lives; ``FileNotFoundError`` otherwise."""
        m = _PROC_FD.match(path)
        if m is not None:
            pid, fd = int(m.group(1)), int(m.group(2))
            proc = self._procs.get(pid)
            file = self._files.get(fd)
            if proc is not None and proc.alive and file is not None and file[0] == pid:
                return fd, file[1]
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)

    def open(self, path: str, flags: int, mode: int = 0o777) -> int:
        fd, inode = self._lookup(path)
        dup = os.dup(fd)
        self._opened[dup] = inode
        return dup

    def stat(self, path: str) -> Any:
        fd, inode = self._lookup(path)
        st = os.fstat(fd)
        return types.SimpleNamespace(st_ino=inode, st_mode=st.st_mode, st_size=st.st_size)

    def end(self) -> None:
        """The run is over: every memory file it made is closed (a killed process's
        arena is never closed by its own code; its mapping goes with its objects)."""
        for fd in [*self._files, *self._opened]:
            os.close(fd)
        self._files.clear()
        self._opened.clear()


class _Secrets:
    """The arena's ``secrets``: first tokens from the run's generator."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def randbits(self, k: int) -> int:
        return self._rng.getrandbits(k)


def _memory(process: Any) -> Any:
    server = getattr(process, "server", None)
    client = getattr(process, "client", None)
    if server is not None:
        return server.shared
    if client is not None:
        return client.connection._shm.memory
    return None


def memory_of(process: Any) -> Any:
    """The shared memory of a run's real shard or client (:class:`zps.shm.SharedMemory`),
    if its path is on and its arena made; else None."""
    memory = _memory(process)
    return memory if memory is not None and memory.arena_made else None


def reuse_all(memory: Any) -> int:
    """Release every region of ``memory``'s arena that is not pinned (a shard's dense
    values, a client's reserved arrays), whatever its age; how many (counted as
    reclaimed).  A shard's own reclaim does that to regions older than its reclaim time
    when its arena is full; a client's regions are never reclaimed, so for a client this
    is a stronger fault than the product makes, within what its readers must survive (a
    region found reused is refused, and the request sent again with new ones, as after a
    call given up retokens its buffer)."""
    arena = memory.arena
    regions = [r for r in arena._by_token.values() if not r.pinned]
    for r in regions:
        arena._release(r)
    arena.reclaimed += len(regions)
    return len(regions)


def close_all(processes: Any) -> None:
    """The run is over: the shared memory of each process it can still reach (its last
    start) is closed through the seams, so no arena keeps a descriptor number that
    :meth:`ShmOS.end` closes (a later close would hit whatever then had that number)."""
    for process in processes:
        memory = _memory(process)
        if memory is not None:
            memory.close()


def install(seed: int, draw: ShmDraw, host_of: Any) -> tuple[Saved, ShmOS]:
    """Replace the path's seams (see the module notes) for a run; returns what
    :func:`zps.testing.sim.simtransport.uninstall` puts back (after :meth:`ShmOS.end`)."""
    from zps.shard import server
    from zps.shm import arena, mapper, memory

    sim_os = ShmOS(seed, host_of)
    saved: Saved = []

    def put(obj: Any, attr: str, value: Any) -> None:
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    for mod in (arena, mapper):
        put(mod, "os", sim_os)
    for mod in (arena, mapper, memory):
        put(mod, "time", CLOCK)
    put(arena, "secrets", _Secrets(sim_os.tokens))
    put(memory, "host_key", sim_os.host)
    put(memory, "disabled_by_env", lambda: False)
    put(server, "SHM_RECLAIM_S", draw.reclaim_s)
    init: Any = memory.SharedMemory.__init__
    put(init, "__kwdefaults__", {**init.__kwdefaults__, "min_bytes": draw.min_bytes})
    return saved, sim_os
