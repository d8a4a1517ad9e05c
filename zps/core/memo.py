"""Answers for recently seen id arrays, matched by content.

A training step pulls a batch's rows and then pushes gradients for the same
ids, so work keyed by the id array (a table's row positions, a client's split
by partition) is often asked for twice in a row.  :class:`IdsMemo` keeps the
last few answers; a lookup compares arrays (microseconds for thousands of
ids), which pays only for batches of at least ``min_len`` ids.
"""

from __future__ import annotations

import collections
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from zps.core.rows import same_ids

V = TypeVar("V")


class IdsMemo(Generic[V]):
    """The last ``size`` answers for id arrays of ``min_len``..``max_len`` ids.

    ``tag`` is part of the key, compared by identity (the cluster map a split
    was made under, say).  Stored answers are shared: callers must not modify
    them.
    """

    def __init__(self, size: int = 8, min_len: int = 256, max_len: int = 1 << 16) -> None:
        self.min_len, self.max_len = min_len, max_len
        self._entries: collections.deque[tuple[npt.NDArray[np.int64], object, V]] = (
            collections.deque(maxlen=size)
        )

    def get(self, ids: npt.NDArray[np.int64], tag: object = None) -> V | None:
        n = ids.shape[0]
        if not self.min_len <= n <= self.max_len:
            return None
        for seen, seen_tag, value in self._entries:
            if seen_tag is tag and seen.shape[0] == n and seen[0] == ids[0] and same_ids(seen, ids):
                return value
        return None

    def put(self, ids: npt.NDArray[np.int64], value: V, tag: object = None) -> None:
        if self.min_len <= ids.shape[0] <= self.max_len:
            self._entries.append((ids.copy(), tag, value))

    def clear(self) -> None:
        self._entries.clear()
