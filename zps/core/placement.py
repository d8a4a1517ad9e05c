"""Where a partition's copies go: on distinct hosts (then zones) where the spares allow.

Pure functions over the broker's shard records (rule 7 of :mod:`zps.core.cluster`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from zps.core.nodes import ShardNode


def clash(node: ShardNode, copies: Sequence[ShardNode]) -> tuple[bool, bool]:
    """(same host as a copy, same zone as a copy): False sorts first."""
    return (
        any(c.host == node.host for c in copies),
        bool(node.zone) and any(c.zone == node.zone for c in copies),
    )


def pick_replica(
    copies: Mapping[int, Sequence[ShardNode]], spares: Sequence[ShardNode]
) -> tuple[int, ShardNode]:
    """Of the partitions short of replicas (``copies``: each one's current copies), the
    one with the fewest good choices among ``spares`` (non-empty), and the good spare the
    other partitions want least."""

    def rank(p: int, n: ShardNode) -> tuple[bool, bool]:
        return clash(n, copies[p])

    def good(p: int) -> list[ShardNode]:
        best = min(rank(p, n) for n in spares)
        return [n for n in spares if rank(p, n) == best]

    short = sorted(copies)
    p = min(short, key=lambda q: (min(rank(q, n) for n in spares), len(good(q)), q))
    node = min(
        good(p),
        key=lambda n: sum(1 for q in short if q != p and rank(q, n) == (False, False)),
    )
    return p, node


def warning(copies: Sequence[ShardNode]) -> str | None:
    """Copies sharing a host (or a zone), or None."""
    for attr, what in (("host", "host"), ("zone", "zone")):
        seen: dict[str, int] = {}
        for c in copies:
            label = getattr(c, attr)
            if label:
                seen[label] = seen.get(label, 0) + 1
        shared = sorted(k for k, v in seen.items() if v > 1)
        if shared:
            return (
                f"{seen[shared[0]]} copies on {what} {shared[0]}: one {what} failure "
                "loses them together (no spare shard elsewhere)"
            )
    return None


def badly_placed(node: ShardNode, copies: Sequence[ShardNode]) -> bool:
    """Whether ``node`` shares a host or a zone with one of ``copies``."""
    return clash(node, copies) > (False, False)


def rebalance_step(
    replica: str,
    copies: Mapping[str, ShardNode],
    extra: bool,
    in_sync: Sequence[str],
    needed: int,
    spares: Sequence[ShardNode],
) -> tuple[str, ShardNode | None] | None:
    """What to do about ``replica`` of a partition whose copies are ``copies`` (by node
    id), if it is badly placed: ``("drop", None)`` once the partition has an ``extra``
    replica and, without it, ``needed`` in-sync replicas one of which is well placed;
    ``("add", spare)`` while it is in sync and a spare would be better placed; else
    None (rule 7 of :mod:`zps.core.cluster`)."""

    def others(n: str) -> list[ShardNode]:
        return [c for i, c in copies.items() if i != n]

    if not badly_placed(copies[replica], others(replica)):
        return None
    if extra:
        rest = [x for x in in_sync if x != replica]
        fine = [x for x in rest if not badly_placed(copies[x], others(x))]
        return ("drop", None) if len(rest) >= needed and fine else None
    rank = clash(copies[replica], others(replica))
    better = [n for n in spares if clash(n, others(replica)) < rank]
    return ("add", better[0]) if better and replica in in_sync else None
