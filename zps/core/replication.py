"""Replication bookkeeping, without I/O.

A primary gives every message that mutates state a log sequence number (LSN)
and streams it to its replicas, which apply messages strictly in LSN order.

Rules:

1. With ``acks=all`` a write is acknowledged only once every replica in the
   *required* set has applied it (:class:`AckTracker`).  The required set is
   what the broker publishes as in-sync, plus replicas this primary has seen
   catch up but the broker has not confirmed yet: the primary waits for at
   least everyone the broker might promote.
2. A replica leaves the required set only when the broker's map drops it; a
   primary never decides alone to acknowledge without a replica the broker may
   still promote.
3. Acknowledgements release waiting writes strictly in LSN order.
4. A replica accepts the stream only from its primary's epoch and only the
   message that follows its LSN (:func:`check_stream`: a message carries the
   primary's LSN before and after it); anything else means it must
   resynchronise from a snapshot.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class AckTracker(Generic[T]):
    """Holds writes (any item) until the required replicas have applied them."""

    def __init__(self) -> None:
        self.required: frozenset[str] = frozenset()
        self.acked: dict[str, int] = {}
        #: The highest LSN released (acknowledged) so far.
        self.released = 0
        self._waiting: deque[tuple[int, T]] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def committed(self) -> int | None:
        """The LSN every required replica has applied (None: no replica required)."""
        if not self.required:
            return None
        return min(self.acked.get(node, 0) for node in self.required)

    def add(self, lsn: int, item: T) -> list[T]:
        """``item`` waits until the required replicas applied ``lsn``; several may wait
        for one LSN (a write and a re-sent copy of it answered from the dedup record)."""
        if self._waiting and lsn < self._waiting[-1][0]:
            raise ValueError(f"LSN {lsn} added after {self._waiting[-1][0]}")
        self._waiting.append((lsn, item))
        return self._release()

    def ack(self, node: str, lsn: int) -> list[T]:
        if lsn > self.acked.get(node, 0):
            self.acked[node] = lsn
        return self._release()

    def set_required(self, nodes: Iterable[str]) -> list[T]:
        self.required = frozenset(nodes)
        for node in list(self.acked):
            if node not in self.required:
                del self.acked[node]
        return self._release()

    def require(self, node: str, acked_lsn: int) -> None:
        """Add one replica (it caught up) without releasing anything."""
        self.required = self.required | {node}
        self.acked[node] = max(self.acked.get(node, 0), acked_lsn)

    def take_all(self) -> list[T]:
        """Remove every waiting write (the primary stepped down: fail them)."""
        items = [item for _, item in self._waiting]
        self._waiting.clear()
        return items

    def _release(self) -> list[T]:
        committed = self.committed
        out: list[T] = []
        while self._waiting and (committed is None or self._waiting[0][0] <= committed):
            lsn, item = self._waiting.popleft()
            self.released = max(self.released, lsn)
            out.append(item)
        return out


class StreamCheck(enum.Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"  # already applied (a resent message): ignore
    RESYNC = "resync"  # a gap or another epoch: take a fresh snapshot


def check_stream(*, my_epoch: int, my_lsn: int, epoch: int, prev_lsn: int, lsn: int) -> StreamCheck:
    if epoch != my_epoch:
        return StreamCheck.RESYNC
    if prev_lsn == my_lsn:
        return StreamCheck.APPLY
    if lsn <= my_lsn:
        return StreamCheck.DUPLICATE
    return StreamCheck.RESYNC
