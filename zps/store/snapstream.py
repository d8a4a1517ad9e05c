"""A snapshot in bounded chunks: the chunk plan of a stream and its receiving side.

A snapshot travels to a replica as one byte stream (the checkpoint file format:
header, arrays, SHA-256; see :mod:`zps.shard.checkpoint`) cut into chunks of at
most ``chunk_bytes``.  Chunk ``seq`` of ``count`` carries the stream's bytes
``[seq * chunk_bytes, min(total, (seq + 1) * chunk_bytes))``, as pieces of the
stream's parts (no copy on the sending side).

Rule: a :class:`StreamBuilder` accepts chunks strictly in order and hands over a
complete, validated snapshot or raises :class:`~zps.errors.ProtocolError`.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from zps.errors import BadRequestError, ProtocolError
from zps.protocol.codec import CODEC_RAW, WIRE_DTYPES, BufferLike
from zps.protocol.specs import EmbeddingSpec, spec_from_wire
from zps.store import mapped
from zps.store.checksums import CHECKSUMS, STREAM_MAGIC, Checksum, stream_checksum
from zps.store.index import IndexBuild
from zps.store.snapshot import Snapshot, decode_snapshot

#: Default size of one snapshot chunk.
DEFAULT_CHUNK_BYTES = 8 << 20
#: Chunks sent and not yet acknowledged, per replica.
DEFAULT_CHUNK_WINDOW = 4

Piece = tuple[int, int, int]  # (part index, start, stop) within the stream's parts


@dataclass(frozen=True)
class ChunkPlan:
    total: int
    chunk_bytes: int
    chunks: tuple[tuple[Piece, ...], ...]

    @property
    def count(self) -> int:
        return len(self.chunks)


def plan_chunks(sizes: Sequence[int], chunk_bytes: int) -> ChunkPlan:
    """Cut parts of the given sizes, in order, into chunks of ``chunk_bytes`` (the last may
    be shorter; an empty stream is one empty chunk)."""
    if type(chunk_bytes) is not int or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    chunks: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    room = chunk_bytes
    for part, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"part {part} has a negative size {size}")
        start = 0
        while start < size:
            stop = min(size, start + room)
            current.append((part, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                chunks.append(tuple(current))
                current, room = [], chunk_bytes
    if current or not chunks:
        chunks.append(tuple(current))
    return ChunkPlan(sum(sizes), chunk_bytes, tuple(chunks))


def chunk_count(total: int, chunk_bytes: int) -> int:
    return max(1, -(-total // chunk_bytes))


_HEAD_LEN = struct.Struct("<Q")
_PREFIX = len(STREAM_MAGIC) + _HEAD_LEN.size
_MIN_DIGEST = min(c.size for c in CHECKSUMS.values())


class StreamBuilder:
    """A replica's side (and a restart's): the chunks of one snapshot stream, accepted
    strictly in order, written as they come into the arrays the partition's tables
    will own (no copy of the stream is assembled).

    Every field is validated: ``total`` at most ``max_bytes``, ``count`` consistent
    with ``total`` and ``chunk_bytes``; a chunk out of order, repeated, of the wrong
    size or of another snapshot raises :class:`ProtocolError` (:meth:`check`, on the
    caller's loop), and so does a stream whose header does not describe it
    (:meth:`take`, which copies, in a worker thread; chunks are taken in order, one at
    a time).  :meth:`snapshot` gives the validated snapshot once every chunk is taken;
    the caller compares :meth:`digest` with the checksum it took of the chunks.
    """

    def __init__(
        self, snapshot_id: int, total: int, chunk_bytes: int, count: int, max_bytes: int
    ) -> None:
        for name, value in (
            ("snapshot_id", snapshot_id),
            ("total", total),
            ("chunk_bytes", chunk_bytes),
            ("count", count),
        ):
            if type(value) is not int or value < 0:
                raise ProtocolError(f"snapshot chunk {name} must be a non-negative integer")
        if chunk_bytes == 0:
            raise ProtocolError("snapshot chunk_bytes must be positive")
        if total > max_bytes:
            raise ProtocolError(f"snapshot of {total} bytes exceeds the limit of {max_bytes}")
        if total < _PREFIX + _MIN_DIGEST:
            raise ProtocolError(f"snapshot of {total} bytes is too short to be one")
        if count != chunk_count(total, chunk_bytes):
            raise ProtocolError(
                f"snapshot of {total} bytes in chunks of {chunk_bytes} cannot be {count} chunks"
            )
        self.snapshot_id, self.total, self.chunk_bytes, self.count = (
            snapshot_id,
            total,
            chunk_bytes,
            count,
        )
        self.max_bytes = max_bytes
        self.received = 0  # chunks checked
        self.taken = 0  # bytes copied
        self._prefix = bytearray()
        self._head_len = -1
        self._head = bytearray()
        self._header: dict[str, Any] | None = None
        self._frames: list[np.ndarray] = []  # each frame's bytes, where they go
        self._dests: dict[int, np.ndarray] = {}  # frames that are tables' arrays
        self._id_frames: dict[int, str] = {}  # frames that are tables' ids, by table
        #: By table, the index of its ids, built (by a thread) once they are taken.
        self.indexes: dict[str, IndexBuild] = {}
        self._frame = 0
        self._frame_pos = 0
        self._digest = bytearray()
        #: The checksum the stream ends with (known once its magic is taken).
        self.checksum: Checksum | None = None

    @classmethod
    def from_header(cls, header: dict[str, Any], *, max_bytes: int) -> StreamBuilder:
        """A builder for the snapshot a first chunk's header announces."""
        try:
            sid, total, chunk, count = (header[k] for k in ("id", "total", "chunk", "count"))
        except KeyError as e:
            raise ProtocolError(f"snapshot chunk header lacks {e}") from None
        return cls(sid, total, chunk, count, max_bytes)

    @property
    def done(self) -> bool:
        return self.received == self.count

    def check(self, snapshot_id: object, seq: object, pieces: Sequence[BufferLike]) -> bool:
        """Accept chunk ``seq`` (``pieces``: its bytes), to be taken next; True if it is
        the last."""
        return self.check_size(snapshot_id, seq, sum(len(memoryview(p).cast("B")) for p in pieces))

    def check_size(self, snapshot_id: object, seq: object, size: int) -> bool:
        """:meth:`check` of a chunk of ``size`` bytes (a reader that places them itself,
        :meth:`direct`)."""
        if snapshot_id != self.snapshot_id:
            raise ProtocolError(
                f"chunk of snapshot {snapshot_id} while assembling {self.snapshot_id}"
            )
        if type(seq) is not int or seq != self.received:
            what = "repeated" if type(seq) is int and 0 <= seq < self.received else "out of order"
            raise ProtocolError(
                f"snapshot chunk {seq!r} is {what}: expected chunk {self.received} of {self.count}"
            )
        start = seq * self.chunk_bytes
        expected = min(self.total, start + self.chunk_bytes) - start
        if size != expected:
            raise ProtocolError(f"snapshot chunk {seq} has {size} bytes, expected {expected}")
        self.received += 1
        return self.done

    def take(self, pieces: Sequence[BufferLike]) -> None:
        """Copy a checked chunk's bytes to where they go (the next chunk's, in order)."""
        for piece in pieces:
            view = memoryview(piece).cast("B")
            while len(view):
                view = view[self._feed(view) :]

    def direct(self) -> tuple[np.ndarray, int, int] | None:
        """Where the next bytes go when a reader may write them there itself (a table's
        array in a memory file: :func:`mapped.fill_from`): the array, the byte offset in
        it and how many bytes of it are still to come, which the reader then reports with
        :meth:`took`; None when the next bytes are to be :meth:`take` n."""
        if self._header is None or not 0 <= self._frame < len(self._frames):
            return None
        if not self._fills(self._frame):
            return None
        owner = self._dests[self._frame]
        return owner, self._frame_pos, self._frames[self._frame].shape[0] - self._frame_pos

    def _fills(self, frame: int) -> bool:
        """Whether a reader writes frame ``frame`` itself (see :meth:`direct`): a
        table's array (not its ids, indexed once taken) in a memory file."""
        owner = self._dests.get(frame)
        return owner is not None and frame not in self._id_frames and mapped.fillable(owner)

    def took(self, n: int) -> None:
        """``n`` bytes of :meth:`direct`'s array were written there by the reader."""
        target = self.direct()
        if target is None or not 0 < n <= target[2]:
            raise ValueError(f"{n} bytes taken directly where {target and target[2]} were due")
        self._frame_pos += n
        self.taken += n
        if self._frame_pos == self._frames[self._frame].shape[0]:
            self._next_frame()

    def buffered(self) -> int:
        """How many of the next bytes are to be :meth:`take` n before :meth:`direct`
        gives a place for any (all that is left if it never will; only up to the end of
        the header before the header is read)."""
        if self._header is None:
            if self._head_len < 0:
                return _PREFIX - len(self._prefix)
            return self._head_len - len(self._head)
        n, i, pos = 0, self._frame, self._frame_pos
        while i < len(self._frames):
            if self._fills(i) and (n or self._frames[i].shape[0] > pos):
                return n
            n += self._frames[i].shape[0] - pos
            i, pos = i + 1, 0
        assert self.checksum is not None  # known since the prefix
        return n + self.checksum.size - len(self._digest)

    def _feed(self, view: memoryview) -> int:
        """Take what of ``view`` belongs to the current region; how many bytes."""
        if self._header is None:
            if self._head_len < 0:
                take = min(len(view), _PREFIX - len(self._prefix))
                self._prefix += view[:take]
                if len(self._prefix) == _PREFIX:
                    self._begin(bytes(self._prefix))
            else:
                take = min(len(view), self._head_len - len(self._head))
                self._head += view[:take]
                if len(self._head) == self._head_len:
                    self._open(bytes(self._head))
                    self._head = bytearray()
        elif self._frame < len(self._frames):
            dest = self._frames[self._frame]
            take = min(len(view), dest.shape[0] - self._frame_pos)
            owner = self._dests.get(self._frame)
            # A table's array is written through its memory file (one copy in the
            # kernel, no page faults); other memory is copied into, its pages faulted in
            # at once rather than one by one.
            if owner is None or not mapped.write_at(owner, self._frame_pos, view[:take]):
                if owner is not None:
                    mapped.populate(owner, self._frame_pos, self._frame_pos + take)
                dest[self._frame_pos : self._frame_pos + take] = np.frombuffer(
                    view[:take], np.uint8
                )
            self._frame_pos += take
            if self._frame_pos == dest.shape[0]:
                name = self._id_frames.get(self._frame)
                if name is not None:  # indexed while the rows come
                    self.indexes[name] = IndexBuild(self._dests[self._frame])
                self._next_frame()
        else:
            assert self.checksum is not None  # known since the prefix
            take = min(len(view), self.checksum.size - len(self._digest))
            if take == 0:
                raise ProtocolError("snapshot stream runs past its checksum")
            self._digest += view[:take]
        self.taken += take
        return take

    def _begin(self, prefix: bytes) -> None:
        checksum = stream_checksum(prefix)
        if checksum is None:
            raise ProtocolError("snapshot stream does not begin as one (bad magic)")
        self.checksum = checksum
        (head_len,) = _HEAD_LEN.unpack_from(prefix, len(STREAM_MAGIC))
        if head_len > self.total - _PREFIX - checksum.size:
            raise ProtocolError("snapshot header runs past the end of the stream")
        self._head_len = head_len
        if head_len == 0:
            raise ProtocolError("snapshot stream has no header")

    def _open(self, raw: bytes) -> None:
        """The header is here: where each frame goes, checked against the stream."""
        try:
            header = msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise ProtocolError(f"snapshot header does not decode: {e}") from None
        if not isinstance(header, dict):
            raise ProtocolError("snapshot header is not a map")
        sizes = header.pop("frame_bytes", None)
        assert self.checksum is not None  # known since the prefix
        body = self.total - _PREFIX - self._head_len - self.checksum.size
        if (
            not isinstance(sizes, list)
            or not all(type(n) is int and n >= 0 for n in sizes)
            or sum(sizes) != body
        ):
            raise ProtocolError("snapshot frame sizes do not match the stream")
        self._header = header
        self._dests = _destinations(header, sizes)
        self._id_frames = _id_frames(header, self._dests)
        self._frames = [
            self._dests[i].reshape(-1).view(np.uint8) if i in self._dests else np.empty(n, np.uint8)
            for i, n in enumerate(sizes)
        ]
        self._frame, self._frame_pos = -1, 0
        self._next_frame()

    def _next_frame(self) -> None:
        self._frame += 1
        self._frame_pos = 0
        while self._frame < len(self._frames) and self._frames[self._frame].shape[0] == 0:
            self._frame += 1

    def digest(self) -> bytes:
        """The checksum the stream ends with (once every chunk is taken)."""
        return bytes(self._digest)

    def snapshot(self) -> Snapshot:
        """The snapshot, validated; its embedding tables' arrays are the ones the chunks
        were written into (:func:`build_store` makes the tables own them)."""
        if not self.done or self.taken != self.total or self._header is None:
            raise ProtocolError(
                f"snapshot incomplete: {self.received} of {self.count} chunks, "
                f"{self.taken} of {self.total} bytes taken"
            )
        header, dests = self._header, self._dests
        payloads = [f.data for f in self._frames]
        self._frames, self._dests = [], {}
        snap = decode_snapshot(header, payloads, max_bytes=self.max_bytes, copy=False)
        del payloads
        for name, descs in header["tables"].items():
            arrays = snap.export["tables"][name]
            for key, desc in descs.items():
                dest = dests.get(desc[0])
                if dest is not None:
                    arrays[key] = dest  # the same bytes, owned (and growable)
        return dataclasses.replace(snap, indexes=dict(self.indexes))


def _destinations(header: dict[str, Any], sizes: list[int]) -> dict[int, np.ndarray]:
    """By frame index: the arrays of embedding tables' ``rows``, state and ``ids`` the
    header describes (raw, of the frame's size), allocated for the frames to fill.  What
    is malformed is left to :func:`decode_snapshot` to refuse."""
    specs, tables = header.get("specs"), header.get("tables")
    if not isinstance(specs, list) or not isinstance(tables, dict):
        return {}
    names = set()
    for wire in specs:
        try:
            spec = spec_from_wire(wire)
        except (BadRequestError, ProtocolError, KeyError, TypeError, ValueError):
            return {}
        if isinstance(spec, EmbeddingSpec):
            names.add(spec.name)
    out: dict[int, np.ndarray] = {}
    for name, descs in tables.items():
        if name not in names or not isinstance(descs, dict):
            continue
        for desc in descs.values():
            if not (isinstance(desc, list) and len(desc) == 4):
                continue
            index, dtype, shape, codec = desc
            if (
                type(index) is not int
                or not 0 <= index < len(sizes)
                or index in out
                or dtype not in WIRE_DTYPES
                or codec != CODEC_RAW
                or type(shape) is not list
                or len(shape) not in (1, 2)
                or not all(type(d) is int and d >= 0 for d in shape)
            ):
                continue
            dt = np.dtype(dtype)
            if math.prod(shape) * dt.itemsize != sizes[index]:
                continue
            if len(shape) == 2:
                out[index] = mapped.empty(shape[0], shape[1], dt)
            else:
                out[index] = np.empty(shape[0], dt)
    return out


#: Tables of at least this many ids have them indexed by a thread of their own as soon
#: as a stream's ids are taken, while its rows come (smaller ones at the build).
INDEX_AHEAD_IDS = 1 << 16


def _id_frames(header: dict[str, Any], dests: dict[int, np.ndarray]) -> dict[int, str]:
    """By frame index, the embedding tables whose ids are large frames of ``dests``."""
    out: dict[int, str] = {}
    tables = header.get("tables")
    for name, descs in tables.items() if isinstance(tables, dict) else ():
        desc = descs.get("ids") if isinstance(descs, dict) else None
        if isinstance(name, str) and isinstance(desc, list) and desc and type(desc[0]) is int:
            dest = dests.get(desc[0])
            if dest is not None and dest.ndim == 1 and dest.shape[0] >= INDEX_AHEAD_IDS:
                out[desc[0]] = name
    return out
