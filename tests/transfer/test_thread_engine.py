"""ThreadCopyEngine: ordering, lifetime, responsiveness and stress (FM-01/08/09/10/44).

Responsiveness is proved by counting what the event loop ran while a copy was held in
its worker, never by reading a clock: the loop lag itself is measured by
``kvoffload bench copy --loop-lag`` (docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref

import anyio
import anyio.lowlevel
import pytest
import torch
from transfer_helpers import bits, gpu_block, load_plan, make_layout, random_kv, store_plan

from kvoffload.errors import ClosedError, LayoutMismatchError
from kvoffload.testing import CopyFaults
from kvoffload.transfer import CompletionPoller, CopyEngine, ThreadCopyEngine, TransferTask

pytestmark = pytest.mark.anyio


class GatedCopy:
    """A ``copy_hook`` that holds every copy in its worker until the test opens the gate.

    A copy is provably in flight between ``entered`` and ``gate``: whatever the event loop
    does meanwhile, it does while the copy runs. ``loop_thread`` is refused: a copy that ran
    on the loop's own thread would block the loop, and raises here instead of hanging.
    """

    def __init__(self, loop_thread: int) -> None:
        self.loop_thread = loop_thread
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.calls = 0
        self.on_loop_thread = 0

    def __call__(self, plan: object) -> None:
        if threading.get_ident() == self.loop_thread:
            self.on_loop_thread += 1
            raise RuntimeError("copy ran on the event loop's thread")
        self.calls += 1
        self.entered.set()
        self.gate.wait()


def open_gate_later(gate: threading.Event, after_s: float = 30.0) -> threading.Timer:
    """Open ``gate`` from another thread after ``after_s``: a blocked loop then resumes, and
    the test fails on its tick count instead of hanging (never a limit on a duration)."""
    timer = threading.Timer(after_s, gate.set)
    timer.daemon = True
    timer.start()
    return timer


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


async def test_submits_never_wait_for_the_workers_fm09(host_factory) -> None:
    """5,000 submits while the workers are held: none waits for a copy to finish (a full
    queue would block the loop here), and the loop keeps running between them."""
    layout = make_layout(layers=1, heads=1, head=4, block_size=1)
    host = host_factory(layout, 64)
    hook = GatedCopy(threading.get_ident())
    engine = ThreadCopyEngine(layout, random_kv(layout, 64), host, copy_hook=hook)
    done: list[TransferTask] = []
    all_done = anyio.Event()
    total = 5000

    def on_complete(task: TransferTask) -> None:
        done.append(task)
        if len(done) == total:
            all_done.set()

    poller = CompletionPoller(on_complete, poll_interval_s=0.0005)
    ticks = 0

    ticker = anyio.CancelScope()

    async def count_ticks() -> None:
        nonlocal ticks
        with ticker:
            while True:
                await anyio.lowlevel.checkpoint()
                ticks += 1

    timer = open_gate_later(hook.gate)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        tg.start_soon(count_ticks)
        for i in range(total):
            plan = store_plan([i % 64], [i % 64]) if i % 2 else load_plan([i % 64], [i % 64])
            poller.track(engine.submit(plan))
            if i % 100 == 99:
                await anyio.lowlevel.checkpoint()
        submitted_while_held = not hook.gate.is_set()
        ticks_while_held = ticks
        pending = total - len(done)
        # Stop the busy ticker before the copies run: a loop that never sleeps holds the
        # GIL, and the workers would each wait a switch interval for it, copy by copy.
        ticker.cancel()
        hook.gate.set()
        with anyio.fail_after(60):
            await all_done.wait()
        tg.cancel_scope.cancel()
    timer.cancel()
    await engine.aclose()
    assert submitted_while_held, "a submit waited until the gate opened"
    assert pending == total  # every copy was still held when the last submit returned
    assert ticks_while_held >= 40  # the loop ran between the batches of submits
    assert hook.on_loop_thread == 0
    assert hook.calls == total
    assert len(done) == total
    assert all(t.status.value == "done" for t in done)


async def test_loop_keeps_running_while_a_copy_is_in_flight_fm10(host_factory) -> None:
    """While a copy is held in its worker and a coroutine awaits it, the loop keeps
    ticking: awaiting a task never waits on the copy synchronously."""
    layout = make_layout(layers=4, heads=4, head=64, block_size=16)  # 64 KiB blocks
    host = host_factory(layout, 128)
    kv = random_kv(layout, 128)
    expected = [gpu_block(layout, kv, layer, 5).clone() for layer in range(4)]
    hook = GatedCopy(threading.get_ident())
    engine = ThreadCopyEngine(layout, kv, host, copy_hook=hook)
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.0002)
    in_flight_ticks = 0
    awaited = anyio.Event()

    ticker = anyio.CancelScope()

    async def count_ticks() -> None:
        nonlocal in_flight_ticks
        with ticker:
            while True:
                await anyio.lowlevel.checkpoint()
                if hook.entered.is_set() and not hook.gate.is_set():
                    in_flight_ticks += 1

    timer = open_gate_later(hook.gate)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        ids = list(range(128))
        task = engine.submit(store_plan(ids, ids[::-1]))  # 8 MiB
        poller.track(task)

        async def await_copy() -> None:
            await task
            awaited.set()

        tg.start_soon(await_copy)
        tg.start_soon(count_ticks)
        while in_flight_ticks < 500 and not hook.gate.is_set():
            await anyio.lowlevel.checkpoint()
        finished_early = awaited.is_set() or task.done()
        ticks = in_flight_ticks
        ticker.cancel()  # a loop that never sleeps would starve the worker of the GIL
        hook.gate.set()
        with anyio.fail_after(60):
            await awaited.wait()
        tg.cancel_scope.cancel()
    timer.cancel()
    await engine.aclose()
    assert ticks >= 500, f"only {ticks} loop iterations ran while the copy was held"
    assert not finished_early  # the ticks all ran while the copy was provably in flight
    assert hook.calls == 1
    assert hook.on_loop_thread == 0
    assert task.status.value == "done"
    for layer in range(4):
        assert torch.equal(bits(host.block(122)[layer]), bits(expected[layer]))


async def test_concurrent_stores_and_loads_keep_progressing_fm44(host_factory) -> None:
    """Stores and loads submitted between bursts of GIL-holding Python work all complete,
    round after round: each round's copies land before the next round is submitted."""
    layout = make_layout(layers=2, heads=2, head=32, block_size=8)
    host = host_factory(layout, 64)
    engine = ThreadCopyEngine(layout, random_kv(layout, 64), host)
    count = 0

    def on_complete(task: TransferTask) -> None:
        nonlocal count
        count += 1

    poller = CompletionPoller(on_complete, poll_interval_s=0.0005)
    per_round: list[int] = []
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        i = 0
        for _round in range(10):
            for _ in range(25):
                ids = [(i + k) % 64 for k in range(8)]
                poller.track(engine.submit(store_plan(ids, ids[::-1])))
                poller.track(engine.submit(load_plan(ids[::-1], ids)))
                sum(range(2000))  # Python-side work holding the GIL
                i += 1
                await anyio.lowlevel.checkpoint()
            with anyio.fail_after(30):
                await poller.drain()
            per_round.append(count)
        tg.cancel_scope.cancel()
    await engine.aclose()
    assert per_round == [50 * (r + 1) for r in range(10)]
    assert count == 2 * i


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
