"""The store planner: which computed blocks each step copies to CPU, and the cursors.

Eager mode scans every live request from its cursor over newly computed full blocks (the
hot loop: `run_offer()`, which each full group's lanes of a `GroupedScheduler` run too);
``restore_evicted`` first re-stores blocks below live cursors that were evicted; lazy
mode walks the engine's GPU cache from the block closest to eviction. Blocks already
cached or being filled (the ledger's pending hashes) are skipped; the admission filter
may refuse a block. When no CPU block is free the rest is *deferred*: cursors stay,
nothing referenced is evicted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, final

from kvoffload._logging import get_logger
from kvoffload.config import OffloadConfig
from kvoffload.errors import InvalidInputError
from kvoffload.hashing import BlockHash
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.pool.policies.admission import AlwaysAdmit, make_admission
from kvoffload.scheduler._counts import count_down, count_up
from kvoffload.scheduler.ledger import BlockLedger, PlanEntry
from kvoffload.scheduler.requests import RequestTable
from kvoffload.scheduler.state import RequestOffloadState, RequestPhase
from kvoffload.scheduler.stats import Counters
from kvoffload.transfer.plan import StorePlan

__all__ = [
    "GpuCacheView",
    "Run",
    "StoreBatch",
    "StorePlanner",
    "StoreUndo",
    "run_offer",
    "scan_lazy",
]

_log = get_logger("scheduler")

_LIVE = RequestPhase.LIVE
_HOLDING = RequestPhase.HOLDING


class GpuCacheView(Protocol):
    """The engine's cached GPU blocks, for lazy offloading."""

    def iter_eviction_order(self) -> Iterable[tuple[int, BlockHash]]:
        """Yield ``(gpu_block_id, block_hash)`` of cached, fully computed GPU blocks,
        the one the engine will evict next first."""


@dataclass(slots=True, eq=False)
class StoreUndo:
    """What `cancel()` of a store plan puts back."""

    # (request, cursor before the plan) of every cursor the plan moved.
    rollback: list[tuple[RequestOffloadState, int]]
    # Hashes the admission filter refused while the plan was built.
    refused: tuple[BlockHash, ...] = ()
    # Finished requests whose hold the plan ended: (state, held ids, cursor).
    holds: list[tuple[RequestOffloadState, list[int], int]] = field(default_factory=list)


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
        self.rollback: list[tuple[RequestOffloadState, int]] = []
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


@final
class StorePlanner:
    """Plans the stores of each step and keeps the request cursors.

    Args:
        config: the settings (store mode, restore policy, admission, step limit).
        ledger: where CPU blocks are taken.
        table: the registered requests.
        counters: the statistics this planner adds to.
    """

    def __init__(
        self, config: OffloadConfig, ledger: BlockLedger, table: RequestTable, counters: Counters
    ) -> None:
        self._config = config
        self._block_size = config.block_size
        self._lazy = config.store_mode == "lazy"
        self._ledger = ledger
        self._table = table
        self._counters = counters
        admission = make_admission(config.store_admission)
        self._admit = None if isinstance(admission, AlwaysAdmit) else admission.admit
        self._undo_admission = None if isinstance(admission, AlwaysAdmit) else admission.undo
        self.live_refs: dict[BlockHash, int] = {}
        """Hash → live cursors past it (to count evictions of blocks still in use)."""
        self.restore_needed = False
        self.plan_calls = 0
        """``plan_stores`` calls so far (the clock of finish holds)."""
        self.undo: dict[int, StoreUndo] = {}
        """Store plan id → what cancelling it puts back."""

    # -- cursors ---------------------------------------------------------------------------

    def reset_cursor(self, state: RequestOffloadState) -> None:
        """Move a request's cursor back to 0."""
        live_refs = self.live_refs
        for block_hash in state.block_hashes[: state.num_stored_blocks]:
            count_down(live_refs, block_hash)
        state.num_stored_blocks = 0

    def set_cursor(self, state: RequestOffloadState, cursor: int) -> None:
        """Move a cursor that is at 0 to ``cursor``."""
        live_refs = self.live_refs
        for block_hash in state.block_hashes[:cursor]:
            count_up(live_refs, block_hash)
        state.num_stored_blocks = cursor

    def roll_back(self, state: RequestOffloadState, old: int) -> None:
        """Move a cursor back to ``old``, where it was before a cancelled plan."""
        live_refs = self.live_refs
        for block_hash in state.block_hashes[old : state.num_stored_blocks]:
            count_down(live_refs, block_hash)
        state.num_stored_blocks = old

    # -- planning --------------------------------------------------------------------------

    def plan(
        self,
        gpu_cache: GpuCacheView | None,
        end_holds: Callable[
            [list[RequestOffloadState], StorePlan | None, Mapping[int, StoreUndo]], None
        ],
    ) -> StorePlan | None:
        """`OffloadScheduler.plan_stores()`: scan, then make the batch's plan; the holds
        the scan finished are handed to ``end_holds`` (`FinishHolds.end_planned()`) with
        the plan, also when making it raised (then with ``None``)."""
        if self._lazy and gpu_cache is None:
            raise InvalidInputError("store_mode='lazy' needs the engine's gpu_cache view")
        hold_done: list[RequestOffloadState] = []
        batch = self.scan(gpu_cache, hold_done)
        plan: StorePlan | None = None
        try:
            plan = self.make_plan(batch)
            return plan
        finally:
            if hold_done:
                end_holds(hold_done, plan, self.undo)

    def scan(
        self, gpu_cache: GpuCacheView | None, hold_done: list[RequestOffloadState]
    ) -> StoreBatch:
        """Choose this step's blocks (``hold_done`` gets finished requests whose hold
        ends: planned, or expired)."""
        self.plan_calls += 1
        batch = StoreBatch(self._ledger, self._config.max_store_blocks_per_step)
        if gpu_cache is not None and self._lazy:
            scan_lazy(gpu_cache, batch, self._config.lazy_offload_blocks)
        else:
            if self.restore_needed and self._config.restore_evicted:
                self._scan_restore(batch)
            self._scan_eager(batch, hold_done)
        return batch

    def make_plan(self, batch: StoreBatch) -> StorePlan | None:
        """Take the CPU blocks of a scanned batch and open its plan (``None``: nothing
        to store)."""
        counters = self._counters
        batch.count(self._ledger, counters)
        priorities = self._priorities(batch) if self._table.prioritized else None
        if not batch.hashes:
            return None
        evicted: list[BlockHash] = []
        request_ids = tuple(dict.fromkeys(batch.owners))
        plan = self._ledger.open_store(
            batch.hashes,
            batch.gpu_ids,
            request_ids,
            protect=batch.protect,
            evicted=evicted,
            ends=batch.run_ends(),
            priorities=priorities,
        )
        live_refs = self.live_refs
        for block_hash in evicted:
            if block_hash in live_refs:
                counters.evicted_while_live += 1
                self.restore_needed = True
        self.undo[plan.plan_id] = StoreUndo(batch.rollback, tuple(batch.refused))
        requests = self._table.requests
        for rid in request_ids:
            requests[rid].in_flight.add(plan.plan_id)
        counters.store_plans += 1
        return plan

    def _priorities(self, batch: StoreBatch) -> dict[BlockHash, int]:
        """The retention priority of each block this scan passed for a request that has
        one (the highest, for a block several requests share): the blocks the batch
        plans get theirs from the returned map; cached or pending ones are raised now."""
        want: dict[BlockHash, int] = {}
        requests = self._table.requests
        if batch.owners:  # one per planned hash (none in lazy mode)
            batch.owner_priorities(lambda rid: requests[rid].priority, want)
        for state, start in batch.rollback:
            priority = state.priority
            if priority:
                for block_hash in state.block_hashes[start : state.num_stored_blocks]:
                    if priority > want.get(block_hash, 0):
                        want[block_hash] = priority
        return self._ledger.prioritize(want, batch.planned)

    def _scan_eager(self, batch: StoreBatch, hold_done: list[RequestOffloadState]) -> None:
        # The hot loop: one `run_offer()` over every request's run.
        run_offer(batch, self.live_refs, self._admit, self._eager_runs(batch, hold_done))

    def _eager_runs(self, batch: StoreBatch, hold_done: list[RequestOffloadState]) -> Iterator[Run]:
        """Each live request's run of new full blocks, for `run_offer()`; moves the
        cursors where each run stopped."""
        bs = self._block_size
        rollback = batch.rollback
        calls = self.plan_calls
        live, holding = _LIVE, _HOLDING
        for state in self._table.requests.values():
            phase = state.phase
            if phase is not live:
                if phase is not holding:
                    continue  # preempted, or finished holding nothing
                if calls > state.hold_deadline:
                    self._counters.hold_expired_blocks += len(state.held_gpu_block_ids)
                    hold_done.append(state)
                    continue
            elif state.recheck_table:
                continue  # a table to check again first (after a reset)
            hashes = state.block_hashes
            gpu_ids = state.gpu_block_ids
            end = state.num_computed_tokens // bs  # min() of the three, without a call
            if len(hashes) < end:  # noqa: PLR1730 - no call per request
                end = len(hashes)
            if len(gpu_ids) < end:  # noqa: PLR1730
                end = len(gpu_ids)
            i = start = state.num_stored_blocks
            if batch.deferred:
                if end > i:
                    batch.deferred += end - i
                    batch.skipped.append(hashes[i])
                continue
            if i < end:
                yield hashes, gpu_ids, i, end, state.request_id
                i = batch.stopped
                if i != start:
                    state.num_stored_blocks = i
                    rollback.append((state, start))
            if i >= end and phase is holding:
                hold_done.append(state)

    def _scan_restore(self, batch: StoreBatch) -> None:
        """Re-store blocks below live cursors that were evicted (``restore_evicted``)."""
        before = len(batch.hashes)
        for state in self._table.requests.values():
            if state.phase is not _LIVE or state.recheck_table:
                continue
            gpu_ids = state.gpu_block_ids
            rid = state.request_id
            for i, block_hash in enumerate(state.block_hashes[: state.num_stored_blocks]):
                if not batch.offer(block_hash, gpu_ids[i], rid):
                    batch.deferred = 1
                    batch.deferred_request = rid
                    batch.skipped.append(block_hash)
                    self._counters.restored_blocks += len(batch.hashes) - before
                    batch.end_run()
                    return
            batch.end_run()
        self._counters.restored_blocks += len(batch.hashes) - before
        self.restore_needed = False

    # -- undo ------------------------------------------------------------------------------

    def cancel_plan(
        self,
        rec: PlanEntry,
        current: bool,
        restore_hold: Callable[[RequestOffloadState, list[int], int], None],
    ) -> None:
        """A store plan was cancelled (the ledger released its blocks): give back the
        holds it ended, put the admission filter's state and the cursors it moved back
        (only of requests still live, and only if no reset came between). A request that
        finished since keeps its cursor: the engine freed the cancelled plan's GPU blocks
        (it keeps only the blocks a hold names, from the cursor on; a hold the plan ended
        comes back with its own cursor)."""
        undo = self.undo.pop(rec.plan.plan_id)
        counters = self._counters
        counters.store_plans -= 1
        if self._undo_admission is not None:
            self._undo_admission(rec.hashes, undo.refused)
        if self._config.restore_evicted:
            self.restore_needed = True  # the plan may have held re-stores
        for state, held, cursor in undo.holds:
            restore_hold(state, held, cursor)
        requests = self._table.requests
        for state, old in undo.rollback:
            live = requests.get(state.request_id) is state
            if live and current and state.phase is _LIVE and state.num_stored_blocks > old:
                self.roll_back(state, old)

    def reset(self) -> None:
        """The cache was reset: nothing evicted is waiting to be stored again."""
        self.restore_needed = False
