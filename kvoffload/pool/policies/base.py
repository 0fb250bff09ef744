"""The `EvictionPolicy` protocol: how `CpuBlockPool` asks which free block to reuse.

The pool stays the owner of every reference count and of the free queue: a block is free
(evictable) exactly when its ``ref_cnt`` is 0, whatever the policy. A policy only *ranks*
the free blocks. The pool tells it what happened to each block and asks it for victims:

* `EvictionPolicy.on_touch`: a block is about to take one more reference (a prefix hit
  pinning it for a load, or any other holder). ``block.ref_cnt`` is still the old count,
  so ``block.ref_cnt == 0`` means the block leaves the free set now.
* `EvictionPolicy.on_free`: blocks whose last reference one `CpuBlockPool.free` call
  dropped; they are free again. Each ``block_hash`` says whether the block holds
  published data (``None``: it holds nothing findable and is the cheapest block to
  reuse). They come in the order the caller gave them, once each; the scheduler and the
  replay free a request's blocks together, tail first, so one call is one prefix chain
  (or a few).
* ``on_lookup(block_hashes, hits)``, optional: a policy that defines it is told of every
  `CpuBlockPool.lookup`, with the hashes looked up (a sequence, in prefix order) and how
  many of them hit, after the lookup. It is how `AdaptivePolicy` sees a request's misses,
  which no other call carries. It is not a member of the protocol, so a policy without it
  still is an `EvictionPolicy`; the pool looks for it once, when the policy is attached,
  and LRU and the other built-in policies, which lack it, pay nothing for it.
* `EvictionPolicy.victims`: pick blocks to reuse. The pool checks the answer (distinct,
  free, not protected, as many as asked) before it changes anything, so a faulty policy
  raises `InvariantError` instead of evicting a block that holds a reference.

A policy is attached to one pool (`EvictionPolicy.attach`) and keeps whatever per-block
state it needs in arrays indexed by ``block_id``. LRU needs none: the pool's own free queue
is the LRU order, and the pool runs its fast path for `LruPolicy` without calling it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvoffload.pool.block import CpuBlock
    from kvoffload.pool.free_queue import LruFreeQueue

__all__ = ["EvictionPolicy"]


@runtime_checkable
class EvictionPolicy(Protocol):
    """Ranks a `CpuBlockPool`'s free blocks for reuse.

    Implementations must be deterministic (the same calls give the same victims) and must
    never return a block with a reference: the pool verifies every answer.
    """

    @property
    def name(self) -> str:
        """The name `OffloadConfig.eviction_policy` and ``kvoffload replay`` use."""
        ...

    def attach(self, blocks: Sequence[CpuBlock], free: LruFreeQueue) -> None:
        """Bind the policy to a pool; called once, by the pool's constructor.

        Args:
            blocks: every block of the pool, indexed by ``block_id``; all free and
                unpublished at this point.
            free: the pool's free queue in LRU order (read-only for the policy: iterate it,
                never link or unlink blocks).

        Raises:
            ValueError: the policy is already attached to a pool.
        """
        ...

    def on_touch(self, block: CpuBlock) -> None:
        """``block`` is about to take a reference (``block.ref_cnt`` is the old count)."""
        ...

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        """``blocks`` (freed by one call, in its order) lost their last reference."""
        ...

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """Choose ``n`` distinct free blocks, none in ``protect``, to be reused now.

        The pool guarantees that at least ``n`` such blocks exist. The returned blocks are
        still published (``block_hash`` is set) when the policy sees them, so a policy can
        remember what it evicted; the pool unpublishes and allocates them right after.

        Returns:
            exactly ``n`` blocks.
        """
        ...

    def check(self) -> None:
        """Check the policy's own bookkeeping against the pool (O(num_blocks)).

        Raises:
            InvariantError: the policy's state is inconsistent.
        """
        ...
