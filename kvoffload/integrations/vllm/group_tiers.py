"""The connector's tiers, per KV cache group (``tiers``; one group or several).

A model of one group keeps ``config.tiers`` as they are (the names and files
`KVOffloader` gives them). With several groups, as `KVOffloader` does
(`kvoffload.tiers.groups`), each cacheable group gets its own tier stack
(`group_tier_stacks`: every tier named ``<tier>.<group>``, a disk tier's file
``<stem>.<group><suffix>`` with a share of ``capacity_bytes``), keyed by that group's
namespace root, and with several ranks by `rank_namespace` of it (a disk file gets
``.rank<r>`` too). Each group's conversation is that of
`kvoffload.integrations.vllm.tiers`: one `SchedulerTiers` per group over
that group's ledger on the scheduler side, one `WorkerTiers` per group over that group's
host buffer on each worker; probes and reads name their group (`TierProbe.group`) and
take their keys from one counter, so a worker's reports name one probe or read each.

Which blocks each group's tiers are asked for is `GroupPromotions`'s rule, the
offloader's: a full group the run after its CPU blocks, other kinds the blocks of
``needed(g, P)`` per store point; a hit needs every group. While a promotion of a block
the next longer hit lacks runs in any group, the grouped lookup answers "ask again"
(``None`` to vLLM), for at most the longest of the groups' lookup budgets.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, final

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm.tiers import (
    SchedulerTiers,
    TierProbe,
    TierRead,
    VllmTierStatistics,
    WorkerTiers,
    check_tier_settings,
)
from kvoffload.tiers.groups import (
    GroupLedgerPart,
    GroupPromotions,
    group_tier_stacks,
    sum_tier_statistics,
)

if TYPE_CHECKING:
    from kvoffload.hashing import BlockHash
    from kvoffload.scheduler.groups import GroupedScheduler
    from kvoffload.tier_config import AnyTierSettings
    from kvoffload.tiers.stats import TierManagerStatistics, TierStatistics
    from kvoffload.transfer.plan import StorePlan

__all__ = [
    "GroupedSchedulerTiers",
    "GroupedWorkerTiers",
    "check_group_tier_settings",
    "connector_tier_stacks",
]


def connector_tier_stacks(
    settings: Sequence[AnyTierSettings], need: Mapping[str, int]
) -> dict[str, list[AnyTierSettings]]:
    """Per cacheable group, its tiers, the one rule of both connector sides: one group's
    are ``settings`` as they are (the names and files `KVOffloader` gives them); several
    groups' are named and split by ``need``, each group's CPU pool in bytes
    (`group_tier_stacks`)."""
    if len(need) == 1:
        return {name: list(settings) for name in need}
    return group_tier_stacks(settings, need)


def check_group_tier_settings(
    stacks: Mapping[str, Sequence[AnyTierSettings]],
    roots: Mapping[str, bytes],
    block_nbytes: Mapping[str, int],
) -> None:
    """Build every group's tiers once, unopened (`check_tier_settings`), so that settings
    no tier accepts stop start-up in the scheduler process.

    Raises:
        ConfigError: a tier refuses its settings for a group (the tier named, and the
            group with several).
    """
    for name, stack in stacks.items():
        try:
            check_tier_settings(stack, namespace=roots[name], block_nbytes=block_nbytes[name])
        except ConfigError as exc:
            if len(stacks) == 1:
                raise
            raise ConfigError(f"group {name!r}: {exc}") from exc


@final
class GroupedSchedulerTiers(GroupPromotions[SchedulerTiers]):
    """The tiers' part of a multi-group scheduler side: one `SchedulerTiers` per cacheable
    group over its ledger, asked by `GroupPromotions`'s rule; installs itself as the
    grouped scheduler's ``extension``.

    Args:
        scheduler: the scheduler side's `GroupedScheduler`.
        stacks: per cacheable group, its tiers (`group_tier_stacks`).
        world_size: ranks that must all answer a probe and read a promoted block.
        index: per cacheable group, vLLM's group index (what probes and reads name).
    """

    __slots__ = ()

    def __init__(
        self,
        scheduler: GroupedScheduler,
        stacks: Mapping[str, Sequence[AnyTierSettings]],
        *,
        world_size: int,
        index: Mapping[str, int],
    ) -> None:
        keys = itertools.count(1)
        parts = {
            name: SchedulerTiers(
                GroupLedgerPart(scheduler.ledger(name)),
                stack,
                world_size=world_size,
                group=index[name],
                keys=keys,
            )
            for name, stack in stacks.items()
        }
        super().__init__(scheduler, parts)

    @property
    def parts(self) -> Mapping[str, SchedulerTiers]:
        """Per cacheable group, its `SchedulerTiers`."""
        return self._parts

    def take_work(self) -> tuple[tuple[TierProbe, ...], tuple[TierRead, ...]]:
        """Every group's probes and reads for this step's metadata."""
        probes: list[TierProbe] = []
        reads: list[TierRead] = []
        for part in self._parts.values():
            p, r = part.take_work()
            probes += p
            reads += r
        return tuple(probes), tuple(reads)

    def on_reports(
        self,
        probes: Mapping[int, Mapping[int, int]],
        reads: Mapping[int, Mapping[int, Sequence[bool]]],
    ) -> None:
        """Hand the workers' answers to every group (each takes the keys it sent)."""
        for part in self._parts.values():
            part.on_reports(probes, reads)

    def forget_absent(self, group: str, hashes: Sequence[BlockHash]) -> None:
        """``group``'s blocks were just stored: a later lookup may probe for them again."""
        self._parts[group].forget_absent(hashes)

    def reset(self) -> None:
        """Every group's CPU cache was reset (`SchedulerTiers.reset`)."""
        for part in self._parts.values():
            part.reset()

    def statistics(self) -> VllmTierStatistics:
        """The groups' counters added up (`SchedulerTiers.statistics`), but
        ``deferred_lookups``: each grouped lookup that answered "ask again" waiting for a
        probe once, however many groups it waited for (`GroupPromotions.lookup_deferred`);
        for one group, its counters."""
        parts = list(self.group_statistics().values())
        sums = {
            f.name: sum(getattr(p, f.name) for p in parts)
            for f in dataclasses.fields(VllmTierStatistics)
            if f.name != "deferred_lookups"
        }
        return VllmTierStatistics(deferred_lookups=self._deferred, **sums)

    def group_statistics(self) -> dict[str, VllmTierStatistics]:
        """Per cacheable group, its counters (`SchedulerTiers.statistics`; its
        ``deferred_lookups``: the grouped lookups that waited for its probes)."""
        return {name: part.statistics() for name, part in self._parts.items()}

    def manager_statistics(self) -> TierManagerStatistics:
        """The groups' `SchedulerTiers.manager_statistics` added up, ``deferred_lookups``
        as in `statistics`."""
        return sum_tier_statistics(
            (p.manager_statistics() for p in self._parts.values()), deferred_lookups=self._deferred
        )


@final
class GroupedWorkerTiers:
    """One rank's tiers: one `WorkerTiers` per cacheable group (its own bridge, host
    buffer and namespace; a one-group model has one, group 0), each answering the probes
    and reads that name its group and writing down that group's stores (`WorkerSide`).

    Args:
        parts: per vLLM group index, the group's opened `WorkerTiers`.
    """

    __slots__ = ("parts",)

    def __init__(self, parts: Mapping[int, WorkerTiers]) -> None:
        self.parts = dict(parts)
        """Per vLLM group index, its tiers."""

    def submit(self, probes: Sequence[TierProbe], reads: Sequence[TierRead]) -> None:
        """Start each probe and read on its group's tiers (never waits)."""
        for index, part in self.parts.items():
            mine_p = [p for p in probes if p.group == index]
            mine_r = [r for r in reads if r.group == index]
            if mine_p or mine_r:
                part.submit(mine_p, mine_r)

    def on_stored(self, group: int, plan: StorePlan) -> None:
        """Group ``group``'s store copy ended on this rank: write its blocks down."""
        self.parts[group].on_stored(plan)

    def take(self) -> tuple[dict[int, int], dict[int, tuple[bool, ...]]]:
        """Every group's probes and reads that ended since the last call (see
        `WorkerTiers.take`; keys are unique across groups)."""
        probes: dict[int, int] = {}
        reads: dict[int, tuple[bool, ...]] = {}
        for part in self.parts.values():
            p, r = part.take()
            probes.update(p)
            reads.update(r)
        return probes, reads

    def statistics(self) -> tuple[TierStatistics, ...]:
        """Every group's tiers' counters, group by group (waits for the bridges)."""
        return tuple(t for part in self.parts.values() for t in part.statistics())

    def manager_statistics(self) -> TierManagerStatistics:
        """Every group's tiers (each named ``<tier>.<group>``) as the ``kvoffload_tier_*``
        metrics read them (`WorkerTiers.manager_statistics`; a worker answers no lookup:
        ``deferred_lookups`` is 0); never waits."""
        return sum_tier_statistics(
            (p.manager_statistics() for p in self.parts.values()), deferred_lookups=0
        )

    def close(self) -> None:
        """Close every group's tiers (`WorkerTiers.close`)."""
        for part in self.parts.values():
            part.close()
