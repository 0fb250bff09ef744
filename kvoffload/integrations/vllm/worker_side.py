"""The connector's worker side: kvoffload's copy engines over the KV caches vLLM registers.

Each worker (one per tensor-parallel rank) owns a host buffer with the same number of CPU
blocks as the scheduler side's pool and copies its own shard of every plan. Loads finish
before the step's forward reads them; stores start after the forward wrote their blocks.
Finished copies are collected by a `CompletionPoller` driven from vLLM's step (no
event loop) and reported back in the worker metadata, keyed by plan and rank.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, final

import anyio
import torch

from kvoffload._logging import get_logger
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import LayoutMismatchError
from kvoffload.integrations.vllm.metadata import (
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.pages import page_views
from kvoffload.storage import HostKVBuffer
from kvoffload.transfer import (
    CompletionPoller,
    CopyEngine,
    CudaCopyEngine,
    ThreadCopyEngine,
    TransferStatus,
    TransferTask,
)

if TYPE_CHECKING:
    from kvoffload.transfer.thread_engine import CopyHook

__all__ = ["WorkerSide", "layer_views", "worker_rank"]

_log = get_logger("integrations.vllm")
_LOAD_WAIT_S = 0.0002


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


def worker_rank() -> int:
    """This worker's rank in vLLM's world group (0 when vLLM's groups are not set up)."""
    try:
        from vllm.distributed.parallel_state import get_world_group  # noqa: PLC0415

        return int(get_world_group().rank_in_group)
    except (AssertionError, ImportError, RuntimeError, AttributeError):
        return 0


@final
class WorkerSide:
    """One vLLM worker's copies.

    Args:
        config: the settings (pool size, pinning, poll interval).
        layout: one CPU block's geometry (this rank's shard).
        layer_names: attention layers in the order CPU blocks hold them.
        num_gpu_blocks: vLLM's GPU block count.
        rank: this worker's rank (``None``: read it from vLLM).
        copy_hook: for `ThreadCopyEngine`, run before each copy (fault injection).
        opaque: move pages as bytes (``layout`` is an `opaque_layout`: an MLA latent,
            K/V of two head sizes) through `page_views` instead of `layer_views`.
    """

    def __init__(
        self,
        config: OffloadConfig,
        layout: KVLayout,
        layer_names: Sequence[str],
        num_gpu_blocks: int,
        *,
        rank: int | None = None,
        copy_hook: CopyHook | None = None,
        opaque: bool = False,
    ) -> None:
        self.config = config
        self.opaque = opaque
        self.layout = layout
        self.layer_names = list(layer_names)
        self.num_gpu_blocks = num_gpu_blocks
        self.rank = worker_rank() if rank is None else rank
        self._copy_hook = copy_hook
        self.engine: CopyEngine | None = None
        self.host: HostKVBuffer | None = None
        self._device: torch.device | None = None
        self._poller = CompletionPoller(self._on_complete, poll_interval_s=config.poll_interval_s)
        self._reports: dict[int, bool] = {}
        self._load_errors: set[int] = set()
        self._meta: KVOffloadConnectorMetadata | None = None
        self.bytes_loaded = 0
        self.bytes_stored = 0

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Build the host buffer and the copy engine over vLLM's KV caches.

        Raises:
            LayoutMismatchError: the caches do not fit the layout (see `layer_views`).
            HostMemoryError: the host buffer cannot be allocated or pinned.
        """
        views_of = page_views if self.opaque else layer_views
        views = views_of(kv_caches, self.layer_names, self.layout, self.num_gpu_blocks)
        num_cpu_blocks = self.config.resolve_num_cpu_blocks(self.layout)
        self.host = HostKVBuffer(
            self.layout,
            num_cpu_blocks,
            pin_memory=self.config.pin_memory,
            pin_chunk_bytes=int(self.config.pin_chunk_bytes),
        )
        self._device = views[0].device
        if self._device.type == "cuda":
            self.engine = CudaCopyEngine(
                self.layout, views, self.host, poll_interval_s=self.config.poll_interval_s
            )
        else:
            self.engine = ThreadCopyEngine(
                self.layout,
                views,
                self.host,
                copy_hook=self._copy_hook,
                poll_interval_s=self.config.poll_interval_s,
            )
        _log.info(
            "vllm_worker_ready",
            rank=self.rank,
            device=str(self._device),
            cpu_blocks=num_cpu_blocks,
            bytes_per_block=self.layout.bytes_per_block,
        )

    def _on_complete(self, task: TransferTask) -> None:
        ok = task.status is TransferStatus.DONE
        plan = task.plan
        self._reports[plan.plan_id] = self._reports.get(plan.plan_id, True) and ok
        if plan.kind == "load":
            if ok:
                self.bytes_loaded += task.nbytes
            else:
                self._load_errors.update(plan.gpu_block_ids)
        elif ok:
            self.bytes_stored += task.nbytes

    def _submit(self, engine: CopyEngine, plan: object) -> TransferTask:
        from kvoffload.transfer.plan import TransferPlan  # noqa: PLC0415

        if not isinstance(plan, TransferPlan):
            raise TypeError(f"expected a TransferPlan, got {type(plan).__name__}")
        task = engine.submit(plan)
        self._poller.track(task)
        return task

    def bind(self, meta: KVOffloadConnectorMetadata) -> None:
        """Remember the step's plans."""
        self._meta = meta

    def clear(self) -> None:
        """Forget the step's plans."""
        self._meta = None

    def start_load_kv(self) -> None:
        """Run the step's loads; on CPU, return once they ended (failed blocks are kept
        for `take_load_errors()`); on CUDA, make the compute stream wait for them."""
        meta = self._meta
        engine = self.engine
        if meta is None or not meta.loads or engine is None:
            return
        tasks = [self._submit(engine, plan) for plan in meta.loads]
        if self._device is not None and self._device.type == "cuda":
            current = torch.cuda.current_stream(self._device)
            for task in tasks:
                task.wait_on(current)
            self._poller.poll()
            return
        while not all(task.done() for task in tasks):
            if not self._poller.poll():
                time.sleep(_LOAD_WAIT_S)

    def wait_for_save(self) -> None:
        """Start the step's stores (after the forward that wrote their blocks)."""
        meta = self._meta
        engine = self.engine
        if meta is not None and engine is not None:
            for plan in meta.stores:
                self._submit(engine, plan)
        self._poller.poll()

    def take_load_errors(self) -> set[int]:
        """GPU block ids whose load failed since the last call."""
        self._poller.poll()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_reports(self) -> KVOffloadWorkerMetadata | None:
        """This rank's finished copies since the last call, or ``None``."""
        self._poller.poll()
        if not self._reports:
            return None
        reports, self._reports = self._reports, {}
        return KVOffloadWorkerMetadata({pid: {self.rank: ok} for pid, ok in reports.items()})

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
        """Wait for the copies in flight, then release the engine and the host buffer."""
        self.wait_idle()
        engine, self.engine = self.engine, None
        if engine is not None:
            anyio.run(engine.aclose)
        host, self.host = self.host, None
        if host is not None:
            host.close()
