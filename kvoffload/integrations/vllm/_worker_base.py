"""What the connector's two worker sides share (`WorkerSide` for one full-attention group,
`GroupedWorkerSide` for several): the worker's rank, the copy engine and host buffer built
over vLLM's KV caches, the `CompletionPoller` driven from vLLM's step, and the reports of
finished copies sent back to the scheduler side.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import anyio
import torch

from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.integrations.vllm.events import TierWrites
from kvoffload.integrations.vllm.metadata import (
    KVOffloadConnectorMetadata,
    KVOffloadWorkerMetadata,
)
from kvoffload.integrations.vllm.stats import (
    ConnectorStatistics,
    KVOffloadConnectorStats,
    StatsReporter,
)
from kvoffload.storage import HostKVBuffer
from kvoffload.transfer import (
    CompletionPoller,
    CopyEngine,
    CudaCopyEngine,
    ThreadCopyEngine,
    TransferTask,
)

if TYPE_CHECKING:
    from kvoffload.integrations.vllm.group_tiers import GroupedWorkerTiers
    from kvoffload.integrations.vllm.tiers import WorkerTiers
    from kvoffload.transfer.thread_engine import CopyHook

__all__ = ["WorkerSideBase", "worker_rank"]

_LOAD_WAIT_S = 0.0002


def worker_rank() -> int:
    """This worker's rank in vLLM's world group (0 when vLLM's groups are not set up)."""
    try:
        from vllm.distributed.parallel_state import get_world_group  # noqa: PLC0415

        return int(get_world_group().rank_in_group)
    except (AssertionError, ImportError, RuntimeError, AttributeError):
        return 0


class WorkerSideBase:
    """The state and steps both worker sides keep alike.

    Args:
        config: the settings (pinning, poll interval).
        num_gpu_blocks: vLLM's GPU block count.
        rank: this worker's rank (``None``: read it from vLLM).
        copy_hook: for `ThreadCopyEngine`, run before each copy (fault injection).
    """

    def __init__(
        self,
        config: OffloadConfig,
        num_gpu_blocks: int,
        *,
        rank: int | None,
        copy_hook: CopyHook | None,
    ) -> None:
        self.config = config
        self.num_gpu_blocks = num_gpu_blocks
        self.rank = worker_rank() if rank is None else rank
        self._copy_hook = copy_hook
        self._device: torch.device | None = None
        self._poller = CompletionPoller(self._on_complete, poll_interval_s=config.poll_interval_s)
        self._reports: dict[int, bool] = {}
        self._meta: KVOffloadConnectorMetadata | None = None
        self._stats = StatsReporter(rank=self.rank)
        self._tier_writes = TierWrites()
        """Write-downs that ended, per group and tier (with KV events on)."""

    def _on_complete(self, task: TransferTask) -> None:
        """Account for a finished copy (called by the poller)."""
        raise NotImplementedError

    # -- building ----------------------------------------------------------------------

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

    @staticmethod
    def _release(engine: CopyEngine | None, host: HostKVBuffer | None) -> None:
        if engine is not None:
            anyio.run(engine.aclose)
        if host is not None:
            host.close()

    # -- the step ----------------------------------------------------------------------

    def _tiers(self) -> WorkerTiers | GroupedWorkerTiers | None:
        """This rank's tiers (``config.tiers``, once the KV caches are registered)."""
        raise NotImplementedError

    def bind(self, meta: KVOffloadConnectorMetadata) -> None:
        """Remember the step's plans; start its tier probes and reads."""
        self._meta = meta
        tiers = self._tiers()
        if tiers is not None and (meta.tier_probes or meta.tier_reads):
            tiers.submit(meta.tier_probes, meta.tier_reads)

    def clear(self) -> None:
        """Forget the step's plans."""
        self._meta = None

    def _report(self, key: int, ok: bool) -> None:
        self._reports[key] = self._reports.get(key, True) and ok

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

    def take_reports(self) -> KVOffloadWorkerMetadata | None:
        """This rank's finished copies (keyed by plan, or by transfer key on a
        multi-group model), tier probes and tier reads since the last call, or ``None``."""
        self._poller.poll()
        rank = self.rank
        meta = None
        if self._reports:
            reports, self._reports = self._reports, {}
            meta = KVOffloadWorkerMetadata({key: {rank: ok} for key, ok in reports.items()})
        tiers = self._tiers()
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
        tiers = self._tiers()
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
