"""One process's side of the path: its arena (made at first use), its mappings of
peers' arenas, and its host key; what it sends (:meth:`SharedMemory.outbound`: frames
copied into regions or named where they already are, and loans of a shard's arrays
to their readers) and what it receives (:meth:`SharedMemory.inbound`)."""

from __future__ import annotations

import collections
import math
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from zps.core.rows import memory_ordered
from zps.errors import ProtocolError
from zps.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES
from zps.shm.arena import Arena
from zps.shm.header import KEY, Inbound, descriptors, with_entry
from zps.shm.mapper import SWEEP_S, Mapper
from zps.shm.region import ShmUnavailableError, disabled_by_env, host_key

#: Payload frames of at least this many bytes go through shared memory: a sparse
#: step's rows and gradients from 1,536 rows of 32 float32s on, and dense chunks.
#: Below it the sockets are cheaper (figures: docs/performance.md, "Figures behind the
#: code's rules").
MIN_BYTES = 192 << 10


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

    @property
    def arena_made(self) -> bool:
        """Whether this side's arena exists (it is made at first use)."""
        return self._arena is not None

    @property
    def staged_regions(self) -> int:
        """Regions made by :meth:`reserve`, :meth:`reserve_array` or :meth:`buffer` and
        not freed yet.  The region of an array that is gone is freed at this memory's
        next call (see :attr:`unstaged_regions`), not at once."""
        return len(self._staged)

    @property
    def buffer_regions(self) -> int:
        """Those of the regions of :attr:`staged_regions` that are :meth:`buffer` arrays."""
        return len(self._buffers)

    @property
    def tracked_tokens(self) -> int:
        """Tokens this memory still keeps a record of: those of its staged regions, and
        those of :meth:`buffer` regions named by requests not yet freed.  None is kept
        once every region is freed."""
        return len(self._staged_tokens) + len(self._buffer_uses)

    @property
    def unstaged_regions(self) -> int:
        """Regions whose array is gone, noted to be freed at this memory's next call."""
        return len(self._unstaged)

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
        descs = descriptors(info.get("d", []))
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


def _nbytes(f: Any) -> int:
    if isinstance(f, bytes | bytearray):
        return len(f)
    try:
        return memoryview(f).nbytes
    except TypeError:
        return len(f)
