"""The enums the roles share: a job's mode, a shard's role, a reply's status.  Pure."""

from __future__ import annotations

import enum


class Mode(enum.StrEnum):
    """A training job's consistency mode."""

    ASYNC = "async"
    SYNC = "sync"
    SSP = "ssp"


class Role(enum.StrEnum):
    """What a shard does for a partition."""

    PRIMARY = "primary"
    REPLICA = "replica"
    SPARE = "spare"


class Status(enum.StrEnum):
    """The status code of a reply (its ``"st"``); errors carry a ``"msg"`` too."""

    OK = "OK"
    BAD_REQUEST = "BAD_REQUEST"
    UNKNOWN_TABLE = "UNKNOWN_TABLE"
    SHAPE_MISMATCH = "SHAPE_MISMATCH"
    TABLE_CONFLICT = "TABLE_CONFLICT"
    SHARD_UNAVAILABLE = "SHARD_UNAVAILABLE"
    NOT_PRIMARY = "NOT_PRIMARY"
    STALE_EPOCH = "STALE_EPOCH"
    INTERNAL = "INTERNAL"
    JOB_FAILED = "JOB_FAILED"
    #: The broker could not pass the request on (its shard's queue is full); retry later.
    OVERLOADED = "OVERLOADED"
    #: acks="all": fewer copies of the partition are in sync than ``min_in_sync``.
    NOT_ENOUGH_REPLICAS = "NOT_ENOUGH_REPLICAS"
    #: The message's route frame has another protocol version (the reply has this one).
    VERSION_MISMATCH = "VERSION_MISMATCH"
    #: A standby broker of a pair: ask the other one (clients switch and retry).
    PASSIVE = "PASSIVE"
    #: Live resharding: the partition no longer holds some slots of the request (not
    #: applied); the client splits the call again by its newer map.
    MOVED = "MOVED"
