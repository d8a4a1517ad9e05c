"""Synchronous training on a shard: gradients buffered per step, applied once.

In ``sync`` mode a push carries the worker's step; the shard validates it and
keeps it here instead of applying it.  When the broker commits step ``c``
with the set of workers that finished it, their step-``c`` gradients are
averaged (summed, divided by the number of workers) and applied once per
tensor chunk or table; gradients of workers not in the set are dropped.

Rules: a step is committed once and in order (``committed`` only grows); a
push for a step already committed is refused; the buffer travels with
snapshots and checkpoints, so a promoted replica commits what its primary
buffered.  No I/O.

Bounds: a push may be for at most ``window`` steps past the last committed one
(the broker's clock keeps sync workers within one step of it), else
``BAD_REQUEST`` naming the step; the buffered gradients hold at most
``max_bytes``, else ``OVERLOADED``.  Both are decided from the buffer's own
state, so a replica re-running its primary's pushes decides the same way when
it has the same limits.  A snapshot is loaded whole, whatever it holds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from zps.errors import BadRequestError, OverloadedError
from zps.store import PartitionStore

#: What one buffered push costs beyond its arrays, its client id and table name.
ENTRY_OVERHEAD = 300


def is_entry(e: object) -> bool:
    """``e`` has the shape of an exported entry, ``[step, cid, table, chunk, ids, grad]``
    (the arrays, in whatever form they travel, are the caller's to check)."""
    return (
        isinstance(e, list)
        and len(e) == 6
        and type(e[0]) is int
        and isinstance(e[1], bytes)
        and isinstance(e[2], str)
        and type(e[3]) is int
    )


@dataclass(frozen=True)
class Pending:
    step: int
    cid: bytes
    table: str
    chunk: int  # dense chunk, or -1 for embedding rows
    ids: np.ndarray | None
    grad: np.ndarray

    @property
    def nbytes(self) -> int:
        ids = 0 if self.ids is None else self.ids.nbytes
        return ENTRY_OVERHEAD + len(self.cid) + len(self.table) + ids + self.grad.nbytes


class StepBuffer:
    def __init__(self, *, window: int = 8, max_bytes: int = 2 << 30) -> None:
        self.window = window
        self.max_bytes = max_bytes
        self.committed = -1
        self.entries: list[Pending] = []
        self.nbytes = 0

    def add(self, entry: Pending) -> None:
        if entry.step <= self.committed:
            raise BadRequestError(
                f"step {entry.step} was already committed (the last committed "
                f"step is {self.committed}); pull and push for a later step"
            )
        if entry.step > self.committed + self.window:
            raise BadRequestError(
                f"step {entry.step} is too far ahead: the last committed step is "
                f"{self.committed} and pushes are taken for at most {self.window} "
                "steps past it"
            )
        size = entry.nbytes
        if self.nbytes + size > self.max_bytes:
            raise OverloadedError(
                f"the sync-mode step buffer holds {self.nbytes} bytes; a push of "
                f"{size} bytes for step {entry.step} would exceed its limit of "
                f"{self.max_bytes} (limits.step_buffer_bytes)"
            )
        self.entries.append(entry)
        self.nbytes += size

    def commit(self, store: PartitionStore, step: int, workers: Iterable[bytes]) -> bool:
        """Apply the average of ``workers``' step-``step`` gradients; False if already done."""
        if step <= self.committed:
            return False
        members = set(workers)
        scale = 1.0 / max(1, len(members))
        mine = [e for e in self.entries if e.step == step and e.cid in members]
        self.entries = [e for e in self.entries if e.step > step]
        self.nbytes = sum(e.nbytes for e in self.entries)
        self.committed = step
        dense: dict[tuple[str, int], np.ndarray] = {}
        rows: dict[str, list[Pending]] = defaultdict(list)
        for e in mine:
            if e.ids is None:
                key = (e.table, e.chunk)
                dense[key] = dense[key] + e.grad if key in dense else e.grad.copy()
            else:
                rows[e.table].append(e)
        for (name, chunk), g in sorted(dense.items()):
            store.dense(name).push(chunk, g * scale)
        for name, parts in sorted(rows.items()):
            ids = np.concatenate([p.ids for p in parts if p.ids is not None])
            grads = np.concatenate([p.grad for p in parts]) * scale
            store.embedding(name).push(ids, grads)
        return True

    def export(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "entries": [[e.step, e.cid, e.table, e.chunk, e.ids, e.grad] for e in self.entries],
        }

    def load(self, data: dict[str, Any]) -> None:
        committed, entries = data.get("committed", -1), data.get("entries", [])
        if type(committed) is not int or not isinstance(entries, list):
            raise BadRequestError("step buffer: malformed export")
        loaded = []
        for e in entries:
            if not (
                is_entry(e)
                and (e[4] is None or isinstance(e[4], np.ndarray))
                and isinstance(e[5], np.ndarray)
            ):
                raise BadRequestError("step buffer: malformed entry")
            loaded.append(Pending(e[0], e[1], e[2], e[3], e[4], e[5]))
        self.committed, self.entries = committed, loaded
        self.nbytes = sum(e.nbytes for e in loaded)
