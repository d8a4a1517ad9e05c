"""Coalescing of small operations into messages, and cutting of large ones, per partition.

The client queues every operation for a partition issued within one event
loop turn and sends them as few messages as the limits allow.  A single
operation larger than ``max_bytes`` still travels (alone): limits bound
batching, they never refuse work.  Order within a partition is preserved.

Large calls are cut before they are queued, so that no operation's request or
expected reply payload exceeds the message budget (see
:data:`zps.protocol.codec.MESSAGE_BUDGET`): :func:`row_runs` for pulls of rows
and dense chunks, :func:`split_push` for pushes of rows.  Sizes given to
:func:`plan_batches` and :func:`merge_row_ops` are an operation's cost: the
larger of its request payload and the reply payload it will get back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.core.rows import take_rows
from zps.protocol.ops import MERGEABLE


def row_runs(n_rows: int, row_bytes: int, budget: int) -> list[tuple[int, int]]:
    """Cut ``n_rows`` rows of ``row_bytes`` each into ``[start, stop)`` runs of at most
    ``budget`` bytes, as even as that allows (a row wider than the budget goes alone)."""
    if budget < 1 or row_bytes < 0 or n_rows < 0:
        raise ValueError("budget must be >= 1, row_bytes and n_rows >= 0")
    if n_rows == 0:
        return []
    per = max(1, budget // max(row_bytes, 1))
    n_runs = -(-n_rows // per)
    base, extra = divmod(n_rows, n_runs)
    runs, start = [], 0
    for i in range(n_runs):
        stop = start + base + (i < extra)
        runs.append((start, stop))
        start = stop
    return runs


def groups_by_bytes(sizes: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of consecutive items whose sizes sum to at most ``budget``
    (an item larger than the budget goes alone)."""
    return plan_batches(sizes, max(1, len(sizes)), budget)


def split_push(
    ids: npt.NDArray[np.int64], grads: np.ndarray, budget: int
) -> list[tuple[npt.NDArray[np.int64], np.ndarray]]:
    """Cut a push of rows into pushes of at most ``budget`` payload bytes (ids and
    gradients) each; a push that fits comes back whole, as given.

    A shard sums the gradients of duplicate ids of one push into one update, and
    two pushes of an id would be two updates (not the same for Adagrad, Adam or
    FTRL).  So a push that must be cut first sums its duplicates exactly as the
    shard does (stable sort by id, then ``np.add.reduceat``): each id travels once,
    and the shard applies the same values as it would for the whole push.  The
    parts carry ids in increasing order.
    """
    n = int(ids.shape[0])
    row_bytes = ids.itemsize + (grads.nbytes // n if n else 0)
    if n * row_bytes <= budget:
        return [(ids, grads)]
    order = np.argsort(ids, kind="stable")
    keys = ids[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    if starts.size == n:
        uniq, summed = keys, take_rows(grads, order)
    else:
        uniq, summed = keys[starts], np.add.reduceat(grads[order], starts, axis=0)
    return [(uniq[a:b], summed[a:b]) for a, b in row_runs(uniq.size, row_bytes, budget)]


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


@dataclass(frozen=True)
class Merged:
    """One operation standing for several: ``parts`` are ``(op index, start, stop)``,
    the rows of each original operation within the merged ``ids``."""

    body: dict[str, Any]
    arrays: dict[str, np.ndarray]
    parts: tuple[tuple[int, int, int], ...]


def merge_row_ops(
    ops: Sequence[tuple[dict[str, Any], dict[str, np.ndarray]]],
    max_members: int = 1 << 30,
    *,
    sizes: Sequence[int] | None = None,
    max_bytes: int = 1 << 62,
) -> list[Merged]:
    """Fold row operations on the same table into one operation each.

    Pulls of one table merge freely.  Pushes merge only while their ids do not
    overlap: the shard sums duplicate ids of one push into one update, which
    for Adagrad, Adam or FTRL differs from two updates in a row.  Any other
    operation passes through alone and closes the open groups of its table,
    so the order of operations on one table is kept.  A group takes at most
    ``max_members`` operations and, with ``sizes`` (each operation's cost, see
    the module notes), at most ``max_bytes`` of them: an operation that would
    take it past either starts a new group.
    """
    if sizes is not None and len(sizes) != len(ops):
        raise ValueError(f"{len(sizes)} sizes for {len(ops)} operations")
    group_bytes: dict[int, int] = {}
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
        size = 0 if sizes is None else sizes[i]
        if g is not None and (
            len(groups[g][1]) >= max_members or group_bytes[g] + size > max_bytes
        ):
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
            group_bytes[g] = 0
            groups.append((body, [], []))
        group_bytes[g] += size
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
