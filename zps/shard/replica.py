"""A replica's side of replication: one subscription to its primary.

It asks the primary for the stream (again every two heartbeat intervals until
a snapshot arrives), loads the snapshot, then applies the stream strictly in
LSN order and acknowledges what it applied.  Invariants: the stream is applied
only on top of a loaded snapshot of this partition at this epoch
(:attr:`ShardSession.synced <zps.shard.session.ShardSession.synced>`); a gap, a
message that does not apply or one that leaves another LSN than the primary's
means a fresh snapshot (:meth:`~zps.shard.session.ShardSession.resync`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from zps import transport
from zps.core.replication import StreamCheck, check_stream
from zps.errors import ProtocolError, ZpsError
from zps.protocol.codec import BufferLike, MsgType, Route, decode, encode
from zps.protocol.messages import (
    Bye,
    Replicate,
    SnapshotAck,
    SnapshotChunk,
    StreamAck,
    Subscribe,
)
from zps.shard.checkpoint import CheckpointError, decode_checkpoint
from zps.shard.core import ShardCore
from zps.shard.session import ShardSession
from zps.store.snapshot import ChunkAssembly, Snapshot

#: Stream messages kept while a snapshot arrives, applied once it is loaded.
HELD_STREAM_BYTES = 256 << 20
#: The largest snapshot a replica assembles (as a checkpoint file may be).
MAX_SNAPSHOT_BYTES = 1 << 40
#: A snapshot transfer with no chunk for this long is abandoned and asked for again.
CHUNK_STALL_S = 10.0

log = logging.getLogger("zps.shard")


class Upstream:
    def __init__(
        self,
        session: ShardSession[Any],
        core: ShardCore,
        channel: transport.Channel,
        *,
        interval: float,
        max_message_bytes: int,
    ) -> None:
        self.session = session
        self.core = core
        self.channel = channel
        self.interval = interval
        self.max_message_bytes = max_message_bytes
        #: The snapshot being received (chunks arrive in order), when one is.
        self._assembly: ChunkAssembly | None = None
        self._last_chunk = 0.0
        self._abandoned: int | None = None
        #: Stream messages that arrived during the snapshot: (route, header, payloads).
        self._held: list[tuple[Route, Replicate, Any]] = []
        self._held_bytes = 0

    async def run(self) -> None:
        """Subscribe to the primary, load its snapshot, then apply its stream."""
        self.session.upstream_started()
        await self._ask()
        await transport.serve(
            self.channel,
            self._handle,
            self._malformed,
            on_burst=self._after_burst,
            idle=self.interval,
            on_idle=self._ask,
        )

    async def ack(self) -> None:
        # Never waits on a primary that stopped reading: a later ack supersedes this one.
        transport.try_send(
            self.channel,
            encode(
                Route(MsgType.ACK),
                # ``base`` names the snapshot this state grew from: the primary counts
                # acknowledgements of its own stream only, never of another history.
                StreamAck(self.core.lsn, self.core.epoch, self.session.base_lsn).to_wire(),
            ),
        )

    async def _ask(self) -> None:
        now = time.monotonic()
        if self._assembly is not None and now - self._last_chunk < CHUNK_STALL_S:
            return  # a snapshot is on its way: asking again would not speed it up
        if self._assembly is not None:
            log.warning("snapshot %d stalled; asking for a new one", self._assembly.snapshot_id)
            self._abandon()
        if self.session.subscribe_due(now):
            sub = Subscribe(self.session.partition, self.session.epoch, self._abandoned)
            await transport.send(self.channel, encode(Route(MsgType.SUBSCRIBE), sub.to_wire()))
            self.session.subscribe_sent(time.monotonic())

    async def _after_burst(self) -> None:
        if self.session.synced:
            await self.ack()
        await self._ask()

    def _malformed(self, frames: transport.Frames, e: ProtocolError) -> None:
        log.warning("bad message from the primary: %s; resync", e)
        self.session.resync()

    async def _handle(self, frames: transport.Frames) -> None:
        try:
            msg = decode([transport.frame_buffer(f) for f in frames])
            match msg.route.mtype:
                case MsgType.SNAPSHOT_CHUNK if not self.session.synced:
                    await self._on_chunk(msg.route, msg.header, msg.payloads)
                case MsgType.REPLICATE if self.session.synced:
                    self._apply_stream(msg.route, Replicate.parse(msg.header), msg.payloads)
                case MsgType.REPLICATE:  # the stream runs ahead of the snapshot's chunks
                    self._hold(msg.route, Replicate.parse(msg.header), msg.payloads)
                case MsgType.BYE:
                    bye = Bye.parse(msg.header)
                    self.session.refused()
                    log.info("the primary refused the subscription: %s", bye.msg)
        except ProtocolError:
            raise
        except ZpsError as e:
            raise ProtocolError(str(e)) from e

    def _abandon(self) -> None:
        if self._assembly is not None:
            self._abandoned = self._assembly.snapshot_id
        self._assembly = None
        self._held, self._held_bytes = [], 0
        self.session.resync()

    def _hold(self, route: Route, header: Replicate, payloads: Any) -> None:
        """Keep a stream message until the snapshot under way is loaded (bounded; what
        the snapshot already holds is skipped when the held messages are applied)."""
        size = sum(len(p) for p in payloads)
        if self._held_bytes + size > HELD_STREAM_BYTES:
            log.warning("stream during the snapshot passed %d bytes: resync", HELD_STREAM_BYTES)
            self._abandon()
            return
        self._held.append((route, header, payloads))
        self._held_bytes += size

    async def _on_chunk(
        self, route: Route, header: dict[str, Any], payloads: Sequence[BufferLike]
    ) -> None:
        """Take one snapshot chunk; once all are here, load the snapshot and the held stream."""
        try:
            chunk = SnapshotChunk.parse(header)
        except ProtocolError:
            if self._assembly is not None:
                self._abandon()
            raise
        seq, sid = chunk.seq, chunk.id
        if seq == 0 and (self._assembly is None or self._assembly.snapshot_id != sid):
            self._assembly = ChunkAssembly.from_header(header, max_bytes=MAX_SNAPSHOT_BYTES)
        assembly = self._assembly
        if assembly is None:  # the rest of a transfer this replica does not hold
            if sid != self._abandoned:
                self._abandoned = sid  # the next SUBSCRIBE asks for a new one
                self.session.resync()
            return
        try:
            done = assembly.add(sid, seq, payloads)
        except ProtocolError:
            self._abandon()
            raise
        self._last_chunk = time.monotonic()
        await transport.send(
            self.channel, encode(Route(MsgType.SNAPSHOT_ACK), SnapshotAck(sid, seq).to_wire())
        )
        if not done:
            return
        try:
            snap = await asyncio.to_thread(decode_checkpoint, assembly.stream())
        except CheckpointError as e:
            self._abandon()
            raise ProtocolError(f"snapshot {sid} does not decode: {e}") from None
        if self._assembly is not assembly:
            return  # replaced while decoding
        held, self._held, self._held_bytes = self._held, [], 0
        self._assembly = None
        self._abandoned = None
        ok = self._load(snap)
        self.session.snapshot_loaded(ok, snap.lsn)
        if ok:
            for r, h, p in held:
                if self.session.synced:
                    self._apply_stream(r, h, p)
            if self.session.synced:
                await self.ack()

    def _load(self, snap: Snapshot) -> bool:
        if snap.epoch != self.core.epoch or snap.partition != self.core.partition:
            return False
        self.core.load_snapshot(snap)
        log.info("loaded a snapshot of partition %d at LSN %d", snap.partition, snap.lsn)
        return True

    def _apply_stream(self, route: Route, head: Replicate, payloads: Any) -> None:
        prev, lsn = head.prev, head.lsn
        if not payloads:
            raise ProtocolError(f"REPLICATE of LSN {lsn} without the request it carries")
        verdict = check_stream(
            my_epoch=self.core.epoch,
            my_lsn=self.core.lsn,
            epoch=route.epoch,
            prev_lsn=prev,
            lsn=lsn,
        )
        if verdict is StreamCheck.DUPLICATE:
            return
        if verdict is StreamCheck.RESYNC:
            log.warning(
                "replication stream gap (at LSN %d, got %d..%d, epoch %d): resync",
                self.core.lsn,
                prev,
                lsn,
                route.epoch,
            )
            self.session.resync()
            return
        try:
            header = decode([Route(MsgType.REQUEST).pack(), payloads[0]]).header
            got = self.core.apply_replicated(header, payloads[1:])
        except (ZpsError, KeyError, ValueError) as e:
            log.error("could not apply LSN %d from the primary: %s; resync", lsn, e)
            self.session.resync()
            return
        if got != lsn:
            log.error("replica diverged: LSN %d after applying, primary had %d; resync", got, lsn)
            self.session.resync()
