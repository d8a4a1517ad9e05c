"""Export a running cluster's model and import one (warm start), through a client's
key-value API (:class:`Tables`).

Export (:func:`export_model`): every partition's primary copies the values of its tables
and their optimizer state (``values_only``: the values alone) at one point of its log
(the ``cut`` operation: memory copies, between two requests), and
the client reads the copies in pieces within the message budget while training goes on,
writing them into the open format of :mod:`zps.model.format`.  Each partition is cut at one
LSN (reported in the manifest); training may continue during and after the cut.  If a
primary changes while its cut is read (a failover), the copy is gone with it and the
export starts again (at most ``attempts`` times); so it does when live resharding moved
slots while the partitions were cut (a partition added or removed, or the slot map
changed between the first cut and the last): each row is then in exactly one cut.

Import (:func:`import_model`): creates each table with the exported spec (idempotent for
an identical one; ``TableConflictError`` naming the fields if a table of that name differs),
sets its step count to the exported one (``advance_step`` with ``to``: a learning-rate
schedule continues where it was), and sets its values and optimizer state with
``set_dense`` / ``set_rows`` carrying the state columns, which are replicated, logged and
applied once like pushes: what was exported continues exactly where it stopped.  A table
exported without state (values only, or by a zps that exported none) gets the optimizer's
initial state, said in a log line.  A delta (``since``) carries values only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from zps.client.futures import gather
from zps.client.session import NO_SUCH_PARTITION
from zps.client.values import runs
from zps.core.batching import groups_by_bytes
from zps.core.routing import ClusterMap, chunk_partition
from zps.core.rows import Split, take_rows
from zps.errors import BadRequestError, ShardUnavailableError, UnknownTableError
from zps.model.format import Export, ExportWriter, state_offsets
from zps.ops.config import ClientConfig
from zps.protocol.specs import DenseSpec, EmbeddingSpec, TableSpec, spec_from_wire


class Tables(Protocol):
    """What an export or import needs of the client (its key-value API,
    :class:`~zps.client.keyvalue.KeyValue`)."""

    @property
    def config(self) -> ClientConfig: ...
    @property
    def cluster_map(self) -> ClusterMap: ...
    def submit(
        self,
        partition: int,
        body: dict[str, Any],
        arrays: dict[str, np.ndarray],
        *,
        reply_bytes: int = 0,
    ) -> asyncio.Future[dict[str, Any]]: ...
    async def create_spec(self, spec: DenseSpec | EmbeddingSpec) -> None: ...
    def check_row(self, spec: EmbeddingSpec) -> int: ...
    def check_chunks(self, spec: DenseSpec) -> None: ...
    def split(self, ids: npt.NDArray[np.int64]) -> Split: ...
    async def set_dense(self, name: str, values: npt.ArrayLike) -> None: ...
    async def set_rows(self, name: str, ids: npt.ArrayLike, rows: npt.ArrayLike) -> None: ...


log = logging.getLogger("zps.export")

#: Rows set per ``set_rows`` call of an import (the client cuts each into messages).
IMPORT_ROWS = 1 << 20


async def export_model(
    client: Tables,
    out: str | os.PathLike[str],
    *,
    tables: Sequence[str] | None = None,
    source: dict[str, Any] | None = None,
    since: str | os.PathLike[str] | None = None,
    attempts: int = 3,
    values_only: bool = False,
) -> dict[str, Any]:
    """Write the values of ``tables`` (default: all) and their optimizer state (unless
    ``values_only``) to the directory ``out``; returns the manifest.  With ``since`` (an
    earlier export, full or delta-applied), write a delta of values: only rows and
    tensors that differ from it, the ids it had that are gone, and the tables it had
    that are gone (see :func:`zps.model.format.apply_delta`)."""
    base = Export(since) if since is not None else None
    state = not values_only and base is None
    for attempt in range(1, attempts + 1):
        try:
            return await _export_once(client, Path(out), tables, source, base, state)
        except (BadRequestError, ShardUnavailableError) as e:
            again = (
                e.missing == NO_SUCH_PARTITION
                if isinstance(e, ShardUnavailableError)
                else "take a new cut" in str(e)
            )
            if not again or attempt == attempts:
                raise
            log.warning("export: %s; starting again (attempt %d)", e, attempt + 1)
            shutil.rmtree(Path(out) / "tables", ignore_errors=True)
    raise AssertionError("unreachable")


async def _export_once(
    client: Tables,
    out: Path,
    names: Sequence[str] | None,
    source: dict[str, Any] | None,
    base: Export | None,
    state: bool,
) -> dict[str, Any]:
    cmap = client.cluster_map
    n = cmap.n_partitions
    cut_op: dict[str, Any] = {"op": "cut", "state": True} if state else {"op": "cut"}
    cuts = await gather(client.submit(p, dict(cut_op), {}) for p in range(n))
    try:
        now = client.cluster_map
        if now.n_partitions != n or not np.array_equal(now.slot_map, cmap.slot_map):
            raise BadRequestError(
                "live resharding moved slots while the partitions were cut: take a new cut"
            )
        per_table: dict[str, list[dict[str, Any]]] = {}
        for cut in cuts:
            for t in cut["tables"]:
                per_table.setdefault(t["spec"]["name"], []).append(t)
        wanted = sorted(per_table) if names is None else list(names)
        for name in wanted:
            if name not in per_table:
                raise UnknownTableError(f"unknown table {name!r}: nothing to export")
            if len(per_table[name]) != n:
                raise BadRequestError(
                    f"table {name!r} is on {len(per_table[name])} of {n} partitions "
                    "(created or dropped during the export); export again"
                )
        writer = ExportWriter(out, source or {"kind": "cluster"}, base=base)
        for name in wanted:
            spec = spec_from_wire(per_table[name][0]["spec"])
            old = base.tables.get(name) if base is not None else None
            if old is not None and old.spec != spec:
                old = None  # dropped and created again: all of it is new
            if isinstance(spec, EmbeddingSpec):
                if base is None:
                    await _export_rows(client, writer, spec, cuts, state)
                else:
                    await _delta_rows(client, writer, spec, cuts, base if old else None)
            elif base is None:
                values = writer.dense(spec)
                columns = writer.dense_state(spec) if state else {}
                await _export_dense(client, values.reshape(-1), spec, cuts, columns)
                values.flush()
                for a in columns.values():
                    a.flush()
            else:
                flat = np.empty(spec.size, dtype=spec.dtype)
                await _export_dense(client, flat, spec, cuts, {})
                if old is None or not np.array_equal(base.values(name).reshape(-1), flat):
                    values = writer.dense(spec)
                    values.reshape(-1)[:] = flat
                    values.flush()
        dropped = sorted(set(base.tables) - set(per_table)) if base is not None else []
        partitions = {p: {"lsn": c["lsn"], "epoch": c["epoch"]} for p, c in enumerate(cuts)}
        writer.finish(partitions, dropped=dropped)
        return Export(out).manifest
    finally:
        drops = [
            client.submit(p, {"op": "cut_drop", "cut": c["cut"]}, {}) for p, c in enumerate(cuts)
        ]
        await gather(drops)


def _rows_of(cut: dict[str, Any], name: str) -> int:
    return next(int(t["n"]) for t in cut["tables"] if t["spec"]["name"] == name)


async def _export_rows(
    client: Tables,
    writer: ExportWriter,
    spec: EmbeddingSpec,
    cuts: list[dict[str, Any]],
    state: bool,
) -> None:
    counts = [_rows_of(c, spec.name) for c in cuts]
    sink = writer.embedding(spec, sum(counts), state=state)
    async for ids, rows, columns in _pages(client, spec, cuts, counts, state):
        sink.write(ids, rows, columns if state else None)
    sink.close()


async def _delta_rows(
    client: Tables,
    writer: ExportWriter,
    spec: EmbeddingSpec,
    cuts: list[dict[str, Any]],
    base: Export | None,
) -> None:
    """The rows that differ from ``base``'s (or all, without one), held until the end."""
    counts = [_rows_of(c, spec.name) for c in cuts]
    old_ids = base.ids(spec.name) if base is not None else np.empty(0, dtype=np.int64)
    old_values = base.values(spec.name) if base is not None else None
    order = np.argsort(old_ids, kind="stable")
    sorted_ids = np.asarray(old_ids)[order]
    seen = np.zeros(old_ids.shape[0], dtype=bool)
    kept_ids: list[np.ndarray] = []
    kept_rows: list[np.ndarray] = []
    async for ids, rows, _ in _pages(client, spec, cuts, counts, False):
        changed = np.ones(ids.shape[0], dtype=bool)
        if sorted_ids.size:
            at = np.minimum(np.searchsorted(sorted_ids, ids), sorted_ids.size - 1)
            found = sorted_ids[at] == ids
            where = order[at[found]]
            seen[where] = True
            assert old_values is not None
            changed[found] = (np.asarray(old_values[where]) != rows[found]).any(axis=1)
        kept_ids.append(np.array(ids[changed]))
        kept_rows.append(np.array(rows[changed]))
    ids_all = np.concatenate(kept_ids) if kept_ids else np.empty(0, dtype=np.int64)
    sink = writer.embedding(spec, ids_all.shape[0], removed=np.asarray(old_ids)[~seen])
    if kept_rows:
        sink.write(ids_all, np.concatenate(kept_rows))
    sink.close()


async def _pages(
    client: Tables,
    spec: EmbeddingSpec,
    cuts: list[dict[str, Any]],
    counts: list[int],
    state: bool,
) -> AsyncIterator[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]:
    """``(ids, rows, state columns)`` of every partition's cut, in pages within the
    message budget (no columns unless ``state``)."""
    widths = spec.optimizer.state_widths(spec.dim) if state else {}
    row_bytes = 8 + (spec.dim + sum(widths.values())) * np.dtype(spec.dtype).itemsize
    page = max(1, client.config.message_budget // row_bytes)
    for p, (cut, count) in enumerate(zip(cuts, counts, strict=True)):
        # a few pages in flight per partition, written in order
        starts = list(range(0, count, page))
        for i in range(0, len(starts), 4):
            futures = [
                client.submit(
                    p,
                    {
                        "op": "cut_read",
                        "cut": cut["cut"],
                        "t": spec.name,
                        "start": s,
                        "count": page,
                    },
                    {},
                    reply_bytes=min(page, count - s) * row_bytes,
                )
                for s in starts[i : i + 4]
            ]
            for result in await gather(futures):
                ids, rows, *columns = result["arrays"]
                yield ids, rows, dict(zip(result.get("keys", []), columns, strict=True))


async def _export_dense(
    client: Tables,
    flat: np.ndarray,
    spec: DenseSpec,
    cuts: list[dict[str, Any]],
    columns: Mapping[str, np.ndarray],
) -> None:
    """The tensor's values into ``flat`` and, if ``columns`` are given, its optimizer
    state into them (see :meth:`zps.model.format.ExportWriter.dense_state`)."""
    cmap = client.cluster_map
    itemsize = np.dtype(spec.dtype).itemsize
    keys = list(columns)
    offsets = state_offsets(spec, keys)
    by_part: dict[int, list[int]] = {}
    for c in range(spec.n_chunks):
        by_part.setdefault(chunk_partition(spec.name, c, cmap), []).append(c)
    for p, chunks in sorted(by_part.items()):
        sizes = [
            (
                spec.chunk_range(c)[1]
                - spec.chunk_range(c)[0]
                + sum(offsets[k][c + 1] - offsets[k][c] for k in keys)
            )
            * itemsize
            for c in chunks
        ]
        op: dict[str, Any] = {"op": "cut_read", "cut": cuts[p]["cut"], "t": spec.name}
        for a, b in groups_by_bytes(sizes, client.config.message_budget):
            group = chunks[a:b]
            result = await client.submit(
                p, {**op, "chunks": group}, {}, reply_bytes=sum(sizes[a:b])
            )
            arrays = iter(result["arrays"])
            for c in group:
                start, stop = spec.chunk_range(c)
                flat[start:stop] = next(arrays)
                for k in result.get("keys", []):
                    columns[k][offsets[k][c] : offsets[k][c + 1]] = next(arrays)


async def import_model(
    client: Tables,
    path: str | os.PathLike[str],
    *,
    tables: Sequence[str] | None = None,
) -> list[str]:
    """Create the tables of the export at ``path`` (default: all) and set their values;
    returns the names imported."""
    export = Export(path)
    names = list(export.tables) if tables is None else list(tables)
    n = client.cluster_map.n_partitions
    for name in names:
        entry = export.entry(name)
        await client.create_spec(entry.spec)
        # A table that existed already keeps its count through create: set it.
        op = {"op": "advance_step", "t": name, "to": entry.spec.step}
        await gather(client.submit(p, dict(op), {}) for p in range(n))
    for name in names:
        entry = export.entry(name)
        state = export.state(name)
        if state is None and entry.spec.optimizer.state_widths(1):
            log.warning(
                "import of %r: the export at %s carries no optimizer state; %s starts afresh",
                name,
                export.path,
                entry.spec.optimizer.kind,
            )
        if isinstance(entry.spec, DenseSpec):
            values = np.asarray(export.values(name))
            if state is None:
                await client.set_dense(name, values)
            else:
                await _set_dense_state(client, entry.spec, values, state)
            continue
        ids, values = export.ids(name), export.values(name)
        for start in range(0, ids.shape[0], IMPORT_ROWS):
            stop = start + IMPORT_ROWS
            page_ids, page_rows = np.asarray(ids[start:stop]), np.asarray(values[start:stop])
            if state is None:
                await client.set_rows(name, page_ids, page_rows)
            else:
                page_state = {k: np.asarray(a[start:stop]) for k, a in state.items()}
                await _set_rows_state(client, entry.spec, page_ids, page_rows, page_state)
    return names


async def _set_rows_state(
    client: Tables,
    spec: TableSpec,
    ids: np.ndarray,
    rows: np.ndarray,
    state: dict[str, np.ndarray],
) -> None:
    """``set_rows`` with the rows' optimizer state (the shards check every array)."""
    assert isinstance(spec, EmbeddingSpec)
    client.check_row(spec)
    widths = spec.optimizer.state_widths(spec.dim)
    row_bytes = 8 + (spec.dim + sum(widths.values())) * np.dtype(spec.dtype).itemsize
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    split = client.split(ids)
    by_part = take_rows(np.ascontiguousarray(rows), split.order)
    columns = {k: take_rows(np.ascontiguousarray(a), split.order) for k, a in state.items()}
    op = {"op": "set_rows", "t": spec.name, "state": list(columns)}
    futures = [
        client.submit(
            p,
            dict(op),
            {
                "ids": split.ids[a:b],
                "v": by_part[a:b],
                **{f"s.{k}": c[a:b] for k, c in columns.items()},
            },
        )
        for p, a, b in runs(split, row_bytes, client.config.message_budget)
    ]
    await gather(futures)


async def _set_dense_state(
    client: Tables, spec: TableSpec, values: np.ndarray, state: dict[str, np.ndarray]
) -> None:
    """``set_dense`` with the tensor's optimizer state, chunk by chunk."""
    assert isinstance(spec, DenseSpec)
    client.check_chunks(spec)
    flat = np.ascontiguousarray(values).reshape(-1)
    offsets = state_offsets(spec, list(state))
    futures = []
    for c in range(spec.n_chunks):
        start, stop = spec.chunk_range(c)
        arrays = {"v": flat[start:stop]}
        for k, a in state.items():
            arrays[f"s.{k}"] = np.ascontiguousarray(a[offsets[k][c] : offsets[k][c + 1]])
        futures.append(
            client.submit(
                chunk_partition(spec.name, c, client.cluster_map),
                {"op": "set_dense", "t": spec.name, "chunk": c, "state": list(state)},
                arrays,
            )
        )
    await gather(futures)
