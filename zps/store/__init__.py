"""The I/O-free storage core: id index, table specs, tables and partitions.

Nothing here imports ``zmq`` or ``asyncio``; drivers call it with decoded
arrays and turn its return values and exceptions into replies.
"""

from zps.protocol.specs import DenseSpec, EmbeddingSpec, TableSpec, spec_from_wire
from zps.store.index import IdIndex
from zps.store.partition import PartitionStore
from zps.store.tables import DenseTensor, EmbeddingTable

__all__ = [
    "DenseSpec",
    "DenseTensor",
    "EmbeddingSpec",
    "EmbeddingTable",
    "IdIndex",
    "PartitionStore",
    "TableSpec",
    "spec_from_wire",
]
