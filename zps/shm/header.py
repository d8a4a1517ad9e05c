"""The header entry (:data:`KEY`) of a message whose payload frames are in shared memory:
added to an encoded header without decoding it, its descriptors checked, and what a
receiver makes of such a message (:class:`Inbound`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from zps.errors import ProtocolError

#: The header key of a message with payload frames in shared memory.
KEY = "shm"

#: msgpack's map markers: fixmap (0x80-0x8f, the count in the low bits), map 16, map 32.
_FIXMAP, _MAP16, _MAP32 = 0x80, 0xDE, 0xDF


def with_entry(header: Any, key: str, value: Any) -> bytes:
    """The msgpack map ``header`` (bytes of one map, not holding ``key``) with
    ``key: value`` added: its count raised and the entry appended, without decoding
    the map (a request's or a reply's header, encoded by zps, gains :data:`KEY`)."""
    head = bytes(header)
    entry: bytes = msgpack.packb(key) + msgpack.packb(value, use_bin_type=True)
    first = head[0] if head else -1
    if _FIXMAP <= first < _FIXMAP + 15:
        return bytes((first + 1,)) + head[1:] + entry
    if first == _FIXMAP + 15:  # 15 entries: a 16th needs a map 16
        return bytes((_MAP16, 0, 16)) + head[1:] + entry
    if first == _MAP16 and len(head) >= 3:
        count = int.from_bytes(head[1:3], "big") + 1
        if count <= 0xFFFF:
            return bytes((_MAP16,)) + count.to_bytes(2, "big") + head[3:] + entry
        return bytes((_MAP32,)) + count.to_bytes(4, "big") + head[3:] + entry
    if first == _MAP32 and len(head) >= 5:
        count = int.from_bytes(head[1:5], "big") + 1
        return bytes((_MAP32,)) + count.to_bytes(4, "big") + head[5:] + entry
    raise ProtocolError("header must be a map")


def descriptors(value: object) -> list[list[int]]:
    """The descriptors of a header's :data:`KEY` entry (its ``"d"`` value), checked:
    a list of at most 4096, each ``[frame, pid, fd, inode, offset, length, token]`` with
    an optional ``skip`` (a multiple of 8), every field an int in ``[0, 2**64)``.
    Returns ``value`` itself; a malformed one is a :class:`ProtocolError` naming it."""
    if not isinstance(value, list) or len(value) > 4096:
        raise ProtocolError("shared memory descriptors must be a list")
    for d in value:
        if (
            not isinstance(d, list)
            or len(d) not in (7, 8)
            or any(type(x) is not int or not 0 <= x < 1 << 64 for x in d)
            or (len(d) == 8 and d[7] % 8)
        ):
            raise ProtocolError(f"bad shared memory descriptor {d!r}"[:200])
    return value


@dataclass(frozen=True, slots=True)
class Inbound:
    """A message with its shared-memory frames read: ``frames`` as if sent inline (the
    header without :data:`KEY`), and what the sender asked of this receiver."""

    frames: list[Any]
    header: dict[str, Any]  # the header without KEY
    reply_ok: bool  # the sender takes large reply frames through shared memory
    done: list[int]  # regions of this process's arena the sender has read
    #: Payloads whose floats were checked finite as they were read (see inbound's check)
    finite: frozenset[int] = frozenset()
    #: The sender asked for large reply frames this way, and this receiver cannot send
    #: them (another host, or the path off here): the sender should be told.
    reply_refused: bool = False


def tokens(descs: Sequence[list[int]]) -> list[int]:
    """The region tokens of descriptors from :meth:`SharedMemory.outbound`."""
    return [d[6] for d in descs]
