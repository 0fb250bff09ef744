"""The store planning of `GroupedScheduler`: per group, which blocks of which store
points to copy, deferral when a group's pool is full or its step limit is reached, the
admission filter, and the records that undo a plan."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeAlias, final

from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError, InputTypeError, InvalidInputError, InvariantError
from kvoffload.groups import KVCacheGroup, needed, store_points
from kvoffload.hashing import BlockHash
from kvoffload.pool.policies.admission import AdmissionFilter, AlwaysAdmit, make_admission
from kvoffload.scheduler._counts import count_down, count_up
from kvoffload.scheduler.group_state import (
    GroupCounts,
    GroupedPlan,
    GroupedRequest,
    InputNames,
    Lane,
    LiveCopy,
    StoreRecord,
    live_blocks,
    live_mark,
)
from kvoffload.scheduler.holds import HeldBlocks
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.requests import PriorityCount
from kvoffload.scheduler.stats import Counters
from kvoffload.scheduler.stores import GpuCacheView, Run, StoreBatch, run_offer, scan_lazy
from kvoffload.transfer.plan import TransferPlan

__all__ = [
    "LAZY_BY_KIND",
    "CacheViews",
    "GroupStorePlanner",
    "check_store_limit",
    "lazy_refusal",
    "point_blocks",
]

CacheViews: TypeAlias = "Mapping[str, GpuCacheView] | GpuCacheView"
"""What a lazy ``plan_stores()`` takes with several groups: one `GpuCacheView` per group
name (a single view is refused: `GroupStorePlanner.plan_lazy()`)."""

_LAZY_SPLITS = (
    "; storing them eagerly at their store points instead would split a prefix over two "
    "times, and a hit needs every group's blocks of it: until the full groups' blocks are "
    "evicted and stored, neither the engine's cache nor the CPU pool would hold the whole "
    "prefix"
)
LAZY_BY_KIND = {
    "sliding_window": "a lazy store copies a block only when the engine is about to evict "
    "it, and the engine drops this group's blocks as the window slides, not in an eviction "
    "order (a window's block alone gives no hit)" + _LAZY_SPLITS,
    "chunked": "a lazy store copies a block only when the engine is about to evict it, and "
    "the engine drops this group's blocks as each chunk ends, not in an eviction order (a "
    "chunk's block alone gives no hit)" + _LAZY_SPLITS,
    "recurrent": "its state is one snapshot per checkpoint, overwritten in place as the "
    "request runs: there is no eviction order of its blocks to walk" + _LAZY_SPLITS,
}
"""Why a lazy store (``store_mode="lazy"``) cannot serve each kind of group but a full
one (full-attention groups store lazily, each from its own eviction order)."""


def lazy_refusal(groups: Sequence[KVCacheGroup]) -> str:
    """Why ``store_mode="lazy"`` is refused for these groups, group by group (``""``:
    every cacheable group is full attention, lazy stores work)."""
    return "; ".join(
        f"group {g.name!r} ({g.kind}): {LAZY_BY_KIND[g.kind]}"
        for g in groups
        if g.kind in LAZY_BY_KIND
    )


def point_blocks(g: KVCacheGroup, align: int) -> int:
    """The most blocks one store point of ``g`` needs (a point is a multiple of ``align``,
    `needed()` there): one for a full or recurrent group, the window's blocks for a
    sliding window, and for chunked attention the most blocks a point reaches above its
    chunk's start."""
    if g.kind == "sliding_window" and g.window is not None:
        return -(-(g.window - 1) // g.block_size)
    if g.kind == "chunked" and g.chunk is not None:
        return (g.chunk - math.gcd(g.chunk, align)) // g.block_size
    return 1


def check_store_limit(groups: Sequence[KVCacheGroup], limit: int, align: int) -> None:
    """Refuse a ``max_store_blocks_per_step`` below what one store point of a group needs:
    a point is planned whole or deferred, so such a point would be deferred forever.

    Raises:
        ConfigError: naming the setting, the group, its kind and the blocks needed.
    """
    for g in groups:
        need = point_blocks(g, align)
        if need > limit:
            raise ConfigError(
                f"max_store_blocks_per_step={limit!r}: group {g.name!r} ({g.kind}) needs "
                f"{need} blocks for one store point, planned whole in one step (a point is "
                f"stored whole or deferred), so it could never be stored; set it to at "
                f"least {need}"
            )


def note_full_deferral(g: KVCacheGroup, states: Iterable[GroupedRequest]) -> None:
    """A plan of full group ``g`` deferred: each request whose lane stopped short of its
    computed full blocks is marked (`GroupedRequest.full_deferred`), so its finish stores
    no point past the full groups' stores (`full_cover()`)."""
    name, bs = g.name, g.block_size
    for state in states:
        lane = state.lanes[name]
        if lane.cursor < min(len(lane.table), len(lane.hashes), state.num_computed_tokens // bs):
            state.full_deferred = True


def full_cover(state: GroupedRequest) -> int | None:
    """The tokens every full group's lane of ``state`` planned or passed (its cursor):
    a store point past them serves no hit (``None``: the model has no full group)."""
    cover = [lane.cursor * lane.full for lane in state.lanes.values() if lane.full]
    return min(cover) if cover else None


@final
class GroupLiveBlocks:
    """The one owner of every group's live-block counts: per group, how many live lanes
    passed each hash (`Lane.live_end` and `Lane.holes` of a full lane, `Lane.live` of the
    others), whether a live block was evicted since the last restore, and the restore
    scan that offers those blocks again (``restore_evicted``).

    Args:
        names: the cacheable groups' names.
    """

    __slots__ = ("refs", "restore_needed")

    def __init__(self, names: Sequence[str]) -> None:
        self.refs: dict[str, dict[BlockHash, int]] = {name: {} for name in names}
        """Per group, hash → live lanes whose cursor passed it."""
        self.restore_needed = dict.fromkeys(names, False)
        """Per group, whether a live request's block was evicted since the last restore."""

    def reset(self) -> None:
        """The cache was reset: nothing evicted is waiting to be stored again."""
        for name in self.restore_needed:
            self.restore_needed[name] = False

    def forget(self, state: GroupedRequest) -> None:
        """``state``'s cursors went back to 0 (finish, preemption, reset): its blocks are
        not live any more."""
        for name, lane in state.lanes.items():
            self.drop(name, lane, 0)

    def drop(self, name: str, lane: Lane, keep: int) -> None:
        """Only ``lane``'s live blocks before ``keep`` (a `live_mark()`) stay live."""
        refs, hashes = self.refs[name], lane.hashes
        if lane.full:
            end = lane.live_end
            if keep >= end:
                return
            holes = lane.holes
            if holes:
                for i in range(keep, end):
                    if i not in holes:
                        count_down(refs, hashes[i])
                lane.holes = [i for i in holes if i < keep]
            else:
                for block_hash in hashes[keep:end]:
                    count_down(refs, block_hash)
            lane.live_end = keep
            return
        live = lane.live
        for i, _ in live[keep:]:
            count_down(refs, hashes[i])
        del live[keep:]

    def give_back(self, name: str, lane: Lane, live: LiveCopy) -> None:
        """A cancelled plan's hold comes back: so do the lane's live blocks it dropped."""
        lane.live_end, lane.holes, lane.live = live
        refs, hashes = self.refs[name], lane.hashes
        for i, _ in live_blocks(lane):
            count_up(refs, hashes[i])

    def restore(
        self,
        batch: StoreBatch,
        name: str,
        states: Sequence[GroupedRequest],
        rec: StoreRecord,
        counters: Counters,
    ) -> None:
        """Offer again the live blocks of ``states`` in group ``name`` (``restore_evicted``:
        cached or pending ones are skipped; when no CPU
        block is left the rest waits, the flag stays set; ``counters``: the group's)."""
        before = len(batch.hashes)
        for state in states:
            if state.finished:
                continue  # only live requests' blocks are restored
            lane = state.lanes[name]
            table, hashes, rid = lane.table, lane.hashes, state.request_id
            for i, point in live_blocks(lane):
                entry = table[i] if i < len(table) else None
                if entry is None or i < lane.valid_from:
                    continue  # the engine no longer holds it
                n = len(batch.hashes)
                if not batch.offer(hashes[i], entry, rid):
                    batch.deferred = 1
                    batch.deferred_request = rid
                    batch.skipped.append(hashes[i])
                    batch.end_run()
                    counters.restored_blocks += len(batch.hashes) - before
                    return
                if len(batch.hashes) > n and not lane.full:
                    rec.blocks.append((rid, i, point))
            batch.end_run()
        counters.restored_blocks += len(batch.hashes) - before
        self.restore_needed[name] = False

    def check(self, requests: Iterable[GroupedRequest]) -> None:
        """The counts are the lanes' (and a live full lane's blocks end at its cursor).

        Raises:
            InvariantError: naming the group and the breach.
        """
        states = list(requests)
        for name, refs in self.refs.items():
            want: dict[BlockHash, int] = {}
            for state in states:
                lane = state.lanes[name]
                for i, _ in live_blocks(lane):
                    count_up(want, lane.hashes[i])
                if lane.full and (
                    (lane.live_end != lane.cursor and not state.finished)
                    or any(i >= lane.live_end for i in lane.holes)
                ):
                    raise InvariantError(
                        f"group {name!r}: request {state.request_id!r}: live blocks end at "
                        f"{lane.live_end} (holes {lane.holes}), its cursor is {lane.cursor}"
                    )
            if want != refs:
                raise InvariantError(f"group {name!r}: live block counts disagree with the lanes")


@final
class GroupStorePlanner:
    """Plans the stores of every group; owns the records of the store plans in flight.

    Args:
        cacheable: the cacheable groups.
        ledgers: each group's ledger.
        counts: each group's counters.
        requests: the scheduler's requests by id (read, and their ``in_flight`` marked).
        align: the hit alignment.
        checkpoint: tokens between store points.
        limit: ``max_store_blocks_per_step``, per group pool and plan (``None``: none);
            `check_store_limit()` refuses one below a group's store point.
        admission: ``store_admission``, a filter per group pool (hashes differ per group).
        restore: ``restore_evicted``: a live request's blocks evicted from a group's pool
            are stored again from its GPU blocks (per group pool).
        priorities: the requests' `PriorityCount` (while it is 0, no request's priority
            is looked at; ``None``: every call looks).
        holds: with ``hold_blocks_on_finish``, each group's `HeldBlocks` (the one-group
            rules of finish holds, per group pool); ``None``: no holds.
        names: how its messages name the input (`InputNames`, the request table's).
    """

    def __init__(
        self,
        cacheable: Sequence[KVCacheGroup],
        ledgers: Mapping[str, BlockLedger],
        counts: Mapping[str, GroupCounts],
        requests: Mapping[str, GroupedRequest],
        *,
        align: int,
        checkpoint: int,
        config: OffloadConfig | None = None,
        priorities: PriorityCount | None = None,
        names: InputNames,
    ) -> None:
        # the store settings (``None``: none of them, as `GroupedScheduler` alone)
        limit = None if config is None else config.max_store_blocks_per_step
        if limit is not None:
            check_store_limit(cacheable, limit, align)
        self.lazy_window = 0
        """``lazy_offload_blocks`` with ``store_mode="lazy"`` (0: eager stores)."""
        if config is not None and config.store_mode == "lazy":
            why = lazy_refusal(cacheable)
            if why:
                raise ConfigError(f"store_mode='lazy' cannot serve these groups: {why}")
            self.lazy_window = config.lazy_offload_blocks
        self._limit = sys.maxsize if limit is None else limit
        admission = "always" if config is None else config.store_admission
        filters = {g.name: make_admission(admission) for g in cacheable}
        self._admissions: dict[str, AdmissionFilter] = {
            name: f for name, f in filters.items() if not isinstance(f, AlwaysAdmit)
        }
        self._cacheable = cacheable
        self._ledgers = ledgers
        self._counts = counts
        self._requests = requests
        self._names = names
        self._align = align
        self._checkpoint = checkpoint
        self._priorities = priorities
        self.records: dict[tuple[str, int], StoreRecord] = {}
        """(group, plan id) → who the store plan serves and the cursors before it."""
        self._restore = config is not None and config.restore_evicted
        self.live = GroupLiveBlocks([g.name for g in cacheable])
        """Every group's live-block counts."""
        self.holds = (
            {name: HeldBlocks(config, c.counters) for name, c in counts.items()}
            if config is not None and config.hold_blocks_on_finish and not self.lazy_window
            else None
        )
        """Per group, the GPU blocks finished requests hold (``None``: no holds; lazy
        stores hold nothing)."""
        self.plan_calls = 0
        """``plan_stores`` calls so far (the clock of finish holds)."""
        self.deferred_steps = 0
        """Plans (``plan_stores`` and ``finish`` calls) that deferred anything in some
        group (per group: `GroupStatistics.deferred_steps`)."""

    # -- finish holds --------------------------------------------------------------------------

    def held_blocks(self, state: GroupedRequest | None) -> dict[str, list[int]]:
        """Per group, the GPU blocks finished ``state`` holds (none: ``{}``)."""
        if state is None or not state.finished:
            return {}
        return {name: list(lane.held) for name, lane in state.lanes.items() if lane.held}

    def take_released(self) -> dict[str, list[int]]:
        """Per group, the GPU blocks whose hold ended since the last call."""
        out = {name: book.take_released() for name, book in (self.holds or {}).items()}
        return {name: ids for name, ids in out.items() if ids}

    def held_totals(self) -> dict[str, int]:
        """Per group, the GPU blocks held now (0 without holds)."""
        holds = self.holds
        return {g.name: holds[g.name].total if holds else 0 for g in self._cacheable}

    def begin_hold(self, state: GroupedRequest) -> None:
        """``state`` finished: each lane holds the GPU blocks of the store points it
        computed and did not plan yet, whole points from its cursor within its group's
        `HeldBlocks.room()` (as one group holds a prefix within ``hold_max_blocks``); its
        stores stop there (`Lane.stop`), and the next ``plan_stores`` plans them. A lane
        that holds nothing stores nothing more."""
        holds = self.holds
        if holds is None:
            return
        for g in self._cacheable:
            name = g.name
            lane = state.lanes[name]
            book = holds[name]
            room = book.room()
            held: list[int] = []
            stop = lane.cursor if g.kind != "full" else lane.cursor * g.block_size
            wanted = self.scan(state, name, g, True)
            k = 0
            while k < len(wanted):
                point = wanted[k][1]
                end = k
                while end < len(wanted) and wanted[end][1] == point:
                    end += 1
                ids = [lane.table[i] for i, _ in wanted[k:end] if i >= 0]
                if len(held) + len(ids) > room:
                    break
                held.extend(e for e in ids if e is not None)
                stop = point
                k = end
            lane.stop = stop
            if held:
                lane.held = held
                book.take(held)
        if state.holding:
            state.hold_deadline = next(iter(holds.values())).deadline(self.plan_calls)

    def end_hold(
        self, state: GroupedRequest, name: str, *, report: bool = True, expired: bool = False
    ) -> None:
        """``state``'s lane of group ``name`` is planned or given up: release its hold."""
        if self.holds is None:
            raise InvariantError(f"request {state.request_id!r}: a hold without holds")
        lane = state.lanes[name]
        held, lane.held = lane.held, []
        self.holds[name].end(held, report=report, expired=expired)
        self.live.drop(name, lane, 0)

    def _end_holds(
        self,
        name: str,
        ended: list[tuple[GroupedRequest, bool]],
        plan: TransferPlan | None,
        rec: StoreRecord,
    ) -> None:
        """End the holds of group ``name`` a plan finished or that expired (after the
        plan evicted what it did, in scan order); a plan
        that reads a request's held blocks records how to give its hold back if
        cancelled."""
        for state, expired in ended:
            lane = state.lanes[name]
            rid = state.request_id
            if plan is not None and not expired and rid in plan.request_ids:
                cursor = next(old for s, old, _ in rec.rollback if s is state)
                live: LiveCopy = (lane.live_end, lane.holes[:], lane.live[:])
                rec.holds.append((rid, lane.held, cursor, live))
            self.end_hold(state, name, expired=expired)

    def expire(self, state: GroupedRequest, *, report: bool = True) -> None:
        """Give every lane's hold of ``state`` up unstored (``hold_expired_blocks``)."""
        for name, lane in state.lanes.items():
            if lane.held:
                self.end_hold(state, name, report=report, expired=True)

    # -- live blocks -------------------------------------------------------------------------

    def scan(
        self,
        state: GroupedRequest,
        name: str,
        g: KVCacheGroup,
        final: bool,
        cap: int | None = None,
    ) -> list[tuple[int, int]]:
        """(block index, store point) of the blocks a request's store points up to the
        last one planned need in one group, in order: a block is listed once, ``-1 - i``
        for an entry not to store (``None``, past the table or hashes, or below the lane's
        ``valid_from``: not known to hold the request's KV). ``cap``: no point past it."""
        lane = state.lanes[name]
        limit = min(len(lane.table), len(lane.hashes))
        computed = min(state.num_computed_tokens, lane.stop)
        if cap is not None and cap < computed:
            computed = cap
        valid = lane.valid_from  # an entry below it is treated as None
        table = lane.table
        bs = g.block_size
        if g.kind == "full":
            return [
                (i if table[i] is not None and i >= valid else -1 - i, (i + 1) * bs)
                for i in range(lane.cursor, min(limit, computed // bs))
            ]
        points = list(store_points(lane.cursor, computed, self._checkpoint))
        last = computed // self._align * self._align
        if final and last > lane.cursor and (not points or points[-1] != last):
            points.append(last)
        seen: set[int] = set()
        out: list[tuple[int, int]] = []
        for point in points:
            for i in needed(g, point):
                if i in seen:
                    continue
                seen.add(i)
                usable = i < limit and i >= valid and table[i] is not None
                out.append((i if usable else -1 - i, point))
        return out

    def _offer(
        self,
        batch: StoreBatch,
        state: GroupedRequest,
        g: KVCacheGroup,
        wanted: list[tuple[int, int]],
        rec: StoreRecord,
        *,
        passed: list[int] | None,
    ) -> int | None:
        """Offer one request's blocks to the group's batch, a store point whole (its new
        blocks first, then its cached ones: `StoreBatch.offer()` keeps the plan from
        evicting those while a block is free); the cursor to keep when a point does not
        fit (the batch is marked deferred), else ``None``. A point that fits asks the
        group's admission filter about each new block; a refused one is not stored (the
        cursor passes it, as with one group). ``passed``, when given, gets the index of
        every block of the points offered (new or cached: a request's retention priority
        reaches them all, as with one group)."""
        lane = state.lanes[g.name]
        hashes, table = lane.hashes, lane.table
        get_cached, pending, planned = batch.get_cached, batch.pending, batch.planned
        rid = state.request_id
        counts = self._counts[g.name]
        admission = self._admissions.get(g.name)
        admit = admission.admit if admission is not None else None
        # a full lane's live blocks are a prefix up to its cursor; a finished lane's were
        # dropped (nothing below its cursor is live), so nothing it passes is live either
        prefix = lane.live_end == lane.cursor
        k = 0
        while k < len(wanted):
            point = wanted[k][1]
            end = k
            while end < len(wanted) and wanted[end][1] == point:
                end += 1
            usable = [i for i, _ in wanted[k:end] if i >= 0]
            new = [
                i
                for i in usable
                if get_cached(hashes[i]) is None
                and hashes[i] not in pending
                and hashes[i] not in planned
            ]
            if len(new) > min(batch.free, batch.left):
                batch.deferred = sum(1 for i, _ in wanted[k:] if i >= 0)
                batch.deferred_request = rid
                batch.skipped.append(hashes[new[0]])
                if g.kind == "full":
                    return point // g.block_size - 1
                return (point - 1) // self._checkpoint * self._checkpoint
            counts.skipped_null += (end - k) - len(usable)
            refs = self.live.refs[g.name]
            if not lane.full:
                for i in usable:
                    lane.live.append((i, point))
                    count_up(refs, hashes[i])
            elif prefix:  # a prefix, with holes where an entry was None (`Lane.live_end`)
                for j, _ in wanted[k:end]:
                    if j < 0:
                        lane.holes.append(-1 - j)
                    lane.live_end = (j if j >= 0 else -1 - j) + 1
                for i in usable:
                    count_up(refs, hashes[i])
            if passed is not None:  # refused ones too: the cursor passes them
                passed.extend(usable)
            if admit is not None:  # OffloadConfig.store_admission, block by block
                refused = [i for i in new if not admit(hashes[i])]
                if refused:
                    batch.refused.extend(hashes[i] for i in refused)
                    new = [i for i in new if i not in refused]
                    usable = [i for i in usable if i not in refused]
            fresh = set(new)
            for i in new + [i for i in usable if i not in fresh]:
                entry = table[i]
                if entry is None:  # scan() marked these
                    raise InvariantError(f"group {g.name!r}: a null entry was planned")
                if not batch.offer(hashes[i], entry, rid) and i in fresh:
                    raise InvariantError(f"group {g.name!r}: a store point did not fit")
            if not lane.full:
                rec.blocks.extend((rid, i, point) for i in new)
            k = end
        return None

    def plan(
        self, states: Sequence[GroupedRequest], final: bool, gpu_cache: CacheViews | None = None
    ) -> GroupedPlan | None:
        """One store plan per group for ``states``: their store points up to their computed
        length (and that length itself when ``final``), a point whole or deferred with every
        later one and every later request's (as one group defers: `StoreBatch`). A step
        (not ``final``) first stores again the live blocks evicted from a group's pool,
        with ``restore_evicted``. Lazy stores plan from ``gpu_cache`` instead
        (`plan_lazy()`). A finish (``final``) plans nothing in a full group: its eager
        steps stored every full block they could, and what a step deferred is not tried
        again at finish, as with one group (so two full groups count and store what one
        does)."""
        if self.lazy_window:
            return self.plan_lazy(gpu_cache)
        plans: dict[str, TransferPlan] = {}
        count = self._priorities
        prioritized = (
            {s.request_id: s.priority for s in states if s.priority}
            if count is None or count.count
            else {}
        )
        deferred = False
        for g in self._cacheable:
            if final and g.kind == "full":
                continue
            name = g.name
            batch = StoreBatch(self._ledgers[name], self._limit)
            rec = StoreRecord()
            want: dict[BlockHash, int] = {}
            if self._restore and self.live.restore_needed[name] and not final:
                self.live.restore(batch, name, states, rec, self._counts[name].counters)
            # holds this plan ends once it is made (expired: given up unstored), in order
            ended: list[tuple[GroupedRequest, bool]] = []
            if g.kind == "full":
                # the one-group store loop over the lanes whose new blocks all hold their
                # request's KV, one call per stretch of them; a lane that needs the
                # store-point scan stops the stretch, is planned, and the next one starts
                refs = self.live.refs[name]
                admission = self._admissions.get(name)
                admit = admission.admit if admission is not None else None
                todo = iter(states)
                stopped: list[GroupedRequest] = []
                while True:
                    run_offer(batch, refs, admit, self._full_runs(batch, g, todo, rec, stopped))
                    if not stopped:
                        break
                    self._plan_points(batch, stopped.pop(), g, final, rec, want=want, ended=ended)
            else:
                for state in states:
                    self._plan_points(batch, state, g, final, rec, want=want, ended=ended)
            if prioritized:  # every planned block, re-stores too, as with one group
                batch.owner_priorities(lambda rid: prioritized.get(rid, 0), want)
            if batch.deferred and g.kind == "full":
                note_full_deferral(g, states)
            deferred = deferred or bool(batch.deferred)
            plan = self._open(name, batch, rec, want)
            self._end_holds(name, ended, plan, rec)
            if plan is not None:
                plans[name] = plan
        self.deferred_steps += deferred
        return GroupedPlan("store", plans) if plans else None

    def _full_runs(
        self,
        batch: StoreBatch,
        g: KVCacheGroup,
        states: Iterator[GroupedRequest],
        rec: StoreRecord,
        stopped: list[GroupedRequest],
    ) -> Iterator[Run]:
        """Each live request's run of new blocks in full group ``g``, for `run_offer()`
        (the cursor moves where the run stopped; a run
        after a deferral is counted deferred). Stops at a request whose lane needs the
        store-point scan (`_plan_points()`: a retention priority, a hold, an entry that
        is ``None`` or below ``valid_from``), handing it over in ``stopped``."""
        name = g.name
        bs = g.block_size
        rollback = rec.rollback
        for state in states:
            lane = state.lanes[name]
            if state.finished or state.priority:
                stopped.append(state)
                return
            start = lane.cursor
            table, hashes = lane.table, lane.hashes
            end = state.num_computed_tokens // bs  # min() of the three, without a call
            size = len(table)
            if size < end:  # noqa: PLR1730 - no call per request
                end = size
            if len(hashes) < end:  # noqa: PLR1730
                end = len(hashes)
            if start >= end:
                continue  # nothing new
            # every entry is a distinct id unless one is ``None``: ids and table agree in size
            if start < lane.valid_from or (len(lane.ids) != size and None in table[start:end]):
                stopped.append(state)
                return
            if batch.deferred:
                batch.deferred += end - start
                batch.skipped.append(hashes[start])
                continue
            yield hashes, table, start, end, state.request_id
            i = batch.stopped
            if i != start:
                rollback.append((state, start, lane.live_end))
                lane.cursor = lane.live_end = i

    def _plan_points(
        self,
        batch: StoreBatch,
        state: GroupedRequest,
        g: KVCacheGroup,
        final: bool,
        rec: StoreRecord,
        *,
        want: dict[BlockHash, int],
        ended: list[tuple[GroupedRequest, bool]],
    ) -> None:
        """Plan ``state``'s store points in group ``g`` (`scan()`, `_offer()`): its
        computed ones, and its last one when ``final`` or finished (a hold); a hold past
        ``hold_max_steps`` goes to ``ended`` as expired, one whose points are all planned
        as ended; ``want`` gets the retention priority of every block passed."""
        lane = state.lanes[g.name]
        fin = final or state.finished  # a hold: its last point too
        if state.finished and self.plan_calls > state.hold_deadline:
            if lane.held:  # hold_max_steps passed
                ended.append((state, True))
            return
        # a finish after a full group's step deferred plans a window, chunk or state only
        # as far as the full groups' stores went (a finish retries nothing, as with one
        # group): a point past them would take pool room and serve no hit
        cap = full_cover(state) if final and state.full_deferred else None
        wanted = self.scan(state, g.name, g, fin, cap)
        if batch.deferred:
            usable = [i for i, _ in wanted if i >= 0]
            if usable:
                batch.deferred += len(usable)
                batch.skipped.append(lane.hashes[usable[0]])
            return
        rec.rollback.append((state, lane.cursor, live_mark(lane)))
        passed: list[int] | None = [] if state.priority else None
        cut = self._offer(batch, state, g, wanted, rec, passed=passed)
        if passed:
            prio = state.priority
            for i in passed:
                h = lane.hashes[i]
                if prio > want.get(h, 0):
                    want[h] = prio
        new = self.advance(g, state, fin, cap) if cut is None else cut
        if cut is None and lane.held:  # every held point planned
            ended.append((state, False))
        lane.cursor = max(lane.cursor, new)
        batch.end_run()

    def plan_lazy(self, gpu_caches: CacheViews | None) -> GroupedPlan | None:
        """One store plan per group from each group's cache view (``store_mode="lazy"``,
        every group full attention): the blocks closest to eviction, the first
        ``lazy_offload_blocks`` of its order, by the one-group lazy scan (`scan_lazy()`);
        no request's cursor moves, and nothing is planned at finish (as with one group).

        Raises:
            InputTypeError: ``gpu_caches`` is not a mapping.
            InvalidInputError: no views, or views that do not name exactly the cacheable
                groups.
        """
        names = [g.name for g in self._cacheable]
        if gpu_caches is None:
            raise InvalidInputError(f"store_mode='lazy' needs {self._names.views}")
        if not isinstance(gpu_caches, Mapping):
            raise InputTypeError(
                f"gpu_cache={type(gpu_caches).__name__}: with several KV cache groups, "
                f"store_mode='lazy' takes one GpuCacheView per group name {names}"
            )
        missing = [n for n in names if n not in gpu_caches]
        unknown = [n for n in gpu_caches if n not in names]
        if missing or unknown:
            raise InvalidInputError(
                f"gpu_cache must name exactly the cacheable groups {names}; missing "
                f"{missing}, unknown {unknown}"
            )
        plans: dict[str, TransferPlan] = {}
        deferred = False
        for g in self._cacheable:
            name = g.name
            batch = StoreBatch(self._ledgers[name], self._limit)
            scan_lazy(gpu_caches[name], batch, self.lazy_window)
            deferred = deferred or bool(batch.deferred)
            plan = self._open(name, batch, StoreRecord(), {})
            if plan is not None:
                plans[name] = plan
        self.deferred_steps += deferred
        return GroupedPlan("store", plans) if plans else None

    def _open(
        self, name: str, batch: StoreBatch, rec: StoreRecord, want: dict[BlockHash, int]
    ) -> TransferPlan | None:
        """Count a scanned batch of group ``name`` and open its store plan (``None``:
        nothing to store); ``want``: the retention priorities the scan passed."""
        ledger = self._ledgers[name]
        counters = self._counts[name].counters
        batch.count(ledger, counters, group=name)
        # as with one group (`BlockLedger.prioritize()`): planned blocks are published
        # with their priority, cached or pending ones raised now
        priorities = ledger.prioritize(want, batch.planned) if want else None
        if not batch.hashes:
            return None
        evicted: list[BlockHash] = []
        plan = ledger.open_store(
            batch.hashes,
            batch.gpu_ids,
            tuple(dict.fromkeys(batch.owners)),
            protect=batch.protect,
            evicted=evicted,
            ends=batch.run_ends(),
            priorities=priorities,
        )
        refs = self.live.refs[name]
        for block_hash in evicted:
            if block_hash in refs:
                counters.evicted_while_live += 1
                self.live.restore_needed[name] = True
        counters.store_plans += 1
        rec.refused = tuple(batch.refused)
        self.records[(name, plan.plan_id)] = rec
        key = (name, plan.plan_id)
        requests = self._requests
        for rid in plan.request_ids:
            requests[rid].in_flight.add(key)
        return plan

    def advance(
        self, g: KVCacheGroup, state: GroupedRequest, final: bool, cap: int | None = None
    ) -> int:
        lane = state.lanes[g.name]
        computed = min(state.num_computed_tokens, lane.stop)
        if cap is not None and cap < computed:
            computed = cap
        if g.kind == "full":
            return max(
                lane.cursor, min(len(lane.table), len(lane.hashes), computed // g.block_size)
            )
        if final:
            return computed // self._align * self._align
        return computed // self._checkpoint * self._checkpoint

    def cancel(self, group: str, plan_id: int, hashes: Sequence[BlockHash], current: bool) -> None:
        """A store plan of ``hashes`` was cancelled: the admission filter forgets its
        offers, its requests' cursors go back (if ``current``)."""
        store = self.records.pop((group, plan_id))
        admission = self._admissions.get(group)
        if admission is not None:
            admission.undo(hashes, store.refused)
        if self._restore:
            self.live.restore_needed[group] = True  # the plan may have held re-stores
        if self.holds is not None:
            book = self.holds[group]
            for rid, held, cursor, live in store.holds:
                state = self._requests.get(rid)
                if state is not None and book.give_back(held):
                    lane = state.lanes[group]
                    lane.held, lane.cursor = held, cursor
                    self.live.give_back(group, lane, live)
        if not current:
            return
        requests = self._requests
        for state, old, mark in store.rollback:
            lane = state.lanes[group]
            if requests.get(state.request_id) is state and (not state.finished or lane.held):
                # a request that finished since keeps its cursor: the engine freed the
                # plan's GPU blocks and holds only those from the cursor on (a hold this
                # plan ended came back above, with its own cursor); its cancelled blocks
                # stop being live
                if not state.finished:
                    lane.cursor = min(lane.cursor, old)
                self.live.drop(group, lane, mark)

    def check_invariants(self) -> None:
        """Every block of a store in flight lies in ``needed(g, point)`` of its point, the
        records are the ledgers' store plans, and the live counts are the lanes'.

        Raises:
            InvariantError: naming the group and the breach.
        """
        groups = {g.name: g for g in self._cacheable}
        self.live.check(self._requests.values())
        for name in self.live.refs:
            held = sum(len(s.lanes[name].held) for s in self._requests.values())
            if self.holds is not None and held != self.holds[name].total:
                raise InvariantError(
                    f"group {name!r}: held GPU blocks {held}, counted {self.holds[name].total}"
                )
        for name, ledger in self._ledgers.items():
            kinds = {rec.plan.plan_id for rec in ledger.plans() if rec.plan.kind == "store"}
            if {p for g, p in self.records if g == name} != kinds:
                raise InvariantError(f"group {name!r}: store records disagree with the ledger")
        for (name, _), rec in self.records.items():
            for rid, i, point in rec.blocks:
                if i not in needed(groups[name], point):
                    raise InvariantError(
                        f"group {name!r}: request {rid!r} stores block {i}, outside needed({point})"
                    )
