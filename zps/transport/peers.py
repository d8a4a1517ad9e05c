"""Which connection of a CURVE server stands for which zps id: :class:`PeerTable`.

Under CURVE a ROUTER's routing id of a connection is a handle no other peer can name
(the ZAP handler's ``Identity``, or the peer's own secret ``p-`` id), and the zps id
(``c-TAG-...``, ``r-TAG-...``, ``s-NAME``, ``h-s-NAME``) travels with the connection as
its ``X-Zps-Id`` metadata.  Everything above the channel speaks zps ids; this table
turns one into the handle to send to.

Rules: a zps id is bound to a connection only by a message of it that its receiver
accepted (the key owns the id), the newest accepted one winning; a message refused
binds nothing.  A connection holds at most one binding, dropped when it closes, so
the table is bounded by the open connections.  What a connection's metadata said (its
zps id) is remembered by its handle until it closes: it cannot change.  Pure
decisions, no I/O.
"""

from __future__ import annotations

#: The prefix of a peer's own secret routing id (see zps.transport.sockets).
SECRET_PREFIX = b"p-"
#: The prefix of a handle the ZAP handler assigns (see zps.transport.curve).
ASSIGNED_PREFIX = b"z-"


class PeerTable:
    """zps id -> the handle of the connection its newest accepted message came by."""

    def __init__(self) -> None:
        self._route: dict[bytes, tuple[bytes, int | None]] = {}  # zps id -> (handle, fd)
        self._bound: dict[int, bytes] = {}  # fd -> the zps id bound to its connection
        self._seen: dict[int, bytes] = {}  # fd -> the handle of its connection's messages
        # fd -> closes still to be told of connections that held it before the one
        # seen there now (a descriptor is reused before its old connection's close
        # is reported).
        self._stale: dict[int, int] = {}
        # handle -> (zps id, fd) of a connection whose metadata passed the edge's checks.
        self._known: dict[bytes, tuple[bytes, int]] = {}

    def __len__(self) -> int:
        return len(self._route)

    def seen(self, handle: bytes, fd: int | None) -> None:
        """A message came by connection ``fd`` under ``handle`` (accepted or not)."""
        if fd is None:
            return
        before = self._seen.get(fd)
        if before == handle:
            return
        self._seen[fd] = handle
        if before is not None:
            self._known.pop(before, None)
            # Another connection has the descriptor now: the one before it closed.
            self._stale[fd] = self._stale.get(fd, 0) + 1
            self._unbind(fd)

    def known(self, handle: bytes) -> tuple[bytes, int] | None:
        """The zps id and descriptor of the open connection of ``handle``, as
        :meth:`learn` was told; None: not known (read its metadata)."""
        return self._known.get(handle)

    def learn(self, handle: bytes, zid: bytes, fd: int | None) -> None:
        """A message by connection ``fd`` under ``handle`` carried zps id ``zid`` and
        passed the edge's checks: remembered until that connection closes."""
        self.seen(handle, fd)
        if fd is not None:
            self._known[handle] = (zid, fd)

    def accepted(self, zid: bytes, handle: bytes, fd: int | None) -> None:
        """A message of ``zid`` by connection ``fd`` (``handle``) was accepted: what is
        sent to ``zid`` goes there from now on."""
        before = self._route.get(zid)
        if before is not None and before[1] is not None and before[1] != fd:
            self._bound.pop(before[1], None)
        if fd is not None:
            other = self._bound.get(fd)
            if other is not None and other != zid:
                self._route.pop(other, None)
            self._bound[fd] = zid
        self._route[zid] = (handle, fd)

    def route(self, zid: bytes) -> bytes | None:
        """The handle to send ``zid``'s messages to; None: no connection holds it."""
        bound = self._route.get(zid)
        return bound[0] if bound is not None else None

    def closed(self, fd: int) -> bytes | None:
        """Connection ``fd`` closed: the zps id it held (now unbound), or None."""
        stale = self._stale.get(fd, 0)
        if stale:
            if stale == 1:
                del self._stale[fd]
            else:
                self._stale[fd] = stale - 1
            return None  # an earlier connection of that descriptor
        handle = self._seen.pop(fd, None)
        if handle is not None:
            self._known.pop(handle, None)
        return self._unbind(fd)

    def _unbind(self, fd: int) -> bytes | None:
        zid = self._bound.pop(fd, None)
        if zid is not None and self._route.get(zid, (b"", None))[1] == fd:
            del self._route[zid]
        return zid


def is_handle(handle: bytes, assigned: bytes | None) -> bool:
    """Whether a received message's routing id is one no other peer can present: the
    handle the ZAP handler assigned its connection (``assigned``) or the peer's own
    secret ``p-`` id.  Anything else (a predictable id libzmq generated, or an id the
    peer chose, winning the race with the ZAP reply) is refused."""
    if assigned is not None and handle == assigned:
        return True
    return handle.startswith(SECRET_PREFIX) and len(handle) > len(SECRET_PREFIX)
