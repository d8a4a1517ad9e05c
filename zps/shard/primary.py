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

A follower on this host (its SUBSCRIBE names this process's shared-memory host key)
gets the large payload frames through this process's arena (:mod:`zps.shm`): each
such message's frames are copied there once, whoever follows (a write whose frames
came through a client's shared memory was read straight into the arena, see
``stage_room``: no copy at all), and the region is freed when every follower it
went to has acknowledged its LSN or left.  A region
the follower finds reused (it was reclaimed, see ``SHM_RECLAIM_S``) makes it resync;
what it reads is never another message's bytes.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, assert_never

import msgpack

from zps import shm, transport
from zps.errors import ProtocolError
from zps.ops.security import RefusalLog
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


#: Follower names bound to keys at most (past it, only current replicas' are kept).
MAX_OWNERS = 4096
#: Messages zmq queues per follower before :class:`~zps.transport.Outbound` holds them
#: (counted in bytes): keeps the bytes zmq itself may pin for a stalled follower small.
REPLICATION_HWM = 64


@dataclass(slots=True)
class _SharedFrames:
    """Regions of the arena holding one stream message's large frames, until every
    follower it went to (``readers``) acknowledged ``lsn`` or left."""

    lsn: int
    tokens: list[int]
    nbytes: int
    readers: set[str]
    born: float
    #: The message as received: frames read into regions of the arena (see
    #: ``stage_room``) live as long as something refers to them.
    frames: list[Any]


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
        shared: shm.SharedMemory | None = None,
    ) -> None:
        self.session = session
        self.core = core
        self.channel = channel
        self.queue_bytes = queue_bytes
        # Per follower: ``queue_bytes`` of stream beyond its snapshot (see _subscribe).
        self.out = transport.Outbound(
            channel,
            total_limit=1 << 62,
            stall_timeout=stall_timeout,
            name="replication",
        )
        self.dropped = 0  # followers dropped for a full queue or silence
        #: CURVE: follower name -> the key that owns it here (see _admit), and refusals.
        self._owners: dict[str, bytes] = {}
        self.refusals = RefusalLog(log, "the replication endpoint")
        self._release = release  # answer the clients of writes the replicas now hold
        self._settle = settle  # re-decide what waiting writes wait for (a follower left)
        self._report = report  # tell the broker the in-sync set at once
        self.snapshots = SnapshotSender(session, core, post=self._post, drop=self.drop)
        #: Same-host shared memory for large stream frames (None: every frame inline),
        #: the followers that read it, and the regions they have still to read.
        self.shm = shared
        self.shm_followers: set[str] = set()
        self._shared: collections.deque[_SharedFrames] = collections.deque()
        self.shared_bytes = 0
        self.shared_messages = 0  # stream messages whose large frames went this way
        #: At most this much of the arena holds stream frames; the rest is the replies'.
        self.shared_limit = shared.budget // 2 if shared is not None else 0

    async def serve(self) -> None:
        """Handle SUBSCRIBE and ACK until the ROUTER closes."""
        unwatch = (
            transport.watch_handshakes(
                self.channel, self._handshake_refused, self._connection_closed, auth=True
            )
            if self.channel.curve_server
            else None
        )
        try:
            await transport.serve(self.channel, self._handle, self._malformed, fast=self._take)
        finally:
            if unwatch is not None:
                unwatch()
            self.snapshots.close()
            self.out.close()
            self._release_shared(lambda entry: True)

    def _malformed(self, frames: transport.Frames, e: ProtocolError) -> None:
        self.core.stats.malformed += 1
        log.warning("dropped a bad replication message: %s", e)

    async def _handle(self, frames: transport.Frames) -> None:
        self._take(frames)

    def _take(self, frames: transport.Frames) -> bool:
        """Every message, handled at once (in the reader callback: see transport.serve)."""
        try:
            node = transport.frame_bytes(frames[0]).decode()
            key = transport.sender_key(frames[1]) if len(frames) > 1 else None
            if key is not None and not self._admit(node, key, frames):
                return True  # refused, counted
            msg = decode([transport.frame_buffer(f) for f in frames[1:]])
            try:
                message = _from_replica(msg.route.mtype, msg.header)
            except ProtocolError:
                self._unreadable(node, msg.route.mtype, msg.header)
                return True
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
        return True

    def _handshake_refused(self, peer: str, key: bytes | None, reason: str) -> None:
        self.refusals.refused(f"a peer {peer}", key, reason, time.monotonic())

    def _connection_closed(self, fd: int) -> None:
        """CURVE: a follower's connection closed: it is dropped, and nothing goes to its
        name until its key subscribes again (the next connection may be another's)."""
        node = self.out.connection_closed(fd)
        if node is not None:
            self.drop(node.decode("utf-8", "replace"), "its connection closed")

    def bind_keys(self, keys: Mapping[str, str]) -> None:
        """CURVE: the broker's word on which key registered each shard name (Z85): that
        key owns the name here.  A follower of another key under a name is dropped."""
        for node, key in keys.items():
            owner, self._owners[node] = self._owners.get(node), key.encode()
            if owner is not None and owner != key.encode() and node in self.session.followers:
                self.drop(node, "its key is not the one its name registered with")
        if len(self._owners) > MAX_OWNERS:  # a current replica's and the broker's stay
            self._owners = {
                n: k for n, k in self._owners.items() if n in self.session.replicas or n in keys
            }

    def _admit(self, node: str, key: bytes, frames: transport.Frames) -> bool:
        """CURVE: a follower is a shard identity, owned by the key the broker says
        registered it (:meth:`bind_keys`) or, from a broker that does not say, by the
        key that first subscribed as an assigned replica, for this process's life: a
        message from any other key under it (a subscription, an acknowledgement that
        would release ``acks="all"`` writes) is refused, counted by reason and logged
        once per peer and key a minute."""
        now = time.monotonic()
        if not node.startswith("s-"):
            self.refusals.refused(node, key, "wrong_role", now, "not a shard identity")
            return False
        owner = self._owners.get(node)
        if owner is None and node in self.session.replicas:
            if len(self._owners) >= MAX_OWNERS:  # never a current replica's
                self._owners = {n: k for n, k in self._owners.items() if n in self.session.replicas}
            owner = self._owners[node] = key
        if owner is None or owner == key:
            self.channel.accepted(frames)
            return True
        self.refusals.refused(node, key, "identity_of_another_key", now)
        return False

    def _unreadable(self, node: str, mtype: MsgType, h: dict[str, Any]) -> None:
        """A SUBSCRIBE, ACK or SNAPSHOT_ACK whose header its record refuses: not
        malformed traffic but a request this primary cannot serve.  A subscription is
        refused (BYE, so a replica asks again); an acknowledgement is ignored, as one of
        another stream would be."""
        if mtype is MsgType.SUBSCRIBE:
            partition, epoch = h.get("partition"), h.get("epoch")
            self._bye(node, f"not the primary of partition {partition} at epoch {epoch}")

    def replicate(self, prev: int, frames: list[Any], *, checked: bool = False) -> None:
        """Stream a request (header and payload frames as received) to every follower;
        never waits: a follower that cannot take it within its bound is dropped.
        ``checked``: every operation of it succeeded here (see Replicate)."""
        if not self.session.followers:
            return
        route = Route(MsgType.REPLICATE, self.core.partition or 0, self.core.epoch, 0)
        head = msgpack.packb(Replicate(prev, self.core.lsn, checked).to_wire())
        message = [route.pack(), head, *frames[1:]]
        shared, readers = self._share(message)
        for node in list(self.session.followers):
            out = shared if node in readers else message
            posted = self.out.post([node.encode(), *out], self._limit(node))
            if posted is transport.Posted.DROPPED:
                self.drop(node, f"more than {self.queue_bytes} bytes of stream unread")
            elif posted is transport.Posted.UNROUTABLE:
                self.drop(node, "its connection is gone")

    def stage_room(self) -> int:
        """How many bytes of a write's large frames, read from a client's shared memory,
        should go straight into this process's arena (0: none).  Some, when every
        follower reads the stream from there in sync (an inline follower's queue would
        pin them), up to what is left of the stream's share.  The write is then applied
        from those bytes and streamed with no copy of its own."""
        followers = self.session.followers
        if self.shm is None or not followers:
            return 0
        readers = self.shm_followers & self.session.local_in_sync
        if any(node not in readers for node in followers):
            return 0
        return max(0, self.shared_limit - self.shared_bytes)

    def _share(self, message: list[Any]) -> tuple[list[Any], set[str]]:
        """``message`` with its large payload frames in this process's arena, and the
        followers to send it that way (the region waits for them); no followers when
        none reads this way, no frame is large enough, or the stream's share of the
        arena is spent (then all go inline)."""
        sm = self.shm
        if sm is None or not self.shm_followers or not sm.wants(message):
            return message, set()
        # In-sync followers only: one still loading a snapshot may take longer than
        # the stall timeout to read its stream, so its frames wait inline, bounded
        # as before (the Outbound's allowance).
        readers = self.shm_followers & self.session.local_in_sync
        size = transport.message_bytes(message[2:])  # at most this goes to the arena
        if not readers or self.shared_bytes + size > self.shared_limit:
            return message, set()
        out, descs = sm.outbound(message)
        if not descs:
            return message, set()
        nbytes = sum(d[5] for d in descs)
        entry = _SharedFrames(
            self.core.lsn, shm.tokens(descs), nbytes, readers, time.monotonic(), message
        )
        self._shared.append(entry)
        self.shared_bytes += nbytes
        self.shared_messages += 1
        return out, readers

    def expire_shared(self, now: float) -> None:
        """Drop the followers that have not acknowledged a message whose frames have
        waited in shared memory for the stall timeout: zmq takes descriptors without
        filling, so this is what the Outbound's stall timeout is for inline frames.
        Readers that are no longer followers (this shard stepped down, or the session
        let them go) are forgotten at once."""
        if not self._shared:
            return
        readers: set[str] = set()
        for entry in self._shared:
            readers |= entry.readers
        for node in readers - self.session.followers.keys():
            self._forget_reader(node)
        while self._shared and now - self._shared[0].born > self.out.stall_timeout:
            entry = self._shared[0]
            for node in sorted(entry.readers):
                self.drop(node, f"stream in shared memory unread for {self.out.stall_timeout}s")
            if self._shared and self._shared[0] is entry:  # no reader left: freed by drop
                break

    def _read(self, node: str, lsn: int) -> None:
        """``node`` acknowledged ``lsn``: the regions of messages up to it are read."""
        for entry in self._shared:
            if entry.lsn > lsn:
                break
            entry.readers.discard(node)
        self._release_shared(lambda entry: not entry.readers, front=True)

    def _release_shared(self, done: Callable[[_SharedFrames], bool], front: bool = False) -> None:
        """Free the regions of entries ``done`` says are finished (from the front only,
        with ``front``: regions are freed in LSN order as acknowledgements arrive)."""
        kept: collections.deque[_SharedFrames] = collections.deque()
        while self._shared:
            entry = self._shared.popleft()
            if not done(entry):
                if front:
                    self._shared.appendleft(entry)
                    return
                kept.append(entry)
                continue
            self.shared_bytes -= entry.nbytes
            if self.shm is not None:
                self.shm.free(entry.tokens)
        self._shared = kept

    def _forget_reader(self, node: str) -> None:
        self.shm_followers.discard(node)
        for entry in self._shared:
            entry.readers.discard(node)
        self._release_shared(lambda entry: not entry.readers)

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
        self._forget_reader(node)
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
        if self.shm is not None and sub.host == self.shm.host:
            self.shm_followers.add(node)
        else:
            self._forget_reader(node)  # it asked for the stream inline
        if not self.snapshots.subscribe(node, sub.abandoned, sub.checksums):
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
        if self._shared:
            self._read(node, ack.lsn)
        if result.in_sync:
            log.info("replica %s is in sync at LSN %d", node, self.session.followers[node].acked)
            self._report()  # tell the broker now, not at the next beat
        self._release(result.released)
