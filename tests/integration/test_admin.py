"""Table administration with real processes: list, describe, drop, set values, list ids,
on-demand checkpoints; values set survive a primary's SIGKILL (failover) and a restart of
every process from checkpoints and write-ahead logs."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from zps.errors import BadRequestError, ShapeMismatchError, UnknownTableError
from zps.init import Normal
from zps.optim import SGD, Adam
from zps.testing import DataDirCluster, LocalCluster, free_port


def test_admin_calls_blocking(cluster: LocalCluster) -> None:
    with zps.connect_sync(cluster.address, timeout=20) as ps:
        ps.create_dense("adm/w", shape=(3, 700), init=Normal(0, 1), optimizer=Adam())
        ps.create_embedding("adm/e", dim=4, optimizer=Adam(lr=0.1))
        assert {"adm/w", "adm/e"} <= set(ps.list_tables())
        # dense: values set exactly, optimizer state reset (Adam's first step is lr*sign)
        w = np.arange(2100, dtype=np.float32).reshape(3, 700) / 7
        ps.push_dense("adm/w", np.ones((3, 700)))
        ps.set_dense("adm/w", w)
        np.testing.assert_array_equal(ps.pull_dense("adm/w"), w)
        ps.push_dense("adm/w", np.ones((3, 700)))
        np.testing.assert_allclose(ps.pull_dense("adm/w"), w - 0.001, rtol=0, atol=1e-5)
        # rows: set over both partitions, the rest untouched
        ids = np.arange(-500, 1500, 3, dtype=np.int64)
        rows = np.random.default_rng(1).normal(size=(ids.size, 4)).astype(np.float32)
        ps.set_rows("adm/e", ids, rows)
        np.testing.assert_array_equal(ps.pull_rows("adm/e", ids), rows)
        np.testing.assert_array_equal(ps.pull_rows("adm/e", [2]), np.zeros((1, 4)))
        ps.push_rows("adm/e", [2, 8], np.ones((2, 4)))  # two new ids
        # ids: every id exactly once, in bounded chunks
        chunks = list(ps.table_ids("adm/e", chunk=100))
        assert max(c.size for c in chunks) == 100
        got = np.concatenate(chunks)
        assert got.size == np.unique(got).size
        assert set(got.tolist()) == {*ids.tolist(), 2, 8}
        d = ps.describe("adm/e")
        assert d["kind"] == "embedding" and d["rows"] == ids.size + 2
        assert d["spec"].dim == 4 and len(d["partitions"]) == cluster.partitions
        assert sum(p["rows"] for p in d["partitions"]) == d["rows"] and d["bytes"] > 0
        assert ps.describe("adm/w")["kind"] == "dense"
        # errors name what is wrong
        with pytest.raises(UnknownTableError, match="'adm/none'"):
            ps.describe("adm/none")
        with pytest.raises(ShapeMismatchError, match=r"'adm/e'.*\(2, 4\)"):
            ps.set_rows("adm/e", [1, 2], np.zeros((2, 5)))
        with pytest.raises(ShapeMismatchError, match=r"'adm/w'.*\(3, 700\)"):
            ps.set_dense("adm/w", np.zeros(2100))
        with pytest.raises(BadRequestError, match="id 2 appears more than once"):
            ps.set_rows("adm/e", [2, 2], np.zeros((2, 4)))
        with pytest.raises(BadRequestError, match="no data dir"):
            ps.checkpoint(timeout=5)
        # drop: gone everywhere, the name free again
        assert ps.drop_table("adm/e") is True
        assert "adm/e" not in ps.list_tables()
        with pytest.raises(UnknownTableError, match="'adm/e'"):
            ps.pull_rows("adm/e", [1])
        with pytest.raises(UnknownTableError, match="'adm/e'"):
            ps.drop_table("adm/e")
        assert ps.drop_table("adm/e", missing_ok=True) is False
        ps.create_embedding("adm/e", dim=2)
        np.testing.assert_array_equal(ps.pull_rows("adm/e", ids[:3]), np.zeros((3, 2)))


async def test_admin_calls_async(cluster: LocalCluster) -> None:
    async with zps.connect(cluster.address, timeout=20) as ps:
        await ps.create_embedding("adm/async", dim=2)
        ids = np.arange(1000, dtype=np.int64) * 7919
        await ps.set_rows("adm/async", ids, np.ones((1000, 2)))
        seen = [c async for c in ps.table_ids("adm/async", chunk=128)]
        assert sorted(np.concatenate(seen).tolist()) == sorted(ids.tolist())
        assert (await ps.describe("adm/async"))["rows"] == 1000
        assert await ps.drop_table("adm/async")
        assert "adm/async" not in await ps.list_tables()


# -- failover and restart ------------------------------------------------------------

HB = 0.1
LIVENESS = 20


@pytest.fixture
def data_cluster(tmp_path: Path) -> Iterator[DataDirCluster]:
    c = DataDirCluster(
        partitions=2, replication=2, heartbeat_interval=HB, liveness=LIVENESS, workdir=tmp_path
    )
    c.port = free_port()
    try:
        yield c
    finally:
        c.stop()


def served(status: dict[str, Any]) -> bool:
    return all(p["state"] in ("ok", "degraded") for p in status["partitions"])


def expect(ps: Any, dense: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    np.testing.assert_array_equal(ps.pull_dense("keep/w"), dense)
    np.testing.assert_array_equal(ps.pull_rows("keep/e", ids), rows)
    assert ps.list_tables() == ["keep/e", "keep/w"]


@pytest.mark.timeout(150)
def test_values_set_survive_failover_and_a_restart_of_everything(
    data_cluster: DataDirCluster, tmp_path: Path
) -> None:
    c = data_cluster
    flags = ["--durability", "interval", "--checkpoint-interval", "0"]
    dirs = [tmp_path / f"data{i}" for i in range(4)]
    c.start_broker()
    shards = [c.start_shard(d, flags) for d in dirs]
    c.wait_healthy(40)
    rng = np.random.default_rng(7)
    ids = rng.integers(-(2**40), 2**40, size=3000).astype(np.int64)
    ids = np.unique(ids)
    rows = rng.normal(size=(ids.size, 8)).astype(np.float32)
    dense = rng.normal(size=(300, 1000)).astype(np.float32)  # chunked over both partitions
    with zps.connect_sync(c.address, timeout=30) as ps:
        ps.create_dense("keep/w", shape=(300, 1000), optimizer=SGD(lr=1.0))
        ps.create_embedding("keep/e", dim=8, optimizer=Adam(lr=0.1))
        ps.create_embedding("gone/e", dim=2)
        ps.push_rows("keep/e", ids[:50], np.ones((50, 8)))  # state for set_rows to reset
        ps.set_dense("keep/w", dense)
        ps.set_rows("keep/e", ids, rows)
        assert ps.drop_table("gone/e")
        expect(ps, dense, ids, rows)
        before = ps.checksums()
        primaries = [c.shard_pid(p) for p in range(2)]
    # SIGKILL both primaries: the replicas take over with the same state
    for pid in primaries:
        c.kill(pid)
    c.wait_for(
        lambda s: served(s) and all(x["pid"] not in primaries for x in s["shards"]),
        40,
        "the replicas to take over",
    )
    # one copy left of each partition (below min_in_sync): writes with acks=1
    with zps.connect_sync(c.address, timeout=30, acks=1) as ps:
        expect(ps, dense, ids, rows)
        after = ps.checksums()
        assert [after[p]["checksum"] for p in range(2)] == [before[p]["checksum"] for p in range(2)]
        # an on-demand checkpoint, reported per partition, then more writes in the log only
        report = ps.checkpoint(timeout=30)
        assert sorted(report) == [0, 1]
        for p, ck in report.items():
            assert ck["lsn"] >= after[p]["lsn"] and Path(ck["path"]).is_file(), report
        dense[5] = 42.0
        ps.set_dense("keep/w", dense)
        rows[:10] = -3.0
        ps.set_rows("keep/e", ids[:10], rows[:10])
        expect(ps, dense, ids, rows)
    # SIGKILL every process; restart all on the same data dirs
    victims = [p for p in [*shards, c.broker()] if p.alive()]
    for p in victims:
        os.kill(p.pid, signal.SIGKILL)
    for p in victims:
        p.popen.wait(10)
    restarted = [c.start_shard(d, flags) for d in dirs]
    c.restart_broker(grace=1.0)
    c.wait_for(served, 60, "the restarted shards to claim their partitions")
    with zps.connect_sync(c.address, timeout=30) as ps:
        expect(ps, dense, ids, rows)
    # each partition came back from a checkpoint plus logged messages after it
    replayed: dict[int, int] = {}
    for proc in restarted:
        for part, n in re.findall(
            r"restored partition (\d+) .*ckpt-.* and (\d+) logged", proc.log()
        ):
            replayed[int(part)] = max(replayed.get(int(part), 0), int(n))
    assert all(replayed.get(p, 0) >= 1 for p in range(2)), replayed


@pytest.mark.timeout(120)
def test_a_capped_table_stays_under_its_cap_and_replicas_evict_alike(tmp_path: Path) -> None:
    c = LocalCluster(
        partitions=2, shards=4, replication=2, heartbeat_interval=HB, liveness=LIVENESS
    )
    with c:  # started
        cap, stream = 2000, 20_000  # a stream of 10x more distinct ids than the cap
        with zps.connect_sync(c.address, timeout=30) as ps:
            ps.create_embedding("cap", dim=8, optimizer=Adam(), admit_count=2, max_rows=cap)
            assert ps.describe("cap")["spec"].max_rows == cap // 2  # per partition
            rng = np.random.default_rng(5)
            ids = rng.permutation(np.unique(rng.integers(10, 2**62, size=stream + 100)))[:stream]
            peak = 0
            for i in range(0, stream, 500):
                batch = ids[i : i + 500]
                for _ in range(2):  # admitted at the second push
                    ps.push_rows("cap", batch, np.ones((batch.size, 8)))
                d = ps.describe("cap")
                peak = max(peak, d["rows"])
                assert all(p["rows"] <= cap // 2 for p in d["partitions"]), d
            ps.push_rows("cap", [7], np.ones((1, 8)))  # seen once: counted, not trained
            d = ps.describe("cap")
            assert d["admitted"] == d["rows"] - 1
            assert np.array_equal(ps.pull_rows("cap", [7]), np.zeros((1, 8)))
            assert 7 not in set(np.concatenate(list(ps.table_ids("cap"))).tolist())
            latest = ids[-200:]
            assert np.all(ps.pull_rows("cap", latest) < 0)  # the newest rows are kept
            before = ps.checksums()
            primaries = [c.shard_pid(p) for p in range(2)]
        assert cap * 0.9 <= peak <= cap
        for pid in primaries:
            c.kill(pid)
        c.wait_for(
            lambda s: served(s) and all(x["pid"] not in primaries for x in s["shards"]),
            40,
            "the replicas to take over",
        )
        with zps.connect_sync(c.address, timeout=30) as ps:
            after = ps.checksums()  # the replicas evicted exactly the same rows
            assert [after[p]["checksum"] for p in range(2)] == [
                before[p]["checksum"] for p in range(2)
            ]
