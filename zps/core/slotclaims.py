"""The slot map a broker without its record learns from the shards' claims.

Live resharding changes the slot map, and with it the partition count; the broker keeps
both in its state record.  A broker that starts without that record (its data dir lost)
would otherwise route by the default map of its configured partition count, which the
shards, serving the slots they were last given, answer ``MOVED`` for ever.  Each
shard's claim carries the slots it serves and the map version they match
(``ShardClaim.slots``); during the start-up hold the broker takes them.

The same holds for a broker of a pair that takes over with a record found stale
(BinaryStar rule 7: a shard obeyed a newer term, whose active broker may have moved
slots the record does not know of).

Rules:

1. Only a broker that restored no record, or one whose record is stale, and only during
   its start-up hold (no write is routed), learns slots from claims; a current record's
   map is never overridden, nor a stale one's by claims of its version or older.
2. Per partition, the claim of the newest map version counts (a copy that missed the
   latest moves claims an older one).
3. The map is the recorded one (none: the default one of the configured partition
   count), then each partition's claimed slots in the order of their versions: a slot
   claimed by two partitions goes to the newer claim (a slot leaves its source only
   after its destination serves it).
4. The partition count becomes the highest partition owning a slot, plus one (a claim
   of a partition past the configured count grows the cluster; partitions past the
   highest owner that nobody serves are dropped).
5. The broker's map versions continue past the newest claimed version, so every shard
   takes the maps that follow.
6. A broker without a record finishes, once its hold is over, the moves the claims show
   under way (their slots fenced at a source, or imported at a destination), one at a
   time as a broker taking over does with a recorded one: slots the map gives to
   another partition, which serves them (it activated them), are released at the
   source (the move completed); the others are unfenced at the source and dropped from
   the destination's import (the move cancelled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from zps.core.routing import default_slot_map

#: A move a record-less broker finishes (rule 6): source, destination (-1: none), its
#: slots, and the stage of a recorded one it is finished as ("copied": completed,
#: "copying": cancelled).
Orphan = tuple[int, int, tuple[int, ...], str]


@dataclass(frozen=True)
class Learned:
    """A new slot map from the claims: its partition count and the version to pass."""

    slot_map: npt.NDArray[np.int32]
    partitions: int
    version: int


class SlotClaims:
    """The slots claimed per partition during a record-less broker's hold."""

    def __init__(
        self,
        n_slots: int,
        configured: int,
        *,
        base: npt.NDArray[np.int32] | None = None,
        floor: int = 0,
    ) -> None:
        self.n_slots = n_slots
        self.configured = configured
        #: The stale record's map and its version (rule 1): claims of it or older count not.
        self.base = base
        self.floor = floor
        self._fenced: dict[int, npt.NDArray[np.bool_]] = {}
        self._importing: dict[int, npt.NDArray[np.bool_]] = {}
        self._claimed: dict[int, tuple[int, npt.NDArray[np.bool_]]] = {}

    @property
    def newest(self) -> int:
        """The newest map version claimed (0: none)."""
        return max((v for v, _ in self._claimed.values()), default=0)

    def learn(self, partition: int, bits: bytes, version: int) -> str | None:
        """Take one claim's slots (rules 2-3); returns why they were not taken, if not."""
        n = self.n_slots
        if len(bits) != -(-n // 8):
            return f"its slots are of another slot count ({len(bits) * 8} bits for {n} slots)"
        owned = np.unpackbits(np.frombuffer(bits, dtype=np.uint8))[:n].astype(np.bool_)
        known = self._claimed.get(partition)
        if version <= self.floor or (known is not None and known[0] >= version):
            return None  # a copy of the same or a newer map claimed already
        self._claimed[partition] = (version, owned)
        return None

    def slot_map(self) -> npt.NDArray[np.int32]:
        """The map the claims so far make (rule 3)."""
        if self.base is not None:
            slot_map = self.base.copy()
        else:
            slot_map = default_slot_map(self.n_slots, self.configured)
        for p, (_, owned) in sorted(self._claimed.items(), key=lambda kv: (kv[1][0], kv[0])):
            slot_map[owned] = p
        return slot_map

    def take(
        self,
        node_id: str,
        partition: int,
        bits: bytes,
        version: int,
        current: npt.NDArray[np.int32],
        served: Sequence[bool],
    ) -> tuple[tuple[str, str] | None, Learned | None]:
        """The claim of ``node_id``: a notice for the operator and the map it makes, if
        it changes ``current`` (``served[p]``: partition p has a copy; rule 4)."""
        why_not = self.learn(partition, bits, version)
        if why_not is not None:
            msg = f"shard {node_id}'s claim of p{partition}: {why_not}; its slots are not taken"
            return ("error", msg), None
        slot_map = self.slot_map()
        if np.array_equal(slot_map, current):
            return None, None
        need = int(slot_map.max()) + 1
        if any(served[need:]):
            need = len(served)  # a partition past the owners is served: kept
        counts = np.bincount(slot_map, minlength=need).tolist()
        msg = (
            f"{'a stale' if self.base is not None else 'no'} state record: the slot map "
            f"is the shards' (p{partition} claims "
            f"{counts[partition]} slots at map version {version}); {need} partitions, "
            f"slots per partition {counts}"
        )
        return ("warning", msg), Learned(slot_map, need, self.newest)

    def note_moves(self, partition: int, fenced: bytes | None, importing: bytes | None) -> None:
        """A claim's slots under a move (rule 6), joined over the partition's copies."""
        n = self.n_slots
        for bits, into in ((fenced, self._fenced), (importing, self._importing)):
            if bits is None or len(bits) != -(-n // 8):
                continue
            mask = np.unpackbits(np.frombuffer(bits, dtype=np.uint8))[:n].astype(np.bool_)
            if mask.any():
                into[partition] = into[partition] | mask if partition in into else mask

    def orphans(self, slot_map: npt.NDArray[np.int32]) -> list[Orphan]:
        """The moves the claims show under way, as ``slot_map`` stands (rule 6)."""
        out: list[Orphan] = []
        importing = {q: m.copy() for q, m in sorted(self._importing.items())}
        for p, fenced in sorted(self._fenced.items()):
            for q in sorted({int(x) for x in slot_map[fenced]} - {p}):
                done = fenced & (slot_map == q)
                out.append((p, q, _slots(done), "copied"))
            rest = fenced & (slot_map == p)
            for q, imp in importing.items():
                both = rest & imp
                if both.any():
                    out.append((p, q, _slots(both), "copying"))
                    rest &= ~both
                    imp &= ~both
            if rest.any():
                out.append((p, -1, _slots(rest), "copying"))
        out += [(-1, q, _slots(imp), "copying") for q, imp in importing.items() if imp.any()]
        return out


def _slots(mask: npt.NDArray[np.bool_]) -> tuple[int, ...]:
    return tuple(int(s) for s in np.flatnonzero(mask))
