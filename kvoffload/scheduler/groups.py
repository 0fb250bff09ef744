"""`GroupedScheduler`: store and load decisions for a model with several KV cache groups.

Each group is a *lane*: its own `CpuBlockPool` and its own `BlockLedger` (the one owner
of that pool's references), so DESIGN.md invariants 1-3 and 6 hold per group by
construction. The coordinator keeps, per request, one block table and one hash list per
group, and applies the rules of `kvoffload.groups`:

* a lookup's hit is the largest ``N``, a multiple of the LCM of the block sizes, at most
  the prompt's length - 1, for which **every** group has every block of
  ``needed(g, N)`` published (one ``N`` for all groups; a multi-group store is visible
  only once every group stored its part: atomic commit by rule);
* stores: a full group stores every full block (the eager cursor); the other kinds store
  only at *store points* (every multiple of ``checkpoint_tokens``, and the request's
  computed length at `finish()`), only the blocks of ``needed(g, point)`` and only those
  whose table entry is not ``None`` (``None``: the engine no longer holds the block) and
  is known to hold the request's KV (an entry below the blocks a load wrote or the
  engine's prefix holds is never stored, whatever the table names there). A deferred
  store point is planned again from the table as it is then: an entry that became
  ``None`` is not stored. `preempt()` stores nothing (the engine freed the blocks);
* loads: exactly the blocks of ``needed(g, N)`` above the engine's own prefix;
* a table naming one GPU block twice is refused, as with one group (`check_distinct()`).

* a request's retention priority applies to its blocks in every group (`set_priority()`),
  and `retain()` holds exactly the blocks a lookup of a prefix needs, in every group.

`KVOffloader` keeps `OffloadScheduler` for a single full-attention model; the vLLM
connector's one scheduler side runs every model on this class, one group included.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, KeysView, Mapping, Sequence
from typing import final

from kvoffload.config import OffloadConfig
from kvoffload.errors import (
    ConfigError,
    InvalidInputError,
)
from kvoffload.groups import (
    KVCacheGroup,
    check_groups,
    default_checkpoint_tokens,
    hit_alignment,
)
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler.group_flight import LoadsInFlight
from kvoffload.scheduler.group_loads import (
    GroupLookupExtension,
    check_ledgers,
    check_request,
    check_shorter_load,
)
from kvoffload.scheduler.group_lookup import GroupLookups
from kvoffload.scheduler.group_retain import release_groups, retain_groups
from kvoffload.scheduler.group_state import (
    GroupCounts,
    GroupedPlan,
    GroupHashes,
    GroupRequests,
    GroupStatistics,
    GroupTables,
    check_tables,
)
from kvoffload.scheduler.group_stores import CacheViews, GroupStorePlanner
from kvoffload.scheduler.group_totals import GroupCounters, PlanParts
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.misses import MissReason
from kvoffload.scheduler.requests import as_int
from kvoffload.scheduler.state import RequestPhase, check_move
from kvoffload.scheduler.stats import Counters
from kvoffload.transfer.plan import LoadPlan, TransferPlan

__all__ = ["GroupStatistics", "GroupedPlan", "GroupedScheduler"]

# read as module globals: an Enum member looked up on its class is a Python-level call
_PREEMPTED, _DRAINING = RequestPhase.PREEMPTED, RequestPhase.DRAINING


def _check_setup(
    groups: Sequence[KVCacheGroup],
    pools: Mapping[str, CpuBlockPool],
    checkpoint_tokens: int | None,
    num_gpu_blocks: Mapping[str, int],
) -> int:
    """Check the groups, pools, GPU block counts and store-point spacing; the spacing."""
    align = check_groups(groups)
    cacheable = [g.name for g in groups if g.cacheable]
    missing = [name for name in cacheable if name not in pools]
    if missing:
        raise ConfigError(f"no CPU block pool for the cacheable groups {missing}")
    owner: dict[int, str] = {}
    for name in cacheable:
        first = owner.setdefault(id(pools[name]), name)
        if first != name:
            raise ConfigError(
                f"pools: groups {first!r} and {name!r} are given one CpuBlockPool; each "
                "cacheable group needs a pool of its own (their blocks and keys differ)"
            )
    names = [g.name for g in groups]
    for name, n in num_gpu_blocks.items():
        if name not in names:
            raise ConfigError(f"num_gpu_blocks names {name!r}, not a group (groups {names})")
        if type(n) is not int or n < 1:
            raise ConfigError(
                f"num_gpu_blocks[{name!r}]={n!r} must be a positive int (the group's GPU "
                "block count)"
            )
    if checkpoint_tokens is None:
        checkpoint_tokens = default_checkpoint_tokens(groups)
    if type(checkpoint_tokens) is not int or checkpoint_tokens < 1 or checkpoint_tokens % align:
        raise ConfigError(
            f"checkpoint_tokens={checkpoint_tokens!r} must be a positive multiple of the "
            f"hit alignment {align} (the LCM of the groups' block sizes), an int (got "
            f"{type(checkpoint_tokens).__name__})"
        )
    return checkpoint_tokens


def _ledger_of(ledgers: Mapping[str, BlockLedger], group: str) -> BlockLedger:
    """The ledger of cacheable group ``group`` (`InvalidInputError`: none)."""
    ledger = ledgers.get(group)
    if ledger is None:
        raise InvalidInputError(
            f"group={group!r} is not a cacheable group (they are {list(ledgers)})"
        )
    return ledger


@final
class GroupedScheduler:
    """Decides what to store and load for every group of a multi-group model.

    Args:
        groups: the model's groups, in order; names unique.
        pools: one CPU block pool per cacheable group name.
        checkpoint_tokens: spacing of store points, a multiple of the hit alignment
            (``None``: `default_checkpoint_tokens()`).
        num_gpu_blocks: per group name, the engine's GPU block count, a positive int
            (table entries must lie in ``[0, n)``; a group not named accepts any id >= 0).
        config: the store settings it honours, with their one-group meaning, per group
            pool: ``max_store_blocks_per_step`` (each group's plan of one call holds at
            most that many blocks, so one full group and two identical ones plan alike)
            and ``store_admission`` (one filter per group), ``restore_evicted`` (a
            live request's blocks evicted from a group's pool are stored again from its
            GPU blocks), ``hold_blocks_on_finish`` with ``hold_max_blocks`` (per group
            pool) and ``hold_max_steps`` (see `finish()`), and lazy stores (`plan_stores()`).
            ``None``: no limit, every block admitted, nothing restored, nothing held.
        store_at_finish: `finish()` plans the last store point (the engine keeps those GPU
            blocks until it completes); ``False``: nothing (one group's contract).

    Call it from one thread; every method is synchronous. A refused call changes nothing.

    Raises:
        ConfigError: groups `check_groups()` refuses, a cacheable group without a pool of
            its own, a GPU block count not a positive int or for no group, or a
            ``checkpoint_tokens`` not a positive int multiple of the alignment, lazy stores
            with a group not full attention, or a ``max_store_blocks_per_step`` below the
            blocks of a group's store point.
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        pools: Mapping[str, CpuBlockPool],
        *,
        checkpoint_tokens: int | None = None,
        num_gpu_blocks: Mapping[str, int] | None = None,
        config: OffloadConfig | None = None,
        store_at_finish: bool = True,
    ) -> None:
        self._groups = tuple(groups)
        self._cacheable = tuple(g for g in groups if g.cacheable)
        self._limits = dict(num_gpu_blocks or {})
        checkpoint_tokens = _check_setup(groups, pools, checkpoint_tokens, self._limits)
        self._align = hit_alignment(groups)
        self._checkpoint = checkpoint_tokens
        self._store_at_finish = store_at_finish
        self._ledgers = {g.name: BlockLedger(pools[g.name]) for g in self._cacheable}
        self._table = GroupRequests(
            self._cacheable,
            limits=self._limits,
            every_entry=config is not None and config.restore_evicted,
        )
        self._requests = self._table.requests
        self._counts = {
            g.name: GroupCounts(Counters(g.block_size, g.bytes_per_block)) for g in self._cacheable
        }
        self._loads = LoadsInFlight(self._cacheable, self._ledgers, self._counts, self._table)
        self.abandoned_loads = 0
        """Loads their request abandoned while the copy was in flight (`abandon_load()`)."""
        self._lookups = GroupLookups(
            self._cacheable,
            self._ledgers,
            self._counts,
            self._table,
            self._loads,
            self._align,
            checkpoint_tokens,
        )
        self._plans = PlanParts(self._lookups.totals)
        """The whole model's count of plans (`totals`), kept per plan of several parts."""
        self._planner = GroupStorePlanner(
            self._cacheable,
            self._ledgers,
            self._counts,
            self._requests,
            align=self._align,
            checkpoint=checkpoint_tokens,
            config=config,
            priorities=self._table.priorities,
            names=self._table.names,
        )

    def __repr__(self) -> str:
        return (
            f"GroupedScheduler(groups={[g.name for g in self._groups]}, "
            f"requests={len(self._requests)}, in_flight={self.num_in_flight})"
        )

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        """The groups, in order."""
        return self._groups

    @property
    def hit_alignment(self) -> int:
        """Hits are multiples of this many tokens (the LCM of the block sizes)."""
        return self._align

    @property
    def checkpoint_tokens(self) -> int:
        """Spacing of the store points."""
        return self._checkpoint

    def ledger(self, group: str) -> BlockLedger:
        """The ledger of ``group``'s pool (the tiers take its references through it)."""
        return self._ledgers[group]

    @property
    def totals(self) -> GroupCounters:
        """The whole model's counters (per group: `counters()`): its lookups and the
        plans `plan_load()` and `plan_stores()` made, each counted once however many
        groups it spans; a caller that runs the transfers counts how each ended
        (`GroupCounters.ended()`)."""
        return self._lookups.totals

    def counters(self, group: str) -> Counters:
        """The running counters of cacheable group ``group`` (its statistics' source)."""
        return self._counts[group].counters

    @property
    def deferred_steps(self) -> int:
        """``plan_stores`` and ``finish`` calls that deferred anything in some group (per
        group: `GroupStatistics.deferred_steps`; counted by `GroupStorePlanner`)."""
        return self._planner.deferred_steps

    @property
    def extension(self) -> GroupLookupExtension | None:
        """Asked after every lookup (the groups' tiers, `kvoffload.tiers.groups`)."""
        return self._lookups.extension

    @extension.setter
    def extension(self, extension: GroupLookupExtension | None) -> None:
        self._lookups.extension = extension

    @property
    def clock(self) -> Callable[[], float]:
        """The clock of the deferral deadline (a test may drive its own)."""
        return self._lookups.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._lookups.clock = clock

    @property
    def deferrals_bounded(self) -> int:
        """Lookups that answered with the CPU hit instead of "ask again": the request's
        run of those answers reached its bound (`deferral_spent()`)."""
        return self._lookups.deferrals_bounded

    @property
    def num_in_flight(self) -> int:
        """Plans in flight over all groups."""
        return sum(ledger.num_plans for ledger in self._ledgers.values())

    def has_request(self, request_id: str) -> bool:
        """Whether state is kept for ``request_id``."""
        return request_id in self._requests

    def was_finished(self, request_id: str) -> bool:
        """Whether ``request_id`` is one of the last ``FINISHED_IDS_REMEMBERED`` finished
        (every call naming it raises `RequestStateError`, as with one group)."""
        return self._table.finished.was_finished(request_id)

    @property
    def request_table(self) -> GroupRequests:
        """The request states and the finished ids they refuse (`GroupRequests`)."""
        return self._table

    @property
    def request_ids(self) -> KeysView[str]:
        """The ids state is kept for: live requests, and finished ones whose copies are
        in flight or whose blocks are held (`OffloadScheduler`'s ``live_requests``)."""
        return self._requests.keys()

    # -- requests --------------------------------------------------------------------------

    def set_priority(self, request_id: str, priority: int) -> None:
        """Give ``request_id`` (registered on first use) a retention priority, as
        `OffloadScheduler.set_priority()` does, in every group: its blocks are published
        and its hits touched with it in each group's pool.

        Raises:
            InvalidInputError: not an int in [0, `MAX_PRIORITY`] (InputTypeError: a float).
            RequestStateError: the request is finished.
        """
        self._table.set_priority(request_id, priority)

    def reserve(self, request_id: str) -> None:
        """Register ``request_id`` before its first call (a handle does), so a second
        handle for it is refused instead of sharing its state.

        Raises:
            RequestStateError: the id is in use (registered and not dropped yet) or
                finished.
        """
        self._table.reserve(request_id)

    def retain(
        self, block_hashes: GroupHashes, owner: Hashable, *, fit: bool = False
    ) -> tuple[int, bool]:
        """Retain a prefix's blocks in every group for ``owner`` until
        `release_retained()`: exactly what a lookup of it needs (`retain_groups()`).

        Returns:
            The blocks held for it, all groups together, and whether that is the whole
            prefix.
        """
        return retain_groups(
            self._cacheable, self._ledgers, block_hashes, owner, align=self._align, fit=fit
        )

    def release_retained(self, owner: Hashable) -> int:
        """Release what ``owner`` retains in every group (`release_groups()`)."""
        return release_groups(self._ledgers, owner)

    def update(
        self,
        request_id: str,
        tables: GroupTables,
        block_hashes: GroupHashes,
        num_computed_tokens: int,
    ) -> None:
        """Tell the scheduler what the engine holds for a request after a step.

        Args:
            request_id: the engine's id (registered on first use).
            tables: per group, the request's whole GPU block table; ``None`` entries are
                blocks the engine does not hold (out of window, padding, freed). An entry
                that became ``None`` is never stored afterwards, nor one below what the
                request's load or prefix wrote (`note_load()`: it is ignored).
            block_hashes: per group, the hashes of its full blocks (`KVCacheGroup.namespace()`);
                more than a block behind the computed tokens: `UnhashedBlocksWarning`, once.
            num_computed_tokens: tokens whose KV is computed.

        Raises:
            RequestStateError: the request is finished.
            BlockTableError: a missing table, an id out of range, or one GPU block
                named twice in a group's table.
            InvalidInputError: a negative count, missing or changed hashes.
            InputTypeError: an entry not an int or ``None``; a float or bool count.
        """
        self._table.update(request_id, tables, block_hashes, num_computed_tokens)

    # -- lookup and loads ------------------------------------------------------------------

    def lookup(
        self,
        request_id: str,
        block_hashes: GroupHashes,
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: bool = False,
        no_read: bool = False,
    ) -> int | None:
        """How many tokens past the engine's own prefix can be loaded, valid for every group.

        The hit is ``N - num_computed_tokens`` for the largest ``N`` with ``N % alignment
        == 0``, ``num_computed_tokens <= N <= num_tokens - 1`` and every block of
        ``needed(g, N)`` above the engine's prefix published in every group. Those blocks
        are pinned, per group, until `plan_load()` or `release()`. Then ``extension`` (the
        tiers) may start bringing in a longer hit for a later lookup.

        With ``allow_defer``, ``None`` (nothing pinned) when `lookup_defers_grouped()` says
        "ask again later". With ``no_read`` (the request must not read the cache), 0 and
        nothing pinned, the miss read as `MissReason.NOT_READ`, as with one group.

        Raises:
            RequestStateError: the request is finished.
            InvalidInputError: counts out of range or ``num_computed_tokens`` not a
                multiple of the alignment; hashes missing for a group (InputTypeError:
                a float or bool count).
        """
        return self._lookups.lookup(
            request_id, block_hashes, num_tokens, num_computed_tokens, allow_defer, no_read
        )

    def miss_reason(self, request_id: str) -> MissReason:
        """The `MissReason` of ``request_id``'s last lookup (`UnknownRequestError`: none)."""
        return self._table.known(request_id).miss_reason

    def lookup_outcome(self, request_id: str) -> tuple[MissReason, bool, dict[str, int] | None]:
        """Of ``request_id``'s last lookup: its `MissReason`, whether it was the first
        since the request was registered or preempted (its prompt tokens are counted
        then, once, as with one group), and the tokens of its hit each tier promoted
        (``None``: none). Raises `UnknownRequestError` when there was none."""
        state = self._table.known(request_id)
        return state.miss_reason, state.new_prompt, state.tier_hits

    def release(self, request_id: str) -> None:
        """Drop the pins of ``request_id``'s last lookup (in every group).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: the request finished and was forgotten.
        """
        self._lookups.release(request_id)

    def plan_load(
        self, request_id: str, tables: GroupTables, num_tokens: int
    ) -> GroupedPlan | None:
        """Plan the load of the last lookup's hit into the engine's per-group tables.

        Args:
            request_id: the request.
            tables: per group, the request's whole GPU block table; every destination
                entry (the blocks of ``needed(g, N)`` above the engine's prefix) must be an
                id, not ``None``.
            num_tokens: the lookup's hit, 0 (release the pins), or less: see
                `check_shorter_load()` (every cacheable group full attention).

        Returns:
            One plan per group with blocks to load, or ``None`` when ``num_tokens`` is 0.

        Raises:
            UnknownRequestError: no state for that id.
            InvalidInputError: ``num_tokens`` refused by `check_shorter_load()`
                (InputTypeError: a float).
            BlockTableError: a destination entry missing or ``None``, or a table as
                `update()` refuses it.
        """
        num_tokens = as_int(num_tokens, "num_tokens", request_id)
        state = self._table.live(request_id)
        hit = 0 if state.hit is None else state.hit - state.hit_from
        if num_tokens == 0:
            self.release(request_id)
            return None
        cut = None if num_tokens == hit else check_shorter_load(self._cacheable, state, num_tokens)
        checked = check_tables(self._cacheable, self._limits, request_id, tables, self._table.names)
        plans = self._loads.open(state, checked, num_tokens, cut)
        state.hit = None
        if not plans:
            return None
        self._plans.opened("load", plans)
        return GroupedPlan("load", plans)

    def abandon_load(self, request_id: str) -> dict[str, list[LoadPlan]]:
        """Stop waiting for ``request_id``'s loads in flight, in every group at once (see
        `abandon_grouped()`): its lookup pins
        are released; each group's part is marked abandoned (its CPU blocks stay
        referenced until `complete()`, which counts nothing for it); the tables from each
        group's first abandoned block on are forgotten and the computed tokens go back to
        the engine's prefix (the request recomputes, maybe into other GPU blocks). A
        finished request whose load was in flight is forgotten at once.

        Returns:
            Per group with a load abandoned now, its plans, oldest first (empty without
            a load in flight).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: the id finished and was forgotten.
        """
        state = self._table.known(request_id)
        self.release(request_id)
        abandoned = self._loads.abandon(state)
        if abandoned:
            # one load is one plan in every cacheable group (every group needs a block of
            # any hit above the prefix), so the longest list counts the loads
            self.abandoned_loads += max(len(plans) for plans in abandoned.values())
        self._table.drop_if_done(state)
        return abandoned

    # -- stores ----------------------------------------------------------------------------

    def plan_stores(self, gpu_cache: CacheViews | None = None) -> GroupedPlan | None:
        """Plan this step's stores for every live request and group, as one batch.

        A group whose pool has no room defers the rest of its points (the cursor stays on
        the last point planned); a deferred point is planned later from the table as it
        is then. Finished requests' holds are planned too (their last point included),
        and given up after ``hold_max_steps`` calls. With ``store_mode="lazy"`` each group
        stores from its view in ``gpu_cache`` instead (`GroupStorePlanner.plan_lazy()`).

        Returns:
            One store plan per group with blocks to store, or ``None``.
        """
        planner = self._planner
        planner.plan_calls += 1
        live = [
            s
            for s in self._requests.values()
            if (not s.finished or s.holding) and not s.recheck_table
        ]
        plan = planner.plan(live, False, gpu_cache)
        if plan is not None:
            self._plans.opened("store", plan.plans)
        if planner.holds is not None:  # without holds no finished request was planned
            for state in live:
                if state.finished:
                    self._table.drop_if_done(state)  # a hold the plan ended, or that expired
        return plan

    # -- finish, preempt, reset ------------------------------------------------------------

    def finish(self, request_id: str) -> GroupedPlan | None:
        """The engine finished ``request_id``: plan its last store point now.

        The returned plan stores the blocks of the request's computed length (rounded down
        to the alignment) that are not stored yet; the engine keeps those GPU blocks until
        the plan completes. Nothing is scheduled for the request afterwards.

        With ``hold_blocks_on_finish`` nothing is planned here (``None``), as with one
        group: each group's lane holds the GPU blocks of the points it computed and did
        not store (whole points from its cursor, within ``hold_max_blocks`` per group:
        `held_blocks()`); the engine keeps them until `take_released_holds()` returns
        them: a later `plan_stores()` planned them, or ``hold_max_steps`` calls passed.
        Lazy stores plan and hold nothing here, as with one group.

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it was already finished.
        """
        state = self._table.live(request_id, finishing=True)
        # asked before anything changes; `mark_finished()` makes the move (a hold begun
        # on the way makes the request read HOLDING: both follow the same phases)
        check_move(request_id, state.phase, _DRAINING)
        self.release(request_id)
        planner = self._planner
        plan = None
        # after a reset, a table not compared again: nothing held or stored from it
        if not state.recheck_table:
            if planner.holds is not None:
                planner.begin_hold(state)
            elif self._store_at_finish and not planner.lazy_window:  # lazy: none (one group too)
                plan = self._planner.plan([state], True)
                if plan is not None:
                    self._plans.opened("store", plan.plans)
        self._table.mark_finished(state)
        for name, lane in state.lanes.items():
            if not lane.held:
                planner.live.drop(name, lane, 0)
        self._table.drop_if_done(state)
        return plan

    def held_blocks(self, request_id: str) -> dict[str, list[int]]:
        """Per group, the GPU blocks finished ``request_id`` holds (none: ``{}``)."""
        return self._planner.held_blocks(self._requests.get(request_id))

    def take_released_holds(self) -> dict[str, list[int]]:
        """Per group, the GPU blocks whose hold ended since the last call (free them once
        no transfer in flight names them)."""
        return self._planner.take_released()

    def cancel_hold(self, request_id: str) -> None:
        """Undo the hold `finish()` just made (the engine could not keep the blocks; they
        are not reported by `take_released_holds()`)."""
        state = self._requests.get(request_id)
        if state is not None and state.holding:
            self._planner.expire(state, report=False)
            self._table.drop_if_done(state)

    def release_all_holds(self) -> None:
        """Give up every hold now (on close); their blocks stay unstored."""
        for state in [s for s in self._requests.values() if s.holding]:
            self._planner.expire(state)
            self._table.drop_if_done(state)

    def preempt(self, request_id: str) -> None:
        """The engine preempted ``request_id`` and freed its GPU blocks (it may reuse them
        at once), so nothing is stored from them: pins released, tables and cursors reset
        (a re-admitted request rescans), hashes kept; stores in flight run on (pinned).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it is finished.
        """
        state = self._table.live(request_id)
        # preempted until its next update; moved first: a refusal changes nothing
        state.move_to(_PREEMPTED)
        self.release(request_id)
        self._planner.live.forget(state)
        for lane in state.lanes.values():
            lane.table, lane.cursor, lane.valid_from = [], 0, 0
            lane.ids = set()
        state.num_computed_tokens = 0
        state.recheck_table = False  # no table left to compare again
        state.admitted = False  # a re-admission counts its prompt again, as with one group

    def reset(self) -> bool:
        """Empty every group's CPU prefix cache (plans in flight publish nothing); pins are
        released and cursors go back to 0.

        Returns:
            Whether no transfer is in flight any more.
        """
        self.release_all_holds()
        for state in self._requests.values():
            self.release(state.request_id)
            self._planner.live.forget(state)
            if not state.finished and any(lane.cursor for lane in state.lanes.values()):
                state.recheck_table = True  # its next update compares the whole tables
            for lane in state.lanes.values():
                lane.cursor = 0
        self._planner.live.reset()
        for ledger in self._ledgers.values():
            ledger.reset()
        return not self.num_in_flight

    # -- completion ------------------------------------------------------------------------

    def complete(self, group: str, plan: TransferPlan, ok: bool) -> bool:
        """Record the outcome of ``group``'s transfer (once per plan).

        A successful store publishes its blocks in that group (a prefix is findable only
        once every group it needs published); a failed load unpublishes its blocks.

        Returns:
            ``False`` when the plan is unknown or already completed, or is not
            ``group``'s (another group's plan of the same id: nothing changes).

        Raises:
            InvalidInputError: ``group`` is not a cacheable group.
        """
        ledger = _ledger_of(self._ledgers, group)
        rec = ledger.close(plan.plan_id, ok, plan)
        counters = self._counts[group].counters
        if rec is None:
            counters.ignored_completions += 1
            return False
        self._plans.ended(group, plan.plan_id)
        if plan.kind == "store":
            self._planner.records.pop((group, plan.plan_id))
        else:
            self._loads.completed(group, plan.plan_id)
        counters.completed(rec, ok=ok, current=rec.epoch == ledger.epoch)
        self._table.detach(group, plan)
        return True

    def complete_all(self, plan: GroupedPlan, ok: bool) -> None:
        """`complete()` every group's plan of ``plan`` with the same outcome."""
        for group, sub in plan.plans.items():
            self.complete(group, sub, ok)

    def cancel(self, group: str, plan: TransferPlan) -> bool:
        """Undo ``group``'s plan whose copy never started: a store's cursors go back (its
        blocks are planned again); a load's blocks become its request's lookup pin again
        once every group's part of that load was cancelled (`LoadsInFlight`: the same hit
        may be loaded again), or are released when that cannot be.

        Returns:
            ``False`` when the plan is unknown or already completed, or is not
            ``group``'s (another group's plan of the same id: nothing changes).

        Raises:
            InvalidInputError: ``group`` is not a cacheable group.
        """
        ledger = _ledger_of(self._ledgers, group)
        rec = ledger.cancel(plan.plan_id, plan)
        counters = self._counts[group].counters
        if rec is None:
            counters.ignored_completions += 1
            return False
        counters.cancelled_plans += 1
        self._plans.cancelled(group, plan.plan_id)
        if plan.kind == "store":
            counters.store_plans -= 1
            self._planner.cancel(group, plan.plan_id, rec.hashes, rec.epoch == ledger.epoch)
        else:
            self._loads.cancelled(group, rec, rec.epoch == ledger.epoch)
        self._table.detach(group, plan)
        return True

    # -- observation -----------------------------------------------------------------------

    def statistics(self) -> dict[str, GroupStatistics]:
        """Per cacheable group, a snapshot of its counters and pool."""
        held = self._planner.held_totals()
        return {n: self._counts[n].snapshot(ledger, held[n]) for n, ledger in self._ledgers.items()}

    def check_invariants(self) -> None:
        """Check every group's pool and ledger, then the cross-group rules: a request's
        pins cover exactly ``needed(g, N)`` above its prefix in every group for one ``N``;
        every in-flight store block is in ``needed(g, point)`` of its store point and its
        table entry was a block id; the requests' plans are the ledgers' plans.

        Raises:
            InvariantError: naming the group and the breach.
        """
        loads = self._loads
        check_ledgers(self._ledgers, self._requests.values(), loads.records, loads.parked())
        self._plans.check_invariants(self._ledgers)
        loads.check_invariants()
        self._table.priorities.check(self._requests.values())
        self._planner.check_invariants()
        groups = {g.name: g for g in self._cacheable}
        for state in self._requests.values():
            check_request(groups, state, self._align)
