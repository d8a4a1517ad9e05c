"""Descriptor numbers below every socket's, for the memory files of a partition's tables.

A killed shard is noticed by its broker as its connections close (a closed connection is a
dropped route: see :mod:`zps.core.membership`), and the kernel closes them only as it tears
the process down: it closes the descriptors in increasing order, and releases each file
whose last descriptor that was in the reverse order, the last one first.  A table's memory
file frees its pages as it is released (about 0.15 s a GB here), so one whose descriptors
are numbered above the sockets' is freed before the connections close: a shard holding
3 GB was heard dead 0.6 s after its SIGKILL; with its memory files' descriptors below the
sockets', 0.16 s (docs/performance.md, "Big partitions").

So a shard reserves a block of low numbers before it opens any socket
(:func:`reserve`, holding ``/dev/null`` on each), and every descriptor of a memory file is
made in one of them (:func:`low`: a number is freed just before the call that makes the
descriptor, which takes the lowest free number).  Only speed depends on this: a descriptor
that lands elsewhere (the block used up, another thread quicker, a lower number freed by
someone else) works the same.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["BLOCK", "low", "release", "reserve"]

#: Numbers reserved by :func:`reserve` (at most a sixteenth of the process's limit).
BLOCK = 128

T = TypeVar("T")

_lock = threading.Lock()
_free: list[int] = []  # reserved numbers, each holding /dev/null, lowest last
_ceiling = 0  # numbers below this are low (the block's end); 0: nothing reserved
_want = 0


def reserve(count: int = BLOCK) -> int:
    """Hold ``count`` low descriptor numbers for memory files (call before any socket is
    opened); the numbers held."""
    global _ceiling, _want
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = min(count, max(0, soft // 16))
    with _lock:
        _want = max(_want, count)
        _top_up(force=True)
        if _free:
            _ceiling = max(_ceiling, max(_free) + 1)
        return len(_free)


def _top_up(*, force: bool = False) -> None:
    """Hold again the low numbers freed since (a memory file closed); never a number at
    or above the block's end."""
    while len(_free) < _want:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        if not force and fd >= _ceiling:
            os.close(fd)
            break
        _free.append(fd)
        _free.sort(reverse=True)


def low(make: Callable[[], T]) -> T:
    """``make()``, which opens one descriptor, with the lowest reserved number freed just
    before it, so that the descriptor takes that number."""
    with _lock:
        if _ceiling:
            _top_up()
        if not _free:
            return make()
        slot = _free.pop()
        os.close(slot)
        try:
            return make()
        finally:
            _top_up()


def release(fd: int) -> None:
    """Close ``fd`` (a memory file's descriptor) and hold its number again if it is low."""
    with _lock:
        os.close(fd)
        if _ceiling:
            _top_up()
