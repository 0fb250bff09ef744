"""Use counts with aging for prefix caches (GreedyDual over the free blocks)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, final

from kvoffload.errors import InvariantError
from kvoffload.pool.policies._common import PolicyBase

if TYPE_CHECKING:
    from kvoffload.pool.block import CpuBlock

__all__ = ["PrefixFrequencyPolicy"]


@final
class PrefixFrequencyPolicy(PolicyBase):
    """Evict the free block with the lowest aged use count; chains leave from the tail.

    Each cached block counts its uses (the store, then one per request that hits it). A
    freed block is ranked ``L + log2(1 + uses)``, where ``L``, the *inflation*, is the
    rank of the last block evicted (GreedyDual's aging: a block nobody asks for any more
    is overtaken by the rising ``L`` and leaves). The logarithm keeps a block hit a
    thousand times from outliving a recently useful one by a thousand generations. Equal
    ranks leave in the order they were freed.

    Why it suits prefix caches: a prefix hit on a block is also a hit on every block
    before it, so along a chain counts never increase and a parent always ranks at least
    as high as its children; the pool frees a request tail first, so among equals the
    deepest block goes first. The policy therefore evicts chains from the leaves and never
    keeps a child whose parent it dropped (a prefix lookup could not reach that child). A
    system prompt shared by many requests ranks above every private continuation of it.
    Blocks that hold nothing findable (a store that lost a race) are reused first.
    """

    __slots__ = ("_heap", "_inflation", "_rank", "_seq", "_uses")

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[float, int, int]] = []
        self._inflation = 0.0
        self._seq = 0
        self._uses: list[int] = []
        self._rank: list[float] = []  # rank of the block's live heap entry, -1 when none

    @property
    def name(self) -> str:
        """``"prefix-freq"``."""
        return "prefix-freq"

    def __repr__(self) -> str:
        return f"PrefixFrequencyPolicy(queued={len(self._heap)}, inflation={self._inflation:.1f})"

    def _attached(self, num_blocks: int) -> None:
        self._uses = [0] * num_blocks
        self._rank = [-1.0] * num_blocks

    def on_touch(self, block: CpuBlock) -> None:
        """A hit: count it; a free block leaves the ranking until it is freed again."""
        block_id = block.block_id
        if block.block_hash is not None and self._uses[block_id]:
            self._uses[block_id] += 1
        if block.ref_cnt == 0:
            self._rank[block_id] = -1.0
            self._empty.pop(block_id, None)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        """Rank each block ``inflation + log2(1 + uses)``; queue empty blocks first."""
        uses, rank, empty, heap = self._uses, self._rank, self._empty, self._heap
        inflation = self._inflation
        for block in blocks:
            block_id = block.block_id
            if rank[block_id] >= 0 or block_id in empty:
                continue
            if block.block_hash is None:
                uses[block_id] = 0
                empty[block_id] = None
                continue
            count = uses[block_id] or 1
            uses[block_id] = count
            rank[block_id] = value = inflation + math.log2(1 + count)
            self._seq += 1
            heapq.heappush(heap, (value, self._seq, block_id))

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """Free unpublished blocks first, then the lowest ranks."""
        out: list[CpuBlock] = []
        self._take_empty(n, protect, out)
        heap, rank, blocks = self._heap, self._rank, self._blocks
        kept: list[tuple[float, int, int]] = []
        while len(out) < n:
            if not heap:
                raise InvariantError("PrefixFrequencyPolicy: no evictable block left")
            entry = heapq.heappop(heap)
            block_id = entry[2]
            if rank[block_id] != entry[0]:
                continue  # stale: the block was touched (or re-ranked) since
            block = blocks[block_id]
            if block in protect:
                kept.append(entry)
                continue
            rank[block_id] = -1.0
            self._uses[block_id] = 0
            self._inflation = entry[0]
            out.append(block)
        for entry in kept:
            heapq.heappush(heap, entry)
        if len(heap) > 4 * len(blocks) + 64:
            self._compact()
        return out

    def _compact(self) -> None:
        rank = self._rank
        self._heap = [e for e in self._heap if rank[e[2]] == e[0]]
        heapq.heapify(self._heap)

    def check(self) -> None:
        """Every free block is ranked once or queued as empty; no held block is ranked.

        Raises:
            InvariantError: a lost free block or a ranked held block.
        """
        self._check_empty()
        live = {e[2] for e in self._heap if self._rank[e[2]] == e[0]}
        for block in self._blocks:
            ranked = block.block_id in live
            if block.ref_cnt == 0 and not ranked and block.block_id not in self._empty:
                raise InvariantError(f"PrefixFrequencyPolicy: free block {block.block_id} is lost")
            if block.ref_cnt > 0 and ranked:
                raise InvariantError(
                    f"PrefixFrequencyPolicy: held block {block.block_id} is still ranked"
                )
