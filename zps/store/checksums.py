"""The checksums a snapshot stream (and a checkpoint file) ends with, named by its magic
(:mod:`zps.store.snapshot` re-exports them)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from zps.protocol.codec import BufferLike


class Hasher(Protocol):
    def update(self, data: BufferLike, /) -> None: ...
    def digest(self) -> bytes: ...


@dataclass(frozen=True)
class Checksum:
    """The checksum a snapshot stream ends with, as its magic names it."""

    name: str
    size: int  # bytes of the digest at the stream's end
    new: Callable[[], Hasher]


#: A snapshot stream's first bytes (as a checkpoint file's) name the checksum of
#: everything before its last bytes, which hold it: XXH3-128 in the streams written now
#: (integrity at memory speed: a multi-GB stream is hashed on both sides of every
#: transfer and at every checkpoint and restart), SHA-256 in those written before
#: (still read).  The length of the header follows the magic.
STREAM_MAGIC = b"ZPSCKPT2"
STREAM_MAGIC_SHA256 = b"ZPSCKPT1"
CHECKSUMS: dict[bytes, Checksum] = {
    STREAM_MAGIC: Checksum("XXH3-128", 16, xxhash.xxh3_128),
    STREAM_MAGIC_SHA256: Checksum("SHA-256", 32, hashlib.sha256),
}
#: The checksum's length in the streams written now.
STREAM_DIGEST = CHECKSUMS[STREAM_MAGIC].size


def stream_checksum(magic: BufferLike) -> Checksum | None:
    """The checksum a stream beginning with ``magic`` ends with (None: not a stream)."""
    return CHECKSUMS.get(bytes(memoryview(magic).cast("B")[: len(STREAM_MAGIC)]))


#: The names of the checksums this release reads, as a replica tells its primary.
READABLE: tuple[str, ...] = tuple(c.name for c in CHECKSUMS.values())


def magic_for(readable: Sequence[str]) -> bytes:
    """The magic of the stream to send a replica that reads the checksums named
    ``readable``: the one written now if it reads it, else SHA-256's, which every
    release reads (one of an earlier release names none)."""
    return STREAM_MAGIC if CHECKSUMS[STREAM_MAGIC].name in readable else STREAM_MAGIC_SHA256
