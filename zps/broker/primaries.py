"""Which primaries a routing broker hears on their links to it (pure: time is an argument).

Every shard sends its heartbeat to each routing broker it is linked to, every heartbeat
interval.  A primary of a partition this router routes that it has not heard for
``silence`` (counted from when a map first named it primary, at the latest) has no live
link to it, as far as the router can tell: the connection may have died unseen, or the
shard cannot make it again.  The router then refuses that partition's requests
``bypass`` rather than post them into a link that may be dead, and names the partition in
its heartbeat echoes (``unroutable``), so each client sends those requests, and the ones
in flight through this router for it, to the broker (:mod:`zps.client.routers`).
"""

from __future__ import annotations

from zps.core.routing import ClusterMap


class PrimaryLinks:
    """When each primary of this router's partitions was last heard (module notes)."""

    def __init__(self, silence: float) -> None:
        if silence <= 0:
            raise ValueError(f"silence must be positive, got {silence!r}")
        self.silence = silence
        self._heard: dict[str, float] = {}  # only the primaries of the map's partitions

    def on_map(self, cmap: ClusterMap, now: float) -> None:
        """Follow the primaries ``cmap`` names: one new to this map is given a whole
        silence from now; one it no longer names is forgotten."""
        primaries = {i.primary for i in cmap.partitions.values() if i.primary is not None}
        self._heard = {p: self._heard.get(p, now) for p in primaries}

    def heard(self, shard: str, now: float) -> None:
        """A message from ``shard`` on its link to this router."""
        if shard in self._heard:
            self._heard[shard] = now

    def live(self, primary: str, now: float) -> bool:
        """Whether ``primary``'s link to this router was heard within the silence."""
        heard = self._heard.get(primary)
        return heard is not None and now - heard < self.silence

    def silent(self, cmap: ClusterMap | None, router: str, now: float) -> list[int]:
        """The partitions ``cmap`` gives the router ``router`` whose primary is not
        :meth:`live`."""
        if cmap is None:
            return []
        return [
            p
            for p, i in cmap.partitions.items()
            if i.router == router and i.primary is not None and not self.live(i.primary, now)
        ]
