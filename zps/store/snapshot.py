"""A partition's whole state as one message: snapshot encoding, without I/O.

Used to bring a replica up to date (snapshot at LSN L, then the stream from
L+1).  The header carries the table specs, the LSN, the epoch and the dedup
record; every array travels as a payload frame (see :mod:`zps.protocol.codec`).

Rule: :func:`decode_snapshot` returns a complete, validated snapshot or raises
:class:`~zps.errors.ProtocolError`; a half-read snapshot is never loaded.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from zps.errors import BadRequestError, ProtocolError
from zps.protocol.codec import CODEC_RAW, WIRE_DTYPES, BufferLike, Encoder, array_from
from zps.protocol.specs import EmbeddingSpec, spec_from_wire
from zps.store import mapped
from zps.store.checksums import (  # the stream's checksums, re-exported from here
    CHECKSUMS,
    READABLE,  # noqa: F401
    STREAM_DIGEST,  # noqa: F401
    STREAM_MAGIC,
    STREAM_MAGIC_SHA256,  # noqa: F401
    Checksum,
    Hasher,  # noqa: F401
    magic_for,  # noqa: F401
    stream_checksum,
)
from zps.store.index import IndexBuild
from zps.store.partition import PartitionStore
from zps.store.tables import DenseMemory, EmbeddingTable

DedupEntry = tuple[bytes, int, list[dict[str, Any]]]


@dataclass(frozen=True)
class Snapshot:
    partition: int
    epoch: int
    lsn: int
    export: dict[str, Any]  # as PartitionStore.export() returns it
    dedup: list[DedupEntry]
    #: Sync-mode gradients waiting for their step's commit (StepBuffer.export()).
    steps: dict[str, Any] = field(default_factory=lambda: {"committed": -1, "entries": []})
    #: Per client, the highest seq evicted from the dedup record (DedupCache.floors()).
    dedup_floors: list[tuple[bytes, int]] = field(default_factory=list)
    #: Live resharding: the slots the partition serves, fences and imports included
    #: (``zps.shard.slotops.SlotState.to_wire``); None: every slot routed to it.
    slots: dict[str, Any] | None = None
    #: The frozen versions its arrays read (:func:`freeze_export`), released once the
    #: snapshot is encoded and read: see zps.shard.checkpoint.release.
    frozen: tuple[mapped.Frozen, ...] = ()
    #: By embedding table, the index of its ids built while the rest of the stream
    #: arrived (:class:`StreamBuilder`), which :func:`build_store` uses.
    indexes: dict[str, IndexBuild] = field(default_factory=dict)


def encode_snapshot(enc: Encoder, snap: Snapshot) -> dict[str, Any]:
    """Add the snapshot's arrays to ``enc``; return the header to send with them."""
    tables = {
        name: {key: _array(enc, arr) for key, arr in arrays.items()}
        for name, arrays in snap.export["tables"].items()
    }
    header: dict[str, Any] = {
        "partition": snap.partition,
        "epoch": snap.epoch,
        "lsn": snap.lsn,
        "specs": snap.export["specs"],
        "tables": tables,
        "dedup": [[cid, seq, statuses] for cid, seq, statuses in snap.dedup],
        "steps": {
            "committed": snap.steps["committed"],
            "entries": [
                [step, cid, table, chunk, None if ids is None else enc.array(ids), enc.array(g)]
                for step, cid, table, chunk, ids, g in snap.steps["entries"]
            ],
        },
    }
    if snap.dedup_floors:
        header["dedup_floors"] = [[cid, seq] for cid, seq in snap.dedup_floors]
    if snap.slots is not None:
        header["slots"] = snap.slots
    return header


def _array(enc: Encoder, arr: Any) -> list[Any]:
    """``enc.array``, or for a frozen array a frame that is read when the stream is."""
    if not isinstance(arr, FrozenArray):
        return enc.array(arr)
    enc.frames.append(FrozenPart(arr.version, 0, arr.nbytes))  # type: ignore[arg-type]
    return [len(enc.frames) - 1, arr.dtype.name, list(arr.shape), CODEC_RAW]


def decode_snapshot(
    header: dict[str, Any], payloads: Sequence[BufferLike], *, max_bytes: int, copy: bool = True
) -> Snapshot:
    """A snapshot's header and frames, validated.  Its tables' arrays are copies, unless
    ``copy`` is False: then they are read-only views of ``payloads``, for a caller that
    loads them into tables (which copy) at once and keeps the frames alive meanwhile."""
    try:
        partition, epoch, lsn = header["partition"], header["epoch"], header["lsn"]
        specs, tables, dedup = header["specs"], header["tables"], header["dedup"]
    except KeyError as e:
        raise ProtocolError(f"snapshot header lacks {e}") from None
    if not all(type(v) is int and v >= 0 for v in (partition, epoch, lsn)):
        raise ProtocolError("snapshot partition, epoch and lsn must be non-negative integers")
    if not isinstance(specs, list) or not isinstance(tables, dict) or not isinstance(dedup, list):
        raise ProtocolError("snapshot specs/tables/dedup have the wrong types")
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for name, descs in tables.items():
        if not isinstance(name, str) or not isinstance(descs, dict):
            raise ProtocolError("snapshot tables must map names to array maps")
        # copies unless the caller loads them at once (a table owns what it loads)
        arrays[name] = {
            str(k): np.array(array_from(d, payloads, max_bytes=max_bytes), copy=copy)
            for k, d in descs.items()
        }
    entries: list[DedupEntry] = []
    for entry in dedup:
        if (
            not isinstance(entry, list)
            or len(entry) != 3
            or not isinstance(entry[0], bytes)
            or type(entry[1]) is not int
            or not isinstance(entry[2], list)
        ):
            raise ProtocolError("snapshot dedup entries must be [cid, seq, statuses]")
        entries.append((entry[0], entry[1], entry[2]))
    floors = header.get("dedup_floors", [])
    if not isinstance(floors, list) or not all(
        isinstance(f, list) and len(f) == 2 and isinstance(f[0], bytes) and type(f[1]) is int
        for f in floors
    ):
        raise ProtocolError("snapshot dedup_floors must be a list of [cid, seq]")
    steps = header.get("steps", {"committed": -1, "entries": []})
    try:
        pending = [
            [
                s,
                cid,
                t,
                c,
                None if ids is None else np.array(array_from(ids, payloads, max_bytes=max_bytes)),
                np.array(array_from(g, payloads, max_bytes=max_bytes)),
            ]
            for s, cid, t, c, ids, g in steps["entries"]
        ]
        step_state = {"committed": steps["committed"], "entries": pending}
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"snapshot step buffer is malformed: {e}") from None
    slots = header.get("slots")
    if slots is not None and not isinstance(slots, dict):
        raise ProtocolError("snapshot slots must be a map")
    return Snapshot(
        partition,
        epoch,
        lsn,
        {"specs": specs, "tables": arrays},
        entries,
        step_state,
        [(f[0], f[1]) for f in floors],
        slots,
    )


# -- a consistent cut, cheap enough for the event loop ---------------------------
#
# Copying a large table into fresh memory costs mostly page faults.  So a cut is
# taken in three steps: :func:`cut_space` sizes buffers (on the loop, instant),
# :meth:`CutSpace.prefault` touches them (in a worker thread), :func:`cut_export`
# copies the tables into them (on the loop: memory copies only).  Snapshots and
# checkpoints keep the rows in storage order; :func:`ordered` sorts them by id for a
# caller that wants :meth:`PartitionStore.export`'s order.


@dataclass
class CutSpace:
    """Pre-allocated room for an embedding table's arrays: ``{table: {key: buffer}}``."""

    buffers: dict[str, dict[str, np.ndarray]]

    def prefault(self) -> None:
        """Touch every page, so the copy into them costs no page faults."""
        for arrays in self.buffers.values():
            for buf in arrays.values():
                buf.fill(0)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for arrays in self.buffers.values() for b in arrays.values())

    def fits(self, store: PartitionStore) -> bool:
        """Whether a cut of ``store`` taken now copies no embedding rows but into these
        buffers: each table can be frozen now, or has room here for all its arrays.
        (Another cut that froze the tables since the buffers were sized makes it False:
        a cut then would copy them into memory nobody touched.)"""
        for spec in store.specs():
            if not isinstance(spec, EmbeddingSpec):
                continue
            table = store.embedding(spec.name)
            if _freezable(table):
                continue
            room, n = self.buffers.get(spec.name, {}), len(table)
            for key in ("rows", *table._state):
                buf = room.get(key)
                if buf is None or buf.shape[0] < n:
                    return False
        return True


#: Room for rows inserted between sizing and copying a cut.
CUT_SLACK = 0.05


def cut_space(store: PartitionStore, *, frozen: bool = False) -> CutSpace:
    """Buffers (not yet touched) for a cut of ``store``'s embedding tables (with
    ``frozen``, only the ids of those :func:`freeze_export` can freeze now: their ids
    are copied, the rest frozen)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for spec in store.specs():
        if isinstance(spec, EmbeddingSpec):
            table = store.embedding(spec.name)
            rows = int(len(table) * (1 + CUT_SLACK)) + 1024
            arrays = {"ids": np.empty(rows, dtype=np.int64)}
            if frozen and _freezable(table):
                out[spec.name] = arrays
                continue
            arrays["rows"] = np.empty((rows, spec.dim), dtype=table.dtype)
            for key, width in table._widths.items():
                arrays[key] = np.empty((rows, width), dtype=table.dtype)
            out[spec.name] = arrays
    return CutSpace(out)


def cut_export(store: PartitionStore, space: CutSpace | None = None) -> dict[str, Any]:
    """The partition's contents at this instant, as copies (memory copies only).

    Embedding rows come in storage order, copied into ``space`` where it is big
    enough; :func:`ordered` then gives exactly
    :meth:`PartitionStore.export <zps.store.partition.PartitionStore.export>`.
    Dense tensors are small (bounded chunks) and are exported as they are.
    """
    specs = store.specs()
    tables: dict[str, dict[str, np.ndarray]] = {}
    for spec in specs:
        if isinstance(spec, EmbeddingSpec):
            room = space.buffers.get(spec.name, {}) if space is not None else {}
            tables[spec.name] = _unordered_copy(store.embedding(spec.name), room)
        else:
            tables[spec.name] = store.dense(spec.name).export()
    return {"specs": [s.to_wire() for s in specs], "tables": tables}


def _unordered_copy(table: EmbeddingTable, room: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``ids``, ``rows`` and each state array in storage order: one copy each."""
    n = len(table)
    sources = {"ids": table._index._ids, "rows": table._rows, **table._state}
    out: dict[str, np.ndarray] = {}
    for key, src in sources.items():
        buf = room.get(key)
        if buf is None or buf.shape[0] < n or buf.shape[1:] != src.shape[1:]:
            out[key] = src[:n].copy()
        else:
            np.copyto(buf[:n], src[:n])
            out[key] = buf[:n]
    return out


def ordered(export: dict[str, Any]) -> dict[str, Any]:
    """:func:`cut_export`'s result in :meth:`PartitionStore.export`'s order (ids ascending).

    Sorts one array at a time, releasing each unsorted copy as it goes.
    """
    for arrays in export["tables"].values():
        if "ids" not in arrays:
            continue
        order = np.argsort(arrays["ids"], kind="stable")
        for key in list(arrays):
            arrays[key] = arrays.pop(key)[order]
    return export


# -- a consistent cut with no copy: frozen versions -------------------------------
#
# :func:`freeze_export` takes the cut without copying the rows: each large array of an
# embedding table is frozen (:func:`zps.store.mapped.freeze`: only pages written from
# then on are copied, by the kernel, as they are written) and the export holds a
# :class:`FrozenArray` for it, which the stream reads in slices (:func:`slices`) into a
# buffer of its own.  The ids (8 bytes a row) and small arrays are copied.


@dataclass(frozen=True)
class FrozenArray:
    """An array of a frozen cut: its shape and dtype, its bytes in ``version``."""

    version: mapped.Frozen
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def numpy(self) -> np.ndarray:
        """A copy of it (for tests and small readers: a stream reads it in slices)."""
        out = np.empty(self.shape, self.dtype)
        if out.nbytes:
            self.version.read_into(0, out.reshape(-1).view(np.uint8).data)
        return out


@dataclass(frozen=True)
class FrozenPart:
    """Bytes ``[start, stop)`` of a frozen version: a part of a stream, read as it goes."""

    version: mapped.Frozen
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


Part = bytes | memoryview | FrozenPart


def read_part(part: Part, a: int, b: int, out: memoryview) -> None:
    """Bytes ``[a, b)`` of ``part`` into ``out`` (``b - a`` bytes)."""
    if isinstance(part, FrozenPart):
        part.version.read_into(part.start + a, out[: b - a])
    else:
        out[: b - a] = memoryview(part).cast("B")[a:b]


def slices(
    parts: Sequence[Part], size: int, buf: memoryview, *, mapped_frozen: bool = False
) -> Iterator[memoryview]:
    """The stream ``parts`` make, in slices of at most ``size`` bytes: views of parts in
    memory, frozen parts read into ``buf``, or with ``mapped_frozen`` viewed in a mapping
    of their file made for the slice (:meth:`mapped.Frozen.window`: no copy; ``buf`` is
    then unused).  A slice is valid until the next one is asked for."""
    for part in parts:
        n = len(part)
        for a in range(0, n, size):
            b = min(n, a + size)
            if isinstance(part, FrozenPart) and mapped_frozen:
                with part.version.window(part.start + a, b - a) as view:
                    yield view
            elif isinstance(part, FrozenPart):
                read_part(part, a, b, buf)
                yield buf[: b - a]
            else:
                yield memoryview(part).cast("B")[a:b]


def _freezable(table: EmbeddingTable) -> bool:
    return len(table) > 0 and all(
        mapped.freezable(a) for a in (table._rows, *table._state.values())
    )


def drop_pages(store: PartitionStore) -> None:
    """:func:`mapped.drop_pages` of every array :func:`freeze_export` would freeze now:
    from a thread other than the tables' writer, just before a frozen cut, so that the
    cut's remap drops only the page-table entries of the pages touched since."""
    for spec in store.specs():
        if isinstance(spec, EmbeddingSpec):
            table = store.embedding(spec.name)
            arrays = [table._rows, *list(table._state.values())]
            if len(table) > 0:
                for arr in arrays:
                    mapped.drop_pages(arr)


def freeze_export(
    store: PartitionStore, space: CutSpace | None = None
) -> tuple[dict[str, Any], tuple[mapped.Frozen, ...]]:
    """:func:`cut_export`, with the large arrays of embedding tables frozen instead of
    copied (see above); and the versions frozen, which the caller releases (from this
    thread: the tables' writer) once the stream has read them."""
    specs = store.specs()
    tables: dict[str, dict[str, Any]] = {}
    versions: list[mapped.Frozen] = []
    try:
        for spec in specs:
            if isinstance(spec, EmbeddingSpec):
                table = store.embedding(spec.name)
                room = space.buffers.get(spec.name, {}) if space is not None else {}
                if _freezable(table):
                    tables[spec.name] = _frozen_copy(table, versions, room)
                else:
                    tables[spec.name] = _unordered_copy(table, room)
            else:
                tables[spec.name] = store.dense(spec.name).export()
    except BaseException:
        for version in versions:
            version.release()
        raise
    return {"specs": [s.to_wire() for s in specs], "tables": tables}, tuple(versions)


def _frozen_copy(
    table: EmbeddingTable, versions: list[mapped.Frozen], room: dict[str, np.ndarray]
) -> dict[str, Any]:
    n = len(table)
    ids, buf = table._index._ids, room.get("ids")
    out: dict[str, Any] = {}
    if buf is None or buf.shape[0] < n:
        out["ids"] = ids[:n].copy()
    else:  # touched off the loop: the copy costs no page faults
        np.copyto(buf[:n], ids[:n])
        out["ids"] = buf[:n]
    for key, src in {"rows": table._rows, **table._state}.items():
        version = mapped.freeze(src)
        if version is None:
            out[key] = src[:n].copy()
        else:
            versions.append(version)
            out[key] = FrozenArray(version, src.dtype, (n, *src.shape[1:]))
    return out


# -- a snapshot in bounded chunks --------------------------------------------------
#
# A snapshot travels to a replica as one byte stream (the checkpoint file format:
# header, arrays, SHA-256; see :mod:`zps.shard.checkpoint`) cut into chunks of at
# most ``chunk_bytes``.  Chunk ``seq`` of ``count`` carries the stream's bytes
# ``[seq * chunk_bytes, min(total, (seq + 1) * chunk_bytes))``, as pieces of the
# stream's parts (no copy on the sending side).

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


def build_store(snap: Snapshot, memory: DenseMemory | None = None) -> PartitionStore:
    """The tables of ``snap``, validated, their embedding tables owning the snapshot's
    arrays where they can (a :class:`StreamBuilder`'s: no copy of the rows), copies
    otherwise; dense tensors loaded as :meth:`PartitionStore.load` does."""
    export = snap.export
    specs, tables = export.get("specs"), export.get("tables")
    if not isinstance(specs, list) or not isinstance(tables, dict):
        raise BadRequestError("partition export: 'specs' must be a list, 'tables' a map")
    parsed = [spec_from_wire(w) for w in specs]
    emb = {s.name: s for s in parsed if isinstance(s, EmbeddingSpec)}
    if len({s.name for s in parsed}) != len(parsed):
        raise BadRequestError("partition export: a table appears twice")
    if set(tables) != {s.name for s in parsed}:
        raise BadRequestError("partition export: 'tables' and 'specs' name different tables")
    store = PartitionStore(memory)
    store.load(
        {
            "specs": [w for w, s in zip(specs, parsed, strict=True) if s.name not in emb],
            "tables": {n: t for n, t in tables.items() if n not in emb},
        }
    )
    for name, spec in emb.items():
        data = tables[name]
        if not isinstance(data, dict):
            raise BadRequestError(f"partition export: no data for table {name!r}")
        store.create(spec)
        store.embedding(name).adopt(data, snap.indexes.get(name))
    return store
