"""Export a model from shards' data dirs, with no process running (``zps-server export
--data-dir DIR ... --out DIR``).

Each ``partition-P`` folder of each data dir is a copy of partition P: its newest
checkpoint that verifies, then its write-ahead log replayed after it, read only (unlike a
shard's start-up, nothing is cut, renamed or written).  Of several copies of one partition
(a primary's and its replicas' data dirs) the newest is used, by the rule a restarted
broker applies: the later epoch, then the higher LSN.  Every partition from 0 to the
highest found (or to ``partitions - 1``) must have a copy.

A copy that a live resharding involved holds the slots it served (its slot state, in its
checkpoint and log): only its rows and chunks on those slots are exported.  Rows of slots
given away and not dropped yet are left out, and a partition that serves no slot (a
scale-down removed it; its copies stay in the data dirs) is skipped.  The copies chosen
must serve each slot once (and, when each says which it serves, every slot): copies from
different points of a move are refused, naming how many slots they disagree on.

Memory: one partition is held at a time (each is restored twice: once to find the
newest copy and count rows, once to write), and tables go straight to their files.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.errors import BadRequestError
from zps.init import generate
from zps.model.format import EmbeddingSink, Export, ExportWriter, state_offsets
from zps.protocol.specs import DenseSpec, EmbeddingSpec, TableSpec
from zps.shard.checkpoint import CheckpointStore
from zps.shard.core import ShardCore
from zps.shard.restore import apply_record
from zps.store.slots import chunk_slot, slots_of_ids
from zps.store.wal import Wal

log = logging.getLogger("zps.export")

_PARTITION = re.compile(r"partition-(\d+)")


@dataclass
class Copy:
    """One data dir's copy of one partition, as restored."""

    data_dir: Path
    partition: int
    epoch: int = 0
    lsn: int = 0
    checkpoint: Path | None = None
    replayed: int = 0
    stopped: str | None = None
    rows: dict[str, int] = field(default_factory=dict)
    specs: dict[str, TableSpec] = field(default_factory=dict)
    #: The slots the copy served, once a move involved it (None: every row is its own).
    owned: npt.NDArray[np.bool_] | None = None

    @property
    def removed(self) -> bool:
        """The partition gave away every slot: a scale-down removed it."""
        return self.owned is not None and not bool(self.owned.any())


def owned_rows(owned: npt.NDArray[np.bool_] | None, ids: npt.NDArray[np.int64]) -> Any:
    """Which of ``ids`` are on the ``owned`` slots (a slice of all of them: None)."""
    return slice(None) if owned is None else owned[slots_of_ids(ids, owned.shape[0])]


def owned_chunk(owned: npt.NDArray[np.bool_] | None, name: str, chunk: int) -> bool:
    return owned is None or bool(owned[chunk_slot(name, chunk, owned.shape[0])])


def restore_copy(data_dir: Path, partition: int) -> tuple[Copy, ShardCore]:
    """The partition as its checkpoint and log in ``data_dir`` hold it (nothing written)."""
    store = CheckpointStore(data_dir)
    core = ShardCore()
    found = store.latest(partition)
    copy = Copy(data_dir, partition)
    if found is not None:
        core.load_snapshot(found.snapshot)
        copy.checkpoint = found.path
    else:
        core.assign(partition, 0, primary=False)
    lsn, epoch = core.lsn, core.epoch
    for rec in Wal(store.folder(partition)).records():
        if rec.lsn <= lsn:
            continue
        if rec.prev != lsn:
            copy.stopped = f"a gap: LSN {lsn}, then a record from {rec.prev} to {rec.lsn}"
        elif rec.epoch < epoch:
            copy.stopped = f"a record of epoch {rec.epoch} after epoch {epoch}"
        else:
            try:
                got = apply_record(core, rec)
            except Exception as e:
                got, copy.stopped = -1, f"LSN {rec.lsn} does not apply: {e}"
            if got != rec.lsn and copy.stopped is None:
                copy.stopped = f"LSN {rec.lsn} left the state at LSN {got}"
        if copy.stopped is not None:
            break
        lsn, epoch = rec.lsn, rec.epoch
        copy.replayed += 1
    core.epoch = epoch
    copy.epoch, copy.lsn = epoch, core.lsn
    slots = core.slots
    copy.owned = slots.owned.copy() if slots is not None and slots.active else None
    for spec in core.store.specs():
        copy.specs[spec.name] = spec
        if isinstance(spec, EmbeddingSpec):
            ids = core.store.embedding(spec.name).admitted_ids()
            copy.rows[spec.name] = len(ids[owned_rows(copy.owned, ids)])
    return copy, core


def find_copies(data_dirs: Sequence[str | os.PathLike[str]]) -> dict[int, list[Copy]]:
    """Every copy of every partition in ``data_dirs``, restored once to learn its state."""
    copies: dict[int, list[Copy]] = {}
    for d in data_dirs:
        root = Path(d)
        if not root.is_dir():
            raise BadRequestError(f"data dir {root} does not exist")
        for folder in sorted(root.iterdir()):
            m = _PARTITION.fullmatch(folder.name)
            if m is None or not folder.is_dir():
                continue
            copy, _ = restore_copy(root, int(m.group(1)))
            if copy.lsn == 0:
                continue  # nothing there
            copies.setdefault(copy.partition, []).append(copy)
    return copies


def newest(copies: list[Copy]) -> Copy:
    return max(copies, key=lambda c: (c.epoch, c.lsn))


def export_data_dirs(
    data_dirs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    partitions: int | None = None,
    tables: Sequence[str] | None = None,
    values_only: bool = False,
) -> dict[str, Any]:
    """Write the model held by ``data_dirs`` to ``out``; returns the manifest."""
    found = find_copies(data_dirs)
    if not found:
        raise BadRequestError(f"no partition with data in {', '.join(map(str, data_dirs))}")
    n = partitions if partitions is not None else max(found) + 1
    missing = [p for p in range(n) if p not in found]
    if missing:
        raise BadRequestError(f"no copy of partitions {missing} in the data dirs given")
    chosen = {p: newest(found[p]) for p in range(n)}
    for p in [p for p, c in chosen.items() if c.removed]:
        log.info(
            "partition %d: %s serves no slot (a scale-down removed the partition, or a move "
            "never reached it): skipped",
            p,
            chosen[p].data_dir,
        )
        del chosen[p]
    if not chosen:
        raise BadRequestError("no partition in the data dirs given serves a slot")
    _check_slots(chosen)
    for p, c in chosen.items():
        log.info(
            "partition %d: %s at epoch %d, LSN %d (%s + %d logged messages)%s",
            p,
            c.data_dir,
            c.epoch,
            c.lsn,
            c.checkpoint.name if c.checkpoint else "no checkpoint",
            c.replayed,
            f"; log replay stopped: {c.stopped}" if c.stopped else "",
        )
    specs: dict[str, TableSpec] = {}
    for c in chosen.values():
        for name, spec in c.specs.items():
            if specs.setdefault(name, spec) != spec:
                raise BadRequestError(f"table {name!r} has different specs on different partitions")
    names = sorted(specs) if tables is None else list(tables)
    for name in names:
        if name not in specs:
            raise BadRequestError(f"unknown table {name!r}: not in the data dirs given")
    writer = ExportWriter(
        out, {"kind": "data-dirs", "data_dirs": [str(Path(d).resolve()) for d in data_dirs]}
    )
    state = not values_only
    sinks: dict[str, EmbeddingSink] = {}
    dense: dict[str, np.ndarray] = {}
    dense_state: dict[str, dict[str, np.ndarray]] = {}
    for name in names:
        spec = specs[name]
        if isinstance(spec, EmbeddingSpec):
            n_rows = sum(c.rows.get(name, 0) for c in chosen.values())
            sinks[name] = writer.embedding(spec, n_rows, state=state)
        else:
            dense[name] = _initial(writer, spec)
            if state:
                dense_state[name] = _initial_state(writer, spec)
    for p, c in chosen.items():
        _, core = restore_copy(c.data_dir, p)
        if (core.epoch, core.lsn) != (c.epoch, c.lsn):
            raise BadRequestError(f"partition {p} in {c.data_dir} changed during the export")
        for name in names:
            if name not in core.store:
                continue
            if name in sinks:
                table = core.store.embedding(name)
                ids, rows = table.copy_values()
                keep = owned_rows(c.owned, ids)
                st = {k: a[keep] for k, a in table.copy_state().items()} if state else None
                sinks[name].write(ids[keep], rows[keep], st)
            else:
                spec = specs[name]
                assert isinstance(spec, DenseSpec)
                flat = dense[name].reshape(-1)
                tensor = core.store.dense(name)
                for chunk, values in tensor.copy_values().items():
                    if owned_chunk(c.owned, name, chunk):
                        start, stop = spec.chunk_range(chunk)
                        flat[start:stop] = values
                if state:
                    columns = dense_state[name]
                    offsets = state_offsets(spec, list(columns))
                    for chunk, chunk_state in tensor.copy_state().items():
                        if not owned_chunk(c.owned, name, chunk):
                            continue
                        for k, a in chunk_state.items():
                            columns[k][offsets[k][chunk] : offsets[k][chunk + 1]] = a
        del core
    for sink in sinks.values():
        sink.close()
    for arr in [*dense.values(), *(a for c in dense_state.values() for a in c.values())]:
        arr.flush()  # type: ignore[attr-defined]
    writer.finish({p: {"lsn": c.lsn, "epoch": c.epoch} for p, c in chosen.items()})
    return Export(out).manifest


def _check_slots(chosen: dict[int, Copy]) -> None:
    """The copies a move involved must serve each slot once, and, when every copy says
    which slots it serves, all of them together every slot: copies taken at different
    points of a move (the cluster stopped in its cut-over, or a copy behind the others)
    would put rows twice or nowhere."""
    known = [c.owned for c in chosen.values() if c.owned is not None]
    if not known:
        return
    serving = np.sum(known, axis=0)
    twice = int((serving > 1).sum())
    if twice:
        raise BadRequestError(
            f"{twice} slots are served by two partitions' copies (the cluster stopped in a "
            "move's cut-over): start the cluster to finish the move, then export"
        )
    nowhere = int((serving == 0).sum())
    if nowhere and len(known) == len(chosen):
        raise BadRequestError(
            f"{nowhere} slots are served by no copy in the data dirs given (a move's "
            "destination missing or behind): give every shard's data dir, or start the "
            "cluster to finish the move, then export"
        )


def _initial(writer: ExportWriter, spec: DenseSpec) -> np.ndarray:
    """The tensor's file, filled with its initial values (chunks no partition stored)."""
    values = writer.dense(spec)
    flat = values.reshape(-1)
    for c in range(spec.n_chunks):
        start, stop = spec.chunk_range(c)
        flat[start:stop] = generate(
            spec.init, spec.seed, np.arange(start, stop), 1, np.dtype(spec.dtype)
        ).ravel()
    return values


def _initial_state(writer: ExportWriter, spec: DenseSpec) -> dict[str, np.ndarray]:
    """The tensor's optimizer state files, filled with each chunk's initial state."""
    columns: dict[str, np.ndarray] = dict(writer.dense_state(spec))
    offsets = state_offsets(spec, list(columns))
    for c in range(spec.n_chunks):
        start, stop = spec.chunk_range(c)
        init = spec.optimizer.init_state(1, stop - start, np.dtype(spec.dtype))
        for k, a in init.items():
            columns[k][offsets[k][c] : offsets[k][c + 1]] = a.reshape(-1)
    return columns
