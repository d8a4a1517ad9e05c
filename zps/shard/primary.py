"""The primary's side of replication: the stream to followers over its ROUTER.

A replica subscribes here; it gets a snapshot, then every message that changed
state (header and payload frames as the client sent them), and acknowledges
the LSNs it applied.  Who may subscribe, when a follower counts as in sync and
which writes an acknowledgement releases is decided by
:class:`~zps.shard.session.ShardSession`; this module only moves the frames.
Invariant: every message that advanced the primary's LSN goes to every follower
in LSN order, or the follower is dropped and told so (BYE), so it resubscribes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from zps import transport
from zps.errors import ProtocolError
from zps.protocol.codec import Encoder, MsgType, Route, decode, encode
from zps.shard.core import ShardCore
from zps.shard.session import ShardSession
from zps.store.snapshot import encode_snapshot

log = logging.getLogger("zps.shard")

Reply = tuple[bytes, list[Any]]  # (client identity, reply frames)


class ReplicationStream:
    def __init__(
        self,
        session: ShardSession[Reply],
        core: ShardCore,
        channel: transport.Channel,
        *,
        release: Callable[[list[Reply]], None],
        report: Callable[[], Awaitable[None]],
    ) -> None:
        self.session = session
        self.core = core
        self.channel = channel
        self._release = release  # answer the clients of writes the replicas now hold
        self._report = report  # tell the broker the in-sync set at once

    async def serve(self) -> None:
        """Handle SUBSCRIBE and ACK until the ROUTER closes."""
        await transport.serve(self.channel, self._handle, self._malformed)

    def _malformed(self, frames: transport.Frames, e: ProtocolError) -> None:
        self.core.stats.malformed += 1
        log.warning("dropped a bad replication message: %s", e)

    async def _handle(self, frames: transport.Frames) -> None:
        try:
            node = transport.frame_bytes(frames[0]).decode()
            msg = decode([transport.frame_buffer(f) for f in frames[1:]])
            match msg.route.mtype:
                case MsgType.SUBSCRIBE:
                    await self._subscribe(node, msg.header, time.monotonic())
                case MsgType.ACK:
                    await self._on_ack(node, msg.header, time.monotonic())
                case _:
                    raise ProtocolError(f"unexpected {msg.route.mtype.name}")
        except (UnicodeDecodeError, ValueError, TypeError) as e:
            raise ProtocolError(str(e)) from e

    async def replicate(self, prev: int, frames: list[Any]) -> None:
        """Stream a request (header and payload frames as received) to every follower."""
        if not self.session.followers:
            return
        route = Route(MsgType.REPLICATE, self.core.partition or 0, self.core.epoch, 0)
        head = msgpack.packb({"prev": prev, "lsn": self.core.lsn})
        for node in list(self.session.followers):
            ok = await transport.send(
                self.channel, [node.encode(), route.pack(), head, *frames[1:]]
            )
            if not ok:
                self.drop(node, "its connection is gone")

    def drop(self, node: str, why: str) -> None:
        if self.session.follower_gone(node):
            log.warning("stopped streaming to replica %s: %s", node, why)
            # So it subscribes again, if it still can.
            transport.try_send(
                self.channel,
                [node.encode(), *encode(Route(MsgType.BYE), {"msg": f"stream stopped: {why}"})],
            )

    async def _subscribe(self, node: str, h: dict[str, Any], now: float) -> None:
        if not self.session.accepts_subscription(node, h.get("partition"), h.get("epoch")):
            partition, epoch = h.get("partition"), h.get("epoch")
            refusal = {"msg": f"not the primary of partition {partition} at epoch {epoch}"}
            await transport.send(
                self.channel, [node.encode(), *encode(Route(MsgType.BYE), refusal)]
            )
            return
        snap = self.core.snapshot()
        enc = Encoder()
        header = encode_snapshot(enc, snap)
        route = Route(MsgType.SNAPSHOT, snap.partition, snap.epoch, snap.lsn)
        self.session.subscribed(node, snap.lsn, now)
        await transport.send(self.channel, [node.encode(), *enc.build(route, header)])
        log.info(
            "replica %s subscribed: snapshot at LSN %d (%d tables)",
            node,
            snap.lsn,
            len(snap.export["specs"]),
        )

    async def _on_ack(self, node: str, h: dict[str, Any], now: float) -> None:
        lsn = h.get("lsn")
        if type(lsn) is not int:
            return
        result = self.session.acked(node, lsn, h.get("epoch"), now)
        if result.in_sync:
            log.info("replica %s is in sync at LSN %d", node, self.session.followers[node].acked)
            await self._report()  # tell the broker now, not at the next beat
        self._release(result.released)
