"""Which copy may serve a partition after a crash (rules 4 and 8 of
:mod:`zps.core.cluster`), and what the broker tells the operator about it.

Pure functions over the broker's records; :class:`zps.core.cluster.ClusterState`
carries out what they decide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from zps.core.nodes import Claim, Partition, ShardNode
from zps.protocol.messages import Role

_RESET = "zps-server reset-partition --partition {p} --accept-data-loss"


def claim_epoch(part: Partition, claim: Claim) -> int:
    """The epoch a claimed copy serves at: its own, unless the partition has moved
    past it (a copy from before a promotion that never took writes is as good)."""
    return claim.epoch if claim.epoch >= part.epoch else part.epoch + 1


def distrust(
    part: Partition, claim: Claim, node_id: str, holding: bool = False, stale: bool = False
) -> str | None:
    """Why a primary claim may not have its partition (rule 4), or None.  A copy outside
    the partition's last in-sync set may not have it while no primary serves it (nor,
    once restored from a record, at all).  During the start-up hold (``holding``) a
    member of the recorded in-sync set is one still.  With
    a ``stale`` record (:func:`unpin`) its floor is a bound still, but a claim below the
    partition's epoch is not trusted: a newer broker may have confirmed that epoch."""
    if part.released:
        return None
    if not claim.complete:
        return "it was restored without a log and may lack acknowledged writes"
    member = node_id in part.members or (holding and node_id in part.recorded)
    if (claim.epoch, claim.lsn) < part.floor and not (member and claim.lsn >= part.floor_lsn):
        # (A member's copy at the floor's LSN from an older epoch took no write at the
        # floor's epoch, or its log would say so: it is the floor's copy.)
        return (
            f"older than the epoch {part.floor_epoch}, LSN {part.floor_lsn} its primary confirmed"
        )
    # The last in-sync set binds once restored from a record (pinned), and whenever no
    # primary serves: the floor trails what a primary acknowledged alone since its last
    # confirmed heartbeat, and only its members hold those writes.
    if (part.pinned or (part.primary is None and part.members)) and not member:
        return f"it is not in the partition's last in-sync set ({', '.join(part.members)})"
    # At or past the floor.  Below the current epoch only when a floor is known
    # (the newer epoch was never confirmed, so it took no writes).
    if claim.epoch >= part.epoch or (part.floor_epoch > 0 and not stale):
        return None
    return f"its epoch {claim.epoch} is older than the partition's {part.epoch}"


def vouches(part: Partition, claim: Claim) -> bool:
    """Whether a primary claim that :func:`distrust` accepts, following the serving
    primary at its epoch, holds every acknowledged write as surely as the primary's own
    copy: a member of the recorded in-sync set, or, with no recorded set to go by (or
    once an operator released the partition), a copy at least as new as the one the
    serving primary was granted from.  During the start-up hold (no write routed yet)
    such a copy is in sync, so it is elected if the primary dies before it caught up."""
    if part.pinned and not part.released:
        return True
    return (claim.epoch, claim.lsn) >= part.origin


def says_in_sync(part: Partition, claim: Claim) -> bool:
    """Whether a replica's own word that it was in sync counts during the start-up hold:
    while no copy serves the partition, or when it holds at least the copy the serving
    primary was granted from.  A primary granted first was sent a map without it, and
    such a map releases the writes that waited for it (routed by the broker before
    this one, and applied on the primary's copy, whose LSN counts them): a replica behind
    that copy may lack writes acknowledged since."""
    if not claim.in_sync:
        return False
    return part.primary is None or (claim.epoch, claim.lsn) >= part.origin


def reported_in_sync(part: Partition, in_sync: list[str], *, holding: bool) -> set[str]:
    """The in-sync set a primary's report gives ``part``: the replicas it names; during
    the start-up hold (no write is routed) a member of the recorded set in sync stays so
    (and the primary waits for it while the map names it)."""
    reported = {r for r in in_sync if r in part.replicas}
    if holding:
        reported |= part.in_sync.intersection(part.recorded)
    return reported


def unseen_newer(part: Partition, claim: Claim, node_id: str) -> bool:
    """Whether a claim is a newer history than the serving line's origin that this
    broker never saw, with no recorded in-sync set to vouch for the line (rule 8)."""
    return (
        not part.pinned
        and (claim.epoch, node_id) not in part.seen
        and (claim.epoch, claim.lsn) > part.origin
    )


def unpin(parts: Sequence[Partition]) -> None:
    """The broker's record is stale (:mod:`zps.core.bstar` rule 7: a shard obeyed a newer
    broker since it was made): its in-sync set for each part binds no more, since the newer
    broker may have dropped any member and acknowledged writes without it.  The partition
    is judged as by a broker restarted without its record (the newest claim wins during
    the hold; after it a newer copy takes over only from a primary that took no write
    since it was granted, else both are kept: rule 8), but for its floor, a bound still
    (floors only grow), though not one that vouches for a claim below the partition's
    epoch (:func:`distrust`).  Its members from now on are the ones its primary confirms
    to this broker."""
    for part in parts:
        part.pinned = False
        part.members = part.recorded = ()


def claims_in(parts: Sequence[Partition], shards: Mapping[str, ShardNode], stale: bool) -> bool:
    """Whether a broker restarted from its record (``parts`` as restored, ``shards``
    registered since) may end its start-up hold now, before the grace runs out.

    The rule: the record is not ``stale``, at least one partition held data, and every
    partition that held data (epoch > 0) has a recorded in-sync set, each member of which
    has registered with this broker, and its primary back (granted; not being handed
    over).  Otherwise the grace bounds the hold.

    Why that is enough: ending the hold changes nothing but when routing starts, since
    no claim still to come could change who serves.  Only a recorded member may be
    elected (rule 4), a later member's claim does not displace a granted one (rule 8 is
    for partitions with no recorded set), and every member holds every acknowledged
    write; with all of them in, a later claim is a non-member's, which may not serve the
    partition, and joins it out of sync (it resynchronises).  Each member is waited for,
    not just one: a member still away (a partition whose recorded set has 2 copies, 1
    claimed) may come back within the grace; in the hold it would rejoin the in-sync set
    at once (:func:`says_in_sync`, :func:`vouches`), after it the primary writes without
    it and it resynchronises, or, its claim at an epoch the partition left, it is made a
    spare.  A member that registered with nothing (its disk wiped) has said its last
    word.  A lost partition, whose last in-sync set names a copy that is away, waits the
    whole grace (that copy alone may hold its writes), as does one whose members all
    came back and none was granted (its election or loss is decided when the grace
    ends).

    Never early: without a record (no partition held data: an empty partition cannot
    be told from one whose copies are away), for a partition that held data with no
    recorded set (the newest claim wins only during the hold; after it a newer copy
    waits for the serving primary to be fenced, or for the operator: rule 8), and with
    a ``stale`` record (:func:`unpin`: no set binds, and every shard that is up should
    report the term it obeyed before a write is routed: :mod:`zps.core.bstar` rule 7).
    Whether a record counts at all is the driver's: a pair's broker that took over
    having heard no peer since it started (rule 8 of :mod:`zps.core.bstar`) holds for
    the whole grace."""
    known = [part for part in parts if part.epoch > 0]
    if stale or not known:
        return False
    return all(
        part.recorded
        and all(m in shards for m in part.recorded)
        and part.primary in shards
        and part.contender is None
        for part in known
    )


def hold_copies(p: int, part: Partition, shards: Mapping[str, ShardNode]) -> None:
    """A lost partition's replicas keep their copies, held as a claim not taken is: no
    role, no assignment (a spare drops its partition), so each keeps what it holds, which
    may be every acknowledged write (with ``min_in_sync`` 2 its primary acknowledged
    nothing without it).  reset-partition serves the newest; a broker rebuilding from
    claims finds them; a copy at the floor that comes back releases the older ones."""
    for r in part.replicas:
        node = shards[r]
        node.held = Claim(p, node.epoch, Role.REPLICA, node.lsn, complete=True)
        node.role, node.partition, node.epoch = Role.SPARE, None, 0
    part.replicas, part.in_sync = [], set()


def not_taken(node: ShardNode, claim: Claim, why: str) -> str:
    return (
        f"shard {node.node_id} ({node.host}) came back with partition {claim.partition} at "
        f"epoch {claim.epoch}, LSN {claim.lsn}: not taken ({why}; acknowledged writes would "
        "be lost); the partition waits for a copy that holds them, or for "
        + _RESET.format(p=claim.partition)
    )


def waits_behind(p: int, node: ShardNode, contender: str) -> str:
    return (
        f"shard {node.node_id}: partition {p} is already being handed to {contender}; "
        f"{node.node_id} waits with its copy"
    )


def fencing(p: int, node: ShardNode, claim: Claim, current: ShardNode, part: Partition) -> str:
    return (
        f"partition {p}: {node.node_id} came back with epoch {claim.epoch}, LSN {claim.lsn}, "
        f"newer than {current.node_id}'s (epoch {part.origin[0]}, LSN {part.origin[1]}); "
        f"fencing {current.node_id} to hand the partition over if it took no write"
    )


def conflict(p: int, node: ShardNode, claim: Claim, part: Partition, lsn: int) -> str:
    """Two copies hold writes the other lacks: the operator's two choices."""
    return (
        f"partition {p}: two copies hold writes the other lacks. {node.node_id} came back "
        f"with epoch {claim.epoch}, LSN {claim.lsn}; {part.primary} serves it from epoch "
        f"{part.origin[0]}, LSN {part.origin[1]} and has taken writes since (LSN "
        f"{part.granted_lsn} -> {lsn}). Neither is overwritten: {node.node_id} is kept "
        f"with no role. To keep the serving copy, stop {node.node_id}, set its data dir "
        f"aside and start it empty; to serve {node.node_id}'s copy instead, stop "
        f"{part.primary} (set its data dir aside) and run " + _RESET.format(p=p)
    )


def handed_over(p: int, contender: ShardNode, claim: Claim, current: ShardNode) -> str:
    return (
        f"partition {p}: {contender.node_id} holds a newer copy (epoch {claim.epoch}, LSN "
        f"{claim.lsn}) than {current.node_id}, which took no write since it took the "
        f"partition: {contender.node_id} serves it"
    )


def lost(p: int, part: Partition, stopped: str | None) -> str:
    """No copy serves ``p`` (``stopped``: its last one was stopped on purpose)."""
    where = f" (its copies were on {', '.join(part.hosts)})" if part.hosts else ""
    after = (
        "requests for it wait (up to their timeout) until a shard holding such a copy "
        "registers, or until " + _RESET.format(p=p)
    )
    if stopped is not None:
        return (
            f"partition {p} has no copy serving: its last one, {stopped}, was stopped (at "
            f"epoch {part.floor_epoch}, LSN {part.floor_lsn}){where}; " + after
        )
    return (
        f"partition {p} is lost: no copy of it at epoch {part.floor_epoch}, LSN "
        f"{part.floor_lsn} or newer is left{where}; " + after
    )


def elect(part: Partition, shards: Mapping[str, ShardNode]) -> str | None:
    """The in-sync replica of ``part`` to promote (rule 4): the highest LSN, then the
    greatest id; after a broker restart only a recorded member (until an operator
    released the partition); None: no copy holds every acknowledged write."""
    candidates = [r for r in part.replicas if r in part.in_sync and r in shards]
    if part.pinned and not part.released:
        candidates = [r for r in candidates if r in part.members]
    return max(candidates, key=lambda r: (shards[r].lsn, r)) if candidates else None


def call_off(part: Partition, node_id: str, shards: Mapping[str, ShardNode]) -> bool:
    """A hand-over (rule 8) is off once its contender or its fenced primary is gone: a
    dead primary's last writes are unknown, so the held copy waits for the operator
    (or is compared again).  Returns whether one was called off."""
    if part.contender is None or node_id not in (part.contender, part.primary):
        return False
    if part.primary is not None and part.primary in shards:
        shards[part.primary].fenced = False
    part.contender = None
    return True
