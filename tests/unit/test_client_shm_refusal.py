"""A shard's ``noshm`` refusals and the client (zps.client.connection): a ``gone`` of
the regions a request names now frees them (the re-send takes new ones), a late one,
of an earlier sending's regions, leaves the current ones alone; an ``open`` marks the
shard that said so, and nothing goes to it through shared memory after; a ``busy``
(the shard out of descriptors or memory) only for a while."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgpack
import numpy as np
import pytest

from zps import shm
from zps.client.connection import Connection, _ShmRequest
from zps.client.session import Send
from zps.core.routing import ClusterMap, PartitionInfo, default_slot_map
from zps.ops.config import ClientConfig
from zps.protocol.codec import Message, MsgType, Route

pytestmark = pytest.mark.skipif(shm.host_key() is None, reason="no memfd or /proc here")

MiB = 1 << 20


@pytest.fixture
async def conn() -> AsyncIterator[Connection]:
    c = Connection("tcp://127.0.0.1:1", ClientConfig())  # never started: no sockets
    if c._shm is None:
        await c.close()
        pytest.skip("shared memory is off here")
    yield c
    await c.close()


def _sent(conn: Connection, req_id: int) -> _ShmRequest:
    """A request whose one large frame went through the client's shared memory."""
    assert conn._shm is not None
    frames = [Route(MsgType.REQUEST, 0, 1, req_id).pack(), b"\x80", np.ones(MiB, np.uint8)]
    _, descs = conn._shm.outbound(frames)
    assert len(descs) == 1
    req = _ShmRequest([], False, descs)
    conn._shm_reqs[req_id] = req
    return req


def _gone(req_id: int, tokens: list[int] | None) -> Message:
    header: dict[str, object] = {"st": "OVERLOADED", "noshm": "gone"}
    if tokens is not None:
        header["tok"] = tokens
    return Message(Route(MsgType.REPLY, 0, 1, req_id), header, [])


async def test_a_refusal_of_the_current_regions_frees_them(conn: Connection) -> None:
    assert conn._shm is not None
    req = _sent(conn, 7)
    live = conn._shm.arena.live
    conn._shm_refusal(_gone(7, shm.tokens(req.regions)))
    assert req.regions == [] and conn._shm.arena.live == live - 1


async def test_a_late_refusal_leaves_the_current_regions(conn: Connection) -> None:
    assert conn._shm is not None
    req = _sent(conn, 7)
    old = shm.tokens(req.regions)
    conn._shm_refusal(_gone(7, old))  # the first sending's regions: freed
    _, req.regions = conn._shm.outbound(  # the re-send takes new ones
        [Route(MsgType.REQUEST, 0, 1, 7).pack(), b"\x80", np.ones(MiB, np.uint8)]
    )
    current, live = list(req.regions), conn._shm.arena.live
    conn._shm_refusal(_gone(7, old))  # another copy of the first sending, refused late
    assert req.regions == current and conn._shm.arena.live == live


async def test_a_refusal_naming_no_token_frees_the_current_regions(conn: Connection) -> None:
    """As from a shard of an earlier release, which names no token."""
    assert conn._shm is not None
    req = _sent(conn, 7)
    live = conn._shm.arena.live
    conn._shm_refusal(_gone(7, None))
    assert req.regions == [] and conn._shm.arena.live == live - 1


def _mapped(conn: Connection, primary: str) -> None:
    """The client's map: one partition whose primary is ``primary``."""
    conn._session.map = ClusterMap(
        1, 8, default_slot_map(8, 1), {0: PartitionInfo(primary=primary)}
    )


async def test_open_marks_the_shard_that_said_so(conn: Connection) -> None:
    """``by`` names the refusing shard: not the map's primary (the map may be stale)."""
    _mapped(conn, "s-old")
    assert conn._shm_to(0)
    open_ = {"st": "OVERLOADED", "noshm": "open", "by": "s-new"}
    conn._shm_refusal(Message(Route(MsgType.REPLY, 0, 1, 7), open_, []))
    assert set(conn._shm_refused) == {"s-new"} and conn._shm_to(0)  # s-old still may
    _mapped(conn, "s-new")
    assert not conn._shm_to(0)  # no payloads or replies this way with s-new


async def test_open_without_by_marks_the_maps_primary(conn: Connection) -> None:
    """As from a shard of an earlier release."""
    _mapped(conn, "s-a")
    conn._shm_refusal(Message(Route(MsgType.REPLY, 0, 1, 7), {"noshm": "open"}, []))
    assert set(conn._shm_refused) == {"s-a"} and not conn._shm_to(0)


async def test_no_primary_known_means_inline(conn: Connection) -> None:
    assert not conn._shm_to(0)  # no map yet


async def test_a_refused_request_is_sent_again_inline_whatever_the_map_says(
    conn: Connection,
) -> None:
    """The client's map still names the old primary (s-old, on this host) when the new
    one (s-new, elsewhere) refuses: the re-send goes inline all the same, so it reaches
    a shard that can answer it (or tell the client its map is stale)."""
    assert conn._shm is not None
    _mapped(conn, "s-old")
    req = _sent(conn, 7)
    refusal = {"st": "OVERLOADED", "noshm": "open", "by": "s-new"}
    conn._shm_refusal(Message(Route(MsgType.REPLY, 0, 1, 7), refusal, []))
    assert req.inline and conn._shm_to(0)  # s-old itself may still share memory
    frames = [Route(MsgType.REQUEST, 0, 1, 7).pack(), b"\x80", np.ones(MiB, np.uint8)]
    sent = conn._shm_frames(Send(frames, 7))
    # No shared-memory header, the payload inline:
    assert sent[1] == b"\x80" and np.frombuffer(sent[2], np.uint8).size == MiB


async def test_busy_sends_inline_for_a_while_then_offers_shared_memory_again(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(conn, "_now", lambda: now[0])
    _mapped(conn, "s-a")
    req = _sent(conn, 7)
    busy = {"st": "OVERLOADED", "noshm": "busy", "by": "s-a", "msg": "Too many open files"}
    conn._shm_refusal(Message(Route(MsgType.REPLY, 0, 1, 7), busy, []))
    assert req.inline and not conn._shm_to(0)
    now[0] += shm.RETRY_S - 1
    assert not conn._shm_to(0)
    now[0] += 1
    assert conn._shm_to(0) and not conn._shm_refused  # offered again, and forgotten
    conn._shm_refusal(Message(Route(MsgType.REPLY, 0, 1, 8), {"noshm": "open", "by": "s-a"}, []))
    now[0] += 10 * shm.RETRY_S
    assert not conn._shm_to(0)  # open: for good


async def test_replies_come_inline_for_a_while_when_this_client_is_busy(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client itself could not open a shard's memory (out of descriptors): its
    requests ask for inline replies until RETRY_S has passed."""
    assert conn._shm is not None
    now = [100.0]
    monkeypatch.setattr(conn, "_now", lambda: now[0])
    _mapped(conn, "s-a")

    def fail(desc: list[int], into: np.ndarray | None = None) -> np.ndarray:
        raise shm.ShmUnavailableError("cannot open: Too many open files", permanent=True, busy=True)

    monkeypatch.setattr(conn._shm.mapper, "read", fail)
    bufs = [Route(MsgType.REPLY, 0, 1, 9).pack(), b"\x80", b""]
    header = {shm.KEY: {"h": conn._shm.host, "d": [[0, 1, 2, 3, 0, 8, 5]]}}
    got = conn._shm_reply(bufs, Message(Route(MsgType.REPLY, 0, 1, 9), header, [b""]))
    assert got.header["st"] == "OVERLOADED"

    def asks(req_id: int) -> bool:
        conn._shm_reqs[req_id] = _ShmRequest([], True)
        frames = [Route(MsgType.REQUEST, 0, 1, req_id).pack(), b"\x80", np.ones(MiB, np.uint8)]
        header = msgpack.unpackb(conn._shm_frames(Send(frames, req_id))[1])
        return header[shm.KEY].get("r") is True  # its reply through shared memory

    assert not asks(10)
    now[0] += shm.RETRY_S
    assert asks(11)
