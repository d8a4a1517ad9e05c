"""The primary's side of replication: the stream to followers over its ROUTER.

A replica subscribes here; it gets a snapshot, then every message that changed
state (header and payload frames as the client sent them), and acknowledges
the LSNs it applied.  Who may subscribe, when a follower counts as in sync and
which writes an acknowledgement releases is decided by
:class:`~zps.shard.session.ShardSession`; this module only moves the frames.
Invariants: every message that advanced the primary's LSN goes to every follower
in LSN order, or the follower is dropped and told so (BYE), so it resubscribes.
The primary never waits on a follower: what zmq cannot take for one at once is
held for it (:class:`~zps.transport.Outbound`), within ``queue_bytes`` of stream
beyond the snapshot it was sent; a follower past that bound is dropped, and the
session reports it out of sync.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, assert_never

import msgpack

from zps import transport
from zps.errors import ProtocolError
from zps.protocol.codec import MsgType, Route, decode, encode
from zps.protocol.messages import (
    Bye,
    FromReplica,
    Replicate,
    SnapshotAck,
    StreamAck,
    Subscribe,
)
from zps.shard.core import ShardCore
from zps.shard.session import ShardSession
from zps.shard.snapshots import SnapshotSender

log = logging.getLogger("zps.shard")

Reply = tuple[bytes, list[Any]]  # (client identity, reply frames)


#: Messages zmq queues per follower before :class:`~zps.transport.Outbound` holds them
#: (counted in bytes): keeps the bytes zmq itself may pin for a stalled follower small.
REPLICATION_HWM = 64


def _from_replica(mtype: MsgType, header: dict[str, Any]) -> FromReplica | None:
    """The record of a message from a replica (None: not one a primary expects)."""
    match mtype:
        case MsgType.SUBSCRIBE:
            return Subscribe.parse(header)
        case MsgType.ACK:
            return StreamAck.parse(header)
        case MsgType.SNAPSHOT_ACK:
            return SnapshotAck.parse(header)
        case _:
            return None


class ReplicationStream:
    def __init__(
        self,
        session: ShardSession[Reply],
        core: ShardCore,
        channel: transport.Channel,
        *,
        release: Callable[[list[Reply]], None],
        settle: Callable[[], None],
        report: Callable[[], None],
        queue_bytes: int,
        stall_timeout: float,
    ) -> None:
        self.session = session
        self.core = core
        self.channel = channel
        self.queue_bytes = queue_bytes
        # Per follower: ``queue_bytes`` of stream beyond its snapshot (see _subscribe).
        self.out = transport.Outbound(
            channel, total_limit=1 << 62, stall_timeout=stall_timeout, name="replication"
        )
        self.dropped = 0  # followers dropped for a full queue or silence
        self._release = release  # answer the clients of writes the replicas now hold
        self._settle = settle  # re-decide what waiting writes wait for (a follower left)
        self._report = report  # tell the broker the in-sync set at once
        self.snapshots = SnapshotSender(session, core, post=self._post, drop=self.drop)

    async def serve(self) -> None:
        """Handle SUBSCRIBE and ACK until the ROUTER closes."""
        try:
            await transport.serve(self.channel, self._handle, self._malformed)
        finally:
            self.snapshots.close()
            self.out.close()

    def _malformed(self, frames: transport.Frames, e: ProtocolError) -> None:
        self.core.stats.malformed += 1
        log.warning("dropped a bad replication message: %s", e)

    async def _handle(self, frames: transport.Frames) -> None:
        try:
            node = transport.frame_bytes(frames[0]).decode()
            msg = decode([transport.frame_buffer(f) for f in frames[1:]])
            try:
                message = _from_replica(msg.route.mtype, msg.header)
            except ProtocolError:
                self._unreadable(node, msg.route.mtype, msg.header)
                return
            match message:
                case Subscribe() as sub:
                    self._subscribe(node, sub, time.monotonic())
                case StreamAck() as ack:
                    self._on_ack(node, ack, time.monotonic())
                case SnapshotAck() as ack:
                    self.snapshots.acked(node, ack)
                case None:
                    raise ProtocolError(f"unexpected {msg.route.mtype.name}")
                case unknown:
                    assert_never(unknown)
        except (UnicodeDecodeError, ValueError, TypeError) as e:
            raise ProtocolError(str(e)) from e

    def _unreadable(self, node: str, mtype: MsgType, h: dict[str, Any]) -> None:
        """A SUBSCRIBE, ACK or SNAPSHOT_ACK whose header its record refuses: not
        malformed traffic but a request this primary cannot serve.  A subscription is
        refused (BYE, so a replica asks again); an acknowledgement is ignored, as one of
        another stream would be."""
        if mtype is MsgType.SUBSCRIBE:
            partition, epoch = h.get("partition"), h.get("epoch")
            self._bye(node, f"not the primary of partition {partition} at epoch {epoch}")

    def replicate(self, prev: int, frames: list[Any]) -> None:
        """Stream a request (header and payload frames as received) to every follower;
        never waits: a follower that cannot take it within its bound is dropped."""
        if not self.session.followers:
            return
        route = Route(MsgType.REPLICATE, self.core.partition or 0, self.core.epoch, 0)
        head = msgpack.packb(Replicate(prev, self.core.lsn).to_wire())
        for node in list(self.session.followers):
            posted = self.out.post(
                [node.encode(), route.pack(), head, *frames[1:]], self._limit(node)
            )
            if posted is transport.Posted.DROPPED:
                self.drop(node, f"more than {self.queue_bytes} bytes of stream unread")
            elif posted is transport.Posted.UNROUTABLE:
                self.drop(node, "its connection is gone")

    def _post(self, node: str, frames: list[Any]) -> bool:
        posted = self.out.post([node.encode(), *frames], self._limit(node))
        return posted is transport.Posted.SENT or posted is transport.Posted.HELD

    def _limit(self, node: str) -> int:
        # Until it caught up, its snapshot may still be held for it too.
        follower = self.session.followers.get(node)
        if follower is None or node in self.session.local_in_sync:
            return self.queue_bytes
        return self.queue_bytes + follower.snapshot_bytes

    def drop(self, node: str, why: str) -> None:
        """Stop streaming to ``node`` (it must resubscribe) and report the smaller set."""
        self.snapshots.cancel(node)
        self.out.forget(node.encode())
        if self.session.follower_gone(node):
            self.dropped += 1
            log.warning("stopped streaming to replica %s: %s", node, why)
            self._bye(node, f"stream stopped: {why}")
            self._report()
        self._settle()

    def _bye(self, node: str, why: str) -> None:
        # So it subscribes again, if it still can.
        self.out.post([node.encode(), *encode(Route(MsgType.BYE), Bye(why).to_wire())], 1 << 16)

    def _subscribe(self, node: str, sub: Subscribe, now: float) -> None:
        if not self.session.accepts_subscription(node, sub.partition, sub.epoch):
            self._bye(node, f"not the primary of partition {sub.partition} at epoch {sub.epoch}")
            return
        if not self.snapshots.subscribe(node, sub.abandoned):
            return  # its snapshot is on its way (zps.shard.snapshots)
        self.out.forget(node.encode())  # what was held for an earlier subscription

    def _on_ack(self, node: str, ack: StreamAck, now: float) -> None:
        if node not in self.session.followers:
            # A replica that was dropped, or that follows an earlier primary: it must
            # subscribe again (its state is not this stream's).
            if self.session.accepts_subscription(node, self.session.partition, self.session.epoch):
                self._bye(node, "not subscribed: resynchronise")
            return
        if node not in self.session.replicas:
            self.drop(node, "no longer a replica of this partition")
            return
        result = self.session.acked(node, ack.lsn, ack.epoch, now, ack.base)
        if result.in_sync:
            log.info("replica %s is in sync at LSN %d", node, self.session.followers[node].acked)
            self._report()  # tell the broker now, not at the next beat
        self._release(result.released)
