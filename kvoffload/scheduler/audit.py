"""The ledger's audit: every reference it holds on a CPU block against the pool's counts.

`BlockLedger.check_invariants()` hands its records to `check_references()` (DESIGN.md
invariants 1 to 3 as far as references go); the check is O(blocks) and reads nothing but
what it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from kvoffload.errors import InvariantError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block import CpuBlock
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler._counts import count_up
from kvoffload.transfer.plan import TransferPlan

__all__ = ["check_references"]


class _Plan(Protocol):
    """What the audit reads of a `PlanEntry`."""

    @property
    def plan(self) -> TransferPlan: ...
    @property
    def blocks(self) -> list[CpuBlock]: ...
    @property
    def abandoned(self) -> bool: ...


class _Promotion(Protocol):
    """What the audit reads of a `Promotion`."""

    @property
    def blocks(self) -> list[CpuBlock]: ...


def check_references(  # noqa: PLR0917 - one positional per record of the ledger
    pool: CpuBlockPool,
    plans: Iterable[_Plan],
    pins: Iterable[list[CpuBlock]],
    promotions: Iterable[_Promotion],
    tier_refs_held: Mapping[int, int],
    holders: Iterable[Callable[[], Mapping[int, int]]],
    pending: Mapping[BlockHash, CpuBlock],
    priorities: Mapping[BlockHash, int],
    loading_counted: Mapping[int, int],
) -> None:
    """Check the pool, then every reference a `BlockLedger` holds against the pool's
    counts, the loads against the load plans and the pending hashes.

    Args:
        pool: the ledger's pool (its own `check_invariants()` runs first).
        plans: the plans in flight.
        pins: the lookup pins (one list per lease).
        promotions: the promotions from a tier in flight.
        tier_refs_held: CPU block id → references the tiers hold through the ledger.
        holders: callables giving the references held outside the ledger (by block id).
        pending: hash → the CPU block being filled with it.
        priorities: pending hash → the priority it is published with.
        loading_counted: CPU block id → loads in flight that read it, as the ledger counts.

    Raises:
        InvariantError: naming the breach.
    """
    pool.check_invariants()
    expected: dict[int, int] = {}
    loading: dict[int, int] = {}
    for rec in plans:
        is_load = rec.plan.kind == "load" and not rec.abandoned
        for block in rec.blocks:
            if block.ref_cnt < 1:
                raise InvariantError(
                    f"block {block.block_id} of in-flight plan {rec.plan.plan_id} has "
                    f"ref_cnt {block.ref_cnt}"
                )
            count_up(expected, block.block_id)
            if is_load:
                count_up(loading, block.block_id)
    for blocks in pins:
        for block in blocks:
            count_up(expected, block.block_id)
    promoted: dict[int, int] = {}
    for promotion in promotions:
        for block in promotion.blocks:
            count_up(promoted, block.block_id)
    for block_id, n in promoted.items():
        if tier_refs_held.get(block_id, 0) < n:
            raise InvariantError(f"promoted block {block_id} holds fewer refs than taken")
    tier_refs = dict(tier_refs_held)
    for holder in holders:
        for block_id, n in holder().items():
            tier_refs[block_id] = tier_refs.get(block_id, 0) + n
    for block_id, n in tier_refs.items():
        expected[block_id] = expected.get(block_id, 0) + n
    for block_id, n in pool.retained_refs().items():
        expected[block_id] = expected.get(block_id, 0) + n
    if not priorities.keys() <= pending.keys():
        raise InvariantError("a priority is kept for a hash that is not being filled")
    if loading != loading_counted:
        raise InvariantError("blocks marked as loading disagree with the load plans")
    for block_id in range(pool.num_blocks):
        block = pool.block(block_id)
        if block.ref_cnt != expected.get(block_id, 0):
            raise InvariantError(
                f"block {block_id}: ref_cnt {block.ref_cnt} but plans, pins, tiers and retains "
                f"hold {expected.get(block_id, 0)}"
            )
    for block_hash, block in pending.items():
        if pool.is_cached(block_hash):
            raise InvariantError(f"hash of in-flight block {block.block_id} is already published")
        if block.ref_cnt < 1:
            raise InvariantError(f"in-flight block {block.block_id} has no reference")
