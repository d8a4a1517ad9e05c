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
from zps.protocol.codec import Encoder
from zps.shard.core import ShardCore
from zps.store.snapshot import (
    CutSpace,
    Snapshot,
    cut_export,
    decode_snapshot,
    encode_snapshot,
    ordered,
)

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


def decode_checkpoint(data: bytes | memoryview, *, max_bytes: int = 1 << 40) -> Snapshot:
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
        return decode_snapshot(header, frames, max_bytes=max_bytes)
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

    def write(self, snap: Snapshot) -> Path:
        """Write atomically; prune old files; return the new file's path."""
        folder = self._dir(snap.partition)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"ckpt-{snap.epoch:08d}-{snap.lsn:016d}.zps"
        tmp = folder / f".{final.name}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            for part in encode_checkpoint(snap):
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

    def candidates(self) -> list[Path]:
        """Every checkpoint, newest first (by time, then epoch and LSN)."""
        files = list(self.root.glob("partition-*/ckpt-*.zps")) if self.root.is_dir() else []
        return sorted(files, key=lambda p: (p.stat().st_mtime, p.name), reverse=True)

    def latest(self) -> Found | None:
        """The newest checkpoint that loads; corrupt ones are logged and skipped."""
        for path in self.candidates():
            try:
                return Found(decode_checkpoint(path.read_bytes()), path)
            except (CheckpointError, OSError) as e:
                log.error("checkpoint %s is unusable (%s); trying an older one", path, e)
        return None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
