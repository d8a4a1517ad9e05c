"""A shard's ``noshm`` refusals and the client (zps.client.shmpath): a ``gone`` of
the regions a request names now frees them (the re-send takes new ones), a late one,
of an earlier sending's regions, leaves the current ones alone; an ``open`` marks the
shard that said so, and nothing goes to it through shared memory after; a ``busy``
(the shard out of descriptors or memory) only for a while."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import pytest

from zps import shm
from zps.client.session import Send
from zps.client.shmpath import ClientShm, ShmRequest
from zps.core.routing import ClusterMap, PartitionInfo, default_slot_map
from zps.ops.config import ClientConfig
from zps.protocol.codec import Message, MsgType, Route

pytestmark = pytest.mark.skipif(shm.host_key() is None, reason="no memfd or /proc here")

MiB = 1 << 20


class _Client:
    """What a client's shared-memory path asks of the client: the time and the primary
    its map names for a partition."""

    def __init__(self, memory: shm.SharedMemory) -> None:
        self.map: ClusterMap | None = None
        self.clock: Callable[[], float] = lambda: 100.0
        self.path = ClientShm(memory, now=lambda: self.clock(), primary_of=self.primary_of)

    def primary_of(self, partition: int) -> str | None:
        info = self.map.partitions.get(partition) if self.map is not None else None
        return info.primary if info is not None else None


@pytest.fixture
def conn() -> Iterator[_Client]:
    config = ClientConfig()
    memory = shm.SharedMemory.create(
        config.shm_bytes, "client", max_frame_bytes=config.max_message_bytes
    )
    if memory is None:
        pytest.skip("shared memory is off here")
    c = _Client(memory)
    yield c
    c.path.close()


def _sent(conn: _Client, req_id: int) -> ShmRequest:
    """A request whose one large frame went through the client's shared memory."""
    assert conn.path.memory is not None
    frames = [Route(MsgType.REQUEST, 0, 1, req_id).pack(), b"\x80", np.ones(MiB, np.uint8)]
    _, descs = conn.path.memory.outbound(frames)
    assert len(descs) == 1
    req = ShmRequest([], False, descs)
    conn.path.requests[req_id] = req
    return req


def _gone(req_id: int, tokens: list[int] | None) -> Message:
    header: dict[str, object] = {"st": "OVERLOADED", "noshm": "gone"}
    if tokens is not None:
        header["tok"] = tokens
    return Message(Route(MsgType.REPLY, 0, 1, req_id), header, [])


async def test_a_refusal_of_the_current_regions_frees_them(conn: _Client) -> None:
    assert conn.path.memory is not None
    req = _sent(conn, 7)
    live = conn.path.memory.arena.live
    conn.path.refusal(_gone(7, shm.tokens(req.regions)))
    assert req.regions == [] and conn.path.memory.arena.live == live - 1


async def test_a_late_refusal_leaves_the_current_regions(conn: _Client) -> None:
    assert conn.path.memory is not None
    req = _sent(conn, 7)
    old = shm.tokens(req.regions)
    conn.path.refusal(_gone(7, old))  # the first sending's regions: freed
    _, req.regions = conn.path.memory.outbound(  # the re-send takes new ones
        [Route(MsgType.REQUEST, 0, 1, 7).pack(), b"\x80", np.ones(MiB, np.uint8)]
    )
    current, live = list(req.regions), conn.path.memory.arena.live
    conn.path.refusal(_gone(7, old))  # another copy of the first sending, refused late
    assert req.regions == current and conn.path.memory.arena.live == live


async def test_a_refusal_naming_no_token_frees_the_current_regions(conn: _Client) -> None:
    """As from a shard of an earlier release, which names no token."""
    assert conn.path.memory is not None
    req = _sent(conn, 7)
    live = conn.path.memory.arena.live
    conn.path.refusal(_gone(7, None))
    assert req.regions == [] and conn.path.memory.arena.live == live - 1


def _mapped(conn: _Client, primary: str) -> None:
    """The client's map: one partition whose primary is ``primary``."""
    conn.map = ClusterMap(1, 8, default_slot_map(8, 1), {0: PartitionInfo(primary=primary)})


async def test_open_marks_the_shard_that_said_so(conn: _Client) -> None:
    """``by`` names the refusing shard: not the map's primary (the map may be stale)."""
    _mapped(conn, "s-old")
    assert conn.path.to(0)
    open_ = {"st": "OVERLOADED", "noshm": "open", "by": "s-new"}
    conn.path.refusal(Message(Route(MsgType.REPLY, 0, 1, 7), open_, []))
    assert set(conn.path.refused) == {"s-new"} and conn.path.to(0)  # s-old still may
    _mapped(conn, "s-new")
    assert not conn.path.to(0)  # no payloads or replies this way with s-new


async def test_open_without_by_marks_the_maps_primary(conn: _Client) -> None:
    """As from a shard of an earlier release."""
    _mapped(conn, "s-a")
    conn.path.refusal(Message(Route(MsgType.REPLY, 0, 1, 7), {"noshm": "open"}, []))
    assert set(conn.path.refused) == {"s-a"} and not conn.path.to(0)


async def test_no_primary_known_means_inline(conn: _Client) -> None:
    assert not conn.path.to(0)  # no map yet


async def test_a_refused_request_is_sent_again_inline_whatever_the_map_says(
    conn: _Client,
) -> None:
    """The client's map still names the old primary (s-old, on this host) when the new
    one (s-new, elsewhere) refuses: the re-send goes inline all the same, so it reaches
    a shard that can answer it (or tell the client its map is stale)."""
    assert conn.path.memory is not None
    _mapped(conn, "s-old")
    req = _sent(conn, 7)
    refusal = {"st": "OVERLOADED", "noshm": "open", "by": "s-new"}
    conn.path.refusal(Message(Route(MsgType.REPLY, 0, 1, 7), refusal, []))
    assert req.inline and conn.path.to(0)  # s-old itself may still share memory
    frames = [Route(MsgType.REQUEST, 0, 1, 7).pack(), b"\x80", np.ones(MiB, np.uint8)]
    sent = conn.path.frames(Send(frames, 7))
    # No shared-memory header, the payload inline:
    assert sent[1] == b"\x80" and np.frombuffer(sent[2], np.uint8).size == MiB


async def test_busy_sends_inline_for_a_while_then_offers_shared_memory_again(
    conn: _Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(conn, "clock", lambda: now[0])
    _mapped(conn, "s-a")
    req = _sent(conn, 7)
    busy = {"st": "OVERLOADED", "noshm": "busy", "by": "s-a", "msg": "Too many open files"}
    conn.path.refusal(Message(Route(MsgType.REPLY, 0, 1, 7), busy, []))
    assert req.inline and not conn.path.to(0)
    now[0] += shm.RETRY_S - 1
    assert not conn.path.to(0)
    now[0] += 1
    assert conn.path.to(0) and not conn.path.refused  # offered again, and forgotten
    conn.path.refusal(Message(Route(MsgType.REPLY, 0, 1, 8), {"noshm": "open", "by": "s-a"}, []))
    now[0] += 10 * shm.RETRY_S
    assert not conn.path.to(0)  # open: for good


async def test_replies_come_inline_for_a_while_when_this_client_is_busy(
    conn: _Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client itself could not open a shard's memory (out of descriptors): its
    requests ask for inline replies until RETRY_S has passed."""
    assert conn.path.memory is not None
    now = [100.0]
    monkeypatch.setattr(conn, "clock", lambda: now[0])
    _mapped(conn, "s-a")

    def fail(desc: list[int], into: np.ndarray | None = None) -> np.ndarray:
        raise shm.ShmUnavailableError("cannot open: Too many open files", permanent=True, busy=True)

    monkeypatch.setattr(conn.path.memory.mapper, "read", fail)
    bufs = [Route(MsgType.REPLY, 0, 1, 9).pack(), b"\x80", b""]
    header = {shm.KEY: {"h": conn.path.memory.host, "d": [[0, 1, 2, 3, 0, 8, 5]]}}
    got = conn.path.reply(bufs, Message(Route(MsgType.REPLY, 0, 1, 9), header, [b""]))
    assert got.header["st"] == "OVERLOADED"

    def asks(req_id: int) -> bool:
        conn.path.requests[req_id] = ShmRequest([], True)
        frames = [Route(MsgType.REQUEST, 0, 1, req_id).pack(), b"\x80", np.ones(MiB, np.uint8)]
        header = msgpack.unpackb(conn.path.frames(Send(frames, req_id))[1])
        return header[shm.KEY].get("r") is True  # its reply through shared memory

    assert not asks(10)
    now[0] += shm.RETRY_S
    assert asks(11)
