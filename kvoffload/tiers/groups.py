"""Tiers for a model with several KV cache groups: `GroupTiers`, one `TierManager` per group.

Each cacheable group gets its own tier stack, built from ``OffloadConfig.tiers`` and keyed
by that group's namespace (its hash chain root, distinct per group): the namespace is in
every key and in every verified header, so keys never collide across groups and a block
of one group read back as another's fails verification (a miss, counted, deleted). A disk
tier's file is split into one file per group (``<stem>.<group><suffix>``), its
``capacity_bytes`` shared by the groups' CPU pool sizes in bytes; a Redis tier keeps its
server and ``key_prefix`` (the namespace is part of every key).

* Write-downs: what a grouped store publishes in a group's CPU pool is queued for that
  group's tiers (`on_stored()`), as with one group.
* Promotions: after every grouped lookup (`GroupedScheduler.lookup()`), each group's
  tiers are asked for the blocks a longer hit needs that its CPU pool lacks
  (`extend_grouped_lookup()`): a full group the run after its CPU blocks, up to the
  prompt; the other kinds the blocks of ``needed(g, P)`` for each store point ``P`` (the
  multiples of ``checkpoint_tokens``) past the hit, and those of ``needed(g, R)`` where
  ``R`` is where the full groups' CPU blocks end (a request's finish point, once the full
  groups' blocks are back), each point in a promotion of its own (a point its tier lacks
  stops no other). A lookup that may wait (``allow_defer``) answers "ask again" while a
  promotion of a block its next longer hit lacks runs in any group
  (`GroupedScheduler.lookup()`); it counts one ``deferred_lookups`` in each group with a
  promotion in flight of a block the lookup asked that group's tiers for, and one in the
  whole model's (`GroupPromotions.lookup_deferred()`). Promotions land asynchronously, each
  in its own group's pool; the hit stays the largest ``N`` valid for **every** group with
  CPU-resident blocks only, so a promotion that landed in one group and not (yet) in
  another is never part of a hit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, final

import anyio.abc

from kvoffload.config import DiskTierSettings, OffloadConfig
from kvoffload.errors import ConfigError, InvariantError
from kvoffload.hashing import BlockHash, HashNamespace
from kvoffload.scheduler.group_loads import hit_blocks
from kvoffload.scheduler.group_promote import GroupPromotions, GroupTierPart, safe_group_name
from kvoffload.tier_config import AnyTierSettings
from kvoffload.tiers.base import SecondaryTier
from kvoffload.tiers.build import build_tier
from kvoffload.tiers.manager import TierManager
from kvoffload.tiers.stats import TierManagerStatistics

if TYPE_CHECKING:
    from kvoffload.pool.block_pool import CpuBlockPool
    from kvoffload.pool.free_queue import CpuBlock
    from kvoffload.scheduler.group_promote import GroupTierPart
    from kvoffload.scheduler.groups import GroupedScheduler
    from kvoffload.scheduler.ledger import BlockLedger
    from kvoffload.storage.host_buffer import HostKVBuffer
    from kvoffload.transfer.plan import StorePlan

__all__ = [
    "GroupLedgerPart",
    "GroupPromotions",
    "GroupTierPart",
    "GroupTiers",
    "group_tier_settings",
    "group_tier_stacks",
    "sum_tier_statistics",
]


@final
class GroupLedgerPart:
    """One group's pool and ledger, as a group's tiers see a scheduler (`TierScheduler`:
    a `TierManager`, or the vLLM connector's per-group `SchedulerTiers`).

    The grouped lookup asks `GroupPromotions` (which asks each group's tiers), so the
    lookup hook a group's tiers install here is not used.
    """

    __slots__ = ("_ledger",)

    def __init__(self, ledger: BlockLedger) -> None:
        self._ledger = ledger

    @property
    def ledger(self) -> BlockLedger:
        return self._ledger

    @property
    def pool(self) -> CpuBlockPool:
        return self._ledger.pool

    def set_lookup_extension(self, extension: GroupTierPart | None) -> None:
        del extension


def group_tier_settings(
    settings: AnyTierSettings, index: int, group: str, share: float
) -> AnyTierSettings:
    """The settings of tier ``index`` for ``group``: named ``<tier>.<group>``; a disk
    tier's file is ``<stem>.<group><suffix>`` with ``share`` of ``capacity_bytes``."""
    safe = safe_group_name(group)
    update: dict[str, object] = {"name": f"{settings.name or f'{settings.kind}{index}'}.{safe}"}
    if isinstance(settings, DiskTierSettings):
        path = settings.path
        update["path"] = path.with_name(f"{path.stem}.{safe}{path.suffix}")
        update["capacity_bytes"] = int(int(settings.capacity_bytes) * share)
    return settings.model_copy(update=update)


def group_tier_stacks(
    settings: Sequence[AnyTierSettings], need: Mapping[str, int]
) -> dict[str, list[AnyTierSettings]]:
    """Per cacheable group, its tiers (`group_tier_settings`): a disk tier's
    ``capacity_bytes`` is shared by ``need``, each group's CPU pool size in bytes.

    Raises:
        ConfigError: two groups' names give their tiers (and disk files) the same name.
    """
    groups = list(need)
    names = [safe_group_name(g) for g in groups]
    if len(set(names)) != len(names):
        raise ConfigError(
            f"the groups {groups} give their tiers the names {names}, which must be unique"
        )
    total = sum(need.values()) or 1
    return {
        g: [group_tier_settings(s, i, g, need[g] / total) for i, s in enumerate(settings)]
        for g in groups
    }


def sum_tier_statistics(
    parts: Iterable[TierManagerStatistics], *, deferred_lookups: int
) -> TierManagerStatistics:
    """Several groups' tier statistics as one: every group's tiers (each named
    ``<tier>.<group>``), group by group, the promotion counters added up, and
    ``deferred_lookups``, the whole model's (each grouped lookup that waited for a
    promotion once, however many groups it waited for: not the groups' added up)."""
    parts = list(parts)
    sums = {
        f.name: sum(getattr(p, f.name) for p in parts)
        for f in dataclasses.fields(TierManagerStatistics)
        if f.name not in {"tiers", "deferred_lookups"}
    }
    return TierManagerStatistics(
        tiers=tuple(t for p in parts for t in p.tiers), deferred_lookups=deferred_lookups, **sums
    )


@final
class GroupTiers(GroupPromotions[TierManager]):
    """One `TierManager` per cacheable group of a `GroupedScheduler`; installs itself as
    the scheduler's ``extension`` (its lookups call `extend_grouped_lookup()`).

    Args:
        config: the settings (``config.tiers`` describes every group's stack).
        scheduler: the grouped scheduler: each manager takes and publishes CPU blocks
            through its group's ledger.
        hosts: per cacheable group, its host buffer.
        namespaces: per cacheable group, its hash namespace (its root keys that group's
            tiers and is written into every header).

    Raises:
        ConfigError: two groups' disk files would share a path, or a group's share of a
            disk tier is below one slot (naming the tier and the group).
    """

    __slots__ = ("managers",)

    def __init__(
        self,
        config: OffloadConfig,
        scheduler: GroupedScheduler,
        hosts: Mapping[str, HostKVBuffer],
        namespaces: Mapping[str, HashNamespace],
    ) -> None:
        ledgers = {g.name: scheduler.ledger(g.name) for g in scheduler.groups if g.cacheable}
        need = {n: ledger.pool.num_blocks * hosts[n].layout.bytes_per_block
                for n, ledger in ledgers.items()}  # fmt: skip
        stacks = group_tier_stacks(config.tiers, need)
        self.managers: dict[str, TierManager] = {}
        """Per cacheable group, its tier manager."""
        for name, ledger in ledgers.items():
            root = namespaces[name].root
            nbytes = hosts[name].layout.bytes_per_block
            stack = []
            for i, mine in enumerate(stacks[name]):
                try:
                    tier = build_tier(mine, i, namespace=root, block_nbytes=nbytes)
                except ConfigError as exc:
                    raise ConfigError(f"group {name!r}: {exc}") from exc
                stack.append((tier, mine))
            self.managers[name] = TierManager(
                stack,
                scheduler=GroupLedgerPart(ledger),
                host=hosts[name],
                namespace=root,
                max_prefetch_fraction=config.max_prefetch_fraction,
            )
        super().__init__(scheduler, self.managers)

    def __repr__(self) -> str:
        return f"GroupTiers({', '.join(f'{n}={m!r}' for n, m in self.managers.items())})"

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start every group's manager in ``task_group`` (see `TierManager.run()`)."""
        for manager in self.managers.values():
            await task_group.start(manager.run)

    async def aclose(self) -> None:
        """Close every group's manager (shielded; references released on return)."""
        for manager in self.managers.values():
            await manager.aclose()

    def reset(self) -> None:
        """Every group's CPU cache was reset: promotions in flight publish nothing."""
        for manager in self.managers.values():
            manager.reset()

    # -- write-downs and promotions ----------------------------------------------------------

    def on_stored(self, group: str, plan: StorePlan) -> None:
        """``group``'s part of a grouped store completed: queue what it published."""
        self.managers[group].on_stored(plan)

    async def prefetch(self, lanes: Mapping[str, Sequence[BlockHash]], num_tokens: int) -> int:
        """Promote, in every group, what a lookup of a prompt of ``num_tokens`` tokens needs
        past its CPU hit now (`SessionHints.prefetch()`); return the tokens a lookup finds
        on CPU on return (`find_hit()`).

        The blocks are those a lookup asks for (`_wanted()`): a full group the run after
        the hit, the other kinds ``needed(g, P)`` for every store point ``P`` up to the
        prompt, each point a prefetch of its own; once the full groups' blocks are back,
        the other kinds' blocks where they end (a finish point). Every group's prefetches
        run at once, each within its own pool's ``max_prefetch_fraction``; the hit's
        blocks are never evicted by them. Cancellation publishes nothing of the reads in
        progress, in any group, and releases every CPU block they took.

        Args:
            lanes: per cacheable group, the prompt's block hashes.
            num_tokens: the prompt's length (a hit is at most ``num_tokens - 1``).
        """
        cap = max(0, num_tokens - 1)
        hit = self._cpu_hit(lanes, num_tokens)
        pins = hit_blocks(self._groups, self._ledgers, lanes, hit, 0)
        keep = {name: blocks for name, (_, blocks) in pins.items()}
        await self._prefetch_runs(
            lanes,
            keep,
            {g.name: self._wanted(g, len(lanes[g.name]), hit, cap, hit) for g in self._groups},
        )
        reach = self._full_reach(lanes, hit, cap)
        if reach > hit and reach % self._checkpoint:
            # The full groups' blocks are back to ``reach``, not a store point: the other
            # kinds' blocks there (a request's finish point), as a later lookup asks.
            await self._prefetch_runs(
                lanes,
                keep,
                {
                    g.name: self._wanted(g, len(lanes[g.name]), hit, cap, reach)[-1:]
                    for g in self._groups
                    if g.kind != "full"
                },
            )
        return self._cpu_hit(lanes, num_tokens)

    async def _prefetch_runs(
        self,
        lanes: Mapping[str, Sequence[BlockHash]],
        keep: Mapping[str, Sequence[CpuBlock]],
        runs: Mapping[str, Sequence[Sequence[int]]],
    ) -> None:
        """Each group's ``runs`` prefetched one after the other, the groups at once."""

        async def one(name: str) -> None:
            manager, hashes = self.managers[name], lanes[name]
            for run in runs[name]:
                await manager.prefetch([hashes[i] for i in run], keep.get(name, ()))

        async with anyio.create_task_group() as tg:
            for name in runs:
                tg.start_soon(one, name)

    # -- observation (`TierFront`) ------------------------------------------------------------

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        """Every group's tiers, group by group (each named ``<tier>.<group>``)."""
        return tuple(t for m in self.managers.values() for t in m.tiers)

    @property
    def max_prefetch_blocks(self) -> int:
        """The groups' prefetch bounds added up (each group's pool keeps its own,
        ``max_prefetch_fraction`` of it)."""
        return sum(m.max_prefetch_blocks for m in self.managers.values())

    @property
    def prefetch_blocks(self) -> int:
        """CPU blocks prefetches in flight hold now, all groups together."""
        return sum(m.prefetch_blocks for m in self.managers.values())

    def is_promoting(self, block_hash: BlockHash) -> bool:
        """Whether a promotion covering ``block_hash`` is in flight in some group (a hash
        is keyed by its group's namespace: it names one group's block)."""
        return any(m.is_promoting(block_hash) for m in self.managers.values())

    def group_statistics(self) -> dict[str, TierManagerStatistics]:
        """Per cacheable group, its tier manager's statistics."""
        return {n: m.statistics() for n, m in self.managers.items()}

    def statistics(self) -> TierManagerStatistics:
        """Every group's tiers (each named ``<tier>.<group>``), group by group, and the
        promotion counters added up over the groups; ``deferred_lookups`` counts each
        grouped lookup that answered "ask again" waiting for a promotion once (a group's,
        in `group_statistics()`, the lookups that waited for that group's promotions:
        see `lookup_deferred()`)."""
        return sum_tier_statistics(
            self.group_statistics().values(), deferred_lookups=self._deferred
        )

    def check_invariants(self) -> None:
        """Check every group's manager (see `TierManager.check_invariants()`), and that
        the whole model's ``deferred_lookups`` counts each deferred lookup once: at least
        any group's, at most the groups' added up (`lookup_deferred()`).

        Raises:
            InvariantError: a manager's check failed, or the counts disagree.
        """
        per = []
        for manager in self.managers.values():
            manager.check_invariants()
            per.append(manager.statistics().deferred_lookups)
        if not max(per, default=0) <= self._deferred <= sum(per):
            raise InvariantError(
                f"the whole model's deferred_lookups {self._deferred} is not between the "
                f"most of one group's and the groups' added up {per}"
            )
