"""The records of `GroupedScheduler`: its plans and statistics, a request's lanes (one
per group), and the checks of its per-group inputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import final

from kvoffload.errors import BlockTableError, InputTypeError, InvalidInputError
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHash
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.misses import MissReason
from kvoffload.scheduler.requests import check_distinct
from kvoffload.transfer.plan import TransferPlan

__all__ = [
    "GroupCounts",
    "GroupHashes",
    "GroupStatistics",
    "GroupTables",
    "GroupedPlan",
    "GroupedRequest",
    "Lane",
    "StoreRecord",
    "check_hashes",
    "check_tables",
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
    """One group's counters (a snapshot).

    Attributes:
        stored_blocks: blocks whose store completed and published.
        loaded_blocks: blocks whose load completed.
        skipped_null_blocks: blocks of a store point not stored: the table entry was
            ``None`` when planned (out of window, freed or reused), or lay below what the
            request's load or prefix wrote (never known to hold its KV).
        deferred_stores: store plans cut short because the group's pool had no free block.
        pinned_blocks: blocks pinned by lookups now.
        in_flight_plans: the group's plans in flight.
        num_cpu_blocks: the group's pool size.
        free_cpu_blocks: free blocks in the pool.
        cached_cpu_blocks: published blocks in the pool.
        lookup_misses: lookups whose hit stopped at a block of this group, by
            `MissReason` (docs/misses.md).
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
    lookup_misses: Mapping[MissReason, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Lane:
    """One request's state in one group."""

    table: list[int | None] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    # full: blocks planned or skipped; other kinds: tokens of the last store point planned
    cursor: int = 0
    pin: list[CpuBlock] | None = None
    pin_start: int = 0
    # table entries below this index are not known to hold this request's KV (below the
    # engine's prefix's needed blocks, or below a window, chunk or state a load landed
    # above them): never stored, whatever the engine's table names there
    valid_from: int = 0


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
    # the retention priority of its blocks in every group (`PriorityCount.set()`)
    priority: int = 0


@dataclass(slots=True)
class GroupCounts:
    stored: int = 0
    loaded: int = 0
    skipped_null: int = 0
    deferred: int = 0
    misses: dict[MissReason, int] = field(default_factory=dict)

    def snapshot(self, ledger: BlockLedger) -> GroupStatistics:
        """These counters and ``ledger``'s pool, as `GroupStatistics`."""
        pool = ledger.pool
        return GroupStatistics(
            stored_blocks=self.stored,
            loaded_blocks=self.loaded,
            skipped_null_blocks=self.skipped_null,
            deferred_stores=self.deferred,
            pinned_blocks=sum(len(p) for p in ledger.pins()),
            in_flight_plans=ledger.num_plans,
            num_cpu_blocks=pool.num_blocks,
            free_cpu_blocks=pool.num_free,
            cached_cpu_blocks=pool.num_cached,
            lookup_misses=dict(self.misses),
        )


@dataclass(slots=True, eq=False)
class StoreRecord:
    # (request id, block index, store point, cursor before) per block; cursors per request
    blocks: list[tuple[str, int, int]]
    cursors: dict[str, int]


def check_tables(
    cacheable: Sequence[KVCacheGroup], limits: Mapping[str, int], rid: str, tables: GroupTables
) -> dict[str, list[int | None]]:
    """Check one table per cacheable group (ints in range or ``None``, no GPU block named
    twice: `check_distinct()`, the one-group rule); copies of them."""
    out: dict[str, list[int | None]] = {}
    for g in cacheable:
        table = tables.get(g.name)
        if table is None:
            raise BlockTableError(f"request {rid!r}: no block table for group {g.name!r}")
        if isinstance(table, (str, bytes)) or not isinstance(table, Sequence):
            raise InputTypeError(
                f"request {rid!r}: group {g.name!r}: block table must be a sequence"
            )
        limit = limits.get(g.name)
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
        check_distinct(out[g.name], rid, group=g.name)
    return out


def check_hashes(
    cacheable: Sequence[KVCacheGroup], rid: str, state: GroupedRequest, hashes: GroupHashes
) -> None:
    """Check one hash list per cacheable group, grown from what ``state`` knows."""
    for g in cacheable:
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


def load_destinations(
    rid: str, state: GroupedRequest, tables: Mapping[str, list[int | None]]
) -> dict[str, list[int]]:
    """Per group, the GPU block ids the pinned blocks load into (checked tables).

    Raises:
        BlockTableError: a destination entry is missing or ``None``.
    """
    dests: dict[str, list[int]] = {}
    for name, lane in state.lanes.items():
        table = tables[name]
        ids: list[int] = []
        for k in range(len(lane.pin or ())):
            pos = lane.pin_start + k
            entry = table[pos] if pos < len(table) else None
            if entry is None:
                raise BlockTableError(
                    f"request {rid!r}: group {name!r}: no GPU block at position {pos} to load into"
                )
            ids.append(entry)
        dests[name] = ids
    return dests
