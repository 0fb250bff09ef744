"""The one-group rules that guard against wrong KV, with several KV cache groups through
the same helpers: a table whose entries a store may still read changed or shrank is
refused (`check_known_entries()`); a store plan cancelled after its request finished
never plans the GPU blocks the engine freed (one group and several alike)."""

from __future__ import annotations

import pytest
from groups_helpers import Rig, group

from kvoffload.config import OffloadConfig
from kvoffload.errors import BlockTableError, InputTypeError, InvalidInputError
from kvoffload.hashing import BlockHasher, HashNamespace
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler

TOKENS = list(range(16))


def full_and_window(**kw: object) -> Rig:
    return Rig(
        [group("f", "full", 4), group("w", "sliding_window", 4, window=8)],
        checkpoint_tokens=8,
        **kw,  # type: ignore[arg-type]
    )


def started(rig: Rig) -> dict[str, list[int | None]]:
    """Request "a" computed 8 of 16 tokens, and its first stores are planned (full
    lane's cursor at block 2, the window's at its point 8)."""
    tables: dict[str, list[int | None]] = {"f": [0, 1, 2, 3], "w": [4, 5, 6, 7]}
    rig.sched.update("a", tables, rig.hashes(TOKENS), 8)
    assert rig.sched.plan_stores() is not None
    return tables


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"f": [0, 1, 9, 3]}, r"request 'a': tables\['f'\]\[2\] changed from 2 to 9 since"),
        ({"f": [0, 1]}, r"request 'a': tables\['f'\] shrank from 4 to 2 entries"),
        ({"w": [4, 5, 6, 9]}, r"request 'a': tables\['w'\]\[3\] changed from 7 to 9 since"),
        ({"w": [4, 5]}, r"request 'a': tables\['w'\] shrank from 4 to 2 entries"),
    ],
)
def test_a_table_entry_a_store_still_reads_may_not_change(
    change: dict[str, list[int | None]], message: str
) -> None:
    rig = full_and_window()
    tables = started(rig)
    with pytest.raises(BlockTableError, match=message):
        rig.sched.update("a", {**tables, **change}, rig.hashes(TOKENS), 16)
    # refused: nothing changed, the next store reads the blocks the request computed
    rig.sched.update("a", tables, rig.hashes(TOKENS), 16)
    plan = rig.sched.plan_stores()
    assert plan is not None
    assert plan.plans["f"].gpu_block_ids == (2, 3)
    rig.sched.check_invariants()


def test_an_entry_may_become_none_or_change_below_the_cursor() -> None:
    """What several groups take that one group does not name: a block the engine no
    longer holds (``None``, never stored), and an entry below the store cursor, which no
    store reads (read from the table as it is now)."""
    rig = full_and_window()
    started(rig)
    rig.sched.update("a", {"f": [0, 8, 2, None], "w": [None, 5, 6, 7]}, rig.hashes(TOKENS), 16)
    plan = rig.sched.plan_stores()
    assert plan is not None
    assert plan.plans["f"].gpu_block_ids == (2,)  # the nulled block 3 is not stored
    rig.sched.check_invariants()


HOLD = {"hold_blocks_on_finish": True, "hold_max_blocks": 6, "max_store_blocks_per_step": 2}


def test_one_group_a_store_cancelled_after_finish_never_reads_a_freed_block() -> None:
    config = OffloadConfig(num_cpu_blocks=16, block_size=4, **HOLD)  # type: ignore[arg-type]
    sched = OffloadScheduler(config, CpuBlockPool(16), num_gpu_blocks=40)
    hasher = BlockHasher(HashNamespace(model_id="t").root, 4)
    hasher.extend(list(range(12)))
    sched.update("a", [4, 5, 6], list(hasher.block_hashes), 12)
    plan = sched.plan_stores()
    assert plan is not None
    assert plan.gpu_block_ids == (4, 5)
    assert sched.finish("a") == (6,)  # the engine may free 4 and 5 once the plan ends
    assert sched.cancel(plan)  # it ends: 4 and 5 may hold another request's KV now
    again = sched.plan_stores()
    assert again is not None
    assert again.gpu_block_ids == (6,)  # only the block the engine still holds
    assert sched.take_released_holds() == [6]
    sched.check_invariants()


def test_several_groups_a_store_cancelled_after_finish_never_reads_a_freed_block() -> None:
    rig = Rig(
        [group("f", "full", 4), group("g", "full", 4)],
        config=OffloadConfig(num_cpu_blocks=64, block_size=4, **HOLD),  # type: ignore[arg-type]
    )
    sched = rig.sched
    tables: dict[str, list[int | None]] = {"f": [4, 5, 6], "g": [14, 15, 16]}
    sched.update("a", tables, rig.hashes(list(range(12))), 12)
    plan = sched.plan_stores()
    assert plan is not None
    assert {n: p.gpu_block_ids for n, p in plan.plans.items()} == {"f": (4, 5), "g": (14, 15)}
    assert sched.finish("a") is None
    assert sched.held_blocks("a") == {"f": [6], "g": [16]}
    for name, sub in plan.plans.items():
        assert sched.cancel(name, sub)
    again = sched.plan_stores()
    assert again is not None
    assert {n: p.gpu_block_ids for n, p in again.plans.items()} == {"f": (6,), "g": (16,)}
    assert sched.take_released_holds() == {"f": [6], "g": [16]}
    sched.check_invariants()


def test_a_plan_completed_under_another_groups_name_is_ignored() -> None:
    """Each group's ledger counts its plan ids from 0: ``complete("g", f's plan 0)``
    must not publish g's plan 0, whose copy may not have run (ignored, as one group
    ignores an unknown plan); an unknown group is named."""
    rig = Rig([group("f", "full", 4), group("g", "full", 4)])
    sched = rig.sched
    sched.update("a", {"f": [0, 1, 2, 3], "g": [4, 5, 6, 7]}, rig.hashes(TOKENS), 16)
    plan = sched.plan_stores()
    assert plan is not None
    f_plan, g_plan = plan.plans["f"], plan.plans["g"]
    assert f_plan.plan_id == g_plan.plan_id
    assert not sched.complete("g", f_plan, True)
    assert not sched.cancel("g", f_plan)
    stats = sched.statistics()["g"]
    assert (stats.cached_cpu_blocks, stats.stored_blocks, stats.in_flight_plans) == (0, 0, 1)
    assert stats.ignored_completions == 2
    with pytest.raises(InvalidInputError, match=r"group='nope' is not a cacheable group"):
        sched.complete("nope", f_plan, True)
    sched.check_invariants()
    assert sched.complete("g", g_plan, True)
    assert sched.statistics()["g"].stored_blocks == 4
    sched.check_invariants()


def test_one_group_ignores_another_schedulers_plan_of_the_same_id() -> None:
    config = OffloadConfig(num_cpu_blocks=16, block_size=4)
    hasher = BlockHasher(HashNamespace(model_id="t").root, 4)
    hasher.extend(list(range(8)))
    mine, other = (OffloadScheduler(config, CpuBlockPool(16)) for _ in range(2))
    mine.update("a", [0, 1], list(hasher.block_hashes), 8)
    other.update("b", [5, 6], list(hasher.block_hashes), 8)
    plan, foreign = mine.plan_stores(), other.plan_stores()
    assert plan is not None
    assert foreign is not None
    assert plan.plan_id == foreign.plan_id
    assert not mine.complete(foreign, True)
    assert mine.pool.num_cached == 0
    assert mine.complete(plan, True)
    assert mine.pool.num_cached == 2
    mine.check_invariants()


@pytest.mark.parametrize("shape", ["one group", "two groups"])
def test_a_load_into_other_blocks_than_update_was_given_is_refused(shape: str) -> None:
    rig = Rig([group("f", "full", 4), group("g", "full", 4)])
    sched = rig.sched
    prompt = list(range(17))
    h = rig.hashes(prompt)
    sched.update("a", {"f": [0, 1, 2, 3], "g": [4, 5, 6, 7]}, h, 16)
    stores = sched.plan_stores()
    assert stores is not None
    sched.complete_all(stores, True)
    if shape == "one group":
        config = OffloadConfig(num_cpu_blocks=16, block_size=4)
        one = OffloadScheduler(config, CpuBlockPool(16))
        hasher = BlockHasher(HashNamespace(model_id="t").root, 4)
        hasher.extend(prompt)
        hashes = list(hasher.block_hashes)
        one.update("a", [0, 1, 2, 3], hashes, 16)
        first = one.plan_stores()
        assert first is not None
        one.complete(first, True)
        assert one.lookup("b", hashes, 17) == 16
        one.update("b", [10, 11], hashes, 0)
        with pytest.raises(BlockTableError, match=r"gpu_block_ids\[0\]=20 differs from the"):
            one.plan_load("b", [20, 21, 22, 23], 16)
        assert one.plan_load("b", [10, 11, 22, 23], 16) is not None  # the pin was kept
        one.check_invariants()
        return
    assert sched.lookup("b", h, 17) == 16
    sched.update("b", {"f": [10, 11], "g": [12, 13]}, h, 0)
    with pytest.raises(BlockTableError, match=r"tables\['f'\]\[0\]=20 differs from the"):
        sched.plan_load("b", {"f": [20, 21, 22, 23], "g": [12, 13, 26, 27]}, 16)
    load = sched.plan_load("b", {"f": [10, 11, 22, 23], "g": [12, 13, 26, 27]}, 16)
    assert load is not None  # the pins were kept
    assert load.plans["f"].gpu_block_ids == (10, 11, 22, 23)
    sched.check_invariants()


def test_a_negative_count_is_named_alike_with_one_group_and_several() -> None:
    rig = full_and_window()
    with pytest.raises(InvalidInputError) as several:
        rig.sched.update("a", {"f": [0], "w": [1]}, rig.hashes(TOKENS[:4]), -4)
    one = OffloadScheduler(OffloadConfig(num_cpu_blocks=4, block_size=4), CpuBlockPool(4))
    with pytest.raises(InvalidInputError) as single:
        one.update("a", [0], [], -4)
    assert str(several.value) == str(single.value)
    assert str(single.value) == "request 'a': num_computed_tokens=-4 is negative"
    assert not rig.sched.has_request("a")


def test_one_group_refuses_a_mapping_per_group_name_naming_it() -> None:
    one = OffloadScheduler(OffloadConfig(num_cpu_blocks=4, block_size=4), CpuBlockPool(4))
    several = r"got dict \(one per group name is for several KV cache groups\)"
    with pytest.raises(InputTypeError, match=rf"request 'a': gpu_block_ids must be .*{several}"):
        one.update("a", {"full": [0, 1]}, [], 0)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match=rf"request 'a': block_hashes must be .*{several}"):
        one.update("a", [0, 1], {"full": []}, 0)  # type: ignore[arg-type]
    assert not one.has_request("a")
