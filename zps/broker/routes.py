"""The broker's forwarding rule: which peer gets a client's REQUEST, or why none does.

One job, decided in one place: the broker rebuilds a :class:`RouteTable` from each new
cluster map, and every forwarding path only consults it: the compiled step
(``_forward.c`` reads :attr:`RouteTable.targets`, declining whatever it finds no
identity for), the Python fast path and the serving task (both call :func:`route`).
No I/O, no clock: whether the broker holds for claims is an argument.

Rules, in the order they apply to a REQUEST for partition ``p``:

1. ``p`` outside the map: refused ``SHARD_UNAVAILABLE`` (no such partition).
2. While the broker collects the shards' claims (after a start or a takeover): refused
   ``NOT_PRIMARY``; a claim granted now may still be displaced by a newer copy, so no
   write may land on it until the hold ends.
3. The map names ``p``'s primary: the request goes to that identity.
4. Otherwise refused ``SHARD_UNAVAILABLE``: the partition is lost (no copy at its floor
   is left) or not yet assigned (a shard handing it over counts as none).

What happens to a request the table routes (its peer's queue full, its connection
gone) is the sender's business, not this rule's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zps.core.routing import ClusterMap
from zps.protocol.messages import Status


class NoRoute(enum.Enum):
    """Why a REQUEST goes to no shard."""

    NO_SUCH_PARTITION = "no such partition"
    HOLDING = "holding"
    LOST = "lost"
    UNASSIGNED = "unassigned"


@dataclass(frozen=True, slots=True)
class RouteTable:
    """Each partition's primary identity, or None, and whether it is lost.

    ``targets`` is a list of ``bytes | None`` exactly (the compiled step reads it as
    such); a table is never changed, only replaced."""

    targets: list[bytes | None]
    lost: tuple[bool, ...]

    @classmethod
    def empty(cls, n_partitions: int) -> RouteTable:
        """No primary anywhere (before the first map)."""
        return cls([None] * n_partitions, (False,) * n_partitions)

    @classmethod
    def of(cls, cmap: ClusterMap) -> RouteTable:
        """The table of a published map (a partition handing over has no primary)."""
        parts = [cmap.partitions[p] for p in range(cmap.n_partitions)]
        return cls(
            [None if i.primary is None else i.primary.encode() for i in parts],
            tuple(i.lost for i in parts),
        )

    def resized(self, n_partitions: int) -> RouteTable:
        """This table cut or padded (no primary) to ``n_partitions``."""
        n = n_partitions
        return RouteTable((self.targets + [None] * n)[:n], (self.lost + (False,) * n)[:n])

    def __len__(self) -> int:
        return len(self.targets)


def route(table: RouteTable, partition: int, *, holding: bool) -> bytes | NoRoute:
    """The identity a REQUEST for ``partition`` goes to, or why it goes nowhere."""
    if not 0 <= partition < len(table.targets):
        return NoRoute.NO_SUCH_PARTITION
    if holding:
        return NoRoute.HOLDING
    target = table.targets[partition]
    if target is not None:
        return target
    return NoRoute.LOST if table.lost[partition] else NoRoute.UNASSIGNED


def refusal(why: NoRoute, partition: int, floor: tuple[int, int] | None) -> tuple[Status, str]:
    """The answer to a REQUEST that goes nowhere (``floor``: a lost partition's epoch and
    LSN, which a copy must reach to serve it)."""
    p = partition
    if why is NoRoute.HOLDING:
        return Status.NOT_PRIMARY, f"partition {p}: the broker is collecting the shards' claims"
    if why is NoRoute.LOST:
        epoch, lsn = floor if floor is not None else (0, 0)
        return Status.SHARD_UNAVAILABLE, (
            f"partition {p} is lost: no copy at epoch {epoch}, LSN {lsn} or "
            "newer is left; it is unavailable until a shard holding one registers "
            f"(or an operator runs zps-server reset-partition --partition {p} "
            "--accept-data-loss)"
        )
    reason = (
        "no such partition" if why is NoRoute.NO_SUCH_PARTITION else "not yet assigned to a shard"
    )
    return Status.SHARD_UNAVAILABLE, f"partition {p} has no live shard ({reason})"
