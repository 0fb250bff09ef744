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

_SLACK = 64
"""Stale heap entries tolerated beyond the live ones before the heap is compacted."""


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

    The ranking is a heap whose entries for re-used blocks go stale rather than being
    removed; once the stale entries outnumber the live ones by more than 64 the heap is
    rebuilt from the live ones, so it never holds more than ``2 * ranked + 64`` entries
    (at most ``2C + 64`` for a pool of ``C`` blocks) whatever the traffic, at an
    amortised O(1) per operation.
    """

    __slots__ = ("_entry", "_heap", "_inflation", "_live", "_seq", "_uses")

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[float, int, int]] = []  # (rank, seq, block id)
        self._inflation = 0.0
        self._seq = 0
        self._uses: list[int] = []
        self._entry: list[int] = []  # seq of the block's live heap entry, 0 when none
        self._live = 0  # blocks with a live heap entry

    @property
    def name(self) -> str:
        """``"prefix-freq"``."""
        return "prefix-freq"

    def __repr__(self) -> str:
        return (
            f"PrefixFrequencyPolicy(ranked={self._live}, queued={len(self._heap)}, "
            f"inflation={self._inflation:.1f})"
        )

    def _attached(self, num_blocks: int) -> None:
        self._uses = [0] * num_blocks
        self._entry = [0] * num_blocks

    def on_touch(self, block: CpuBlock) -> None:
        """A hit: count it; a free block leaves the ranking until it is freed again."""
        block_id = block.block_id
        if block.block_hash is not None and self._uses[block_id]:
            self._uses[block_id] += 1
        if block.ref_cnt == 0:
            self._empty.pop(block_id, None)
            if self._entry[block_id]:
                self._entry[block_id] = 0  # its heap entry is stale from now on
                self._live -= 1
                if len(self._heap) > 2 * self._live + _SLACK:
                    self._compact()

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        """Rank each block ``inflation + log2(1 + uses)``; queue empty blocks first."""
        uses, entry, empty, heap = self._uses, self._entry, self._empty, self._heap
        inflation = self._inflation
        seq = self._seq
        for block in blocks:
            block_id = block.block_id
            if entry[block_id] or block_id in empty:
                continue
            if block.block_hash is None:
                uses[block_id] = 0
                empty[block_id] = None
                continue
            count = uses[block_id] or 1
            uses[block_id] = count
            seq += 1
            entry[block_id] = seq
            self._live += 1
            heapq.heappush(heap, (inflation + math.log2(1 + count), seq, block_id))
        self._seq = seq

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """Free unpublished blocks first, then the lowest ranks."""
        out: list[CpuBlock] = []
        self._take_empty(n, protect, out)
        heap, live_seq, blocks = self._heap, self._entry, self._blocks
        kept: list[tuple[float, int, int]] = []
        while len(out) < n:
            if not heap:
                raise InvariantError("PrefixFrequencyPolicy: no evictable block left")
            entry = heapq.heappop(heap)
            block_id = entry[2]
            if live_seq[block_id] != entry[1]:
                continue  # stale: the block was touched since
            block = blocks[block_id]
            if block in protect:
                kept.append(entry)
                continue
            live_seq[block_id] = 0
            self._live -= 1
            self._uses[block_id] = 0
            self._inflation = entry[0]
            out.append(block)
        for entry in kept:
            heapq.heappush(heap, entry)
        if len(heap) > 2 * self._live + _SLACK:
            self._compact()
        return out

    def _compact(self) -> None:
        """Drop the stale entries (O(len(heap)), paid for by the touches that made them)."""
        live_seq = self._entry
        self._heap = [e for e in self._heap if live_seq[e[2]] == e[1]]
        heapq.heapify(self._heap)

    def check(self) -> None:
        """Every free block is ranked once or queued as empty; no held block is ranked;
        the heap holds at most ``2 * ranked + 64`` entries.

        Raises:
            InvariantError: a lost free block, a ranked held block, a block ranked twice,
                a wrong count of ranked blocks, or a heap beyond its bound.
        """
        self._check_empty()
        entry = self._entry
        entries = [e[2] for e in self._heap if entry[e[2]] == e[1]]
        live = set(entries)
        if len(entries) != len(live):
            raise InvariantError("PrefixFrequencyPolicy: a block has two live heap entries")
        num_ranked = sum(1 for s in entry if s)
        if len(live) != num_ranked or num_ranked != self._live:
            raise InvariantError(
                f"PrefixFrequencyPolicy: {num_ranked} blocks are ranked, {len(live)} have a "
                f"live heap entry, {self._live} counted"
            )
        if len(self._heap) > 2 * self._live + _SLACK:
            raise InvariantError(
                f"PrefixFrequencyPolicy: the heap holds {len(self._heap)} entries, beyond "
                f"2 * {self._live} ranked blocks + {_SLACK}"
            )
        for block in self._blocks:
            ranked = block.block_id in live
            if block.ref_cnt == 0 and not ranked and block.block_id not in self._empty:
                raise InvariantError(f"PrefixFrequencyPolicy: free block {block.block_id} is lost")
            if block.ref_cnt > 0 and ranked:
                raise InvariantError(
                    f"PrefixFrequencyPolicy: held block {block.block_id} is still ranked"
                )
