"""A hypothesis state machine over OffloadScheduler with a simulated engine.

Random lookups, loads, chunked updates, stores, successful / failed / delayed completions,
finishes (holding unstored blocks or not), preemptions, resets and abandoned loads (the
engine recomputes into fresh GPU blocks while the abandoned copy may still land); and
malformed input that must be refused with nothing changed (duplicate, out-of-range and
changed block-table entries, reuse of a finished id), and plans undone because the
engine's pinner raised.
finishes (holding unstored blocks or not), preemptions and resets, retention priorities
drawn at random (per request, changed mid-flight) and prefixes retained and released
within the pool's bound; and malformed input
that must be refused with nothing changed (duplicate, out-of-range and changed block-table
entries, reuse of a finished id), and plans undone because the engine's pinner raised.
After every step: ``check_invariants()`` plus the model's own checks: every published CPU
block holds the KV of its hash, and every load delivers exactly the KV the request needs
(wrong KV is the worst bug there is). The engine reuses GPU blocks, but never one that an
in-flight transfer names (the pinner's contract), so a scheduler that planned from stale
GPU ids would be caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from scheduler_helpers import BS, SimKV, hashes, make

from kvoffload.errors import BlockTableError, InvalidInputError, RequestStateError
from kvoffload.hashing import BlockHash
from kvoffload.transfer.plan import LoadPlan, StorePlan, TransferPlan

NUM_GPU_BLOCKS = 24
FAMILIES = 2
MAX_BLOCKS = 5


def prompt(family: int, variant: int, num_blocks: int) -> list[int]:
    """Prompts of one family share their first block; variants diverge after it."""
    head = [family * 1000 + i for i in range(BS)]
    tail = [family * 1000 + variant * 100 + 500 + i for i in range((num_blocks - 1) * BS)]
    return head + tail + [7]  # one more token: every full block is loadable


@dataclass
class Req:
    toks: list[int]
    hs: list[BlockHash]
    table: list[int] = field(default_factory=list)
    computed: int = 0
    loading: bool = False


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched = make(num_blocks=6)
        self.sim = SimKV()
        self.reqs: dict[str, Req] = {}
        self.gpu_free = list(range(NUM_GPU_BLOCKS))
        self.gpu_deferred_free: list[int] = []
        self.in_flight: list[TransferPlan] = []
        self.next_id = 0
        self.held: list[int] = []  # GPU blocks finished requests hold (hold_blocks_on_finish)
        self.finished: list[str] = []
        self.abandoned: set[int] = set()  # load plans abandoned, their copy still in flight
        self.retained: set[str] = set()  # owners of retained prefixes
        self.prompts: list[list[BlockHash]] = []  # every admitted prompt's hashes

    @initialize(
        restore=st.booleans(),
        size=st.integers(2, 8),
        hold=st.booleans(),
        retained=st.sampled_from([0.1, 0.5, 1.0, 1.0]),
    )
    def setup(self, restore: bool, size: int, hold: bool, retained: float) -> None:
        self.sched = make(
            num_blocks=size,
            restore_evicted=restore,
            hold_blocks_on_finish=hold,
            hold_max_blocks=4,
            hold_max_steps=3,
            num_gpu_blocks=NUM_GPU_BLOCKS,
            max_retained_fraction=retained,
        )

    # -- engine side ---------------------------------------------------------------------

    def pinned_gpu(self) -> set[int]:
        return {g for p in self.in_flight for g in p.gpu_block_ids} | set(self.held)

    def take_released(self) -> None:
        for g in self.sched.take_released_holds():
            self.held.remove(g)
        self.settle_gpu()

    def free_gpu(self, ids: list[int]) -> None:
        pinned = self.pinned_gpu()
        for g in ids:
            (self.gpu_deferred_free if g in pinned else self.gpu_free).append(g)

    def settle_gpu(self) -> None:
        pinned = self.pinned_gpu()
        still = [g for g in self.gpu_deferred_free if g in pinned]
        self.gpu_free += [g for g in self.gpu_deferred_free if g not in pinned]
        self.gpu_deferred_free = still

    def take_gpu(self, n: int) -> list[int] | None:
        if len(self.gpu_free) < n:
            return None
        out, self.gpu_free = self.gpu_free[:n], self.gpu_free[n:]
        for g in out:
            self.sim.gpu[g] = None  # fresh block: garbage
        return out

    # -- rules ---------------------------------------------------------------------------

    @rule(
        family=st.integers(0, FAMILIES - 1),
        variant=st.integers(0, 1),
        num_blocks=st.integers(1, MAX_BLOCKS),
        accept=st.floats(0, 1),
        allow_defer=st.booleans(),
        engine_prefix=st.integers(0, 2),
        pin_fails=st.booleans(),
        priority=st.sampled_from([0, 0, 1, 2, 7]),
    )
    def admit(
        self,
        family: int,
        variant: int,
        num_blocks: int,
        accept: float,
        allow_defer: bool,
        engine_prefix: int,
        pin_fails: bool,
        priority: int,
    ) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        if priority:
            self.sched.set_priority(rid, priority)
        toks = prompt(family, variant, num_blocks)
        req = Req(toks, hashes(toks))
        self.prompts.append(req.hs)
        own = min(engine_prefix, len(req.hs))  # blocks the engine's own prefix cache holds
        hit = self.sched.lookup(rid, req.hs, len(toks), own * BS, allow_defer=allow_defer)
        self.reqs[rid] = req
        if hit is None:
            return  # ask again later: the engine keeps it waiting (state exists, no pin)
        assert hit % BS == 0
        assert own * BS + hit <= (len(toks) - 1) // BS * BS
        table = self.take_gpu(len(req.hs))
        if table is None:
            self.sched.release(rid)
            return
        req.table = table
        for i in range(own):
            self.sim.gpu[table[i]] = req.hs[i]
        req.computed = own * BS
        take = int(hit // BS * accept) * BS
        if take and len(table) > 1:
            before = self.snapshot()
            bad = [*table[:-1], table[0]]  # a duplicate id: refused, nothing changes
            with pytest.raises(BlockTableError, match="appears twice"):
                self.sched.plan_load(rid, bad, take)
            assert self.snapshot() == before
        plan = self.sched.plan_load(rid, table, take)
        if plan is not None and pin_fails:
            # The engine's pinner raised: the load is undone and the hit pinned again.
            assert self.sched.cancel(plan)
            plan = self.sched.plan_load(rid, table, take)
        if plan is not None:
            assert plan.gpu_block_ids == tuple(table[own : own + take // BS])
            req.loading = True
            self.in_flight.append(plan)
        else:
            self.sched.update(rid, req.table, req.hs, req.computed)

    def cached_prompts(self) -> list[tuple[int, int]]:
        pool = self.sched.pool
        return [
            (f, v)
            for f in range(FAMILIES)
            for v in range(2)
            if pool.is_cached(hashes(prompt(f, v, 1))[0])
        ]

    @precondition(lambda self: self.cached_prompts())
    @rule(data=st.data(), num_blocks=st.integers(1, MAX_BLOCKS))
    def admit_for_a_hit(self, data: st.DataObject, num_blocks: int) -> None:
        """A prompt whose first block is cached: the lookup hits and the load starts (random
        admissions alone rarely find one)."""
        family, variant = data.draw(st.sampled_from(self.cached_prompts()))
        priority = data.draw(st.sampled_from([0, 0, 1, 2, 7]))
        self.admit(family, variant, num_blocks, 1.0, False, 0, False, priority)

    @precondition(lambda self: any(not r.loading for r in self.reqs.values()))
    @rule(data=st.data(), chunk=st.integers(1, 3 * BS))
    def step(self, data: st.DataObject, chunk: int) -> None:
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if not r.loading)))
        self.step_request(rid, chunk)

    def step_request(self, rid: str, chunk: int) -> None:
        req = self.reqs[rid]
        if not req.table:  # new or preempted: allocate its blocks
            table = self.take_gpu(len(req.hs))
            if table is None:
                return
            req.table = table
        new = min(len(req.toks), req.computed + chunk)
        done_blocks = min(new // BS, len(req.hs))
        for i in range(req.computed // BS, done_blocks):
            self.sim.gpu[req.table[i]] = req.hs[i]  # compute writes the block's true KV
        req.computed = new
        self.sched.update(rid, req.table, req.hs, req.computed)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def run_to_end(self, data: st.DataObject) -> None:
        """Compute a request's whole prompt and store it (a common, fast path)."""
        candidates = sorted(k for k, r in self.reqs.items() if not r.loading)
        if not candidates:
            return
        rid = data.draw(st.sampled_from(candidates))
        self.step_request(rid, len(self.reqs[rid].toks))
        self.plan_stores()

    @rule(pin_fails=st.booleans())
    def plan_stores(self, pin_fails: bool = False) -> None:
        cursors = self.cursors()
        plan = self.sched.plan_stores()
        if plan is not None and pin_fails:
            # The engine's pinner raised: the plan is undone (every cursor back where it
            # was, nothing lost) and planned again.
            assert self.sched.cancel(plan)
            self.take_released()
            self.sched.check_invariants()
            assert self.cursors() == cursors
            plan = self.sched.plan_stores()
        if plan is not None:
            assert isinstance(plan, StorePlan)
            assert len(set(plan.block_hashes)) == plan.num_blocks
            assert len(set(plan.cpu_block_ids)) == plan.num_blocks
            self.in_flight.append(plan)
        self.take_released()

    def cursors(self) -> dict[str, int]:
        return {
            rid: self.sched.request_state(rid).num_stored_blocks
            for rid in self.reqs
            if self.sched.has_request(rid)
        }

    def snapshot(self) -> tuple[object, ...]:
        sched = self.sched
        pool = sched.pool
        states = {
            rid: (
                list(st.gpu_block_ids),
                len(st.block_hashes),
                st.num_computed_tokens,
                st.num_stored_blocks,
                [b.block_id for b in st.pinned],
                st.priority,
            )
            for rid in self.reqs
            if sched.has_request(rid)
            for st in [sched.request_state(rid)]
        }
        refs = [pool.block(i).ref_cnt for i in range(pool.num_blocks)]
        cached = [
            (pool.block(i).block_hash, pool.block(i).priority) for i in range(pool.num_blocks)
        ]
        return states, refs, cached, sched.num_in_flight

    @precondition(lambda self: any(r.table for r in self.reqs.values()))
    @rule(data=st.data(), kind=st.sampled_from(["duplicate", "out_of_range", "changed"]))
    def bad_update(self, data: st.DataObject, kind: str) -> None:
        """A malformed block table is refused and changes nothing, for anyone."""
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if r.table)))
        req = self.reqs[rid]
        state = self.sched.request_state(rid)
        if kind == "duplicate":
            table = [*req.table, data.draw(st.sampled_from(req.table))]
        elif kind == "out_of_range":
            table = [*req.table, data.draw(st.sampled_from([-1, NUM_GPU_BLOCKS, 10**6]))]
        else:
            known = len(state.gpu_block_ids)
            first = min(state.num_stored_blocks, known - 1) if known else 0
            if state.preempted or first >= known:
                return
            i = data.draw(st.integers(first, known - 1))
            table = list(req.table)
            table[i] = NUM_GPU_BLOCKS - 1 - table[i]  # another block
            if table[i] in req.table:
                return
        before = self.snapshot()
        with pytest.raises(BlockTableError):
            self.sched.update(rid, table, req.hs, req.computed)
        assert self.snapshot() == before

    @precondition(lambda self: self.finished)
    @rule(data=st.data())
    def reuse_finished_id(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.finished))
        before = self.snapshot()
        with pytest.raises(RequestStateError, match="finished"):
            self.sched.lookup(rid, [], 1)
        with pytest.raises(RequestStateError, match="finished"):
            self.sched.update(rid, [], [], 0)
        with pytest.raises(RequestStateError, match="finished"):
            self.sched.finish(rid)
        assert self.snapshot() == before

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), ok=st.booleans())
    def complete(self, data: st.DataObject, ok: bool) -> None:
        i = data.draw(st.integers(0, len(self.in_flight) - 1))
        plan = self.in_flight.pop(i)
        if ok:
            if isinstance(plan, StorePlan):
                for g, h in zip(plan.gpu_block_ids, plan.block_hashes, strict=True):
                    assert self.sim.gpu[g] == h, "a store would read a block that is not its KV"
            self.sim.execute(plan)  # an abandoned load writes too: into blocks nobody reads
            if isinstance(plan, LoadPlan) and plan.plan_id not in self.abandoned:
                req = self.reqs.get(plan.request_id)
                if req is not None and req.table:
                    first = req.table.index(plan.gpu_block_ids[0])
                    for j, g in enumerate(plan.gpu_block_ids):
                        assert self.sim.gpu[g] == req.hs[first + j], "a load delivered wrong KV"
        assert self.sched.complete(plan, ok=ok)
        if isinstance(plan, LoadPlan) and plan.plan_id in self.abandoned:
            self.abandoned.discard(plan.plan_id)
        elif isinstance(plan, LoadPlan) and plan.request_id in self.reqs:
            req = self.reqs[plan.request_id]
            req.loading = False
            if ok and req.table:
                req.computed += plan.num_tokens
            elif req.table:
                for g in plan.gpu_block_ids:
                    self.sim.gpu[g] = None  # failed load: garbage, recompute
        self.settle_gpu()

    @precondition(lambda self: any(r.loading for r in self.reqs.values()))
    @rule(data=st.data())
    def abandon_load(self, data: st.DataObject) -> None:
        """The engine stops waiting for a load and recomputes into fresh GPU blocks (or,
        when none are free, is preempted); the copy stays in flight and may land later,
        into blocks no computation uses until it ended."""
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if r.loading)))
        req = self.reqs[rid]
        (plan,) = self.sched.abandon_load(rid)
        assert plan in self.in_flight
        assert not self.sched.request_state(rid).pinned
        assert self.sched.abandon_load(rid) == []  # once
        self.abandoned.add(plan.plan_id)
        req.loading = False
        old = list(plan.gpu_block_ids)
        fresh = self.take_gpu(len(old))
        if fresh is None:
            self.sched.preempt(rid)
            self.free_gpu(req.table)
            req.table, req.computed = [], 0
            return
        first = req.table.index(old[0])
        req.table[first : first + len(old)] = fresh
        self.free_gpu(old)  # pinned by the abandoned copy: reusable only once it ended
        self.sched.update(rid, req.table, req.hs, req.computed)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        held = self.sched.finish(rid)
        self.finished.append(rid)
        assert set(held) <= set(req.table)
        self.held += held
        self.free_gpu(req.table)

    @precondition(lambda self: any(r.table and not r.loading for r in self.reqs.values()))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(
            st.sampled_from(sorted(k for k, r in self.reqs.items() if r.table and not r.loading))
        )
        req = self.reqs[rid]
        self.sched.preempt(rid)
        self.free_gpu(req.table)
        req.table = []
        req.computed = 0

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), priority=st.sampled_from([0, 1, 3, 7, -1, "high"]))
    def reprioritize(self, data: st.DataObject, priority: object) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        if not isinstance(priority, int) or priority < 0:
            before = self.snapshot()
            with pytest.raises(InvalidInputError, match=rf"request {rid!r}: priority"):
                self.sched.set_priority(rid, priority)  # type: ignore[arg-type]
            assert self.snapshot() == before
            return
        self.sched.set_priority(rid, priority)
        assert self.sched.request_state(rid).priority == priority

    def cached_prefixes(self) -> list[list[BlockHash]]:
        is_cached = self.sched.pool.is_cached
        return [hs for hs in self.prompts if hs and is_cached(hs[0])]

    @precondition(lambda self: self.cached_prefixes())
    @rule(data=st.data(), owner=st.sampled_from(["sys0", "sys1", "sys2"]))
    def retain(self, data: st.DataObject, owner: str) -> None:
        hs = data.draw(st.sampled_from(self.cached_prefixes()))
        hs = hs[: data.draw(st.integers(1, len(hs)))]
        pool = self.sched.pool
        before = self.snapshot()
        try:
            run = self.sched.ledger.retain(hs, owner)
        except InvalidInputError:
            assert self.snapshot() == before  # over the bound: nothing retained
            return
        assert run
        assert [b.block_hash for b in run] == hs[: len(run)]
        assert pool.num_retained <= pool.max_retained_blocks
        self.retained.add(owner)

    @precondition(lambda self: self.retained)
    @rule(data=st.data())
    def release_retained(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.retained)))
        self.retained.discard(owner)
        assert self.sched.ledger.release_retained(owner) >= 1
        with pytest.raises(InvalidInputError, match="retains no block"):
            self.sched.ledger.release_retained(owner)

    @rule()
    def reset(self) -> None:
        clean = self.sched.reset()
        assert not self.sched.pool.retained_owners  # a reset releases every retained block
        self.retained.clear()
        self.take_released()
        assert clean == (not self.in_flight)
        assert self.sched.pool.num_cached == 0
        # Stores read the whole table again: the engine reports it again first.
        for rid, req in self.reqs.items():
            if req.table and not req.loading:
                self.sched.update(rid, req.table, req.hs, req.computed)

    # -- checks ----------------------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        self.sched.check_invariants()
        pool = self.sched.pool
        for req in self.reqs.values():
            for h in req.hs:
                block = pool.get_cached(h)
                if block is not None:
                    assert self.sim.cpu.get(block.block_id) == h, "published block holds wrong KV"
        assert self.sched.num_in_flight == len(self.in_flight)

    def teardown(self) -> None:
        for owner in self.retained:
            self.sched.ledger.release_retained(owner)
        while self.in_flight:
            self.sched.complete(self.in_flight.pop(), ok=True)
        for rid in list(self.reqs):
            self.sched.finish(rid)
        self.sched.release_all_holds()
        self.sched.check_invariants()
        assert self.sched.pool.num_free == self.sched.pool.num_blocks, "a reference leaked"
        assert self.sched.statistics().live_requests == 0


SchedulerMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
