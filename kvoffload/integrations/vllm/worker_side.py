"""The connector's worker side: kvoffload's copy engines over the KV caches vLLM registers.

Each worker (one per tensor-parallel rank) owns a host buffer with the same number of CPU
blocks as the scheduler side's pool and copies its own shard of every plan (the one
group's `GroupTransfer` of the step's ``group_loads`` and ``group_stores``). Loads finish
before the step's forward reads them; stores start after the forward wrote their blocks.
Finished copies are collected by a `CompletionPoller` driven from vLLM's step (no
event loop) and reported back in the worker metadata, keyed by transfer key and rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, final

import torch

from kvoffload._logging import get_logger
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import LayoutMismatchError
from kvoffload.integrations.vllm._worker_base import WorkerSideBase, worker_rank
from kvoffload.integrations.vllm.metadata import GroupTransfer
from kvoffload.integrations.vllm.pages import page_views
from kvoffload.integrations.vllm.tiers import WorkerTiers, open_worker_tiers
from kvoffload.storage import HostKVBuffer
from kvoffload.transfer import CopyEngine, StorePlan, TransferStatus, TransferTask

if TYPE_CHECKING:
    from kvoffload.transfer.thread_engine import CopyHook

__all__ = ["WorkerSide", "layer_views", "worker_rank"]

_log = get_logger("integrations.vllm")


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
class WorkerSide(WorkerSideBase):
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
        namespace: the root of the scheduler side's hash namespace (the tiers' keys are
            under `rank_namespace` of it).
        world_size: ranks in all (each keeps its shard in the tiers under its own
            namespace when there are several).

    With ``config.tiers``, `register_kv_caches` opens this rank's tiers (`WorkerTiers`,
    in `tiers`): stored blocks are written down, and the scheduler side's probes and
    promotions run there.
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
        namespace: bytes = b"",
        world_size: int = 1,
    ) -> None:
        super().__init__(config, num_gpu_blocks, rank=rank, copy_hook=copy_hook)
        self._namespace = namespace
        self._world_size = world_size
        self.tiers: WorkerTiers | None = None
        self.opaque = opaque
        self.layout = layout
        self.layer_names = list(layer_names)
        self.engine: CopyEngine | None = None
        self.host: HostKVBuffer | None = None
        self._load_errors: set[int] = set()
        self._keys: dict[int, int] = {}  # id(plan) -> its transfer key, while it runs
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
        self.host = self._host_buffer(self.layout, num_cpu_blocks)
        self.engine = self._copy_engine(self.layout, views, self.host)
        if self.config.tiers:
            self.tiers = self._open_tiers(self.host)
        _log.info(
            "vllm_worker_ready",
            rank=self.rank,
            device=str(self._device),
            cpu_blocks=num_cpu_blocks,
            bytes_per_block=self.layout.bytes_per_block,
        )

    def _open_tiers(self, host: HostKVBuffer) -> WorkerTiers:
        tiers = open_worker_tiers(
            self.config.tiers,
            root=self._namespace,
            host=host,
            rank=self.rank,
            world_size=self._world_size,
            name=f"kvoffload-vllm-tiers-{self.rank}",
        )
        if self.config.enable_events:
            # KV events: the scheduler side publishes the blocks every rank wrote down.
            tiers.on_written = self._tier_writes.note  # group 0
        return tiers

    def _tiers(self) -> WorkerTiers | None:
        return self.tiers

    def _on_complete(self, task: TransferTask) -> None:
        ok = task.status is TransferStatus.DONE
        plan = task.plan
        self._report(self._keys.pop(id(plan)), ok)
        if ok and self.tiers is not None and isinstance(plan, StorePlan):
            self.tiers.on_stored(plan)
        if plan.kind == "load":
            if ok:
                self.bytes_loaded += task.nbytes
            else:
                self._load_errors.update(plan.gpu_block_ids)
        elif ok:
            self.bytes_stored += task.nbytes

    def _submit(self, engine: CopyEngine, transfer: GroupTransfer) -> TransferTask:
        task = engine.submit(transfer.plan)
        self._keys[id(transfer.plan)] = transfer.key
        self._poller.track(task)
        return task

    def start_load_kv(self) -> None:
        """Run the step's loads; on CPU, return once they ended (failed blocks are kept
        for `take_load_errors()`); on CUDA, make the compute stream wait for them."""
        meta = self._meta
        engine = self.engine
        if meta is None or not meta.group_loads or engine is None:
            return
        self._wait_for_loads([self._submit(engine, t) for t in meta.group_loads])

    def wait_for_save(self) -> None:
        """Start the step's stores (after the forward that wrote their blocks)."""
        meta = self._meta
        engine = self.engine
        if meta is not None and engine is not None:
            for transfer in meta.group_stores:
                self._submit(engine, transfer)
        self._poller.poll()

    def take_load_errors(self) -> set[int]:
        """GPU block ids whose load failed since the last call."""
        self._poller.poll()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Wait for the copies in flight, then release the engine and the host buffer."""
        self.wait_idle()
        tiers, self.tiers = self.tiers, None
        if tiers is not None:
            tiers.close()
        engine, self.engine = self.engine, None
        host, self.host = self.host, None
        self._release(engine, host)
