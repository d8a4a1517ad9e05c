"""A partition's write-ahead log: framed records in segment files.

Each record is one message that changed the partition, as the primary streams it
to its replicas: the epoch it was applied in, the LSN before and after it, and
its frames (the client's msgpack header, which carries the dedup key
``(client_id, seq)``, then the payload frames)::

    u32 body length | u32 crc32(body) | body
    body = u64 epoch | u64 prev LSN | u64 LSN | u32 frame count | u32 size * count | frames

Segments are files ``wal-PREV.log`` in the partition's folder, named by the LSN
the first record follows (its *start*); records follow each other without a gap
(each one's ``prev`` is the LSN of the one before).  A new segment begins when the
active one passes ``segment_bytes``, or when a checkpoint asks (:meth:`Wal.truncate`),
so that a checkpoint at LSN L lets every segment wholly at or below L go.

Reading stops at the first record that is short, too long for the file or fails
its CRC: a crash mid-write leaves a torn tail, which :meth:`Wal.recover` cuts off
before appending again.  Records that do not continue the recovered state (a gap,
or an older epoch than the state's: another history) end the replay the same way.
Nothing is thrown away silently: cut whole segments are renamed ``*.broken`` and
logged.

This module does file I/O and nothing else: no sockets, no event loop, no clock.
Durability (when to fsync, who waits for it) is the caller's.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("zps.wal")

Buffer = bytes | bytearray | memoryview

_FRAME = struct.Struct("<II")  # body length, crc32 of the body
_BODY = struct.Struct("<QQQI")  # epoch, prev LSN, LSN, frame count
#: The largest record read back (a message is at most 1 GiB by default).
MAX_RECORD_BYTES = (4 << 30) - 1
_SEGMENT = re.compile(r"wal-(\d{16})\.log")


class WalError(Exception):
    """A log that cannot be written or recovered."""


@dataclass(frozen=True)
class Record:
    epoch: int
    prev: int
    lsn: int
    frames: Sequence[Buffer]


def encode_record(rec: Record) -> list[Buffer]:
    """The record as byte strings to write in order (the frames are not copied)."""
    if not 0 <= rec.prev < rec.lsn:
        raise ValueError(f"a record goes from LSN {rec.prev} to {rec.lsn}: it must advance")
    sizes = [memoryview(f).nbytes for f in rec.frames]
    head = _BODY.pack(rec.epoch, rec.prev, rec.lsn, len(sizes)) + struct.pack(
        f"<{len(sizes)}I", *sizes
    )
    length = len(head) + sum(sizes)
    if length > MAX_RECORD_BYTES:
        raise ValueError(f"a record of {length} bytes is larger than {MAX_RECORD_BYTES}")
    crc = zlib.crc32(head)
    for f in rec.frames:
        crc = zlib.crc32(f, crc)
    return [_FRAME.pack(length, crc), head, *rec.frames]


@dataclass(frozen=True)
class Parsed:
    """The records read from the start of a buffer, and where reading stopped."""

    records: list[tuple[Record, int]]  # (record, offset just past it)
    end: int  # offset past the last good record
    error: str | None  # why reading stopped before the end of the buffer, if it did


def parse_records(data: Buffer) -> Parsed:
    """Every whole record from the start of ``data``; stops at the first bad one."""
    view = memoryview(data).cast("B")
    out: list[tuple[Record, int]] = []
    pos, n = 0, len(view)
    error = None
    while pos < n:
        if n - pos < _FRAME.size:
            error = f"{n - pos} bytes of a torn record header"
            break
        length, crc = _FRAME.unpack_from(view, pos)
        start = pos + _FRAME.size
        if length < _BODY.size or start + length > n:
            error = f"a record of {length} bytes at offset {pos} runs past the end ({n})"
            break
        body = view[start : start + length]
        if zlib.crc32(body) != crc:
            error = f"CRC mismatch in the record at offset {pos}"
            break
        epoch, prev, lsn, count = _BODY.unpack_from(body)
        sizes_end = _BODY.size + 4 * count
        if sizes_end > length:
            error = f"the record at offset {pos} names {count} frames it cannot hold"
            break
        sizes = struct.unpack_from(f"<{count}I", body, _BODY.size)
        if sizes_end + sum(sizes) != length or not prev < lsn:
            error = f"the record at offset {pos} is inconsistent"
            break
        frames: list[Buffer] = []
        at = sizes_end
        for size in sizes:
            frames.append(body[at : at + size])
            at += size
        pos = start + length
        out.append((Record(epoch, prev, lsn, frames), pos))
    return Parsed(out, pos, error)


@dataclass(frozen=True)
class Recovery:
    """What :meth:`Wal.recover` replayed."""

    lsn: int  # the state's LSN after the replay
    epoch: int  # the epoch of the last record replayed (or the state's)
    applied: int  # records replayed
    cut: str | None  # why the log was cut short, if it was (torn tail, gap, bad record)


def segment_name(start: int) -> str:
    return f"wal-{start:016d}.log"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Wal:
    """The log of one partition, in ``folder``.  Not thread-safe: one writer."""

    def __init__(self, folder: str | os.PathLike[str], *, segment_bytes: int = 64 << 20) -> None:
        self.folder = Path(folder)
        self.segment_bytes = segment_bytes
        #: The LSN of the last record written (or the base of an empty log).
        self.lsn = 0
        self._file: BinaryIO | None = None
        self._start = 0  # start of the active segment
        self._size = 0  # bytes in the active segment
        self._dirty = False  # written since the last sync

    # -- reading ----------------------------------------------------------------

    def segments(self) -> list[tuple[int, Path]]:
        """(start, path) of every segment, oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            m = _SEGMENT.fullmatch(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def records(self) -> Iterator[Record]:
        """Every readable record, in order (reading stops at the first bad one)."""
        for _, path in self.segments():
            parsed = parse_records(path.read_bytes())
            for rec, _ in parsed.records:
                yield rec
            if parsed.error:
                return

    def recover(self, lsn: int, epoch: int, apply: Callable[[Record], int]) -> Recovery:
        """Replay the records that continue a state at ``lsn`` and ``epoch``, then open
        the log for appending after the last one.

        ``apply`` runs one record and returns the state's new LSN (which must be the
        record's).  Records at or below ``lsn`` are skipped (a checkpoint holds them).
        Replay stops at a gap, a record of an older epoch than the state's, a record
        that does not apply, or a torn or corrupt record; the log is cut there (a
        partial segment truncated, later segments renamed ``*.broken``).
        """
        self.close()
        position: tuple[Path, int] | None = None
        applied, cut = 0, None
        segments = self.segments()
        stopped_in: int | None = None  # index of the segment replay stopped in
        for i, (start, path) in enumerate(segments):
            if start == lsn:  # the state continues into this segment
                position = (path, 0)
            parsed = parse_records(path.read_bytes())
            for rec, end in parsed.records:
                if rec.lsn <= lsn:
                    if rec.lsn == lsn:
                        position = (path, end)
                    continue
                if rec.prev != lsn:
                    cut = f"a gap: LSN {lsn}, then a record from {rec.prev} to {rec.lsn}"
                elif rec.epoch < epoch:
                    cut = f"a record of epoch {rec.epoch} after epoch {epoch}"
                else:
                    try:
                        got = apply(rec)
                    except Exception as e:  # a record that does not apply ends the replay
                        got, cut = -1, f"LSN {rec.lsn} does not apply: {e}"
                    if got != rec.lsn and cut is None:
                        cut = f"LSN {rec.lsn} left the state at LSN {got}"
                if cut is not None:
                    break
                lsn, epoch = rec.lsn, rec.epoch
                applied += 1
                position = (path, end)
            if cut is None and parsed.error is not None:
                cut = f"{path.name}: {parsed.error}"
            if cut is not None:
                stopped_in = i
                break
        self._cut(segments, position, stopped_in, lsn)
        return Recovery(lsn, epoch, applied, cut)

    def _cut(
        self,
        segments: list[tuple[int, Path]],
        position: tuple[Path, int] | None,
        stopped_in: int | None,
        lsn: int,
    ) -> None:
        """Open for appending at ``position``; set aside whatever follows it."""
        if position is None:
            for _, path in segments:
                self._set_aside(path)
            self.reset(lsn)
            return
        path, offset = position
        keep = [p for _, p in segments].index(path)
        for _, later in segments[keep + 1 :]:
            self._set_aside(later)
        size = path.stat().st_size
        if size > offset:
            if stopped_in is not None:
                log.error("write-ahead log %s: cut %d bytes after LSN %d", path, size - offset, lsn)
            with open(path, "r+b") as f:
                f.truncate(offset)
                f.flush()
                os.fsync(f.fileno())
        self._open(segments[keep][0], path, lsn)

    def _set_aside(self, path: Path) -> None:
        broken = path.with_name(path.name + ".broken")
        log.error("write-ahead log: %s does not continue the replay; kept as %s", path, broken)
        os.replace(path, broken)

    # -- writing ----------------------------------------------------------------

    def _open(self, start: int, path: Path, lsn: int) -> None:
        self._file = open(path, "ab")  # noqa: SIM115 (kept open while the segment is active)
        self._start, self._size, self.lsn = start, self._file.tell(), lsn

    def reset(self, base: int) -> None:
        """Start an empty log after LSN ``base`` (a checkpoint holds the state at it):
        every segment goes.  Durable when it returns."""
        self.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        for _, path in self.segments():
            path.unlink()
        self._new_segment(base)

    def _new_segment(self, start: int) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
        path = self.folder / segment_name(start)
        with open(path, "wb"):
            pass
        _fsync_dir(self.folder)  # the new name must survive a crash as the records do
        self._open(start, path, start)

    def append(self, records: Sequence[Record]) -> int:
        """Write ``records`` (in LSN order, continuing the log); returns bytes written.
        Not durable until :meth:`sync`."""
        if self._file is None:
            raise WalError(f"write-ahead log in {self.folder} is not open")
        written = 0
        for rec in records:
            if rec.prev != self.lsn:
                raise WalError(
                    f"write-ahead log in {self.folder}: record {rec.prev}..{rec.lsn} "
                    f"does not follow LSN {self.lsn}"
                )
            if self._size >= self.segment_bytes:
                self._new_segment(self.lsn)
            assert self._file is not None
            for part in encode_record(rec):
                self._file.write(part)
                n = memoryview(part).nbytes
                self._size += n
                written += n
            self.lsn = rec.lsn
        self._dirty = self._dirty or bool(records)
        return written

    @property
    def dirty(self) -> bool:
        return self._dirty

    def sync(self) -> None:
        """Everything appended so far is on disk when this returns."""
        if self._file is not None:
            self._file.flush()
            if self._dirty:
                os.fdatasync(self._file.fileno())
        self._dirty = False

    def flush(self) -> None:
        """Hand what was appended to the operating system (it survives a crash of this
        process, not of the machine)."""
        if self._file is not None:
            self._file.flush()

    def roll(self) -> None:
        """Begin a new segment after the last record (when the active one has any): a
        checkpoint of the state at :attr:`lsn` then frees every older segment."""
        if self._file is not None and self._size > 0:
            self._new_segment(self.lsn)

    def truncate(self, checkpoint_lsn: int) -> list[Path]:
        """A checkpoint holds the state at ``checkpoint_lsn``: delete the segments whose
        records are all at or below it.  Returns the deleted paths."""
        segments = self.segments()
        gone = []
        # A segment's records end where the next segment starts.
        for (_, path), (next_start, _) in itertools.pairwise(segments):
            if next_start <= checkpoint_lsn:
                path.unlink()
                gone.append(path)
        if gone:
            _fsync_dir(self.folder)
        return gone

    def close(self) -> None:
        if self._file is not None:
            try:
                self.sync()
            finally:
                self._file.close()
                self._file = None
