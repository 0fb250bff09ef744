"""Replaying request traces through `CpuBlockPool`: hit rates per policy, the optimal bound
and the infinite-capacity ceiling.

The replay follows the trace README's block-level model, in arrival order. A request
``lookup``s its block hashes and pins the leading run found (its *prefix hits*), then
stores every missing block (allocate and publish; admission filters may refuse some,
and blocks beyond a full pool are skipped), then frees all its blocks tail first, which
is what the offload scheduler does for a request that runs to completion.

`optimal_hits` is Belady's rule (evict the block whose next use is farthest in the
future, bypassing a block whose own next use is farther still) in O(N log N) for N block
accesses. It is optimal for block hits; prefix hits count only the leading run, for which
it is the reference bound the trace README uses. `ceiling_hits` is what an infinite pool
gets: a block hits once it was seen before.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, final

from kvoffload.bench.trace import HASH_ID_MAX, HASH_ID_MIN, read_trace, useful_capacity
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.hints import RetentionHints, leading_runs
from kvoffload.pool.policies import POLICY_NAMES, STATIC_POLICY_NAMES, make_policy
from kvoffload.pool.policies.admission import make_admission
from kvoffload.pool.priority import DEFAULT_RETAINED_FRACTION, default_max_retained

__all__ = [
    "REPLAY_SCHEMA_VERSION",
    "CapacityRow",
    "MissSplit",
    "PolicyResult",
    "PriorityHits",
    "ReplayReport",
    "Trace",
    "ceiling_hits",
    "load_trace",
    "optimal_hits",
    "replay_pool",
    "run_replay",
    "smallest_capacity",
    "static_frequency_hits",
    "useful_capacity",
]

REPLAY_SCHEMA_VERSION = 3
"""Version of the JSON `ReplayReport.to_json()` writes (``kvoffload replay --json``)."""


@final
@dataclass(frozen=True, slots=True)
class Trace:
    """A request trace: per request, its block ids in prefix order.

    Attributes:
        path: where it was read from ("" when built in memory).
        requests: block ids per request.
        priorities: per request its retention priority; empty when the trace carries
            none (every request 0).
        hints: per request ``(arrival in seconds, session, retain_for_s)``; empty when
            the trace gives no retention hint (docs/hints.md).
    """

    path: str
    requests: tuple[tuple[int, ...], ...]
    priorities: tuple[int, ...] = ()
    hints: tuple[tuple[float, str | None, float | None], ...] = ()

    @property
    def num_blocks(self) -> int:
        """Block accesses over all requests."""
        return sum(len(r) for r in self.requests)

    @property
    def num_unique(self) -> int:
        """Distinct block ids (the capacity that holds everything)."""
        return len({b for r in self.requests for b in r})


def load_trace(path: str | Path) -> Trace:
    """Read a Mooncake-format trace (one JSON object a line, see ``docs/policies.md``).

    Raises:
        FileNotFoundError: no such file.
        TraceFormatError: a line is not a trace record (a ``ValueError``); the message names
            the file, the line and the field.
        OSError: the file cannot be read.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    records = list(read_trace(path))
    priorities = tuple(r.priority for r in records)
    hinted = any(r.retain_for_s is not None for r in records)
    return Trace(
        str(path),
        tuple(r.hash_ids for r in records),
        priorities if any(priorities) else (),
        tuple((r.timestamp_ms / 1000, r.session, r.retain_for_s) for r in records)
        if hinted
        else (),
    )


def _keys(trace: Trace) -> list[list[BlockHash]]:
    intern: dict[int, BlockHash] = {}
    out = []
    for i, request in enumerate(trace.requests):
        keys = []
        for h in request:
            key = intern.get(h)
            if key is None:
                if type(h) is not int or not HASH_ID_MIN <= h <= HASH_ID_MAX:
                    raise ValueError(
                        f"request {i} of trace {trace.path!r}: block id {h!r} is not an "
                        "integer in the signed 128-bit range of block keys"
                    )
                key = intern[h] = BlockHash(h.to_bytes(16, "little", signed=True))
            keys.append(key)
        out.append(keys)
    return out


@final
@dataclass(frozen=True, slots=True)
class PriorityHits:
    """The requests of one priority, replayed under one policy.

    Attributes:
        priority: the requests' priority.
        requests: how many requests carry it.
        blocks: their block accesses.
        hit_blocks: their prefix hits.
        hit_rate: ``hit_blocks / blocks``.
    """

    priority: int
    requests: int
    blocks: int
    hit_blocks: int
    hit_rate: float


@final
@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy at one capacity.

    Attributes:
        policy: policy name.
        hit_blocks: prefix hits.
        hit_rate: ``hit_blocks`` over the trace's block accesses.
        stored_blocks: blocks stored (allocated and published).
        refused_blocks: missing blocks the admission filter refused.
        evictions: published blocks the pool evicted.
        by_priority: hits per request priority, lowest first (one entry, priority 0,
            for a trace without priorities).
        misses: with ``explain``, the missed blocks split by cause (`MissSplit`).
        hinted: whether the trace's retention hints were honoured.
    """

    policy: str
    hit_blocks: int
    hit_rate: float
    stored_blocks: int
    refused_blocks: int
    evictions: int
    by_priority: tuple[PriorityHits, ...] = ()
    misses: MissSplit | None = None
    hinted: bool = False


@final
@dataclass(frozen=True, slots=True)
class MissSplit:
    """A policy's missed blocks (accesses past each request's prefix hit), by cause.

    Attributes:
        cold: the block's first use in the trace: no cache could have hit it.
        capacity: the block was stored before and evicted since: a larger pool (or a
            better policy) would have hit it.
        other: the rest: the block was stored and is still cached but lies past the
            request's first missing block (a prefix hit stops there), or it was seen
            but never stored (admission refused it, or no block was free).
    """

    cold: int
    capacity: int
    other: int


def replay_pool(
    trace: Trace | Sequence[Sequence[BlockHash]],
    capacity: int,
    policy: str = "lru",
    admission: str = "always",
    *,
    priorities: Sequence[int] | None = None,
    hints: Sequence[tuple[float, str | None, float | None]] | None = None,
    retained_fraction: float = DEFAULT_RETAINED_FRACTION,
    explain: bool = False,
    on_progress: Callable[[int], None] | None = None,
) -> PolicyResult:
    """Replay a trace through a `CpuBlockPool` of ``capacity`` blocks.

    With ``hints`` (``Trace.hints``), a request that gives ``retain_for_s`` retains its
    blocks for its session (`RetentionHints`, in trace time, within
    ``retained_fraction`` of the pool) after it ran; a later hint of the session replaces
    it, and it ends by itself at its deadline. Entries without ``retain_for_s`` change
    nothing: a trace whose hints are never given replays exactly as without ``hints``.

    A request's priority goes to the blocks it touches (hits) and publishes (stores), so
    the pool evicts the blocks of lower-priority requests first.

    A capacity above `useful_capacity()` replays with that many blocks: a larger pool
    holds nothing more, and would only cost memory.

    Args:
        trace: a `Trace`, or per request its block hashes.
        capacity: pool size in blocks.
        policy: a registered eviction policy name.
        admission: an admission spec (``"always"``, ``"seen_twice"``, ``"seen:N[:W]"``).
        priorities: per request its priority (a `Trace` brings its own); ``None`` or
            empty: every request 0.
        hints: per request ``(arrival in seconds, session, retain_for_s)``; ``None`` or
            empty: no hints (a `Trace`'s are used only when passed here).
        retained_fraction: the share of the pool hints may retain (as
            ``OffloadConfig.max_retained_fraction``).
        explain: split the misses by cause (`PolicyResult.misses`).
        on_progress: called with the number of requests replayed since the last call.

    Raises:
        ConfigError: unknown policy or admission spec.
        ValueError: ``capacity`` below 1, or a block id a key cannot hold.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    requests = _keys(trace) if isinstance(trace, Trace) else trace
    if priorities is None and isinstance(trace, Trace):
        priorities = trace.priorities
    if priorities and len(priorities) != len(requests):
        raise ValueError(f"{len(priorities)} priorities for {len(requests)} requests")
    if hints and len(hints) != len(requests):
        raise ValueError(f"{len(hints)} hints for {len(requests)} requests")
    capacity = min(capacity, useful_capacity(requests))
    pool = CpuBlockPool(
        capacity,
        policy=make_policy(policy),
        max_retained_blocks=default_max_retained(capacity, retained_fraction),
    )
    held_hints = (
        RetentionHints(
            leading_runs(lambda h, o, fit: pool.retain(h, owner=o, fit=fit)),
            pool.release_retained,
        )
        if hints
        else None
    )
    seen: set[BlockHash] = set()
    ever_stored: set[BlockHash] = set()
    cold = capacity_misses = other = 0
    is_cached = pool.is_cached
    admit = make_admission(admission).admit
    always = admission.strip().lower() == "always"
    lookup, touch, allocate, publish, free = (
        pool.lookup,
        pool.touch,
        pool.allocate,
        pool.publish,
        pool.free,
    )
    total = hits = stored = refused = 0
    since = 0
    tally: dict[int, list[int]] = {}  # priority -> [requests, blocks, hits]
    for i, keys in enumerate(requests):
        p = priorities[i] if priorities else 0
        if held_hints is not None:
            held_hints.expire(hints[i][0])  # type: ignore[index]
        found = lookup(keys)
        h = len(found)
        touch(found, priority=p)
        missing = keys[h:]
        if explain:
            for key in missing:
                if key not in seen:
                    cold += 1
                elif key in ever_stored and not is_cached(key):
                    capacity_misses += 1
                else:
                    other += 1
            seen.update(missing)
        if not always:
            wanted = [k for k in missing if admit(k)]
            refused += len(missing) - len(wanted)
            missing = wanted
        k = min(len(missing), pool.num_free)
        new = allocate(k)
        for block, key in zip(new, missing[:k], strict=True):
            if publish(block, key, priority=p):
                stored += 1
                if explain:
                    ever_stored.add(key)
        held = found + new
        held.reverse()
        free(held)
        if held_hints is not None:
            at, session, retain_for_s = hints[i]  # type: ignore[index]
            if retain_for_s is not None:
                held_hints.hint(
                    session if session is not None else f"#{i}", keys, retain_for_s, now=at
                )
        total += len(keys)
        hits += h
        row = tally.get(p)
        if row is None:
            row = tally[p] = [0, 0, 0]
        row[0] += 1
        row[1] += len(keys)
        row[2] += h
        since += 1
        if on_progress is not None and since == 256:
            on_progress(since)
            since = 0
    if on_progress is not None and since:
        on_progress(since)
    return PolicyResult(
        policy=pool.policy.name,
        hit_blocks=hits,
        hit_rate=hits / total if total else 0.0,
        stored_blocks=stored,
        refused_blocks=refused,
        evictions=pool.statistics().evictions,
        by_priority=tuple(
            PriorityHits(p, r, b, x, x / b if b else 0.0) for p, (r, b, x) in sorted(tally.items())
        ),
        misses=MissSplit(cold, capacity_misses, other) if explain else None,
        hinted=bool(hints),
    )


def optimal_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Prefix hits under Belady's rule, with bypass, in O(N log N).

    Args:
        requests: block ids per request, in arrival order.
        capacity: cache size in blocks, >= 0.

    Raises:
        ValueError: ``capacity`` is negative.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    # The trace README's model: a request uses all its blocks at once, so a block's next
    # use is the index of the next request holding it (len(requests) + its position when
    # none, unique so that stale heap entries are told apart). Ties leave oldest first.
    flat = [b for r in requests for b in r]
    owner = [i for i, r in enumerate(requests) for _ in r]
    n = len(flat)
    never = len(requests)
    next_use = [0] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        b = flat[i]
        nxt = last.get(b)
        next_use[i] = nxt if nxt is not None else never + i
        last[b] = owner[i]
    resident: dict[int, int] = {}  # block -> next use
    heap: list[tuple[int, int, int]] = []  # (-next use, insertion order, block), lazy
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    pos = 0
    for request in requests:
        for b in request:
            if b not in resident:
                break
            hits += 1
        for b in request:
            nu = next_use[pos]
            pos += 1
            if b in resident:
                resident[b] = nu
                push(heap, (-nu, pos, b))
                continue
            if capacity == 0:
                continue
            if len(resident) >= capacity:
                while -heap[0][0] != resident.get(heap[0][2]):
                    pop(heap)
                if -heap[0][0] <= nu:
                    continue  # the new block is needed last: do not cache it
                del resident[pop(heap)[2]]
            resident[b] = nu
            push(heap, (-nu, pos, b))
    return hits


def static_frequency_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Prefix hits of a cache that keeps forever the most used blocks of the whole trace.

    An offline reference, not a policy: it knows every block's total number of accesses in
    advance, caches a block the first time it is seen if the block is among the
    ``capacity`` most accessed of the trace (ties: the block seen first), never evicts,
    and caches nothing else. It shows how far frequency alone, with perfect knowledge of
    it, can go; an online frequency policy only learns counts as the trace goes by.

    Args:
        requests: block ids per request, in arrival order.
        capacity: cache size in blocks, >= 0.

    Returns:
        The prefix hits (each request's leading run of cached blocks).

    Raises:
        ValueError: ``capacity`` is negative.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    counts: dict[int, int] = {}
    for request in requests:
        for b in request:
            counts[b] = counts.get(b, 0) + 1
    # dicts keep insertion order, so a stable sort breaks ties by first appearance.
    keep = set(sorted(counts, key=counts.__getitem__, reverse=True)[:capacity])
    seen: set[int] = set()
    hits = 0
    for request in requests:
        for b in request:
            if b not in seen or b not in keep:
                break
            hits += 1
        seen.update(request)
    return hits


def ceiling_hits(requests: Iterable[Sequence[int]]) -> int:
    """Prefix hits with an infinite cache: a block hits once it was seen before."""
    seen: set[int] = set()
    hits = 0
    for request in requests:
        for b in request:
            if b not in seen:
                break
            hits += 1
        seen.update(request)
    return hits


@final
@dataclass(frozen=True, slots=True)
class CapacityRow:
    """Every policy at one capacity, with the two references.

    Attributes:
        capacity: pool size in blocks, as asked for.
        results: one per policy, in the order asked for.
        optimal_hit_rate: Belady's prefix hit rate at this capacity.
        pool_blocks: the blocks the pool was built with: ``capacity``, or the trace's
            `useful_capacity()` when that is smaller (a larger pool holds nothing more).
        best_static_policy: the static policy (any but ``"adaptive"``) with the highest
            hit rate among those replayed (the first one on a tie), ``None`` if none was.
        best_static_hit_rate: its hit rate, ``None`` if none was replayed.
        hinted: for a trace with retention hints, each policy again honouring them (in
            the order of ``results``); empty otherwise.
    """

    capacity: int
    results: tuple[PolicyResult, ...]
    optimal_hit_rate: float
    pool_blocks: int
    best_static_policy: str | None = None
    best_static_hit_rate: float | None = None
    hinted: tuple[PolicyResult, ...] = ()


@final
@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What ``kvoffload replay`` measured.

    Attributes:
        trace: the trace's path.
        requests: requests in the trace.
        blocks: block accesses in the trace.
        unique_blocks: distinct blocks.
        useful_capacity: the largest pool the trace can use (`useful_capacity()`).
        admission: the admission spec every policy ran with.
        ceiling_hit_rate: the infinite-capacity prefix hit rate.
        rows: one per capacity, in the order asked for.
    """

    trace: str
    requests: int
    blocks: int
    unique_blocks: int
    useful_capacity: int
    admission: str
    ceiling_hit_rate: float
    rows: tuple[CapacityRow, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (schema `REPLAY_SCHEMA_VERSION`)."""
        data = asdict(self)
        data["schema_version"] = REPLAY_SCHEMA_VERSION
        return data


def run_replay(
    trace: Trace,
    capacities: Sequence[int],
    policies: Sequence[str] = POLICY_NAMES,
    admission: str = "always",
    *,
    explain: bool = False,
    retained_fraction: float = DEFAULT_RETAINED_FRACTION,
    on_progress: Callable[[int], None] | None = None,
) -> ReplayReport:
    """Replay ``trace`` with each policy at each capacity, plus the references.

    A trace with retention hints (``Trace.hints``) is replayed twice per policy and
    capacity, without and with them (`CapacityRow.hinted`), side by side.

    Args:
        trace: the trace.
        capacities: pool sizes in blocks.
        policies: registered policy names.
        admission: the admission spec for every policy.
        explain: split each policy's misses by cause (`MissSplit`).
        retained_fraction: the share of the pool hints may retain.
        on_progress: called with requests replayed (policies x capacities x requests in
            all, twice with hints).

    Raises:
        ConfigError: unknown policy or admission spec (checked before anything runs).
        ValueError: a capacity below 1, a trace without blocks, or a block id a key
            cannot hold.
    """
    for name in policies:
        make_policy(name)
    make_admission(admission)
    if any(c < 1 for c in capacities):
        raise ValueError(f"capacities must be >= 1, got {list(capacities)}")
    total = trace.num_blocks
    if not total:
        raise ValueError(f"the trace {trace.path!r} has no blocks: nothing to replay")
    keys = _keys(trace)
    useful = useful_capacity(trace.requests)
    rows = []
    for capacity in capacities:
        results = tuple(
            replay_pool(
                keys,
                capacity,
                name,
                admission,
                priorities=trace.priorities,
                explain=explain,
                on_progress=on_progress,
            )
            for name in policies
        )
        hinted = tuple(
            replay_pool(
                keys,
                capacity,
                name,
                admission,
                priorities=trace.priorities,
                hints=trace.hints,
                retained_fraction=retained_fraction,
                explain=explain,
                on_progress=on_progress,
            )
            for name in policies
            if trace.hints
        )
        optimal = optimal_hits(trace.requests, capacity)
        static = [r for r in results if r.policy in STATIC_POLICY_NAMES]
        best = max(static, key=lambda r: r.hit_rate) if static else None
        rows.append(
            CapacityRow(
                capacity,
                results,
                optimal / total,
                min(capacity, useful),
                best.policy if best is not None else None,
                best.hit_rate if best is not None else None,
                hinted,
            )
        )
    ceiling = ceiling_hits(trace.requests)
    return ReplayReport(
        trace=trace.path,
        requests=len(trace.requests),
        blocks=total,
        unique_blocks=trace.num_unique,
        useful_capacity=useful,
        admission=admission,
        ceiling_hit_rate=ceiling / total,
        rows=tuple(rows),
    )


def smallest_capacity(
    trace: Trace,
    target: float,
    policy: str = "lru",
    admission: str = "always",
    *,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[int, float, float]:
    """The smallest pool reaching ``target`` x the ceiling hit rate, by bisection.

    Bisection assumes the hit rate grows with capacity (true of LRU and Belady; nearly
    so of the others); the capacity returned is always one that was replayed and
    reached the goal.

    Args:
        trace: the trace.
        target: fraction of the ceiling, in (0, 1].
        policy: eviction policy name.
        admission: admission spec.
        on_progress: as for `replay_pool`.

    Returns:
        ``(capacity, hit_rate, ceiling_hit_rate)``.

    Raises:
        ValueError: ``target`` outside (0, 1] (NaN included), an empty trace, or a block id
            a key cannot hold.
    """
    if not 0.0 < target <= 1.0:  # False for NaN too
        raise ValueError(f"target must be in (0, 1], got {target}")
    total = trace.num_blocks
    if not total:
        raise ValueError(f"the trace {trace.path!r} has no blocks: nothing to size")
    ceiling = ceiling_hits(trace.requests) / total
    goal = target * ceiling
    keys = _keys(trace)
    lo, hi = 1, max(1, trace.num_unique)
    rate_hi = replay_pool(
        keys, hi, policy, admission, priorities=trace.priorities, on_progress=on_progress
    ).hit_rate
    while lo < hi:
        mid = (lo + hi) // 2
        rate = replay_pool(
            keys, mid, policy, admission, priorities=trace.priorities, on_progress=on_progress
        ).hit_rate
        if rate >= goal:
            hi, rate_hi = mid, rate
        else:
            lo = mid + 1
    return hi, rate_hi, ceiling
