"""A partition's whole state as one message: snapshot encoding, without I/O.

Used to bring a replica up to date (snapshot at LSN L, then the stream from
L+1).  The header carries the table specs, the LSN, the epoch and the dedup
record; every array travels as a payload frame (see :mod:`zps.protocol.codec`).

Rule: :func:`decode_snapshot` returns a complete, validated snapshot or raises
:class:`~zps.errors.ProtocolError`; a half-read snapshot is never loaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zps.errors import BadRequestError, ProtocolError
from zps.protocol.codec import CODEC_RAW, BufferLike, Encoder, array_from
from zps.protocol.specs import EmbeddingSpec, spec_from_wire
from zps.store import mapped
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
