"""Export a running cluster's model and import one (warm start), through a client.

Export (:func:`export_model`): every partition's primary copies the values of its tables
at one point of its log (the ``cut`` operation: memory copies, between two requests), and
the client reads the copies in pieces within the message budget while training goes on,
writing them into the open format of :mod:`zps.model.format`.  Each partition is cut at one
LSN (reported in the manifest); training may continue during and after the cut.  If a
primary changes while its cut is read (a failover), the copy is gone with it and the
export starts again (at most ``attempts`` times).

Import (:func:`import_model`): creates each table with the exported spec (idempotent for
an identical one; ``TableConflictError`` naming the fields if a table of that name differs)
and sets its values with ``set_dense`` / ``set_rows``, which are replicated, logged and
applied once like pushes, and reset the optimizer state of what they set.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from zps.core.batching import groups_by_bytes
from zps.core.routing import chunk_partition
from zps.errors import BadRequestError, UnknownTableError
from zps.model.format import Export, ExportWriter
from zps.protocol.specs import DenseSpec, EmbeddingSpec, spec_from_wire

if TYPE_CHECKING:
    from zps.client.client import Client

log = logging.getLogger("zps.export")

#: Rows set per ``set_rows`` call of an import (the client cuts each into messages).
IMPORT_ROWS = 1 << 20


async def export_model(
    client: Client,
    out: str | os.PathLike[str],
    *,
    tables: Sequence[str] | None = None,
    source: dict[str, Any] | None = None,
    since: str | os.PathLike[str] | None = None,
    attempts: int = 3,
    values_only: bool = False,
) -> dict[str, Any]:
    """Write the values of ``tables`` (default: all) to the directory ``out``; returns
    the manifest.  With ``since`` (an earlier export, full or delta-applied), write a
    delta: only rows and tensors that differ from it, the ids it had that are gone, and
    the tables it had that are gone (see :func:`zps.model.format.apply_delta`)."""
    base = Export(since) if since is not None else None
    for attempt in range(1, attempts + 1):
        try:
            return await _export_once(client, Path(out), tables, source, base)
        except BadRequestError as e:
            if "take a new cut" not in str(e) or attempt == attempts:
                raise
            log.warning("export: %s; starting again (attempt %d)", e, attempt + 1)
            shutil.rmtree(Path(out) / "tables", ignore_errors=True)
    raise AssertionError("unreachable")


async def _export_once(
    client: Client,
    out: Path,
    names: Sequence[str] | None,
    source: dict[str, Any] | None,
    base: Export | None,
) -> dict[str, Any]:
    cmap = client.cluster_map
    n = cmap.n_partitions
    cuts = await client._gather(client._submit(p, {"op": "cut"}, {}) for p in range(n))
    try:
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
                    await _export_rows(client, writer, spec, cuts)
                else:
                    await _delta_rows(client, writer, spec, cuts, base if old else None)
            elif base is None:
                values = writer.dense(spec)
                await _export_dense(client, values.reshape(-1), spec, cuts)
                values.flush()
            else:
                flat = np.empty(spec.size, dtype=spec.dtype)
                await _export_dense(client, flat, spec, cuts)
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
            client._submit(p, {"op": "cut_drop", "cut": c["cut"]}, {}) for p, c in enumerate(cuts)
        ]
        await client._gather(drops)


def _rows_of(cut: dict[str, Any], name: str) -> int:
    return next(int(t["n"]) for t in cut["tables"] if t["spec"]["name"] == name)


async def _export_rows(
    client: Client, writer: ExportWriter, spec: EmbeddingSpec, cuts: list[dict[str, Any]]
) -> None:
    counts = [_rows_of(c, spec.name) for c in cuts]
    sink = writer.embedding(spec, sum(counts))
    async for ids, rows in _pages(client, spec, cuts, counts):
        sink.write(ids, rows)
    sink.close()


async def _delta_rows(
    client: Client,
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
    async for ids, rows in _pages(client, spec, cuts, counts):
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
    client: Client, spec: EmbeddingSpec, cuts: list[dict[str, Any]], counts: list[int]
) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, rows)`` of every partition's cut, in pages within the message budget."""
    row_bytes = 8 + spec.dim * np.dtype(spec.dtype).itemsize
    page = max(1, client.config.message_budget // row_bytes)
    for p, (cut, count) in enumerate(zip(cuts, counts, strict=True)):
        # a few pages in flight per partition, written in order
        starts = list(range(0, count, page))
        for i in range(0, len(starts), 4):
            futures = [
                client._submit(
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
            for result in await client._gather(futures):
                ids, rows = result["arrays"]
                yield ids, rows


async def _export_dense(
    client: Client, flat: np.ndarray, spec: DenseSpec, cuts: list[dict[str, Any]]
) -> None:
    cmap = client.cluster_map
    itemsize = np.dtype(spec.dtype).itemsize
    by_part: dict[int, list[int]] = {}
    for c in range(spec.n_chunks):
        by_part.setdefault(chunk_partition(spec.name, c, cmap), []).append(c)
    for p, chunks in sorted(by_part.items()):
        sizes = [(spec.chunk_range(c)[1] - spec.chunk_range(c)[0]) * itemsize for c in chunks]
        for a, b in groups_by_bytes(sizes, client.config.message_budget):
            group = chunks[a:b]
            result = await client._submit(
                p,
                {"op": "cut_read", "cut": cuts[p]["cut"], "t": spec.name, "chunks": group},
                {},
                reply_bytes=sum(sizes[a:b]),
            )
            for c, arr in zip(group, result["arrays"], strict=True):
                start, stop = spec.chunk_range(c)
                flat[start:stop] = arr


async def import_model(
    client: Client,
    path: str | os.PathLike[str],
    *,
    tables: Sequence[str] | None = None,
) -> list[str]:
    """Create the tables of the export at ``path`` (default: all) and set their values;
    returns the names imported."""
    export = Export(path)
    names = list(export.tables) if tables is None else list(tables)
    for name in names:
        entry = export.entry(name)
        await client._create(entry.spec)
    for name in names:
        entry = export.entry(name)
        if isinstance(entry.spec, DenseSpec):
            await client.set_dense(name, np.asarray(export.values(name)))
            continue
        ids, values = export.ids(name), export.values(name)
        for start in range(0, ids.shape[0], IMPORT_ROWS):
            stop = start + IMPORT_ROWS
            await client.set_rows(name, np.asarray(ids[start:stop]), np.asarray(values[start:stop]))
    return names
