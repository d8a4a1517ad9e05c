"""What a shard's core bounds and counts: per-request limits, statistics, and the
status an operation's failure becomes (rule 4 of :mod:`zps.shard.core`).  No I/O."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from zps.errors import ProtocolError, RemoteError


@dataclass
class Limits:
    """Per-request limits (larger requests get BAD_REQUEST, not a crash) and the
    byte bounds of what a shard keeps between requests."""

    max_ops: int = 4096
    max_array_bytes: int = 512 << 20
    max_ids: int = 8 << 20
    #: Bytes of the dedup record (see :class:`DedupCache`).
    dedup_bytes: int = 64 << 20
    #: Sync mode: how many steps past the last committed one a push may be for.
    step_window: int = 8
    #: Sync mode: bytes of gradients buffered until their step commits.
    step_buffer_bytes: int = 2 << 30


@dataclass
class ShardStats:
    requests: int = 0
    ops: int = 0
    errors: int = 0
    duplicates: int = 0
    malformed: int = 0
    #: Re-sent messages older than the dedup record, refused (see :class:`DedupCache`).
    expired: int = 0
    bytes_in: int = 0
    by_op: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))


#: Error messages are cut to this length: they may quote hostile input, and
#: they are kept in the dedup record.
MAX_MESSAGE_CHARS = 300


def error_status(e: Exception) -> dict[str, Any]:
    if isinstance(e, RemoteError):
        st, msg = e.code, str(e)
    elif isinstance(e, ProtocolError):
        st, msg = "BAD_REQUEST", str(e)
    else:
        st, msg = "INTERNAL", f"{type(e).__name__}: {e}"
    if len(msg) > MAX_MESSAGE_CHARS:
        msg = msg[: MAX_MESSAGE_CHARS - 3] + "..."
    return {"st": st, "msg": msg}
