"""`GroupPromotions`: the rule of promotions for any number of KV cache groups, over any
per-group tiers (`GroupTierPart`: a `TierManager`, or the vLLM connector's per-group
tiers). After every lookup, each group's tiers are asked for the blocks a longer hit
needs that its CPU pool lacks: a full group the run after its CPU blocks, up to the
prompt; the other kinds the blocks of ``needed(g, P)`` for each store point ``P`` past
the hit, and those of ``needed(g, R)`` where ``R`` is where the full groups' CPU blocks
end. It installs itself as the scheduler's lookup extension (`GroupLookupExtension`); one
group is a lane like any other (`OffloadScheduler.set_lookup_extension()`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from kvoffload.groups import KVCacheGroup, needed
from kvoffload.hashing import BlockHash
from kvoffload.scheduler.group_loads import find_hit
from kvoffload.scheduler.loads import LookupExtension
from kvoffload.scheduler.misses import MissReason

if TYPE_CHECKING:
    from kvoffload.pool.free_queue import CpuBlock
    from kvoffload.scheduler.groups import GroupedScheduler

__all__ = ["GroupPromotions", "GroupTierPart", "safe_group_name"]


def _blocks_of(group: KVCacheGroup, points: Iterable[int], limit: int) -> list[int]:
    """The blocks of ``needed(group, p)`` for every point ``p``, in order, each once."""
    seen: dict[int, None] = {}
    for p in points:
        for i in needed(group, p):
            if i < limit:
                seen[i] = None
    return list(seen)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def safe_group_name(name: str) -> str:
    """``name`` with every character a file or key name should not hold replaced by ``_``
    (a group's suffix in its tiers' names: ``<tier>.<group>``)."""
    return _UNSAFE.sub("_", name)


class GroupTierPart(LookupExtension, Protocol):
    """One group's tiers as a lookup asks them: a `LookupExtension` of that group's pool
    that also says what it is promoting and hears a lookup that waited for it
    (`TierManager`, or the vLLM connector's per-group `SchedulerTiers`)."""

    def is_promoting(self, block_hash: BlockHash) -> bool:
        """Whether a promotion covering ``block_hash`` is in flight."""
        ...

    def lookup_deferred(self) -> None:
        """A lookup answered "ask again" waiting for a promotion of these tiers: count it
        in their ``deferred_lookups``."""
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
            suffix = "." + safe_group_name(g.name)
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
