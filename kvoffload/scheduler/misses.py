"""Why a lookup's hit stopped where it did: `MissReason`, and the bounded memory of one
pool's recent evictions and skipped stores that tells the reasons apart (`MissMemory`).

A lookup names one reason: the cause at the first block (or, with several KV cache
groups, the first aligned step) that it could not load. The reasons are checked in this
order, the first that holds is the answer: nothing missed (`MissReason.NONE`), the cache
not read (`NOT_READ`), the last prompt token (`LAST_TOKEN`), a block or checkpoint
boundary (`BOUNDARY`), the block's copy into the pool in flight (`IN_FLIGHT`), a tier
that failed on it (`TIER_FAILED`), an eviction remembered (`EVICTED`), a skipped store
remembered (`STORE_SKIPPED`), another group holding its part of the step
(`GROUP_MISSING`), and otherwise `NEVER_STORED`. docs/misses.md says what to do about
each.

"Evicted" and "store skipped" are told from "never stored" by `MissMemory`: per pool, the
hashes of the last ``capacity`` blocks evicted (by default as many as the pool holds, so a
lookup sees back over the last pool-full of evictions) and of the last ``capacity`` stores
skipped. A hash that fell out of that window reads `NEVER_STORED`. Recording costs one
ordered-dict insert per evicted block, on the paths that evict, and nothing when nothing
is evicted or skipped; ``capacity=0`` records nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from enum import Enum
from typing import final

from kvoffload.hashing import BlockHash

__all__ = ["MissMemory", "MissReason"]


class MissReason(str, Enum):
    """Why a lookup's hit stopped where it did (its value is the metric label)."""

    NONE = "none"
    """Nothing was missed: the engine's own prefix covers the prompt."""

    NOT_READ = "not_read"
    """The lookup was asked not to read the cache (``no_read``)."""

    LAST_TOKEN = "last_token"
    """The hit reached the block that holds the prompt's last token, which is never
    loaded: one token is always computed, to produce the next one. Nothing to fix."""

    BOUNDARY = "boundary"
    """The hit was rounded down to a whole block (the prompt's tail is not a full block),
    or, with several KV cache groups, to the groups' alignment or a checkpoint boundary
    (a group stores its state only at checkpoints). Nothing was lost."""

    IN_FLIGHT = "in_flight"
    """The next block's copy into the CPU pool (a store, or a promotion from a tier) is
    still in flight: ``lookup(allow_defer=True)`` would have answered "ask again"."""

    TIER_FAILED = "tier_failed"
    """A secondary tier was asked for the next block and timed out, raised, was
    unhealthy, or returned a block that failed its check."""

    EVICTED = "evicted"
    """The next block was stored in the CPU pool and later evicted (and no tier brought
    it back). Seen back over the pool's last ``capacity`` evictions (`MissMemory`)."""

    STORE_SKIPPED = "store_skipped"
    """The next block's store was skipped or deferred and never done: no free CPU block
    (the pool full of blocks in flight or pinned), the admission filter refused it, or
    the per-step store limit was reached."""

    GROUP_MISSING = "group_missing"
    """Several KV cache groups: the next aligned step is stored in some group and
    missing, with no other reason known, in another (often a window or chunk the group
    did not store)."""

    NEVER_STORED = "never_stored"
    """The next block was never stored in this pool (as far back as `MissMemory` sees):
    a prompt not seen before, or one stored and evicted longer ago."""


@final
class MissMemory:
    """The hashes one pool evicted, and whose stores were skipped, most recently.

    Args:
        capacity: how many hashes of each kind to remember (0: none, and nothing is
            recorded).
    """

    __slots__ = ("_evicted", "_skipped", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._evicted: OrderedDict[BlockHash, None] = OrderedDict()
        self._skipped: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._evicted) + len(self._skipped)

    def note_evicted(self, hashes: Iterable[BlockHash]) -> None:
        """Remember that these published blocks were evicted."""
        _remember(self._evicted, hashes, self.capacity)

    def note_skipped(self, hashes: Iterable[BlockHash]) -> None:
        """Remember that these blocks' stores were skipped or deferred."""
        _remember(self._skipped, hashes, self.capacity)

    def reason(self, block_hash: BlockHash) -> MissReason:
        """`EVICTED`, `STORE_SKIPPED` or `NEVER_STORED`, for a block not in the pool."""
        if block_hash in self._evicted:
            return MissReason.EVICTED
        if block_hash in self._skipped:
            return MissReason.STORE_SKIPPED
        return MissReason.NEVER_STORED

    def clear(self) -> None:
        """Forget everything (the cache was reset)."""
        self._evicted.clear()
        self._skipped.clear()


def _remember(seen: OrderedDict[BlockHash, None], hashes: Iterable[BlockHash], cap: int) -> None:
    if not cap:
        return
    for block_hash in hashes:
        if block_hash in seen:
            seen.move_to_end(block_hash)
        else:
            seen[block_hash] = None
    while len(seen) > cap:
        seen.popitem(last=False)
