"""A region's format and the token protocol between its owner and its readers, and who
can read whose regions.

Every region starts with a :data:`HEAD_BYTES` head holding :data:`MAGIC`, its token and
its data's length.  The owner writes a fresh token before the data and clears it
before the region's bytes may be reused; a reader checks the token, copies the bytes
out, and checks it again.  A full memory barrier (:func:`zps.core.rows.fence`) stands
between a token's store or last load and the data's bytes on both sides: here, the
one place the protocol touches a token.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct

from zps.core.rows import fence
from zps.errors import ZpsError

#: A region's head: magic, token, length (padded to 64 bytes).
MAGIC = b"ZPSSHM01"
HEAD = struct.Struct("<8sQQ")
HEAD_BYTES = 64
#: A region's token, 8 bytes into its head.
TOKEN = struct.Struct("<Q")
_TOKEN_AT = 8
#: Why opening or mapping a peer's memory may fail for a while only: this process
#: is out of descriptors or memory.  The peer's frames go inline meanwhile, and a
#: sender tries its memory again after :data:`RETRY_S`.
BUSY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR})
#: How long a peer that could not open this process's memory for a while (``busy``)
#: gets inline frames before they are offered through shared memory again.
RETRY_S = 30.0


class ShmUnavailableError(ZpsError):
    """A region named by a descriptor cannot be read (another host, the owner gone,
    the region reused): the message must be sent again with inline frames."""

    def __init__(
        self, message: str, *, permanent: bool, token: int | None = None, busy: bool = False
    ) -> None:
        super().__init__(message)
        #: True: this peer cannot open the sender's memory at all (another host or
        #: user); False: this one region is gone (re-sending it may work).
        self.permanent = permanent or busy
        #: Not now (out of descriptors or memory: see :data:`RETRY_S`), where
        #: ``permanent`` alone means not ever.
        self.busy = busy
        #: The token the descriptor named, when its region was reused (else None).
        self.token = token


def disabled_by_env() -> bool:
    return os.environ.get("ZPS_NO_SHM", "") not in ("", "0")


def host_key() -> str | None:
    """Who can open whose memfds: the boot and the pid namespace (None: the path is
    unavailable here)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    if not hasattr(os, "memfd_create"):
        return None
    return f"{boot}/{pidns}"


def write_head(mm: mmap.mmap, offset: int, token: int, length: int) -> None:
    """The owner: a new region's head, written before any of its data (a reader that
    saw any of the new bytes sees this token, or a later one, when it checks again)."""
    HEAD.pack_into(mm, offset, MAGIC, token, length)


def set_token(mm: mmap.mmap, offset: int, token: int) -> None:
    """The owner: region ``offset`` gets ``token`` (0: cleared, before its bytes may be
    reused), visible before any of its bytes changed after this call."""
    TOKEN.pack_into(mm, offset + _TOKEN_AT, token)
    fence()


def token_after_copy(mm: mmap.mmap, offset: int) -> int:
    """A reader: region ``offset``'s token, loaded after every load of the copy just
    made (unchanged since the first check, the copy is whole)."""
    fence()
    token: int = TOKEN.unpack_from(mm, offset + _TOKEN_AT)[0]
    return token
