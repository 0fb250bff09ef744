"""Write-downs: stored CPU blocks cascade down to every tier, through per-tier queues.

* A CPU block queued for or being written to a tier holds a reference (invariant 2),
  taken and released through the scheduler's `BlockLedger`, so it is neither evicted nor
  reused while a write reads it; each tier holds at most ``max_queued_writes`` such
  blocks, and write-downs beyond that are skipped and counted.
* A tier that is unhealthy or read-only skips the write-down (counted); nothing waits.
* Writes go through the tier's `PriorityGate`: a write waits while a read waits, and
  writes never fill a tier's last operation slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, final

import anyio

from kvoffload.hashing import BlockHash
from kvoffload.tiers.health import TierPart
from kvoffload.tiers.ops import write_blocks

if TYPE_CHECKING:
    from kvoffload.pool.free_queue import CpuBlock
    from kvoffload.tiers.health import TierState
    from kvoffload.transfer.plan import StorePlan

__all__ = ["Cascade"]


@final
class Cascade(TierPart):
    """Queues newly stored CPU blocks for the tiers and writes them in the tiers' writers
    (built with the `TierPart` arguments: the ledger holds the write-down references)."""

    __slots__ = ()

    def enqueue(self, plan: StorePlan) -> list[CpuBlock]:
        """A CPU store completed: queue its newly published blocks for every tier.

        Each queued block takes a reference. A full queue or an unhealthy tier skips the
        block for that tier (counted); nothing waits.

        Returns:
            The plan's blocks that are published (cached under the plan's hashes).
        """
        get_cached = self._pool.get_cached
        blocks = []
        for block_id, block_hash in zip(plan.cpu_block_ids, plan.block_hashes, strict=True):
            block = get_cached(block_hash)
            if block is not None and block.block_id == block_id:
                blocks.append(block)
        if not blocks:
            return blocks
        for t in self._tiers:
            if not (t.healthy and t.writable):
                t.skipped_unhealthy += len(blocks)
                continue
            room = max(0, t.max_queued - t.held)
            take = blocks[:room]
            t.skipped_full += len(blocks) - len(take)
            if not take:
                continue
            self._ledger.open_write_down(take)
            t.queue.extend(take)
            t.held += len(take)
            t.max_held = max(t.max_held, t.held)
            t.wake.set()
        return blocks

    def drop_all(self) -> None:
        """Drop every tier's queued write-downs (releasing their references)."""
        for t in self._tiers:
            self._health.drop_queue(t)

    async def writer(self, t: TierState) -> None:
        """One writer of tier ``t``: writes its queue in batches. Runs until cancelled."""
        while True:
            while not t.queue:
                # One event shared by every idle writer of the tier: a writer replacing
                # it with its own would leave the others waiting on events never set.
                if t.wake.is_set():
                    t.wake = anyio.Event()
                await t.wake.wait()
            batch = [t.queue.popleft() for _ in range(min(t.max_batch, len(t.queue)))]
            try:
                await self._write(t, batch)
            finally:
                t.held -= len(batch)
                self._ledger.close_write_down(batch[::-1])

    async def _write(self, t: TierState, batch: list[CpuBlock]) -> None:
        hashes: list[BlockHash] = []
        views: list[memoryview] = []
        for block in batch:
            # A reference is held, so the block cannot be reused; it can be unpublished
            # (a reset, a failed load) - then it is not written.
            if block.block_hash is not None:
                hashes.append(block.block_hash)
                views.append(self._block_view(block.block_id))
        await write_blocks(
            t, self._health, hashes, views, namespace=self._namespace, nbytes=self._nbytes
        )
