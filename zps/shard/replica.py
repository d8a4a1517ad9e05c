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

import logging
import time
from typing import Any

from zps import transport
from zps.core.replication import StreamCheck, check_stream
from zps.errors import ProtocolError, ZpsError
from zps.protocol.codec import MsgType, Route, decode, encode
from zps.shard.core import ShardCore
from zps.shard.session import ShardSession
from zps.store.snapshot import decode_snapshot

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
        await transport.send(
            self.channel,
            encode(Route(MsgType.ACK), {"lsn": self.core.lsn, "epoch": self.core.epoch}),
        )

    async def _ask(self) -> None:
        if self.session.subscribe_due(time.monotonic()):
            header = {"partition": self.session.partition, "epoch": self.session.epoch}
            await transport.send(self.channel, encode(Route(MsgType.SUBSCRIBE), header))
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
                case MsgType.SNAPSHOT:
                    self.session.snapshot_loaded(self._load_snapshot(msg.header, msg.payloads))
                case MsgType.REPLICATE if self.session.synced:
                    self._apply_stream(msg.route, msg.header, msg.payloads)
                case MsgType.BYE:
                    self.session.refused()
                    log.info("the primary refused the subscription: %s", msg.header.get("msg"))
        except ProtocolError:
            raise
        except ZpsError as e:
            raise ProtocolError(str(e)) from e

    def _load_snapshot(self, header: dict[str, Any], payloads: Any) -> bool:
        snap = decode_snapshot(header, payloads, max_bytes=self.max_message_bytes)
        if snap.epoch != self.core.epoch or snap.partition != self.core.partition:
            return False
        self.core.load_snapshot(snap)
        log.info("loaded a snapshot of partition %d at LSN %d", snap.partition, snap.lsn)
        return True

    def _apply_stream(self, route: Route, head: dict[str, Any], payloads: Any) -> None:
        prev, lsn = head.get("prev"), head.get("lsn")
        if type(prev) is not int or type(lsn) is not int or not payloads:
            raise ProtocolError("replication header needs integer prev and lsn")
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
