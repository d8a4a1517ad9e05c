"""zps: a parameter server for distributed training on asyncio and ZeroMQ.

Use ``zps.connect(address)`` (async) or ``zps.connect_sync(address)``
(blocking) to reach a cluster started with ``zps-server``; ``address`` may be a
broker pair, ``["tcp://a:5555", "tcp://b:5555"]``, of which the client follows
the active one.
"""

from zps import errors, init, optim
from zps.client import Client, SyncClient, connect, connect_sync
from zps.errors import (
    ShardUnavailableError,
    ZpsError,
    ZpsTimeoutError,
)
from zps.version import __version__

__all__ = [
    "Client",
    "ShardUnavailableError",
    "SyncClient",
    "ZpsError",
    "ZpsTimeoutError",
    "__version__",
    "connect",
    "connect_sync",
    "errors",
    "init",
    "optim",
]
