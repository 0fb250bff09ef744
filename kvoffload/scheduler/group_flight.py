"""`LoadsInFlight`: a `GroupedScheduler`'s loads in flight, from their opening to their
completion, abandonment or cancellation; a load cancelled part by part gives its hit back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import final

from kvoffload.errors import InvariantError
from kvoffload.groups import KVCacheGroup
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler.group_loads import (
    GroupedLoad,
    LoadRecord,
    abandon_grouped,
    open_grouped_loads,
)
from kvoffload.scheduler.group_state import (
    GroupCounts,
    GroupedRequest,
    GroupRequests,
    load_destinations,
)
from kvoffload.scheduler.ledger import BlockLedger, PlanEntry
from kvoffload.transfer.plan import LoadPlan, TransferPlan

__all__ = ["LoadsInFlight"]


@final
class LoadsInFlight:
    """The one owner of a `GroupedScheduler`'s loads in flight: their records (`records`)
    and the parts of a load cancelled before their copy started while another part of it
    is still in flight.

    A load is one part per group (`GroupedLoad`). When every part is cancelled (a failed
    launch cancels them one by one), the request gets its lookup back as it was before
    `plan_load()`, but for what a shorter load released: each lane pins that part's CPU
    blocks again from the part's first block (``pin_start``), its ``valid_from`` goes back
    to before `note_load()`, and the request's hit is the one the load took, so the
    engine may load it again. Until the last part is cancelled, the parts cancelled so far
    keep their CPU blocks referenced (a pin of their group's ledger, as their plans kept
    them) but no lane pins them and the request has no hit: every call sees the load as
    still in flight.

    The hit is not given back, and the cancelled parts' blocks are released, when a part
    of the load completed or failed instead, when the request's pins were released in
    between (a lookup, ``release()``, a finish, preemption, abandonment or reset:
    `released()`), when a part's epoch is not the ledger's, or when the request is gone,
    finished, or holds a hit or a pin again.

    Args:
        groups: the cacheable groups.
        ledgers: per group, its ledger.
        counts: per group, its counters (``load_plans`` counts the plans opened and not
            cancelled).
        requests: the request table: its states by id, and how the checks of a load's
            tables name them (`GroupRequests.names`).
    """

    __slots__ = ("_counts", "_groups", "_ledgers", "_names", "_open", "_requests", "records")

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        ledgers: Mapping[str, BlockLedger],
        counts: Mapping[str, GroupCounts],
        requests: GroupRequests,
    ) -> None:
        self._groups = tuple(groups)
        self._ledgers = ledgers
        self._counts = counts
        self._requests = requests.requests
        self._names = requests.names
        self.records: dict[str, dict[int, LoadRecord]] = {g.name: {} for g in groups}
        """Per group, its load plans in flight (abandoned ones too) by plan id."""
        self._open: dict[str, list[GroupedLoad]] = {}
        """By request id, its loads that may still give their hit back."""

    def open(
        self,
        state: GroupedRequest,
        tables: Mapping[str, list[int | None]],
        num_tokens: int,
        cut: Mapping[str, int] | None,
    ) -> dict[str, TransferPlan]:
        """Open, per group, the load of ``num_tokens`` of ``state``'s pinned hit into its
        checked ``tables`` (`load_destinations()`, `open_grouped_loads()`): all of it, or
        with ``cut`` (a load shorter than the hit, `check_shorter_load()`) the blocks it
        names.

        Returns:
            Per group with blocks to load, its plan.
        """
        dests = load_destinations(state.request_id, state, tables, self._names, cut)
        plans, load = open_grouped_loads(
            self._groups, self._ledgers, self._counts, self.records, state, dests, num_tokens
        )
        if load is not None and not load.spoiled:
            self._open.setdefault(load.request_id, []).append(load)
        return plans

    def abandon(self, state: GroupedRequest) -> dict[str, list[LoadPlan]]:
        """``state``'s request stops waiting for its loads in flight (`abandon_grouped()`;
        its pins were released first: `released()`).

        Returns:
            Per group with a load abandoned now, its plans, oldest first.
        """
        return abandon_grouped(self._groups, self._ledgers, self.records, state)

    def released(self, request_id: str) -> None:
        """``request_id``'s pins were released: none of its loads gives its hit back."""
        for load in self._open.pop(request_id, ()):
            self._spoil(load)

    def completed(self, group: str, plan_id: int) -> None:
        """``group``'s part of a load completed (or failed): forget its record; the load
        gives no hit back (its cancelled parts' blocks are released)."""
        rec = self.records[group].pop(plan_id)
        load = rec.load
        if load is not None:
            load.open.discard(group)
            self._spoil(load)

    def cancelled(self, group: str, entry: PlanEntry, current: bool) -> None:
        """``group``'s part of a load was cancelled (`BlockLedger.cancel()`: its blocks
        are a pin of the ledger again, unless the load was abandoned: released): park
        them until the load's last part is cancelled, then give the hit back; or release
        them (see the class). ``current``: the part's epoch is the ledger's."""
        self._counts[group].counters.load_plans -= 1
        rec = self.records[group].pop(entry.plan.plan_id)
        load = rec.load
        if load is None:  # no load to give back (not opened by open_grouped_loads())
            if not entry.abandoned:
                self._ledgers[group].unpin(entry.blocks)
            return
        load.open.discard(group)
        if entry.abandoned:  # the ledger released its blocks
            self._spoil(load)
            return
        state = self._requests.get(load.request_id)
        if load.spoiled or not current or state is None or state.finished:
            self._spoil(load)
            self._ledgers[group].unpin(entry.blocks)
            return
        load.parked[group] = (entry.blocks, rec)
        if load.open:
            return  # the load's other parts are in flight
        if state.hit is not None or any(lane.pin is not None for lane in state.lanes.values()):
            self._spoil(load)  # a newer hit (`released()` saw every lookup: a safeguard)
            return
        self._forget(load)
        for name, (blocks, part) in load.parked.items():
            lane = state.lanes[name]
            lane.pin, lane.pin_start, lane.valid_from = blocks, part.start, part.valid_from
        load.parked.clear()
        state.hit, state.hit_from = load.hit, load.hit_from

    def _spoil(self, load: GroupedLoad) -> None:
        """``load`` gives no hit back: release its parked parts' blocks."""
        if load.spoiled:
            return
        load.spoiled = True
        for name, (blocks, _) in load.parked.items():
            self._ledgers[name].unpin(blocks)
        load.parked.clear()
        self._forget(load)

    def _forget(self, load: GroupedLoad) -> None:
        loads = self._open.get(load.request_id)
        if loads is not None and load in loads:
            loads.remove(load)
            if not loads:
                del self._open[load.request_id]

    def parked(self) -> dict[str, list[list[CpuBlock]]]:
        """Per group, the CPU blocks of the parts parked now (pins of its ledger)."""
        out: dict[str, list[list[CpuBlock]]] = {}
        for loads in self._open.values():
            for load in loads:
                for name, (blocks, _) in load.parked.items():
                    out.setdefault(name, []).append(blocks)
        return out

    def check_invariants(self) -> None:
        """A load that may give its hit back is not spoiled and has a part in flight (a
        record) in each of its open groups and a record or a parked part in every lane
        of its request, which holds no hit and no pin while a part is parked.

        Raises:
            InvariantError: naming the request and the breach.
        """
        for rid, loads in self._open.items():
            state = self._requests.get(rid)
            for load in loads:
                in_flight = {
                    name
                    for name, records in self.records.items()
                    if any(rec.load is load for rec in records.values())
                }
                if load.spoiled or not load.open or in_flight != load.open:
                    raise InvariantError(f"request {rid!r}: a load's parts in flight are lost")
                if state is None or load.open | load.parked.keys() != state.lanes.keys():
                    raise InvariantError(f"request {rid!r}: a load's parts miss a group")
                if load.parked and (
                    state.hit is not None
                    or any(lane.pin is not None for lane in state.lanes.values())
                ):
                    raise InvariantError(f"request {rid!r}: a hit beside a parked load part")
