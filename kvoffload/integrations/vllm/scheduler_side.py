"""The connector's scheduler side: vLLM's scheduler events mapped onto `OffloadScheduler`.

It runs in vLLM's scheduler process, owns the CPU block pool's bookkeeping and never
touches a tensor. Every plan it makes travels to the workers in the step's metadata;
a plan is completed (published, or released) only once every worker reported it.

GPU blocks a store reads are referenced in vLLM's GPU block pool from the moment the
store is planned until every worker finished copying them, so neither a finished or
preempted request nor an eviction can hand them to another request while they are read.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, final

from kvoffload._logging import get_logger
from kvoffload.build import build_core
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.hashing import BlockHash, BlockHasher, HashNamespace
from kvoffload.integrations.vllm._scheduler_base import (
    RequestEntry,
    SchedulerSideBase,
    Tracked,
    grow_hashes,
    hash_extra,
)
from kvoffload.integrations.vllm.metadata import GroupTransfer, KVOffloadConnectorMetadata
from kvoffload.integrations.vllm.stats import ConnectorStatistics
from kvoffload.integrations.vllm.tiers import SchedulerTiers, check_tier_settings
from kvoffload.transfer.plan import StorePlan

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

_log = get_logger("integrations.vllm")


@dataclass(slots=True, eq=False)
class _RequestHashes(RequestEntry):
    """The kvoffload block hashes of one request's tokens, grown as it runs."""

    hasher: BlockHasher

    @property
    def hashes(self) -> Sequence[BlockHash]:
        return self.hasher.block_hashes


class _FreeQueueView:
    """vLLM's cached, unreferenced GPU blocks, next to be evicted first (lazy mode)."""

    __slots__ = ("_known", "_pool")

    def __init__(self, pool: BlockPool, known: dict[int, tuple[object, BlockHash]]) -> None:
        self._pool = pool
        self._known = known

    def iter_eviction_order(self) -> Iterator[tuple[int, BlockHash]]:
        known = self._known
        for block in self._pool.free_block_queue.iter_blocks_after(None):
            entry = known.get(block.block_id)
            # Only blocks still holding what we hashed: a reused block has a new vLLM hash.
            if entry is not None and block.block_hash is not None and entry[0] == block.block_hash:
                yield block.block_id, entry[1]


@final
class SchedulerSide(SchedulerSideBase[_RequestHashes]):
    """kvoffload's decisions for one vLLM scheduler.

    Args:
        config: the settings from ``kv_connector_extra_config``.
        layout: one CPU block's geometry (one rank's shard of every layer).
        namespace: what block hashes are namespaced by.
        world_size: workers that copy every plan (tensor and pipeline parallel ranks).

    With ``config.tiers``, lookups that miss on CPU ask the workers' tiers
    (`SchedulerTiers`, in `tiers`).

    Raises:
        ConfigError: the pool size does not fit the layout, or a tier's settings are
            refused by the tier (named).
        HostMemoryError: the pool's bookkeeping exceeds the memory left (see
            `kvoffload.build.check_host_memory()`).
    """

    def __init__(
        self,
        config: OffloadConfig,
        layout: KVLayout,
        namespace: HashNamespace,
        *,
        world_size: int,
    ) -> None:
        super().__init__(config, world_size=world_size)
        self.layout = layout
        # The pool's bookkeeping lives here; each worker allocates its own host buffer.
        core = build_core(config, layout, world_size=world_size, host_buffer=False)
        self.pool = core.pool
        self.scheduler = core.scheduler
        self._root = namespace.root
        self._block_size = layout.block_size
        self._loads: list[GroupTransfer] = []
        # Lazy mode: GPU block id -> (vLLM's hash when we saw it computed, our hash).
        self._gpu_hashes: dict[int, tuple[object, BlockHash]] = {}
        self.tiers: SchedulerTiers | None = None
        if config.tiers:
            check_tier_settings(
                config.tiers, namespace=bytes(self._root), block_nbytes=layout.bytes_per_block
            )
            self.tiers = SchedulerTiers(self.scheduler, config.tiers, world_size=world_size)

    # -- hashing -----------------------------------------------------------------------

    def _hashes(self, request: Request, num_tokens: int) -> Sequence[BlockHash]:
        """Hashes of the request's full blocks below ``num_tokens``."""
        entry = self._requests.get(request.request_id)
        if entry is None or entry.request is not request:
            hasher = BlockHasher(self._root, self._block_size, hash_extra(request))
            entry = _RequestHashes(request, hasher)
            self._requests[request.request_id] = entry
        return grow_hashes(entry.hasher, request, self._block_size, num_tokens)

    # -- vLLM scheduler hooks ----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past vLLM's own prefix that can be loaded from CPU (loaded before the
        step's forward, so never asynchronously); ``None`` while the next block's store
        is still in flight."""
        if not self._offloadable(request):
            return 0, False
        rid = request.request_id
        sched = self.scheduler
        if sched.has_request(rid):
            state = sched.request_state(rid)
            if state.gpu_block_ids and not (state.preempted or state.finished):
                # A request with a block table asks again: vLLM preempted it. The
                # connector hears of that only in build_connector_meta, after the new
                # table was allocated, so start the request over now (the old table's
                # blocks must never be read for it again).
                sched.preempt(rid)
                self._restarted.add(rid)
        hashes = self._hashes(request, request.num_tokens)
        hit = sched.lookup(
            rid,
            hashes,
            request.num_tokens,
            num_computed_tokens,
            allow_defer=True,
            no_read=bool(getattr(request, "skip_reading_prefix_cache", False)),
        )
        return hit, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the accepted part of the hit into the allocated blocks."""
        rid = request.request_id
        if not self.scheduler.has_request(rid):
            return
        if num_external_tokens == 0:
            self.scheduler.release(rid)
            return
        block_ids = blocks.get_block_ids()[0]
        plan = self.scheduler.plan_load(rid, block_ids, num_external_tokens)
        if plan is not None:
            self._loads.append(GroupTransfer(plan.plan_id, 0, plan))
            self._tracked[plan.plan_id] = Tracked(plan, [])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVOffloadConnectorMetadata:
        """Record what vLLM scheduled, plan this step's stores, and hand out the plans."""
        sched = self.scheduler
        self._take_preempted(scheduler_output)
        manager = self._bound_manager()
        lazy = self.config.store_mode == "lazy"
        for rid, request, computed in self._scheduled(scheduler_output):
            hashes = self._hashes(request, computed)
            block_ids = manager.get_block_ids(rid)[0]
            try:
                sched.update(rid, block_ids, hashes, computed)
            except ValueError:
                # vLLM replaced a block of the table (a copy-on-write of a shared partial
                # block): start the request over, as after a preemption.
                _log.debug("block_table_changed", request_id=rid)
                sched.preempt(rid)
                sched.update(rid, block_ids, hashes, computed)
            if lazy:
                self._remember_gpu_hashes(block_ids, hashes)
        if lazy:
            if self._gpu_pool is None:
                raise InvariantError("KVOffloadConnector: the GPU block pool was never bound")
            plan = sched.plan_stores(_FreeQueueView(self._gpu_pool, self._gpu_hashes))
        else:
            plan = sched.plan_stores()
        stores: tuple[GroupTransfer, ...] = ()
        if plan is not None:
            # one group: vLLM's group 0, reported under the plan id (unique in one pool)
            stores = (GroupTransfer(plan.plan_id, 0, plan),)
            self._tracked[plan.plan_id] = Tracked(plan, self._pin_gpu_blocks(plan.gpu_block_ids))
            if self.config.enable_events:
                self.events.note_store(
                    0,
                    plan,
                    self._block_size,
                    self._hash_block_size(self._block_size),
                    self._request_hashes,
                )
        loads, self._loads = tuple(self._loads), []
        return self._with_tier_work(
            KVOffloadConnectorMetadata(group_loads=loads, group_stores=stores, async_loads=False)
        )

    def _tiers(self) -> SchedulerTiers | None:
        return self.tiers

    def _remember_gpu_hashes(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        pool = self._gpu_pool
        if pool is None:
            return
        known = self._gpu_hashes
        for gpu_id, block_hash in zip(block_ids, hashes, strict=False):
            vllm_hash = pool.blocks[gpu_id].block_hash
            if vllm_hash is not None:
                known[gpu_id] = (vllm_hash, block_hash)

    def _request_hashes(self, rid: str) -> tuple[Request, Sequence[BlockHash]] | None:
        entry = self._requests.get(rid)
        return None if entry is None else (entry.request, entry.hashes)

    def _preempt_reported(self, rid: str) -> None:
        sched = self.scheduler
        if sched.has_request(rid) and not sched.request_state(rid).finished:
            sched.preempt(rid)

    def _complete(self, tracked: Tracked, ok: bool) -> None:
        self.scheduler.complete(tracked.plan, ok)
        plan = tracked.plan
        if not ok and isinstance(plan, StorePlan):
            self.events.forget_unstored(0, plan.block_hashes, self.pool.is_cached)
        if ok and self.tiers is not None and isinstance(plan, StorePlan):
            self.tiers.forget_absent(plan.block_hashes)

    def request_finished(self, request: Request) -> bool:
        """The request left vLLM. Its store copies keep their GPU blocks referenced on
        their own, so vLLM may free the request's blocks now (always ``False``)."""
        rid = request.request_id
        self._requests.pop(rid, None)
        sched = self.scheduler
        if sched.has_request(rid) and not sched.request_state(rid).finished:
            sched.finish(rid)
        return False

    def reset_cache(self) -> bool:
        """Empty the CPU prefix cache (copies in flight publish nothing)."""
        self.scheduler.reset()
        self._gpu_hashes.clear()
        if self.tiers is not None:
            self.tiers.reset()
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The pool's events as vLLM KV cache events (`KVEvents`: medium ``"CPU"``,
        group 0, vLLM's hashes), then the blocks every rank wrote down to a tier (its
        medium, `kvoffload.integrations.vllm.events.tier_medium`)."""
        if not self.config.enable_events:
            return ()
        return self.events.translate((0, event) for event in self.pool.take_events())

    # -- observation -------------------------------------------------------------------

    def statistics(self) -> ConnectorStatistics:
        """The CPU pool's and the scheduler's statistics, and with tiers the promotions'
        (`SchedulerTiers.manager_statistics`)."""
        return ConnectorStatistics(
            pool=self.pool.statistics(),
            scheduler=self.scheduler.statistics(),
            tiers=None if self.tiers is None else self.tiers.manager_statistics(),
        )

    def pinned_gpu_block_ids(self) -> list[int]:
        """GPU blocks referenced by stores in flight (with repetitions)."""
        return list(
            itertools.chain.from_iterable(
                (b.block_id for b in t.pinned_gpu_blocks) for t in self._tracked.values()
            )
        )
