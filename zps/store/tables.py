"""The two kinds of table one partition holds, by their old path: embedding tables
(zps/store/embedding.py) and dense chunks (zps/store/dense.py), with what they share
(zps/store/common.py) and the compiled kernel's binding (zps/store/kernel.py).

Every name is read where it is defined: a switch of the kernel (``KERNEL``, ``COMPILED``)
is set on :mod:`zps.store.kernel`, which the tables consult at each call.
"""

from __future__ import annotations

from zps.store.common import Array, checksum_arrays
from zps.store.dense import DenseMemory, DenseTensor
from zps.store.embedding import SEEN, TOUCHED, EmbeddingTable, WriteLog

__all__ = [
    "SEEN",
    "TOUCHED",
    "Array",
    "DenseMemory",
    "DenseTensor",
    "EmbeddingTable",
    "WriteLog",
    "checksum_arrays",
]
