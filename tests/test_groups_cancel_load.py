"""A grouped load cancelled before its copy started gives its hit back, as one group's does
(tests/test_scheduler_input.py::test_cancelled_load_pins_the_hit_again): once every part
of the load was cancelled, each group's CPU blocks are that lane's lookup pin again and the
request's hit is restored, so `plan_load()` with the same hit plans the same CPU blocks.

Until the last part is cancelled, the parts cancelled so far keep their CPU blocks
referenced (as their plans did; counted in ``pinned_blocks``) but no lane pins them and
the request has no hit: it looks as it did while its load was in flight. A part that
completed or failed, or a lookup, release, finish, preemption, abandonment or reset in
between, releases the cancelled parts' blocks instead."""

from __future__ import annotations

import pytest

from kvoffload import KVOffloader, PinnerError
from kvoffload.errors import InvalidInputError
from kvoffload.groups import KVCacheGroup, needed
from kvoffload.scheduler.groups import GroupedPlan
from tests.groups_helpers import Rig, group
from tests.test_groups import Tables, tokens
from tests.test_offloader_faults import FlakyPinner
from tests.test_offloader_groups import Model, config, engines_for, groups_of, serve
from tests.test_offloader_groups import Tables as Tables_

pytestmark = pytest.mark.anyio

SHAPES = ["full+sliding", "full+full"]


def groups(shape: str) -> list[KVCacheGroup]:
    if shape == "full+sliding":
        return [group("attn", "full", 4), group("win", "sliding_window", 4, window=9)]
    return [group("f", "full", 4), group("g", "full", 4)]


def stored_rig(shape: str) -> Rig:
    """A rig whose pools hold request ``a``'s 16 tokens in every group."""
    rig = Rig(groups(shape), checkpoint_tokens=16)
    tabs = Tables(rig, 16)
    rig.fill(tabs.t)
    rig.sched.update("a", tabs.t, rig.hashes(tokens(16)), 16)
    rig.run(rig.sched.plan_stores())
    rig.run(rig.sched.finish("a"))
    return rig


def loaded(rig: Rig) -> tuple[dict[str, list[int | None]], GroupedPlan]:
    """Request ``b`` looked up its 16-token hit and planned its load into fresh tables."""
    assert rig.sched.lookup("b", rig.hashes(tokens(17)), 17) == 16
    tables = Tables(rig, 16).t
    plan = rig.sched.plan_load("b", tables, 16)
    assert plan is not None
    assert set(plan.plans) == {g.name for g in rig.groups}
    return tables, plan


def pins(rig: Rig, rid: str) -> dict[str, list[int] | None]:
    lanes = rig.sched.request_table.requests[rid].lanes
    return {
        name: None if lane.pin is None else [b.block_id for b in lane.pin]
        for name, lane in lanes.items()
    }


def pinned_blocks(rig: Rig) -> dict[str, int]:
    return {name: s.pinned_blocks for name, s in rig.sched.statistics().items()}


def all_free(rig: Rig) -> bool:
    return all(p.num_free == p.num_blocks for p in rig.pools.values())


@pytest.mark.parametrize("shape", SHAPES)
def test_every_part_cancelled_pins_the_hit_again(shape: str) -> None:
    rig = stored_rig(shape)
    tables, plan = loaded(rig)
    for name, sub in plan.plans.items():
        assert rig.sched.cancel(name, sub)
    rig.sched.check_invariants()
    want = {name: list(sub.cpu_block_ids) for name, sub in plan.plans.items()}
    assert pins(rig, "b") == want
    again = rig.sched.plan_load("b", tables, 16)  # the same hit, the same tables
    assert again is not None
    assert {n: s.cpu_block_ids for n, s in again.plans.items()} == {
        n: s.cpu_block_ids for n, s in plan.plans.items()
    }
    assert {n: s.gpu_block_ids for n, s in again.plans.items()} == {
        n: s.gpu_block_ids for n, s in plan.plans.items()
    }
    rig.sched.check_invariants()
    rig.run(again)
    rig.check_bytes(tables, {g.name: needed(g, 16) for g in rig.groups})
    rig.sched.finish("b")
    rig.sched.check_invariants()
    assert all_free(rig)


@pytest.mark.parametrize("shape", SHAPES)
def test_one_part_cancelled_shows_no_half_pin(shape: str) -> None:
    """Between two part cancels the cancelled part's blocks stay referenced (as its plan
    kept them) but are no lane's pin: no hit, no pin anywhere, invariants hold."""
    rig = stored_rig(shape)
    _, plan = loaded(rig)
    (first, sub), (second, other) = plan.plans.items()
    assert rig.sched.cancel(first, sub)
    rig.sched.check_invariants()
    assert pins(rig, "b") == {first: None, second: None}
    assert pinned_blocks(rig) == {first: sub.num_blocks, second: 0}
    with pytest.raises(InvalidInputError, match="must be 0 or the lookup.s hit 0"):
        rig.sched.plan_load("b", Tables(rig, 16).t, 16)  # no hit to load yet
    assert rig.sched.cancel(second, other)
    rig.sched.check_invariants()
    assert pins(rig, "b") == {n: list(s.cpu_block_ids) for n, s in plan.plans.items()}
    rig.sched.release("b")
    rig.sched.check_invariants()
    assert pinned_blocks(rig) == {first: 0, second: 0}
    rig.sched.finish("b")
    assert all_free(rig)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("outcome", [True, False])
def test_a_part_that_completed_releases_the_cancelled_ones(shape: str, outcome: bool) -> None:
    rig = stored_rig(shape)
    _, plan = loaded(rig)
    (first, sub), (second, other) = plan.plans.items()
    assert rig.sched.cancel(first, sub)
    assert rig.sched.complete(second, other, outcome)
    rig.sched.check_invariants()
    assert pins(rig, "b") == {first: None, second: None}
    assert pinned_blocks(rig) == {first: 0, second: 0}
    rig.sched.finish("b")
    assert all_free(rig)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("between", ["lookup", "release", "abandon"])
def test_a_call_between_two_part_cancels_releases_them(shape: str, between: str) -> None:
    rig = stored_rig(shape)
    _, plan = loaded(rig)
    (first, sub), (second, other) = plan.plans.items()
    assert rig.sched.cancel(first, sub)
    if between == "lookup":  # looked up again, here with no hit: nothing to restore
        assert rig.sched.lookup("b", rig.hashes(tokens(17, seed=3)), 17) == 0
    elif between == "release":
        rig.sched.release("b")
    else:
        rig.sched.abandon_load("b")
    rig.sched.check_invariants()
    assert rig.sched.cancel(second, other)
    rig.sched.check_invariants()
    assert pins(rig, "b") == {first: None, second: None}
    assert pinned_blocks(rig) == {first: 0, second: 0}
    rig.sched.finish("b")
    assert all_free(rig)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("between", ["reset", "preempt", "finish", "lookup"])
def test_cancels_after_a_reset_preemption_finish_or_lookup_release(
    shape: str, between: str
) -> None:
    rig = stored_rig(shape)
    _, plan = loaded(rig)
    if between == "reset":
        rig.sched.reset()
    elif between == "preempt":
        rig.sched.preempt("b")
    elif between == "finish":
        rig.sched.finish("b")
    else:
        assert rig.sched.lookup("b", rig.hashes(tokens(17, seed=3)), 17) == 0
    for name, sub in plan.plans.items():
        assert rig.sched.cancel(name, sub)
        rig.sched.check_invariants()
    assert pinned_blocks(rig) == {g.name: 0 for g in rig.groups}
    if rig.sched.has_request("b"):
        assert pins(rig, "b") == {g.name: None for g in rig.groups}
        rig.sched.finish("b")
    rig.sched.check_invariants()
    assert all_free(rig)


async def test_pin_failure_on_a_hybrid_load_keeps_the_hit_pinned() -> None:
    """`test_offloader_faults.py::test_pin_failure_on_load_keeps_the_hit_pinned` on a
    full + sliding window model with one pinner per group: the sliding window's pin
    fails, the launch cancels every part; the same load succeeds on the next call, with
    the right bytes."""
    model = Model(groups_of("sliding"))
    alloc = Tables_(model)
    engines, hosts = engines_for(model, {}, 32)
    pinners = {g.name: FlakyPinner() for g in model.groups}
    try:
        async with KVOffloader(
            config(), model.kv, groups=model.groups, copy_engine=engines, pinner=pinners
        ) as off:
            prompt = list(range(1, 18))  # 17 tokens: the hit is at 16
            hit, _ = await serve(off, model, alloc, "a", prompt)
            assert hit == 0
            model.wipe()
            sched = off._life.front.scheduler  # type: ignore[union-attr]
            with off.request("b", prompt) as req:
                hit = req.lookup()
                assert hit == 16
                tables = alloc.new(req.blocks_for(len(prompt)))
                pinners["swa"].fail_pin = True  # the full group's part was pinned
                with pytest.raises(PinnerError):
                    req.load(tables)
                pinners["swa"].fail_pin = False
                assert not pinners["full"].held
                sched.check_invariants()
                task = req.load(tables)
                assert task is not None
                await task
                model.check(tables, prompt, hit)
            await off.drain()
            sched.check_invariants()
            assert not any(p.held for p in pinners.values())
            stats = sched.statistics().values()
            assert all(s.free_cpu_blocks == s.num_cpu_blocks for s in stats)
    finally:
        for host in hosts.values():
            host.close()
