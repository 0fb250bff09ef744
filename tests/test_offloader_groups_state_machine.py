"""A hypothesis state machine over a multi-group `KVOffloader` and its request handles.

Full + sliding window and full + recurrent groups, real `ThreadCopyEngine`s (one host
buffer per group) with injected copy failures in one group, a small CPU pool (stores
deferred, blocks evicted), and a simulated engine: conversations whose requests look up,
load (or abandon the load and recompute), compute in chunks (a sliding-window group frees
the blocks its window left, the table entry becoming ``None``), store, finish or are
preempted, with the transfers'
completions settling in between. Every GPU block the engine hands out is unpinned (the
groups' `RefCountPinner`s). After every step: `KVOffloader.check_invariants()`, and every
load's bytes are checked in every group.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio.from_thread
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import TransferError
from kvoffload.pinner import RefCountPinner
from kvoffload.request import OffloadRequest
from kvoffload.testing import CopyFaults
from kvoffload.transfer.task import TransferStatus
from tests.test_offloader_groups import BS, NUM_GPU, Model, engines_for, groups_of

CPU_BLOCKS = 10


class Live:
    """A request the engine runs."""

    def __init__(self, conv: int, handle: OffloadRequest, tables: dict[str, list[int | None]]):
        self.conv = conv
        self.handle = handle
        self.tables = tables
        self.computed = 0


class OffloaderGroupsMachine(RuleBasedStateMachine):
    KIND = "sliding"

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(groups_of(self.KIND))
        self.names = [g.name for g in self.model.groups]
        self.pinners = {n: RefCountPinner() for n in self.names}
        self.free = {n: list(range(NUM_GPU)) for n in self.names}
        self.convs: list[list[int]] = [[], []]
        self.live: dict[str, Live] = {}
        self.n = 0
        self.loads = 0
        self.abandons = 0
        self.exits: list[Any] = []

    @initialize(fail=st.sets(st.integers(0, 8), max_size=4), group=st.integers(0, 1))
    def start(self, fail: set[int], group: int) -> None:
        faults = {self.names[group]: CopyFaults(fail_copies=fail)}
        engines, self.hosts = engines_for(self.model, faults, CPU_BLOCKS)
        config = OffloadConfig(num_cpu_blocks=CPU_BLOCKS, block_size=BS, checkpoint_tokens=8)
        off = KVOffloader(
            config,
            self.model.kv,
            groups=self.model.groups,
            copy_engine=engines,
            pinner=self.pinners,
        )
        self.stack = contextlib.ExitStack()
        self.portal = self.stack.enter_context(anyio.from_thread.start_blocking_portal())
        self.off = self.stack.enter_context(self.portal.wrap_async_context_manager(off))

    def teardown(self) -> None:
        stack = getattr(self, "stack", None)
        if stack is not None:
            for r in list(self.live.values()):
                self.portal.call(r.handle.finish)
            stack.close()
            for host in self.hosts.values():
                host.close()
            for p in self.pinners.values():
                assert p.num_pinned == 0

    # -- the engine's blocks ------------------------------------------------------------------

    def _alloc(self, name: str, n: int) -> list[int | None] | None:
        pinner = self.pinners[name]
        usable = [b for b in self.free[name] if not pinner.is_pinned(b)]
        if len(usable) < n:
            return None
        got = usable[:n]
        for b in got:
            self.free[name].remove(b)
        return list(got)

    def _give_back(self, tables: dict[str, list[int | None]]) -> None:
        for name, t in tables.items():
            self.free[name].extend(b for b in t if b is not None)

    # -- rules --------------------------------------------------------------------------------

    @rule(conv=st.integers(0, 1), extra=st.integers(1, 12), abandon=st.booleans())
    def admit(self, conv: int, extra: int, abandon: bool = False) -> None:
        if any(r.conv == conv for r in self.live.values()):
            return
        self.n += 1
        base = 1000 * conv
        tokens = [*self.convs[conv], *range(base + self.n * 20, base + self.n * 20 + extra)]
        rid = f"r{self.n}"
        handle = self.portal.call(self.off.request, rid, tokens)
        hit = self.portal.call(handle.lookup)
        nb = -(-len(tokens) // BS)
        tables: dict[str, list[int | None]] = {}
        for name in self.names:
            got = self._alloc(name, nb)
            if got is None:
                self._give_back(tables)
                self.portal.call(handle.finish)
                return
            tables[name] = got
        r = Live(conv, handle, tables)
        self.live[rid] = r
        if hit:
            if abandon:
                again = self._abandon(rid, tables)
                if again is None:
                    return  # recomputed from 0, in fresh blocks
                hit = again
            try:  # the portal awaits the task load() returns
                self.portal.call(handle.load, tables)
            except TransferError:
                return  # recomputed from 0
            self.model.check(tables, tokens, hit)
            self.loads += 1
            r.computed = hit

    def _abandon(self, rid: str, tables: dict[str, list[int | None]]) -> int | None:
        """Start the load and abandon it at once (every group's part); the engine
        recomputes into fresh blocks (the load's stay pinned until their copies end).
        ``None`` when it was abandoned; else the copies ended first and the request
        looked up again: its new hit, loaded as without abandoning."""
        handle = self.live[rid].handle
        (task,) = self.portal.call(lambda: (handle.load(tables),))
        late = self.portal.call(handle.abandon_load)
        if not late:  # the copies ended and were delivered first: nothing to abandon
            assert late == {}
            assert task is None or task.done()
            hit: int = self.portal.call(handle.lookup)
            return hit
        assert isinstance(late, dict)
        assert task is not None
        assert task.status is TransferStatus.ABANDONED
        assert set(late) == set(self.names)
        self.abandons += 1
        for name, ids in late.items():
            assert all(self.pinners[name].is_pinned(b) for b in ids) or task.done()
            fresh = self._alloc(name, len(ids))
            if fresh is None:  # no room: the engine gives the request up
                self._end(rid, preempt=True)
                return None
            swap = dict(zip(ids, fresh, strict=True))
            tables[name] = [b if b is None else swap.get(b, b) for b in tables[name]]
            self.free[name].extend(ids)  # handed out again only once unpinned
        return None

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 10))
    def compute(self, data: st.DataObject, chunk: int) -> None:
        self._compute(data.draw(st.sampled_from(sorted(self.live))), chunk)

    def _compute(self, rid: str, chunk: int) -> None:
        r = self.live[rid]
        tokens = list(r.handle.token_ids)
        r.computed = min(len(tokens), r.computed + chunk)
        self.model.fill(r.tables, tokens[: r.computed])
        for g in self.model.groups:
            if g.kind == "sliding_window" and g.window is not None:
                stale = max(0, (r.computed - g.window + 1) // BS)
                t = r.tables[g.name]
                gone = [t[i] for i in range(min(stale, len(t))) if t[i] is not None]
                for i in range(min(stale, len(t))):
                    t[i] = None
                self.free[g.name].extend(b for b in gone if b is not None)
        self.portal.call(r.handle.advance, r.tables, r.computed)
        self.portal.call(self.off.store)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def end(self, data: st.DataObject, preempt: bool) -> None:
        self._end(data.draw(st.sampled_from(sorted(self.live))), preempt)

    def _end(self, rid: str, preempt: bool) -> None:
        r = self.live.pop(rid)
        if preempt:
            self.portal.call(r.handle.preempt)
        self.portal.call(r.handle.finish)  # plans the last store point, pins its blocks
        self._give_back(r.tables)
        if not preempt:
            self.convs[r.conv] = list(r.handle.token_ids)[: r.computed]

    @rule()
    def settle(self) -> None:
        self.portal.call(_drain, self.off)

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "off"):
            self.portal.call(self.off.check_invariants)


async def _drain(off: KVOffloader) -> None:
    await off.drain()


class FullSlidingOffloader(OffloaderGroupsMachine):
    KIND = "sliding"


class FullRecurrentOffloader(OffloaderGroupsMachine):
    KIND = "recurrent"


SETTINGS = settings(
    max_examples=15,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFullSlidingOffloader = SETTINGS(FullSlidingOffloader).TestCase
TestFullRecurrentOffloader = SETTINGS(FullRecurrentOffloader).TestCase


def test_the_machine_loads_bytes_from_cpu() -> None:
    """A run that loads: the machine's load checks are not vacuous."""
    for cls in (FullSlidingOffloader, FullRecurrentOffloader):
        m = cls()
        m.start(fail=set(), group=0)
        try:
            m.admit(0, 12)
            m._compute("r1", 10)
            m._compute("r1", 10)
            m._end("r1", False)
            m.settle()
            m.admit(0, 3)
            assert m.loads == 1
            m.invariants_hold()
            m._end("r2", False)
            m.admit(0, 3, abandon=True)
            m.invariants_hold()
            m.settle()
            m.invariants_hold()
            assert m.loads + m.abandons == 2
        finally:
            m.teardown()
