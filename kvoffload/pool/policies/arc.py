"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), over the pool's free blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, final

from kvoffload.errors import InvariantError
from kvoffload.pool.policies._common import GhostList, PolicyBase

if TYPE_CHECKING:
    from kvoffload.pool.block import CpuBlock

__all__ = ["ArcPolicy"]


@final
class ArcPolicy(PolicyBase):
    """ARC: a recency list and a frequency list whose split adapts to the workload.

    ``T1`` holds cached blocks hit no time since they were stored, ``T2`` blocks hit at
    least once, each in LRU order. ``B1`` and ``B2`` remember the hashes of blocks evicted
    from each. A block stored again while its hash is in ``B1`` says ``T1`` was too small
    and grows its target share ``p``; one found in ``B2`` shrinks it. Victims come from the
    LRU end of ``T1`` while ``T1`` is above ``p``, else from ``T2``.

    Blocks holding a reference stay in their list but are skipped when choosing victims:
    the pool never evicts them. A hit moves a block to the MRU end of ``T2`` when it is
    touched.
    """

    __slots__ = ("_b1", "_b2", "_capacity", "_p", "_t1", "_t2")

    def __init__(self) -> None:
        super().__init__()
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1 = GhostList(0)
        self._b2 = GhostList(0)
        self._p = 0.0
        self._capacity = 0

    @property
    def name(self) -> str:
        """``"arc"``."""
        return "arc"

    def __repr__(self) -> str:
        return (
            f"ArcPolicy(t1={len(self._t1)}, t2={len(self._t2)}, b1={len(self._b1)}, "
            f"b2={len(self._b2)}, p={self._p:.1f})"
        )

    def _attached(self, num_blocks: int) -> None:
        self._capacity = num_blocks
        self._b1 = GhostList(num_blocks)
        self._b2 = GhostList(2 * num_blocks)

    def on_touch(self, block: CpuBlock) -> None:
        """A hit: move the block to the MRU end of ``T2``."""
        block_id = block.block_id
        if block_id in self._t2:
            self._t2.move_to_end(block_id)
        elif self._t1.pop(block_id, 0) is None:
            self._t2[block_id] = None
        elif block.ref_cnt == 0:
            self._empty.pop(block_id, None)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        """A newly stored block enters ``T1``, or ``T2`` when its hash is a ghost."""
        for block in blocks:
            self._free_one(block)

    def _free_one(self, block: CpuBlock) -> None:
        block_id = block.block_id
        if block_id in self._t1 or block_id in self._t2:
            return
        block_hash = block.block_hash
        if block_hash is None:
            self._empty[block_id] = None
            return
        b1, b2 = self._b1, self._b2
        if block_hash in b1:
            self._p = min(float(self._capacity), self._p + max(len(b2) / len(b1), 1.0))
            b1.discard(block_hash)
            self._t2[block_id] = None
        elif block_hash in b2:
            self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
            b2.discard(block_hash)
            self._t2[block_id] = None
        else:
            self._t1[block_id] = None

    def _first_free(self, queue: OrderedDict[int, None], protect: Collection[CpuBlock]) -> int:
        blocks = self._blocks
        for block_id in queue:
            block = blocks[block_id]
            if block.ref_cnt == 0 and block not in protect:
                return block_id
        return -1

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """Free unpublished blocks first, then ARC's REPLACE step ``n`` times."""
        out: list[CpuBlock] = []
        self._take_empty(n, protect, out)
        blocks = self._blocks
        t1, t2 = self._t1, self._t2
        while len(out) < n:
            from_t1 = bool(t1) and (len(t1) > self._p or not t2)
            first, second = (t1, t2) if from_t1 else (t2, t1)
            block_id = self._first_free(first, protect)
            queue = first
            if block_id < 0:
                block_id = self._first_free(second, protect)
                queue = second
            if block_id < 0:
                raise InvariantError("ArcPolicy: no evictable block left in T1 or T2")
            del queue[block_id]
            block = blocks[block_id]
            block_hash = block.block_hash
            if block_hash is not None:
                if queue is t1:
                    self._b1.add(block_hash)
                    self._b1.trim(self._capacity - len(t1))
                else:
                    self._b2.add(block_hash)
                    self._b2.trim(2 * self._capacity - len(t1) - len(t2) - len(self._b1))
            out.append(block)
        return out

    def check(self) -> None:
        """Each free block is in exactly one of T1, T2 and the empty queue.

        Raises:
            InvariantError: a block is in two lists, or a free block in none.
        """
        self._check_empty()
        t1, t2, empty = set(self._t1), set(self._t2), set(self._empty)
        if t1 & t2 or t1 & empty or t2 & empty:
            raise InvariantError("ArcPolicy: a block is in two of T1, T2 and the empty queue")
        for block in self._blocks:
            listed = block.block_id in t1 or block.block_id in t2 or block.block_id in empty
            if block.ref_cnt == 0 and not listed:
                raise InvariantError(f"ArcPolicy: free block {block.block_id} is in no list")
        if not 0.0 <= self._p <= self._capacity:
            raise InvariantError(f"ArcPolicy: target p={self._p} outside [0, {self._capacity}]")
