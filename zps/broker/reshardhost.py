"""What live resharding (:mod:`zps.broker.reshard`) needs of its broker and of the
training: the narrow interfaces the broker implements."""

from __future__ import annotations

from typing import Any, Protocol

from zps.core.cluster import Assignment, ClusterState


class CommitGate(Protocol):
    """What a move needs of the training: hold sync commits back while slots move."""

    paused: bool

    @property
    def commit_in_flight(self) -> bool: ...

    async def advance(self) -> None: ...


class ReshardHost(Protocol):
    """What the resharding needs of its broker (the map's owner)."""

    @property
    def state(self) -> ClusterState: ...

    @property
    def training(self) -> CommitGate: ...

    def routing(self) -> bool:
        """Whether the broker routes now (a pair's active one, not holding for claims)."""

    def state_changed(self) -> None:
        """The state record changed (the resharding record is part of it)."""

    async def persisted(self, *, standby: bool = False) -> bool:
        """Return once the state record as it is now survives the broker; ``standby``:
        in a pair, only once the standby holds it (False: it did not within the bound)."""

    async def apply(self, assignments: list[Assignment]) -> None:
        """Send the shards these assignments."""

    async def publish_if_changed(self, before: int) -> None:
        """Publish the map if its version is no longer ``before``."""

    def post(self, frames: list[Any]) -> object:
        """Send at once (or hold for a slow peer), never waiting."""
