"""The write-ahead log across a power loss, on the simulator's disk (zps/testing/sim/disk.py:
what was not synced is gone when the machine stops; a killed process loses nothing)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from zps.store.wal import Record, Wal, WalLost
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


def test_a_segment_made_as_a_folder_sync_fails_has_the_run_s_time(tmp_path: Path) -> None:
    # The sim disk stamps files with the run's clock; an empty segment whose folder sync
    # failed kept a wall-clock time, newer than every file of the run, and a restart
    # took its partition for the newest (seed 31 of the real pair's faults).
    sim_os = simdisk.SimOS()
    sim_os.clock = lambda: 1.7e9 + 5.0
    d = simdisk.Disk(tmp_path / "data", random.Random(0))
    sim_os.disks.append(d)
    saved = simdisk.install(sim_os)
    try:
        folder = d.root / "partition-1"
        wal, _ = _replay(folder)
        wal.append([_rec(1)])
        wal.sync()
        d.fsync_eio = 1
        with pytest.raises(WalLost):
            wal.roll()  # a new segment, then the folder's sync fails
        stamps = sorted(p.stat().st_mtime for p in folder.iterdir())
        assert len(stamps) == 2 and max(stamps) < simdisk.WALL
        wal.close(sync=False)
    finally:
        simdisk.uninstall(saved)
