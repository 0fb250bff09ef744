"""A hypothesis state machine over a `KVOffloader` and its request handles, on every shape.

One full-attention group (a plain one-group offloader: the handle takes one table), full +
sliding window, full + recurrent state, full + chunked local attention; real
`ThreadCopyEngine`s (one host buffer per group) with injected copy failures in one group
and a gate that holds copies in flight, a small CPU pool (stores deferred, blocks
evicted), and a simulated engine: conversations whose requests (each with a retention
priority) look up (or look up and defer: "ask again" waits its turn), load (awaited,
abandoned and recomputed, its wait cancelled and awaited again, or dropped in flight by
finishing the request), compute in chunks (a sliding-window or chunked group frees the
blocks the next token no longer attends to, the table entry becoming ``None``), store,
finish or are preempted, with the transfers' completions settling in between and the CPU
cache reset now and then. Every GPU block the engine hands out is unpinned (the groups'
`RefCountPinner`s). After every step: `KVOffloader.check_invariants()`; every load's bytes
are checked in every group, and every block a lookup hit pins carries at least the
request's priority.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import anyio
import anyio.from_thread
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import TransferError
from kvoffload.groups import KVCacheGroup, needed
from kvoffload.pinner import RefCountPinner
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.request import OffloadRequest
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import CopyFaults
from kvoffload.transfer import ThreadCopyEngine
from kvoffload.transfer.task import TransferStatus
from tests.test_offloader_groups import ATTN, BS, NUM_GPU, Model, engines_for, groups_of

CPU_BLOCKS = 6
CHUNK = 12  # the chunked group's chunk: store points at 8 need blocks 0-1, at 16 block 3
LOAD_MODES = ("await", "abandon", "cancel_wait", "drop")
PRIORITIES = st.sampled_from([0, 0, 1, 7])
PICK = st.integers(0, 63)  # which live request a rule acts on (see OffloaderGroupsMachine._pick)


def shape(kind: str) -> tuple[KVCacheGroup, ...]:
    """The groups of a shape: ``full`` (one group), ``sliding``, ``recurrent``, ``chunked``."""
    full = KVCacheGroup.from_layout(ATTN, name="full")
    if kind == "full":
        return (full,)
    if kind == "chunked":
        return (full, KVCacheGroup.from_layout(ATTN, name="loc", kind="chunked", chunk=CHUNK))
    return groups_of(kind)


class Live:
    """A request the engine runs (``tables`` is None while its lookup waits its turn)."""

    def __init__(self, conv: int, handle: OffloadRequest, priority: int) -> None:
        self.conv = conv
        self.handle = handle
        self.priority = priority
        self.tables: dict[str, list[int | None]] | None = None
        self.computed = 0


class OffloaderGroupsMachine(RuleBasedStateMachine):
    KIND = "sliding"

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(shape(self.KIND))
        self.names = [g.name for g in self.model.groups]
        self.one = len(self.names) == 1  # a plain one-group offloader: flat tables
        self.pinners = {n: RefCountPinner() for n in self.names}
        self.free = {n: list(range(NUM_GPU)) for n in self.names}
        self.convs: list[list[int]] = [[], [], []]
        self.live: dict[str, Live] = {}
        self.n = 0
        self.gate = threading.Event()  # cleared: every copy waits (stores stay in flight)
        self.gate.set()
        self.hosts: dict[str, HostKVBuffer] = {}
        # what the runs reached (the directed tests below check the rules are not vacuous)
        self.loads = 0
        self.abandons = 0
        self.deferred = 0
        self.cancelled_waits = 0
        self.dropped = 0
        self.failed_loads = 0

    @initialize(fail=st.sets(st.integers(0, 8), max_size=4), group=st.integers(0, 1))
    def start(self, fail: set[int], group: int) -> None:
        name = self.names[group % len(self.names)]
        faults = {
            n: CopyFaults(fail_copies=fail if n == name else (), gate=self.gate) for n in self.names
        }
        if self.one:
            host = HostKVBuffer(ATTN, CPU_BLOCKS, pin_memory="never")
            self.hosts = {"full": host}
            kv = self.model.kv["full"]
            engine = ThreadCopyEngine(ATTN, kv, host, copy_hook=faults["full"], copy_threads=1)
            off = KVOffloader(
                OffloadConfig(num_cpu_blocks=CPU_BLOCKS, block_size=BS),
                kv,
                copy_engine=engine,
                pinner=self.pinners["full"],
            )
        else:
            engines, self.hosts = engines_for(self.model, faults, CPU_BLOCKS)  # type: ignore[arg-type]
            config = OffloadConfig(num_cpu_blocks=CPU_BLOCKS, block_size=BS, checkpoint_tokens=8)
            off = KVOffloader(
                config,
                self.model.kv,
                groups=self.model.groups,
                copy_engine=engines,
                pinner=self.pinners,
            )
        self._enter(off)

    def _enter(self, off: KVOffloader) -> None:
        self.stack = contextlib.ExitStack()
        self.portal = self.stack.enter_context(anyio.from_thread.start_blocking_portal())
        self.off = self.stack.enter_context(self.portal.wrap_async_context_manager(off))

    def teardown(self) -> None:
        self.gate.set()
        stack = getattr(self, "stack", None)
        if stack is not None:
            for r in list(self.live.values()):
                self.portal.call(r.handle.finish)
            stack.close()
            for host in self.hosts.values():
                host.close()
            for p in self.pinners.values():
                assert p.num_pinned == 0

    # -- the shape's calls ----------------------------------------------------------------------

    def _t(self, tables: dict[str, list[int | None]]) -> Any:
        """What the handle takes: one table with one group, else the mapping."""
        return tables["full"] if self.one else tables

    def _pools(self) -> dict[str, CpuBlockPool]:
        if self.one:
            return {"full": self.off.pool}
        session = self.off._life.front
        assert session is not None
        return {n: session.scheduler.ledger(n).pool for n in self.names}

    def _hashes(self, tokens: list[int]) -> dict[str, list[Any]]:
        if self.one:
            return {"full": self.off.hash_prompt(tokens)}
        session = self.off._life.front
        assert session is not None
        return dict(session.hash_prompt(tokens))

    def _pick(self, pick: int, *, waiting: bool | None = None) -> str | None:
        """A live request (``waiting``: whose lookup answered "ask again"; ``False``: one
        that runs). Chosen from a drawn number, not drawn from the live set: which
        requests wait depends on when copies complete, and hypothesis needs the same
        draws each run."""
        rids = sorted(
            rid for rid, r in self.live.items() if waiting is None or (r.tables is None) == waiting
        )
        return rids[pick % len(rids)] if rids else None

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

    def _give_back(self, tables: dict[str, list[int | None]] | None) -> None:
        for name, t in (tables or {}).items():
            self.free[name].extend(b for b in t if b is not None)

    # -- rules --------------------------------------------------------------------------------

    @rule(
        conv=st.integers(0, 2),
        extra=st.integers(1, 12),
        mode=st.sampled_from(LOAD_MODES),
        defer=st.booleans(),
        priority=PRIORITIES,
    )
    def admit(
        self, conv: int, extra: int, mode: str = "await", defer: bool = False, priority: int = 0
    ) -> None:
        for rid, r in list(self.live.items()):
            if r.conv == conv:  # the conversation's next turn: this one ends first
                self._end(rid, preempt=False)
        self.n += 1
        base = 1000 * conv
        tokens = [*self.convs[conv], *range(base + self.n * 20, base + self.n * 20 + extra)]
        rid = f"r{self.n}"
        handle = self.portal.call(lambda: self.off.request(rid, tokens, priority=priority))
        self.live[rid] = Live(conv, handle, priority)
        self._ask(rid, mode, defer)

    @rule(pick=PICK, mode=st.sampled_from(LOAD_MODES), defer=st.booleans())
    def ask_again(self, pick: int, mode: str, defer: bool) -> None:
        """A request whose lookup answered "ask again" asks again (maybe deferring again)."""
        rid = self._pick(pick, waiting=True)
        if rid is not None:
            self._ask(rid, mode, defer)

    def _ask(self, rid: str, mode: str, defer: bool) -> None:
        r = self.live[rid]
        handle = r.handle
        hit = self.portal.call(lambda: handle.lookup(allow_defer=defer))
        if hit is None:  # "ask again": nothing pinned, the request waits its turn
            assert defer
            self.deferred += 1
            return
        tokens = list(handle.token_ids)
        if hit:
            self._check_hit_priority(tokens, hit, r.priority)
        nb = -(-len(tokens) // BS)
        tables: dict[str, list[int | None]] = {}
        for name in self.names:
            got = self._alloc(name, nb)
            if got is None:
                self._give_back(tables)
                self.live.pop(rid)
                self.portal.call(handle.finish)
                return
            tables[name] = got
        r.tables = tables
        if not hit:
            return
        if mode == "abandon":
            again = self._abandon(rid, tables, hit)
            if not again:
                return  # recomputed from 0 (in fresh blocks when abandoned)
            hit = again
        elif mode == "drop":  # the engine gives the request up with its load in flight
            self.portal.call(lambda: (handle.load(self._t(tables)),))  # not awaited
            self.dropped += 1
            self._end(rid, preempt=False)
            return
        if not self._load(rid, tables, cancel_wait=mode == "cancel_wait"):
            return  # recomputed from 0
        self.model.check(tables, tokens, hit)
        self.loads += 1
        r.computed = hit

    def _load(self, rid: str, tables: dict[str, list[int | None]], *, cancel_wait: bool) -> bool:
        """Load the hit and wait for it (``cancel_wait``: a first wait is cancelled, which
        cancels only the wait; the copy goes on and a second wait sees it end)."""
        handle = self.live[rid].handle
        self.gate.set()  # the engine waits for the load: the copies run

        async def load() -> bool:
            task = handle.load(self._t(tables))
            assert task is not None
            if cancel_wait:
                with anyio.CancelScope() as scope, contextlib.suppress(TransferError):
                    scope.cancel()
                    await task
                assert scope.cancelled_caught or task.done()
                self.cancelled_waits += 1
            try:
                await task
            except TransferError:
                self.failed_loads += 1
                return False
            return True

        return bool(self.portal.call(load))

    def _check_hit_priority(self, tokens: list[int], hit: int, priority: int) -> None:
        """Every block the hit pins, in every group, is cached with at least the request's
        retention priority (a lookup touches its hit with it)."""
        pools, hashes = self._pools(), self._hashes(tokens)
        for g in self.model.groups:
            for pos in needed(g, hit):
                block = pools[g.name].get_cached(hashes[g.name][pos])
                assert block is not None, (g.name, pos, hit)
                assert block.ref_cnt >= 1, (g.name, pos)
                assert block.priority >= priority, (g.name, pos, block.priority, priority)

    def _abandon(self, rid: str, tables: dict[str, list[int | None]], hit: int) -> int | None:
        """Start the load and abandon it at once (every group's part); the engine
        recomputes into fresh blocks (the load's stay pinned until their copies end).
        ``None`` when it was abandoned; else the copies ended first and the request
        looked up again: its new hit, loaded as without abandoning."""
        handle = self.live[rid].handle
        (task,) = self.portal.call(lambda: (handle.load(self._t(tables)),))
        late = self.portal.call(handle.abandon_load)
        if not late:  # the copies ended and were delivered first: nothing to abandon
            assert not late
            assert task is None or task.done()
            hit: int = self.portal.call(handle.lookup)
            return hit
        assert task is not None
        assert task.status is TransferStatus.ABANDONED
        if self.one:
            assert isinstance(late, tuple)
            late = {"full": late}
        assert isinstance(late, dict)
        # every group that had blocks to load (a chunked group may need none at a hit)
        loaded = {g.name for g in self.model.groups if needed(g, hit)}
        assert set(late) == loaded, (late, loaded)
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

    @rule(pick=PICK, chunk=st.integers(1, 10))
    def compute(self, pick: int, chunk: int) -> None:
        rid = self._pick(pick, waiting=False)
        if rid is not None:
            self._compute(rid, chunk)

    def _compute(self, rid: str, chunk: int) -> None:
        r = self.live[rid]
        assert r.tables is not None
        tokens = list(r.handle.token_ids)
        r.computed = min(len(tokens), r.computed + chunk)
        self.model.fill(r.tables, tokens[: r.computed])
        for g in self.model.groups:
            if g.kind == "sliding_window" and g.window is not None:
                stale = max(0, (r.computed - g.window + 1) // BS)
            elif g.kind == "chunked" and g.chunk is not None:
                stale = r.computed // g.chunk * g.chunk // BS  # before the next token's chunk
            else:
                continue
            t = r.tables[g.name]
            gone = [t[i] for i in range(min(stale, len(t))) if t[i] is not None]
            for i in range(min(stale, len(t))):
                t[i] = None
            self.free[g.name].extend(b for b in gone if b is not None)
        self.portal.call(r.handle.advance, self._t(r.tables), r.computed)
        self.portal.call(self.off.store)

    @rule(pick=PICK, preempt=st.booleans())
    def end(self, pick: int, preempt: bool) -> None:
        rid = self._pick(pick)
        if rid is not None:
            self._end(rid, preempt)

    def _end(self, rid: str, preempt: bool) -> None:
        r = self.live.pop(rid)
        if preempt:
            self.portal.call(r.handle.preempt)
        self.portal.call(r.handle.finish)  # plans the last store point, pins its blocks
        self._give_back(r.tables)
        if not preempt and r.computed:
            self.convs[r.conv] = list(r.handle.token_ids)[: r.computed]

    @rule(pick=PICK, chunk=st.integers(1, 10), priority=PRIORITIES, defer=st.booleans())
    def follow_up_while_storing(self, pick: int, chunk: int, priority: int, defer: bool) -> None:
        """The engine computes a step whose stores stay in flight (the copies wait on a
        gate), finishes the request, and the conversation's next turn looks up at once,
        deferring: "ask again" while the block after its hit is being stored (or a shorter
        hit). The gate opens before anything is loaded."""
        rid = self._pick(pick, waiting=False)
        if rid is not None:
            self._follow_up(rid, chunk, priority, defer)

    def _follow_up(self, rid: str, chunk: int, priority: int = 0, defer: bool = True) -> None:
        conv = self.live[rid].conv
        self.gate.clear()
        try:
            self._compute(rid, chunk)
            self._end(rid, preempt=False)
            self.n += 1
            base = 1000 * conv
            tokens = [*self.convs[conv], *range(base + self.n * 20, base + self.n * 20 + 3)]
            nxt = f"r{self.n}"
            handle = self.portal.call(lambda: self.off.request(nxt, tokens, priority=priority))
            self.live[nxt] = Live(conv, handle, priority)
            hit = self.portal.call(lambda: handle.lookup(allow_defer=True))
            self.portal.call(self.off.check_invariants)
            if hit is not None:
                self.portal.call(handle.release)  # asked again below, once the gate is open
            else:
                self.deferred += 1
        finally:
            self.gate.set()
        self._ask(nxt, "await", defer)

    @rule(reset=st.sampled_from([False, False, False, True]))
    def settle(self, reset: bool = False) -> None:
        """Wait for the copies in flight; or (``reset``) empty the CPU cache: stores in
        flight are abandoned (they publish nothing)."""
        self.gate.set()
        self.portal.call(_reset if reset else _drain, self.off)

    def reset(self) -> None:
        self.settle(reset=True)

    @rule(hold=st.booleans())
    def hold_copies(self, hold: bool) -> None:
        """Hold every copy started from now on in flight (the gate closes) until a rule
        waits for one (a load, a settle), or let them run again: stores pile up in
        flight (later stores defer for want of free CPU blocks), abandoned loads are
        really still copying."""
        if hold:
            self.gate.clear()
        else:
            self.gate.set()

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "off"):
            self.portal.call(self.off.check_invariants)


async def _drain(off: KVOffloader) -> None:
    await off.drain()


async def _reset(off: KVOffloader) -> None:
    await off.reset()


class FullOnlyOffloader(OffloaderGroupsMachine):
    KIND = "full"


class FullSlidingOffloader(OffloaderGroupsMachine):
    KIND = "sliding"


class FullRecurrentOffloader(OffloaderGroupsMachine):
    KIND = "recurrent"


class FullChunkedOffloader(OffloaderGroupsMachine):
    KIND = "chunked"


SHAPES = (FullOnlyOffloader, FullSlidingOffloader, FullRecurrentOffloader, FullChunkedOffloader)

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFullOnlyOffloader = SETTINGS(FullOnlyOffloader).TestCase
TestFullSlidingOffloader = SETTINGS(FullSlidingOffloader).TestCase
TestFullRecurrentOffloader = SETTINGS(FullRecurrentOffloader).TestCase
TestFullChunkedOffloader = SETTINGS(FullChunkedOffloader).TestCase


def test_the_machine_loads_bytes_from_cpu() -> None:
    """A run that loads, abandons, cancels a wait, drops a load and defers, on every
    shape: the machine's checks are not vacuous."""
    for cls in SHAPES:
        m = cls()
        m.start(fail=set(), group=0)
        try:
            m.admit(0, 12)
            m._compute("r1", 10)
            m._compute("r1", 10)
            m._end("r1", False)
            m.settle()
            m.admit(0, 3, priority=7)
            assert m.loads == 1, cls
            m.invariants_hold()
            m._end("r2", False)
            m.admit(0, 3, mode="abandon")
            m.invariants_hold()
            m.settle()
            m.invariants_hold()
            assert m.loads + m.abandons == 2, cls
            m._end("r3", False)
            m.admit(0, 3, mode="cancel_wait")
            assert m.cancelled_waits == 1, cls
            m._end("r4", False)
            m.admit(0, 3, mode="drop")
            assert m.dropped == 1, cls
            m.settle()
            m.admit(1, 12)
            m._follow_up("r6", 10)
            assert m.deferred >= 1, cls  # the block after the hit was being stored
            m.invariants_hold()
            m.reset()
            m.invariants_hold()
        finally:
            m.teardown()


def test_the_machine_defers_stores_when_copies_hold_the_pool() -> None:
    """Copies held in flight fill the small CPU pool: the next stores defer, on every
    shape; and an abandoned load is one whose copy is really still running."""
    for cls in SHAPES:
        m = cls()
        m.start(fail=set(), group=0)
        try:
            m.hold_copies(hold=True)
            for conv in range(3):  # fresh conversations: no hit, no load opens the gate
                m.admit(conv, 16)
                m._compute(f"r{conv + 1}", 16)
                m.invariants_hold()
            assert m.off.statistics().scheduler.deferred_blocks > 0, cls
            m.settle()
            m.hold_copies(hold=True)
            m.admit(0, 1, mode="abandon")  # ends r1; the next turn's load is held, abandoned
            assert m.abandons == 1, cls
            m.settle()
            m.invariants_hold()
        finally:
            m.teardown()
