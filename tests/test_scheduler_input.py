"""Malformed input to the scheduler is refused alone, clearly, and changes nothing.

Regression tests of the hardening issue: duplicate and changed block-table entries, one
request's bad ids costing the whole batch, refused loads unpublishing a hit, finished ids
coming back, errors outside the documented tree; and the behaviour vLLM's offload tests
expect (eviction order of a batched store, concurrent lookups of one prefix, blocks
deferred in a request's last step).
"""

from __future__ import annotations

import warnings

import pytest
from scheduler_helpers import BS, NS, SimKV, hashes, make, run_request, tokens

from kvoffload.config import OffloadConfig
from kvoffload.errors import (
    BlockTableError,
    InputTypeError,
    InvalidInputError,
    KvOffloadError,
    RequestStateError,
    UnhashedBlocksWarning,
)
from kvoffload.hashing import hash_prompt
from kvoffload.pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler, group_state, requests
from kvoffload.scheduler.requests import grown_table
from kvoffload.transfer.plan import LoadPlan, StorePlan


def snapshot(sched: OffloadScheduler) -> tuple[object, ...]:
    """Everything a refused call must leave unchanged."""
    pool = sched.pool
    states = {}
    for rid in ("a", "b", "c"):
        if sched.has_request(rid):
            st = sched.request_state(rid)
            states[rid] = (
                list(st.gpu_block_ids),
                list(st.block_hashes),
                st.num_computed_tokens,
                st.num_stored_blocks,
                [b.block_id for b in st.pinned],
            )
    refs = [pool.block(i).ref_cnt for i in range(pool.num_blocks)]
    cached = [pool.block(i).block_hash for i in range(pool.num_blocks)]
    return states, refs, cached, sched.num_in_flight


# -- 1. duplicate GPU ids ------------------------------------------------------------------


def test_update_refuses_a_table_naming_one_gpu_block_twice() -> None:
    sched = make(num_gpu_blocks=16)
    toks = tokens(1, 3)
    with pytest.raises(BlockTableError, match=r"'a'.*GPU block 5 .*positions 0 and 1"):
        sched.update("a", [5, 5, 6], hashes(toks), len(toks))
    assert not sched.has_request("a")  # nothing registered
    assert sched.plan_stores() is None
    # Across calls: a new entry that repeats a known one.
    sched.update("a", [5, 6], hashes(toks)[:2], 2 * BS)
    before = snapshot(sched)
    with pytest.raises(BlockTableError, match="GPU block 5 .*positions 0 and 2"):
        sched.update("a", [5, 6, 5], hashes(toks), len(toks))
    assert snapshot(sched) == before
    sched.check_invariants()


def test_load_refuses_a_table_naming_one_gpu_block_twice_and_keeps_the_pin() -> None:
    sched, sim = make(num_gpu_blocks=16), SimKV()
    toks = tokens(2, 3)
    run_request(sched, "a", toks, [0, 1, 2], sim)
    hit = sched.lookup("b", hashes(toks), len(toks) + 1)
    assert hit == 3 * BS
    before = snapshot(sched)
    with pytest.raises(BlockTableError, match=r"'b'.*GPU block 7 .*positions 1 and 2"):
        sched.plan_load("b", [4, 7, 7], hit)
    assert snapshot(sched) == before  # pin kept, blocks published, nothing planned
    plan = sched.plan_load("b", [4, 7, 8], hit)
    assert plan is not None
    assert plan.gpu_block_ids == (4, 7, 8)
    sched.complete(plan, ok=True)
    sched.check_invariants()


# -- 2. changed entries ---------------------------------------------------------------------


def test_update_refuses_a_changed_entry_a_store_still_reads() -> None:
    sched = make(num_gpu_blocks=16)
    toks = tokens(3, 4)
    hs = hashes(toks)
    sched.update("a", [1, 2, 3], hs[:3], BS)  # one block computed, three allocated
    before = snapshot(sched)
    with pytest.raises(BlockTableError, match=r"'a'.*gpu_block_ids\[1\] changed from 2 to 9"):
        sched.update("a", [1, 9, 3, 4], hs, 3 * BS)
    assert snapshot(sched) == before
    # The first entry is below nothing stored yet either: compared too.
    with pytest.raises(BlockTableError, match=r"gpu_block_ids\[0\] changed"):
        sched.update("a", [8, 2, 3, 4], hs, 3 * BS)
    sched.update("a", [1, 2, 3, 4], hs, 4 * BS)
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.gpu_block_ids == (1, 2, 3, 4)


def test_after_a_reset_every_known_entry_is_compared_again() -> None:
    sched = make(num_gpu_blocks=16)
    toks = tokens(4, 3)
    hs = hashes(toks)
    sched.update("a", [1, 2], hs[:2], 2 * BS)
    plan = sched.plan_stores()
    assert plan is not None
    sched.complete(plan, ok=True)
    # Below the cursor: nothing reads entry 0 any more, so it is not compared.
    sched.update("a", [7, 2, 3], hs, 2 * BS)
    assert sched.request_state("a").gpu_block_ids == [1, 2, 3]
    sched.reset()  # the cursor goes back to 0: stores would read entry 0 again
    assert sched.plan_stores() is None  # not before the table was checked again
    with pytest.raises(BlockTableError, match=r"gpu_block_ids\[0\] changed from 1 to 7"):
        sched.update("a", [7, 2, 3], hs, 3 * BS)
    sched.update("a", [1, 2, 3], hs, 3 * BS)
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.gpu_block_ids == (1, 2, 3)


# -- 3. one bad request does not cost the batch ----------------------------------------------


def test_one_requests_out_of_range_id_is_refused_alone() -> None:
    sched = make(num_gpu_blocks=8)
    a, b = tokens(5, 2), tokens(6, 2)
    sched.update("a", [0, 1], hashes(a), len(a))
    with pytest.raises(BlockTableError, match=r"'b'.*gpu_block_ids\[1\]=99 is out of range"):
        sched.update("b", [2, 99], hashes(b), len(b))
    with pytest.raises(BlockTableError, match="out of range"):
        sched.update("b", [-1], hashes(b), BS)
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.block_hashes == tuple(hashes(a))
    sched.update("b", [2, 3], hashes(b), len(b))
    plan2 = sched.plan_stores()
    assert plan2 is not None
    assert plan2.block_hashes == tuple(hashes(b))


def test_cancelled_store_plan_moves_every_cursor_back() -> None:
    sched = make()
    a, b = tokens(7, 2), tokens(8, 3)
    sched.update("a", [0, 1], hashes(a), len(a))
    sched.update("b", [2, 3, 4], hashes(b), len(b))
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.num_blocks == 5
    assert sched.cancel(plan)
    sched.check_invariants()
    assert sched.pool.num_free == sched.pool.num_blocks
    assert sched.request_state("a").num_stored_blocks == 0
    assert not sched.cancel(plan)  # once
    again = sched.plan_stores()
    assert again is not None
    assert again.block_hashes == plan.block_hashes
    assert again.gpu_block_ids == plan.gpu_block_ids
    assert sched.statistics().cancelled_plans == 1


# -- 4. a refused load changes nothing ---------------------------------------------------------


def test_load_refused_for_a_bad_table_keeps_the_hit_published() -> None:
    sched, sim = make(num_gpu_blocks=8), SimKV()
    toks = tokens(9, 3)
    run_request(sched, "a", toks, [0, 1, 2], sim)
    hit = sched.lookup("b", hashes(toks), len(toks) + 1)
    before = snapshot(sched)
    with pytest.raises(BlockTableError, match="out of range"):
        sched.plan_load("b", [3, 4, 50], hit)
    with pytest.raises(BlockTableError, match="has 2 GPU blocks"):
        sched.plan_load("b", [3, 4], hit)
    with pytest.raises(InputTypeError):
        sched.plan_load("b", [3, 4, 5.0], hit)  # type: ignore[list-item]
    assert snapshot(sched) == before
    assert all(sched.pool.is_cached(h) for h in hashes(toks))
    assert sched.lookup("c", hashes(toks), len(toks) + 1) == hit  # others still hit


def test_cancelled_load_pins_the_hit_again() -> None:
    sched, sim = make(), SimKV()
    toks = tokens(10, 2)
    run_request(sched, "a", toks, [0, 1], sim)
    hit = sched.lookup("b", hashes(toks), len(toks) + 1)
    plan = sched.plan_load("b", [5, 6], hit)
    assert isinstance(plan, LoadPlan)
    assert sched.cancel(plan)
    sched.check_invariants()
    assert len(sched.request_state("b").pinned) == 2
    assert all(sched.pool.is_cached(h) for h in hashes(toks))
    again = sched.plan_load("b", [5, 6], hit)
    assert again is not None
    assert again.cpu_block_ids == plan.cpu_block_ids


# -- 7. finished ids do not come back ------------------------------------------------------


def test_a_finished_request_id_is_not_reused() -> None:
    sched = make()
    toks = tokens(11, 2)
    sched.update("a", [0, 1], hashes(toks), 0)
    sched.finish("a")
    assert not sched.has_request("a")
    with pytest.raises(RequestStateError, match="'a' is finished"):
        sched.update("a", [0, 1], hashes(toks), len(toks))
    with pytest.raises(RequestStateError, match="'a' is finished"):
        sched.lookup("a", hashes(toks), len(toks))
    with pytest.raises(RequestStateError, match="'a' is finished"):
        sched.finish("a")
    with pytest.raises(RequestStateError):
        sched.release("a")
    assert not sched.has_request("a")
    sched.check_invariants()


# -- 8. errors inside the tree ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.update("a", [0, 1], [], 1.0), InputTypeError),
        (lambda s: s.update("a", (g for g in [0, 1]), [], 0), InputTypeError),
        (lambda s: s.update("a", {0, 1}, [], 0), InputTypeError),
        (lambda s: s.update("a", [0, 1], [b"x"], True), InputTypeError),
        (lambda s: s.update("a", [0, 1], ["not bytes"], 0), InputTypeError),
        (lambda s: s.update("a", [0, 1.5], [], 0), InputTypeError),
        (lambda s: s.update("a", [0, 1], [], -1), InvalidInputError),
        (lambda s: s.update("a", [0, 40], [], 0), BlockTableError),
        (lambda s: s.lookup("a", [], 4.0), InputTypeError),
        (lambda s: s.lookup("a", [1234], 2 * BS), InputTypeError),
        (lambda s: s.lookup("a", [], 3, 1), InvalidInputError),
        (lambda s: s.plan_load("a", [0], BS), BlockTableError),
    ],
)
def test_bad_values_raise_errors_of_the_tree(call: object, error: type[Exception]) -> None:
    sched = make(num_gpu_blocks=32)
    if "plan_load" in repr(call.__code__.co_names):  # type: ignore[attr-defined]
        toks = tokens(12, 2)
        run_request(sched, "x", toks, [0, 1])
        sched.lookup("a", hashes(toks), len(toks) + 1)
        call = lambda s: s.plan_load("a", [], 2 * BS)  # noqa: E731
    with pytest.raises(error) as info:
        call(sched)  # type: ignore[operator]
    assert isinstance(info.value, KvOffloadError)
    assert "'a'" in str(info.value)


def test_shrinking_table_and_lazy_store_without_view_are_tree_errors() -> None:
    sched = make()
    sched.update("a", [0, 1], [], 0)
    with pytest.raises(BlockTableError, match="shrank from 2 to 1"):
        sched.update("a", [0], [], 0)
    lazy = make(store_mode="lazy")
    with pytest.raises(InvalidInputError, match="gpu_cache"):
        lazy.plan_stores()
    with pytest.raises(InputTypeError, match="64-bit int"):
        hash_prompt([1, 2, 1 << 70, 4], 4, NS)
    with pytest.raises(InputTypeError, match="64-bit int"):
        hash_prompt([1, 2, 3.0, 4], 4, NS)  # type: ignore[list-item]


# -- 9. eviction order of one batched store -----------------------------------------------------


def test_batched_store_frees_requests_in_plan_order_each_tail_first() -> None:
    sched, sim = make(num_blocks=4), SimKV()
    a, b = tokens(13, 2), tokens(14, 2)
    sim.compute([0, 1], hashes(a))
    sim.compute([2, 3], hashes(b))
    sched.update("a", [0, 1], hashes(a), len(a))
    sched.update("b", [2, 3], hashes(b), len(b))
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.request_ids == ("a", "b")
    sched.complete(plan, ok=True)
    sched.finish("a")
    sched.finish("b")
    # Evict one block at a time: a's tail, a's head, b's tail, b's head.
    order: list[bytes] = []
    for seed in range(4):
        c = tokens(20 + seed, 1)
        sched.update(f"c{seed}", [10 + seed], hashes(c), BS)
        store = sched.plan_stores()
        assert store is not None
        sched.complete(store, ok=True)
        sched.finish(f"c{seed}")
        gone = [h for h in hashes(a) + hashes(b) if not sched.pool.is_cached(h)]
        order.append(next(h for h in gone if h not in order))
    assert order == [hashes(a)[1], hashes(a)[0], hashes(b)[1], hashes(b)[0]]


# -- 10. concurrent lookups of one prefix ----------------------------------------------------


def test_a_prefix_being_loaded_is_deferred_not_loaded_twice() -> None:
    sched, sim = make(), SimKV()
    toks = tokens(15, 3)
    run_request(sched, "a", toks, [0, 1, 2], sim)
    hit = sched.lookup("b", hashes(toks), len(toks) + 1)
    first = sched.plan_load("b", [4, 5, 6], hit)
    assert first is not None
    assert sched.lookup("c", hashes(toks), len(toks) + 1, allow_defer=True) is None
    assert sched.statistics().deferred_lookups == 1
    sched.complete(first, ok=True)
    assert sched.lookup("c", hashes(toks), len(toks) + 1, allow_defer=True) == hit
    sched.release("c")
    # Without allow_defer the second load happens, and is counted.
    hit = sched.lookup("d", hashes(toks), len(toks) + 1)
    one = sched.plan_load("d", [8, 9, 10], hit)
    hit2 = sched.lookup("e", hashes(toks), len(toks) + 1)
    two = sched.plan_load("e", [11, 12, 13], hit2)
    assert one is not None
    assert two is not None
    assert one.cpu_block_ids == two.cpu_block_ids
    assert sched.statistics().concurrent_load_blocks == 3
    sched.check_invariants()
    sched.complete(one, ok=True)
    sched.complete(two, ok=True)
    sched.check_invariants()


# -- 11. blocks deferred in a request's last step ----------------------------------------------


def held_scheduler(**overrides: object) -> OffloadScheduler:
    config = OffloadConfig(block_size=BS, num_cpu_blocks=3, hold_blocks_on_finish=True, **overrides)  # type: ignore[arg-type]
    return OffloadScheduler(config, CpuBlockPool(3))


def test_finish_holds_deferred_blocks_until_a_later_step_stores_them() -> None:
    sched, sim = held_scheduler(), SimKV()
    blocker = tokens(16, 3)
    sim.compute([20, 21, 22], hashes(blocker))
    sched.update("x", [20, 21, 22], hashes(blocker), len(blocker))
    busy = sched.plan_stores()  # fills the pool; its copy is in flight
    assert busy is not None
    toks = tokens(17, 2)
    sim.compute([0, 1], hashes(toks))
    sched.update("a", [0, 1], hashes(toks), len(toks))
    assert sched.plan_stores() is None  # deferred: no free block
    assert sched.finish("a") == (0, 1)
    assert sched.has_request("a")
    assert sched.statistics().held_blocks == 2
    sched.check_invariants()
    sim.execute(busy)
    sched.complete(busy, ok=True)
    sched.finish("x")
    plan = sched.plan_stores()
    assert isinstance(plan, StorePlan)
    assert plan.gpu_block_ids == (0, 1)
    assert sorted(sched.take_released_holds()) == [0, 1]
    assert sched.take_released_holds() == []
    sim.execute(plan)
    sched.complete(plan, ok=True)
    assert not sched.has_request("a")
    assert all(sched.pool.is_cached(h) for h in hashes(toks))
    sched.check_invariants()


def test_holds_are_bounded_in_blocks_and_steps() -> None:
    sched = held_scheduler(hold_max_blocks=1, hold_max_steps=2)
    blocker = tokens(18, 3)
    sched.update("x", [20, 21, 22], hashes(blocker), len(blocker))
    busy = sched.plan_stores()
    assert busy is not None
    toks = tokens(19, 2)
    sched.update("a", [0, 1], hashes(toks), len(toks))
    assert sched.finish("a") == (0,)  # the prefix that fits the budget
    assert sched.plan_stores() is None
    assert sched.plan_stores() is None
    assert sched.take_released_holds() == []
    assert sched.plan_stores() is None  # third call: given up
    assert sched.take_released_holds() == [0]
    assert sched.statistics().hold_expired_blocks == 1
    assert not sched.has_request("a")
    sched.complete(busy, ok=True)
    sched.check_invariants()


def test_holding_is_off_by_default() -> None:
    sched = make(num_blocks=1)
    toks = tokens(21, 2)
    sched.update("a", [0, 1], hashes(toks), len(toks))
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.num_blocks == 1
    assert sched.finish("a") == ()
    sched.complete(plan, ok=True)
    assert not sched.has_request("a")


# -- issue 8: computed tokens past the hashed blocks ----------------------------------------


def test_computed_tokens_far_past_the_hashes_warn_once() -> None:
    sched = make()
    toks = tokens(22, 8)
    hs = hashes(toks)
    sched.update("a", [0, 1, 2], hs[:2], 3 * BS)  # one block ahead: normal, no warning
    with pytest.warns(UnhashedBlocksWarning, match=r"'a'.*4 full blocks but only 2"):
        sched.update("a", [0, 1, 2, 3], hs[:2], 4 * BS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.update("a", [0, 1, 2, 3, 4], hs[:2], 5 * BS)  # once only


def test_one_table_growth_rule_serves_one_group_and_each_group() -> None:
    """`grown_table()` is the one rule: a list that only grew, with the entries a store
    may still read (and the last known one) unchanged and fresh new ids, gives its new
    entries; anything else asks for the full check (``None``). One group's
    `RequestTable` and `GroupedScheduler`'s table check both call it."""
    assert group_state.grown_table is requests.grown_table
    old = [4, 5, 6]
    seen = set(old)
    assert grown_table([4, 5, 6, 7, 8], old, seen, 1, None) == [7, 8]
    assert grown_table([4, 5, 6], old, seen, 1, None) == []
    assert grown_table([9, 5, 6, 7], old, seen, 1, None) == [7]  # below the cursor: unread
    assert grown_table([4, 9, 6, 7], old, seen, 1, None) is None  # read by a store
    assert grown_table([4, 5, 9, 7], old, seen, 5, None) is None  # the last known entry
    assert grown_table([4, 5], old, seen, 0, None) is None  # shrank
    assert grown_table((4, 5, 6, 7), old, seen, 0, None) is None  # not a list
    assert grown_table([4, 5, 6, 5], old, seen, 0, None) is None  # an id named twice
    assert grown_table([4, 5, 6, 7, 7], old, seen, 0, None) is None
    assert grown_table([4, 5, 6, None], old, seen, 0, None) is None
    assert grown_table([4, 5, 6, 8], old, seen, 0, 8) is None  # out of range
    assert grown_table([4, 5, 6, -1], old, seen, 0, None) is None
    assert grown_table([1, 2], [], set(), 0, 8) == [1, 2]
