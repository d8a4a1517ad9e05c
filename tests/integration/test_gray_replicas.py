"""Replicas that stop reading, histories that differ, and ``min_in_sync``, with real
processes paused (SIGSTOP) and killed.

What must hold: a paused replica never freezes its primary (writes go on within about
one liveness timeout, the replica leaves the in-sync set, no request waits forever);
a replica counts as in sync only once it holds the new primary's state; acks="all"
never quietly becomes acks=1.  Every acknowledged write is checked by exact sums.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zps
from tests.integration.wire import raw_dealer
from zps.errors import NotEnoughReplicasError
from zps.optim import SGD
from zps.protocol.codec import Encoder, MsgType, Route, decode
from zps.testing import LocalCluster

HB, LIVENESS = 0.1, 10  # a silent peer is dead after 1 s
DIM = 4


@dataclass
class Writer:
    """Pushes integer values to its own rows; remembers what was acknowledged."""

    ids: np.ndarray[Any, Any]
    acked: float = 0.0
    pushes: int = 0
    errors: list[BaseException] = field(default_factory=list)
    acks: list[tuple[float, float]] = field(default_factory=list)  # (sent, acknowledged)

    async def run(self, address: str, acks: Any, stop: asyncio.Event) -> None:
        # A connection of its own: every push is a message of its own (one client would
        # coalesce concurrent pushes into one message).
        async with zps.connect(address, timeout=5.0, acks=acks) as ps:
            await self._push(ps, stop)

    async def _push(self, ps: zps.Client, stop: asyncio.Event) -> None:
        while not stop.is_set():
            value = float(self.pushes % 5 + 1)
            sent = time.monotonic()
            try:
                await ps.push_rows("t", self.ids, np.full((self.ids.size, DIM), value))
            except Exception as e:  # recorded: the test fails on any
                self.errors.append(e)
                return
            self.acked += value
            self.pushes += 1
            self.acks.append((sent, time.monotonic()))


async def check_sums(address: str, writers: list[Writer]) -> list[str]:
    problems = [repr(e) for w in writers for e in w.errors]
    async with zps.connect(address, timeout=10) as ps:
        for i, w in enumerate(writers):
            got = await ps.pull_rows("t", w.ids)
            if not np.array_equal(got, np.full_like(got, -w.acked)):
                problems.append(f"writer {i}: expected {-w.acked}, found {np.unique(got)[:4]}")
    return problems


def replicas(c: LocalCluster) -> list[tuple[int, str]]:
    """(pid, node id) of every replica."""
    return [(s["pid"], s["node"]) for s in c.status()["shards"] if s["role"] == "replica"]


def in_sync(status: dict[str, Any]) -> set[str]:
    return {r["node"] for p in status["partitions"] for r in p["replicas"] if r["in_sync"]}


def config(tmp_path: Path, **replication: int) -> list[str]:
    path = tmp_path / "zps.toml"
    lines = ["[replication]", *(f"{k} = {v}" for k, v in replication.items())]
    path.write_text("\n".join(lines) + "\n")
    return ["--config", str(path)]


#: Pushes acknowledged while the replica stays paused, within 3 s (about 16 MiB: its
#: socket buffers and the follower queue fill many times over).
PAUSED_PUSHES = 1000


async def pushes_since(writers: list[Writer], before: int, count: int, within: float) -> int:
    """The pushes acknowledged since ``before`` once there are ``count`` of them, or
    after ``within`` seconds, whichever comes first."""
    deadline = time.monotonic() + within
    while (done := sum(w.pushes for w in writers) - before) < count:
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.01)
    return done


async def writers_acked_since(writers: list[Writer], t: float, within: float) -> int:
    """How many writers had a push acknowledged after ``t``, once all of them have, or
    after ``within`` seconds from ``t``."""

    def acked() -> int:
        return sum(bool(w.acks) and w.acks[-1][1] > t for w in writers)

    while acked() < len(writers) and time.monotonic() < t + within:
        await asyncio.sleep(0.01)
    return acked()


@pytest.mark.parametrize("acks", ["all", 1])
async def test_a_paused_replica_never_freezes_its_primary(acks: Any, tmp_path: Path) -> None:
    # Replication 3: with one replica paused, two copies stay in sync (min_in_sync 2).
    with LocalCluster(
        partitions=1,
        shards=3,
        replication=3,
        heartbeat_interval=HB,
        liveness=LIVENESS,
        shard_args=config(tmp_path, follower_queue_bytes=1 << 20),
    ) as c:
        async with zps.connect(c.address, timeout=5.0, acks=acks) as ps:
            await ps.create_embedding("t", dim=DIM, dtype="float64", optimizer=SGD(lr=1.0))
            writers = [Writer(np.arange(k * 512, (k + 1) * 512, dtype=np.int64)) for k in range(6)]
            stop = asyncio.Event()
            load = asyncio.gather(*(w.run(c.address, acks, stop) for w in writers))
            try:
                await asyncio.sleep(0.3)
                paused, node = replicas(c)[0]
                c.kill(paused, signal.SIGSTOP)
                paused_at = time.monotonic()
                try:
                    # It leaves the in-sync set (the primary drops it, or the broker
                    # declares it dead) within about one liveness timeout.
                    await asyncio.to_thread(
                        c.wait_for,
                        lambda s: node not in in_sync(s),
                        5,
                        "the paused replica to leave the in-sync set",
                    )
                    left_after = time.monotonic() - paused_at
                    # Thousands of pushes while it stays paused (PAUSED_PUSHES of 16 KiB,
                    # far past its socket buffers and the follower queue): none may hang.
                    before = sum(w.pushes for w in writers)
                    during = await pushes_since(writers, before, PAUSED_PUSHES, 3.0)
                finally:
                    c.kill(paused, signal.SIGKILL)
                killed_at = time.monotonic()
                after_kill = await writers_acked_since(writers, killed_at, 1.0)
            finally:
                stop.set()
                await load
        worst = max(acked - sent for w in writers for sent, acked in w.acks)
        print(f"acks={acks}: left in-sync after {left_after:.2f}s, {during} pushes paused")
        print(f"worst push latency {worst:.3f}s")
        assert left_after < 2.5, f"left the in-sync set only after {left_after:.2f}s"
        assert during >= PAUSED_PUSHES, f"only {during} pushes acknowledged in 3 s paused"
        assert after_kill == len(writers), "writes stopped after the replica was killed"
        assert worst < 2.0, f"a push waited {worst:.2f}s"
        assert await check_sums(c.address, writers) == []
        status = c.status()
        assert status["partitions"][0]["epoch"] == 1  # no failover: the primary kept serving
        primary = next(s for s in status["shards"] if s["role"] == "primary")
        log = c.proc_by_pid(primary["pid"]).log()
        assert "no word from the broker" not in log


async def test_min_in_sync_refuses_acks_all_with_too_few_copies_not_acks_one() -> None:
    with LocalCluster(
        partitions=1, shards=2, replication=2, heartbeat_interval=HB, liveness=LIVENESS
    ) as c:
        ids = np.arange(64, dtype=np.int64)
        ones = np.ones((64, DIM))
        async with (
            zps.connect(c.address, timeout=1.5) as strict,
            zps.connect(c.address, timeout=5.0, acks=1) as fast,
        ):
            await strict.create_embedding("t", dim=DIM, dtype="float64", optimizer=SGD(lr=1.0))
            await strict.push_rows("t", ids, ones)  # both copies hold it
            replica = replicas(c)[0][0]
            c.kill(replica, signal.SIGKILL)
            await asyncio.to_thread(c.wait_gone, replica)
            # One copy left: acks="all" is refused (after the client's retries), not
            # quietly acknowledged by the primary alone.
            t0 = time.monotonic()
            with pytest.raises(NotEnoughReplicasError, match="min_in_sync"):
                await strict.push_rows("t", ids, ones)
            assert time.monotonic() - t0 < 3.0
            for _ in range(3):
                await fast.push_rows("t", ids, ones)  # acks=1 is unaffected
            # A new shard becomes the replica; once it has caught up, acks="all" works.
            c.start_shard()
            await asyncio.to_thread(c.wait_healthy, 20)
            await strict.push_rows("t", ids, ones)
            got = await strict.pull_rows("t", ids)
        # 1 + 3 + 1 acknowledged pushes; the refused one was never applied.
        np.testing.assert_array_equal(got, np.full((64, DIM), -5.0))


BIG = 131_072  # float64 values: 1 MiB per push, so a paused reader's socket buffers fill


async def test_a_replica_with_another_history_is_in_sync_only_from_the_new_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replication 3.  Replica A is paused while the primary P streams to B; P and B are
    paused too and A, behind both, is promoted.  P and B come back as A's replicas holding
    a longer, different history.  They count as in sync only once they loaded A's snapshot,
    so acks="all" writes never rest on their old LSNs: with both paused again and A killed,
    every acknowledged write is on the replica promoted next, and the copies converge."""
    # A liveness timeout of 3 s: A's pause (while 24 MiB go by) must stay shorter.
    # The stream inline (no shared memory): A must fall behind while paused, which
    # needs its socket buffers to fill; through P's memory, zmq would queue it all.
    monkeypatch.setenv("ZPS_NO_SHM", "1")
    with LocalCluster(
        partitions=1, shards=3, replication=3, heartbeat_interval=HB, liveness=30
    ) as c:
        async with (
            zps.connect(c.address, timeout=30.0) as strict,
            zps.connect(c.address, timeout=30.0, acks=1) as fast,
        ):
            for name in ("old", "new"):
                await strict.create_dense(name, shape=(BIG,), dtype="float64", optimizer=SGD(lr=1))
            status = c.status()
            p_pid = next(s["pid"] for s in status["shards"] if s["role"] == "primary")
            (a_pid, a_node), (b_pid, _) = replicas(c)
            # 1. A paused: P and B take 24 MiB that A's socket cannot; P and B pause too.
            c.kill(a_pid, signal.SIGSTOP)
            t0 = time.monotonic()
            await asyncio.gather(*(fast.push_dense("old", np.ones(BIG)) for _ in range(24)))
            print(f"24 MiB pushed in {time.monotonic() - t0:.2f}s")
            ahead = await asyncio.to_thread(
                c.wait_for,
                lambda s: all(x["lsn"] >= 26 for x in s["shards"] if x["pid"] != a_pid),
                1.0,
                "P and B to report the 24 pushes",
            )
            assert time.monotonic() - t0 < 2.5, "too slow to keep A's pause under 3 s"
            c.kill(b_pid, signal.SIGSTOP)
            # B must be declared dead before P, or the broker would promote B.
            await asyncio.to_thread(
                c.wait_for,
                lambda s: any(x["pid"] == b_pid and x["last_seen_s"] > 0.5 for x in s["shards"]),
                1.5,
                "B silent for half a second",
            )
            c.kill(p_pid, signal.SIGSTOP)
            c.kill(a_pid, signal.SIGCONT)
            # B is declared dead first, then P: A, the only in-sync copy left, is promoted.
            promoted = await asyncio.to_thread(
                c.wait_for,
                lambda s: s["partitions"][0]["primary"] == a_node,
                10,
                "A promoted",
            )
            assert promoted["partitions"][0]["epoch"] == 2
            a_lsn = next(x["lsn"] for x in promoted["shards"] if x["pid"] == a_pid)
            old = {x["pid"]: x["lsn"] for x in ahead["shards"]}
            print(f"LSNs: A promoted at {a_lsn}; P and B held {old[p_pid]}, {old[b_pid]}")
            assert a_lsn < old[b_pid], "the scenario needs B ahead of the promoted A"
            c.kill(b_pid, signal.SIGCONT)
            c.kill(p_pid, signal.SIGCONT)
            await asyncio.to_thread(c.wait_healthy, 20)  # P and B: A's replicas, in sync
            # 2. Both replicas paused: acks="all" writes to A must wait for them.
            c.kill(b_pid, signal.SIGSTOP)
            c.kill(p_pid, signal.SIGSTOP)
            pushes = [
                asyncio.create_task(strict.push_dense("new", np.ones(BIG))) for _ in range(24)
            ]
            await asyncio.sleep(0.5)
            acked_early = sum(t.done() and t.exception() is None for t in pushes)
            c.kill(a_pid, signal.SIGKILL)
            c.kill(b_pid, signal.SIGCONT)
            c.kill(p_pid, signal.SIGCONT)
            results = await asyncio.gather(*pushes, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert errors == []
            assert acked_early == 0, f"{acked_early} writes acknowledged with both replicas paused"
            got = await strict.pull_dense("new")
            np.testing.assert_array_equal(got, np.full(BIG, -24.0))
            # 3. The copies converge: the next promoted copy has the same state.
            c.start_shard()
            await asyncio.to_thread(c.wait_healthy, 20)
            before = (await strict.checksums())[0]
            c.kill(c.shard_pid(0), signal.SIGKILL)
            await asyncio.to_thread(
                c.wait_for, lambda s: s["partitions"][0]["epoch"] == 4, 10, "a second promotion"
            )
            after = (await strict.checksums())[0]
            assert after == before


async def test_a_replica_paused_past_the_liveness_timeout_never_leaves_writes_waiting(
    tmp_path: Path,
) -> None:
    # Replication 2 and a spare: the paused replica is declared dead and the spare takes
    # its place.  Resumed, the old replica still acknowledges the stream it follows, then
    # re-registers and its connection goes.  No write may wait for it after that.
    with LocalCluster(
        partitions=1, shards=3, replication=2, heartbeat_interval=HB, liveness=LIVENESS
    ) as c:
        c.wait_healthy(30)
        async with zps.connect(c.address, timeout=10) as ps:
            await ps.create_embedding("t", dim=DIM, optimizer=SGD(lr=1.0))
        ((victim, node),) = replicas(c)
        writer = Writer(np.arange(8, dtype=np.int64))
        stop = asyncio.Event()
        task = asyncio.create_task(writer.run(c.address, "all", stop))
        try:
            await asyncio.sleep(0.5)
            c.kill(victim, signal.SIGSTOP)
            await asyncio.to_thread(
                c.wait_for, lambda s: node not in {x["node"] for x in s["shards"]}, 10, "dead"
            )
            c.kill(victim, signal.SIGCONT)
            await asyncio.to_thread(c.wait_healthy, 30)  # the spare took its place
            resumed_at = time.monotonic()
            while time.monotonic() - resumed_at < 3.0 and not writer.errors:
                before = writer.pushes
                await asyncio.sleep(1.0)
                assert writer.pushes > before, "writes stopped after the replica came back"
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        assert writer.pushes > 0
        assert await check_sums(c.address, [writer]) == []


async def test_a_pipelined_pull_is_answered_while_a_paused_replica_holds_its_push() -> None:
    """A pipelined step sends the last step's background push and this step's pull in one
    request.  With the replica paused, the primary answers the pull at once (reads see
    what it applied, as any read does) while the push's answer waits for the replica;
    after the replica resumes, the push is acknowledged and applied exactly once."""
    # A paused replica is dropped only after 5 s: the pull must not wait for that.
    with LocalCluster(
        partitions=1, shards=2, replication=2, heartbeat_interval=HB, liveness=50
    ) as c:
        ids = np.arange(64, dtype=np.int64)
        ones = np.ones((64, DIM))
        async with zps.connect(c.address, timeout=30.0) as ps:
            await ps.create_embedding("t", dim=DIM, dtype="float64", optimizer=SGD(lr=1.0))
            await ps.push_rows("t", ids, ones)  # the replica is in sync: acks="all" waits for it
            replica = replicas(c)[0][0]
            c.kill(replica, signal.SIGSTOP)
            try:
                # Both queued in one turn of the loop, so they go in one request.
                push = asyncio.ensure_future(ps.push_rows("t", ids, ones, wait=False))
                pull = asyncio.ensure_future(ps.pull_rows("t", ids))
                await push  # a background push: returns once sent
                got = await asyncio.wait_for(pull, 3.0)
                np.testing.assert_array_equal(got, np.full((64, DIM), -2.0))  # saw the push
                assert ps.stats.early_replies == 1
                assert ps.requests_in_flight == 1  # the push: not acknowledged by one copy alone
            finally:
                c.kill(replica, signal.SIGCONT)
            await asyncio.wait_for(ps.flush(), 10.0)
            assert ps.requests_in_flight == 0
            np.testing.assert_array_equal(await ps.pull_rows("t", ids), np.full((64, DIM), -2.0))
        status = c.status()
        assert status["partitions"][0]["epoch"] == 1  # no failover
        assert in_sync(status) == {replicas(c)[0][1]}


async def test_answers_to_pipelined_pushes_ride_on_the_next_replies(tmp_path: Path) -> None:
    """Pipelined steps with replication 2 (acks="all"): the answer to each step's
    background push rides on the reply to the next step's request, not a message of its
    own, and every push is applied exactly once.  The shards may hold an answer for a
    second here; ``flush()`` asks for what is held and gets it at once."""
    path = tmp_path / "zps.toml"
    path.write_text("[shard]\nack_hold_s = 1\n")
    with LocalCluster(
        partitions=2,
        shards=4,
        replication=2,
        heartbeat_interval=HB,
        liveness=LIVENESS,
        shard_args=["--config", str(path)],
    ) as c:
        ids = np.arange(256, dtype=np.int64)
        ones = np.ones((256, DIM))
        async with zps.connect(c.address, timeout=30.0) as ps:
            await ps.create_embedding("t", dim=DIM, dtype="float64", optimizer=SGD(lr=1.0))
            await asyncio.to_thread(c.wait_healthy, 20)
            await ps.pull_rows("t", ids)
            for _ in range(100):
                # A step: the push and the next pull, in one request per partition.
                push = asyncio.ensure_future(ps.push_rows("t", ids, ones, wait=False))
                pull = asyncio.ensure_future(ps.pull_rows("t", ids))
                await push
                await pull
            # The last push's answer is held (for a second) until the flush asks for it.
            before = ps.stats.requests
            await asyncio.wait_for(ps.flush(), 0.9)
            assert ps.stats.requests - before == 2  # an "acks" request per partition
            # A request per partition and step; their pushes' answers mostly ride along.
            assert ps.stats.early_replies >= 100
            assert ps.stats.carried_acks > 0
            got = await ps.pull_rows("t", ids)
        np.testing.assert_array_equal(got, np.full((256, DIM), -100.0))


async def test_a_resent_write_is_answered_only_once_the_replicas_hold_it() -> None:
    """A write sent twice (a client's re-send: the same id and sequence number) while
    its only replica is paused: the copy answered from the dedup record waits for the
    replica as the first does (acks="all"), then both are answered and it applied once."""
    with LocalCluster(
        partitions=1, shards=2, replication=2, heartbeat_interval=HB, liveness=50
    ) as c:
        ids = np.arange(8, dtype=np.int64)
        async with zps.connect(c.address, timeout=30.0) as ps:
            await ps.create_embedding("t", dim=DIM, dtype="float64", optimizer=SGD(lr=1.0))
            await ps.push_rows("t", ids, np.ones((8, DIM)))  # the replica is in sync
        epoch = (await asyncio.to_thread(c.status))["partitions"][0]["epoch"]
        enc = Encoder()
        op = {"op": "push_rows", "t": "t", "ids": enc.array(ids), "g": enc.array(np.ones((8, DIM)))}
        header = {"cid": b"c-resend", "seq": 1, "ops": [op]}
        first, again = (enc.build(Route(MsgType.REQUEST, 0, epoch, r), header) for r in (1, 2))
        replica = replicas(c)[0][0]
        with raw_dealer(c.address, b"c-resend") as sock:
            c.kill(replica, signal.SIGSTOP)
            try:
                sock.send_multipart(first)
                sock.send_multipart(again)
                # Neither is answered while the only replica is paused: the re-sent copy
                # would be acknowledged on the primary's word alone.
                assert not await asyncio.to_thread(sock.poll, 1000)
            finally:
                c.kill(replica, signal.SIGCONT)
            answered = {}
            while len(answered) < 2 and await asyncio.to_thread(sock.poll, 10_000):
                reply = decode(sock.recv_multipart())
                answered[reply.route.req_id] = reply.header
            assert {k: h["st"] for k, h in answered.items()} == {1: "OK", 2: "OK"}
        async with zps.connect(c.address, timeout=30.0) as ps:
            got = await ps.pull_rows("t", ids)
        np.testing.assert_array_equal(got, np.full((8, DIM), -2.0))  # applied once
