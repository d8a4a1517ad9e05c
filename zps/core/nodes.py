"""The broker's records of shards, clients and partitions, and what it tells shards.

Plain data for :mod:`zps.core.cluster` (its rules say what the fields mean) and for
the modules that read it (:mod:`zps.core.placement`, :mod:`zps.core.cluster_status`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zps.protocol.messages import Role


@dataclass(frozen=True)
class Claim:
    """What a shard says it already serves when it (re)registers."""

    partition: int
    epoch: int
    role: Role
    lsn: int = 0
    in_sync: bool = False
    #: False: the copy may lack writes it acknowledged (see ``ShardClaim.complete``).
    complete: bool = True
    #: The slots it serves (packed bits) and their map version (``ShardClaim.slots``).
    slots: bytes | None = None
    slot_version: int = 0
    #: The slots a move fences at it, and those it imports (``ShardClaim.fenced``).
    fenced: bytes | None = None
    importing: bytes | None = None


@dataclass
class ShardNode:
    node_id: str
    host: str
    pid: int
    address: str
    registered_at: float
    role: Role = Role.SPARE
    partition: int | None = None
    epoch: int = 0
    lsn: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    zone: str = ""
    #: The send time of its last heartbeat answered with a renewing lease echo.
    lease_t: float | None = None
    #: A primary being fenced (rule 8): its lease echoes renew nothing.
    fenced: bool = False
    #: The LSN a fenced primary reported after its lease ran out.
    final_lsn: int | None = None
    #: A copy it came back with that is older than its partition's floor: kept
    #: (the shard is not made a spare) until a newer copy returns or an operator
    #: accepts this one.
    held: Claim | None = None
    #: The claim it registered with, when it named the slots it serves (cluster rule 9).
    claimed: Claim | None = None


@dataclass
class ClientNode:
    node_id: str
    host: str
    pid: int
    name: str
    registered_at: float


@dataclass(frozen=True)
class Assignment:
    """Tell ``node_id`` its role; a replica also learns whom to follow."""

    node_id: str
    role: Role
    partition: int | None
    epoch: int
    primary: str | None = None
    primary_address: str = ""


@dataclass
class Partition:
    """What the broker knows of one partition (its fields follow the rules of
    :mod:`zps.core.cluster`)."""

    epoch: int = 0
    primary: str | None = None
    replicas: list[str] = field(default_factory=list)
    in_sync: set[str] = field(default_factory=set)
    lost: bool = False
    #: The newest (epoch, LSN) a primary of it confirmed (see rule 4).
    floor_epoch: int = 0
    floor_lsn: int = 0
    #: Hosts of its copies as last recorded (for the operator when it is lost).
    hosts: tuple[str, ...] = ()
    #: An operator accepted the loss of what the missing copies held.
    released: bool = False
    #: Its last in-sync set, primary first, as its confirmed primary reported it (rule
    #: 4); binding on claims while no primary serves it, and on every claim once
    #: restored from a broker's record (``pinned``).
    members: tuple[str, ...] = ()
    pinned: bool = False
    #: The in-sync set the broker's record held when this broker started: during the
    #: start-up hold (no write is routed) each of them still holds every acknowledged
    #: write, also once a claim granted to one of them made it the members alone.
    recorded: tuple[str, ...] = ()
    #: The (epoch, LSN) of the copy its primary's line was granted from (a claim or
    #: nothing; kept across failovers), and the LSN then (rule 8).
    origin: tuple[int, int] = (0, 0)
    granted_lsn: int = 0
    #: (epoch, shard) pairs this broker gave or granted: histories it has seen.
    seen: set[tuple[int, str]] = field(default_factory=set)
    #: Lost because its last copy was stopped on purpose (a planned shutdown).
    stopped: bool = False
    #: A newer copy waiting for the serving primary to be fenced (rule 8).
    contender: str | None = None
    #: The shard-clock time after which the fenced primary's lease has run out.
    fence_after: float = 0.0

    @property
    def floor(self) -> tuple[int, int]:
        return (self.floor_epoch, self.floor_lsn)

    def confirm(self, epoch: int, lsn: int, durable: int | None) -> None:
        """Its primary of ``epoch`` confirmed by heartbeat (it serves, and may write, at
        that epoch): the floor rises to what its log holds (``durable``; without a log,
        to ``lsn``: a restart would bring back less than it acknowledged)."""
        kept = lsn if durable is None else min(lsn, durable)
        self.floor_lsn = max(self.floor_lsn, kept) if self.floor_epoch == epoch else kept
        self.floor_epoch = epoch
        self.refresh_members()

    def refresh_members(self) -> None:
        """A confirmed primary's in-sync set is the partition's members (a promoted
        copy takes no write before it is confirmed: its lease starts then)."""
        if self.primary is not None and self.floor_epoch == self.epoch and self.epoch > 0:
            self.members = (self.primary, *sorted(self.in_sync))


def merge(assignments: list[Assignment]) -> list[Assignment]:
    """The last assignment per node wins (one message each)."""
    last: dict[str, Assignment] = {}
    for a in assignments:
        last.pop(a.node_id, None)
        last[a.node_id] = a
    return list(last.values())
