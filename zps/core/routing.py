"""Where data lives: ids and dense chunks -> slots -> partitions.

``slot = mix64(id) % n_slots`` and ``partition = slot_map[slot]``.  The slot
count is fixed for the life of a cluster, so partitions can later be added or
moved by reassigning slots without rehashing ids.  Dense tensors are cut into
chunks; chunk ``i`` of tensor ``name`` sits on slot ``(name_hash + i) %
n_slots``, which spreads a big tensor over every partition.

Pure functions over numpy arrays; no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zps.core.hashing import mix64, mix64_int, name_hash
from zps.errors import ProtocolError
from zps.protocol.ops import CHUNK_OPS, ROW_OPS

DEFAULT_SLOTS = 4096
_M64 = (1 << 64) - 1
_FIRST = np.zeros(1, dtype=np.intp)
_FIRST.flags.writeable = False

I64 = npt.NDArray[np.int64]


def default_slot_map(n_slots: int, n_partitions: int) -> npt.NDArray[np.int32]:
    """Round-robin slots over partitions: an even spread for ids and chunks."""
    return (np.arange(n_slots, dtype=np.int64) % n_partitions).astype(np.int32)


@dataclass(frozen=True)
class PartitionInfo:
    """What the cluster map says of one partition."""

    epoch: int = 0
    primary: str | None = None
    replicas: tuple[str, ...] = ()
    in_sync: tuple[str, ...] = ()
    #: No copy of the partition is left: requests fail instead of waiting.
    lost: bool = False
    #: The endpoint of the routing broker its requests go to ("": the broker itself).
    router: str = ""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "epoch": self.epoch,
            "primary": self.primary,
            "replicas": list(self.replicas),
            "in_sync": list(self.in_sync),
            "lost": self.lost,
        }
        if self.router:
            out["router"] = self.router
        return out


@dataclass(frozen=True)
class RouterInfo:
    """A routing broker (``zps-server broker --follow``) the map lists."""

    name: str
    endpoint: str
    host: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "endpoint": self.endpoint, "host": self.host}


@dataclass(frozen=True)
class ClusterMap:
    """A versioned, immutable picture of the cluster; a change makes a new map."""

    version: int
    n_slots: int
    slot_map: npt.NDArray[np.int32]
    partitions: Mapping[int, PartitionInfo] = field(default_factory=dict)
    #: Which life of the broker made this map: versions restart at a new one.
    incarnation: str = ""
    #: The routing brokers that route requests (see ``PartitionInfo.router``).
    routers: tuple[RouterInfo, ...] = ()

    @property
    def n_partitions(self) -> int:
        return len(self.partitions)

    @functools.cached_property
    def slot_list(self) -> list[int]:
        """``slot_map`` as Python ints, for routing a few ids without numpy."""
        return [int(p) for p in self.slot_map.tolist()]

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "n_slots": self.n_slots,
            "slot_map": self.slot_map.astype("<i4").tobytes(),
            "partitions": {str(p): info.to_wire() for p, info in sorted(self.partitions.items())},
            "incarnation": self.incarnation,
            **({"routers": [r.to_wire() for r in self.routers]} if self.routers else {}),
        }

    @staticmethod
    def from_wire(obj: object) -> ClusterMap:
        """Parse a map received from the broker (ProtocolError if malformed)."""

        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ValueError(what)

        try:
            need(isinstance(obj, dict), "not a map")
            assert isinstance(obj, dict)  # for the type checker
            version, n_slots, raw = obj["version"], obj["n_slots"], obj["slot_map"]
            need(type(version) is int and type(n_slots) is int and n_slots > 0, "bad sizes")
            need(isinstance(raw, bytes) and len(raw) == 4 * n_slots, "bad slot_map")
            slot_map = np.frombuffer(raw, dtype="<i4").astype(np.int32)
            incarnation = obj.get("incarnation", "")
            need(isinstance(incarnation, str), "bad incarnation")
            parts: dict[int, PartitionInfo] = {}
            for key, info in obj["partitions"].items():
                primary, epoch = info["primary"], info["epoch"]
                need(primary is None or isinstance(primary, str), "bad primary")
                need(type(epoch) is int and epoch >= 0, "bad epoch")
                parts[int(key)] = PartitionInfo(
                    epoch=epoch,
                    primary=primary,
                    replicas=_names(info["replicas"]),
                    in_sync=_names(info["in_sync"]),
                    lost=info.get("lost", False) is True,
                    router=_router_endpoint(info.get("router", "")),
                )
            routers = tuple(
                RouterInfo(
                    _router_endpoint(r["name"]),
                    _router_endpoint(r["endpoint"]),
                    _router_endpoint(r.get("host", "")),
                )
                for r in obj.get("routers", [])
            )
            need(sorted(parts) == list(range(len(parts))), "partitions must be 0..n-1")
            need(
                slot_map.size == 0
                or (int(slot_map.min()) >= 0 and int(slot_map.max()) < len(parts)),
                "slot_map names unknown partitions",
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise ProtocolError(f"malformed cluster map: {type(e).__name__} {e}") from None
        return ClusterMap(version, n_slots, slot_map, parts, incarnation, routers)


def _router_endpoint(obj: object) -> str:
    if not isinstance(obj, str):
        raise ValueError("router fields must be strings")
    return obj


def _names(obj: object) -> tuple[str, ...]:
    if not isinstance(obj, list) or not all(isinstance(x, str) for x in obj):
        raise ValueError("node lists must be lists of strings")
    return tuple(obj)


def partitions_of_ids(ids: I64, cmap: ClusterMap) -> npt.NDArray[np.int32]:
    n = cmap.n_slots
    h = mix64(ids)
    # A power-of-two slot count (the default) needs a mask, not a 64-bit division.
    h = h & np.uint64(n - 1) if n & (n - 1) == 0 else h % np.uint64(n)
    return cmap.slot_map[h.view(np.int64)]


#: Below this many ids, routing in plain Python beats numpy's per-call overhead.
SMALL_IDS = 16
#: Up to this many partitions, one comparison pass per partition beats sorting
#: (figures: docs/performance.md, "Figures behind the code's rules").
SPLIT_BY_MASK = 8


def split_by_partition(ids: I64, cmap: ClusterMap) -> list[tuple[int, npt.NDArray[np.intp]]]:
    """``(partition, positions)`` pairs, by partition: the positions in ``ids`` each owns."""
    if ids.size == 1:  # one-row calls are common enough for their own path
        return [(cmap.slot_list[mix64_int(int(ids[0]) & _M64) % cmap.n_slots], _FIRST)]
    if ids.size <= SMALL_IDS:
        n_slots, slot_list = cmap.n_slots, cmap.slot_list
        owner = [slot_list[mix64_int(x & _M64) % n_slots] for x in ids.tolist()]
        if owner and owner.count(owner[0]) == len(owner):
            return [(owner[0], np.arange(len(owner), dtype=np.intp))]
        owners: dict[int, list[int]] = {}
        for pos, p in enumerate(owner):
            owners.setdefault(p, []).append(pos)
        return [(p, np.array(owners[p], dtype=np.intp)) for p in sorted(owners)]
    parts = partitions_of_ids(ids, cmap)
    if parts.size == 0:
        return []
    if cmap.n_partitions <= SPLIT_BY_MASK:
        out = []
        for p in range(cmap.n_partitions):
            mine = np.flatnonzero(parts == p)
            if mine.size:
                out.append((p, mine))
        return out
    order = np.argsort(parts, kind="stable")
    sorted_parts = parts[order]
    bounds = np.flatnonzero(np.diff(sorted_parts)) + 1
    starts = np.concatenate(([0], bounds))
    stops = np.concatenate((bounds, [sorted_parts.size]))
    return [
        (int(sorted_parts[start]), order[start:stop])
        for start, stop in zip(starts.tolist(), stops.tolist(), strict=True)
    ]


def chunk_partition(name: str, chunk: int, cmap: ClusterMap) -> int:
    return int(cmap.slot_map[(name_hash(name) + chunk) % cmap.n_slots])


def dense_chunk_elems(
    size: int,
    itemsize: int,
    n_partitions: int,
    target_bytes: int = 2 << 20,
    min_bytes: int = 256 << 10,
) -> int:
    """Elements per chunk for a dense tensor.

    Small tensors stay whole (one chunk on one partition).  Large ones are cut
    into chunks of about ``target_bytes`` and at least one chunk per partition,
    so one big tensor keeps every shard busy.
    """
    nbytes = size * itemsize
    if nbytes <= min_bytes or (n_partitions <= 1 and nbytes <= target_bytes):
        return max(size, 1)
    per_part = -(-nbytes // max(n_partitions, 1))
    chunk_bytes = max(min_bytes, min(target_bytes, per_part))
    return max(1, chunk_bytes // itemsize)


@dataclass(frozen=True)
class Resplit:
    """One operation split again by a newer map (after a ``MOVED`` answer): the pieces
    to send (partition, body, arrays, reply bytes), and how to join their results."""

    pieces: list[tuple[int, dict[str, Any], dict[str, npt.NDArray[Any]], int]]
    #: pull_rows: each piece's positions in the original ids; pull_dense: its chunks.
    positions: list[Any]
    kind: str
    n: int = 0
    chunks: tuple[int, ...] = ()


def resplit(
    body: dict[str, Any], arrays: dict[str, npt.NDArray[Any]], reply_bytes: int, cmap: ClusterMap
) -> Resplit | None:
    """Split an operation refused ``MOVED`` by ``cmap`` (None: not a slot operation)."""
    name = body.get("op")
    if name in ROW_OPS and "ids" in arrays:
        ids = arrays["ids"]
        n = int(ids.shape[0])
        pieces, positions = [], []
        for p, pos in split_by_partition(ids, cmap):
            sub = {k: (a[pos] if a.shape[:1] == (n,) else a) for k, a in arrays.items()}
            pieces.append((p, dict(body), sub, reply_bytes * pos.size // max(n, 1)))
            positions.append(pos)
        return Resplit(pieces, positions, "rows" if name == "pull_rows" else "ok", n)
    if name in CHUNK_OPS and isinstance(body.get("t"), str) and type(body.get("chunk")) is int:
        p = chunk_partition(body["t"], body["chunk"], cmap)
        return Resplit([(p, dict(body), arrays, reply_bytes)], [None], "ok")
    chunks = body.get("chunks")
    if name == "pull_dense" and isinstance(body.get("t"), str) and isinstance(chunks, list):
        by_part: dict[int, list[int]] = {}
        for c in chunks:
            by_part.setdefault(chunk_partition(body["t"], c, cmap), []).append(c)
        total = max(len(chunks), 1)
        return Resplit(
            [
                (p, {**body, "chunks": cs}, {}, reply_bytes * len(cs) // total)
                for p, cs in by_part.items()
            ],
            list(by_part.values()),
            "chunks",
            chunks=tuple(chunks),
        )
    return None


def join_resplit(plan: Resplit, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The result of the original operation from its pieces' results (in order)."""
    if plan.kind == "rows":
        first = results[0]["arrays"]
        rows = np.empty((plan.n, *first.shape[1:]), dtype=first.dtype)
        for pos, res in zip(plan.positions, results, strict=True):
            rows[pos] = res["arrays"]
        return {"st": "OK", "arrays": rows}
    if plan.kind == "chunks":
        got: dict[int, Any] = {}
        for cs, res in zip(plan.positions, results, strict=True):
            got.update(zip(cs, res["arrays"], strict=True))
        return {"st": "OK", "arrays": [got[c] for c in plan.chunks]}
    return {"st": "OK"}
