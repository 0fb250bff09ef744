"""The hit rule of `GroupedScheduler` (the largest ``N`` valid for every group) and its
cross-group checks."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, final

from kvoffload.errors import InvalidInputError, InvariantError
from kvoffload.groups import KVCacheGroup, hit_alignment, needed
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler.group_state import GroupCounts, GroupedRequest
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.loads import (
    abandon_loads,
    block_miss_reason,
    check_load_tokens,
    lookup_defers,
)
from kvoffload.scheduler.misses import MissReason
from kvoffload.transfer.plan import LoadPlan, TransferPlan

__all__ = [
    "GroupLookupExtension",
    "GroupedLoad",
    "HitStops",
    "LoadRecord",
    "abandon_grouped",
    "check_ledgers",
    "check_request",
    "check_shorter_load",
    "find_hit",
    "hit_blocks",
    "load_range",
    "longer_hit_filling",
    "lookup_defers_grouped",
    "note_load",
    "note_prefix",
    "open_grouped_loads",
    "promotions_defer",
    "valid_from",
]


class GroupLookupExtension(Protocol):
    """What a grouped lookup asks of the storage below the CPU pools (the groups' tiers)."""

    def extend_grouped_lookup(
        self,
        lanes: Mapping[str, Sequence[BlockHash]],
        hit: int,
        num_tokens: int,
        pinned: Mapping[str, Sequence[CpuBlock]],
    ) -> None:
        """A lookup of ``num_tokens`` found ``hit`` tokens valid for every group (the
        engine's prefix when none), the CPU blocks ``pinned`` per group; start what brings
        in the blocks of a longer hit (never evicting ``pinned``: the lookup may let
        them go at once, to ask again). Nothing it starts may change this lookup's
        answer; whether to ask again is `lookup_defers_grouped()`'s, with `promoting`."""
        ...

    def hit_sources(self, pinned: Mapping[str, Sequence[CpuBlock]]) -> dict[str, int] | None:
        """Of a lookup's hit (its CPU blocks ``pinned`` per group), the tokens each tier
        (by name) promoted into the pools; ``None`` when none did (as `LookupExtension`'s
        ``hit_sources`` for one group, in tokens)."""
        ...

    def promoting(self, group: str, block_hash: BlockHash) -> bool:
        """Whether a promotion of ``group``'s tiers covering ``block_hash`` is in flight
        (probing, or reading into CPU blocks)."""
        ...

    def lookup_deferred(self) -> None:
        """The lookup whose `extend_grouped_lookup()` was the last call answered "ask
        again" while a promotion ran: counted in the ``deferred_lookups`` of the tiers of
        each group it waits for (as one group's tiers count theirs), and once in the whole
        model's."""
        ...

    @property
    def defer_deadline_s(self) -> float:
        """The longest a request's lookups may answer "ask again" in a row while the
        tiers bring blocks in (as `LookupExtension.defer_deadline_s`)."""
        ...

    def miss_reason(self, group: str, block_hash: BlockHash) -> MissReason | None:
        """Why ``group``'s tiers did not bring ``block_hash`` in (`MissReason.IN_FLIGHT`:
        its promotion runs; `MissReason.TIER_FAILED`), or ``None`` when they know no
        reason (as `LookupExtension.miss_reason` for one group)."""
        ...


def load_range(g: KVCacheGroup, n: int, computed: int) -> range:
    """The blocks of ``needed(g, n)`` above the engine's prefix of ``computed`` tokens
    (the engine holds the rest: ``needed(g, n)`` below it lies in ``needed(g, computed)``)."""
    span = needed(g, n)
    return range(max(span.start, computed // g.block_size), span.stop)


def valid_from(g: KVCacheGroup, n: int, computed: int) -> int:
    """The first table entry of ``g`` known to hold a request's KV once it holds ``n``
    tokens: the engine's prefix of ``computed`` tokens holds ``needed(g, computed)``, a
    load of a hit at ``n > computed`` writes `load_range()`, and the engine computes from
    ``n`` on. Entries between the prefix and the first loaded block (below a window,
    chunk or state a hit needs), and below the prefix's needed blocks, were written by
    nobody: a store must never read them, whatever the engine's table names there."""
    if n > computed:
        first = load_range(g, n, computed).start
        if first > computed // g.block_size:
            return first
    return needed(g, computed).start


def note_prefix(cacheable: Sequence[KVCacheGroup], state: GroupedRequest, computed: int) -> None:
    """A lookup over the engine's prefix of ``computed`` tokens: a lane with no table yet
    (a new or preempted request) holds only the prefix's needed blocks (`valid_from()`)."""
    for g in cacheable:
        lane = state.lanes[g.name]
        if not lane.table:
            lane.valid_from = valid_from(g, computed, computed)


@dataclass(slots=True, eq=False)
class LoadRecord:
    """One group's load plan in flight, as `abandon_grouped()` needs it."""

    start: int
    """The request block its first CPU block fills."""
    prefix: int
    """The engine's own prefix (tokens) the load lands above."""
    valid_from: int
    """The lane's ``valid_from`` before the load was planned."""
    load: GroupedLoad | None = None
    """The load it is a part of (`open_grouped_loads()`)."""


@dataclass(slots=True, eq=False)
class GroupedLoad:
    """One load of a request's hit, every group's part of it (`open_grouped_loads()`):
    what cancelling every part gives back to the request (`LoadsInFlight`)."""

    request_id: str
    hit: int
    """The lookup's hit ``N`` (tokens) it loads."""
    hit_from: int
    """The engine's prefix (tokens) the hit was found above."""
    open: set[str]
    """The groups whose part is in flight: neither completed nor cancelled yet."""
    parked: dict[str, tuple[list[CpuBlock], LoadRecord]] = field(default_factory=dict)
    """Per group whose part was cancelled while another part is in flight: its CPU
    blocks (a pin of the group's ledger, no lane's, as the plan kept them) and record."""
    spoiled: bool = False
    """The hit cannot be given back: a part completed, or the request's pins were
    released since (a lookup, ``release()``, a finish, preemption, abandonment, reset);
    a part cancelled now releases its blocks."""


_SHORTER_NEEDS = {
    "sliding_window": "the window below a shorter hit lies in blocks before the pinned ones",
    "chunked": "a shorter hit may need its chunk's blocks before the pinned ones",
    "recurrent": "a shorter hit needs the state saved at its own end, not the pinned one",
}
"""Per group kind but full, why a load shorter than the lookup's hit cannot take a prefix
of the blocks the lookup pinned (docs/groups.md)."""


def check_shorter_load(
    groups: Sequence[KVCacheGroup], state: GroupedRequest, num_tokens: int
) -> dict[str, int]:
    """A `GroupedScheduler.plan_load()` of ``num_tokens`` that is neither 0 nor the
    lookup's hit (tokens above the engine's prefix; the whole hit is taken without this
    call): taken as one group takes it (`check_load_tokens()`, by the hit alignment)
    when every cacheable group (``groups``) is full attention, where a shorter hit's
    blocks are the first ``num_tokens // block_size`` of each group's pin; refused with
    any other kind of group, whose shorter hit needs other blocks (the engine looks up
    again with fewer tokens).

    Returns:
        Per group, how many of its pin's first blocks the load takes (the rest is
        released: `open_grouped_loads()`).

    Raises:
        InvalidInputError: naming the request, ``num_tokens``, the hit and (a shorter
            load refused) the group that cannot take it and why.
    """
    rid = state.request_id
    hit = 0 if state.hit is None else state.hit - state.hit_from
    other = next((g for g in groups if g.kind != "full"), None)
    check_load_tokens(rid, num_tokens, hit, hit_alignment(groups), shorter=other is None)
    if other is not None:
        n = state.hit_from + num_tokens
        raise InvalidInputError(
            f"request {rid!r}: cannot load num_tokens={num_tokens} of the lookup's hit "
            f"{hit}: group {other.name!r} (kind {other.kind!r}) takes no load shorter than "
            f"the hit: {_SHORTER_NEEDS.get(other.kind, 'it needs other blocks')}; load the "
            f"whole hit, or release it and look up again with fewer tokens (num_tokens="
            f"{n + 1} finds a hit of at most {num_tokens})"
        )
    return {g.name: num_tokens // g.block_size for g in groups}


def note_load(
    cacheable: Sequence[KVCacheGroup], state: GroupedRequest, n: int
) -> dict[str, LoadRecord]:
    """A load of ``state``'s hit at ``n`` tokens is planned: no lane's entries below what
    it lands (and above the prefix) were ever written (`valid_from()`); they are never
    stored.

    Returns:
        Per group, the record of its part of the load (before this note).
    """
    out: dict[str, LoadRecord] = {}
    for g in cacheable:
        lane = state.lanes[g.name]
        out[g.name] = LoadRecord(lane.pin_start, state.hit_from, lane.valid_from)
        lane.valid_from = max(lane.valid_from, valid_from(g, n, state.hit_from))
    return out


def abandon_grouped(
    cacheable: Sequence[KVCacheGroup],
    ledgers: Mapping[str, BlockLedger],
    loads: Mapping[str, Mapping[int, LoadRecord]],
    state: GroupedRequest,
) -> dict[str, list[LoadPlan]]:
    """``state``'s request stops waiting for its loads in flight, every group's part at
    once: in each group the one-group rule (`abandon_loads()`) marks them abandoned; they
    no longer serve the request; and what the scheduler knew of its tables from the
    engine's prefix on is forgotten in every group, its computed tokens go back to the
    engine's prefix the loads landed above, and each lane's ``valid_from`` to what it was
    before them (the engine recomputes from that prefix, into other GPU blocks).

    Returns:
        Per group with a load abandoned now, its plans, oldest first.
    """
    out: dict[str, list[LoadPlan]] = {}
    prefix: int | None = None
    for g in cacheable:
        name = g.name
        records = loads[name]
        starts = {p: records[p].start for grp, p in state.in_flight if grp == name and p in records}
        plans, first = abandon_loads(ledgers[name], state.request_id, starts, starts)
        if first is None:
            continue
        out[name] = plans
        lane = state.lanes[name]
        for plan in plans:
            state.in_flight.discard((name, plan.plan_id))
            rec = records[plan.plan_id]
            prefix = rec.prefix if prefix is None else min(prefix, rec.prefix)
            lane.valid_from = min(lane.valid_from, rec.valid_from)
    if prefix is None:
        return out
    for g in cacheable:
        # the engine recomputes from its prefix, maybe into other GPU blocks, in every
        # lane: each forgets its entries from the prefix on (a window's load started
        # above them; a lane may have had no block to load), as one group's table does
        lane = state.lanes[g.name]
        del lane.table[prefix // g.block_size :]
        lane.ids = {e for e in lane.table if e is not None}
    state.num_computed_tokens = min(state.num_computed_tokens, prefix)
    return out


def _valid(
    groups: Sequence[KVCacheGroup],
    pools: Mapping[str, CpuBlockPool],
    lanes: Mapping[str, Sequence[BlockHash]],
    n: int,
    computed: int,
) -> bool:
    for g in groups:
        hashes = lanes[g.name]
        get = pools[g.name].get_cached
        span = load_range(g, n, computed)
        if span.stop > len(hashes):
            return False
        for i in span:
            if get(hashes[i]) is None:
                return False
    return True


def find_hit(
    groups: Sequence[KVCacheGroup],
    pools: Mapping[str, CpuBlockPool],
    lanes: Mapping[str, Sequence[BlockHash]],
    num_tokens: int,
    *,
    computed: int,
    align: int,
    observe: bool = False,
) -> int:
    """The largest ``N`` (``computed`` when none is larger): a multiple of ``align``, at
    most ``num_tokens - 1``, with every block of ``load_range(g, N, computed)``
    published in every group's pool. A full group's leading run bounds ``N`` first; the
    other kinds are checked at each candidate, from the largest down.

    With ``observe`` (a lookup's own), a full group's run is found by its pool's
    `CpuBlockPool.lookup()`, as one group's lookup finds it: the pool counts the lookup
    and its hit blocks, and an eviction policy with an ``on_lookup`` hook is told."""
    top = cap = max(0, num_tokens - 1) // align * align
    others = [g for g in groups if g.kind != "full"]  # a full group's run bounds the cap
    for g in groups:
        if g.kind == "full":
            pool = pools[g.name]
            hashes = lanes[g.name]
            i = computed // g.block_size
            end = min(len(hashes), top // g.block_size)
            if observe:
                if i < end:
                    i += len(pool.lookup(itertools.islice(hashes, i, end)))
            else:
                get = pool.get_cached
                while i < end and get(hashes[i]) is not None:
                    i += 1
            cap = min(cap, i * g.block_size // align * align)
    n = cap
    while n > computed and others and not _valid(others, pools, lanes, n, computed):
        n -= align
    return max(n, computed)


@final
class HitStops:
    """Why a grouped lookup's hit stopped where it did (`MissReason`), counted per group.

    The next aligned step past the hit is examined: the first group (in order) missing
    a block of it is blamed, and its `GroupStatistics.lookup_misses` counts the reason;
    a block never stored in that group while another group holds its part of the step
    is `MissReason.GROUP_MISSING`. A reason of the prompt's own (nothing missed, the
    last token, a boundary) blames no group.

    Args:
        groups: the cacheable groups, in order.
        ledgers: per group, its ledger (pool, pending hashes, `MissMemory`).
        counts: per group, the counters ``lookup_misses`` is read from.
        checkpoint: spacing of the store points of the groups that are not full.
    """

    __slots__ = ("_align", "_checkpoint", "_counts", "_groups", "_ledgers")

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        ledgers: Mapping[str, BlockLedger],
        counts: Mapping[str, GroupCounts],
        checkpoint: int,
    ) -> None:
        self._groups = tuple(groups)
        self._ledgers = ledgers
        self._counts = counts
        self._align = hit_alignment(groups)
        self._checkpoint = checkpoint

    def stop(
        self,
        lanes: Mapping[str, Sequence[BlockHash]],
        n: int,
        num_tokens: int,
        computed: int,
        extension: GroupLookupExtension | None = None,
    ) -> MissReason:
        """The reason `find_hit()`'s hit ``n`` (over a prefix of ``computed`` tokens,
        of a prompt of ``num_tokens``) stopped there; counted for the group blamed. A
        block a group lacks is classified by `block_miss_reason()`, asking that group's
        tiers (``extension``) as one group asks its own."""
        if n >= num_tokens:
            return MissReason.NONE
        step = n + self._align
        if step > num_tokens - 1:
            return MissReason.LAST_TOKEN if step <= num_tokens else MissReason.BOUNDARY
        gaps: list[tuple[MissReason, str]] = []
        for g in self._groups:
            ledger = self._ledgers[g.name]
            below = None if extension is None else functools.partial(extension.miss_reason, g.name)
            reason = _gap(
                g, ledger, lanes[g.name], step, computed, self._checkpoint, num_tokens, below
            )
            if reason is not None:
                gaps.append((reason, g.name))
        if not gaps:  # every group holds the step (a window the hit search passed over)
            return MissReason.BOUNDARY
        reason, group = gaps[0]
        if reason is MissReason.NEVER_STORED and len(gaps) < len(self._groups):
            reason = MissReason.GROUP_MISSING
        misses = self._counts[group].counters.lookup_misses
        misses[reason] = misses.get(reason, 0) + 1
        return reason


def _gap(  # noqa: PLR0917 - one group's view of one step
    g: KVCacheGroup,
    ledger: BlockLedger,
    hashes: Sequence[BlockHash],
    step: int,
    computed: int,
    checkpoint: int,
    num_tokens: int,
    below: Callable[[BlockHash], MissReason | None] | None,
) -> MissReason | None:
    """Why group ``g`` lacks a block a hit at ``step`` needs (``None``: it lacks none).
    A group that stores at checkpoints is asked about the next checkpoint in the
    prompt; without one, the gap is a `MissReason.BOUNDARY`."""
    get = ledger.pool.get_cached
    for i in load_range(g, step, computed):
        if i >= len(hashes):
            return MissReason.BOUNDARY  # the prompt's hashes stop short of the step
        block_hash = hashes[i]
        if get(block_hash) is not None:
            continue
        if g.kind != "full" and step % checkpoint:
            point = -(-step // checkpoint) * checkpoint
            if point > num_tokens - 1:
                return MissReason.BOUNDARY  # the group stores its state at checkpoints
            return _gap(g, ledger, hashes, point, computed, checkpoint, num_tokens, below) or (
                MissReason.BOUNDARY
            )
        return block_miss_reason(ledger, block_hash, below)
    return None


def check_request(groups: Mapping[str, KVCacheGroup], state: GroupedRequest, align: int) -> None:
    """A request's pins cover exactly ``load_range(g, N)`` in every group for its one
    aligned hit ``N`` (none without a hit); each lane's ``ids`` are exactly its table's
    int entries (the store loop's "no ``None`` here" shortcut reads them); a finished
    request is kept only while its transfers run or it holds GPU blocks
    (``hold_blocks_on_finish``); one whose tables await a comparison after a reset
    neither stored nor holds anything since; a preempted one keeps no table and no
    cursor until its next update.

    Raises:
        InvariantError: naming the request, the group and the breach.
    """
    rid = state.request_id
    if state.finished and not state.in_flight and not state.holding:
        raise InvariantError(f"finished request {rid!r} kept")
    if state.recheck_table and (state.holding or any(lo.cursor for lo in state.lanes.values())):
        raise InvariantError(f"request {rid!r}: stored or held from a table not compared again")
    if state.preempted and any(lo.table or lo.cursor for lo in state.lanes.values()):
        raise InvariantError(f"request {rid!r}: preempted, yet a table or cursor is kept")
    for name, lane in state.lanes.items():
        if lane.ids != {e for e in lane.table if e is not None}:
            raise InvariantError(
                f"request {rid!r}: group {name!r}: the GPU block ids kept "
                f"{sorted(lane.ids)} are not the table's {lane.table}"
            )
    if state.hit is None:
        if any(lane.pin is not None for lane in state.lanes.values()):
            raise InvariantError(f"request {rid!r}: pins without a hit")
        return
    if state.hit % align:
        raise InvariantError(f"request {rid!r}: unaligned hit {state.hit}")
    for name, lane in state.lanes.items():
        span = load_range(groups[name], state.hit, state.hit_from)
        if lane.pin is None or len(lane.pin) != len(span):
            got = None if lane.pin is None else len(lane.pin)
            raise InvariantError(
                f"request {rid!r}: group {name!r} pins {got} blocks for a hit needing {len(span)}"
            )


def check_ledgers(
    ledgers: Mapping[str, BlockLedger],
    requests: Iterable[GroupedRequest],
    loads: Mapping[str, Mapping[int, LoadRecord]],
    parked: Mapping[str, Iterable[list[CpuBlock]]],
) -> None:
    """Check every group's pool and ledger, and that the ledger's pins are the requests'
    lookups and the ``parked`` parts of loads cancelled part by part (`LoadsInFlight`), its
    plans the requests' plans in flight (an abandoned load or a lazy store: no
    request's) and its load plans those ``loads`` records.

    Raises:
        InvariantError: naming the group and the breach.
    """
    states = list(requests)
    for name, ledger in ledgers.items():
        ledger.check_invariants()
        pins = {id(p) for p in ledger.pins()}
        held = {id(s.lanes[name].pin) for s in states if s.lanes[name].pin is not None}
        held.update(id(blocks) for blocks in parked.get(name, ()))
        if pins != held:
            raise InvariantError(f"group {name!r}: the ledger's pins are not the lookups'")
        # an abandoned load serves no request any more (`abandon_grouped()`), nor does a
        # lazy store (it walks the engine's eviction order, not requests)
        plans = {
            rec.plan.plan_id for rec in ledger.plans() if not rec.abandoned and rec.plan.request_ids
        }
        named = {p for s in states for g, p in s.in_flight if g == name}
        if plans != named:
            raise InvariantError(f"group {name!r}: requests' plans {named} != {plans}")
        load_ids = {rec.plan.plan_id for rec in ledger.plans() if rec.plan.kind == "load"}
        if load_ids != set(loads[name]):
            raise InvariantError(f"group {name!r}: load records disagree with the ledger")


def lookup_defers_grouped(  # noqa: PLR0917 - the lookup's state, in its order
    groups: Sequence[KVCacheGroup],
    ledgers: Mapping[str, BlockLedger],
    lanes: Mapping[str, Sequence[BlockHash]],
    hits: Mapping[str, tuple[int, Sequence[CpuBlock]]],
    longer: int,
    num_tokens: int,
    computed: int,
    promoting: Callable[[str, BlockHash], bool] | None = None,
) -> bool:
    """Whether a grouped lookup answers "ask again later": `lookup_defers()` (the
    single-group rule) says so for some group's pool, given the blocks of that group's
    hit (``hits``, as `hit_blocks()`) and those it lacks for the next longer hit,
    ``longer`` tokens; with ``promoting`` (the tiers' `GroupLookupExtension.promoting`),
    a block a promotion of that group's tiers is bringing in counts as being filled."""
    for g in groups:
        ledger = ledgers[g.name]
        hashes = lanes[g.name]
        nxt: list[BlockHash] = []
        if longer <= num_tokens - 1:
            span = load_range(g, longer, computed)
            if span.stop <= len(hashes):
                get = ledger.pool.get_cached
                nxt = [hashes[i] for i in span if get(hashes[i]) is None]
        below = None if promoting is None else functools.partial(promoting, g.name)
        if lookup_defers(ledger, nxt, hits[g.name][1] if g.name in hits else (), below):
            return True
    return False


def hit_blocks(
    groups: Sequence[KVCacheGroup],
    ledgers: Mapping[str, BlockLedger],
    lanes: Mapping[str, Sequence[BlockHash]],
    n: int,
    computed: int,
) -> dict[str, tuple[int, list[CpuBlock]]]:
    """Per group, the first block and the CPU blocks of the hit ``n`` above the engine's
    prefix (`load_range()`; none when ``n`` is not above it), as `find_hit()` found them.

    Raises:
        InvariantError: a block `find_hit()` checked is not cached any more.
    """
    out: dict[str, tuple[int, list[CpuBlock]]] = {}
    for g in groups if n > computed else ():
        span = load_range(g, n, computed)
        get = ledgers[g.name].pool.get_cached
        blocks = [b for b in (get(lanes[g.name][i]) for i in span) if b is not None]
        if len(blocks) != len(span):
            raise InvariantError(f"group {g.name!r}: a checked block vanished")
        out[g.name] = (span.start, blocks)
    return out


def promotions_defer(  # noqa: PLR0917 - the lookup's state, in its order
    groups: Sequence[KVCacheGroup],
    ledgers: Mapping[str, BlockLedger],
    lanes: Mapping[str, Sequence[BlockHash]],
    hits: Mapping[str, tuple[int, Sequence[CpuBlock]]],
    extension: GroupLookupExtension,
    n: int,
    num_tokens: int,
    computed: int,
    checkpoint: int,
) -> bool:
    """After ``extension`` was asked to bring in a longer hit than ``n``: whether a
    promotion of a block a longer hit lacks runs (maybe started just now), so the lookup
    asks again once it landed, as one group's lookup does. A longer hit is the next
    aligned one, or the next store point (where a window or a state is kept), or any
    later aligned one whose every missing block, in every group, is being filled
    (`longer_hit_filling()`: a recurrent group's tier may hold only the state where a
    request ended, none at the points before it)."""
    longer = n + hit_alignment(groups)
    point = (n // checkpoint + 1) * checkpoint
    if any(
        lookup_defers_grouped(
            groups, ledgers, lanes, hits, at, num_tokens, computed, extension.promoting
        )
        for at in ((longer,) if point == longer else (longer, point))
    ):
        return True
    return longer_hit_filling(groups, ledgers, lanes, n, num_tokens, computed, extension.promoting)


def longer_hit_filling(  # noqa: PLR0917 - the lookup's state, in its order
    groups: Sequence[KVCacheGroup],
    ledgers: Mapping[str, BlockLedger],
    lanes: Mapping[str, Sequence[BlockHash]],
    n: int,
    num_tokens: int,
    computed: int,
    promoting: Callable[[str, BlockHash], bool],
) -> bool:
    """Whether some aligned hit longer than ``n`` (at most ``num_tokens - 1``) needs, in
    every group, only blocks on CPU or being filled (stored or promoted: the ledger's
    pending hashes, or ``promoting``), at least one of them being filled: once they land
    it is the hit. A full group's blocks are walked once (the run from ``computed`` of
    blocks there or coming bounds the candidates); the other kinds' few blocks are checked
    per candidate, each block once."""
    seen: dict[tuple[str, int], int] = {}

    def state(name: str, i: int) -> int:
        """Of block ``i`` of group ``name``: 0 on CPU, 1 being filled, 2 neither."""
        got = seen.get((name, i))
        if got is None:
            ledger, block_hash = ledgers[name], lanes[name][i]
            if ledger.pool.get_cached(block_hash) is not None:
                got = 0
            else:
                got = 1 if block_hash in ledger.pending or promoting(name, block_hash) else 2
            seen[name, i] = got
        return got

    align = hit_alignment(groups)
    cap = num_tokens - 1
    filling_from = cap + 1  # the first token of a full group's block being filled
    for g in groups:
        if g.kind != "full":
            continue
        hashes, bs = lanes[g.name], g.block_size
        i = computed // bs
        end = min(len(hashes), cap // bs)
        while i < end:
            got = state(g.name, i)
            if got == 2:
                break
            if got == 1:
                filling_from = min(filling_from, i * bs)
            i += 1
        cap = min(cap, i * bs)
    for at in range(cap // align * align, n, -align):
        filling = filling_from < at
        for g in groups:
            if g.kind == "full":
                continue
            span = load_range(g, at, computed)
            hashes = lanes[g.name]
            if span.stop > len(hashes):
                break
            states = [state(g.name, i) for i in span]
            if 2 in states:
                break
            filling = filling or 1 in states
        else:
            if filling:
                return True
    return False


def open_grouped_loads(  # noqa: PLR0917 - the load's state, in its order
    groups: Sequence[KVCacheGroup],
    ledgers: Mapping[str, BlockLedger],
    counts: Mapping[str, GroupCounts],
    loads: Mapping[str, dict[int, LoadRecord]],
    state: GroupedRequest,
    dests: Mapping[str, list[int]],
    num_tokens: int,
) -> tuple[dict[str, TransferPlan], GroupedLoad | None]:
    """Open, per group, the load of ``num_tokens`` of the request's pinned hit into
    ``dests``, the GPU blocks it loads into (`load_destinations()`, which takes only the
    first blocks of each pin for a load shorter than the hit): the pins become the plans'
    references (the rest of a pin is released, as one group's load releases it,
    `BlockLedger.open_load()`), each plan is recorded in ``loads`` and counted in its
    group's counters.

    Returns:
        Per group, its plan, and the `GroupedLoad` they are parts of (``None``: no plan).
        A load that does not cover every lane could not give a whole hit back: spoiled.
    """
    rid = state.request_id
    n = state.hit_from + num_tokens
    load = GroupedLoad(rid, n, state.hit_from, set())
    plans: dict[str, TransferPlan] = {}
    records = note_load(groups, state, n)
    for name, lane in state.lanes.items():
        pinned = lane.pin
        lane.pin = None
        if pinned is None:
            continue
        dest = dests[name]
        plan, concurrent = ledgers[name].open_load(pinned, len(dest), dest, rid, num_tokens)
        if plan is not None:
            counters = counts[name].counters
            counters.load_plans += 1
            counters.concurrent_load_blocks += concurrent
            plans[name] = plan
            records[name].load = load
            loads[name][plan.plan_id] = records[name]
            state.in_flight.add((name, plan.plan_id))
    if not plans:
        return plans, None
    load.open.update(plans)
    load.spoiled = load.open != state.lanes.keys()
    return plans, load
