"""The shard process: serves one partition for the broker.

It connects a DEALER to the broker, registers (claiming the partition it
already serves, so a restarted broker rebuilds its map from the shards),
answers requests through :class:`~zps.shardcore.ShardCore`, and heartbeats.

Frames from the broker are ``[source, route, header, payloads...]``: an empty
``source`` is the broker itself, anything else is the client to answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Any

import zmq.asyncio

from zps import transport
from zps.cluster import Role
from zps.codec import MsgType, Route, decode, encode, unpack_route
from zps.config import ShardConfig
from zps.errors import ClosedError, ProtocolError
from zps.shardcore import ShardCore

log = logging.getLogger("zps.shard")


class ShardServer:
    def __init__(self, config: ShardConfig, *, node_id: str | None = None) -> None:
        self.config = config
        self.node_id = node_id or f"s-{uuid.uuid4().hex[:12]}"
        self.core = ShardCore()
        self.role = Role.SPARE
        self.assigned = asyncio.Event()
        self._stop = asyncio.Event()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._last_broker = 0.0
        self._broker_lost = False

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Serve until :meth:`stop`; sockets are closed on the way out."""
        self._ctx = transport.new_context()
        self._sock = transport.dealer(
            self._ctx,
            self.config.broker,
            self.node_id.encode(),
            max_message_bytes=self.config.max_message_bytes,
        )
        log.info(
            "shard %s (pid %d) connecting to %s", self.node_id, os.getpid(), self.config.broker
        )
        try:
            await self._register()
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._recv_loop()), tg.create_task(self._heartbeat_loop())]
                await self._stop.wait()
                await self._to_broker(MsgType.BYE, {})
                for t in tasks:
                    t.cancel()
        finally:
            transport.close(self._sock)
            transport.term(self._ctx)
            log.info("shard %s stopped", self.node_id)

    # -- broker link ---------------------------------------------------------

    async def _to_broker(self, mtype: MsgType, header: dict[str, Any]) -> None:
        assert self._sock is not None
        await transport.send(self._sock, [b"", *encode(Route(mtype), header)])

    async def _register(self) -> None:
        claim = None
        if self.role is Role.PRIMARY and self.core.partition is not None:
            claim = [self.core.partition, self.core.epoch]
        await self._to_broker(
            MsgType.REGISTER,
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "address": "",
                "claim": claim,
                "lsn": self.core.lsn,
            },
        )

    async def _heartbeat_loop(self) -> None:
        hb = self.config.heartbeat
        while True:
            await asyncio.sleep(hb.interval)
            await self._to_broker(
                MsgType.HEARTBEAT, {"lsn": self.core.lsn, "stats": self.core.report()}
            )
            silent = time.monotonic() - self._last_broker
            if silent > hb.interval * hb.liveness and not self._broker_lost:
                self._broker_lost = True
                log.warning(
                    "no word from the broker for %.1fs; still serving, "
                    "re-registering when it answers",
                    silent,
                )

    def _on_broker(self, route: Route, header: dict[str, Any]) -> bool:
        """Handle a control message; returns True when a re-registration is due."""
        match route.mtype:
            case MsgType.ASSIGN:
                role = Role(header["role"])
                partition = header.get("partition")
                epoch = int(header.get("epoch", 0))
                self.role = role
                self.core.assign(partition if role is Role.PRIMARY else None, epoch)
                log.info("assigned: %s of partition %s at epoch %d", role.value, partition, epoch)
                self.assigned.set()
            case MsgType.REGISTER:  # the broker does not know us (it restarted)
                return True
            case MsgType.HEARTBEAT | MsgType.MAP:
                pass
            case _:
                log.warning("unexpected %s from the broker", route.mtype.name)
        return False

    # -- requests ------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            try:
                burst = await transport.recv_burst(sock)
            except ClosedError:
                return
            self._last_broker = time.monotonic()
            if self._broker_lost:
                self._broker_lost = False
                log.info("broker is back")
            for frames in burst:
                if len(frames) < 3:
                    self.core.stats.malformed += 1
                    continue
                source = transport.frame_bytes(frames[0])
                try:
                    route = unpack_route(transport.frame_buffer(frames[1]))
                except ProtocolError as e:
                    self.core.stats.malformed += 1
                    log.debug("dropped a message with a bad route frame: %s", e)
                    continue
                if not source:
                    try:
                        msg = decode([transport.frame_buffer(f) for f in frames[1:]])
                        if self._on_broker(route, msg.header):
                            await self._register()
                    except (ProtocolError, KeyError, ValueError, TypeError) as e:
                        self.core.stats.malformed += 1
                        log.warning("bad control message from the broker: %s", e)
                    continue
                await transport.send(sock, [source, *self._answer(route, frames[1:])])

    def _answer(self, route: Route, frames: list[Any]) -> list[Any]:
        bufs = [transport.frame_buffer(f) for f in frames]
        try:
            msg = decode(bufs)
        except ProtocolError as e:
            self.core.stats.malformed += 1
            reply = Route(MsgType.REPLY, route.partition, self.core.epoch, route.req_id)
            return encode(reply, {"st": "BAD_REQUEST", "msg": str(e)})
        if route.mtype is not MsgType.REQUEST:
            self.core.stats.malformed += 1
            reply = Route(MsgType.REPLY, route.partition, self.core.epoch, route.req_id)
            return encode(
                reply,
                {"st": "BAD_REQUEST", "msg": f"a shard serves REQUEST, not {route.mtype.name}"},
            )
        return self.core.handle(route, msg.header, msg.payloads)
