"""Statistics of the tiers: `TierStatistics` per tier and `TierManagerStatistics`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TierManagerStatistics", "TierStatistics"]


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """Counters of one tier, as the manager saw it.

    Attributes:
        name: the tier's name.
        kind: ``"disk"``, ``"redis"`` or the class name of a custom tier.
        healthy: whether the tier is in use now (read from, at least).
        writable: whether write-downs go to it now; ``False`` while it is unhealthy, or
            healthy but unable to write (a full disk): it then still serves reads.
        blocks_written: blocks the tier reported stored.
        bytes_written: their payload bytes.
        writes_skipped_full: write-downs skipped because the queue was full (back-pressure).
        writes_skipped_unhealthy: write-downs skipped (or dropped from the queue) because
            the tier was unhealthy or could not write.
        writes_failed: blocks of write operations that failed.
        writes_held: write-downs queued or running now (each holds a CPU block).
        max_writes_held: the most ever held at once (never above ``max_queued_writes``).
        blocks_read: blocks read and verified.
        bytes_read: their payload bytes.
        blocks_promoted: of those, blocks published into the CPU pool.
        read_misses: blocks the probe found but the read did not (evicted meanwhile).
        failed_checks: blocks that failed verification (deleted from the tier).
        errors: operations that failed (each also marks the tier unhealthy, or
            read-only when only writes fail).
        unhealthy_events: times the tier went from healthy to unhealthy, or from writable
            to read-only.
        recoveries: times it came back.
        write_seconds: total time of write operations.
        read_seconds: total time of read operations.
        last_error: the last error's message ("" if none).
        details: the tier's own figures (`SecondaryTier.statistics()`).
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

    Attributes:
        tiers: one entry per tier, in order.
        promotions: promotion jobs started by lookups.
        promotions_no_space: promotions that found blocks but no free CPU block.
        deferred_lookups: lookups answered ``None`` because a promotion was in flight.
        promotion_errors: promotions ended by an unexpected error (logged; nothing published).
        promotions_in_flight: promotion jobs running now.
        refs_held: CPU block references the manager holds now.
    """

    tiers: tuple[TierStatistics, ...]
    promotions: int
    promotions_no_space: int
    deferred_lookups: int
    promotion_errors: int
    promotions_in_flight: int
    refs_held: int
