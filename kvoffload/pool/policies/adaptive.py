"""An eviction policy that follows whichever of several expert policies fits the workload.

Each expert runs in a *shadow pool*: a `CpuBlockPool` of the real pool's size that holds
hashes only (no data), driven by every request the real pool sees, as if it were the real
pool under that expert. The shadows' prefix hits, decayed over a window of recent block
accesses, say which expert is doing best on the current traffic; the real pool then
evicts as that leader would: first the free blocks that the leader's shadow no longer
holds, then (when that is not enough) the least recently freed ones.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, final

from kvoffload.errors import InvariantError
from kvoffload.pool.policies._common import PolicyBase
from kvoffload.pool.policies._static import STATIC_POLICY_NAMES
from kvoffload.pool.policies.arc import ArcPolicy
from kvoffload.pool.policies.gdfreq import PrefixFrequencyPolicy
from kvoffload.pool.policies.s3fifo import S3FifoPolicy

if TYPE_CHECKING:
    from kvoffload.hashing import BlockHash
    from kvoffload.pool.free_queue import CpuBlock, LruFreeQueue
    from kvoffload.pool.policies.base import EvictionPolicy

__all__ = ["DEFAULT_EXPERTS", "AdaptivePolicy", "AdaptiveStatistics", "ShadowPool"]


class ShadowPool(Protocol):
    """What the adaptive policy uses of a shadow pool: a hash-only `CpuBlockPool`.

    The policy never imports the pool (the pool imports the policies); the pool hands it a
    factory for its own class through `AdaptivePolicy.bind_pool_factory()`.
    """

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    @property
    def policy(self) -> EvictionPolicy: ...
    def lookup(self, block_hashes: Iterable[BlockHash]) -> list[CpuBlock]: ...
    def touch(self, blocks: Iterable[CpuBlock]) -> None: ...
    def allocate(
        self, num_blocks: int, *, evicted: list[BlockHash] | None = None
    ) -> list[CpuBlock]: ...
    def publish(self, block: CpuBlock, block_hash: BlockHash) -> None: ...
    def free(self, blocks: Iterable[CpuBlock]) -> None: ...
    def is_cached(self, block_hash: BlockHash) -> bool: ...
    def check_invariants(self) -> None: ...


ShadowPoolFactory = Callable[[int, str], ShadowPool]
"""Makes a shadow pool: ``(num_blocks, policy name) -> ShadowPool``."""

DEFAULT_EXPERTS: tuple[str, ...] = ("lru", "s3fifo", "arc")
"""The experts `AdaptivePolicy` chooses among by default; the first one leads at the start."""


@final
@dataclass(frozen=True, slots=True)
class AdaptiveStatistics:
    """A snapshot of an `AdaptivePolicy`.

    Attributes:
        leader: the expert the pool currently evicts like.
        scores: per expert, its shadow's prefix hits decayed over the window.
        shadow_hits: per expert, its shadow's prefix hits since the start (undecayed).
        switches: how many times the leader changed.
        metadata_entries: block records, hashes and ids the policy keeps, all experts
            together (see `AdaptivePolicy.metadata_bound`).
        metadata_bound: the most ``metadata_entries`` can ever be for this pool size.
    """

    leader: str
    scores: dict[str, float]
    shadow_hits: dict[str, int]
    switches: int
    metadata_entries: int
    metadata_bound: int


def _expert_entries(policy: EvictionPolicy) -> int:
    """Ids and hashes an expert's own structures hold (its shadow pool's are counted apart)."""
    if isinstance(policy, ArcPolicy):
        return (
            len(policy._t1)
            + len(policy._t2)
            + len(policy._b1)
            + len(policy._b2)
            + len(policy._empty)
        )
    if isinstance(policy, S3FifoPolicy):
        return len(policy._small) + len(policy._main) + len(policy._ghost) + len(policy._empty)
    if isinstance(policy, PrefixFrequencyPolicy):
        return len(policy._heap) + len(policy._empty)
    return 0


def _expert_bound(name: str, capacity: int) -> int:
    """The most `_expert_entries` can reach for an expert of a ``capacity``-block pool."""
    if name == "arc":
        return 4 * capacity  # T1, T2 and the empty queue <= C, B1 <= C, B2 <= 2C
    if name == "s3fifo":
        return 2 * capacity  # both queues and the empty queue <= C, the ghost list < C
    if name == "prefix-freq":
        # The heap holds at most 2 * ranked + 64 entries (the policy compacts it past
        # that) and ranked + empty <= C, so 2C + 64 in all; the bound allows 6C + 64.
        return 6 * capacity + 64
    return 0


@final
class AdaptivePolicy(PolicyBase):
    """Evict like the expert whose shadow pool has had the most recent prefix hits.

    Each expert (by default LRU, S3-FIFO, ARC and ``prefix-freq``) runs in a shadow pool
    of the same size that holds hashes only. A lookup is a request's use of its blocks:
    the pool passes the looked-up hashes to `on_lookup`, and every shadow replays the
    request the way the replay tools drive a pool (look up, pin the leading hits, store
    the rest as far as blocks are free, free tail first), so under `kvoffload.replay` a
    shadow's hits are exactly those of the expert on its own. A lookup repeated before
    anything was freed (a request asking again) is not a new use. Each expert's score is
    its shadow's prefix hits, decayed with a time constant of ``window`` times the pool
    size in block accesses. The leader changes when another expert's score ``s`` beats
    the leader's ``l`` by more than ``margin * l + confidence * sqrt(s + l)``: the square
    root is the noise of hit counts, so a lead has to be real before the pool follows it
    (each change costs hits while the pool's contents move over).

    The shadows replay a request at its lookup, before the pool allocates for it, so the
    blocks the leader's shadow evicted for it are known when the pool asks for victims:
    the policy takes free blocks that hold nothing findable, then free blocks whose hash
    the leader's shadow no longer holds (in the order it dropped them), then the least
    recently freed blocks. Under one leader the pool's contents are the leader's.

    Memory is bounded by the pool size ``C``: per expert a shadow pool (``C`` block
    records, at most ``C`` hashes) and the expert's own metadata (none for LRU, at most
    ``4C`` entries for ARC, ``2C`` for S3-FIFO, ``6C + 64`` for ``prefix-freq``), plus at
    most ``4C`` ids and hashes of the policy's own (`metadata_bound`); the time per
    request is that of one replay step per expert.

    Args:
        experts: registered policy names to choose among (not ``"adaptive"``); the first
            leads until another one does better, and wins ties.
        window: decay time constant of the scores, in multiples of the pool size (block
            accesses); ``math.inf`` counts every hit since the start equally.
        margin: the lead (a fraction of the leader's score) another expert needs to take
            over, on top of the ``confidence`` term.
        confidence: the lead, in standard deviations of the hit counts, another expert
            needs to take over.

    Raises:
        ValueError: no experts, a repeated or unknown expert, or a window, margin or
            confidence out of range.
    """

    __slots__ = (
        "_capacity",
        "_confidence",
        "_experts",
        "_hits",
        "_last",
        "_leader",
        "_margin",
        "_orphans",
        "_scores",
        "_shadows",
        "_switches",
        "_tau",
        "_where",
        "_window",
    )

    def __init__(
        self,
        *,
        experts: Sequence[str] = DEFAULT_EXPERTS,
        window: float = 16.0,
        margin: float = 0.0,
        confidence: float = 0.5,
    ) -> None:
        names = tuple(name.strip().lower() for name in experts)
        if not names:
            raise ValueError("AdaptivePolicy needs at least one expert")
        if len(set(names)) != len(names):
            raise ValueError(f"AdaptivePolicy: an expert is named twice in {list(names)}")
        for name in names:
            if name not in STATIC_POLICY_NAMES:
                known = ", ".join(STATIC_POLICY_NAMES)
                raise ValueError(f"AdaptivePolicy: unknown expert {name!r}; known: {known}")
        if not window > 0:
            raise ValueError(f"window must be > 0, got {window}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        if not 0.0 <= confidence < math.inf:
            raise ValueError(f"confidence must be finite and >= 0, got {confidence}")
        super().__init__()
        self._experts = names
        self._window = float(window)
        self._margin = float(margin)
        self._confidence = float(confidence)
        self._capacity = 0
        self._tau = math.inf
        self._shadows: list[ShadowPool] = []
        self._scores = [0.0] * len(names)
        self._hits = [0] * len(names)
        self._leader = 0
        self._switches = 0
        # Free blocks whose hash the leader's shadow evicted, oldest first (checked when used).
        self._orphans: OrderedDict[int, None] = OrderedDict()
        # The real block each freed hash was last seen in (checked when used).
        self._where: dict[BlockHash, int] = {}
        # The hashes of the last lookup replayed, until the next free.
        self._last: tuple[BlockHash, ...] | None = None

    @property
    def name(self) -> str:
        """``"adaptive"``."""
        return "adaptive"

    @property
    def experts(self) -> tuple[str, ...]:
        """The experts' names, in the order given."""
        return self._experts

    @property
    def leader(self) -> str:
        """The expert the pool currently evicts like."""
        return self._experts[self._leader]

    @property
    def metadata_bound(self) -> int:
        """The most block records, hashes and ids the policy ever keeps (0 before attach)."""
        c = self._capacity
        if not c:
            return 0
        return sum(2 * c + _expert_bound(name, c) for name in self._experts) + 4 * c

    def __repr__(self) -> str:
        return f"AdaptivePolicy(experts={list(self._experts)}, leader={self.leader!r})"

    def _attached(self, num_blocks: int) -> None:
        self._capacity = num_blocks
        self._tau = self._window * num_blocks

    def bind_pool_factory(self, make_pool: ShadowPoolFactory) -> None:
        """Build one shadow pool per expert; the pool calls it right after `attach()`.

        Args:
            make_pool: makes a pool of the given size and policy (the attaching pool's
                own class), so this module needs no import of the pool.
        """
        self._shadows = [make_pool(self._capacity, name) for name in self._experts]

    # -- what the pool tells the policy -----------------------------------------------------

    def on_touch(self, block: CpuBlock) -> None:
        """A block leaving the free set is no longer an empty block to reuse first."""
        if block.ref_cnt == 0:
            self._empty.pop(block.block_id, None)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        """Queue empty blocks; remember which block holds each freed hash."""
        where, empty = self._where, self._empty
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                empty[block.block_id] = None
            else:
                where[block_hash] = block.block_id
        if len(where) > 2 * self._capacity:
            self._where = {
                b.block_hash: b.block_id for b in self._blocks if b.block_hash is not None
            }
        self._last = None

    def on_lookup(self, block_hashes: Sequence[BlockHash], hits: int) -> None:
        """Replay the looked-up request in every shadow (a repeat of the last one is skipped)."""
        keys = tuple(block_hashes)
        if not keys or keys == self._last:
            return
        self._last = keys
        self._observe(keys)

    def _observe(self, keys: tuple[BlockHash, ...]) -> None:
        """Replay one request (its hashes in prefix order) in every shadow; rescore."""
        decay = math.exp(-len(keys) / self._tau)
        scores, hits = self._scores, self._hits
        evicted: list[BlockHash] = []
        for i, shadow in enumerate(self._shadows):
            found = shadow.lookup(keys)
            h = len(found)
            shadow.touch(found)
            missing = keys[h:]
            k = min(len(missing), shadow.num_free)
            new = shadow.allocate(k, evicted=evicted if i == self._leader else None)
            for block, key in zip(new, missing, strict=False):
                shadow.publish(block, key)
            held = found + new
            held.reverse()
            shadow.free(held)
            hits[i] += h
            scores[i] = scores[i] * decay + h
        self._note_evicted(evicted)
        leader = self._leader
        best = max(range(len(scores)), key=scores.__getitem__)
        lead = scores[best] - scores[leader]
        if best != leader and lead > self._margin * scores[leader] + self._confidence * math.sqrt(
            scores[best] + scores[leader]
        ):
            self._leader = best
            self._switches += 1
            self._rebuild_orphans()

    def _note_evicted(self, evicted: list[BlockHash]) -> None:
        where, blocks, orphans = self._where, self._blocks, self._orphans
        for block_hash in evicted:
            block_id = where.get(block_hash)
            if block_id is not None and blocks[block_id].block_hash == block_hash:
                orphans[block_id] = None

    def _rebuild_orphans(self) -> None:
        """After a change of leader: the free blocks its shadow does not hold, oldest first."""
        cached = self._shadows[self._leader].is_cached
        self._orphans = OrderedDict(
            (b.block_id, None)
            for b in self._free_queue()
            if b.block_hash is not None and not cached(b.block_hash)
        )

    def _free_queue(self) -> LruFreeQueue:
        if self._free is None:
            raise InvariantError("AdaptivePolicy is not attached to a pool")
        return self._free

    # -- choosing victims --------------------------------------------------------------------

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """Empty blocks, then blocks the leader's shadow evicted, then the least recently freed."""
        out: list[CpuBlock] = []
        self._take_empty(n, protect, out)
        if len(out) < n:
            self._take_orphans(n, protect, out)
        if len(out) < n:
            chosen = {b.block_id for b in out}
            for block in self._free_queue():
                if block.block_id not in chosen and block not in protect:
                    out.append(block)
                    if len(out) == n:
                        break
        orphans, where, empty = self._orphans, self._where, self._empty
        for block in out:
            orphans.pop(block.block_id, None)
            empty.pop(block.block_id, None)
            if block.block_hash is not None and where.get(block.block_hash) == block.block_id:
                del where[block.block_hash]
        return out

    def _take_orphans(self, n: int, protect: Collection[CpuBlock], out: list[CpuBlock]) -> None:
        cached = self._shadows[self._leader].is_cached
        blocks, orphans = self._blocks, self._orphans
        chosen = {b.block_id for b in out}
        stale: list[int] = []
        for block_id in orphans:
            block = blocks[block_id]
            block_hash = block.block_hash
            if (
                block.ref_cnt
                or block_id in chosen
                or (block_hash is not None and cached(block_hash))
            ):
                stale.append(block_id)
            elif block not in protect:
                out.append(block)
                if len(out) == n:
                    break
        for block_id in stale:
            del orphans[block_id]

    # -- observation -------------------------------------------------------------------------

    def metadata_entries(self) -> int:
        """Block records, hashes and ids kept now, all experts together (O(1))."""
        total = len(self._orphans) + len(self._where) + len(self._empty)
        for shadow in self._shadows:
            total += shadow.num_blocks + shadow.num_cached + _expert_entries(shadow.policy)
        return total

    def statistics(self) -> AdaptiveStatistics:
        """A snapshot of the leader, the scores and the memory kept."""
        return AdaptiveStatistics(
            leader=self.leader,
            scores=dict(zip(self._experts, self._scores, strict=True)),
            shadow_hits=dict(zip(self._experts, self._hits, strict=True)),
            switches=self._switches,
            metadata_entries=self.metadata_entries(),
            metadata_bound=self.metadata_bound,
        )

    def check(self) -> None:
        """The empty queue holds free blocks; each shadow is consistent; memory is in bound.

        Raises:
            InvariantError: a held block queued as empty, a broken shadow, or metadata
                beyond `metadata_bound`.
        """
        self._check_empty()
        for shadow in self._shadows:
            shadow.check_invariants()
        if not 0 <= self._leader < len(self._experts):
            raise InvariantError(f"AdaptivePolicy: leader index {self._leader} out of range")
        if any(not s >= 0.0 for s in self._scores):
            raise InvariantError(f"AdaptivePolicy: a score is negative or NaN: {self._scores}")
        if self._shadows and self.metadata_entries() > self.metadata_bound:
            raise InvariantError(
                f"AdaptivePolicy: {self.metadata_entries()} metadata entries exceed the "
                f"bound {self.metadata_bound}"
            )
