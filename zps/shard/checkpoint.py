"""Checkpoint files: a partition's snapshot on disk, atomic and checksummed.

Layout of ``partition-P/ckpt-EPOCH-LSN.zps``::

    b"ZPSCKPT1" | u64 header length | msgpack header | frame 0 | frame 1 | ... | sha256

The header is :func:`zps.store.snapshot.encode_snapshot`'s plus the frame lengths;
the SHA-256 covers everything before it.  A file is written to a temporary
name, fsynced, renamed into place and the directory fsynced, so a crash
leaves either the old set of files or the new one.  Loading verifies the
checksum and every field; a corrupt or truncated file is reported and the
next older one is used.  The newest ``keep`` files per partition are kept.

The same byte stream is what a joining replica receives, in bounded chunks
(:mod:`zps.shard.snapshots`).  A snapshot is taken in two steps so that no
step delays the event loop by more than a memory copy: :func:`cut` copies the
partition at one LSN (on the loop, between two requests), :func:`finish` puts
the rows in id order (in a worker thread, like the encoding and the writing).

A partition's write-ahead log (:mod:`zps.store.wal`) sits beside its checkpoints
in ``partition-P/``.  :func:`restore` is the start-up path: the newest checkpoint
that loads, then every logged message after it, replayed as a replica applies
the stream (the dedup record included, so a client's retry is still answered
from it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import msgpack

from zps.errors import ProtocolError, ZpsError
from zps.protocol.codec import Encoder, MsgType, Route, decode
from zps.shard.core import ShardCore
from zps.store.snapshot import (
    CutSpace,
    Snapshot,
    cut_export,
    decode_snapshot,
    encode_snapshot,
    ordered,
)
from zps.store.wal import Record, Recovery, Wal

log = logging.getLogger("zps.checkpoint")

MAGIC = b"ZPSCKPT1"
_LEN = struct.Struct("<Q")
_DIGEST = 32


class CheckpointError(ZpsError):
    """A checkpoint file is corrupt, truncated or unreadable."""


def cut(core: ShardCore, space: CutSpace | None = None) -> Snapshot:
    """Everything a checkpoint holds, copied at the current LSN (memory copies only;
    pass it through :func:`finish` before encoding)."""
    return core.snapshot(lambda store: cut_export(store, space))


def finish(snap: Snapshot) -> Snapshot:
    """A :func:`cut` in the order of :meth:`ShardCore.snapshot` (rows by id)."""
    return dataclasses.replace(snap, export=ordered(snap.export))


def encode_checkpoint(snap: Snapshot) -> list[bytes | memoryview]:
    enc = Encoder()
    header = encode_snapshot(enc, snap)
    frames = [memoryview(f).cast("B") if not isinstance(f, bytes) else f for f in enc.frames]
    header["frame_bytes"] = [len(f) for f in frames]
    head = msgpack.packb(header, use_bin_type=True)
    parts: list[bytes | memoryview] = [MAGIC, _LEN.pack(len(head)), head, *frames]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    parts.append(digest.digest())
    return parts


def decode_checkpoint(
    data: bytes | memoryview, *, max_bytes: int = 1 << 40, copy: bool = True
) -> Snapshot:
    """A checkpoint's snapshot, its checksum and structure verified (``copy``: see
    :func:`zps.store.snapshot.decode_snapshot`)."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + _LEN.size + _DIGEST or bytes(view[: len(MAGIC)]) != MAGIC:
        raise CheckpointError("not a zps checkpoint (bad magic or too short)")
    body, digest = view[:-_DIGEST], bytes(view[-_DIGEST:])
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError("checksum mismatch (corrupt or truncated)")
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


class CheckpointStore:
    """The checkpoints of one shard, under ``data_dir``."""

    def __init__(self, data_dir: str | os.PathLike[str], keep: int = 3) -> None:
        self.root = Path(data_dir)
        self.keep = keep

    def _dir(self, partition: int) -> Path:
        return self.root / f"partition-{partition}"

    def folder(self, partition: int) -> Path:
        """Where ``partition``'s checkpoints and write-ahead log live."""
        return self._dir(partition)

    def write(self, snap: Snapshot) -> Path:
        """Write atomically; prune old files; return the new file's path."""
        return self.write_encoded(snap.partition, snap.epoch, snap.lsn, encode_checkpoint(snap))

    def write_encoded(
        self, partition: int, epoch: int, lsn: int, parts: list[bytes | memoryview]
    ) -> Path:
        """Write an encoded checkpoint (a verified snapshot stream as a replica received
        it, or :func:`encode_checkpoint`'s parts) atomically; prune old files."""
        folder = self._dir(partition)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"ckpt-{epoch:08d}-{lsn:016d}.zps"
        tmp = folder / f".{final.name}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(folder)
        self._prune(folder)
        return final

    def _prune(self, folder: Path) -> None:
        files = sorted(folder.glob("ckpt-*.zps"))
        for old in files[: max(0, len(files) - self.keep)]:
            old.unlink(missing_ok=True)
        for stale in folder.glob(".ckpt-*.tmp-*"):  # a crash mid-write
            stale.unlink(missing_ok=True)

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
                return Found(decode_checkpoint(path.read_bytes()), path)
            except (CheckpointError, OSError) as e:
                log.error("checkpoint %s is unusable (%s); trying an older one", path, e)
        return None


def apply_record(core: ShardCore, rec: Record) -> int:
    """Re-run a logged message on ``core`` (as a replica applies the stream); the new LSN."""
    if not rec.frames:
        raise CheckpointError(f"logged LSN {rec.lsn} holds no message")
    header = decode([Route(MsgType.REQUEST).pack(), rec.frames[0]]).header
    return core.apply_replicated(header, rec.frames[1:])


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` loaded into the core."""

    partition: int
    epoch: int
    lsn: int
    checkpoint: Path | None  # the checkpoint it started from (None: an empty partition)
    recovery: Recovery | None  # what the log replayed (None: no log)


def restore(
    core: ShardCore, store: CheckpointStore, *, log_segment_bytes: int | None = None
) -> tuple[Restored | None, Wal | None]:
    """Load the newest checkpoint that verifies into ``core`` and, with a log
    (``log_segment_bytes`` given), replay the log after it; returns what was
    restored and the log, open for appending after its last good record.

    Without a log, the newest checkpoint of any partition is used.  With one, the
    partition is the one whose files changed last; its log may start from an empty
    partition (a primary that never checkpointed).  A torn or corrupt tail of the
    log is cut (:meth:`~zps.store.wal.Wal.recover`).
    """
    if log_segment_bytes is None:
        found = store.latest()
        if found is None:
            return None, None
        core.load_snapshot(found.snapshot)
        snap = found.snapshot
        return Restored(snap.partition, snap.epoch, snap.lsn, found.path, None), None
    partition = store.newest_partition()
    if partition is None:
        return None, None
    found = store.latest(partition)
    if found is not None:
        core.load_snapshot(found.snapshot)
    else:
        core.assign(partition, 0, primary=False)  # the log may start from nothing
    wal = Wal(store.folder(partition), segment_bytes=log_segment_bytes)
    recovery = wal.recover(core.lsn, core.epoch, lambda rec: apply_record(core, rec))
    core.epoch = recovery.epoch
    if found is None and core.lsn == 0:
        core.assign(None, 0)
        wal.close()
        return None, None
    restored = Restored(partition, core.epoch, core.lsn, found.path if found else None, recovery)
    return restored, wal


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
