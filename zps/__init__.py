"""zps: a parameter server for distributed training on asyncio and ZeroMQ.

Use ``zps.connect(address)`` (async) or ``zps.connect_sync(address)``
(blocking) to reach a cluster started with ``zps-server``; ``address`` may be a
broker pair, ``["tcp://a:5555", "tcp://b:5555"]``, of which the client follows
the active one.

The names below are loaded on first use (PEP 562): a broker, a shard or a worker
imports ``zps.cli`` and what it runs, never the client it does not use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zps.version import __version__

if TYPE_CHECKING:
    from zps import errors, init, optim
    from zps.client import Client, SyncClient, connect, connect_sync
    from zps.errors import ShardUnavailableError, ZpsError, ZpsTimeoutError

#: Each lazy name and the module it comes from (a submodule of zps is its own name).
_LAZY = {
    "Client": "zps.client",
    "SyncClient": "zps.client",
    "connect": "zps.client",
    "connect_sync": "zps.client",
    "ShardUnavailableError": "zps.errors",
    "ZpsError": "zps.errors",
    "ZpsTimeoutError": "zps.errors",
    "errors": "zps.errors",
    "init": "zps.init",
    "optim": "zps.optim",
}

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


if not TYPE_CHECKING:  # the type checker sees the imports above, and no other name

    def __getattr__(name: str) -> Any:
        source = _LAZY.get(name)
        if source is None:
            raise AttributeError(f"module 'zps' has no attribute {name!r}")
        module = importlib.import_module(source)
        value = module if source == f"zps.{name}" else getattr(module, name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
