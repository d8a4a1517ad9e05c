"""The write-ahead log's files: framing, torn tails, segments, replay and truncation."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from zps.shard.durability import Durability
from zps.store.wal import Record, Wal, encode_record, parse_records, segment_name


def rec(lsn: int, epoch: int = 1, *, prev: int | None = None, size: int = 8) -> Record:
    """A record from ``prev`` (default lsn - 1) to ``lsn`` with recognisable frames."""
    body = bytes([lsn % 251]) * size
    return Record(epoch, lsn - 1 if prev is None else prev, lsn, [b"head-%d" % lsn, body])


class Applier:
    """Stands for the shard: records what was replayed; its LSN is the last record's."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.seen: list[Record] = []
        self.fail_at = fail_at

    def __call__(self, r: Record) -> int:
        if r.lsn == self.fail_at:
            raise ValueError("does not apply")
        self.seen.append(Record(r.epoch, r.prev, r.lsn, [bytes(f) for f in r.frames]))
        return r.lsn


def write(
    folder: Path, records: list[Record], *, base: int = 0, segment_bytes: int = 1 << 20
) -> Wal:
    wal = Wal(folder, segment_bytes=segment_bytes)
    wal.reset(base)
    wal.append(records)
    wal.sync()
    return wal


def test_records_round_trip_with_their_frames(tmp_path: Path) -> None:
    records = [rec(i, size=i * 100) for i in range(1, 20)]
    write(tmp_path, records).close()
    back = list(Wal(tmp_path).records())
    assert [(r.epoch, r.prev, r.lsn) for r in back] == [(1, i - 1, i) for i in range(1, 20)]
    assert [[bytes(f) for f in r.frames] for r in back] == [list(r.frames) for r in records]


def test_a_record_must_advance_and_follow_the_log(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="advance"):
        encode_record(Record(1, 5, 5, [b"x"]))
    wal = write(tmp_path, [rec(1), rec(2)])
    with pytest.raises(Exception, match="does not follow LSN 2"):
        wal.append([rec(4, prev=3)])


def test_a_torn_tail_is_cut_and_only_the_torn_record_is_lost(tmp_path: Path) -> None:
    write(tmp_path, [rec(i) for i in range(1, 11)]).close()
    (seg,) = tmp_path.glob("wal-*.log")
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - 3)  # a crash in the middle of the last record
    wal = Wal(tmp_path)
    applied = Applier()
    result = wal.recover(0, 0, applied)
    assert [r.lsn for r in applied.seen] == list(range(1, 10))
    assert result.lsn == 9 and result.applied == 9 and result.cut is not None
    assert "runs past the end" in result.cut
    # The tail is gone and the log goes on after LSN 9.
    wal.append([rec(10, size=20), rec(11)])
    wal.close()
    again = Applier()
    assert Wal(tmp_path).recover(0, 0, again).cut is None
    assert [r.lsn for r in again.seen] == list(range(1, 12))
    assert again.seen[9].frames[1] == bytes([10]) * 20  # the new record 10, not the torn one


@pytest.mark.parametrize("keep", [0, 1, 5, 7])
def test_a_torn_header_is_cut(tmp_path: Path, keep: int) -> None:
    write(tmp_path, [rec(1), rec(2)]).close()
    (seg,) = tmp_path.glob("wal-*.log")
    with open(seg, "ab") as f:
        f.write(encode_record(rec(3))[0][:keep])  # part of the next length + CRC
    applied = Applier()
    result = Wal(tmp_path).recover(0, 0, applied)
    assert result.lsn == 2
    assert (result.cut is None) == (keep == 0)


def test_a_corrupt_record_ends_the_replay_and_later_segments_are_set_aside(
    tmp_path: Path,
) -> None:
    wal = write(tmp_path, [rec(i, size=100) for i in range(1, 31)], segment_bytes=1000)
    wal.close()
    segs = sorted(tmp_path.glob("wal-*.log"))
    assert len(segs) >= 3
    # Flip one byte in the middle of the second segment.
    data = bytearray(segs[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    segs[1].write_bytes(bytes(data))
    applied = Applier()
    result = Wal(tmp_path).recover(0, 0, applied)
    assert result.cut is not None and "CRC" in result.cut
    lsns = [r.lsn for r in applied.seen]
    assert lsns == list(range(1, lsns[-1] + 1)) and 1 < lsns[-1] < 30
    assert sorted(p.name for p in tmp_path.glob("*.broken")) == [
        p.name + ".broken" for p in segs[2:]
    ]


def test_replay_skips_what_the_checkpoint_holds(tmp_path: Path) -> None:
    write(tmp_path, [rec(i) for i in range(1, 11)]).close()
    applied = Applier()
    result = Wal(tmp_path).recover(6, 1, applied)
    assert [r.lsn for r in applied.seen] == [7, 8, 9, 10]
    assert (result.lsn, result.applied, result.cut) == (10, 4, None)


def test_replay_stops_at_a_gap_and_at_an_older_epoch(tmp_path: Path) -> None:
    # The log starts after the state: a gap; the log is set aside, a new one begins.
    write(tmp_path / "gap", [rec(i) for i in range(11, 15)], base=10).close()
    applied = Applier()
    wal = Wal(tmp_path / "gap")
    result = wal.recover(5, 1, applied)
    assert applied.seen == [] and result.lsn == 5 and result.cut and "gap" in result.cut
    assert [p.name for p in (tmp_path / "gap").glob("wal-*.log")] == [segment_name(5)]
    wal.append([rec(6)])  # appends go on after the state
    # A record of an older epoch than the state's is another history.
    write(tmp_path / "old", [rec(1, epoch=1), rec(2, epoch=2), rec(3, epoch=1)]).close()
    applied = Applier()
    result = Wal(tmp_path / "old").recover(0, 0, applied)
    assert [r.lsn for r in applied.seen] == [1, 2]
    assert result.epoch == 2 and result.cut and "epoch 1 after epoch 2" in result.cut


def test_a_record_that_does_not_apply_ends_the_replay(tmp_path: Path) -> None:
    write(tmp_path, [rec(i) for i in range(1, 6)]).close()
    applied = Applier(fail_at=4)
    result = Wal(tmp_path).recover(0, 0, applied)
    assert result.lsn == 3 and result.cut and "does not apply" in result.cut
    assert list(r.lsn for r in Wal(tmp_path).records()) == [1, 2, 3]


def test_segments_roll_by_size_and_a_checkpoint_frees_what_it_covers(tmp_path: Path) -> None:
    wal = write(tmp_path, [rec(i, size=200) for i in range(1, 41)], segment_bytes=1000)
    starts = [s for s, _ in wal.segments()]
    assert len(starts) > 3 and starts[0] == 0
    # A checkpoint at 20: every segment whose records all are <= 20 goes.
    gone = wal.truncate(20)
    left = [s for s, _ in wal.segments()]
    assert gone and left[0] <= 20 and all(s in starts for s in left)
    assert all(s > 20 for s in left[1:])
    applied = Applier()
    wal.close()
    assert Wal(tmp_path).recover(20, 1, applied).cut is None
    assert [r.lsn for r in applied.seen] == list(range(21, 41))


def test_a_roll_at_the_checkpoint_lets_the_whole_log_go(tmp_path: Path) -> None:
    wal = write(tmp_path, [rec(i) for i in range(1, 6)])
    wal.roll()  # the checkpoint is cut at LSN 5
    wal.append([rec(6), rec(7)])
    wal.sync()
    wal.truncate(5)
    assert [s for s, _ in wal.segments()] == [5]
    wal.roll()
    wal.truncate(7)
    assert [s for s, _ in wal.segments()] == [7]
    wal.close()
    # An empty newest segment continues the replay (nothing set aside).
    applied = Applier()
    result = Wal(tmp_path).recover(7, 1, applied)
    assert (result.lsn, result.cut, applied.seen) == (7, None, [])
    assert not list(tmp_path.glob("*.broken"))


def test_an_empty_segment_after_a_roll_is_kept(tmp_path: Path) -> None:
    wal = write(tmp_path, [rec(1), rec(2)])
    wal.roll()
    wal.close()
    applied = Applier()
    wal2 = Wal(tmp_path)
    assert wal2.recover(0, 0, applied).cut is None
    assert [s for s, _ in wal2.segments()] == [0, 2]
    wal2.append([rec(3)])
    wal2.close()
    assert [r.lsn for r in Wal(tmp_path).records()] == [1, 2, 3]


def test_reset_starts_an_empty_log_at_a_base(tmp_path: Path) -> None:
    wal = write(tmp_path, [rec(i) for i in range(1, 4)])
    wal.reset(100)
    assert [s for s, _ in wal.segments()] == [100] and wal.lsn == 100
    wal.append([rec(101, epoch=3)])
    wal.close()
    applied = Applier()
    assert Wal(tmp_path).recover(100, 3, applied).lsn == 101


def test_garbage_never_raises_and_never_yields_a_bad_record() -> None:
    good = b"".join(bytes(p) for r in [rec(1), rec(2, size=50)] for p in encode_record(r))
    rng = random.Random(7)
    for _ in range(2000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            op = rng.randint(0, 2)
            if op == 0 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op == 1:
                del data[rng.randrange(len(data) + 1) :]
            else:
                data[rng.randrange(len(data) + 1) : 0] = os.urandom(rng.randint(1, 16))
        parsed = parse_records(bytes(data))
        for r, _ in parsed.records:
            assert r.prev < r.lsn
            assert r.lsn in (1, 2) and [bytes(f) for f in r.frames] == list(
                rec(r.lsn, size=len(r.frames[1])).frames
            )


# -- the group-commit driver ----------------------------------------------------------


class SlowDisk:
    """Stands in for fdatasync: each call blocks (in the log's thread) until released."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(10)


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.001)


@pytest.mark.asyncio
async def test_fsync_mode_acknowledges_after_the_disk_and_groups_what_waited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = SlowDisk()
    monkeypatch.setattr("zps.store.wal.os.fdatasync", disk)
    d = Durability("fsync")
    d.start(tmp_path, 0, 0)
    writer = asyncio.create_task(d.run())
    released: list[int] = []
    d.log(1, 0, 1, [b"h1"])
    d.after(1, lambda: released.append(1))
    await asyncio.to_thread(disk.entered.wait, 5)  # the first batch is in fsync
    # The event loop keeps turning while the disk is slow; nothing is acknowledged.
    ticks = 0
    for lsn in range(2, 12):
        d.log(1, lsn - 1, lsn, [b"h%d" % lsn])
        d.after(lsn, lambda lsn=lsn: released.append(lsn))
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 10 and released == [] and d.acked_lsn(11) == 0
    calls = disk.calls
    disk.gate.set()
    await _until(lambda: released == list(range(1, 12)))
    # Ten records that arrived during one fsync shared the next one.
    assert disk.calls == calls + 1 and d.acked_lsn(11) == 11
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer
    assert [r.lsn for r in Wal(tmp_path).records()] == list(range(1, 12))


@pytest.mark.asyncio
async def test_a_roll_that_syncs_the_log_counts_as_its_sync(tmp_path: Path) -> None:
    # A checkpoint's roll ends the segment with a sync, leaving the batch's last sync
    # nothing to do: a replica waiting for a sync after what it applied must see it.
    d = Durability("fsync")
    d.start(tmp_path, 0, 0)
    d.log(1, 0, 1, [b"h"])
    d.roll()  # one batch: the new log, the record, the roll
    writer = asyncio.create_task(d.run())
    await _until(lambda: d.durable == 1)
    assert d.stats.syncs == 1
    d.log(1, 1, 2, [b"h"])
    await _until(lambda: d.durable == 2)
    assert d.stats.syncs == 2
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer
    assert [s for s, _ in Wal(tmp_path).segments()] == [0, 1]


@pytest.mark.asyncio
async def test_interval_mode_acknowledges_once_written_and_syncs_within_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[float] = []
    monkeypatch.setattr("zps.store.wal.os.fdatasync", lambda fd: synced.append(time.monotonic()))
    d = Durability("interval", interval=0.2)
    d.start(tmp_path, 0, 0)
    writer = asyncio.create_task(d.run())
    # The writer has started the log: its first segment is on disk (no sync counted).
    await _until(lambda: d.stats.syncs == 0 and bool(Wal(tmp_path).segments()))
    released: list[int] = []
    t0 = time.monotonic()
    d.log(1, 0, 1, [b"h"])
    d.after(1, lambda: released.append(1))
    await _until(lambda: released == [1])  # in the operating system: acknowledged
    assert Wal(tmp_path).segments() and [r.lsn for r in Wal(tmp_path).records()] == [1]
    await _until(lambda: bool(synced), timeout=2)
    assert synced[-1] - t0 < 0.2 + 0.15  # on disk within the interval (and a turn)
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer


def test_none_mode_logs_nothing_and_waits_for_nothing(tmp_path: Path) -> None:
    d = Durability("none")
    d.start(tmp_path, 0, 0)
    released: list[int] = []
    d.log(1, 0, 1, [b"h"])
    d.after(1, lambda: released.append(1))
    assert released == [1] and d.acked_lsn(5) == 5
    assert not list(tmp_path.glob("wal-*.log"))


# -- storage faults ---------------------------------------------------------------

#: Runs in a child process (a file-size limit there stands for a full disk: writes
#: past it fail with EFBIG, SIGXFSZ ignored): five records, then a sixth too large
#: for the limit, then the limit lifted and the sixth written again, as the writer
#: retries a batch.  Prints the segment's size before and after the failed write.
_FULL_DISK = """
import json, os, resource, signal, sys
from zps.store.wal import Record, Wal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
folder = sys.argv[1]
rec = lambda lsn, size: Record(1, lsn - 1, lsn, [b"head-%d" % lsn, bytes([lsn]) * size])
wal = Wal(folder)
wal.reset(0)
wal.append([rec(i, 100) for i in range(1, 6)])
wal.sync()
(seg,) = [p for _, p in wal.segments()]
before = os.path.getsize(seg)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (before + 700, hard))
try:
    wal.append([rec(6, 2000), rec(7, 50)])
    wal.sync()
    error = None
except OSError as e:
    error = e.errno
after = os.path.getsize(seg)
lsn_after = wal.lsn
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
wal.append([rec(i, 2000 if i == 6 else 50) for i in (6, 7) if i > wal.lsn])
wal.close()
print(json.dumps({"before": before, "after": after, "error": error, "lsn": lsn_after}))
"""


def test_a_write_that_fills_the_disk_leaves_no_partial_record_and_the_retry_replays(
    tmp_path: Path,
) -> None:
    import errno
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(root)},
        check=True,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["error"] == errno.EFBIG, got
    # The failed write left nothing behind: the segment ends after record 5.
    assert got["after"] == got["before"] and got["lsn"] == 5, got
    applied = Applier()
    result = Wal(tmp_path).recover(0, 0, applied)
    assert result.cut is None and not list(tmp_path.glob("*.cut-*"))
    assert [r.lsn for r in applied.seen] == [1, 2, 3, 4, 5, 6, 7]
    assert applied.seen[5].frames[1] == bytes([6]) * 2000


class FullDisk:
    """os.writev that writes part of what it is given, then fails with ENOSPC, while
    ``full`` is set."""

    def __init__(self) -> None:
        self.full = threading.Event()
        self.failed = 0
        self.real = os.writev

    def __call__(self, fd: int, buffers: list[memoryview]) -> int:
        if not self.full.is_set():
            return self.real(fd, buffers)
        self.failed += 1
        first = bytes(buffers[0])
        if len(first) > 1 and self.failed % 2:
            return self.real(fd, [first[: len(first) // 2]])  # a short write ...
        raise OSError(28, "No space left on device")  # ... then the error


@pytest.mark.asyncio
async def test_a_batch_retried_after_a_full_disk_is_written_once_and_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = FullDisk()
    monkeypatch.setattr("zps.store.wal.os.writev", disk)
    monkeypatch.setattr("zps.shard.durability.RETRY_S", 0.01)
    d = Durability("fsync")
    d.start(tmp_path, 0, 0)
    writer = asyncio.create_task(d.run())
    released: list[int] = []
    d.log(1, 0, 1, [b"h1", b"x" * 100])
    d.after(1, lambda: released.append(1))
    await _until(lambda: released == [1])
    disk.full.set()
    for lsn in range(2, 6):
        d.log(1, lsn - 1, lsn, [b"h%d" % lsn, b"y" * 300])
        d.after(lsn, lambda lsn=lsn: released.append(lsn))
    await _until(lambda: disk.failed >= 4)
    assert released == [1] and d.durable == 1 and d.stats.errors >= 2
    disk.full.clear()
    await _until(lambda: released == [1, 2, 3, 4, 5])
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer
    applied = Applier()
    assert Wal(tmp_path).recover(0, 0, applied).cut is None
    assert [r.lsn for r in applied.seen] == [1, 2, 3, 4, 5]


def test_a_failed_sync_loses_the_log_and_is_never_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zps.store.wal import WalLost

    wal = write(tmp_path, [rec(1), rec(2)])
    calls: list[int] = []

    def eio(fd: int) -> None:
        calls.append(fd)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("zps.store.wal.os.fdatasync", eio)
    wal.append([rec(3)])
    with pytest.raises(WalLost, match="fdatasync failed"):
        wal.sync()
    assert wal.lost is not None
    # Nothing more is written or synced: what the file reads back is not the disk's.
    with pytest.raises(WalLost):
        wal.append([rec(4, prev=3)])
    with pytest.raises(WalLost):
        wal.sync()
    wal.close()
    assert len(calls) == 1


@pytest.mark.asyncio
async def test_a_failed_sync_releases_nothing_and_tells_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail = threading.Event()
    real = os.fdatasync
    syncs: list[int] = []

    def fdatasync(fd: int) -> None:
        syncs.append(fd)
        if fail.is_set():
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr("zps.store.wal.os.fdatasync", fdatasync)
    monkeypatch.setattr("zps.shard.durability.RETRY_S", 0.01)
    d = Durability("fsync")
    lost: list[str] = []
    d.on_lost = lost.append
    d.start(tmp_path, 0, 0)
    writer = asyncio.create_task(d.run())
    released: list[int] = []
    d.log(1, 0, 1, [b"h1"])
    d.after(1, lambda: released.append(1))
    await _until(lambda: released == [1])
    fail.set()
    d.log(1, 1, 2, [b"h2"])
    d.after(2, lambda: released.append(2))
    await _until(lambda: bool(lost))
    assert "fdatasync failed" in lost[0] and d.lost == lost[0]
    n = len(syncs)
    d.log(1, 2, 3, [b"h3"])  # ignored: the log is lost
    d.after(3, lambda: released.append(3))
    await asyncio.wait_for(writer, 5)  # the writer stopped: no retry
    assert released == [1] and d.durable == 1 and d.acked_lsn(3) == 1 and len(syncs) == n


def test_a_cut_tail_is_kept_aside_with_what_it_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, [rec(i) for i in range(1, 7)]).close()
    (seg,) = tmp_path.glob("wal-*.log")
    whole = seg.read_bytes()
    result = Wal(tmp_path).recover(0, 0, Applier(fail_at=4))
    assert result.lsn == 3 and result.set_aside == 3  # records 4, 5 and 6
    assert result.reached == 6 and not result.complete
    (kept,) = tmp_path.glob("wal-*.log.cut-*")
    offset = int(kept.name.rsplit("-", 1)[1])
    assert seg.read_bytes() == whole[:offset] and kept.read_bytes() == whole[offset:]
    assert "3 whole records (LSN 4..6)" in caplog.text
    # A torn last record alone: nothing whole is set aside, but what the first
    # recovery set aside is remembered (REACHED): the copy is still short of LSN 6.
    with open(seg, "ab") as f:
        f.write(b"".join(bytes(p) for p in encode_record(rec(4)))[:-2])
    torn = Wal(tmp_path).recover(0, 0, Applier())
    assert torn.set_aside == 0 and torn.reached == 6 and not torn.complete
    assert len(list(tmp_path.glob("wal-*.log.cut-*"))) == 2


def test_a_copy_short_of_what_it_set_aside_stays_incomplete_until_it_passes_it(
    tmp_path: Path,
) -> None:
    """Restarted again before it caught up, a copy whose recovery set records aside is
    still incomplete (the segment no longer shows them); once its state passes them (its
    partition's data from a complete copy), it is complete and the record goes."""
    write(tmp_path, [rec(i) for i in range(1, 7)]).close()
    first = Wal(tmp_path).recover(0, 0, Applier(fail_at=4))
    assert (first.lsn, first.reached, first.complete) == (3, 6, False)
    assert (tmp_path / "REACHED").read_text() == "6\n"
    again = Wal(tmp_path).recover(0, 0, Applier())
    assert (again.lsn, again.reached, again.cut, again.complete) == (3, 6, None, False)
    wal = Wal(tmp_path)
    wal.recover(0, 0, Applier())
    wal.append([rec(i) for i in range(4, 8)])  # caught up past LSN 6
    wal.close()
    caught_up = Wal(tmp_path).recover(0, 0, Applier())
    assert caught_up.lsn == 7 and caught_up.complete
    assert not (tmp_path / "REACHED").exists()
    assert Wal(tmp_path).recover(0, 0, Applier()).complete
    (tmp_path / "REACHED").write_text("garbage")  # damaged itself: one past, at least
    damaged = Wal(tmp_path).recover(0, 0, Applier())
    assert (damaged.lsn, damaged.reached, damaged.complete) == (7, 8, False)


@pytest.mark.parametrize("where", ["body", "crc"])
def test_a_last_record_damaged_at_rest_leaves_the_copy_incomplete(
    tmp_path: Path, where: str
) -> None:
    """A whole last record that fails its CRC was written whole (a torn append leaves a
    short file): it may have been synced and acknowledged, so the copy says it may lack
    it, unlike a torn last record."""
    write(tmp_path, [rec(i, size=40) for i in range(1, 6)]).close()
    (seg,) = tmp_path.glob("wal-*.log")
    data = bytearray(seg.read_bytes())
    last = len(b"".join(bytes(p) for p in encode_record(rec(5, size=40))))
    data[len(data) - (last // 2 if where == "body" else last - 5)] ^= 0x10
    seg.write_bytes(bytes(data))
    result = Wal(tmp_path).recover(0, 0, Applier())
    assert result.lsn == 4 and result.cut is not None and "CRC" in result.cut
    assert result.set_aside == 1 and result.reached == 5 and not result.complete
    assert len(list(tmp_path.glob("wal-*.log.cut-*"))) == 1  # kept for the operator


def test_a_length_damaged_at_rest_to_run_past_the_end_leaves_the_copy_incomplete(
    tmp_path: Path,
) -> None:
    """A flipped bit makes a record's length run past the end of the file, as a torn
    append's would; but whole records follow it, which a torn append never leaves: the
    copy says it may lack them (the simulator's seed 901200: a copy restored three
    records short was granted its partition after a whole-cluster power loss)."""
    write(tmp_path, [rec(i, size=40) for i in range(1, 6)]).close()
    (seg,) = tmp_path.glob("wal-*.log")
    data = bytearray(seg.read_bytes())
    each = len(b"".join(bytes(p) for p in encode_record(rec(1, size=40))))
    data[2 * each + 2] ^= 0x40  # record 3's length: 2**22 more bytes than the file has
    seg.write_bytes(bytes(data))
    result = Wal(tmp_path).recover(0, 0, Applier())
    assert result.lsn == 2 and result.cut is not None and "runs past the end" in result.cut
    assert result.reached == 5 and not result.complete


def test_a_torn_last_record_leaves_the_copy_complete(tmp_path: Path) -> None:
    """The same length past the end with nothing after it is a torn append: the record
    was never acknowledged, the copy is complete."""
    write(tmp_path, [rec(i, size=40) for i in range(1, 6)]).close()
    (seg,) = tmp_path.glob("wal-*.log")
    os.truncate(seg, seg.stat().st_size - 20)
    result = Wal(tmp_path).recover(0, 0, Applier())
    assert result.lsn == 4 and result.complete


def test_a_log_that_ends_below_the_state_goes_on_in_a_new_segment(tmp_path: Path) -> None:
    # A checkpoint at LSN 8 is newer than the log (which a lost log leaves behind).
    write(tmp_path, [rec(i) for i in range(1, 6)]).close()
    wal = Wal(tmp_path)
    result = wal.recover(8, 1, Applier())
    assert (result.lsn, result.applied, result.cut, result.set_aside) == (8, 0, None, 0)
    assert result.complete
    assert [s for s, _ in wal.segments()] == [0, 8]  # the old one kept: it holds 1..5
    wal.append([rec(9)])
    wal.close()
    assert not list(tmp_path.glob("*.broken"))
    applied = Applier()
    assert Wal(tmp_path).recover(8, 1, applied).cut is None
    assert [r.lsn for r in applied.seen] == [9]


def test_a_torn_segment_before_the_one_the_state_continues_into_stops_nothing(
    tmp_path: Path,
) -> None:
    # A log lost before its last sync left LSN 1..5 in the page cache and a checkpoint at
    # 8 holds them; the restart went on in a segment at 8 and synced 9..12 there.  A
    # power loss then tears the old segment's unsynced tail: the replay from 8 does not
    # read it, and nothing synced after it is set aside.
    write(tmp_path, [rec(i, size=64) for i in range(1, 6)]).close()
    wal = Wal(tmp_path)
    wal.recover(8, 1, Applier())
    wal.append([rec(i) for i in range(9, 13)])
    wal.close()
    old = tmp_path / segment_name(0)
    os.truncate(old, old.stat().st_size - 30)
    applied = Applier()
    result = Wal(tmp_path).recover(8, 1, applied)
    assert [r.lsn for r in applied.seen] == [9, 10, 11, 12]
    assert (result.lsn, result.cut, result.set_aside) == (12, None, 0)
    assert not list(tmp_path.glob("*.broken")) and not list(tmp_path.glob("*.cut-*"))


def test_a_segment_that_cannot_be_created_leaves_the_active_one_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    # Five records of 250 bytes fill the segment: the next append begins another.
    wal = write(tmp_path, [rec(i, size=200) for i in range(1, 6)], segment_bytes=1250)
    assert len(wal.segments()) == 1
    real = builtins.open

    def full(path: object, mode: str = "r", *args: object, **kw: object) -> object:
        if mode == "wb":
            raise OSError(28, "No space left on device")
        return real(path, mode, *args, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr("zps.store.wal.open", full, raising=False)
    segments = wal.segments()
    with pytest.raises(OSError, match="No space"):
        wal.append([rec(6, size=200)])  # the active segment is full: a new one is due
    assert wal.segments() == segments and wal.lsn == 5 and wal.lost is None
    monkeypatch.undo()
    wal.append([rec(6, size=200), rec(7)])  # the retry
    wal.close()
    applied = Applier()
    assert Wal(tmp_path).recover(0, 0, applied).cut is None
    assert [r.lsn for r in applied.seen] == [1, 2, 3, 4, 5, 6, 7]


def test_a_state_older_than_where_the_log_begins_is_not_complete(tmp_path: Path) -> None:
    # The log restarted at base 10 (a replica's snapshot) and holds nothing yet: a state
    # restored at LSN 5 (an older checkpoint) lacks 6..10, which the log had reached.
    write(tmp_path, [], base=10).close()
    result = Wal(tmp_path).recover(5, 1, Applier())
    assert result.lsn == 5 and result.set_aside == 0
    assert result.reached == 10 and not result.complete
    assert [p.name for p in tmp_path.glob("*.broken")] == [segment_name(10) + ".broken"]


@pytest.mark.asyncio
async def test_a_failed_sync_on_the_way_out_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = Durability("interval", interval=60.0)
    lost: list[str] = []
    d.on_lost = lost.append
    d.start(tmp_path, 0, 0)
    writer = asyncio.create_task(d.run())
    released: list[int] = []
    d.log(1, 0, 1, [b"h1"])
    d.after(1, lambda: released.append(1))
    await _until(lambda: released == [1])  # written, not yet synced

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("zps.store.wal.os.fdatasync", eio)
    writer.cancel()  # the shard stops: the log is synced and closed
    with contextlib.suppress(asyncio.CancelledError):
        await writer
    assert lost and "fdatasync failed" in lost[0] and d.lost == lost[0]


def test_a_cut_that_cannot_be_kept_aside_destroys_no_whole_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    from zps.store.wal import WalError

    real = builtins.open

    def full(path: object, mode: str = "r", *args: object, **kw: object) -> object:
        if ".cut-" in str(path):
            raise OSError(28, "No space left on device")
        return real(path, mode, *args, **kw)  # type: ignore[call-overload]

    write(tmp_path, [rec(i) for i in range(1, 7)]).close()
    (seg,) = tmp_path.glob("wal-*.log")
    whole = seg.read_bytes()
    monkeypatch.setattr("zps.store.wal.open", full, raising=False)
    # Records 4..6 would be cut (4 does not apply): refused, the segment untouched.
    with pytest.raises(WalError, match=r"3 whole records .* make room"):
        Wal(tmp_path).recover(0, 0, Applier(fail_at=4))
    assert seg.read_bytes() == whole and not list(tmp_path.glob("*.cut-*"))
    # A torn last record only: nothing whole is lost, so it is cut even so.
    with open(seg, "ab") as f:
        f.write(b"".join(bytes(p) for p in encode_record(rec(7)))[:-2])
    result = Wal(tmp_path).recover(0, 0, Applier())
    assert result.lsn == 6 and result.complete and seg.read_bytes() == whole


def test_records_after_a_snapshot_of_another_history_are_set_aside(tmp_path: Path) -> None:
    """A replica keeps a snapshot at LSN 6 as its checkpoint while its log holds LSN 1-10
    of the history that snapshot replaces: restarted between the checkpoint and its new
    log, it replayed 7-10 after the checkpoint (a mix of two histories).  cut_after(6)
    first sets them aside, and replay after a state at 6 applies nothing."""
    write(tmp_path, [rec(i) for i in range(1, 11)], segment_bytes=120).close()
    before = Applier()
    Wal(tmp_path).recover(6, 1, before)
    assert [r.lsn for r in before.seen] == [7, 8, 9, 10]  # what the restart did before
    write(tmp_path, [rec(i) for i in range(1, 11)], segment_bytes=120).close()
    wal = Wal(tmp_path)
    assert wal.cut_after(6) == 4
    wal.close()
    after = Applier()
    recovery = Wal(tmp_path).recover(6, 1, after)
    assert after.seen == [] and recovery.lsn == 6
    assert any(p.name.endswith((".broken",)) or ".cut-" in p.name for p in tmp_path.iterdir())
    # Records at or below the checkpoint stay; a log ending below it loses nothing.
    assert [r.lsn for r in Wal(tmp_path).records()] == [1, 2, 3, 4, 5, 6]
    short = tmp_path / "short"
    write(short, [rec(i) for i in range(1, 4)]).close()
    wal = Wal(short)
    assert wal.cut_after(6) == 0
    wal.close()
    assert [r.lsn for r in Wal(short).records()] == [1, 2, 3]


def test_a_cut_reads_only_the_segments_from_the_one_holding_its_lsn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A joining copy's checkpoint waits for the cut: a long old log is not read whole.
    write(tmp_path, [rec(i, size=100) for i in range(1, 41)], segment_bytes=1000).close()
    segments = Wal(tmp_path).segments()
    at = next(s for s, _ in segments if s > 20)
    holding = max(i for i, (s, _) in enumerate(segments) if s <= at + 1)
    read: list[str] = []
    real = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        read.append(self.name)
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    wal = Wal(tmp_path)
    set_aside = wal.cut_after(at + 1)
    wal.close()
    monkeypatch.undo()
    assert read and set(read) <= {p.name for _, p in segments[holding:]}
    assert set_aside == 40 - (at + 1)
    assert [r.lsn for r in Wal(tmp_path).records()] == list(range(1, at + 2))


@pytest.mark.asyncio
async def test_durability_sets_a_replaced_history_aside_in_the_writers_turn(
    tmp_path: Path,
) -> None:
    d = Durability("fsync")
    d.start(tmp_path, 0, 0)
    writer = asyncio.create_task(d.run())
    try:
        for lsn in range(1, 9):
            d.log(1, lsn - 1, lsn, [b"h%d" % lsn])
        await _until(lambda: d.acked_lsn(8) == 8)
        assert await asyncio.wait_for(d.cut_after(tmp_path, 5), 10) is True
        other = tmp_path / "other"  # a partition whose log is not the open one
        write(other, [rec(i) for i in range(1, 5)]).close()
        assert await asyncio.wait_for(d.cut_after(other, 2), 10) is True
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
    assert [r.lsn for r in Wal(tmp_path).records()] == [1, 2, 3, 4, 5]
    assert [r.lsn for r in Wal(other).records()] == [1, 2]
    assert await Durability("none").cut_after(tmp_path, 3) is True


@pytest.mark.asyncio
async def test_a_cut_that_cannot_set_records_aside_loses_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records after the cut cannot be kept aside (EIO as their copy is synced: seed
    351817 of the simulator's long run): the log is lost, as after a failed sync (the
    shard leaves its role, exits and starts again from its files), the checkpoint is not
    committed, and nothing is cut.  Before, the WalError ended the writer task, and the
    shard's process with it, in a traceback."""
    d = Durability("fsync")
    lost: list[str] = []
    d.on_lost = lost.append
    d.start(tmp_path, 0, 0)
    writer = asyncio.create_task(d.run())
    for lsn in range(1, 9):
        d.log(1, lsn - 1, lsn, [b"h%d" % lsn])
    await _until(lambda: d.acked_lsn(8) == 8)
    real_fsync = os.fsync

    def failing(fd: int) -> None:
        if ".cut-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error (injected)")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    assert await asyncio.wait_for(d.cut_after(tmp_path, 5), 10) is False
    await asyncio.wait_for(writer, 10)  # the writer ends: no exception
    assert d.lost is not None and "cannot be kept aside" in d.lost
    assert lost == [d.lost]
    monkeypatch.undo()
    assert [r.lsn for r in Wal(tmp_path).records()] == list(range(1, 9))


@pytest.mark.asyncio
async def test_a_log_from_nothing_removes_an_earlier_historys_checkpoints(tmp_path: Path) -> None:
    # A partition removed by a scale-down and created again: the shard that held the old
    # one's copy starts the new one's log from LSN 0 in the same folder.  A restart took
    # the old checkpoint for the new history's base (acknowledged writes lost).
    old = tmp_path / "ckpt-00000001-0000000000000040.zps"
    old.write_bytes(b"another history")
    d = Durability("fsync")
    d.start(tmp_path, 1, 0)
    writer = asyncio.create_task(d.run())
    d.log(1, 0, 1, [b"h"])
    await _until(lambda: d.durable == 1)
    assert not old.exists()
    # A log that starts after a checkpoint's LSN keeps that checkpoint: it is its base.
    base = tmp_path / "ckpt-00000002-0000000000000001.zps"
    base.write_bytes(b"the base")
    d.start(tmp_path, 1, 1)
    d.log(2, 1, 2, [b"h"])
    await _until(lambda: d.durable == 2)
    assert base.exists()
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer
