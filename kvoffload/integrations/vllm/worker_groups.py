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

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, final

import torch

from kvoffload._logging import get_logger
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.integrations.vllm._worker_base import WorkerSideBase
from kvoffload.integrations.vllm.group_tiers import GroupedWorkerTiers
from kvoffload.integrations.vllm.metadata import GroupTransfer
from kvoffload.integrations.vllm.pages import page_views
from kvoffload.integrations.vllm.tiers import open_worker_tiers
from kvoffload.storage import HostKVBuffer
from kvoffload.tiers.groups import group_tier_stacks
from kvoffload.transfer import CopyEngine, TransferStatus, TransferTask
from kvoffload.transfer.plan import LoadPlan, StorePlan

if TYPE_CHECKING:
    from kvoffload.transfer.thread_engine import CopyHook

__all__ = ["GroupedWorkerSide", "WorkerGroup"]

_log = get_logger("integrations.vllm")


@final
class WorkerGroup:
    """One cacheable group on a worker: its layers, layout and CPU block count.

    Attributes:
        index: vLLM's group id.
        layer_names: the group's layers, in the order CPU blocks hold them.
        layout: the `opaque_layout` of one CPU block of the group.
        num_cpu_blocks: CPU blocks of the group's host buffer (its pool's size).
        name: kvoffload's name of the group (``g<index>``: its tiers are named after it).
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
        name: str = "",
        root: bytes = b"",
    ) -> None:
        self.index = index
        self.name = name or f"g{index}"
        self.root = root
        self.layer_names = list(layer_names)
        self.layout = layout
        self.num_cpu_blocks = num_cpu_blocks
        self.engine: CopyEngine | None = None
        self.host: HostKVBuffer | None = None
        self.views: list[torch.Tensor] = []
        """The group's layers' pages (`page_views`), once registered."""


@final
class GroupedWorkerSide(WorkerSideBase):
    """One vLLM worker's copies for a multi-group model.

    Args:
        config: the settings (pinning, poll interval).
        groups: the cacheable groups.
        num_gpu_blocks: vLLM's block count (shared by every group).
        rank: this worker's rank (``None``: read it from vLLM).
        copy_hook: for `ThreadCopyEngine`, run before each copy (fault injection).
        world_size: ranks in all (each keeps its shard in the tiers under its own
            namespace when there are several).

    With ``config.tiers``, `register_kv_caches` opens each group's tiers on this rank
    (`GroupedWorkerTiers`, in `tiers`): a group's stored blocks are written down to its
    tiers, and the scheduler side's probes and reads run on the tiers of their group.
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
        super().__init__(config, num_gpu_blocks, rank=rank, copy_hook=copy_hook)
        self.groups = {g.index: g for g in groups}
        self._world_size = world_size
        self.tiers: GroupedWorkerTiers | None = None
        self._running: dict[int, GroupTransfer] = {}  # id(plan) -> its transfer
        self._receiving: dict[str, int] = {}  # request -> its loads not ended yet
        self._received: set[str] = set()
        self._failed: set[str] = set()
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
        )

    def _open_tiers(self) -> GroupedWorkerTiers:
        """Each group's tiers on this rank (`group_tier_stacks`, as the scheduler side
        builds them), opened over the group's host buffer."""
        groups = list(self.groups.values())
        need = {g.name: g.num_cpu_blocks * g.layout.bytes_per_block for g in groups}
        stacks = group_tier_stacks(self.config.tiers, need)
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
                    name=f"kvoffload-vllm-tiers-{self.rank}-{g.name}",
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

    def _tiers(self) -> GroupedWorkerTiers | None:
        return self.tiers

    def _on_complete(self, task: TransferTask) -> None:
        ok = task.status is TransferStatus.DONE
        plan = task.plan
        transfer = self._running.pop(id(plan))
        self._report(transfer.key, ok)
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
            if self.tiers is not None and isinstance(plan, StorePlan):
                self.tiers.on_stored(transfer.group, plan)

    def _submit(self, transfer: GroupTransfer) -> TransferTask:
        engine = self.groups[transfer.group].engine
        if engine is None:
            raise RuntimeError("register_kv_caches() was not called")
        task = engine.submit(transfer.plan)
        self._running[id(transfer.plan)] = transfer
        self._poller.track(task)
        return task

    def start_load_kv(self) -> None:
        """Run the step's loads of every group; on CPU, return once they ended."""
        meta = self._meta
        if meta is None or not meta.group_loads:
            return
        for transfer in meta.group_loads:
            plan = transfer.plan
            if isinstance(plan, LoadPlan):
                self._receiving[plan.request_id] = self._receiving.get(plan.request_id, 0) + 1
        if self._wait_for_loads([self._submit(t) for t in meta.group_loads]):
            self._poller.poll()  # deliver them now, for take_received()

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
            self._release(engine, host)
