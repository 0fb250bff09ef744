"""What the connector's two scheduler sides share (`SchedulerSide` for one full-attention
group, `GroupedSchedulerSide` for several): vLLM's KV cache manager and GPU block pool,
request hashing inputs, the GPU block references a store holds, and the collection of
every worker's reports before a plan is completed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from kvoffload._logging import get_logger
from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError, InvariantError
from kvoffload.hashing import BlockHash, BlockHasher
from kvoffload.integrations.vllm.events import KVEvents, tier_medium
from kvoffload.integrations.vllm.metadata import (
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.stats import (
    ConnectorStatistics,
    KVOffloadConnectorStats,
    StatsReporter,
)
from kvoffload.transfer.plan import TransferPlan

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvoffload.integrations.vllm.group_tiers import GroupedSchedulerTiers
    from kvoffload.integrations.vllm.tiers import SchedulerTiers

__all__ = ["RequestEntry", "SchedulerSideBase", "Tracked", "grow_hashes", "hash_extra"]

_log = get_logger("integrations.vllm")


@dataclass(slots=True, eq=False)
class Tracked:
    """A plan sent to the workers and not yet reported by all of them (``group``: its
    group's name on a multi-group model, ``""`` for one group)."""

    plan: TransferPlan
    pinned_gpu_blocks: list[Any]
    group: str = ""
    reports: dict[int, bool] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class RequestEntry:
    """A request vLLM told the connector about, with the hashers of its tokens."""

    request: Request


def hash_extra(request: Request) -> bytes:
    """What a request's block hashes mix in besides its tokens: its LoRA adapter and its
    cache salt."""
    parts = []
    if request.lora_request is not None:
        parts.append(f"lora:{request.lora_request.lora_name}")
    if request.cache_salt:
        parts.append(f"salt:{request.cache_salt}")
    return "\x00".join(parts).encode()


def grow_hashes(
    hasher: BlockHasher, request: Request, block_size: int, num_tokens: int
) -> Sequence[BlockHash]:
    """``hasher``'s hashes of the request's full blocks below ``num_tokens``, hashing the
    blocks it lacks (whole blocks only: the hasher keeps no tail here)."""
    hashes = hasher.block_hashes
    want = min(num_tokens, request.num_tokens) // block_size
    if len(hashes) < want:
        hasher.extend(request.all_token_ids[len(hashes) * block_size : want * block_size])
    return hashes[:want]


E = TypeVar("E", bound=RequestEntry)


class SchedulerSideBase(Generic[E]):
    """The state and hooks both scheduler sides keep alike.

    Args:
        config: the settings from ``kv_connector_extra_config``.
        world_size: workers that copy every plan.

    Raises:
        ConfigError: ``world_size`` < 1.
    """

    _report_key: ClassVar[str] = "plan_id"
    """The name the ``late_report_ignored`` log event gives a report's key."""

    def __init__(self, config: OffloadConfig, *, world_size: int) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        self.config = config
        self.world_size = world_size
        self._requests: dict[str, E] = {}
        self._tracked: dict[int, Tracked] = {}
        self._gpu_pool: BlockPool | None = None
        self._manager: KVCacheManager | None = None
        # Requests preempted by vLLM and started over in this step, before
        # build_connector_meta lists them as preempted.
        self._restarted: set[str] = set()
        self.load_failures = 0
        self._stats = StatsReporter()
        self.events = KVEvents(tier_media=[tier_medium(t.kind) for t in config.tiers])
        """The vLLM view of the blocks stores write (``enable_events``)."""

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

    # -- requests ----------------------------------------------------------------------

    def _offloadable(self, request: Request) -> bool:
        return not request.mm_features and request.prompt_embeds is None

    def _preempt_reported(self, rid: str) -> None:
        """vLLM reported ``rid`` preempted (and it was not started over this step)."""
        raise NotImplementedError

    def _take_preempted(self, scheduler_output: SchedulerOutput) -> None:
        """Start over the requests vLLM preempted this step (once: not those started over
        already when they asked again)."""
        restarted, self._restarted = self._restarted, set()
        for rid in scheduler_output.preempted_req_ids or ():
            if rid in restarted:
                continue  # started over when it asked again (get_num_new_matched_tokens)
            self._preempt_reported(rid)

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

    # -- GPU block references and reports ----------------------------------------------

    def _pin_gpu_blocks(self, block_ids: Sequence[int]) -> list[Any]:
        """Reference the GPU blocks a store reads in vLLM's block pool until it is done."""
        pool = self._gpu_pool
        if pool is None:
            return []
        blocks = [pool.blocks[i] for i in block_ids]
        pool.touch(blocks)
        return blocks

    def _complete(self, tracked: Tracked, ok: bool) -> None:
        """Complete a plan every worker reported (``ok``: all of them copied it)."""
        raise NotImplementedError

    # -- tiers -------------------------------------------------------------------------

    def _tiers(self) -> SchedulerTiers | GroupedSchedulerTiers | None:
        """The side's tiers (``config.tiers``), or ``None``."""
        raise NotImplementedError

    def _with_tier_work(self, meta: KVOffloadConnectorMetadata) -> KVOffloadConnectorMetadata:
        """The step's metadata with the tiers' probes and reads of this step."""
        tiers = self._tiers()
        if tiers is None:
            return meta
        meta.tier_probes, meta.tier_reads = tiers.take_work()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Complete every plan that all workers have now reported; hand the tiers'
        answers to the side's tiers (probes answered, promotions read)."""
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, KVOffloadWorkerMetadata):
            raise TypeError(f"KVOffloadConnector got worker metadata of type {type(meta).__name__}")
        for key, ranks in meta.reports.items():
            tracked = self._tracked.get(key)
            if tracked is None:
                _log.debug("late_report_ignored", **{self._report_key: key})
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
        tiers = self._tiers()
        if tiers is not None and (meta.tier_probes or meta.tier_reads):
            # the tiers' answers: probes answered, promotions read
            tiers.on_reports(meta.tier_probes, meta.tier_reads)
        if meta.tier_writes and self.config.enable_events:
            # write-downs every rank ended: BlockStored events of the tiers' media
            self.events.note_tier_writes(meta.tier_writes, self.world_size)

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

    def _hash_block_size(self, default: int) -> int:
        """The tokens per hash of vLLM's ``request.block_hashes`` (its block pool's)."""
        pool = self._gpu_pool
        return int(getattr(pool, "hash_block_size", default) or default)

    # -- observation -------------------------------------------------------------------

    def statistics(self) -> ConnectorStatistics:
        """The side's statistics now (the parts vLLM's metrics read)."""
        raise NotImplementedError

    def take_stats(self) -> KVOffloadConnectorStats | None:
        """What changed since the last call, for vLLM's ``get_kv_connector_stats()``."""
        return self._stats.take(self.statistics())

    def in_flight_plan_ids(self) -> list[int]:
        """Plans (on a multi-group model, transfer keys) sent to workers and not reported
        by all of them yet."""
        return list(self._tracked)
