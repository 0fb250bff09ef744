"""`GroupLookups`: a `GroupedScheduler`'s lookups and the hits they pin, from the lookup
to `release()`; the deferral of a lookup ("ask again") and its bound.

The one owner of a request's lookup pins in every group (``lane.pin``, ``pin_start``),
its hit (``hit``, ``hit_from``), its run of deferrals, the lookup extension (the groups'
tiers) and the clock of the deferral deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import final

from kvoffload.groups import KVCacheGroup
from kvoffload.scheduler.group_flight import LoadsInFlight
from kvoffload.scheduler.group_loads import (
    GroupLookupExtension,
    HitStops,
    find_hit,
    hit_blocks,
    lookup_defers_grouped,
    note_prefix,
    promotions_defer,
)
from kvoffload.scheduler.group_state import (
    GroupCounts,
    GroupedRequest,
    GroupHashes,
    GroupRequests,
    check_hashes,
)
from kvoffload.scheduler.group_totals import GroupCounters
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.loads import check_lookup_counts, run_extend, run_spent
from kvoffload.scheduler.misses import MissReason
from kvoffload.scheduler.requests import as_int

__all__ = ["GroupLookups"]


@final
class GroupLookups:
    """Answers a `GroupedScheduler`'s lookups and owns the pins they leave (`lookup()`,
    `release()`); see `GroupedScheduler.lookup()` for the rule."""

    __slots__ = (
        "_align",
        "_cacheable",
        "_checkpoint",
        "_ledgers",
        "_loads",
        "_stops",
        "_table",
        "clock",
        "deferrals_bounded",
        "extension",
        "totals",
    )

    def __init__(  # noqa: PLR0917 - the scheduler's parts, in its order
        self,
        cacheable: Sequence[KVCacheGroup],
        ledgers: Mapping[str, BlockLedger],
        counts: Mapping[str, GroupCounts],
        table: GroupRequests,
        loads: LoadsInFlight,
        align: int,
        checkpoint: int,
    ) -> None:
        self._cacheable = tuple(cacheable)
        self._ledgers = ledgers
        self._table = table
        self._loads = loads
        self._align = align
        self._checkpoint = checkpoint
        self._stops = HitStops(self._cacheable, ledgers, counts, checkpoint)
        self.extension: GroupLookupExtension | None = None
        """Asked after every lookup (the groups' tiers, `kvoffload.tiers.groups`)."""
        self.clock: Callable[[], float] = time.monotonic
        """The clock of the deferral deadline (a test may drive its own)."""
        self.deferrals_bounded = 0
        """Lookups that answered with the CPU hit instead of "ask again": the request's
        run of those answers reached its bound (`deferral_spent()`)."""
        self.totals = GroupCounters()
        """The whole model's counters: every lookup is counted here, once, whatever the
        number of groups (`GroupCounters.count_lookup()`)."""

    def lookup(  # noqa: PLR0917 - GroupedScheduler.lookup()'s arguments
        self,
        request_id: str,
        block_hashes: GroupHashes,
        num_tokens: int,
        num_computed_tokens: int,
        allow_defer: bool,
        no_read: bool,
    ) -> int | None:
        """`GroupedScheduler.lookup()`, counted in `totals`."""
        num_tokens = as_int(num_tokens, "num_tokens", request_id)
        num_computed_tokens = as_int(num_computed_tokens, "num_computed_tokens", request_id)
        hit = self._answer(
            request_id, block_hashes, num_tokens, num_computed_tokens, allow_defer, no_read
        )
        state = self._table.requests[request_id]
        self.totals.count_lookup(
            hit, num_tokens, num_computed_tokens, state.miss_reason, new_prompt=state.new_prompt
        )
        return hit

    def _answer(  # noqa: PLR0917 - lookup()'s arguments, counts checked as ints
        self,
        request_id: str,
        block_hashes: GroupHashes,
        num_tokens: int,
        num_computed_tokens: int,
        allow_defer: bool,
        no_read: bool,
    ) -> int | None:
        align = self._align
        table = self._table
        check_lookup_counts(request_id, num_tokens, num_computed_tokens, align, table.unit)
        check_hashes(self._cacheable, request_id, None, block_hashes, table.hash_args)
        state = table.state(request_id)
        self.release(request_id)
        note_prefix(self._cacheable, state, num_computed_tokens)
        state.new_prompt, state.admitted = not state.admitted, True
        state.tier_hits = None
        if no_read:
            state.deferrals = 0
            missed = num_tokens > num_computed_tokens
            state.miss_reason = MissReason.NOT_READ if missed else MissReason.NONE
            return 0
        ledgers = self._ledgers
        lanes = {g.name: block_hashes[g.name] for g in self._cacheable}
        pools = {name: ledger.pool for name, ledger in ledgers.items()}
        n = find_hit(
            self._cacheable,
            pools,
            lanes,
            num_tokens,
            computed=num_computed_tokens,
            align=align,
            observe=True,
        )
        hits = hit_blocks(self._cacheable, ledgers, lanes, n, num_computed_tokens)
        extension = self.extension
        deferrals, state.deferrals = state.deferrals, 0
        below = None if extension is None else extension.defer_deadline_s
        if allow_defer and deferrals and run_spent(state, deferrals, self.clock, below):
            allow_defer = False
            self.deferrals_bounded += 1
        if allow_defer and lookup_defers_grouped(
            self._cacheable, ledgers, lanes, hits, n + align, num_tokens, num_computed_tokens
        ):
            self._defer(state, deferrals)
            return None
        for name, (start, pinned) in hits.items():
            ledgers[name].pin(pinned, state.priority)
            state.lanes[name].pin, state.lanes[name].pin_start = pinned, start
            state.hit, state.hit_from = n, num_computed_tokens
        if extension is not None:
            pinned_blocks = {name: blocks for name, (_, blocks) in hits.items()}
            if n > num_computed_tokens:
                state.tier_hits = extension.hit_sources(pinned_blocks)
            extension.extend_grouped_lookup(lanes, n, num_tokens, pinned_blocks)
            if allow_defer and promotions_defer(
                self._cacheable,
                ledgers,
                lanes,
                hits,
                extension,
                n,
                num_tokens,
                num_computed_tokens,
                self._checkpoint,
            ):
                self.release(request_id)
                extension.lookup_deferred()
                self._defer(state, deferrals)
                return None
        state.miss_reason = self._stops.stop(lanes, n, num_tokens, num_computed_tokens, extension)
        return n - num_computed_tokens

    def _defer(self, state: GroupedRequest, deferrals: int) -> None:
        """Answer "ask again": one more in the request's run of them (nothing pinned)."""
        run_extend(state, deferrals, self.clock)
        state.miss_reason = MissReason.IN_FLIGHT

    def release(self, request_id: str) -> None:
        """`GroupedScheduler.release()`."""
        state = self._table.requests.get(request_id)
        if state is None:
            state = self._table.known(request_id)  # raises, as one group's release()
        for name, lane in state.lanes.items():
            if lane.pin is not None:
                self._ledgers[name].unpin(lane.pin)
                lane.pin = None
        state.hit = None
        self._loads.released(request_id)
