"""The requests a routing broker posted to each shard and no reply has come back for
(pure bookkeeping, no I/O, no clock).

A request posted to a shard's link is gone with it if the connection closes before the
shard read it, and so is a reply the shard wrote to it: nothing tells the client, which
would wait for the whole of its deadline.  The router remembers each request it posted,
by shard, until a reply to it passes back; when it learns that the shard's link was lost
or made again (a post finds the shard not connected, the shard's greeting on a new
connection says ``new_link``, or the shard went silent) it refuses every request still
remembered for that shard, so each client sends it again (the shard's dedup record keeps
each exactly once).

Rules:

1. A request is remembered under its shard and ``(client, req_id)``; a reply from that
   shard to that client with that id forgets it (a first part of a split reply too: a
   link lost between the parts is not covered).
2. At most ``limit`` requests are remembered in all; past that the shard's oldest is
   forgotten (counted in :attr:`Forwarded.forgotten`): it loses the cover, nothing else.
3. :meth:`Forwarded.lost` hands back every request remembered for a shard, oldest first,
   and forgets them.
"""

from __future__ import annotations

import collections

from zps.protocol.codec import Route

#: Requests remembered at most (a few hundred bytes each).
MAX_FORWARDED = 1 << 16

Key = tuple[bytes, int]


class Forwarded:
    """Requests posted to each shard and not answered yet (see the module notes)."""

    def __init__(self, limit: int = MAX_FORWARDED) -> None:
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit!r}")
        self.limit = limit
        self._by_shard: dict[bytes, collections.OrderedDict[Key, tuple[bytes, Route]]] = {}
        self._count = 0
        #: Requests forgotten unanswered to keep the bound (rule 2).
        self.forgotten = 0

    def __len__(self) -> int:
        return self._count

    def posted(self, shard: bytes, client: bytes, route: Route) -> None:
        """``client``'s request ``route`` was posted to ``shard``'s link."""
        pending = self._by_shard.get(shard)
        if pending is None:
            pending = self._by_shard[shard] = collections.OrderedDict()
        key = (bytes(client), route.req_id)
        if key in pending:
            pending[key] = (key[0], route)
            pending.move_to_end(key)
            return
        if self._count >= self.limit:
            victim = pending if pending else max(self._by_shard.values(), key=len)
            victim.popitem(last=False)
            self._count -= 1
            self.forgotten += 1
        pending[key] = (key[0], route)
        self._count += 1

    def answered(self, shard: bytes, client: bytes, req_id: int) -> None:
        """A reply from ``shard`` to ``client`` for ``req_id`` passed back."""
        pending = self._by_shard.get(shard)
        if pending and pending.pop((bytes(client), req_id), None) is not None:
            self._count -= 1

    def lost(self, shard: bytes) -> list[tuple[bytes, Route]]:
        """Every request remembered for ``shard`` (client, route), oldest first, now
        forgotten: its link was lost or made again."""
        pending = self._by_shard.pop(shard, None)
        if not pending:
            return []
        self._count -= len(pending)
        return list(pending.values())

    def shards(self) -> list[bytes]:
        """The shards with requests remembered."""
        return [s for s, pending in self._by_shard.items() if pending]
