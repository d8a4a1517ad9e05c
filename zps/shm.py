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
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import errno
import itertools
import math
import mmap
import os
import secrets
import stat
import struct
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from zps.core.rows import copy_finite, fence, memory_ordered
from zps.errors import ProtocolError, ZpsError
from zps.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES

#: The header key of a message with payload frames in shared memory.
KEY = "shm"
#: Payload frames of at least this many bytes go through shared memory: a sparse
#: step's rows and gradients from 1,536 rows of 32 float32s on, and dense chunks.
#: Below it the sockets are cheaper (measured: 64 and 128 KiB frames 3-11% slower
#: through shared memory, 192 KiB even, 256 KiB 14% faster, 512 KiB 26-66%; see
#: docs/performance.md).
MIN_BYTES = 192 << 10
#: A region's head: magic, token, length (padded to 64 bytes).
MAGIC = b"ZPSSHM01"
HEAD = struct.Struct("<8sQQ")
HEAD_BYTES = 64
_TOKEN = struct.Struct("<Q")
#: Mappings of peers' arenas a reader keeps at most.
MAX_MAPPINGS = 64
#: How often a reader looks for mappings of owners that are gone, at most.
SWEEP_S = 1.0
#: Why opening or mapping a peer's memory may fail for a while only: this process
#: is out of descriptors or memory.  The peer's frames go inline meanwhile, and a
#: sender tries its memory again after :data:`RETRY_S`.
_BUSY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR})
#: How long a peer that could not open this process's memory for a while (``busy``)
#: gets inline frames before they are offered through shared memory again.
RETRY_S = 30.0


class ShmUnavailableError(ZpsError):
    """A region named by a descriptor cannot be read (another host, the owner gone,
    the region reused): the message must be sent again with inline frames."""

    def __init__(
        self, message: str, *, permanent: bool, token: int | None = None, busy: bool = False
    ) -> None:
        super().__init__(message)
        #: True: this peer cannot open the sender's memory at all (another host or
        #: user); False: this one region is gone (re-sending it may work).
        self.permanent = permanent or busy
        #: Not now (out of descriptors or memory: see :data:`RETRY_S`), where
        #: ``permanent`` alone means not ever.
        self.busy = busy
        #: The token the descriptor named, when its region was reused (else None).
        self.token = token


def disabled_by_env() -> bool:
    return os.environ.get("ZPS_NO_SHM", "") not in ("", "0")


def host_key() -> str | None:
    """Who can open whose memfds: the boot and the pid namespace (None: the path is
    unavailable here)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    if not hasattr(os, "memfd_create"):
        return None
    return f"{boot}/{pidns}"


@dataclass(slots=True)
class _Region:
    offset: int
    size: int  # head and data, rounded up to 64 bytes
    token: int
    born: float
    pinned: bool = False  # never reclaimed (see Arena.take)


def _round(n: int) -> int:
    return (n + 63) & ~63


class Arena:
    """One process's shared memory for the payloads it sends (see the module notes).

    ``put`` never blocks: it returns None when the budget has no room.  With
    ``reclaim_after`` (seconds), a region older than that may be reused for a new one
    without being freed first (its reader, if any, then finds it reused).
    """

    def __init__(self, budget: int, name: str, *, reclaim_after: float | None = None) -> None:
        if budget <= 0:
            raise ValueError(f"shared memory budget must be positive, got {budget}")
        self.budget = budget
        self.reclaim_after = reclaim_after
        self.pid = os.getpid()
        self.fd = os.memfd_create(f"zps-{self.pid}-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, budget)
            self._mm = mmap.mmap(self.fd, budget)
        except OSError:
            os.close(self.fd)
            raise
        self.inode = os.fstat(self.fd).st_ino
        self._view = np.frombuffer(self._mm, dtype=np.uint8)
        self._bytes = memoryview(self._mm)
        self._offsets: list[int] = []  # live regions by offset, sorted
        self._by_offset: dict[int, _Region] = {}
        self._by_token: dict[int, _Region] = {}
        self._tokens = itertools.count(secrets.randbits(62) | 1)
        self.used = 0
        self.touched = 0  # bytes from the start that may hold pages (see trim)
        self.puts = 0
        self.full = 0  # frames that went inline for want of room
        self.reclaimed = 0  # regions reused after reclaim_after without a free

    @property
    def live(self) -> int:
        return len(self._by_token)

    def _fit(self, size: int) -> int | None:
        """The lowest offset with ``size`` free bytes (first fit keeps the pages in use few)."""
        start = 0
        for off in self._offsets:
            if off - start >= size:
                return start
            start = off + self._by_offset[off].size
        return start if self.budget - start >= size else None

    def _reclaim(self, now: float) -> bool:
        if self.reclaim_after is None:
            return False
        old = [
            r
            for r in self._by_token.values()
            if now - r.born >= self.reclaim_after and not r.pinned
        ]
        for r in old:
            self._release(r)
        self.reclaimed += len(old)
        return bool(old)

    def put(self, data: Any, now: float | None = None) -> list[int] | None:
        """Copy ``data`` (a buffer) into a new region: ``[pid, fd, inode, offset, length,
        token]`` for a descriptor, or None when the budget has no room."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        src = src.reshape(-1).view(np.uint8)
        region = self.take(src.size, now)
        if region is not None:
            off = region[3]
            self._view[off + HEAD_BYTES : off + HEAD_BYTES + src.size] = src
        return region

    def take(
        self, length: int, now: float | None = None, *, pinned: bool = False
    ) -> list[int] | None:
        """A new region of ``length`` bytes, for the caller to write (see :meth:`data`):
        its descriptor as :meth:`put`'s, or None.  A ``pinned`` region is never
        reclaimed: only :meth:`free` gives it back."""
        size = _round(HEAD_BYTES + length)
        off = self._fit(size)
        if off is None:
            now = time.monotonic() if now is None else now
            if self._reclaim(now):
                off = self._fit(size)
            if off is None:
                self.full += 1
                return None
        token = self._next_token()
        region = _Region(off, size, token, time.monotonic() if now is None else now, pinned)
        bisect.insort(self._offsets, off)
        self._by_offset[off] = region
        self._by_token[token] = region
        self.used += size
        self.touched = max(self.touched, off + size)
        self.puts += 1
        # The token first, then the data: a reader that saw any of the new bytes sees
        # this token (or a later one) when it checks again.
        HEAD.pack_into(self._mm, off, MAGIC, token, length)
        return [self.pid, self.fd, self.inode, off, length, token]

    def _next_token(self) -> int:
        return next(self._tokens) & ((1 << 64) - 1) or 1

    def retoken(self, token: int) -> int | None:
        """Give region ``token`` a new token, before its owner changes its bytes in
        place: a reader told the old one finds it changed, as if the region had been
        reused (None: no such region)."""
        region = self._by_token.pop(token, None)
        if region is None:
            return None
        region.token = self._next_token()
        self._by_token[region.token] = region
        _TOKEN.pack_into(self._mm, region.offset + 8, region.token)
        fence()  # the new token visible before any of the bytes changed after it
        return region.token

    def data(self, offset: int, length: int) -> memoryview:
        """The data bytes of the region at ``offset`` (its head left out), writable."""
        return self._bytes[offset + HEAD_BYTES : offset + HEAD_BYTES + length]

    def free(self, token: int) -> bool:
        """The reader is done with region ``token`` (unknown tokens are ignored)."""
        region = self._by_token.get(token)
        if region is None:
            return False
        self._release(region)
        return True

    def _release(self, region: _Region) -> None:
        # Cleared before the bytes can be reused: a reader still copying finds out.
        _TOKEN.pack_into(self._mm, region.offset + 8, 0)
        fence()  # ... and visible before any new byte written there
        del self._by_token[region.token]
        del self._by_offset[region.offset]
        self._offsets.remove(region.offset)
        self.used -= region.size

    def trim(self) -> int:
        """Give the pages above the last region in use back to the kernel; the bytes."""
        top = 0
        if self._offsets:
            last = self._by_offset[self._offsets[-1]]
            top = last.offset + last.size
        top = -(-top // mmap.PAGESIZE) * mmap.PAGESIZE
        if top >= self.touched:
            return 0
        freed = self.touched - top
        self._mm.madvise(mmap.MADV_REMOVE, top, freed)
        self.touched = top
        return freed

    def close(self) -> None:
        self._by_token.clear()
        self._by_offset.clear()
        self._offsets.clear()
        del self._view
        with contextlib.suppress(BufferError):  # a view is alive: it goes with the process
            self._bytes.release()
            self._mm.close()
        os.close(self.fd)


class Mapper:
    """A reader's mappings of its peers' arenas, by owner pid and memfd inode."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int, int], mmap.mmap] = {}
        self.swept = time.monotonic()
        self.reads = 0
        self.refused = 0

    @property
    def mapped(self) -> int:
        return len(self._maps)

    def _open(self, pid: int, fd: int, inode: int) -> mmap.mmap:
        key = (pid, fd, inode)
        mm = self._maps.get(key)
        if mm is not None:
            return mm
        path = f"/proc/{pid}/fd/{fd}"
        try:
            # Never blocks (a descriptor naming a pipe or a FIFO) nor takes a terminal.
            f = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        except FileNotFoundError:
            raise ShmUnavailableError(
                f"shared memory of process {pid} is gone (it exited)", permanent=False
            ) from None
        except OSError as e:
            raise ShmUnavailableError(
                f"cannot open shared memory {path}: {e.strerror}",
                permanent=True,
                busy=e.errno in _BUSY,
            ) from None
        try:
            st = os.fstat(f)
            if st.st_ino != inode or not stat.S_ISREG(st.st_mode):
                raise ShmUnavailableError(
                    f"{path} is not the shared memory the message names (the process exited?)",
                    permanent=False,
                )
            mm = mmap.mmap(f, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        except ValueError as e:  # an empty file: no arena of a zps process
            raise ShmUnavailableError(
                f"cannot map shared memory {path}: {e}", permanent=True
            ) from None
        except OSError as e:
            raise ShmUnavailableError(
                f"cannot map shared memory {path}: {e.strerror}",
                permanent=True,
                busy=e.errno in _BUSY,
            ) from None
        finally:
            os.close(f)
        if len(self._maps) >= MAX_MAPPINGS:
            self.sweep(force=True)
            if len(self._maps) >= MAX_MAPPINGS:
                _close(self._maps.pop(next(iter(self._maps))))
        self._maps[key] = mm
        return mm

    def read(self, desc: Sequence[int], into: np.ndarray | None = None) -> np.ndarray:
        """The bytes of the region ``desc`` names (``[pid, fd, inode, offset, length,
        token]``, or a slice of it with ``skip`` after), copied into this process's
        memory: into ``into`` (a writable uint8 array of exactly that length: where the
        caller wants them, one copy fewer), else a fresh array."""
        return self.read_finite(desc, into, 0)[0]

    def read_finite(
        self, desc: Sequence[int], into: np.ndarray | None, itemsize: int
    ) -> tuple[np.ndarray, bool]:
        """:meth:`read`, and whether the copy's floats (``itemsize`` 4 or 8; 0: none)
        are known to be finite, checked in the same pass as the copy
        (:func:`zps.core.rows.copy_finite`)."""
        now = time.monotonic()
        if now - self.swept >= SWEEP_S:
            self.sweep(now=now)
        pid, fd, inode, offset, length, token = desc[:6]
        skip = desc[6] if len(desc) > 6 else None
        start = offset + HEAD_BYTES + (skip or 0)
        mm = self._open(pid, fd, inode)
        if start + length > len(mm):
            raise ProtocolError(
                f"shared memory region [{offset}, +{length}) is outside the segment "
                f"of {len(mm)} bytes"
            )
        magic, have, declared = HEAD.unpack_from(mm, offset)
        whole = declared == length if skip is None else skip + length <= declared
        if magic != MAGIC or have != token or not whole:
            self.refused += 1
            raise ShmUnavailableError(
                "the shared memory region was reused before it was read",
                permanent=False,
                token=token,
            )
        out = into if into is not None and into.nbytes == length else np.empty(length, np.uint8)
        src = np.frombuffer(mm, dtype=np.uint8, count=length, offset=start)
        finite = False
        if itemsize:
            finite = copy_finite(out, src, itemsize)
        else:
            out[:] = src
        # The owner clears the token before reusing the bytes: unchanged, the copy is whole.
        # The barrier keeps the copy's loads before this one (CPUs that reorder loads).
        fence()
        if _TOKEN.unpack_from(mm, offset + 8)[0] != token:
            self.refused += 1
            raise ShmUnavailableError(
                "the shared memory region was reused while it was read",
                permanent=False,
                token=token,
            )
        self.reads += 1
        return out, finite

    def sweep(self, *, now: float | None = None, force: bool = False) -> int:
        """Unmap the arenas of owners that are gone (so the kernel can free them)."""
        self.swept = time.monotonic() if now is None else now
        gone = []
        for key in self._maps:
            pid, fd, inode = key
            try:
                alive = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
            except OSError:
                alive = False
            if not alive:
                gone.append(key)
        for key in gone:
            _close(self._maps.pop(key))
        return len(gone)

    def close(self) -> None:
        for mm in self._maps.values():
            _close(mm)
        self._maps.clear()


def _close(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still alive; unmapped when it goes
        mm.close()


#: msgpack's map markers: fixmap (0x80-0x8f, the count in the low bits), map 16, map 32.
_FIXMAP, _MAP16, _MAP32 = 0x80, 0xDE, 0xDF


def with_entry(header: Any, key: str, value: Any) -> bytes:
    """The msgpack map ``header`` (bytes of one map, not holding ``key``) with
    ``key: value`` added: its count raised and the entry appended, without decoding
    the map (a request's or a reply's header, encoded by zps, gains :data:`KEY`)."""
    head = bytes(header)
    entry: bytes = msgpack.packb(key) + msgpack.packb(value, use_bin_type=True)
    first = head[0] if head else -1
    if _FIXMAP <= first < _FIXMAP + 15:
        return bytes((first + 1,)) + head[1:] + entry
    if first == _FIXMAP + 15:  # 15 entries: a 16th needs a map 16
        return bytes((_MAP16, 0, 16)) + head[1:] + entry
    if first == _MAP16 and len(head) >= 3:
        count = int.from_bytes(head[1:3], "big") + 1
        if count <= 0xFFFF:
            return bytes((_MAP16,)) + count.to_bytes(2, "big") + head[3:] + entry
        return bytes((_MAP32,)) + count.to_bytes(4, "big") + head[3:] + entry
    if first == _MAP32 and len(head) >= 5:
        count = int.from_bytes(head[1:5], "big") + 1
        return bytes((_MAP32,)) + count.to_bytes(4, "big") + head[5:] + entry
    raise ProtocolError("header must be a map")


def _descriptors(value: object) -> list[list[int]]:
    if not isinstance(value, list) or len(value) > 4096:
        raise ProtocolError("shared memory descriptors must be a list")
    for d in value:
        if (
            not isinstance(d, list)
            or len(d) not in (7, 8)
            or any(type(x) is not int or not 0 <= x < 1 << 64 for x in d)
            or (len(d) == 8 and d[7] % 8)
        ):
            raise ProtocolError(f"bad shared memory descriptor {d!r}"[:200])
    return value


@dataclass(frozen=True, slots=True)
class Inbound:
    """A message with its shared-memory frames read: ``frames`` as if sent inline (the
    header without :data:`KEY`), and what the sender asked of this receiver."""

    frames: list[Any]
    header: dict[str, Any]  # the header without KEY
    reply_ok: bool  # the sender takes large reply frames through shared memory
    done: list[int]  # regions of this process's arena the sender has read
    #: Payloads whose floats were checked finite as they were read (see inbound's check)
    finite: frozenset[int] = frozenset()
    #: The sender asked for large reply frames this way, and this receiver cannot send
    #: them (another host, or the path off here): the sender should be told.
    reply_refused: bool = False


class SharedMemory:
    """One process's side of the path: its arena (made at first use), its mappings
    of peers' arenas, and its host key."""

    def __init__(
        self,
        budget: int,
        name: str,
        *,
        reclaim_after: float | None = None,
        min_bytes: int = MIN_BYTES,
        max_frame_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        host: str | None = None,
        loan_after: float | None = None,
    ) -> None:
        key = host or host_key()
        if key is None:
            raise ShmUnavailableError("shared memory is unavailable here", permanent=True)
        self.host = key
        self.budget = budget
        self.name = name
        self.reclaim_after = reclaim_after
        #: How long a loan lasts unreported (see _expire_loans): ``reclaim_after`` unless
        #: the owner may hold a reply longer before sending it.
        self.loan_after = loan_after if loan_after is not None else reclaim_after
        self.min_bytes = min_bytes
        #: The largest frame read from a peer's memory (as zmq's MAXMSGSIZE for a frame).
        self.max_frame_bytes = max_frame_bytes
        self.mapper = Mapper()
        self._arena: Arena | None = None
        #: Regions :meth:`reserve` made, by the address of their data and by token (one
        #: descriptor list each, its token changed in place by a retoken), and those
        #: whose array is gone (a finalizer's note, maybe from another thread: see
        #: _unstage).
        self._staged: dict[int, list[int]] = {}
        self._staged_tokens: dict[int, list[int]] = {}
        self.reserved = 0  # regions made by reserve
        self.named = 0  # frames outbound named in such a region instead of copying
        self._unstaged: collections.deque[tuple[int, list[int], int]] = collections.deque()
        #: Regions of :meth:`reserve_array` arrays (a shard's dense values): their
        #: bytes, and at most this many (the rest of the arena is for frames).
        self.array_bytes = 0
        self.array_limit = budget // 4
        #: Reserved regions named in replies (``lend_to``), by the token the reader was
        #: told: (reader, when, the frame), oldest first.  The frame keeps its array
        #: referred to, so its owner changes a copy instead (see DenseTensor.push),
        #: until the reader says it is done or ``loan_after`` passes.
        self._lent: dict[int, collections.deque[tuple[bytes, float, Any]]] = {}
        self.lent = 0  # reply frames named in a reserved region instead of copied
        self.expired = 0  # loans ended by loan_after, the reader not done
        #: Regions a loan of which expired while younger ones still hold them.
        self._tainted: set[int] = set()
        self.retokened = 0  # regions whose token changed for that
        #: Regions of :meth:`buffer` arrays, by the address of their data: (its end,
        #: the region); and by token, how many requests name a slice of one now.
        self._buffers: dict[int, tuple[int, list[int]]] = {}
        self._buffer_uses: dict[int, int] = {}
        self.buffered = 0  # frames named as a slice of a buffer instead of copied

    @classmethod
    def create(
        cls,
        budget: int,
        name: str,
        *,
        reclaim_after: float | None = None,
        max_frame_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        loan_after: float | None = None,
    ) -> SharedMemory | None:
        """The path, or None when it is off (``budget`` 0, ``ZPS_NO_SHM``) or unavailable."""
        if budget <= 0 or disabled_by_env() or not memory_ordered():
            # (the tokens' order between processes needs the compiled barrier on CPUs
            # that reorder memory: without it, the path stays off there)
            return None
        try:
            return cls(
                budget,
                name,
                reclaim_after=reclaim_after,
                max_frame_bytes=max_frame_bytes,
                loan_after=loan_after,
            )
        except ShmUnavailableError:
            return None

    @property
    def arena(self) -> Arena:
        if self._arena is None:
            self._arena = Arena(self.budget, self.name, reclaim_after=self.reclaim_after)
        return self._arena

    def reserve(self, length: int) -> np.ndarray | None:
        """A new region of ``length`` bytes of the arena, as a writable uint8 array (its
        bytes not yet written), or None when the budget has no room.  Sent as a payload
        frame, the array's bytes go with no copy: :meth:`outbound` names its region.
        The region lives as long as the array does (anything that refers to it or to a
        view of it: an operation, a request kept for re-sending, a frame zmq has not
        sent, a stream message a follower has not read), and is freed after; it is
        never reclaimed, nor freed by :meth:`free`."""
        return self._reserve((length,), np.dtype(np.uint8), counted=False)

    def reserve_array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
        """A new C-contiguous array in the arena, for a shard's dense values: as
        :meth:`reserve`, within :attr:`array_limit` bytes of such arrays.  A reply
        naming it lends it (``outbound(lend_to=)``): while lent, the array is referred
        to, so its owner writes a copy rather than change it (see DenseTensor.push)."""
        dt = np.dtype(dtype)
        length = math.prod(shape) * dt.itemsize
        self._unstage()  # arrays gone give their room back first
        if self.array_bytes + length > self.array_limit:
            return None
        return self._reserve(shape, dt, counted=True)

    def _reserve(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], *, counted: bool
    ) -> np.ndarray | None:
        self._unstage()
        length = math.prod(shape) * dtype.itemsize
        region = self.arena.take(length, pinned=True)
        if region is None:
            return None
        self.reserved += 1
        # Its base is the memoryview, so numpy looks no further: views of it have it
        # as their base and keep it alive (and count as references to it).
        arr = np.ndarray(shape, dtype, buffer=self.arena.data(region[3], length))
        address = arr.ctypes.data
        self._staged[address] = region
        self._staged_tokens[region[5]] = region
        # The finalizer may run in pyzmq's garbage-collection thread: it only leaves a
        # note (see _unstage).
        size = length if counted else 0
        self.array_bytes += size
        weakref.finalize(arr, self._unstaged.append, (address, region, size))
        return arr

    def buffer(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
        """A new C-contiguous array of zeros in the arena, for the caller to fill and
        send from (a dense gradient): as :meth:`reserve`, but any slice of it sent as a
        payload frame is named, not copied (a descriptor with ``skip``).  Its region
        gets a new token whenever no request names it any more (see :meth:`free`): a
        copy of a finished request that reaches its reader late finds the region
        changed and is refused, rather than read as the values written since.  None
        when the budget has no room."""
        arr = self._reserve(tuple(shape), np.dtype(dtype), counted=False)
        if arr is None:
            return None
        arr.fill(0)  # pages of a reused region may hold an earlier array's bytes
        region = self._staged[arr.ctypes.data]
        self._buffers[arr.ctypes.data] = (arr.ctypes.data + arr.nbytes, region)
        return arr

    def stage(self, data: np.ndarray) -> np.ndarray | None:
        """A copy of ``data`` (1-D, C-contiguous) in a region of the arena (see
        :meth:`reserve`), or None when the budget has no room."""
        buf = self.reserve(data.nbytes)
        if buf is None:
            return None
        copy = buf.view(data.dtype)
        copy[:] = data
        return copy

    def _unstage(self) -> None:
        """Free the regions of reserved arrays that are gone."""
        while self._unstaged:
            address, region, counted = self._unstaged.popleft()
            token = region[5]  # the current one (see _retoken)
            if self._staged.get(address) is region:
                del self._staged[address]
            if address in self._buffers and self._buffers[address][1] is region:
                del self._buffers[address]
                self._buffer_uses.pop(token, None)
            self._staged_tokens.pop(token, None)
            self.array_bytes -= counted
            if self._arena is not None:
                self._arena.free(token)

    def _staged_region(self, frame: Any) -> tuple[list[int], int | None] | None:
        """The region of a frame that is exactly a staged copy's bytes, with None; or
        of a buffer the frame is a slice of, with the slice's start in it (None: not
        one).  The frame must be contiguous (as any payload frame)."""
        if not self._staged:
            return None
        data = np.frombuffer(frame, dtype=np.uint8)
        address = data.ctypes.data
        region = self._staged.get(address)
        if region is not None and region[4] == data.nbytes and address not in self._buffers:
            return region, None
        for start, (end, region) in self._buffers.items():
            if start <= address and address + data.nbytes <= end:
                # A slice starts 8-byte aligned (a reader's checked copy loads words):
                # another is copied as any frame.
                return (region, address - start) if (address - start) % 8 == 0 else None
        return None

    def wants(self, frames: Sequence[Any]) -> bool:
        """Whether any payload frame of ``[route, header, payloads...]`` is large enough."""
        return any(_nbytes(f) >= self.min_bytes for f in frames[2:])

    def outbound(
        self,
        frames: Sequence[Any],
        *,
        payloads: bool = True,
        reuse: Sequence[list[int]] = (),
        reply_ok: bool = False,
        done: Sequence[int] = (),
        now: float | None = None,
        lend_to: bytes | None = None,
    ) -> tuple[list[Any], list[list[int]]]:
        """``[route, header, payloads...]`` with its large payload frames (``payloads``)
        in shared memory, and the descriptors of the regions taken (free them with
        :meth:`free` and :func:`tokens` once the receiver has read them; a frame that is
        a :meth:`reserve` region's bytes is named as it is, not copied; with
        ``lend_to``, the reader, it is kept referred to until that reader's ``done``
        names it, or ``loan_after`` passes and its token changes).  ``reuse``:
        the descriptors an earlier sending of the same frames took (a re-send copies
        nothing again).  ``reply_ok`` and ``done`` go into the header for the receiver.
        Frames the budget has no room for stay inline; with nothing to say, the frames
        are returned as they are."""
        descs: list[list[int]] = []
        out = list(frames)
        self._unstage()
        if payloads:
            descs = list(reuse)
            for d in descs:
                out[2 + d[0]] = b""
            full = bool(reuse)  # a re-send copies nothing again
            for i in range(2, len(out)):
                f = out[i]
                if _nbytes(f) < self.min_bytes:
                    continue
                named = self._staged_region(f)
                if named is not None:
                    region, skip = named
                    out[i] = b""
                    if skip is not None:
                        descs.append([i - 2, *region[:4], _nbytes(f), region[5], skip])
                        self.buffered += 1
                        token = region[5]  # (a re-send's frames are in ``reuse``)
                        self._buffer_uses[token] = self._buffer_uses.get(token, 0) + 1
                        continue
                    descs.append([i - 2, *region])
                    self.named += 1
                    if lend_to is not None:
                        when = time.monotonic() if now is None else now
                        self._lent.setdefault(region[5], collections.deque()).append(
                            (lend_to, when, f)
                        )
                        self.lent += 1
                    continue
                if full:
                    continue
                put = self.arena.put(f, now)
                if put is None:
                    full = True  # the budget is spent: the rest go inline
                    continue
                descs.append([i - 2, *put])
                out[i] = b""
        if not descs and not reply_ok and not done:
            return out, []
        info: dict[str, Any] = {"h": self.host}
        if descs:
            info["d"] = descs
        if reply_ok:
            info["r"] = True
        if done:
            info["done"] = list(done)
        out[1] = with_entry(out[1], KEY, info)
        return out, descs

    def inbound(
        self,
        frames: Sequence[Any],
        header: dict[str, Any],
        into: Mapping[int, np.ndarray] | None = None,
        *,
        stage: int = 0,
        reader: bytes = b"",
        check: Mapping[int, int] | None = None,
        header_frame: bool = True,
    ) -> Inbound:
        """Read the shared-memory frames of a received ``[route, header, payloads...]``
        whose decoded header is ``header`` (it has :data:`KEY`), from ``reader`` (whose
        ``done`` ends its loans, see :meth:`outbound`).  ``header_frame`` False: the
        caller reads only the decoded header and the payloads, so ``frames[1]`` is left
        as it came (with :data:`KEY`) rather than encoded again.  ``check``: payload index ->
        float item size (4 or 8) of payloads whose values should be checked finite as
        they are copied (those found so are in ``Inbound.finite``).  ``into``: where the
        caller wants payload ``i``'s bytes (a uint8 array of its length; others, and
        other lengths, get fresh arrays).  ``stage``: up to that many bytes of the others
        go into regions of this process's own arena (:meth:`reserve`), to be sent on with
        no further copy.  Raises :class:`ShmUnavailableError` when a
        region cannot be read (nothing read is used then; an ``into`` array may hold
        part of it), ProtocolError for a malformed descriptor."""
        info = header.get(KEY)
        if not isinstance(info, dict):
            raise ProtocolError(f"header {KEY!r} must be a map")
        done = info.get("done", [])
        if not isinstance(done, list) or any(type(t) is not int for t in done):
            raise ProtocolError("shared memory 'done' must be a list of tokens")
        self.free(done, reader=reader)
        descs = _descriptors(info.get("d", []))
        finite: set[int] = set()
        rest = dict(header)
        del rest[KEY]
        out = list(frames)
        if header_frame:
            out[1] = msgpack.packb(rest, use_bin_type=True)
        if descs:
            if info.get("h") != self.host:
                self.mapper.refused += 1
                raise ShmUnavailableError(
                    "the sender's shared memory is on another host", permanent=True
                )
            for d in descs:
                i = 2 + d[0]
                if i >= len(out) or _nbytes(out[i]) != 0:
                    raise ProtocolError(f"shared memory descriptor names frame {d[0]}")
                if d[5] > self.max_frame_bytes:
                    raise ProtocolError(
                        f"a shared memory frame of {d[5]} bytes exceeds {self.max_frame_bytes}"
                    )
                target = into.get(d[0]) if into else None
                if target is None and self.min_bytes <= d[5] <= stage:
                    target = self.reserve(d[5])
                    if target is not None:
                        stage -= d[5]
                itemsize = check.get(d[0], 0) if check else 0
                if itemsize:
                    got, ok = self.mapper.read_finite(d[1:], target, itemsize)
                    if ok:
                        finite.add(d[0])
                else:
                    got = self.mapper.read(d[1:], target)
                out[i] = got.data
        asked = info.get("r") is True
        reply_ok = asked and info.get("h") == self.host
        return Inbound(out, rest, reply_ok, list(done), frozenset(finite), asked and not reply_ok)

    def housekeeping(self, now: float | None = None) -> None:
        """Drop mappings of peers that are gone (at most every :data:`SWEEP_S`); a
        process calls it now and then, reading or not."""
        self._unstage()
        now = time.monotonic() if now is None else now
        self._expire_loans(now)
        if self.mapper.mapped and now - self.mapper.swept >= SWEEP_S:
            self.mapper.sweep(now=now)

    def trim(self) -> int:
        """Give the unused pages of this process's arena back (a quiet moment)."""
        return self._arena.trim() if self._arena is not None else 0

    def free(self, tokens: Sequence[int], *, reader: bytes = b"") -> None:
        """The receiver (``reader``) is done with these regions: a region it was lent
        ends that loan (the oldest, if it had several); one of :meth:`reserve` goes
        with its array instead, and one of :meth:`buffer` that no request names any
        more gets a new token."""
        if self._arena is None:
            return
        for t in tokens:
            uses = self._buffer_uses.get(t)
            if uses is not None:
                if uses > 1:
                    self._buffer_uses[t] = uses - 1
                else:
                    del self._buffer_uses[t]
                    self._retoken(t)
                continue
            loans = self._lent.get(t)
            if loans is not None:
                for i, loan in enumerate(loans):
                    if loan[0] == reader:
                        del loans[i]
                        break
                if not loans:
                    del self._lent[t]
                    if t in self._tainted:  # a loan of it expired: see _expire_loans
                        self._tainted.discard(t)
                        self._retoken(t)
            elif t not in self._staged_tokens:
                self._arena.free(t)

    def _expire_loans(self, now: float) -> None:
        """End the loans older than ``loan_after``.  Once a region's last loan has ended,
        if any of them expired, an array still held there (a tensor's values) gets a new
        token before its owner may change it in place: a reader that took that long
        finds its region changed and asks again.  (Not before: the younger loans' readers
        would be refused for nothing, and the array cannot change while they hold it.)"""
        if self.loan_after is None or not self._lent:
            return
        cutoff = now - self.loan_after
        stale = []
        for token, loans in self._lent.items():
            if loans[0][1] > cutoff:
                continue
            while loans and loans[0][1] <= cutoff:
                loans.popleft()
                self.expired += 1
            stale.append(token)
        for token in stale:
            if self._lent[token]:
                self._tainted.add(token)
            else:
                del self._lent[token]
                self._tainted.discard(token)
                self._retoken(token)

    def _retoken(self, token: int) -> None:
        """A new token for region ``token``, if its array is still held (else it is gone,
        freed with its token cleared)."""
        self._unstage()
        region = self._staged_tokens.pop(token, None)
        if region is None or self._arena is None:
            return
        new = self._arena.retoken(token)
        if new is not None:
            region[5] = new
            self._staged_tokens[new] = region
            self.retokened += 1

    def stats(self) -> dict[str, int]:
        a = self._arena
        return {
            "used": a.used if a else 0,
            "live": a.live if a else 0,
            "puts": a.puts if a else 0,
            "full": a.full if a else 0,
            "reclaimed": a.reclaimed if a else 0,
            "reserved": self.reserved,
            "named": self.named,
            "buffered": self.buffered,
            "lent": self.lent,
            "loans": sum(len(v) for v in self._lent.values()),
            "expired": self.expired,
            "retokened": self.retokened,
            "array_bytes": self.array_bytes,
            "reads": self.mapper.reads,
            "refused": self.mapper.refused,
            "mapped": self.mapper.mapped,
        }

    def close(self) -> None:
        self.mapper.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None


class _Off(SharedMemory):
    """A process with the path off: refuses descriptors, ignores the rest."""

    def __init__(self) -> None:
        super().__init__(1, "off", host="off")

    def inbound(
        self,
        frames: Sequence[Any],
        header: dict[str, Any],
        into: Mapping[int, np.ndarray] | None = None,
        *,
        stage: int = 0,
        reader: bytes = b"",
        check: Mapping[int, int] | None = None,
        header_frame: bool = True,
    ) -> Inbound:
        info = header.get(KEY)
        if isinstance(info, dict) and info.get("d"):
            self.mapper.refused += 1
            raise ShmUnavailableError("shared memory is off here", permanent=True)
        got = super().inbound(frames, header, header_frame=header_frame)
        return Inbound(got.frames, got.header, False, [], reply_refused=got.reply_refused)


#: What a process with the path off uses to read a message that names shared memory.
OFF = _Off()


def tokens(descs: Sequence[list[int]]) -> list[int]:
    """The region tokens of descriptors from :meth:`SharedMemory.outbound`."""
    return [d[6] for d in descs]


def _nbytes(f: Any) -> int:
    if isinstance(f, bytes | bytearray):
        return len(f)
    try:
        return memoryview(f).nbytes
    except TypeError:
        return len(f)
