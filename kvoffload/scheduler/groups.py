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
  computed length at `finish()` / `preempt()`), only the blocks of ``needed(g, point)``
  and only those whose table entry is not ``None`` (``None``: the engine no longer holds
  the block). A deferred store point is planned again from the table as it is then: an
  entry that became ``None`` is not stored;
* loads: exactly the blocks of ``needed(g, N)`` above the engine's own prefix.

A single full-attention model never uses this class: it keeps `OffloadScheduler`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import final

from kvoffload._logging import get_logger
from kvoffload.errors import (
    BlockTableError,
    ConfigError,
    InputTypeError,
    InvalidInputError,
    InvariantError,
    RequestStateError,
    UnknownRequestError,
)
from kvoffload.groups import (
    KVCacheGroup,
    default_checkpoint_tokens,
    hit_alignment,
    needed,
    store_points,
)
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.transfer.plan import TransferPlan

__all__ = ["GroupStatistics", "GroupedPlan", "GroupedScheduler"]

_log = get_logger("scheduler.groups")

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
    """One group's counters (a snapshot).

    Attributes:
        stored_blocks: blocks whose store completed and published.
        loaded_blocks: blocks whose load completed.
        skipped_null_blocks: blocks of a store point not stored: the table entry was
            ``None`` when planned (out of window, freed or reused).
        deferred_stores: store plans cut short because the group's pool had no free block.
        pinned_blocks: blocks pinned by lookups now.
        in_flight_plans: the group's plans in flight.
        num_cpu_blocks: the group's pool size.
        free_cpu_blocks: free blocks in the pool.
        cached_cpu_blocks: published blocks in the pool.
    """

    stored_blocks: int
    loaded_blocks: int
    skipped_null_blocks: int
    deferred_stores: int
    pinned_blocks: int
    in_flight_plans: int
    num_cpu_blocks: int
    free_cpu_blocks: int
    cached_cpu_blocks: int


@dataclass(slots=True, eq=False)
class _Lane:
    """One request's state in one group."""

    table: list[int | None] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    # full: blocks planned or skipped; other kinds: tokens of the last store point planned
    cursor: int = 0
    pin: list[CpuBlock] | None = None
    pin_start: int = 0


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    lanes: dict[str, _Lane]
    num_computed_tokens: int = 0
    hit: int | None = None
    hit_from: int = 0
    in_flight: set[tuple[str, int]] = field(default_factory=set)
    finished: bool = False


@dataclass(slots=True)
class _Counts:
    stored: int = 0
    loaded: int = 0
    skipped_null: int = 0
    deferred: int = 0


@dataclass(slots=True, eq=False)
class _StoreRecord:
    # (request id, block index, store point, cursor before) per block; cursors per request
    blocks: list[tuple[str, int, int]]
    cursors: dict[str, int]


@final
class GroupedScheduler:
    """Decides what to store and load for every group of a multi-group model.

    Args:
        groups: the model's groups, in order; names unique.
        pools: one CPU block pool per cacheable group name.
        checkpoint_tokens: spacing of store points, a multiple of the hit alignment
            (``None``: `default_checkpoint_tokens()`).
        num_gpu_blocks: per group name, the engine's GPU block count (table entries must
            lie in ``[0, n)``); a group not named accepts any non-negative id.

    Call it from one thread; every method is synchronous. A refused call changes nothing.

    Raises:
        ConfigError: duplicate names, a cacheable group without a pool, or a
            ``checkpoint_tokens`` that is not a multiple of the alignment.
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        pools: Mapping[str, CpuBlockPool],
        *,
        checkpoint_tokens: int | None = None,
        num_gpu_blocks: Mapping[str, int] | None = None,
    ) -> None:
        names = [g.name for g in groups]
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"group names must be unique and non-empty, got {names}")
        self._groups = tuple(groups)
        self._cacheable = tuple(g for g in groups if g.cacheable)
        missing = [g.name for g in self._cacheable if g.name not in pools]
        if missing:
            raise ConfigError(f"no CPU block pool for the cacheable groups {missing}")
        self._align = hit_alignment(groups)
        if checkpoint_tokens is None:
            checkpoint_tokens = default_checkpoint_tokens(groups)
        if checkpoint_tokens < 1 or checkpoint_tokens % self._align:
            raise ConfigError(
                f"checkpoint_tokens={checkpoint_tokens} must be a positive multiple of the "
                f"hit alignment {self._align} (the LCM of the groups' block sizes)"
            )
        self._checkpoint = checkpoint_tokens
        self._ledgers = {g.name: BlockLedger(pools[g.name]) for g in self._cacheable}
        self._limits = dict(num_gpu_blocks or {})
        self._requests: dict[str, _Request] = {}
        self._counts = {g.name: _Counts() for g in self._cacheable}
        self._stores: dict[tuple[str, int], _StoreRecord] = {}

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
    def num_in_flight(self) -> int:
        """Plans in flight over all groups."""
        return sum(ledger.num_plans for ledger in self._ledgers.values())

    def has_request(self, request_id: str) -> bool:
        """Whether state is kept for ``request_id``."""
        return request_id in self._requests

    # -- requests --------------------------------------------------------------------------

    def _state(self, request_id: str, *, live: bool = True) -> _Request:
        state = self._requests.get(request_id)
        if state is None:
            state = _Request(request_id, {g.name: _Lane() for g in self._cacheable})
            self._requests[request_id] = state
        elif live and state.finished:
            raise RequestStateError(f"request {request_id!r} is finished")
        return state

    def _check_tables(self, rid: str, tables: GroupTables) -> dict[str, list[int | None]]:
        out: dict[str, list[int | None]] = {}
        for g in self._cacheable:
            table = tables.get(g.name)
            if table is None:
                raise BlockTableError(f"request {rid!r}: no block table for group {g.name!r}")
            if isinstance(table, (str, bytes)) or not isinstance(table, Sequence):
                raise InputTypeError(
                    f"request {rid!r}: group {g.name!r}: block table must be a sequence"
                )
            limit = self._limits.get(g.name)
            for pos, entry in enumerate(table):
                if entry is None:
                    continue
                if type(entry) is not int:
                    raise InputTypeError(
                        f"request {rid!r}: group {g.name!r}: entry {pos} is {entry!r}, "
                        "not an int or None"
                    )
                if entry < 0 or (limit is not None and entry >= limit):
                    raise BlockTableError(
                        f"request {rid!r}: group {g.name!r}: GPU block id {entry} at "
                        f"position {pos} is out of range"
                    )
            out[g.name] = list(table)
        return out

    def _check_hashes(self, rid: str, state: _Request, hashes: GroupHashes) -> None:
        for g in self._cacheable:
            new = hashes.get(g.name)
            if new is None:
                raise InvalidInputError(f"request {rid!r}: no block hashes for group {g.name!r}")
            old = state.lanes[g.name].hashes
            if len(new) < len(old) or (old and new[len(old) - 1] != old[-1]):
                raise InvalidInputError(
                    f"request {rid!r}: group {g.name!r}: block hashes shrank or changed"
                )
            for h in new[len(old) :]:
                if not isinstance(h, bytes):
                    raise InputTypeError(
                        f"request {rid!r}: group {g.name!r}: a block hash is {type(h).__name__}"
                    )

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
                that became ``None`` is never stored afterwards.
            block_hashes: per group, the hashes of the request's full blocks so far (the
                group's namespace; `KVCacheGroup.namespace()`).
            num_computed_tokens: tokens whose KV is computed.

        Raises:
            RequestStateError: the request is finished.
            BlockTableError: a missing table or an id out of range.
            InvalidInputError: a negative count, missing or changed hashes.
            InputTypeError: an entry that is not an int or ``None``.
        """
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            raise InvalidInputError(
                f"request {request_id!r}: num_computed_tokens={num_computed_tokens!r}"
            )
        existing = self._requests.get(request_id)
        if existing is not None and existing.finished:
            raise RequestStateError(f"request {request_id!r} is finished")
        checked = self._check_tables(request_id, tables)
        probe = existing or _Request(request_id, {g.name: _Lane() for g in self._cacheable})
        self._check_hashes(request_id, probe, block_hashes)
        state = self._state(request_id)
        for name, lane in state.lanes.items():
            lane.table = checked[name]
            lane.hashes = list(block_hashes[name])
        state.num_computed_tokens = num_computed_tokens

    # -- lookup and loads ------------------------------------------------------------------

    def _load_range(self, g: KVCacheGroup, n: int, computed: int) -> range:
        span = needed(g, n)
        return range(max(span.start, computed // g.block_size), span.stop)

    def _valid(self, n: int, computed: int, lanes: Mapping[str, Sequence[BlockHash]]) -> bool:
        for g in self._cacheable:
            hashes = lanes[g.name]
            get = self._ledgers[g.name].pool.get_cached
            span = self._load_range(g, n, computed)
            if span.stop > len(hashes):
                return False
            for i in span:
                if get(hashes[i]) is None:
                    return False
        return True

    def lookup(
        self,
        request_id: str,
        block_hashes: GroupHashes,
        num_tokens: int,
        num_computed_tokens: int = 0,
    ) -> int:
        """How many tokens past the engine's own prefix can be loaded, valid for every group.

        The hit is ``N - num_computed_tokens`` for the largest ``N`` with ``N % alignment
        == 0``, ``num_computed_tokens <= N <= num_tokens - 1`` and every block of
        ``needed(g, N)`` above the engine's prefix published in every group. Those blocks
        are pinned, per group, until `plan_load()` or `release()`.

        Raises:
            RequestStateError: the request is finished.
            InvalidInputError: counts out of range or ``num_computed_tokens`` not a
                multiple of the alignment; hashes missing for a group.
        """
        align = self._align
        if (
            type(num_tokens) is not int
            or type(num_computed_tokens) is not int
            or num_computed_tokens < 0
            or num_computed_tokens % align
            or num_tokens < num_computed_tokens
        ):
            raise InvalidInputError(
                f"request {request_id!r}: num_tokens={num_tokens!r} and "
                f"num_computed_tokens={num_computed_tokens!r} (a multiple of {align}, "
                "at most num_tokens) are out of range"
            )
        probe = _Request(request_id, {g.name: _Lane() for g in self._cacheable})
        self._check_hashes(request_id, probe, block_hashes)
        state = self._state(request_id)
        self.release(request_id)
        lanes = {g.name: block_hashes[g.name] for g in self._cacheable}
        cap = max(0, num_tokens - 1) // align * align
        for g in self._cacheable:  # a full group's leading run bounds N at once
            if g.kind == "full":
                get = self._ledgers[g.name].pool.get_cached
                hashes = lanes[g.name]
                i = num_computed_tokens // g.block_size
                end = min(len(hashes), cap // g.block_size)
                while i < end and get(hashes[i]) is not None:
                    i += 1
                cap = min(cap, i * g.block_size // align * align)
        n = cap
        while n > num_computed_tokens and not self._valid(n, num_computed_tokens, lanes):
            n -= align
        if n <= num_computed_tokens:
            return 0
        for g in self._cacheable:
            span = self._load_range(g, n, num_computed_tokens)
            pool = self._ledgers[g.name].pool
            blocks = [pool.get_cached(lanes[g.name][i]) for i in span]
            pinned = [b for b in blocks if b is not None]
            if len(pinned) != len(blocks):  # _valid() just checked every one
                raise InvariantError(f"group {g.name!r}: a checked block vanished")
            self._ledgers[g.name].pin(pinned)
            lane = state.lanes[g.name]
            lane.pin, lane.pin_start = pinned, span.start
        state.hit, state.hit_from = n, num_computed_tokens
        return n - num_computed_tokens

    def release(self, request_id: str) -> None:
        """Drop the pins of ``request_id``'s last lookup (in every group)."""
        state = self._requests.get(request_id)
        if state is None:
            return
        for name, lane in state.lanes.items():
            if lane.pin is not None:
                self._ledgers[name].unpin(lane.pin)
                lane.pin = None
        state.hit = None

    def plan_load(
        self, request_id: str, tables: GroupTables, num_tokens: int
    ) -> GroupedPlan | None:
        """Plan the load of the last lookup's hit into the engine's per-group tables.

        Args:
            request_id: the request.
            tables: per group, the request's whole GPU block table; every destination
                entry (the blocks of ``needed(g, N)`` above the engine's prefix) must be an
                id, not ``None``.
            num_tokens: the lookup's hit, or 0 (release the pins). A shorter hit would
                need other blocks in a windowed group: look up again instead.

        Returns:
            One plan per group with blocks to load, or ``None`` when ``num_tokens`` is 0.

        Raises:
            UnknownRequestError: no state for that id.
            InvalidInputError: ``num_tokens`` is neither 0 nor the hit.
            BlockTableError: a destination entry missing or ``None``.
        """
        state = self._requests.get(request_id)
        if state is None:
            raise UnknownRequestError(request_id)
        if state.finished:
            raise RequestStateError(f"request {request_id!r} is finished")
        hit = 0 if state.hit is None else state.hit - state.hit_from
        if num_tokens == 0:
            self.release(request_id)
            return None
        if num_tokens != hit:
            raise InvalidInputError(
                f"request {request_id!r}: num_tokens={num_tokens!r} must be 0 or the "
                f"lookup's hit {hit}"
            )
        checked = self._check_tables(request_id, tables)
        dests: dict[str, list[int]] = {}
        for name, lane in state.lanes.items():
            pin = lane.pin or []
            table = checked[name]
            ids: list[int] = []
            for k in range(len(pin)):
                pos = lane.pin_start + k
                entry = table[pos] if pos < len(table) else None
                if entry is None:
                    raise BlockTableError(
                        f"request {request_id!r}: group {name!r}: no GPU block at "
                        f"position {pos} to load into"
                    )
                ids.append(entry)
            dests[name] = ids
        plans: dict[str, TransferPlan] = {}
        for name, lane in state.lanes.items():
            pinned = lane.pin
            lane.pin = None
            if pinned is None:
                continue
            plan, _ = self._ledgers[name].open_load(
                pinned, len(pinned), dests[name], request_id, num_tokens
            )
            if plan is not None:
                plans[name] = plan
                state.in_flight.add((name, plan.plan_id))
        state.hit = None
        return GroupedPlan("load", plans) if plans else None

    # -- stores ----------------------------------------------------------------------------

    def _scan(
        self, state: _Request, name: str, g: KVCacheGroup, final: bool
    ) -> list[tuple[int, int]]:
        """(block index, store point) of the blocks to store for one request and group,
        up to the last point planned; skips null entries, cached and pending blocks."""
        lane = state.lanes[name]
        ledger = self._ledgers[name]
        is_cached, pending = ledger.pool.is_cached, ledger.pending
        counts = self._counts[name]
        limit = min(len(lane.table), len(lane.hashes))
        out: list[tuple[int, int]] = []
        computed = state.num_computed_tokens
        if g.kind == "full":
            for i in range(lane.cursor, min(limit, computed // g.block_size)):
                if lane.table[i] is None:
                    counts.skipped_null += 1
                elif not is_cached(lane.hashes[i]) and lane.hashes[i] not in pending:
                    out.append((i, (i + 1) * g.block_size))
            return out
        points = list(store_points(lane.cursor, computed, self._checkpoint))
        last = computed // self._align * self._align
        if final and last > lane.cursor and (not points or points[-1] != last):
            points.append(last)
        seen: set[int] = set()
        for point in points:
            for i in needed(g, point):
                if i in seen:
                    continue
                seen.add(i)
                if i >= limit or lane.table[i] is None:
                    counts.skipped_null += 1
                elif not is_cached(lane.hashes[i]) and lane.hashes[i] not in pending:
                    out.append((i, point))
        return out

    def _plan_stores(self, states: Sequence[_Request], final: bool) -> GroupedPlan | None:
        plans: dict[str, TransferPlan] = {}
        for g in self._cacheable:
            name = g.name
            ledger = self._ledgers[name]
            hashes: list[BlockHash] = []
            gpu: list[int] = []
            rec = _StoreRecord([], {})
            free = ledger.pool.num_free
            batch: set[BlockHash] = set()
            for state in states:
                lane = state.lanes[name]
                wanted = self._scan(state, name, g, final)
                wanted = [w for w in wanted if lane.hashes[w[0]] not in batch]
                rec.cursors[state.request_id] = lane.cursor
                room = free - len(hashes)
                if len(wanted) > room:
                    # a store point is planned whole, or deferred with every later one
                    cut = wanted[room][1]
                    wanted = [w for w in wanted if w[1] < cut]
                    if g.kind == "full":
                        new = cut // g.block_size - 1
                    else:
                        new = (cut - 1) // self._checkpoint * self._checkpoint
                    self._counts[name].deferred += 1
                    _log.debug("store_deferred", group=name, request_id=state.request_id)
                else:
                    new = self._advance(g, state, final)
                for i, point in wanted:
                    entry = lane.table[i]
                    if entry is None:  # _scan() skipped these
                        raise InvariantError(f"group {name!r}: a null entry was planned")
                    hashes.append(lane.hashes[i])
                    batch.add(lane.hashes[i])
                    gpu.append(entry)
                    rec.blocks.append((state.request_id, i, point))
                lane.cursor = max(lane.cursor, new)
            if not hashes:
                continue
            plan = ledger.open_store(
                hashes,
                gpu,
                tuple(dict.fromkeys(r for r, _, _ in rec.blocks)),
                protect=set(),
                evicted=[],
                ends=None,
            )
            plans[name] = plan
            self._stores[(name, plan.plan_id)] = rec
            for rid in plan.request_ids:
                self._requests[rid].in_flight.add((name, plan.plan_id))
        return GroupedPlan("store", plans) if plans else None

    def _advance(self, g: KVCacheGroup, state: _Request, final: bool) -> int:
        lane = state.lanes[g.name]
        computed = state.num_computed_tokens
        if g.kind == "full":
            return max(
                lane.cursor, min(len(lane.table), len(lane.hashes), computed // g.block_size)
            )
        if final:
            return computed // self._align * self._align
        return computed // self._checkpoint * self._checkpoint

    def plan_stores(self) -> GroupedPlan | None:
        """Plan this step's stores for every live request and group, as one batch.

        A group whose pool has no room defers the rest of its points (the cursor stays on
        the last point planned); a deferred point is planned later from the table as it
        is then.

        Returns:
            One store plan per group with blocks to store, or ``None``.
        """
        live = [s for s in self._requests.values() if not s.finished]
        return self._plan_stores(live, final=False)

    # -- finish, preempt, reset ------------------------------------------------------------

    def finish(self, request_id: str) -> GroupedPlan | None:
        """The engine finished ``request_id``: plan its last store point now.

        The returned plan stores the blocks of the request's computed length (rounded down
        to the alignment) that are not stored yet; the engine keeps those GPU blocks until
        the plan completes. Nothing is scheduled for the request afterwards.

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it was already finished.
        """
        state = self._requests.get(request_id)
        if state is None:
            raise UnknownRequestError(request_id)
        if state.finished:
            raise RequestStateError(f"request {request_id!r} is already finished")
        self.release(request_id)
        plan = self._plan_stores([state], final=True)
        state.finished = True
        self._drop_if_done(state)
        return plan

    def preempt(self, request_id: str) -> GroupedPlan | None:
        """The engine preempted ``request_id``: plan its last store point now (as in
        `finish()`), then reset its tables and cursors (a re-admitted request rescans)."""
        state = self._requests.get(request_id)
        if state is None:
            raise UnknownRequestError(request_id)
        if state.finished:
            raise RequestStateError(f"request {request_id!r} is finished")
        self.release(request_id)
        plan = self._plan_stores([state], final=True)
        for lane in state.lanes.values():
            lane.table, lane.cursor = [], 0
        state.num_computed_tokens = 0
        return plan

    def reset(self) -> bool:
        """Empty every group's CPU prefix cache (plans in flight publish nothing); pins are
        released and cursors go back to 0.

        Returns:
            Whether no transfer is in flight any more.
        """
        for state in self._requests.values():
            self.release(state.request_id)
            for lane in state.lanes.values():
                lane.cursor = 0
        for ledger in self._ledgers.values():
            ledger.reset()
        return not self.num_in_flight

    def _drop_if_done(self, state: _Request) -> None:
        if state.finished and not state.in_flight:
            del self._requests[state.request_id]

    # -- completion ------------------------------------------------------------------------

    def complete(self, group: str, plan: TransferPlan, ok: bool) -> bool:
        """Record the outcome of ``group``'s transfer (once per plan).

        A successful store publishes its blocks in that group (a prefix is findable only
        once every group it needs published); a failed load unpublishes its blocks.

        Returns:
            ``False`` when the plan is unknown or already completed.
        """
        ledger = self._ledgers[group]
        rec = ledger.close(plan.plan_id, ok)
        if rec is None:
            return False
        counts = self._counts[group]
        if plan.kind == "store":
            self._stores.pop((group, plan.plan_id))
            counts.stored += rec.published
        elif ok:
            counts.loaded += len(rec.blocks)
        self._detach(group, plan)
        return True

    def complete_all(self, plan: GroupedPlan, ok: bool) -> None:
        """`complete()` every group's plan of ``plan`` with the same outcome."""
        for group, sub in plan.plans.items():
            self.complete(group, sub, ok)

    def cancel(self, group: str, plan: TransferPlan) -> bool:
        """Undo ``group``'s plan whose copy never started: a store's cursors go back (its
        blocks are planned again), a load's pin is released (look up again).

        Returns:
            ``False`` when the plan is unknown or already completed.
        """
        ledger = self._ledgers[group]
        rec = ledger.cancel(plan.plan_id)
        if rec is None:
            return False
        if plan.kind == "store":
            store = self._stores.pop((group, plan.plan_id))
            if rec.epoch == ledger.epoch:
                for rid, old in store.cursors.items():
                    state = self._requests.get(rid)
                    if state is not None and not state.finished:
                        lane = state.lanes[group]
                        lane.cursor = min(lane.cursor, old)
        else:
            ledger.unpin(rec.blocks)
        self._detach(group, plan)
        return True

    def _detach(self, group: str, plan: TransferPlan) -> None:
        for rid in plan.request_ids:
            state = self._requests.get(rid)
            if state is not None:
                state.in_flight.discard((group, plan.plan_id))
                self._drop_if_done(state)

    # -- observation -----------------------------------------------------------------------

    def statistics(self) -> dict[str, GroupStatistics]:
        """Per cacheable group, a snapshot of its counters and pool."""
        out: dict[str, GroupStatistics] = {}
        for name, ledger in self._ledgers.items():
            c, pool = self._counts[name], ledger.pool
            out[name] = GroupStatistics(
                stored_blocks=c.stored,
                loaded_blocks=c.loaded,
                skipped_null_blocks=c.skipped_null,
                deferred_stores=c.deferred,
                pinned_blocks=sum(len(p) for p in ledger.pins()),
                in_flight_plans=ledger.num_plans,
                num_cpu_blocks=pool.num_blocks,
                free_cpu_blocks=pool.num_free,
                cached_cpu_blocks=pool.num_cached,
            )
        return out

    def check_invariants(self) -> None:
        """Check every group's pool and ledger, then the cross-group rules: a request's
        pins cover exactly ``needed(g, N)`` above its prefix in every group for one ``N``;
        every in-flight store block is in ``needed(g, point)`` of its store point and its
        table entry was a block id; the requests' plans are the ledgers' plans.

        Raises:
            InvariantError: naming the group and the breach.
        """
        groups = {g.name: g for g in self._cacheable}
        for name, ledger in self._ledgers.items():
            ledger.check_invariants()
            pins = {id(p) for p in ledger.pins()}
            held = {
                id(s.lanes[name].pin)
                for s in self._requests.values()
                if s.lanes[name].pin is not None
            }
            if pins != held:
                raise InvariantError(f"group {name!r}: the ledger's pins are not the lookups'")
            plans = {rec.plan.plan_id for rec in ledger.plans()}
            named = {p for s in self._requests.values() for g, p in s.in_flight if g == name}
            if plans != named:
                raise InvariantError(f"group {name!r}: requests' plans {named} != {plans}")
            stores = {p for g, p in self._stores if g == name}
            kinds = {rec.plan.plan_id for rec in ledger.plans() if rec.plan.kind == "store"}
            if stores != kinds:
                raise InvariantError(f"group {name!r}: store records disagree with the ledger")
        for (name, _), rec in self._stores.items():
            for rid, i, point in rec.blocks:
                if i not in needed(groups[name], point):
                    raise InvariantError(
                        f"group {name!r}: request {rid!r} stores block {i}, outside needed({point})"
                    )
        for state in self._requests.values():
            if state.finished and not state.in_flight:
                raise InvariantError(f"finished request {state.request_id!r} kept")
            pinned = [lane.pin is not None for lane in state.lanes.values()]
            if state.hit is None:
                if any(pinned):
                    raise InvariantError(f"request {state.request_id!r}: pins without a hit")
                continue
            if state.hit % self._align:
                raise InvariantError(f"request {state.request_id!r}: unaligned hit")
            for name, lane in state.lanes.items():
                span = self._load_range(groups[name], state.hit, state.hit_from)
                if lane.pin is None or len(lane.pin) != len(span):
                    raise InvariantError(
                        f"request {state.request_id!r}: group {name!r} pins "
                        f"{None if lane.pin is None else len(lane.pin)} blocks for a hit "
                        f"needing {len(span)}"
                    )
