"""What a run is judged by at its end: pure functions of what its clients did and read,
each returning the checks that failed (the run reports them in this order)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from zps.core.routing import ClusterMap, PartitionInfo
from zps.testing.sim.simclient import Op


class Tables(Protocol):
    def checksum(self) -> str: ...


@dataclass
class Result:
    seed: int
    failures: list[str]
    schedule: list[str]
    digest: str
    events: int
    acked: int
    maybe: int
    unavailable: list[int]
    sim_seconds: float
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def writable(cmap: ClusterMap, p: int) -> PartitionInfo | None:
    """What the map says of partition ``p`` if, every node running and every link
    working, a write to it must be acknowledged: a primary serves it and it owns a
    slot (None otherwise).  One with no slot (a new partition no move reached yet, as
    when the move into it waits for a lost source; an emptied one) is sent no id: a
    probe of it goes where the map sends its row, whose own probe judges that."""
    info = cmap.partitions.get(p)
    if info is None or info.primary is None or p not in cmap.slot_list:
        return None
    return info


def stalled(cmap: ClusterMap, probes: Iterable[Op]) -> Iterator[str]:
    """Every node runs, every link works: a partition a primary serves takes writes."""
    for op in probes:
        info = writable(cmap, op.partition)
        if op.outcome != "acked" and info is not None:
            yield (f"p{op.partition} is served by {info.primary} (epoch {info.epoch}) "
                   f"but a write to it ended {op.outcome!r}: writes stall")  # fmt: skip


def failed_with_only_resets(ops: Iterable[Op], until: float) -> Iterator[str]:
    """Every write whose deadline came before ``until`` (the first fault but connection
    resets) succeeded: the product makes a reset connection again at once and sends
    again what it lost."""
    for op in ops:
        if op.outcome not in ("acked", "") and op.deadline < until:
            yield (f"{op.client} request to p{op.partition} (row {op.row}) ended "
                   f"{op.outcome!r} at {op.at:.3f} with only connection resets before it: "
                   "what a reset lost was not sent again")  # fmt: skip


def unanswered(ops: Iterable[Op], now: float) -> Iterator[str]:
    """Every request answered or failed by its deadline."""
    for op in ops:
        if op.outcome == "" and op.deadline + 0.05 < now:
            yield (f"{op.client} request to p{op.partition} (row {op.row}) never "
                   f"answered; its deadline was {op.deadline:.3f}")  # fmt: skip


def sums(ops: Iterable[Op], rows: int) -> tuple[dict[int, int], dict[int, int]]:
    """Per row, the sum of the acknowledged pushes and that of the pushes that failed or
    were never answered (maybe applied)."""
    acked = dict.fromkeys(range(rows), 0)
    maybe = dict.fromkeys(range(rows), 0)
    for op in ops:
        if op.outcome == "acked":
            acked[op.row] += op.grad
        else:
            maybe[op.row] += op.grad
    return acked, maybe


def misread(read: Op, acked: Mapping[int, int], maybe: Mapping[int, int]) -> Iterator[str]:
    """No acknowledged write lost or doubled: each row of the final ``read`` lies between
    the sum of its acknowledged pushes and that sum plus the maybe-applied (:func:`sums`)."""
    for row, value in zip(read.rows, read.values, strict=True):
        lo, hi = acked[row], acked[row] + maybe[row]
        if not lo <= value <= hi:
            kind = "lost" if value < lo else "doubled"
            yield (f"row {row} (p{read.partition}) reads {value:g}; acknowledged pushes "
                   f"sum to {lo}, at most {hi} with the maybe-applied: acknowledged writes "
                   f"{kind}")  # fmt: skip


def copies_differ(
    cmap: ClusterMap, copies: Mapping[str, tuple[int | None, int, Tables]]
) -> list[str]:
    """Each replica the map has in sync with its partition's primary holds, at the
    primary's LSN, the same tables (a copy damaged at rest and replayed, or a stream
    applied otherwise, differs).  ``copies``: each shard running, by name, with the
    partition it holds, its LSN and its tables; replicas at another LSN are not
    compared (still catching up)."""
    out = []
    for p, info in sorted(cmap.partitions.items()):
        primary = copies.get(info.primary) if info.primary else None
        if primary is None or primary[0] != p:
            continue
        want: str | None = None
        for name in info.in_sync:
            copy = copies.get(name)
            if name == info.primary or copy is None or copy[:2] != primary[:2]:
                continue
            if want is None:
                want = primary[2].checksum()
            if copy[2].checksum() != want:
                out.append(f"p{p}: replica {name}, in sync at LSN {primary[1]}, holds other "
                           f"tables than its primary {info.primary} at that LSN")  # fmt: skip
    return out
