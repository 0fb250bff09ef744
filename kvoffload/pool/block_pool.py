"""The CPU block pool: reference counts, the prefix-cache map and pluggable eviction.

A block is *free* when its ``ref_cnt`` is 0: it sits in the free queue and may be
evicted (reallocated) at any time, even while still published. Which free block is
reused first is the `EvictionPolicy`'s choice (LRU by default, on an inlined fast
path). A block with a reference is never evicted. A block is *published* (findable by
`CpuBlockPool.lookup()`) only after its store completed; the scheduler decides when.
Blocks carry a retention priority (`CpuBlock.priority`, 0 unless raised by `publish()`
or `touch()`): a free block of a lower priority is evicted first (see
`kvoffload.pool.priority`). `retain()` holds published blocks (a system prompt) with one
reference each, up to ``max_retained_blocks``, until `release_retained()`.
The pool touches no tensors.

The pool composes its parts and keeps the hot paths inlined here (LRU with no priority in
use: allocate, touch, free, publish, lookup): the free set by priority level and every
other policy's victim choice are `FreeLevels` (``priority.py``), the owners of retained
blocks `RetainedBlocks` (``retention.py``), the map's cold operations, its events and
counters `PrefixMap` (``prefix_map.py``), and the records ``events.py``.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from operator import length_hint
from typing import final

from kvoffload.errors import BlockStateError, InvariantError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block import BlockId, CpuBlock
from kvoffload.pool.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PoolEvent,
    PoolStatistics,
)
from kvoffload.pool.free_queue import LruFreeQueue
from kvoffload.pool.policies import EvictionPolicy
from kvoffload.pool.prefix_map import PrefixMap, publish_refused
from kvoffload.pool.priority import attach_policy, check_priority
from kvoffload.pool.retention import RetainedBlocks

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CpuBlockPool",
    "PoolEvent",
    "PoolStatistics",
]


@final
class CpuBlockPool:
    """Reference-counted CPU blocks with a hash map for prefix lookup and pluggable eviction.

    Args:
        num_blocks: number of CPU blocks.
        enable_events: record `BlockStored` / `BlockRemoved` events for
            `take_events()` (for KV-aware routers); off costs nothing.
        policy: which free block to reuse first: an `EvictionPolicy` (attached to this
            pool; not shareable), a registered name (``"lru"``, ``"arc"``, ``"s3fifo"``,
            ...), or ``None`` for LRU.
        max_retained_blocks: the most blocks `retain()` may hold at once (all owners
            together); ``None`` for a tenth of the pool, 0 to refuse every retain.

    Raises:
        ValueError: ``num_blocks`` is below 1, ``max_retained_blocks`` outside
            [0, num_blocks - 1], or the policy is already attached.
        ConfigError: ``policy`` names no registered policy (the message lists them).
    """

    __slots__ = (
        "_blocks",
        "_cached",
        "_enable_events",
        "_events",
        "_free",
        "_hooked",
        "_levels",
        "_map",
        "_num_blocks",
        "_on_lookup",
        "_plain",
        "_policy",
        "_retained",
        "_token",
    )

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_events: bool = False,
        policy: EvictionPolicy | str | None = None,
        max_retained_blocks: int | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._retained = RetainedBlocks(num_blocks, max_retained_blocks)
        self._num_blocks = num_blocks
        self._blocks = tuple(CpuBlock(BlockId(i)) for i in range(num_blocks))
        self._token = token = object()
        for block in self._blocks:
            block._owner = token
        self._free = LruFreeQueue(self._blocks)
        # The map and its event log; the inlined paths use the same dict and list.
        self._map = PrefixMap(enable_events=enable_events)
        self._cached = self._map.cached
        self._enable_events = enable_events
        self._events = self._map.events
        # The policy, its levels and its lookup hook (see `attach_policy`); a policy that
        # simulates pools of its own gets this class to make them with.
        self._policy, self._hooked, self._levels, self._on_lookup = attach_policy(
            policy, self._blocks, self._free, token, lambda n, name: CpuBlockPool(n, policy=name)
        )
        # LRU is the free queue itself, served by the inlined paths while no block has a
        # raised priority (the pool is _plain); the rest goes through the levels.
        self._plain = self._hooked is None

    def __repr__(self) -> str:
        return (
            f"CpuBlockPool(num_blocks={self._num_blocks}, num_free={self.num_free}, "
            f"num_cached={len(self._cached)})"
        )

    @property
    def num_blocks(self) -> int:
        """Pool size in blocks."""
        return self._num_blocks

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy attached to this pool."""
        return self._policy

    @property
    def num_free(self) -> int:
        """Blocks with no reference: allocatable, possibly still published."""
        return self._free._len + self._levels.upper_free

    @property
    def num_retained(self) -> int:
        """Distinct blocks `retain()` holds now, all owners together."""
        return len(self._retained)

    @property
    def max_retained_blocks(self) -> int:
        """The most blocks `retain()` may hold at once."""
        return self._retained.max_retained

    @property
    def num_cached(self) -> int:
        """Published blocks."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks that hold a reference, in [0, 1]."""
        return 1.0 - self.num_free / self._num_blocks

    def block(self, block_id: int) -> CpuBlock:
        """The block with id ``block_id``; `IndexError` if there is none."""
        if not 0 <= block_id < self._num_blocks:
            raise IndexError(f"block_id {block_id} out of range [0, {self._num_blocks})")
        return self._blocks[block_id]

    def is_cached(self, block_hash: BlockHash) -> bool:
        """Whether ``block_hash`` is published."""
        return block_hash in self._cached

    def get_cached(self, block_hash: BlockHash) -> CpuBlock | None:
        """The block published under ``block_hash``, or ``None``."""
        return self._cached.get(block_hash)

    # -- reference counting ----------------------------------------------------------------

    def allocate(
        self,
        n: int,
        *,
        protect: Collection[CpuBlock] = (),
        evicted: list[BlockHash] | None = None,
    ) -> list[CpuBlock]:
        """Take ``n`` free blocks chosen by the eviction policy, each with ``ref_cnt == 1``.

        A block that was still published is unpublished first (an eviction). Only free
        blocks (``ref_cnt == 0``) are ever taken.

        Args:
            n: blocks to take.
            protect: free blocks that must not be taken by this call; they keep their
                place in the eviction order (e.g. blocks a store plan just found cached).
            evicted: when given, the hashes of evicted blocks are appended to it.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are free (not counting protected
                ones); nothing changed.
            ValueError: ``n`` is negative.
            InvariantError: a policy named a block that is not free, is protected or is
                named twice; nothing changed.
        """
        free = self._free
        if not (self._plain and not protect and 0 < n <= free._len):
            blocks = self._levels.allocate(n, protect, self._map, evicted)
            self._plain = self._hooked is None and not self._levels.raised
            return blocks
        # The hot path (LRU, no priority, nothing protected): `LruFreeQueue.popleft_n()`
        # and each block's eviction inlined in one pass (the pool owns its queue). A
        # method call per evicted block costs the LRU replay 18 % more instructions
        # (`scripts/pool_lru_instructions.py`); with no ``evicted`` list and no events,
        # an eviction is only the map's entry and the block's hash.
        cached = self._cached
        num_cached = len(cached)
        blocks = []
        append = blocks.append
        head = free._head
        node = head._next
        if evicted is None and not self._enable_events:
            for _ in range(n):
                block: CpuBlock = node  # type: ignore[assignment]
                node = block._next
                block._prev = block._next = None
                block_hash = block.block_hash
                if block_hash is not None:
                    del cached[block_hash]
                    block.block_hash = None
                block.ref_cnt = 1
                append(block)
        else:
            events = self._events if self._enable_events else None
            for _ in range(n):
                block = node  # type: ignore[assignment]
                node = block._next
                block._prev = block._next = None
                block_hash = block.block_hash
                if block_hash is not None:
                    del cached[block_hash]
                    block.block_hash = None
                    if evicted is not None:
                        evicted.append(block_hash)
                    if events is not None:
                        events.append(BlockRemoved(block_hash, block.block_id))
                block.ref_cnt = 1
                append(block)
        head._next = node
        node._prev = head  # type: ignore[union-attr]
        free._len -= n
        if num_cached != len(cached):
            self._map.evictions += num_cached - len(cached)
        return blocks

    def touch(self, blocks: Iterable[CpuBlock], *, priority: int = 0) -> None:
        """Take one more reference on each block; a block going 0 → 1 leaves the free queue.

        Args:
            blocks: the blocks.
            priority: raise each block's retention priority to at least this (a block
                keeps the highest it was published or touched with until reallocated).

        Raises:
            BlockStateError: a block of another pool; nothing changed.
            InvalidInputError: a bad ``priority`` (see `check_priority`); nothing changed.
        """
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = list(blocks)
        token = self._token
        for block in blocks:
            if block._owner is not token:
                raise BlockStateError(f"block {block.block_id} belongs to another pool")
        if priority or not self._plain:
            self._levels.touch(blocks, check_priority(priority))
            if self._levels.raised:
                self._plain = False
            return
        # Hot path: LruFreeQueue.remove() inlined (the pool owns its queue).
        free = self._free
        unlinked = 0
        for block in blocks:
            if block.ref_cnt == 0:
                prev = block._prev
                if prev is None:
                    raise InvariantError(f"block {block.block_id} has ref_cnt 0 but is not free")
                nxt = block._next
                prev._next = nxt
                nxt._prev = prev  # type: ignore[union-attr]
                block._prev = block._next = None
                unlinked += 1
            block.ref_cnt += 1
        free._len -= unlinked

    def free(self, blocks: Sequence[CpuBlock]) -> None:
        """Drop one reference from each block.

        Blocks reaching 0 join the most recently used end in the order given, so under
        LRU the first one freed is evicted first: free a request's blocks tail first to
        keep its prefix longest. Other policies are told of each such block in the same
        order. A block listed twice loses two references.

        Raises:
            BlockStateError: a block already at ``ref_cnt == 0`` (double free), or a block
                of another pool; the blocks before it are restored, so nothing changed.
        """
        if not self._plain and self._levels.raised:
            self._levels.free(blocks)
            return
        # Hot path: LruFreeQueue.append() inlined (the pool owns its queue). The position
        # of a refused block is read off the iterator (exact for a list or a tuple), so
        # the loop keeps no index.
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = list(blocks)
        free = self._free
        tail = free._tail
        last = tail._prev
        linked = 0
        token = self._token
        it = iter(blocks)
        for block in it:
            ref_cnt = block.ref_cnt
            if ref_cnt <= 0 or block._owner is not token:
                done = len(blocks) - 1 - length_hint(it)
                self._levels.refuse_free(blocks, done, last, linked)
            block.ref_cnt = ref_cnt - 1
            if ref_cnt == 1:
                last._next = block  # type: ignore[union-attr]
                block._prev = last
                last = block
                linked += 1
        last._next = tail  # type: ignore[union-attr]
        tail._prev = last
        free._len += linked
        if linked and self._hooked is not None:
            # In the order they reached 0: a block listed twice does so at its last listing.
            zeroed = dict.fromkeys(reversed(blocks))
            self._hooked.on_free([b for b in reversed(zeroed) if b.ref_cnt == 0])

    def raise_priority(self, block: CpuBlock, priority: int) -> None:
        """Raise ``block``'s retention priority to at least ``priority``, taking no
        reference (a free block moves to the most recently used end of its new level
        under LRU; another policy keeps its place). Raises `BlockStateError` for another
        pool's block, `InvalidInputError` for a bad ``priority``."""
        if self._levels.raise_priority(block, priority):
            self._plain = False

    # -- the prefix-cache map ---------------------------------------------------------------

    def publish(self, block: CpuBlock, block_hash: BlockHash, priority: int = 0) -> bool:
        """Make a referenced block findable under ``block_hash``.

        Args:
            block: a block holding a reference.
            block_hash: its key.
            priority: raise the block's retention priority to at least this.

        Returns:
            ``True`` if ``block`` is now published under ``block_hash``; ``False`` if
            another block already holds that hash (the first keeps it; ``block`` stays
            unpublished and, once freed, is taken in LRU order like any other block).

        Raises:
            BlockStateError: ``block`` has no reference, is published under another hash,
                or belongs to another pool (it would be served for this pool's lookups).
            InvalidInputError: a bad ``priority`` (see `check_priority`).
        """
        # ``priority`` is not keyword-only: CPython 3.11 specializes no call to a function
        # with keyword-only parameters, and a store calls this once per block.
        if priority:
            check_priority(priority)
        if block._owner is not self._token or block.ref_cnt <= 0:
            raise publish_refused(block, self._token)
        current = block.block_hash
        if current is None:
            cached = self._cached
            if block_hash in cached and cached[block_hash] is not block:
                return False
            cached[block_hash] = block
            block.block_hash = block_hash
            if self._enable_events:
                self._events.append(BlockStored(block_hash, block.block_id))
        elif current != block_hash:
            raise BlockStateError(
                f"block {block.block_id} is already published under {current.hex()[:16]}…"
            )
        if priority and priority > block.priority:
            self._levels.raise_to(block, priority)
            self._plain = False
        return True

    def unpublish(self, block: CpuBlock) -> bool:
        """Make ``block`` unfindable (e.g. its data is suspect), its references unchanged;
        return whether it was published."""
        return self._map.unpublish(block)

    def unpublish_all(self) -> int:
        """Unpublish every block, referenced or not; return how many were published. Unlike
        `reset_prefix_cache()` this never refuses: references are unchanged (a block pinned
        by a load stays pinned, it just can no longer be found)."""
        return self._map.unpublish_all()

    def lookup(self, block_hashes: Iterable[BlockHash]) -> list[CpuBlock]:
        """The longest leading run of published blocks for ``block_hashes``.

        Does not take references: callers `touch()` what they keep. A policy with an
        ``on_lookup`` hook is told of the hashes looked up and how many hit.
        """
        if self._on_lookup is not None:
            return self._map.lookup_observed(block_hashes, self._on_lookup)
        m = self._map
        get = m.cached.get
        hits: list[CpuBlock] = []
        append = hits.append
        for block_hash in block_hashes:
            block = get(block_hash)
            if block is None:
                break
            append(block)
        m.lookups += 1
        m.hit_blocks += len(hits)
        return hits

    # -- retention ---------------------------------------------------------------------------

    def retain(
        self, block_hashes: Iterable[BlockHash], *, owner: Hashable, fit: bool = False
    ) -> list[CpuBlock]:
        """Hold the leading run of published blocks for ``block_hashes`` for ``owner``
        (any hashable name, e.g. ``"system-prompt"``), one reference per owner and block,
        until `release_retained(owner)`; return the run (`RetainedBlocks.retain`).

        With ``fit`` (a session hint) ``owner`` holds exactly the run afterwards, cut to
        fit: its blocks outside the run are released, those it keeps are not touched.

        Raises:
            InvalidInputError: it would hold more than ``max_retained_blocks`` distinct
                blocks (``fit``: the run is cut to fit instead); nothing changed.
        """
        return self._retained.retain(
            block_hashes, owner, self._cached.get, self.touch, self.free, fit=fit
        )

    def retainable(
        self, block_hashes: Iterable[BlockHash], owner: Hashable, *, fit: bool = True
    ) -> int:
        """How many blocks `retain(block_hashes, owner=owner, fit=fit)` could hold now
        (the published leading run within ``max_retained_blocks``); changes nothing
        (`RetainedBlocks.retainable`)."""
        return self._retained.retainable(block_hashes, owner, self._cached.get, fit=fit)

    def release_retained(self, owner: Hashable) -> int:
        """Drop every reference `retain()` took for ``owner``; return how many blocks.
        Raises `InvalidInputError` if ``owner`` retains nothing (released twice, or never)."""
        return self._retained.release(owner, self.free)

    @property
    def retained_owners(self) -> tuple[Hashable, ...]:
        """The owners that retain blocks now."""
        return self._retained.owners

    def retained_refs(self) -> dict[int, int]:
        """Block id → references `retain()` holds on it now (one per owner)."""
        return self._retained.refs()

    def reset_prefix_cache(self) -> bool:
        """Unpublish every block; ``False`` (and nothing changed) while any block holds a
        reference (a retained block does: release it first)."""
        return self._map.clear_if(self.num_free == self._num_blocks)

    # -- observation -------------------------------------------------------------------------

    def take_events(self) -> list[PoolEvent]:
        """Return and clear the events recorded since the last call (empty when disabled)."""
        return self._map.take_events()

    def statistics(self) -> PoolStatistics:
        """A snapshot of sizes and counters."""
        return self._map.statistics(self._num_blocks, self.num_free)

    def check_invariants(self) -> None:
        """Check DESIGN invariants 1 and 3 over the whole pool (O(num_blocks)), the levels,
        the retained set and the eviction policy's own bookkeeping.

        Raises:
            InvariantError: conservation, free-queue membership, the hash map or the
                policy's bookkeeping is broken.
        """
        self._levels.check(self._plain)
        self._retained.check(self._blocks)
        self._map.check(self._blocks)
        self._policy.check()
