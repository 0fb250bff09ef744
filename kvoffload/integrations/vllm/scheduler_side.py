"""The connector's scheduler side: vLLM's scheduler events mapped onto kvoffload's
`GroupedScheduler`, for a model of one KV cache group or several.

It runs in vLLM's scheduler process, owns the CPU block pools' bookkeeping (one pool per
cacheable group) and never touches a tensor. Every plan it makes travels to the workers
in the step's metadata as a `GroupTransfer` (one per group's part, under a key of its
own); a plan is completed (published, or released) only once every worker reported it.

vLLM hands the connector one block-id list per group (`KVCacheBlocks.get_block_ids()`);
its null block (id 0) marks a block the group does not hold (out of the window, a
skipped state, padding) and becomes a ``None`` entry. Each group hashes the request's
tokens in its own namespace with its own block size, so a hit is checked group by group
and is valid for every group, a multiple of the LCM of their block sizes (vLLM's
``cache_hit_alignment_tokens``), added beyond vLLM's own local hit. A single
full-attention model is one group: its hit is a multiple of its block size, its
namespace and tiers are those of `KVOffloader` with the same layout.

Store points are every multiple of that LCM (``checkpoint_tokens`` = the alignment): a
recurrent-state snapshot exists in vLLM's table only right after the step that computed
it, so every boundary a step ends at must be a store point. GPU blocks a store reads are
referenced in vLLM's GPU block pool from the moment the store is planned until every
worker finished copying them, so neither a finished or preempted request nor an eviction
can hand them to another request while they are read.

Loads: with one group they run before the step's forward (``async_loads=False``); with
several, vLLM waits for them asynchronously (`loads_are_async`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, final

from kvoffload._logging import get_logger
from kvoffload.build import build_grouped_scheduler
from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError, InvariantError, RequestStateError
from kvoffload.groups import KVCacheGroup, hit_alignment
from kvoffload.hashing import BlockHash, BlockHasher
from kvoffload.integrations.vllm.events import KVEvents, tier_medium
from kvoffload.integrations.vllm.group_tiers import (
    GroupedSchedulerTiers,
    check_group_tier_settings,
    connector_tier_stacks,
)
from kvoffload.integrations.vllm.metadata import (
    GroupTransfer,
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.stats import (
    ConnectorStatistics,
    KVOffloadConnectorStats,
    StatsReporter,
)
from kvoffload.scheduler.group_totals import pool_statistics
from kvoffload.scheduler.groups import GroupedPlan, GroupedScheduler
from kvoffload.transfer.plan import StorePlan, TransferPlan

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvoffload.tier_config import AnyTierSettings

__all__ = ["SchedulerSide", "group_roots", "loads_are_async", "tables_of"]

_log = get_logger("integrations.vllm")


def loads_are_async(groups: Sequence[KVCacheGroup]) -> bool:
    """Whether vLLM waits for the loads asynchronously: with several cacheable groups
    (vLLM takes a multi-group model's load failures only per waiting request, and copies
    a loaded recurrent state before the forward of the step it is scheduled in); one
    group's loads end before the step's forward reads them."""
    return sum(g.cacheable for g in groups) > 1


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


def hash_extra(request: Request) -> bytes:
    """What a request's block hashes mix in besides its tokens: its LoRA adapter and its
    cache salt."""
    parts = []
    if request.lora_request is not None:
        parts.append(f"lora:{request.lora_request.lora_name}")
    if request.cache_salt:
        parts.append(f"salt:{request.cache_salt}")
    return "\x00".join(parts).encode()


def _grow(
    hasher: BlockHasher, request: Request, block_size: int, num_tokens: int
) -> list[BlockHash]:
    """``hasher``'s hashes of the request's full blocks below ``num_tokens``, hashing the
    blocks it lacks (whole blocks only: the hasher keeps no tail here)."""
    hashes = hasher.block_hashes
    want = min(num_tokens, request.num_tokens) // block_size
    if len(hashes) < want:
        hasher.extend(request.all_token_ids[len(hashes) * block_size : want * block_size])
    return list(hashes[:want])


@dataclass(slots=True, eq=False)
class _Hashes:
    """A request vLLM told the connector about, with one hasher per cacheable group."""

    request: Request
    hashers: dict[str, BlockHasher]


@dataclass(slots=True, eq=False)
class _Tracked:
    """One group's part of a plan, sent to the workers and not yet reported by all."""

    plan: TransferPlan
    pinned_gpu_blocks: list[Any]
    group: str
    reports: dict[int, bool] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Transfer:
    """One grouped transfer whose parts (one per group) travel under their own keys."""

    parts: int
    tokens: int = 0
    ok: bool = True


class _FreeQueueView:
    """vLLM's cached, unreferenced GPU blocks of one group, next to be evicted first
    (lazy stores)."""

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
class SchedulerSide:
    """kvoffload's decisions for one vLLM scheduler, for any number of KV cache groups.

    Args:
        config: the settings from ``kv_connector_extra_config``.
        groups: one `KVCacheGroup` per vLLM group, in vLLM's group order (a single
            full-attention model: one ``full`` group).
        roots: per cacheable group, the root of its hash namespace (`group_roots`; one
            group: the root of the `HashNamespace` of its layout, as `KVOffloader`'s).
        world_size: workers that copy every plan (tensor and pipeline parallel ranks);
            the byte counters count every rank's shard.
        num_gpu_blocks: vLLM's block count (shared by every group).

    With ``config.tiers``, each cacheable group has its own tiers under its own namespace
    and a lookup that misses on CPU asks them (`GroupedSchedulerTiers`, in `tiers`); a
    lookup then answers "ask again" (``None``) while a promotion a longer hit needs runs,
    for at most the tiers' lookup budget. One group's tiers keep the names and files of
    ``config.tiers``; with several, each is named ``<tier>.<group>`` (`group_tier_stacks`).

    Raises:
        ConfigError: ``world_size`` < 1, a group gets no CPU block, the groups refuse a
            setting (lazy stores with a group not full attention: the group named, and
            why), or a tier's settings are refused by the tier (named).
    """

    def __init__(
        self,
        config: OffloadConfig,
        groups: Sequence[KVCacheGroup],
        roots: Mapping[str, BlockHash],
        *,
        world_size: int,
        num_gpu_blocks: int,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        self.config = config
        self.world_size = world_size
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
        self.async_loads = loads_are_async(self.groups)
        """Whether vLLM waits for loads asynchronously (`loads_are_async`)."""
        self._by_name = {g.name: g for g in self.groups}
        self._index = {g.name: i for i, g in enumerate(self.groups)}
        self._names: list[str | None] = [g.name if g.cacheable else None for g in self.groups]
        self._roots = {g.name: roots[g.name] for g in self._cacheable}
        self._requests: dict[str, _Hashes] = {}
        # Requests whose id a finished request had (a client may reuse ids): kvoffload
        # never reuses a request's state, so these run without offload, until they finish.
        self._reused: set[str] = set()
        self._tracked: dict[int, _Tracked] = {}
        self._transfers: dict[tuple[str, int], _Transfer] = {}
        self._keys = itertools.count()
        self._loads: list[GroupTransfer] = []
        self._stores: list[GroupTransfer] = []
        self._gpu_pool: BlockPool | None = None
        self._manager: KVCacheManager | None = None
        # Requests whose GPU blocks the scheduler knows (a table or a load), until they
        # are preempted or finish: asked again, vLLM preempted them.
        self._tabled: set[str] = set()
        # Requests preempted by vLLM and started over in this step, before
        # build_connector_meta lists them as preempted.
        self._restarted: set[str] = set()
        # Lazy stores: per group, GPU block id -> (vLLM's hash when seen computed, ours).
        self._gpu_hashes: dict[str, dict[int, tuple[object, BlockHash]]] = {
            g.name: {} for g in self._cacheable
        }
        self._lazy = config.store_mode == "lazy"
        self.load_failures = 0
        self.loaded_tokens = 0
        """Prompt tokens planned to load from the CPU pool (beyond vLLM's own hits)."""
        self.counters = self.scheduler.totals
        """The whole model's counters (lookups and plans counted by the scheduler, the
        transfers' bytes and outcomes here, once all parts ended)."""
        self._page_bytes = {g.name: g.bytes_per_block for g in self.groups}  # a rank's shard
        self._stats = StatsReporter()
        self.events = KVEvents(tier_media=[tier_medium(t.kind) for t in config.tiers])
        """The vLLM view of the blocks stores write (``enable_events``)."""
        self.tiers: GroupedSchedulerTiers | None = None
        if config.tiers:
            self.tiers = GroupedSchedulerTiers(
                self.scheduler, self._tier_stacks(config.tiers), world_size=world_size,
                index=self._index,
            )  # fmt: skip

    def _tier_stacks(self, settings: Sequence[AnyTierSettings]) -> dict[str, list[AnyTierSettings]]:
        """Per cacheable group, its tiers (`connector_tier_stacks`), checked."""
        need = {
            g.name: self._page_bytes[g.name] * self.scheduler.ledger(g.name).pool.num_blocks
            for g in self._cacheable
        }
        stacks = connector_tier_stacks(settings, need)
        check_group_tier_settings(stacks, self._roots, self._page_bytes)
        return stacks

    # -- binding -----------------------------------------------------------------------

    def bind(self, manager: KVCacheManager) -> None:
        """Use vLLM's KV cache manager (block tables and GPU block references)."""
        self._manager = manager
        self._gpu_pool = manager.block_pool

    def _bound_manager(self) -> KVCacheManager:
        manager = self._manager
        if manager is None:
            raise InvariantError("KVOffloadConnector: the KV cache manager was never bound")
        return manager

    # -- requests and hashing ----------------------------------------------------------

    def _offloadable(self, request: Request) -> bool:
        return (
            not request.mm_features
            and request.prompt_embeds is None
            and request.request_id not in self._reused
        )

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
            g.name: _grow(entry.hashers[g.name], request, g.block_size, num_tokens)
            for g in self._cacheable
        }

    def _tables(self, block_ids: Sequence[Sequence[int]]) -> dict[str, list[int | None]]:
        return tables_of(block_ids, self._names)

    def _scheduled(self, scheduler_output: SchedulerOutput) -> Iterator[tuple[str, Request, int]]:
        """``(request id, request, computed tokens)`` of each offloadable request the step
        scheduled (its speculative tokens not counted)."""
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for rid, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            entry = self._requests.get(rid)
            if entry is None or not self._offloadable(entry.request):
                continue
            request = entry.request
            computed = request.num_computed_tokens + num_scheduled - len(spec_tokens.get(rid, ()))
            yield rid, request, computed

    def _preempt(self, rid: str) -> None:
        """Start ``rid`` over: vLLM freed its GPU blocks (nothing is stored from them)."""
        self._tabled.discard(rid)
        sched = self.scheduler
        if sched.has_request(rid) and rid in self._requests:
            sched.preempt(rid)

    # -- vLLM scheduler hooks ----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past vLLM's own prefix (a multiple of the alignment) that every group
        can load from CPU, and whether the load is asynchronous (`async_loads`, when
        there is a hit); ``None`` ("ask again") while the store of a block a longer hit
        needs is in flight or, with tiers, a promotion of one runs, for at most the
        lookup budget (`GroupedScheduler.lookup`)."""
        if not self._offloadable(request):
            return 0, False
        rid = request.request_id
        if rid not in self._requests and self.scheduler.was_finished(rid):
            # a new request under a finished request's id: served without offload (every
            # scheduler call naming a finished id is refused: its state is never reused)
            self._reused.add(rid)
            _log.warning("request_id_reused", request_id=rid, offload=False)
            return 0, False
        if rid in self._tabled:
            # A request whose blocks the scheduler knows asks again: vLLM preempted it.
            # The connector hears of that only in build_connector_meta, after the new
            # table was allocated, so start it over now (the old table's blocks must
            # never be read or stored for it again).
            self._preempt(rid)
            self._restarted.add(rid)
        hashes = self._hashes(request, request.num_tokens)  # its blocks are stored too
        if num_computed_tokens % self.alignment:
            return 0, False
        hit = self.scheduler.lookup(
            rid,
            hashes,
            request.num_tokens,
            num_computed_tokens,
            allow_defer=True,
            no_read=bool(getattr(request, "skip_reading_prefix_cache", False)),
        )
        return hit, self.async_loads and bool(hit)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the accepted hit into the blocks vLLM allocated in every
        group."""
        rid = request.request_id
        sched = self.scheduler
        if rid in self._reused or not sched.has_request(rid):
            return
        if num_external_tokens == 0:
            sched.release(rid)
            return
        plan = sched.plan_load(rid, self._tables(blocks.get_block_ids()), num_external_tokens)
        if plan is None:
            return
        self._tabled.add(rid)
        self.loaded_tokens += num_external_tokens
        transfer = _Transfer(len(plan.plans), tokens=num_external_tokens)
        for name, sub in plan.plans.items():
            key = next(self._keys)
            self._loads.append(GroupTransfer(key, self._index[name], sub))
            self._tracked[key] = _Tracked(sub, [], name)
            self._transfers[name, sub.plan_id] = transfer

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVOffloadConnectorMetadata:
        """Record what vLLM scheduled in every group, plan this step's stores, and hand
        out the plans."""
        sched = self.scheduler
        self._take_preempted(scheduler_output)
        manager = self._bound_manager()
        for rid, request, computed in self._scheduled(scheduler_output):
            hashes = self._hashes(request, computed)
            tables = self._tables(manager.get_block_ids(rid))
            sched.update(rid, tables, hashes, computed)
            self._tabled.add(rid)
            if self._lazy:
                self._remember_gpu_hashes(tables, hashes)
        self._track_stores(sched.plan_stores(self._lazy_views() if self._lazy else None))
        loads, self._loads = tuple(self._loads), []
        stores, self._stores = tuple(self._stores), []
        meta = KVOffloadConnectorMetadata(
            group_loads=loads, group_stores=stores, async_loads=self.async_loads
        )
        if self.tiers is not None:
            meta.tier_probes, meta.tier_reads = self.tiers.take_work()
        return meta

    def _take_preempted(self, scheduler_output: SchedulerOutput) -> None:
        """Start over the requests vLLM preempted this step (once: not those started over
        already when they asked again)."""
        restarted, self._restarted = self._restarted, set()
        for rid in scheduler_output.preempted_req_ids or ():
            if rid not in restarted:
                self._preempt(rid)

    def _remember_gpu_hashes(
        self, tables: Mapping[str, Sequence[int | None]], hashes: Mapping[str, Sequence[BlockHash]]
    ) -> None:
        pool = self._gpu_pool
        if pool is None:
            return
        for name, known in self._gpu_hashes.items():
            for gpu_id, block_hash in zip(tables[name], hashes[name], strict=False):
                if gpu_id is None:
                    continue
                vllm_hash = pool.blocks[gpu_id].block_hash
                if vllm_hash is not None:
                    known[gpu_id] = (vllm_hash, block_hash)

    def _lazy_views(self) -> dict[str, _FreeQueueView]:
        pool = self._gpu_pool
        if pool is None:
            raise InvariantError("KVOffloadConnector: the GPU block pool was never bound")
        return {name: _FreeQueueView(pool, known) for name, known in self._gpu_hashes.items()}

    def _pin_gpu_blocks(self, block_ids: Sequence[int]) -> list[Any]:
        """Reference the GPU blocks a store reads in vLLM's block pool until it is done."""
        pool = self._gpu_pool
        if pool is None:
            return []
        blocks = [pool.blocks[i] for i in block_ids]
        pool.touch(blocks)
        return blocks

    def _track_stores(self, plan: GroupedPlan | None) -> None:
        if plan is None:
            return
        transfer = _Transfer(len(plan.plans))
        hash_block_size = self._hash_block_size(min(g.block_size for g in self._cacheable))
        for name, sub in plan.plans.items():
            key = next(self._keys)
            self._stores.append(GroupTransfer(key, self._index[name], sub))
            self._tracked[key] = _Tracked(sub, self._pin_gpu_blocks(sub.gpu_block_ids), name)
            self._transfers[name, sub.plan_id] = transfer
            if self.config.enable_events:
                self.events.note_store(
                    self._index[name],
                    sub,  # type: ignore[arg-type]
                    self._by_name[name].block_size,
                    hash_block_size,
                    functools.partial(self._request_hashes, group=name),
                )

    def _hash_block_size(self, default: int) -> int:
        """The tokens per hash of vLLM's ``request.block_hashes`` (its block pool's)."""
        pool = self._gpu_pool
        return int(getattr(pool, "hash_block_size", default) or default)

    def _request_hashes(self, rid: str, group: str) -> tuple[Request, Sequence[BlockHash]] | None:
        entry = self._requests.get(rid)
        return None if entry is None else (entry.request, entry.hashers[group].block_hashes)

    # -- reports -----------------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Complete every plan that all workers have now reported; hand the tiers'
        answers to the tiers (probes answered, promotions read)."""
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, KVOffloadWorkerMetadata):
            raise TypeError(f"KVOffloadConnector got worker metadata of type {type(meta).__name__}")
        for key, ranks in meta.reports.items():
            tracked = self._tracked.get(key)
            if tracked is None:
                _log.debug("late_report_ignored", key=key)
                continue
            for rank, ok in ranks.items():
                tracked.reports[rank] = tracked.reports.get(rank, True) and ok
            if len(tracked.reports) < self.world_size:
                continue
            del self._tracked[key]
            ok = all(tracked.reports.values())
            if not ok and tracked.plan.kind == "load":
                self.load_failures += 1
            self._complete(tracked, ok)
            if tracked.pinned_gpu_blocks and self._gpu_pool is not None:
                self._gpu_pool.free_blocks(tracked.pinned_gpu_blocks)
        tiers = self.tiers
        if tiers is not None and (meta.tier_probes or meta.tier_reads):
            tiers.on_reports(meta.tier_probes, meta.tier_reads)
        if meta.tier_writes and self.config.enable_events:
            # write-downs every rank ended: BlockStored events of the tiers' media
            self.events.note_tier_writes(meta.tier_writes, self.world_size)

    def _complete(self, tracked: _Tracked, ok: bool) -> None:
        """Complete a group's part every worker reported (``ok``: all of them copied it)."""
        group, plan = tracked.group, tracked.plan
        self.scheduler.complete(group, plan, ok)
        self._count_part(group, plan, ok)
        if ok and self.tiers is not None and isinstance(plan, StorePlan):
            self.tiers.forget_absent(group, plan.block_hashes)
        if not ok and isinstance(plan, StorePlan) and self.config.enable_events:
            pool = self.scheduler.ledger(group).pool
            self.events.forget_unstored(self._index[group], plan.block_hashes, pool.is_cached)

    def _count_part(self, group: str, plan: TransferPlan, ok: bool) -> None:
        """Count one group's part of a transfer; the transfer once all parts ended."""
        transfer = self._transfers.pop((group, plan.plan_id), None)
        if transfer is None:
            return
        c = self.counters
        nbytes = len(plan.cpu_block_ids) * self._page_bytes[group] * self.world_size
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

    def has_pending_block_frees(self) -> bool:
        """Whether a store in flight is the last holder of some GPU block, so that its
        completion gives vLLM a free block (vLLM then waits instead of preempting)."""
        held: dict[int, int] = {}
        for tracked in self._tracked.values():
            for block in tracked.pinned_gpu_blocks:
                held[block.block_id] = held.get(block.block_id, 0) + 1
        pool = self._gpu_pool
        if pool is None:
            return False
        return any(pool.blocks[i].ref_cnt == n for i, n in held.items())

    # -- finish, reset, events ---------------------------------------------------------

    def request_finished(self, request: Request) -> bool:
        """The request left vLLM, before vLLM frees its blocks: plan its last store point
        now (its GPU blocks stay referenced until the copies end; one full-attention
        group has stored every computed block already); always ``False``."""
        rid = request.request_id
        self._restarted.discard(rid)
        self._tabled.discard(rid)
        if rid in self._reused:
            self._reused.discard(rid)
            return False
        sched = self.scheduler
        if sched.has_request(rid) and rid in self._requests:
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
        for known in self._gpu_hashes.values():
            known.clear()
        if self.tiers is not None:
            self.tiers.reset()
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Every group's pool events as vLLM KV cache events (`KVEvents`: medium
        ``"CPU"``, the group's vLLM index, vLLM's hashes), then the blocks every rank
        wrote down to a tier (its medium, `kvoffload.integrations.vllm.events.tier_medium`)."""
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
        """The pools added up, the whole model's counters and, with several groups, each
        group's; with tiers the promotions of every group added up
        (`GroupedSchedulerTiers.manager_statistics`)."""
        sched = self.scheduler
        return ConnectorStatistics(
            pool=pool_statistics(sched),
            scheduler=self.counters.statistics(
                sched, live_requests=len(self._requests), in_flight_transfers=len(self._tracked)
            ),
            tiers=None if self.tiers is None else self.tiers.manager_statistics(),
            groups=sched.statistics() if len(self._cacheable) > 1 else None,
        )

    def take_stats(self) -> KVOffloadConnectorStats | None:
        """What changed since the last call, for vLLM's ``get_kv_connector_stats()``."""
        return self._stats.take(self.statistics())

    def in_flight_plan_ids(self) -> list[int]:
        """The transfer keys sent to workers and not reported by all of them yet."""
        return list(self._tracked)

    def pinned_gpu_block_ids(self) -> list[int]:
        """GPU blocks referenced by stores in flight (with repetitions)."""
        return list(
            itertools.chain.from_iterable(
                (b.block_id for b in t.pinned_gpu_blocks) for t in self._tracked.values()
            )
        )
