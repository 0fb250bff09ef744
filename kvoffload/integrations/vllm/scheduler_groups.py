"""The connector's scheduler side for a model of several KV cache groups: vLLM's hybrid
KV cache manager events mapped onto kvoffload's `GroupedScheduler`.

vLLM hands the connector one block-id list per group (`KVCacheBlocks.get_block_ids()`,
``NewRequestData.block_ids``); its null block (id 0) marks a block the group does not
hold (out of the window, a skipped state, padding) and becomes a ``None`` entry. Each
group hashes the request's tokens in its own namespace with its own block size, so a hit
is checked group by group and is valid for every group, a multiple of the LCM of their
block sizes (vLLM's ``cache_hit_alignment_tokens``), added beyond vLLM's own local hit.

Store points are every multiple of that LCM (``checkpoint_tokens`` = the alignment): a
recurrent-state snapshot exists in vLLM's table only right after the step that computed
it, so every boundary a step ends at must be a store point. Stores and loads are planned
per group; GPU blocks a store reads are referenced in vLLM's block pool until every
worker finished copying them, as in the single-group path.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, final

from kvoffload._logging import get_logger
from kvoffload.build import build_grouped_scheduler
from kvoffload.config import OffloadConfig
from kvoffload.errors import RequestStateError
from kvoffload.groups import KVCacheGroup, hit_alignment
from kvoffload.hashing import BlockHash, BlockHasher
from kvoffload.integrations.vllm._scheduler_base import (
    RequestEntry,
    SchedulerSideBase,
    Tracked,
    grow_hashes,
    hash_extra,
)
from kvoffload.integrations.vllm.group_tiers import (
    GroupedSchedulerTiers,
    check_group_tier_settings,
)
from kvoffload.integrations.vllm.metadata import GroupTransfer, KVOffloadConnectorMetadata
from kvoffload.integrations.vllm.stats import ConnectorStatistics
from kvoffload.scheduler.group_totals import GroupCounters, pool_statistics
from kvoffload.scheduler.groups import GroupedPlan, GroupedScheduler
from kvoffload.tiers.groups import group_tier_stacks
from kvoffload.transfer.plan import StorePlan, TransferPlan

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["GroupedSchedulerSide", "group_roots"]

_log = get_logger("integrations.vllm")


@dataclass(slots=True, eq=False)
class _Hashes(RequestEntry):
    """One request's block hashes, one hasher per cacheable group."""

    hashers: dict[str, BlockHasher]


@dataclass(slots=True, eq=False)
class _Transfer:
    """One grouped transfer whose parts (one per group) travel under their own keys."""

    parts: int
    tokens: int = 0
    ok: bool = True


def tables_of(
    block_ids: Sequence[Sequence[int]], names: Sequence[str | None]
) -> dict[str, list[int | None]]:
    """Per cacheable group name, vLLM's block ids with its null block (0) as ``None``."""
    return {
        name: [b or None for b in ids]
        for name, ids in zip(names, block_ids, strict=True)
        if name is not None
    }


def group_roots(
    groups: Sequence[KVCacheGroup], *, model_id: str, salt: str
) -> dict[str, BlockHash]:
    """Per cacheable group, the root of its hash namespace (its block hashes chain from
    it; its tiers' keys and headers are under it): the same on both sides."""
    return {g.name: g.namespace(model_id=model_id, salt=salt).root for g in groups if g.cacheable}


@final
class GroupedSchedulerSide(SchedulerSideBase[_Hashes]):
    """kvoffload's decisions for one vLLM scheduler of a multi-group model.

    Args:
        config: the settings from ``kv_connector_extra_config``.
        groups: one `KVCacheGroup` per vLLM group, in vLLM's group order.
        model_id: mixed into every group's hash namespace.
        world_size: workers that copy every plan.
        num_gpu_blocks: vLLM's block count (shared by every group).

    With ``config.tiers``, each cacheable group has its own tiers under its own namespace
    and a lookup that misses on CPU asks them (`GroupedSchedulerTiers`, in `tiers`); a
    lookup then answers "ask again" (``None``) while a promotion a longer hit needs runs.

    Raises:
        ConfigError: a group gets no CPU block, ``world_size`` < 1, or a tier's settings
            are refused by the tier (the group and tier named).
    """

    _report_key: ClassVar[str] = "key"

    def __init__(
        self,
        config: OffloadConfig,
        groups: Sequence[KVCacheGroup],
        *,
        model_id: str,
        world_size: int,
        num_gpu_blocks: int,
    ) -> None:
        super().__init__(config, world_size=world_size)
        self.groups = tuple(groups)
        self.alignment = hit_alignment(self.groups)
        self.checkpoint_tokens = self.alignment
        self.scheduler: GroupedScheduler = build_grouped_scheduler(
            config,
            self.groups,
            checkpoint_tokens=self.checkpoint_tokens,
            num_gpu_blocks={g.name: num_gpu_blocks for g in self.groups if g.cacheable},
        )
        self._cacheable = [g for g in self.groups if g.cacheable]
        self._by_name = {g.name: g for g in self.groups}
        self._index = {g.name: i for i, g in enumerate(self.groups)}
        self._names: list[str | None] = [g.name if g.cacheable else None for g in self.groups]
        self._roots = group_roots(self._cacheable, model_id=model_id, salt=config.hash_salt)
        self._keys = itertools.count()
        self._loads: list[GroupTransfer] = []
        self._stores: list[GroupTransfer] = []
        self.loaded_tokens = 0
        """Prompt tokens planned to load from the CPU pool (beyond vLLM's own hits)."""
        self.counters = GroupCounters()
        """The whole model's counters (as a multi-group `KVOffloader` keeps them)."""
        self._transfers: dict[tuple[str, int], _Transfer] = {}
        self._page_bytes = {g.name: g.num_layers * g.bytes_per_layer_block for g in self.groups}
        self.tiers: GroupedSchedulerTiers | None = None
        if config.tiers:
            need = {
                g.name: self._page_bytes[g.name] * self.scheduler.ledger(g.name).pool.num_blocks
                for g in self._cacheable
            }
            stacks = group_tier_stacks(config.tiers, need)
            check_group_tier_settings(stacks, self._roots, self._page_bytes)
            self.tiers = GroupedSchedulerTiers(
                self.scheduler, stacks, world_size=world_size, index=self._index
            )

    # -- hashing -----------------------------------------------------------------------

    def _tiers(self) -> GroupedSchedulerTiers | None:
        return self.tiers

    def _hashes(self, request: Request, num_tokens: int) -> dict[str, list[BlockHash]]:
        """Per cacheable group, the hashes of the request's full blocks below
        ``num_tokens``."""
        entry = self._requests.get(request.request_id)
        if entry is None or entry.request is not request:
            extra = hash_extra(request)
            hashers = {
                g.name: BlockHasher(self._roots[g.name], g.block_size, extra)
                for g in self._cacheable
            }
            entry = _Hashes(request, hashers)
            self._requests[request.request_id] = entry
        return {
            g.name: list(grow_hashes(entry.hashers[g.name], request, g.block_size, num_tokens))
            for g in self._cacheable
        }

    def _tables(self, block_ids: Sequence[Sequence[int]]) -> dict[str, list[int | None]]:
        return tables_of(block_ids, self._names)

    # -- vLLM scheduler hooks ----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past vLLM's own prefix (a multiple of the alignment) that every group
        can load from CPU; a load is always asynchronous (vLLM takes a multi-group
        model's load failures only per waiting request, and copies a loaded recurrent
        state before the forward of the step it is scheduled in). With tiers, ``None``
        ("ask again") while a promotion of a block a longer hit needs runs in some group,
        for at most the tiers' lookup budget (`GroupedScheduler.lookup`)."""
        if not self._offloadable(request):
            return 0, False
        rid = request.request_id
        sched = self.scheduler
        if sched.has_request(rid) and rid not in self._restarted:
            # Asked again with state kept: vLLM preempted it and freed its blocks (it tells
            # the connector only in build_connector_meta). Start it over (preempt() stores
            # nothing from the freed blocks).
            sched.preempt(rid)
            self._restarted.add(rid)
        hashes = self._hashes(request, request.num_tokens)  # its blocks are stored too
        if num_computed_tokens % self.alignment or getattr(
            request, "skip_reading_prefix_cache", False
        ):
            return 0, False
        hit = sched.lookup(
            rid,
            hashes,
            request.num_tokens,
            num_computed_tokens,
            allow_defer=self.tiers is not None,
        )
        reason, new_prompt, _ = sched.lookup_outcome(rid)
        self.counters.count_lookup(
            hit, request.num_tokens, num_computed_tokens, reason, new_prompt=new_prompt
        )
        return hit, bool(hit)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the hit into the blocks vLLM allocated in every group."""
        rid = request.request_id
        sched = self.scheduler
        if not sched.has_request(rid):
            return
        if num_external_tokens == 0:
            sched.release(rid)
            return
        tables = self._tables(blocks.get_block_ids())
        plan = sched.plan_load(rid, tables, num_external_tokens)
        if plan is None:
            return
        self.loaded_tokens += num_external_tokens
        self.counters.load_plans += 1
        transfer = _Transfer(len(plan.plans), tokens=num_external_tokens)
        for name, sub in plan.plans.items():
            key = next(self._keys)
            self._loads.append(GroupTransfer(key, self._index[name], sub))
            self._tracked[key] = Tracked(sub, [], name)
            self._transfers[name, sub.plan_id] = transfer

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVOffloadConnectorMetadata:
        """Record what vLLM scheduled in every group, plan this step's stores, and hand
        out the plans."""
        sched = self.scheduler
        self._take_preempted(scheduler_output)
        manager = self._bound_manager()
        for rid, request, computed in self._scheduled(scheduler_output):
            hashes = self._hashes(request, computed)
            sched.update(rid, self._tables(manager.get_block_ids(rid)), hashes, computed)
        self._track_stores(sched.plan_stores())
        loads, self._loads = tuple(self._loads), []
        stores, self._stores = tuple(self._stores), []
        return self._with_tier_work(
            KVOffloadConnectorMetadata(group_loads=loads, group_stores=stores, async_loads=True)
        )

    def _track_stores(self, plan: GroupedPlan | None) -> None:
        if plan is None:
            return
        self.counters.store_plans += 1
        transfer = _Transfer(len(plan.plans))
        hash_block_size = self._hash_block_size(min(g.block_size for g in self._cacheable))
        for name, sub in plan.plans.items():
            key = next(self._keys)
            self._stores.append(GroupTransfer(key, self._index[name], sub))
            self._tracked[key] = Tracked(sub, self._pin_gpu_blocks(sub.gpu_block_ids), name)
            self._transfers[name, sub.plan_id] = transfer
            if self.config.enable_events:
                self.events.note_store(
                    self._index[name],
                    sub,  # type: ignore[arg-type]
                    self._by_name[name].block_size,
                    hash_block_size,
                    functools.partial(self._request_hashes, group=name),
                )

    def _request_hashes(self, rid: str, group: str) -> tuple[Request, Sequence[BlockHash]] | None:
        entry = self._requests.get(rid)
        return None if entry is None else (entry.request, entry.hashers[group].block_hashes)

    def _preempt_reported(self, rid: str) -> None:
        if self.scheduler.has_request(rid):
            self.scheduler.preempt(rid)

    def _complete(self, tracked: Tracked, ok: bool) -> None:
        group, plan = tracked.group, tracked.plan
        self.scheduler.complete(group, plan, ok)
        self._count_part(group, plan, ok)
        if ok and self.tiers is not None and isinstance(plan, StorePlan):
            self.tiers.forget_absent(group, plan.block_hashes)
        if not ok and plan.kind == "store" and self.config.enable_events:
            pool = self.scheduler.ledger(group).pool
            self.events.forget_unstored(
                self._index[group],
                plan.block_hashes,  # type: ignore[attr-defined]
                pool.is_cached,
            )

    def _count_part(self, group: str, plan: TransferPlan, ok: bool) -> None:
        """Count one group's part of a transfer; the transfer once all parts ended."""
        transfer = self._transfers.pop((group, plan.plan_id), None)
        if transfer is None:
            return
        c = self.counters
        nbytes = len(plan.cpu_block_ids) * self._page_bytes[group]
        if ok and plan.kind == "store":
            c.bytes_stored += nbytes
        elif ok:
            c.bytes_loaded += nbytes
        transfer.ok = transfer.ok and ok
        transfer.parts -= 1
        if transfer.parts:
            return
        if not transfer.ok and plan.kind == "store":
            c.failed_stores += 1
        elif not transfer.ok:
            c.failed_loads += 1
        else:
            c.loaded_tokens += transfer.tokens

    def request_finished(self, request: Request) -> bool:
        """The request left vLLM, before vLLM frees its blocks: plan its last store point
        now (its GPU blocks stay referenced until the copies end); always ``False``."""
        rid = request.request_id
        self._restarted.discard(rid)
        sched = self.scheduler
        if sched.has_request(rid):
            try:
                plan = sched.finish(rid)
            except RequestStateError:  # already finished, its transfers still in flight
                _log.debug("finish_ignored", request_id=rid)
                plan = None
            self._track_stores(plan)  # while the request's hashes are known (events)
        self._requests.pop(rid, None)
        return False

    def reset_cache(self) -> bool:
        """Empty every group's CPU prefix cache (copies in flight publish nothing)."""
        self.scheduler.reset()
        if self.tiers is not None:
            self.tiers.reset()
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Every group's pool events as vLLM KV cache events (`KVEvents`: medium
        ``"CPU"``, the group's vLLM index, vLLM's hashes)."""
        if not self.config.enable_events:
            return ()
        sched = self.scheduler
        return self.events.translate(
            (self._index[g.name], event)
            for g in self._cacheable
            for event in sched.ledger(g.name).pool.take_events()
        )

    # -- observation -------------------------------------------------------------------

    def statistics(self) -> ConnectorStatistics:
        """The pools added up, the whole model's counters, each group's, and with tiers
        the promotions of every group added up (`GroupedSchedulerTiers.manager_statistics`)."""
        sched = self.scheduler
        return ConnectorStatistics(
            pool=pool_statistics(sched),
            scheduler=self.counters.statistics(
                sched, live_requests=len(self._requests), in_flight_transfers=len(self._tracked)
            ),
            tiers=None if self.tiers is None else self.tiers.manager_statistics(),
            groups=sched.statistics(),
        )
