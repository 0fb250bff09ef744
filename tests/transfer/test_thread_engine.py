"""ThreadCopyEngine: ordering, lifetime, responsiveness and stress (FM-01/08/09/10/44)."""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import pytest
import torch
from transfer_helpers import bits, gpu_block, load_plan, make_layout, random_kv, store_plan

from kvoffload.errors import ClosedError, LayoutMismatchError
from kvoffload.testing import CopyFaults
from kvoffload.transfer import CompletionPoller, CopyEngine, ThreadCopyEngine, TransferTask

pytestmark = pytest.mark.anyio


async def heartbeat(lags: list[float], stop: anyio.Event, period: float = 0.001) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await anyio.sleep(period)
        lags.append(time.perf_counter() - t0 - period)


def test_is_a_copy_engine_and_rejects_bad_input(host_factory) -> None:
    layout = make_layout()
    host = host_factory(layout, 4)
    engine = ThreadCopyEngine(layout, random_kv(layout, 6), host)
    assert isinstance(engine, CopyEngine)
    with pytest.raises(ValueError, match=r"cpu_block_ids\[0\]=4 out of range \[0, 4\)"):
        engine.submit(store_plan([0], [4]))
    with pytest.raises(ValueError, match=r"gpu_block_ids\[0\]=6 out of range \[0, 6\)"):
        engine.submit(load_plan([6], [0]))
    with pytest.raises(TypeError, match="after must be"):
        engine.submit(store_plan([0], [0]), after=object())
    other = make_layout(head=16)
    with pytest.raises(LayoutMismatchError, match="does not match"):
        ThreadCopyEngine(other, random_kv(other, 4), host)


async def test_store_waits_for_its_producer_fm01(host_factory) -> None:
    """The store is ordered after the producer that writes its block, never before."""
    layout = make_layout()
    kv = [torch.zeros(layout.tensor_shape(4), dtype=torch.float32) for _ in range(3)]
    host = host_factory(layout, 4)
    engine = ThreadCopyEngine(layout, kv, host)
    produced = threading.Event()
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.0005)

    def producer() -> None:
        time.sleep(0.05)
        for t in kv:
            t[2].fill_(7.0)
        produced.set()

    thread = threading.Thread(target=producer)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        task = engine.submit(store_plan([2], [1]), after=produced)
        thread.start()
        poller.track(task)
        with anyio.fail_after(5):
            await task
        tg.cancel_scope.cancel()
    thread.join()
    assert bool((host.block(1) == 7.0).all())
    await engine.aclose()


async def test_task_keeps_copy_alive_when_user_drops_references_fm08(host_factory) -> None:
    layout = make_layout()
    kv = random_kv(layout, 4, seed=3)
    expected = [gpu_block(layout, kv, layer, 1).clone() for layer in range(3)]
    host = host_factory(layout, 4)
    gate = threading.Event()
    engine = ThreadCopyEngine(layout, kv, host, copy_hook=CopyFaults(gate=gate))
    kv_ref = weakref.ref(kv[0])
    task = engine.submit(store_plan([1], [2]))
    del kv
    gc.collect()
    assert kv_ref() is not None  # held for the copy
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.0005)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        gate.set()
        with anyio.fail_after(5):
            await task
        tg.cancel_scope.cancel()
    for layer in range(3):
        assert torch.equal(bits(host.block(2)[layer]), bits(expected[layer]))
    await engine.aclose()


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """Keep what earlier tests left in this process out of the cycle collector's reach.

    A test that imported transformers and built a model leaves a large heap behind; a full
    collection of it pauses the event loop for hundreds of milliseconds, which would show
    up as loop lag of the copy engine under test. The objects the test itself allocates
    are still collected as usual.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.usefixtures("frozen_heap")
async def test_many_small_submits_stay_cheap_and_the_loop_stays_live_fm09(host_factory) -> None:
    layout = make_layout(layers=1, heads=1, head=4, block_size=1)
    host = host_factory(layout, 64)
    engine = ThreadCopyEngine(layout, random_kv(layout, 64), host)
    done: list[TransferTask] = []
    all_done = anyio.Event()
    total = 5000

    def on_complete(task: TransferTask) -> None:
        done.append(task)
        if len(done) == total:
            all_done.set()

    poller = CompletionPoller(on_complete, poll_interval_s=0.0005)
    lags: list[float] = []
    stop = anyio.Event()
    submit_times: list[float] = []
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        tg.start_soon(heartbeat, lags, stop)
        for i in range(total):
            plan = store_plan([i % 64], [i % 64]) if i % 2 else load_plan([i % 64], [i % 64])
            t0 = time.perf_counter()
            task = engine.submit(plan)
            submit_times.append(time.perf_counter() - t0)
            poller.track(task)
            if i % 100 == 99:
                await anyio.lowlevel.checkpoint()
        with anyio.fail_after(30):
            await all_done.wait()
        stop.set()
        tg.cancel_scope.cancel()
    await engine.aclose()
    assert len(done) == total
    assert all(t.status.value == "done" for t in done)
    submit_times.sort()
    assert submit_times[len(submit_times) // 2] < 0.001  # median submit well under 1 ms
    assert submit_times[-10] < 0.05  # no submit blocks on a full queue
    assert max(lags) < 0.25


@pytest.mark.usefixtures("frozen_heap")
async def test_loop_stays_responsive_during_a_200ms_copy_fm10(host_factory) -> None:
    layout = make_layout(layers=4, heads=4, head=64, block_size=16)  # 64 KiB blocks
    host = host_factory(layout, 128)
    kv = random_kv(layout, 128)
    faults = CopyFaults(delay_s=0.2)  # the worker sleeps (GIL released), then copies 8 MiB
    engine = ThreadCopyEngine(layout, kv, host, copy_hook=faults)
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.0002)
    lags: list[float] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        await anyio.sleep(0.01)
        tg.start_soon(heartbeat, lags, stop)
        ids = list(range(0, 128))
        t0 = time.perf_counter()
        task = engine.submit(load_plan(ids[::-1], ids))
        poller.track(task)
        await task
        elapsed = time.perf_counter() - t0
        stop.set()
        tg.cancel_scope.cancel()
    await engine.aclose()
    assert elapsed >= 0.2
    assert faults.calls == 1
    assert len(lags) > 50  # the heartbeat kept ticking during the copy
    assert max(lags) < 0.02, f"max heartbeat lag {max(lags) * 1000:.1f} ms"


async def test_concurrent_stores_and_loads_keep_progressing_fm44(host_factory) -> None:
    layout = make_layout(layers=2, heads=2, head=32, block_size=8)
    host = host_factory(layout, 64)
    engine = ThreadCopyEngine(layout, random_kv(layout, 64), host)
    count = 0
    last_progress = time.perf_counter()

    def on_complete(task: TransferTask) -> None:
        nonlocal count, last_progress
        count += 1
        last_progress = time.perf_counter()

    poller = CompletionPoller(on_complete, poll_interval_s=0.0005)
    stall = 0.0
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        end = time.perf_counter() + 0.5
        i = 0
        while time.perf_counter() < end:
            ids = [(i + k) % 64 for k in range(8)]
            poller.track(engine.submit(store_plan(ids, ids[::-1])))
            poller.track(engine.submit(load_plan(ids[::-1], ids)))
            sum(range(2000))  # Python-side work holding the GIL
            i += 1
            await anyio.sleep(0.001)
            stall = max(stall, time.perf_counter() - last_progress)
        with anyio.fail_after(10):
            await poller.drain()
        tg.cancel_scope.cancel()
    await engine.aclose()
    assert count == 2 * i
    assert stall < 1.0


async def test_submit_after_close_raises(host_factory) -> None:
    layout = make_layout()
    engine = ThreadCopyEngine(layout, random_kv(layout, 2), host_factory(layout, 2))
    await engine.aclose()
    await engine.aclose()
    assert engine.closed
    with pytest.raises(ClosedError):
        engine.submit(store_plan([0], [0]))


@pytest.mark.parametrize("kind", ["blocks_first", "kv_first"])
@pytest.mark.parametrize("threads", [1, 2, 3])
async def test_large_copies_split_across_threads_are_bit_exact(host_factory, kind, threads):
    # 6 layers x 32 blocks of 24 KiB per layer piece: above the 4 MiB split threshold.
    layout = make_layout(kind=kind, layers=6, heads=4, head=96, block_size=16)
    n = 40
    kv = random_kv(layout, n, seed=threads)
    original = [t.clone() for t in kv]
    host = host_factory(layout, n)
    engine = ThreadCopyEngine(layout, kv, host, copy_threads=threads)
    rng = random.Random(threads)
    src, cpu, dst = rng.sample(range(n), 32), rng.sample(range(n), 32), rng.sample(range(n), 32)
    assert 32 * layout.bytes_per_block >= 4 << 20
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.001)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        for plan in (store_plan(src, cpu), load_plan(dst, cpu)):
            task = engine.submit(plan)
            poller.track(task)
            await task
        tg.cancel_scope.cancel()
    await engine.aclose()
    for layer in range(layout.num_layers):
        for a, b in zip(src, dst, strict=True):
            assert torch.equal(
                bits(gpu_block(layout, kv, layer, b)), bits(gpu_block(layout, original, layer, a))
            )


def test_copy_threads_must_be_positive(host_factory) -> None:
    layout = make_layout()
    with pytest.raises(ValueError, match="copy_threads"):
        ThreadCopyEngine(layout, random_kv(layout, 4), host_factory(layout, 4), copy_threads=0)


async def test_worker_completion_wakes_the_poller_without_waiting_a_round(host_factory) -> None:
    # The worker thread hands its completion to the loop: with a 30 s poll interval the
    # task is still delivered at once (polling alone would take 30 s).
    layout = make_layout()
    kv = random_kv(layout, 8)
    engine = ThreadCopyEngine(layout, kv, host_factory(layout, 8))
    poller = CompletionPoller(lambda t: None, poll_interval_s=30.0)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        for i in range(5):
            task = engine.submit(store_plan([i], [i]))
            poller.track(task)
            with anyio.fail_after(10):
                await task
        tg.cancel_scope.cancel()
    await engine.aclose()
