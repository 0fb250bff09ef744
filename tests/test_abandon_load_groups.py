"""Abandoning a load with several KV cache groups, as with one (tests/test_abandon_load.py).

The scenarios of the one-group tests, on two shapes (full + sliding window, full +
recurrent state), through real `ThreadCopyEngine`s (one per group, a gate holds the
copies) and one `RefCountPinner` per group: `OffloadRequest.abandon_load()` and
`KVOffloader.abandon_load()` resolve the load's one task as abandoned at once, every
group's part together; each copy runs on, its CPU blocks keep their reference and its GPU
blocks stay pinned in their group until it ended, it publishes and counts nothing, and the
request recomputes into other GPU blocks. The bytes of every group are checked, and the
scheduler's invariants after each step.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest

from kvoffload import (
    KVOffloader,
    LoadAbandonedError,
    OffloadRequest,
    RefCountPinner,
    RequestStateError,
    TransferError,
    TransferStatus,
    TransferTask,
    UnknownRequestError,
)
from kvoffload.groups import needed
from kvoffload.scheduler.groups import GroupedScheduler
from kvoffload.testing import CopyFaults
from tests.groups_helpers import Rig as HelperRig
from tests.groups_helpers import group
from tests.test_offloader_groups import Model, Tables, config, engines_for, groups_of

pytestmark = pytest.mark.anyio

PROMPT = list(range(1, 18))  # 17 tokens: store points 8 and 16, the hit is at 16
HIT = 16

Tabs = dict[str, list[int | None]]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["sliding", "recurrent"])
def shape(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass
class Rig:
    """A multi-group offloader over real CPU tensors, its pinners and the copies' gate."""

    off: KVOffloader
    model: Model
    alloc: Tables
    pinners: dict[str, RefCountPinner]
    released: dict[str, list[int]]
    gate: threading.Event

    @property
    def sched(self) -> GroupedScheduler:
        assert self.off._life.front is not None
        return self.off._life.front.scheduler

    def hold(self) -> None:
        """From now on, copies stay in flight until `land()`."""
        self.gate.clear()

    def land(self) -> None:
        """End every copy held so far."""
        self.gate.set()

    def check(self) -> None:
        self.sched.check_invariants()


@asynccontextmanager
async def rig(shape: str) -> AsyncIterator[Rig]:
    model = Model(groups_of(shape))
    gate = threading.Event()
    gate.set()
    released: dict[str, list[int]] = {g.name: [] for g in model.groups}
    pinners = {g.name: RefCountPinner(on_release=released[g.name].extend) for g in model.groups}
    engines, hosts = engines_for(model, {g.name: CopyFaults(gate=gate) for g in model.groups}, 32)
    try:
        async with KVOffloader(
            config(), model.kv, groups=model.groups, copy_engine=engines, pinner=pinners
        ) as off:
            yield Rig(off, model, Tables(model), pinners, released, gate)
            gate.set()
    finally:
        gate.set()
        for host in hosts.values():
            host.close()


def loaded(r: Rig, tables: Tabs) -> dict[str, tuple[int, ...]]:
    """Per group, the GPU blocks a load of the hit at `HIT` (no prefix) writes."""
    out: dict[str, tuple[int, ...]] = {}
    for g in r.model.groups:
        ids = [tables[g.name][i] for i in needed(g, HIT)]
        out[g.name] = tuple(b for b in ids if b is not None)
    return out


def cached(r: Rig) -> dict[str, int]:
    return {name: s.cached_cpu_blocks for name, s in r.sched.statistics().items()}


async def store_prompt(r: Rig) -> None:
    """Request "a" computes PROMPT in its blocks of every group and stores points 8, 16."""
    tables = r.alloc.new(5)
    with r.off.request("a", PROMPT) as a:
        r.model.fill(tables, PROMPT)
        a.advance(tables, len(PROMPT))
        r.off.store()
    await r.off.drain()
    assert all(c > 0 for c in cached(r).values())
    assert all(p.num_pinned == 0 for p in r.pinners.values())
    for got in r.released.values():
        got.clear()
    r.model.wipe()  # what "b" finds in its blocks comes from the CPU pools
    r.check()


async def load_then_abandon(
    r: Rig, rid: str
) -> tuple[OffloadRequest, TransferTask, dict[str, tuple[int, ...]], Tabs]:
    """``rid`` reports its tables, looks PROMPT up, loads the hit (held in flight) while a
    coroutine awaits the load, and abandons it. Returns the handle, the task, what
    `abandon_load()` returned and the tables the load writes."""
    r.hold()
    req = r.off.request(rid, PROMPT)
    tables = r.alloc.new(5)
    req.advance(tables, 0)  # the scheduler knows the tables the load writes
    assert req.lookup() == HIT
    task = req.load(tables)
    assert task is not None
    seen: list[BaseException] = []

    async def waiter() -> None:
        try:
            await task
        except TransferError as exc:
            seen.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.lowlevel.checkpoint()  # the waiter is waiting
        assert not seen
        blocks = req.abandon_load()
    assert len(seen) == 1
    assert isinstance(seen[0], LoadAbandonedError)  # the wait ended without the copy
    assert isinstance(blocks, dict)
    r.check()
    return req, task, blocks, tables


def assert_quarantined(
    r: Rig, task: TransferTask, blocks: dict[str, tuple[int, ...]], tables: Tabs
) -> None:
    """The abandoned copies are still running: in every group their blocks are pinned and
    referenced."""
    assert blocks == loaded(r, tables)
    assert task.status is TransferStatus.ABANDONED
    assert task.done()
    with pytest.raises(LoadAbandonedError, match="abandoned"):
        task.result()
    stats = r.sched.statistics()
    for name, ids in blocks.items():
        assert ids
        assert all(r.pinners[name].is_pinned(b) for b in ids), name
        assert not set(r.released[name]) & set(ids)
        s = stats[name]
        assert s.free_cpu_blocks == s.num_cpu_blocks - len(ids)  # refs kept until the copy ends
        assert s.in_flight_plans == 1
    r.check()


async def assert_all_back(r: Rig, blocks: dict[str, tuple[int, ...]]) -> None:
    await r.off.drain()
    for name, ids in blocks.items():
        assert sorted(r.released[name]) == sorted(ids)  # each group's release hook, once each
    assert all(p.num_pinned == 0 for p in r.pinners.values())
    for name, s in r.sched.statistics().items():
        assert s.free_cpu_blocks == s.num_cpu_blocks, name
        assert s.loaded_blocks == 0, name  # never counted as a hit
        assert s.in_flight_plans == 0
    stats = r.off.statistics().scheduler
    assert stats.abandoned_loads == 1  # one load, every group's part of it
    assert stats.loaded_blocks == stats.loaded_tokens == 0
    assert stats.failed_loads == 0
    assert stats.in_flight_transfers == 0
    r.check()


async def test_a_copy_that_completes_after_it_was_abandoned(shape: str) -> None:
    async with rig(shape) as r:
        await store_prompt(r)
        before = cached(r)
        req, task, blocks, tables = await load_then_abandon(r, "b")
        assert_quarantined(r, task, blocks, tables)
        assert req.hit_tokens == 0
        # The hit is still there (nothing was unpublished), and not "being loaded": a
        # deferring lookup answers now.
        assert req.lookup(allow_defer=True) == HIT
        req.release()
        r.check()
        # The request recomputes into fresh blocks of every group and reports them.
        fresh = r.alloc.new(5)
        for name, t in fresh.items():
            for tensor in r.model.kv[name]:
                tensor[[b for b in t if b is not None]] = 7.0
        req.advance(fresh, len(PROMPT))
        r.check()
        r.land()  # the abandoned copies land, in the loaded blocks only
        await r.off.drain()
        r.check()
        for name, t in fresh.items():  # the recompute never sees them
            for tensor in r.model.kv[name]:
                assert bool((tensor[[b for b in t if b is not None]] == 7.0).all()), name
        r.model.check(tables, PROMPT, HIT)  # they did copy, bytes exact in every group
        assert cached(r) == before  # an abandoned copy that ended well unpublishes nothing
        req.finish()
        await assert_all_back(r, blocks)


async def test_a_copy_that_completes_after_the_request_finished(shape: str) -> None:
    async with rig(shape) as r:
        await store_prompt(r)
        req, task, blocks, tables = await load_then_abandon(r, "b")
        req.finish()
        # The request waits on nothing any more: its state is gone.
        assert not r.sched.has_request("b")
        assert_quarantined(r, task, blocks, tables)
        r.land()
        await assert_all_back(r, blocks)
        # A late completion changed nothing for a new request with the same prefix.
        with r.off.request("c", PROMPT) as c:
            assert c.lookup() == HIT
            t = r.alloc.new(5)
            task2 = c.load(t)
            assert task2 is not None
            await task2
            r.model.check(t, PROMPT, HIT)
        await r.off.drain()
        r.check()


async def test_a_copy_that_completes_after_reset(shape: str) -> None:
    async with rig(shape) as r:
        await store_prompt(r)
        req, task, blocks, _ = await load_then_abandon(r, "b")
        results: list[bool] = []

        async def reset() -> None:
            results.append(await r.off.reset())

        async with anyio.create_task_group() as tg:
            tg.start_soon(reset)
            await anyio.sleep(0.01)
            assert not results  # the reset waits for the abandoned copies
            assert not any(cached(r).values())
            for name, ids in blocks.items():
                assert all(r.pinners[name].is_pinned(b) for b in ids)
            r.check()
            r.land()
        assert results == [True]
        assert task.status is TransferStatus.ABANDONED
        req.finish()
        await r.off.drain()
        for name, ids in blocks.items():
            assert sorted(r.released[name]) == sorted(ids)
        for s in r.sched.statistics().values():
            assert s.free_cpu_blocks == s.num_cpu_blocks
            assert s.cached_cpu_blocks == 0
        r.check()


async def test_abandoning_a_load_the_reset_abandoned_ends_the_wait_too(shape: str) -> None:
    async with rig(shape) as r:
        await store_prompt(r)
        r.hold()
        with r.off.request("b", PROMPT) as req:
            assert req.lookup() == HIT
            tables = r.alloc.new(5)
            task = req.load(tables)
            assert task is not None
            async with anyio.create_task_group() as tg:
                tg.start_soon(r.off.reset)  # waits for the load's copies
                await anyio.sleep(0.01)
                assert req.abandon_load() == loaded(r, tables)
                with pytest.raises(LoadAbandonedError):
                    await task  # at once, while the copies are held
                r.check()
                r.land()
        await r.off.drain()
        assert all(p.num_pinned == 0 for p in r.pinners.values())
        for s in r.sched.statistics().values():
            assert s.free_cpu_blocks == s.num_cpu_blocks
        r.check()


async def test_abandon_without_a_load_in_flight(shape: str) -> None:
    async with rig(shape) as r:
        await store_prompt(r)
        with r.off.request("b", PROMPT) as req:
            assert req.abandon_load() == {}  # a live handle that never looked up
            assert req.lookup() == HIT
            assert req.abandon_load() == {}  # only the pins go
            for s in r.sched.statistics().values():
                assert s.free_cpu_blocks == s.num_cpu_blocks
                assert s.pinned_blocks == 0
            r.check()
            assert req.lookup() == HIT
            tables = r.alloc.new(5)
            task = req.load(tables)
            assert task is not None
            await task  # not held: it completes
            assert req.abandon_load() == {}  # a completed load is not abandoned
            assert task.status is TransferStatus.DONE
            r.model.check(tables, PROMPT, HIT)
            r.check()
        await r.off.drain()
        stats = r.off.statistics()
        assert stats.scheduler.abandoned_loads == 0
        assert stats.groups is not None
        assert all(s.loaded_blocks > 0 for s in stats.groups.values())
        r.check()


async def test_a_finished_handle_refuses_abandon_load(shape: str) -> None:
    async with rig(shape) as r:
        req = r.off.request("b", PROMPT)
        req.finish()
        with pytest.raises(RequestStateError, match="abandon_load"):
            req.abandon_load()


async def test_the_low_level_call_and_after_finish(shape: str) -> None:
    # KVOffloader.abandon_load(): an unknown id is refused; a finished request whose load
    # is still in flight can abandon it too, and is forgotten at once.
    async with rig(shape) as r:
        with pytest.raises(UnknownRequestError, match="'nobody'"):
            r.off.abandon_load("nobody")
        await store_prompt(r)
        r.hold()
        req = r.off.request("b", PROMPT)
        assert req.lookup() == HIT
        tables = r.alloc.new(5)
        task = req.load(tables)
        assert task is not None
        req.finish()
        assert r.sched.has_request("b")  # draining: its load is in flight
        blocks = r.off.abandon_load("b")
        assert isinstance(blocks, dict)
        assert not r.sched.has_request("b")
        assert_quarantined(r, task, blocks, tables)
        r.land()
        await assert_all_back(r, blocks)


async def test_a_recompute_may_reuse_the_blocks_once_the_pinners_released_them(
    shape: str,
) -> None:
    # The other way the docs give: wait for each group's release hook, then recompute in
    # place.
    async with rig(shape) as r:
        await store_prompt(r)
        req, _task, blocks, tables = await load_then_abandon(r, "b")
        r.land()
        with anyio.fail_after(10):
            while not all(set(ids) <= set(r.released[n]) for n, ids in blocks.items()):
                await anyio.sleep(0.001)
        r.model.fill(tables, PROMPT)  # the recompute, after the copies ended
        for name, t in tables.items():
            for tensor in r.model.kv[name]:
                tensor[t[0]] = 3.0  # a block of its own, to see the copy never lands later
        req.advance(tables, len(PROMPT))
        r.check()
        await r.off.drain()
        for name, t in tables.items():
            for tensor in r.model.kv[name]:
                assert bool((tensor[t[0]] == 3.0).all()), name
        req.finish()
        await assert_all_back(r, blocks)


async def test_the_abandoned_load_is_one_task_over_every_group(shape: str) -> None:
    # Atomic over the groups: a lookup of another request does not defer to any group's
    # part of the abandoned load, and its own load of the same hit is served in full.
    async with rig(shape) as r:
        await store_prompt(r)
        _req, task, blocks, _tables = await load_then_abandon(r, "b")
        assert set(blocks) == {g.name for g in r.model.groups}
        assert task.plan.num_blocks == sum(len(ids) for ids in blocks.values())
        r.land()
        with r.off.request("c", PROMPT) as c:
            assert c.lookup(allow_defer=True) == HIT
            t = r.alloc.new(5)
            task2 = c.load(t)
            assert task2 is not None
            await task2
            r.model.check(t, PROMPT, HIT)
        _req.finish()
        await r.off.drain()
        r.check()


@pytest.mark.parametrize("other", ["sliding_window", "recurrent"])
def test_the_scheduler_stores_nothing_from_the_abandoned_loads_tables(other: str) -> None:
    # The engine reported the loaded tokens as computed, then abandoned the load: its
    # blocks go back to the engine (and to other requests), so until it reports its
    # recompute no group stores anything from the tables the load wrote, even once the
    # CPU copies are gone.
    kw: dict[str, object] = {"window": 9} if other == "sliding_window" else {}
    gs = [group("attn", "full", 4), group("other", other, 4, **kw)]
    rig = HelperRig(gs, cpu_blocks=16, checkpoint_tokens=8)
    sched = rig.sched
    tokens = list(range(1, 18))
    hashes = rig.hashes(tokens)
    t0: dict[str, list[int | None]] = {"attn": [0, 1, 2, 3, 4], "other": [0, 1, 2, 3, 4]}
    rig.fill(t0)
    sched.update("a", t0, hashes, 17)
    rig.run(sched.plan_stores())
    rig.run(sched.finish("a"))
    t1: dict[str, list[int | None]] = {"attn": [5, 6, 7, 8, 9], "other": [5, 6, 7, 8, 9]}
    assert sched.lookup("b", hashes, 17) == 16
    load = sched.plan_load("b", t1, 16)
    assert load is not None
    sched.update("b", t1, hashes, 16)  # the engine counts the loaded tokens as computed
    got = sched.abandon_load("b")
    assert {n: [p.plan_id for p in ps] for n, ps in got.items()} == {
        n: [p.plan_id] for n, p in load.plans.items()
    }
    sched.check_invariants()
    assert sched.statistics()["attn"].in_flight_plans == 1  # the copy runs on
    rig.run(load)  # the copies end; they count nothing
    assert all(s.loaded_blocks == 0 for s in sched.statistics().values())
    assert sched.abandoned_loads == 1
    sched.reset()  # the CPU copies are gone: a store would be planned again
    sched.check_invariants()
    assert sched.plan_stores() is None  # nothing is computed for "b" until it reports
    # Its recompute, in other blocks, is stored as any request's.
    t2: dict[str, list[int | None]] = {"attn": [10, 11, 12, 13], "other": [10, 11, 12, 13]}
    rig.fill(t2)
    sched.update("b", t2, hashes, 17)
    plan = sched.plan_stores()
    assert plan is not None
    for sub in plan.plans.values():
        assert set(sub.gpu_block_ids) <= {10, 11, 12, 13}
    rig.run(plan)
    rig.run(sched.finish("b"))
    sched.check_invariants()
