"""Helpers shared by the scheduler tests: prompts, hashes and a simulated KV store.

``SimKV`` plays the engine's GPU memory and the CPU pool's memory as dicts whose values
are the block hash each block's KV was computed for; executing a plan copies those values,
so a test can assert that a load delivered exactly the KV the request needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.config import OffloadConfig
from kvoffload.hashing import BlockHash, HashNamespace, hash_prompt
from kvoffload.pool import CpuBlockPool
from kvoffload.pool.priority import default_max_retained
from kvoffload.scheduler import OffloadScheduler
from kvoffload.transfer.plan import TransferPlan

BS = 4
NS = HashNamespace(model_id="test-model", dtype="float16", layout="test")


def tokens(seed: int, num_blocks: int, extra: int = 0) -> list[int]:
    """A prompt of ``num_blocks`` full blocks (+ ``extra`` tokens) unique to ``seed``."""
    return [seed * 100_000 + i for i in range(num_blocks * BS + extra)]


def hashes(toks: Sequence[int]) -> list[BlockHash]:
    return hash_prompt(toks, BS, NS)


def make(
    num_blocks: int = 16, *, num_gpu_blocks: int | None = None, **overrides: object
) -> OffloadScheduler:
    config = OffloadConfig(block_size=BS, num_cpu_blocks=num_blocks, **overrides)  # type: ignore[arg-type]
    pool = CpuBlockPool(
        num_blocks,
        max_retained_blocks=default_max_retained(num_blocks, config.max_retained_fraction),
    )
    return OffloadScheduler(config, pool, bytes_per_block=100, num_gpu_blocks=num_gpu_blocks)


@dataclass
class SimKV:
    """GPU and CPU block contents: the hash whose KV each block holds."""

    gpu: dict[int, BlockHash | None] = field(default_factory=dict)
    cpu: dict[int, BlockHash | None] = field(default_factory=dict)

    def compute(self, gpu_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        for gid, h in zip(gpu_ids, block_hashes, strict=False):
            self.gpu[gid] = h

    def execute(self, plan: TransferPlan) -> None:
        for gid, cid in zip(plan.gpu_block_ids, plan.cpu_block_ids, strict=True):
            if plan.kind == "store":
                self.cpu[cid] = self.gpu.get(gid)
            else:
                self.gpu[gid] = self.cpu.get(cid)


def run_request(
    sched: OffloadScheduler,
    rid: str,
    toks: Sequence[int],
    gpu_ids: Sequence[int],
    sim: SimKV | None = None,
    *,
    finish: bool = True,
) -> TransferPlan | None:
    """Compute a whole prompt, store it, complete the store and (by default) finish."""
    hs = hashes(toks)
    if sim is not None:
        sim.compute(gpu_ids, hs)
    sched.update(rid, gpu_ids, hs, len(toks))
    plan = sched.plan_stores()
    if plan is not None:
        if sim is not None:
            sim.execute(plan)
        sched.complete(plan, ok=True)
    if finish:
        sched.finish(rid)
    sched.check_invariants()
    return plan
