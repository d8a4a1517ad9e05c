"""Typed records of the control messages, and the enums the roles share.

One job: turn a decoded header into a typed record, or raise :class:`ProtocolError`
(and nothing else), so a driver never indexes an untyped dict.
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """What a shard does for a partition."""

    PRIMARY = "primary"
    REPLICA = "replica"
    SPARE = "spare"
