"""Abandoning a load: the wait ends now, the copy lands harmlessly later.

`OffloadRequest.abandon_load()` (and `KVOffloader.abandon_load()`) resolve the load's task
as abandoned at once; the copy runs on, its CPU blocks keep their reference and its GPU
blocks stay pinned until it ended, it publishes and counts nothing, and the request
recomputes into other GPU blocks. Every scenario runs under the controllable copy engine
(the copy ends when the test says) and the thread engine (a gate holds the real copy).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest
import torch

from kvoffload import (
    KVLayout,
    KVOffloader,
    LoadAbandonedError,
    OffloadConfig,
    OffloadRequest,
    RefCountPinner,
    RequestStateError,
    TransferError,
    TransferStatus,
    TransferTask,
    UnknownRequestError,
)
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import ControllableCopyEngine, CopyFaults
from kvoffload.transfer.plan import TransferPlan
from kvoffload.transfer.thread_engine import ThreadCopyEngine

pytestmark = pytest.mark.anyio

BS = 4
NUM_GPU = 32
NUM_CPU = 16
PROMPT = list(range(13))  # three full blocks before the last token
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=BS)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass
class Rig:
    """An offloader over real CPU KV tensors, its pinner and a way to end held copies."""

    off: KVOffloader
    kv: list[torch.Tensor]
    pinner: RefCountPinner
    released: list[int]
    hold: Callable[[], None]
    """From now on, copies stay in flight until `land()`."""
    land: Callable[[], None]
    """End every copy held so far."""


class HeldCopies:
    """A `ControllableCopyEngine` whose copies end at once, except while held."""

    def __init__(self, inner: ControllableCopyEngine) -> None:
        self.inner = inner
        self.held = False

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def submit(self, plan: TransferPlan, *, after: object | None = None) -> TransferTask:
        task = self.inner.submit(plan, after=after)
        if not self.held:
            self.inner.complete(task)
        return task

    def hold(self) -> None:
        self.held = True

    def land(self) -> None:
        self.held = False
        self.inner.complete_all()

    async def aclose(self) -> None:
        await self.inner.aclose()


def make_kv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(LAYOUT.tensor_shape(NUM_GPU), generator=gen) for _ in range(2)]


@asynccontextmanager
async def rig(kind: str) -> AsyncIterator[Rig]:
    kv = make_kv()
    released: list[int] = []
    pinner = RefCountPinner(on_release=released.extend)
    config = OffloadConfig(block_size=BS, num_cpu_blocks=NUM_CPU)
    host = HostKVBuffer(LAYOUT, NUM_CPU, pin_memory="never")
    gate = threading.Event()
    gate.set()
    try:
        if kind == "controllable":
            controllable = ControllableCopyEngine(layout=LAYOUT, gpu_kv=kv, host=host)
            copies = HeldCopies(controllable)
            async with KVOffloader(
                config, kv, layout=LAYOUT, copy_engine=copies, pinner=pinner
            ) as off:
                yield Rig(off, kv, pinner, released, copies.hold, copies.land)
                copies.land()
        else:
            engine = ThreadCopyEngine(LAYOUT, kv, host, copy_hook=CopyFaults(gate=gate))
            async with KVOffloader(
                config, kv, layout=LAYOUT, copy_engine=engine, pinner=pinner
            ) as off:
                yield Rig(off, kv, pinner, released, gate.clear, gate.set)
                gate.set()
    finally:
        gate.set()
        host.close()


@pytest.fixture(params=["controllable", "thread"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def block(kv: list[torch.Tensor], gpu_block: int) -> torch.Tensor:
    return torch.stack([t[gpu_block] for t in kv])


def check(r: Rig) -> None:
    r.off.scheduler.check_invariants()


async def store_prompt(r: Rig) -> None:
    """Request "a" computes PROMPT in GPU blocks 0..3 and stores its three full blocks."""
    with r.off.request("a", PROMPT) as a:
        a.advance([0, 1, 2, 3], len(PROMPT))
        r.off.store()
    await r.off.drain()
    assert r.released == [0, 1, 2]


async def load_then_abandon(
    r: Rig, rid: str
) -> tuple[OffloadRequest, TransferTask, tuple[int, ...]]:
    """``rid`` reports its table (GPU blocks 4..7), looks PROMPT up, loads the hit (held in
    flight) while a coroutine awaits the load, and abandons it. Returns the handle, the
    task and what `abandon_load()` returned."""
    r.hold()
    req = r.off.request(rid, PROMPT)
    req.advance([4, 5, 6, 7], 0)  # the scheduler knows the table the load writes
    assert req.lookup() == 3 * BS
    task = req.load([4, 5, 6, 7])
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
    return req, task, blocks


def assert_quarantined(r: Rig, task: TransferTask, blocks: tuple[int, ...]) -> None:
    """The abandoned copy is still running: its blocks are pinned and referenced."""
    assert blocks == (4, 5, 6)
    assert task.status is TransferStatus.ABANDONED
    assert task.done()
    with pytest.raises(LoadAbandonedError, match="abandoned"):
        task.result()
    assert all(r.pinner.is_pinned(b) for b in blocks)
    assert not set(r.released) & set(blocks)
    pool = r.off.pool
    assert pool.num_free == pool.num_blocks - 3  # its CPU blocks keep their reference
    assert r.off.scheduler.num_in_flight == 1
    check(r)


async def assert_all_back(r: Rig, blocks: tuple[int, ...]) -> None:
    await r.off.drain()
    assert sorted(r.released[3:]) == sorted(blocks)  # the release hook, once each
    assert r.pinner.num_pinned == 0
    pool = r.off.pool
    assert pool.num_free == pool.num_blocks
    stats = r.off.statistics().scheduler
    assert stats.abandoned_loads == 1
    assert stats.loaded_blocks == stats.loaded_tokens == 0  # never counted as a hit
    assert stats.failed_loads == 0
    assert stats.in_flight_transfers == 0
    check(r)


async def test_a_copy_that_completes_after_it_was_abandoned(kind: str) -> None:
    async with rig(kind) as r:
        await store_prompt(r)
        req, task, blocks = await load_then_abandon(r, "b")
        assert_quarantined(r, task, blocks)
        assert req.hit_tokens == 0
        # The hit is still there (nothing was unpublished), and not "being loaded": a
        # deferring lookup answers now, a second load is no concurrent one.
        assert req.lookup(allow_defer=True) == 3 * BS
        req.release()
        # The request recomputes into fresh blocks (8..11) and reports them.
        fresh = [8, 9, 10, 11]
        for t in r.kv:
            t[fresh] = 7.0
        req.advance(fresh, len(PROMPT))
        check(r)
        r.land()  # the abandoned copy lands, in blocks 4..6 only
        await r.off.drain()
        for b in fresh:  # the recompute never sees it
            assert torch.equal(block(r.kv, b), torch.full_like(block(r.kv, b), 7.0))
        for gpu, src in zip(blocks, [0, 1, 2], strict=True):
            assert torch.equal(block(r.kv, gpu), block(r.kv, src))  # it did copy
        assert all(r.off.pool.is_cached(h) for h in r.off.hash_prompt(PROMPT))
        req.finish()
        await assert_all_back(r, blocks)


async def test_a_copy_that_completes_after_the_request_finished(kind: str) -> None:
    async with rig(kind) as r:
        await store_prompt(r)
        req, task, blocks = await load_then_abandon(r, "b")
        req.finish()
        # The request waits on nothing any more: its state is gone, its id refused.
        assert not r.off.scheduler.has_request("b")
        assert r.off.scheduler.was_finished("b")
        assert_quarantined(r, task, blocks)
        r.land()
        await assert_all_back(r, blocks)
        # A late completion changed nothing for a new request with the same prefix.
        with r.off.request("c", PROMPT) as c:
            assert c.lookup() == 3 * BS


async def test_a_copy_that_completes_after_reset(kind: str) -> None:
    async with rig(kind) as r:
        await store_prompt(r)
        req, task, blocks = await load_then_abandon(r, "b")
        results: list[bool] = []

        async def reset() -> None:
            results.append(await r.off.reset())

        async with anyio.create_task_group() as tg:
            tg.start_soon(reset)
            await anyio.sleep(0.01)
            assert not results  # the reset waits for the abandoned copy
            assert r.off.pool.num_cached == 0
            assert all(r.pinner.is_pinned(b) for b in blocks)
            check(r)
            r.land()
        assert results == [True]
        assert task.status is TransferStatus.ABANDONED
        req.finish()
        await r.off.drain()
        assert sorted(r.released[3:]) == sorted(blocks)
        assert r.off.pool.num_free == r.off.pool.num_blocks
        assert r.off.pool.num_cached == 0
        check(r)


async def test_abandoning_a_load_the_reset_abandoned_ends_the_wait_too(kind: str) -> None:
    async with rig(kind) as r:
        await store_prompt(r)
        r.hold()
        with r.off.request("b", PROMPT) as req:
            assert req.lookup() == 3 * BS
            task = req.load([4, 5, 6, 7])
            assert task is not None
            async with anyio.create_task_group() as tg:
                tg.start_soon(r.off.reset)  # waits for the load's copy
                await anyio.sleep(0.01)
                assert req.abandon_load() == (4, 5, 6)
                with pytest.raises(LoadAbandonedError):
                    await task  # at once, while the copy is held
                r.land()
        await r.off.drain()
        assert r.pinner.num_pinned == 0
        assert r.off.pool.num_free == r.off.pool.num_blocks
        check(r)


async def test_abandon_without_a_load_in_flight(kind: str) -> None:
    async with rig(kind) as r:
        await store_prompt(r)
        with r.off.request("b", PROMPT) as req:
            assert req.lookup() == 3 * BS
            assert req.abandon_load() == ()  # only the pin goes
            assert r.off.pool.num_free == r.off.pool.num_blocks
            check(r)
            assert req.lookup() == 3 * BS
            task = req.load([4, 5, 6, 7])
            assert task is not None
            await task  # not held: it completes
            assert req.abandon_load() == ()  # a completed load is not abandoned
            assert task.status is TransferStatus.DONE
        await r.off.drain()
        stats = r.off.statistics().scheduler
        assert stats.abandoned_loads == 0
        assert stats.loaded_blocks == 3
        check(r)


async def test_a_finished_handle_refuses_abandon_load(kind: str) -> None:
    async with rig(kind) as r:
        req = r.off.request("b", PROMPT)
        req.finish()
        with pytest.raises(RequestStateError, match="abandon_load"):
            req.abandon_load()


async def test_the_low_level_call_and_after_finish(kind: str) -> None:
    # KVOffloader.abandon_load(): an unknown id is refused; a finished request whose load
    # is still in flight can abandon it too, and is forgotten at once.
    async with rig(kind) as r:
        with pytest.raises(UnknownRequestError, match="'nobody'"):
            r.off.abandon_load("nobody")
        await store_prompt(r)
        r.hold()
        hashes = r.off.hash_prompt(PROMPT)
        assert r.off.lookup("b", hashes, len(PROMPT)) == 3 * BS
        task = r.off.load("b", [4, 5, 6, 7], 3 * BS)
        assert task is not None
        r.off.finish("b")
        assert r.off.scheduler.has_request("b")  # draining: its load is in flight
        blocks = r.off.abandon_load("b")
        assert not r.off.scheduler.has_request("b")
        assert_quarantined(r, task, blocks)
        r.land()
        await assert_all_back(r, blocks)


async def test_a_recompute_may_reuse_the_blocks_once_the_pinner_released_them(
    kind: str,
) -> None:
    # The other way the docs give: wait for the release hook, then recompute in place.
    async with rig(kind) as r:
        await store_prompt(r)
        req, _task, blocks = await load_then_abandon(r, "b")
        r.land()
        with anyio.fail_after(10):
            while not set(blocks) <= set(r.released):
                await anyio.sleep(0.001)
        for t in r.kv:
            t[list(blocks)] = 3.0  # the recompute, after the copy ended
        req.advance([4, 5, 6, 7], len(PROMPT))
        await r.off.drain()
        assert torch.equal(block(r.kv, 4), torch.full_like(block(r.kv, 4), 3.0))
        req.finish()
        await assert_all_back(r, blocks)


@pytest.mark.cuda
async def test_on_cuda_the_abandoned_copys_event_is_waited_on_before_release() -> None:
    # The CUDA path: the load queues behind a stalled compute stream; abandoning it ends
    # the wait at once, but the blocks come back only once the poller saw its event fire.
    kv = [t.cuda() for t in make_kv()]
    released: list[int] = []
    pinner = RefCountPinner(on_release=released.extend)
    config = OffloadConfig(block_size=BS, num_cpu_blocks=NUM_CPU)
    async with KVOffloader(config, kv, layout=LAYOUT, pinner=pinner) as off:
        with off.request("a", PROMPT) as a:
            a.advance([0, 1, 2, 3], len(PROMPT))
            off.store()
        await off.drain()
        released.clear()
        with off.request("b", PROMPT) as req:
            assert req.lookup() == 3 * BS
            torch.cuda._sleep(200_000_000)  # the load waits for the compute stream
            task = req.load([4, 5, 6, 7])
            assert task is not None
            blocks = req.abandon_load()
            assert blocks == (4, 5, 6)
            assert task.status is TransferStatus.ABANDONED
            task.wait_on(torch.cuda.current_stream())  # enqueues nothing any more
            # No checkpoint since: the poller cannot have delivered it, the event is held.
            assert task._completion is not None
            assert all(pinner.is_pinned(b) for b in blocks)
            assert not released
            with pytest.raises(LoadAbandonedError):
                await task
            for t in kv:
                t[[8, 9, 10]] = 7.0  # the recompute, in fresh blocks
            req.advance([8, 9, 10, 11], len(PROMPT))
        await off.drain()
        assert task._completion is None  # delivered: its event had fired
        assert sorted(released) == [4, 5, 6]
        assert pinner.num_pinned == 0
        torch.cuda.synchronize()
        for gpu, src in zip(blocks, [0, 1, 2], strict=True):
            assert torch.equal(block(kv, gpu), block(kv, src))  # the late copy landed there
        for b in (8, 9, 10):
            assert torch.equal(block(kv, b), torch.full_like(block(kv, b), 7.0))
        assert off.pool.num_free == off.pool.num_blocks
        stats = off.statistics().scheduler
        assert stats.abandoned_loads == 1
        assert stats.loaded_tokens == 0
        off.scheduler.check_invariants()
