"""`TierManager`: cascades stored CPU blocks down to the tiers and promotes them back.

Decisions are synchronous and made on the event loop thread, like the scheduler's: which
blocks to write down (and which to skip because a tier's queue is full or the tier is
unhealthy), which lookups start a promotion, which CPU blocks a promotion may take. Bytes
move in tasks of the manager's own task group: one or more writers and one health loop per
tier, and one task per promotion.

The manager is the façade over three parts, each with its rules (DESIGN.md's invariants
extended to tiers):

* `kvoffload.tiers.health` (`TierHealth`, `TierState`, `PriorityGate`): a tier error marks
  the tier unhealthy or read-only and it is pinged with backoff until it answers; reads
  (promotions) take precedence over write-downs. No tier error reaches the engine's step
  loop.
* `kvoffload.tiers.cascade` (`Cascade`): write-downs of stored blocks through bounded
  per-tier queues, each queued block holding a reference.
* `kvoffload.tiers.promote` (`Promoter`): probe, read, verify and publish.

CPU blocks are taken, published and released only through the scheduler's `BlockLedger`.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, final

import anyio
import anyio.abc

from kvoffload._logging import get_logger
from kvoffload.errors import InvariantError
from kvoffload.hashing import BlockHash
from kvoffload.pool.priority import default_max_retained
from kvoffload.scheduler.misses import MissReason
from kvoffload.tier_config import AnyTierSettings
from kvoffload.tiers.base import SecondaryTier
from kvoffload.tiers.cascade import Cascade
from kvoffload.tiers.health import TierHealth, TierState
from kvoffload.tiers.promote import Promoter, tiers_defer_deadline_s
from kvoffload.tiers.stats import TierManagerStatistics

if TYPE_CHECKING:
    from kvoffload.pool.block_pool import CpuBlockPool
    from kvoffload.pool.free_queue import CpuBlock
    from kvoffload.scheduler.group_promote import GroupTierPart
    from kvoffload.scheduler.ledger import BlockLedger
    from kvoffload.storage.host_buffer import HostKVBuffer
    from kvoffload.transfer.plan import StorePlan

__all__ = ["TierManager", "TierScheduler"]

_log = get_logger("tiers")


class TierScheduler(Protocol):
    """What a `TierManager` needs of the scheduler above it: the ledger and pool of one
    CPU pool, and the lookup hook (an `OffloadScheduler`, or one group of a
    `GroupedScheduler`, see `kvoffload.tiers.groups`)."""

    @property
    def ledger(self) -> BlockLedger:
        """The one owner of the pool's references."""
        ...

    @property
    def pool(self) -> CpuBlockPool:
        """The CPU block pool the tiers write down from and promote into."""
        ...

    def set_lookup_extension(self, extension: GroupTierPart | None) -> None:
        """Install the hook its lookups ask after every CPU hit."""
        ...


@final
class TierManager:
    """Moves blocks between the CPU pool and the secondary tiers.

    Built and driven by `KVOffloader` when ``OffloadConfig.tiers`` is set; tests may build
    one directly around their own tiers.

    Args:
        tiers: ``(tier, settings)`` pairs, in lookup order (fastest first).
        scheduler: the offloader's scheduler (or one group's part of it, `TierScheduler`):
            CPU blocks are taken and published through its ledger, and its lookups ask
            `extend_lookup()` (the manager installs itself).
        host: the host buffer whose blocks are read and written.
        namespace: the 32-byte namespace digest written into every block header.
        max_prefetch_fraction: the share of the CPU pool `prefetch()` calls in flight may
            take together (``OffloadConfig.max_prefetch_fraction``).

    Call `run()` through ``task_group.start`` and `aclose()` before the host buffer is
    freed. The synchronous methods must be called on the event loop thread.
    """

    def __init__(
        self,
        tiers: Sequence[tuple[SecondaryTier, AnyTierSettings]],
        *,
        scheduler: TierScheduler,
        host: HostKVBuffer,
        namespace: bytes,
        max_prefetch_fraction: float = 0.25,
    ) -> None:
        self._scheduler = scheduler
        self._ledger = scheduler.ledger
        self._pool: CpuBlockPool = scheduler.pool
        self._namespace = namespace
        self._nbytes = host.layout.bytes_per_block
        raw = host.raw
        buffer = (ctypes.c_ubyte * (raw.numel() * raw.element_size())).from_address(raw.data_ptr())
        self._host = host  # keeps the memory the view below points at alive
        self._memory = memoryview(buffer).cast("B")
        self._tiers = [TierState.from_settings(tier, s) for tier, s in tiers]
        # A lookup may wait for a promotion as long as one may take: a probe and its
        # reads, each within the tier's own bound (a cluster tier's lookup_budget_ms,
        # any other tier's op_timeout_s).
        self._defer_deadline = tiers_defer_deadline_s([s for _, s in tiers])
        self._health = TierHealth(self._ledger)
        self._cascade = Cascade(
            self._tiers,
            ledger=self._ledger,
            pool=self._pool,
            health=self._health,
            namespace=namespace,
            nbytes=self._nbytes,
            block_view=self.block_view,
        )
        self._promoter = Promoter(
            self._tiers,
            ledger=self._ledger,
            pool=self._pool,
            health=self._health,
            namespace=namespace,
            nbytes=self._nbytes,
            block_view=self.block_view,
            max_prefetch_blocks=default_max_retained(self._pool.num_blocks, max_prefetch_fraction),
        )
        self._task_group: anyio.abc.TaskGroup | None = None
        self._stopped = anyio.Event()
        self._closing = False
        scheduler.set_lookup_extension(self)

    def __repr__(self) -> str:
        names = ",".join(t.tier.name for t in self._tiers)
        return f"TierManager(tiers=[{names}], refs={sum(self._ledger.tier_refs().values())})"

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        """The tiers, in lookup order."""
        return tuple(t.tier for t in self._tiers)

    def block_view(self, block_id: int) -> memoryview:
        """The bytes of CPU block ``block_id`` (no copy)."""
        n = self._nbytes
        return self._memory[block_id * n : (block_id + 1) * n]

    # -- references ------------------------------------------------------------------------

    def held_refs(self) -> Mapping[int, int]:
        """CPU block id → references the tiers hold (write-downs and promotions; the
        scheduler's ledger keeps them)."""
        return self._ledger.tier_refs()

    # -- lifecycle -------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Open the tiers and run the writers and health loops until `aclose()`.

        A tier that cannot be opened starts unhealthy and is retried with backoff.
        """
        health = self._health
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                for t in self._tiers:
                    try:
                        with anyio.fail_after(t.timeout_s):
                            await t.tier.open()
                    except Exception as exc:
                        health.fault(t, exc, "open")
                    else:
                        t.opened = t.healthy = True
                    tg.start_soon(health.watch, t)
                    for _ in range(max(1, t.gate.limit - 1)):
                        tg.start_soon(self._cascade.writer, t)
                task_status.started()
        finally:
            self._task_group = None
            with anyio.CancelScope(shield=True):
                self._cascade.drop_all()
                for t in self._tiers:
                    try:
                        await t.tier.close()
                    except Exception as exc:
                        _log.warning("tier_close_failed", tier=t.tier.name, error=repr(exc))
            self._stopped.set()

    async def aclose(self) -> None:
        """Stop: drop queued write-downs, end running operations, close the tiers.

        Shielded; safe to call more than once. References the manager held are all
        released on return.
        """
        self._closing = True
        self._promoter.close()
        self._cascade.drop_all()
        tg = self._task_group
        if tg is not None:
            tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._stopped.wait()

    def reset(self) -> None:
        """The CPU cache was reset: promotions in flight publish nothing."""
        self._promoter.reset()

    # -- cascade on store -------------------------------------------------------------------

    def on_stored(self, plan: StorePlan) -> None:
        """A CPU store completed: queue its newly published blocks for every tier.

        Each queued block takes a reference. A full queue or an unhealthy tier skips the
        block for that tier (counted); nothing waits.
        """
        if self._closing or not self._tiers:
            return
        blocks = self._cascade.enqueue(plan)
        if blocks:
            self._promoter.forget_absent(blocks)

    # -- promotion on lookup ----------------------------------------------------------------

    def extend_lookup(
        self,
        block_hashes: Sequence[BlockHash],
        end: int,
        limit: int,
        pinned: Sequence[CpuBlock],
        *,
        allow_defer: bool,
    ) -> bool:
        """Extend a CPU lookup with the tiers: start a promotion of what follows the hit
        (the scheduler's lookups call this, see `LookupExtension`).

        Args:
            block_hashes: the lookup's block hashes.
            end: index of the first block after the CPU hit.
            limit: the blocks ``block_hashes[:limit]`` may be loaded.
            pinned: the hit's CPU blocks (pinned; a promotion does not evict them).
            allow_defer: ask the caller to come back later while a promotion of the
                block after the hit is in flight.

        Returns:
            ``True`` when the lookup should answer "ask again later".
        """
        tg = self._task_group
        if not self._tiers or tg is None or self._closing:
            return False
        return self._promoter.extend(
            block_hashes, end, limit, pinned, allow_defer=allow_defer, task_group=tg
        )

    # -- prefetch -----------------------------------------------------------------------------

    async def prefetch(
        self, block_hashes: Sequence[BlockHash], protect: Sequence[CpuBlock] = ()
    ) -> int:
        """Promote a prefix from the tiers into the CPU pool ahead of the lookup that will
        need it (`SessionHints.prefetch()`); return how many of its leading blocks are in
        the CPU pool on return.

        Runs in the caller's task. CPU blocks are taken like a promotion's (free blocks
        only: never one with a copy in flight, nor the prefix's cached run, nor
        ``protect``: with several groups, the hit being extended); all
        prefetches in flight together take at most `max_prefetch_blocks`, and a prefetch
        past that bound promotes the part that fits. Hashes being stored or promoted now
        are left to that copy. Cancellation publishes nothing of the read in progress
        and releases every CPU block it took (blocks published before stay).
        """
        if not self._tiers or self._task_group is None or self._closing:
            return self._promoter.prefetch_cached(block_hashes)
        return await self._promoter.prefetch(block_hashes, protect)

    @property
    def max_prefetch_blocks(self) -> int:
        """The most CPU blocks prefetches in flight take together
        (``max_prefetch_fraction`` of the pool, rounded down, at most the pool less one)."""
        return self._promoter.max_prefetch_blocks

    @property
    def prefetch_blocks(self) -> int:
        """CPU blocks prefetches in flight hold now."""
        return self._promoter.prefetch_blocks

    @property
    def defer_deadline_s(self) -> float:
        """The longest a request's lookups answer "ask again" in a row while a promotion
        runs: the longest a promotion from one of the tiers may take (its probe and its
        reads of ``max_batch_blocks``, each within the tier's lookup budget: a cluster
        tier's ``lookup_budget_ms``, another tier's ``op_timeout_s``); the scheduler
        bounds every run of deferrals by it (see `LookupExtension`)."""
        return self._defer_deadline

    def is_promoting(self, block_hash: BlockHash) -> bool:
        """Whether a promotion covering ``block_hash`` is in flight."""
        return self._promoter.is_promoting(block_hash)

    def lookup_deferred(self) -> None:
        """A lookup whose "ask again" was decided above the manager (a grouped lookup,
        `kvoffload.tiers.groups.GroupPromotions`) waited for a promotion of these tiers:
        counted in ``deferred_lookups``, where `extend_lookup()` counts one group's."""
        self._promoter.deferred_lookups += 1

    def hit_sources(self, pinned: Sequence[CpuBlock]) -> dict[str, int] | None:
        """Of a lookup's CPU hit ``pinned``, how many blocks each tier (by name) promoted
        into the pool since a lookup last pinned them (see `LookupExtension`); ``None``
        when none was: the whole hit was in the CPU pool."""
        if not self._tiers:
            return None
        return self._promoter.hit_sources(pinned)

    def miss_reason(self, block_hash: BlockHash) -> MissReason | None:
        """Why the tiers did not bring ``block_hash`` in (see `LookupExtension`):
        ``IN_FLIGHT`` while its promotion runs, ``TIER_FAILED`` when a recent read of it
        timed out, raised or failed its check, or no tier is healthy; else ``None``."""
        if not self._tiers:
            return None
        return self._promoter.miss_reason(block_hash)

    # -- observation -------------------------------------------------------------------------

    def statistics(self) -> TierManagerStatistics:
        """A snapshot of every tier's counters and the promotion counters."""
        promoter = self._promoter
        return TierManagerStatistics(
            tiers=tuple(t.snapshot() for t in self._tiers),
            promotions=promoter.promotions,
            promotions_no_space=promoter.no_space,
            deferred_lookups=promoter.deferred_lookups,
            promotion_errors=promoter.errors,
            promotions_in_flight=promoter.in_flight,
            refs_held=sum(self._ledger.tier_refs().values()),
            prefetches=promoter.prefetches,
            prefetches_completed=promoter.prefetches_completed,
            prefetches_cancelled=promoter.prefetches_cancelled,
            prefetch_blocks_promoted=promoter.prefetch_promoted,
            prefetches_bounded=promoter.prefetch_bounded,
        )

    def check_invariants(self) -> None:
        """Check the manager's own bookkeeping (queues within bounds, refs consistent).

        Raises:
            InvariantError: naming the breach.
        """
        queued: Counter[int] = Counter()
        for t in self._tiers:
            if t.held > t.max_queued or t.held < len(t.queue):
                raise InvariantError(
                    f"tier {t.tier.name!r}: {t.held} write-downs held, {len(t.queue)} queued, "
                    f"bound {t.max_queued}"
                )
            for block in t.queue:
                queued[block.block_id] += 1
        refs = self._ledger.tier_refs()
        promoter = self._promoter
        if not 0 <= promoter.prefetch_blocks <= promoter.max_prefetch_blocks:
            raise InvariantError(
                f"prefetches hold {promoter.prefetch_blocks} CPU blocks, bound "
                f"{promoter.max_prefetch_blocks}"
            )
        for block_id, n in queued.items():
            if refs.get(block_id, 0) < n:
                raise InvariantError(f"queued block {block_id} holds fewer refs than queued")
        for block_id, n in refs.items():
            if n < 1 or self._pool.block(block_id).ref_cnt < n:
                raise InvariantError(
                    f"tier manager holds {n} refs on block {block_id} with ref_cnt "
                    f"{self._pool.block(block_id).ref_cnt}"
                )
