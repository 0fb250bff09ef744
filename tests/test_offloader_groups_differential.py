"""One full-attention group through a plain `KVOffloader` and two full-attention groups of
the same geometry through a multi-group `KVOffloader`, driven through the request handles
with one seeded workload (shared prefixes, retention priorities, lookups that defer or
not, loads, stores each step, finishes, preemptions, a pool small enough to evict and
defer): every lookup gives the same answer, request by request, and each group counts
what the one group counts. Every copy of a step is held in flight until the step's calls
are made (both offloaders see the same transfers in flight), then all complete in the
order they were submitted (`ControllableCopyEngine`: thread timing decides nothing)."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import torch

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import TransferError
from kvoffload.groups import KVCacheGroup
from kvoffload.request import OffloadRequest
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import ControllableCopyEngine
from tests.test_offloader_groups import ATTN, BS

NUM_GPU = 96
CPU_BLOCKS = 6
COUNTERS = ("stored_blocks", "loaded_blocks", "deferred_blocks", "store_plans", "load_plans")


@dataclass
class Req:
    tokens: list[int]
    prompt: int
    one: OffloadRequest
    two: OffloadRequest
    table: list[int] = field(default_factory=list)
    computed: int = 0
    waiting: bool = True


class Pair:
    """The two offloaders, each with copy engines whose copies end when the test says."""

    def __init__(self) -> None:
        self.hosts: list[HostKVBuffer] = []
        kv = [torch.zeros(ATTN.tensor_shape(NUM_GPU)) for _ in range(ATTN.num_layers)]
        self.engine = self._eng(kv)
        self.one = KVOffloader(
            OffloadConfig(num_cpu_blocks=CPU_BLOCKS, block_size=BS), kv, copy_engine=self.engine
        )
        groups = [KVCacheGroup.from_layout(ATTN, name=n) for n in ("a", "b")]
        kvs = {g.name: [torch.zeros(ATTN.tensor_shape(NUM_GPU)) for _ in range(2)] for g in groups}
        self.engines = {n: self._eng(t) for n, t in kvs.items()}
        self.two = KVOffloader(
            OffloadConfig(num_cpu_blocks=CPU_BLOCKS, block_size=BS),
            kvs,
            groups=groups,
            copy_engine=dict(self.engines),
        )

    def _eng(self, kv: list[torch.Tensor]) -> ControllableCopyEngine:
        host = HostKVBuffer(ATTN, CPU_BLOCKS, pin_memory="never")
        self.hosts.append(host)
        return ControllableCopyEngine(layout=ATTN, gpu_kv=kv, host=host)

    def complete_all(self) -> None:
        """End every copy in flight, each engine's in submission order."""
        for engine in (self.engine, *self.engines.values()):
            for task in list(engine.pending):
                engine.complete(task)


async def _wait(task: Any) -> None:
    if task is not None:
        with contextlib.suppress(TransferError):
            await task


async def run(seed: int, steps: int = 40) -> tuple[list[object], Any]:
    pair = Pair()
    try:
        return await _run(pair, seed, steps)
    finally:
        for host in pair.hosts:
            host.close()


async def _run(pair: Pair, seed: int, steps: int) -> tuple[list[object], Any]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((8, 12, 16)))] for _ in range(3)]
    free = list(range(NUM_GPU))
    reqs: dict[str, Req] = {}
    log: list[object] = []
    async with pair.one as one, pair.two as two:
        one.scheduler.clock = lambda: 0.0  # deferral bounds by time: one clock
        assert two._life.front is not None
        two._life.front.scheduler.clock = lambda: 0.0
        try:
            for step in range(steps):
                loads: list[Any] = []
                if len(reqs) < 4 and rng.random() < 0.6:
                    prefix = rng.choice(prefixes) if rng.random() < 0.8 else []
                    prompt = prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
                    tokens = prompt + [rng.randrange(1000) for _ in range(rng.randrange(0, 10))]
                    rid, priority = f"r{step}", rng.choice((0, 0, 3))
                    reqs[rid] = Req(
                        tokens,
                        len(prompt),
                        one.request(rid, prompt, priority=priority),
                        two.request(rid, prompt, priority=priority),
                    )
                for rid, r in list(reqs.items()):
                    if r.waiting:
                        defer = rng.random() < 0.5
                        hit = r.one.lookup(allow_defer=defer)
                        ghit = r.two.lookup(allow_defer=defer)
                        assert hit == ghit, (seed, step, rid, hit, ghit)
                        log.append((rid, hit))
                        if hit is None:
                            continue
                        r.waiting = False
                        need = -(-len(r.tokens) // BS)
                        r.table, free[:] = free[:need], free[need:]
                        if hit and rng.random() < 0.8:
                            loads.append(r.one.load(r.table))
                            loads.append(r.two.load({"a": r.table, "b": r.table}))
                            r.computed = hit
                        elif hit:
                            r.one.release()
                            r.two.release()
                        continue
                    if r.computed < len(r.tokens):
                        if r.one.num_tokens < len(r.tokens):
                            more = r.tokens[r.one.num_tokens :]
                            r.one.extend(more)
                            r.two.extend(more)
                        r.computed = min(len(r.tokens), r.computed + rng.randrange(1, 9))
                        r.one.advance(r.table, r.computed)
                        r.two.advance({"a": r.table, "b": r.table}, r.computed)
                one.store()
                two.store()
                for rid, r in list(reqs.items()):
                    if r.waiting:
                        continue
                    x = rng.random()
                    if r.computed >= len(r.tokens) or x < 0.05:
                        r.one.finish()
                        r.two.finish()
                        free.extend(r.table)
                        del reqs[rid]
                    elif x > 0.95:
                        r.one.preempt()
                        r.two.preempt()
                        free.extend(r.table)
                        r.table, r.computed, r.waiting = [], 0, True
                pair.complete_all()
                await one.drain()
                await two.drain()
                for task in loads:
                    await _wait(task)
                one.check_invariants()
                two.check_invariants()
            for r in reqs.values():
                r.one.finish()
                r.two.finish()
            pair.complete_all()
            await one.drain()
            await two.drain()
            want = one.statistics().scheduler
            groups = two.statistics().groups
            assert groups is not None
            for n in ("a", "b"):
                for name in COUNTERS:
                    assert getattr(groups[n], name) == getattr(want, name), (seed, n, name)
            return log, want
        finally:
            pair.complete_all()  # a failed check: the copies end before the offloaders close


@pytest.mark.parametrize("seed", range(24))
def test_two_full_groups_answer_as_one_through_the_handles(seed: int) -> None:
    anyio.run(run, seed)


def test_the_workload_hits_defers_and_evicts() -> None:
    """The workload reaches what it compares: hits, "ask again" answers, deferred stores."""
    hits = asks = deferred = 0
    for seed in range(6):
        log, stats = anyio.run(run, seed)
        hits += sum(1 for _, hit in log if hit)  # type: ignore[misc]
        asks += sum(1 for _, hit in log if hit is None)  # type: ignore[misc]
        deferred += stats.deferred_blocks
    assert hits
    assert asks
    assert deferred
