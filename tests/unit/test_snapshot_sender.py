"""The primary's snapshot sender and the writes a joining replica lets go on.

With ``write_while_repairing``, an acks="all" write is acknowledged on the primary's log
alone while a replica the map lists is being rebuilt.  The replica counts as being
rebuilt from the moment its SUBSCRIBE is taken, not once its snapshot is cut: the cut
waits for any other cut to end and holds the loop for a time that grows with the
partition, and a promoted primary refused every write until then."""

from __future__ import annotations

from typing import Any

from zps.protocol.messages import Role
from zps.shard.core import ShardCore
from zps.shard.session import ShardSession
from zps.shard.snapshots import SnapshotSender

P, E = 0, 3


def _promoted() -> tuple[ShardSession[str], ShardCore]:
    session: ShardSession[str] = ShardSession(
        "me", heartbeat_interval=0.1, liveness=10, min_in_sync=2, repair=True, now=0.0
    )
    session.assign(Role.REPLICA, P, E - 1, "tcp://old:1")
    session.assign(Role.PRIMARY, P, E)
    session.on_map(E, set(), {"spare"})
    core = ShardCore()
    core.assign(P, E, primary=True)
    core.lsn = 40
    return session, core


async def test_a_replica_whose_subscription_is_taken_lets_writes_go_on_before_its_cut() -> None:
    session, core = _promoted()
    posted: list[Any] = []

    def post(node: str, frames: list[Any]) -> bool:
        posted.append(frames)
        return True

    sender = SnapshotSender(session, core, post=post, drop=print)
    assert not session.enough_in_sync()  # the spare has not subscribed yet
    try:
        assert sender.subscribe("spare")
        # No turn of the loop yet: the transfer has not prepared, let alone cut.
        assert not posted
        assert session.enough_in_sync(), "writes wait for the spare's snapshot to be cut"
        assert session.followers["spare"].snapshot_lsn == core.lsn
    finally:
        sender.close()
