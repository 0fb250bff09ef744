"""The connector's worker side for a model of several KV cache groups (vLLM's hybrid
KV cache manager on).

Each cacheable group has its own host buffer (one CPU block = one block of the group's
layers, its pages as opaque bytes) and its own copy engine over `page_views` of exactly
that group's layers. vLLM's group tensors alias one allocation, so a copy of one group's
blocks touches that group's layers' pages of those blocks only; the step's metadata names
the group of every plan (`GroupTransfer`).

vLLM waits for a multi-group model's loads asynchronously: block ids are not unique
across groups, so vLLM takes load failures only per request (``failed_recving``), and
only for a request waiting for its load; and a recurrent group's loaded state is copied
into the request's running block before the forward, so it must have landed a step
earlier. A request is reported finished receiving (`get_transfer_results`) once all of
its groups' loads ended, and failed if any of them failed: vLLM then recomputes it from
the start in every group.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, final

import anyio
import torch

from kvoffload._logging import get_logger
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.integrations.vllm.metadata import (
    GroupTransfer,
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.pages import page_views
from kvoffload.integrations.vllm.worker_side import worker_rank
from kvoffload.storage import HostKVBuffer
from kvoffload.transfer import (
    CompletionPoller,
    CopyEngine,
    CudaCopyEngine,
    ThreadCopyEngine,
    TransferStatus,
    TransferTask,
)
from kvoffload.transfer.plan import LoadPlan

if TYPE_CHECKING:
    from kvoffload.transfer.thread_engine import CopyHook

__all__ = ["GroupedWorkerSide", "WorkerGroup"]

_log = get_logger("integrations.vllm")
_LOAD_WAIT_S = 0.0002


@final
class WorkerGroup:
    """One cacheable group on a worker: its layers, layout and CPU block count.

    Attributes:
        index: vLLM's group id.
        layer_names: the group's layers, in the order CPU blocks hold them.
        layout: the `opaque_layout` of one CPU block of the group.
        num_cpu_blocks: CPU blocks of the group's host buffer (its pool's size).
    """

    __slots__ = ("engine", "host", "index", "layer_names", "layout", "num_cpu_blocks", "views")

    def __init__(
        self, index: int, layer_names: Sequence[str], layout: KVLayout, num_cpu_blocks: int
    ) -> None:
        self.index = index
        self.layer_names = list(layer_names)
        self.layout = layout
        self.num_cpu_blocks = num_cpu_blocks
        self.engine: CopyEngine | None = None
        self.host: HostKVBuffer | None = None
        self.views: list[torch.Tensor] = []
        """The group's layers' pages (`page_views`), once registered."""


@final
class GroupedWorkerSide:
    """One vLLM worker's copies for a multi-group model.

    Args:
        config: the settings (pinning, poll interval).
        groups: the cacheable groups.
        num_gpu_blocks: vLLM's block count (shared by every group).
        rank: this worker's rank (``None``: read it from vLLM).
        copy_hook: for `ThreadCopyEngine`, run before each copy (fault injection).
    """

    def __init__(
        self,
        config: OffloadConfig,
        groups: Sequence[WorkerGroup],
        num_gpu_blocks: int,
        *,
        rank: int | None = None,
        copy_hook: CopyHook | None = None,
    ) -> None:
        self.config = config
        self.groups = {g.index: g for g in groups}
        self.num_gpu_blocks = num_gpu_blocks
        self.rank = worker_rank() if rank is None else rank
        self._copy_hook = copy_hook
        self._device: torch.device | None = None
        self._poller = CompletionPoller(self._on_complete, poll_interval_s=config.poll_interval_s)
        self._running: dict[int, GroupTransfer] = {}  # id(plan) -> its transfer
        self._reports: dict[int, bool] = {}
        self._receiving: dict[str, int] = {}  # request -> its loads not ended yet
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._meta: KVOffloadConnectorMetadata | None = None
        self.bytes_loaded: dict[int, int] = dict.fromkeys(self.groups, 0)
        self.bytes_stored: dict[int, int] = dict.fromkeys(self.groups, 0)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Build each group's host buffer and copy engine over its own layers' pages.

        Raises:
            LayoutMismatchError: a layer's tensor is not block-major pages (`page_view`).
            HostMemoryError: a host buffer cannot be allocated or pinned.
        """
        for group in self.groups.values():
            views = page_views(kv_caches, group.layer_names, group.layout, self.num_gpu_blocks)
            host = HostKVBuffer(
                group.layout,
                group.num_cpu_blocks,
                pin_memory=self.config.pin_memory,
                pin_chunk_bytes=int(self.config.pin_chunk_bytes),
            )
            group.host = host
            group.views = views
            self._device = views[0].device
            if self._device.type == "cuda":
                group.engine = CudaCopyEngine(
                    group.layout, views, host, poll_interval_s=self.config.poll_interval_s
                )
            else:
                group.engine = ThreadCopyEngine(
                    group.layout,
                    views,
                    host,
                    copy_hook=self._copy_hook,
                    poll_interval_s=self.config.poll_interval_s,
                )
        _log.info(
            "vllm_worker_ready",
            rank=self.rank,
            device=str(self._device),
            groups={g.index: g.num_cpu_blocks for g in self.groups.values()},
        )

    def _on_complete(self, task: TransferTask) -> None:
        ok = task.status is TransferStatus.DONE
        plan = task.plan
        transfer = self._running.pop(id(plan))
        self._reports[transfer.key] = self._reports.get(transfer.key, True) and ok
        if isinstance(plan, LoadPlan):
            rid = plan.request_id
            if ok:
                self.bytes_loaded[transfer.group] += task.nbytes
            else:
                self._failed.add(rid)
            left = self._receiving.get(rid)
            if left is not None:
                if left <= 1:
                    del self._receiving[rid]
                    self._received.add(rid)
                else:
                    self._receiving[rid] = left - 1
        elif ok:
            self.bytes_stored[transfer.group] += task.nbytes

    def _submit(self, transfer: GroupTransfer) -> TransferTask:
        engine = self.groups[transfer.group].engine
        if engine is None:
            raise RuntimeError("register_kv_caches() was not called")
        task = engine.submit(transfer.plan)
        self._running[id(transfer.plan)] = transfer
        self._poller.track(task)
        return task

    def bind(self, meta: KVOffloadConnectorMetadata) -> None:
        """Remember the step's plans."""
        self._meta = meta

    def clear(self) -> None:
        """Forget the step's plans."""
        self._meta = None

    def start_load_kv(self) -> None:
        """Run the step's loads of every group; on CPU, return once they ended."""
        meta = self._meta
        if meta is None or not meta.group_loads:
            return
        for transfer in meta.group_loads:
            plan = transfer.plan
            if isinstance(plan, LoadPlan):
                self._receiving[plan.request_id] = self._receiving.get(plan.request_id, 0) + 1
        tasks = [self._submit(t) for t in meta.group_loads]
        if self._device is not None and self._device.type == "cuda":
            current = torch.cuda.current_stream(self._device)
            for task in tasks:
                task.wait_on(current)
            self._poller.poll()
            return
        while not all(task.done() for task in tasks):
            if not self._poller.poll():
                time.sleep(_LOAD_WAIT_S)
        self._poller.poll()

    def wait_for_save(self) -> None:
        """Start the step's stores of every group (after the forward wrote them)."""
        meta = self._meta
        if meta is not None:
            for transfer in meta.group_stores:
                self._submit(transfer)
        self._poller.poll()

    def take_received(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)``: the requests whose loads all ended since the last call,
        and those of them with a failed load (a subset)."""
        self._poller.poll()
        done, self._received = self._received, set()
        failed = self._failed & done
        self._failed -= failed
        return done, failed

    def take_load_errors(self) -> set[int]:
        """Nothing: a multi-group model's load failures go per request (`take_received`)."""
        return set()

    def take_reports(self) -> KVOffloadWorkerMetadata | None:
        """This rank's finished copies since the last call, keyed by transfer key."""
        self._poller.poll()
        if not self._reports:
            return None
        reports, self._reports = self._reports, {}
        return KVOffloadWorkerMetadata({key: {self.rank: ok} for key, ok in reports.items()})

    @property
    def in_flight(self) -> int:
        """Copies submitted and not yet delivered."""
        return self._poller.in_flight

    def wait_idle(self) -> None:
        """Block until every submitted copy ended."""
        while self._poller.in_flight:
            if not self._poller.poll():
                time.sleep(_LOAD_WAIT_S)

    def shutdown(self) -> None:
        """Wait for the copies in flight, then release the engines and host buffers."""
        self.wait_idle()
        for group in self.groups.values():
            engine, group.engine = group.engine, None
            if engine is not None:
                anyio.run(engine.aclose)
            host, group.host = group.host, None
            if host is not None:
                host.close()
