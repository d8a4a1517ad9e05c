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
Nothing is thrown away silently: the cut tail of a segment is copied to
``wal-PREV.log.cut-OFFSET`` before the segment is truncated, whole later segments
are renamed ``*.broken``, and both are logged with what they hold.

A write that fails (a full disk: ENOSPC, EFBIG) leaves no partial record: the
segment is truncated back to where the failed write began before the error is
raised, so the caller may write the same records again.  A failed ``fdatasync`` (or a partial
record that cannot be removed) is never retried: the kernel may have dropped the
pages it could not write, so what the file reads back is no longer what is on
disk.  The log is then *lost* (:class:`WalLost`): it refuses every later write.

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

from zps.ops import durable

log = logging.getLogger("zps.wal")

Buffer = bytes | bytearray | memoryview

_FRAME = struct.Struct("<II")  # body length, crc32 of the body
_BODY = struct.Struct("<QQQI")  # epoch, prev LSN, LSN, frame count
#: The largest record read back (a message is at most 1 GiB by default).
MAX_RECORD_BYTES = (4 << 30) - 1
_SEGMENT = re.compile(r"wal-(\d{16})\.log")


class WalError(Exception):
    """A log that cannot be written or recovered."""


class WalLost(WalError):
    """The log no longer holds what was written to it (a failed sync, or a partial
    record that could not be removed): nothing written to it may be acknowledged."""


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
    #: Whole records after the replayed LSN that the cut set aside (in a cut tail or a
    #: ``*.broken`` segment).  A torn last record alone sets aside none.
    set_aside: int = 0
    #: The highest LSN the log is known to have reached: past :attr:`lsn` when what was
    #: set aside holds a record after it or a segment that starts after it.
    reached: int = 0

    @property
    def complete(self) -> bool:
        """Whether the state holds everything the log is known to have reached (else
        it may lack writes that were acknowledged)."""
        return self.reached <= self.lsn


#: The file in a log's folder that records, while the state is short of it, the highest
#: LSN the log is known to have reached (:meth:`Wal._remember_reached`).
REACHED = "REACHED"


def segment_name(start: int) -> str:
    return f"wal-{start:016d}.log"


#: Buffers per writev call (Linux's IOV_MAX is 1024).
_IOV_MAX = 1024


def _write_all(fd: int, parts: Sequence[Buffer]) -> None:
    """Write every byte of ``parts`` to ``fd``, in order (short writes continued)."""
    views = [memoryview(p).cast("B") for p in parts]
    i = 0
    while i < len(views):
        chunk = views[i : i + _IOV_MAX]
        n = os.writev(fd, chunk)
        for v in chunk:
            if n >= len(v):
                n -= len(v)
                i += 1
            else:
                views[i] = v[n:]
                break


def whole_records(data: Buffer, above: int = -1) -> tuple[int, int | None, int | None]:
    """(count, first LSN, last LSN) of the whole records after LSN ``above`` in
    ``data``, a cut tail or a set-aside segment: read from its start, and past one
    bad record whose length field still frames it (a flipped bit in its body).  That
    record counts too, as one after ``above`` (its own LSN is not to be trusted): its
    header and every byte its length names are in the file, which a torn append never
    leaves (the file grows only with the bytes written), so it was written whole and
    damaged since, and may have been synced and acknowledged."""
    view = memoryview(data).cast("B")
    parsed = parse_records(view)
    found = [r.lsn for r, _ in parsed.records]
    if parsed.error is not None and len(view) - parsed.end >= _FRAME.size:
        length, _ = _FRAME.unpack_from(view, parsed.end)
        after = parsed.end + _FRAME.size + length
        if length >= _BODY.size and after <= len(view):
            found.append(max([above, *found]) + 1)  # the damaged record, at least
            found += [r.lsn for r, _ in parse_records(view[after:]).records]
        else:
            later = _records_past_a_bad_length(view, parsed.end)
            if later:
                found.append(max([above, *found]) + 1)  # the damaged record, at least
                found += later
    found = [lsn for lsn in found if lsn > above]
    if not found:
        return 0, None, None
    return len(found), min(found), max(found)


def _records_past_a_bad_length(view: memoryview, at: int) -> list[int]:
    """The LSNs of whole records after the record at ``at`` whose length field runs past
    the end, when its body's header still reads (a flipped bit in its length): the
    record after it names that record's LSN as its ``prev``, and is found by it.  A torn
    append has nothing after it (the file grows only with the bytes written), so any
    whole record found there shows the bad record was written whole and damaged since."""
    head = at + _FRAME.size
    if len(view) - head < _BODY.size:
        return []
    _, prev, lsn, _ = _BODY.unpack_from(view, head)
    if not prev < lsn:
        return []
    data = view.tobytes()
    key = struct.pack("<Q", lsn)
    # The next record: frame (8 bytes), epoch (8), then prev == lsn.
    q = data.find(key, head + _BODY.size)
    while q != -1:
        start = q - 8 - _FRAME.size
        if start >= head + _BODY.size:
            records = parse_records(view[start:]).records
            if records and records[0][0].prev == lsn:
                return [r.lsn for r, _ in records]
        q = data.find(key, q + 1)
    return []


def _first_to_read(segments: list[tuple[int, Path]], lsn: int) -> int:
    """The index of the last segment starting at or below ``lsn`` (0 if none): a
    segment's records end where the next one starts, so the ones before it hold only
    what a state at ``lsn`` holds, and are not read (a torn tail there, the unsynced
    records of a lost log that a checkpoint covers, stops nothing)."""
    return max((i for i, (start, _) in enumerate(segments) if start <= lsn), default=0)


def _aside_name(path: Path, suffix: str) -> Path:
    """``path`` + ``suffix``, numbered if that name is taken (nothing set aside is
    ever replaced)."""
    target = path.with_name(path.name + suffix)
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}{suffix}.{n}")
        n += 1
    return target


class Wal:
    """The log of one partition, in ``folder``.  Not thread-safe: one writer."""

    def __init__(self, folder: str | os.PathLike[str], *, segment_bytes: int = 64 << 20) -> None:
        self.folder = Path(folder)
        self.segment_bytes = segment_bytes
        #: The LSN of the last record written (or the base of an empty log).
        self.lsn = 0
        #: Why the log can no longer be written (see :class:`WalLost`), or None.
        self.lost: str | None = None
        self._fd: int | None = None  # the active segment, opened for appending
        self._start = 0  # start of the active segment
        self._size = 0  # bytes in the active segment
        self._dirty = False  # written since the last sync
        #: Syncs that made appended records durable (a roll's and a new segment's too).
        self.syncs = 0

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
        that does not apply, or a torn or corrupt record; the log is cut there (the
        cut tail of a segment copied to ``*.cut-OFFSET``, then truncated; later
        segments renamed ``*.broken``).  A log that ends below ``lsn`` (the state is
        newer than the log) goes on in a new segment at ``lsn``.  The segments kept
        are synced before the log opens: what replay read is durable before anything
        is appended after it.
        """
        self.close()
        position: tuple[Path, int] | None = None  # just after the record at ``lsn``
        covered: set[Path] = set()  # segments whose records are all at or below ``lsn``
        applied, cut = 0, None
        segments = self.segments()
        stopped_in: int | None = None  # index of the segment replay stopped in
        first = _first_to_read(segments, lsn)
        covered.update(path for _, path in segments[:first])  # unread (see the helper)
        for i, (start, path) in enumerate(segments):
            if i < first:
                continue
            if start == lsn:  # the state continues into this segment
                position = (path, 0)
            parsed = parse_records(path.read_bytes())
            if (
                applied == 0
                and parsed.error is None
                and start <= lsn
                and all(rec.lsn <= lsn for rec, _ in parsed.records)
            ):
                covered.add(path)
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
        set_aside, reached = self._cut(segments, position, covered, stopped_in, lsn)
        reached = self._remember_reached(lsn, reached)
        return Recovery(lsn, epoch, applied, cut, set_aside, max(lsn, reached))

    def _remember_reached(self, lsn: int, reached: int) -> int:
        """How far the log is known to have reached past the state at ``lsn``, across
        restarts: what this recovery set aside (``reached``), or what an earlier one did,
        as recorded in ``REACHED`` (a copy that set aside records it may have
        acknowledged stays incomplete, through any number of restarts, until its state
        passes them: it was given its partition's data by a complete copy since).
        Written durably while the state is short of it; removed once it is not."""
        marker = self.folder / REACHED
        try:
            reached = max(reached, int(marker.read_text().strip()))
        except FileNotFoundError:
            pass
        except (OSError, ValueError):  # there, but unreadable: past the state, at least
            reached = max(reached, lsn + 1)
        if reached > lsn:
            durable.write_atomic(marker, f"{reached}\n".encode())
        elif marker.exists():
            marker.unlink()
            durable.fsync_dir(self.folder)
        return reached

    def cut_after(self, lsn: int) -> int:
        """Set aside every record after LSN ``lsn`` and open the log for appending after
        it: a checkpoint at ``lsn`` of another copy's history is about to replace the
        state, and a restart must never replay records of the history it replaced after
        that checkpoint.  Records at or below ``lsn`` stay (the checkpoint holds the
        state at it).  Set aside as recovery sets a torn tail aside (``*.cut-OFFSET``,
        ``*.broken``), never deleted.  Returns the records set aside."""
        self.close()
        position: tuple[Path, int] | None = None
        segments = self.segments()
        first = _first_to_read(segments, lsn)
        covered = {path for _, path in segments[:first]}  # unread: all at or below ``lsn``
        for start, path in segments[first:]:
            if start == lsn and position is None:
                position = (path, 0)
            parsed = parse_records(path.read_bytes())
            below = all(r.lsn <= lsn for r, _ in parsed.records)
            if parsed.error is None and start <= lsn and below:
                covered.add(path)
            for rec, end in parsed.records:
                if rec.lsn == lsn:
                    position = (path, end)
        aside, _ = self._cut(segments, position, covered, None, lsn)
        return aside

    def _cut(
        self,
        segments: list[tuple[int, Path]],
        position: tuple[Path, int] | None,
        covered: set[Path],
        stopped_in: int | None,
        lsn: int,
    ) -> tuple[int, int]:
        """Open for appending at ``position`` (None: no record ends at ``lsn``, so a
        new segment starts there, after the ``covered`` segments, which the state
        holds); set aside whatever follows.  Returns the whole records set aside and
        the highest LSN they (or the starts of the segments set aside) show."""
        aside, reached = 0, 0
        if position is None:
            for start, p in segments:
                if p not in covered:
                    count, last = self._set_aside(p, lsn)
                    aside, reached = aside + count, max(reached, start, last)
            self.folder.mkdir(parents=True, exist_ok=True)
            self._new_segment(lsn)
            return aside, reached
        path, offset = position
        keep = [p for _, p in segments].index(path)
        for start, later in segments[keep + 1 :]:
            count, last = self._set_aside(later, lsn)
            aside, reached = aside + count, max(reached, start, last)
        size = path.stat().st_size
        if size > offset:
            tail = path.read_bytes()[offset:]
            count, first, tail_last = whole_records(tail, lsn)
            aside, reached = aside + count, max(reached, tail_last or 0)
            saved = _aside_name(path, f".cut-{offset}")
            held = f"{count} whole records" + (f" (LSN {first}..{tail_last})" if count else "")
            try:
                with open(saved, "wb") as f:
                    f.write(tail)
                    f.flush()
                    os.fsync(f.fileno())
                durable.fsync_dir(self.folder)
            except OSError as e:
                saved.unlink(missing_ok=True)
                if count:  # never destroyed: the operator makes room first
                    raise WalError(
                        f"write-ahead log {path}: the {size - offset} bytes after LSN {lsn} "
                        f"hold {held} and cannot be kept aside as {saved} ({e}); make room "
                        "in the data dir and start again"
                    ) from e
                log.error(
                    "write-ahead log %s: the %d bytes after LSN %d (no whole record) cannot "
                    "be kept aside (%s): cut",
                    path, size - offset, lsn, e,
                )  # fmt: skip
            else:
                log.error(
                    "write-ahead log %s: cut %d bytes after LSN %d (they hold %s after it); "
                    "kept as %s",
                    path, size - offset, lsn, held, saved,
                )  # fmt: skip
            with open(path, "r+b") as f:
                f.truncate(offset)
                f.flush()
                os.fsync(f.fileno())
        for _, kept in segments[: keep + 1]:
            if kept not in covered:
                self._sync_replayed(kept)
        self._open(segments[keep][0], path, lsn)
        return aside, reached

    def _sync_replayed(self, path: Path) -> None:
        """Make a kept segment durable before anything is appended after it.  What
        replay read may be only in the page cache (written by a process that died or
        lost its log before syncing it); records appended to a later segment and
        synced there must not come to follow a record a power loss takes back."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise WalError(
                f"write-ahead log {path}: the records replayed from it cannot be made durable ({e})"
            ) from e

    def _set_aside(self, path: Path, lsn: int) -> tuple[int, int]:
        """Rename a segment that does not continue the replay ``*.broken``; returns the
        whole records it holds after ``lsn`` and the last one's LSN (0: none)."""
        count, first, last = whole_records(path.read_bytes(), lsn)
        broken = _aside_name(path, ".broken")
        held = f"{count} whole records" + (f" (LSN {first}..{last})" if count else "")
        log.error(
            "write-ahead log: %s does not continue the replay at LSN %d (it holds %s after it); "
            "kept as %s",
            path, lsn, held, broken,
        )  # fmt: skip
        os.replace(path, broken)
        return count, last or 0

    # -- writing ----------------------------------------------------------------

    def _check(self) -> int:
        if self.lost is not None:
            raise WalLost(f"write-ahead log in {self.folder} is lost: {self.lost}")
        if self._fd is None:
            raise WalError(f"write-ahead log in {self.folder} is not open")
        return self._fd

    def _lose(self, why: str) -> WalLost:
        self.lost = why
        return WalLost(f"write-ahead log in {self.folder} is lost: {why}")

    def _open(self, start: int, path: Path, lsn: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._fd, self._start, self._size, self.lsn = fd, start, os.fstat(fd).st_size, lsn

    def reset(self, base: int) -> None:
        """Start an empty log after LSN ``base`` (a checkpoint holds the state at it):
        every segment goes.  Durable when it returns."""
        self.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        for _, path in self.segments():
            path.unlink()
        self._new_segment(base)

    def _new_segment(self, start: int) -> None:
        """Begin the segment ``wal-START.log``.  If it cannot be created (a full disk),
        the active segment stays active and the OSError is raised."""
        path = self.folder / segment_name(start)
        with open(path, "wb"):
            pass
        try:
            durable.fsync_dir(self.folder)  # the new name must survive a crash as the records do
        except OSError as e:
            raise self._lose(f"fsync of the folder failed ({e})") from e
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None
        self._open(start, path, start)

    def append(self, records: Sequence[Record]) -> int:
        """Write ``records`` (in LSN order, continuing the log); returns bytes written.
        Not durable until :meth:`sync`.

        A write that fails (OSError: a full disk) leaves no partial record: the
        segment is truncated back to where this call's records in it began, and
        :attr:`lsn` is the last record written whole, so the same records may be
        written again.  If that truncation fails too, the log is lost
        (:class:`WalLost`)."""
        self._check()
        lsn = self.lsn
        for rec in records:
            if rec.prev != lsn:
                raise WalError(
                    f"write-ahead log in {self.folder}: record {rec.prev}..{rec.lsn} "
                    f"does not follow LSN {lsn}"
                )
            lsn = rec.lsn
        written = 0
        parts: list[Buffer] = []
        size, last = 0, self.lsn
        for rec in records:
            if parts and self._size + size >= self.segment_bytes:
                written += self._write(parts, size, last)
                parts, size = [], 0
            if self._size >= self.segment_bytes:
                self._new_segment(self.lsn)
            for part in encode_record(rec):
                parts.append(part)
                size += memoryview(part).nbytes
            last = rec.lsn
        if parts:
            written += self._write(parts, size, last)
        return written

    def _write(self, parts: list[Buffer], size: int, lsn: int) -> int:
        """Append whole records (``size`` bytes, through ``lsn``) to the active segment."""
        fd = self._check()
        try:
            _write_all(fd, parts)
        except OSError as e:
            try:
                os.ftruncate(fd, self._size)
            except OSError as undo:
                raise self._lose(
                    f"a write failed ({e}) and its partial record could not be removed ({undo})"
                ) from e
            raise
        self._size += size
        self.lsn = lsn
        self._dirty = True
        return size

    @property
    def dirty(self) -> bool:
        return self._dirty

    def sync(self) -> None:
        """Everything appended so far is on disk when this returns.  A failed sync is
        never retried: the log is lost (:class:`WalLost`)."""
        if self.lost is not None:
            raise WalLost(f"write-ahead log in {self.folder} is lost: {self.lost}")
        if self._fd is not None and self._dirty:
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                raise self._lose(f"fdatasync failed ({e})") from e
            self.syncs += 1
        self._dirty = False

    def flush(self) -> None:
        """Hand what was appended to the operating system (it survives a crash of this
        process, not of the machine): every append already has."""
        if self.lost is not None:
            raise WalLost(f"write-ahead log in {self.folder} is lost: {self.lost}")

    def roll(self) -> None:
        """Begin a new segment after the last record (when the active one has any): a
        checkpoint of the state at :attr:`lsn` then frees every older segment."""
        if self._fd is not None and self._size > 0:
            self._new_segment(self.lsn)

    def truncate(self, checkpoint_lsn: int) -> list[Path]:
        """The oldest checkpoint kept holds the state at ``checkpoint_lsn``: delete the
        segments whose records are all at or below it.  Returns the deleted paths."""
        segments = self.segments()
        gone = []
        # A segment's records end where the next segment starts.
        for (_, path), (next_start, _) in itertools.pairwise(segments):
            if next_start <= checkpoint_lsn:
                path.unlink()
                gone.append(path)
        if gone:
            durable.fsync_dir(self.folder)
        return gone

    def close(self, *, sync: bool = True) -> None:
        """Sync (unless the log is lost, or ``sync`` is false) and close the active
        segment.  Without the sync what was written stays where a process that dies
        leaves it: in the page cache, lost at a power loss."""
        if self._fd is not None:
            try:
                if sync and self.lost is None:
                    self.sync()
            finally:
                os.close(self._fd)
                self._fd = None
