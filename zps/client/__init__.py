"""The client: the async ``Client``, the blocking ``SyncClient`` and their request machinery."""

from zps.client.client import Client, connect
from zps.client.sync import SyncClient, connect_sync

__all__ = ["Client", "SyncClient", "connect", "connect_sync"]
