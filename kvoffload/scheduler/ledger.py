"""`BlockLedger`: the one owner of every reference taken on a CPU block.

Every reference on a pool block is taken and dropped here, in two phases: a store, a
load, a tier write-down or a promotion from a tier is *opened* (the blocks are taken or
referenced, the hashes being filled are marked pending) and later *closed* (ok or
failed: published, unpublished, released) or *cancelled*. Lookup pins are leases of the
same kind. The ledger knows hashes and CPU blocks, never requests: the scheduler's other
parts keep what a plan means for a request.

Because stores and promotions share one map of pending hashes, a promotion never reads
a block whose store is in flight, and a store never plans a block being promoted (both
are "being filled": DESIGN.md invariants 2 and 3).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import final

from kvoffload.errors import InvariantError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler._counts import count_down, count_up
from kvoffload.scheduler.audit import check_references
from kvoffload.scheduler.misses import MissMemory
from kvoffload.transfer.plan import LoadPlan, StorePlan, TransferPlan

__all__ = ["BlockLedger", "PlanEntry", "Promotion"]


@dataclass(slots=True, eq=False)
class PlanEntry:
    """A transfer plan in flight and the CPU blocks it references (one ref each)."""

    plan: TransferPlan
    blocks: list[CpuBlock]
    hashes: tuple[BlockHash, ...]
    epoch: int
    # Where each request's run of a store ends in ``blocks`` (None: one run); the blocks
    # return to the pool run by run, each run's tail first.
    ends: tuple[int, ...] | None = None
    # A completed store: how many of its blocks were published.
    published: int = 0
    # A load its request abandoned (`BlockLedger.abandon_load()`): no longer "loading",
    # its references kept until the copy has ended.
    abandoned: bool = False


@dataclass(slots=True, eq=False)
class Promotion:
    """CPU blocks taken for blocks read from a tier: ``blocks[k]`` is filled with
    ``wanted[k]``'s hash (``wanted[k] = (index in the caller's run, hash)``)."""

    wanted: list[tuple[int, BlockHash]]
    blocks: list[CpuBlock]
    epoch: int


@final
class BlockLedger:
    """Plans in flight, pending hashes, loads, pins, and the tiers' references.

    Args:
        pool: the CPU block pool whose references this ledger holds.
        miss_memory: how many recent evictions (and skipped stores) `misses` remembers
            (``None``: as many as the pool has blocks; 0: none).

    Attributes:
        pending: hash → the CPU block being filled with it right now (by a store or a
            promotion); read it, change it only through the ledger.
        loading: CPU block id → loads in flight that read it.
        misses: the pool's recent evictions (every allocation here records them) and
            skipped stores (the store planners record them), for `MissReason`.
    """

    def __init__(self, pool: CpuBlockPool, *, miss_memory: int | None = None) -> None:
        self._pool = pool
        self.misses = MissMemory(pool.num_blocks if miss_memory is None else miss_memory)
        self.pending: dict[BlockHash, CpuBlock] = {}
        self.priorities: dict[BlockHash, int] = {}
        """Pending hash → the retention priority it is published with (absent: 0)."""
        self.loading: dict[int, int] = {}
        self._plans: dict[int, PlanEntry] = {}
        self._pins: dict[int, list[CpuBlock]] = {}
        self._tier_refs: dict[int, int] = {}
        self._promotions: dict[int, Promotion] = {}
        self._holders: list[Callable[[], Mapping[int, int]]] = []
        self._plan_ids = itertools.count()
        self.epoch = 0
        """Bumped by `reset()`: plans and promotions opened before publish nothing."""

    def __repr__(self) -> str:
        return (
            f"BlockLedger(plans={len(self._plans)}, pending={len(self.pending)}, "
            f"pins={len(self._pins)}, tier_refs={sum(self._tier_refs.values())})"
        )

    @property
    def pool(self) -> CpuBlockPool:
        """The pool."""
        return self._pool

    @property
    def num_plans(self) -> int:
        """Plans in flight."""
        return len(self._plans)

    def plans(self) -> Iterator[PlanEntry]:
        """The plans in flight, oldest first."""
        return iter(self._plans.values())

    def has_plan(self, plan_id: int) -> bool:
        """Whether ``plan_id`` is in flight."""
        return plan_id in self._plans

    def add_ref_holder(self, holder: Callable[[], Mapping[int, int]]) -> None:
        """Count references taken outside the ledger in `check_invariants()`."""
        self._holders.append(holder)

    # -- stores ----------------------------------------------------------------------------

    def open_store(
        self,
        hashes: list[BlockHash],
        gpu_block_ids: list[int],
        request_ids: tuple[str, ...],
        *,
        protect: set[CpuBlock],
        evicted: list[BlockHash],
        ends: tuple[int, ...] | None,
        priorities: Mapping[BlockHash, int] | None = None,
    ) -> StorePlan:
        """Take one CPU block per hash (evicting only free blocks), mark the hashes
        pending and open the store plan that fills them (each published with its entry
        in ``priorities``, 0 when absent, unless raised meanwhile)."""
        blocks = self._pool.allocate(len(hashes), protect=protect, evicted=evicted)
        if evicted:
            self.misses.note_evicted(evicted)
        if priorities:
            self.priorities.update(priorities)
        pending = self.pending
        for block, block_hash in zip(blocks, hashes, strict=True):
            pending[block_hash] = block
        plan = StorePlan(
            plan_id=next(self._plan_ids),
            kind="store",
            gpu_block_ids=tuple(gpu_block_ids),
            cpu_block_ids=tuple(b.block_id for b in blocks),
            request_ids=request_ids,
            block_hashes=tuple(hashes),
        )
        self._plans[plan.plan_id] = PlanEntry(plan, blocks, plan.block_hashes, self.epoch, ends)
        return plan

    # -- pins and loads --------------------------------------------------------------------

    def pin(self, blocks: list[CpuBlock], priority: int = 0) -> None:
        """Reference a lookup's hit (a lease on the list itself, released by `unpin()`
        or turned into a load by `open_load()`), raising each block to ``priority``."""
        if priority:
            self._pool.touch(blocks, priority=priority)
        else:
            self._pool.touch(blocks)
        self._pins[id(blocks)] = blocks

    def raise_priority(self, block_hash: BlockHash, priority: int) -> None:
        """Raise the retention priority of the block being filled with ``block_hash``
        (it is published with it) or published under it; nothing for an unknown hash."""
        if block_hash in self.pending:
            if self.priorities.get(block_hash, 0) < priority:
                self.priorities[block_hash] = priority
        elif (block := self._pool.get_cached(block_hash)) is not None:
            self._pool.raise_priority(block, priority)

    def prioritize(
        self, want: Mapping[BlockHash, int], planned: Collection[BlockHash]
    ) -> dict[BlockHash, int]:
        """A store's priorities: ``want`` maps each block a store scan passed for a
        request with a priority to the highest such priority. Those not ``planned`` (being
        filled by an earlier plan, or published) are raised now (`raise_priority()`); the
        planned ones are returned, for `open_store()` to publish them with."""
        raise_priority = self.raise_priority
        for block_hash, priority in want.items():
            if block_hash not in planned:
                raise_priority(block_hash, priority)
        return {h: p for h, p in want.items() if h in planned}

    def retain(
        self, block_hashes: Sequence[BlockHash], owner: Hashable, *, fit: bool = False
    ) -> list[CpuBlock]:
        """`CpuBlockPool.retain()`: hold the published leading run of ``block_hashes``
        for ``owner`` (one reference each) until `release_retained()`."""
        return self._pool.retain(block_hashes, owner=owner, fit=fit)

    def release_retained(self, owner: Hashable) -> int:
        """`CpuBlockPool.release_retained()`."""
        return self._pool.release_retained(owner)

    def unpin(self, blocks: list[CpuBlock]) -> None:
        """Release a pin taken by `pin()` (or left by a cancelled load).

        Raises:
            InvariantError: ``blocks`` is not a pin of this ledger.
        """
        if self._pins.pop(id(blocks), None) is not blocks:
            raise InvariantError(f"release of {len(blocks)} CPU blocks that are not a pin")
        self._pool.free(blocks[::-1])

    def open_load(
        self,
        pinned: list[CpuBlock],
        n: int,
        gpu_block_ids: list[int],
        request_id: str,
        num_tokens: int,
    ) -> tuple[LoadPlan | None, int]:
        """Turn the first ``n`` blocks of a pin into a load plan; release the rest.

        Returns:
            The plan (``None`` when ``n`` is 0), and how many of its blocks another load
            in flight reads too.
        """
        if self._pins.pop(id(pinned), None) is not pinned:
            raise InvariantError(f"load of {len(pinned)} CPU blocks that are not a pin")
        take, rest = pinned[:n], pinned[n:]
        if rest:
            self._pool.free(rest[::-1])
        if not n:
            return None, 0
        loading = self.loading
        concurrent = 0
        for block in take:  # count_up() inlined: a loop per block
            block_id = block.block_id
            count = loading.get(block_id, 0)
            if count:
                concurrent += 1
            loading[block_id] = count + 1
        plan = LoadPlan(
            plan_id=next(self._plan_ids),
            kind="load",
            gpu_block_ids=tuple(gpu_block_ids),
            cpu_block_ids=tuple(b.block_id for b in take),
            request_ids=(request_id,),
            request_id=request_id,
            num_tokens=num_tokens,
        )
        self._plans[plan.plan_id] = PlanEntry(plan, take, (), self.epoch)
        return plan, concurrent

    def abandon_load(self, plan_id: int) -> PlanEntry | None:
        """A load's request stopped waiting for it: its blocks are no longer counted as
        being loaded (a lookup does not defer to it, a second load is not concurrent),
        but keep their references until the copy ends and `close()` releases them.

        Returns:
            The plan's entry, or ``None`` when it is not an open load that was not
            abandoned yet (nothing changed).
        """
        rec = self._plans.get(plan_id)
        if rec is None or rec.plan.kind != "load" or rec.abandoned:
            return None
        rec.abandoned = True
        self._unmark_loading(rec.blocks)
        return rec

    def _unmark_loading(self, blocks: list[CpuBlock]) -> None:
        loading = self.loading
        for block in blocks:  # count_down() inlined: a loop per block
            block_id = block.block_id
            left = loading[block_id] - 1
            if left:
                loading[block_id] = left
            else:
                del loading[block_id]

    # -- closing plans -----------------------------------------------------------------------

    def _take(self, plan_id: int, plan: TransferPlan | None) -> PlanEntry | None:
        """The entry of plan ``plan_id``, no longer in flight; ``None`` (nothing changed)
        when no plan of that id is, or when ``plan`` is given and is not that plan (a
        plan of another ledger: each group's ledger counts its plan ids from 0)."""
        plans = self._plans
        rec = plans.get(plan_id)
        if rec is None or (plan is not None and rec.plan is not plan and rec.plan != plan):
            return None
        del plans[plan_id]
        return rec

    def close(self, plan_id: int, ok: bool, plan: TransferPlan | None = None) -> PlanEntry | None:
        """A plan's copy ended: publish a successful store of this epoch (only now are
        its hashes findable), unpublish a failed load's blocks, release every reference.

        Returns:
            The plan's entry, or ``None`` when it is not in flight, or ``plan`` is given
            and is another plan of that id (nothing changed).
        """
        rec = self._take(plan_id, plan)
        if rec is None:
            return None
        pool = self._pool
        blocks = rec.blocks
        if rec.plan.kind == "store":
            pending = self.pending
            publish = pool.publish
            if ok and rec.epoch == self.epoch and self.priorities:
                rec.published = _publish_prioritized(rec, pending, self.priorities, publish)
            elif ok and rec.epoch == self.epoch:
                published = 0
                for block, block_hash in zip(blocks, rec.hashes, strict=True):
                    if pending.get(block_hash) is block:
                        del pending[block_hash]
                    if publish(block, block_hash):
                        published += 1
                rec.published = published
            else:
                for block, block_hash in zip(blocks, rec.hashes, strict=True):
                    if pending.get(block_hash) is block:
                        del pending[block_hash]
                _forget_priorities(self.priorities, self.pending, rec.hashes)
        else:
            if not rec.abandoned:
                self._unmark_loading(blocks)
            if not ok:
                for block in blocks:
                    pool.unpublish(block)
        pool.free(_free_order(rec))
        return rec

    def cancel(self, plan_id: int, plan: TransferPlan | None = None) -> PlanEntry | None:
        """Undo a plan whose copy never started: a store's blocks are released
        unpublished; a load's blocks become a pin again (`unpin()` releases it).

        Returns:
            The plan's entry, or ``None`` when it is not in flight, or ``plan`` is given
            and is another plan of that id (nothing changed).
        """
        rec = self._take(plan_id, plan)
        if rec is None:
            return None
        blocks = rec.blocks
        if rec.plan.kind == "store":
            pending = self.pending
            for block, block_hash in zip(blocks, rec.hashes, strict=True):
                if pending.get(block_hash) is block:
                    del pending[block_hash]
            _forget_priorities(self.priorities, self.pending, rec.hashes)
            self._pool.free(blocks[::-1])
        elif rec.abandoned:
            self._pool.free(blocks[::-1])
        else:
            self._unmark_loading(blocks)
            self._pins[id(blocks)] = blocks
        return rec

    def reset(self) -> None:
        """Empty the cache: plans and promotions open now publish nothing when they
        close; nothing is pending any more; every retained block is released and every
        published block unpublished."""
        self.epoch += 1
        self.pending.clear()
        self.priorities.clear()
        self.misses.clear()
        self.release_all_retained()
        self._pool.unpublish_all()

    def release_all_retained(self) -> int:
        """Release every retained block, of every owner (a reset, a close); return how
        many references that dropped."""
        pool = self._pool
        return sum(pool.release_retained(owner) for owner in pool.retained_owners)

    # -- tiers -------------------------------------------------------------------------------

    def tier_refs(self) -> Mapping[int, int]:
        """CPU block id → references the tiers hold (write-downs and promotions)."""
        return self._tier_refs

    def open_write_down(self, blocks: Sequence[CpuBlock]) -> None:
        """Reference published blocks a tier write will read."""
        self._pool.touch(blocks)
        refs = self._tier_refs
        for block in blocks:
            count_up(refs, block.block_id)

    def close_write_down(self, blocks: Sequence[CpuBlock]) -> None:
        """Release the references of `open_write_down()` (in the order given)."""
        refs = self._tier_refs
        for block in blocks:
            count_down(refs, block.block_id)
        self._pool.free(blocks)

    def promotable(self, wanted: Sequence[tuple[int, BlockHash]]) -> list[tuple[int, BlockHash]]:
        """The entries of ``wanted`` neither published nor being filled right now."""
        is_cached = self._pool.is_cached
        pending = self.pending
        return [(i, h) for i, h in wanted if h not in pending and not is_cached(h)]

    def open_promotion(
        self, wanted: Sequence[tuple[int, BlockHash]], protect: set[CpuBlock]
    ) -> Promotion | None:
        """Take free CPU blocks for the `promotable()` part of ``wanted`` (fewer when
        fewer are free; never a referenced block or one in ``protect``), and mark
        their hashes pending.

        Returns:
            The promotion (possibly of no block), or ``None`` when no block is free.
        """
        wanted = self.promotable(wanted)
        if not wanted:
            return Promotion([], [], self.epoch)
        pool = self._pool
        available = pool.num_free - sum(1 for b in protect if b.ref_cnt == 0)
        if available <= 0:
            return None
        wanted = wanted[:available]
        evicted: list[BlockHash] = []
        blocks = pool.allocate(len(wanted), protect=protect, evicted=evicted)
        if evicted:
            self.misses.note_evicted(evicted)
        pending = self.pending
        refs = self._tier_refs
        for (_, block_hash), block in zip(wanted, blocks, strict=True):
            pending[block_hash] = block
            count_up(refs, block.block_id)
        promotion = Promotion(wanted, blocks, self.epoch)
        self._promotions[id(promotion)] = promotion
        return promotion

    def close_promotion(self, promotion: Promotion, good: Sequence[bool] | None) -> list[bool]:
        """Publish the blocks read and verified (``good[k]``) unless the cache was reset
        since the promotion opened (``good=None``: publish nothing); release every
        reference.

        Returns:
            Which blocks were published.
        """
        if not promotion.blocks:
            return []
        if self._promotions.pop(id(promotion), None) is not promotion:
            raise InvariantError("close of a promotion that is not open")
        pool = self._pool
        pending = self.pending
        publish = good is not None and promotion.epoch == self.epoch
        out: list[bool] = []
        for k, ((_, block_hash), block) in enumerate(
            zip(promotion.wanted, promotion.blocks, strict=True)
        ):
            priority = 0
            if pending.get(block_hash) is block:
                del pending[block_hash]
                priority = self.priorities.pop(block_hash, 0) if self.priorities else 0
            out.append(
                publish
                and good is not None
                and good[k]
                and pool.publish(block, block_hash, priority=priority)
            )
        blocks = promotion.blocks[::-1]
        refs = self._tier_refs
        for block in blocks:
            count_down(refs, block.block_id)
        pool.free(blocks)
        return out

    # -- checks ------------------------------------------------------------------------------

    def pins(self) -> Iterator[list[CpuBlock]]:
        """Every pin held (one list per lease)."""
        return iter(self._pins.values())

    def check_invariants(self) -> None:
        """Check the pool, then every reference this ledger holds against the pool's
        counts, the loads against the load plans and the pending hashes (O(blocks)).

        Raises:
            InvariantError: naming the breach.
        """
        check_references(
            self._pool,
            self._plans.values(),
            self._pins.values(),
            self._promotions.values(),
            self._tier_refs,
            self._holders,
            self.pending,
            self.priorities,
            self.loading,
        )


def _publish_prioritized(
    rec: PlanEntry,
    pending: dict[BlockHash, CpuBlock],
    priorities: dict[BlockHash, int],
    publish: Callable[..., bool],
) -> int:
    """`BlockLedger.close()` of a store while some pending hash has a priority: publish
    each block with its own; return how many were published."""
    published = 0
    for block, block_hash in zip(rec.blocks, rec.hashes, strict=True):
        priority = 0
        if pending.get(block_hash) is block:
            del pending[block_hash]
            priority = priorities.pop(block_hash, 0)
        published += publish(block, block_hash, priority=priority)
    return published


def _forget_priorities(
    priorities: dict[BlockHash, int],
    pending: dict[BlockHash, CpuBlock],
    hashes: Sequence[BlockHash],
) -> None:
    """Drop the priorities of ``hashes`` no longer pending (their fill ended unpublished)."""
    if priorities:
        for block_hash in hashes:
            if block_hash not in pending:
                priorities.pop(block_hash, None)


def _free_order(rec: PlanEntry) -> list[CpuBlock]:
    """A plan's blocks in the order they return to the pool: run by run, tail first
    (within a request the prefix is evicted last)."""
    blocks, ends = rec.blocks, rec.ends
    if ends is None:
        return blocks[::-1]
    order: list[CpuBlock] = []
    begin = 0
    for end in ends:
        order.extend(blocks[end - 1 : begin - 1 if begin else None : -1])
        begin = end
    if begin < len(blocks):
        order.extend(blocks[: begin - 1 : -1])
    return order
