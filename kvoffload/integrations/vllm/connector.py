"""`KVOffloadConnector`: the vLLM v1 KV connector vLLM loads by module path."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvoffload.build import REFUSED, check_settings, grouped_pool_sizes
from kvoffload.errors import InvariantError
from kvoffload.groups import KVCacheGroup, check_groups, hit_alignment
from kvoffload.hashing import BlockHash, HashNamespace
from kvoffload.integrations.vllm.events import events_enabled
from kvoffload.integrations.vllm.groups import GroupDescription, to_kv_cache_group
from kvoffload.integrations.vllm.metadata import KVOffloadConnectorMetadata
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide, group_roots
from kvoffload.integrations.vllm.setup import (
    accepted_groups,
    is_single_full_group,
    model_namespace_id,
    offload_config,
    opaque_layout,
    refuse_recurrent_hybrid,
    single_group_layout,
)
from kvoffload.integrations.vllm.stats import KVOffloadConnectorStats, KVOffloadPromMetrics
from kvoffload.integrations.vllm.worker_side import WorkerGroup, WorkerSide

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvoffload.transfer.thread_engine import CopyHook

__all__ = ["KVOffloadConnector"]


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Offloads vLLM's KV blocks to a CPU pool with kvoffload and loads them back.

    vLLM builds one instance in its scheduler process (``role=SCHEDULER``: the decisions,
    by `SchedulerSide` over kvoffload's `GroupedScheduler`) and one in every worker
    (``role=WORKER``: the copies, by `ThreadCopyEngine` on CPU tensors or
    `CudaCopyEngine` on CUDA tensors). Settings come from ``kv_connector_extra_config``:
    every `OffloadConfig` field under its own name.

    It supports vLLM's hybrid KV cache manager (`SupportsHMA`): one `SchedulerSide` and
    one `WorkerSide` serve a model of one full-attention group and one of several groups
    (sliding window, chunked, recurrent state, full). Loads are waited for before the
    forward with one group and asynchronous with several: a policy the step's metadata
    carries (``async_loads``), not a second class.

    ``tiers`` (disk, Redis, Redis Cluster, as for `KVOffloader`) sit below the CPU pool:
    stored blocks are written down by the workers, and a lookup that misses on CPU
    promotes what the tiers hold (`kvoffload.integrations.vllm.tiers`; with several
    groups each group's blocks under its own namespace and a hit needing every group,
    `kvoffload.integrations.vllm.group_tiers`).

    Args:
        vllm_config: vLLM's configuration (its ``kv_transfer_config`` names this class).
        role: scheduler or worker.
        kv_cache_config: the KV cache layout vLLM allocated.

    Raises:
        ConfigError: an unknown or invalid setting, a setting the connector cannot
            honour for this model (`kvoffload.build.check_settings()`), a tier's
            settings that its tier refuses, or a model with a group the connector cannot
            offload (named, with its kind and why).

    The class is not final: vLLM instantiates whatever class the configuration names, and
    tests subclass it to choose a worker's rank (`_worker_rank`) or to inject copy
    failures (`_copy_hook`).
    """

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Check ``kv_connector_extra_config`` before vLLM loads the model; no layout needed.

        vLLM asks this in its scheduler process (the engine core) while it picks the KV
        cache layout, before any worker loads weights or builds a connector: a misspelt
        key or a bad value then stops start-up at once with a `ConfigError` naming it,
        instead of from each worker after the model has loaded.

        A model with recurrent-state layers (Mamba, linear attention) next to attention
        is refused here too when vLLM's hybrid KV cache manager is turned off: vLLM would
        then fail after loading the model with "Failed to promote local KV cache specs to
        one unified type".

        Raises:
            ConfigError: as `offload_config` (the key named, the valid keys listed), a
                setting the connector cannot honour for any model (finish holds,
                ...: `kvoffload.build.REFUSED`), or such a hybrid with the hybrid
                manager off (its architecture named).
        """
        transfer = vllm_config.kv_transfer_config
        block_size = vllm_config.cache_config.block_size
        if transfer is not None and block_size is not None:
            config = offload_config(transfer.kv_connector_extra_config, block_size=block_size)
            # What no model can change: the groups are not known yet.
            common = REFUSED["vllm"].keys() & REFUSED["vllm_groups"].keys()
            refused = {name: why for name, why in REFUSED["vllm"].items() if name in common}
            check_settings(config, "vllm", refused=refused)
        refuse_recurrent_hybrid(vllm_config)
        return None

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.offload_config = offload_config(extra, block_size=vllm_config.cache_config.block_size)
        if events_enabled(vllm_config) and not self.offload_config.enable_events:
            # vLLM publishes KV events: the CPU pool's go with them.
            self.offload_config = self.offload_config.model_copy(update={"enable_events": True})
        self.groups = accepted_groups(kv_cache_config)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        model_id = model_namespace_id(vllm_config, self.offload_config)
        world_size = vllm_config.parallel_config.world_size
        kv_groups = [to_kv_cache_group(g) for g in self.groups]
        single = is_single_full_group(self.groups)
        if single:
            check_settings(self.offload_config, "vllm")
            self.layout, layer_names, opaque = single_group_layout(kv_cache_config)
            namespace = HashNamespace.from_layout(
                self.layout, model_id=model_id, salt=self.offload_config.hash_salt
            )
            roots = {kv_groups[0].name: namespace.root}
        else:
            # groups whose hit alignment exceeds the model's context can never hit: refused
            check_groups(kv_groups, max_model_len=vllm_config.model_config.max_model_len)
            check_settings(self.offload_config, "vllm_groups")
            roots = group_roots(kv_groups, model_id=model_id, salt=self.offload_config.hash_salt)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(
                self.offload_config,
                kv_groups,
                roots,
                world_size=world_size,
                num_gpu_blocks=kv_cache_config.num_blocks,
            )
        elif single:
            cpu_blocks = self.offload_config.resolve_num_cpu_blocks(self.layout)
            root = bytes(roots[kv_groups[0].name])
            group = WorkerGroup(0, layer_names, self.layout, cpu_blocks, opaque=opaque, root=root)
            self._init_worker([group], kv_cache_config.num_blocks, world_size)
        else:
            self._init_worker(
                self._worker_groups(kv_groups, roots), kv_cache_config.num_blocks, world_size
            )

    def _worker_groups(
        self, kv_groups: list[KVCacheGroup], roots: dict[str, BlockHash]
    ) -> list[WorkerGroup]:
        """The cacheable groups of a multi-group model, as the worker side copies them."""
        sizes = grouped_pool_sizes(self.offload_config, kv_groups, hit_alignment(kv_groups))
        described: dict[str, GroupDescription] = {
            k.name: d for k, d in zip(kv_groups, self.groups, strict=True)
        }
        return [
            WorkerGroup(
                described[k.name].index,
                described[k.name].layer_names,
                opaque_layout(described[k.name]),
                sizes[k.name],
                name=k.name,
                root=bytes(roots[k.name]),
            )
            for k in kv_groups
            if k.cacheable
        ]

    def _init_worker(self, groups: list[WorkerGroup], num_blocks: int, world_size: int) -> None:
        """The worker side, for one group or several."""
        self.worker_side = WorkerSide(
            self.offload_config,
            groups,
            num_blocks,
            rank=self._worker_rank(),
            copy_hook=self._copy_hook(),
            world_size=world_size,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        """``False``: the CPU pool is a best-effort cache; a dropped store is a later miss."""
        return False

    # -- extension points (tests) ------------------------------------------------------

    def _worker_rank(self) -> int | None:
        """This worker's rank; ``None`` reads it from vLLM's process groups."""
        return None

    def _copy_hook(self) -> CopyHook | None:
        """A hook run before each CPU copy (fault injection); ``None`` by default."""
        return None

    def _sched(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise InvariantError("a scheduler-side method was called on a worker connector")
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise InvariantError("a worker-side method was called on a scheduler connector")
        return self.worker_side

    # -- scheduler side ----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Keep vLLM's cache manager: block tables, and GPU block references for stores."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past vLLM's prefix that the CPU pool holds (``None``: ask again)."""
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of ``num_external_tokens`` into the request's new blocks."""
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Record the step, plan its stores, and send every plan to the workers."""
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Complete the plans every worker reported."""
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Finish the request in kvoffload; stores in flight keep their GPU blocks
        referenced themselves, so vLLM frees the rest now."""
        return self._sched().request_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished, before vLLM frees its blocks in every group: plan its
        last store point in every group (those blocks stay referenced until the copies
        end), so vLLM frees the rest now."""
        return self._sched().request_finished(request), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The CPU pool's events for vLLM's event publisher, with vLLM's block hashes
        (on with vLLM's ``kv_events_config.enable_kv_cache_events``, or ``enable_events``;
        `kvoffload.integrations.vllm.events`)."""
        return self._sched().take_events()

    def reset_cache(self) -> bool:
        """Empty the CPU prefix cache."""
        return self._sched().reset_cache()

    def has_pending_block_frees(self) -> bool:
        """Whether a store in flight will free a GPU block when it completes."""
        return self._sched().has_pending_block_frees()

    # -- statistics (both sides) -------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's figures since the last call (scheduler: pool, scheduler, groups,
        tiers; worker: its poller), `kvoffload.integrations.vllm.stats`."""
        side = self.scheduler_side if self.scheduler_side is not None else self.worker_side
        return None if side is None else side.take_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild the statistics vLLM carried as a dict (`KVOffloadConnectorStats`)."""
        return KVOffloadConnectorStats() if data is None else KVOffloadConnectorStats(data=data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVOffloadPromMetrics:
        """kvoffload's metrics in vLLM's ``/metrics`` (`KVOffloadPromMetrics`)."""
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the host buffer and the copy engine over vLLM's KV caches."""
        self._worker().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take the step's plans."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None and isinstance(
            connector_metadata, KVOffloadConnectorMetadata
        ):
            self.worker_side.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Drop the step's plans."""
        super().clear_connector_metadata()
        if self.worker_side is not None:
            self.worker_side.clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Run the step's loads before the forward reads them."""
        self._worker().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads ended (or were ordered) in `start_load_kv`."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: whole blocks are stored after the forward."""

    def wait_for_save(self) -> None:
        """Start the step's stores."""
        self._worker().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous loads ended (a multi-group model; vLLM asks
        `get_transfer_results`, which also names the failed ones); no request waits on a
        store (frees are not delayed)."""
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads (``async_loads``, a multi-group model): the requests whose
        loads all ended, and those with a failed load (vLLM recomputes them from the
        start). Nothing when the step's loads were waited for (one group)."""
        worker = self.worker_side
        if worker is None:
            return KVConnectorTransferResults()
        done, failed = worker.take_received()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose load failed: vLLM recomputes them."""
        return self._worker().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This rank's finished copies, for the scheduler side."""
        return self._worker().take_reports()

    def shutdown(self) -> None:
        """Wait for copies in flight and release host memory."""
        if self.worker_side is not None:
            self.worker_side.shutdown()
