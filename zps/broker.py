"""The broker process: one ROUTER endpoint for clients and shards.

Routing reads only the 20-byte route frame; headers and array frames are
forwarded as the same zmq frames (zero-copy).  Sender identities tell the two
kinds of peer apart: shards use ``s-...``, clients anything else.

* client -> broker: ``[client, route, header, payloads...]``; a REQUEST goes to
  the partition's primary as ``[shard, client, route, header, payloads...]``.
* shard -> broker: ``[shard, target, route, ...]``; a non-empty ``target`` is a
  client to forward the reply to, an empty one is a control message.

Any message counts as a heartbeat.  A shard silent past the liveness timeout
leaves the map, every client gets the new map, and requests for its
partition are answered ``SHARD_UNAVAILABLE`` at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

from zps import transport
from zps.cluster import Assignment, ClusterState
from zps.codec import MsgType, Route, decode, encode, unpack_route
from zps.config import BrokerConfig
from zps.errors import ClosedError, ProtocolError
from zps.membership import FailureDetector

log = logging.getLogger("zps.broker")


@dataclass
class BrokerStats:
    routed: int = 0
    replies: int = 0
    unavailable: int = 0
    malformed: int = 0
    undeliverable: int = 0


class Broker:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.state = ClusterState(config.partitions, config.slots)
        self.detector = FailureDetector(config.heartbeat.interval, config.heartbeat.liveness)
        self.stats = BrokerStats()
        self.endpoint: str | None = None
        self.bound = asyncio.Event()
        self._stop = asyncio.Event()
        self._sock: zmq.asyncio.Socket | None = None
        self._routes: list[bytes | None] = [None] * config.partitions
        self._epochs: list[int] = [0] * config.partitions
        self._started = time.monotonic()
        self._last_beat = 0.0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        ctx = transport.new_context()
        self._sock, self.endpoint = transport.router(
            ctx, self.config.bind, max_message_bytes=self.config.max_message_bytes
        )
        log.info(
            "broker (pid %d) listening on %s: %d partitions",
            os.getpid(),
            self.endpoint,
            self.config.partitions,
        )
        self.bound.set()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._recv_loop()), tg.create_task(self._tick_loop())]
                await self._stop.wait()
                for t in tasks:
                    t.cancel()
        finally:
            transport.close(self._sock)
            transport.term(ctx)
            log.info("broker stopped")

    # -- sending -------------------------------------------------------------

    async def _send(self, frames: list[Any]) -> bool:
        assert self._sock is not None
        ok = await transport.send(self._sock, frames)
        if not ok:
            self.stats.undeliverable += 1
        return ok

    async def _control(self, node: bytes, mtype: MsgType, header: dict[str, Any]) -> None:
        """Broker-originated message; shards get the empty source frame."""
        prefix = [node, b""] if node.startswith(b"s-") else [node]
        await self._send([*prefix, *encode(Route(mtype), header)])

    async def _reply_error(self, client: bytes, route: Route, code: str, message: str) -> None:
        reply = Route(MsgType.REPLY, route.partition, route.epoch, route.req_id)
        await self._send([client, *encode(reply, {"st": code, "msg": message})])

    async def _apply(self, assignments: list[Assignment]) -> None:
        for a in assignments:
            await self._control(
                a.node_id.encode(),
                MsgType.ASSIGN,
                {
                    "role": a.role.value,
                    "partition": a.partition,
                    "epoch": a.epoch,
                    "n_partitions": self.state.n_partitions,
                },
            )

    async def _publish_if_changed(self, before: int) -> None:
        if self.state.map_version == before:
            return
        for p in range(self.state.n_partitions):
            primary = self.state.primary_of(p)
            self._routes[p] = primary.encode() if primary else None
            self._epochs[p] = self.state.map.partitions[p].epoch
        wire = self.state.map.to_wire()
        for client in list(self.state.clients):
            await self._control(client.encode(), MsgType.MAP, {"map": wire})

    # -- receiving -----------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                burst = await transport.recv_burst(self._sock)
            except ClosedError:
                return
            now = time.monotonic()
            for frames in burst:
                if len(frames) < 2:
                    self.stats.malformed += 1
                    continue
                ident = transport.frame_bytes(frames[0])
                node = ident.decode("utf-8", "replace")
                self.detector.seen(node, now)
                try:
                    if ident.startswith(b"s-"):
                        await self._from_shard(ident, node, frames, now)
                    else:
                        await self._from_client(ident, node, frames, now)
                except ProtocolError as e:
                    self.stats.malformed += 1
                    log.debug("dropped a malformed message from %s: %s", node, e)

    async def _from_client(self, ident: bytes, node: str, frames: list[Any], now: float) -> None:
        route = unpack_route(transport.frame_buffer(frames[1]))
        if route.mtype is MsgType.REQUEST:
            p = route.partition
            target = self._routes[p] if 0 <= p < len(self._routes) else None
            if target is None:
                self.stats.unavailable += 1
                why = (
                    "no such partition"
                    if not 0 <= p < len(self._routes)
                    else "lost with its last shard"
                    if self.state.is_lost(p)
                    else "not yet assigned to a shard"
                )
                await self._reply_error(
                    ident, route, "SHARD_UNAVAILABLE", f"partition {p} has no live shard ({why})"
                )
                return
            self.stats.routed += 1
            if not await self._send([target, ident, *frames[1:]]):
                await self._reply_error(
                    ident, route, "SHARD_UNAVAILABLE", f"the shard of partition {p} is unreachable"
                )
            return
        msg = decode([transport.frame_buffer(f) for f in frames[1:]])
        known = node in self.state.clients
        match route.mtype:
            case MsgType.HELLO:
                h = msg.header
                self.state.register_client(
                    node,
                    host=str(h.get("host", "?")),
                    pid=int(h.get("pid", 0) or 0),
                    name=str(h.get("name", "")),
                    now=now,
                )
                log.info("client %s joined (%s pid %s)", node, h.get("host"), h.get("pid"))
                await self._control(ident, MsgType.MAP, {"map": self.state.map.to_wire()})
            case MsgType.HEARTBEAT:
                if not known:  # the broker restarted: let the client re-introduce itself
                    await self._control(ident, MsgType.HELLO, {})
            case MsgType.STATUS:
                await self._control(ident, MsgType.STATUS, self.status(now))
            case MsgType.BYE:
                self.detector.forget(node)
                self.state.node_gone(node)
            case _:
                raise ProtocolError(f"a client may not send {route.mtype.name}")

    async def _from_shard(self, ident: bytes, node: str, frames: list[Any], now: float) -> None:
        if len(frames) < 3:
            raise ProtocolError("shard message without target and route frames")
        target = transport.frame_bytes(frames[1])
        if target:
            self.stats.replies += 1
            await self._send([target, *frames[2:]])
            return
        route = unpack_route(transport.frame_buffer(frames[2]))
        msg = decode([transport.frame_buffer(f) for f in frames[2:]])
        h = msg.header
        before = self.state.map_version
        match route.mtype:
            case MsgType.REGISTER:
                claim: Any = h.get("claim")
                ok_claim = (
                    isinstance(claim, list)
                    and len(claim) == 2
                    and all(type(x) is int for x in claim)
                )
                assignments = self.state.register_shard(
                    node,
                    host=str(h.get("host", "?")),
                    pid=int(h.get("pid", 0) or 0),
                    address=str(h.get("address", "")),
                    now=now,
                    claim=(claim[0], claim[1]) if ok_claim else None,
                )
                log.info(
                    "shard %s registered (%s pid %s): %s",
                    node,
                    h.get("host"),
                    h.get("pid"),
                    ", ".join(
                        f"{a.role.value} of {a.partition} epoch {a.epoch}" for a in assignments
                    ),
                )
                await self._apply(assignments)
            case MsgType.HEARTBEAT:
                if node not in self.state.shards:
                    await self._control(ident, MsgType.REGISTER, {})
                else:
                    stats = h.get("stats")
                    self.state.report(
                        node,
                        lsn=int(h.get("lsn", 0)),
                        stats=stats if isinstance(stats, dict) else {},
                    )
            case MsgType.BYE:
                log.info("shard %s left", node)
                self.detector.forget(node)
                await self._apply(self.state.node_gone(node))
            case _:
                raise ProtocolError(f"a shard may not send {route.mtype.name} to the broker")
        await self._publish_if_changed(before)

    # -- time ----------------------------------------------------------------

    async def _tick_loop(self) -> None:
        interval = self.config.heartbeat.interval
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            before = self.state.map_version
            for node in self.detector.tick(now):
                kind = "shard" if node in self.state.shards else "client"
                log.warning("%s %s missed its heartbeats; declared dead", kind, node)
                await self._apply(self.state.node_gone(node))
            await self._publish_if_changed(before)
            if now - self._last_beat >= interval:
                self._last_beat = now
                for node in [*self.state.shards, *self.state.clients]:
                    await self._control(node.encode(), MsgType.HEARTBEAT, {})

    def status(self, now: float) -> dict[str, Any]:
        report = self.state.status(
            now, {n: self.detector.last_seen(n) for n in [*self.state.shards, *self.state.clients]}
        )
        report["broker"] = {
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "uptime_s": round(now - self._started, 1),
            "heartbeat_interval_s": self.config.heartbeat.interval,
            "liveness": self.config.heartbeat.liveness,
            **vars(self.stats),
        }
        return report
