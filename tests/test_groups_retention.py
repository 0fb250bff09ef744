"""Retention with several KV cache groups (full + sliding window, full + recurrent state),
through real `ThreadCopyEngine`s: a retained prefix (``retain_prefix()``, a session hint)
survives a scan that evicts everything else, for as long as its hint and not longer, and
is then a CPU hit of the same length, bytes exact; a request's priority keeps its blocks
in every group; ``max_retained_fraction`` bounds each group's pool. The hint clock is
driven by hand (no test sleeps)."""

from __future__ import annotations

import pytest

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import InvalidInputError
from kvoffload.groups import needed
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.priority import default_max_retained
from tests.test_offloader_groups import BS, Model, Tables, groups_of, serve

pytestmark = pytest.mark.anyio

KINDS = ["sliding", "recurrent"]
CONTEXT = list(range(1, 19))  # 18 tokens: store points 8 and 16; a hit of 16
HELD = {"sliding": 4 + 2, "recurrent": 4 + 1}  # needed(g, 16): 4 full blocks + window/state


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def offloader(model: Model, num_cpu: int = 16, fraction: float = 0.5) -> KVOffloader:
    cfg = OffloadConfig(
        num_cpu_blocks=num_cpu, block_size=BS, checkpoint_tokens=8, max_retained_fraction=fraction
    )
    return KVOffloader(cfg, model.kv, groups=model.groups)


def pools(off: KVOffloader) -> dict[str, CpuBlockPool]:
    groups = off._life.front
    assert groups is not None
    return {n: groups.scheduler.ledger(n).pool for n in groups.scheduler.statistics()}


async def turn(off: KVOffloader, model: Model, rid: str, tokens: list[int]) -> int:
    """One request with fresh GPU blocks and wiped GPU tensors; its hit (bytes checked)."""
    model.wipe()
    alloc = Tables(model)
    hit, _ = await serve(off, model, alloc, rid, tokens)
    off.check_invariants()
    return hit


async def scan(off: KVOffloader, model: Model, first: int) -> None:
    """Distinct conversations that fill every group's pool several times over."""
    for seed in range(first, first + 6):
        await turn(off, model, f"scan{seed}", [seed * 1000 + i for i in range(18)])


@pytest.mark.parametrize("kind", KINDS)
async def test_a_retained_prefix_survives_a_scan_and_is_the_same_hit_bytes_exact(
    kind: str,
) -> None:
    model = Model(groups_of(kind))
    async with offloader(model) as off:
        await turn(off, model, "a", CONTEXT)
        await turn(off, model, "other", [7000 + i for i in range(18)])  # not retained
        assert off.retain_prefix(CONTEXT, owner="sys") == HELD[kind]
        for name, pool in pools(off).items():  # exactly what a hit at 16 needs
            g = next(g for g in model.groups if g.name == name)
            assert pool.num_retained == len(needed(g, 16))
        await scan(off, model, 10)
        assert await turn(off, model, "other2", [7000 + i for i in range(18)] + [1]) == 0
        assert await turn(off, model, "b", [*CONTEXT, 50, 51]) == 16  # bytes checked
        assert off.release_retained("sys") == HELD[kind]
        assert all(p.num_retained == 0 for p in pools(off).values())
        await scan(off, model, 20)
        assert await turn(off, model, "c", [*CONTEXT, 60, 61]) == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_hinted_prefix_survives_for_as_long_as_its_hint_and_not_longer(kind: str) -> None:
    model = Model(groups_of(kind))
    clock = Clock()
    async with offloader(model) as off:
        off.hints.clock = clock
        alloc = Tables(model)
        with off.request("turn1", CONTEXT) as req:  # the hint given at finish
            req.lookup()
            tables = alloc.new(req.blocks_for(len(CONTEXT)))
            model.fill(tables, CONTEXT)
            req.advance(tables, len(CONTEXT))
            off.store()
            await off.drain()
            req.finish(retain_for_s=30.0, session="agent")
        assert off.hints.sessions == ("agent",)
        assert sum(p.num_retained for p in pools(off).values()) == HELD[kind]
        clock.now += 29.0  # the tool call runs; other traffic scans every pool
        await scan(off, model, 10)
        assert await turn(off, model, "turn2", [*CONTEXT, 50, 51]) == 16
        clock.now += 1.0  # the deadline: the hint ends at the next store()
        await scan(off, model, 20)
        assert off.hints.sessions == ()
        assert all(p.num_retained == 0 for p in pools(off).values())
        assert await turn(off, model, "turn3", [*CONTEXT, 60, 61]) == 0
        # the same through SessionHints.retain_for(), ended early by release()
        await turn(off, model, "turn4", CONTEXT)
        assert off.hints.retain_for(CONTEXT, 60, session="s") == HELD[kind]
        assert off.hints.release("s") == HELD[kind]
        assert off.hints.release("s") == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_hint_stored_later_is_retained_at_a_later_store(kind: str) -> None:
    model = Model(groups_of(kind))
    async with offloader(model) as off:
        assert off.hints.retain_for(CONTEXT, 60, session="s") == 0  # nothing stored yet
        await turn(off, model, "a", CONTEXT)  # stores it; the next store() retains it
        off.store()
        assert sum(p.num_retained for p in pools(off).values()) == HELD[kind]
        await scan(off, model, 10)
        assert await turn(off, model, "b", [*CONTEXT, 50]) == 16


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prioritized", [True, False])
async def test_a_high_priority_requests_blocks_outlive_a_low_ones_in_every_group(
    kind: str, prioritized: bool
) -> None:
    model = Model(groups_of(kind))
    hi, lo = list(range(1, 19)), list(range(501, 519))
    async with offloader(model, num_cpu=8) as off:
        for rid, tokens, priority in (("hi", hi, 5 if prioritized else 0), ("lo", lo, 0)):
            alloc = Tables(model)
            with off.request(rid, tokens, priority=priority) as req:
                req.lookup()
                tables = alloc.new(req.blocks_for(len(tokens)))
                model.fill(tables, tokens)
                req.advance(tables, len(tokens))
                off.store()
                await off.drain()
        await scan(off, model, 10)  # LRU alone evicts hi first: it is the oldest
        groups = off._life.front
        assert groups is not None
        for g in model.groups:
            pool = pools(off)[g.name]
            for tokens, kept in ((hi, prioritized), (lo, False)):
                hashes = groups.hash_prompt(tokens)[g.name]
                cached = [pool.is_cached(hashes[i]) for i in needed(g, 16)]
                assert cached == [kept] * len(cached), (g.name, tokens[0])
            pool.check_invariants()
        assert await turn(off, model, "hi2", [*hi, 9]) == (16 if prioritized else 0)


@pytest.mark.parametrize("kind", KINDS)
async def test_max_retained_fraction_bounds_each_groups_pool(kind: str) -> None:
    model = Model(groups_of(kind))
    long = list(range(1, 27))  # 26 tokens: a hit of 24 needs 6 full blocks
    async with offloader(model, num_cpu=16, fraction=0.25) as off:  # 4 blocks per pool
        for pool in pools(off).values():
            assert pool.max_retained_blocks == default_max_retained(16, 0.25) == 4
        await turn(off, model, "a", long)
        with pytest.raises(InvalidInputError, match=r"'sys'.*group 'full' needs 6 blocks.*=4"):
            off.retain_prefix(long, owner="sys")
        assert all(p.num_retained == 0 for p in pools(off).values())  # nothing, anywhere
        # a hint is cut to the longest hit every pool can hold: 16 tokens here
        assert off.hints.retain_for(long, 60, session="s") == HELD[kind]
        for pool in pools(off).values():
            assert pool.num_retained <= pool.max_retained_blocks
        await scan(off, model, 10)
        assert await turn(off, model, "b", [*long, 5]) == 16
        off.check_invariants()
