"""Message size limits with real processes: calls larger than MAXMSGSIZE are cut into
messages within the budget and joined again exactly; what cannot be cut is refused with
an error naming the limit; a shard whose broker link is full refuses requests
(OVERLOADED) instead of queueing their replies without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

import zps
from tests.integration.wire import raw_dealer
from zps.errors import BadRequestError, ConfigError
from zps.optim import SGD
from zps.protocol.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MESSAGE_BUDGET,
    ROUTE,
    Encoder,
    MsgType,
    Route,
    unpack_route,
)
from zps.protocol.messages import Assign, LeaseEcho, Role
from zps.protocol.specs import EmbeddingSpec
from zps.testing import LocalCluster, free_port, scrape_metric

DIM = 32
#: float32 rows of DIM: 128 bytes a row.
ROW_BYTES = DIM * 4


@pytest.fixture(scope="module")
def one() -> Iterator[LocalCluster]:
    """One partition, so a call's whole payload goes to one shard, over the limit."""
    with LocalCluster(partitions=1, shards=1, log_level="warning") as c:
        yield c


def test_the_limit_is_64_mib_and_the_budget_fits_in_it() -> None:
    assert DEFAULT_MAX_MESSAGE_BYTES == 64 << 20
    assert MESSAGE_BUDGET * 2 <= DEFAULT_MAX_MESSAGE_BYTES


@pytest.mark.timeout(120)
async def test_rows_beyond_the_message_limit_round_trip_exactly(one: LocalCluster) -> None:
    rng = np.random.default_rng(5)
    n_unique, n_dup = 700_000, 100_000
    base = rng.choice(1 << 40, size=n_unique, replace=False).astype(np.int64)
    ids = np.concatenate([base, rng.choice(base, size=n_dup)])
    rng.shuffle(ids)
    # Small integers: every sum is exact in float32, whatever the order of addition.
    grads = rng.integers(-8, 9, size=(ids.size, DIM)).astype(np.float32)
    assert grads.nbytes + ids.nbytes > DEFAULT_MAX_MESSAGE_BYTES
    assert ids.size * ROW_BYTES > DEFAULT_MAX_MESSAGE_BYTES  # the pull's reply too
    async with zps.connect(one.address, timeout=60) as ps:
        await ps.create_embedding("big-rows", dim=DIM, optimizer=SGD(lr=1.0))
        before = ps.stats.requests
        await ps.push_rows("big-rows", ids, grads)
        pushed = ps.stats.requests - before
        before = ps.stats.requests
        rows = await ps.pull_rows("big-rows", ids)
        pulled = ps.stats.requests - before
    # Duplicates are summed before the push is cut: each id is updated once, by its sum.
    uniq, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((uniq.size, DIM), dtype=np.float32)
    np.add.at(summed, inverse, grads)
    assert np.array_equal(rows, -summed[inverse])
    # Several messages each way, each within the budget.
    assert pushed >= -(-(n_unique * (8 + ROW_BYTES)) // MESSAGE_BUDGET), pushed
    assert pulled >= -(-(ids.size * ROW_BYTES) // MESSAGE_BUDGET), pulled
    assert pushed <= 2 * -(-(n_unique * (8 + ROW_BYTES)) // MESSAGE_BUDGET), pushed


@pytest.mark.timeout(120)
async def test_a_dense_tensor_beyond_the_message_limit_round_trips(one: LocalCluster) -> None:
    size = 18 << 20  # 72 MiB of float32
    grad = np.random.default_rng(6).standard_normal(size, dtype=np.float32)
    assert grad.nbytes > DEFAULT_MAX_MESSAGE_BYTES
    async with zps.connect(one.address, timeout=60) as ps:
        await ps.create_dense("big-dense", shape=(size // 1024, 1024), optimizer=SGD(lr=1.0))
        await ps.push_dense("big-dense", grad.reshape(-1, 1024))
        before = ps.stats.requests
        value = await ps.pull_dense("big-dense")
        pulled = ps.stats.requests - before
        out = np.empty((size // 1024, 1024), dtype=np.float32)
        assert await ps.pull_dense("big-dense", out=out) is out
    assert np.array_equal(value.reshape(-1), -grad)
    assert np.array_equal(out, value)
    assert pulled >= -(-grad.nbytes // MESSAGE_BUDGET), pulled


@pytest.mark.timeout(60)
async def test_a_call_that_cannot_fit_gets_an_error_naming_the_limit(one: LocalCluster) -> None:
    async with zps.connect(one.address, timeout=20) as ps:
        await ps.create_dense("chunky", shape=(4 << 20,), optimizer=SGD(lr=1.0))  # 2 MiB chunks
        await ps.create_embedding("small-rows", dim=DIM, optimizer=SGD(lr=1.0))
        await ps.create_embedding("wide-rows", dim=65536, dtype="float64", optimizer=SGD())
    tight = {"max_message_bytes": 1 << 20, "message_budget": 256 << 10}
    async with zps.connect(one.address, timeout=20, **tight) as ps:
        with pytest.raises(BadRequestError, match=r"client\.max_message_bytes"):
            await ps.pull_dense("chunky")
        with pytest.raises(BadRequestError, match=r"client\.max_message_bytes"):
            await ps.push_dense("chunky", np.ones(4 << 20, dtype=np.float32))
        with pytest.raises(BadRequestError, match=r"client\.max_message_bytes"):
            await ps.pull_rows("wide-rows", [1, 2])  # a row and its id: 512 KiB + 8 bytes
        # Rows are cut to the small budget instead: 10,000 rows, 1.3 MB each way.
        ids = np.arange(10_000, dtype=np.int64)
        before = ps.stats.requests
        await ps.push_rows("small-rows", ids, np.ones((ids.size, DIM), dtype=np.float32))
        assert np.array_equal(await ps.pull_rows("small-rows", ids), -np.ones((ids.size, DIM)))
        assert ps.stats.requests - before >= 2 * -(-(ids.size * ROW_BYTES) // (256 << 10))
    with pytest.raises(ConfigError, match="message_budget"):
        zps.connect(one.address, max_message_bytes=1 << 20, message_budget=1 << 20)


def _request(cid: bytes, epoch: int, req_id: int, ops: list[dict[str, Any]]) -> list[bytes]:
    """A request as a client sends it: arrays of each op under the keys it names."""
    enc = Encoder()
    wire = [
        {k: enc.array(v) if isinstance(v, np.ndarray) else v for k, v in op.items()} for op in ops
    ]
    header = {"cid": cid, "seq": req_id, "ops": wire, "acks": 1}
    return [bytes(f) for f in enc.build(Route(MsgType.REQUEST, 0, epoch, req_id), header)]


def _reply(frames: list[bytes]) -> tuple[int, dict[str, Any]] | None:
    """(request id, header) of a REPLY among ``frames`` (after any envelope)."""
    for i, f in enumerate(frames[:3]):
        if len(f) == ROUTE.size and f[:2] == b"ZP" and i + 1 < len(frames):
            route = unpack_route(f)
            if route.mtype is MsgType.REPLY:
                return route.req_id, msgpack.unpackb(frames[i + 1])
    return None


@pytest.mark.timeout(60)
async def test_a_reply_over_the_limit_is_refused_and_the_shard_stays(one: LocalCluster) -> None:
    async with zps.connect(one.address, timeout=20) as ps:
        await ps.create_embedding("hostile", dim=DIM, optimizer=SGD(lr=1.0))
    status = await asyncio.to_thread(one.status)
    (shard,) = status["shards"]
    epoch = status["partitions"][0]["epoch"]
    n = DEFAULT_MAX_MESSAGE_BYTES // ROW_BYTES + 1000  # a reply just over the limit
    with raw_dealer(one.address, b"c-gray-limits") as sock:
        ops = [{"op": "pull_rows", "t": "hostile", "ids": np.arange(n, dtype=np.int64)}]
        sock.send_multipart(_request(b"c-gray-limits", epoch, 7, ops))
        got = None
        deadline = time.monotonic() + 20
        while got is None and sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            got = _reply(sock.recv_multipart())
        assert got is not None, "no answer to a pull whose reply exceeds the limit"
        req_id, header = got
        assert req_id == 7
        assert header["st"] == "BAD_REQUEST" and "max_message_bytes" in header["msg"], header
    # The shard kept its connection: same primary, same epoch, and it answers.
    async with zps.connect(one.address, timeout=20) as ps:
        rows = await ps.pull_rows("hostile", np.arange(10, dtype=np.int64))
    assert rows.shape == (10, DIM)
    after = await asyncio.to_thread(one.status)
    assert after["partitions"][0]["epoch"] == epoch
    assert [s["pid"] for s in after["shards"]] == [shard["pid"]]


# -- the shard's link to the broker ---------------------------------------------------


class FakeBroker:
    """A ROUTER that registers one shard as primary of partition 0, renews its lease
    while asked to, and otherwise reads only when told (a broker that stops reading)."""

    EPOCH = 1

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)  # take as little as zmq allows when not reading
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDTIMEO, 10_000)  # a shard that stops reading fails the test
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.shard = b""
        self.echoes = 0
        self.replies: dict[int, list[dict[str, Any]]] = {}

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def _control(self, mtype: MsgType, header: dict[str, Any]) -> None:
        self.sock.send_multipart(
            [self.shard, b"", Route(mtype).pack(), msgpack.packb(header, use_bin_type=True)]
        )

    def handle(self, frames: list[bytes]) -> None:
        """Answer registration and heartbeats; keep replies to requests."""
        ident, target, route = frames[0], frames[1], unpack_route(frames[2])
        if not target:
            header = msgpack.unpackb(frames[3])
            if route.mtype is MsgType.REGISTER:
                self.shard = ident
                assign = Assign(Role.PRIMARY, 0, self.EPOCH, n_partitions=1)
                self._control(MsgType.ASSIGN, assign.to_wire())
            elif route.mtype is MsgType.HEARTBEAT and self.shard:
                echo = LeaseEcho(header.get("t"), Role.PRIMARY, 0, self.EPOCH)
                self._control(MsgType.HEARTBEAT, echo.to_wire())
                self.echoes += 1
            return
        got = _reply(frames[1:])
        assert got is not None, frames[:3]
        self.replies.setdefault(got[0], []).append(got[1])

    def serve_until(self, done: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            assert left > 0, "timed out"
            if self.sock.poll(int(left * 1000) + 1):
                self.handle(self.sock.recv_multipart())

    def request(self, req_id: int, ops: list[dict[str, Any]]) -> None:
        cid = b"c-gray-flood"
        self.sock.send_multipart([self.shard, cid, *_request(cid, self.EPOCH, req_id, ops)])


@pytest.mark.timeout(90)
def test_a_shard_whose_broker_stops_reading_refuses_requests_within_its_bound(
    tmp_path: Path,
) -> None:
    """A broker that reads nothing: the shard's replies fill zmq's queue, then are held
    within ``reply_queue_bytes``; past that the shard refuses requests OVERLOADED and
    keeps reading, and every request gets exactly one answer once the broker reads."""
    port, mport = free_port(), free_port()
    cfg = tmp_path / "zps.toml"
    cfg.write_text("[shard]\nmax_message_bytes = 1048576\nreply_queue_bytes = 2097152\n")
    c = LocalCluster(partitions=1, shards=1, liveness=50, log_level="warning", workdir=tmp_path)
    c.port = port
    broker = FakeBroker(port)
    try:
        proc = c.start_shard(["--config", str(cfg), "--metrics-port", str(mport)])
        broker.serve_until(lambda: bool(broker.shard), 20)
        spec = EmbeddingSpec("flood", DIM, "float32", zps.init.Zeros(), SGD(lr=1.0), 1)
        # Renew the lease until the table exists (the shard answers only with a lease:
        # NOT_PRIMARY until its first heartbeat was echoed).
        first = 1_000_000
        for req_id in range(first, first + 100):
            broker.request(req_id, [{"op": "create", "spec": spec.to_wire()}])
            broker.serve_until(lambda r=req_id: r in broker.replies, 20)
            if broker.replies[req_id][0]["st"] == "OK":
                break
        assert broker.replies[req_id][0]["res"][0]["st"] == "OK", broker.replies[req_id]
        # One more echo, fresh: the lease (4.9 s) outlasts the flood.
        echoes = broker.echoes
        broker.serve_until(lambda: broker.echoes > echoes, 5)
        n, ids = 3000, np.arange(128, dtype=np.int64)  # 16 KiB a reply: 47 MiB in all
        taken = scrape_metric(mport, "zps_shard_requests_total", 0.0)
        for req_id in range(2, n + 2):
            broker.request(req_id, [{"op": "pull_rows", "t": "flood", "ids": ids}])
        deadline = time.monotonic() + 30
        while (
            scrape_metric(mport, "zps_shard_requests_total", 0.0)
            + scrape_metric(mport, "zps_shard_overloaded_total", 0.0)
            < taken + n
        ):
            assert proc.alive() and time.monotonic() < deadline, (
                "the shard stopped taking requests",
                scrape_metric(mport, "zps_shard_requests_total", 0.0) - taken,
                scrape_metric(mport, "zps_shard_overloaded_total", 0.0),
            )
            time.sleep(0.05)
        overloaded = scrape_metric(mport, "zps_shard_overloaded_total", 0.0)
        broker.serve_until(lambda: all(i in broker.replies for i in range(2, n + 2)), 30)
        # Whatever arrives next (heartbeats) is not a reply: nothing was answered twice.
        assert all(len(broker.replies[i]) == 1 for i in range(2, n + 2))
        statuses = [broker.replies[i][0]["st"] for i in range(2, n + 2)]
        assert set(statuses) <= {"OK", "OVERLOADED"}, set(statuses)
        assert statuses.count("OVERLOADED") == overloaded > 0
        assert statuses.count("OK") > 1000  # zmq's own queue took the first thousand
        refused = next(broker.replies[i][0] for i in range(2, n + 2) if statuses[i - 2] != "OK")
        assert "reply_queue_bytes" in refused["msg"], refused
    finally:
        broker.close()
        c.stop()
