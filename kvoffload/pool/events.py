"""What a `CpuBlockPool` reports: the events a KV-aware router reads, and its statistics.

Plain records, made by the pool (`kvoffload.pool.block_pool`) and re-exported from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.hashing import BlockHash
from kvoffload.pool.block import BlockId

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "PoolEvent", "PoolStatistics"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A block became findable under ``block_hash``.

    ``group``: the KV cache group whose pool holds the block (with one group: its
    name when the offloader was given ``groups=[...]``, else ``None``); each group has a
    pool of its own, so ``(group, block_id)`` names one block and never collides.
    """

    block_hash: BlockHash
    block_id: BlockId
    group: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block is no longer findable under ``block_hash`` (evicted or unpublished);
    ``group`` as in `BlockStored`."""

    block_hash: BlockHash
    block_id: BlockId
    group: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped by `CpuBlockPool.reset_prefix_cache()` (with
    several groups: ``group``'s pool)."""

    group: str | None = None


PoolEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of a `CpuBlockPool`.

    Attributes:
        num_blocks: CPU blocks in the pool.
        num_free: blocks no request or transfer holds, which an allocation may reuse.
        num_cached: blocks whose hash is published for lookup.
        lookups: prefix lookups made in the pool (calls to ``lookup()``).
        hit_blocks: blocks the pool's lookups returned (prefix hits).
        evictions: published blocks an allocation reused, dropping their hash from
            lookup.
    """

    num_blocks: int
    num_free: int
    num_cached: int
    lookups: int
    hit_blocks: int
    evictions: int
