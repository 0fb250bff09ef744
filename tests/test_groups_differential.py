"""One full-attention group through `OffloadScheduler` and two full-attention groups of the
same geometry through `GroupedScheduler` run one seeded random workload (shared prefixes,
lookups that defer, loads, stores each step, completions in random order and some failing,
finishes, preemptions, a pool small enough to evict and defer), also with a per-step store
limit and an admission filter, and with lazy stores (from a simulated GPU prefix cache's
eviction order): every lookup gives the same hit, every step plans the same blocks, each
group's pool holds what the one pool holds, and each group counts what the one scheduler
counts."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvoffload.config import OffloadConfig
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler, SchedulerStatistics
from kvoffload.scheduler.groups import GroupedPlan, GroupedScheduler
from kvoffload.transfer.plan import TransferPlan
from tests.groups_helpers import group

BS = 4
CPU_BLOCKS = 14
GPU_CACHED = 12  # free GPU blocks that keep their KV (the engine's prefix cache), at most
NAMES = ("a", "b")
# The counters both report with the same meaning (per group for the grouped scheduler).
COUNTERS = (
    "stored_blocks",
    "loaded_blocks",
    "deferred_blocks",
    "deferred_steps",
    "store_plans",
    "load_plans",
    "failed_stores",
    "failed_loads",
    "concurrent_load_blocks",
    "cancelled_plans",
    "ignored_completions",
    "evicted_while_live",
    "restored_blocks",
    "held_blocks",
    "hold_expired_blocks",
)


def chain(tag: str, tokens: list[int]) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens`` in namespace ``tag``."""
    out: list[bytes] = []
    prev = tag.encode()
    for k in range(len(tokens) // BS):
        prev = hashlib.sha256(prev + repr(tokens[k * BS : (k + 1) * BS]).encode()).digest()
        out.append(prev)
    return out


class View:
    """The simulated engine's free GPU blocks that still hold their KV, next to be evicted
    first, under one namespace's hashes."""

    def __init__(self, blocks: list[tuple[int, bytes]]) -> None:
        self.blocks = blocks

    def iter_eviction_order(self) -> Iterator[tuple[int, BlockHash]]:
        return iter((i, BlockHash(h)) for i, h in self.blocks)


@dataclass
class Req:
    rid: str
    tokens: list[int]
    prompt: int
    computed: int = 0
    hashed: int = 0  # tokens hashed so far (hashes never shrink, across preemptions too)
    table: list[int] = field(default_factory=list)
    waiting: bool = True  # admitted by a lookup next


class Pair:
    """The two schedulers, driven with the same calls."""

    def __init__(self, **settings: object) -> None:
        config = OffloadConfig.model_validate(
            {"block_size": BS, "num_cpu_blocks": CPU_BLOCKS, **settings}
        )
        self.one = OffloadScheduler(config, CpuBlockPool(CPU_BLOCKS))
        self.one.clock = lambda: 0.0
        groups = [group(n, "full", BS) for n in NAMES]
        self.grouped = GroupedScheduler(
            groups, {n: CpuBlockPool(CPU_BLOCKS) for n in NAMES}, config=config
        )
        self.grouped.clock = lambda: 0.0
        self.in_flight: list[tuple[TransferPlan, GroupedPlan]] = []
        self.gpu_ids = itertools.count()
        self.lazy = config.store_mode == "lazy"
        # the engine's free GPU blocks holding KV, oldest (evicted next) first:
        # gpu id -> (hash in "one", hash per group)
        self.free: OrderedDict[int, tuple[bytes, dict[str, bytes]]] = OrderedDict()

    def hashes(self, req: Req) -> tuple[list[bytes], dict[str, list[bytes]]]:
        req.hashed = max(req.hashed, req.prompt, req.computed)
        known = req.tokens[: req.hashed]
        return chain("one", known), {n: chain(n, known) for n in NAMES}

    def tables(self, req: Req) -> dict[str, list[int | None]]:
        return {n: list(req.table) for n in NAMES}

    def grow_table(self, req: Req, tokens: int) -> None:
        while len(req.table) * BS < tokens:
            req.table.append(next(self.gpu_ids))

    def release_blocks(self, req: Req) -> None:
        """The engine frees ``req``'s computed full blocks (tail first, as vLLM): they
        join the eviction order, and the oldest beyond `GPU_CACHED` are reused."""
        one_h, grouped_h = self.hashes(req)
        n = min(req.computed // BS, len(req.table), len(one_h))
        for i in reversed(range(n)):
            self.free[req.table[i]] = (one_h[i], {g: grouped_h[g][i] for g in NAMES})
        while len(self.free) > GPU_CACHED:
            self.free.popitem(last=False)

    def plan_stores(self) -> tuple[TransferPlan | None, GroupedPlan | None]:
        if not self.lazy:
            return self.one.plan_stores(), self.grouped.plan_stores()
        blocks = list(self.free.items())
        one = View([(i, h) for i, (h, _) in blocks])
        views = {g: View([(i, hs[g]) for i, (_, hs) in blocks]) for g in NAMES}
        return self.one.plan_stores(one), self.grouped.plan_stores(views)

    def pair(self, one: TransferPlan | None, grouped: GroupedPlan | None, what: str) -> None:
        if one is None:
            assert grouped is None, what
            return
        assert grouped is not None, what
        assert set(grouped.plans) == set(NAMES), what
        for n in NAMES:
            assert grouped.plans[n].gpu_block_ids == one.gpu_block_ids, (what, n)
        self.in_flight.append((one, grouped))

    def check(self, what: str) -> None:
        self.one.check_invariants()
        self.grouped.check_invariants()
        pool = self.one.pool
        for n in NAMES:
            gpool = self.grouped.ledger(n).pool
            assert (gpool.num_free, gpool.num_cached) == (pool.num_free, pool.num_cached), (
                what,
                n,
            )


def admit(pair: Pair, req: Req, rng: random.Random, log: list[object]) -> None:
    one_h, grouped_h = pair.hashes(req)
    defer = rng.random() < 0.3
    hit = pair.one.lookup(req.rid, one_h, req.prompt, allow_defer=defer)
    ghit = pair.grouped.lookup(req.rid, grouped_h, req.prompt, allow_defer=defer)
    assert hit == ghit, (req.rid, "lookup", hit, ghit)
    log.append(("lookup", req.rid, hit))
    if hit is None:
        return  # asked again next step
    req.waiting = False
    if hit and rng.random() < 0.8:
        pair.grow_table(req, hit + 1)
        plan = pair.one.plan_load(req.rid, req.table, hit)
        gplan = pair.grouped.plan_load(req.rid, pair.tables(req), hit)
        pair.pair(plan, gplan, f"load {req.rid}")
        req.computed = hit
    else:
        pair.one.release(req.rid)
        pair.grouped.release(req.rid)
        req.computed = 0


def run(
    seed: int, steps: int = 70, **settings: object
) -> tuple[list[object], SchedulerStatistics, int]:
    rng = random.Random(seed)
    pair = Pair(**settings)
    holds = bool(settings.get("hold_blocks_on_finish"))
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((8, 12, 16, 24)))] for _ in range(3)]
    reqs: dict[str, Req] = {}
    log: list[object] = []
    ids = itertools.count()
    for step in range(steps):
        if len(reqs) < 5 and rng.random() < 0.6:
            prefix = rng.choice(prefixes) if rng.random() < 0.8 else []
            prompt = prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
            tokens = prompt + [rng.randrange(1000) for _ in range(rng.randrange(0, 14))]
            rid = f"r{next(ids)}"
            reqs[rid] = Req(rid, tokens, len(prompt))
        for req in list(reqs.values()):
            if req.waiting:
                admit(pair, req, rng, log)
                continue
            if req.computed < len(req.tokens):
                req.computed = min(len(req.tokens), req.computed + rng.randrange(1, 9))
            pair.grow_table(req, req.computed)
            one_h, grouped_h = pair.hashes(req)
            pair.one.update(req.rid, req.table, one_h, req.computed)
            pair.grouped.update(req.rid, pair.tables(req), grouped_h, req.computed)
        pair.pair(*pair.plan_stores(), f"step {step} stores")
        released = pair.one.take_released_holds()
        greleased = pair.grouped.take_released_holds()
        assert all(greleased.get(n, []) == released for n in NAMES), (step, "released holds")
        # completions in random order, some failing, some later
        rng.shuffle(pair.in_flight)
        keep: list[tuple[TransferPlan, GroupedPlan]] = []
        for one, grouped in pair.in_flight:
            if rng.random() < 0.5:
                keep.append((one, grouped))
                continue
            ok = rng.random() < 0.93
            assert pair.one.complete(one, ok)
            for n in NAMES:
                assert pair.grouped.complete(n, grouped.plans[n], ok)
        pair.in_flight = keep
        for req in list(reqs.values()):
            if req.waiting:
                continue
            state = pair.one.request_state(req.rid)
            caught_up = state.num_stored_blocks >= min(req.computed // BS, len(req.table))
            done = req.computed >= len(req.tokens)
            r = rng.random()
            if (caught_up or holds or pair.lazy) and (done or r < 0.05):
                pair.release_blocks(req)
                held = list(pair.one.finish(req.rid))
                assert pair.grouped.finish(req.rid) is None, req.rid
                gheld = pair.grouped.held_blocks(req.rid)
                assert all(gheld.get(n, []) == held for n in NAMES), (req.rid, held, gheld)
                log.append(("held", req.rid, len(held)))
                del reqs[req.rid]
            elif r > 0.95:
                pair.release_blocks(req)
                pair.one.preempt(req.rid)
                pair.grouped.preempt(req.rid)
                req.waiting, req.computed, req.table = True, 0, []
        pair.check(f"seed {seed} step {step}")
    while pair.in_flight:
        one, grouped = pair.in_flight.pop(rng.randrange(len(pair.in_flight)))
        pair.one.complete(one, True)
        for n in NAMES:
            pair.grouped.complete(n, grouped.plans[n], True)
    pair.check(f"seed {seed} drained")
    want = pair.one.statistics()
    got = pair.grouped.statistics()
    for n in NAMES:
        for name in COUNTERS:
            assert getattr(got[n], name) == getattr(want, name), (seed, n, name)
    return log, want, pair.one.pool.statistics().evictions


@pytest.mark.parametrize("seed", range(50))
def test_two_full_groups_behave_as_one(seed: int) -> None:
    run(seed)


# The store settings with their one-group meaning: a per-step limit small enough to cut
# steps, and an admission filter that refuses a block's first offer.
STORE_SETTINGS = {"max_store_blocks_per_step": 3, "store_admission": "seen_twice"}


@pytest.mark.parametrize("seed", range(30))
def test_two_full_groups_behave_as_one_with_the_store_settings(seed: int) -> None:
    run(seed, **STORE_SETTINGS)


@pytest.mark.parametrize("seed", range(30))
def test_two_full_groups_behave_as_one_restoring_evicted_blocks(seed: int) -> None:
    run(seed, restore_evicted=True)


HOLDS = {"hold_blocks_on_finish": True, "hold_max_blocks": 5, "hold_max_steps": 1}


@pytest.mark.parametrize("seed", range(30))
def test_two_full_groups_behave_as_one_holding_blocks_on_finish(seed: int) -> None:
    """Requests finish also before their blocks are all stored: each group holds what
    one group holds (within the budget), and releases it at the same step."""
    run(seed, **HOLDS)


LAZY = {"store_mode": "lazy", "lazy_offload_blocks": 5}


@pytest.mark.parametrize("seed", range(30))
def test_two_full_groups_behave_as_one_storing_lazily(seed: int) -> None:
    """Lazy stores: each group walks its own view of the engine's eviction order with the
    one-group lazy scan, so both plan the same blocks and hit alike."""
    run(seed, **LAZY)


@pytest.mark.parametrize("seed", range(10))
def test_two_full_groups_behave_as_one_storing_lazily_with_a_step_limit(seed: int) -> None:
    run(seed, **LAZY, max_store_blocks_per_step=2)


def test_lazy_stores_take_effect_in_the_workload() -> None:
    """The lazy workload stores, hits, defers and evicts (so the comparison sees them),
    and stores other blocks than eager stores do."""
    hits = deferred = evictions = 0
    for seed in range(10):
        log, lazy, evicted = run(seed, **LAZY)
        _, eager, _ = run(seed)
        assert lazy.stored_blocks != eager.stored_blocks, seed
        hits += sum(1 for e in log if isinstance(e, tuple) and e[0] == "lookup" and e[2])
        deferred += lazy.deferred_blocks
        evictions += evicted
    assert hits
    assert deferred
    assert evictions


def test_the_store_settings_take_effect_in_the_workload() -> None:
    """The settings change what the workload stores (so the comparison above sees them)."""
    for seed in range(5):
        _, plain, _ = run(seed)
        _, limited, _ = run(seed, **STORE_SETTINGS)
        assert limited.stored_blocks < plain.stored_blocks, seed
    restored = sum(run(seed, restore_evicted=True)[1].restored_blocks for seed in range(10))
    assert restored
    held = expired = 0
    for seed in range(30):
        log, stats, _ = run(seed, **HOLDS)
        held += sum(e[2] for e in log if isinstance(e, tuple) and e[0] == "held")
        expired += stats.hold_expired_blocks
    assert held
    assert expired


def test_the_workload_evicts_defers_and_hits() -> None:
    """The workload reaches what it is meant to compare: hits, "ask again" answers,
    deferred stores, failed copies and evictions."""
    hits = asks = evictions = deferred = failed = 0
    for seed in range(10):
        log, stats, evicted = run(seed)
        hits += sum(1 for e in log if isinstance(e, tuple) and e[0] == "lookup" and e[2])
        asks += sum(1 for e in log if isinstance(e, tuple) and e[0] == "lookup" and e[2] is None)
        evictions += evicted
        deferred += stats.deferred_blocks
        failed += stats.failed_stores + stats.failed_loads
    assert hits
    assert asks
    assert evictions
    assert deferred
    assert failed
