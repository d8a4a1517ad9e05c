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
