"""The broker's forwarding rule (zps/broker/routes.py), what the compiled step shares with
the Python code (zps/broker/_forward.pyx against codec, membership and acceptance), and one
verdict per message on the Python data path (zps/broker/datapath.py)."""

from __future__ import annotations

import asyncio
import re
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

import zps
from zps import transport
from zps.broker import acceptance, forward
from zps.broker.broker import Broker
from zps.broker.routes import NoRoute, RouteTable, refusal, route
from zps.core import membership
from zps.core.routing import ClusterMap, PartitionInfo
from zps.ops.config import BrokerConfig
from zps.protocol import codec
from zps.protocol.codec import MsgType, Route, encode
from zps.protocol.messages import Status
from zps.testing import free_port

SOURCE = Path(zps.__file__).parent / "broker" / "_forward.pyx"


def defines() -> dict[str, str]:
    """``#define NAME VALUE`` of the C source (the value up to a comment)."""
    text = SOURCE.read_text()
    return {
        m.group(1): m.group(2).strip()
        for m in re.finditer(r"^#define\s+(\w+)\s+(.*?)\s*(?:/\*.*)?$", text, re.M)
    }


def c_string(value: str) -> bytes:
    assert value.startswith('"') and value.endswith('"'), value
    return value[1:-1].encode()


def test_the_compiled_steps_constants_are_the_python_codes() -> None:
    d = defines()
    assert int(d["ROUTE_SIZE"]) == codec.ROUTE.size
    assert c_string(d["ROUTE_MAGIC"]) == codec.MAGIC
    assert int(d["ROUTE_MAGIC_LEN"]) == len(codec.MAGIC)
    assert int(d["PROTOCOL_VERSION"]) == codec.PROTOCOL_VERSION
    assert int(d["MSG_REQUEST"]) == codec.MsgType.REQUEST
    # The offsets, read off a packed route frame of distinct fields.
    frame = Route(MsgType.REQUEST, partition=-123456, epoch=77, req_id=99).pack()
    assert frame[: int(d["ROUTE_MAGIC_LEN"])] == codec.MAGIC
    assert frame[int(d["ROUTE_VERSION_AT"])] == codec.PROTOCOL_VERSION
    assert frame[int(d["ROUTE_TYPE_AT"])] == codec.MsgType.REQUEST
    assert struct.unpack_from("<i", frame, int(d["ROUTE_PARTITION_AT"]))[0] == -123456
    # Identities and the pseudo clients' targets.
    assert c_string(d["SHARD_PREFIX"]) == membership.SHARD_PREFIX
    assert int(d["SHARD_PREFIX_LEN"]) == len(membership.SHARD_PREFIX)
    liveness = membership.LIVENESS_PREFIX + membership.SHARD_PREFIX
    assert c_string(d["LIVENESS_PREFIX"]) == liveness
    assert int(d["LIVENESS_PREFIX_LEN"]) == len(liveness)
    assert membership.is_liveness(liveness + b"x")
    assert d["PSEUDO_TARGET"] == "'\\0'"
    for target in (acceptance.COMMIT_TARGET, acceptance.MOVE_TARGET):
        assert target[:1] == b"\0"


def test_the_c_code_spells_no_shared_constant_itself() -> None:
    """Below the defines, the shared values appear only by name."""
    text = SOURCE.read_text()
    body = text[text.index("#define PSEUDO_TARGET") :].split("\n", 1)[1]
    for literal in ('"s-"', '"h-s-"', '"h-"', "'Z'", "'P'", '"ZP"', "'\\0'"):
        assert literal not in body, literal


# -- the rule ------------------------------------------------------------------------


def table(*parts: tuple[str | None, bool]) -> RouteTable:
    infos = {
        p: PartitionInfo(epoch=1, primary=primary, lost=lost)
        for p, (primary, lost) in enumerate(parts)
    }
    return RouteTable.of(ClusterMap(3, 4096, None, infos))  # type: ignore[arg-type]


def test_a_request_goes_to_the_primary_the_map_names() -> None:
    t = table(("s-a", False), (None, True), (None, False))
    assert t.targets == [b"s-a", None, None]
    assert route(t, 0, holding=False) == b"s-a"
    assert route(t, 1, holding=False) is NoRoute.LOST
    assert route(t, 2, holding=False) is NoRoute.UNASSIGNED
    for p in (-1, 3):
        assert route(t, p, holding=False) is NoRoute.NO_SUCH_PARTITION
        assert route(t, p, holding=True) is NoRoute.NO_SUCH_PARTITION
    for p in range(3):  # a claim granted in the hold may still be displaced
        assert route(t, p, holding=True) is NoRoute.HOLDING


def test_each_refusal_says_why() -> None:
    status, msg = refusal(NoRoute.HOLDING, 4, None)
    assert status is Status.NOT_PRIMARY and "collecting the shards' claims" in msg
    status, msg = refusal(NoRoute.LOST, 4, (7, 1234))
    assert status is Status.SHARD_UNAVAILABLE
    assert "partition 4 is lost" in msg and "epoch 7, LSN 1234" in msg
    assert "reset-partition --partition 4" in msg
    status, msg = refusal(NoRoute.UNASSIGNED, 4, None)
    assert (status, msg) == (
        Status.SHARD_UNAVAILABLE,
        "partition 4 has no live shard (not yet assigned to a shard)",
    )
    assert refusal(NoRoute.NO_SUCH_PARTITION, 9, None)[1].endswith("(no such partition)")


def test_a_resized_table_keeps_its_routes_and_pads_with_none() -> None:
    t = table(("s-a", False), (None, True))
    assert t.resized(3).targets == [b"s-a", None, None]
    assert t.resized(3).lost == (False, True, False)
    assert t.resized(1).targets == [b"s-a"]


# -- one verdict per message ----------------------------------------------------------


async def _until(condition: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0)


async def _next_of(ch: transport.Channel, mtype: MsgType) -> Any:
    """The next message of type ``mtype`` ``ch`` receives (others are skipped)."""
    async with asyncio.timeout(5):
        while True:
            for frames in await ch.recv_burst():
                msg = codec.decode([transport.frame_buffer(f) for f in frames])
                if msg.route.mtype is mtype:
                    return msg


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["compiled", "python"])
async def test_a_message_the_fast_path_leaves_is_decoded_once(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A running broker, a client and a shard on its socket: the client's HELLO is left
    by the fast path (and the compiled step) to the serving task, which decodes it once;
    a REQUEST the route table names the shard for goes to it with nothing decoded."""
    if path == "compiled" and forward.step is None:
        pytest.skip("the compiled step was not built")
    if path == "python":
        monkeypatch.setattr(forward, "step", None)
    decoded: list[int] = []
    real = codec.decode

    def counting(frames: Any) -> Any:
        decoded.append(1)
        return real(frames)

    monkeypatch.setattr(acceptance, "decode", counting)
    b = Broker(BrokerConfig(partitions=2, startup_grace=0.0, bind=f"tcp://127.0.0.1:{free_port()}"))
    serving = asyncio.create_task(b.run())
    plain = zmq.Context()
    peers: dict[bytes, transport.Channel] = {}
    try:
        await asyncio.wait_for(b.bound.wait(), 10)
        assert b.endpoint is not None
        for ident in (b"c-1", b"s-a"):
            sock = plain.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, ident)
            sock.connect(b.endpoint)
            peers[ident] = transport.Channel(sock)
        # The shard's first word (a late reply: counted, no more) shows it is connected.
        peers[b"s-a"].send_nowait([b"c-0", Route(MsgType.REPLY).pack(), b""])
        await _until(lambda: b.stats.stale_replies == 1)
        assert decoded == []

        hello = encode(Route(MsgType.HELLO, req_id=1), {"host": "h", "pid": 1})
        peers[b"c-1"].send_nowait(hello)
        await _next_of(peers[b"c-1"], MsgType.MAP)  # its map
        assert len(decoded) == 1  # a control message: the serving task's, decoded once
        assert "c-1" in b.state.clients

        # A REQUEST is routed by the table (by the compiled step where it runs), with
        # nothing decoded.
        b.routes = RouteTable([b"s-a", None], (False, False))
        peers[b"c-1"].send_nowait([Route(MsgType.REQUEST, 0, 1, 5).pack(), b"hdr", b"x"])
        (got,) = await asyncio.wait_for(peers[b"s-a"].recv_burst(), 5)
        assert [transport.frame_bytes(f) for f in got] == [
            b"c-1",
            Route(MsgType.REQUEST, 0, 1, 5).pack(),
            b"hdr",
            b"x",
        ]
        assert len(decoded) == 1
        assert b.stats.routed == 1
        report = b.status(time.monotonic())["broker"]
        assert report["forwarded_compiled"] == (1 if path == "compiled" else 0)
    finally:
        b.stop()
        await asyncio.wait_for(serving, 10)
        for ch in peers.values():
            ch.close()
        plain.term()
