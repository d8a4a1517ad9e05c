"""A partition's whole state as one message: snapshot encoding, without I/O.

Used to bring a replica up to date (snapshot at LSN L, then the stream from
L+1).  The header carries the table specs, the LSN, the epoch and the dedup
record; every array travels as a payload frame (see :mod:`zps.protocol.codec`).

Rule: :func:`decode_snapshot` returns a complete, validated snapshot or raises
:class:`~zps.errors.ProtocolError`; a half-read snapshot is never loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zps.errors import ProtocolError
from zps.protocol.codec import BufferLike, Encoder, array_from
from zps.protocol.specs import EmbeddingSpec
from zps.store.partition import PartitionStore
from zps.store.tables import EmbeddingTable

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


def encode_snapshot(enc: Encoder, snap: Snapshot) -> dict[str, Any]:
    """Add the snapshot's arrays to ``enc``; return the header to send with them."""
    tables = {
        name: {key: enc.array(arr) for key, arr in arrays.items()}
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


#: Room for rows inserted between sizing and copying a cut.
CUT_SLACK = 0.05


def cut_space(store: PartitionStore) -> CutSpace:
    """Buffers (not yet touched) for a cut of ``store``'s embedding tables."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for spec in store.specs():
        if isinstance(spec, EmbeddingSpec):
            table = store.embedding(spec.name)
            rows = int(len(table) * (1 + CUT_SLACK)) + 1024
            arrays = {"ids": np.empty(rows, dtype=np.int64)}
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


@dataclass
class ChunkAssembly:
    """A replica's side: the chunks of one snapshot, accepted strictly in order.

    Every field is validated: ``total`` at most ``max_bytes``, ``count`` consistent
    with ``total`` and ``chunk_bytes``; a chunk out of order, repeated, of the wrong
    size or of another snapshot raises :class:`ProtocolError` and the assembly is
    abandoned by the caller.
    """

    snapshot_id: int
    total: int
    chunk_bytes: int
    count: int
    max_bytes: int
    received: int = 0
    _buf: np.ndarray = field(
        default_factory=lambda: np.empty(0, np.uint8), repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name in ("snapshot_id", "total", "chunk_bytes", "count"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ProtocolError(f"snapshot chunk {name} must be a non-negative integer")
        if self.chunk_bytes == 0:
            raise ProtocolError("snapshot chunk_bytes must be positive")
        if self.total > self.max_bytes:
            raise ProtocolError(
                f"snapshot of {self.total} bytes exceeds the limit of {self.max_bytes}"
            )
        if self.count != chunk_count(self.total, self.chunk_bytes):
            raise ProtocolError(
                f"snapshot of {self.total} bytes in chunks of {self.chunk_bytes} "
                f"cannot be {self.count} chunks"
            )
        # Not zeroed: the pages are touched as the chunks are copied in, a chunk's worth
        # at a time, where zeroing them all at once held the loop (0.2 s for 416 MB).
        self._buf = np.empty(self.total, dtype=np.uint8)

    @classmethod
    def from_header(cls, header: dict[str, Any], *, max_bytes: int) -> ChunkAssembly:
        """An assembly for the snapshot a first chunk's header announces."""
        try:
            sid, total, chunk, count = (header[k] for k in ("id", "total", "chunk", "count"))
        except KeyError as e:
            raise ProtocolError(f"snapshot chunk header lacks {e}") from None
        return cls(sid, total, chunk, count, max_bytes)

    @property
    def done(self) -> bool:
        return self.received == self.count

    def add(self, snapshot_id: object, seq: object, pieces: Sequence[BufferLike]) -> bool:
        """Take chunk ``seq``; True once the whole snapshot is here."""
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
        size = sum(len(memoryview(p).cast("B")) for p in pieces)
        if size != expected:
            raise ProtocolError(f"snapshot chunk {seq} has {size} bytes, expected {expected}")
        pos = start
        for piece in pieces:
            view = memoryview(piece).cast("B")
            self._buf[pos : pos + len(view)] = view
            pos += len(view)
        self.received += 1
        return self.done

    def chunk_view(self, seq: int) -> memoryview:
        """The bytes of chunk ``seq`` (taken already) in the assembled stream."""
        if type(seq) is not int or not 0 <= seq < self.received:
            raise ProtocolError(f"snapshot chunk {seq!r} has not been taken")
        start = seq * self.chunk_bytes
        return self._buf.data[start : min(self.total, start + self.chunk_bytes)]

    def stream(self) -> memoryview:
        """The assembled stream (only once :attr:`done`)."""
        if not self.done:
            raise ProtocolError(f"snapshot incomplete: {self.received} of {self.count} chunks")
        return self._buf.data
