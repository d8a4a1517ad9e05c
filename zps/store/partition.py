"""All tables of one partition, by name: the state a shard serves and replicates.

Invariants: a name maps to exactly one table, of exactly one spec, for the
partition's lifetime; ``create`` is idempotent for an identical spec and a
:class:`~zps.errors.TableConflictError` for a different one.  ``checksum`` and
``export`` visit tables in name order, so two partitions with equal contents
agree whatever order their tables were created in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any, TypeAlias

from zps.errors import BadRequestError, TableConflictError, UnknownTableError
from zps.optim import Optimizer
from zps.protocol.specs import MAX_STEP, DenseSpec, TableSpec, spec_from_wire
from zps.store.tables import Array, DenseMemory, DenseTensor, EmbeddingTable, checksum_arrays

__all__ = ["PartitionStore"]

Table: TypeAlias = DenseTensor | EmbeddingTable


def _make(spec: TableSpec, memory: DenseMemory | None) -> Table:
    if isinstance(spec, DenseSpec):
        return DenseTensor(spec, memory)
    return EmbeddingTable(spec)


def _differences(old: TableSpec, new: TableSpec) -> list[str]:
    if type(old) is not type(new):
        return ["kind"]
    # The step count is progress, not identity (see zps/protocol/specs.py).
    return [
        f.name for f in fields(old) if f.compare and getattr(old, f.name) != getattr(new, f.name)
    ]


class PartitionStore:
    """The tables of one partition; ``memory``: where dense values may live (see
    :class:`~zps.store.tables.DenseTensor`)."""

    def __init__(self, memory: DenseMemory | None = None) -> None:
        self._tables: dict[str, Table] = {}
        self._memory = memory

    def use_memory(self, memory: DenseMemory | None) -> None:
        """Dense values written from now on go to ``memory`` (those held stay where
        they are until their next write)."""
        self._memory = memory
        for table in self._tables.values():
            if isinstance(table, DenseTensor):
                table.use_memory(memory)

    def __len__(self) -> int:
        return len(self._tables)

    def __contains__(self, name: object) -> bool:
        return name in self._tables

    def create(self, spec: TableSpec) -> bool:
        """True if created, False if an identical table exists; a different one conflicts."""
        existing = self._tables.get(spec.name)
        if existing is None:
            self._tables[spec.name] = _make(spec, self._memory)
            return True
        if existing.spec == spec:
            return False
        diff = ", ".join(_differences(existing.spec, spec))
        raise TableConflictError(
            f"table {spec.name!r} already exists with a different spec (differs in: {diff})"
        )

    def set_optimizer(self, name: str, optimizer: Optimizer, *, reset: bool = False) -> bool:
        """Give table ``name`` another optimizer (see ``retune`` of its table: without
        ``reset`` the same kind keeps the state and another kind is refused; ``reset``
        starts the state afresh); False if that changed nothing (the same optimizer,
        without ``reset``)."""
        table = self._get(name)
        if table.spec.optimizer == optimizer and not reset:
            return False
        table.retune(replace(table.spec, optimizer=optimizer), reset=reset)  # type: ignore[arg-type]
        return True

    def advance_step(self, name: str | None, steps: int) -> bool:
        """Add ``steps`` to the step count of table ``name`` (None: of every table);
        False if that changed nothing (no table, or 0 steps)."""
        tables = list(self._tables.values()) if name is None else [self._get(name)]
        if not steps or not tables:
            return False
        for table in tables:
            if table.spec.step + steps > MAX_STEP:
                raise BadRequestError(
                    f"table {table.spec.name!r}: step {table.spec.step} + {steps} exceeds 2**53"
                )
        for table in tables:
            table.retune(replace(table.spec, step=table.spec.step + steps))  # type: ignore[arg-type]
        return True

    def set_step(self, name: str, step: int) -> bool:
        """Set the step count of table ``name`` (an import restores an export's);
        False if it was that already."""
        table = self._get(name)
        if table.spec.step == step:
            return False
        table.retune(replace(table.spec, step=step))  # type: ignore[arg-type]
        return True

    def drop(self, name: str) -> bool:
        """Remove table ``name``; False if there is none."""
        return self._tables.pop(name, None) is not None

    def table(self, name: str) -> Table:
        """Table ``name`` of either kind (UnknownTableError naming it if absent)."""
        return self._get(name)

    def _get(self, name: str) -> Table:
        table = self._tables.get(name)
        if table is None:
            raise UnknownTableError(f"unknown table {name!r}")
        return table

    def dense(self, name: str) -> DenseTensor:
        table = self._get(name)
        if not isinstance(table, DenseTensor):
            raise BadRequestError(f"table {name!r} is an embedding table, not a dense tensor")
        return table

    def embedding(self, name: str) -> EmbeddingTable:
        table = self._get(name)
        if not isinstance(table, EmbeddingTable):
            raise BadRequestError(f"table {name!r} is a dense tensor, not an embedding table")
        return table

    def specs(self) -> list[TableSpec]:
        """Specs of all tables, in name order."""
        return [self._tables[n].spec for n in sorted(self._tables)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tables.values())

    def checksum(self) -> str:
        """sha256 over every table's spec and contents, in name order."""
        h = hashlib.sha256()
        for name in sorted(self._tables):
            table = self._tables[name]
            h.update(json.dumps(table.spec.to_wire(), sort_keys=True).encode())
            checksum_arrays(table.export(), h)
        return h.hexdigest()

    def export(self) -> dict[str, Any]:
        """``{"specs": [wire spec, ...], "tables": {name: table export}}``, in name order."""
        names = sorted(self._tables)
        return {
            "specs": [self._tables[n].spec.to_wire() for n in names],
            "tables": {n: self._tables[n].export() for n in names},
        }

    def load(self, data: object) -> None:
        """Replace every table with those of an :meth:`export` (validated; all or nothing)."""
        if not isinstance(data, Mapping) or set(data) != {"specs", "tables"}:
            raise BadRequestError("partition export must be a map with 'specs' and 'tables'")
        specs, exports = data["specs"], data["tables"]
        if not isinstance(specs, list) or not isinstance(exports, Mapping):
            raise BadRequestError("partition export: 'specs' must be a list, 'tables' a map")
        tables: dict[str, Table] = {}
        for wire in specs:  # one iteration per table
            spec = spec_from_wire(wire)
            if spec.name in tables:
                raise BadRequestError(f"partition export: table {spec.name!r} appears twice")
            table_data = exports.get(spec.name)
            if not isinstance(table_data, Mapping):
                raise BadRequestError(f"partition export: no data for table {spec.name!r}")
            table = _make(spec, self._memory)
            arrays: dict[str, Array] = dict(table_data)
            table.load(arrays)
            tables[spec.name] = table
        if set(exports) != set(tables):
            raise BadRequestError("partition export: 'tables' and 'specs' name different tables")
        self._tables = tables
