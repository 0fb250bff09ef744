"""The connector's worker side: kvoffload's copy engines over the KV caches vLLM registers.

Each worker (one per tensor-parallel rank) serves the model's cacheable KV cache groups
(`WorkerGroup`; one for a model of one full-attention group): each group has its own host
buffer, with as many CPU blocks as the scheduler side's pool of that group, and its own
copy engine over exactly that group's layers (`layer_views`, or `page_views` for pages
moved as opaque bytes). The step's metadata names the group of every plan
(`GroupTransfer`); a worker copies its own shard of each. Stores start after the forward
wrote their blocks. Finished copies are collected by a `CompletionPoller` driven from
vLLM's step (no event loop) and reported back in the worker metadata, keyed by transfer
and rank.

How vLLM waits for loads is the step's policy (``async_loads``, set by the scheduler
side). Synchronous (one group): loads end before the forward reads them (on CUDA, the
compute stream waits for them), and a failed load's GPU blocks are reported for vLLM to
recompute (`take_load_errors`). Asynchronous (several groups): block ids are not unique
across groups, so vLLM takes load failures only per request, and a recurrent group's
loaded state is copied into the request's running block before the forward, so it must
have landed a step earlier. A request is then reported finished receiving
(`take_received`) once all of its groups' loads ended, and failed if any of them failed:
vLLM recomputes it from the start in every group.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, final

import anyio
import torch

from kvoffload._logging import get_logger
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import InvariantError, LayoutMismatchError
from kvoffload.integrations.vllm.events import TierWrites
from kvoffload.integrations.vllm.group_tiers import GroupedWorkerTiers, connector_tier_stacks
from kvoffload.integrations.vllm.metadata import (
    GroupTransfer,
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.pages import page_views
from kvoffload.integrations.vllm.stats import (
    ConnectorStatistics,
    KVOffloadConnectorStats,
    StatsReporter,
)
from kvoffload.integrations.vllm.tiers import open_worker_tiers
from kvoffload.storage import HostKVBuffer
from kvoffload.transfer import (
    CompletionPoller,
    CopyEngine,
    CudaCopyEngine,
    ThreadCopyEngine,
    TransferStatus,
    TransferTask,
)
from kvoffload.transfer.plan import LoadPlan, StorePlan

if TYPE_CHECKING:
    from kvoffload.transfer.thread_engine import CopyHook

__all__ = ["WorkerGroup", "WorkerSide", "layer_views", "worker_rank"]

_log = get_logger("integrations.vllm")

_LOAD_WAIT_S = 0.0002


def worker_rank() -> int:
    """This worker's rank in vLLM's world group (0 when vLLM's groups are not set up)."""
    try:
        from vllm.distributed.parallel_state import get_world_group  # noqa: PLC0415

        return int(get_world_group().rank_in_group)
    except (AssertionError, ImportError, RuntimeError, AttributeError):
        return 0


def layer_views(
    kv_caches: Mapping[str, torch.Tensor],
    layer_names: Sequence[str],
    layout: KVLayout,
    num_gpu_blocks: int,
) -> list[torch.Tensor]:
    """Per-layer views of vLLM's KV caches in ``layout``'s ``blocks_first`` shape.

    A layer's cache must hold each block's page as one contiguous run, blocks one after
    the other (block-major, as vLLM's CPU backend and FlashInfer lay it out); how a page
    orders heads, tokens, K and V inside does not matter, since CPU blocks hold it as is.

    Raises:
        LayoutMismatchError: a layer is missing, or its tensor is not block-major and
            contiguous with pages of the layout's size (named with its shape and strides).
    """
    views = []
    want = layout.tensor_shape(num_gpu_blocks)
    per_block = layout.bytes_per_layer_block // layout.element_size
    for name in layer_names:
        tensor = kv_caches.get(name)
        if tensor is None:
            raise LayoutMismatchError(f"vLLM registered no KV cache for layer {name!r}")
        if tensor.dtype != layout.torch_dtype:
            raise LayoutMismatchError(
                f"layer {name!r}: dtype {tensor.dtype} != the cache spec's {layout.dtype}"
            )
        dims = [d for d, size in enumerate(tensor.shape) if size == num_gpu_blocks]
        ok = (
            tensor.is_contiguous()
            and bool(dims)
            and dims[0] == 0
            and tensor.numel() == num_gpu_blocks * per_block
        )
        if not ok:
            raise LayoutMismatchError(
                f"layer {name!r}: KV cache of shape {tuple(tensor.shape)} and strides "
                f"{tensor.stride()} is not {num_gpu_blocks} contiguous block-major pages of "
                f"{per_block} elements; this attention backend's layout is not supported"
            )
        views.append(tensor.view(want))
    return views


@final
class WorkerGroup:
    """One cacheable group on a worker: its layers, layout and CPU block count.

    Attributes:
        index: vLLM's group id.
        layer_names: the group's layers, in the order CPU blocks hold them.
        layout: one CPU block of the group (this rank's shard; an `opaque_layout` when
            ``opaque``).
        num_cpu_blocks: CPU blocks of the group's host buffer (its pool's size).
        opaque: move pages as bytes through `page_views` (an MLA latent, K/V of two head
            sizes, any group of a multi-group model) instead of `layer_views`.
        name: kvoffload's name of the group (``g<index>``: with several groups, its
            tiers are named after it).
        root: the root of the group's hash namespace (its tiers' keys are under it).
    """

    __slots__ = (
        "engine",
        "host",
        "index",
        "layer_names",
        "layout",
        "name",
        "num_cpu_blocks",
        "opaque",
        "root",
        "views",
    )

    def __init__(
        self,
        index: int,
        layer_names: Sequence[str],
        layout: KVLayout,
        num_cpu_blocks: int,
        *,
        opaque: bool = True,
        name: str = "",
        root: bytes = b"",
    ) -> None:
        self.index = index
        self.name = name or f"g{index}"
        self.root = root
        self.layer_names = list(layer_names)
        self.layout = layout
        self.num_cpu_blocks = num_cpu_blocks
        self.opaque = opaque
        self.engine: CopyEngine | None = None
        self.host: HostKVBuffer | None = None
        self.views: list[torch.Tensor] = []
        """The group's layers' views (`layer_views` or `page_views`), once registered."""


@final
class WorkerSide:
    """One vLLM worker's copies, for one KV cache group or several.

    Args:
        config: the settings (pinning, poll interval, tiers).
        groups: the cacheable groups (one for a model of one full-attention group).
        num_gpu_blocks: vLLM's block count (shared by every group).
        rank: this worker's rank (``None``: read it from vLLM).
        copy_hook: for `ThreadCopyEngine`, run before each copy (fault injection).
        world_size: ranks in all (each keeps its shard in the tiers under its own
            namespace when there are several).

    With ``config.tiers``, `register_kv_caches` opens each group's tiers on this rank
    (`GroupedWorkerTiers`, in `tiers`): a group's stored blocks are written down to its
    tiers, and the scheduler side's probes and reads run on the tiers of their group. One
    group's tiers keep their names and files (``kv.bin``); with several, each group's are
    named after it (`group_tier_stacks`: ``kv.<group>.bin``).
    """

    def __init__(
        self,
        config: OffloadConfig,
        groups: Sequence[WorkerGroup],
        num_gpu_blocks: int,
        *,
        rank: int | None = None,
        copy_hook: CopyHook | None = None,
        world_size: int = 1,
    ) -> None:
        self.config = config
        self.num_gpu_blocks = num_gpu_blocks
        self.rank = worker_rank() if rank is None else rank
        self.groups = {g.index: g for g in groups}
        self._copy_hook = copy_hook
        self._world_size = world_size
        self._device: torch.device | None = None
        self._poller = CompletionPoller(self._on_complete, poll_interval_s=config.poll_interval_s)
        self._meta: KVOffloadConnectorMetadata | None = None
        self._stats = StatsReporter(rank=self.rank)
        self.tiers: GroupedWorkerTiers | None = None
        self._tier_writes = TierWrites()
        """Write-downs that ended, per group and tier (with KV events on)."""
        self._running: dict[int, tuple[GroupTransfer, bool]] = {}
        """``id(task) -> (its transfer, whether it is an asynchronous load)``."""
        self._reports: dict[int, bool] = {}
        self._load_errors: set[int] = set()
        self._receiving: dict[str, int] = {}  # request -> its asynchronous loads running
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self.bytes_loaded: dict[int, int] = dict.fromkeys(self.groups, 0)
        self.bytes_stored: dict[int, int] = dict.fromkeys(self.groups, 0)

    # -- building ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Build each group's host buffer and copy engine over its own layers.

        Raises:
            LayoutMismatchError: the caches do not fit a group's layout (see
                `layer_views`, `page_view`).
            HostMemoryError: a host buffer cannot be allocated or pinned.
        """
        for group in self.groups.values():
            views_of = page_views if group.opaque else layer_views
            views = views_of(kv_caches, group.layer_names, group.layout, self.num_gpu_blocks)
            group.host = host = self._host_buffer(group.layout, group.num_cpu_blocks)
            group.views = views
            group.engine = self._copy_engine(group.layout, views, host)
        if self.config.tiers:
            self.tiers = self._open_tiers()
        _log.info(
            "vllm_worker_ready",
            rank=self.rank,
            device=str(self._device),
            groups={g.index: g.num_cpu_blocks for g in self.groups.values()},
            bytes_per_block={g.index: g.layout.bytes_per_block for g in self.groups.values()},
        )

    def _host_buffer(self, layout: KVLayout, num_cpu_blocks: int) -> HostKVBuffer:
        return HostKVBuffer(
            layout,
            num_cpu_blocks,
            pin_memory=self.config.pin_memory,
            pin_chunk_bytes=int(self.config.pin_chunk_bytes),
        )

    def _copy_engine(
        self, layout: KVLayout, views: list[torch.Tensor], host: HostKVBuffer
    ) -> CopyEngine:
        """A copy engine between ``views`` and ``host``: `CudaCopyEngine` on CUDA tensors,
        else `ThreadCopyEngine`; the views' device becomes the worker's."""
        self._device = views[0].device
        if self._device.type == "cuda":
            return CudaCopyEngine(layout, views, host, poll_interval_s=self.config.poll_interval_s)
        return ThreadCopyEngine(
            layout,
            views,
            host,
            copy_hook=self._copy_hook,
            poll_interval_s=self.config.poll_interval_s,
        )

    def _open_tiers(self) -> GroupedWorkerTiers:
        """Each group's tiers on this rank (`connector_tier_stacks`, as the
        scheduler side builds them), opened over the group's host buffer."""
        groups = list(self.groups.values())
        several = len(groups) > 1
        need = {g.name: g.num_cpu_blocks * g.layout.bytes_per_block for g in groups}
        stacks = connector_tier_stacks(self.config.tiers, need)
        hosts = {g.index: g.host for g in groups if g.host is not None}
        parts = {}
        try:
            for g in groups:
                parts[g.index] = open_worker_tiers(
                    stacks[g.name],
                    root=g.root,
                    host=hosts[g.index],
                    rank=self.rank,
                    world_size=self._world_size,
                    name=f"kvoffload-vllm-tiers-{self.rank}" + (f"-{g.name}" if several else ""),
                )
                if self.config.enable_events:
                    # KV events: the scheduler side publishes what every rank wrote down
                    parts[g.index].on_written = functools.partial(
                        self._tier_writes.note, group=g.index
                    )
        except BaseException:
            for opened in parts.values():
                opened.close()
            raise
        return GroupedWorkerTiers(parts)

    # -- the step ----------------------------------------------------------------------

    def bind(self, meta: KVOffloadConnectorMetadata) -> None:
        """Remember the step's plans; start its tier probes and reads."""
        self._meta = meta
        tiers = self.tiers
        if tiers is not None and (meta.tier_probes or meta.tier_reads):
            tiers.submit(meta.tier_probes, meta.tier_reads)

    def clear(self) -> None:
        """Forget the step's plans."""
        self._meta = None

    def start_load_kv(self) -> None:
        """Run the step's loads of every group. On CPU, return once they ended; on CUDA,
        make the compute stream wait for them. With ``async_loads``, vLLM learns of them
        per request (`take_received`), else failed blocks wait for `take_load_errors()`."""
        meta = self._meta
        if meta is None or not meta.group_loads:
            return
        waiting = meta.async_loads
        if waiting:
            for transfer in meta.group_loads:
                plan = transfer.plan
                if isinstance(plan, LoadPlan):
                    rid = plan.request_id
                    self._receiving[rid] = self._receiving.get(rid, 0) + 1
        tasks = [self._submit(t, waiting) for t in meta.group_loads]
        if self._wait_for_loads(tasks):
            self._poller.poll()  # deliver them now, for take_received()

    def wait_for_save(self) -> None:
        """Start the step's stores of every group (after the forward wrote them)."""
        meta = self._meta
        if meta is not None:
            for transfer in meta.group_stores:
                self._submit(transfer, False)
        self._poller.poll()

    def _submit(self, transfer: GroupTransfer, waiting: bool) -> TransferTask:
        engine = self.groups[transfer.group].engine
        if engine is None:
            raise InvariantError("KVOffloadConnector: register_kv_caches() was not called")
        task = engine.submit(transfer.plan)
        self._running[id(task)] = (transfer, waiting)
        self._poller.track(task)
        return task

    def _wait_for_loads(self, tasks: Sequence[TransferTask]) -> bool:
        """On CUDA, make the compute stream wait for ``tasks`` (``False``); on CPU,
        return once they all ended (``True``)."""
        if self._device is not None and self._device.type == "cuda":
            current = torch.cuda.current_stream(self._device)
            for task in tasks:
                task.wait_on(current)
            self._poller.poll()
            return False
        while not all(task.done() for task in tasks):
            if not self._poller.poll():
                time.sleep(_LOAD_WAIT_S)
        return True

    def _on_complete(self, task: TransferTask) -> None:
        """Account for a finished copy (called by the poller)."""
        ok = task.status is TransferStatus.DONE
        plan = task.plan
        transfer, waiting = self._running.pop(id(task))
        self._reports[transfer.key] = self._reports.get(transfer.key, True) and ok
        if isinstance(plan, LoadPlan):
            if ok:
                self.bytes_loaded[transfer.group] += task.nbytes
            elif waiting:
                self._failed.add(plan.request_id)
            else:
                self._load_errors.update(plan.gpu_block_ids)
            if waiting:
                self._received_one(plan.request_id)
        elif ok:
            self.bytes_stored[transfer.group] += task.nbytes
            if self.tiers is not None and isinstance(plan, StorePlan):
                self.tiers.on_stored(transfer.group, plan)

    def _received_one(self, rid: str) -> None:
        left = self._receiving.get(rid)
        if left is None:
            return
        if left <= 1:
            del self._receiving[rid]
            self._received.add(rid)
        else:
            self._receiving[rid] = left - 1

    # -- what the scheduler side and vLLM are told -------------------------------------

    def take_received(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)``: the requests whose asynchronous loads all ended since
        the last call, and those of them with a failed load (a subset); both empty
        without ``async_loads``."""
        self._poller.poll()
        done, self._received = self._received, set()
        failed = self._failed & done
        self._failed -= failed
        return done, failed

    def take_load_errors(self) -> set[int]:
        """GPU block ids whose synchronous load failed since the last call (asynchronous
        loads fail per request, `take_received`)."""
        self._poller.poll()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_reports(self) -> KVOffloadWorkerMetadata | None:
        """This rank's finished copies (keyed by transfer), tier probes, tier reads and
        tier write-downs since the last call, or ``None``."""
        self._poller.poll()
        rank = self.rank
        meta = None
        if self._reports:
            reports, self._reports = self._reports, {}
            meta = KVOffloadWorkerMetadata({key: {rank: ok} for key, ok in reports.items()})
        tiers = self.tiers
        if tiers is None:
            return meta
        probes, reads = tiers.take()
        writes = self._tier_writes.take()
        if not probes and not reads and not writes:
            return meta
        if meta is None:
            meta = KVOffloadWorkerMetadata()
        meta.tier_probes = {key: {rank: run} for key, run in probes.items()}
        meta.tier_reads = {key: {rank: good} for key, good in reads.items()}
        meta.tier_writes = {key: {rank: hashes} for key, hashes in writes.items()}
        return meta

    def statistics(self) -> ConnectorStatistics:
        """This rank's statistics now: its completion poller's and, with tiers, its
        tiers' (`WorkerTiers.manager_statistics`: never waits for them)."""
        stats = ConnectorStatistics(poller=self._poller.statistics())
        tiers = self.tiers
        if tiers is None:
            return stats
        return replace(stats, tiers=tiers.manager_statistics())

    def take_stats(self) -> KVOffloadConnectorStats | None:
        """This rank's figures (`statistics()`) that changed since the last call
        (labelled ``rank``), for vLLM's ``get_kv_connector_stats()``."""
        return self._stats.take(self.statistics())

    @property
    def in_flight(self) -> int:
        """Copies submitted and not yet delivered."""
        return self._poller.in_flight

    def wait_idle(self) -> None:
        """Block until every submitted copy ended (used on shutdown and in tests)."""
        while self._poller.in_flight:
            if not self._poller.poll():
                time.sleep(_LOAD_WAIT_S)

    def shutdown(self) -> None:
        """Wait for the copies in flight and the tiers' writes, then release the engines
        and host buffers."""
        self.wait_idle()
        tiers, self.tiers = self.tiers, None
        if tiers is not None:
            tiers.close()
        for group in self.groups.values():
            engine, group.engine = group.engine, None
            host, group.host = group.host, None
            if engine is not None:
                anyio.run(engine.aclose)
            if host is not None:
                host.close()
