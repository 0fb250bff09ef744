"""The records of `GroupedScheduler`: its plans and statistics, a request's lanes (one
per group), and the checks of its per-group inputs."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, final

from kvoffload.errors import (
    BlockTableError,
    InvalidInputError,
    KvOffloadError,
    RequestStateError,
    UnknownRequestError,
)
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHash
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.misses import MissReason
from kvoffload.scheduler.requests import (
    FinishedIds,
    PriorityCount,
    as_count,
    check_agrees,
    check_distinct,
    check_entry,
    check_known_entries,
    check_load_span,
    check_request_priority,
    check_reservable,
    finished_again,
    fresh_ids,
    grown_hashes,
    grown_table,
    hashes_lag,
    length,
    warn_unhashed,
)
from kvoffload.scheduler.state import RequestPhase, check_move
from kvoffload.scheduler.stats import Counters
from kvoffload.transfer.plan import TransferPlan

__all__ = [
    "GroupCounts",
    "GroupHashes",
    "GroupStatistics",
    "GroupTables",
    "GroupedPlan",
    "GroupedRequest",
    "InputNames",
    "Lane",
    "LiveCopy",
    "StoreRecord",
    "check_hashes",
    "check_tables",
    "table_changes",
    "live_blocks",
    "live_mark",
    "load_destinations",
]

GroupTables = Mapping[str, Sequence[int | None]]
"""One GPU block table per group name; ``None`` marks a block the engine does not hold."""
GroupHashes = Mapping[str, Sequence[BlockHash]]
"""One list of block hashes per group name (each group hashes in its own namespace)."""


@final
@dataclass(frozen=True, slots=True)
class GroupedPlan:
    """One step's transfers: one plan per group that has blocks to move.

    Attributes:
        kind: ``"store"`` or ``"load"``.
        plans: group name → that group's plan (its ids address that group's pool and GPU
            tensors only).
    """

    kind: str
    plans: Mapping[str, TransferPlan]

    @property
    def num_blocks(self) -> int:
        """Blocks moved over all groups."""
        return sum(p.num_blocks for p in self.plans.values())


@final
@dataclass(frozen=True, slots=True)
class GroupStatistics:
    """One group's counters (a snapshot). A counter named as one of `SchedulerStatistics`
    has its meaning, for this group's pool and plans.

    Attributes:
        stored_blocks: blocks whose store completed and published.
        loaded_blocks: blocks whose load completed.
        skipped_null_blocks: blocks of a store point not stored: the table entry was
            ``None`` when planned (out of window, freed or reused), or lay below what the
            request's load or prefix wrote (never known to hold its KV).
        deferred_blocks: blocks that a ``plan_stores`` (or ``finish``) call could not
            allocate in this group's pool (counted per call).
        deferred_steps: ``plan_stores`` (or ``finish``) calls that deferred anything in
            this group.
        pinned_blocks: blocks pinned by lookups now.
        in_flight_plans: the group's plans in flight.
        num_cpu_blocks: the group's pool size.
        free_cpu_blocks: free blocks in the pool.
        cached_cpu_blocks: published blocks in the pool.
        lookup_misses: lookups whose hit stopped at a block of this group, by
            `MissReason` (docs/misses.md).
        store_plans: the group's store plans made.
        load_plans: the group's load plans made.
        failed_stores: the group's store transfers that failed (nothing published).
        failed_loads: the group's load transfers that failed (their CPU blocks were
            unpublished).
        abandoned_transfers: the group's transfers that completed after a ``reset``.
        ignored_completions: completions or cancellations of the group's unknown or
            already completed plans.
        cancelled_plans: the group's plans undone because their launch raised.
        concurrent_load_blocks: blocks planned for a load while another load of the same
            CPU block was in flight.
        evicted_while_live: the group's blocks evicted while a live request's cursor had
            passed them.
        restored_blocks: such blocks stored again (``restore_evicted=True``).
        held_blocks: the group's GPU blocks finished requests hold now
            (``hold_blocks_on_finish``).
        hold_expired_blocks: the group's held GPU blocks given up unstored after
            ``hold_max_steps``.
    """

    stored_blocks: int
    loaded_blocks: int
    skipped_null_blocks: int
    deferred_blocks: int
    deferred_steps: int
    pinned_blocks: int
    in_flight_plans: int
    num_cpu_blocks: int
    free_cpu_blocks: int
    cached_cpu_blocks: int
    lookup_misses: Mapping[MissReason, int] = field(default_factory=dict)
    store_plans: int = 0
    load_plans: int = 0
    failed_stores: int = 0
    failed_loads: int = 0
    abandoned_transfers: int = 0
    ignored_completions: int = 0
    cancelled_plans: int = 0
    concurrent_load_blocks: int = 0
    evicted_while_live: int = 0
    restored_blocks: int = 0
    held_blocks: int = 0
    hold_expired_blocks: int = 0


@dataclass(slots=True, eq=False)
class Lane:
    """One request's state in one group."""

    table: list[int | None] = field(default_factory=list)
    ids: set[int] = field(default_factory=set)  # the int entries of ``table``
    hashes: list[BlockHash] = field(default_factory=list)
    # full: blocks planned or skipped; other kinds: tokens of the last store point planned
    cursor: int = 0
    pin: list[CpuBlock] | None = None
    pin_start: int = 0
    # the blocks the cursor passed that held the request's KV (stored, cached, in flight
    # or refused by admission): the blocks `restore_evicted` stores again, and whose
    # hashes count as live (`evicted_while_live`). A full lane's are a prefix, as one
    # group's are the blocks below its cursor: its first ``live_end`` blocks but the
    # ``holes`` (entries that were ``None`` when the cursor passed them); the other kinds'
    # are listed as (block index, store point) in ``live``
    live: list[tuple[int, int]] = field(default_factory=list)
    live_end: int = 0
    holes: list[int] = field(default_factory=list)
    # a full lane's block size (0: a lane of another kind)
    full: int = 0
    # a finished request's hold (`hold_blocks_on_finish`): the GPU blocks this lane holds
    # until a store plan reads them, and the tokens its stores stop at
    held: list[int] = field(default_factory=list)
    stop: int = sys.maxsize
    # table entries below this index are not known to hold this request's KV (below the
    # engine's prefix's needed blocks, or below a window, chunk or state a load landed
    # above them): never stored, whatever the engine's table names there
    valid_from: int = 0


# read as module globals: an Enum member looked up on its class is a Python-level call
_LIVE, _PREEMPTED = RequestPhase.LIVE, RequestPhase.PREEMPTED
_HOLDING, _DRAINING = RequestPhase.HOLDING, RequestPhase.DRAINING


@dataclass(slots=True, eq=False)
class GroupedRequest:
    request_id: str
    lanes: dict[str, Lane]
    num_computed_tokens: int = 0
    hit: int | None = None
    hit_from: int = 0
    in_flight: set[tuple[str, int]] = field(default_factory=set)
    finished: bool = False
    # the request's run of "ask again" lookups: how many, and since when (scheduler clock)
    deferrals: int = 0
    deferred_since: float = 0.0
    miss_reason: MissReason = MissReason.NONE
    # a lookup counted its prompt tokens since it was registered or last preempted
    # (``new_prompt``: the last lookup was that one), as `RequestOffloadState.admitted`
    admitted: bool = False
    new_prompt: bool = False
    # per secondary tier (by name), the tokens of the last lookup's hit it promoted
    tier_hits: dict[str, int] | None = None
    # the retention priority of its blocks in every group (`PriorityCount.set()`)
    priority: int = 0
    # the ``plan_stores`` call after which a hold is given up (`HeldBlocks.deadline()`)
    hold_deadline: int = 0
    # a step deferred blocks of a full group: its finish stores no point past the full
    # groups' cursors (`full_cover()`)
    full_deferred: bool = False
    # a reset moved its cursors back over entries no update compared since they were
    # stored: until the next update compares its whole tables, nothing is stored or held
    # from them (one group's `RequestOffloadState.recheck_table`)
    recheck_table: bool = False
    # the engine preempted it and it made no update since (its tables are empty)
    preempted: bool = False

    @property
    def holding(self) -> bool:
        """Whether the (finished) request holds GPU blocks in some group."""
        return any(lane.held for lane in self.lanes.values())

    @property
    def phase(self) -> RequestPhase:
        """Where the request is in its life (`RequestPhase`), read from its state (a
        finished request holds while a lane holds GPU blocks, then drains)."""
        if self.finished:
            return _HOLDING if self.holding else _DRAINING
        return _PREEMPTED if self.preempted else _LIVE

    def move_to(self, phase: RequestPhase) -> None:
        """Enter ``phase``, if it may follow the current one (`check_move()`): the one
        way ``finished`` and ``preempted`` change. ``HOLDING`` and ``DRAINING`` both
        finish the request; which of the two it is, its lanes' holds say.

        Raises:
            RequestStateError: naming both phases.
        """
        check_move(self.request_id, self.phase, phase)
        if phase is _LIVE or phase is _PREEMPTED:
            self.preempted = phase is _PREEMPTED
        else:
            self.finished = True


def live_blocks(lane: Lane) -> list[tuple[int, int]]:
    """``(block index, store point)`` of ``lane``'s live blocks, in order (a full lane's
    from its prefix: `Lane.live_end` and `Lane.holes`)."""
    bs = lane.full
    if not bs:
        return lane.live
    holes = lane.holes
    return [(i, (i + 1) * bs) for i in range(lane.live_end) if i not in holes]


LiveCopy: TypeAlias = "tuple[int, list[int], list[tuple[int, int]]]"
"""A copy of a lane's live blocks: `Lane.live_end`, `Lane.holes` and `Lane.live`."""


def live_mark(lane: Lane) -> int:
    """Where ``lane``'s live blocks end now (a full lane's: the block index; the other
    kinds': the length of `Lane.live`), for `GroupStorePlanner.drop_live()`."""
    return lane.live_end if lane.full else len(lane.live)


@final
class InputNames:
    """How the messages of a `GroupedScheduler`'s input checks name its input: one choice,
    made when it is built. With one cacheable group, as `OffloadScheduler` names it
    (``gpu_block_ids``, ``block_hashes``, "block table", ``block_size``), so a one-group
    model's user (Llama through the vLLM connector) reads one group's words; with several,
    each group by name (``tables['g']``, ``block_hashes['g']``, "the block table of group
    'g'", ``hit_alignment``). The checks read these strings; a message is the only place
    they are used.

    Attributes:
        tables: per group name, how a message names its GPU block table (the ``what`` of
            `check_entry()`, `length()`, `check_known_entries()` and `check_agrees()`).
        hashes: per group name, how a message names its hash list (`grown_hashes()`).
        groups: per group name, the group `check_distinct()`, `check_load_span()` and
            `warn_unhashed()` name (``None``: one group's words).
        unit: how a message names the unit of a hit (`check_lookup_counts()`); with one
            cacheable group the hit alignment is its block size.
        views: what a lazy ``plan_stores()`` without the engine's cache view lacks
            (`GroupStorePlanner.plan_lazy()`).
    """

    __slots__ = ("groups", "hashes", "tables", "unit", "views")

    def __init__(self, cacheable: Sequence[KVCacheGroup]) -> None:
        one = len(cacheable) == 1
        self.tables = {g.name: "gpu_block_ids" if one else f"tables[{g.name!r}]" for g in cacheable}
        self.hashes = {
            g.name: "block_hashes" if one else f"block_hashes[{g.name!r}]" for g in cacheable
        }
        self.groups: dict[str, str | None] = {g.name: None if one else g.name for g in cacheable}
        self.unit = "block_size" if one else "hit_alignment"
        self.views = (
            "plan_stores(gpu_cache)"
            if one
            else f"the engine's gpu_cache view of every group {[g.name for g in cacheable]}"
        )


@final
class GroupRequests:
    """The one owner of a `GroupedScheduler`'s request states, as `RequestTable` is of
    one group's: registration on first use, the live and known lookups, retention
    priorities (`PriorityCount`), the finished ids it refuses (`FinishedIds`, one group's
    rule: ids are never reused) and dropping a finished request once nothing of it is
    left.

    Args:
        lanes: the cacheable groups (one `Lane` each per request).
        limits: per group name, its GPU block count (`update()` refuses ids past it).
        every_entry: ``restore_evicted`` (a store may read any table entry again, so
            `update()` compares a full lane's entries from the first, as one group does).

    An `UnhashedBlocksWarning` is issued once (`warn_unhashed()`) when an update's computed
    tokens run more than one block past a group's hashes (`hashes_lag()`, one group's rule).
    """

    __slots__ = (
        "_cacheable",
        "_checks",
        "_every_entry",
        "_lanes",
        "_limits",
        "_single",
        "_step",
        "_warned_unhashed",
        "finished",
        "hash_args",
        "names",
        "priorities",
        "requests",
        "unit",
    )

    def __init__(
        self,
        lanes: Sequence[KVCacheGroup],
        *,
        limits: Mapping[str, int] | None = None,
        every_entry: bool = False,
    ) -> None:
        self._cacheable = tuple(lanes)
        self._lanes = tuple((g.name, g.block_size if g.kind == "full" else 0) for g in lanes)
        self._limits = dict(limits or {})
        self._every_entry = every_entry
        self.names = InputNames(lanes)
        """How the checks' messages name the input (one group's words with one group)."""
        self.hash_args = self.names.hashes
        """How the checks' messages name each group's hash list (`InputNames.hashes`)."""
        self.unit = self.names.unit
        """How a lookup's message names the unit of a hit (`InputNames.unit`)."""
        # per lane in order: its group's name, GPU block count, hash list's name and
        # block size
        self._checks = tuple(
            (g.name, self._limits.get(g.name), self.hash_args[g.name], g.block_size) for g in lanes
        )
        self._warned_unhashed = False
        # every block size is a multiple of this: while ``computed // _step`` stays, no
        # lane's count of full blocks moves, so no lane's hashes start to lag
        self._step = math.gcd(*(g.block_size for g in lanes))
        self._single = self._checks[0] if len(self._checks) == 1 else None
        """The one lane's checks when there is one cacheable group (`_grew_one()`)."""
        self.requests: dict[str, GroupedRequest] = {}
        """Every request with state, by id (the store planner reads it too)."""
        self.priorities = PriorityCount()
        """Counts the requests whose priority is not 0."""
        self.finished = FinishedIds()
        """The finished ids it refuses (the last `FINISHED_IDS_REMEMBERED`)."""

    def state(self, request_id: str, *, live: bool = True) -> GroupedRequest:
        """The state of ``request_id``, registered on first use (`RequestStateError`:
        finished, unless ``live`` is false; a remembered finished id is never registered
        again)."""
        state = self.requests.get(request_id)
        if state is None:
            self.finished.refuse(request_id)
            state = GroupedRequest(request_id, {name: Lane(full=bs) for name, bs in self._lanes})
            self.requests[request_id] = state
        elif live and state.finished:
            raise RequestStateError(f"request {request_id!r} is finished")
        return state

    def update(
        self,
        request_id: str,
        tables: GroupTables,
        block_hashes: GroupHashes,
        num_computed_tokens: int,
        frames: int = 4,
    ) -> None:
        """Check a `GroupedScheduler.update()` call in full, then apply it (a refused
        call changes nothing). ``frames``: from `warn_unhashed()`'s caller here to the
        scheduler's caller (`UnhashedBlocksWarning` names its line)."""
        num_computed_tokens = as_count(num_computed_tokens, "num_computed_tokens", request_id)
        existing = self.requests.get(request_id)
        if existing is None:
            self.finished.refuse(request_id)
        else:
            if existing.finished:
                raise RequestStateError(f"request {request_id!r} is finished")
            single = self._single
            if single is not None and self._grew_one(
                existing, single, tables, block_hashes, num_computed_tokens
            ):
                return
            # the common case, in one pass: every lane's table only grew by the one-group
            # rule (`grown_table()`) and its hashes too (`grown_hashes()`); else (nothing
            # raised here) the full checks below name what the call did wrong first
            grown: list[tuple[Lane, list[Any], Sequence[BlockHash]]] = []
            every, checks = self._every_entry, self._checks
            k = 0
            for lane in existing.lanes.values():  # the cacheable groups' lanes, in order
                name, limit, what, _ = checks[k]
                k += 1  # noqa: SIM113 - no enumerate object per call
                old = lane.table
                if not old:
                    break
                try:
                    table, added = tables[name], block_hashes[name]
                except KeyError:
                    break
                read_from = lane.cursor if lane.full and not every else 0
                new = grown_table(table, old, lane.ids, read_from, limit)
                if new is None:
                    break
                try:
                    hashes = grown_hashes(lane.hashes, added, request_id, what)
                except KvOffloadError:
                    break
                grown.append((lane, new, hashes))
            else:
                for lane, new, hashes in grown:
                    if new:
                        lane.table.extend(new)
                        lane.ids.update(new)
                    if hashes:
                        lane.hashes.extend(hashes)
                step = self._step
                moved = num_computed_tokens // step != existing.num_computed_tokens // step
                existing.num_computed_tokens = num_computed_tokens
                existing.recheck_table = False  # every known entry was compared (cursor 0)
                if moved and not self._warned_unhashed:
                    self._warn_unhashed(existing, frames)
                return
        state = self._full_update(request_id, existing, tables, block_hashes, num_computed_tokens)
        if not self._warned_unhashed:
            self._warn_unhashed(state, frames)

    def update_one(
        self,
        request_id: str,
        table: Sequence[int | None],
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
    ) -> None:
        """`update()` of a model with one cacheable group, given its table and hashes
        without a mapping (the one-group face's call)."""
        single = self._single
        assert single is not None
        existing = self.requests.get(request_id)
        if (
            existing is not None
            and not existing.finished
            and type(num_computed_tokens) is int
            and num_computed_tokens >= 0
            and self._grew_lane(existing, single, table, block_hashes, num_computed_tokens, 4)
        ):
            return
        name = single[0]
        self.update(request_id, {name: table}, {name: block_hashes}, num_computed_tokens, 5)

    def _grew_one(
        self,
        state: GroupedRequest,
        check: tuple[str, int | None, str, int],
        tables: GroupTables,
        block_hashes: GroupHashes,
        num_computed_tokens: int,
    ) -> bool:
        """The common case of a model with one cacheable group, without the loop over the
        lanes: apply the call if its table and hashes only grew (the rules of the loop in
        `update()`); ``False`` (nothing changed) leaves it to the full checks."""
        name = check[0]
        try:
            table, added = tables[name], block_hashes[name]
        except KeyError:
            return False
        return self._grew_lane(state, check, table, added, num_computed_tokens, 5)

    def _grew_lane(  # noqa: PLR0917 - the lane's call, and the warning's frames
        self,
        state: GroupedRequest,
        check: tuple[str, int | None, str, int],
        table: Sequence[int | None],
        added: Sequence[BlockHash],
        num_computed_tokens: int,
        stacklevel: int,
    ) -> bool:
        """`_grew_one()` given the lane's table and hashes (``stacklevel``: the frames from
        here to the caller of the scheduler's ``update()``, for the warning)."""
        name, limit, what, block_size = check
        lane = state.lanes[name]
        old = lane.table
        if not old:
            return False
        new = grown_table(
            table, old, lane.ids, lane.cursor if lane.full and not self._every_entry else 0, limit
        )
        if new is None:
            return False
        try:
            hashes = grown_hashes(lane.hashes, added, state.request_id, what)
        except KvOffloadError:
            return False
        if new:
            old.extend(new)
            lane.ids.update(new)
        if hashes:
            lane.hashes.extend(hashes)
        moved = num_computed_tokens // block_size != state.num_computed_tokens // block_size
        state.num_computed_tokens = num_computed_tokens
        state.recheck_table = False  # every known entry was compared (cursor 0)
        if (
            moved  # a lane's hashes start to lag only when its count of full blocks moves
            and not self._warned_unhashed
            and hashes_lag(num_computed_tokens, block_size, lane.hashes)
        ):
            self._warned_unhashed = True
            n = len(lane.hashes)
            warn_unhashed(state.request_id, num_computed_tokens, block_size, n, None, stacklevel)
        return True

    def _warn_unhashed(self, state: GroupedRequest, frames: int) -> None:
        """`warn_unhashed()` for the first lane of ``state`` whose hashes lag its computed
        tokens (`hashes_lag()`), naming its group (with several); then never again."""
        n = state.num_computed_tokens
        lanes = state.lanes
        for name, _, _, block_size in self._checks:
            hashes = lanes[name].hashes
            if hashes_lag(n, block_size, hashes):
                self._warned_unhashed = True
                group = self.names.groups[name]
                warn_unhashed(state.request_id, n, block_size, len(hashes), group, frames)
                return

    def _full_update(
        self,
        request_id: str,
        existing: GroupedRequest | None,
        tables: GroupTables,
        block_hashes: GroupHashes,
        num_computed_tokens: int,
    ) -> GroupedRequest:
        """Check the call in full (naming what it did wrong first), then apply it; the
        request's state."""
        cacheable = self._cacheable
        changes = table_changes(
            cacheable,
            self._limits,
            request_id,
            existing,
            tables,
            every_entry=self._every_entry,
            names=self.names,
        )
        new_hashes = check_hashes(cacheable, request_id, existing, block_hashes, self.hash_args)
        state = existing if existing is not None else self.state(request_id)
        if state.preempted:  # checked and made before any change: a refusal changes nothing
            state.move_to(_LIVE)
        for k, lane in enumerate(state.lanes.values()):  # the cacheable groups' lanes
            append, entries = changes[k]
            ids = lane.ids
            if append:
                lane.table.extend(entries)
            else:
                lane.table = entries
                ids = lane.ids = set()
            ids.update(entries)  # type: ignore[arg-type] # at C speed; ``None`` names no block
            ids.discard(None)
            lane.hashes.extend(new_hashes[k])
        state.num_computed_tokens = num_computed_tokens
        state.recheck_table = False
        return state

    def known(self, request_id: str) -> GroupedRequest:
        """The state of ``request_id`` (`UnknownRequestError`: none; `RequestStateError`:
        a remembered finished id, as with one group)."""
        state = self.requests.get(request_id)
        if state is None:
            self.finished.refuse(request_id)
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return state

    def live(self, request_id: str, *, finishing: bool = False) -> GroupedRequest:
        """`known()`, refusing a finished request (`RequestStateError`; ``finishing``: the
        refusal of a second `finish()`, worded as one group's)."""
        state = self.known(request_id)
        if state.finished:
            if finishing:
                raise finished_again(request_id)
            raise RequestStateError(f"request {request_id!r} is finished")
        return state

    def set_priority(self, request_id: str, priority: object) -> None:
        """Give ``request_id`` (registered on first use) a checked retention priority."""
        priority = check_request_priority(request_id, priority)
        self.priorities.set(self.state(request_id), priority)

    def reserve(self, request_id: str) -> None:
        """Register ``request_id`` for a new request (a handle, before its first call),
        refused when in use (state kept for it) or finished (`check_reservable()`).

        Raises:
            RequestStateError: the id is in use or finished.
        """
        check_reservable(request_id, request_id in self.requests, self.finished)
        self.state(request_id)

    def mark_finished(self, state: GroupedRequest) -> None:
        """``state``'s request finished: nothing is scheduled for it, and its id is
        refused from now on."""
        state.move_to(_DRAINING)  # its lanes' holds, if any, make it HOLDING
        self.finished.remember(state.request_id)

    def detach(self, group: str, plan: TransferPlan) -> None:
        """``group``'s ``plan`` completed or was cancelled: its requests stop waiting on
        it (a finished one left with nothing is forgotten), as one group's
        `RequestTable.detach()`."""
        key = (group, plan.plan_id)
        requests = self.requests
        for rid in plan.request_ids:
            state = requests.get(rid)
            if state is not None:
                state.in_flight.discard(key)
                if state.finished:
                    self.drop_if_done(state)

    def drop_if_done(self, state: GroupedRequest) -> None:
        """Forget a finished request once no copy of it is in flight and it holds nothing."""
        if state.finished and not state.in_flight and not state.holding:
            del self.requests[state.request_id]
            self.priorities.drop(state)


@dataclass(slots=True, eq=False)
class GroupCounts:
    """One group's running totals: `Counters` (the single-group counters, with their
    meaning), and the blocks of store points not stored (a grouped rule's own)."""

    counters: Counters
    skipped_null: int = 0

    def snapshot(self, ledger: BlockLedger, held: int = 0) -> GroupStatistics:
        """These counters, ``ledger``'s pool and the ``held`` GPU blocks, as
        `GroupStatistics`."""
        pool = ledger.pool
        c = self.counters
        return GroupStatistics(
            stored_blocks=c.stored_blocks,
            loaded_blocks=c.loaded_blocks,
            skipped_null_blocks=self.skipped_null,
            deferred_blocks=c.deferred_blocks,
            deferred_steps=c.deferred_steps,
            pinned_blocks=sum(len(p) for p in ledger.pins()),
            in_flight_plans=ledger.num_plans,
            num_cpu_blocks=pool.num_blocks,
            free_cpu_blocks=pool.num_free,
            cached_cpu_blocks=pool.num_cached,
            lookup_misses=dict(c.lookup_misses),
            store_plans=c.store_plans,
            load_plans=c.load_plans,
            failed_stores=c.failed_stores,
            failed_loads=c.failed_loads,
            abandoned_transfers=c.abandoned_transfers,
            ignored_completions=c.ignored_completions,
            cancelled_plans=c.cancelled_plans,
            concurrent_load_blocks=c.concurrent_load_blocks,
            evicted_while_live=c.evicted_while_live,
            restored_blocks=c.restored_blocks,
            held_blocks=held,
            hold_expired_blocks=c.hold_expired_blocks,
        )


@dataclass(slots=True, eq=False)
class StoreRecord:
    """What undoing one group's store plan needs (`GroupStorePlanner.cancel()`)."""

    # (request, its lane's cursor and `live_mark()` before the plan) of every request the
    # plan moved, one entry each, to roll back on a cancel
    rollback: list[tuple[GroupedRequest, int, int]] = field(default_factory=list)
    # (request id, block index, store point) of the blocks a lane of a kind other than
    # full attention plans (`check_invariants()` checks they lie in their point's needed
    # blocks; a full lane's always do, and are not listed, as with one group)
    blocks: list[tuple[str, int, int]] = field(default_factory=list)
    # hashes the admission filter refused while the plan was built (undone on cancel)
    refused: tuple[BlockHash, ...] = ()
    # holds the plan ended (request id, held ids, cursor before, and the lane's live
    # blocks: `LiveCopy`): a cancel gives them back (`HeldBlocks.give_back()`)
    holds: list[tuple[str, list[int], int, LiveCopy]] = field(default_factory=list)


def table_changes(
    cacheable: Sequence[KVCacheGroup],
    limits: Mapping[str, int],
    rid: str,
    state: GroupedRequest | None,
    tables: GroupTables,
    *,
    names: InputNames,
    every_entry: bool = False,
) -> list[tuple[bool, list[int | None]]]:
    """`update()`'s check of one table per cacheable group, in O(new entries) where it
    can: per group in order, ``(True, entries to append to its lane's table)``, or
    ``(False, the whole checked table)`` to replace it when it is new or its known
    entries changed.

    By the one-group rule (`grown_table()`, which `RequestTable.new_table_entries()`
    calls too): a table whose entries a store may still read (a full group's from its
    cursor on, every entry of the other kinds) are unchanged and that only grew has its
    new entries checked with `fresh_ids()`; any other table is checked in full by
    `check_tables()`. With ``every_entry`` (``restore_evicted``: a store may read any
    entry again) a full group's entries are compared from the first, as with one group.
    ``names``: how the messages name the tables (`InputNames`)."""
    out: list[tuple[bool, list[int | None]]] = []
    full: list[KVCacheGroup] = []
    known: list[tuple[str, list[int | None], int]] = []  # (group, its table, read from)
    for g in cacheable:
        lane = state.lanes[g.name] if state is not None else None
        if lane is None or not lane.table:
            full.append(g)
            continue
        read_from = lane.cursor if lane.full and not every_entry else 0
        new = grown_table(tables.get(g.name), lane.table, lane.ids, read_from, limits.get(g.name))
        if new is None:
            full.append(g)
            if g.kind != "recurrent":
                # the entries from the store cursor on (a block index) are read by the
                # stores to come: the one-group rule; below it, the table as it is now
                start = lane.cursor if lane.full else lane.cursor // g.block_size
                known.append((g.name, lane.table, start))
            continue
        out.append((True, new))
    if not full:
        return out
    checked = check_tables(full, limits, rid, tables, names)
    for name, old, read_from in known:
        what = names.tables[name]
        check_known_entries(checked[name], old, read_from, rid, what, may_drop=True)
    grown = iter(out)
    return [(False, checked[g.name]) if g.name in checked else next(grown) for g in cacheable]


def check_tables(
    cacheable: Sequence[KVCacheGroup],
    limits: Mapping[str, int],
    rid: str,
    tables: GroupTables,
    names: InputNames | None = None,
) -> dict[str, list[int | None]]:
    """Check one table per cacheable group (ints in range or ``None``, no GPU block named
    twice: `check_distinct()`, the one-group rule); copies of them. ``names``: how the
    messages name the tables (`InputNames`; ``None``: made from ``cacheable``, every
    cacheable group then, only when a check needs it: a table that is not a list, or an
    entry the fast check does not take)."""
    out: dict[str, list[int | None]] = {}
    for g in cacheable:
        table = tables.get(g.name)
        if table is None:
            raise BlockTableError(f"request {rid!r}: no block table for group {g.name!r}")
        if type(table) is not list:
            names = names or InputNames(cacheable)
            length(table, names.tables[g.name], rid)  # a sequence, as one group's
        limit = limits.get(g.name)
        entries = list(table)
        if entries and fresh_ids(entries, (), limit):
            out[g.name] = entries  # every entry an id in range, none twice: the fast check
            continue
        names = names or InputNames(cacheable)
        what = names.tables[g.name]
        for pos, entry in enumerate(entries):
            if entry is not None and (  # ``None`` names no block
                type(entry) is not int or entry < 0 or (limit is not None and entry >= limit)
            ):
                entries[pos] = check_entry(entry, pos, rid, limit, what)  # converts or raises
        out[g.name] = entries
        check_distinct(entries, rid, group=names.groups[g.name])
    return out


def check_hashes(
    cacheable: Sequence[KVCacheGroup],
    rid: str,
    state: GroupedRequest | None,
    hashes: GroupHashes,
    args: Mapping[str, str],
) -> list[Sequence[BlockHash]]:
    """Check one hash list per cacheable group, grown from what ``state`` knows (none:
    from nothing) by the one-group rule (`grown_hashes()`; ``args``: `hashes_args()`);
    per group in order, its new hashes."""
    out: list[Sequence[BlockHash]] = []
    if state is None:
        for g in cacheable:
            name = g.name
            new = hashes.get(name)
            if new is None:
                raise InvalidInputError(f"request {rid!r}: no block hashes for group {name!r}")
            out.append(grown_hashes((), new, rid, args[name]))
        return out
    for name, lane in state.lanes.items():  # the cacheable groups' lanes, in order
        new = hashes.get(name)
        if new is None:
            raise InvalidInputError(f"request {rid!r}: no block hashes for group {name!r}")
        out.append(grown_hashes(lane.hashes, new, rid, args[name]))
    return out


def load_destinations(
    rid: str,
    state: GroupedRequest,
    tables: Mapping[str, list[int | None]],
    names: InputNames,
    cut: Mapping[str, int] | None = None,
) -> dict[str, list[int]]:
    """Per group, the GPU block ids the pinned blocks load into (checked tables; ``names``:
    how the messages name them): all of each lane's pin, or with ``cut`` (a load shorter
    than the hit), per group, how many of its first pinned blocks.

    Raises:
        BlockTableError: a destination entry is missing or ``None``, or differs from the
            table `update()` was given (`check_agrees()`, the one-group rule).
    """
    dests: dict[str, list[int]] = {}
    for name, lane in state.lanes.items():
        table = tables[name]
        what = names.tables[name]
        start = lane.pin_start
        n = len(lane.pin or ()) if cut is None else cut[name]
        check_load_span(len(table), start, n, rid, names.groups[name])
        ids: list[int] = []
        for pos in range(start, start + n):
            entry = table[pos]
            if entry is None:
                group = names.groups[name]
                where = "" if group is None else f"group {group!r}: "
                raise BlockTableError(
                    f"request {rid!r}: {where}no GPU block at position {pos} to load into"
                )
            ids.append(entry)
        check_agrees(lane.table, table, range(start, start + n), rid, what)
        dests[name] = ids
    return dests
