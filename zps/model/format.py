"""The export format: a model's values (and optimizer state) in files any numpy program
can read.

An export is a directory::

    manifest.json
    tables/0000-emb/ids.npy       int64, (rows,)        an embedding table's ids
    tables/0000-emb/values.npy    float32|64, (rows, dim)  their rows, in the same order
    tables/0000-emb/state-m.npy   the optimizer's state columns, one file each (if exported)
    tables/0001-w/values.npy      float32|64, the tensor's shape   a dense tensor

``manifest.json`` holds ``format`` (``"zps-export"``), ``version`` (1), the zps release
that wrote it, when, from what (``source``), the LSN and epoch each partition was cut at
(``partitions``) and one entry per table: ``name``, ``kind`` (``"embedding"`` or
``"dense"``), ``rows`` (embedding) or ``shape`` (dense), ``dtype``, ``files`` (paths
relative to the directory), ``spec`` (the table's zps spec: init, optimizer with its
learning-rate schedule if any, seed, and ``step``, the step count the schedule was at, when
not 0) and ``step`` (that count again, for readers without zps; an import restores the
spec's).  The manifest is written last, atomically: a directory without
one is an unfinished export.

Optimizer state: a table exported with it lists its optimizer's state columns in
``state`` (Adam ``m``, ``v``, ``step``; Adagrad ``accumulator``; FTRL ``z``, ``n``;
momentum ``velocity``; SGD none) and names each file in ``files`` as ``state.COLUMN``.
The files are in the table's dtype: an embedding table's ``(rows, width)``, row for row
as ``values.npy``; a dense tensor's 1-D, each chunk's state in chunk order (chunks of the
spec's ``chunk`` elements; see :func:`state_offsets`).  A table without ``state`` (an
export of values only, or one written before state was exported) has none.

Why ``.npy`` files: the format is numpy's own, documented and stable, read by
``numpy.load`` with no zps installed (and by readers in C, C++, Rust, Java, Julia and
JavaScript); a file can be memory-mapped (``numpy.load(path, mmap_mode="r")``), so a
serving process or an import reads a table larger than memory a slice at a time; and a
writer streams into it at a known size, so an export never holds a whole table in memory.
One pair of files per embedding table (rather than one ``.npz``, whose members can be
neither memory-mapped nor written in pieces) keeps both properties.

A delta (``export --since OLD``) has the same layout with only what differs from the
export ``OLD``: per embedding table the changed and new rows and ``removed.npy`` (the ids
``OLD`` had that are gone), dense tensors only if they changed; its manifest adds
``delta_of`` (``OLD``'s path, creation time and partitions) and ``dropped`` (``OLD``'s
tables that are gone).  :func:`apply_delta` turns ``OLD`` and a delta into a full export.

Embedding ids are unique and in no particular order (partition by partition); a reader
that needs a lookup builds its own (``np.argsort(ids)`` and ``np.searchsorted``).  A
delta carries values only, and so does what :func:`apply_delta` writes.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.errors import BadRequestError
from zps.protocol.specs import DenseSpec, EmbeddingSpec, TableSpec, spec_from_wire
from zps.version import __version__

__all__ = [
    "FORMAT",
    "VERSION",
    "EmbeddingSink",
    "Export",
    "ExportWriter",
    "TableEntry",
    "apply_delta",
    "state_offsets",
]

FORMAT = "zps-export"
VERSION = 1
MANIFEST = "manifest.json"


def _stem(i: int, name: str) -> str:
    return f"{i:04d}-{re.sub(r'[^A-Za-z0-9._-]', '_', name)[:80]}"


def state_file(key: str) -> str:
    """The file name of the optimizer state column ``key``."""
    return f"state-{re.sub(r'[^A-Za-z0-9._-]', '_', key)}.npy"


def state_offsets(spec: DenseSpec, keys: Sequence[str]) -> dict[str, list[int]]:
    """Per state column of a dense tensor: where each chunk's state starts in the
    column's 1-D file, and where the last one ends (one more entry than chunks)."""
    out = {k: [0] for k in keys}
    for c in range(spec.n_chunks):
        start, stop = spec.chunk_range(c)
        widths = spec.optimizer.state_widths(stop - start)
        for k in keys:
            out[k].append(out[k][-1] + widths[k])
    return out


def dense_state_size(spec: DenseSpec, key: str) -> int:
    """Elements of a dense tensor's state column ``key``: each chunk's, in chunk order."""
    return state_offsets(spec, [key])[key][-1]


class EmbeddingSink:
    """Rows of one embedding table as they arrive: ``write(ids, rows[, state])``
    appends; the values (and optimizer state columns, if the table's export carries
    them) go straight to their files, the ids are kept (8 bytes a row) and written at
    :meth:`close`, which checks that exactly ``rows`` arrived, each id once."""

    def __init__(
        self, folder: Path, spec: EmbeddingSpec, rows: int, state: Sequence[str] = ()
    ) -> None:
        self.spec, self.rows, self.folder = spec, rows, folder
        dtype = np.dtype(spec.dtype)
        self._values = np.lib.format.open_memmap(
            folder / "values.npy", mode="w+", dtype=dtype, shape=(rows, spec.dim)
        )
        widths = spec.optimizer.state_widths(spec.dim)
        self._state = {
            k: np.lib.format.open_memmap(
                folder / state_file(k), mode="w+", dtype=dtype, shape=(rows, widths[k])
            )
            for k in state
        }
        self._ids = np.empty(rows, dtype=np.int64)
        self._n = 0

    def write(
        self,
        ids: npt.ArrayLike,
        rows: npt.ArrayLike,
        state: dict[str, np.ndarray] | None = None,
    ) -> None:
        i, v = np.asarray(ids, dtype=np.int64), np.asarray(rows)
        n = i.shape[0]
        if v.shape != (n, self.spec.dim) or self._n + n > self.rows:
            raise BadRequestError(
                f"export of {self.spec.name!r}: {n} rows of shape {v.shape} after "
                f"{self._n} do not fit {self.rows} rows of dim {self.spec.dim}"
            )
        if set(state or {}) != set(self._state):
            raise BadRequestError(
                f"export of {self.spec.name!r}: state columns {sorted(state or {})} given, "
                f"{sorted(self._state)} expected"
            )
        self._ids[self._n : self._n + n] = i
        self._values[self._n : self._n + n] = v
        for k, a in (state or {}).items():
            self._state[k][self._n : self._n + n] = a
        self._n += n

    def close(self) -> None:
        if self._n != self.rows:
            raise BadRequestError(
                f"export of {self.spec.name!r}: {self._n} rows arrived, {self.rows} expected"
            )
        if np.unique(self._ids).shape[0] != self.rows:
            raise BadRequestError(f"export of {self.spec.name!r}: an id appears twice")
        self._values.flush()
        del self._values
        for a in self._state.values():
            a.flush()
        self._state.clear()
        np.save(self.folder / "ids.npy", self._ids)


class ExportWriter:
    """Writes an export into ``out`` (created; it must not hold an export already)."""

    def __init__(
        self, out: str | os.PathLike[str], source: dict[str, Any], *, base: Export | None = None
    ) -> None:
        self.base = base
        self.out = Path(out)
        if (self.out / MANIFEST).exists():
            raise BadRequestError(f"{self.out} already holds an export ({MANIFEST})")
        (self.out / "tables").mkdir(parents=True, exist_ok=True)
        self.source = source
        self._tables: list[dict[str, Any]] = []

    def _folder(self, spec: TableSpec) -> Path:
        folder = self.out / "tables" / _stem(len(self._tables), spec.name)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def embedding(
        self,
        spec: EmbeddingSpec,
        rows: int,
        *,
        removed: np.ndarray | None = None,
        state: bool = False,
    ) -> EmbeddingSink:
        """A sink for ``rows`` rows (with every optimizer state column if ``state``); in a
        delta, ``removed`` are the base's ids now gone."""
        folder = self._folder(spec)
        rel = folder.relative_to(self.out).as_posix()
        files = {"ids": f"{rel}/ids.npy", "values": f"{rel}/values.npy"}
        if removed is not None:
            np.save(folder / "removed.npy", np.asarray(removed, dtype=np.int64))
            files["removed"] = f"{rel}/removed.npy"
        keys = list(spec.optimizer.state_widths(spec.dim)) if state else []
        files.update({f"state.{k}": f"{rel}/{state_file(k)}" for k in keys})
        entry: dict[str, Any] = {
            "name": spec.name,
            "kind": "embedding",
            "rows": int(rows),
            "dim": spec.dim,
            "dtype": spec.dtype,
            "files": files,
            "spec": spec.to_wire(),
            "step": spec.step,
        }
        if state:
            entry["state"] = keys
        self._tables.append(entry)
        return EmbeddingSink(folder, spec, rows, keys)

    def dense(self, spec: DenseSpec) -> np.memmap[Any, Any]:
        """The tensor's values file, to be filled by the caller (flushed at :meth:`finish`)."""
        folder = self._folder(spec)
        rel = folder.relative_to(self.out).as_posix()
        self._tables.append(
            {
                "name": spec.name,
                "kind": "dense",
                "shape": list(spec.shape),
                "dtype": spec.dtype,
                "files": {"values": f"{rel}/values.npy"},
                "spec": spec.to_wire(),
                "step": spec.step,
            }
        )
        out: np.memmap[Any, Any] = np.lib.format.open_memmap(
            folder / "values.npy", mode="w+", dtype=np.dtype(spec.dtype), shape=spec.shape
        )
        return out

    def dense_state(self, spec: DenseSpec) -> dict[str, np.memmap[Any, Any]]:
        """The optimizer state files of the tensor :meth:`dense` just added, one per
        column: 1-D, each chunk's state in chunk order; filled by the caller."""
        entry = self._tables[-1]
        if entry["name"] != spec.name or entry["kind"] != "dense":
            raise BadRequestError(f"dense_state of {spec.name!r} must follow its dense()")
        rel = Path(entry["files"]["values"]).parent.as_posix()
        keys = list(spec.optimizer.state_widths(1))
        entry["state"] = keys
        out: dict[str, np.memmap[Any, Any]] = {}
        for k in keys:
            entry["files"][f"state.{k}"] = f"{rel}/{state_file(k)}"
            out[k] = np.lib.format.open_memmap(
                self.out / rel / state_file(k),
                mode="w+",
                dtype=np.dtype(spec.dtype),
                shape=(dense_state_size(spec, k),),
            )
        return out

    def finish(self, partitions: dict[int, dict[str, int]], *, dropped: Sequence[str] = ()) -> Path:
        """Write the manifest (last, atomically); returns its path.  A delta names the
        tables of its base that are gone (``dropped``)."""
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "zps_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": self.source,
            "partitions": {str(p): v for p, v in sorted(partitions.items())},
            "tables": self._tables,
        }
        if self.base is not None:
            manifest["delta_of"] = {
                "path": str(self.base.path),
                "created": self.base.manifest.get("created"),
                "partitions": self.base.manifest.get("partitions"),
            }
            manifest["dropped"] = list(dropped)
        path = self.out / MANIFEST
        tmp = self.out / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path


@dataclass(frozen=True)
class TableEntry:
    name: str
    kind: str
    spec: TableSpec
    files: dict[str, Path]
    rows: int | None = None


class Export:
    """An export directory, read: ``Export(path)``; arrays are memory-mapped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BadRequestError(
                f"{self.path} is not a finished zps export: no {MANIFEST}"
            ) from None
        except (OSError, ValueError) as e:
            raise BadRequestError(f"{manifest_path} is unreadable: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise BadRequestError(f"{manifest_path} is not a {FORMAT} manifest")
        if manifest.get("version") != VERSION:
            raise BadRequestError(
                f"{manifest_path} has format version {manifest.get('version')!r}; "
                f"this zps reads version {VERSION}"
            )
        self.manifest: dict[str, Any] = manifest
        self.tables: dict[str, TableEntry] = {}
        for t in manifest.get("tables", []):
            spec = spec_from_wire(t.get("spec"))
            files = {k: self.path / v for k, v in t.get("files", {}).items()}
            self.tables[spec.name] = TableEntry(
                spec.name,
                "dense" if isinstance(spec, DenseSpec) else "embedding",
                spec,
                files,
                t.get("rows"),
            )

    @property
    def is_delta(self) -> bool:
        return "delta_of" in self.manifest

    def removed(self, name: str) -> np.ndarray:
        """A delta's ids of ``name`` that its base had and that are gone."""
        entry = self.entry(name)
        path = entry.files.get("removed")
        if path is None:
            return np.empty(0, dtype=np.int64)
        out: np.ndarray = np.load(path)
        return out

    def __iter__(self) -> Iterator[TableEntry]:
        return iter(self.tables.values())

    def entry(self, name: str) -> TableEntry:
        found = self.tables.get(name)
        if found is None:
            raise BadRequestError(
                f"table {name!r} is not in the export at {self.path} (it has {sorted(self.tables)})"
            )
        return found

    def _load(self, entry: TableEntry, key: str) -> np.ndarray:
        path = entry.files.get(key)
        if path is None:
            raise BadRequestError(f"export of {entry.name!r} lists no {key!r} file")
        arr: np.ndarray = np.load(path, mmap_mode="r")
        return arr

    def values(self, name: str) -> np.ndarray:
        """A dense tensor's values, or an embedding table's rows (memory-mapped)."""
        entry = self.entry(name)
        v = self._load(entry, "values")
        spec = entry.spec
        want = spec.shape if isinstance(spec, DenseSpec) else (entry.rows, spec.dim)
        if v.shape != want or v.dtype != np.dtype(spec.dtype):
            raise BadRequestError(
                f"export of {name!r}: values of shape {v.shape} {v.dtype}, "
                f"the manifest says {want} {spec.dtype}"
            )
        return v

    def state(self, name: str) -> dict[str, np.ndarray] | None:
        """The optimizer state columns of ``name`` (memory-mapped; an embedding table's
        ``(rows, width)`` in the order of :meth:`values`, a dense tensor's 1-D, chunk by
        chunk), or None if the export carries none for it (``--values-only``, or
        written by a zps that exported values only)."""
        entry = self.entry(name)
        keys = self.manifest_entry(name).get("state")
        if not keys:
            return None
        spec = entry.spec
        widths = spec.optimizer.state_widths(spec.dim if isinstance(spec, EmbeddingSpec) else 1)
        if set(keys) != set(widths):
            raise BadRequestError(
                f"export of {name!r}: state columns {sorted(keys)}; its optimizer "
                f"({spec.optimizer.kind}) keeps {sorted(widths)}"
            )
        out = {}
        for k in keys:
            a = self._load(entry, f"state.{k}")
            if isinstance(spec, EmbeddingSpec):
                want: tuple[int, ...] = (entry.rows or 0, widths[k])
            else:
                want = (dense_state_size(spec, k),)
            if a.shape != want or a.dtype != np.dtype(spec.dtype):
                raise BadRequestError(
                    f"export of {name!r}: state {k!r} of shape {a.shape} {a.dtype}, "
                    f"expected {want} {spec.dtype}"
                )
            out[k] = a
        return out

    def manifest_entry(self, name: str) -> dict[str, Any]:
        """The manifest's entry of the table ``name``."""
        self.entry(name)
        return next(t for t in self.manifest["tables"] if t["spec"]["name"] == name)

    def ids(self, name: str) -> np.ndarray:
        """An embedding table's ids (memory-mapped), in the order of :meth:`values`."""
        entry = self.entry(name)
        if entry.kind != "embedding":
            raise BadRequestError(f"{name!r} is a dense tensor in this export: it has no ids")
        ids = self._load(entry, "ids")
        if ids.shape != (entry.rows,) or ids.dtype != np.int64:
            raise BadRequestError(
                f"export of {name!r}: ids of shape {ids.shape} {ids.dtype}, "
                f"expected ({entry.rows},) int64"
            )
        return ids


def apply_delta(
    base: str | os.PathLike[str], delta: str | os.PathLike[str], out: str | os.PathLike[str]
) -> Path:
    """Write into ``out`` the full export that ``delta`` (``export --since base``) brings
    ``base`` to: every table of the delta (changed dense tensors whole; embedding rows of
    the base without the removed ids and the delta's rows, replaced or added), the base's
    other tables as they were, minus the dropped ones.  Returns the manifest's path."""
    b, d = Export(base), Export(delta)
    if not d.is_delta:
        raise BadRequestError(f"{d.path} is not a delta export (no 'delta_of')")
    writer = ExportWriter(out, {"kind": "delta-applied", "base": str(b.path), "delta": str(d.path)})
    dropped = set(d.manifest.get("dropped", []))
    names = sorted((set(b.tables) - dropped) | set(d.tables))
    for name in names:
        src = d if name in d.tables else b
        entry = src.entry(name)
        spec = entry.spec
        if isinstance(spec, DenseSpec):
            values = writer.dense(spec)
            values[...] = src.values(name)
            values.flush()
            continue
        assert isinstance(spec, EmbeddingSpec)
        new_ids = d.ids(name) if src is d else np.empty(0, dtype=np.int64)
        gone = np.concatenate([d.removed(name), new_ids]) if src is d else new_ids
        old_ids = b.ids(name) if name in b.tables and b.entry(name).spec == spec else None
        keep = np.flatnonzero(~np.isin(old_ids, gone)) if old_ids is not None else np.empty(0, int)
        sink = writer.embedding(spec, keep.shape[0] + new_ids.shape[0])
        if old_ids is not None and keep.size:
            sink.write(np.asarray(old_ids)[keep], np.asarray(b.values(name))[keep])
        if src is d and new_ids.size:
            sink.write(new_ids, np.asarray(d.values(name)))
        sink.close()
    writer.finish({int(p): v for p, v in d.manifest.get("partitions", {}).items()})
    return writer.out / MANIFEST
