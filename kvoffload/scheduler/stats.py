"""`SchedulerStatistics`, and the counters the scheduler's parts add to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload.scheduler.misses import MissReason

if TYPE_CHECKING:
    from kvoffload.scheduler.ledger import PlanEntry

__all__ = ["SchedulerStatistics"]


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """Counters of an `OffloadScheduler` since it was made.

    Attributes:
        lookups: calls to ``lookup``.
        hit_tokens: tokens those lookups offered from CPU (counted at every lookup: a
            request looked up again, after a release or a deferral, counts again); what
            was used is ``loaded_tokens``.
        miss_tokens: prompt tokens past the engine's own prefix that were not found.
        deferred_lookups: lookups answered "ask again" because the next block was in flight.
        store_plans: store plans made.
        stored_blocks: blocks whose store completed and were published.
        deferred_blocks: blocks that a ``plan_stores`` call could not allocate (counted per call).
        deferred_steps: ``plan_stores`` calls that deferred anything.
        evicted_while_live: CPU blocks evicted while a live request's cursor was past them.
        restored_blocks: such blocks stored again (``restore_evicted=True``).
        load_plans: load plans made.
        loaded_blocks: blocks whose load completed.
        failed_stores: store transfers that failed (nothing published).
        failed_loads: load transfers that failed (their CPU blocks were unpublished).
        abandoned_transfers: transfers that completed after a ``reset``, or after their
            load was abandoned (nothing published, nothing counted as loaded).
        ignored_completions: completions of unknown or already completed plans.
        bytes_stored: bytes of completed stores.
        bytes_loaded: bytes of completed loads.
        live_requests: requests the scheduler holds state for.
        in_flight_transfers: plans not yet completed.
        concurrent_load_blocks: blocks planned for a load while another load of the same
            CPU block was in flight (the lookup had no ``allow_defer``).
        cancelled_plans: plans undone because their launch raised (`cancel()`).
        held_blocks: GPU blocks finished requests hold now (``hold_blocks_on_finish``).
        hold_expired_blocks: held GPU blocks given up unstored after ``hold_max_steps``.
        loaded_tokens: tokens whose load completed successfully (tokens the offload tiers
            served); ``loaded_tokens / prompt_tokens`` is the prefix hit rate.
        prompt_tokens: tokens of the requests looked up, counted once per admission (at
            a request's first lookup, and again at its first lookup after a preemption),
            the engine's own prefix included.
        abandoned_loads: loads their request abandoned while the copy was in flight
            (``abandon_load``); the engine recomputed those tokens.
        deferrals_bounded: lookups that answered with the CPU hit instead of "ask
            again" because their request had been answered "ask again"
            ``MAX_LOOKUP_DEFERRALS`` times in a row, or for longer than the deferral
            deadline (a promotion or store that does not end in time).
        lookup_misses: lookups that missed tokens, by `MissReason` (the reason of each
            lookup's stop; ``none`` is never counted): docs/misses.md.
        miss_reason_tokens: ``miss_tokens`` by the `MissReason` of the lookup that
            missed them (the values add up to ``miss_tokens``).
    """

    lookups: int
    hit_tokens: int
    miss_tokens: int
    deferred_lookups: int
    store_plans: int
    stored_blocks: int
    deferred_blocks: int
    deferred_steps: int
    evicted_while_live: int
    restored_blocks: int
    load_plans: int
    loaded_blocks: int
    failed_stores: int
    failed_loads: int
    abandoned_transfers: int
    ignored_completions: int
    bytes_stored: int
    bytes_loaded: int
    live_requests: int
    in_flight_transfers: int
    concurrent_load_blocks: int = 0
    cancelled_plans: int = 0
    held_blocks: int = 0
    hold_expired_blocks: int = 0
    loaded_tokens: int = 0
    prompt_tokens: int = 0
    abandoned_loads: int = 0
    deferrals_bounded: int = 0
    lookup_misses: Mapping[MissReason, int] = field(default_factory=dict)
    miss_reason_tokens: Mapping[MissReason, int] = field(default_factory=dict)


class Counters:
    """The running totals behind `SchedulerStatistics`, shared by the scheduler's parts.

    One attribute per counter of `SchedulerStatistics` (not the gauges: those are read
    from their owners when a snapshot is taken); each part adds to its own.
    """

    __slots__ = (
        "_block_size",
        "abandoned_loads",
        "abandoned_transfers",
        "bytes_loaded",
        "bytes_per_block",
        "bytes_stored",
        "cancelled_plans",
        "concurrent_load_blocks",
        "deferrals_bounded",
        "deferred_blocks",
        "deferred_lookups",
        "deferred_steps",
        "evicted_while_live",
        "failed_loads",
        "failed_stores",
        "hit_tokens",
        "hold_expired_blocks",
        "ignored_completions",
        "load_plans",
        "loaded_blocks",
        "loaded_tokens",
        "lookup_misses",
        "lookups",
        "miss_reason_tokens",
        "miss_tokens",
        "prompt_tokens",
        "restored_blocks",
        "store_plans",
        "stored_blocks",
    )

    def __init__(self, block_size: int, bytes_per_block: int) -> None:
        self._block_size = block_size
        self.bytes_per_block = bytes_per_block
        """Bytes each stored or loaded block counts in ``bytes_*`` (0: bytes not counted)."""
        self.lookups = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.deferred_lookups = 0
        self.store_plans = 0
        self.stored_blocks = 0
        self.deferred_blocks = 0
        self.deferred_steps = 0
        self.evicted_while_live = 0
        self.restored_blocks = 0
        self.load_plans = 0
        self.loaded_blocks = 0
        self.failed_stores = 0
        self.failed_loads = 0
        self.abandoned_transfers = 0
        self.ignored_completions = 0
        self.bytes_stored = 0
        self.bytes_loaded = 0
        self.concurrent_load_blocks = 0
        self.cancelled_plans = 0
        self.hold_expired_blocks = 0
        self.loaded_tokens = 0
        self.prompt_tokens = 0
        self.abandoned_loads = 0
        self.deferrals_bounded = 0
        self.lookup_misses: dict[MissReason, int] = {}
        self.miss_reason_tokens: dict[MissReason, int] = {}

    def missed(self, reason: MissReason, tokens: int) -> None:
        """Count a lookup that missed ``tokens`` for ``reason``."""
        add_miss(self.lookup_misses, self.miss_reason_tokens, reason, tokens)

    def completed(self, rec: PlanEntry, *, ok: bool, current: bool) -> None:
        """Count a plan the ledger closed (``current``: opened since the last reset)."""
        if not current or rec.abandoned:
            self.abandoned_transfers += 1
            return
        store = rec.plan.kind == "store"
        if not ok:
            if store:
                self.failed_stores += 1
            else:
                self.failed_loads += 1
        elif store:
            self.stored_blocks += rec.published
            self.bytes_stored += rec.published * self.bytes_per_block
        else:
            n = len(rec.blocks)
            self.loaded_blocks += n
            self.loaded_tokens += n * self._block_size
            self.bytes_loaded += n * self.bytes_per_block

    def snapshot(
        self, *, live_requests: int, in_flight_transfers: int, held_blocks: int
    ) -> SchedulerStatistics:
        """The counters now, with the gauges given."""
        return SchedulerStatistics(
            lookups=self.lookups,
            hit_tokens=self.hit_tokens,
            miss_tokens=self.miss_tokens,
            deferred_lookups=self.deferred_lookups,
            store_plans=self.store_plans,
            stored_blocks=self.stored_blocks,
            deferred_blocks=self.deferred_blocks,
            deferred_steps=self.deferred_steps,
            evicted_while_live=self.evicted_while_live,
            restored_blocks=self.restored_blocks,
            load_plans=self.load_plans,
            loaded_blocks=self.loaded_blocks,
            failed_stores=self.failed_stores,
            failed_loads=self.failed_loads,
            abandoned_transfers=self.abandoned_transfers,
            ignored_completions=self.ignored_completions,
            bytes_stored=self.bytes_stored,
            bytes_loaded=self.bytes_loaded,
            concurrent_load_blocks=self.concurrent_load_blocks,
            cancelled_plans=self.cancelled_plans,
            hold_expired_blocks=self.hold_expired_blocks,
            loaded_tokens=self.loaded_tokens,
            prompt_tokens=self.prompt_tokens,
            abandoned_loads=self.abandoned_loads,
            deferrals_bounded=self.deferrals_bounded,
            lookup_misses=dict(self.lookup_misses),
            miss_reason_tokens=dict(self.miss_reason_tokens),
            live_requests=live_requests,
            in_flight_transfers=in_flight_transfers,
            held_blocks=held_blocks,
        )


def add_miss(
    lookups: dict[MissReason, int], tokens: dict[MissReason, int], reason: MissReason, n: int
) -> None:
    """Count one lookup that missed ``n`` tokens for ``reason`` in these two maps."""
    lookups[reason] = lookups.get(reason, 0) + 1
    tokens[reason] = tokens.get(reason, 0) + n
