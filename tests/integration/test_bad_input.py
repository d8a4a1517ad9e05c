"""Bad input gets a clear error; the processes keep serving."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import numpy as np
import pytest
import zmq

import zps
from tests.integration.wire import raw_dealer
from zps import errors
from zps.optim import SGD
from zps.protocol.codec import PROTOCOL_VERSION, MsgType, Route
from zps.testing import LocalCluster


async def raw_roundtrip(
    address: str, frames: list[bytes], expect_reply: bool, timeout: float = 3.0
) -> list[bytes] | None:
    with raw_dealer(address, f"c-raw-{uuid.uuid4().hex[:8]}".encode()) as sock:
        sock.send_multipart(frames)
        if not expect_reply:
            return None
        if not await asyncio.to_thread(sock.poll, timeout * 1000, zmq.POLLIN):
            raise AssertionError("no reply")
        return list(sock.recv_multipart())


async def test_garbage_to_the_broker_is_dropped_and_it_keeps_serving(cluster: LocalCluster) -> None:
    garbage = [
        [b"x"],
        [b"\x00" * 20, b"junk"],
        [b"ZP" + bytes([PROTOCOL_VERSION]) + b"\xff" * 17, b""],  # an unknown type
        [Route(MsgType.HELLO).pack(), b"\xc1\xc1"],
        [b""] * 5,
    ]
    before = cluster.status()["broker"]["malformed"]
    # One socket: the broker handles one peer's messages in order, so the
    # status reply comes after every piece of garbage was processed.
    with raw_dealer(cluster.address) as sock:
        for frames in garbage:
            sock.send_multipart(frames)
        sock.send_multipart([Route(MsgType.STATUS).pack(), msgpack.packb({})])
        assert await asyncio.to_thread(sock.poll, 5000, zmq.POLLIN), "the broker stopped answering"
        status = msgpack.unpackb(sock.recv_multipart()[1])
    assert status["broker"]["malformed"] - before == len(garbage)
    async with zps.connect(cluster.address) as ps:
        await ps.create_dense("after-garbage", shape=(2,), optimizer=SGD(lr=1.0))
        await ps.push_dense("after-garbage", np.ones(2))
        assert (await ps.pull_dense("after-garbage")).tolist() == [-1.0, -1.0]


@pytest.mark.parametrize(
    "header, code, fragment",
    [
        (b"\xc1", "BAD_REQUEST", "msgpack"),
        (msgpack.packb([1, 2]), "BAD_REQUEST", "map"),
        (msgpack.packb({"ops": []}), "BAD_REQUEST", "ops"),
        (msgpack.packb({"ops": "x"}), "BAD_REQUEST", "ops"),
    ],
)
async def test_malformed_request_to_a_shard_gets_an_error_reply(
    cluster: LocalCluster, header: bytes, code: str, fragment: str
) -> None:
    epoch = cluster.status()["partitions"][0]["epoch"]
    route = Route(MsgType.REQUEST, 0, epoch, 42).pack()
    reply = await raw_roundtrip(cluster.address, [route, header], expect_reply=True)
    assert reply is not None
    body = msgpack.unpackb(reply[1])
    assert body["st"] == code and fragment in body["msg"], body


async def test_bad_operations_get_per_operation_errors(cluster: LocalCluster) -> None:
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding("bad-ops", dim=4)
    epoch = cluster.status()["partitions"][1]["epoch"]
    ops = [
        {"op": "explode"},
        {"op": "pull_rows", "t": "nope", "ids": [0, "int64", [1], 0]},
        {"op": "pull_rows", "t": "bad-ops", "ids": [0, "float32", [1], 0]},
        {"op": "pull_rows", "t": "bad-ops", "ids": [7, "int64", [1], 0]},
        {"op": "pull_rows", "t": "bad-ops", "ids": [0, "int64", [10**9], 0]},
        {
            "op": "push_rows",
            "t": "bad-ops",
            "ids": [0, "int64", [1], 0],
            "g": [1, "float32", [1, 3], 0],
        },
        {"op": "pull_rows", "t": "bad-ops", "ids": [0, "int64", [1], 0]},
    ]
    header = msgpack.packb({"cid": b"c-raw", "seq": 1, "ops": ops})
    payloads = [np.array([5], dtype=np.int64).tobytes(), np.zeros(3, np.float32).tobytes()]
    reply = await raw_roundtrip(
        cluster.address,
        [Route(MsgType.REQUEST, 1, epoch, 7).pack(), header, *payloads],
        expect_reply=True,
    )
    assert reply is not None
    res = msgpack.unpackb(reply[1])["res"]
    codes = [r["st"] for r in res]
    assert codes == [
        "BAD_REQUEST",
        "UNKNOWN_TABLE",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "BAD_REQUEST",
        "SHAPE_MISMATCH",
        "OK",
    ], res
    assert "explode" in res[0]["msg"] and "nope" in res[1]["msg"]


async def test_client_side_validation_names_the_problem(cluster: LocalCluster) -> None:
    async with zps.connect(cluster.address) as ps:
        await ps.create_embedding("val-emb", dim=4)
        await ps.create_dense("val-dense", shape=(3, 2))
        with pytest.raises(errors.ShapeMismatchError, match=r"\(3, 2\)"):
            await ps.push_dense("val-dense", np.ones(6))
        with pytest.raises(errors.ShapeMismatchError, match="dim 4"):
            await ps.push_rows("val-emb", [1, 2], np.ones((2, 3)))
        with pytest.raises(errors.ShapeMismatchError, match="integers"):
            await ps.pull_rows("val-emb", np.array([1.5]))
        with pytest.raises(errors.UnknownTableError, match="missing"):
            await ps.pull_rows("missing", [1])
        with pytest.raises(errors.TableConflictError, match="embedding"):
            await ps.pull_dense("val-emb")
        with pytest.raises(errors.BadRequestError, match="dtype"):
            await ps.create_dense("val-int", shape=(2,), dtype="int8")
        # and it still works
        assert (await ps.pull_rows("val-emb", [1, 1])).shape == (2, 4)
