"""The whole model's plan counts (``store_plans``, ``load_plans`` of
`GroupedScheduler.totals`, the ``scheduler`` statistics of a `KVOffloader` and of the vLLM
connector): a plan counts once however many groups' parts it has, a finish's last store
counts as every other store plan, and a plan whose every part was cancelled (its copy
never started) is uncounted, as one group's plan is."""

from __future__ import annotations

import pytest
from scheduler_helpers import BS as ONE_BS
from scheduler_helpers import hashes, make, tokens

from kvoffload.errors import InvariantError
from kvoffload.scheduler.group_totals import GroupCounters, PlanParts
from tests.groups_helpers import Rig, group

BS = 4
SHAPES = {
    "full+swa": [group("full", "full", BS), group("swa", "sliding_window", BS, window=9)],
    "full+full": [group("a", "full", BS), group("b", "full", BS)],
}


def registered(shape: str, rid: str = "r", n_tokens: int = 32) -> Rig:
    r = Rig(SHAPES[shape], checkpoint_tokens=8)
    toks = list(range(n_tokens))
    tables: dict[str, list[int | None]] = {
        g.name: list(range(n_tokens // g.block_size)) for g in r.groups
    }
    r.sched.update(rid, tables, r.hashes(toks), n_tokens)
    return r


@pytest.mark.parametrize("shape", SHAPES)
def test_a_plan_of_several_parts_counts_once(shape: str) -> None:
    r = registered(shape)
    plan = r.sched.plan_stores()
    assert plan is not None
    assert len(plan.plans) == 2
    totals = r.sched.totals
    assert totals.store_plans == 1
    assert sum(s.store_plans for s in r.sched.statistics().values()) == 2  # per group
    r.run(plan)
    assert totals.store_plans == 1  # completion leaves it counted
    r.sched.check_invariants()


def test_a_finish_store_counts_as_a_store_plan() -> None:
    r = registered("full+swa", n_tokens=30)  # the last point (30) is not a step's
    step = r.sched.plan_stores()
    r.run(step)
    last = r.sched.finish("r")
    assert last is not None
    assert r.sched.totals.store_plans == 2
    r.run(last)
    r.sched.check_invariants()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_plan_whose_every_part_was_cancelled_is_uncounted(shape: str) -> None:
    r = registered(shape)
    plan = r.sched.plan_stores()
    assert plan is not None
    totals = r.sched.totals
    (first, a), (second, b) = plan.plans.items()
    assert r.sched.cancel(first, a)
    assert totals.store_plans == 1  # a part is still in flight
    assert r.sched.cancel(second, b)
    assert totals.store_plans == 0
    r.sched.check_invariants()
    again = r.sched.plan_stores()  # the cursors went back: planned again, counted again
    assert again is not None
    assert totals.store_plans == 1
    r.run(again)
    r.sched.check_invariants()


def test_a_load_whose_every_part_was_cancelled_is_uncounted() -> None:
    r = registered("full+full")
    r.run(r.sched.plan_stores())
    toks = list(range(32))
    hit = r.sched.lookup("q", r.hashes(toks), 33)
    assert hit == 32
    tables = {g.name: list(range(100, 108)) for g in r.groups}
    plan = r.sched.plan_load("q", tables, hit)
    assert plan is not None
    assert r.sched.totals.load_plans == 1
    for name, part in plan.plans.items():
        assert r.sched.cancel(name, part)
    assert r.sched.totals.load_plans == 0
    r.sched.check_invariants()


def test_a_plan_one_part_of_which_ran_stays_counted() -> None:
    r = registered("full+full")
    plan = r.sched.plan_stores()
    assert plan is not None
    (first, a), (second, b) = plan.plans.items()
    assert r.sched.complete(first, a, ok=True)
    assert r.sched.cancel(second, b)
    assert r.sched.totals.store_plans == 1
    r.sched.check_invariants()


def test_one_group_counts_as_its_lane() -> None:
    """One group's face reads its lane's counters: a cancelled plan is uncounted there
    too (the rule the whole model's count follows)."""
    sched = make()
    sched.update("a", [0, 1], hashes(tokens(1, 2)), 2 * ONE_BS)
    plan = sched.plan_stores()
    assert plan is not None
    assert sched.statistics().store_plans == 1
    assert sched.cancel(plan)
    assert sched.statistics().store_plans == 0
    assert sched.grouped.totals.store_plans == 0


def test_a_counted_part_the_ledger_does_not_know_breaks_an_invariant() -> None:
    r = registered("full+full")
    plan = r.sched.plan_stores()
    assert plan is not None
    parts = PlanParts(GroupCounters())
    parts.opened("store", plan.plans)
    ledgers = {g.name: r.sched.ledger(g.name) for g in r.groups}
    parts.check_invariants(ledgers)  # in flight: known to every ledger
    r.run(plan)  # the ledgers close the plan; this count was never told
    with pytest.raises(InvariantError, match="plan .* is counted as in flight"):
        parts.check_invariants(ledgers)
