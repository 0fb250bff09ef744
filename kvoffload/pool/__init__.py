"""The CPU block pool and its LRU free queue."""

from kvoffload.pool.block import BlockId, CpuBlock
from kvoffload.pool.block_pool import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CpuBlockPool,
    PoolEvent,
    PoolStatistics,
)
from kvoffload.pool.free_queue import LruFreeQueue

__all__ = [
    "AllBlocksCleared",
    "BlockId",
    "BlockRemoved",
    "BlockStored",
    "CpuBlock",
    "CpuBlockPool",
    "LruFreeQueue",
    "PoolEvent",
    "PoolStatistics",
]
