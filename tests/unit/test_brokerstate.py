"""The broker's state record: round trips, validation, versions, the file format."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zps.broker.statefile import MAGIC, StateFile, StateWriter, decode, frame
from zps.core.brokerstate import (
    BrokerState,
    BrokerStateError,
    ClockRecord,
    JobRecord,
    PartitionRecord,
)
from zps.core.coord import Clocks, Job
from zps.errors import ConfigError
from zps.protocol.messages import Mode


def sample(version: int = 7) -> BrokerState:
    job = Job("j", n_records=100, per_task=10, epochs=2, seed=3)
    a = job.next("w1")
    b = job.next("w2")
    assert a is not None and b is not None
    job.finish("w1", a.task_id)
    job.release("w2", b.task_id, failed=True)
    clocks = Clocks()
    clocks.join("w1", Mode.SYNC, 0)
    clocks.tick("w1", Mode.SYNC, 0, 1)
    clocks.committing, clocks.commit_workers = 0, ("w1",)
    return BrokerState(
        version=version,
        n_partitions=2,
        n_slots=64,
        replication=2,
        map_version=41,
        partitions=(PartitionRecord(3, 3, 1200, ("a", "b")), PartitionRecord()),
        clocks=clocks.to_record(),
        jobs=(job.to_record(),),
    )


def test_round_trip_through_bytes_keeps_everything() -> None:
    rec = sample()
    assert BrokerState.from_bytes(rec.to_bytes()) == rec
    assert BrokerState.from_dict(rec.to_dict()) == rec


def test_jobs_and_clocks_come_back_as_they_were() -> None:
    rec = BrokerState.from_bytes(sample().to_bytes())
    job = Job.from_record(rec.jobs[0])
    assert len(job.done) == 1 and set(job.retries.values()) == {1}
    assert [t for _, (w, t) in job.held.items()] == []  # w2's task went back, w1's is done
    first = job.next("w3")
    assert first is not None and job.retries.get(first.task_id) == 1  # back first in line
    clocks = Clocks.from_record(rec.clocks)
    assert clocks.mode is Mode.SYNC and clocks.committing == 0
    assert clocks.workers["w1"].step == 1 and clocks.workers["w1"].waiting
    assert clocks.sync_committed(0) == ["w1"]


def test_a_finished_epoch_is_one_run_on_the_wire() -> None:
    job = Job("big", n_records=10_000, per_task=1, epochs=2)
    while (t := job.next("w")) is not None and t.epoch == 0:
        job.finish("w", t.task_id)
    wire = BrokerState(1, 1, 16, 1, 0, (PartitionRecord(),), jobs=(job.to_record(),)).to_dict()
    assert wire["jobs"][0]["done"] == [[0, 10_000]]


def test_same_content_and_floors_only() -> None:
    rec = sample()
    assert rec.same_content(BrokerState.from_bytes(sample(version=9).to_bytes()))
    moved = BrokerState(
        rec.version,
        2,
        64,
        2,
        41,
        (PartitionRecord(3, 3, 1300, ("a", "b")), PartitionRecord()),
        rec.clocks,
        rec.jobs,
    )
    assert not moved.same_content(rec) and moved.floors_only_differ(rec)
    new_epoch = BrokerState(
        rec.version,
        2,
        64,
        2,
        41,
        (PartitionRecord(4, 4, 0, ("a",)), PartitionRecord()),
        rec.clocks,
        rec.jobs,
    )
    assert not new_epoch.floors_only_differ(rec)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(kind="other"), "kind"),
        (lambda d: d.update(format=99), "format"),
        (lambda d: d.update(version=-1), "version"),
        (lambda d: d.update(n_partitions=3), "partitions"),
        (lambda d: d["partitions"][0].__setitem__(1, 9), "floor_epoch"),
        (lambda d: d["partitions"][0].__setitem__(2, "x"), "floor_lsn"),
        (lambda d: d["clocks"].update(mode="fast"), "clocks.mode"),
        (lambda d: d["clocks"]["workers"].append(["w", 1]), "clocks.workers"),
        (lambda d: d["jobs"][0]["queue"].append(0), "jobs[0]"),
        (lambda d: d["jobs"][0]["queue"].append(10_000), "jobs[0].queue"),
        (lambda d: d["jobs"][0].update(settings=[1, 1, 0, 0, 0]), "jobs[0].settings"),
        (lambda d: d["jobs"].append(d["jobs"][0]), "jobs"),
    ],
)
def test_bad_records_name_the_field(edit: object, field: str) -> None:
    d = sample().to_dict()
    edit(d)  # type: ignore[operator]
    with pytest.raises(BrokerStateError, match=field.replace("[", r"\[").replace("]", r"\]")):
        BrokerState.from_dict(d)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_raises_only_the_state_error(raw: bytes) -> None:
    with contextlib.suppress(BrokerStateError):
        BrokerState.from_bytes(raw)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, len(sample().to_bytes()) - 1), st.integers(1, 255))
def test_flipped_bytes_are_refused_or_still_valid(pos: int, delta: int) -> None:
    raw = bytearray(sample().to_bytes())
    raw[pos] = (raw[pos] + delta) % 256
    with contextlib.suppress(BrokerStateError):
        BrokerState.from_bytes(bytes(raw))


def test_the_file_is_checked_and_replaced_whole(tmp_path: Path) -> None:
    f = StateFile(tmp_path / "broker")
    f.prepare()
    assert f.load() is None
    f.write(sample().to_bytes())
    assert f.load() == sample()
    f.write(sample(version=8).to_bytes())
    assert f.load() == sample(version=8)
    assert sorted(p.name for p in f.dir.iterdir()) == ["broker-state.zps"]
    raw = bytearray(f.path.read_bytes())
    raw[-1] ^= 1
    f.path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="checksum mismatch"):
        f.load()
    with pytest.raises(ConfigError, match="not a zps broker state"):
        decode(b"nonsense")
    assert decode(frame(sample().to_bytes())) == sample()
    assert frame(b"x").startswith(MAGIC)


def test_the_writer_coalesces_and_writes_the_newest(tmp_path: Path) -> None:
    f = StateFile(tmp_path)
    versions = iter(range(1, 1000))
    current: dict[str, BrokerState] = {}

    def produce() -> BrokerState:
        rec = current.get("rec")
        if rec is None or current.get("dirty") is not None:
            v = next(versions)
            rec = BrokerState(v, 1, 16, 1, v, (PartitionRecord(v, v, v),))
            current["rec"] = rec
            current.pop("dirty", None)
        return rec

    async def main() -> None:
        w = StateWriter(f, produce, lsn_delay=0.0, min_gap=0.0)
        task = asyncio.create_task(w.run())
        for _ in range(50):
            current["dirty"] = BrokerState(0, 1, 16, 1, 0, (PartitionRecord(),))
            w.changed()
            await asyncio.sleep(0)
        for _ in range(100):
            if w.written is not None and w.written == current["rec"]:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        assert w.written == current["rec"] and f.load() == current["rec"]
        assert 1 <= w.writes < 50  # coalesced

    asyncio.run(main())


def test_clock_record_defaults() -> None:
    assert Clocks.from_record(ClockRecord()).to_record() == ClockRecord()
    rec = JobRecord("x", 5, 5, 1, 3, 0, queue=(0,))
    assert Job.from_record(rec).to_record() == rec
