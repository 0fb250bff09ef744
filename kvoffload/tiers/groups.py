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
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, final

import anyio.abc

from kvoffload.config import DiskTierSettings, OffloadConfig
from kvoffload.errors import ConfigError, InvariantError
from kvoffload.groups import KVCacheGroup, needed
from kvoffload.hashing import BlockHash, HashNamespace
from kvoffload.scheduler.group_loads import find_hit, hit_blocks
from kvoffload.scheduler.misses import MissReason
from kvoffload.tier_config import AnyTierSettings
from kvoffload.tiers.base import SecondaryTier
from kvoffload.tiers.build import build_tier
from kvoffload.tiers.manager import TierManager
from kvoffload.tiers.stats import TierManagerStatistics

if TYPE_CHECKING:
    from kvoffload.pool.block_pool import CpuBlockPool
    from kvoffload.pool.free_queue import CpuBlock
    from kvoffload.scheduler.groups import GroupedScheduler
    from kvoffload.scheduler.ledger import BlockLedger
    from kvoffload.scheduler.loads import LookupExtension
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


def _blocks_of(group: KVCacheGroup, points: Iterable[int], limit: int) -> list[int]:
    """The blocks of ``needed(group, p)`` for every point ``p``, in order, each once."""
    seen: dict[int, None] = {}
    for p in points:
        for i in needed(group, p):
            if i < limit:
                seen[i] = None
    return list(seen)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


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

    def set_lookup_extension(self, extension: LookupExtension | None) -> None:
        del extension


def group_tier_settings(
    settings: AnyTierSettings, index: int, group: str, share: float
) -> AnyTierSettings:
    """The settings of tier ``index`` for ``group``: named ``<tier>.<group>``; a disk
    tier's file is ``<stem>.<group><suffix>`` with ``share`` of ``capacity_bytes``."""
    safe = _UNSAFE.sub("_", group)
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
    names = [_UNSAFE.sub("_", g) for g in groups]
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


class GroupTierPart(Protocol):
    """One group's tiers as a grouped lookup asks them (a `LookupExtension` of that
    group's pool): `TierManager`, or the vLLM connector's per-group `SchedulerTiers`."""

    def extend_lookup(
        self,
        block_hashes: Sequence[BlockHash],
        end: int,
        limit: int,
        pinned: Sequence[CpuBlock],
        *,
        allow_defer: bool,
    ) -> bool:
        """Bring in ``block_hashes[end:limit]`` (see `LookupExtension.extend_lookup()`)."""
        ...

    def is_promoting(self, block_hash: BlockHash) -> bool:
        """Whether a promotion covering ``block_hash`` is in flight."""
        ...

    def lookup_deferred(self) -> None:
        """A grouped lookup answered "ask again" waiting for a promotion of these tiers:
        count it in their ``deferred_lookups`` (the counter one group's lookups count in)."""
        ...

    def miss_reason(self, block_hash: BlockHash) -> MissReason | None:
        """Why the tiers did not bring ``block_hash`` in (`LookupExtension.miss_reason`)."""
        ...

    def hit_sources(self, pinned: Sequence[CpuBlock]) -> dict[str, int] | None:
        """Of a lookup's CPU hit, the blocks each tier (by name) brought in
        (`LookupExtension.hit_sources`)."""
        ...

    @property
    def defer_deadline_s(self) -> float:
        """The tiers' lookup budget."""
        ...


P = TypeVar("P", bound=GroupTierPart)


class GroupPromotions(Generic[P]):
    """The rule of promotions with several groups, for any per-group tiers (``parts``):
    which blocks of which group a longer hit needs (see the module docstring); installs
    itself as the grouped scheduler's ``extension`` (a `GroupLookupExtension`). One rule
    for `GroupTiers` (the offloader's tier managers) and the vLLM connector's tiers
    (`kvoffload.integrations.vllm.group_tiers`).

    Args:
        scheduler: the grouped scheduler (its groups, checkpoints, alignment, ledgers).
        parts: per cacheable group, its tiers.
    """

    __slots__ = (
        "_align",
        "_asked",
        "_checkpoint",
        "_deferred",
        "_groups",
        "_ledgers",
        "_parts",
    )

    def __init__(self, scheduler: GroupedScheduler, parts: Mapping[str, P]) -> None:
        self._groups = [g for g in scheduler.groups if g.cacheable]
        self._checkpoint = scheduler.checkpoint_tokens
        self._align = scheduler.hit_alignment
        # The whole model's ``deferred_lookups`` (each group's: its tiers' own counter).
        self._deferred = 0
        # What the last lookup asked the tiers for (`extend_grouped_lookup()`): its lanes,
        # hit, cap and full reach, until `lookup_deferred()` reads it.
        self._asked: tuple[Mapping[str, Sequence[BlockHash]], int, int, int] | None = None
        self._ledgers = {g.name: scheduler.ledger(g.name) for g in self._groups}
        self._parts: dict[str, P] = dict(parts)
        scheduler.extension = self

    def hit_sources(self, pinned: Mapping[str, Sequence[CpuBlock]]) -> dict[str, int] | None:
        """Of a grouped lookup's hit (its CPU blocks ``pinned`` per group), the tokens each
        tier (by its name in ``config.tiers``, not the group's ``<tier>.<group>``) brought
        in: the most of any one group (a hit token needs every group's block, so a token
        one group's tier promoted came from that tier); ``None`` when no tier did."""
        served: dict[str, int] = {}
        for g in self._groups:
            blocks = pinned.get(g.name)
            sources = self._parts[g.name].hit_sources(blocks) if blocks else None
            if not sources:
                continue
            suffix = "." + _UNSAFE.sub("_", g.name)
            for name, count in sources.items():
                base = name.removesuffix(suffix)
                served[base] = max(served.get(base, 0), count * g.block_size)
        return served or None

    def extend_grouped_lookup(
        self,
        lanes: Mapping[str, Sequence[BlockHash]],
        hit: int,
        num_tokens: int,
        pinned: Mapping[str, Sequence[CpuBlock]],
    ) -> None:
        """A grouped lookup found ``hit`` tokens (pinned): ask each group's tiers for the
        blocks a longer hit needs that its CPU pool lacks (see the module docstring).

        Args:
            lanes: per cacheable group, the lookup's block hashes.
            hit: the lookup's ``N`` (the engine's prefix when nothing was found).
            num_tokens: the prompt's length (a hit is at most ``num_tokens - 1``).
            pinned: per group, the hit's CPU blocks: no promotion evicts them (the lookup
                may release them at once, to ask again).
        """
        cap = max(0, num_tokens - 1)
        reach = self._full_reach(lanes, hit, cap)
        self._asked = (lanes, hit, cap, reach)
        for g in self._groups:
            hashes = lanes[g.name]
            keep = pinned.get(g.name, ())
            asked = False
            for run in self._wanted(g, len(hashes), hit, cap, reach):
                asked |= self._promote(g.name, hashes, run, keep)
            if keep and not asked:
                # Nothing to promote: the group's tiers still hear of the hit, as one
                # group's do at every lookup (its blocks stop counting as promoted, and
                # stop being kept from a promotion's evictions, once a lookup pinned them).
                self._parts[g.name].extend_lookup((), 0, 0, keep, allow_defer=False)

    def _cpu_hit(self, lanes: Mapping[str, Sequence[BlockHash]], num_tokens: int) -> int:
        """The tokens a lookup (nothing computed on the engine) finds on CPU now."""
        pools = {name: ledger.pool for name, ledger in self._ledgers.items()}
        return find_hit(self._groups, pools, lanes, num_tokens, computed=0, align=self._align)

    def _wanted(
        self, g: KVCacheGroup, count: int, hit: int, cap: int, reach: int
    ) -> list[Sequence[int]]:
        """The block indices (of ``count``) of group ``g`` a hit longer than ``hit`` (at
        most ``cap`` tokens) needs, one run per promotion: a full group the run after
        ``hit``; the other kinds ``needed(g, P)`` for each store point ``P`` past ``hit``,
        each point a run of its own (a point its tier lacks, its window slid past before
        it was stored, stops no other one), and last ``needed(g, reach)`` where the full
        groups' CPU blocks end (a finish point, likely) when that is not a store point."""
        if g.kind == "full":
            return [range(hit // g.block_size, min(count, cap // g.block_size))]
        step = self._checkpoint
        points: list[int] = list(range((hit // step + 1) * step, cap + 1, step))
        if reach > hit and reach % step:
            points.append(reach)
        return [_blocks_of(g, [p], count) for p in points]

    def promoting(self, group: str, block_hash: BlockHash) -> bool:
        """Whether a promotion of ``group``'s tiers covering ``block_hash`` is in flight."""
        return self._parts[group].is_promoting(block_hash)

    def lookup_deferred(self) -> None:
        """The lookup of the last `extend_grouped_lookup()` answered "ask again" while a
        promotion ran: each group it waits for counts one in its tiers'
        ``deferred_lookups`` (`GroupTierPart.lookup_deferred()`, the counter one group's
        lookups count in), and the whole model's (`statistics()`) counts the lookup once.

        A group is waited for when a promotion of its tiers is in flight for a block the
        lookup asked them for (`_wanted()`) and its pool lacks; `promotions_defer()`
        answers only yes or no, so this names the groups whose promotions could make the
        longer hit. A lookup that waited for no group's promotion (only for stores in
        flight) is counted by none: the scheduler counts it (its ``deferred_lookups``),
        as one group's lookups deferred for a store are.
        """
        asked, self._asked = self._asked, None
        if asked is None:
            return
        lanes, hit, cap, reach = asked
        waited = False
        for g in self._groups:
            if self._waits_for(g, lanes[g.name], hit, cap, reach):
                self._parts[g.name].lookup_deferred()
                waited = True
        self._deferred += waited

    def _waits_for(
        self, g: KVCacheGroup, hashes: Sequence[BlockHash], hit: int, cap: int, reach: int
    ) -> bool:
        """Whether a promotion of ``g``'s tiers is in flight for a block of ``hashes`` a
        lookup of hit ``hit`` asked them for (`_wanted()`) that ``g``'s pool lacks."""
        get, part = self._ledgers[g.name].pool.get_cached, self._parts[g.name]
        return any(
            get(hashes[i]) is None and part.is_promoting(hashes[i])
            for run in self._wanted(g, len(hashes), hit, cap, reach)
            for i in run
        )

    def miss_reason(self, group: str, block_hash: BlockHash) -> MissReason | None:
        """Why ``group``'s tiers did not bring ``block_hash`` in (see
        `TierManager.miss_reason()`)."""
        return self._parts[group].miss_reason(block_hash)

    @property
    def defer_deadline_s(self) -> float:
        """The longest of the groups' lookup budgets: a grouped lookup waits for the
        promotions of every group."""
        return max((p.defer_deadline_s for p in self._parts.values()), default=0.0)

    def _full_reach(self, lanes: Mapping[str, Sequence[BlockHash]], hit: int, cap: int) -> int:
        """The longest aligned prefix every full group holds on CPU from ``hit`` on (``hit``
        when there is no full group)."""
        reach = None
        for g in self._groups:
            if g.kind != "full":
                continue
            hashes, get = lanes[g.name], self._ledgers[g.name].pool.get_cached
            i, end = hit // g.block_size, min(len(hashes), cap // g.block_size)
            while i < end and get(hashes[i]) is not None:
                i += 1
            reach = i * g.block_size if reach is None else min(reach, i * g.block_size)
        return hit if reach is None else reach // self._align * self._align

    def _promote(
        self,
        group: str,
        hashes: Sequence[BlockHash],
        want: Iterable[int],
        keep: Sequence[CpuBlock] = (),
    ) -> bool:
        """Ask ``group``'s tiers for the blocks ``want`` from the first not on CPU on (the
        run's blocks already on CPU, and ``keep``, are protected from its evictions);
        ``False`` when every block is on CPU (the tiers were not asked)."""
        get = self._ledgers[group].pool.get_cached
        order = [i for i in want if i < len(hashes)]
        cached: list[CpuBlock] = list(keep)
        for k, i in enumerate(order):
            block = get(hashes[i])
            if block is None:
                wanted = [hashes[j] for j in order]
                self._parts[group].extend_lookup(wanted, k, len(wanted), cached, allow_defer=False)
                return True
            cached.append(block)
        return False


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
