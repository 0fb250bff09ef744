"""Retention priorities: the checks, and `FreeLevels`, the pool's free set off its fast path.

A free block of a lower priority is evicted before any of a higher one. Under LRU the pool
keeps one free queue per priority level present (level 0 is the pool's own free queue, so a
pool that uses no priority runs the single-queue path unchanged). Other policies see every
free block, as before, and are asked for victims one level at a time, lowest first, with a
`LevelGuard` as ``protect``: it hides every block of another level, so a policy ranks only
candidates of the level being evicted.

`CpuBlockPool` serves LRU with no priority in use on inlined paths of its own; every other
case (a policy other than LRU, protected blocks, blocks of raised priority) goes through
the `FreeLevels` it composes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NoReturn, final

from kvoffload.errors import BlockStateError, InvalidInputError, InvariantError, OutOfBlocksError
from kvoffload.hashing import BlockHash
from kvoffload.pool.free_queue import LruFreeQueue
from kvoffload.pool.policies import EvictionPolicy, LruPolicy, make_policy

if TYPE_CHECKING:
    from kvoffload.pool.block import CpuBlock, QueueNode
    from kvoffload.pool.prefix_map import PrefixMap

LookupHook = Callable[[Sequence[BlockHash], int], None]
"""A policy's ``on_lookup`` hook: the hashes looked up, and how many hit."""

__all__ = [
    "MAX_PRIORITY",
    "FreeLevels",
    "LevelGuard",
    "LookupHook",
    "attach_policy",
    "check_priority",
    "default_max_retained",
]

MAX_PRIORITY = 1 << 16
"""The highest retention priority a block may carry."""

DEFAULT_RETAINED_FRACTION = 0.1
"""The share of a pool `CpuBlockPool.retain` may hold unless told otherwise."""


def check_priority(priority: object) -> int:
    """``priority`` if it is an int in [0, `MAX_PRIORITY`].

    Raises:
        InvalidInputError: anything else; the message names the value.
    """
    if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
        raise InvalidInputError(
            f"priority must be an integer in [0, {MAX_PRIORITY}], got {priority!r}"
        )
    return priority


def default_max_retained(num_blocks: int, fraction: float = DEFAULT_RETAINED_FRACTION) -> int:
    """The retention bound of a pool of ``num_blocks`` that may retain ``fraction`` of
    itself (at most ``num_blocks - 1``: one block is always left to store into)."""
    return min(int(num_blocks * fraction), num_blocks - 1)


def attach_policy(
    policy: EvictionPolicy | str | None,
    blocks: tuple[CpuBlock, ...],
    free: LruFreeQueue,
    token: object,
    pool_factory: Callable[[int, str], object],
) -> tuple[EvictionPolicy, EvictionPolicy | None, FreeLevels, LookupHook | None]:
    """A `CpuBlockPool`'s eviction policy made from ``policy`` (`make_policy`) and attached
    to its ``blocks`` and ``free`` queue; return it, the policy the pool's slow paths call
    (``None`` for LRU: the free queue is the policy), the `FreeLevels` over them and the
    policy's lookup hook.

    A policy that simulates pools of its own (the adaptive one) gets ``pool_factory``
    (``(num_blocks, policy name) -> pool``) to make them with, so the policies never
    import the pool. The adaptive policy's lookup hook (see `EvictionPolicy`) costs the
    pool one test per lookup.
    """
    made = make_policy(policy)
    made.attach(blocks, free)
    bind = getattr(made, "bind_pool_factory", None)
    if callable(bind):
        bind(pool_factory)
    hooked = None if isinstance(made, LruPolicy) else made
    levels = FreeLevels(blocks, free, made, hooked, token)
    on_lookup = getattr(hooked, "on_lookup", None)
    return made, hooked, levels, on_lookup if callable(on_lookup) else None


@final
class LevelGuard(Collection["CpuBlock"]):
    """``protect`` for one level: holds the caller's protected blocks and every block of
    another priority (membership is tested, never enumerated for the latter)."""

    __slots__ = ("level", "protect")

    def __init__(self, level: int, protect: Collection[CpuBlock]) -> None:
        self.level = level
        self.protect = protect

    def __contains__(self, block: object) -> bool:
        return getattr(block, "priority", None) != self.level or block in self.protect

    def __iter__(self) -> Iterator[CpuBlock]:
        return iter(self.protect)

    def __len__(self) -> int:
        return len(self.protect)


@final
class FreeLevels:
    """The free blocks of a `CpuBlockPool` by priority level, and victim choice off the
    pool's LRU fast path.

    Under LRU a free block of priority p > 0 sits in the queue of level p (level 0 is the
    pool's queue ``free``); other policies keep every free block in ``free`` and this
    counts those of each p > 0.

    Args:
        blocks: the pool's blocks (by id).
        free: the pool's free queue (level 0).
        policy: the pool's eviction policy, attached to ``free``.
        hooked: ``policy`` unless it is LRU (then ``None``: the queues are the policy).
        token: the pool's token (`CpuBlock._owner`).
    """

    __slots__ = (
        "_blocks",
        "_free",
        "_hooked",
        "_level_free",
        "_levels",
        "_policy",
        "_token",
        "raised",
        "upper_free",
    )

    def __init__(
        self,
        blocks: tuple[CpuBlock, ...],
        free: LruFreeQueue,
        policy: EvictionPolicy,
        hooked: EvictionPolicy | None,
        token: object,
    ) -> None:
        self._blocks = blocks
        self._free = free
        self._policy = policy
        self._hooked = hooked
        self._token = token
        self._levels: dict[int, LruFreeQueue] = {}
        self._level_free: dict[int, int] = {}
        self.upper_free = 0
        """Free blocks in the queues of levels above 0 (LRU only)."""
        self.raised = 0
        """Blocks whose priority is not 0 (while 0 under LRU the pool runs its fast paths)."""

    # -- references -------------------------------------------------------------------------

    def touch(self, blocks: Iterable[CpuBlock], priority: int) -> None:
        """`CpuBlockPool.touch()` off the fast path."""
        hooked = self._hooked
        on_touch = hooked.on_touch if hooked is not None else None
        raised = self.raised
        for block in blocks:
            if block.ref_cnt == 0:
                if block._prev is None:
                    raise InvariantError(f"block {block.block_id} has ref_cnt 0 but is not free")
                if on_touch is not None:
                    on_touch(block)
                self.unlink(block)
            elif on_touch is not None:
                on_touch(block)
            block.ref_cnt += 1
            if priority > block.priority:
                raised += not block.priority
                block.priority = priority
        self.raised = raised

    def raise_priority(self, block: CpuBlock, priority: int) -> bool:
        """`CpuBlockPool.raise_priority()`: return whether ``block``'s priority rose.

        Raises:
            BlockStateError: a block of another pool. InvalidInputError: a bad ``priority``.
        """
        check_priority(priority)
        if block._owner is not self._token:
            raise BlockStateError(f"block {block.block_id} belongs to another pool")
        if priority > block.priority:
            self.raise_to(block, priority)
            return True
        return False

    def raise_to(self, block: CpuBlock, priority: int) -> None:
        """Raise a block's priority to ``priority`` (above its own), wherever it is."""
        if block.ref_cnt:  # in no free queue
            self.raised += not block.priority
            block.priority = priority
        else:
            self._raise_free(block, priority)

    def take(self, blocks: Iterable[CpuBlock]) -> None:
        """Blocks an allocation took out of the free set: one reference each, priority 0."""
        for block in blocks:
            if block.priority:
                block.priority = 0
                self.raised -= 1
            block.ref_cnt = 1

    def free(self, blocks: Sequence[CpuBlock]) -> None:
        """`CpuBlockPool.free()` while some block has a raised priority."""
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
            self.link(block)
        if zeroed and self._hooked is not None:
            self._hooked.on_free(zeroed)

    def refuse_free(
        self, blocks: Sequence[CpuBlock], done: int, last: QueueNode | None, linked: int
    ) -> NoReturn:
        """`CpuBlockPool.free()` met ``blocks[done]`` at ``ref_cnt`` 0 or of another pool,
        after freeing the ones before it on its fast path (``linked`` of them appended to
        the free queue after its node ``last``, not yet linked to the tail): close the
        queue, restore those, then raise.

        Raises:
            BlockStateError: always, naming the block.
        """
        free = self._free
        tail = free._tail
        last._next = tail  # type: ignore[union-attr]
        tail._prev = last
        free._len += linked
        block = blocks[done]
        ref_cnt = block.ref_cnt
        remove = self._free.remove
        for undo in reversed(blocks[:done]):
            if undo.ref_cnt == 0:
                remove(undo)
            undo.ref_cnt += 1
        if ref_cnt > 0:
            raise BlockStateError(f"block {block.block_id} belongs to another pool")
        raise BlockStateError(
            f"free of block {block.block_id} whose ref_cnt is {ref_cnt} (double free)"
        )

    def _raise_free(self, block: CpuBlock, priority: int) -> None:
        """Raise a free block's priority: under LRU it moves to the most recently used end
        of its new level; another policy keeps its place (only the counts change)."""
        old = block.priority
        self.raised += not old
        if self._hooked is None:
            self.unlink(block)
            block.priority = priority
            self.link(block)
            return
        counts = self._level_free
        if old:
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]
        counts[priority] = counts.get(priority, 0) + 1
        block.priority = priority

    def unlink(self, block: CpuBlock) -> None:
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
            self.upper_free -= 1
            if not queue._len:
                del self._levels[p]

    def link(self, block: CpuBlock) -> None:
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
            self.upper_free += 1

    # -- victims ----------------------------------------------------------------------------

    def allocate(
        self,
        n: int,
        protect: Collection[CpuBlock],
        prefix_map: PrefixMap,
        evicted: list[BlockHash] | None,
    ) -> list[CpuBlock]:
        """`CpuBlockPool.allocate()` off its fast path: take the victims, unpublish those
        still published (in ``prefix_map``, appending their hashes to ``evicted``), give
        each one reference.

        Raises:
            ValueError: ``n`` is negative. OutOfBlocksError, InvariantError: see `victims()`.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        blocks = self.victims(n, protect)
        prefix_map.evict(blocks, evicted)
        self.take(blocks)
        return blocks

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """The ``n`` free blocks `CpuBlockPool.allocate()` takes off its fast path, out of
        the free set (lowest level first while some block has a raised priority).

        Raises:
            OutOfBlocksError: fewer than ``n`` are free, not counting protected ones.
            InvariantError: the policy chose a block it may not.
        """
        if self.raised:
            return self._victims_by_level(n, protect)
        if self._hooked is not None:
            return self._policy_victims(n, protect)
        free = self._free
        if protect:
            available = len(free) - sum(1 for b in set(protect) if b.ref_cnt == 0)
            if n > available:
                raise OutOfBlocksError(n, available)
            blocks: list[CpuBlock] = []
            if n:
                for block in free.iter_after(None):
                    if block not in protect:
                        blocks.append(block)
                        if len(blocks) == n:
                            break
                remove = free.remove
                for block in blocks:
                    remove(block)
            return blocks
        if n > len(free):
            raise OutOfBlocksError(n, len(free))
        return []  # n == 0

    def _victims_by_level(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """Lowest level first. Under LRU each level's queue is taken in order; another
        policy is asked for each level's share with a `LevelGuard` that hides the others."""
        guarded = {b for b in protect if b.ref_cnt == 0 and b._owner is self._token}
        available = self._free._len + self.upper_free - len(guarded)
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
                self.unlink(block)
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
                self.unlink(block)
        else:
            remove = free.remove
            for block in blocks:
                remove(block)
        return blocks

    # -- checks -----------------------------------------------------------------------------

    def check(self, plain: bool) -> None:
        """Check DESIGN invariant 1 (conservation; a block is in a free queue iff its
        ``ref_cnt`` is 0), every block's priority against its queue and the counts, and
        the pool's fast path flag ``plain`` (set only under LRU with no raised priority).

        Raises:
            InvariantError: naming the breach.
        """
        if plain != (self._hooked is None and not self.raised):
            raise InvariantError(f"fast path flag {plain} with priorities in use")
        queued = self._free.check()
        level_of = dict.fromkeys((id(b) for b in queued), 0)
        upper = 0
        for level, queue in self._levels.items():
            if self._hooked is not None or level <= 0 or not len(queue):
                raise InvariantError(f"free queue of level {level} should not exist")
            for block in queue.check():
                level_of[id(block)] = level
                upper += 1
        if self.upper_free != upper:
            raise InvariantError(f"upper levels count {self.upper_free} free blocks, hold {upper}")
        counted = referenced = 0
        counts: dict[int, int] = {}
        for block in self._blocks:
            if block.ref_cnt < 0:
                raise InvariantError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            p = block.priority
            if type(p) is not int or p < 0:
                raise InvariantError(f"block {block.block_id} has priority {p!r}")
            counted += p != 0
            found = level_of.get(id(block))
            if (found is not None) != (block.ref_cnt == 0):
                raise InvariantError(
                    f"block {block.block_id}: ref_cnt={block.ref_cnt} but "
                    f"{'in' if found is not None else 'not in'} the free queue"
                )
            if found is None:
                referenced += 1
                continue
            if self._hooked is None and found != p:
                raise InvariantError(
                    f"free block {block.block_id} of priority {p} sits in level {found}'s queue"
                )
            if p:
                counts[p] = counts.get(p, 0) + 1
        if counted != self.raised:
            raise InvariantError(f"{counted} blocks have a priority, {self.raised} counted")
        if self._hooked is not None and counts != self._level_free:
            raise InvariantError(f"free blocks per level {counts} != counted {self._level_free}")
        if len(level_of) + referenced != len(self._blocks):
            raise InvariantError(
                f"conservation: free {len(level_of)} + referenced {referenced} "
                f"!= {len(self._blocks)}"
            )
