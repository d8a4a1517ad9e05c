"""Same-host shared memory for large payload frames.

A message keeps its route and header frames and still goes through the broker; a
payload frame of at least :data:`MIN_BYTES` whose sender and final receiver share a
host travels as a region of the sender's shared memory instead, and the frame itself
becomes empty.  The header then carries, under :data:`KEY`, a map::

    {"h": host key, "d": [[frame, pid, fd, inode, offset, length, token(, skip)], ...],
     "r": true,            # (requests) the sender takes large reply frames this way
     "done": [token, ...]} # (requests) reply regions of the receiver it has read

A descriptor with ``skip`` names ``length`` bytes from ``skip`` bytes into the region's
data (a slice of a client's :meth:`SharedMemory.buffer`, such as one chunk of a dense
gradient); without it, the region's data whole.

Memory: each process has one arena, a ``memfd`` of at most its byte budget (pages
are taken as they are first written).  A memfd has no name in ``/dev/shm``; a peer
opens it as ``/proc/PID/fd/FD`` (the same host, pid namespace and user only) and
checks its inode, and the kernel frees it once the owner has exited and no peer maps
it, SIGKILL included: nothing is left behind to clean up.  Readers drop the
mappings of owners that are gone (:meth:`Mapper.sweep`).

Safety: every region starts with a 64-byte head holding its token; the owner writes
a fresh token before the data and clears it before the region's bytes may be reused.
A reader checks the token, copies the bytes out into its own memory, and checks the
token again: a region reused meanwhile is refused (:class:`ShmUnavailableError`),
never read as other data.  Both sides put a full memory barrier
(:func:`zps.core.rows.fence`) between a token's store or last load and the data's
bytes, so a CPU that reorders memory keeps that order too; without the compiled
barrier the path is on only for CPUs that keep it anyway (x86).  So a reader never
keeps a view of another process's memory, and what it replicates or logs is its own
copy.  The owner reuses a region when its reader said it is done (a client frees a
request's regions once the request is answered; a shard frees a reply's once the
client's next request says so, or after ``reclaim_after`` seconds), and when the
budget is spent a frame simply goes
inline: nothing ever waits for memory.

``ZPS_NO_SHM=1`` in the environment turns the path off (as the ``shm_bytes = 0``
settings do); so does a host without ``memfd_create`` or ``/proc``, and a CPU other
than x86 without the compiled kernel (``zps.core._rows``, for its barrier).

The package: :mod:`~zps.shm.region` (a region's head and token protocol, who can read
whose memory), :mod:`~zps.shm.arena` (the owner's regions), :mod:`~zps.shm.mapper`
(a reader's mappings and checked copies), :mod:`~zps.shm.header` (the header entry and
its descriptors), :mod:`~zps.shm.memory` (one process's side: :class:`SharedMemory`).
"""

from zps.shm.arena import Arena
from zps.shm.header import KEY, Inbound, descriptors, tokens, with_entry
from zps.shm.mapper import MAX_MAPPINGS, SWEEP_S, Mapper
from zps.shm.memory import MIN_BYTES, OFF, SharedMemory
from zps.shm.region import (
    HEAD,
    HEAD_BYTES,
    MAGIC,
    RETRY_S,
    ShmUnavailableError,
    disabled_by_env,
    host_key,
)

__all__ = [
    "HEAD",
    "HEAD_BYTES",
    "KEY",
    "MAGIC",
    "MAX_MAPPINGS",
    "MIN_BYTES",
    "OFF",
    "RETRY_S",
    "SWEEP_S",
    "Arena",
    "Inbound",
    "Mapper",
    "SharedMemory",
    "ShmUnavailableError",
    "descriptors",
    "disabled_by_env",
    "host_key",
    "tokens",
    "with_entry",
]
