"""The replication stream's regions in the primary's shared memory: who gets
descriptors, and when each region is freed (every reader acknowledged it, left, or
let it wait past the stall timeout).  Real zmq (inproc) and a real arena; the
replicas are DEALER sockets the test reads and writes, and the stream serves them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from zps import shm, transport
from zps.protocol.codec import MsgType, Route, decode, encode
from zps.protocol.messages import Role, StreamAck, Subscribe
from zps.shard.core import ShardCore
from zps.shard.primary import ReplicationStream
from zps.shard.session import ShardSession

pytestmark = pytest.mark.skipif(shm.host_key() is None, reason="no memfd or /proc here")

P, E = 0, 1
STALL = 2.0
BIG = 2 << 20  # a payload frame above shm.MIN_BYTES


@dataclass
class Rig:
    stream: ReplicationStream
    session: ShardSession[Any]
    core: ShardCore
    shared: shm.SharedMemory
    replicas: dict[str, zmq.Socket[Any]]

    def write(self, payload: bytes) -> int:
        """A request that advanced the LSN, streamed as the shard server does."""
        prev = self.core.lsn
        self.core.lsn += 1
        head = msgpack.packb({"op": "push_dense"})
        self.stream.replicate(prev, [b"route", head, payload])
        return self.core.lsn

    def received(self, node: str) -> list[list[bytes]]:
        sock, out = self.replicas[node], []
        while sock.poll(200):
            out.append(sock.recv_multipart())
        return out

    async def tell(self, node: str, mtype: MsgType, header: dict[str, Any]) -> None:
        """``node`` sends the primary a message; returns once the stream has taken it
        (its channel counts it received, and the stream handles what it receives at
        once, in that step)."""
        seen = self.stream.channel.received
        self.replicas[node].send_multipart(encode(Route(mtype), header))
        async with asyncio.timeout(5):
            while self.stream.channel.received == seen:
                await asyncio.sleep(0)

    async def ack(self, node: str, lsn: int) -> None:
        base = self.session.followers[node].snapshot_lsn
        await self.tell(node, MsgType.ACK, StreamAck(lsn, E, base).to_wire())

    async def subscribe(self, node: str, host: str | None = None) -> None:
        await self.tell(node, MsgType.SUBSCRIBE, Subscribe(P, E, host=host).to_wire())

    @property
    def live(self) -> int:
        return self.shared.stats()["live"]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    ctx = transport.new_context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind("inproc://stream")
    plain = zmq.Context.shadow(ctx.underlying)  # the replicas: blocking sockets
    replicas = {}
    for node in ("r1", "r2", "r3"):
        d = plain.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, node.encode())
        d.connect("inproc://stream")
        replicas[node] = d
    session: ShardSession[Any] = ShardSession(
        "s-primary", heartbeat_interval=0.25, liveness=4, now=0.0
    )
    session.assign(Role.PRIMARY, P, E)
    session.on_map(E, set(), set(replicas))
    core = ShardCore()
    core.partition, core.epoch, core.primary = P, E, True
    shared = shm.SharedMemory(64 << 20, "test")
    stream = ReplicationStream(
        session,
        core,
        transport.Channel(router),
        release=lambda replies: None,
        settle=lambda: None,
        report=lambda: None,
        queue_bytes=64 << 20,
        stall_timeout=STALL,
        shared=shared,
    )
    for node in replicas:  # subscribed (as the snapshot sender records it) and in sync
        session.subscribed(node, 0, 0.0)
        assert session.acked(node, 0, E, 0.0, 0).in_sync
    stream.shm_followers = {"r1", "r2"}  # r3 asked for the stream inline
    r = Rig(stream, session, core, shared, replicas)
    serving = asyncio.create_task(stream.serve())
    try:
        yield r
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        transport.close(stream.channel)
        for d in replicas.values():
            d.close(0)
        shared.close()
        ctx.term()


def _read(frames: list[bytes], reader: shm.SharedMemory) -> list[Any]:
    """A replica's reading of a stream message: its frames as if sent inline."""
    msg = decode(frames)
    if shm.KEY not in msg.header:
        return frames
    return reader.inbound(frames, msg.header).frames


async def test_a_subscription_naming_this_host_reads_through_shared_memory(rig: Rig) -> None:
    await rig.subscribe("r3", host=rig.shared.host)
    assert "r3" in rig.stream.shm_followers
    await rig.subscribe("r3", host="another-boot/1")
    assert "r3" not in rig.stream.shm_followers
    await rig.subscribe("r2")  # it asks for the stream inline now
    assert rig.stream.shm_followers == {"r1"}


async def test_in_sync_readers_on_the_host_get_descriptors_of_one_region(rig: Rig) -> None:
    payload = np.random.default_rng(1).bytes(BIG)
    rig.write(payload)
    reader = shm.SharedMemory(1 << 20, "reader", host=rig.shared.host)
    try:
        got = {node: rig.received(node) for node in ("r1", "r2", "r3")}
        for node, msgs in got.items():
            assert len(msgs) == 1, node
            assert bytes(_read(msgs[0], reader)[3]) == payload  # the same bytes either way
        assert len(got["r1"][0][3]) == 0 and len(got["r2"][0][3]) == 0  # a descriptor
        assert len(got["r3"][0][3]) == BIG  # inline: r3 asked for no shared memory
    finally:
        reader.close()
    assert rig.live == 1  # one region, however many read it
    assert rig.stream.shared_bytes >= BIG and rig.stream.shared_messages == 1


async def test_a_region_is_freed_once_every_reader_acknowledged_it(rig: Rig) -> None:
    first = rig.write(b"x" * BIG)
    second = rig.write(b"y" * BIG)
    assert rig.live == 2
    await rig.ack("r1", second)
    assert rig.live == 2  # r2 has read neither
    await rig.ack("r2", first)
    assert rig.live == 1  # the first is read by both
    await rig.ack("r2", second)
    assert rig.live == 0 and rig.stream.shared_bytes == 0


async def test_a_reader_that_leaves_frees_what_waited_for_it(rig: Rig) -> None:
    lsn = rig.write(b"x" * BIG)
    await rig.ack("r1", lsn)
    rig.stream.drop("r2", "test")
    assert rig.live == 0
    assert "r2" not in rig.stream.shm_followers


async def test_a_step_down_frees_the_regions_at_the_next_check(rig: Rig) -> None:
    rig.write(b"x" * BIG)
    rig.session.step_down()  # the session lets every follower go
    rig.stream.expire_shared(0.1)
    assert rig.live == 0 and rig.stream.shared_bytes == 0


async def test_a_reader_that_leaves_a_region_unread_for_the_stall_timeout_is_dropped(
    rig: Rig,
) -> None:
    t0 = time.monotonic()
    lsn = rig.write(b"x" * BIG)  # its region is born between t0 and t1
    t1 = time.monotonic()
    await rig.ack("r1", lsn)
    rig.stream.expire_shared(t0 + STALL - 0.1)
    assert rig.live == 1 and "r2" in rig.session.followers  # not yet
    rig.stream.expire_shared(t1 + STALL + 0.1)
    assert rig.live == 0
    assert "r2" not in rig.session.followers and "r1" in rig.session.followers
    told = [decode(m).route.mtype for m in rig.received("r2")]
    assert told[-1] is MsgType.BYE  # so it subscribes again


async def test_a_follower_not_yet_in_sync_gets_the_stream_inline(rig: Rig) -> None:
    rig.session.subscribed("r2", 5, 0.0)  # resubscribed: loading a snapshot at LSN 5
    lsn = rig.write(b"x" * BIG)
    (msg,) = rig.received("r2")
    assert len(msg[3]) == BIG
    (desc,) = rig.received("r1")
    assert len(desc[3]) == 0  # r1 reads it from the region ...
    await rig.ack("r1", lsn)
    assert rig.live == 0  # ... its only reader: r2's acknowledgement is not waited for


async def test_the_stream_keeps_to_half_the_arena(rig: Rig) -> None:
    rig.stream.drop("r3", "test")  # only readers through shared memory are left
    fits = rig.stream.shared_limit // (BIG + 64)
    for _ in range(fits + 3):
        rig.write(b"z" * BIG)
    sizes = [len(m[3]) for m in rig.received("r1")]
    assert sizes == [0] * fits + [BIG] * 3  # past the stream's share: inline
    assert rig.stream.shared_bytes <= rig.stream.shared_limit
    assert rig.live == fits


async def test_writes_are_staged_only_for_readers_all_in_sync_and_within_the_share(
    rig: Rig,
) -> None:
    """A primary reads a write's frames into its arena (to stream them with no copy)
    only while every follower reads from there in sync, up to what is left of the
    stream's share: an inline follower's queue would pin them."""
    assert rig.stream.stage_room() == 0  # r3 reads the stream inline
    rig.stream.drop("r3", "test")
    room = rig.stream.stage_room()
    assert room == rig.stream.shared_limit
    rig.write(b"x" * BIG)  # waiting in the arena for r1 and r2
    assert rig.stream.stage_room() == room - BIG
    rig.session.subscribed("r2", 5, 0.0)  # loading a snapshot: not in sync
    assert rig.stream.stage_room() == 0
