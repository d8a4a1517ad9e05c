"""The known defects (:mod:`.bugs`) as they apply to the real code paths a
``--real-broker`` run takes: the real :class:`~zps.broker.pair.Pair` and the wire
shard of :mod:`.realpair`; with the real shards (``--real-shard`` and the default), their
replication stream and their links to a broker pair.
``--bug NAME`` puts both in place; a defect with no entry here patches the stand-in
only (or, as ``pair-primary-first`` in :class:`~zps.core.bstar.BinaryStar`, code both
run).  The defects of the client's driver (:data:`CLIENT_BUGS`) exist only in the real
client, so only the default mode (``--real-client``) runs them."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

Patch = list[tuple[Any, str, Any]]


def _pair_unfenced() -> Patch:
    from zps.testing.sim.realpair import WirePairShard

    def fenced(self: Any, src: str, header: dict[str, Any]) -> bool:
        self.current = src  # whichever broker spoke last, and no term learnt (none stamped)
        return False

    return [(WirePairShard, "_fenced", fenced)]


def _standby_without_record() -> Patch:
    from zps.broker.pair import Pair

    real = Pair._on_peer

    async def on_peer(self: Any, frames: Any) -> None:
        await real(self, frames[:2])  # the record the active peer sent is dropped

    return [(Pair, "_on_peer", on_peer)]


def _pair_map_before_standby() -> Patch:
    from zps.broker.pair import Pair

    def after_held(self: Any, callback: Callable[[], object]) -> None:
        callback()  # at once, whatever the standby holds

    return [(Pair, "after_held", after_held)]


_PATCHES: dict[str, Callable[[], Patch]] = {
    "pair-unfenced": _pair_unfenced,
    "standby-without-record": _standby_without_record,
    "pair-map-before-standby": _pair_map_before_standby,
}


def _stale_replica_stream() -> Patch:
    from zps.shard.primary import ReplicationStream

    def on_ack(self: Any, node: str, ack: Any, now: float) -> None:
        # ReplicationStream._on_ack as it was: no drop of a node the map no longer lists.
        if node not in self.session.followers:
            return
        result = self.session.acked(node, ack.lsn, ack.epoch, now, ack.base)
        if self._shared:
            self._read(node, ack.lsn)
        if result.in_sync:
            self._report()
        self._release(result.released)

    return [(ReplicationStream, "_on_ack", on_ack)]


def _pair_unfenced_links() -> Patch:
    from zps.shard.links import BrokerLinks

    # BrokerLinks.fenced and with_term as with one broker: the shard obeys whichever
    # broker of the pair spoke last and stamps no term.
    def fenced(self: Any, link: int, header: dict[str, Any]) -> bool:
        if len(self.links) > 1 and link != self.current:  # whichever broker spoke last
            self.current = link
            self.sock, self.out = self.links[link]
        return False  # and no term learnt

    def with_term(self: Any, header: dict[str, Any]) -> dict[str, Any]:
        return header  # none stamped

    return [(BrokerLinks, "fenced", fenced), (BrokerLinks, "with_term", with_term)]


#: The shard's defects in the real shard's own driver (``--real-shard`` and the default
#: mode); those of the
#: pure cores (``ShardSession``, ``Durability.acked_lsn``, ``Wal._write``) are patched in
#: by :mod:`.bugs` for every run.
SHARD_PATCHES: dict[str, Callable[[], Patch]] = {
    "stale-replica-in-tracker": _stale_replica_stream,
    "pair-unfenced": _pair_unfenced_links,
}


def _client_seq_restart() -> Patch:
    from zps.client.connection import Connection

    real = Connection._hello

    async def hello(self: Any) -> None:
        if self._session.map is not None:  # introduced before: the broker restarted
            self._session._seqs = itertools.count(1)  # a session started over, same id
        await real(self)

    return [(Connection, "_hello", hello)]


def _shm_token_unchecked() -> Patch:
    import numpy as np

    from zps.shm.mapper import Mapper
    from zps.shm.region import HEAD_BYTES

    def read_finite(self: Any, desc: Any, into: Any, itemsize: int) -> tuple[Any, bool]:
        pid, fd, inode, offset, length, _token = desc[:6]
        skip = desc[6] if len(desc) > 6 else 0
        mm = self._open(pid, fd, inode)
        out = into if into is not None and into.nbytes == length else np.empty(length, np.uint8)
        out[:] = np.frombuffer(mm, np.uint8, length, offset + HEAD_BYTES + skip)
        self.reads += 1
        return out, False  # whatever the region holds now, its token unchecked

    return [(Mapper, "read_finite", read_finite)]


#: The defects of the client's driver and of the shared-memory path (``--real-client``),
#: with what each does.
def _client_not_relinked() -> Patch:
    from zps.client.session import ClientSession

    def relinked(self: Any, partitions: Any, now: float) -> list[Any]:
        return []  # what a connection made again may have lost waits out its deadline

    return [(ClientSession, "relinked", relinked)]


def _client_ignores_relinked() -> Patch:
    from zps.client.session import ClientSession

    real = ClientSession.relinked

    def relinked(self: Any, partitions: Any, now: float) -> list[Any]:
        # The broker's word that a primary's data link was made again goes unheeded.
        return real(self, partitions, now) if partitions is None else []

    return [(ClientSession, "relinked", relinked)]


def _router_link_loss_unanswered() -> Patch:
    from zps.broker.router import Router

    def link_lost(self: Any, shard: bytes, how: str, *, bypass: bool = True) -> None:
        self._forwarded.lost(shard)  # forgotten, and nobody told

    return [(Router, "_link_lost", link_lost)]


def _wal_crc_unchecked() -> Patch:
    import types

    import zps.store.wal as wal

    # Every record's CRC is 0 as written and as read: a record damaged at rest is replayed.
    return [(wal, "zlib", types.SimpleNamespace(crc32=lambda *args: 0))]


def _wal_damage_as_torn() -> Patch:
    import zps.store.wal as wal

    real = wal.whole_records

    def whole_records(data: Any, above: int = -1) -> tuple[int, int | None, int | None]:
        view = memoryview(data).cast("B")
        parsed = wal.parse_records(view)
        if parsed.error is not None and not parsed.records and len(view) > parsed.end:
            length, _ = wal._FRAME.unpack_from(view, parsed.end)
            if parsed.end + wal._FRAME.size + length == len(view):
                return 0, None, None  # the damaged last record taken for a torn one
        return real(data, above)

    return [(wal, "whole_records", whole_records)]


def _wal_reached_forgotten() -> Patch:
    from zps.store.wal import Wal

    def remember_reached(self: Any, lsn: int, reached: int) -> int:
        return reached  # what an earlier recovery set aside is forgotten at the next

    return [(Wal, "_remember_reached", remember_reached)]


CLIENT_BUGS: dict[str, str] = {
    "client-seq-restart": "a client that introduces itself again to a restarted broker "
    "(HELLO_AGAIN) numbers its requests from 1 again under the same client id, so a "
    "shard answers its next pushes from the dedup record of earlier ones, unapplied",
    "client-not-relinked": "a client does not send again what was in flight on a "
    "connection made again (ClientSession.relinked, rule 10, doing nothing), so a request "
    "the closed connection took with it waits out its deadline",
    "client-ignores-relinked": "a client does not send again what was in flight to a "
    "partition whose primary's data link to the broker was made again (the broker's "
    "HEARTBEAT relinked=(p,), unheeded), so a request the closed link took with it waits "
    "out its deadline",
    "wal-crc-unchecked": "the log checks no record's CRC (every CRC 0, as written and as "
    "read), so a record a bit of which flipped at rest is replayed as it reads: a "
    "gradient, a row id or a count other than the one acknowledged",
    "wal-damage-as-torn": "a log whose last record is whole but damaged (a bit flipped "
    "at rest) is cut there as if the record were torn, and the copy claims to be complete: "
    "a synced, acknowledged record is lost with it, and the copy may be granted its "
    "partition before a copy that holds the record",
    "wal-reached-forgotten": "a copy that set aside records it may have acknowledged "
    "claims to be complete at its next restart (the segment no longer shows them: "
    "Wal._remember_reached keeping no REACHED), so a second crash before it caught up "
    "lets it take its partition short of them",
    "router-link-loss-unanswered": "a routing broker forgets, without a word, what it "
    "posted to a shard whose link closed, went silent or was made again (Router._link_lost "
    "refusing nothing), so a request lost with the link waits out its deadline",
    "shm-token-unchecked": "a reader copies a region of another process's shared memory "
    "without checking its token (Mapper.read_finite without its checks), so a region "
    "reused before it was read is taken for the message's bytes",
}
CLIENT_PATCHES: dict[str, Callable[[], Patch]] = {
    "client-seq-restart": _client_seq_restart,
    "shm-token-unchecked": _shm_token_unchecked,
    "client-not-relinked": _client_not_relinked,
    "router-link-loss-unanswered": _router_link_loss_unanswered,
    "client-ignores-relinked": _client_ignores_relinked,
    "wal-crc-unchecked": _wal_crc_unchecked,
    "wal-damage-as-torn": _wal_damage_as_torn,
    "wal-reached-forgotten": _wal_reached_forgotten,
}


@contextlib.contextmanager
def patched(
    name: str | None, *, real_shard: bool = False, real_client: bool = False
) -> Iterator[None]:
    """Run with the real code paths' form of the defect ``name`` in place (None, or a
    defect without one: nothing); ``real_shard``: the real shard's too
    (:data:`SHARD_PATCHES`); ``real_client``: the client driver's (:data:`CLIENT_PATCHES`)."""
    table = {**_PATCHES, **SHARD_PATCHES} if real_shard else dict(_PATCHES)
    if real_client:
        table.update(CLIENT_PATCHES)
    if name is None or name not in table:
        yield
        return
    patches = table[name]()
    saved = [(obj, attr, obj.__dict__[attr]) for obj, attr, _ in patches]
    for obj, attr, value in patches:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)
