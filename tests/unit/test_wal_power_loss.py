"""The write-ahead log across a power loss, on the simulator's disk (zps/testing/sim/disk.py:
what was not synced is gone when the machine stops; a killed process loses nothing)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from zps.store.wal import Record, Wal
from zps.testing.sim import disk as simdisk


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[simdisk.Disk]:
    sim_os = simdisk.SimOS()
    d = simdisk.Disk(tmp_path / "data", random.Random(0))
    sim_os.disks.append(d)
    saved = simdisk.install(sim_os)
    try:
        yield d
    finally:
        simdisk.uninstall(saved)


def _rec(lsn: int) -> Record:
    return Record(1, lsn - 1, lsn, [b"x" * 40])


def _replay(folder: Path) -> tuple[Wal, list[int]]:
    seen: list[int] = []
    wal = Wal(folder, segment_bytes=1 << 20)

    def apply(rec: Record) -> int:
        seen.append(rec.lsn)
        return rec.lsn

    wal.recover(0, 0, apply)
    return wal, seen


def _kill(wal: Wal) -> None:
    """The process dies: its file stays as written, nothing is synced on the way out."""
    wal.close(sync=False)


def test_what_a_restart_replays_is_durable_before_it_appends_after_it(
    disk: simdisk.Disk,
) -> None:
    """A record written but not synced by a process that died is replayed by the next
    one (it is in the page cache); records that one appends in a new segment and syncs
    must still follow it after a power loss (seed 157 of the simulator: the restarted
    copy lost every acknowledged write after it to a gap)."""
    folder = disk.root / "partition-0"
    wal = Wal(folder, segment_bytes=1 << 20)
    wal.reset(0)
    wal.append([_rec(1), _rec(2)])
    wal.sync()
    wal.append([_rec(3)])  # written, not synced: the process dies before its sync
    _kill(wal)

    wal, seen = _replay(folder)
    assert seen == [1, 2, 3]
    wal.roll()  # the next records go to a segment of their own
    wal.append([_rec(4), _rec(5)])
    wal.sync()  # 4 and 5 are durable, and acknowledged as such
    _kill(wal)

    disk.crash(torn=False)  # the machine loses power
    wal, seen = _replay(folder)
    wal.close()
    assert seen == [1, 2, 3, 4, 5]
