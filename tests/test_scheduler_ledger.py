"""The block ledger (every CPU-block reference, two-phase) and the request phases."""

from __future__ import annotations

import pytest
from scheduler_helpers import BS, hashes, make, tokens

from kvoffload.errors import InvariantError, RequestStateError
from kvoffload.pool import CpuBlockPool
from kvoffload.scheduler import BlockLedger, RequestPhase
from kvoffload.scheduler.group_state import GroupedRequest, Lane


def test_store_is_pending_until_closed_and_publishes_once() -> None:
    ledger = BlockLedger(CpuBlockPool(4))
    hs = hashes(tokens(1, 2))
    plan = ledger.open_store(hs, [0, 1], ("a",), protect=set(), evicted=[], ends=None)
    assert set(ledger.pending) == set(hs)
    assert ledger.pool.num_cached == 0
    ledger.check_invariants()
    rec = ledger.close(plan.plan_id, ok=True)
    assert rec is not None
    assert rec.published == 2
    assert not ledger.pending
    assert ledger.pool.num_cached == 2
    assert ledger.pool.num_free == 4
    assert ledger.close(plan.plan_id, ok=True) is None  # closed once
    ledger.check_invariants()


def test_failed_and_cancelled_stores_publish_nothing() -> None:
    ledger = BlockLedger(CpuBlockPool(4))
    hs = hashes(tokens(2, 2))
    failed = ledger.open_store(hs[:1], [0], ("a",), protect=set(), evicted=[], ends=None)
    cancelled = ledger.open_store(hs[1:], [1], ("a",), protect=set(), evicted=[], ends=None)
    ledger.close(failed.plan_id, ok=False)
    ledger.cancel(cancelled.plan_id)
    assert not ledger.pending
    assert ledger.pool.num_cached == 0
    assert ledger.pool.num_free == 4
    ledger.check_invariants()


def test_a_promotion_skips_pending_and_published_hashes() -> None:
    ledger = BlockLedger(CpuBlockPool(6))
    hs = hashes(tokens(3, 4))
    stored = ledger.open_store(hs[:1], [0], ("a",), protect=set(), evicted=[], ends=None)
    ledger.close(stored.plan_id, ok=True)  # hs[0] published
    ledger.open_store(hs[1:2], [1], ("a",), protect=set(), evicted=[], ends=None)  # pending
    promotion = ledger.open_promotion(list(enumerate(hs)), protect=set())
    assert promotion is not None
    assert [h for _, h in promotion.wanted] == hs[2:]
    assert ledger.pending[hs[2]] is promotion.blocks[0]
    ledger.check_invariants()
    assert ledger.close_promotion(promotion, [True, False]) == [True, False]
    assert ledger.pool.is_cached(hs[2])
    assert not ledger.pool.is_cached(hs[3])
    assert not ledger.tier_refs()
    ledger.check_invariants()


def test_a_reset_promotion_publishes_nothing() -> None:
    ledger = BlockLedger(CpuBlockPool(4))
    hs = hashes(tokens(4, 2))
    promotion = ledger.open_promotion(list(enumerate(hs)), protect=set())
    assert promotion is not None
    ledger.reset()
    assert ledger.close_promotion(promotion, [True, True]) == [False, False]
    assert ledger.pool.num_cached == 0
    assert ledger.pool.num_free == 4
    ledger.check_invariants()


def test_write_down_refs_are_counted_and_released() -> None:
    ledger = BlockLedger(CpuBlockPool(4))
    hs = hashes(tokens(5, 1))
    plan = ledger.open_store(hs, [0], ("a",), protect=set(), evicted=[], ends=None)
    ledger.close(plan.plan_id, ok=True)
    block = ledger.pool.get_cached(hs[0])
    assert block is not None
    ledger.open_write_down([block])
    assert ledger.tier_refs() == {block.block_id: 1}
    assert block.ref_cnt == 1
    ledger.check_invariants()
    ledger.close_write_down([block])
    assert not ledger.tier_refs()
    assert block.ref_cnt == 0
    with pytest.raises(KeyError):
        ledger.close_write_down([block])


def test_check_invariants_sees_a_reference_taken_behind_its_back() -> None:
    ledger = BlockLedger(CpuBlockPool(4))
    hs = hashes(tokens(6, 1))
    plan = ledger.open_store(hs, [0], ("a",), protect=set(), evicted=[], ends=None)
    ledger.close(plan.plan_id, ok=True)
    block = ledger.pool.get_cached(hs[0])
    assert block is not None
    ledger.pool.touch([block])  # not through the ledger
    with pytest.raises(InvariantError, match=f"block {block.block_id}: ref_cnt 1"):
        ledger.check_invariants()


def test_unpin_of_a_list_that_is_not_a_pin_is_refused() -> None:
    ledger = BlockLedger(CpuBlockPool(2))
    with pytest.raises(InvariantError, match="not a pin"):
        ledger.unpin([ledger.pool.block(0)])


def test_scheduler_pins_live_in_the_ledger() -> None:
    sched = make()
    hs = hashes(tokens(7, 3))
    sched.update("a", [0, 1, 2], hs, 3 * BS)
    plan = sched.plan_stores()
    assert plan is not None
    assert sched.ledger.pending.keys() == set(hs)
    sched.complete(plan, ok=True)
    assert sched.lookup("b", hs, 3 * BS + 1) == 3 * BS
    assert [list(p) for p in sched.ledger.pins()] == [sched.request_state("b").pinned]
    sched.check_invariants()
    sched.release("b")
    assert not list(sched.ledger.pins())
    sched.check_invariants()


def test_lookup_with_allow_defer_asks_again_while_the_store_is_in_flight() -> None:
    sched = make()
    hs = hashes(tokens(8, 2))
    sched.update("a", [0, 1], hs, 2 * BS)
    plan = sched.plan_stores()
    assert plan is not None
    assert sched.lookup("b", hs, 2 * BS + 1, allow_defer=True) is None  # the store is in flight
    assert sched.lookup("c", hs, 2 * BS + 1) == 0
    sched.complete(plan, ok=True)
    assert sched.lookup("b", hs, 2 * BS + 1, allow_defer=True) == 2 * BS
    sched.check_invariants()


def test_phases_follow_the_request() -> None:
    sched = make(hold_blocks_on_finish=True)
    hs = hashes(tokens(9, 2))
    sched.update("a", [0, 1], hs, 2 * BS)
    assert sched.request_state("a").phase is RequestPhase.LIVE
    sched.preempt("a")
    assert sched.request_state("a").phase is RequestPhase.PREEMPTED
    sched.update("a", [2, 3], hs, 2 * BS)
    state = sched.request_state("a")
    assert state.phase is RequestPhase.LIVE
    assert sched.finish("a") == (2, 3)  # nothing stored yet: held
    assert state.phase is RequestPhase.HOLDING
    assert state.finished
    plan = sched.plan_stores()
    assert plan is not None
    assert state.phase is RequestPhase.DRAINING
    sched.complete(plan, ok=True)
    assert not sched.has_request("a")
    sched.check_invariants()


def in_phase(phase: RequestPhase) -> GroupedRequest:
    """A request state in ``phase`` (its flags and its lane's hold, as the scheduler sets
    them)."""
    state = GroupedRequest("r", {"g0": Lane(full=BS)})
    state.finished = phase in {RequestPhase.HOLDING, RequestPhase.DRAINING}
    state.preempted = phase is RequestPhase.PREEMPTED
    if phase is RequestPhase.HOLDING:
        state.lanes["g0"].held = [0]
    assert state.phase is phase
    return state


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (RequestPhase.HOLDING, RequestPhase.LIVE),
        (RequestPhase.DRAINING, RequestPhase.LIVE),
        (RequestPhase.DRAINING, RequestPhase.PREEMPTED),
        (RequestPhase.HOLDING, RequestPhase.HOLDING),
    ],
)
def test_a_transition_that_may_not_happen_names_both_phases(
    source: RequestPhase, target: RequestPhase
) -> None:
    state = in_phase(source)
    with pytest.raises(RequestStateError, match=f"'r'.*{source.value!r}.*{target.value!r}"):
        state.move_to(target)
    assert state.phase is source


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (RequestPhase.LIVE, RequestPhase.PREEMPTED),
        (RequestPhase.PREEMPTED, RequestPhase.LIVE),
        (RequestPhase.LIVE, RequestPhase.DRAINING),
        (RequestPhase.PREEMPTED, RequestPhase.DRAINING),
    ],
)
def test_a_transition_that_may_happen_is_made(source: RequestPhase, target: RequestPhase) -> None:
    state = in_phase(source)
    state.move_to(target)
    assert state.phase is target


def test_the_scheduler_changes_a_phase_only_through_the_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """preempt(), update() and finish() each ask the one transition rule: with a rule
    that allows none of their moves, each is refused naming both phases."""
    import kvoffload.scheduler.state as state_module  # noqa: PLC0415

    sched = make()
    hs = hashes(tokens(9, 2))
    sched.update("a", [0, 1], hs, 2 * BS)
    rule = dict(state_module._NEXT)
    monkeypatch.setitem(state_module._NEXT, "live", ())
    with pytest.raises(RequestStateError, match="'live'.*'preempted'"):
        sched.preempt("a")
    with pytest.raises(RequestStateError, match="'live'.*'draining'"):
        sched.finish("a")
    state = sched.request_state("a")  # each refusal changed nothing
    assert (state.phase, state.gpu_block_ids, state.num_computed_tokens) == (
        RequestPhase.LIVE,
        [0, 1],
        2 * BS,
    )
    monkeypatch.setitem(state_module._NEXT, "live", rule["live"])
    sched.preempt("a")
    monkeypatch.setitem(state_module._NEXT, "preempted", ())
    with pytest.raises(RequestStateError, match="'preempted'.*'live'"):
        sched.update("a", [2, 3], hs, 2 * BS)
    assert (state.phase, state.gpu_block_ids) == (RequestPhase.PREEMPTED, [])
    sched.check_invariants()
