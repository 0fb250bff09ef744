"""Statistics of the tiers: `TierStatistics` per tier and `TierManagerStatistics`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TierManagerStatistics", "TierStatistics"]


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """Counters of one tier, as the manager saw it.

    Each entry is also the help text of the tier's metric (`kvoffload.metrics`).

    Attributes:
        name: the tier's name.
        kind: ``"disk"``, ``"redis"`` or the class name of a custom tier.
        healthy: whether the tier is in use now (read from, at least); false while it is
            unhealthy.
        writable: whether write-downs go to the tier now; false while it is unhealthy, or
            healthy but unable to write (a full disk): it then still serves reads.
        blocks_written: blocks the tier reported stored.
        bytes_written: payload bytes of the blocks the tier reported stored.
        writes_skipped_full: write-downs skipped because the tier's queue was full
            (back-pressure).
        writes_skipped_unhealthy: write-downs skipped (or dropped from the queue) because
            the tier was unhealthy or could not write.
        writes_failed: blocks of write operations that failed.
        writes_dropped: blocks a write operation returned without storing, though it did
            not fail: a Redis Cluster node whose breaker was open or that was still busy
            when the write budget ran out, a disk tier with every slot being read. Each
            such block is absent from the tier, never half there.
        writes_held: write-downs queued or running now (each holds a CPU block).
        max_writes_held: the most write-downs ever held at once (never above
            ``max_queued_writes``).
        blocks_read: blocks read from the tier and verified.
        bytes_read: payload bytes of the blocks read from the tier and verified.
        blocks_promoted: verified blocks published into the CPU pool.
        read_misses: blocks the probe found but the read did not (evicted meanwhile).
        failed_checks: blocks that failed verification (never published; deleted from
            the tier).
        errors: tier operations that failed (each marks the tier unhealthy, or read-only
            when only writes fail).
        unhealthy_events: times the tier went from healthy to unhealthy, or from writable
            to read-only.
        recoveries: times the tier came back after being unhealthy or read-only.
        write_seconds: time spent in the tier's write operations.
        read_seconds: time spent in the tier's read operations.
        last_error: the last error's message ("" if none).
        details: the tier's own figures (slots, I/O counts ...), from
            `SecondaryTier.statistics()`.
    """

    name: str
    kind: str
    healthy: bool
    writable: bool
    blocks_written: int
    bytes_written: int
    writes_skipped_full: int
    writes_skipped_unhealthy: int
    writes_failed: int
    writes_dropped: int
    writes_held: int
    max_writes_held: int
    blocks_read: int
    bytes_read: int
    blocks_promoted: int
    read_misses: int
    failed_checks: int
    errors: int
    unhealthy_events: int
    recoveries: int
    write_seconds: float
    read_seconds: float
    last_error: str
    details: Mapping[str, int | float | str | bool]


@dataclass(frozen=True, slots=True)
class TierManagerStatistics:
    """Counters of a `TierManager`.

    Each entry is also the help text of the manager's metric (`kvoffload.metrics`).

    Attributes:
        tiers: one entry per tier, in order.
        promotions: promotions from the tiers started by lookups.
        promotions_no_space: promotions that found blocks in a tier but no free CPU block.
        deferred_lookups: lookups answered ``None`` ("ask again") because a promotion was
            in flight.
        promotion_errors: promotions ended by an unexpected error (logged; nothing
            published).
        promotions_in_flight: promotions running now.
        refs_held: CPU block references the tier manager holds now.
        prefetches: prefetches started (``off.hints.prefetch()`` calls that asked a tier).
        prefetches_completed: prefetches that ran to their end, whatever they found.
        prefetches_cancelled: prefetches cancelled while they ran (nothing of the read
            in progress published, every CPU block they took released).
        prefetch_blocks_promoted: blocks prefetches brought from a tier into the CPU pool.
        prefetches_bounded: prefetches that took fewer blocks than they wanted (or none)
            because prefetches in flight held their share of the pool
            (``max_prefetch_fraction``).
    """

    tiers: tuple[TierStatistics, ...]
    promotions: int
    promotions_no_space: int
    deferred_lookups: int
    promotion_errors: int
    promotions_in_flight: int
    refs_held: int
    prefetches: int = 0
    prefetches_completed: int = 0
    prefetches_cancelled: int = 0
    prefetch_blocks_promoted: int = 0
    prefetches_bounded: int = 0
