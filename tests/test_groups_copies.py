"""Grouped plans through the real copy engines: one `ThreadCopyEngine` and host buffer per
group (CPU tensors, each group with its own page), bytes exact for every group on load."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHasher
from kvoffload.layout import KVLayout
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler.groups import GroupedPlan, GroupedScheduler
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.transfer import CompletionPoller, ThreadCopyEngine

pytestmark = pytest.mark.anyio

NUM_GPU = 32
LAYOUTS = {
    "attn": KVLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32", block_size=4),
    "win": KVLayout(num_layers=3, num_kv_heads=2, head_size=2, dtype="bfloat16", block_size=4),
}
GROUPS = (
    KVCacheGroup.from_layout(LAYOUTS["attn"], name="attn"),
    KVCacheGroup.from_layout(LAYOUTS["win"], name="win", kind="sliding_window", window=9),
)


def value(group: int, layer: int, pos: int) -> float:
    return float(group * 100 + layer * 10 + pos)


def fill(kv: dict[str, list[torch.Tensor]], tables: dict[str, list[int | None]]) -> None:
    for gi, g in enumerate(GROUPS):
        for pos, b in enumerate(tables[g.name]):
            if b is not None:
                for layer, t in enumerate(kv[g.name]):
                    t[b].fill_(value(gi, layer, pos))


def hashes(n: int) -> dict[str, list[bytes]]:
    out = {}
    for g in GROUPS:
        h = BlockHasher(g.namespace().root, g.block_size)
        h.extend(list(range(n)))
        out[g.name] = list(h.block_hashes)
    return out


async def test_grouped_plans_round_trip_bytes_exact_through_thread_engines() -> None:
    pools = {g.name: CpuBlockPool(16) for g in GROUPS}
    sched = GroupedScheduler(
        GROUPS, pools, checkpoint_tokens=16, num_gpu_blocks=dict.fromkeys(LAYOUTS, NUM_GPU)
    )
    kv = {
        name: [
            torch.zeros(lay.tensor_shape(NUM_GPU), dtype=lay.torch_dtype)
            for _ in range(lay.num_layers)
        ]
        for name, lay in LAYOUTS.items()
    }
    hosts = {name: HostKVBuffer(lay, 16, pin_memory="never") for name, lay in LAYOUTS.items()}
    engines = {n: ThreadCopyEngine(LAYOUTS[n], kv[n], hosts[n]) for n in LAYOUTS}
    copied = dict.fromkeys(LAYOUTS, 0)
    poller = CompletionPoller(lambda task: None, poll_interval_s=0.0005)

    async def run(plan: GroupedPlan | None) -> None:
        if plan is None:
            return
        for name, sub in plan.plans.items():
            task = engines[name].submit(sub)
            poller.track(task)
            result = await task
            copied[name] += result.num_blocks
            sched.complete(name, sub, True)

    try:
        async with anyio.create_task_group() as tg:
            await tg.start(poller.run)
            tables: dict[str, list[int | None]] = {n: list(range(8)) for n in LAYOUTS}
            fill(kv, tables)
            sched.update("a", tables, hashes(32), 32)
            await run(sched.plan_stores())  # points 16 and 32
            assert sched.finish("a") is None  # nothing left: the final point is 32
            assert copied == {"attn": 8, "win": 4}  # the window group: blocks 2, 3, 6, 7
            for tensors in kv.values():
                for t in tensors:
                    t.zero_()
            fresh: dict[str, list[int | None]] = {n: list(range(10, 18)) for n in LAYOUTS}
            assert sched.lookup("b", hashes(33), 33) == 32
            await run(sched.plan_load("b", fresh, 32))
            assert copied == {"attn": 16, "win": 6}  # loads blocks 6 and 7 of the window
            loaded = {"attn": range(8), "win": range(6, 8)}
            for gi, g in enumerate(GROUPS):
                for pos in range(8):
                    for layer, t in enumerate(kv[g.name]):
                        block = t[fresh[g.name][pos]]
                        want = value(gi, layer, pos) if pos in loaded[g.name] else 0.0
                        assert bool((block == want).all()), (g.name, layer, pos)
            sched.check_invariants()
            tg.cancel_scope.cancel()
    finally:
        for engine in engines.values():
            await engine.aclose()
        for host in hosts.values():
            host.close()
