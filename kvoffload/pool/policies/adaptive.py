"""An eviction policy that weighs several expert policies by the hits each would have had.

Each expert runs in a *shadow pool*: a `CpuBlockPool` of the real pool's size that holds
hashes only (no data), driven by every request the real pool sees, as if it were the real
pool under that expert. The shadows' prefix hits, decayed over a window of recent block
accesses, weigh the experts; the real pool then keeps the free blocks that the experts'
weights most agree on keeping: a free block is worth the weights of the experts whose
shadow holds its hash, and the least worth goes first. An expert's weight is the chance,
under the noise of the hit counts (measured: hits come in runs of a request's blocks),
that it is really as good as the best one: an expert far ahead decides alone; experts
whose hits are within noise of each other share the pool.
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

__all__ = [
    "DEFAULT_EXPERTS",
    "TEMPERATURE",
    "AdaptivePolicy",
    "AdaptiveStatistics",
    "ShadowPool",
    "expert_weights",
]


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

DEFAULT_EXPERTS: tuple[str, ...] = ("s3fifo", "lru", "arc", "prefix-freq")
"""The experts `AdaptivePolicy` weighs by default; the first one leads at the start.

S3-FIFO leads: with no evidence yet the pool keeps what it keeps (scan resistant, and
the best static policy in most cells of the grid in docs/policies.md); LRU and the
others take over as soon as their shadows hit more.
"""

TEMPERATURE = 1.0
"""`AdaptivePolicy`'s default ``temperature`` (the measured standard deviation, unscaled)."""


@final
@dataclass(frozen=True, slots=True)
class AdaptiveStatistics:
    """A snapshot of an `AdaptivePolicy`.

    Attributes:
        leader: the expert with the most weight (it breaks ties between blocks).
        scores: per expert, its shadow's prefix hits decayed over the window.
        weights: per expert, the weight its vote to keep a block has now (1 for the best
            score, less the further behind an expert is, in standard deviations of the
            hit counts; while every score is the same, 1 for the leader and 0 for the
            others).
        shadow_hits: per expert, its shadow's prefix hits since the start (undecayed).
        switches: how many times the leader changed.
        metadata_entries: block records, hashes and ids the policy keeps, all experts
            together (see `AdaptivePolicy.metadata_bound`).
        metadata_bound: the most ``metadata_entries`` can ever be for this pool size.
    """

    leader: str
    scores: dict[str, float]
    weights: dict[str, float]
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
    """Keep the blocks that the experts with the most recent prefix hits keep.

    Each expert (by default S3-FIFO, LRU, ARC and ``prefix-freq``) runs in a shadow pool
    of the same size that holds hashes only. A lookup is a request's use of its blocks:
    the pool passes the looked-up hashes to `on_lookup`, and every shadow replays the
    request the way the replay tools drive a pool (look up, pin the leading hits, store
    the rest as far as blocks are free, free tail first), so under `kvoffload.replay` a
    shadow's hits are exactly those of the expert on its own. A lookup repeated before
    anything was freed (a request asking again) is not a new use. Each expert's score is
    its shadow's prefix hits since the start (or decayed with a time constant of ``window``
    times the pool size in block accesses). A request's hits come as one run of its
    leading blocks, so the noise of an expert's score is not that of independent hits
    (``sqrt(s)``): it is ``sqrt(q)``, where ``q`` sums the squares of the expert's
    per-request hits (decayed alike; the variance of a sum of random runs). An expert
    whose score ``s`` (squares ``q``) is behind the best one ``b`` (squares ``p``) is
    ``z = (b - s) / sqrt(p + q + 1)`` standard deviations behind and weighs
    ``erfc(z / (temperature * sqrt(2)))``, the chance that a normal variable falls at
    least ``z / temperature`` standard deviations from its mean: how plausibly the
    expert is really as good as the best. An expert within noise of the best
    weighs nearly as much (1), one 1, 2 or 3 standard deviations behind 0.32, 0.046 or
    0.003.

    The shadows replay a request at its lookup, before the pool allocates for it, so
    which experts still hold each free block's hash is known when the pool asks for
    victims. The policy takes free blocks that hold nothing findable first, then free
    blocks by the summed weight of the experts whose shadow holds their hash, least
    first (on a tie: one the leader does not hold, then the longest held at that worth).
    While every expert's score is the same (no expert has hit anything the others did
    not, as at the start), the leader's weight alone counts: experts that agree are no
    evidence, and a majority of them would evict what the leader keeps (on a cycle
    larger than the pool, LRU, ARC and ``prefix-freq`` hold the same recent blocks and
    never hit, and the blocks S3-FIFO would hit were gone by its first hit).
    When one expert weighs more than all the others together, the pool's contents are
    its shadow's; while several are close, the pool keeps what most of that weight
    keeps, so a change in which expert is best does not leave it holding the blocks of
    the wrong one (which following a single leader did: each change cost hits while the
    contents moved over). The leader is the expert with the best score, changed when
    another one's ``s`` beats the leader's ``l`` by more than ``margin * l + confidence *
    sqrt(s + l)``; it only breaks ties, and names the front runner in `statistics()`.

    Memory is bounded by the pool size ``C``: per expert a shadow pool (``C`` block
    records, at most ``C`` hashes) and the expert's own metadata (none for LRU, at most
    ``4C`` entries for ARC, ``2C`` for S3-FIFO, ``6C + 64`` for ``prefix-freq``), plus at
    most ``5C`` ids, masks and hashes of the policy's own (`metadata_bound`); the time per
    request is that of one replay step per expert.

    Args:
        experts: registered policy names to choose among (not ``"adaptive"``); the first
            leads until another one does better, and wins ties.
        window: decay time constant of the scores, in multiples of the pool size (block
            accesses); ``math.inf`` (the default) counts every hit since the start
            equally, so the weights sharpen as the evidence grows. A finite window lets
            old traffic fade, for workloads that change shape, and keeps the weights
            softer (the experts share the pool more).
        margin: the lead (a fraction of the leader's score) another expert needs to take
            over, on top of the ``confidence`` term.
        confidence: the lead, in standard deviations of the hit counts, another expert
            needs to take over as the leader.
        temperature: a scale on the measured standard deviation of the hit counts (1:
            as measured); larger shares the pool more evenly, smaller follows the best
            expert sooner.

    Raises:
        ValueError: no experts, a repeated or unknown expert, or a window, margin,
            confidence or temperature out of range.
    """

    __slots__ = (
        "_buckets",
        "_capacity",
        "_confidence",
        "_experts",
        "_hits",
        "_last",
        "_leader",
        "_margin",
        "_mask_of",
        "_scores",
        "_shadows",
        "_squares",
        "_switches",
        "_tau",
        "_temperature",
        "_where",
        "_window",
    )

    def __init__(
        self,
        *,
        experts: Sequence[str] = DEFAULT_EXPERTS,
        window: float = math.inf,
        margin: float = 0.0,
        confidence: float = 0.5,
        temperature: float = TEMPERATURE,
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
        if not 0.0 < temperature < math.inf:
            raise ValueError(f"temperature must be finite and > 0, got {temperature}")
        super().__init__()
        self._experts = names
        self._window = float(window)
        self._margin = float(margin)
        self._confidence = float(confidence)
        self._temperature = float(temperature)
        self._capacity = 0
        self._tau = math.inf
        self._shadows: list[ShadowPool] = []
        self._scores = [0.0] * len(names)
        self._squares = [0.0] * len(names)
        self._hits = [0] * len(names)
        self._leader = 0
        self._switches = 0
        # Per mask of the experts whose shadow holds its hash (bit i: expert i), the free
        # published blocks, in the order they came to that mask; a block's mask is checked
        # again when it is chosen. ``_mask_of[block_id]`` is its bucket, -1 for none.
        self._buckets: list[OrderedDict[int, None]] = [
            OrderedDict() for _ in range(1 << len(names))
        ]
        self._mask_of: list[int] = []
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
        """The expert with the best score (see the class docstring); it breaks ties."""
        return self._experts[self._leader]

    @property
    def metadata_bound(self) -> int:
        """The most block records, hashes and ids the policy ever keeps (0 before attach)."""
        c = self._capacity
        if not c:
            return 0
        return sum(2 * c + _expert_bound(name, c) for name in self._experts) + 5 * c

    def __repr__(self) -> str:
        return f"AdaptivePolicy(experts={list(self._experts)}, leader={self.leader!r})"

    def _attached(self, num_blocks: int) -> None:
        self._capacity = num_blocks
        self._mask_of = [-1] * num_blocks
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
        """A block leaving the free set is no candidate any more."""
        if block.ref_cnt == 0:
            self._empty.pop(block.block_id, None)
            self._unbucket(block.block_id)

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        """Queue empty blocks; bucket the others by the experts that hold their hash."""
        where, empty, mask = self._where, self._empty, self._mask
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                empty[block.block_id] = None
            else:
                where[block_hash] = block.block_id
                self._rebucket(block.block_id, mask(block_hash))
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
        scores, squares, hits = self._scores, self._squares, self._hits
        for i, shadow in enumerate(self._shadows):
            found = shadow.lookup(keys)
            h = len(found)
            shadow.touch(found)
            missing = keys[h:]
            k = min(len(missing), shadow.num_free)
            evicted: list[BlockHash] = []
            new = shadow.allocate(k, evicted=evicted)
            for block, key in zip(new, missing, strict=False):
                shadow.publish(block, key)
            held = found + new
            held.reverse()
            shadow.free(held)
            hits[i] += h
            scores[i] = scores[i] * decay + h
            squares[i] = squares[i] * decay * decay + h * h
            if evicted:
                self._note_evicted(evicted, 1 << i)
        leader = self._leader
        best = max(range(len(scores)), key=scores.__getitem__)
        lead = scores[best] - scores[leader]
        if best != leader and lead > self._margin * scores[leader] + self._confidence * math.sqrt(
            scores[best] + scores[leader]
        ):
            self._leader = best
            self._switches += 1

    def _mask(self, block_hash: BlockHash) -> int:
        """Which experts' shadows hold ``block_hash`` (bit i: expert i)."""
        mask = 0
        for i, shadow in enumerate(self._shadows):
            if shadow.is_cached(block_hash):
                mask |= 1 << i
        return mask

    def _unbucket(self, block_id: int) -> None:
        old = self._mask_of[block_id]
        if old >= 0:
            del self._buckets[old][block_id]
            self._mask_of[block_id] = -1

    def _rebucket(self, block_id: int, mask: int) -> None:
        """Move a free block to the end of its mask's bucket (-1: out of every bucket)."""
        self._unbucket(block_id)
        if mask >= 0:
            self._buckets[mask][block_id] = None
            self._mask_of[block_id] = mask

    def _note_evicted(self, evicted: list[BlockHash], bit: int) -> None:
        """An expert's shadow dropped these hashes: their free real blocks lose its vote."""
        where, blocks, mask_of = self._where, self._blocks, self._mask_of
        for block_hash in evicted:
            block_id = where.get(block_hash)
            if block_id is None:
                continue
            old = mask_of[block_id]
            if old >= 0 and old & bit and blocks[block_id].block_hash == block_hash:
                self._rebucket(block_id, old & ~bit)

    def weights(self) -> list[float]:
        """Per expert (in the order given), the weight of its vote now; the best is 1
        (see `expert_weights()`)."""
        return expert_weights(self._scores, self._squares, self._leader, self._temperature)

    def _free_queue(self) -> LruFreeQueue:
        if self._free is None:
            raise InvariantError("AdaptivePolicy is not attached to a pool")
        return self._free

    # -- choosing victims --------------------------------------------------------------------

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """Empty blocks, then free blocks by the weight of the experts that hold them, least
        first, then blocks every expert holds, least recently freed first."""
        out: list[CpuBlock] = []
        self._take_empty(n, protect, out)
        if len(out) < n:
            self._take_by_weight(n, protect, out)
        if len(out) < n:
            chosen = {b.block_id for b in out}
            for block in self._free_queue():
                if block.block_id not in chosen and block not in protect:
                    out.append(block)
                    if len(out) == n:
                        break
        where, empty = self._where, self._empty
        for block in out:
            empty.pop(block.block_id, None)
            self._unbucket(block.block_id)
            if block.block_hash is not None and where.get(block.block_hash) == block.block_id:
                del where[block.block_hash]
        return out

    def _take_by_weight(self, n: int, protect: Collection[CpuBlock], out: list[CpuBlock]) -> None:
        """Move free blocks into ``out``, buckets of least summed weight first."""
        w = self.weights()
        lead = 1 << self._leader
        buckets = self._buckets

        def worth(mask: int) -> tuple[float, bool]:
            return (sum(x for i, x in enumerate(w) if mask >> i & 1), bool(mask & lead))

        blocks, mask = self._blocks, self._mask
        chosen: set[int] = {b.block_id for b in out}
        # Blocks every expert holds are left to the caller: they go in the pool's own order.
        full = len(buckets) - 1
        for m in sorted((m for m in range(full) if buckets[m]), key=worth):
            moves: list[tuple[int, int]] = []
            for block_id in buckets[m]:
                block = blocks[block_id]
                block_hash = block.block_hash
                if block.ref_cnt or block_id in chosen or block_hash is None:
                    moves.append((block_id, -1))  # left the free set, or unpublished
                    continue
                now = mask(block_hash)
                if now != m:  # a shadow stored the hash again since: the mask went stale
                    moves.append((block_id, now))
                elif block not in protect:
                    out.append(block)
                    chosen.add(block_id)
                    if len(out) == n:
                        break
            for block_id, now in moves:
                self._rebucket(block_id, now)
            if len(out) == n:
                return

    # -- observation -------------------------------------------------------------------------

    def metadata_entries(self) -> int:
        """Block records, hashes and ids kept now, all experts together (O(experts))."""
        total = len(self._where) + len(self._empty) + len(self._mask_of)
        total += sum(len(bucket) for bucket in self._buckets)
        for shadow in self._shadows:
            total += shadow.num_blocks + shadow.num_cached + _expert_entries(shadow.policy)
        return total

    def statistics(self) -> AdaptiveStatistics:
        """A snapshot of the leader, the scores, the weights and the memory kept."""
        return AdaptiveStatistics(
            leader=self.leader,
            scores=dict(zip(self._experts, self._scores, strict=True)),
            weights=dict(zip(self._experts, self.weights(), strict=True)),
            shadow_hits=dict(zip(self._experts, self._hits, strict=True)),
            switches=self._switches,
            metadata_entries=self.metadata_entries(),
            metadata_bound=self.metadata_bound,
        )

    def check(self) -> None:
        """The empty queue and the buckets hold free blocks, each in one bucket; each shadow
        is consistent; memory is in bound.

        Raises:
            InvariantError: a held block queued as empty or bucketed, a block in a bucket
                other than its recorded one, a broken shadow, or metadata beyond
                `metadata_bound`.
        """
        self._check_empty()
        for m, bucket in enumerate(self._buckets):
            for block_id in bucket:
                if self._mask_of[block_id] != m or self._blocks[block_id].ref_cnt:
                    raise InvariantError(
                        f"AdaptivePolicy: block {block_id} in bucket {m} is recorded in "
                        f"bucket {self._mask_of[block_id]} and holds "
                        f"{self._blocks[block_id].ref_cnt} reference(s)"
                    )
        for shadow in self._shadows:
            shadow.check_invariants()
        _check_scores(self._scores, self._squares, self._leader)
        if self._shadows and self.metadata_entries() > self.metadata_bound:
            raise InvariantError(
                f"AdaptivePolicy: {self.metadata_entries()} metadata entries exceed the "
                f"bound {self.metadata_bound}"
            )


def expert_weights(
    scores: Sequence[float], squares: Sequence[float], leader: int, temperature: float
) -> list[float]:
    """The weight of each expert's vote, the best's 1.

    An expert ``z`` standard deviations of the hit counts behind the best weighs
    ``erfc(z / (temperature * sqrt(2)))``, the deviation measured from the sums of the
    squares of the experts' per-request hits (``squares``; see `AdaptivePolicy`). While
    every score is the same (no evidence yet), the leader's vote is 1 and the others' 0:
    experts that agree are no evidence, and their majority would evict what the leader
    keeps.
    """
    top = max(scores)
    if top == min(scores):
        return [float(i == leader) for i in range(len(scores))]
    p = squares[list(scores).index(top)]
    scale = temperature * math.sqrt(2.0)
    return [
        math.erfc((top - s) / (scale * math.sqrt(p + q + 1.0)))
        for s, q in zip(scores, squares, strict=True)
    ]


def _check_scores(scores: Sequence[float], squares: Sequence[float], leader: int) -> None:
    """Raise `InvariantError` for a leader out of range, or a score or sum of squares that
    is negative or NaN."""
    if not 0 <= leader < len(scores):
        raise InvariantError(f"AdaptivePolicy: leader index {leader} out of range")
    if any(not s >= 0.0 for s in scores):
        raise InvariantError(f"AdaptivePolicy: a score is negative or NaN: {list(scores)}")
    if any(not q >= 0.0 for q in squares):
        raise InvariantError(
            f"AdaptivePolicy: a sum of squares is negative or NaN: {list(squares)}"
        )
