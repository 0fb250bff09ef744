"""`TierFront`: what ``KVOffloader.tiers`` is, for one KV cache group or several.

With one group it is the offloader's `TierManager`; with several it is `GroupTiers`, one
manager per cacheable group behind the same read API. What is meaningful for the whole
model is on the front (every tier, the promotion counters added up, the invariants of
every group, whether a hash is being promoted: a hash is keyed by its group's namespace,
so it names one group's block); what is a group's own (its tier stack, its host
memory, its held references) is reached per group (`GroupTiers.managers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvoffload.hashing import BlockHash
    from kvoffload.tiers.base import SecondaryTier
    from kvoffload.tiers.stats import TierManagerStatistics

__all__ = ["TierFront"]


class TierFront(Protocol):
    """The secondary tiers of one `KVOffloader`, for inspection (``off.tiers``)."""

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        """Every tier, in lookup order (with several groups, group by group, each named
        ``<tier>.<group>``; the order of ``statistics().tiers``)."""
        ...

    @property
    def defer_deadline_s(self) -> float:
        """The longest a request's lookups answer "ask again" in a row while a
        promotion runs (with several groups, the longest of the groups')."""
        ...

    @property
    def max_prefetch_blocks(self) -> int:
        """The most CPU blocks prefetches in flight take together (with several groups,
        the groups' bounds added up; each pool keeps its own)."""
        ...

    @property
    def prefetch_blocks(self) -> int:
        """CPU blocks prefetches in flight hold now (all groups together)."""
        ...

    def is_promoting(self, block_hash: BlockHash) -> bool:
        """Whether a promotion covering ``block_hash`` is in flight."""
        ...

    def statistics(self) -> TierManagerStatistics:
        """Every tier's counters and the promotion counters (added up over the groups)."""
        ...

    def check_invariants(self) -> None:
        """Check the tiers' bookkeeping (every group's); raises `InvariantError`."""
        ...
