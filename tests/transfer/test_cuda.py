"""The same scenarios on a real GPU (skipped without one)."""

from __future__ import annotations

import random

import anyio
import pytest
import torch
from transfer_helpers import bits, gpu_block, load_plan, make_layout, random_kv, store_plan

from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.transfer import CompletionPoller, CudaCopyEngine, TransferTask

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def cuda_kv(layout, n: int, seed: int = 0) -> list[torch.Tensor]:
    return [t.cuda() for t in random_kv(layout, n, seed)]


async def run(engine: CudaCopyEngine, *plans_and_after) -> list[TransferTask]:
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.0002)
    tasks = []
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        for plan, after in plans_and_after:
            task = engine.submit(plan, after=after)
            poller.track(task)
            with anyio.fail_after(60):
                await task
            tasks.append(task)
        tg.cancel_scope.cancel()
    return tasks


@pytest.mark.parametrize("kind", ["blocks_first", "kv_first"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 7, 64, 512])
async def test_cuda_round_trip_is_bit_exact(kind, dtype, n) -> None:
    layout = make_layout(kind=kind, dtype=dtype, layers=4, heads=2, head=64, block_size=16)
    kv = cuda_kv(layout, 600, seed=n)
    original = [t.clone() for t in kv]
    host = HostKVBuffer(layout, 600, pin_memory="always")
    engine = CudaCopyEngine(layout, kv, host, staging_bytes=100 * layout.bytes_per_block)
    rng = random.Random(n)
    g, c, g2 = rng.sample(range(600), n), rng.sample(range(600), n), rng.sample(range(600), n)
    await run(engine, (store_plan(g, c), None))
    for t in kv:
        t.zero_()
    task = engine.submit(load_plan(g2, c))
    task.wait_on(torch.cuda.current_stream())
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.0002)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        await task
        tg.cancel_scope.cancel()
    for layer in range(layout.num_layers):
        for a, b in zip(g, g2, strict=True):
            assert torch.equal(
                bits(gpu_block(layout, kv, layer, b)).cpu(),
                bits(gpu_block(layout, original, layer, a)).cpu(),
            )
    await engine.aclose()
    host.close()


async def test_store_is_ordered_after_a_slow_producer_fm01() -> None:
    layout = make_layout(layers=2, heads=2, head=64, block_size=16)
    kv = cuda_kv(layout, 8)
    host = HostKVBuffer(layout, 8, pin_memory="always")
    engine = CudaCopyEngine(layout, kv, host)
    torch.cuda._sleep(200_000_000)  # stall the compute stream (~0.1 s)
    for t in kv:
        t[3].fill_(42.0)
    await run(engine, (store_plan([3], [5]), None))
    assert bool((host.block(5) == 42.0).all())
    await engine.aclose()
    host.close()


async def test_load_is_not_wiped_by_queued_zeroing_fm03() -> None:
    layout = make_layout(layers=2, heads=2, head=64, block_size=16)
    kv = cuda_kv(layout, 8)
    host = HostKVBuffer(layout, 8, pin_memory="always")
    host.blocks[1].fill_(9.0)
    engine = CudaCopyEngine(layout, kv, host)
    torch.cuda._sleep(200_000_000)
    for t in kv:
        t[4].zero_()  # deferred zeroing queued on compute before the load
    task = engine.submit(load_plan([4], [1]))
    task.wait_on(torch.cuda.current_stream())
    poller = CompletionPoller(lambda t: None, poll_interval_s=0.0002)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        poller.track(task)
        await task
        tg.cancel_scope.cancel()
    for t in kv:
        assert bool((t[4] == 9.0).all())
    await engine.aclose()
    host.close()


async def test_aclose_waits_for_in_flight_store_fm04() -> None:
    layout = make_layout(layers=2, heads=2, head=64, block_size=16)
    kv = cuda_kv(layout, 8)
    host = HostKVBuffer(layout, 8, pin_memory="always")
    engine = CudaCopyEngine(layout, kv, host)
    torch.cuda._sleep(200_000_000)
    for t in kv:
        t[2].fill_(3.0)
    task = engine.submit(store_plan([2], [2]))
    await engine.aclose()
    assert task._completion is not None
    assert task._completion.query()
    assert bool((host.block(2) == 3.0).all())
    host.close()
    assert float(torch.ones(1, device="cuda").sum()) == 1.0  # the context is healthy
