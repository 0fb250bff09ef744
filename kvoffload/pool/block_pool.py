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
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import final

from kvoffload.errors import BlockStateError, InvalidInputError, InvariantError, OutOfBlocksError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block import BlockId, CpuBlock
from kvoffload.pool.free_queue import LruFreeQueue
from kvoffload.pool.policies import EvictionPolicy, LruPolicy, make_policy
from kvoffload.pool.priority import LevelGuard, check_priority, default_max_retained

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CpuBlockPool",
    "PoolEvent",
    "PoolStatistics",
]

_LookupHook = Callable[[Sequence[BlockHash], int], None]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A block became findable under ``block_hash``."""

    block_hash: BlockHash
    block_id: BlockId


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block is no longer findable under ``block_hash`` (evicted or unpublished)."""

    block_hash: BlockHash
    block_id: BlockId


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped by `CpuBlockPool.reset_prefix_cache()`."""


PoolEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of a `CpuBlockPool`.

    Attributes:
        num_blocks: CPU blocks in the pool.
        num_free: blocks no request or transfer holds, which an allocation may reuse.
        num_cached: blocks whose hash is published for lookup.
        lookups: prefix lookups made in the pool (calls to ``lookup()``).
        hit_blocks: blocks the pool's lookups returned (prefix hits).
        evictions: published blocks an allocation reused, dropping their hash from
            lookup.
    """

    num_blocks: int
    num_free: int
    num_cached: int
    lookups: int
    hit_blocks: int
    evictions: int


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
        "_evictions",
        "_free",
        "_hit_blocks",
        "_hooked",
        "_level_free",
        "_levels",
        "_lookups",
        "_max_retained",
        "_num_blocks",
        "_on_lookup",
        "_plain",
        "_policy",
        "_raised",
        "_retained",
        "_retainers",
        "_token",
        "_upper_free",
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
        if max_retained_blocks is None:
            max_retained_blocks = default_max_retained(num_blocks)
        if not 0 <= max_retained_blocks < num_blocks:
            raise ValueError(
                f"max_retained_blocks must be in [0, {num_blocks - 1}] for a pool of "
                f"{num_blocks} blocks, got {max_retained_blocks}"
            )
        self._max_retained = max_retained_blocks
        self._num_blocks = num_blocks
        self._blocks = tuple(CpuBlock(BlockId(i)) for i in range(num_blocks))
        self._token = token = object()
        for block in self._blocks:
            block._owner = token
        self._free = LruFreeQueue(self._blocks)
        self._cached: dict[BlockHash, CpuBlock] = {}
        self._enable_events = enable_events
        self._events: list[PoolEvent] = []
        self._lookups = 0
        self._hit_blocks = 0
        self._evictions = 0
        self._policy = make_policy(policy)
        self._policy.attach(self._blocks, self._free)
        # A policy that simulates pools of its own (the adaptive one) gets this class to
        # make them with, so the policies never import the pool.
        bind = getattr(self._policy, "bind_pool_factory", None)
        if callable(bind):
            bind(lambda n, name: CpuBlockPool(n, policy=name))
        # LRU is the free queue itself: the inlined paths below serve it without calls.
        self._hooked = None if isinstance(self._policy, LruPolicy) else self._policy
        # Priorities. Under LRU, a free block of priority p > 0 sits in _levels[p] (level 0
        # is _free); other policies keep every free block in _free and _level_free counts
        # those of each p > 0. _raised counts blocks whose priority is not 0; while it is
        # 0 under LRU the pool is _plain and runs the single-queue fast paths.
        self._levels: dict[int, LruFreeQueue] = {}
        self._level_free: dict[int, int] = {}
        self._upper_free = 0
        self._raised = 0
        self._plain = self._hooked is None
        # Retention: owner -> its blocks; block_id -> how many owners hold it.
        self._retained: dict[Hashable, list[CpuBlock]] = {}
        self._retainers: dict[int, int] = {}
        # The optional lookup hook (see `EvictionPolicy`); ``None`` for every built-in
        # policy but the adaptive one, and then `lookup()` costs one test more.
        on_lookup = getattr(self._hooked, "on_lookup", None)
        self._on_lookup: _LookupHook | None = on_lookup if callable(on_lookup) else None

    def __repr__(self) -> str:
        return (
            f"CpuBlockPool(num_blocks={self._num_blocks}, num_free={self.num_free}, "
            f"num_cached={len(self._cached)})"
        )

    # -- sizes ---------------------------------------------------------------------------

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
        return self._free._len + self._upper_free

    @property
    def num_retained(self) -> int:
        """Distinct blocks `retain()` holds now, all owners together."""
        return len(self._retainers)

    @property
    def max_retained_blocks(self) -> int:
        """The most blocks `retain()` may hold at once."""
        return self._max_retained

    @property
    def num_cached(self) -> int:
        """Published blocks."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks that hold a reference, in [0, 1]."""
        return 1.0 - self.num_free / self._num_blocks

    def block(self, block_id: int) -> CpuBlock:
        """The block with id ``block_id``.

        Raises:
            IndexError: no such block.
        """
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
        if self._plain and not protect and 0 < n <= free._len:
            return self._allocate_lru(n, evicted)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if self._raised:
            blocks = self._victims_by_level(n, protect)
        elif self._hooked is not None:
            blocks = self._policy_victims(n, protect)
        elif protect:
            available = len(free) - sum(1 for b in set(protect) if b.ref_cnt == 0)
            if n > available:
                raise OutOfBlocksError(n, available)
            blocks = []
            if n:
                for block in free.iter_after(None):
                    if block not in protect:
                        blocks.append(block)
                        if len(blocks) == n:
                            break
                remove = free.remove
                for block in blocks:
                    remove(block)
        else:
            if n > len(free):
                raise OutOfBlocksError(n, len(free))
            blocks = []  # n == 0
        cached = self._cached
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                del cached[block_hash]
                block.block_hash = None
                self._evictions += 1
                if evicted is not None:
                    evicted.append(block_hash)
                if self._enable_events:
                    self._events.append(BlockRemoved(block_hash, block.block_id))
            if block.priority:
                block.priority = 0
                self._raised -= 1
            block.ref_cnt = 1
        self._plain = self._hooked is None and not self._raised
        return blocks

    def _allocate_lru(self, n: int, evicted: list[BlockHash] | None) -> list[CpuBlock]:
        """`allocate()`'s hot path under LRU: ``0 < n <= num_free``, nothing protected.

        `LruFreeQueue.popleft_n()` and the eviction of each block in one pass (the pool
        owns its queue). The eviction is written out here as in `allocate()`'s loop on
        purpose: a method call per evicted block costs the LRU replay 18 % more
        instructions (`scripts/pool_lru_instructions.py`).
        """
        free = self._free
        cached = self._cached
        blocks: list[CpuBlock] = []
        append = blocks.append
        head = free._head
        node = head._next
        for _ in range(n):
            block: CpuBlock = node  # type: ignore[assignment]
            node = block._next
            block._prev = block._next = None
            block_hash = block.block_hash
            if block_hash is not None:
                del cached[block_hash]
                block.block_hash = None
                self._evictions += 1
                if evicted is not None:
                    evicted.append(block_hash)
                if self._enable_events:
                    self._events.append(BlockRemoved(block_hash, block.block_id))
            block.ref_cnt = 1
            append(block)
        head._next = node
        node._prev = head  # type: ignore[union-attr]
        free._len -= n
        return blocks

    def touch(self, blocks: Iterable[CpuBlock], *, priority: int = 0) -> None:
        """Take one more reference on each block; a block going 0 → 1 leaves the free queue.

        Args:
            blocks: the blocks.
            priority: raise each block's retention priority to at least this (a block
                keeps the highest it was published or touched with until reallocated).

        Raises:
            BlockStateError: a block of another pool; nothing changed.
            InvalidInputError: ``priority`` is not an int in [0, `MAX_PRIORITY`]; nothing
                changed.
        """
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = list(blocks)
        token = self._token
        for block in blocks:
            if block._owner is not token:
                raise BlockStateError(f"block {block.block_id} belongs to another pool")
        if priority or not self._plain:
            self._touch_levels(blocks, check_priority(priority))
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
        if self._raised:
            self._free_levels(blocks)
            return
        # Hot path: LruFreeQueue.append() inlined (the pool owns its queue).
        free = self._free
        tail = free._tail
        last = tail._prev
        linked = 0
        token = self._token
        for done, block in enumerate(blocks):
            ref_cnt = block.ref_cnt
            if ref_cnt <= 0 or block._owner is not token:
                last._next = tail  # type: ignore[union-attr]
                tail._prev = last
                free._len += linked
                self._undo_free(blocks, done)
                if ref_cnt > 0:
                    raise BlockStateError(f"block {block.block_id} belongs to another pool")
                raise BlockStateError(
                    f"free of block {block.block_id} whose ref_cnt is {ref_cnt} (double free)"
                )
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

    def _undo_free(self, blocks: Sequence[CpuBlock], done: int) -> None:
        remove = self._free.remove
        for block in reversed(blocks[:done]):
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    # -- the policy hook (every policy but LRU) ----------------------------------------------

    def _touch_levels(self, blocks: Iterable[CpuBlock], priority: int) -> None:
        hooked = self._hooked
        on_touch = hooked.on_touch if hooked is not None else None
        for block in blocks:
            if block.ref_cnt == 0:
                if block._prev is None:
                    raise InvariantError(f"block {block.block_id} has ref_cnt 0 but is not free")
                if on_touch is not None:
                    on_touch(block)
                self._unlink_free(block)
            elif on_touch is not None:
                on_touch(block)
            block.ref_cnt += 1
            if priority > block.priority:
                self._raise(block, priority)

    def _raise(self, block: CpuBlock, priority: int) -> None:
        """Raise a referenced block's priority (it sits in no free queue)."""
        if not block.priority:
            self._raised += 1
            self._plain = False
        block.priority = priority

    def _unlink_free(self, block: CpuBlock) -> None:
        """Take a free block out of the free set (whichever queue or count holds it)."""
        p = block.priority
        if not p:
            self._free.remove(block)
        elif self._hooked is not None:
            self._free.remove(block)
            left = self._level_free[p] - 1
            if left:
                self._level_free[p] = left
            else:
                del self._level_free[p]
        else:
            queue = self._levels[p]
            queue.remove(block)
            self._upper_free -= 1
            if not queue._len:
                del self._levels[p]

    def _link_free(self, block: CpuBlock) -> None:
        """Put a block whose last reference went at the MRU end of its level."""
        p = block.priority
        if not p:
            self._free.append(block)
        elif self._hooked is not None:
            self._free.append(block)
            self._level_free[p] = self._level_free.get(p, 0) + 1
        else:
            queue = self._levels.get(p)
            if queue is None:
                queue = self._levels[p] = LruFreeQueue()
            queue.append(block)
            self._upper_free += 1

    def _free_levels(self, blocks: Sequence[CpuBlock]) -> None:
        token = self._token
        for done, block in enumerate(blocks):
            ref_cnt = block.ref_cnt
            if ref_cnt <= 0 or block._owner is not token:
                for undo in blocks[:done]:
                    undo.ref_cnt += 1
                if ref_cnt > 0:
                    raise BlockStateError(f"block {block.block_id} belongs to another pool")
                raise BlockStateError(
                    f"free of block {block.block_id} whose ref_cnt is {ref_cnt} (double free)"
                )
            block.ref_cnt = ref_cnt - 1
        # In the order they reached 0: a block listed twice does so at its last listing.
        zeroed = [b for b in reversed(dict.fromkeys(reversed(blocks))) if b.ref_cnt == 0]
        for block in zeroed:
            self._link_free(block)
        if zeroed and self._hooked is not None:
            self._hooked.on_free(zeroed)

    def _victims_by_level(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """Free blocks for `allocate()` while priorities are in use: lowest level first.

        Under LRU each level's queue is taken in order; another policy is asked for each
        level's share with a `LevelGuard` that hides the other levels.
        """
        guarded = {b for b in protect if b.ref_cnt == 0 and b._owner is self._token}
        available = self.num_free - len(guarded)
        if n > available:
            raise OutOfBlocksError(n, available)
        if not n:
            return []
        out: list[CpuBlock] = []
        if self._hooked is None:
            queues = [self._free, *(q for _, q in sorted(self._levels.items()))]
            for queue in queues:
                for block in queue:
                    if block not in guarded:
                        out.append(block)
                        if len(out) == n:
                            break
                if len(out) == n:
                    break
            for block in out:
                self._unlink_free(block)
            return out
        counts = dict(self._level_free)
        counts[0] = self._free._len - sum(counts.values())
        for block in guarded:
            counts[block.priority] -= 1
        for level in sorted(counts):
            want = min(n - len(out), counts[level])
            if want <= 0:
                continue
            chosen = self._policy_victims(want, LevelGuard(level, protect), level)
            for block in chosen:
                block.ref_cnt = 1  # taken: a later level's ask must not see it free
            out.extend(chosen)
            if len(out) == n:
                break
        return out

    def _policy_victims(
        self, n: int, protect: Collection[CpuBlock], level: int | None = None
    ) -> list[CpuBlock]:
        free = self._free
        if level is None:
            if protect:
                available = len(free) - sum(1 for b in set(protect) if b.ref_cnt == 0)
            else:
                available = len(free)
            if n > available:
                raise OutOfBlocksError(n, available)
            if not n:
                return []
        policy = self._policy
        blocks = policy.victims(n, protect)
        seen: set[int] = set()
        for block in blocks:
            if (
                block.ref_cnt != 0
                or block._prev is None
                or block in protect
                or block.block_id in seen
                or self._blocks[block.block_id] is not block
                or (level is not None and block.priority != level)
            ):
                raise InvariantError(
                    f"eviction policy {policy.name!r} chose block {block.block_id} "
                    f"(ref_cnt={block.ref_cnt}, free={block._prev is not None}, "
                    f"protected={block in protect}, repeated={block.block_id in seen})"
                )
            seen.add(block.block_id)
        if len(blocks) != n:
            raise InvariantError(
                f"eviction policy {policy.name!r} chose {len(blocks)} blocks, {n} were asked for"
            )
        if level:
            for block in blocks:
                self._unlink_free(block)
        else:
            remove = free.remove
            for block in blocks:
                remove(block)
        return blocks

    # -- the prefix-cache map ---------------------------------------------------------------

    def publish(self, block: CpuBlock, block_hash: BlockHash, *, priority: int = 0) -> bool:
        """Make a referenced block findable under ``block_hash``.

        Args:
            block: a block holding a reference.
            block_hash: its key.
            priority: raise the block's retention priority to at least this when it is
                published (or already was, under this hash).

        Returns:
            ``True`` if ``block`` is now published under ``block_hash``; ``False`` if
            another block already holds that hash (the first keeps it; ``block`` stays
            unpublished and, once freed, is taken in LRU order like any other block).

        Raises:
            BlockStateError: ``block`` has no reference, is published under another hash,
                or belongs to another pool (it would be served for this pool's lookups).
            InvalidInputError: ``priority`` is not an int in [0, `MAX_PRIORITY`].
        """
        if priority:
            check_priority(priority)
        if block._owner is not self._token:
            raise BlockStateError(f"block {block.block_id} belongs to another pool")
        if block.ref_cnt <= 0:
            raise BlockStateError(
                f"publish of block {block.block_id} with ref_cnt {block.ref_cnt}: "
                "only a referenced block may be published"
            )
        current = block.block_hash
        if current is not None:
            if current == block_hash:
                if priority > block.priority:
                    self._raise(block, priority)
                return True
            raise BlockStateError(
                f"block {block.block_id} is already published under {current.hex()[:16]}…"
            )
        holder = self._cached.setdefault(block_hash, block)
        if holder is not block:
            return False
        block.block_hash = block_hash
        if priority > block.priority:
            self._raise(block, priority)
        if self._enable_events:
            self._events.append(BlockStored(block_hash, block.block_id))
        return True

    def unpublish(self, block: CpuBlock) -> bool:
        """Make ``block`` unfindable (e.g. its data is suspect); its references are unchanged.

        Returns:
            whether it was published.
        """
        block_hash = block.block_hash
        if block_hash is None:
            return False
        del self._cached[block_hash]
        block.block_hash = None
        if self._enable_events:
            self._events.append(BlockRemoved(block_hash, block.block_id))
        return True

    def unpublish_all(self) -> int:
        """Unpublish every block, referenced or not; return how many were published.

        Unlike `reset_prefix_cache()` this never refuses: references are unchanged, so
        a block pinned by a load stays pinned, it just can no longer be found.
        """
        count = len(self._cached)
        if self._enable_events:
            self._events.extend(BlockRemoved(h, b.block_id) for h, b in self._cached.items())
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return count

    def lookup(self, block_hashes: Iterable[BlockHash]) -> list[CpuBlock]:
        """The longest leading run of published blocks for ``block_hashes``.

        Does not take references: callers `touch()` what they keep. A policy with an
        ``on_lookup`` hook is told of the hashes looked up and how many hit.
        """
        if self._on_lookup is not None:
            return self._lookup_observed(block_hashes, self._on_lookup)
        get = self._cached.get
        hits: list[CpuBlock] = []
        append = hits.append
        for block_hash in block_hashes:
            block = get(block_hash)
            if block is None:
                break
            append(block)
        self._lookups += 1
        self._hit_blocks += len(hits)
        return hits

    def _lookup_observed(
        self, block_hashes: Iterable[BlockHash], on_lookup: _LookupHook
    ) -> list[CpuBlock]:
        if type(block_hashes) is not list and type(block_hashes) is not tuple:
            block_hashes = list(block_hashes)
        get = self._cached.get
        hits: list[CpuBlock] = []
        for block_hash in block_hashes:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        self._lookups += 1
        self._hit_blocks += len(hits)
        on_lookup(block_hashes, len(hits))
        return hits

    # -- retention ---------------------------------------------------------------------------

    def retain(self, block_hashes: Iterable[BlockHash], *, owner: Hashable) -> list[CpuBlock]:
        """Keep the leading run of published blocks for ``block_hashes`` until released.

        Each block the run holds takes one reference for ``owner`` (one per owner and
        block, however often it is retained), so it is never evicted, whatever its
        priority, until `release_retained(owner)`. Hashes past the first one not
        published are ignored: a prefix hit cannot reach them. The lookup counters are
        not changed.

        Args:
            block_hashes: the prefix's block hashes, in order.
            owner: any hashable name for the holder (e.g. ``"system-prompt"``).

        Returns:
            the blocks ``owner`` now retains for this prefix (the leading run).

        Raises:
            InvalidInputError: retaining them would hold more than ``max_retained_blocks``
                distinct blocks; nothing changed.
        """
        get = self._cached.get
        run: list[CpuBlock] = []
        for block_hash in block_hashes:
            block = get(block_hash)
            if block is None:
                break
            run.append(block)
        held = self._retained.get(owner, [])
        have = {b.block_id for b in held}
        new = [b for b in dict.fromkeys(run) if b.block_id not in have]
        more = sum(1 for b in new if b.block_id not in self._retainers)
        if len(self._retainers) + more > self._max_retained:
            raise InvalidInputError(
                f"retain for owner {owner!r} would hold {len(self._retainers) + more} blocks, "
                f"over max_retained_blocks={self._max_retained} "
                f"({len(self._retainers)} held, {more} more asked)"
            )
        if new:
            self.touch(new)
            retainers = self._retainers
            for block in new:
                retainers[block.block_id] = retainers.get(block.block_id, 0) + 1
            self._retained[owner] = held + new
        return run

    def release_retained(self, owner: Hashable) -> int:
        """Drop every reference `retain()` took for ``owner``; return how many blocks.

        The blocks join the free set (most recently used end of their level) unless
        something else still holds them.

        Raises:
            InvalidInputError: ``owner`` retains nothing (released twice, or never).
        """
        held = self._retained.pop(owner, None)
        if held is None:
            raise InvalidInputError(f"owner {owner!r} retains no block in this pool")
        retainers = self._retainers
        for block in held:
            left = retainers[block.block_id] - 1
            if left:
                retainers[block.block_id] = left
            else:
                del retainers[block.block_id]
        held.reverse()  # tail first, as a request frees: the prefix's head is kept longest
        self.free(held)
        return len(held)

    @property
    def retained_owners(self) -> tuple[Hashable, ...]:
        """The owners that retain blocks now."""
        return tuple(self._retained)

    def reset_prefix_cache(self) -> bool:
        """Unpublish every block.

        Returns:
            ``False`` (and changes nothing) while any block holds a reference (a
            retained block does: release it first).
        """
        if self.num_free != self._num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self._enable_events:
            self._events.append(AllBlocksCleared())
        return True

    # -- observation -------------------------------------------------------------------------

    def take_events(self) -> list[PoolEvent]:
        """Return and clear the events recorded since the last call (empty when disabled)."""
        events, self._events = self._events, []
        return events

    def statistics(self) -> PoolStatistics:
        """A snapshot of sizes and counters."""
        return PoolStatistics(
            num_blocks=self._num_blocks,
            num_free=self.num_free,
            num_cached=len(self._cached),
            lookups=self._lookups,
            hit_blocks=self._hit_blocks,
            evictions=self._evictions,
        )

    def check_invariants(self) -> None:
        """Check DESIGN invariants 1 and 3 over the whole pool (O(num_blocks)).

        Also runs the eviction policy's own check.

        Raises:
            InvariantError: conservation, free-queue membership, the hash map or the
                policy's bookkeeping is broken.
        """
        queued = self._free.check()
        level_of = dict.fromkeys((id(b) for b in queued), 0)
        for level, queue in self._levels.items():
            if self._hooked is not None or level <= 0 or not len(queue):
                raise InvariantError(f"free queue of level {level} should not exist")
            for block in queue.check():
                level_of[id(block)] = level
                queued.append(block)
        if self._upper_free != len(queued) - self._free._len:
            raise InvariantError(
                f"upper levels count {self._upper_free} free blocks, hold "
                f"{len(queued) - self._free._len}"
            )
        self._check_priorities(level_of)
        self._check_retained()
        queued_ids = level_of
        referenced = 0
        for block in self._blocks:
            if block.ref_cnt < 0:
                raise InvariantError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            in_queue = id(block) in queued_ids
            if in_queue != (block.ref_cnt == 0):
                raise InvariantError(
                    f"block {block.block_id}: ref_cnt={block.ref_cnt} but "
                    f"{'in' if in_queue else 'not in'} the free queue"
                )
            if block.ref_cnt > 0:
                referenced += 1
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise InvariantError(
                    f"block {block.block_id} carries a hash the map does not point at it"
                )
        if len(queued) + referenced != self._num_blocks:
            raise InvariantError(
                f"conservation: free {len(queued)} + referenced {referenced} != {self._num_blocks}"
            )
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise InvariantError(
                    f"map entry for block {block.block_id} does not match its block_hash"
                )
        self._policy.check()

    def _check_priorities(self, level_of: dict[int, int]) -> None:
        raised = 0
        counts: dict[int, int] = {}
        for block in self._blocks:
            p = block.priority
            if type(p) is not int or p < 0:
                raise InvariantError(f"block {block.block_id} has priority {p!r}")
            raised += p != 0
            level = level_of.get(id(block))
            if level is None:
                continue
            if self._hooked is None and level != p:
                raise InvariantError(
                    f"free block {block.block_id} of priority {p} sits in level {level}'s queue"
                )
            if p:
                counts[p] = counts.get(p, 0) + 1
        if raised != self._raised:
            raise InvariantError(f"{raised} blocks have a priority, the pool counts {self._raised}")
        if self._plain != (self._hooked is None and not raised):
            raise InvariantError(f"fast path flag {self._plain} with {raised} raised block(s)")
        if self._hooked is not None and counts != self._level_free:
            raise InvariantError(f"free blocks per level {counts} != counted {self._level_free}")

    def _check_retained(self) -> None:
        holds: dict[int, int] = {}
        for owner, blocks in self._retained.items():
            ids = [b.block_id for b in blocks]
            if not ids or len(set(ids)) != len(ids):
                raise InvariantError(f"owner {owner!r} retains {ids} (empty or repeated)")
            for block_id in ids:
                holds[block_id] = holds.get(block_id, 0) + 1
        if holds != self._retainers:
            raise InvariantError("retained blocks disagree with the owners' records")
        if len(holds) > self._max_retained:
            raise InvariantError(
                f"{len(holds)} blocks retained, over max_retained_blocks={self._max_retained}"
            )
        for held_id, count in holds.items():
            block = self._blocks[held_id]
            if block.ref_cnt < count:
                raise InvariantError(
                    f"block {held_id} is retained {count} time(s) but has ref_cnt {block.ref_cnt}"
                )
