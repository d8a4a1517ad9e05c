"""The reader's side: its mappings of peers' arenas, and the checked copy of a region
out of one (see :mod:`zps.shm`)."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import time
from collections.abc import Sequence

import numpy as np

from zps.core.rows import copy_finite
from zps.errors import ProtocolError
from zps.shm.region import (
    BUSY,
    HEAD,
    HEAD_BYTES,
    MAGIC,
    ShmUnavailableError,
    token_after_copy,
)

#: Mappings of peers' arenas a reader keeps at most.
MAX_MAPPINGS = 64
#: How often a reader looks for mappings of owners that are gone, at most.
SWEEP_S = 1.0


class Mapper:
    """A reader's mappings of its peers' arenas, by owner pid and memfd inode."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int, int], mmap.mmap] = {}
        self.swept = time.monotonic()
        self.reads = 0
        self.refused = 0

    @property
    def mapped(self) -> int:
        return len(self._maps)

    def _open(self, pid: int, fd: int, inode: int) -> mmap.mmap:
        key = (pid, fd, inode)
        mm = self._maps.get(key)
        if mm is not None:
            return mm
        path = f"/proc/{pid}/fd/{fd}"
        try:
            # Never blocks (a descriptor naming a pipe or a FIFO) nor takes a terminal.
            f = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        except FileNotFoundError:
            raise ShmUnavailableError(
                f"shared memory of process {pid} is gone (it exited)", permanent=False
            ) from None
        except OSError as e:
            raise ShmUnavailableError(
                f"cannot open shared memory {path}: {e.strerror}",
                permanent=True,
                busy=e.errno in BUSY,
            ) from None
        try:
            st = os.fstat(f)
            if st.st_ino != inode or not stat.S_ISREG(st.st_mode):
                raise ShmUnavailableError(
                    f"{path} is not the shared memory the message names (the process exited?)",
                    permanent=False,
                )
            mm = mmap.mmap(f, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        except ValueError as e:  # an empty file: no arena of a zps process
            raise ShmUnavailableError(
                f"cannot map shared memory {path}: {e}", permanent=True
            ) from None
        except OSError as e:
            raise ShmUnavailableError(
                f"cannot map shared memory {path}: {e.strerror}",
                permanent=True,
                busy=e.errno in BUSY,
            ) from None
        finally:
            os.close(f)
        if len(self._maps) >= MAX_MAPPINGS:
            self.sweep(force=True)
            if len(self._maps) >= MAX_MAPPINGS:
                _close(self._maps.pop(next(iter(self._maps))))
        self._maps[key] = mm
        return mm

    def read(self, desc: Sequence[int], into: np.ndarray | None = None) -> np.ndarray:
        """The bytes of the region ``desc`` names (``[pid, fd, inode, offset, length,
        token]``, or a slice of it with ``skip`` after), copied into this process's
        memory: into ``into`` (a writable uint8 array of exactly that length: where the
        caller wants them, one copy fewer), else a fresh array."""
        return self.read_finite(desc, into, 0)[0]

    def read_finite(
        self, desc: Sequence[int], into: np.ndarray | None, itemsize: int
    ) -> tuple[np.ndarray, bool]:
        """:meth:`read`, and whether the copy's floats (``itemsize`` 4 or 8; 0: none)
        are known to be finite, checked in the same pass as the copy
        (:func:`zps.core.rows.copy_finite`)."""
        now = time.monotonic()
        if now - self.swept >= SWEEP_S:
            self.sweep(now=now)
        pid, fd, inode, offset, length, token = desc[:6]
        skip = desc[6] if len(desc) > 6 else None
        start = offset + HEAD_BYTES + (skip or 0)
        mm = self._open(pid, fd, inode)
        if start + length > len(mm):
            raise ProtocolError(
                f"shared memory region [{offset}, +{length}) is outside the segment "
                f"of {len(mm)} bytes"
            )
        magic, have, declared = HEAD.unpack_from(mm, offset)
        whole = declared == length if skip is None else skip + length <= declared
        if magic != MAGIC or have != token or not whole:
            self.refused += 1
            raise ShmUnavailableError(
                "the shared memory region was reused before it was read",
                permanent=False,
                token=token,
            )
        out = into if into is not None and into.nbytes == length else np.empty(length, np.uint8)
        src = np.frombuffer(mm, dtype=np.uint8, count=length, offset=start)
        finite = False
        if itemsize:
            finite = copy_finite(out, src, itemsize)
        else:
            out[:] = src
        # The owner clears the token before reusing the bytes: unchanged, the copy is whole.
        if token_after_copy(mm, offset) != token:
            self.refused += 1
            raise ShmUnavailableError(
                "the shared memory region was reused while it was read",
                permanent=False,
                token=token,
            )
        self.reads += 1
        return out, finite

    def sweep(self, *, now: float | None = None, force: bool = False) -> int:
        """Unmap the arenas of owners that are gone (so the kernel can free them)."""
        self.swept = time.monotonic() if now is None else now
        gone = []
        for key in self._maps:
            pid, fd, inode = key
            try:
                alive = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
            except OSError:
                alive = False
            if not alive:
                gone.append(key)
        for key in gone:
            _close(self._maps.pop(key))
        return len(gone)

    def close(self) -> None:
        for mm in self._maps.values():
            _close(mm)
        self._maps.clear()


def _close(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still alive; unmapped when it goes
        mm.close()
