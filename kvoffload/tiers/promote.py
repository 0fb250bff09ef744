"""Promotion: blocks a lookup misses in the CPU pool are read back from the tiers.

* CPU blocks are taken, published and released only through the scheduler's
  `BlockLedger`, which also owns the pending stores: a promotion allocates like a store
  (only free blocks, never one with a copy in flight, never the blocks of the prefix it
  extends), skips every hash being stored or promoted right now, and marks its own
  hashes pending, so no store plans them meanwhile. If no block is free it is skipped
  (the lookup is answered from the CPU pool).
* Every block read from a tier is checked by `verify_block()` before it is published; a
  block that fails is a miss, is deleted from its tier and is counted (invariant 3).
* A probe that found nothing keeps lookups from probing the same block again for a
  while; a reset (a new epoch) makes the promotions in flight publish nothing.
* A prefetch (`Promoter.prefetch()`) is a promotion run in its caller's task, ahead of
  the lookup that will need it: the same probe, ledger, verification and cleanup, and
  all prefetches in flight together take at most ``max_prefetch_blocks`` CPU blocks.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, final

import anyio
import anyio.abc
import anyio.to_thread

from kvoffload._logging import get_logger
from kvoffload.hashing import BlockHash
from kvoffload.scheduler.misses import MissReason
from kvoffload.tier_config import AnyTierSettings, RedisClusterTierSettings
from kvoffload.tiers.health import TierPart
from kvoffload.tiers.ops import probe, read_verified

if TYPE_CHECKING:
    from kvoffload.pool.block_pool import CpuBlockPool
    from kvoffload.pool.free_queue import CpuBlock
    from kvoffload.scheduler.ledger import BlockLedger, Promotion
    from kvoffload.tiers.health import TierHealth, TierState

__all__ = [
    "ABSENT_MAX",
    "ABSENT_TTL_S",
    "PROMOTION_MAX_BLOCKS",
    "LandedBlocks",
    "Promoter",
    "RecentBlocks",
    "promotion_deadline_s",
    "tiers_defer_deadline_s",
]

_log = get_logger("tiers")


@final
class LandedBlocks:
    """Blocks a promotion published into the CPU pool, by hash, with the tier that sent
    them, until a lookup pins them (its hit then counts them for that tier: the
    ``hit_sources()`` of a `LookupExtension`). Bounded to a quarter of the pool, oldest
    forgotten first. One rule for the tier manager and the vLLM connector's tiers.
    """

    __slots__ = ("_landed", "_limit")

    def __init__(self, num_blocks: int) -> None:
        self._landed: OrderedDict[BlockHash, tuple[CpuBlock, str]] = OrderedDict()
        self._limit = max(1, num_blocks // 4)

    def __len__(self) -> int:
        return len(self._landed)

    def add(self, block_hash: BlockHash, block: CpuBlock, source: str) -> None:
        """``block`` was published under ``block_hash`` by the tier named ``source``."""
        landed = self._landed
        landed[block_hash] = (block, source)
        while len(landed) > self._limit:
            landed.popitem(last=False)

    def sources(self, pinned: Sequence[CpuBlock]) -> dict[str, int] | None:
        """Of a lookup's CPU hit ``pinned``, how many blocks each tier brought in
        since a lookup last pinned them; ``None`` when none did."""
        landed = self._landed
        if not landed:
            return None
        served: dict[str, int] = {}
        for block in pinned:
            block_hash = block.block_hash
            got = landed.get(block_hash) if block_hash is not None else None
            if got is not None and got[0] is block:
                served[got[1]] = served.get(got[1], 0) + 1
        return served or None

    def forget(self, pinned: Sequence[CpuBlock]) -> None:
        """A lookup pinned these: later hits on them are the CPU pool's."""
        landed = self._landed
        if landed:
            for block in pinned:
                if block.block_hash is not None:
                    landed.pop(block.block_hash, None)

    def still_published(self) -> Iterator[CpuBlock]:
        """The landed blocks that still hold the hash they landed under."""
        return (b for h, (b, _) in self._landed.items() if b.block_hash == h)

    def clear(self) -> None:
        """Forget every block (the CPU cache was reset)."""
        self._landed.clear()


_ABSENT_TTL_S = 1.0
"""How long a probe that found nothing keeps lookups from probing the same block again."""
_ABSENT_MAX = 4096
_PROMOTION_MAX_BLOCKS = 256
PROMOTION_MAX_BLOCKS = _PROMOTION_MAX_BLOCKS
"""Most blocks one promotion reads (the rest of a longer prompt waits for the next)."""
ABSENT_TTL_S = _ABSENT_TTL_S
ABSENT_MAX = _ABSENT_MAX


@final
class RecentBlocks:
    """A bounded memory of block hashes (or an engine's own block keys), each for
    ``ttl_s`` seconds: the blocks a tier was found to lack (a probe's run stopped there:
    no lookup probes them again until they expire or are stored), or those a tier
    recently failed on (``ttl_s`` infinite: until pushed out). At most ``max_blocks``,
    oldest forgotten first. One rule for the tier manager's promotions, the vLLM
    connector's tiers and kvoffload's secondary tier of vLLM's OffloadingConnector.

    Args:
        ttl_s: how long a hash is remembered (``math.inf``: until pushed out or cleared).
        max_blocks: most hashes remembered.
    """

    __slots__ = ("_expiry", "_max", "_ttl")

    def __init__(self, ttl_s: float = _ABSENT_TTL_S, max_blocks: int = _ABSENT_MAX) -> None:
        self._expiry: OrderedDict[object, float] = OrderedDict()
        self._ttl = ttl_s
        self._max = max_blocks

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, block_hash: object) -> bool:
        """Whether ``block_hash`` is remembered and has not expired (an expired one is
        forgotten here)."""
        expiry = self._expiry.get(block_hash)
        if expiry is None:
            return False
        if expiry > time.monotonic():
            return True
        del self._expiry[block_hash]
        return False

    def add(self, block_hash: Hashable) -> None:
        """Remember ``block_hash`` (any hashable key) for ``ttl_s`` from now (the
        newest)."""
        expiry = self._expiry
        expiry[block_hash] = time.monotonic() + self._ttl
        expiry.move_to_end(block_hash)
        while len(expiry) > self._max:
            expiry.popitem(last=False)

    def forget(self, hashes: Iterable[Hashable | None]) -> None:
        """Forget these hashes (``None`` entries are skipped)."""
        expiry = self._expiry
        if expiry:
            for block_hash in hashes:
                if block_hash is not None:
                    expiry.pop(block_hash, None)

    def clear(self) -> None:
        """Forget every hash."""
        self._expiry.clear()


def promotion_deadline_s(operation_s: float, max_batch: int) -> float:
    """The longest one promotion from a tier may take: its probe and its reads (one per
    ``max_batch`` of at most 256 blocks), each within ``operation_s``."""
    return operation_s * (1 + -(-_PROMOTION_MAX_BLOCKS // max_batch))


def tiers_defer_deadline_s(settings: Sequence[AnyTierSettings]) -> float:
    """The longest a request's lookups may answer "ask again" in a row while a promotion
    from these tiers runs: the longest one promotion may take from any of them (its probe
    and its reads, each within the tier's lookup budget: a cluster tier's
    ``lookup_budget_ms``, any other tier's ``op_timeout_s``); 0 without tiers."""
    return max(
        (
            promotion_deadline_s(
                s.lookup_budget_ms / 1000
                if isinstance(s, RedisClusterTierSettings)
                else s.op_timeout_s,
                s.max_batch_blocks,
            )
            for s in settings
        ),
        default=0.0,
    )


@dataclass(slots=True, eq=False)
class _Promotion:
    hashes: tuple[BlockHash, ...]
    protect: tuple[CpuBlock, ...]
    epoch: int
    prefetch: bool = False


@final
class Promoter(TierPart):
    """Starts promotions after CPU lookups and runs them: probe, read, verify, publish
    (built with the `TierPart` arguments: promotions are opened and closed in the ledger).

    Attributes:
        promotions: promotions started.
        no_space: promotions skipped because no CPU block was free.
        deferred_lookups: lookups answered "ask again" while a promotion ran.
        errors: promotions that ended on an unexpected error.
        in_flight: promotions running now.
        prefetches: prefetches started (`prefetch()` calls that had a tier to read).
        prefetches_completed: prefetches that ran to their end (not cancelled).
        prefetches_cancelled: prefetches cancelled while they ran.
        prefetch_promoted: blocks prefetches published in the CPU pool.
        prefetch_blocks: CPU blocks prefetches hold now (at most ``max_prefetch_blocks``).
        prefetch_bounded: prefetches that took fewer blocks than they wanted (or none)
            because prefetches in flight held ``max_prefetch_blocks`` already.
    """

    __slots__ = (
        "_absent",
        "_closed",
        "_epoch",
        "_failed",
        "_jobs",
        "_landed",
        "deferred_lookups",
        "errors",
        "in_flight",
        "max_prefetch_blocks",
        "no_space",
        "prefetch_blocks",
        "prefetch_bounded",
        "prefetch_promoted",
        "prefetches",
        "prefetches_cancelled",
        "prefetches_completed",
        "promotions",
    )

    def __init__(
        self,
        tiers: Sequence[TierState],
        *,
        ledger: BlockLedger,
        pool: CpuBlockPool,
        health: TierHealth,
        namespace: bytes,
        nbytes: int,
        block_view: Callable[[int], memoryview],
        max_prefetch_blocks: int = 0,
    ) -> None:
        super().__init__(
            tiers,
            ledger=ledger,
            pool=pool,
            health=health,
            namespace=namespace,
            nbytes=nbytes,
            block_view=block_view,
        )
        self._jobs: dict[BlockHash, _Promotion] = {}
        self._absent = RecentBlocks()
        # Blocks promotions published, and the tier each came from, until a lookup pins
        # them (`hit_sources()`).
        self._landed = LandedBlocks(pool.num_blocks)
        # Hashes a tier recently failed on (a timeout, an error, a failed check), for
        # `miss_reason()`; bounded like the absent set.
        self._failed = RecentBlocks(math.inf)
        self._epoch = 0
        self._closed = False
        self.promotions = 0
        self.no_space = 0
        self.deferred_lookups = 0
        self.errors = 0
        self.in_flight = 0
        self.max_prefetch_blocks = max_prefetch_blocks
        self.prefetches = 0
        self.prefetch_blocks = 0
        self.prefetch_bounded = 0
        self.prefetch_promoted = 0
        self.prefetches_completed = 0
        self.prefetches_cancelled = 0

    def close(self) -> None:
        """Promotions still running publish nothing."""
        self._closed = True

    def reset(self) -> None:
        """The CPU cache was reset: promotions in flight publish nothing."""
        self._epoch += 1
        self._absent.clear()
        self._failed.clear()
        self._landed.clear()

    def forget_absent(self, blocks: Sequence[CpuBlock]) -> None:
        """These blocks were just stored: a later lookup may probe for them again."""
        self._absent.forget(block.block_hash for block in blocks)

    def extend(
        self,
        block_hashes: Sequence[BlockHash],
        end: int,
        limit: int,
        pinned: Sequence[CpuBlock],
        *,
        allow_defer: bool,
        task_group: anyio.abc.TaskGroup,
    ) -> bool:
        """Start a promotion of what follows a CPU hit, in ``task_group`` (see
        `TierManager.extend_lookup()`); ``True``: the lookup should ask again later."""
        self._landed.forget(pinned)
        if end >= limit:
            return False
        first = block_hashes[end]
        job = self._jobs.get(first)
        if (
            job is None
            and first not in self._ledger.pending
            and first not in self._absent
            and any(t.healthy for t in self._tiers)
        ):
            job = _Promotion(
                hashes=tuple(block_hashes[end : min(limit, end + _PROMOTION_MAX_BLOCKS)]),
                protect=tuple(pinned),
                epoch=self._epoch,
            )
            for block_hash in job.hashes:
                self._jobs.setdefault(block_hash, job)
            self.promotions += 1
            self.in_flight += 1
            task_group.start_soon(self._promote, job)
        if job is not None and allow_defer:
            self.deferred_lookups += 1
            return True
        return False

    async def prefetch(
        self, block_hashes: Sequence[BlockHash], protect: Sequence[CpuBlock] = ()
    ) -> int:
        """Promote what follows the CPU pool's leading run of ``block_hashes`` from the
        tiers, in the caller's task; return how many leading blocks are in the CPU pool
        on return.

        It allocates like a promotion (free CPU blocks only: never one with a copy in
        flight, never the prefix's cached run nor ``protect``), skips hashes being stored
        or promoted right now, and takes at most what ``max_prefetch_blocks`` leaves to it
        beside the prefetches in flight. Cancellation (at the probe or a read) publishes nothing of
        the read in progress and releases every CPU block it took.
        """
        cached = self._cached_run(block_hashes)
        end = len(cached)
        if (
            end == len(block_hashes)
            or self._closed
            or self._jobs.get(block_hashes[end]) is not None
            or not any(t.healthy for t in self._tiers)
        ):
            return end
        job = _Promotion(
            hashes=tuple(block_hashes[end : end + _PROMOTION_MAX_BLOCKS]),
            protect=(*protect, *cached),
            epoch=self._epoch,
            prefetch=True,
        )
        for block_hash in job.hashes:
            self._jobs.setdefault(block_hash, job)
        self.prefetches += 1
        self.in_flight += 1
        try:
            await self._promote(job)
        except anyio.get_cancelled_exc_class():
            self.prefetches_cancelled += 1
            raise
        self.prefetches_completed += 1
        return len(self._cached_run(block_hashes))

    def prefetch_cached(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``block_hashes`` are in the CPU pool now."""
        return len(self._cached_run(block_hashes))

    def _cached_run(self, block_hashes: Sequence[BlockHash]) -> list[CpuBlock]:
        get = self._pool.get_cached
        run: list[CpuBlock] = []
        for block_hash in block_hashes:
            block = get(block_hash)
            if block is None:
                break
            run.append(block)
        return run

    def hit_sources(self, pinned: Sequence[CpuBlock]) -> dict[str, int] | None:
        """See `TierManager.hit_sources()`."""
        return self._landed.sources(pinned)

    def is_promoting(self, block_hash: BlockHash) -> bool:
        """Whether a promotion covering ``block_hash`` is in flight."""
        return block_hash in self._jobs

    def miss_reason(self, block_hash: BlockHash) -> MissReason | None:
        """See `TierManager.miss_reason()`."""
        if block_hash in self._jobs:
            return MissReason.IN_FLIGHT
        if block_hash in self._failed or not any(t.healthy for t in self._tiers):
            return MissReason.TIER_FAILED
        return None

    def _note_failed(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            self._failed.add(block_hash)

    async def _promote(self, job: _Promotion) -> None:
        opened: list[Promotion] = []
        try:
            await self._promote_job(job, opened)
        except Exception as exc:  # never let a bug here end the offloader's task group
            self.errors += 1
            _log.error("promotion_failed", error=repr(exc), blocks=len(job.hashes))
        finally:
            for block_hash in job.hashes:
                if self._jobs.get(block_hash) is job:
                    del self._jobs[block_hash]
            self.in_flight -= 1
            if opened:  # cancelled or failed while reading: publish nothing
                self._close(job, opened.pop(), None)

    async def _promote_job(self, job: _Promotion, opened: list[Promotion]) -> None:
        """Probe, open a promotion in the ledger (``opened`` holds it while the read runs;
        the caller closes it if this ends early), read, verify, close it (publish)."""
        sources = await self._probe(job.hashes)
        run = sources[-1][2] if sources else 0
        if run < len(job.hashes) and self._pool.get_cached(job.hashes[run]) is None:
            # Where the next lookup's run will stop; not a block stored while the probe
            # ran (its write-down may not have reached the tier yet).
            self._absent.add(job.hashes[run])
        if run == 0:
            return
        if job.epoch != self._epoch or self._closed:
            return
        promotion = self._open(job, run)
        if promotion is None or not promotion.blocks:
            return
        opened.append(promotion)
        ok = await self._read_into(sources, promotion.wanted, promotion.blocks)
        opened.pop()
        current = job.epoch == self._epoch and not self._closed
        published = self._close(job, promotion, ok if current else None)
        for (i, block_hash), block, done in zip(
            promotion.wanted, promotion.blocks, published, strict=True
        ):
            if done:
                tier = self._tier_of(sources, i)
                self._landed.add(block_hash, block, tier.tier.name)
                tier.promoted += 1
                if job.prefetch:
                    self.prefetch_promoted += 1

    def _close(self, job: _Promotion, promotion: Promotion, ok: list[bool] | None) -> list[bool]:
        if job.prefetch:
            self.prefetch_blocks -= len(promotion.blocks)
        return self._ledger.close_promotion(promotion, ok)

    @staticmethod
    def _tier_of(sources: list[tuple[TierState, int, int]], i: int) -> TierState:
        for t, lo, hi in sources:
            if lo <= i < hi:
                return t
        raise IndexError(i)  # pragma: no cover - wanted blocks all lie in a source

    async def _probe(self, hashes: tuple[BlockHash, ...]) -> list[tuple[TierState, int, int]]:
        """Find, tier by tier, the leading run of ``hashes`` the tiers hold together."""
        return await probe(self._tiers, self._health, hashes, on_failed=self._note_failed)

    def _open(self, job: _Promotion, run: int) -> Promotion | None:
        """Open a promotion of the part of the run neither cached nor being filled (a
        store or another promotion in flight), in free CPU blocks only: never a
        referenced block, the prefix being extended or a block just promoted."""
        ledger = self._ledger
        wanted = ledger.promotable(list(enumerate(job.hashes[:run])))
        if not wanted:
            return None
        if job.prefetch:
            room = self.max_prefetch_blocks - self.prefetch_blocks
            if room < len(wanted):
                self.prefetch_bounded += 1
                if room <= 0:
                    return None
                wanted = wanted[:room]
        protect = {b for b in job.protect if b.block_hash is not None}
        protect.update(self._landed.still_published())
        promotion = ledger.open_promotion(wanted, protect)
        if promotion is None:
            self.no_space += 1
            _log.debug("promotion_deferred", blocks=len(wanted), free=self._pool.num_free)
        elif job.prefetch:
            self.prefetch_blocks += len(promotion.blocks)
        return promotion

    async def _read_into(
        self,
        sources: list[tuple[TierState, int, int]],
        wanted: list[tuple[int, BlockHash]],
        blocks: list[CpuBlock],
    ) -> list[bool]:
        ok = [False] * len(wanted)
        for t, lo, hi in sources:
            picks = [j for j, (i, _) in enumerate(wanted) if lo <= i < hi]
            for at in range(0, len(picks), t.max_batch):
                chunk = picks[at : at + t.max_batch]
                if not t.healthy:
                    break
                hashes = [wanted[j][1] for j in chunk]
                views = [self._block_view(blocks[j].block_id) for j in chunk]
                for j, good in zip(chunk, await self._read_chunk(t, hashes, views), strict=True):
                    ok[j] = good
        return ok

    async def _read_chunk(
        self, t: TierState, hashes: list[BlockHash], views: list[memoryview]
    ) -> list[bool]:
        return await read_verified(
            t,
            self._health,
            hashes,
            views,
            namespace=self._namespace,
            nbytes=self._nbytes,
            on_failed=self._note_failed,
        )
