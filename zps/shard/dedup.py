"""The dedup record: statuses of recently applied messages, keyed by ``(client_id,
seq)``, bounded in bytes (rule 3 of :mod:`zps.shard.core`).  No I/O."""

from __future__ import annotations

import collections
import sys
from collections.abc import Sequence
from typing import Any

OK: dict[str, Any] = {"st": "OK"}
#: A recorded list of statuses, or the number of statuses when all are ``OK``.
_Record = int | list[dict[str, Any]]

#: What one dedup entry costs beyond its statuses: the ordered-dict node, the
#: key tuple and its seq (the client id is counted by its size).
ENTRY_OVERHEAD = 300
#: What one client's high-water mark costs beyond its id.
FLOOR_OVERHEAD = 160


def _deep_size(value: object) -> int:
    """Bytes held by a msgpack-like value (dicts, lists, str, bytes, numbers)."""
    n = sys.getsizeof(value)
    if isinstance(value, dict):
        # keys are the handlers' own literals, shared by every status
        n += sum(_deep_size(v) for v in value.values())
    elif isinstance(value, list | tuple):
        n += sum(_deep_size(v) for v in value)
    return n


def _record_size(statuses: list[dict[str, Any]]) -> int:
    """Bytes held by one recorded list of statuses, a status shared by several
    operations (like :data:`OK`) counted once."""
    n = sys.getsizeof(statuses)
    seen: set[int] = set()
    for s in statuses:
        if s is not OK and id(s) not in seen:
            seen.add(id(s))
            n += _deep_size(s)
    return n


class DedupCache:
    """Statuses of recently applied messages, keyed by ``(client_id, seq)``.

    Bounded in bytes (``max_bytes``, counting each entry's statuses, key and
    bookkeeping) and in entries (``capacity``); the oldest entries go first.
    A record whose statuses are all ``OK`` is kept as a count.

    Each client's highest evicted seq is kept (its *floor*, a few hundred
    bytes per client, counted in the same budget): a message of that client
    with a seq at or below its floor that is not in the record anymore may
    have been applied, so :meth:`expired` says so and it is refused instead of
    applied a second time.  A client's seqs only grow, so the floor only
    catches messages that are retried, or delayed, for longer than the record
    lasts.  Floors go only when nothing else is left to evict.
    """

    def __init__(self, max_bytes: int = 64 << 20, capacity: int = 200_000) -> None:
        self.max_bytes = max_bytes
        self.capacity = capacity
        self.nbytes = 0
        self.evicted = 0
        self._seen: collections.OrderedDict[tuple[bytes, int], tuple[_Record, int]] = (
            collections.OrderedDict()
        )
        self._floors: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def get(self, key: tuple[bytes, int]) -> list[dict[str, Any]] | None:
        found = self._seen.get(key)
        if found is None:
            return None
        record = found[0]
        return [OK] * record if isinstance(record, int) else record

    def expired(self, key: tuple[bytes, int]) -> int | None:
        """The client's floor if ``key`` is not recorded but may have been applied."""
        floor = self._floors.get(key[0])
        if floor is None or key[1] > floor or key in self._seen:
            return None
        return floor

    def put(self, key: tuple[bytes, int], statuses: list[dict[str, Any]]) -> None:
        record: _Record
        if statuses and all(s is OK or s == OK for s in statuses):
            record, size = len(statuses), ENTRY_OVERHEAD + len(key[0])
        else:
            record, size = statuses, ENTRY_OVERHEAD + len(key[0]) + _record_size(statuses)
        old = self._seen.get(key)
        if old is not None:
            self.nbytes -= old[1]
        self._seen[key] = (record, size)
        self.nbytes += size
        self._evict()

    def _evict(self) -> None:
        while self._seen and (len(self._seen) > self.capacity or self.nbytes > self.max_bytes):
            (cid, seq), (_, size) = self._seen.popitem(last=False)
            self.nbytes -= size
            self.evicted += 1
            floor = self._floors.pop(cid, None)
            if floor is None:
                self.nbytes += FLOOR_OVERHEAD + len(cid)
            self._floors[cid] = seq if floor is None else max(floor, seq)
        while self._floors and self.nbytes > self.max_bytes:
            cid, _ = self._floors.popitem(last=False)
            self.nbytes -= FLOOR_OVERHEAD + len(cid)

    def __len__(self) -> int:
        return len(self._seen)

    def entries(self) -> list[tuple[bytes, int, list[dict[str, Any]]]]:
        return [
            (cid, seq, [OK] * record if isinstance(record, int) else record)
            for (cid, seq), (record, _) in self._seen.items()
        ]

    def floors(self) -> list[tuple[bytes, int]]:
        """Each client's highest evicted seq, least recently raised first."""
        return list(self._floors.items())

    def load(
        self,
        entries: list[tuple[bytes, int, list[dict[str, Any]]]],
        floors: Sequence[tuple[bytes, int]] = (),
    ) -> None:
        self._seen.clear()
        self._floors.clear()
        self.nbytes = 0
        for cid, floor in floors:
            self._floors[cid] = floor
            self.nbytes += FLOOR_OVERHEAD + len(cid)
        for cid, seq, statuses in entries:
            self.put((cid, seq), statuses)


def expired_status(key: tuple[bytes, int], floor: int) -> dict[str, Any]:
    cid, seq = key
    return {
        "st": "BAD_REQUEST",
        "msg": f"message {seq} of client {cid[:16]!r} is older than this shard's dedup "
        f"record (it forgot this client's messages up to {floor}): it may have been "
        "applied already, so it is not applied again",
    }
