"""What travels between vLLM's scheduler process and its workers.

Scheduler → workers: the `KVOffloadConnectorMetadata` of a step (its load and store
plans, one `GroupTransfer` each, naming its group, for one KV cache group or several).
Workers → scheduler: `KVOffloadWorkerMetadata`, the outcome of every copy a rank
finished, keyed by transfer and rank; vLLM merges the ranks' reports of one step with
`KVOffloadWorkerMetadata.aggregate`, and the scheduler side publishes a plan only once
every rank reported it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import final

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvoffload.hashing import BlockHash
from kvoffload.integrations.vllm.tiers import TierProbe, TierRead
from kvoffload.transfer.plan import TransferPlan

__all__ = ["GroupTransfer", "KVOffloadConnectorMetadata", "KVOffloadWorkerMetadata"]


@final
@dataclass(frozen=True, slots=True)
class GroupTransfer:
    """One group's plan (a model of one full-attention group has one group, id 0).

    Attributes:
        key: what workers report the copy under (unique per scheduler side: plan ids are
            unique only within one group's pool).
        group: vLLM's KV cache group id; the copy touches that group's layers only.
        plan: the group's load or store plan (its ids address that group's CPU pool).
    """

    key: int
    group: int
    plan: TransferPlan


@final
@dataclass
class KVOffloadConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker.

    Attributes:
        group_loads: CPU → GPU copies, each into its group's layers.
        group_stores: GPU → CPU copies of blocks that exist once this step's forward
            ran; a worker starts them after the forward.
        async_loads: how vLLM waits for ``group_loads`` (the scheduler side's policy).
            ``False`` (one group): a worker finishes them before the forward reads them,
            and reports failed GPU blocks (``get_block_ids_with_load_errors``). ``True``
            (several groups): workers report each request whose loads ended, and whether
            one failed, in ``get_transfer_results``.
        tier_probes: ask the tiers how many of these blocks they hold (`TierProbe`).
        tier_reads: read these blocks from the tiers into CPU blocks (`TierRead`).
    """

    group_loads: tuple[GroupTransfer, ...] = ()
    group_stores: tuple[GroupTransfer, ...] = ()
    async_loads: bool = False
    tier_probes: tuple[TierProbe, ...] = ()
    tier_reads: tuple[TierRead, ...] = ()


@final
@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Copies finished on workers since their last report.

    Attributes:
        reports: ``plan_id -> {rank: ok}``; ``ok`` is whether that rank's copy succeeded.
        tier_probes: ``probe key -> {rank: blocks its tiers hold}`` (a leading run).
        tier_reads: ``read key -> {rank: per block, read and verified}``.
        tier_writes: ``(vLLM group index, tier index) -> {rank: blocks written down
            there}``, with KV events on (`kvoffload.integrations.vllm.events.TierWrites`).
    """

    reports: dict[int, dict[int, bool]] = field(default_factory=dict)
    tier_probes: dict[int, dict[int, int]] = field(default_factory=dict)
    tier_reads: dict[int, dict[int, tuple[bool, ...]]] = field(default_factory=dict)
    tier_writes: dict[tuple[int, int], dict[int, tuple[BlockHash, ...]]] = field(
        default_factory=dict
    )

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVOffloadWorkerMetadata:
        """Merge another worker's report into a new one (a rank reporting a plan twice
        keeps its first outcome unless one of them failed).

        Raises:
            TypeError: ``other`` is not a `KVOffloadWorkerMetadata`.
        """
        if not isinstance(other, KVOffloadWorkerMetadata):
            raise TypeError(f"cannot aggregate KVOffloadWorkerMetadata with {type(other).__name__}")
        merged = {plan_id: dict(ranks) for plan_id, ranks in self.reports.items()}
        for plan_id, ranks in other.reports.items():
            into = merged.setdefault(plan_id, {})
            for rank, ok in ranks.items():
                into[rank] = into.get(rank, True) and ok
        probes = {key: dict(ranks) for key, ranks in self.tier_probes.items()}
        for key, runs in other.tier_probes.items():
            probes.setdefault(key, {}).update(runs)
        reads = {key: dict(ranks) for key, ranks in self.tier_reads.items()}
        for key, goods in other.tier_reads.items():
            reads.setdefault(key, {}).update(goods)
        writes = {tier: dict(by_rank) for tier, by_rank in self.tier_writes.items()}
        for tier, by_rank in other.tier_writes.items():
            landed = writes.setdefault(tier, {})
            for writer, hashes in by_rank.items():
                landed[writer] = landed.get(writer, ()) + tuple(hashes)
        return KVOffloadWorkerMetadata(merged, probes, reads, writes)
