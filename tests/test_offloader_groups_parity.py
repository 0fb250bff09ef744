"""Every feature of `KVOffloader` on two full-attention groups of identical geometry
behaves as on one full group: the seeded workload of
`tests/test_offloader_groups_differential.py` (shared prefixes, retention priorities,
lookups that defer or not, loads, stores, finishes, preemptions, a pool small enough to
evict and defer), with retention (`retain_prefix()`, `release_retained()`), session
hints, abandoned loads, events and each store setting mixed in, compares after every
step every `SchedulerStatistics` field (each group's against the one group's, and the
whole model's where its meaning says it adds up or counts once), the events of each
group against the one group's, and every value the calls return. The tests with a tier
run over a second shape too: one full group beside a group that caches nothing, a
`GroupedScheduler` of one lane, whose every counter (each tier manager's
``deferred_lookups`` included) is the one group's `OffloadScheduler`'s (``shape``)."""

from __future__ import annotations

import contextlib
import random
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import InvalidInputError, TransferError
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHash
from kvoffload.pinner import RefCountPinner
from kvoffload.pool.events import PoolStatistics
from kvoffload.request import OffloadRequest
from kvoffload.scheduler import SchedulerStatistics
from kvoffload.scheduler.misses import MissReason
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import ControllableCopyEngine
from kvoffload.tiers import promote
from kvoffload.tiers.groups import GroupTiers
from kvoffload.tiers.stats import TierStatistics
from tests.test_offloader_groups import ATTN, BS
from tests.test_offloader_groups_differential import CPU_BLOCKS, NUM_GPU
from tests.test_offloader_groups_differential import Req as DifferentialReq

NAMES = ("a", "b")
SHAPES = {"two-groups": ("a", "b"), "one-lane": ("a",)}
"""The grouped offloader's full groups (`NAMES`); with one, a group of kind ``none``
beside it makes it a `GroupedScheduler` of one lane (`Pair`)."""
PRIORITIES = (0, 0, 3)
GPU_CACHED = 12  # free GPU blocks that keep their KV (the engine's prefix cache), at most

# What each whole-model counter of two identical groups is, against the one group's:
# counted once per lookup, request or step ("once"), or every group's added up ("sum").
ONCE = (
    "lookups",
    "hit_tokens",
    "miss_tokens",
    "deferred_lookups",
    "live_requests",
    "loaded_tokens",
    "prompt_tokens",
    "abandoned_loads",
    "deferrals_bounded",
    "lookup_misses",
    "miss_reason_tokens",
)
SUM = (
    "stored_blocks",
    "deferred_blocks",
    "evicted_while_live",
    "restored_blocks",
    "loaded_blocks",
    "bytes_stored",
    "bytes_loaded",
    "concurrent_load_blocks",
    "held_blocks",
    "hold_expired_blocks",
)


@dataclass(frozen=True)
class Mix:
    """What the workload mixes in besides lookups, loads, stores, finishes, preemptions."""

    settings: Mapping[str, object] = field(default_factory=dict)
    retain: bool = False  # retain_prefix() / release_retained()
    hints: bool = False  # hints.retain_for() / release(), finish(retain_for_s=)
    abandon: bool = False  # abandon_load() of loads in flight
    lag: bool = False  # copies stay in flight across steps (half the steps end none)
    reset: bool = False  # reset() now and then, once the copies in flight ended


@dataclass
class Req(DifferentialReq):
    loading: tuple[Any, Any] | None = None  # the load tasks in flight


@pytest.fixture(params=list(SHAPES))
def shape(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped offloader's shape: `NAMES` set to the full groups of ``SHAPES``."""
    monkeypatch.setattr(sys.modules[__name__], "NAMES", SHAPES[request.param])


class Pair:
    """One full group and two of its geometry (or, with one of `NAMES`, a grouped
    offloader of one full group), each engine's copies ended by the test."""

    def __init__(self, **settings: object) -> None:
        self.hosts: list[HostKVBuffer] = []
        config = OffloadConfig.model_validate(
            {"num_cpu_blocks": CPU_BLOCKS, "block_size": BS, **settings}
        )
        kv = [_zeros() for _ in range(ATTN.num_layers)]
        groups = [KVCacheGroup.from_layout(ATTN, name=n) for n in NAMES]
        if len(NAMES) == 1:  # one full group beside one that caches nothing: one lane
            groups.append(KVCacheGroup.from_layout(ATTN, name="enc", kind="none"))
        kvs = {n: [_zeros() for _ in range(ATTN.num_layers)] for n in NAMES}
        self.pinner = RefCountPinner()
        self.pinners = {n: RefCountPinner() for n in NAMES}
        pins: dict[str, Any] = {"pinner": self.pinner}
        group_pins: dict[str, Any] = {"groups": groups, "pinner": dict(self.pinners)}
        if config.tiers:  # tiers copy through the host buffers the offloaders make
            self.engine, self.engines = None, {}
            self.one = KVOffloader(config, kv, **pins)
            self.two = KVOffloader(config, kvs, **group_pins)
            return
        self.engine = self._eng(kv)
        self.one = KVOffloader(config, kv, copy_engine=self.engine, **pins)
        self.engines = {n: self._eng(t) for n, t in kvs.items()}
        self.two = KVOffloader(config, kvs, copy_engine=dict(self.engines), **group_pins)

    def check_pins(self, what: object) -> None:
        """Each group's pinner pins the GPU blocks the one group's pins (copies in flight,
        abandoned loads' copies, finish holds)."""
        want = [b for b in range(NUM_GPU) if self.pinner.is_pinned(b)]
        for n in NAMES:
            got = [b for b in range(NUM_GPU) if self.pinners[n].is_pinned(b)]
            same(want, got, (what, "pinned", n))

    def _eng(self, kv: list[torch.Tensor]) -> ControllableCopyEngine:
        host = HostKVBuffer(ATTN, CPU_BLOCKS, pin_memory="never")
        self.hosts.append(host)
        return ControllableCopyEngine(layout=ATTN, gpu_kv=kv, host=host)

    def complete_all(self) -> None:
        for engine in (self.engine, *self.engines.values()):
            for task in list(engine.pending) if engine is not None else ():
                engine.complete(task)

    def close(self) -> None:
        for host in self.hosts:
            host.close()


def _zeros() -> torch.Tensor:
    return torch.zeros(ATTN.tensor_shape(NUM_GPU))


def same(one: object, two: object, what: object) -> None:
    assert one == two, (what, one, two)


def call(what: object, fn1: Any, fn2: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Both calls with the same arguments, which return or raise alike (the error's
    type)."""
    out: list[Any] = []
    for fn in (fn1, fn2):
        try:
            out.append(fn(*args, **kwargs))
        except InvalidInputError as exc:
            out.append(type(exc))
    if out[0] is InvalidInputError or out[1] is InvalidInputError:
        same(out[0], out[1], what)
    return out[0], out[1]


def compare_statistics(one: KVOffloader, two: KVOffloader, what: object) -> None:
    """Every `SchedulerStatistics` field: each group's counter as the one group's, the
    whole model's counted once or added up as its meaning says."""
    one_stats = one.statistics()
    want = one_stats.scheduler
    stats = two.statistics()
    whole = stats.scheduler
    groups = stats.groups
    assert groups is not None
    per = {f.name for f in fields(next(iter(groups.values())))}
    pool = one.pool.statistics()
    for n in NAMES:
        got = (groups[n].num_cpu_blocks, groups[n].free_cpu_blocks, groups[n].cached_cpu_blocks)
        same((pool.num_blocks, pool.num_free, pool.num_cached), got, (what, "pool", n))
    for name in ("in_flight", "completed", "failed", "abandoned", "callback_errors"):
        # a transfer over every group's part is one transfer, as one group's
        same(getattr(one_stats.poller, name), getattr(stats.poller, name), (what, "poller", name))
    for f in fields(PoolStatistics):  # the groups' pools added up
        value = getattr(pool, f.name)
        same(len(NAMES) * value, getattr(stats.pool, f.name), (what, "pool", f.name))
    for f in fields(SchedulerStatistics):
        name = f.name
        value = getattr(want, name)
        if name in per and name != "lookup_misses":
            for n in NAMES:
                same(value, getattr(groups[n], name), (what, "group", n, name))
        if name in ONCE:
            same(value, getattr(whole, name), (what, "whole", name))
        elif name in SUM:
            same(len(NAMES) * value, getattr(whole, name), (what, "whole", name))
        else:  # a transfer or a step's plan over every group counts once
            same(value, getattr(whole, name), (what, "whole", name))


def compare_events(one: KVOffloader, two: KVOffloader, what: object) -> None:
    """Each group's events are the one group's (block ids and kinds), each naming its
    group."""
    e1 = [(type(e).__name__, getattr(e, "block_id", None)) for e in one.take_events()]
    e2 = two.take_events()
    assert all(e.group in NAMES for e in e2), (what, e2)
    for n in NAMES:
        mine = [(type(e).__name__, getattr(e, "block_id", None)) for e in e2 if e.group == n]
        same(e1, mine, (what, "events", n))


async def settle(off: KVOffloader) -> None:
    """Wait until no write-down or promotion of ``off``'s tiers runs."""
    tiers = off.tiers
    assert tiers is not None
    with anyio.fail_after(30):
        while True:
            await off.drain()
            stats = tiers.statistics()
            if not stats.refs_held and not stats.promotions_in_flight:
                return
            await anyio.sleep(0.002)


# A tier's counters that do not count time or name the tier.
TIER_COUNTERS = tuple(
    f.name for f in fields(TierStatistics) if f.type in ("int", "bool") or f.name == "last_error"
)


# The promotion counters of a tier manager (each group's added up for the whole model).
PROMOTION_COUNTERS = (
    "promotions",
    "promotions_no_space",
    "promotion_errors",
    "refs_held",
    "prefetches",
    "prefetches_completed",
    "prefetches_cancelled",
    "prefetch_blocks_promoted",
    "prefetches_bounded",
)


def compare_tiers(one: KVOffloader, two: KVOffloader, what: object) -> None:
    """Each group's tier stack counts what the one group's counts (its
    ``deferred_lookups`` too: the lookups that waited for its promotions); the whole
    model's promotion counters are every group's added up, its ``deferred_lookups`` are
    the lookups' (each counted once)."""
    assert one.tiers is not None
    assert isinstance(two.tiers, GroupTiers)
    want = one.tiers.statistics()
    per = two.tiers.group_statistics()
    whole = two.tiers.statistics()
    for n in NAMES:
        got = per[n]
        for name in PROMOTION_COUNTERS:
            same(getattr(want, name), getattr(got, name), (what, n, name))
            same(len(NAMES) * getattr(want, name), getattr(whole, name), (what, "whole", name))
        same(want.deferred_lookups, got.deferred_lookups, (what, n, "deferred_lookups"))
        [t1] = want.tiers
        [t2] = got.tiers
        assert t2.name == f"{t1.name}.{n}", (what, t2.name)
        for name in TIER_COUNTERS:
            same(getattr(t1, name), getattr(t2, name), (what, n, "tier", name))
    same(want.deferred_lookups, whole.deferred_lookups, (what, "whole", "deferred_lookups"))


async def _wait(task: Any) -> None:
    if task is not None:
        with contextlib.suppress(TransferError):
            await task


async def run(seed: int, mix: Mix, steps: int = 40) -> dict[str, int]:
    pair = Pair(**mix.settings)
    try:
        async with pair.one, pair.two:
            try:
                return await Workload(pair, seed, mix).run(steps)
            finally:
                pair.complete_all()  # a failed check: the copies end before the offloaders close
    finally:
        pair.close()


class View:
    """The engine's free GPU blocks that keep their KV, the next to be evicted first."""

    def __init__(self, blocks: list[tuple[int, BlockHash]]) -> None:
        self.blocks = blocks

    def iter_eviction_order(self) -> Iterator[tuple[int, BlockHash]]:
        return iter(self.blocks)


class Workload:
    """The seeded engine driving both offloaders with the same calls."""

    def __init__(self, pair: Pair, seed: int, mix: Mix) -> None:
        self.one, self.two = pair.one, pair.two
        self.pair, self.seed, self.mix = pair, seed, mix
        self.rng = random.Random(seed)
        self.prefixes = [
            [self.rng.randrange(1000) for _ in range(self.rng.choice((8, 12, 16)))]
            for _ in range(3)
        ]
        self.free = list(range(NUM_GPU))
        self.reqs: dict[str, Req] = {}
        seen = ("hits", "asks", "retained", "released", "hinted", "abandoned", "events")
        self.seen = dict.fromkeys((*seen, "tier_hits", "prefetched", "resets"), 0)
        self.owners: list[object] = []
        self.sessions: list[object] = []
        Workload.now = 0.0
        self.step = 0
        self.lazy = mix.settings.get("store_mode") == "lazy"
        # the engine's free GPU blocks holding KV (lazy stores), evicted oldest first
        self.cached: OrderedDict[int, tuple[BlockHash, dict[str, BlockHash]]] = OrderedDict()

    def what(self, *more: object) -> tuple[object, ...]:
        return (self.seed, self.step, *more)

    now = 0.0
    """The workload's clock (a second a step): one for both offloaders."""

    def clock(self) -> float:
        return Workload.now

    async def run(self, steps: int) -> dict[str, int]:
        one, two = self.one, self.two
        assert two.groups is not None
        # deferral deadlines, hints: one clock, a second per step
        one.scheduler.clock = two._life.front.scheduler.clock = self.clock
        one.hints.clock = two.hints.clock = self.clock
        for self.step in range(steps):
            Workload.now += 1.0
            self.retention()
            if self.mix.hints and one.tiers is not None and self.rng.random() < 0.2:
                await self.prefetch()
            self.admit_new()
            self.abandon()
            hits: list[Req] = []
            for rid, r in list(self.reqs.items()):
                if r.waiting:
                    if self.lookup(rid, r):
                        hits.append(r)
                    if one.tiers is not None:
                        # the promotions this lookup started end before anything else
                        # runs (two promotions, or a promotion and a copy, would take
                        # CPU blocks in the order the threads end them)
                        await settle(one)
                        await settle(two)
                elif r.loading is None:
                    self.advance(r)
            for r in hits:
                r.loading = (r.one.load(r.table), r.two.load(dict.fromkeys(NAMES, r.table)))
            if one.tiers is not None:
                await self.complete()  # the copy engines' threads end loads and stores
                # in any order: the loads end first
            self.store()
            self.end_some()
            compare_statistics(one, two, self.what("in flight"))
            self.pair.check_pins(self.what("in flight"))
            if not self.mix.lag or self.rng.random() < 0.5:
                await self.complete()
                if self.mix.reset and self.rng.random() < 0.08:
                    # nothing in flight: the CPU caches, retention and hints are dropped
                    same(await one.reset(), await two.reset(), self.what("reset"))
                    self.owners.clear()
                    self.seen["resets"] += 1
            one.check_invariants()
            two.check_invariants()
            compare_statistics(one, two, self.what())
            self.pair.check_pins(self.what())
            if self.mix.settings.get("enable_events"):
                compare_events(one, two, self.what())
                self.seen["events"] += 1
        await self.complete()
        for r in self.reqs.values():
            r.one.finish()
            r.two.finish()
        await self.complete()
        compare_statistics(one, two, (self.seed, "end"))
        stats = one.statistics().scheduler
        for name in ONCE + SUM:
            value = getattr(stats, name)
            if isinstance(value, int):
                self.seen[name] = value
        return self.seen

    async def complete(self) -> None:
        """End every copy in flight, in submission order, and wait for the loads (with
        tiers: every write-down and promotion too)."""
        self.pair.complete_all()
        await self.one.drain()
        await self.two.drain()
        if self.one.tiers is not None:
            await settle(self.one)
            await settle(self.two)
            compare_tiers(self.one, self.two, self.what("tiers"))
        for r in self.reqs.values():
            if r.loading is not None:
                for task in r.loading:
                    await _wait(task)
                r.loading = None

    async def prefetch(self) -> None:
        """``hints.prefetch()`` of a prefix and a few tokens (a context the next turn
        extends): one group answers its leading blocks on CPU, several the tokens a
        lookup of a longer prompt finds there."""
        prompt = [*self.rng.choice(self.prefixes), *range(5000, 5000 + self.rng.randrange(5))]
        blocks = await self.one.hints.prefetch(prompt)
        tokens = await self.two.hints.prefetch(prompt)
        same(blocks * BS, tokens, self.what("prefetch"))
        self.seen["prefetched"] += blocks
        await settle(self.one)
        await settle(self.two)

    def retention(self) -> None:
        one, two, rng, mix = self.one, self.two, self.rng, self.mix
        if mix.retain and rng.random() < 0.2:
            prefix = rng.choice(self.prefixes)
            owner = ("owner", self.step)
            n1, n2 = call(
                self.what("retain_prefix"),
                one.retain_prefix,
                two.retain_prefix,
                prefix,
                owner=owner,
            )
            if isinstance(n1, int):
                same(len(NAMES) * n1, n2, self.what("retain_prefix"))
                self.owners.append(owner)
                self.seen["retained"] += n1
        if mix.retain and self.owners and rng.random() < 0.1:
            owner = self.owners.pop(rng.randrange(len(self.owners)))
            r1, r2 = call(
                self.what("release_retained"), one.release_retained, two.release_retained, owner
            )
            if isinstance(r1, int):
                same(len(NAMES) * r1, r2, self.what("release_retained"))
                self.seen["released"] += r1
        if mix.hints and rng.random() < 0.15:
            prefix = rng.choice(self.prefixes)
            session = ("s", rng.randrange(3))
            secs = rng.choice((1.5, 4.0, 20.0))
            h1 = one.hints.retain_for(prefix, secs, session=session)
            h2 = two.hints.retain_for(prefix, secs, session=session)
            same(len(NAMES) * h1, h2, self.what("retain_for"))
            self.sessions.append(session)
            self.seen["hinted"] += h1
        if mix.hints and self.sessions and rng.random() < 0.1:
            session = self.sessions.pop(rng.randrange(len(self.sessions)))
            h1 = one.hints.release(session)
            same(len(NAMES) * h1, two.hints.release(session), self.what("hints.release"))

    def admit_new(self) -> None:
        rng = self.rng
        if len(self.reqs) < 4 and rng.random() < 0.6:
            prefix = rng.choice(self.prefixes) if rng.random() < 0.8 else []
            prompt = prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            tokens = prompt + [rng.randrange(1000) for _ in range(rng.randrange(0, 10))]
            rid, priority = f"r{self.step}", rng.choice(PRIORITIES)
            self.reqs[rid] = Req(
                tokens,
                len(prompt),
                self.one.request(rid, prompt, priority=priority),
                self.two.request(rid, prompt, priority=priority),
            )

    def abandon(self) -> None:
        """Loads still in flight from an earlier step: some are abandoned (a deadline)."""
        if not self.mix.abandon:
            return
        for r in self.reqs.values():
            if r.loading is not None and self.rng.random() < 0.4:
                a1 = r.one.abandon_load()
                a2 = r.two.abandon_load()
                same(dict.fromkeys(NAMES, a1) if a1 else {}, a2, self.what("abandon_load"))
                self.seen["abandoned"] += 1
                r.computed, r.loading = 0, None

    def lookup(self, rid: str, r: Req) -> bool:
        """Look ``r`` up; whether to load its hit (once the step's lookups are made)."""
        defer = self.rng.random() < 0.5
        hit = r.one.lookup(allow_defer=defer)
        same(hit, r.two.lookup(allow_defer=defer), self.what(rid, "hit"))
        same(r.one.miss_reason, r.two.miss_reason, self.what(rid, "miss_reason"))
        same(dict(r.one.tier_hit_tokens), dict(r.two.tier_hit_tokens), self.what(rid, "tiers"))
        self.seen["tier_hits"] += sum(r.one.tier_hit_tokens.values())
        if hit is None:
            self.seen["asks"] += 1
            return False
        self.seen["hits"] += hit
        r.waiting = False
        need = -(-len(r.tokens) // BS)
        r.table, self.free[:] = self.free[:need], self.free[need:]
        for gpu in r.table:
            self.cached.pop(gpu, None)
        if hit and self.rng.random() < 0.8:
            r.computed = hit
            return True
        if hit:
            r.one.release()
            r.two.release()
        return False

    def advance(self, r: Req) -> None:
        if r.computed >= len(r.tokens):
            return
        if r.one.num_tokens < len(r.tokens):
            more = r.tokens[r.one.num_tokens :]
            r.one.extend(more)
            r.two.extend(more)
        r.computed = min(len(r.tokens), r.computed + self.rng.randrange(1, 9))
        r.one.advance(r.table, r.computed)
        r.two.advance(dict.fromkeys(NAMES, r.table), r.computed)

    def store(self) -> None:
        if not self.lazy:
            self.one.store()
            self.two.store()
            return
        blocks = list(self.cached.items())
        self.one.store(gpu_cache=View([(g, h) for g, (h, _) in blocks]))
        self.two.store(gpu_cache={n: View([(g, hs[n]) for g, (_, hs) in blocks]) for n in NAMES})

    def free_blocks(self, r: Req) -> None:
        """The engine frees ``r``'s blocks (tail first); its computed blocks keep their KV
        until reused, and the oldest beyond `GPU_CACHED` are dropped."""
        assert r.two._lanes is not None
        hashes = r.two._lanes.hashes()
        for i in reversed(range(min(r.computed // BS, len(r.table)))):
            self.cached[r.table[i]] = (r.one.block_hashes[i], {n: hashes[n][i] for n in NAMES})
        while len(self.cached) > GPU_CACHED:
            self.cached.popitem(last=False)
        self.free.extend(r.table)

    def end_some(self) -> None:
        rng = self.rng
        for rid, r in list(self.reqs.items()):
            if r.waiting or r.loading is not None:
                continue
            x = rng.random()
            if r.computed >= len(r.tokens) or x < 0.05:
                if self.mix.hints and rng.random() < 0.5:
                    session = ("s", rng.randrange(3))
                    r.one.finish(retain_for_s=3.0, session=session)
                    r.two.finish(retain_for_s=3.0, session=session)
                    self.sessions.append(session)
                else:
                    r.one.finish()
                    r.two.finish()
                self.free_blocks(r)
                del self.reqs[rid]
            elif x > 0.95:
                r.one.preempt()
                r.two.preempt()
                self.free_blocks(r)
                r.table, r.computed, r.waiting = [], 0, True


RETAIN = {"max_retained_fraction": 0.5}
MIXES = {
    "plain": Mix(),
    "lag": Mix(lag=True),
    "events": Mix({"enable_events": True}, lag=True),
    "retention": Mix(RETAIN, retain=True, hints=True),
    "retention-lag": Mix(RETAIN, retain=True, hints=True, lag=True),
    "abandon": Mix(abandon=True, lag=True),
    "store-settings": Mix({"max_store_blocks_per_step": 2, "store_admission": "seen_twice"}),
    "restore": Mix({"restore_evicted": True}, lag=True),
    "holds": Mix(
        {
            "hold_blocks_on_finish": True,
            "hold_max_blocks": 3,
            "hold_max_steps": 2,
            "max_store_blocks_per_step": 1,
        },
        lag=True,
    ),
    "lazy": Mix({"store_mode": "lazy", "lazy_offload_blocks": 4}, lag=True),
    # a policy told of every lookup (`on_lookup`), and one that is not
    "adaptive": Mix({"eviction_policy": "adaptive"}, lag=True),
    "s3fifo": Mix({"eviction_policy": "s3fifo"}, lag=True),
    "all": Mix(
        {"enable_events": True, "restore_evicted": True, "max_store_blocks_per_step": 3, **RETAIN},
        retain=True,
        hints=True,
        abandon=True,
        lag=True,
        reset=True,
    ),
}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mix", list(MIXES))
def test_two_full_groups_are_one_group_with_every_feature(mix: str, seed: int) -> None:
    anyio.run(run, seed, MIXES[mix])


def disk(path: Path) -> dict[str, object]:
    """A disk tier large enough never to evict (each group's file takes a share)."""
    return {"kind": "disk", "name": "d", "path": str(path), "capacity_bytes": "4MiB"}


TIER_MIXES = {
    "retention": Mix(RETAIN, retain=True, hints=True),
    "settings": Mix(
        {
            "enable_events": True,
            "restore_evicted": True,
            "max_store_blocks_per_step": 2,
            "store_admission": "seen_twice",
        }
    ),
    "holds": Mix({"hold_blocks_on_finish": True, "hold_max_steps": 2, "eviction_policy": "arc"}),
}


@pytest.mark.usefixtures("shape")
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mix", list(TIER_MIXES))
def test_two_full_groups_are_one_group_with_a_disk_tier(
    mix: str, seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write-downs, promotions (a lookup that asks again while one runs, then hits what
    it promoted), each group's tier statistics: as one group's, after every step (every
    copy, write-down and promotion ended, so thread timing decides nothing; the tiers'
    memory of absent blocks runs on the workload's clock, a second a step)."""
    monkeypatch.setattr(promote, "time", SimpleNamespace(monotonic=lambda: Workload.now))
    base = TIER_MIXES[mix]
    settings = {**base.settings, "tiers": [disk(tmp_path / "kv.bin")]}
    seen = anyio.run(run, seed, replace(base, settings=settings))
    assert seen["hits"] > 0


def test_the_tier_mixes_reach_promotions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tier mix hits blocks a promotion brought in, and asks again while one runs;
    prefetches (with hints) find blocks."""
    monkeypatch.setattr(promote, "time", SimpleNamespace(monotonic=lambda: Workload.now))
    for name, base in TIER_MIXES.items():
        total = dict.fromkeys(("tier_hits", "asks", *(("prefetched",) if base.hints else ())), 0)
        for seed in range(3):
            settings = {**base.settings, "tiers": [disk(tmp_path / f"{name}{seed}.bin")]}
            seen = anyio.run(run, seed, replace(base, settings=settings))
            for key in total:
                total[key] += seen[key]
        assert all(total.values()), (name, total)


def test_the_mixes_reach_what_they_compare() -> None:
    """Each mix does what it is there for on a few seeds: hits and "ask again" answers,
    retained and released blocks, hints, abandoned loads, events, deferred and restored
    blocks, holds, lazy stores (so every comparison above compares something)."""
    want = {
        "lag": ("hits", "asks", "deferrals_bounded", "deferred_blocks", "concurrent_load_blocks"),
        "events": ("events",),
        "retention-lag": ("retained", "released", "hinted"),
        "abandon": ("abandoned", "abandoned_loads"),
        "store-settings": ("deferred_blocks", "evicted_while_live"),
        "restore": ("restored_blocks", "evicted_while_live"),
        "holds": ("hold_expired_blocks",),
        "lazy": ("stored_blocks", "hits"),
        "all": ("resets", "retained", "abandoned", "restored_blocks"),
    }
    for mix, names in want.items():
        seen: dict[str, int] = {}
        for seed in range(3):
            for name, value in anyio.run(run, seed, MIXES[mix]).items():
                seen[name] = seen.get(name, 0) + value
        for name in names:
            assert seen[name] > 0, (mix, name, seen)


@pytest.mark.usefixtures("shape")
@pytest.mark.parametrize("allow_defer", [False, True])
def test_a_lookup_while_a_promotion_runs_counts_alike(allow_defer: bool, tmp_path: Path) -> None:
    """A lookup that starts a tier's probe: answered from CPU (a miss, ``in_flight``), or
    "ask again" with ``allow_defer``, counted as a deferred lookup (no hit or miss
    tokens: the request asks again), by one group and by two."""

    async def main() -> None:
        pair = Pair(tiers=[disk(tmp_path / "kv.bin")])
        try:
            async with pair.one as one, pair.two as two:
                prompt = list(range(1, 15))
                for off in (one, two):
                    with off.request("r", prompt) as req:
                        hit = req.lookup(allow_defer=allow_defer)
                        assert hit == (None if allow_defer else 0)
                        assert req.miss_reason is MissReason.IN_FLIGHT
                    await settle(off)
                compare_statistics(one, two, allow_defer)
                compare_tiers(one, two, allow_defer)
                stats = one.statistics().scheduler
                assert stats.deferred_lookups == int(allow_defer)
                assert stats.miss_tokens == (0 if allow_defer else len(prompt))
                misses = {} if allow_defer else {MissReason.IN_FLIGHT: 1}
                assert dict(stats.lookup_misses) == misses
        finally:
            pair.close()

    anyio.run(main)


@pytest.mark.usefixtures("shape")
def test_a_promoted_block_counts_for_its_tier_at_one_lookup_only(tmp_path: Path) -> None:
    """Blocks a promotion brought in count in `tier_hit_tokens` (and are kept from a
    promotion's evictions) until a lookup pins them, once, with one group and two: the
    next lookup of the same prompt found them on CPU."""

    async def main() -> None:
        pair = Pair(num_cpu_blocks=16, tiers=[disk(tmp_path / "kv.bin")])
        try:
            async with pair.one as one, pair.two as two:
                prompt = list(range(1, 14))  # three full blocks, a hit of 12 tokens
                table = list(range(4))
                for off, tables in ((one, table), (two, dict.fromkeys(NAMES, table))):
                    with off.request("a", prompt) as req:
                        assert req.lookup() == 0
                        req.advance(tables, 12)  # type: ignore[arg-type]
                        off.store()
                    await settle(off)
                    assert await off.reset()  # the tier keeps them
                    with off.request("b", prompt) as req:
                        assert req.lookup(allow_defer=True) is None  # promoting
                        await settle(off)
                        assert req.lookup(allow_defer=True) == 12
                        assert req.tier_hit_tokens == {"d": 12}
                    with off.request("c", prompt) as req:
                        assert req.lookup(allow_defer=True) == 12
                        assert req.tier_hit_tokens == {}, off.groups
                await settle(one)
                await settle(two)
                compare_statistics(one, two, "promoted")
                compare_tiers(one, two, "promoted")
        finally:
            pair.close()

    anyio.run(main)


@pytest.mark.usefixtures("shape")
def test_a_prefetch_of_a_context_ending_on_a_block_boundary_brings_every_block(
    tmp_path: Path,
) -> None:
    """``hints.prefetch(context)`` brings every full block of the context back, with one
    group and two: the next turn (the context and more tokens) is a CPU hit at once, no
    "ask again" round, also when the context ends on a block boundary."""

    async def main() -> None:
        pair = Pair(num_cpu_blocks=16, tiers=[disk(tmp_path / "kv.bin")])
        try:
            async with pair.one as one, pair.two as two:
                context = list(range(1, 17))  # four full blocks, ending on a boundary
                table = list(range(5))
                for off, tables in ((one, table), (two, dict.fromkeys(NAMES, table))):
                    with off.request("a", [*context, 99]) as req:
                        assert req.lookup() == 0
                        req.advance(tables, 16)  # type: ignore[arg-type]
                        off.store()
                    await settle(off)
                    assert await off.reset()  # the tier keeps them
                assert await one.hints.prefetch(context) == 4  # blocks
                assert await two.hints.prefetch(context) == 16  # tokens
                await settle(one)
                await settle(two)
                compare_tiers(one, two, "prefetch")
                for off in (one, two):
                    with off.request("b", [*context, 7, 8]) as req:
                        assert req.lookup(allow_defer=True) == 16, off.groups
                compare_statistics(one, two, "prefetch")
        finally:
            pair.close()

    anyio.run(main)


def test_a_priority_reaches_a_block_its_request_passed_refused_and_another_stored() -> None:
    """``store_admission`` refuses the first offer of a block: a request of priority 3
    offers a shared block first (refused, its cursor passes it), a request of priority 0
    offers it next in the same step (admitted, planned). The block is published with
    priority 3, with one group and two: a request's priority reaches every block its
    cursor passed."""

    async def main() -> None:
        pair = Pair(store_admission="seen_twice")
        try:
            async with pair.one as one, pair.two as two:
                prompt = list(range(1, 14))  # three full blocks
                los: list[OffloadRequest] = []
                for off, wrap in ((one, list), (two, lambda t: dict.fromkeys(NAMES, t))):
                    hi = off.request("hi", prompt, priority=3)
                    lo = off.request("lo", prompt)
                    assert hi.lookup() == lo.lookup() == 0
                    hi.advance(wrap(list(range(4))), 12)
                    lo.advance(wrap(list(range(4, 8))), 12)
                    off.store()
                    los.append(lo)
                pair.complete_all()
                await one.drain()
                await two.drain()
                blocks = [one.pool.get_cached(h) for h in los[0].block_hashes]
                assert [b.priority if b else None for b in blocks] == [3, 3, 3]
                assert two.groups is not None
                lanes = los[1]._lanes
                assert lanes is not None
                for name in NAMES:
                    pool = two._life.front.scheduler.ledger(name).pool
                    got = [pool.get_cached(h) for h in lanes.hashes()[name]]
                    assert [b.priority if b else None for b in got] == [3, 3, 3], name
                compare_statistics(one, two, "priorities")
        finally:
            pair.complete_all()
            pair.close()

    anyio.run(main)


def test_hints_retried_under_arc_are_one_group_s() -> None:
    """Seed 3: hints retried at each store while their prefix is being stored, with the
    ARC policy. A retry keeps the blocks its hint holds untouched in every group, as one
    group's does: when it released and retained them again, ARC saw another use of each
    and group "a" counted another ``evicted_while_live`` than one group at step 24."""
    anyio.run(run, 3, Mix({"eviction_policy": "arc", **RETAIN}, hints=True, lag=True))
