"""Known defects, patched in from the simulator's side (``--bug NAME``).

Each one re-introduces a defect zps once had or could have, by replacing a function of
the real code for the duration of a run; the product carries no switch for any of them.
The simulator must catch each within the CI budget of seeds (tests/unit/test_sim.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

BUGS: dict[str, str] = {}
_PATCHES: dict[str, Callable[[], list[tuple[Any, str, Any]]]] = {}


def _bug(name: str, doc: str) -> Callable[[Callable[[], list[tuple[Any, str, Any]]]], Any]:
    def register(fn: Callable[[], list[tuple[Any, str, Any]]]) -> Any:
        BUGS[name] = doc
        _PATCHES[name] = fn
        return fn

    return register


@_bug("older-copy-wins", "ClusterState._distrust ignores the recorded in-sync set (members)")
def _older_copy_wins() -> list[tuple[Any, str, Any]]:
    from zps.core.cluster import ClusterState

    real = ClusterState._distrust

    def distrust(part: Any, claim: Any, node_id: str, *args: Any, **kw: Any) -> str | None:
        why = real(part, claim, node_id, *args, **kw)
        return None if why is not None and "last in-sync set" in why else why

    return [(ClusterState, "_distrust", staticmethod(distrust))]


@_bug(
    "empty-shard-takes-partition",
    "ClusterBase._held says no copy is held, and _fill hands a partition that held data "
    "and has no copy serving to a spare",
)
def _empty_shard() -> list[tuple[Any, str, Any]]:
    from zps.core.clusterbase import ClusterBase

    real_fill = ClusterBase._fill

    def fill(self: Any, now: float) -> Any:
        parts = self._parts
        saved = [(p.epoch, p.lost) for p in parts]
        for p in parts:  # the partition looks as if it never held data
            if p.primary is None and not p.replicas and not p.released:
                p.epoch = 0
        try:
            return real_fill(self, now)
        finally:
            for p, (epoch, _lost) in zip(parts, saved, strict=True):
                p.epoch = max(p.epoch, epoch)

    return [(ClusterBase, "_held", lambda self, p: False), (ClusterBase, "_fill", fill)]


@_bug("ack-before-durable", "a replica acknowledges LSNs its log does not hold yet")
def _ack_before_durable() -> list[tuple[Any, str, Any]]:
    from zps.shard.durability import Durability

    return [(Durability, "acked_lsn", lambda self, lsn: lsn)]


@_bug(
    "wal-retry-partial", "a failed log write leaves its partial record; the retry appends behind it"
)
def _wal_retry_partial() -> list[tuple[Any, str, Any]]:
    from zps.store import wal as walmod

    def write(self: Any, parts: list[Any], size: int, lsn: int) -> int:
        fd = self._check()
        walmod._write_all(fd, parts)  # no truncation back on failure
        self._size += size
        self.lsn = lsn
        self._dirty = True
        return size

    return [(walmod.Wal, "_write", write)]


@_bug(
    "stale-replica-in-tracker",
    "a replica the broker replaced stays in the primary's ack tracker: its acks are taken "
    "back (neither the session nor the primary driver refuses them), and a drop by the "
    "primary does not settle the tracker (writes wait for ever)",
)
def _stale_replica() -> list[tuple[Any, str, Any]]:
    from zps.protocol.messages import Role
    from zps.shard.session import MapResult, ShardSession

    real_acked = ShardSession.acked

    def on_map(self: Any, epoch: int, in_sync: set[str], replicas: set[str]) -> Any:
        self.in_sync_published = self.node_id in in_sync
        if self.partition is not None:
            self.copies = max(self.copies, 1 + len(replicas))
        if epoch != self.epoch:
            return MapResult()
        self.replicas = set(replicas)
        if self.role is not Role.PRIMARY:
            return MapResult()
        self.local_in_sync -= self.published_in_sync - in_sync
        self.published_in_sync = set(in_sync)
        required = in_sync | self.local_in_sync
        enough = 1 + len(required) >= self.needed_copies or self.repairing
        refused = [] if enough else self.tracker.take_all()
        return MapResult(self.tracker.set_required(required), refused)

    def acked(self: Any, node: str, lsn: int, epoch: object, now: float, base: object) -> Any:
        replicas = self.replicas
        self.replicas = replicas | {node}  # an ack from a replaced replica counts
        try:
            return real_acked(self, node, lsn, epoch, now, base)
        finally:
            self.replicas = replicas

    from zps.testing.sim.nodes import SimShard

    def on_ack(self: Any, node: str, lsn: int, epoch: int, base: int) -> None:
        # primary.Stream._on_ack as it was: no drop of a node the map no longer lists.
        s = self.session
        if node not in s.followers:
            return
        result = s.acked(node, lsn, epoch, self.w.sched.now, base)
        if result.in_sync:
            self._report()
        self._release(result.released)

    return [
        (ShardSession, "on_map", on_map),
        (ShardSession, "settle", lambda self: MapResult()),
        (ShardSession, "acked", acked),
        (SimShard, "_on_ack", on_ack),
    ]


@_bug(
    "pair-unfenced",
    "a shard of a broker-pair cluster obeys whichever broker spoke last and stamps no term "
    "(the stand-in's PairShard._fenced; the real shard's BrokerLinks.fenced and with_term, "
    "zps.testing.sim.realbugs, as with one broker): a replaced broker that still "
    "thinks itself active is neither ignored nor told",
)
def _pair_unfenced() -> list[tuple[Any, str, Any]]:
    from zps.testing.sim.pair import PairShard

    def fenced(self: Any, src: str, term: int | None) -> bool:
        self.current = src
        return False

    return [(PairShard, "_fenced", fenced)]


@_bug(
    "standby-without-record",
    "the standby broker of a pair drops the record its active peer sends (Pair._on_peer "
    "without keeping it): a takeover starts from whatever its own data dir held (BinaryStar "
    "rule 7, which would find that record stale, off)",
)
def _standby_without_record() -> list[tuple[Any, str, Any]]:
    from zps.testing.sim.pair import PairBroker

    real = PairBroker._on_peer

    def on_peer(self: Any, state: str, term: int, rec: Any, *rest: Any) -> None:
        real(self, state, term, None, *rest)

    return [(PairBroker, "_on_peer", on_peer), *_stale_record_trusted()]


def _stale_record_trusted() -> list[tuple[Any, str, Any]]:
    """BinaryStar rule 7 off: a record older than a term the shards obeyed is never found
    stale.  The rule backs up rule 5 and the standby's record: a defect of theirs that it
    would cover is patched in with it, so that the run shows what the defect alone does."""
    from zps.core.bstar import BinaryStar

    real = BinaryStar.on_term

    def on_term(self: Any, term: int, now: float) -> Any:
        reported = self.reported
        try:
            return real(self, term, now)
        finally:
            self.reported = reported  # no report counts

    return [(BinaryStar, "on_term", on_term), (BinaryStar, "_stale", lambda *_: None)]


@_bug(
    "pair-primary-first",
    "a broker pair started whole is taken over by the primary whatever the records hold "
    "(BinaryStar.on_peer without the peer's record order; rule 7, which would find the "
    "older record stale, off)",
)
def _pair_primary_first() -> list[tuple[Any, str, Any]]:
    from zps.core.bstar import BinaryStar

    real = BinaryStar.on_peer

    def on_peer(self: Any, state: Any, term: int, now: float, record: Any = None) -> Any:
        return real(self, state, term, now)

    return [(BinaryStar, "on_peer", on_peer), *_stale_record_trusted()]


@_bug(
    "pair-map-before-standby",
    "the active broker of a pair publishes a map, or renews a promoted primary's lease, before "
    "its standby holds the record (Pair.after_held releasing at once; BinaryStar rule 7, "
    "which would find an older record stale, off)",
)
def _pair_map_before_standby() -> list[tuple[Any, str, Any]]:
    from zps.testing.sim.pair import PairBroker

    # after_held releases maps and a promoted primary's lease echoes alike.
    return [
        (PairBroker, "_peer_holds", lambda self: True),
        (PairBroker, "_unheld", lambda self, partition: False),
        *_stale_record_trusted(),
    ]


@_bug(
    "stuck-replica-kept",
    "a primary drops an in-sync replica only when it is silent (ShardSession._drop_lagging "
    "without its rule for a replica that acknowledges without getting further): a replica "
    'that does not read, or whose disk is full, holds acks="all" writes while it answers',
)
def _stuck_replica_kept() -> list[tuple[Any, str, Any]]:
    from zps.shard.session import ShardSession

    real = ShardSession._drop_lagging

    def drop_lagging(self: Any, now: float, lsn: int) -> Any:
        for follower in self.followers.values():
            follower.stuck_since = None  # no follower has been stuck for any time
        return real(self, now, lsn)

    return [(ShardSession, "_drop_lagging", drop_lagging)]


@contextlib.contextmanager
def patched(name: str | None) -> Iterator[None]:
    """Run with the defect ``name`` in place (None: none)."""
    if name is None:
        yield
        return
    if name not in _PATCHES:
        raise ValueError(f"unknown bug {name!r}; known: {', '.join(sorted(BUGS))}")
    patches = _PATCHES[name]()
    saved = [(obj, attr, obj.__dict__[attr]) for obj, attr, _ in patches]
    for obj, attr, value in patches:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)
