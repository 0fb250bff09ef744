"""The prefix-cache map of a `CpuBlockPool`: hash → published block, and its events.

`PrefixMap` owns the map and the event log (`kvoffload.pool.events`). The pool publishes,
looks up and evicts on inlined paths of its own over the same dict and list (bound once
per call, nothing added per block); the cold operations — unpublishing, clearing, the
slow eviction loop, observed lookups and the map's checks — are written here once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, final

from kvoffload.errors import BlockStateError, InvariantError
from kvoffload.pool.events import AllBlocksCleared, BlockRemoved, PoolEvent, PoolStatistics

if TYPE_CHECKING:
    from kvoffload.hashing import BlockHash
    from kvoffload.pool.block import CpuBlock

__all__ = ["PrefixMap", "publish_refused"]


def publish_refused(block: CpuBlock, token: object) -> BlockStateError:
    """Why `CpuBlockPool.publish()` refuses ``block``: another pool's (its owner is not
    ``token``), or holding no reference."""
    if block._owner is not token:
        return BlockStateError(f"block {block.block_id} belongs to another pool")
    return BlockStateError(
        f"publish of block {block.block_id} with ref_cnt {block.ref_cnt}: "
        "only a referenced block may be published"
    )


@final
class PrefixMap:
    """The published blocks of one pool, and the events recorded about them.

    Args:
        enable_events: record `BlockStored` / `BlockRemoved` / `AllBlocksCleared`.
    """

    __slots__ = ("cached", "enable_events", "events", "evictions", "hit_blocks", "lookups")

    def __init__(self, *, enable_events: bool) -> None:
        self.cached: dict[BlockHash, CpuBlock] = {}
        """Hash → the block published under it."""
        self.enable_events = enable_events
        self.events: list[PoolEvent] = []
        """Events since the last `take_events()` (the list object is kept)."""
        self.lookups = 0
        self.hit_blocks = 0
        self.evictions = 0
        """The counters of `PoolStatistics`, kept by the pool's paths."""

    def take_events(self) -> list[PoolEvent]:
        """Return and clear the events recorded since the last call."""
        events = self.events[:]
        self.events.clear()
        return events

    def statistics(self, num_blocks: int, num_free: int) -> PoolStatistics:
        """The pool's `PoolStatistics`."""
        return PoolStatistics(
            num_blocks=num_blocks,
            num_free=num_free,
            num_cached=len(self.cached),
            lookups=self.lookups,
            hit_blocks=self.hit_blocks,
            evictions=self.evictions,
        )

    def evict(self, blocks: Sequence[CpuBlock], evicted: list[BlockHash] | None) -> None:
        """Unpublish the published ones of ``blocks`` that an allocation takes (appending
        their hashes to ``evicted`` when given), counting each as an eviction."""
        cached = self.cached
        count = 0
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                del cached[block_hash]
                block.block_hash = None
                count += 1
                if evicted is not None:
                    evicted.append(block_hash)
                if self.enable_events:
                    self.events.append(BlockRemoved(block_hash, block.block_id))
        self.evictions += count

    def unpublish(self, block: CpuBlock) -> bool:
        """`CpuBlockPool.unpublish()`."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        del self.cached[block_hash]
        block.block_hash = None
        if self.enable_events:
            self.events.append(BlockRemoved(block_hash, block.block_id))
        return True

    def unpublish_all(self, *, cleared: bool = False) -> int:
        """Unpublish every block; return how many were published.

        Args:
            cleared: record one `AllBlocksCleared` instead of a `BlockRemoved` per block.
        """
        cached = self.cached
        count = len(cached)
        if self.enable_events:
            if cleared:
                self.events.append(AllBlocksCleared())
            else:
                self.events.extend(BlockRemoved(h, b.block_id) for h, b in cached.items())
        for block in cached.values():
            block.block_hash = None
        cached.clear()
        return count

    def clear_if(self, all_free: bool) -> bool:
        """`CpuBlockPool.reset_prefix_cache()`: unpublish every block (one `AllBlocksCleared`
        event) when ``all_free`` (no block holds a reference); return whether it did."""
        if not all_free:
            return False
        self.unpublish_all(cleared=True)
        return True

    def lookup_observed(
        self,
        block_hashes: Iterable[BlockHash],
        on_lookup: Callable[[Sequence[BlockHash], int], None],
    ) -> list[CpuBlock]:
        """`CpuBlockPool.lookup()` for a policy with an ``on_lookup`` hook, which is told
        of the hashes looked up and how many hit."""
        if type(block_hashes) is not list and type(block_hashes) is not tuple:
            block_hashes = list(block_hashes)
        get = self.cached.get
        hits: list[CpuBlock] = []
        for block_hash in block_hashes:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        self.lookups += 1
        self.hit_blocks += len(hits)
        on_lookup(block_hashes, len(hits))
        return hits

    def check(self, blocks: Sequence[CpuBlock]) -> None:
        """Check DESIGN invariant 3's bookkeeping: each block's hash and the map agree.

        Raises:
            InvariantError: naming the block.
        """
        cached = self.cached
        for block in blocks:
            if block.block_hash is not None and cached.get(block.block_hash) is not block:
                raise InvariantError(
                    f"block {block.block_id} carries a hash the map does not point at it"
                )
        for block_hash, block in cached.items():
            if block.block_hash != block_hash:
                raise InvariantError(
                    f"map entry for block {block.block_id} does not match its block_hash"
                )
