"""S3-FIFO (Yang et al., SOSP 2023), over the pool's free blocks."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, final

from kvoffload.errors import InvariantError
from kvoffload.pool.policies._common import GhostList, PolicyBase

if TYPE_CHECKING:
    from kvoffload.pool.block import CpuBlock

__all__ = ["S3FifoPolicy"]

_NONE, _SMALL, _MAIN = 0, 1, 2
_MAX_FREQ = 3


@final
class S3FifoPolicy(PolicyBase):
    """S3-FIFO: a small probation FIFO, a main FIFO and a ghost list of hashes.

    A newly stored block enters the small queue (a tenth of the pool by default), or the
    main queue when its hash is still in the ghost list. Hits only bump a 2-bit counter;
    nothing moves on a hit. Evicting from the small queue promotes a block that was hit
    there at least ``promote_after`` times to the main queue and drops the others (their
    hashes go to the ghost list); the main queue gives a block with a non-zero counter
    another round (decrementing it), so one-off blocks leave quickly and reused ones stay.

    Blocks holding a reference keep their place and are passed over while choosing victims.

    Args:
        small_fraction: share of the pool the small queue aims at, in (0, 1).
        promote_after: hits in the small queue that earn a place in the main queue.

    Raises:
        ValueError: an argument out of range.
    """

    __slots__ = (
        "_freq",
        "_ghost",
        "_main",
        "_promote_after",
        "_small",
        "_small_fraction",
        "_small_target",
        "_where",
    )

    def __init__(self, *, small_fraction: float = 0.1, promote_after: int = 1) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction}")
        if not 1 <= promote_after <= _MAX_FREQ:
            raise ValueError(f"promote_after must be in [1, {_MAX_FREQ}], got {promote_after}")
        super().__init__()
        self._small_fraction = small_fraction
        self._promote_after = promote_after
        self._small: deque[int] = deque()
        self._main: deque[int] = deque()
        self._ghost = GhostList(0)
        self._where: list[int] = []
        self._freq: list[int] = []
        self._small_target = 1

    @property
    def name(self) -> str:
        """``"s3fifo"``."""
        return "s3fifo"

    def __repr__(self) -> str:
        return (
            f"S3FifoPolicy(small={len(self._small)}, main={len(self._main)}, "
            f"ghost={len(self._ghost)})"
        )

    def _attached(self, num_blocks: int) -> None:
        self._small_target = max(1, int(num_blocks * self._small_fraction))
        self._ghost = GhostList(num_blocks - self._small_target)
        self._where = [_NONE] * num_blocks
        self._freq = [0] * num_blocks

    def on_touch(self, block: CpuBlock) -> None:
        """A hit: bump the block's counter (it keeps its place)."""
        block_id = block.block_id
        if self._where[block_id] != _NONE:
            freq = self._freq[block_id]
            if freq < _MAX_FREQ:
                self._freq[block_id] = freq + 1
        elif block.ref_cnt == 0:
            self._empty.pop(block_id, None)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        """A newly stored block enters the small queue, or the main one if it is a ghost."""
        for block in blocks:
            self._free_one(block)

    def _free_one(self, block: CpuBlock) -> None:
        block_id = block.block_id
        if self._where[block_id] != _NONE:
            return
        block_hash = block.block_hash
        if block_hash is None:
            self._empty[block_id] = None
            return
        self._freq[block_id] = 0
        if self._ghost.discard(block_hash):
            self._where[block_id] = _MAIN
            self._main.append(block_id)
        else:
            self._where[block_id] = _SMALL
            self._small.append(block_id)

    def _evict_small(self, protect: Collection[CpuBlock]) -> CpuBlock | None:
        small, blocks, freq = self._small, self._blocks, self._freq
        skipped: list[int] = []
        found: CpuBlock | None = None
        for _ in range(len(small)):
            block_id = small.popleft()
            block = blocks[block_id]
            if freq[block_id] >= self._promote_after:
                freq[block_id] = 0
                self._where[block_id] = _MAIN
                self._main.append(block_id)
            elif block.ref_cnt or block in protect:
                skipped.append(block_id)
            else:
                self._where[block_id] = _NONE
                if block.block_hash is not None:
                    self._ghost.add(block.block_hash)
                found = block
                break
        small.extendleft(reversed(skipped))
        return found

    def _evict_main(self, protect: Collection[CpuBlock]) -> CpuBlock | None:
        main, blocks, freq = self._main, self._blocks, self._freq
        skipped: list[int] = []
        found: CpuBlock | None = None
        # Each pass decrements every counter, so (_MAX_FREQ + 1) passes reach any block.
        for _ in range((_MAX_FREQ + 1) * len(main)):
            if not main:
                break
            block_id = main.popleft()
            block = blocks[block_id]
            if freq[block_id]:
                freq[block_id] -= 1
                main.append(block_id)
            elif block.ref_cnt or block in protect:
                skipped.append(block_id)
            else:
                self._where[block_id] = _NONE
                found = block
                break
        main.extendleft(reversed(skipped))
        return found

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """Free unpublished blocks first, then S3-FIFO's eviction ``n`` times."""
        out: list[CpuBlock] = []
        self._take_empty(n, protect, out)
        while len(out) < n:
            if len(self._small) >= self._small_target or not self._main:
                block = self._evict_small(protect) or self._evict_main(protect)
            else:
                block = self._evict_main(protect) or self._evict_small(protect)
            if block is None:
                raise InvariantError("S3FifoPolicy: no evictable block left in either queue")
            out.append(block)
        return out

    def check(self) -> None:
        """Each free block is in exactly one queue; ``_where`` matches the queues.

        Raises:
            InvariantError: a block queued twice, a stale ``_where``, or a lost free block.
        """
        self._check_empty()
        small, main = list(self._small), list(self._main)
        if len(set(small)) != len(small) or len(set(main)) != len(main) or set(small) & set(main):
            raise InvariantError("S3FifoPolicy: a block is queued twice")
        where = [_NONE] * len(self._blocks)
        for block_id in small:
            where[block_id] = _SMALL
        for block_id in main:
            where[block_id] = _MAIN
        if where != self._where:
            raise InvariantError("S3FifoPolicy: per-block queue marks disagree with the queues")
        for block in self._blocks:
            lost = where[block.block_id] == _NONE and block.block_id not in self._empty
            if block.ref_cnt == 0 and lost:
                raise InvariantError(f"S3FifoPolicy: free block {block.block_id} is lost")
