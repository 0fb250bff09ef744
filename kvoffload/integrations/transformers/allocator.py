"""The engine's GPU block allocator, with its own prefix cache.

Blocks are reference counted by the requests that use them. A full, computed block can be
registered under its chained hash (`GpuBlockAllocator.cache`); a later request whose prompt
starts with the same blocks takes them (`GpuBlockAllocator.match`) instead of computing or
loading them. A block no request uses goes to an LRU free list and keeps its hash until it
is handed out again, so the prefix cache holds as much as free memory allows.

Blocks that a kvoffload transfer in flight names are pinned through a `RefCountPinner`: the
allocator never hands such a block out. When its last pin goes, the pinner's release hook
(`GpuBlockAllocator.on_unpinned`) makes it available again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

from kvoffload.errors import BlockStateError
from kvoffload.hashing import BlockHash
from kvoffload.pinner import RefCountPinner

__all__ = ["AllocatorStatistics", "GpuBlockAllocator"]


@dataclass(frozen=True, slots=True)
class AllocatorStatistics:
    """Counters of a `GpuBlockAllocator`.

    Attributes:
        num_blocks: blocks in the cache.
        num_used: blocks referenced by a request.
        num_free: blocks that can be handed out now (unreferenced and not pinned).
        num_held: unreferenced blocks waiting for a transfer's pin to go.
        num_cached: blocks registered under a hash (used or not).
        prefix_hit_blocks: blocks `match()` returned.
        evicted_blocks: cached blocks handed out for new data (their hash dropped).
    """

    num_blocks: int
    num_used: int
    num_free: int
    num_held: int
    num_cached: int
    prefix_hit_blocks: int
    evicted_blocks: int


@final
class GpuBlockAllocator:
    """Reference-counted GPU blocks with an LRU prefix cache and transfer pins.

    Args:
        num_blocks: blocks in the engine's KV cache.
        enable_prefix_caching: keep and match hashes of full blocks.
    """

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        self._prefix = enable_prefix_caching
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._held: set[int] = set()  # ref 0 but pinned: handed out once unpinned
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.pinner = RefCountPinner(on_release=self.on_unpinned, on_pin=self.on_pinned)
        """The pinner to give `KVOffloader`; it reports released pins to this allocator."""
        self._hits = 0
        self._evicted = 0

    def __repr__(self) -> str:
        return (
            f"GpuBlockAllocator(blocks={self._num_blocks}, free={len(self._free)}, "
            f"held={len(self._held)}, cached={len(self._block_of)})"
        )

    @property
    def num_blocks(self) -> int:
        """Blocks in the cache."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks `allocate()` can hand out now."""
        return len(self._free)

    def match(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """Take the longest cached run of ``block_hashes[:max_blocks]``; one ref each.

        Returns:
            The GPU blocks holding that prefix, in order (empty without prefix caching).
        """
        if not self._prefix:
            return []
        found: list[int] = []
        for h in block_hashes[:max_blocks]:
            b = self._block_of.get(h)
            if b is None:
                break
            found.append(b)
        for b in found:
            self._ref(b)
        self._hits += len(found)
        return found

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block registered under ``block_hash`` (no ref taken), or ``None``."""
        return self._block_of.get(block_hash) if self._prefix else None

    def take(self, block_ids: Sequence[int]) -> None:
        """Take one ref on each of ``block_ids`` (cached blocks a prefix hit uses)."""
        for b in block_ids:
            self._ref(b)
        self._hits += len(block_ids)

    def allocate(self, n: int) -> list[int] | None:
        """Hand out ``n`` blocks (least recently freed first), one ref each.

        Returns:
            The blocks, or ``None`` (nothing taken) when fewer than ``n`` are free.
        """
        if n > len(self._free):
            return None
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._forget(b)
            self._refs[b] = 1
            out.append(b)
        return out

    def cache(self, block_hash: BlockHash, block_id: int) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if not self._prefix or block_id in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one ref from each block; unreferenced blocks become reusable.

        A freed block keeps its hash (a later `match()` may take it back) until it is
        handed out again. The tail of a table is freed first, so a request's later
        blocks are reused before its prefix.

        Raises:
            BlockStateError: a block holds no ref.
        """
        for b in reversed(block_ids):
            if self._refs[b] <= 0:
                raise BlockStateError(f"GPU block {b} freed but holds no reference")
        for b in reversed(block_ids):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if self.pinner.is_pinned(b):
                self._held.add(b)
            elif b in self._hash_of:
                self._free[b] = None  # cached: most recently used end
            else:
                self._free[b] = None
                self._free.move_to_end(b, last=False)  # no data worth keeping: reuse first

    def on_pinned(self, block_ids: Sequence[int]) -> None:
        """The pinner's pin hook: a free block a transfer now reads is held, not handed
        out, until its last pin goes (a cached block keeps its hash)."""
        for b in block_ids:
            if b in self._free:
                del self._free[b]
                self._held.add(b)

    def on_unpinned(self, block_ids: Sequence[int]) -> None:
        """The pinner's release hook: unreferenced blocks whose last pin went are free."""
        for b in block_ids:
            if b in self._held:
                self._held.discard(b)
                self._free[b] = None

    def ref_count(self, block_id: int) -> int:
        """How many requests' tables hold ``block_id`` (the references `allocate` and
        `match` gave and `free` has not taken back)."""
        return self._refs[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether a block is registered under a hash."""
        return block_id in self._hash_of

    def statistics(self) -> AllocatorStatistics:
        """The counters."""
        return AllocatorStatistics(
            num_blocks=self._num_blocks,
            num_used=self._num_blocks - len(self._free) - len(self._held),
            num_free=len(self._free),
            num_held=len(self._held),
            num_cached=len(self._block_of),
            prefix_hit_blocks=self._hits,
            evicted_blocks=self._evicted,
        )

    def check_invariants(self) -> None:
        """Check the allocator's bookkeeping.

        Raises:
            BlockStateError: a block is both free and used, pinned and free, or a hash
                maps to the wrong block.
        """
        for b in range(self._num_blocks):
            free, held, ref = b in self._free, b in self._held, self._refs[b]
            if (ref > 0) + free + held != 1:
                raise BlockStateError(f"GPU block {b}: refs={ref} free={free} held={held}")
            if free and self.pinner.is_pinned(b):
                raise BlockStateError(f"GPU block {b} is free but pinned by a transfer")
        for h, b in self._block_of.items():
            if self._hash_of.get(b) != h:
                raise BlockStateError(f"GPU block {b}: hash maps disagree")

    # -- internals ---------------------------------------------------------------------------

    def _ref(self, b: int) -> None:
        if self._refs[b] == 0:
            if b in self._free:
                del self._free[b]
            else:
                self._held.discard(b)
        self._refs[b] += 1

    def _forget(self, b: int) -> None:
        h = self._hash_of.pop(b, None)
        if h is not None:
            del self._block_of[h]
            self._evicted += 1
