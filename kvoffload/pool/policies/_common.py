"""Pieces the non-LRU policies share."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from kvoffload.errors import InvariantError

if TYPE_CHECKING:
    from kvoffload.hashing import BlockHash
    from kvoffload.pool.block import CpuBlock
    from kvoffload.pool.free_queue import LruFreeQueue

__all__ = ["GhostList", "PolicyBase"]


class GhostList:
    """Hashes of recently evicted blocks, oldest first, at most ``capacity`` of them.

    Remembers hashes only (no data), so a policy can tell a block that comes back soon
    after it was evicted from one never seen.
    """

    __slots__ = ("_entries", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._entries: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def add(self, block_hash: BlockHash) -> None:
        """Remember ``block_hash`` as the newest entry, forgetting the oldest beyond capacity."""
        entries = self._entries
        entries[block_hash] = None
        entries.move_to_end(block_hash)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def discard(self, block_hash: BlockHash) -> bool:
        """Forget ``block_hash``; return whether it was remembered."""
        return self._entries.pop(block_hash, 0) is None

    def trim(self, size: int) -> None:
        """Forget the oldest entries until at most ``size`` are left."""
        entries = self._entries
        while len(entries) > max(0, size):
            entries.popitem(last=False)


class PolicyBase:
    """Attachment, and a queue of free unpublished blocks that every policy reuses first.

    A free block with no hash holds nothing a lookup can find (its store failed or lost a
    race to another block with the same hash), so reusing it costs no hit.
    """

    __slots__ = ("_blocks", "_empty", "_free")

    def __init__(self) -> None:
        self._blocks: Sequence[CpuBlock] = ()
        self._free: LruFreeQueue | None = None
        self._empty: OrderedDict[int, None] = OrderedDict()

    def attach(self, blocks: Sequence[CpuBlock], free: LruFreeQueue) -> None:
        """Bind to a pool; every block starts free and unpublished.

        Raises:
            ValueError: already attached.
        """
        if self._free is not None:
            raise ValueError(f"this {type(self).__name__} is already attached to a pool")
        self._blocks = blocks
        self._free = free
        self._empty = OrderedDict.fromkeys(b.block_id for b in blocks)
        self._attached(len(blocks))

    def _attached(self, num_blocks: int) -> None:
        """Size per-block state (subclasses)."""

    def _take_empty(self, n: int, protect: Collection[CpuBlock], out: list[CpuBlock]) -> None:
        """Move up to ``n`` free unpublished blocks into ``out``."""
        if not self._empty:
            return
        blocks = self._blocks
        taken: list[int] = []
        for block_id in self._empty:
            block = blocks[block_id]
            if block.ref_cnt == 0 and block not in protect:
                taken.append(block_id)
                out.append(block)
                if len(taken) == n:
                    break
        for block_id in taken:
            del self._empty[block_id]

    def _check_empty(self) -> None:
        for block_id in self._empty:
            block = self._blocks[block_id]
            if block.ref_cnt != 0:
                raise InvariantError(
                    f"{type(self).__name__}: block {block_id} is queued as empty but holds "
                    f"{block.ref_cnt} reference(s)"
                )
