"""The pool's record of one CPU block: `CpuBlock`, and its index type `BlockId`.

A block carries its own links for the free queue (`kvoffload.pool.free_queue`), so that
queue allocates nothing per operation; the pool (`kvoffload.pool.block_pool`) owns the
blocks, their reference counts and their published hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType, final

if TYPE_CHECKING:
    from kvoffload.hashing import BlockHash

__all__ = ["BlockId", "CpuBlock"]

BlockId = NewType("BlockId", int)
"""Index of a CPU block in the pool (and of its byte range in the host buffer)."""


class QueueNode:
    """A link in a free queue: the base of `CpuBlock` and of the queue's private sentinels."""

    __slots__ = ()

    _prev: QueueNode | None
    _next: QueueNode | None


@final
@dataclass(slots=True, eq=False)
class CpuBlock(QueueNode):
    """One CPU block of the pool.

    Attributes:
        block_id: index of the block, stable for the pool's life.
        ref_cnt: holders of the block; 0 means it sits in the free queue and may be evicted.
        block_hash: the key the block is published under, ``None`` until published.
        priority: retention priority (0, the default, for every block of a pool that uses
            none): a free block of a lower priority is evicted first. Raised by
            `CpuBlockPool.publish` and `CpuBlockPool.touch`, reset to 0 when the block is
            reallocated.
    """

    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    priority: int = 0
    _prev: QueueNode | None = field(default=None, init=False, repr=False)
    _next: QueueNode | None = field(default=None, init=False, repr=False)
    # The owning pool's token (not the pool: no reference cycle), for one identity test
    # per block in `CpuBlockPool.touch` and `CpuBlockPool.free`.
    _owner: object = field(default=None, init=False, repr=False)

    @property
    def is_free(self) -> bool:
        """Whether the block sits in a free queue."""
        return self._prev is not None
