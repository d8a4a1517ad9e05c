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
  source after the cut-over, or a destination whose import was cancelled).

Pure functions over :class:`~zps.store.partition.PartitionStore`; no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from zps.core.hashing import mix64, name_hash
from zps.errors import BadRequestError
from zps.protocol.specs import DenseSpec, spec_from_wire
from zps.store.partition import PartitionStore
from zps.store.tables import TOUCHED, Array, DenseTensor, EmbeddingTable


def slots_of_ids(ids: npt.NDArray[np.int64], n_slots: int) -> npt.NDArray[np.int64]:
    """The slot of each id (``mix64(id) % n_slots``, as routing computes it)."""
    h = mix64(ids)
    h = h & np.uint64(n_slots - 1) if n_slots & (n_slots - 1) == 0 else h % np.uint64(n_slots)
    return h.view(np.int64)


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


def cut_slots(store: PartitionStore, mask: npt.NDArray[np.bool_]) -> dict[str, Any]:
    """Copies of everything on the slots of ``mask``: ``{"specs": [...], "tables":
    {name: arrays}}``; an embedding table's arrays are ``ids``, ``rows`` and one per
    state column, a dense tensor's ``chunks``, ``values`` and its state (as
    :meth:`DenseTensor.export`, for the chunks on the slots only)."""
    n_slots = mask.shape[0]
    specs: list[Any] = []
    tables: dict[str, Any] = {}
    for spec in store.specs():
        table = store.table(spec.name)
        specs.append(spec.to_wire())
        if isinstance(table, EmbeddingTable):
            n = len(table._index)
            ids = table._index.ids()
            pos = np.flatnonzero(mask[slots_of_ids(ids, n_slots)]) if n else np.zeros(0, np.intp)
            out: dict[str, Any] = {"ids": ids[pos], "rows": table._rows[:n][pos]}
            for k in _state_keys(table):
                out[k] = table._state[k][:n][pos]
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


def load_rows(store: PartitionStore, spec_wire: Any, data: dict[str, Array]) -> int:
    """Write embedding rows with their state (``ids``, ``rows``, state columns) into the
    table of ``spec_wire`` (created if absent); returns the rows written."""
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
    before = len(table._index)
    pos, n_new = table._index.get_or_insert(ids)
    if n_new:
        table._grow(before, before + n_new)
    table._rows[pos] = rows
    for k in keys:
        table._state[k][pos] = data[k]
    if table._life:
        table._tick = max(table._tick, int(np.asarray(data[TOUCHED]).max(initial=0)))
    return int(n)


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
        start, stop = spec.chunk_range(c)
        arr = np.array(v, dtype=table.dtype).reshape(1, -1)
        if arr.shape[1] != stop - start:
            raise BadRequestError(f"dense chunk {c} of {spec.name!r}: {arr.shape[1]} values")
        table._values[c] = arr
        table._state[c] = {k: np.array(a, dtype=table.dtype) for k, a in st.items()}
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
            on = mask[slots_of_ids(table._index.ids(), n_slots)]
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
