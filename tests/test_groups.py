"""KV cache groups: the `needed()` table, the hit rule, stores at store points, null
entries, loads of exactly the needed blocks with exact bytes, and per-group lifecycles."""

from __future__ import annotations

import itertools

import pytest

from kvoffload.errors import ConfigError, InputTypeError, InvalidInputError, RequestStateError
from kvoffload.groups import (
    MAX_HIT_ALIGNMENT_TOKENS,
    KVCacheGroup,
    bytes_per_cached_token,
    check_groups,
    hit_alignment,
    needed,
    split_capacity,
    store_points,
)
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler.groups import GroupedScheduler
from tests.groups_helpers import Rig, group

FULL4 = group("attn", "full", 4)


class Tables:
    """Distinct GPU block ids per group for one request of ``n`` blocks per group."""

    ids = itertools.count()

    def __init__(self, rig: Rig, num_tokens: int) -> None:
        self.t = {
            g.name: [next(self.ids) % 256 for _ in range(num_tokens // g.block_size)]
            for g in rig.groups
        }


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 1000 + i) % 50_000 for i in range(n)]


# -- the rules -----------------------------------------------------------------------------


def test_needed_per_kind() -> None:
    assert needed(group("f", "full", 4), 18) == range(0, 4)
    # W=9, bs=4: cdiv(8, 4) = 2 blocks just before N
    sw = group("s", "sliding_window", 4, window=9)
    assert needed(sw, 18) == range(2, 4)
    assert needed(sw, 4) == range(0, 1)
    assert needed(sw, 0) == range(0, 0)
    ch = group("c", "chunked", 4, chunk=8)
    assert needed(ch, 20) == range(4, 5)
    assert needed(ch, 16) == range(4, 4)  # a chunk boundary needs nothing
    rec = group("r", "recurrent", 8)
    assert needed(rec, 24) == range(2, 3)
    assert needed(rec, 0) == range(0, 0)
    with pytest.raises(ValueError, match="multiple of block_size=8"):
        needed(rec, 12)
    assert needed(group("n", "none", 4), 100) == range(0, 0)


def test_group_model_refuses_incomplete_kinds() -> None:
    with pytest.raises(ConfigError, match="window is required"):
        group("s", "sliding_window", 4)
    with pytest.raises(ConfigError, match="chunk=6 must be a multiple"):
        group("c", "chunked", 4, chunk=6)
    with pytest.raises(ConfigError, match="cpu_bytes or cpu_share"):
        group("f", "full", 4, cpu_bytes=100, cpu_share=0.5)


@pytest.mark.parametrize("value", [True, "4", 4.0])
@pytest.mark.parametrize("field", ["block_size", "num_layers", "bytes_per_layer_block", "window"])
def test_group_counts_are_strict_and_refused_with_a_config_error(field: str, value: object) -> None:
    """``True``, ``"4"`` and ``4.0`` were taken as counts (a block size of 1, 4, 4), and a
    refused group raised pydantic's ValidationError: now a ConfigError (also a
    ValueError) naming the field and the value."""
    fields: dict[str, object] = {"window": 9, field: value}
    with pytest.raises(ConfigError, match=rf"invalid KVCacheGroup: {field}: .* \(got {value!r}\)"):
        group("s", "sliding_window", 4, **fields)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kind": "x"}, "invalid KVCacheGroup: kind: Input should be"),
        ({"block_size": 0}, r"invalid KVCacheGroup: block_size: .* \(got 0\)"),
        ({"kind": "sliding_window"}, "invalid KVCacheGroup: group 'g' .* window is required"),
    ],
)
def test_model_validate_refuses_as_the_constructor_does(
    values: dict[str, object], message: str
) -> None:
    """``model_validate`` of a dict said "invalid KVCacheGroup: invalid KVCacheGroup: ..."
    (pydantic runs the constructor, whose refusal was wrapped a second time): the one
    message, the constructor's."""
    data = {"name": "g", "kind": "full", "block_size": 4, "num_layers": 1}
    data.update(bytes_per_layer_block=8, **values)
    with pytest.raises(ConfigError) as built:
        KVCacheGroup(**data)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message) as validated:
        KVCacheGroup.model_validate(data)
    assert str(validated.value) == str(built.value)
    assert str(validated.value).count("invalid KVCacheGroup") == 1


def test_group_overrides_and_names_are_strict() -> None:
    with pytest.raises(ConfigError, match=r"cpu_share: .* \(got True\)"):
        group("f", "full", 4, cpu_share=True)
    with pytest.raises(ConfigError, match=r"cpu_bytes: .* \(got True\)"):
        group("f", "full", 4, cpu_bytes=True)
    with pytest.raises(ConfigError, match=r"name: .* \(got 7\)"):
        group(7, "full", 4)  # type: ignore[arg-type]
    assert group("f", "full", 4, cpu_bytes="1KiB").cpu_bytes == 1024  # sizes keep units
    with pytest.raises(ConfigError, match=r"block_size: .* \(got 0\)"):
        KVCacheGroup(name="f", kind="full", block_size=0, num_layers=1, bytes_per_layer_block=8)
    with pytest.raises(ConfigError, match=r"KVCacheGroup is frozen: cannot set block_size=8"):
        FULL4.block_size = 8  # type: ignore[misc]


def test_check_groups_refuses_what_allows_no_hit() -> None:
    with pytest.raises(ConfigError, match=r"no group is cacheable.*\['n'\]"):
        check_groups([group("n", "none", 4)])
    with pytest.raises(ConfigError, match="unique and non-empty"):
        check_groups([])
    odd = [group("a", "full", 31607), group("b", "full", 30727)]
    with pytest.raises(ConfigError, match=r"alignment 971188289 tokens .*'a': 31607"):
        check_groups(odd)
    with pytest.raises(ConfigError, match=r"alignment 971188289 tokens .*'b': 30727"):
        GroupedScheduler(odd, {"a": CpuBlockPool(4), "b": CpuBlockPool(4)})
    sizes = [FULL4, group("s", "sliding_window", 6, window=13)]
    assert check_groups(sizes) == 12
    assert check_groups(sizes, max_model_len=13) == 12
    with pytest.raises(ConfigError, match=r"alignment 12 tokens .* max_model_len=12"):
        check_groups(sizes, max_model_len=12)
    assert check_groups([group("a", "full", MAX_HIT_ALIGNMENT_TOKENS)]) == 1 << 24


def test_grouped_scheduler_refuses_bad_setup_naming_the_field() -> None:
    """A float checkpoint_tokens (crashed later), one pool for two groups and a negative
    GPU block count were accepted."""
    win = group("win", "sliding_window", 4, window=9)
    pools = {"attn": CpuBlockPool(8), "win": CpuBlockPool(8)}
    with pytest.raises(ConfigError, match=r"checkpoint_tokens=16.0 must be .* \(got float\)"):
        GroupedScheduler([FULL4, win], pools, checkpoint_tokens=16.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"checkpoint_tokens=True"):
        GroupedScheduler([FULL4, win], pools, checkpoint_tokens=True)
    shared = CpuBlockPool(8)
    with pytest.raises(ConfigError, match=r"groups 'attn' and 'win' are given one CpuBlockPool"):
        GroupedScheduler([FULL4, win], {"attn": shared, "win": shared})
    for bad in (-1, 0, 2.0, True):
        with pytest.raises(ConfigError, match=rf"num_gpu_blocks\['win'\]={bad!r} must be"):
            GroupedScheduler([FULL4, win], pools, num_gpu_blocks={"attn": 8, "win": bad})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"num_gpu_blocks names 'wim', not a group"):
        GroupedScheduler([FULL4, win], pools, num_gpu_blocks={"wim": 8})
    sched = GroupedScheduler([FULL4, win], pools, num_gpu_blocks={"attn": 8, "win": 8})
    assert sched.checkpoint_tokens == 1024


def test_alignment_and_store_points() -> None:
    assert hit_alignment([FULL4, group("s", "sliding_window", 6, window=13)]) == 12
    assert hit_alignment([FULL4, group("n", "none", 7)]) == 4
    assert list(store_points(0, 40, 16)) == [16, 32]
    assert list(store_points(16, 48, 16)) == [32, 48]


def test_memory_split_by_need() -> None:
    sw = group("s", "sliding_window", 4, window=9)  # 2 blocks per 64-token store point
    assert bytes_per_cached_token(FULL4, 64) == 16 / 4
    assert bytes_per_cached_token(sw, 64) == 2 * 16 / 64
    blocks = split_capacity([FULL4, sw], 16 * 900, 64)
    # shares 4 : 0.5, so the full group gets 8/9 of the bytes
    assert blocks == {"attn": 800, "s": 100}
    over = group("s", "sliding_window", 4, window=9, cpu_share=0.5)
    assert split_capacity([FULL4, over], 16 * 900, 64) == {"attn": 450, "s": 450}
    big = group("s", "sliding_window", 4, window=9, cpu_bytes=20_000)
    with pytest.raises(ConfigError, match=r"overrides \(20000 bytes\) exceed cpu_bytes=16000"):
        split_capacity([FULL4, big], 16_000, 64)
    with pytest.raises(ConfigError, match="group 's' .* less than one block of 16 bytes"):
        split_capacity([FULL4, sw], 16 * 8, 64)


# -- the hit rule --------------------------------------------------------------------------


def _store_prompt(rig: Rig, rid: str, n: int, seed: int = 0) -> Tables:
    tabs = Tables(rig, n)
    rig.fill(tabs.t)
    rig.sched.update(rid, tabs.t, rig.hashes(tokens(n, seed)), n)
    rig.run(rig.sched.plan_stores())
    rig.run(rig.sched.finish(rid))
    rig.sched.check_invariants()
    return tabs


def test_hit_is_lcm_aligned_and_min_over_groups() -> None:
    sw = group("win", "sliding_window", 6, window=13)
    rig = Rig([FULL4, sw], checkpoint_tokens=24)
    _store_prompt(rig, "a", 48)
    h = rig.hashes(tokens(60))
    # a prompt of 60 tokens: cap 59 -> 48 (a multiple of 12); every group stored 48
    assert rig.sched.lookup("b", h, 60) == 48
    rig.sched.check_invariants()
    # a 47-token prompt: cap 46 -> 36; the window group stored only at 24 and 48
    assert rig.sched.lookup("c", h, 47) == 24
    rig.sched.check_invariants()


def test_recurrent_snapshot_at_prompt_end_rounds_down() -> None:
    rec = group("ssm", "recurrent", 8)
    rig = Rig([FULL4, rec], checkpoint_tokens=8)
    _store_prompt(rig, "a", 16)
    h = rig.hashes(tokens(17))
    # the snapshot at 16 already includes token 15: a 16-token prompt hits 8, never 16
    assert rig.sched.lookup("b", {k: v[: 4 if k == "attn" else 2] for k, v in h.items()}, 16) == 8
    rig.sched.release("b")
    assert rig.sched.lookup("c", h, 17) == 16
    rig.sched.check_invariants()


def test_partial_multi_group_store_is_invisible() -> None:
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=16)
    tabs = Tables(rig, 16)
    rig.fill(tabs.t)
    h = rig.hashes(tokens(17))
    rig.sched.update("a", tabs.t, {k: v[:4] for k, v in h.items()}, 16)
    plan = rig.sched.plan_stores()
    assert plan is not None
    assert set(plan.plans) == {"attn", "win"}
    rig.sched.complete("attn", plan.plans["attn"], True)
    rig.sched.check_invariants()
    assert rig.sched.lookup("b", h, 17) == 0  # the window group has not stored yet
    rig.sched.complete("win", plan.plans["win"], True)
    assert rig.sched.lookup("c", h, 17) == 16
    rig.sched.check_invariants()


def test_a_hit_shortened_for_one_group_is_shortened_for_all() -> None:
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=16)
    _store_prompt(rig, "a", 32)
    h = rig.hashes(tokens(33))
    # evict the window group's block 7 (needed at 32): the hit falls back to 16 for both
    pool = rig.pools["win"]
    block = pool.get_cached(h["win"][7])
    assert block is not None
    pool.unpublish(block)
    assert rig.sched.lookup("b", h, 33) == 16
    plan = rig.sched.plan_load("b", Tables(rig, 32).t, 16)
    assert plan is not None
    assert plan.plans["attn"].num_blocks == 4  # not 8: the full group is cut to 16 too
    assert plan.plans["win"].num_blocks == 2
    rig.sched.check_invariants()


# -- stores and loads ----------------------------------------------------------------------


def test_blocks_outside_the_window_are_neither_stored_nor_loaded_bytes_exact() -> None:
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=16)
    _store_prompt(rig, "a", 48)
    # store points 16, 32, 48: the window group stores blocks 2,3, 6,7, 10,11 only
    assert rig.copies == {"attn": 12, "win": 6}
    for name, g in (("attn", FULL4), ("win", sw)):
        rig.gpu[name].zero_()
        del g
    fresh = Tables(rig, 48)
    h = rig.hashes(tokens(49))
    assert rig.sched.lookup("b", h, 49) == 48
    rig.run(rig.sched.plan_load("b", fresh.t, 48))
    assert rig.copies == {"attn": 24, "win": 8}  # the window group loads blocks 10, 11
    rig.check_bytes(fresh.t, {"attn": range(12), "win": range(10, 12)})
    rig.sched.check_invariants()


def test_recurrent_and_chunked_bytes_exact_on_load() -> None:
    rec = group("ssm", "recurrent", 8)
    ch = group("loc", "chunked", 4, chunk=8)
    rig = Rig([FULL4, rec, ch], checkpoint_tokens=16)
    _store_prompt(rig, "a", 44)  # points 16, 32 and 40 (the final length, aligned to 8)
    assert rig.copies["ssm"] == 3  # snapshots at 16, 32, 40
    assert rig.copies["loc"] == 0  # every point is a chunk boundary: nothing needed
    for t in rig.gpu.values():
        t.zero_()
    fresh = Tables(rig, 48)
    assert rig.sched.lookup("b", rig.hashes(tokens(48)), 48) == 40
    rig.run(rig.sched.plan_load("b", fresh.t, 40))
    rig.check_bytes(fresh.t, {"attn": range(10), "ssm": range(4, 5)})
    rig.sched.check_invariants()


def test_delayed_store_of_a_nulled_window_block_publishes_nothing() -> None:
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], cpu_blocks={"attn": 64, "win": 2}, checkpoint_tokens=16)
    _store_prompt(rig, "a", 16, seed=1)  # fills the window pool (2 blocks)
    h1 = rig.hashes(tokens(17, seed=1))
    assert rig.sched.lookup("pin", h1, 17) == 16  # pins both: no free window block
    tabs = Tables(rig, 16)
    h = rig.hashes(tokens(16))
    rig.sched.update("b", tabs.t, h, 16)
    plan = rig.sched.plan_stores()
    assert plan is not None
    assert set(plan.plans) == {"attn"}
    rig.run(plan)
    # the engine frees (and reuses) window block 2 of "b" before the store runs
    tabs.t["win"][2] = None
    rig.sched.update("b", tabs.t, h, 16)
    rig.sched.release("pin")
    later = rig.sched.plan_stores()
    assert later is not None
    assert later.plans["win"].block_hashes == (h["win"][3],)
    rig.run(later)
    assert not rig.pools["win"].is_cached(h["win"][2])
    assert rig.sched.statistics()["win"].skipped_null_blocks >= 1
    assert rig.sched.lookup("c", rig.hashes(tokens(17)), 17) == 0  # block 2 is missing
    rig.sched.check_invariants()


def test_a_block_of_one_group_is_never_served_as_another_groups() -> None:
    a, b = group("a", "full", 4), group("b", "full", 4)
    rig = Rig([a, b])
    h = rig.hashes(tokens(9))
    assert not set(h["a"]) & set(h["b"])  # same tokens, different keys

    def publish(pool_name: str, keys: list[bytes]) -> None:
        pool = rig.pools[pool_name]
        blocks = pool.allocate(len(keys))
        for block, key in zip(blocks, keys, strict=True):
            pool.publish(block, key)  # type: ignore[arg-type]
        pool.free(blocks)

    publish("a", h["a"])
    publish("b", h["a"])  # group a's blocks under a's keys, in b's pool
    assert rig.sched.lookup("x", h, 9) == 0
    publish("b", h["b"])
    assert rig.sched.lookup("y", h, 9) == 8
    rig.sched.check_invariants()


def test_failed_store_of_one_group_publishes_nothing_for_the_prefix() -> None:
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=16)
    tabs = Tables(rig, 16)
    h = rig.hashes(tokens(17))
    rig.sched.update("a", tabs.t, {k: v[:4] for k, v in h.items()}, 16)
    plan = rig.sched.plan_stores()
    assert plan is not None
    rig.sched.complete("attn", plan.plans["attn"], True)
    rig.sched.complete("win", plan.plans["win"], False)
    assert rig.sched.lookup("b", h, 17) == 0
    rig.sched.check_invariants()


# -- lifecycles per group ------------------------------------------------------------------


def test_cancelled_store_is_planned_again() -> None:
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=16)
    tabs = Tables(rig, 16)
    rig.sched.update("a", tabs.t, rig.hashes(tokens(16)), 16)
    plan = rig.sched.plan_stores()
    assert plan is not None
    assert rig.sched.cancel("win", plan.plans["win"])
    rig.sched.check_invariants()
    again = rig.sched.plan_stores()
    assert again is not None
    assert set(again.plans) == {"win"}
    rig.sched.complete("attn", plan.plans["attn"], True)
    rig.run(again)
    rig.sched.check_invariants()
    assert rig.sched.lookup("b", rig.hashes(tokens(17)), 17) == 16


def test_cancelled_load_pins_the_hit_again_and_release_drops_every_pin() -> None:
    # every part cancelled: the hit is pinned again, as with one group
    # (tests/test_groups_cancel_load.py); releasing it drops every pin
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=16)
    _store_prompt(rig, "a", 16)
    assert rig.sched.lookup("b", rig.hashes(tokens(17)), 17) == 16
    plan = rig.sched.plan_load("b", Tables(rig, 16).t, 16)
    assert plan is not None
    for name, sub in plan.plans.items():
        assert rig.sched.cancel(name, sub)
    rig.sched.check_invariants()
    stats = rig.sched.statistics()
    assert {n: s.pinned_blocks for n, s in stats.items()} == {
        n: sub.num_blocks for n, sub in plan.plans.items()
    }
    rig.sched.release("b")
    rig.sched.check_invariants()
    assert all(s.pinned_blocks == 0 for s in rig.sched.statistics().values())


def test_reset_abandons_stores_in_flight_in_every_group() -> None:
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=16)
    _store_prompt(rig, "a", 16)
    rig.sched.update("b", Tables(rig, 32).t, rig.hashes(tokens(32, seed=2)), 32)
    plan = rig.sched.plan_stores()
    assert not rig.sched.reset()
    rig.run(plan)  # completes after the reset: publishes nothing
    assert rig.sched.lookup("c", rig.hashes(tokens(17)), 17) == 0
    assert rig.sched.lookup("d", rig.hashes(tokens(33, seed=2)), 33) == 0
    rig.sched.check_invariants()


def test_preempt_stores_nothing_and_rescans() -> None:
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=16)
    tabs = Tables(rig, 24)
    h = rig.hashes(tokens(24))
    rig.sched.update("a", tabs.t, h, 24)
    rig.run(rig.sched.plan_stores())  # point 16
    rig.sched.preempt("a")  # not point 24: the engine freed the blocks
    assert rig.sched.num_in_flight == 0
    rig.sched.check_invariants()
    assert rig.sched.lookup("b", rig.hashes(tokens(25)), 25) == 16
    rig.sched.release("b")
    assert rig.sched.plan_stores() is None  # "a" holds nothing until its next update
    rig.sched.update("a", Tables(rig, 24).t, h, 24)  # re-admitted: it rescans
    rig.run(rig.sched.plan_stores())
    assert rig.sched.lookup("c", rig.hashes(tokens(25)), 25) == 16
    rig.run(rig.sched.finish("a"))  # the last point, 24
    assert rig.sched.lookup("d", rig.hashes(tokens(25)), 25) == 24
    rig.sched.check_invariants()


def test_finish_drops_the_request_and_refuses_more() -> None:
    rig = Rig([FULL4, group("win", "sliding_window", 4, window=9)], checkpoint_tokens=16)
    tabs = Tables(rig, 16)
    rig.sched.update("a", tabs.t, rig.hashes(tokens(16)), 16)
    plan = rig.sched.finish("a")
    assert plan is not None
    assert rig.sched.has_request("a")
    rig.run(plan)
    assert not rig.sched.has_request("a")
    rig.sched.check_invariants()


def test_bad_input_is_refused_naming_it() -> None:
    rig = Rig([FULL4, group("win", "sliding_window", 4, window=9)], checkpoint_tokens=16)
    with pytest.raises(InvalidInputError, match="no block hashes for group 'win'"):
        rig.sched.lookup("a", {"attn": []}, 8)
    assert not rig.sched.has_request("a")
    with pytest.raises(InvalidInputError, match="num_tokens=17 must be 0 or the lookup's hit"):
        rig.sched.plan_load("a2", {"attn": [], "win": []}, 17) if rig.sched.lookup(
            "a2", rig.hashes(tokens(8)), 8
        ) == 0 else None


def test_a_float_count_is_refused_with_an_input_type_error() -> None:
    """``type(n) is not int`` gave a plain InvalidInputError, and plan_load compared a
    float hit equal to the int one (16.0 == 16) and planned the load."""
    rig = Rig([FULL4, group("win", "sliding_window", 4, window=9)], checkpoint_tokens=16)
    tabs = Tables(rig, 16)
    with pytest.raises(InputTypeError, match=r"request 'a': num_computed_tokens=16.0 is not"):
        rig.sched.update("a", tabs.t, rig.hashes(tokens(16)), 16.0)  # type: ignore[arg-type]
    rig.sched.update("a", tabs.t, rig.hashes(tokens(16)), 16)
    plan = rig.sched.plan_stores()
    assert plan is not None
    rig.run(plan)
    h = rig.hashes(tokens(17))
    with pytest.raises(InputTypeError, match=r"request 'b': num_tokens=17.0 is not an int"):
        rig.sched.lookup("b", h, 17.0)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match=r"request 'b': num_computed_tokens=True is not"):
        rig.sched.lookup("b", h, 17, True)
    assert rig.sched.lookup("b", h, 17) == 16
    with pytest.raises(InputTypeError, match=r"request 'b': num_tokens=16.0 is not an int"):
        rig.sched.plan_load("b", Tables(rig, 16).t, 16.0)  # type: ignore[arg-type]
    assert rig.sched.statistics()["attn"].loaded_blocks == 0
    assert rig.sched.plan_load("b", Tables(rig, 16).t, 16) is not None  # the pin was kept
    rig.sched.check_invariants()


def test_a_none_group_is_never_stored_and_does_not_limit_hits() -> None:
    cross = group("cross", "none", 4)
    rig = Rig([FULL4, cross], checkpoint_tokens=16)
    assert set(rig.pools) == {"attn"}  # no pool for it
    tabs = Tables(rig, 16)
    rig.sched.update("a", tabs.t, rig.hashes(tokens(16)), 16)
    plan = rig.sched.plan_stores()
    assert plan is not None
    assert set(plan.plans) == {"attn"}
    rig.run(plan)
    assert rig.sched.lookup("b", rig.hashes(tokens(17)), 17) == 16
    rig.sched.check_invariants()


def test_a_finished_request_is_refused() -> None:
    rig = Rig([FULL4, group("win", "sliding_window", 4, window=9)], checkpoint_tokens=16)
    tabs = Tables(rig, 8)
    h = rig.hashes(tokens(8))
    rig.sched.update("a", tabs.t, h, 8)
    plan = rig.sched.finish("a")
    with pytest.raises(RequestStateError, match="request 'a' is finished"):
        rig.sched.update("a", tabs.t, h, 8)
    with pytest.raises(RequestStateError, match="request 'a' is finished"):
        rig.sched.finish("a")
    rig.run(plan)


def test_build_grouped_scheduler_splits_cpu_bytes_by_need() -> None:
    from kvoffload.build import build_grouped_scheduler  # noqa: PLC0415
    from kvoffload.config import OffloadConfig  # noqa: PLC0415

    sw = group("s", "sliding_window", 4, window=9)
    config = OffloadConfig(block_size=4, cpu_bytes=16 * 900, eviction_policy="lru")
    sched = build_grouped_scheduler(config, [FULL4, sw], checkpoint_tokens=64)
    stats = sched.statistics()
    assert {n: s.num_cpu_blocks for n, s in stats.items()} == {"attn": 800, "s": 100}
    by_blocks = build_grouped_scheduler(
        OffloadConfig(block_size=4, num_cpu_blocks=7), [FULL4, sw], checkpoint_tokens=64
    )
    assert {n: s.num_cpu_blocks for n, s in by_blocks.statistics().items()} == {
        "attn": 7,
        "s": 7,
    }
    sched.check_invariants()


def test_a_full_lane_keeps_its_live_blocks_as_a_prefix_and_cancel_rolls_it_back() -> None:
    """A full lane records no block one by one: its live blocks are the blocks below its
    cursor but those whose entry was ``None`` (as one group's are those below its
    cursor); a cancelled store plan moves the cursor and the live blocks back together."""
    sw = group("win", "sliding_window", 4, window=9)
    rig = Rig([FULL4, sw], checkpoint_tokens=8)
    sched = rig.sched
    h = rig.hashes(tokens(16))
    table: dict[str, list[int | None]] = {"attn": [0, None, 2, 3], "win": [4, 5, 6, 7]}
    sched.update("a", table, h, 16)
    plan = sched.plan_stores()
    assert plan is not None
    lane = sched._requests["a"].lanes["attn"]
    assert (lane.cursor, lane.live_end, lane.holes, lane.live) == (4, 4, [1], [])
    sched.check_invariants()
    sched.cancel("attn", plan.plans["attn"])
    assert (lane.cursor, lane.live_end, lane.holes, lane.live) == (0, 0, [], [])
    sched.check_invariants()
    table["attn"][1] = 1
    sched.update("a", table, h, 16)
    rig.run(sched.plan_stores())
    assert (lane.cursor, lane.live_end, lane.holes) == (4, 4, [])
    sched.check_invariants()


def test_an_abandoned_load_forgets_the_gpu_blocks_it_wrote_in_every_lane() -> None:
    """After `abandon_load()` a lane's kept GPU block ids are its trimmed table's (the
    store loop's "no None here" shortcut counts them), as one group's `forget_from()`."""
    rig = Rig([group("a", "full", 4), group("b", "full", 4)])
    _store_prompt(rig, "a", 32)
    prompt = rig.hashes(tokens(33))
    assert rig.sched.lookup("b", prompt, 33) == 32
    tabs = Tables(rig, 36)
    assert rig.sched.plan_load("b", tabs.t, 32) is not None
    rig.sched.update("b", tabs.t, prompt, 32)  # the engine reported the hit as computed
    abandoned = rig.sched.abandon_load("b")
    assert set(abandoned) == {"a", "b"}
    rig.sched.check_invariants()
    # the engine recomputes into the blocks it had given the load: not "named twice"
    again = {name: table[:3] for name, table in tabs.t.items()}
    rig.sched.update("b", again, prompt, 12)
    rig.sched.check_invariants()
