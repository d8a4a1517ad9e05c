"""A partition's rows by slot: copy, load and drop the data of a set of slots.

Live resharding moves slots between partitions (:mod:`zps.core.reshard`); what
moves with a slot is every embedding row whose id hashes to it, with its
optimizer state (and admission/eviction bookkeeping), and every dense chunk
that sits on it, with its optimizer state.

- :func:`slot_mask` / :func:`slots_of_ids`: which slot an id or a chunk is on
  (the same hash as :mod:`zps.core.routing`).
- :func:`cut_slots`: copies of the rows and chunks on a set of slots (the
  source's side of a move; cheap memory copies).
- :func:`load_slots`: write rows and chunks with their state into a partition
  (the destination's side; absent tables are created from their specs).
- :func:`drop_slots`: forget every row and chunk on a set of slots (the
  source after the cut-over, or a destination whose import was cancelled), at once.
- :class:`Compaction`: the same, a bounded number of rows per step, for the end of a
  resharding (a shard serves between the steps).

Pure functions over :class:`~zps.store.partition.PartitionStore`; no I/O.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.core.hashing import mix64, name_hash
from zps.core.memo import IdsMemo
from zps.errors import BadRequestError
from zps.protocol.specs import DenseSpec, spec_from_wire
from zps.store import mapped
from zps.store.index import EMPTY, IdIndex
from zps.store.partition import PartitionStore
from zps.store.tables import TOUCHED, Array, DenseTensor, EmbeddingTable, WriteLog


def slots_of_ids(ids: npt.NDArray[np.int64], n_slots: int) -> npt.NDArray[np.int64]:
    """The slot of each id (``mix64(id) % n_slots``, as routing computes it)."""
    h = mix64(ids)
    h = h & np.uint64(n_slots - 1) if n_slots & (n_slots - 1) == 0 else h % np.uint64(n_slots)
    return h.view(np.int64)


class _IndexSlots:
    """The slots of an index's first ``n`` ids (position order), for ``n_slots``."""

    def __init__(self, n_slots: int, cap: int) -> None:
        self.n_slots = n_slots
        self.n = 0
        dtype = np.uint16 if n_slots <= 1 << 16 else np.int32
        self.slots: npt.NDArray[Any] = np.empty(cap, dtype=dtype)


#: The slots of each id index's ids, kept while the index lives (an index never loses
#: an id, nor changes one: a table that drops rows gets a new index, so only ids
#: inserted since are hashed again).  :func:`forget_index_slots` lets them go.
_INDEX_SLOTS: weakref.WeakKeyDictionary[IdIndex, _IndexSlots] = weakref.WeakKeyDictionary()


def index_slots(index: IdIndex, n_slots: int) -> npt.NDArray[Any]:
    """The slot of each id of ``index``, in position order (``slots_of_ids(index.ids(),
    n_slots)``): hashed once per id, not at every move's cut."""
    n = len(index)
    kept = _INDEX_SLOTS.get(index)
    if kept is None or kept.n_slots != n_slots or kept.n > n:
        kept = _INDEX_SLOTS[index] = _IndexSlots(n_slots, n)
    if kept.n < n:
        if kept.slots.shape[0] < n:
            grown = np.empty(max(n, kept.slots.shape[0] * 3 // 2), dtype=kept.slots.dtype)
            grown[: kept.n] = kept.slots[: kept.n]
            kept.slots = grown
        kept.slots[kept.n : n] = slots_of_ids(index._ids[kept.n : n], n_slots)
        kept.n = n
    return kept.slots[:n]


def forget_index_slots(store: PartitionStore) -> None:
    """Let go of the slots kept for the tables of ``store`` (no move under way)."""
    for spec in store.specs():
        table = store.table(spec.name)
        if isinstance(table, EmbeddingTable):
            _INDEX_SLOTS.pop(table._index, None)


def holds_rows_on(store: PartitionStore, mask: npt.NDArray[np.bool_]) -> bool:
    """Whether an embedding table of ``store`` holds a row on a slot of ``mask``."""
    for spec in store.specs():
        table = store.table(spec.name)
        if (
            isinstance(table, EmbeddingTable)
            and len(table._index)
            and mask[index_slots(table._index, mask.shape[0])].any()
        ):
            return True
    return False


def chunk_slot(name: str, chunk: int, n_slots: int) -> int:
    return (name_hash(name) + chunk) % n_slots


def slot_mask(slots: list[int] | npt.NDArray[Any], n_slots: int) -> npt.NDArray[np.bool_]:
    mask = np.zeros(n_slots, dtype=np.bool_)
    arr = np.asarray(slots, dtype=np.int64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= n_slots):
        raise BadRequestError(f"slots must be in [0, {n_slots})")
    mask[arr] = True
    return mask


def _state_keys(table: EmbeddingTable) -> tuple[str, ...]:
    return tuple(table._widths)


def cut_slots(
    store: PartitionStore,
    mask: npt.NDArray[np.bool_],
    changed: dict[str, npt.NDArray[np.int64]] | None = None,
) -> dict[str, Any]:
    """Copies of everything on the slots of ``mask``: ``{"specs": [...], "tables":
    {name: arrays}}``; an embedding table's arrays are ``ids``, ``rows`` and one per
    state column, a dense tensor's ``chunks``, ``values`` and its state (as
    :meth:`DenseTensor.export`, for the chunks on the slots only).  ``changed``: of the
    embedding tables it names, only the rows of those ids (that are on the slots)."""
    n_slots = mask.shape[0]
    specs: list[Any] = []
    tables: dict[str, Any] = {}
    for spec in store.specs():
        table = store.table(spec.name)
        specs.append(spec.to_wire())
        if isinstance(table, EmbeddingTable):
            only = None if changed is None else changed.get(spec.name)
            if only is not None:
                only = only[mask[slots_of_ids(only, n_slots)]]
                pos = table._index.lookup(only)
                ids = only[pos >= 0]  # every one written is there (rows go only by eviction)
                pos = pos[pos >= 0]
            else:
                n = len(table._index)
                pos = np.flatnonzero(mask[index_slots(table._index, n_slots)])
                ids = table._index._ids[:n][pos]
            # ``take``: a gather of whole rows (half the time of fancy indexing).
            out: dict[str, Any] = {"ids": ids, "rows": table._rows.take(pos, axis=0)}
            for k in _state_keys(table):
                out[k] = table._state[k].take(pos, axis=0)
            tables[spec.name] = out
        else:
            assert isinstance(table, DenseTensor)
            mine = [c for c in table.chunks() if mask[chunk_slot(spec.name, c, n_slots)]]
            tables[spec.name] = {
                "chunks": np.asarray(mine, dtype=np.int64),
                "values": [table._values[c].reshape(-1).copy() for c in mine],
                "state": [{k: a.copy() for k, a in table._state[c].items()} for c in mine],
            }
    return {"specs": specs, "tables": tables}


def load_rows(
    store: PartitionStore, spec_wire: Any, data: dict[str, Array], *, absent: bool = False
) -> int:
    """Write embedding rows with their state (``ids``, ``rows``, state columns) into the
    table of ``spec_wire`` (created if absent); returns the rows written.  ``absent``:
    the ids are known distinct and absent from the table (inserted without a lookup)."""
    spec = spec_from_wire(spec_wire)
    if isinstance(spec, DenseSpec):
        raise BadRequestError(f"table {spec.name!r} is not an embedding table")
    store.create(spec)
    table = store.table(spec.name)
    if not isinstance(table, EmbeddingTable):
        raise BadRequestError(f"table {spec.name!r} is not an embedding table")
    keys = _state_keys(table)
    if set(data) != {"ids", "rows", *keys}:
        raise BadRequestError(f"slot rows of {spec.name!r}: keys {sorted(data)}")
    ids = np.asarray(data["ids"])
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise BadRequestError("slot rows: 'ids' must be 1-D int64")
    n = ids.shape[0]
    if n == 0:
        return 0
    rows = np.asarray(data["rows"])
    if rows.shape != (n, spec.dim):
        raise BadRequestError(f"slot rows of {spec.name!r}: rows of shape {rows.shape}")
    for k in keys:
        if np.asarray(data[k]).shape != (n, table._widths[k]):
            raise BadRequestError(f"slot rows of {spec.name!r}: state {k!r} has a wrong shape")
    # Every row and state column of these ids is written below: new rows are not
    # initialised first (EmbeddingTable._positions would draw their initial values).
    if table._dirty is not None:
        table._note(ids)
    before = len(table._index)
    if absent:
        pos, n_new = table._index.insert(ids), n
    else:
        pos, n_new = table._index.get_or_insert(ids)
    if n_new:
        table._grow(before, before + n_new)
    if n_new == n:
        # Every id new (and each once): their positions follow on, a slice, written
        # through the arrays' memory files where they have them (no page faults).
        _write_slice(table._rows, before, rows)
        for k in keys:
            _write_slice(table._state[k], before, np.asarray(data[k]))
    else:
        table._rows[pos] = rows
        for k in keys:
            table._state[k][pos] = data[k]
    if table._life:
        table._tick = max(table._tick, int(np.asarray(data[TOUCHED]).max(initial=0)))
    return int(n)


def _write_slice(arr: npt.NDArray[Any], start: int, src: npt.NDArray[Any]) -> None:
    """``arr[start : start + len(src)] = src``, in the kernel when ``arr`` is an array of
    a memory file not frozen (:func:`zps.store.mapped.write_at`: one copy, no page
    fault, about twice as fast into pages not yet touched), else by numpy."""
    src = np.ascontiguousarray(src, dtype=arr.dtype)
    if (
        src.ndim != arr.ndim
        or not arr.flags.c_contiguous
        or not mapped.write_at(arr, start * arr.strides[0], src.data.cast("B"))
    ):
        arr[start : start + len(src)] = src


def load_chunks(
    store: PartitionStore, spec_wire: Any, chunks: list[int], values: list[Array], state: list[Any]
) -> int:
    """Write dense chunks with their optimizer state into the tensor of ``spec_wire``."""
    spec = spec_from_wire(spec_wire)
    if not isinstance(spec, DenseSpec):
        raise BadRequestError(f"table {spec.name!r} is not a dense tensor")
    store.create(spec)
    table = store.dense(spec.name)
    for c, v, st in zip(chunks, values, state, strict=True):
        table.load_chunk(c, np.asarray(v), st)
    return len(chunks)


def drop_slots(store: PartitionStore, mask: npt.NDArray[np.bool_]) -> int:
    """Forget every row and chunk on the slots of ``mask``; returns how many went."""
    n_slots = mask.shape[0]
    dropped = 0
    for spec in store.specs():
        table = store.table(spec.name)
        if isinstance(table, EmbeddingTable):
            n = len(table._index)
            if not n:
                continue
            on = mask[index_slots(table._index, n_slots)]
            if on.any():
                dropped += int(on.sum())
                table._compact(np.flatnonzero(~on))
        else:
            assert isinstance(table, DenseTensor)
            for c in table.chunks():
                if mask[chunk_slot(spec.name, c, n_slots)]:
                    del table._values[c]
                    del table._state[c]
                    dropped += 1
    return dropped


# -- a move's catch-up ---------------------------------------------------------------


class Tracker:
    """The ids written to each embedding table of a partition since it was made: a
    move copies the moving slots while the source serves them, then, once they are
    fenced, only the rows written since (``EmbeddingTable._dirty`` lists them)."""

    def __init__(self, store: PartitionStore) -> None:
        self.store = store
        self.tables: dict[str, tuple[EmbeddingTable, IdIndex, WriteLog]] = {}
        for spec in store.specs():
            table = store.table(spec.name)
            if isinstance(table, EmbeddingTable):
                log = WriteLog()
                table._dirty = log
                self.tables[spec.name] = (table, table._index, log)

    def changed(self) -> dict[str, npt.NDArray[np.int64]] | None:
        """The ids written to each table since, or None if a table was rebuilt (rows
        evicted, the table dropped or loaded) or its list was lost: then a copy made
        before is not a base to catch up from.  A table made since is not named (it is
        copied whole)."""
        out: dict[str, npt.NDArray[np.int64]] = {}
        for name, (table, index, log) in self.tables.items():
            current = self.store.table(name) if name in self.store else None
            if current is not table or table._index is not index or table._dirty is not log:
                return None
            out[name] = log.take()
        return out

    def stop(self) -> None:
        for table, _, log in self.tables.values():
            if table._dirty is log:
                table._dirty = None
        self.tables.clear()


# -- dropping in steps -------------------------------------------------------------
#
# Dropping the rows of some slots rewrites an embedding table: new arrays and a new id
# index holding only the rows kept (:meth:`EmbeddingTable._compact`), seconds for
# millions of rows, during which a shard would serve nothing.  :class:`Shrink` builds
# the same new arrays and index a bounded number of rows per step, while the table
# stays in use (its index and arrays answer every request until the last step swaps
# the new ones in):
#
# 1. *scan*: which stored rows are kept (their slot is not dropped);
# 2. *fill*: the new index's slots are cleared;
# 3. *copy*: the kept rows, in storage order, go into the new index (so the i-th kept
#    row gets position i) and the new arrays; rows added meanwhile (at the end of the
#    table) are scanned and copied in turn; the last step swaps the new arrays in.
#
# A row copied and then written (a push, a set, an import) would be stale in the copy:
# the table lists the ids of every write while a shrink is under way
# (``EmbeddingTable._dirty``), and each step copies those rows again.  Everything is
# in the table as it was until the swap, so a snapshot, a checkpoint or an export
# taken between steps sees the table as it is (dropped rows are unreachable by the
# ownership rule, kept rows current); a shrink is undone (started again) if the table
# is rebuilt meanwhile (eviction, a load) or the slots to drop change.

#: Work per unit of the step budget: ids hashed per row copied, index slots cleared.
_SCAN_PER_ROW = 8
_FILL_PER_ROW = 8


class Shrink:
    """Drop the rows on the slots of ``mask`` from ``table``, in steps."""

    def __init__(self, table: EmbeddingTable, mask: npt.NDArray[np.bool_]) -> None:
        self.table = table
        self.mask = mask
        self.index = table._index
        self.n0 = len(self.index)
        self.keep = np.empty(self.n0, dtype=np.bool_)
        self.phase = "scan"
        self.cursor = 0
        self.steps = 0
        self.new: IdIndex | None = None
        self.slots: npt.NDArray[np.int64] | None = None
        self.rows: Array | None = None
        self.state: dict[str, Array] = {}
        self.dirty = WriteLog()
        table._dirty = self.dirty

    @property
    def valid(self) -> bool:
        """The table was not rebuilt, and listed every write, since the shrink began
        (else it starts again)."""
        return self.table._index is self.index and self.table._dirty is self.dirty

    def abandon(self) -> None:
        if self.table._dirty is self.dirty:
            self.table._dirty = None

    def step(self, budget: int) -> tuple[int, bool]:
        """At most ``budget`` rows' worth of work: (rows dropped, whether it is done)."""
        self.steps += 1
        if self.phase != "copy":  # nothing copied yet: no write can make a copy stale
            self.dirty.clear()
            self.dirty.n_ids = 0
        if self.phase == "scan":
            stop = min(self.n0, self.cursor + _SCAN_PER_ROW * budget)
            kept = _INDEX_SLOTS.get(self.index)
            if kept is not None and kept.n_slots == self.mask.shape[0] and kept.n >= stop:
                slots: npt.NDArray[Any] = kept.slots[self.cursor : stop]
            else:
                slots = slots_of_ids(self.index._ids[self.cursor : stop], self.mask.shape[0])
            self.keep[self.cursor : stop] = ~self.mask[slots]
            self.cursor = stop
            if self.cursor < self.n0:
                return 0, False
            if bool(self.keep.all()):  # nothing on the dropped slots
                self.table._dirty = None
                return 0, True
            n_keep = int(self.keep.sum())
            room = n_keep + n_keep // 8 + 1024  # rows added meanwhile fit
            cap = 16  # a load of at most 1/2, as IdIndex keeps (and some rows added)
            while cap < 2 * (n_keep + n_keep // 64 + 1024):
                cap *= 2
            self.slots = np.empty((cap, 2), dtype=np.int64)  # cleared by the fill phase
            self.rows = np.empty((room, self.table.spec.dim), dtype=self.table.dtype)
            self.state = {
                k: np.empty((room, w), dtype=self.table.dtype)
                for k, w in self.table._widths.items()
            }
            self.phase, self.cursor = "fill", 0
            return 0, False
        if self.phase == "fill":
            assert self.slots is not None
            stop = min(self.slots.shape[0], self.cursor + _FILL_PER_ROW * budget)
            self.slots[self.cursor : stop, 0] = EMPTY
            self.slots[self.cursor : stop, 1] = -1
            self.cursor = stop
            if self.cursor < self.slots.shape[0]:
                return 0, False
            self.new = _index_over(self.slots)
            self.phase, self.cursor = "copy", 0
            return 0, False
        return self._copy(budget)

    def _copy(self, budget: int) -> tuple[int, bool]:
        table, new = self.table, self.new
        assert new is not None and self.rows is not None
        n = len(self.index)  # rows added since the scan are copied too
        stop = min(n, self.cursor + budget)
        start = self.cursor
        if stop <= self.n0:
            keep = self.keep[start:stop]
        else:  # rows added meanwhile: their slots now
            added = self.index._ids[max(start, self.n0) : stop]
            tail = ~self.mask[slots_of_ids(added, self.mask.shape[0])]
            keep = np.concatenate([self.keep[start : self.n0], tail]) if start < self.n0 else tail
        pos = np.flatnonzero(keep) + start
        dropped = int(stop - start - pos.shape[0])
        if pos.size:
            w = len(new)
            self._room(w + pos.shape[0])
            new.insert(self.index._ids[pos])
            self.rows[w : w + pos.shape[0]] = table._rows[pos]
            for k, a in self.state.items():
                a[w : w + pos.shape[0]] = table._state[k][pos]
        self.cursor = stop
        self._recopy()
        if self.cursor < len(self.index):
            return dropped, False
        # Done: the new index and arrays take over.
        table._index = new
        table._rows = self.rows
        table._state = self.state
        table._recent = IdsMemo()
        table._stamp = np.zeros(0, dtype=np.int32)
        table._dirty = None
        self.phase = "done"
        return dropped, True

    def _recopy(self) -> None:
        """Copy again the rows written since they were copied."""
        new = self.new
        assert new is not None and self.rows is not None
        if not self.dirty:
            return
        ids = self.dirty.take()
        at = new.lookup(ids)
        copied = at >= 0  # the others are copied later, or dropped
        if not copied.any():
            return
        at = at[copied]
        src = self.index.lookup(ids[copied])
        self.rows[at] = self.table._rows[src]
        for k, a in self.state.items():
            a[at] = self.table._state[k][src]

    def _room(self, need: int) -> None:
        assert self.rows is not None
        cap = self.rows.shape[0]
        if need <= cap:
            return
        cap = max(need, cap + cap // 2)
        n = len(self.new) if self.new is not None else 0
        rows = np.empty((cap, self.rows.shape[1]), dtype=self.rows.dtype)
        rows[:n] = self.rows[:n]
        self.rows = rows
        for k, old in list(self.state.items()):
            grown = np.empty((cap, old.shape[1]), dtype=old.dtype)
            grown[:n] = old[:n]
            self.state[k] = grown


def _index_over(slots: npt.NDArray[np.int64]) -> IdIndex:
    """An empty :class:`IdIndex` over cleared ``slots`` (``(capacity, 2)``, every key
    :data:`EMPTY`, every position -1), as ``IdIndex(capacity // 2)`` would make them."""
    index = IdIndex()
    index._slots = slots
    index._records = slots.view(np.dtype((np.void, 16))).reshape(-1)
    index._keys = slots[:, 0]
    index._vals = slots[:, 1]
    index._ids = np.empty(slots.shape[0] // 2, dtype=np.int64)
    index._n = 0
    return index


class Compaction:
    """Drop every row and chunk on the slots of ``mask`` from a partition, a bounded
    number of rows per :meth:`step` (dense chunks, which are few, at the first)."""

    #: A table rebuilt under a shrink this many times (eviction) is shrunk at once.
    MAX_RESTARTS = 3

    def __init__(self, store: PartitionStore, mask: npt.NDArray[np.bool_]) -> None:
        self.store = store
        self.mask = mask.copy()
        self.started = False
        self.shrinks: dict[str, Shrink] = {}
        self.restarts: dict[str, int] = {}
        self.steps = 0
        self.dropped_at_once = 0

    def abandon(self) -> None:
        for s in self.shrinks.values():
            s.abandon()
        self.shrinks.clear()

    def step(self, budget: int) -> tuple[int, bool]:
        """(rows and chunks dropped, whether every table is done): one step of at most
        ``budget`` rows' worth of work; ``budget`` <= 0: all that is left, at once."""
        self.steps += 1
        dropped = 0
        if not self.started:
            self.started = True
            for spec in self.store.specs():
                table = self.store.table(spec.name)
                if isinstance(table, EmbeddingTable):
                    if len(table):
                        self.shrinks[spec.name] = Shrink(table, self.mask)
                else:
                    dropped += _drop_chunks(table, spec.name, self.mask)
        unlimited = budget <= 0
        for name in list(self.shrinks):
            shrink = self._current(name)
            dropped += self.dropped_at_once
            self.dropped_at_once = 0
            if shrink is None:
                continue
            while True:
                got, done = shrink.step(1 << 62 if unlimited else budget)
                dropped += got
                if done:
                    del self.shrinks[name]
                    break
                if not unlimited:
                    return dropped, False
            if not unlimited:  # one table's step at most
                break
        return dropped, not self.shrinks

    def _current(self, name: str) -> Shrink | None:
        """The shrink of table ``name``, started again if the table was rebuilt
        meanwhile (None: nothing left to do there)."""
        shrink = self.shrinks[name]
        table = self.store.table(name) if name in self.store else None
        if table is shrink.table and shrink.valid:
            return shrink
        shrink.abandon()
        del self.shrinks[name]
        if not isinstance(table, EmbeddingTable) or not len(table):
            return None
        n = self.restarts[name] = self.restarts.get(name, 0) + 1
        if n > self.MAX_RESTARTS:  # rebuilt again and again (eviction): at once
            self.dropped_at_once += _drop_rows(table, self.mask)
            return None
        shrink = self.shrinks[name] = Shrink(table, self.mask)
        return shrink


def _drop_rows(table: EmbeddingTable, mask: npt.NDArray[np.bool_]) -> int:
    n = len(table._index)
    if not n:
        return 0
    on = mask[index_slots(table._index, mask.shape[0])]
    if on.any():
        table._compact(np.flatnonzero(~on))
    return int(on.sum())


def _drop_chunks(table: DenseTensor, name: str, mask: npt.NDArray[np.bool_]) -> int:
    dropped = 0
    for c in table.chunks():
        if mask[chunk_slot(name, c, mask.shape[0])]:
            del table._values[c]
            del table._state[c]
            dropped += 1
    return dropped
