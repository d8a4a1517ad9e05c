"""Whole-cluster crashes and restarts in the wrong order, with real processes: the
broker elects only a copy that holds every acknowledged write (its durable in-sync
set), a newer copy takes a partition over from a primary that took no write, and two
copies that both took writes are a conflict in which neither is overwritten
(zps/core/cluster.py rules 4 and 8)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from zps.optim import SGD
from zps.testing import DataDirCluster, Proc, free_port

HB, LIVENESS = 0.1, 10


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., DataDirCluster]]:
    made: list[DataDirCluster] = []

    def make(*, broker_dir: bool, **kwargs: Any) -> DataDirCluster:
        c = DataDirCluster(
            heartbeat_interval=HB,
            liveness=LIVENESS,
            workdir=tmp_path,
            broker_data_dir=tmp_path / "broker" if broker_dir else None,
            **kwargs,
        )
        c.port = free_port()
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def kill(proc: Proc) -> None:
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait(10)


def serves(c: DataDirCluster, proc: Proc) -> Callable[[dict[str, Any]], bool]:
    """Whether ``proc`` is the primary of partition 0 in a status."""

    def check(s: dict[str, Any]) -> bool:
        node = node_of(c, proc, s)
        return bool(node) and s["partitions"][0]["primary"] == node

    return check


def node_of(c: DataDirCluster, proc: Proc, status: dict[str, Any] | None = None) -> str:
    """The node id of ``proc`` ("" until it registered)."""
    status = status or c.status()
    return str(next((s["node"] for s in status["shards"] if s["pid"] == proc.pid), ""))


def push(c: DataDirCluster, n: int) -> None:
    """``n`` acknowledged pushes of ones to the dense ``w`` (SGD lr=1: w = -pushes)."""
    with zps.connect_sync(c.address, timeout=20) as ps:
        for _ in range(n):
            ps.push_dense("w", np.ones(4))


def value(c: DataDirCluster) -> float:
    with zps.connect_sync(c.address, timeout=20) as ps:
        return float(ps.pull_dense("w")[0])


@pytest.mark.parametrize("broker_dir", [True, False], ids=["broker-data-dir", "no-broker-dir"])
def test_an_older_copy_never_wins_a_restart(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path, broker_dir: bool
) -> None:
    """1 partition x 2 copies: the replica dies, the primary acknowledges 20 more
    pushes, then the primary and the broker are SIGKILLed at once; on restart the older
    copy registers first.  Every acknowledged push must be there at the end."""
    config = tmp_path / "zps.toml"
    config.write_text("[replication]\nmin_in_sync = 1\n")
    c = make_cluster(broker_dir=broker_dir, partitions=1, replication=2)
    flags = ["--config", str(config)]
    c.start_broker()
    first = c.start_shard(tmp_path / "a", flags)
    c.wait_for(lambda s: s["partitions"][0]["primary"] is not None, 20, "a primary")
    second = c.start_shard(tmp_path / "b", flags)
    status = c.wait_healthy(30)
    primary = first if status["partitions"][0]["primary"] == node_of(c, first) else second
    replica = second if primary is first else first
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
    push(c, 10)
    kill(replica)
    c.wait_for(
        lambda s: not s["partitions"][0]["replicas"], 20, "the broker to drop the dead replica"
    )
    push(c, 20)  # acknowledged by the primary alone (min_in_sync 1)
    kill(primary)
    kill(c.broker())
    # The older copy comes back first and the new broker's hold ends without the newer.
    old = c.start_shard(replica_dir := tmp_path / ("b" if replica is second else "a"), flags)
    broker = c.start_broker(grace=0.5)
    if broker_dir:
        c.wait_for(
            lambda s: (
                bool(s["partitions"][0].get("held_copies"))
                and s["partitions"][0]["state"] == "lost"
            ),
            20,
            "the older copy to be held",
        )
    else:
        # The newer copy comes after the broker's hold (within it, the newer claim of the
        # two simply wins: no write is routed during the hold).
        c.wait_for(
            lambda s: s["partitions"][0]["primary"] is not None and s["broker"]["holding_s"] == 0,
            20,
            "the older copy to serve after the hold",
        )
    assert replica_dir.exists()
    newer = c.start_shard(tmp_path / ("a" if replica is second else "b"), flags)
    status = c.wait_for(
        lambda s: (
            s["partitions"][0]["state"] == "ok"
            and s["partitions"][0]["primary"] == node_of(c, newer, s)
        ),
        30,
        "the newer copy to serve with the older one in sync behind it",
    )
    assert status["partitions"][0]["replicas"][0]["node"] == node_of(c, old, status)
    assert value(c) == -30.0
    log = broker.log()
    if broker_dir:
        assert re.search(r"ERROR .*came back with partition 0 .*not taken", log), log[-3000:]
    else:
        assert re.search(r"WARNING .*holds a newer copy", log), log[-3000:]


def start_alone(c: DataDirCluster, data: Path) -> Proc:
    """A broker without a data dir and one shard that fills partition 0; then both die."""
    c.start_broker()
    holder = c.start_shard(data)
    c.wait_for(lambda s: s["partitions"][0]["primary"] is not None, 20, "a primary")
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
    push(c, 7)
    kill(holder)
    kill(c.broker())
    return holder


def test_an_empty_shard_hands_a_known_partition_to_the_copy_holding_it(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    """No broker data dir: the restarted broker gives the partition to an empty shard
    (it cannot know the partition held data); the shard holding the data registers
    next and takes it over, since the empty one took no write."""
    c = make_cluster(broker_dir=False, partitions=1, replication=1)
    start_alone(c, tmp_path / "data")
    broker = c.start_broker(grace=0.3)
    empty = c.start_shard()
    c.wait_for(
        serves(c, empty),
        20,
        "the empty shard",
    )
    holder = c.start_shard(tmp_path / "data")
    c.wait_for(
        serves(c, holder),
        20,
        "the copy holding the data to take over",
    )
    assert value(c) == -7.0
    assert re.search(r"WARNING .*holds a newer copy", broker.log()), broker.log()[-3000:]


def test_two_copies_with_writes_are_a_conflict_and_neither_is_overwritten(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    c = make_cluster(broker_dir=False, partitions=1, replication=2)
    start_alone(c, tmp_path / "data")
    before = sorted(p.name for p in (tmp_path / "data" / "partition-0").iterdir())
    broker = c.start_broker(grace=0.3)
    empty = c.start_shard(tmp_path / "empty")
    c.wait_for(
        serves(c, empty),
        20,
        "the empty shard",
    )
    with zps.connect_sync(c.address, timeout=20) as ps:  # a write on the empty copy
        ps.create_dense("other", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
    holder = c.start_shard(tmp_path / "data")
    status = c.wait_for(
        lambda s: bool(s["partitions"][0].get("held_copies")), 20, "the data's copy to be held"
    )
    part = status["partitions"][0]
    assert part["primary"] == node_of(c, empty, status)
    assert part["held_copies"][0]["node"] == node_of(c, holder, status)
    assert part["replicas"] == []  # the held copy is nobody's replica
    log = broker.log()
    assert re.search(r"ERROR .*two copies hold writes the other lacks", log), log[-3000:]
    assert "reset-partition" in log
    # Its files are as they were: nothing loaded over them.
    assert sorted(p.name for p in (tmp_path / "data" / "partition-0").iterdir()) == before


@pytest.mark.parametrize("broker_dir", [True, False], ids=["broker-data-dir", "no-broker-dir"])
def test_a_copy_without_a_log_waits_for_the_operator(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path, broker_dir: bool
) -> None:
    """durability "none": a shard SIGKILLed comes back from a checkpoint written while it
    ran, older than what it acknowledged.  However fresh the broker's record (or with
    none), that copy serves again only once an operator accepts the loss."""
    c = make_cluster(broker_dir=broker_dir, partitions=1, replication=1)
    data = tmp_path / "only"
    flags = ["--durability", "none", "--checkpoint-interval", "0", "--checkpoint-every", "5"]
    c.start_broker()
    shard = c.start_shard(data, flags)
    c.wait_for(serves(c, shard), 20, "a primary")
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
    push(c, 6)
    folder = data / "partition-0"
    c.wait_for(lambda s: bool(list(folder.glob("ckpt-*.zps"))), 20, "a checkpoint")
    push(c, 2)  # acknowledged, in no checkpoint (the next is due 5 updates later)
    kill(shard)
    kill(c.broker())
    broker = c.start_broker(grace=0.3)
    empty = c.start_shard()  # an empty shard must not take it either
    back = c.start_shard(data, flags)
    # Held, and still held once the start-up hold is over (the operator's command is
    # refused during the hold: ask again when it has ended).
    status = c.wait_for(
        lambda s: (
            bool(s["partitions"][0].get("held_copies"))
            and len(s["shards"]) == 2
            and s["broker"]["holding_s"] == 0
        ),
        20,
        "the copy to be held after the start-up hold",
    )
    assert status["partitions"][0]["primary"] is None, status
    assert status["partitions"][0]["held_copies"][0]["node"] == node_of(c, back, status)
    log = broker.log()
    assert re.search(r"ERROR .*restored without a log and may lack acknowledged", log), log
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zps",
            "reset-partition",
            "--broker",
            c.address,
            "--partition",
            "0",
            "--accept-data-loss",
        ],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    c.wait_for(serves(c, back), 20, "the held copy to serve once the loss is accepted")
    assert -8.0 < value(c) <= -5.0  # the checkpoint's pushes, not the last ones
    assert node_of(c, empty)  # registered all along, and given nothing


def test_a_planned_stop_of_the_last_copy_is_no_error(
    make_cluster: Callable[..., DataDirCluster], tmp_path: Path
) -> None:
    """SIGTERM of a partition's only shard (an operator's stop) leaves the partition
    without a copy: logged at WARNING, not as an ERROR 'partition lost'; it serves again
    when the shard comes back."""
    c = make_cluster(broker_dir=True, partitions=1, replication=1)
    broker = c.start_broker()
    shard = c.start_shard(tmp_path / "only")
    c.wait_for(serves(c, shard), 20, "a primary")
    with zps.connect_sync(c.address, timeout=20) as ps:
        ps.create_dense("w", shape=(4,), dtype="float64", optimizer=SGD(lr=1.0))
    push(c, 3)
    shard.popen.send_signal(signal.SIGTERM)
    assert shard.popen.wait(20) == 0, shard.log()[-2000:]
    c.wait_for(lambda s: s["partitions"][0]["state"] == "lost", 20, "no copy serving")
    log = broker.log()
    assert re.search(r"WARNING .*partition 0 has no copy serving: its last one, s-", log), log
    assert re.search(r"WARNING .*partition 0: ok -> lost.*its last copy was stopped", log), log
    assert " ERROR " not in log, log
    back = c.start_shard(tmp_path / "only")
    c.wait_for(serves(c, back), 20, "the copy back")
    assert value(c) == -3.0
