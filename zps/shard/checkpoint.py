"""Checkpoint files: a partition's snapshot on disk, atomic and checksummed.

Layout of ``partition-P/ckpt-EPOCH-LSN.zps``::

    b"ZPSCKPT2" | u64 header length | msgpack header | frame 0 | frame 1 | ... | xxh3-128

The header is :func:`zps.store.snapshot.encode_snapshot`'s plus the frame lengths;
the checksum, 16 bytes of XXH3-128, covers everything before it.  The magic names the
checksum: files written before, ``b"ZPSCKPT1"``, end with a SHA-256 (32 bytes) and
load as they did (:data:`zps.store.snapshot.CHECKSUMS`).  The checksum guards against
a torn or corrupted file or stream, not against tampering: whoever can write a data
directory can write its checkpoints.  A file is written to a temporary
name, fsynced, renamed into place and the directory fsynced, so a crash
leaves either the old set of files or the new one; a write that fails (a full
disk) removes its temporary file and keeps the older checkpoints, and temporary
files a crash left are removed at start-up.  Loading verifies the checksum and
every field; a corrupt or truncated file is reported and the next older one is
used.  The newest ``keep`` files per partition are kept, and the write-ahead log
from the oldest of them on, so that any of them, with the log, restores the
newest state.

A shard that stops cleanly (SIGTERM: it has handed its partition over and
acknowledges nothing more) notes beside its final checkpoint that it is final
(``partition-P/FINAL``, naming the file).  The note is consumed by the next
start-up, before anything is acknowledged: without a log, only a copy restored
from the checkpoint it names is known to hold every write it acknowledged.

The same byte stream is what a joining replica receives, in bounded chunks
(:mod:`zps.shard.snapshots`).  :func:`cut` takes the partition at one LSN (on the
loop, between two requests) without copying its rows: it freezes them
(:func:`zps.store.snapshot.freeze_export`), and the encoding and writing read the
frozen version in slices, in a worker thread; the version is released (on the loop)
when the snapshot is dropped or :func:`release` d.  One cut at a time holds a frozen
version: :func:`thawed` waits for the one under way.  Rows are written in storage
order (files written before held them by id: both load).  A file is read back in
slices into the arrays its tables will own (:class:`~zps.store.snapstream.StreamBuilder`),
the arrays in memory files filled from the file's page cache in the kernel, the
checksum taken beside it from those files: one copy of the partition in memory at a
restore.

A partition's write-ahead log (:mod:`zps.store.wal`) sits beside its checkpoints
in ``partition-P/``.  :func:`zps.shard.restore.restore` is the start-up path: the newest
checkpoint that loads, then every logged message after it, replayed as a replica applies
the stream (the dedup record included, so a client's retry is still answered from it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import io
import itertools
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from zps.errors import ProtocolError, ZpsError
from zps.ops import durable
from zps.protocol.codec import Encoder
from zps.shard.core import ShardCore
from zps.store import mapped
from zps.store.checksums import CHECKSUMS, STREAM_DIGEST, STREAM_MAGIC, Checksum, stream_checksum
from zps.store.slicereader import SliceReader
from zps.store.snapshot import (
    CutSpace,
    FrozenPart,
    Part,
    Snapshot,
    decode_snapshot,
    encode_snapshot,
    freeze_export,
    slices,
)
from zps.store.snapstream import StreamBuilder, chunk_count

log = logging.getLogger("zps.checkpoint")

MAGIC = STREAM_MAGIC
#: The note of a clean stop beside a partition's checkpoints (see mark_final).
FINAL = "FINAL"
_LEN = struct.Struct("<Q")
#: The checksum of the streams and files written now (the magic names it).
CHECKSUM: Checksum = CHECKSUMS[MAGIC]


class CheckpointError(ZpsError):
    """A checkpoint file is corrupt, truncated or unreadable."""


def cut(core: ShardCore, space: CutSpace | None = None) -> Snapshot:
    """Everything a checkpoint holds, at the current LSN: the rows frozen, the rest
    copied (``space``: buffers for the tables that cannot be frozen now).  From the
    event loop that writes the tables; the frozen version is released when the
    snapshot is dropped (on that loop), or at :func:`release`."""
    versions: list[mapped.Frozen] = []

    def export(store: Any) -> dict[str, Any]:
        out, frozen = freeze_export(store, space)
        versions.extend(frozen)
        return out

    try:
        snap = dataclasses.replace(core.snapshot(export), frozen=tuple(versions))
    except BaseException:
        _release(versions)
        raise
    copied = copied_rows(snap.export) if mapped.FREEZABLE else 0
    if copied:
        log.warning(
            "a cut of partition %d at LSN %d: %.0f MB of rows copied on the loop (their "
            "arrays could not be frozen)",
            snap.partition, snap.lsn, copied / 1e6,
        )  # fmt: skip
    if versions:
        _frozen_now.update(versions)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        weakref.finalize(snap, _release_from, threading.get_ident(), loop, snap.frozen)
    return snap


def copied_rows(export: dict[str, Any]) -> int:
    """The bytes of large embedding arrays (rows, optimizer state) a cut's ``export``
    holds as copies rather than frozen: each copied on the loop, at the cut."""
    return sum(
        a.nbytes
        for arrays in export["tables"].values()
        if isinstance(arrays, dict) and "ids" in arrays
        for key, a in arrays.items()
        if key != "ids" and isinstance(a, np.ndarray) and a.nbytes >= mapped.MIN_BYTES
    )


#: Versions frozen by cuts and not yet released, and who waits for none (see thawed).
_frozen_now: set[mapped.Frozen] = set()
_releasing: set[mapped.Frozen] = set()
_thaw_waiters: list[asyncio.Future[None]] = []


#: A frozen version is released in steps of this many bytes of an array, one per turn
#: of the event loop (see zps.store.mapped.Frozen.release_steps).
RELEASE_STEP = 16 << 20


def release(snap: Snapshot) -> None:
    """Release ``snap``'s frozen version (from the loop that cut it), once what reads it
    has read it: in steps, one per turn of the running loop (at once without one)."""
    _start_release(snap.frozen)


def _start_release(versions: Sequence[mapped.Frozen]) -> None:
    todo = [v for v in versions if v in _frozen_now and v not in _releasing]
    if not todo:
        return
    _releasing.update(todo)
    steps = itertools.chain.from_iterable(v.release_steps(RELEASE_STEP) for v in todo)
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    t0, written, longest = time.monotonic(), [0], [0.0]

    def step() -> None:
        began = time.monotonic()
        try:
            written[0] += next(steps)
        except StopIteration:
            _released(todo, time.monotonic() - t0, written[0], longest[0])
            return
        except BaseException:
            _released(todo, time.monotonic() - t0, written[0], longest[0])
            raise
        finally:
            longest[0] = max(longest[0], time.monotonic() - began)
        if loop is None or loop.is_closed():
            step()  # no loop to give turns to: all at once
        else:
            loop.call_soon(step)

    step()


def _released(
    versions: Sequence[mapped.Frozen], took: float, written: int, longest: float = 0.0
) -> None:
    for version in versions:
        _frozen_now.discard(version)
        _releasing.discard(version)
    if written > 64 << 20:
        log.info(
            "a frozen cut released in %.2fs, in steps (%.0f MB written meanwhile, copied "
            "back; longest step %.3fs)",
            took,
            written / 1e6,
            longest,
        )
    if not _frozen_now:
        waiters, _thaw_waiters[:] = list(_thaw_waiters), []
        for w in waiters:
            if not w.done():
                w.set_result(None)


def _release(versions: Sequence[mapped.Frozen]) -> None:
    """Release at once (a cut that failed, or no loop)."""
    for version in versions:
        version.release()
    _released(versions, 0.0, 0)


def _release_from(
    thread: int, loop: asyncio.AbstractEventLoop | None, versions: Sequence[mapped.Frozen]
) -> None:
    """A cut's snapshot was dropped: release its versions on the thread that froze them."""
    if threading.get_ident() == thread:
        _start_release(versions)
    elif loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(_start_release, versions)


async def thawed(timeout: float = 60.0) -> bool:
    """Wait until no cut holds a frozen version (a cut taken then freezes its rows
    rather than copying them); False if one still did after ``timeout`` seconds."""
    while _frozen_now:
        waiter = asyncio.get_running_loop().create_future()
        _thaw_waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            return False
    return True


def finish(snap: Snapshot) -> Snapshot:
    """A :func:`cut` as a checkpoint holds it: rows in storage order, as a snapshot
    stream carries them (a table loads rows in any order, and proves their ids
    distinct as it indexes them); sorting them by id cost a second copy of the
    partition and seconds of CPU per GB."""
    return snap


#: A checkpoint being written is synced each time this many bytes were written since
#: the last sync, in a thread of its own while the writer goes on (the disk writes while
#: the next bytes arrive); the writer waits for the sync before the next one starts, so
#: at most twice this much is unsynced and the final sync never waits on a whole
#: partition in the disk's queue.
SYNC_BYTES = 64 << 20
#: The length of the checksum at the end of a checkpoint stream written now (XXH3-128
#: of everything before it).
DIGEST_BYTES = STREAM_DIGEST
#: Slices in which a stream is written or read, hashed as it goes.
_SLICE = 16 << 20


def encode_parts(snap: Snapshot, magic: bytes = MAGIC) -> list[Part]:
    """A checkpoint stream without its final checksum (see :class:`Digest`): the
    header and the arrays as they are, no copy (frozen arrays are read as the stream
    is: :func:`zps.store.snapshot.slices`).  ``magic`` names the checksum that will end
    it (:data:`zps.store.snapshot.CHECKSUMS`; a replica of an earlier release reads only
    SHA-256's)."""
    if magic not in CHECKSUMS:
        raise ValueError(f"unknown stream magic {magic!r}")
    enc = Encoder()
    header = encode_snapshot(enc, snap)
    frames: list[Part] = [
        f if isinstance(f, bytes | FrozenPart) else memoryview(f).cast("B") for f in enc.frames
    ]
    header["frame_bytes"] = [len(f) for f in frames]
    head = msgpack.packb(header, use_bin_type=True)
    return [magic, _LEN.pack(len(head)), head, *frames]


def encode_checkpoint(snap: Snapshot) -> list[Part]:
    parts = encode_parts(snap)
    digest = CHECKSUM.new()
    buf = memoryview(bytearray(_SLICE))
    for piece in slices(parts, _SLICE, buf):
        digest.update(piece)
    parts.append(digest.digest())
    return parts


class Digest:
    """The checksum of a checkpoint stream of ``total`` bytes, fed in order, piece by
    piece, as the stream is sent or received: the one its magic names (the checksum of
    the streams written now if the magic is not one), and bytes past the body (the
    checksum itself) are left out.  Both checksums release the GIL, so a worker thread
    hashes while the event loop moves the next chunks."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._magic = bytearray()
        self._kind = CHECKSUM
        self._hash: Any = None
        self._room = 0

    @property
    def checksum(self) -> Checksum | None:
        """The checksum taken (None until the magic is fed)."""
        return None if self._hash is None else self._kind

    def feed(self, pieces: list[memoryview]) -> None:
        for piece in pieces:
            if self._hash is None:
                take = min(len(MAGIC) - len(self._magic), len(piece))
                self._magic += piece[:take]
                piece = piece[take:]
                if len(self._magic) < len(MAGIC):
                    continue
                self._kind = stream_checksum(self._magic) or CHECKSUM
                self._hash = self._kind.new()
                self._room = max(0, self._total - self._kind.size)
                self._update(memoryview(self._magic))
            self._update(piece)

    def _update(self, piece: memoryview) -> None:
        take = min(self._room, len(piece))
        if take:
            self._hash.update(piece[:take])
            self._room -= take

    @property
    def complete(self) -> bool:
        return self._hash is not None and self._room == 0

    def digest(self) -> bytes:
        return b"" if self._hash is None else bytes(self._hash.digest())


def decode_checkpoint(
    data: bytes | memoryview, *, max_bytes: int = 1 << 40, copy: bool = True, verified: bool = False
) -> Snapshot:
    """A checkpoint's snapshot, its checksum and structure verified (``copy``: see
    :func:`zps.store.snapshot.decode_snapshot`; ``verified``: the caller checked the
    checksum already, as a :class:`Digest` fed while the stream arrived)."""
    view = memoryview(data).cast("B")
    kind = stream_checksum(view)
    if kind is None or len(view) < len(MAGIC) + _LEN.size + kind.size:
        raise CheckpointError("not a zps checkpoint (bad magic or too short)")
    body, digest = view[: -kind.size], bytes(view[-kind.size :])
    if not verified:
        hashed = kind.new()
        hashed.update(body)
        if hashed.digest() != digest:
            raise CheckpointError(f"{kind.name} checksum mismatch (corrupt or truncated)")
    (head_len,) = _LEN.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if start + head_len > len(body):
        raise CheckpointError("header runs past the end of the file")
    try:
        header = msgpack.unpackb(body[start : start + head_len], raw=False)
        sizes = header.pop("frame_bytes")
        frames: list[memoryview] = []
        pos = start + head_len
        for size in sizes:
            if type(size) is not int or size < 0 or pos + size > len(body):
                raise CheckpointError("frame sizes do not match the file")
            frames.append(body[pos : pos + size])
            pos += size
        if pos != len(body):
            raise CheckpointError("trailing bytes after the last frame")
        return decode_snapshot(header, frames, max_bytes=max_bytes, copy=copy)
    except (ProtocolError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"malformed checkpoint: {e}") from None


@dataclass(frozen=True)
class Found:
    snapshot: Snapshot
    path: Path


def drop_checkpoints(folder: Path) -> int:
    """Remove every checkpoint in a partition's ``folder``, durably; returns how many.
    For a log that starts from nothing (LSN 0): a checkpoint left there is of another
    history of the partition's number (a partition removed by a scale-down and created
    again), and a restart would take it for this one's base."""
    gone = 0
    for path in folder.glob("ckpt-*.zps"):
        path.unlink(missing_ok=True)
        gone += 1
    if gone:
        durable.fsync_dir(folder)
    return gone


class CheckpointStore:
    """The checkpoints of one shard, under ``data_dir``."""

    def __init__(self, data_dir: str | os.PathLike[str], keep: int = 3) -> None:
        self.root = Path(data_dir)
        self.keep = keep
        #: Temporary files of checkpoints being written now (never removed as stale).
        self.pending: set[Path] = set()

    def _dir(self, partition: int) -> Path:
        return self.root / f"partition-{partition}"

    def folder(self, partition: int) -> Path:
        """Where ``partition``'s checkpoints and write-ahead log live."""
        return self._dir(partition)

    def write(self, snap: Snapshot) -> Path:
        """Write atomically; prune old files; return the new file's path.  The checksum
        is taken as the arrays are written, slice by slice, from the tables' own arrays
        (frozen ones read where they are, in their files: no copy of the stream)."""
        return self.write_encoded(
            snap.partition, snap.epoch, snap.lsn, encode_parts(snap), checksum=True
        )

    def write_encoded(
        self,
        partition: int,
        epoch: int,
        lsn: int,
        parts: Sequence[Part],
        *,
        checksum: bool = False,
    ) -> Path:
        """Write an encoded checkpoint (a verified snapshot stream as a replica received
        it, or :func:`encode_checkpoint`'s parts; with ``checksum``, :func:`encode_parts`'
        and the checksum is appended) atomically; prune old files.  A write that fails
        removes its temporary file and keeps the older checkpoints."""
        pending = self.begin(partition, epoch, lsn)
        try:
            if checksum:
                pending.write(memoryview(_write_hashed(pending.write, parts)))
            else:
                buf = memoryview(bytearray(_SLICE))
                for piece in slices(parts, _SLICE, buf):
                    pending.write(piece)
        except BaseException:
            pending.abort()
            raise
        return pending.commit()

    def begin(self, partition: int, epoch: int, lsn: int) -> PendingCheckpoint:
        """A checkpoint written piece by piece (a snapshot stream as it arrives):
        :meth:`PendingCheckpoint.commit` makes it one of the partition's checkpoints,
        :meth:`PendingCheckpoint.abort` removes it."""
        folder = self._dir(partition)
        folder.mkdir(parents=True, exist_ok=True)
        return PendingCheckpoint(self, folder, f"ckpt-{epoch:08d}-{lsn:016d}.zps")

    def _prune(self, folder: Path) -> None:
        files = sorted(folder.glob("ckpt-*.zps"))
        for old in files[: max(0, len(files) - self.keep)]:
            old.unlink(missing_ok=True)
        self.remove_temporary(folder)

    def remove_temporary(self, folder: Path | None = None) -> list[Path]:
        """Delete the temporary files of checkpoints that never finished (a crash or a
        failure mid-write), in ``folder`` or every partition's, but for those being
        written now (:attr:`pending`: a replica keeps a snapshot as it arrives, for as
        long as the transfer takes); returns them."""
        if folder is None:
            found = list(self.root.glob("partition-*/.ckpt-*.tmp-*")) if self.root.is_dir() else []
        else:
            found = list(folder.glob(".ckpt-*.tmp-*"))
        found = [stale for stale in found if stale not in self.pending]
        for stale in found:
            stale.unlink(missing_ok=True)
        return found

    def oldest_lsn(self, partition: int) -> int | None:
        """The LSN of the oldest checkpoint kept of ``partition`` (the write-ahead log
        is kept from there on), or None if there is none."""
        lsns = map(_checkpoint_lsn, self._dir(partition).glob("ckpt-*.zps"))
        found = [lsn for lsn in lsns if lsn is not None]
        return min(found) if found else None

    def mark_final(self, partition: int, checkpoint: Path) -> None:
        """``checkpoint`` holds every write this copy acknowledged (written at a clean
        stop, after the partition was handed over): note it, durably, beside it."""
        durable.write_atomic(self._dir(partition) / FINAL, f"{checkpoint.name}\n".encode())

    def take_finals(self) -> dict[int, str]:
        """By partition, the checkpoint a clean stop noted as final (see
        :meth:`mark_final`); every note is removed (durably), so that a copy that goes
        on to acknowledge more never claims one again.  A note that cannot be removed
        counts as none."""
        found = {}
        for folder in self.root.glob("partition-*") if self.root.is_dir() else []:
            with contextlib.suppress(ValueError):
                partition = int(folder.name.removeprefix("partition-"))
                name = self._take_final(folder)
                if name is not None:
                    found[partition] = name
        return found

    def _take_final(self, folder: Path) -> str | None:
        note = folder / FINAL
        try:
            name = note.read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.error("%s is unreadable (%s): the copy is not known to be complete", note, e)
            name = ""
        try:
            note.unlink()
            durable.fsync_dir(folder)
        except OSError as e:
            log.error("%s could not be removed (%s): the copy is not known to be complete", note, e)
            return None
        return name or None

    def candidates(self, partition: int | None = None) -> list[Path]:
        """Every checkpoint (of ``partition``, if given), newest first (by time, then
        epoch and LSN)."""
        pattern = "partition-*" if partition is None else f"partition-{partition}"
        files = list(self.root.glob(f"{pattern}/ckpt-*.zps")) if self.root.is_dir() else []
        return sorted(files, key=lambda p: (p.stat().st_mtime, p.name), reverse=True)

    def newest_partition(self) -> int | None:
        """The partition whose checkpoint or log changed last (None: nothing on disk)."""
        if not self.root.is_dir():
            return None
        best: tuple[float, int] | None = None
        for path in [
            *self.root.glob("partition-*/ckpt-*.zps"),
            *self.root.glob("partition-*/wal-*.log"),
        ]:
            try:
                part = int(path.parent.name.removeprefix("partition-"))
                stamp = (path.stat().st_mtime, part)
            except (ValueError, OSError):
                continue
            if best is None or stamp > best:
                best = stamp
        return None if best is None else best[1]

    def latest(self, partition: int | None = None) -> Found | None:
        """The newest checkpoint (of ``partition``, if given) that loads; corrupt ones
        are logged and skipped."""
        for path in self.candidates(partition):
            try:
                # Read into the arrays its tables will own, the checksum taken beside.
                return Found(read_checkpoint(path), path)
            except CheckpointError as e:
                log.error("%s; trying an older one", e)
            except OSError as e:
                log.error("checkpoint %s is unusable (%s); trying an older one", path, e)
        return None


class PendingCheckpoint:
    """A checkpoint file being written: a temporary file until :meth:`commit`."""

    def __init__(self, store: CheckpointStore, folder: Path, name: str) -> None:
        self._store, self._folder = store, folder
        self.final = folder / name
        self._tmp = folder / f".{name}.tmp-{os.getpid()}-{id(self):x}"
        self.file: io.RawIOBase = open(self._tmp, "wb", buffering=0)  # noqa: SIM115
        self.written = 0
        self._unsynced = 0
        self._syncer: concurrent.futures.ThreadPoolExecutor | None = None
        self._syncing: concurrent.futures.Future[None] | None = None
        store.pending.add(self._tmp)

    def write(self, view: memoryview) -> None:
        """Append ``view``; synced in pieces of :data:`SYNC_BYTES` behind the writes (see
        :meth:`_sync_behind`), the rest at :meth:`commit`.  From one thread at a time."""
        _write_all(self.file, memoryview(view).cast("B"))
        self.written += len(view)
        self._unsynced += len(view)
        if self._unsynced >= SYNC_BYTES:
            self._sync_behind()
            self._unsynced = 0

    def _sync_behind(self) -> None:
        """Start an ``fdatasync`` of what is written so far in the syncing thread, once
        the one before it has finished (its error raised here)."""
        self._synced()
        if self._syncer is None:
            self._syncer = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="zps-ckpt-sync"
            )
        self._syncing = self._syncer.submit(_sync_and_drop, self.file.fileno(), self.written)

    def _synced(self) -> None:
        """Wait for the sync under way, if any; its error is raised."""
        syncing, self._syncing = self._syncing, None
        if syncing is not None:
            syncing.result()

    def _stop_syncing(self) -> None:
        """Wait for the sync under way (its error ignored) and end the syncing thread."""
        with contextlib.suppress(OSError):
            self._synced()
        if self._syncer is not None:
            self._syncer.shutdown()
            self._syncer = None

    def commit(self) -> Path:
        """Sync the file (once the sync under way, whose error fails the commit, has
        finished), remove the partition's checkpoints named after it (newer than the
        state it holds: of a history this copy left, as when a replica takes a snapshot
        behind its own), rename it into place, sync the folder, prune the oldest."""
        try:
            self._synced()
            self._stop_syncing()
            os.fsync(self.file.fileno())
            _drop_cached(self.file.fileno(), 0)
            self.file.close()
            newer = [p for p in self._folder.glob("ckpt-*.zps") if p.name > self.final.name]
            for path in newer:
                path.unlink(missing_ok=True)
            if newer:
                durable.fsync_dir(self._folder)
            os.replace(self._tmp, self.final)
        except BaseException:
            self.abort()
            raise
        finally:
            self._store.pending.discard(self._tmp)
        durable.fsync_dir(self._folder)
        self._store._prune(self._folder)
        return self.final

    def abort(self) -> None:
        """Close and remove the file (off the event loop: it waits for a sync under way)."""
        self._store.pending.discard(self._tmp)
        self._stop_syncing()
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self._tmp.unlink(missing_ok=True)


def _sync_and_drop(fd: int, upto: int) -> None:
    """``fdatasync`` a checkpoint being written, then drop its first ``upto`` bytes, now
    clean, from the page cache (see :func:`_drop_cached`)."""
    os.fdatasync(fd)
    _drop_cached(fd, upto)


def _drop_cached(fd: int, upto: int) -> None:
    """Drop bytes ``[0, upto)`` (0: all) of a synced file from the page cache.  A
    checkpoint is read only at a restart: cached, it would take the memory of a
    partition from what the machine caches for its other work, and new pages for the
    next writes would have to be reclaimed from it (a replica writing 1 GB spent
    0.3-2.8 CPU-s without the drop, 0.4-0.6 with it)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, upto, os.POSIX_FADV_DONTNEED)


def _checkpoint_lsn(path: Path) -> int | None:
    """The LSN in a checkpoint's name (``ckpt-EPOCH-LSN.zps``)."""
    try:
        return int(path.stem.split("-")[2])
    except (IndexError, ValueError):
        return None


def read_checkpoint(path: Path) -> Snapshot:
    """The snapshot in the checkpoint at ``path``, read in slices into the arrays its
    tables will own (:class:`StreamBuilder`; see :func:`_read_into`) while a second
    thread takes its checksum (the one its magic names); CheckpointError naming the file
    if it does not verify or decode."""
    try:
        return _read_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path} is unusable: {e}") from None


def _read_checkpoint(path: Path) -> Snapshot:
    with SliceReader(path) as f:
        size = f.size
        try:
            builder = StreamBuilder(0, size, _SLICE, chunk_count(size, _SLICE), 1 << 40)
        except ProtocolError as e:
            raise CheckpointError(f"not a zps checkpoint: {e}") from None
        digest = Digest(size)
        try:
            _read_into(f, builder, digest)
        except ProtocolError as e:
            raise CheckpointError(f"malformed checkpoint: {e}") from None
        except EOFError:
            raise CheckpointError("the file ended before its size (truncated)") from None
        f.drop_cached()  # read: its tables hold it now
    if not digest.complete or digest.digest() != builder.digest():
        name = builder.checksum.name if builder.checksum is not None else "its"
        raise CheckpointError(f"{name} checksum mismatch (corrupt or truncated)")
    try:
        return builder.snapshot()
    except (ProtocolError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"malformed checkpoint: {e}") from None


def _read_into(f: SliceReader, builder: StreamBuilder, digest: Digest) -> None:
    """The file ``f`` into ``builder``'s arrays, slice by slice, hashed into ``digest``.

    The bytes of tables' arrays in memory files are copied there in the kernel
    (:func:`zps.store.mapped.fill_from`: the file's page cache to the memory file, no
    buffer between) and hashed from a mapping of the memory file by a thread, while the
    next ones are copied; the rest (the header, ids, small arrays) is read into a buffer,
    taken and hashed.  A slice leaves the page cache once copied.  EOFError if the file
    ends early."""
    buffers = [memoryview(bytearray(min(_SLICE, max(f.size, 1)))) for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zps-ckpt-hash") as pool:
        hashing: list[list[concurrent.futures.Future[None]]] = [[], []]
        try:
            for seq, start in enumerate(range(0, f.size, _SLICE)):
                end = min(f.size, start + _SLICE)
                builder.check_size(0, seq, end - start)
                buf, pending = buffers[seq % 2], hashing[seq % 2]
                for job in pending:  # of the slice before the last: its buffer is reused
                    job.result()
                pending.clear()
                pos = start
                while pos < end:
                    target = builder.direct()
                    if target is not None:
                        arr, offset, left = target
                        n = min(end - pos, left)
                        if mapped.fill_from(arr, offset, f.fd, pos, n) < n:
                            raise EOFError
                        builder.took(n)
                        pending.append(pool.submit(_hash_window, digest, arr, offset, n))
                    else:
                        n = min(end - pos, builder.buffered())
                        piece = buf[pos - start : pos - start + n]
                        if f.read_into(pos, piece) < n:
                            raise EOFError
                        pending.append(pool.submit(digest.feed, [piece]))
                        builder.take([piece])
                    pos += n
                f.drop(start, end - start)  # copied: not cached
        except BaseException:
            for job in (*hashing[0], *hashing[1]):
                job.cancel()  # the pool's exit waits for the one under way
            raise
        for job in (*hashing[0], *hashing[1]):
            job.result()


def _hash_window(digest: Digest, arr: np.ndarray, offset: int, size: int) -> None:
    with mapped.read_window(arr, offset, size) as view:
        digest.feed([view])


def _write_all(f: io.RawIOBase, view: memoryview) -> None:
    while len(view):
        n = f.write(view)
        if not n:
            raise OSError(f"could not write to {getattr(f, 'name', 'a checkpoint')}")
        view = view[n:]


def _write_hashed(write: Callable[[memoryview], None], parts: Sequence[Part]) -> bytes:
    """Write ``parts`` with ``write``, each slice hashed before it is written; the checksum
    (:data:`CHECKSUM`) of all of them.  Frozen parts are hashed and written where they
    are, a slice of their file mapped at a time (no copy into a buffer first).  One
    thread: the checksum runs at memory speed, and a second thread reading the mappings
    would cost each unmapping a flush of its CPU's TLB."""
    digest = CHECKSUM.new()
    for piece in slices(parts, _SLICE, memoryview(b""), mapped_frozen=True):
        digest.update(piece)
        write(piece)
    return digest.digest()
