"""Export cuts: a partition's values (and optimizer state) at one LSN, read in pieces
while writes go on (operations ``cut``, ``cut_read``, ``cut_drop`` of the core).

A shard holds at most :data:`MAX_CUTS`; a new one drops the oldest.  Cuts are not
replicated: a new primary knows none.  No I/O.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np

from zps.errors import BadRequestError, UnknownTableError
from zps.init import generate
from zps.protocol.codec import Encoder
from zps.protocol.specs import DenseSpec, TableSpec
from zps.shard.slotops import SlotState, owned_only
from zps.store import PartitionStore
from zps.store.tables import EmbeddingTable

#: Cuts of the partition (for an export) a shard holds at once; a new one drops the oldest.
MAX_CUTS = 2


@dataclass
class Cut:
    """A partition's values (and optimizer state) at one LSN, for an export: embedding
    tables as ``(ids, rows)`` in storage order, dense tensors as ``{chunk: values}``."""

    lsn: int
    specs: dict[str, TableSpec]
    tables: dict[str, Any]
    #: Whether the optimizer state was copied too: embedding tables as ``(ids, rows,
    #: {column: state})``, dense tensors as ``{chunk: (values, {column: state})}``.
    state: bool = False


class Cuts:
    """The cuts a shard holds, by ``(epoch, n)``."""

    def __init__(self) -> None:
        self._cuts: collections.OrderedDict[tuple[int, int], Cut] = collections.OrderedDict()
        self._counter = 0

    def __len__(self) -> int:
        return len(self._cuts)

    def clear(self) -> None:
        self._cuts.clear()

    def take(
        self,
        store: PartitionStore,
        *,
        epoch: int,
        lsn: int,
        slots: SlotState | None,
        with_state: bool,
    ) -> dict[str, Any]:
        """Copy every table of ``store`` (with ``with_state``, their optimizer state too)
        at ``lsn``; the answer to ``cut``."""
        tables: dict[str, Any] = {}
        for spec in store.specs():
            table = store.table(spec.name)
            if not with_state:
                tables[spec.name] = table.copy_values()
            elif isinstance(table, EmbeddingTable):
                tables[spec.name] = (*table.copy_values(), table.copy_state())
            else:
                states = table.copy_state()
                tables[spec.name] = {c: (v, states[c]) for c, v in table.copy_values().items()}
        owned: dict[str, bytes] = {}
        if slots is not None and slots.active:
            # Live resharding: only the slots this partition owns (not rows it released
            # and still holds, nor an import not yet served), so no id is cut twice; the
            # answer names them, so the reader sees a cut taken in the middle of a move.
            owned_only(slots, tables)
            owned["owned"] = np.packbits(slots.owned).tobytes()
        self._counter += 1
        key = (epoch, self._counter)
        specs = {s.name: s for s in store.specs()}
        self._cuts[key] = Cut(lsn, specs, tables, with_state)
        while len(self._cuts) > MAX_CUTS:
            self._cuts.popitem(last=False)
        return {
            "st": "OK",
            "cut": list(key),
            "lsn": lsn,
            "epoch": epoch,
            "state": with_state,
            **owned,
            "tables": [
                {
                    "spec": spec.to_wire(),
                    "n": len(tables[name][0]) if isinstance(tables[name], tuple) else 0,
                    "chunks": sorted(tables[name]) if isinstance(tables[name], dict) else [],
                }
                for name, spec in self._cuts[key].specs.items()
            ],
        }

    def _get(self, op: dict[str, Any], partition: int | None) -> Cut:
        key = op.get("cut")
        if not isinstance(key, list) or len(key) != 2 or not all(type(k) is int for k in key):
            raise BadRequestError("'cut' must be the [epoch, number] a cut answered")
        cut = self._cuts.get((key[0], key[1]))
        if cut is None:
            raise BadRequestError(
                f"cut {key} is unknown on partition {partition}: it was dropped, a "
                "newer cut replaced it, or another shard became primary; take a new cut"
            )
        return cut

    def read(
        self, op: dict[str, Any], enc: Encoder, *, partition: int | None, max_array_bytes: int
    ) -> dict[str, Any]:
        """Embedding rows ``[start, start+count)`` of a cut (``a``: ids, rows, then each
        optimizer state column of a cut with state, in the order of ``keys``; in storage
        order), or a dense tensor's ``chunks`` (``a``: one array each, each followed by
        its state columns in a cut with state; a chunk this partition never stored has
        its initial values and state)."""
        cut, name = self._get(op, partition), op.get("t")
        if not isinstance(name, str):
            raise BadRequestError(f"operation {op.get('op')!r} needs a table name 't'")
        spec = cut.specs.get(name)
        if spec is None:
            raise UnknownTableError(f"table {name!r} is not in cut {op.get('cut')}")
        data = cut.tables[name]
        itemsize = np.dtype(spec.dtype).itemsize
        if isinstance(data, tuple):
            start, count = op.get("start"), op.get("count")
            if type(start) is not int or type(count) is not int or start < 0 or count < 0:
                raise BadRequestError("cut_read of rows needs integers 'start' and 'count' >= 0")
            ids, rows = data[0], data[1]
            state: dict[str, np.ndarray] = data[2] if cut.state else {}
            width = rows.shape[1] + sum(a.shape[1] for a in state.values())
            if count * (8 + width * itemsize) > max_array_bytes:
                raise BadRequestError(
                    f"cut_read of {count} rows exceeds the per-request limit "
                    f"{max_array_bytes} bytes"
                )
            window = slice(start, start + count)
            arrays = [ids[window], rows[window], *(a[window] for a in state.values())]
            return {"st": "OK", "a": [enc.array(a) for a in arrays], "keys": list(state)}
        assert isinstance(spec, DenseSpec)
        chunks = op.get("chunks")
        if not isinstance(chunks, list) or not all(type(c) is int for c in chunks):
            raise BadRequestError("cut_read of a dense tensor needs 'chunks', a list of integers")
        out = []
        total = 0
        opt = spec.optimizer
        keys = list(opt.state_widths(1)) if cut.state else []
        for c in chunks:
            start_e, stop_e = spec.chunk_range(c)
            widths = opt.state_widths(stop_e - start_e)
            total += (stop_e - start_e + sum(widths[k] for k in keys)) * itemsize
            if total > max_array_bytes:
                raise BadRequestError(
                    f"cut_read of dense chunks exceeds the per-request limit "
                    f"{max_array_bytes} bytes"
                )
            stored = data.get(c)
            if stored is None:
                values = generate(
                    spec.init, spec.seed, np.arange(start_e, stop_e), 1, np.dtype(spec.dtype)
                ).ravel()
                init = opt.init_state(1, stop_e - start_e, np.dtype(spec.dtype))
                chunk_state = {k: a.reshape(-1) for k, a in init.items()}
            elif cut.state:
                values, chunk_state = stored
            else:
                values, chunk_state = stored, {}
            out.append(enc.array(values))
            out.extend(enc.array(chunk_state[k]) for k in keys)
        return {"st": "OK", "a": out, "keys": keys}

    def drop(self, key: object) -> None:
        """Forget cut ``key`` (``[epoch, n]``; anything else: nothing)."""
        if isinstance(key, list) and len(key) == 2 and all(type(k) is int for k in key):
            self._cuts.pop((key[0], key[1]), None)
