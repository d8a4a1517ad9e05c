"""Export a running cluster's model and import one (warm start), through a client's
key-value API (:class:`Tables`).

Export (:func:`export_model`): every partition's primary copies the values of its tables
and their optimizer state (``values_only``: the values alone) at one point of its log
(the ``cut`` operation: memory copies, between two requests), and
the client reads the copies in pieces within the message budget while training goes on,
writing them into the open format of :mod:`zps.model.format`.  Each partition is cut at one
LSN (reported in the manifest); training may continue during and after the cut.  If a
primary changes while its cut is read (a failover), the copy is gone with it and the
export starts again (at most ``attempts`` times).  It starts again too when live
resharding moved slots while the partitions were cut (a partition added or removed, the
slot map changed between the first cut and the last, or a partition cut in the middle of
a move's cut-over, its slots not the map's), after a pause that doubles, for as long as
the client's timeout: the cuts it keeps hold each row exactly once.

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
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt

from zps.client.futures import gather
from zps.client.session import NO_SUCH_PARTITION
from zps.client.values import runs
from zps.core.batching import groups_by_bytes
from zps.core.routing import ClusterMap, chunk_partition
from zps.core.rows import Split, take_rows
from zps.errors import BadRequestError, ProtocolError, ShardUnavailableError, UnknownTableError
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

#: Seconds before an export starts again, doubling up to the most: a slot move's
#: cut-over (its map, activation and release) takes a few round trips, a failover more.
RETRY_PAUSE_S, RETRY_PAUSE_MAX_S = 0.05, 1.0

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
    loop = asyncio.get_running_loop()
    attempt, pause, deadline = 1, RETRY_PAUSE_S, None

    def cut_whole() -> None:  # an attempt's cuts passed the checks: moves waited out
        nonlocal pause, deadline
        pause, deadline = RETRY_PAUSE_S, None

    while True:
        try:
            return await _export_once(client, Path(out), tables, source, base, state, cut_whole)
        except (BadRequestError, ShardUnavailableError) as e:
            moved = isinstance(e, _Resharded) or (
                isinstance(e, ShardUnavailableError) and e.missing == NO_SUCH_PARTITION
            )
            if moved:  # cuts wait for a moment between two moves, within the timeout
                deadline = deadline or loop.time() + client.config.timeout
                if loop.time() >= deadline:
                    raise BadRequestError(
                        f"the cluster kept moving slots for {client.config.timeout:g}s (the "
                        "client's timeout): no export cut fell between two moves; export "
                        "again when the resharding is done (zps-server status)"
                    ) from e
            elif "take a new cut" in str(e) and attempt < attempts:
                attempt += 1
            else:
                raise
            log.warning("export: %s; starting again", e)
            shutil.rmtree(Path(out) / "tables", ignore_errors=True)
            await asyncio.sleep(pause)
            pause = min(2 * pause, RETRY_PAUSE_MAX_S)


class _Resharded(BadRequestError):
    """The cuts did not partition the slots as one map: take new ones."""


async def _export_once(
    client: Tables,
    out: Path,
    names: Sequence[str] | None,
    source: dict[str, Any] | None,
    base: Export | None,
    state: bool,
    cut_whole: Callable[[], None],
) -> dict[str, Any]:
    cmap = client.cluster_map
    n = cmap.n_partitions
    cut_op: dict[str, Any] = {"op": "cut", "state": True} if state else {"op": "cut"}
    taken = await asyncio.gather(
        *(client.submit(p, dict(cut_op), {}) for p in range(n)), return_exceptions=True
    )
    failed = next((c for c in taken if isinstance(c, BaseException)), None)
    if failed is not None:  # free the cuts taken before starting again
        await _free(client, [(p, c) for p, c in enumerate(taken) if isinstance(c, dict)])
        raise failed
    cuts = cast(list[dict[str, Any]], taken)
    try:
        now = client.cluster_map
        if now.n_partitions != n or not np.array_equal(now.slot_map, cmap.slot_map):
            raise _Resharded("live resharding moved slots while the partitions were cut")
        for p, cut in enumerate(cuts):
            if not _serves_its_slots(cut, p, now):
                raise _Resharded(f"partition {p} was cut in the middle of a slot move")
        cut_whole()
        per_table: dict[str, list[dict[str, Any]]] = {}
        on: dict[str, set[int]] = {}
        for p, cut in enumerate(cuts):
            for t in cut["tables"]:
                per_table.setdefault(t["spec"]["name"], []).append(t)
                on.setdefault(t["spec"]["name"], set()).add(p)
        # A partition a scale added learns the specs with its first move's rows: until
        # then it serves no slot, and it may hold no table.
        serving = set(np.unique(now.slot_map).tolist())
        wanted = sorted(per_table) if names is None else list(names)
        for name in wanted:
            if name not in per_table:
                raise UnknownTableError(f"unknown table {name!r}: nothing to export")
            if not serving <= on[name]:
                raise BadRequestError(
                    f"table {name!r} is on {len(on[name] & serving)} of the {len(serving)} "
                    "partitions that serve slots (created or dropped during the export); "
                    "export again"
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
                await _export_dense(client, values.reshape(-1), spec, cuts, now, columns)
                values.flush()
                for a in columns.values():
                    a.flush()
            else:
                flat = np.empty(spec.size, dtype=spec.dtype)
                await _export_dense(client, flat, spec, cuts, now, {})
                if old is None or not np.array_equal(base.values(name).reshape(-1), flat):
                    values = writer.dense(spec)
                    values.reshape(-1)[:] = flat
                    values.flush()
        dropped = sorted(set(base.tables) - set(per_table)) if base is not None else []
        partitions = {p: {"lsn": c["lsn"], "epoch": c["epoch"]} for p, c in enumerate(cuts)}
        writer.finish(partitions, dropped=dropped)
        return Export(out).manifest
    finally:
        await _free(client, list(enumerate(cuts)))


async def _free(client: Tables, cuts: list[tuple[int, dict[str, Any]]]) -> None:
    """Free ``cuts`` (partition, cut).  Not part of the export: a partition that a scale
    removed meanwhile, or whose primary changed, holds no cut to free (a shard keeps two),
    and a closed client frees nothing."""
    drops = []
    for p, c in cuts:
        try:
            drops.append(client.submit(p, {"op": "cut_drop", "cut": c["cut"]}, {}))
        except Exception as e:
            log.debug("export: a cut was not freed: %s", e)
    for freed in await asyncio.gather(*drops, return_exceptions=True):
        if isinstance(freed, Exception):
            log.debug("export: a cut was not freed: %s", freed)


def _serves_its_slots(cut: dict[str, Any], partition: int, cmap: ClusterMap) -> bool:
    """Whether the slots a cut was taken on (``owned``: those of a partition a move
    involved; absent: the partition's slots never changed) are the map's for it, so that
    the cuts of all partitions hold every row once: a cut between a move's map and its
    activation at the destination lacks the slots the map gives it, one between the
    activation and the release at the source still has the slots given away."""
    owned = cut.get("owned")
    if owned is None:
        return True
    if not isinstance(owned, bytes) or len(owned) != (cmap.n_slots + 7) // 8:
        raise ProtocolError(f"partition {partition}'s cut names its slots malformed")
    mask = np.unpackbits(np.frombuffer(owned, dtype=np.uint8), count=cmap.n_slots)
    return bool(np.array_equal(mask.astype(bool), cmap.slot_map == partition))


def _rows_of(cut: dict[str, Any], name: str) -> int:
    """The rows of table ``name`` in ``cut`` (0: a partition without it, serving no slot)."""
    return next((int(t["n"]) for t in cut["tables"] if t["spec"]["name"] == name), 0)


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
    cmap: ClusterMap,
    columns: Mapping[str, np.ndarray],
) -> None:
    """The tensor's values into ``flat`` and, if ``columns`` are given, its optimizer
    state into them (see :meth:`zps.model.format.ExportWriter.dense_state`); each chunk
    from the cut of its partition in ``cmap``, the map the cuts were taken by (a
    partition's cut answers a chunk it does not hold with its initial values)."""
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
