"""The one exception hierarchy of zps.

Every error a caller can see derives from :class:`ZpsError`.  Errors that a
server reports travel as a status code plus a message (the reply's ``st`` and ``msg``)
and are raised on the client as the matching subclass of :class:`RemoteError`.
"""

from __future__ import annotations


class ZpsError(Exception):
    """Base class of every zps error."""


class ConfigError(ZpsError, ValueError):
    """A configuration value is invalid; the message names the key."""


class ProtocolError(ZpsError):
    """A message on the wire is malformed or violates the protocol."""


class ClosedError(ZpsError):
    """The object was closed by its owner and can no longer be used."""


class BrokenError(ZpsError):
    """Something outside this process broke the connection or the peer."""


class ZpsTimeoutError(ZpsError, TimeoutError):
    """A request was not answered within its deadline."""


class DataDirInUseError(ZpsError):
    """Another live process holds the data directory (two owners would corrupt it)."""


class JobFailedError(ZpsError):
    """A data-task job failed: one of its tasks failed more often than allowed."""


class RemoteError(ZpsError):
    """A server answered a request with an error status."""

    code: str = "ERROR"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class BadRequestError(RemoteError, ValueError):
    code = "BAD_REQUEST"


class UnknownTableError(RemoteError, KeyError):
    code = "UNKNOWN_TABLE"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else self.code


class ShapeMismatchError(RemoteError, ValueError):
    code = "SHAPE_MISMATCH"


class TableConflictError(RemoteError, ValueError):
    """``create_*`` named an existing table with a different spec."""

    code = "TABLE_CONFLICT"


class ShardUnavailableError(RemoteError):
    """No live shard serves the partition a request needs.

    Raised by the client once a request that waited for a copy of its partition reached
    its deadline (or at once for a partition the cluster map does not have):
    ``partition`` names it, ``missing`` says what was missing (``"no live copy"``, ``"no
    primary"``, ``"lost"`` or ``"no such partition"``) and ``waited`` how many seconds
    the request waited.  All three are None when a server raised it.
    """

    code = "SHARD_UNAVAILABLE"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        partition: int | None = None,
        missing: str | None = None,
        waited: float | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.partition = partition
        self.missing = missing
        self.waited = waited


class NotPrimaryError(RemoteError):
    code = "NOT_PRIMARY"


class StaleEpochError(RemoteError):
    code = "STALE_EPOCH"


class InternalError(RemoteError):
    code = "INTERNAL"


class OverloadedError(RemoteError):
    """The broker refused a request it could not pass on to a busy shard."""

    code = "OVERLOADED"


class NotEnoughReplicasError(RemoteError):
    """An ``acks="all"`` write was refused: fewer copies of its partition are in sync
    than ``replication.min_in_sync`` (retried until the client's timeout first)."""

    code = "NOT_ENOUGH_REPLICAS"


_BY_CODE: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        BadRequestError,
        UnknownTableError,
        ShapeMismatchError,
        TableConflictError,
        ShardUnavailableError,
        NotPrimaryError,
        StaleEpochError,
        InternalError,
        OverloadedError,
        NotEnoughReplicasError,
    )
}


def remote_error(code: str, message: str) -> RemoteError:
    """Build the exception matching a status code received from a server."""
    cls = _BY_CODE.get(code, RemoteError)
    return cls(message, code=code)
