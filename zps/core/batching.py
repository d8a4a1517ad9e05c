"""Coalescing of small operations into messages and operations, per partition.

The client queues every operation for a partition issued within one event
loop turn and sends them as few messages as the limits allow.  A single
operation larger than ``max_bytes`` still travels (alone): limits bound
batching, they never refuse work.  Order within a partition is preserved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def plan_batches(sizes: Sequence[int], max_ops: int, max_bytes: int) -> list[tuple[int, int]]:
    """Split operations of the given payload sizes into ``[start, stop)`` runs."""
    if max_ops < 1 or max_bytes < 1:
        raise ValueError("max_ops and max_bytes must be >= 1")
    runs: list[tuple[int, int]] = []
    start, nbytes = 0, 0
    for i, size in enumerate(sizes):
        if i > start and (i - start >= max_ops or nbytes + size > max_bytes):
            runs.append((start, i))
            start, nbytes = i, 0
        nbytes += size
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


MERGEABLE = frozenset({"push_rows", "pull_rows"})


@dataclass(frozen=True)
class Merged:
    """One operation standing for several: ``parts`` are ``(op index, start, stop)``,
    the rows of each original operation within the merged ``ids``."""

    body: dict[str, Any]
    arrays: dict[str, np.ndarray]
    parts: tuple[tuple[int, int, int], ...]


def merge_row_ops(
    ops: Sequence[tuple[dict[str, Any], dict[str, np.ndarray]]], max_members: int = 1 << 30
) -> list[Merged]:
    """Fold row operations on the same table into one operation each.

    Pulls of one table merge freely.  Pushes merge only while their ids do not
    overlap: the shard sums duplicate ids of one push into one update, which
    for Adagrad, Adam or FTRL differs from two updates in a row.  Any other
    operation passes through alone and closes the open groups of its table,
    so the order of operations on one table is kept.
    """
    groups: list[tuple[dict[str, Any], list[int], list[dict[str, np.ndarray]]]] = []
    open_groups: dict[tuple[Any, ...], int] = {}
    # The ids of a push group, as a set once a second push wants to join it
    # (a lone push, the common case, never pays for the set).
    seen_ids: dict[int, set[int] | None] = {}
    for i, (body, arrays) in enumerate(ops):
        name, table = body.get("op"), body.get("t")
        ids = arrays.get("ids")
        if name not in MERGEABLE or ids is None or ids.ndim != 1:
            for key in [k for k in open_groups if k[1] == table]:
                del open_groups[key]
            groups.append((body, [i], [arrays]))
            continue
        key = (name, table, body.get("step"))
        g = open_groups.get(key)
        if g is not None and len(groups[g][1]) >= max_members:
            g = None
        if g is not None and name == "push_rows":
            seen = seen_ids[g]
            if seen is None:
                seen = seen_ids[g] = set(groups[g][2][0]["ids"].tolist())
            new = ids.tolist()
            if seen.isdisjoint(new):
                seen.update(new)
            else:
                g = None  # an overlap: this push starts a new group
        if g is None:
            open_groups[key] = g = len(groups)
            seen_ids[g] = None
            groups.append((body, [], []))
        groups[g][1].append(i)
        groups[g][2].append(arrays)
    out = []
    for body, members, arrays_list in groups:
        if len(members) == 1:
            ids = arrays_list[0].get("ids")
            out.append(
                Merged(body, arrays_list[0], ((members[0], 0, 0 if ids is None else ids.size),))
            )
            continue
        merged = {k: np.concatenate([a[k] for a in arrays_list]) for k in arrays_list[0]}
        bounds = np.cumsum([0, *(a["ids"].size for a in arrays_list)]).tolist()
        out.append(
            Merged(
                body, merged, tuple((m, bounds[j], bounds[j + 1]) for j, m in enumerate(members))
            )
        )
    return out
