"""The store planning of `GroupedScheduler`: per group, which blocks of which store
points to copy, deferral when a group's pool is full, and the records that undo a plan."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import final

from kvoffload._logging import get_logger
from kvoffload.errors import InvariantError
from kvoffload.groups import KVCacheGroup, needed, store_points
from kvoffload.hashing import BlockHash
from kvoffload.scheduler.group_state import (
    GroupCounts,
    GroupedPlan,
    GroupedRequest,
    StoreRecord,
)
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.transfer.plan import TransferPlan

__all__ = ["GroupStorePlanner"]

_log = get_logger("scheduler.groups")


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
    ) -> None:
        self._cacheable = cacheable
        self._ledgers = ledgers
        self._counts = counts
        self._requests = requests
        self._align = align
        self._checkpoint = checkpoint
        self.records: dict[tuple[str, int], StoreRecord] = {}
        """(group, plan id) → who the store plan serves and the cursors before it."""

    def scan(
        self,
        state: GroupedRequest,
        name: str,
        g: KVCacheGroup,
        final: bool,
        passed: list[tuple[int, int]] | None = None,
    ) -> list[tuple[int, int]]:
        """(block index, store point) of the blocks to store for one request and group,
        up to the last point planned; skips null entries and those below the lane's
        ``valid_from`` (not known to hold its KV), cached and pending blocks (those two
        appended to ``passed``, when given: a request's priority raises them)."""
        lane = state.lanes[name]
        ledger = self._ledgers[name]
        is_cached, pending = ledger.pool.is_cached, ledger.pending
        counts = self._counts[name]
        limit = min(len(lane.table), len(lane.hashes))
        out: list[tuple[int, int]] = []
        computed = state.num_computed_tokens
        valid = lane.valid_from  # an entry below it is treated as None
        if g.kind == "full":
            for i in range(lane.cursor, min(limit, computed // g.block_size)):
                if lane.table[i] is None or i < valid:
                    counts.skipped_null += 1
                elif not is_cached(lane.hashes[i]) and lane.hashes[i] not in pending:
                    out.append((i, (i + 1) * g.block_size))
                elif passed is not None:
                    passed.append((i, (i + 1) * g.block_size))
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
                if i >= limit or i < valid or lane.table[i] is None:
                    counts.skipped_null += 1
                elif not is_cached(lane.hashes[i]) and lane.hashes[i] not in pending:
                    out.append((i, point))
                elif passed is not None:
                    passed.append((i, point))
        return out

    def plan(self, states: Sequence[GroupedRequest], final: bool) -> GroupedPlan | None:
        """One store plan per group for ``states``: their store points up to their computed
        length (and that length itself when ``final``), a point whole or deferred."""
        plans: dict[str, TransferPlan] = {}
        for g in self._cacheable:
            name = g.name
            ledger = self._ledgers[name]
            hashes: list[BlockHash] = []
            gpu: list[int] = []
            rec = StoreRecord([], {})
            free = ledger.pool.num_free
            batch: set[BlockHash] = set()
            want: dict[BlockHash, int] = {}
            for state in states:
                lane = state.lanes[name]
                passed: list[tuple[int, int]] | None = [] if state.priority else None
                scanned = self.scan(state, name, g, final, passed)
                wanted = [w for w in scanned if lane.hashes[w[0]] not in batch]
                cut: int | None = None
                rec.cursors[state.request_id] = lane.cursor
                room = free - len(hashes)
                if len(wanted) > room:
                    # a store point is planned whole, or deferred with every later one
                    cut = wanted[room][1]
                    ledger.misses.note_skipped((lane.hashes[wanted[room][0]],))
                    wanted = [w for w in wanted if w[1] < cut]
                    if g.kind == "full":
                        new = cut // g.block_size - 1
                    else:
                        new = (cut - 1) // self._checkpoint * self._checkpoint
                    self._counts[name].deferred += 1
                    _log.debug("store_deferred", group=name, request_id=state.request_id)
                else:
                    new = self.advance(g, state, final)
                if passed is not None:
                    # as with one group: every block the cursor passes gets the priority
                    prio = state.priority
                    for i, point in (*scanned, *passed):
                        if cut is None or point < cut:
                            h = lane.hashes[i]
                            if prio > want.get(h, 0):
                                want[h] = prio
                for i, point in wanted:
                    entry = lane.table[i]
                    if entry is None or i < lane.valid_from:  # scan() skipped these
                        raise InvariantError(f"group {name!r}: a null entry was planned")
                    hashes.append(lane.hashes[i])
                    batch.add(lane.hashes[i])
                    gpu.append(entry)
                    rec.blocks.append((state.request_id, i, point))
                lane.cursor = max(lane.cursor, new)
            priorities = ledger.prioritize(want, batch) if want else None
            if not hashes:
                continue
            plan = ledger.open_store(
                hashes,
                gpu,
                tuple(dict.fromkeys(r for r, _, _ in rec.blocks)),
                protect=set(),
                evicted=[],
                ends=None,
                priorities=priorities,
            )
            plans[name] = plan
            self.records[(name, plan.plan_id)] = rec
            for rid in plan.request_ids:
                self._requests[rid].in_flight.add((name, plan.plan_id))
        return GroupedPlan("store", plans) if plans else None

    def advance(self, g: KVCacheGroup, state: GroupedRequest, final: bool) -> int:
        lane = state.lanes[g.name]
        computed = state.num_computed_tokens
        if g.kind == "full":
            return max(
                lane.cursor, min(len(lane.table), len(lane.hashes), computed // g.block_size)
            )
        if final:
            return computed // self._align * self._align
        return computed // self._checkpoint * self._checkpoint

    def cancel(self, group: str, plan_id: int, current: bool) -> None:
        """A store plan was cancelled: its requests' cursors go back (if ``current``)."""
        store = self.records.pop((group, plan_id))
        if not current:
            return
        for rid, old in store.cursors.items():
            state = self._requests.get(rid)
            if state is not None and not state.finished:
                lane = state.lanes[group]
                lane.cursor = min(lane.cursor, old)

    def check_invariants(self) -> None:
        """Every block of a store in flight lies in ``needed(g, point)`` of its point, and
        the records are the ledgers' store plans.

        Raises:
            InvariantError: naming the group and the breach.
        """
        groups = {g.name: g for g in self._cacheable}
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
