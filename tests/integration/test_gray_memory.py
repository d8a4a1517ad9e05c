"""A shard's memory is bounded in bytes, with real processes: the dedup record under
max-size requests, and the sync-mode step buffer under pushes for far-future steps.

Requests come from a raw socket speaking the wire protocol (a client's cid and seq,
re-sent unchanged as a client re-sends), so the test decides exactly which message is a
retry.  Bounds are read back from the broker's status (the shard's heartbeat stats), from
the shard's Prometheus endpoint and from /proc.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

import zps
from tests.integration.wire import dealer
from zps.optim import SGD
from zps.protocol.codec import ROUTE, CompressPolicy, Encoder, MsgType, Route, unpack_route
from zps.testing import LocalCluster, free_port, scrape_metric

EMB = "gray-emb"
DIM = 4
DEDUP_BOUND = 8 << 20
#: Max-size requests whose 4,096 operations all fail with a long message: about 2.3 MB
#: of statuses each in the dedup record, 140 MB for all of them without a byte bound.
N_BIG = 60
RSS_GROWTH_MB = 40.0


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class RawClient:
    """A DEALER to the broker that sends prepared requests and waits for their replies."""

    def __init__(self, address: str, cid: bytes) -> None:
        self.cid = cid
        self.ctx = zmq.Context()
        self.sock = dealer(self.ctx, address, cid)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def frames(
        self,
        epoch: int,
        seq: int,
        ops: list[dict[str, Any]],
        arrays: list[dict[str, np.ndarray]] | None = None,
    ) -> list[bytes]:
        enc = Encoder(CompressPolicy())
        wire = [
            {**op, **{k: enc.array(v) for k, v in (arrays[i] if arrays else {}).items()}}
            for i, op in enumerate(ops)
        ]
        header = {"cid": self.cid, "seq": seq, "ops": wire}
        return [bytes(f) for f in enc.build(Route(MsgType.REQUEST, 0, epoch, seq), header)]

    def call(self, frames: list[bytes], timeout: float = 10.0) -> dict[str, Any]:
        req_id = unpack_route(frames[0]).req_id
        self.sock.send_multipart(frames)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            got = self.sock.recv_multipart()
            for i, f in enumerate(got[:2]):
                if len(f) == ROUTE.size and f[:2] == b"ZP" and i + 1 < len(got):
                    route = unpack_route(f)
                    if route.mtype is MsgType.REPLY and route.req_id == req_id:
                        header: dict[str, Any] = msgpack.unpackb(got[i + 1])
                        return header
        raise AssertionError(f"no reply to request {req_id} within {timeout:g}s")


def shard_stats(c: LocalCluster) -> dict[str, Any]:
    (shard,) = c.status()["shards"]
    stats: dict[str, Any] = shard["stats"]
    return stats


def wait_stats(c: LocalCluster, cond: Callable[[dict[str, Any]], bool], what: str) -> None:
    c.wait_for(lambda s: bool(s["shards"][0]["stats"]) and cond(s["shards"][0]["stats"]), 10, what)


def config(tmp_path: Path, **limits: int) -> str:
    path = tmp_path / "zps.toml"
    path.write_text("[limits]\n" + "".join(f"{k} = {v}\n" for k, v in limits.items()))
    return str(path)


@pytest.mark.timeout(90)
async def test_dedup_memory_stays_within_its_byte_bound_and_retries_apply_once(
    tmp_path: Path,
) -> None:
    mport = free_port()
    with LocalCluster(
        partitions=1,
        shards=1,
        log_level="warning",
        shard_args=[
            "--config",
            config(tmp_path, dedup_bytes=DEDUP_BOUND),
            "--metrics-port",
            str(mport),
        ],
    ) as c:
        async with zps.connect(c.address, timeout=10) as ps:
            await ps.create_embedding(EMB, dim=DIM, dtype="float64", optimizer=SGD(lr=1.0))
        status = await asyncio.to_thread(c.status)
        pid, epoch = status["shards"][0]["pid"], status["partitions"][0]["epoch"]
        raw = RawClient(c.address, b"c-gray-dedup")
        try:
            ids = np.arange(8, dtype=np.int64)
            push_op = {"op": "push_rows", "t": EMB}
            grad = {"ids": ids, "g": np.ones((8, DIM))}
            failing = [
                {"op": "push_rows", "t": f"missing-{i:04d}-" + "x" * 200} for i in range(4096)
            ]
            seqs = iter(range(1, 1 << 30))  # a client's seqs only grow
            raw.call(raw.frames(epoch, next(seqs), failing[:8]))  # warm up, then measure
            before = rss_mb(pid)
            pushes: list[list[bytes]] = []
            for i in range(N_BIG):
                if i % 10 == 0:
                    pushes.append(raw.frames(epoch, next(seqs), [push_op], [grad]))
                    for _ in range(3):  # the message and two re-sends: applied once
                        assert raw.call(pushes[-1])["res"][0]["st"] == "OK"
                reply = raw.call(raw.frames(epoch, next(seqs), failing))
                assert {r["st"] for r in reply.get("res", [])} == {"UNKNOWN_TABLE"}, reply
                if i % 10 == 1:  # a re-send after one big message: still recorded
                    assert raw.call(pushes[-1])["res"][0]["st"] == "OK"
            grew = rss_mb(pid) - before
            # A re-send of a message the record has forgotten is refused, not re-applied.
            late = raw.call(pushes[0])["res"][0]
            assert late["st"] == "BAD_REQUEST" and "dedup record" in late["msg"], late
        finally:
            raw.close()
        async with zps.connect(c.address, timeout=10) as ps:
            rows = await ps.pull_rows(EMB, ids)
        # Six messages, each sent three to five times: applied exactly once each.
        assert np.array_equal(rows, np.full((8, DIM), -6.0))
        wait_stats(c, lambda s: s["expired"] == 1, "the shard's stats to count the refusal")
        stats = await asyncio.to_thread(shard_stats, c)
        assert 0 < stats["dedup_bytes"] <= DEDUP_BOUND, stats
        assert stats["duplicates"] == 6 * 3, stats
        assert 0 < scrape_metric(mport, "zps_shard_dedup_bytes") <= DEDUP_BOUND
        assert scrape_metric(mport, "zps_shard_dedup_evicted_total") > 0
        assert grew < RSS_GROWTH_MB, f"the shard grew by {grew:.0f} MB under {N_BIG} big messages"


@pytest.mark.timeout(90)
async def test_sync_pushes_for_far_future_steps_are_refused_and_nothing_is_lost(
    tmp_path: Path,
) -> None:
    buffer_bound = 4 << 20
    mport = free_port()
    cfg = config(tmp_path, step_window=2, step_buffer_bytes=buffer_bound)
    with LocalCluster(
        partitions=1,
        shards=1,
        log_level="warning",
        shard_args=["--config", cfg, "--metrics-port", str(mport)],
    ) as c:
        status = await asyncio.to_thread(c.status)
        pid = status["shards"][0]["pid"]
        async with zps.connect(c.address, timeout=10, mode="sync", name="gray-w") as ps:
            await ps.create_dense("w", 16, "float64", optimizer=SGD(lr=1.0))
            await ps.create_embedding(EMB, dim=64, dtype="float64", optimizer=SGD(lr=1.0))
            ids = np.arange(6144, dtype=np.int64)
            rows_before = await ps.pull_rows(EMB, ids)
            for _ in range(3):
                await ps.push_dense("w", np.ones(16))
                await ps.clock()
            step = ps.step
            epoch = (await asyncio.to_thread(c.status))["partitions"][0]["epoch"]
            raw = RawClient(c.address, b"c-gray-sync")
            try:
                big = {"ids": ids, "g": np.ones((ids.size, 64))}  # 3 MiB of gradients
                far = {"op": "push_rows", "t": EMB, "step": 1_000_000}
                reply = raw.call(raw.frames(epoch, 1, [far], [big]))
                (res,) = reply["res"]
                assert res["st"] == "BAD_REQUEST", res
                assert "step 1000000 is too far ahead" in res["msg"], res
                assert f"last committed step is {step - 1}" in res["msg"], res
                near = {"op": "push_rows", "t": EMB, "step": step}
                reply = raw.call(raw.frames(epoch, 2, [near, near], [big, big]))
                assert [r["st"] for r in reply["res"]] == ["OK", "OVERLOADED"], reply
                assert "step_buffer_bytes" in reply["res"][1]["msg"]
            finally:
                raw.close()
            wait_stats(
                c,
                lambda s: 3 << 20 <= s["step_bytes"] <= buffer_bound,
                "the step buffer to hold the accepted push",
            )
            assert 3 << 20 <= scrape_metric(mport, "zps_shard_step_buffer_bytes") <= buffer_bound
            # The shard keeps serving: the worker trains on, every push of it counts.
            for _ in range(3):
                await ps.push_dense("w", np.ones(16))
                await ps.clock()
            assert np.array_equal(await ps.pull_dense("w"), np.full(16, -6.0))
            # The stranger's buffered push was not one of the step's workers': dropped.
            assert np.array_equal(await ps.pull_rows(EMB, ids), rows_before)
        wait_stats(c, lambda s: s["step_bytes"] == 0, "the step buffer to be released")
        (shard,) = (await asyncio.to_thread(c.status))["shards"]
        assert shard["pid"] == pid and shard["role"] == "primary"
