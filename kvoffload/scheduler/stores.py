"""The store loop every full lane runs, and the lazy scan.

Eager mode scans every live request from its cursor over newly computed full blocks (the
hot loop: `run_offer()`); lazy mode walks the engine's GPU cache from the block closest to
eviction (`scan_lazy()`). Blocks already cached or being filled (the ledger's pending
hashes) are skipped; the admission filter may refuse a block. When no CPU block is free
the rest is *deferred*: cursors stay, nothing referenced is evicted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeAlias

from kvoffload._logging import get_logger
from kvoffload.hashing import BlockHash
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.stats import Counters

__all__ = [
    "GpuCacheView",
    "Run",
    "StoreBatch",
    "run_offer",
    "scan_lazy",
]

_log = get_logger("scheduler")


class GpuCacheView(Protocol):
    """The engine's cached GPU blocks, for lazy offloading."""

    def iter_eviction_order(self) -> Iterable[tuple[int, BlockHash]]:
        """Yield ``(gpu_block_id, block_hash)`` of cached, fully computed GPU blocks,
        the one the engine will evict next first."""


class StoreBatch:
    """The store plan being built by one ``plan_stores`` call, of one group's pool.

    The rules a batch keeps are every path's (one group's scans, and each group's store
    points of a `GroupedScheduler`): `offer()` skips a cached or pending block and keeps
    the plan's own allocation from evicting a cached block the scan passed over (the
    prefix a request is extending); `end_run()` closes one request's run, so the plan's
    blocks return to the pool request by request (`BlockLedger.close()`).
    """

    __slots__ = (
        "deferred",
        "deferred_request",
        "ends",
        "free",
        "get_cached",
        "gpu_ids",
        "hashes",
        "left",
        "owners",
        "pending",
        "planned",
        "protect",
        "refused",
        "rollback",
        "skipped",
        "stopped",
    )

    def __init__(self, ledger: BlockLedger, limit: int) -> None:
        pool = ledger.pool
        self.get_cached = pool.get_cached
        self.pending = ledger.pending
        self.free = pool.num_free
        self.left = limit
        self.gpu_ids: list[int] = []
        self.hashes: list[BlockHash] = []
        self.owners: list[str] = []
        self.planned: set[BlockHash] = set()
        self.protect: set[CpuBlock] = set()
        self.deferred = 0
        self.deferred_request: str | None = None
        self.ends: list[int] = []
        self.refused: list[BlockHash] = []
        # The first block of each request's deferred run (for `MissReason`).
        self.skipped: list[BlockHash] = []
        # Where `run_offer()`'s last run stopped.
        self.stopped = 0

    def offer(self, block_hash: BlockHash, gpu_block_id: int, owner: str | None) -> bool:
        """Add a block unless it is cached or being filled; ``False`` when it needs a CPU
        block and none is left (the caller defers)."""
        block = self.get_cached(block_hash)
        if block is not None:
            # Cached: skip it, and keep this plan's own allocation from evicting it while
            # a free block is left to spare (blocks planned before already counted on the
            # rest, so protecting it then would make the plan unallocatable).
            if block.ref_cnt == 0 and self.free > 0 and block not in self.protect:
                self.protect.add(block)
                self.free -= 1
            return True
        if block_hash in self.pending or block_hash in self.planned:
            return True
        if self.free <= 0 or self.left <= 0:
            return False
        self.free -= 1
        self.left -= 1
        self.planned.add(block_hash)
        self.hashes.append(block_hash)
        self.gpu_ids.append(gpu_block_id)
        if owner is not None:
            self.owners.append(owner)
        return True

    def owner_priorities(
        self, priority_of: Callable[[str], int], want: dict[BlockHash, int]
    ) -> None:
        """Raise ``want`` to the retention priority of each planned block's owner (the
        highest, for a block several requests share): the one rule for every block a
        batch plans, re-stores (``restore_evicted``) included, with one group or several."""
        for block_hash, rid in zip(self.hashes, self.owners, strict=True):
            priority = priority_of(rid)
            if priority > want.get(block_hash, 0):
                want[block_hash] = priority

    def end_run(self) -> None:
        """Close the run of the request just scanned (nothing when it planned nothing)."""
        n = len(self.hashes)
        if n > (self.ends[-1] if self.ends else 0):
            self.ends.append(n)

    def run_ends(self) -> tuple[int, ...] | None:
        """Where each request's run ends in the plan (`PlanEntry.ends`; ``None``: one run)."""
        return tuple(self.ends) if len(self.ends) > 1 else None

    def count(self, ledger: BlockLedger, counters: Counters, **log: object) -> None:
        """The scan is over: remember what it skipped (for `MissReason`) and count its
        deferral (``deferred_blocks``: blocks not allocated; ``deferred_steps``: one)."""
        if self.skipped or self.refused:
            ledger.misses.note_skipped(self.skipped)
            ledger.misses.note_skipped(self.refused)
        if self.deferred:
            counters.deferred_blocks += self.deferred
            counters.deferred_steps += 1
            _log.debug(
                "store_deferred",
                request_id=self.deferred_request,
                needed=self.deferred,
                free=ledger.pool.num_free,
                protected=len(self.protect),
                planned=len(self.hashes),
                **log,
            )


def scan_lazy(gpu_cache: GpuCacheView, batch: StoreBatch, window: int) -> None:
    """The lazy store scan (``store_mode="lazy"``) of one full-attention group's pool:
    offer the first ``window`` GPU blocks of ``gpu_cache``'s eviction order to ``batch``
    (``lazy_offload_blocks``); the first that finds no CPU block left defers the rest.
    One group's `StorePlanner` and each full group of a `GroupedScheduler` call it."""
    for gpu_block_id, block_hash in itertools.islice(gpu_cache.iter_eviction_order(), window):
        if not batch.offer(block_hash, gpu_block_id, None):
            batch.deferred = 1
            batch.skipped.append(block_hash)
            return


Run: TypeAlias = tuple[Sequence[BlockHash], Sequence[int | None], int, int, str]
"""One request's run for `run_offer()`: ``(hashes, gpu_ids, i, end, rid)``, blocks
``[i, end)`` (``gpu_ids[i:end]`` all ids)."""


def run_offer(
    batch: StoreBatch,
    live_refs: dict[BlockHash, int],
    admit: Callable[[BlockHash], bool] | None,
    runs: Iterable[Run],
) -> None:
    """The eager store loop of full-attention blocks, every path's: one group's
    `StorePlanner` (one call per plan, ``runs`` a generator over the live requests) and
    each full group's lanes of a `GroupedScheduler` (one call per run) run it.

    It is `StoreBatch.offer()` with the batch's state held in the loop's locals: a cached
    block is skipped (and protected from this plan's own allocation while a block is
    free), a pending or planned one skipped, a new one planned for ``rid``, or refused by
    ``admit`` (``store_admission``); each block passed counts once more in ``live_refs``.
    The first new block that finds no CPU block (or no room under the step limit) defers
    the rest of the run (``batch.deferred``). After each run, ``batch.stopped`` is where
    it stopped (``end``, or the block that did not fit; ``runs`` reads it when resumed)
    and the run is closed (`StoreBatch.end_run()`). ``runs`` must not offer to ``batch``
    itself (the free blocks and room are written back when the loop is over).
    """
    get_cached = batch.get_cached
    pending = batch.pending
    planned = batch.planned
    protect = batch.protect
    out_hashes = batch.hashes
    out_gpu = batch.gpu_ids
    owners = batch.owners
    ends = batch.ends
    room, limit = batch.free, batch.left
    for hashes, gpu_ids, start, end, rid in runs:
        i = start
        while i < end:
            block_hash = hashes[i]
            block = get_cached(block_hash)
            if block is not None:
                if block.ref_cnt == 0 and room > 0 and block not in protect:
                    protect.add(block)
                    room -= 1
            elif block_hash not in pending and block_hash not in planned:
                if room <= 0 or limit <= 0:
                    batch.deferred = end - i
                    batch.deferred_request = rid
                    batch.skipped.append(block_hash)
                    break
                if admit is not None and not admit(block_hash):
                    batch.refused.append(block_hash)
                    live_refs[block_hash] = live_refs.get(block_hash, 0) + 1
                    i += 1
                    continue  # refused by OffloadConfig.store_admission
                room -= 1
                limit -= 1
                planned.add(block_hash)
                out_hashes.append(block_hash)
                out_gpu.append(gpu_ids[i])  # type: ignore[arg-type]  # a run: ids only
                owners.append(rid)
            live_refs[block_hash] = live_refs.get(block_hash, 0) + 1
            i += 1
        batch.stopped = i
        n = len(out_hashes)
        if n > (ends[-1] if ends else 0):
            ends.append(n)  # end_run()
    batch.free, batch.left = room, limit
