"""Round trips GPU -> CPU -> GPU are bit-exact for every layout kind, dtype and batch size."""

from __future__ import annotations

import random

import anyio
import pytest
import torch
from transfer_helpers import bits, gpu_block, load_plan, make_layout, random_kv, store_plan

from kvoffload.transfer import CompletionPoller, ThreadCopyEngine, TransferStatus, TransferTask

pytestmark = pytest.mark.anyio

NUM_GPU = 600
NUM_CPU = 560


@pytest.mark.parametrize("kind", ["blocks_first", "kv_first"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("strategy", ["segments", "staged"])
@pytest.mark.parametrize("n", [1, 5, 64, 512])
async def test_round_trip_is_bit_exact(kind, dtype, strategy, n, host_factory) -> None:
    layout = make_layout(kind=kind, dtype=dtype, layers=2, heads=1, head=4, block_size=2)
    original = random_kv(layout, NUM_GPU, seed=n)
    gpu_kv = [t.clone() for t in original]
    host = host_factory(layout, NUM_CPU)
    host.raw.fill_(0xAB)
    rng = random.Random(n)
    g_src = rng.sample(range(NUM_GPU), n)
    c_ids = rng.sample(range(NUM_CPU), n)
    if n > 4:  # include a run of consecutive CPU ids, and an untouched sentinel
        c_ids[:3] = [NUM_CPU - 3, NUM_CPU - 2, NUM_CPU - 1]
        c_ids = list(dict.fromkeys(c_ids))
        while len(c_ids) < n:
            extra = rng.randrange(NUM_CPU)
            if extra not in c_ids:
                c_ids.append(extra)
    g_dst = rng.sample(range(NUM_GPU), n)
    completed: list[TransferTask] = []
    poller = CompletionPoller(completed.append, poll_interval_s=0.0005)
    engine = ThreadCopyEngine(layout, gpu_kv, host, strategy=strategy, staging_blocks=48)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        store = engine.submit(store_plan(g_src, c_ids))
        poller.track(store)
        result = await store
        assert result.num_blocks == n
        assert result.nbytes == n * layout.bytes_per_block
        # The host holds each block as [layers, 2, bs, h, d].
        for g, c in zip(g_src, c_ids, strict=True):
            for layer in range(layout.num_layers):
                assert torch.equal(
                    bits(host.block(c)[layer]), bits(gpu_block(layout, original, layer, g))
                )
        untouched = [c for c in range(NUM_CPU) if c not in set(c_ids)][:3]
        for c in untouched:
            assert bool((host.block_bytes(c) == 0xAB).all())
        for t in gpu_kv:
            t.zero_()
        load = engine.submit(load_plan(g_dst, c_ids))
        poller.track(load)
        await load
        await engine.aclose()
        tg.cancel_scope.cancel()
    dst_set = set(g_dst)
    for layer in range(layout.num_layers):
        for g_old, g_new in zip(g_src, g_dst, strict=True):
            assert torch.equal(
                bits(gpu_block(layout, gpu_kv, layer, g_new)),
                bits(gpu_block(layout, original, layer, g_old)),
            )
        other = next(b for b in range(NUM_GPU) if b not in dst_set)
        assert bool((bits(gpu_block(layout, gpu_kv, layer, other)) == 0).all())
    assert [t.status for t in completed] == [TransferStatus.DONE, TransferStatus.DONE]


async def test_empty_plan_completes(host_factory) -> None:
    layout = make_layout()
    host = host_factory(layout, 4)
    engine = ThreadCopyEngine(layout, random_kv(layout, 4), host)
    seen: list[TransferTask] = []
    poller = CompletionPoller(seen.append, poll_interval_s=0.001)
    async with anyio.create_task_group() as tg:
        await tg.start(poller.run)
        task = engine.submit(store_plan([], []))
        poller.track(task)
        result = await task
        tg.cancel_scope.cancel()
    await engine.aclose()
    assert (result.num_blocks, result.nbytes) == (0, 0)
    assert seen == [task]
