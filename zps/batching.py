"""Coalescing of small operations into messages, per partition.

The client queues every operation for a partition issued within one event
loop turn and sends them as few messages as the limits allow.  A single
operation larger than ``max_bytes`` still travels (alone): limits bound
batching, they never refuse work.  Order within a partition is preserved.
"""

from __future__ import annotations

from collections.abc import Sequence


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
