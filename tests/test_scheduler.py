"""OffloadScheduler scenarios, each its own test, with simulated KV contents."""

from __future__ import annotations

import logging

import pytest
from scheduler_helpers import BS, SimKV, hashes, make, run_request, tokens

from kvoffload.errors import OutOfBlocksError, RequestStateError, UnknownRequestError
from kvoffload.hashing import BlockHash
from kvoffload.transfer.plan import LoadPlan, StorePlan


def load_into(sched, sim: SimKV, rid: str, toks, gpu_ids, computed: int = 0, accept=None):
    """lookup + plan_load + execute + complete; returns the loaded token count."""
    hs = hashes(toks)
    hit = sched.lookup(rid, hs, len(toks), computed)
    take = hit if accept is None else accept
    plan = sched.plan_load(rid, gpu_ids, take)
    if plan is not None:
        sim.execute(plan)
        sched.complete(plan, ok=True)
    sched.check_invariants()
    return hit, plan


def test_eager_store_then_load_identical_prompt() -> None:
    sched, sim = make(), SimKV()
    toks = tokens(1, 4, extra=1)  # 4 full blocks + 1 token
    plan = run_request(sched, "a", toks, [10, 11, 12, 13], sim)
    assert isinstance(plan, StorePlan)
    assert plan.gpu_block_ids == (10, 11, 12, 13)
    assert plan.block_hashes == tuple(hashes(toks))
    hit, load = load_into(sched, sim, "b", toks, [20, 21, 22, 23, 24])
    assert hit == 4 * BS
    assert isinstance(load, LoadPlan)
    assert load.gpu_block_ids == (20, 21, 22, 23)
    assert [sim.gpu[g] for g in (20, 21, 22, 23)] == hashes(toks)
    stats = sched.statistics()
    assert stats.stored_blocks == 4
    assert stats.loaded_blocks == 4
    assert stats.hit_tokens == 4 * BS
    assert stats.bytes_stored == 400


def test_prompt_of_exactly_n_blocks_hits_n_minus_one() -> None:
    sched = make()
    toks = tokens(2, 3)
    run_request(sched, "a", toks, [0, 1, 2])
    assert sched.lookup("b", hashes(toks), len(toks)) == 2 * BS
    # One more token makes the whole third block loadable.
    assert sched.lookup("c", hashes(toks), len(toks) + 1) == 3 * BS


def test_duplicate_store_is_skipped() -> None:
    sched = make()
    toks = tokens(3, 3)
    run_request(sched, "a", toks, [0, 1, 2])
    hs = hashes(toks)
    sched.update("b", [5, 6, 7], hs, len(toks))
    assert sched.plan_stores() is None
    assert sched.request_state("b").num_stored_blocks == 3
    assert sched.statistics().stored_blocks == 3


def test_in_flight_dedup_across_steps_and_requests() -> None:
    sched = make()
    toks = tokens(4, 2)
    hs = hashes(toks)
    sched.update("a", [0, 1], hs, len(toks))
    first = sched.plan_stores()
    assert first is not None
    assert first.num_blocks == 2
    # Same request again, store not finished: nothing new.
    sched.update("a", [0, 1], hs, len(toks))
    assert sched.plan_stores() is None
    # Another request with the same prefix on other GPU blocks: nothing new either.
    sched.update("b", [5, 6], hs, len(toks))
    assert sched.plan_stores() is None
    sched.check_invariants()
    sched.complete(first, ok=True)
    assert sched.lookup("c", hs, len(toks) + 1) == 2 * BS


def test_lru_oldest_request_evicted_first() -> None:
    sched = make(num_blocks=4)
    old, new, newest = tokens(5, 2), tokens(6, 2), tokens(7, 2)
    run_request(sched, "old", old, [0, 1])
    run_request(sched, "new", new, [2, 3])
    run_request(sched, "newest", newest, [4, 5])  # evicts "old"
    assert sched.lookup("q1", hashes(old), len(old) + 1) == 0
    assert sched.lookup("q2", hashes(new), len(new) + 1) == 2 * BS
    assert sched.lookup("q3", hashes(newest), len(newest) + 1) == 2 * BS


def test_touched_blocks_survive() -> None:
    sched, sim = make(num_blocks=4), SimKV()
    old, new, newest = tokens(5, 2), tokens(6, 2), tokens(7, 2)
    run_request(sched, "old", old, [0, 1], sim)
    run_request(sched, "new", new, [2, 3], sim)
    hit, _ = load_into(sched, sim, "rehit", old + [0], [8, 9, 10])  # re-hit "old"
    assert hit == 2 * BS
    sched.finish("rehit")
    run_request(sched, "newest", newest, [4, 5], sim)  # now evicts "new"
    assert sched.lookup("q1", hashes(old), len(old) + 1) == 2 * BS
    assert sched.lookup("q2", hashes(new), len(new) + 1) == 0


def test_prefix_blocks_outlive_tail_blocks() -> None:
    # Completion frees a request's blocks tail first, so its prefix is evicted last.
    sched = make(num_blocks=4)
    a = tokens(8, 4)
    run_request(sched, "a", a, [0, 1, 2, 3])
    run_request(sched, "b", tokens(9, 2), [4, 5])
    assert sched.lookup("q", hashes(a), len(a)) == 2 * BS  # blocks 0 and 1 survive


def test_finish_during_in_flight_store_defers_cleanup() -> None:
    sched = make()
    toks = tokens(10, 2)
    sched.update("a", [0, 1], hashes(toks), len(toks))
    plan = sched.plan_stores()
    assert plan is not None
    sched.finish("a")
    assert sched.has_request("a")  # kept until the store completes
    with pytest.raises(RequestStateError, match="'a'"):
        sched.update("a", [0, 1], hashes(toks), len(toks))
    assert sched.plan_stores() is None  # a finished request schedules nothing
    sched.check_invariants()
    sched.complete(plan, ok=True)
    assert not sched.has_request("a")
    assert sched.pool.num_free == sched.pool.num_blocks
    assert sched.lookup("b", hashes(toks), len(toks) + 1) == 2 * BS


def test_finish_during_in_flight_load_defers_cleanup() -> None:
    sched, sim = make(), SimKV()
    toks = tokens(11, 3)
    run_request(sched, "a", toks, [0, 1, 2], sim)
    hit = sched.lookup("b", hashes(toks), len(toks) + 1)
    plan = sched.plan_load("b", [5, 6, 7], hit)
    assert plan is not None
    sched.finish("b")
    assert sched.has_request("b")
    pinned = [sched.pool.block(c) for c in plan.cpu_block_ids]
    assert all(b.ref_cnt == 1 for b in pinned)  # still held by the load
    sched.check_invariants()
    sched.complete(plan, ok=True)
    assert not sched.has_request("b")
    assert all(b.ref_cnt == 0 for b in pinned)
    assert sched.pool.num_free == sched.pool.num_blocks


def test_chunked_prefill_stores_exactly_the_new_blocks() -> None:
    sched = make()
    toks = tokens(12, 5)
    hs = hashes(toks)
    gpu = [0, 1, 2, 3, 4]
    sched.update("a", gpu[:2], hs[:2], 2 * BS + 1)  # chunk 1: 2 blocks and a bit
    p1 = sched.plan_stores()
    assert p1 is not None
    assert p1.block_hashes == tuple(hs[:2])
    sched.update("a", gpu[:4], hs[:4], 4 * BS - 1)  # chunk 2: block 3 not complete yet
    p2 = sched.plan_stores()
    assert p2 is not None
    assert p2.block_hashes == (hs[2],)
    assert p2.gpu_block_ids == (2,)
    sched.update("a", gpu, hs, 5 * BS)
    p3 = sched.plan_stores()
    assert p3 is not None
    assert p3.block_hashes == tuple(hs[3:5])
    assert p3.gpu_block_ids == (3, 4)
    for p in (p1, p2, p3):
        sched.complete(p, ok=True)
    sched.check_invariants()


def test_blocks_without_computed_tokens_are_never_stored() -> None:
    sched = make()
    toks = tokens(13, 3)
    sched.update("a", [0, 1, 2], hashes(toks), 0)
    assert sched.plan_stores() is None
    sched.update("a", [0, 1, 2], hashes(toks), BS - 1)
    assert sched.plan_stores() is None


def test_gpu_prefix_plus_cpu_hit_with_partial_acceptance() -> None:
    sched, sim = make(), SimKV()
    toks = tokens(14, 6, extra=2)
    run_request(sched, "a", toks, [0, 1, 2, 3, 4, 5], sim)
    # The engine holds blocks 0-1 itself; CPU offers 4 more; it accepts 2.
    table = [30, 31, 32, 33, 34, 35, 36]
    sim.compute(table[:2], hashes(toks)[:2])
    hit = sched.lookup("b", hashes(toks), len(toks), 2 * BS)
    assert hit == 4 * BS
    plan = sched.plan_load("b", table, 2 * BS)
    assert plan is not None
    assert plan.gpu_block_ids == (32, 33)
    expected_cpu = tuple(sched.pool.get_cached(h).block_id for h in hashes(toks)[2:4])
    assert plan.cpu_block_ids == expected_cpu
    sim.execute(plan)
    sched.complete(plan, ok=True)
    assert [sim.gpu[g] for g in table[:4]] == hashes(toks)[:4]
    assert 34 not in sim.gpu  # never written
    assert sched.pool.num_free == sched.pool.num_blocks  # the unaccepted pin was released
    sched.check_invariants()


def test_unaligned_engine_prefix_is_refused() -> None:
    sched = make()
    toks = tokens(15, 3)
    with pytest.raises(ValueError, match="not a multiple"):
        sched.lookup("a", hashes(toks), len(toks), BS + 1)


def test_hit_cannot_be_evicted_between_lookup_and_plan_load() -> None:
    sched, sim = make(num_blocks=4), SimKV()
    a = tokens(16, 2)
    run_request(sched, "a", a, [0, 1], sim)
    hit = sched.lookup("b", hashes(a), len(a) + 1)
    assert hit == 2 * BS
    # Another request now needs the whole pool: only 2 blocks are free.
    c = tokens(17, 4)
    sim.compute([4, 5, 6, 7], hashes(c))
    sched.update("c", [4, 5, 6, 7], hashes(c), len(c))
    plan_c = sched.plan_stores()
    assert plan_c is not None
    assert plan_c.num_blocks == 2  # the rest deferred, the pinned hit untouched
    plan = sched.plan_load("b", [8, 9, 10], hit)
    assert plan is not None
    sim.execute(plan)
    sched.complete(plan, ok=True)
    assert [sim.gpu[8], sim.gpu[9]] == hashes(a)
    sched.check_invariants()


def test_release_drops_the_pin() -> None:
    sched = make()
    toks = tokens(18, 2)
    run_request(sched, "a", toks, [0, 1])
    assert sched.lookup("b", hashes(toks), len(toks) + 1) == 2 * BS
    assert sched.pool.num_free == sched.pool.num_blocks - 2
    sched.release("b")
    assert sched.pool.num_free == sched.pool.num_blocks
    # A repeated lookup drops the previous pin first.
    sched.lookup("b", hashes(toks), len(toks) + 1)
    sched.lookup("b", hashes(toks), len(toks) + 1)
    assert sched.pool.num_free == sched.pool.num_blocks - 2
    sched.check_invariants()


def test_reset_with_pending_stores() -> None:
    sched = make()
    done, pending = tokens(19, 2), tokens(20, 2)
    run_request(sched, "done", done, [0, 1])
    sched.update("p", [2, 3], hashes(pending), len(pending))
    plan = sched.plan_stores()
    assert plan is not None
    assert sched.reset() is False  # a store is still in flight
    assert sched.lookup("q", hashes(done), len(done) + 1) == 0
    sched.complete(plan, ok=True)  # abandoned: publishes nothing
    assert sched.lookup("q", hashes(pending), len(pending) + 1) == 0
    assert sched.reset() is True
    assert sched.pool.num_cached == 0
    stats = sched.statistics()
    assert stats.abandoned_transfers == 1
    assert stats.stored_blocks == 2  # only the one before the reset
    sched.check_invariants()
    # The live request stores again after the reset (its cursor went back to 0), once its
    # next update() has checked its block table again.
    assert sched.plan_stores() is None
    sched.update("p", [2, 3], hashes(pending), len(pending))
    again = sched.plan_stores()
    assert again is not None
    assert again.block_hashes == tuple(hashes(pending))


def test_reset_with_pending_loads() -> None:
    sched, sim = make(), SimKV()
    toks = tokens(21, 3)
    run_request(sched, "a", toks, [0, 1, 2], sim)
    hit = sched.lookup("b", hashes(toks), len(toks) + 1)
    plan = sched.plan_load("b", [5, 6, 7], hit)
    assert plan is not None
    assert sched.reset() is False
    assert sched.pool.num_cached == 0
    sched.complete(plan, ok=True)
    assert sched.reset() is True
    assert sched.pool.num_free == sched.pool.num_blocks
    assert sched.lookup("c", hashes(toks), len(toks) + 1) == 0
    sched.check_invariants()


def test_in_flight_stores_are_protected_and_deferred(caplog: pytest.LogCaptureFixture) -> None:
    sched = make(num_blocks=4)
    a, b = tokens(22, 4), tokens(23, 3)
    sched.update("a", [0, 1, 2, 3], hashes(a), len(a))
    plan_a = sched.plan_stores()
    assert plan_a is not None
    assert plan_a.num_blocks == 4  # every CPU block is now held by an in-flight store
    sched.update("b", [4, 5, 6], hashes(b), len(b))
    with caplog.at_level(logging.DEBUG, logger="kvoffload"):
        assert sched.plan_stores() is None
    assert "store_deferred" in caplog.text
    assert sched.request_state("b").num_stored_blocks == 0  # cursor unchanged
    assert all(sched.pool.block(c).ref_cnt == 1 for c in plan_a.cpu_block_ids)
    stats = sched.statistics()
    assert stats.deferred_blocks == 3
    assert stats.deferred_steps == 1
    sched.check_invariants()
    sched.complete(plan_a, ok=True)
    plan_b = sched.plan_stores()  # now b's blocks are stored, evicting a's (completed) ones
    assert plan_b is not None
    assert plan_b.block_hashes == tuple(hashes(b))
    sched.complete(plan_b, ok=True)
    assert sched.lookup("q", hashes(b), len(b) + 1) == 3 * BS
    sched.check_invariants()


def test_active_request_blocks_can_be_evicted_shorter_hit_never_wrong() -> None:
    sched, sim = make(num_blocks=4), SimKV()
    a = tokens(24, 4)
    run_request(sched, "a", a, [0, 1, 2, 3], sim, finish=False)  # a stays live
    b = tokens(25, 2)
    run_request(sched, "b", b, [4, 5], sim)  # evicts a's tail blocks 3 and 2
    assert sched.statistics().evicted_while_live == 2
    hit, plan = load_into(sched, sim, "c", a, [8, 9, 10, 11])
    assert hit == 2 * BS
    assert plan is not None
    assert [sim.gpu[8], sim.gpu[9]] == hashes(a)[:2]
    # Without restore_evicted the live request does not store them again.
    assert sched.plan_stores() is None


def test_middle_eviction_shortens_hit_at_the_hole() -> None:
    # FM-26: block k evicted: lookup stops at k, never extends past the hole.
    sched, sim = make(num_blocks=4), SimKV()
    a = tokens(26, 4)
    run_request(sched, "a", a, [0, 1, 2, 3], sim)
    pool = sched.pool
    blocks = [pool.get_cached(h) for h in hashes(a)]
    others = [b for i, b in enumerate(blocks) if i != 1 and b is not None]
    pool.touch(others)  # only block 1 stays evictable
    assert pool.allocate(1) == [blocks[1]]  # evict the middle block
    pool.free([blocks[1]])  # type: ignore[list-item]
    pool.free(others)
    hit, plan = load_into(sched, sim, "c", a + [0], [8, 9, 10, 11])
    assert hit == 1 * BS
    assert plan is not None
    assert plan.gpu_block_ids == (8,)
    assert sim.gpu[8] == hashes(a)[0]
    assert 9 not in sim.gpu


def test_preemption_resets_cursor_and_restores_evicted_blocks() -> None:
    sched, sim = make(num_blocks=4), SimKV()
    a = tokens(27, 4)
    run_request(sched, "a", a, [0, 1, 2, 3], sim, finish=False)
    run_request(sched, "b", tokens(28, 2), [4, 5], sim)  # evicts a's blocks 2 and 3
    sched.preempt("a")
    assert sched.request_state("a").num_stored_blocks == 0
    assert sched.plan_stores() is None  # preempted: its GPU blocks are gone
    # Re-admitted with new GPU blocks and recomputed.
    sim.compute([6, 7, 8, 9], hashes(a))
    sched.update("a", [6, 7, 8, 9], hashes(a), len(a))
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.block_hashes == tuple(hashes(a)[2:])
    assert plan.gpu_block_ids == (8, 9)
    sim.execute(plan)
    sched.complete(plan, ok=True)
    hit, _ = load_into(sched, sim, "c", a + [0], [20, 21, 22, 23])
    assert hit == 4 * BS
    assert [sim.gpu[g] for g in (20, 21, 22, 23)] == hashes(a)


def test_finished_request_schedules_nothing() -> None:
    sched = make()
    toks = tokens(29, 3)
    sched.update("a", [0, 1, 2], hashes(toks), len(toks))
    sched.finish("a")
    assert not sched.has_request("a")
    assert sched.plan_stores() is None
    with pytest.raises(RequestStateError, match="'a' is finished"):
        sched.finish("a")
    with pytest.raises(UnknownRequestError, match="'zzz'"):
        sched.preempt("zzz")


def test_restore_evicted_restores_a_middle_block() -> None:
    sched, sim = make(num_blocks=5, restore_evicted=True), SimKV()
    a = tokens(30, 4)
    run_request(sched, "a", a, [0, 1, 2, 3], sim, finish=False)
    # Make block 1 of "a" the LRU one, then evict it with one new block.
    blocks = [sched.pool.get_cached(h) for h in hashes(a)]
    assert all(b is not None for b in blocks)
    sched.pool.touch([blocks[0], blocks[2], blocks[3]])  # type: ignore[list-item]
    sched.pool.free([blocks[3], blocks[2], blocks[0]])  # type: ignore[list-item]
    b = tokens(31, 2)
    run_request(sched, "b", b, [4, 5], sim)  # needs 2: 1 free + evicts block 1 of "a"
    assert not sched.pool.is_cached(hashes(a)[1])
    assert sched.statistics().evicted_while_live >= 1
    plan = sched.plan_stores()
    assert plan is not None
    assert hashes(a)[1] in plan.block_hashes
    assert plan.gpu_block_ids[plan.block_hashes.index(hashes(a)[1])] == 1
    sim.execute(plan)
    sched.complete(plan, ok=True)
    assert sched.statistics().restored_blocks >= 1
    hit, _ = load_into(sched, sim, "c", a + [0], [20, 21, 22, 23])
    assert hit == 4 * BS


def test_failed_store_publishes_nothing() -> None:
    sched = make()
    toks = tokens(32, 3)
    sched.update("a", [0, 1, 2], hashes(toks), len(toks))
    plan = sched.plan_stores()
    assert plan is not None
    assert sched.complete(plan, ok=False)
    assert sched.lookup("b", hashes(toks), len(toks) + 1) == 0
    assert sched.pool.num_free == sched.pool.num_blocks
    assert sched.statistics().failed_stores == 1
    sched.check_invariants()


def test_failed_load_unpublishes_shared_blocks() -> None:
    # FM-41: two requests share block k; a failed load of k sends both to recompute.
    sched, sim = make(), SimKV()
    toks = tokens(33, 3)
    run_request(sched, "a", toks, [0, 1, 2], sim)
    hit1 = sched.lookup("r1", hashes(toks), len(toks) + 1)
    hit2 = sched.lookup("r2", hashes(toks), len(toks) + 1)
    assert hit1 == hit2 == 3 * BS
    p1 = sched.plan_load("r1", [5, 6, 7], hit1)
    p2 = sched.plan_load("r2", [8, 9, 10], hit2)
    assert p1 is not None
    assert p2 is not None
    sched.complete(p1, ok=False)
    assert sched.lookup("r3", hashes(toks), len(toks) + 1) == 0
    sched.complete(p2, ok=True)
    assert sched.pool.num_free == sched.pool.num_blocks
    assert sched.statistics().failed_loads == 1
    sched.check_invariants()


def test_late_or_duplicate_completion_is_ignored() -> None:
    # FM-12 / FM-30
    sched = make()
    toks = tokens(34, 2)
    sched.update("a", [0, 1], hashes(toks), len(toks))
    plan = sched.plan_stores()
    assert plan is not None
    sched.finish("a")
    assert sched.complete(plan, ok=True)
    assert not sched.complete(plan, ok=True)
    assert not sched.complete(plan, ok=False)
    assert sched.statistics().ignored_completions == 2
    assert sched.pool.num_free == sched.pool.num_blocks
    sched.check_invariants()


def test_preempt_with_store_in_flight_then_readmit_defers_lookup() -> None:
    # FM-27 and FM-07: a re-admitted request waits for its own in-flight store.
    sched = make()
    toks = tokens(35, 3)
    hs = hashes(toks)
    sched.update("a", [0, 1, 2], hs, len(toks))
    plan = sched.plan_stores()
    assert plan is not None
    sched.preempt("a")
    assert sched.lookup("a", hs, len(toks) + 1, allow_defer=True) is None
    assert sched.statistics().deferred_lookups == 1
    sched.complete(plan, ok=True)
    assert sched.lookup("a", hs, len(toks) + 1, allow_defer=True) == 3 * BS


def test_preempted_store_publishes_only_after_completion() -> None:
    # FM-07: preemption does not cancel the store; its hashes appear only on success.
    sched = make()
    toks = tokens(36, 2)
    hs = hashes(toks)
    sched.update("a", [0, 1], hs, len(toks))
    plan = sched.plan_stores()
    assert plan is not None
    sched.preempt("a")
    assert not any(sched.pool.is_cached(h) for h in hs)
    sched.complete(plan, ok=False)
    assert not any(sched.pool.is_cached(h) for h in hs)


def test_no_read_never_looks_up() -> None:
    # FM-53
    sched = make()
    toks = tokens(37, 3)
    run_request(sched, "a", toks, [0, 1, 2])
    before = sched.pool.statistics().lookups
    assert sched.lookup("b", hashes(toks), len(toks) + 1, no_read=True) == 0
    assert sched.pool.statistics().lookups == before
    assert sched.plan_load("b", [5, 6, 7], 0) is None
    # It may still store.
    other = tokens(38, 1)
    sched.update("b", [9], hashes(other), len(other))
    assert sched.plan_stores() is not None


def test_store_plan_never_evicts_its_own_skipped_blocks() -> None:
    # FM-22: with the pool full and key 2 cached, storing [2, 3, 4, 5] keeps key 2.
    sched = make(num_blocks=4)
    shared = tokens(39, 1)
    run_request(sched, "x", shared, [0])
    run_request(sched, "y", tokens(40, 3), [1, 2, 3])  # pool full; "x" is the LRU block
    lru_before = [b.block_id for b in sched.pool._free]
    toks = shared + tokens(41, 3)  # block 0 is shared with "x"
    hs = hashes(toks)
    sched.update("z", [4, 5, 6, 7], hs, len(toks))
    plan = sched.plan_stores()
    assert plan is not None
    assert hs[0] not in plan.block_hashes
    assert sched.pool.is_cached(hs[0])
    assert plan.num_blocks == 3
    # The skipped block kept its LRU position: the three evicted ones were behind it.
    assert lru_before[0] == sched.pool.get_cached(hs[0]).block_id
    sched.complete(plan, ok=True)
    assert sched.lookup("q", hs, len(hs) * BS + 1) == 4 * BS


def test_full_pool_of_pins_defers_promptly() -> None:
    # FM-20 / FM-21 / FM-24: nothing evictable -> deferral, not eviction or a hang.
    sched = make(num_blocks=2)
    a = tokens(42, 2)
    run_request(sched, "a", a, [0, 1])
    assert sched.lookup("b", hashes(a), len(a) + 1) == 2 * BS  # pins both
    c = tokens(43, 1)
    sched.update("c", [5], hashes(c), len(c))
    assert sched.plan_stores() is None
    assert sched.request_state("c").num_stored_blocks == 0
    sched.release("b")
    assert sched.plan_stores() is not None


def test_finish_and_final_store_in_every_order() -> None:
    # FM-29: (update, plan_stores, finish, complete) in the orders an engine may use.
    toks = tokens(44, 2)
    hs = hashes(toks)
    for order in ("store-finish-complete", "store-complete-finish", "finish-first"):
        sched = make()
        sched.update("a", [0, 1], hs, len(toks))
        if order == "finish-first":
            sched.finish("a")
            assert sched.plan_stores() is None
            assert not sched.has_request("a")
            continue
        plan = sched.plan_stores()
        assert plan is not None
        if order == "store-finish-complete":
            sched.finish("a")
            sched.complete(plan, ok=True)
        else:
            sched.complete(plan, ok=True)
            sched.finish("a")
        assert not sched.has_request("a")
        assert sched.pool.num_cached == 2
        sched.check_invariants()


def test_abort_at_each_stage_releases_everything() -> None:
    # FM-18 / FM-28: finish at every lifecycle stage returns every counter to zero.
    toks = tokens(45, 3)
    hs = hashes(toks)
    for stage in ("queued", "pinned", "loading", "storing", "done"):
        sched, sim = make(), SimKV()
        run_request(sched, "seed", toks, [0, 1, 2], sim)
        plan = None
        if stage in {"pinned", "loading"}:
            hit = sched.lookup("r", hs, len(toks) + 1)
            if stage == "loading":
                plan = sched.plan_load("r", [5, 6, 7], hit)
        elif stage == "storing":
            other = tokens(46, 2)
            sched.update("r", [5, 6], hashes(other), len(other))
            plan = sched.plan_stores()
        elif stage == "queued":
            sched.update("r", [], [], 0)
        if stage != "done":
            sched.finish("r")
        if plan is not None:
            sched.complete(plan, ok=True)
        sched.check_invariants()
        assert sched.pool.num_free == sched.pool.num_blocks, stage
        assert not sched.has_request("r"), stage


def test_many_hit_miss_cycles_return_to_baseline() -> None:
    # FM-16: 10,000 hit/miss cycles leak nothing.
    sched = make(num_blocks=8)
    warm = tokens(47, 2)
    run_request(sched, "warm", warm, [0, 1])
    hs = hashes(warm)
    for i in range(10_000):
        rid = f"r{i}"
        hit = sched.lookup(rid, hs if i % 2 else hashes(tokens(48 + i % 3, 2)), 2 * BS + 1)
        plan = sched.plan_load(rid, [3, 4], hit)
        if plan is not None:
            sched.complete(plan, ok=True)
        sched.finish(rid)
        assert sched.pool.num_free == 8
    stats = sched.statistics()
    assert stats.live_requests == 0
    assert stats.loaded_blocks == 5_000 * 2
    sched.check_invariants()


def test_lazy_mode_stores_blocks_closest_to_eviction() -> None:
    sched = make(num_blocks=8, store_mode="lazy", lazy_offload_blocks=3)
    toks = tokens(50, 5)
    hs = hashes(toks)

    class View:
        def __init__(self, order: list[tuple[int, BlockHash]]) -> None:
            self.order = order
            self.walked = 0

        def iter_eviction_order(self):
            for item in self.order:
                self.walked += 1
                yield item

    view = View([(g, h) for g, h in zip([4, 3, 2, 1, 0], hs[::-1], strict=True)])
    with pytest.raises(ValueError, match="lazy"):
        sched.plan_stores()
    plan = sched.plan_stores(view)
    assert plan is not None
    assert plan.gpu_block_ids == (4, 3, 2)
    assert plan.block_hashes == tuple(hs[::-1][:3])
    assert view.walked == 3  # only the configured window is walked
    assert plan.request_ids == ()
    assert sched.plan_stores(view) is None  # in flight: nothing new
    sched.complete(plan, ok=True)
    assert sched.plan_stores(view) is None  # cached: still nothing
    view.order = view.order[3:] + view.order[:3]
    plan2 = sched.plan_stores(view)
    assert plan2 is not None
    assert plan2.gpu_block_ids == (1, 0)
    sched.complete(plan2, ok=True)
    assert sched.lookup("q", hs, len(toks) + 1) == 5 * BS
    sched.check_invariants()


def test_misuse_names_the_request() -> None:
    sched = make()
    toks = tokens(51, 2)
    with pytest.raises(UnknownRequestError, match="'ghost'"):
        sched.plan_load("ghost", [0], BS)
    with pytest.raises(UnknownRequestError, match="'ghost'"):
        sched.release("ghost")
    sched.update("a", [0, 1], hashes(toks), len(toks))
    with pytest.raises(ValueError, match="'a'.*shrank"):
        sched.update("a", [0], hashes(toks), len(toks))
    with pytest.raises(ValueError, match="'a'.*changed"):
        sched.update("a", [0, 9], hashes(toks), len(toks))
    with pytest.raises(ValueError, match="'a'.*negative"):
        sched.update("a", [0, 1], hashes(toks), -1)
    with pytest.raises(ValueError, match="'a'"):
        sched.plan_load("a", [0, 1], 3)
    other = tokens(52, 3)
    run_request(sched, "seed", other, [5, 6, 7])
    assert sched.lookup("b", hashes(other), len(other) + 1) == 3 * BS
    with pytest.raises(ValueError, match="'b'.*block table has 2"):
        sched.plan_load("b", [8, 9], 3 * BS)
    with pytest.raises(ValueError, match="'b'.*pinned hit is 12"):
        sched.plan_load("b", [8, 9, 10, 11], 4 * BS)
    held = tokens(53, 1)
    sched.update("c", [12], hashes(held), len(held))
    assert sched.plan_stores() is not None  # "c" keeps its state while this is in flight
    sched.finish("c")
    with pytest.raises(RequestStateError, match="'c'"):
        sched.preempt("c")
    with pytest.raises(RequestStateError, match="'c'.*already finished"):
        sched.finish("c")
    with pytest.raises(RequestStateError, match="'c'"):
        sched.lookup("c", hashes(held), len(held))


def test_cached_block_found_after_the_pool_is_spent_stays_allocatable() -> None:
    # Found by the state machine: a cached block skipped after the plan used every free
    # block must not be protected, or the plan could not be allocated.
    sched = make(num_blocks=2)
    shared = tokens(54, 1)
    run_request(sched, "r0", shared, [0], finish=False)
    other = tokens(55, 2)
    sched.update("r1", [1, 2], hashes(other), len(other))
    sched.update("r2", [3], hashes(shared), len(shared))
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.block_hashes == tuple(hashes(other))
    sched.check_invariants()


def test_in_flight_protection_lives_in_the_block_refs() -> None:
    # FM-06: protection comes from each block's own ref count, not from request
    # metadata: allocating straight from the pool, bypassing the scheduler, still
    # cannot take a block whose store is in flight.
    sched = make(num_blocks=6)
    toks = tokens(60, 3)
    sched.update("a", [0, 1, 2], hashes(toks), len(toks))
    plan = sched.plan_stores()
    assert plan is not None
    in_flight = set(plan.cpu_block_ids)
    grabbed = sched.pool.allocate(sched.pool.num_free)
    assert in_flight.isdisjoint(b.block_id for b in grabbed)
    with pytest.raises(OutOfBlocksError):
        sched.pool.allocate(1)
    sched.pool.free(grabbed)
    sched.complete(plan, ok=True)
    sched.check_invariants()


def test_concurrent_loads_under_pressure_keep_each_others_blocks() -> None:
    # FM-23: a block being loaded for A is not evicted by B's load or by new stores.
    sched, sim = make(num_blocks=4), SimKV()
    a, b = tokens(61, 2), tokens(62, 2)
    run_request(sched, "sa", a, [0, 1], sim)
    run_request(sched, "sb", b, [2, 3], sim)
    hit_a = sched.lookup("A", hashes(a), len(a) + 1)
    hit_b = sched.lookup("B", hashes(b), len(b) + 1)
    load_a = sched.plan_load("A", [10, 11], hit_a)
    load_b = sched.plan_load("B", [12, 13], hit_b)
    assert load_a is not None
    assert load_b is not None
    c = tokens(63, 2)
    sim.compute([20, 21], hashes(c))
    sched.update("C", [20, 21], hashes(c), len(c))
    assert sched.plan_stores() is None  # every block is held by a load: deferred
    sim.execute(load_b)
    sched.complete(load_b, ok=True)
    sim.execute(load_a)
    sched.complete(load_a, ok=True)
    assert [sim.gpu[10], sim.gpu[11]] == hashes(a)
    assert [sim.gpu[12], sim.gpu[13]] == hashes(b)
    sched.check_invariants()


def test_a_store_is_invisible_until_completed_and_never_if_failed() -> None:
    # FM-31: lookups never see a block whose copy is still running or failed.
    sched = make()
    toks = tokens(64, 3)
    hs = hashes(toks)
    sched.update("w", [0, 1, 2], hs, len(toks))
    ok_plan = sched.plan_stores()
    assert ok_plan is not None
    assert sched.lookup("r1", hs, len(toks) + 1) == 0
    sched.complete(ok_plan, ok=True)
    assert sched.lookup("r1", hs, len(toks) + 1) == 3 * BS
    other = tokens(65, 2)
    sched.update("w2", [5, 6], hashes(other), len(other))
    bad_plan = sched.plan_stores()
    assert bad_plan is not None
    assert sched.lookup("r2", hashes(other), len(other) + 1) == 0
    sched.complete(bad_plan, ok=False)
    assert sched.lookup("r2", hashes(other), len(other) + 1) == 0
