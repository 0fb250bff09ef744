"""Retention priorities through the scheduler and the offloader, and retained prefixes.

A request's priority reaches the blocks stored for it and the hits its lookups pin (a
block shared by several requests keeps the highest), so eviction takes lower priorities
first; `KVOffloader.retain_prefix()` keeps a system prompt through a scan that evicts
everything else, within ``max_retained_fraction``; and a retained block or one with a
copy in flight is never evicted: a store that finds no free block is deferred.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from scheduler_helpers import BS, hashes, make, run_request, tokens

from kvoffload import (
    ConfigError,
    InputTypeError,
    InvalidInputError,
    KVLayout,
    KVOffloader,
    OffloadConfig,
    RequestStateError,
)
from kvoffload.scheduler import OffloadScheduler
from kvoffload.transfer.thread_engine import ThreadCopyEngine

pytestmark = pytest.mark.anyio

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=4, dtype="float32", block_size=BS)
GPU_BLOCKS = 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_kv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(LAYOUT.tensor_shape(GPU_BLOCKS), generator=gen) for _ in range(2)]


def offloader(**overrides: object) -> KVOffloader:
    config = OffloadConfig(block_size=BS, num_cpu_blocks=16, model_id="m", **overrides)  # type: ignore[arg-type]
    return KVOffloader(config, make_kv())


async def compute_and_store(off: KVOffloader, rid: str, prompt: Sequence[int]) -> int:
    """One request through the handle: look up, compute the rest, store; its hit."""
    with off.request(rid, prompt) as req:
        hit = req.lookup()
        table = list(range(req.blocks_for(req.num_tokens)))
        if hit and (task := req.load(table)) is not None:
            await task
        req.advance(table, req.num_tokens)
        off.store()
        await off.drain()
    off.scheduler.check_invariants()
    return hit


def cached(sched: OffloadScheduler, toks: Sequence[int]) -> list[bool]:
    return [sched.pool.is_cached(h) for h in hashes(toks)]


# -- retained prefixes through the offloader ----------------------------------------------


@pytest.mark.parametrize("retain", [True, False])
async def test_a_retained_prefix_survives_a_scan_that_evicts_everything_else(
    retain: bool,
) -> None:
    system = tokens(1, 3)
    async with offloader(max_retained_fraction=0.25) as off:
        assert isinstance(off._life.engines["g0"], ThreadCopyEngine)
        await compute_and_store(off, "sys", [*system, 7])
        if retain:
            assert off.retain_prefix(system, owner="system-prompt") == 3
            assert off.pool.num_retained == 3
        for seed in range(10, 20):  # 40 distinct blocks through a pool of 16
            await compute_and_store(off, f"scan{seed}", tokens(seed, 4, 1))
        hit = await compute_and_store(off, "user", [*system, *tokens(99, 1, 1)])
        assert hit == (3 * BS if retain else 0)
        if retain:
            assert off.release_retained("system-prompt") == 3
            assert off.pool.num_retained == 0
            for seed in range(20, 24):  # once released, it is evicted like any block
                await compute_and_store(off, f"scan{seed}", tokens(seed, 4, 1))
            assert await compute_and_store(off, "late", [*system, 7]) == 0
        off.scheduler.check_invariants()


async def test_retain_prefix_counts_the_stored_leading_run_only() -> None:
    async with offloader(max_retained_fraction=0.5) as off:
        assert off.retain_prefix(tokens(1, 3), owner="sys") == 0  # nothing stored yet
        assert off.pool.retained_owners == ()
        await compute_and_store(off, "a", [*tokens(1, 2), 7])  # the first two blocks
        assert off.retain_prefix(tokens(1, 3), owner="sys") == 2
        await compute_and_store(off, "b", [*tokens(1, 3), 7])
        assert off.retain_prefix(tokens(1, 3), owner="sys") == 3  # the new block added
        assert off.pool.num_retained == 3
        assert off.release_retained("sys") == 3
        with pytest.raises(InvalidInputError, match="'sys' retains no block"):
            off.release_retained("sys")
        off.scheduler.check_invariants()


async def test_the_retention_bound_is_enforced() -> None:
    async with offloader(max_retained_fraction=0.25) as off:  # 16 blocks: at most 4
        assert off.pool.max_retained_blocks == 4
        await compute_and_store(off, "a", [*tokens(1, 3), 7])
        await compute_and_store(off, "b", [*tokens(2, 3), 7])
        assert off.retain_prefix(tokens(1, 3), owner="one") == 3
        with pytest.raises(InvalidInputError, match=r"max_retained_blocks=4 \(3 held, 3 more"):
            off.retain_prefix(tokens(2, 3), owner="two")
        assert off.pool.num_retained == 3
        assert off.pool.retained_owners == ("one",)
        assert off.retain_prefix(tokens(2, 1), owner="two") == 1  # what fits is taken
        off.scheduler.check_invariants()
        off.release_retained("one")
        off.release_retained("two")


BAD_RETAIN = {
    "owner=[1]": (lambda t: {"token_ids": t, "owner": [1]}, r"owner=\[1\] must be hashable"),
    "owner={}": (lambda t: {"token_ids": t, "owner": {}}, r"owner=\{\} must be hashable"),
    "token_ids=None": (
        lambda t: {"token_ids": None, "owner": "o"},
        r"token_ids=None must be a sequence of token ids",
    ),
    "a float tensor": (
        lambda t: {"token_ids": torch.empty(len(t)), "owner": "o"},
        r"token_ids\[0\]=tensor\(.*\) is not a 64-bit int",
    ),
    "a string": (lambda t: {"token_ids": "abcd" * 3, "owner": "o"}, r"token_ids='abcd"),
}


@pytest.mark.parametrize("case", sorted(BAD_RETAIN))
async def test_a_bad_retain_argument_names_it_and_retains_nothing(case: str) -> None:
    """Each raised a bare TypeError or RuntimeError ("Boolean value of Tensor with no
    values is ambiguous"); now an InputTypeError naming the argument and the value."""
    async with offloader(max_retained_fraction=0.5) as off:
        await compute_and_store(off, "a", [*tokens(1, 3), 7])
        assert off.retain_prefix(tokens(1, 3), owner="sys") == 3  # an owner to hash against
        kwargs, message = BAD_RETAIN[case]
        with pytest.raises(InputTypeError, match=message):
            off.retain_prefix(**kwargs(tokens(1, 3)))
        assert off.pool.num_retained == 3
        assert off.pool.retained_owners == ("sys",)
        if case.startswith("owner"):
            with pytest.raises(InputTypeError, match="must be hashable"):
                off.release_retained(kwargs([])["owner"])
        assert off.release_retained("sys") == 3
        off.scheduler.check_invariants()


async def test_a_prompt_as_an_int_tensor_or_array_retains_as_a_list_does() -> None:
    """A tensor of token ids whose length is whole blocks raised RuntimeError in the
    hasher (``if rest:`` on an empty tensor)."""
    async with offloader(max_retained_fraction=0.5) as off:
        await compute_and_store(off, "a", [*tokens(1, 3), 7])
        assert off.retain_prefix(torch.tensor(tokens(1, 3)), owner="t") == 3
        assert off.retain_prefix(torch.tensor(tokens(1, 2, extra=1)), owner="u") == 2
        assert off.retain_prefix(torch.empty(0, dtype=torch.int64), owner="v") == 0
        assert off.release_retained("t") == 3
        assert off.release_retained("u") == 2
        off.scheduler.check_invariants()


async def test_reset_releases_every_retained_block() -> None:
    async with offloader(max_retained_fraction=0.5) as off:
        await compute_and_store(off, "a", [*tokens(1, 3), 7])
        assert off.retain_prefix(tokens(1, 3), owner="sys") == 3
        assert await off.reset()
        assert off.pool.retained_owners == ()
        assert off.pool.num_free == off.pool.num_blocks
        off.scheduler.check_invariants()


@pytest.mark.parametrize(("fraction", "bound"), [(0.1, 1), (0.5, 8), (1.0, 15)])
def test_max_retained_fraction_sets_the_pool_bound(fraction: float, bound: int) -> None:
    assert offloader(max_retained_fraction=fraction).pool.max_retained_blocks == bound


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, float("nan")])
def test_a_bad_max_retained_fraction_is_refused(fraction: float) -> None:
    with pytest.raises(ConfigError, match="max_retained_fraction"):
        OffloadConfig(block_size=BS, num_cpu_blocks=16, max_retained_fraction=fraction)


# -- request priorities ---------------------------------------------------------------------


async def test_a_handle_stores_its_blocks_with_its_priority() -> None:
    async with offloader() as off:
        with off.request("hi", [*tokens(1, 2), 7], priority=3) as req:
            assert req.lookup() == 0
            req.advance([0, 1, 2], req.num_tokens)
            off.store()
            await off.drain()
        assert [off.pool.get_cached(h).priority for h in off.hash_prompt(tokens(1, 2))] == [3, 3]  # type: ignore[union-attr]
        off.scheduler.check_invariants()


@pytest.mark.parametrize("priority", [-3, 1 << 17, "high", 1.5, True, None])
async def test_a_bad_priority_names_the_request_and_the_value(priority: object) -> None:
    async with offloader() as off:
        with pytest.raises(InvalidInputError, match=rf"request 'r7': priority.*{priority!r}"):
            off.request("r7", tokens(1, 2), priority=priority)  # type: ignore[arg-type]
        with off.request("r7", tokens(1, 2)):  # the id was not taken
            pass
    sched = make()
    with pytest.raises(InvalidInputError, match=rf"request 'q': priority.*{priority!r}"):
        sched.set_priority("q", priority)  # type: ignore[arg-type]
    assert not sched.has_request("q")


def test_a_finished_request_takes_no_priority() -> None:
    sched = make()
    run_request(sched, "a", tokens(1, 1), [0])
    with pytest.raises(RequestStateError, match="'a' is finished"):
        sched.set_priority("a", 2)


@pytest.mark.parametrize("prioritized", [True, False])
def test_priorities_order_evictions_through_the_scheduler(prioritized: bool) -> None:
    sched = make(num_blocks=6)
    if prioritized:
        sched.set_priority("hi", 5)
    run_request(sched, "hi", tokens(1, 3), [0, 1, 2])  # older: LRU's first victims
    run_request(sched, "lo", tokens(2, 3), [3, 4, 5])
    run_request(sched, "new", tokens(3, 3), [6, 7, 8])  # needs 3 of the 6 blocks
    assert cached(sched, tokens(1, 3)) == [prioritized] * 3
    assert cached(sched, tokens(2, 3)) == [not prioritized] * 3
    assert cached(sched, tokens(3, 3)) == [True] * 3
    # Within one priority the policy decides: the next store evicts LRU among priority 0.
    run_request(sched, "next", tokens(4, 3), [9, 10, 11])
    assert cached(sched, tokens(1, 3)) == [prioritized] * 3
    sched.check_invariants()


@pytest.mark.parametrize("prioritized", [True, False])
def test_a_lookup_hit_raises_the_blocks_it_pins(prioritized: bool) -> None:
    sched = make(num_blocks=6)
    run_request(sched, "a", tokens(1, 3), [0, 1, 2])
    if prioritized:
        sched.set_priority("b", 4)
    assert sched.lookup("b", hashes(tokens(1, 3, 1)), 3 * BS + 1) == 3 * BS
    sched.release("b")
    run_request(sched, "c", tokens(2, 3), [3, 4, 5])
    run_request(sched, "d", tokens(3, 3), [6, 7, 8])
    assert cached(sched, tokens(1, 3)) == [prioritized] * 3
    assert cached(sched, tokens(2, 3)) == [not prioritized] * 3
    sched.check_invariants()


def test_a_block_shared_by_several_requests_keeps_the_highest_priority() -> None:
    sched = make(num_blocks=16)
    shared, pool = tokens(1, 2), sched.pool
    # The same step: "a" plans the blocks, "b" (priority 4) passes them planned.
    sched.update("a", [0, 1], hashes(shared), len(shared))
    sched.set_priority("b", 4)
    sched.update("b", [2, 3], hashes(shared), len(shared))
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.request_ids == ("a",)
    assert sched.ledger.priorities == dict.fromkeys(hashes(shared), 4)
    sched.check_invariants()
    # Later, while the store is still in flight: "c" (priority 6) finds them pending.
    sched.set_priority("c", 6)
    sched.update("c", [4, 5], hashes(shared), len(shared))
    assert sched.plan_stores() is None
    assert sched.ledger.priorities == dict.fromkeys(hashes(shared), 6)
    sched.complete(plan, ok=True)
    assert [pool.get_cached(h).priority for h in hashes(shared)] == [6, 6]  # type: ignore[union-attr]
    # Cached already: "d" (priority 9) raises them as its cursor passes them; a lower
    # priority never lowers them.
    sched.set_priority("d", 9)
    sched.set_priority("e", 1)
    sched.update("d", [6, 7], hashes(shared), len(shared))
    sched.update("e", [8, 9], hashes(shared), len(shared))
    assert sched.plan_stores() is None
    assert [pool.get_cached(h).priority for h in hashes(shared)] == [9, 9]  # type: ignore[union-attr]
    sched.check_invariants()


def test_a_failed_store_drops_the_priorities_it_carried() -> None:
    sched = make(num_blocks=8)
    sched.set_priority("a", 3)
    sched.update("a", [0, 1], hashes(tokens(1, 2)), 2 * BS)
    plan = sched.plan_stores()
    assert plan is not None
    assert len(sched.ledger.priorities) == 2
    sched.complete(plan, ok=False)
    assert sched.ledger.priorities == {}
    sched.check_invariants()


def test_the_default_priority_keeps_the_pool_on_its_fast_path() -> None:
    sched = make(num_blocks=4)
    run_request(sched, "a", tokens(1, 3), [0, 1, 2])
    assert sched.lookup("b", hashes(tokens(1, 3, 1)), 3 * BS + 1) == 3 * BS
    sched.release("b")
    run_request(sched, "c", tokens(2, 3), [3, 4, 5])
    assert sched.pool._plain
    assert all(sched.pool.block(i).priority == 0 for i in range(4))
    assert sched.ledger.priorities == {}


# -- deferral, not eviction ---------------------------------------------------------------


def test_a_retained_block_with_a_copy_in_flight_is_never_evicted_and_a_store_defers() -> None:
    sched = make(num_blocks=4, max_retained_fraction=0.5)  # at most 2 retained
    ledger, pool = sched.ledger, sched.pool
    system = tokens(1, 2)
    run_request(sched, "a", system, [0, 1])
    assert len(ledger.retain(hashes(system), "sys")) == 2
    # A load reads the retained blocks, the two others hold a store in flight.
    assert sched.lookup("b", hashes([*system, 7]), 2 * BS + 1) == 2 * BS
    load = sched.plan_load("b", [2, 3, 4], 2 * BS)
    assert load is not None
    sched.update("c", [5, 6], hashes(tokens(2, 2)), 2 * BS)
    store = sched.plan_stores()
    assert store is not None
    assert pool.num_free == 0
    sched.check_invariants()
    # No block is free: the next store is deferred, nothing retained or in flight evicted.
    sched.update("d", [7, 8], hashes(tokens(3, 2)), 2 * BS)
    assert sched.plan_stores() is None
    assert sched.statistics().deferred_blocks == 2
    assert cached(sched, system) == [True, True]
    sched.check_invariants()
    # Released while the load still reads them: still never evicted.
    assert ledger.release_retained("sys") == 2
    assert sched.plan_stores() is None
    assert cached(sched, system) == [True, True]
    assert all(b.ref_cnt >= 1 for b in map(pool.get_cached, hashes(system)))  # type: ignore[union-attr]
    sched.check_invariants()
    sched.complete(store, ok=True)
    sched.complete(load, ok=True)
    # Now the blocks are free: the deferred store takes them.
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.request_ids == ("d",)
    sched.complete(plan, ok=True)
    for rid in "bcd":
        sched.finish(rid)
    sched.check_invariants()
    assert pool.num_free == pool.num_blocks


async def test_retained_blocks_survive_stores_that_defer_through_the_offloader() -> None:
    """With the thread copy engine: a prefix retains 12 of the 16 CPU blocks, then one
    request computes 8 blocks; 4 are stored, the rest deferred, the prefix kept whole."""
    async with offloader(max_retained_fraction=1.0) as off:
        system = tokens(1, 12)
        await compute_and_store(off, "sys", [*system, 7])
        assert off.retain_prefix(system, owner="sys") == 12
        with off.request("big", tokens(2, 8, 1)) as req:
            assert req.lookup() == 0
            req.advance(list(range(9)), req.num_tokens)
            tasks = off.store()
            assert sum(len(t.plan.cpu_block_ids) for t in tasks) == 4
            assert off.scheduler.statistics().deferred_blocks == 4
            assert all(map(off.pool.is_cached, off.hash_prompt(system)))
            await off.drain()
            # The next store may reuse the 4 blocks stored (free once stored), never the
            # retained ones.
            assert sum(len(t.plan.cpu_block_ids) for t in off.store()) == 4
            await off.drain()
            assert all(map(off.pool.is_cached, off.hash_prompt(system)))
            assert sum(map(off.pool.is_cached, req.block_hashes)) == 4
            off.scheduler.check_invariants()
        assert off.release_retained("sys") == 12
        off.scheduler.check_invariants()
