"""A hypothesis state machine over `GroupedScheduler` with a simulated multi-group engine.

Mixes of groups (full + sliding window, full + recurrent, full + chunked) under random
steps, stores (some deferred by tiny pools), completions that succeed, fail or are
cancelled, lookups and loads, abandoned loads, finishes, preemptions and resets. The
engine frees the blocks of non-full groups that fall out of its window (null table
entries) and reuses them, never while a transfer names them; after a load, the entries
below what it wrote name blocks holding no KV of the request. Requests get retention
priorities, and prefixes are retained (`GroupedScheduler.retain()`, whole or cut to fit
the bounds) and released. After every step: ``check_invariants()`` (per group and
cross-group) and the model's checks: every published CPU block of every group holds the
KV of its key, every load delivers exactly the KV of its (group, position), a store
publishes each block with at least its request's priority and a hit is touched with it,
and every retained prefix holds exactly ``needed(g, N)`` in every group and stays a hit
of ``N``.
Each mix also runs with the store settings on (a per-step limit, an admission filter,
``restore_evicted``, finish holds: the engine frees a held block only once released).
Two full-attention groups of different block sizes also run with lazy stores, each group
storing from its own free GPU blocks (those the engine reuses next first).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.config import OffloadConfig
from kvoffload.errors import InvalidInputError
from kvoffload.groups import KVCacheGroup, needed
from kvoffload.hashing import BlockHash
from kvoffload.scheduler.group_loads import find_hit
from kvoffload.scheduler.groups import GroupedPlan
from kvoffload.transfer.plan import StorePlan, TransferPlan
from tests.groups_helpers import Rig, group

GPU_BLOCKS = 40
KEEP = 3  # blocks a non-full group keeps before the computed length
JUNK = BlockHash(b"junk")  # what a block holds that no request's KV was written into


class FreeBlocks:
    """A group's eviction order: its free GPU blocks that hold a request's KV."""

    def __init__(self, blocks: list[tuple[int, BlockHash]]) -> None:
        self.blocks = blocks

    def iter_eviction_order(self) -> Iterator[tuple[int, BlockHash]]:
        return iter(self.blocks)


@dataclass
class Req:
    tokens: list[int]
    hashes: dict[str, list[BlockHash]]
    tables: dict[str, list[int | None]]
    computed: int = 0
    loading: bool = False


@dataclass
class Flight:
    name: str
    plan: TransferPlan
    rid: str | None = None  # a load's request
    sibling: set[str] = field(default_factory=set)
    # a store's blocks: hash -> the priority of the request that planned it, then
    want: dict[BlockHash, int] = field(default_factory=dict)


@dataclass
class Held:
    """A retained prefix: its hashes per group and the hit ``n`` it holds."""

    hashes: dict[str, list[BlockHash]]
    n: int
    broken: bool = False  # a failed load unpublished one of its blocks (as with one group)


class GroupsMachine(RuleBasedStateMachine):
    GROUPS: tuple[KVCacheGroup, ...] = ()
    CONFIG: OffloadConfig | None = None

    def __init__(self) -> None:
        super().__init__()
        self.rig = Rig(
            self.GROUPS,
            cpu_blocks=10,
            gpu_blocks=GPU_BLOCKS,
            checkpoint_tokens=8,
            max_retained_blocks=5,
            config=self.CONFIG,
        )
        self.sched = self.rig.sched
        self.names = [g.name for g in self.GROUPS]
        self.gmap = {g.name: g for g in self.GROUPS}
        self.free = {n: list(range(GPU_BLOCKS)) for n in self.names}
        self.gpu: dict[str, dict[int, BlockHash]] = {n: {} for n in self.names}
        self.cpu: dict[str, dict[int, BlockHash]] = {n: {} for n in self.names}
        self.reqs: dict[str, Req] = {}
        self.flights: list[Flight] = []
        self.next_id = 0
        self.priority: dict[str, int] = {}
        self.held: dict[str, Held] = {}

    # -- the engine's GPU blocks -------------------------------------------------------

    def _busy(self, name: str) -> set[int]:
        return {b for f in self.flights if f.name == name for b in f.plan.gpu_block_ids}

    def _alloc(self, name: str) -> int | None:
        busy = self._busy(name)
        for k, b in enumerate(self.free[name]):
            if b not in busy:
                return self.free[name].pop(k)
        return None

    def _give_back(self, name: str, table: list[int | None]) -> None:
        # reused first: a block freed too early is overwritten at once
        self.free[name][:0] = [b for b in table if b is not None]

    def _finished(self, rid: str, req: Req) -> None:
        """The engine frees a finished request's blocks, but those it holds only once
        released (`take_released_holds()`)."""
        held = self.sched.held_blocks(rid)
        for name in self.names:
            keep = set(held.get(name, ()))
            self._give_back(name, [b for b in req.tables[name] if b not in keep])
        self._released()

    def _released(self) -> None:
        for name, ids in self.sched.take_released_holds().items():
            self._give_back(name, list(ids))

    def _grow(self, req: Req, computed: int) -> bool:
        """Allocate (and fill) the blocks up to ``computed``, null old non-full blocks."""
        for name in self.names:
            g, table = self.gmap[name], req.tables[name]
            while len(table) < min(computed // g.block_size, len(req.hashes[name])):
                b = self._alloc(name)
                if b is None:
                    return False
                self.gpu[name][b] = req.hashes[name][len(table)]
                table.append(b)
            if g.kind != "full":
                for i in range(max(0, computed // g.block_size - KEEP)):
                    if table[i] is not None:
                        self.free[name].append(table[i])  # type: ignore[arg-type]
                        table[i] = None
        req.computed = computed
        return True

    # -- rules -------------------------------------------------------------------------

    def _tokens(self, family: int, variant: int, n: int) -> list[int]:
        return [family * 1000 + i for i in range(8)] + [
            family * 1000 + variant * 100 + 500 + i for i in range(n - 8)
        ]

    @precondition(lambda self: len(self.reqs) < 3)
    @rule(
        family=st.integers(0, 1),
        variant=st.integers(0, 1),
        length=st.integers(2, 4),
        priority=st.sampled_from([0, 0, 1, 3]),
    )
    def new_request(self, family: int, variant: int, length: int, priority: int = 0) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        n = length * 8 + 1
        toks = self._tokens(family, variant, n)
        req = Req(toks, self.rig.hashes(toks), {n_: [] for n_ in self.names})
        self.reqs[rid] = req
        if priority:
            self.sched.set_priority(rid, priority)
            self.priority[rid] = priority
        hit = self.sched.lookup(rid, req.hashes, n)
        assert hit % self.sched.hit_alignment == 0
        assert hit <= n - 1
        if hit == 0:
            return
        for lane in self.sched._requests[rid].lanes.values():  # hits touched with it
            assert all(b.priority >= priority for b in lane.pin or ())
        tables: dict[str, list[int | None]] = {}
        for name in self.names:
            table: list[int | None] = []
            for _ in range(hit // self.gmap[name].block_size):
                b = self._alloc(name)
                if b is None:  # the engine gives every group's blocks back, to its group
                    self.sched.release(rid)
                    for n_, t in {**tables, name: table}.items():
                        self._give_back(n_, t)
                    return
                table.append(b)
            tables[name] = table
        plan = self.sched.plan_load(rid, tables, hit)
        req.tables = tables
        req.computed = hit
        if plan is not None:
            req.loading = True
            for name, sub in plan.plans.items():
                self.flights.append(Flight(name, sub, rid, set(plan.plans)))
        # the engine computes from the hit on: an entry below it that the load did not
        # write (below a window, chunk or state) holds what its block held before
        for name in self.names:
            loaded = (
                set()
                if plan is None or name not in plan.plans
                else set(plan.plans[name].gpu_block_ids)
            )
            for b in tables[name]:
                if b is not None and b not in loaded:
                    self.gpu[name][b] = JUNK

    @precondition(lambda self: len(self.reqs) < 3)
    @rule(
        family=st.integers(0, 1),
        length=st.integers(2, 4),
        chunk=st.integers(4, 16),
        fail=st.booleans(),
    )
    def serve(self, family: int, length: int, chunk: int, fail: bool) -> None:
        """A whole request: look up, load, compute in chunks storing each step, finish;
        every transfer it starts completes at once (one fails when ``fail``)."""
        self.new_request(family, 0, length)
        rid = f"r{self.next_id - 1}"
        req = self.reqs[rid]
        mine = [f for f in self.flights if f.rid == rid]
        for f in mine:
            self.flights.remove(f)
            self._finish_flight(f, "fail" if fail else "ok")
            fail = False
        while req.computed < len(req.tokens):
            computed = min(len(req.tokens), req.computed + chunk)
            if not self._grow(req, computed):
                break
            self.sched.update(rid, req.tables, req.hashes, computed)
            before = len(self.flights)
            self._fly(self._plan_stores())
            for f in self.flights[before:]:
                self._finish_flight(f, "fail" if fail else "ok")
                fail = False
            del self.flights[before:]
        self.reqs.pop(rid)
        plan = self.sched.finish(rid)
        if plan is not None:
            for name, sub in plan.plans.items():
                self._finish_flight(Flight(name, sub), "ok")
        self._finished(rid, req)

    @precondition(lambda self: any(not r.loading for r in self.reqs.values()))
    @rule(data=st.data(), tokens=st.integers(1, 16), store=st.booleans())
    def step(self, data: st.DataObject, tokens: int, store: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if not r.loading)))
        req = self.reqs[rid]
        computed = min(len(req.tokens), req.computed + tokens)
        if self._grow(req, computed):
            self.sched.update(rid, req.tables, req.hashes, computed)
        if store:
            self._fly(self._plan_stores())

    def _plan_stores(self) -> GroupedPlan | None:
        """``plan_stores()``; lazy: from each group's free GPU blocks that hold KV, the
        next to be reused first (a block a transfer names is never reused)."""
        if self.CONFIG is None or self.CONFIG.store_mode != "lazy":
            return self.sched.plan_stores()
        views = {
            n: FreeBlocks(
                [(b, self.gpu[n][b]) for b in self.free[n] if self.gpu[n].get(b, JUNK) != JUNK]
            )
            for n in self.names
        }
        return self.sched.plan_stores(views)

    def _fly(self, plan: GroupedPlan | None) -> None:
        if plan is not None:
            for name, sub in plan.plans.items():
                rec = self.sched._planner.records[(name, sub.plan_id)]
                want = {
                    self.sched._requests[rid].lanes[name].hashes[i]: self.priority.get(rid, 0)
                    for rid, i, _ in rec.blocks
                }
                self.flights.append(Flight(name, sub, want=want))
        self._released()

    @precondition(lambda self: self.flights)
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "ok", "fail", "cancel"]))
    def complete(self, data: st.DataObject, outcome: str) -> None:
        k = data.draw(st.integers(0, len(self.flights) - 1))
        self._finish_flight(self.flights.pop(k), outcome)

    def _finish_flight(self, f: Flight, outcome: str) -> None:
        name, plan = f.name, f.plan
        ok = outcome == "ok"
        if outcome == "cancel":
            assert self.sched.cancel(name, plan)
        else:
            if ok:
                for gpu, cpu in zip(plan.gpu_block_ids, plan.cpu_block_ids, strict=True):
                    if plan.kind == "store":
                        self.cpu[name][cpu] = self.gpu[name][gpu]
                    else:
                        self.gpu[name][gpu] = self.cpu[name][cpu]
            assert self.sched.complete(name, plan, ok)
            if ok and isinstance(plan, StorePlan):  # published with the priority
                pool = self.rig.pools[name]
                for cpu, key in zip(plan.cpu_block_ids, plan.block_hashes, strict=True):
                    block = pool.block(cpu)
                    if block.block_hash == key:
                        assert block.priority >= f.want.get(key, 0), (name, cpu)
        if plan.kind == "load" and outcome == "fail":
            loaded = set(plan.cpu_block_ids)
            retained = self.rig.pools[name]._retained.held
            for owner, held in self.held.items():
                if any(b.block_id in loaded for b in retained(owner)):
                    held.broken = True
        req = self.reqs.get(f.rid or "")
        if plan.kind != "load" or req is None:
            return
        for gpu in plan.gpu_block_ids:
            pos = req.tables[name].index(gpu)
            if ok:  # every loaded block holds exactly its (group, position)'s KV
                assert self.gpu[name][gpu] == req.hashes[name][pos], (name, pos)
            else:  # the engine recomputes what failed to load
                self.gpu[name][gpu] = req.hashes[name][pos]
        if not any(x.rid == f.rid for x in self.flights):
            req.loading = False

    @precondition(lambda self: any(r.loading for r in self.reqs.values()))
    @rule(data=st.data(), report=st.booleans(), recompute=st.booleans())
    def abandon_load(self, data: st.DataObject, report: bool, recompute: bool) -> None:
        """The engine stops waiting for a load (having reported its tables and the hit as
        computed, or not): every group's part is abandoned at once; it starts over from
        its prefix in fresh blocks (the load's stay busy until their copies end, then go
        to other requests), recomputing now or in later steps (the scheduler must store
        nothing from the old tables meanwhile)."""
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if r.loading)))
        req = self.reqs[rid]
        if report:
            self.sched.update(rid, req.tables, req.hashes, req.computed)
        mine = [f for f in self.flights if f.rid == rid]
        got = self.sched.abandon_load(rid)
        assert {(n, p.plan_id) for n, plans in got.items() for p in plans} == {
            (f.name, f.plan.plan_id) for f in mine
        }
        assert self.sched.abandon_load(rid) == {}  # once
        for f in mine:
            f.rid = None  # it serves nobody; its completion still comes
        req.loading = False
        for name in self.names:
            self._give_back(name, req.tables[name])
            req.tables[name] = []
        hit, req.computed = req.computed, 0
        if recompute and self._grow(req, hit):
            self.sched.update(rid, req.tables, req.hashes, req.computed)

    @precondition(lambda self: any(not r.loading for r in self.reqs.values()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if not r.loading)))
        req = self.reqs.pop(rid)
        if self.sched.has_request(rid):
            self._fly(self.sched.finish(rid))
        self._finished(rid, req)

    @precondition(lambda self: any(not r.loading for r in self.reqs.values()))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if not r.loading)))
        req = self.reqs[rid]
        if self.sched.has_request(rid):
            self.sched.preempt(rid)  # stores nothing: the blocks are reused at once
        for name in self.names:
            self._give_back(name, req.tables[name])
            req.tables[name] = []
        req.computed = 0

    @rule(dice=st.integers(0, 9))
    def reset(self, dice: int) -> None:
        if dice == 0:  # rare: a reset empties everything the other rules built
            self.sched.reset()
            self.held.clear()  # every retained block is released
            self._released()

    @precondition(lambda self: any(not r.loading for r in self.reqs.values()))
    @rule(data=st.data(), priority=st.integers(0, 4))
    def set_priority(self, data: st.DataObject, priority: int) -> None:
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if not r.loading)))
        self.sched.set_priority(rid, priority)
        self.priority[rid] = priority

    @rule(
        family=st.integers(0, 1),
        variant=st.integers(0, 1),
        length=st.integers(1, 4),
        owner=st.sampled_from(["a", "b", "hint"]),
    )
    def retain(self, family: int, variant: int, length: int, owner: str) -> None:
        """``hint`` retains as a session hint does (its prefix replaced, cut to fit);
        the others as ``retain_prefix()`` (added to what they hold, or refused whole)."""
        hashes = self.rig.hashes(self._tokens(family, variant, length * 8))
        before = {n: p.num_retained for n, p in self.rig.pools.items()}
        fit = owner == "hint"
        try:
            held, whole = self.sched.retain(hashes, owner, fit=fit)
        except InvalidInputError:
            assert not fit
            assert before == {n: p.num_retained for n, p in self.rig.pools.items()}
            return
        mine = {n: p._retained.held(owner) for n, p in self.rig.pools.items()}
        assert held <= sum(len(b) for b in mine.values())
        if fit or owner not in self.held:
            n = max(
                (k for k in range(0, length * 8 + 1, self.sched.hit_alignment)
                 if all({hashes[g.name][i] for i in needed(g, k)}
                        == {b.block_hash for b in mine[g.name]} for g in self.GROUPS)),
                default=None,
            )  # fmt: skip
            assert n is not None, "the retained blocks are needed(g, N) for no one N"
            assert whole == (n == length * 8)
            self.held[owner] = Held(hashes, n)
        if owner in self.held and not any(mine.values()):
            del self.held[owner]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.held)))
        want = sum(len(p._retained.held(owner)) for p in self.rig.pools.values())
        assert self.sched.release_retained(owner) == want
        del self.held[owner]
        for pool in self.rig.pools.values():
            assert owner not in pool.retained_owners

    # -- checks ------------------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        self.sched.check_invariants()
        for name, pool in self.rig.pools.items():
            for block_id in range(pool.num_blocks):
                block = pool.block(block_id)
                if block.block_hash is not None:
                    assert self.cpu[name].get(block_id) == block.block_hash, (name, block_id)

    @invariant()
    def retained_prefixes_stay_hits(self) -> None:
        for owner, held in self.held.items():
            for g in self.GROUPS:
                pool = self.rig.pools[g.name]
                blocks = pool._retained.held(owner)
                assert all(b.ref_cnt >= 1 for b in blocks)
                if held.broken:
                    continue
                assert all(b.block_hash is not None for b in blocks)
                keys = {b.block_hash for b in blocks}
                assert {held.hashes[g.name][i] for i in needed(g, held.n)} <= keys
            if held.broken:
                continue
            n = find_hit(
                self.GROUPS,
                self.rig.pools,
                held.hashes,
                held.n + 1,
                computed=0,
                align=self.sched.hit_alignment,
            )
            assert n >= held.n, (owner, n, held.n)

    @invariant()
    def stored_blocks_are_needed_somewhere(self) -> None:
        for f in self.flights:
            g = self.gmap[f.name]
            if f.plan.kind == "store" and g.kind != "full":
                assert f.plan.num_blocks <= 10


_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class FullSlidingMachine(GroupsMachine):
    GROUPS = (group("attn", "full", 4), group("win", "sliding_window", 4, window=9))


class FullRecurrentMachine(GroupsMachine):
    GROUPS = (group("attn", "full", 4), group("ssm", "recurrent", 8))


class FullChunkedMachine(GroupsMachine):
    GROUPS = (group("attn", "full", 4), group("loc", "chunked", 2, chunk=4))


STORE_SETTINGS = OffloadConfig(
    num_cpu_blocks=10,
    max_store_blocks_per_step=3,
    store_admission="seen_twice",
    restore_evicted=True,
    hold_blocks_on_finish=True,
    hold_max_blocks=6,
    hold_max_steps=2,
)


class FullSlidingSettingsMachine(FullSlidingMachine):
    CONFIG = STORE_SETTINGS


class FullRecurrentSettingsMachine(FullRecurrentMachine):
    CONFIG = STORE_SETTINGS


class FullChunkedSettingsMachine(FullChunkedMachine):
    CONFIG = STORE_SETTINGS


class TwoFullLazyMachine(GroupsMachine):
    GROUPS = (group("attn", "full", 4), group("wide", "full", 8))
    CONFIG = OffloadConfig(
        num_cpu_blocks=10, store_mode="lazy", lazy_offload_blocks=4, max_store_blocks_per_step=3
    )


TestTwoFullLazy = TwoFullLazyMachine.TestCase
TestTwoFullLazy.settings = _SETTINGS
TestFullSlidingSettings = FullSlidingSettingsMachine.TestCase
TestFullSlidingSettings.settings = _SETTINGS
TestFullRecurrentSettings = FullRecurrentSettingsMachine.TestCase
TestFullRecurrentSettings.settings = _SETTINGS
TestFullChunkedSettings = FullChunkedSettingsMachine.TestCase
TestFullChunkedSettings.settings = _SETTINGS
TestFullSliding = FullSlidingMachine.TestCase
TestFullSliding.settings = _SETTINGS
TestFullRecurrent = FullRecurrentMachine.TestCase
TestFullRecurrent.settings = _SETTINGS
TestFullChunked = FullChunkedMachine.TestCase
TestFullChunked.settings = _SETTINGS
