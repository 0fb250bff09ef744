"""`off.hints.prefetch()`: a prefix promoted from a tier ahead of the lookup that needs it."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import torch
from prometheus_client import CollectorRegistry
from tier_helpers import (
    BS,
    check,
    compute_and_store,
    config,
    layout,
    make_kv,
    settle,
    tier_stats,
    tokens,
)

from kvoffload.errors import InputTypeError, InvariantError
from kvoffload.groups import KVCacheGroup
from kvoffload.metrics import OffloaderCollector
from kvoffload.offloader import KVOffloader
from kvoffload.testing import CopyFaults
from kvoffload.tiers.manager import TierManager
from kvoffload.transfer.thread_engine import ThreadCopyEngine

pytestmark = pytest.mark.anyio


def disk(path: Path) -> dict[str, object]:
    return {"kind": "disk", "path": str(path), "capacity_bytes": "4MiB"}


def manager(off: KVOffloader) -> TierManager:
    assert off.tiers is not None
    return off.tiers


async def scan(off: KVOffloader, kv: list[torch.Tensor], first: int, count: int) -> None:
    """Other traffic: prompts that evict everything else from the CPU pool."""
    for i in range(count):
        await compute_and_store(off, kv, f"scan-{first + i}", tokens(first + i, 4), range(20, 24))
    await settle(off)


async def stored_then_evicted(off: KVOffloader, kv: list[torch.Tensor], prompt: list[int]) -> int:
    hashes = await compute_and_store(off, kv, "a", prompt, range(len(prompt) // BS))
    await settle(off)
    await scan(off, kv, 100, 6)
    assert not off.pool.is_cached(hashes[0])
    return len(hashes)


async def test_a_prefetch_makes_the_next_lookup_a_cpu_hit(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt = tokens(1, 3)
        n = await stored_then_evicted(off, kv, prompt)
        promoted = tier_stats(off).blocks_promoted
        assert await off.hints.prefetch(prompt) == n
        assert tier_stats(off).blocks_promoted == promoted + n
        check(off)
        assert manager(off).prefetch_blocks == 0
        # No promotion is needed now: the lookup answers at once, without deferring.
        hashes = off.hash_prompt(prompt)
        assert off.lookup("b", hashes, len(prompt), allow_defer=True) == n * BS
        assert not manager(off).is_promoting(hashes[0])
        off.finish("b")
        check(off)


async def test_the_offloader_checks_its_tier_managers_invariants(tmp_path: Path) -> None:
    """`KVOffloader.check_invariants()` checks the tier manager's bookkeeping with one
    group as with several."""
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        off.check_invariants()
        promoter = manager(off)._promoter
        promoter.prefetch_blocks = -1  # a bookkeeping breach only the manager can see
        try:
            with pytest.raises(InvariantError, match="prefetches hold -1 CPU blocks"):
                off.check_invariants()
        finally:
            promoter.prefetch_blocks = 0
        off.check_invariants()


async def test_without_tiers_a_prefetch_answers_what_is_on_cpu() -> None:
    kv = make_kv()
    async with KVOffloader(config([]), kv) as off:
        prompt = tokens(2, 3)
        assert await off.hints.prefetch(prompt) == 0
        await compute_and_store(off, kv, "a", prompt, range(3))
        assert await off.hints.prefetch(prompt) == 3
        assert await off.hints.prefetch([*prompt[: 2 * BS], -1, -2, -3, -4, 5]) == 2


async def test_a_prefetch_takes_at_most_its_share_of_the_pool(tmp_path: Path) -> None:
    kv = make_kv()
    cfg = config([disk(tmp_path / "kv.bin")], max_prefetch_fraction=0.125)  # 2 of 16
    async with KVOffloader(cfg, kv) as off:
        assert manager(off).max_prefetch_blocks == 2
        prompt = tokens(3, 5)
        await stored_then_evicted(off, kv, prompt)
        assert await off.hints.prefetch(prompt) == 2  # the part that fits
        assert manager(off).prefetch_blocks == 0
        assert await off.hints.prefetch(prompt) == 4  # the next turn takes two more
        check(off)


async def test_prefetches_in_flight_share_the_bound(tmp_path: Path) -> None:
    kv = make_kv()
    cfg = config([disk(tmp_path / "kv.bin")], max_prefetch_fraction=0.25)  # 4 of 16
    async with KVOffloader(cfg, kv) as off:
        a, b = tokens(4, 3), tokens(5, 3)
        for rid, prompt in (("a", a), ("b", b)):
            await compute_and_store(off, kv, rid, prompt, range(3))
        await settle(off)
        await scan(off, kv, 100, 6)
        tiers = manager(off)
        held: list[int] = []
        results: dict[str, int] = {}

        async def run(name: str, prompt: list[int]) -> None:
            results[name] = await off.hints.prefetch(prompt)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", a)
            tg.start_soon(run, "b", b)
            while len(results) < 2:
                held.append(tiers.prefetch_blocks)
                check(off)
                await anyio.lowlevel.checkpoint()
        assert max(held) <= 4
        assert results["a"] + results["b"] == 4  # 3 and 1, in either order
        assert tiers.prefetch_blocks == 0
        check(off)


async def test_a_cancelled_prefetch_leaks_nothing(tmp_path: Path) -> None:
    kv = make_kv()
    async with KVOffloader(config([disk(tmp_path / "kv.bin")]), kv) as off:
        prompt = tokens(6, 3)
        await stored_then_evicted(off, kv, prompt)
        tiers = manager(off)
        free = off.pool.num_free
        cached = off.pool.num_cached
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(off.hints.prefetch, prompt)
                # Cancel once the prefetch holds CPU blocks (it is reading the tier).
                while tiers.prefetch_blocks == 0:
                    await anyio.lowlevel.checkpoint()
                assert tiers.held_refs()
                scope.cancel()
        assert tiers.prefetch_blocks == 0
        assert not tiers.held_refs()
        assert off.pool.num_free == free
        # Nothing half-published: the blocks it took (evicting cached ones, like a
        # store) went back to the free queue empty.
        assert not any(off.pool.is_cached(h) for h in off.hash_prompt(prompt))
        assert off.pool.num_cached == cached - 3
        assert not off.scheduler.ledger.pending
        assert tiers.statistics().promotions_in_flight == 0
        check(off)
        # The prefix is still in the tier: a new prefetch brings it.
        assert await off.hints.prefetch(prompt) == 3


async def test_a_prefetch_never_takes_a_referenced_block(tmp_path: Path) -> None:
    kv = make_kv()
    cfg = config([disk(tmp_path / "kv.bin")], max_prefetch_fraction=1.0)
    async with KVOffloader(cfg, kv) as off:
        prompt = tokens(7, 4)
        await stored_then_evicted(off, kv, prompt)
        # A lookup pins 14 of the 16 CPU blocks for a load (a copy about to read them).
        other = tokens(8, 14)
        hashes = await compute_and_store(off, kv, "s", other, range(14))
        await settle(off)
        assert off.lookup("pin", hashes, len(other)) == 14 * BS
        pinned = [off.pool.get_cached(h) for h in hashes]
        got = await off.hints.prefetch(prompt)
        assert got == 2  # the two free blocks only
        assert [off.pool.get_cached(h) for h in hashes] == pinned
        assert all(b is not None and b.ref_cnt >= 1 for b in pinned)
        check(off)
        off.release("pin")
        off.finish("pin")
        check(off)


async def test_a_prefetch_never_takes_a_block_with_a_store_in_flight(tmp_path: Path) -> None:
    kv = make_kv()
    cfg = config([disk(tmp_path / "kv.bin")], max_prefetch_fraction=1.0)
    async with KVOffloader(cfg, kv) as off:
        prompt = tokens(9, 4)
        await stored_then_evicted(off, kv, prompt)
        engine = off._life.engines["g0"]
        assert isinstance(engine, ThreadCopyEngine)
        gate = threading.Event()
        engine._copy_hook = CopyFaults(gate=gate)  # the stores' copies wait on the gate
        try:
            hashes = off.hash_prompt(tokens(10, 14))
            off.update("s", list(range(14)), hashes, 14 * BS)
            tasks = off.store()
            pending = dict(off.scheduler.ledger.pending)
            assert len(pending) == 14  # 14 of the 16 CPU blocks have a copy in flight
            assert await off.hints.prefetch(prompt) == 2  # the two free blocks only
            assert off.scheduler.ledger.pending == pending
            assert all(b.ref_cnt >= 1 for b in pending.values())
            check(off)
        finally:
            gate.set()
        for task in tasks:
            await task
        engine._copy_hook = None
        off.finish("s")
        assert all(off.pool.is_cached(h) for h in hashes)  # every store landed
        check(off)


async def test_without_tiers_a_grouped_prefetch_answers_the_cpu_hit() -> None:
    """Several groups, no tiers: the tokens a lookup finds on CPU now, at once (the
    prefetch with tiers is tests/tiers/test_groups_prefetch.py)."""
    groups = (
        KVCacheGroup.from_layout(layout(), name="full"),
        KVCacheGroup.from_layout(layout(), name="swa", kind="sliding_window", window=9),
    )
    kv = {g.name: make_kv() for g in groups}
    async with KVOffloader(config([]), kv, groups=groups) as off:
        assert await off.hints.prefetch(tokens(1, 2)) == 0
        with pytest.raises(InputTypeError, match="token"):
            await off.hints.prefetch(["x"] * 8)  # type: ignore[list-item]


async def test_prefetch_counters_and_metrics_agree_with_a_tally(tmp_path: Path) -> None:
    kv = make_kv()
    cfg = config([disk(tmp_path / "kv.bin")], max_prefetch_fraction=0.25)  # 4 of 16
    async with KVOffloader(cfg, kv) as off:
        registry = CollectorRegistry()
        registry.register(OffloaderCollector(off.statistics))
        tiers = manager(off)
        want = {"started": 0, "completed": 0, "cancelled": 0, "promoted": 0, "bounded": 0}
        promoted_before = tier_stats(off).blocks_promoted

        a, b, c = tokens(7, 3), tokens(8, 3), tokens(9, 5)
        for rid, prompt in (("a", a), ("b", b), ("c", c)):
            await compute_and_store(off, kv, rid, prompt, range(len(prompt) // BS))
        await settle(off)
        await scan(off, kv, 100, 6)
        assert not any(off.pool.is_cached(off.hash_prompt(p)[0]) for p in (a, b, c))

        assert await off.hints.prefetch(a) == 3  # all of it comes back
        want.update(started=1, completed=1, promoted=3)
        assert await off.hints.prefetch(a) == 3  # all on CPU already: nothing started
        with anyio.CancelScope() as scope:  # b: cancelled while it reads
            async with anyio.create_task_group() as tg:
                tg.start_soon(off.hints.prefetch, b)
                while tiers.prefetch_blocks == 0:
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
        want.update(started=2, cancelled=1)
        assert await off.hints.prefetch(c) == 4  # the bound lets 4 of its 5 blocks in
        want.update(started=3, completed=2, promoted=7, bounded=1)
        check(off)

        stats = tiers.statistics()
        got = {
            "started": stats.prefetches,
            "completed": stats.prefetches_completed,
            "cancelled": stats.prefetches_cancelled,
            "promoted": stats.prefetch_blocks_promoted,
            "bounded": stats.prefetches_bounded,
        }
        assert got == want
        assert tier_stats(off).blocks_promoted - promoted_before == want["promoted"]
        for name, key in (
            ("prefetches", "started"),
            ("prefetches_completed", "completed"),
            ("prefetches_cancelled", "cancelled"),
            ("prefetch_promoted_blocks", "promoted"),
            ("prefetches_bounded", "bounded"),
        ):
            value = registry.get_sample_value(f"kvoffload_tiers_{name}_total")
            assert value == want[key], name
