"""`ChainBudget`: tail-first eviction from the least recently used chain."""

from __future__ import annotations

import pytest

from kvoffload.errors import ConfigError, InvalidInputError
from kvoffload.tiers.chain_budget import ChainBudget


def chain(name: str, n: int) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def leading(budget: ChainBudget[str], keys: list[str]) -> int:
    n = 0
    for key in keys:
        if key not in budget:
            break
        n += 1
    return n


def test_capacity_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="capacity=0"):
        ChainBudget(0)


def test_negative_depth_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="first_depth=-1"):
        ChainBudget[str](4).admit("a0", ["a0"], -1)


def test_pressure_takes_tails_of_the_least_recently_used_chain_and_keeps_heads() -> None:
    budget: ChainBudget[str] = ChainBudget(12)
    a, b = chain("a", 8), chain("b", 8)
    assert budget.admit("a0", a, 0).admitted == 8
    got = budget.admit("b0", b, 0)
    assert got.admitted == 8
    # b needed 4 places: a (least recently used) gave its 4 deepest pages
    assert got.victims == ("a7", "a6", "a5", "a4")
    assert leading(budget, a) == 4
    assert leading(budget, b) == 8
    assert len(budget) == 12


def test_written_in_batches_with_prefix_depths_heads_survive_many_chains() -> None:
    # 40 chains of 10 pages each through room for 50: an LRU of pages would keep the
    # last-written tails; every surviving page here is part of a leading run.
    budget: ChainBudget[str] = ChainBudget(50)
    chains = [chain(f"c{j}-", 10) for j in range(40)]
    for keys in chains:
        for start in range(0, 10, 4):  # batches, as the engine writes them
            budget.admit(keys[0], keys[start : start + 4], start)
    held = sum(leading(budget, keys) for keys in chains)
    assert held == len(budget) == 50


def test_a_chain_alone_refuses_its_tail_rather_than_evicting_its_head() -> None:
    budget: ChainBudget[str] = ChainBudget(5)
    keys = chain("a", 9)
    got = budget.admit("a0", keys, 0)
    assert got.admitted == 5
    assert got.victims == ()
    assert leading(budget, keys) == 5


def test_a_shallower_page_of_the_same_chain_takes_a_deeper_one() -> None:
    budget: ChainBudget[str] = ChainBudget(3)
    budget.admit("r", ["r", "x1", "x2"], 0)
    # another branch under the same head: its depth-1 page takes the depth-2 one
    got = budget.admit("r", ["y1"], 1)
    assert got.admitted == 1
    assert got.victims == ("x2",)
    assert budget.depth("y1") == 1


def test_touch_protects_a_chain_and_forget_frees_room() -> None:
    budget: ChainBudget[str] = ChainBudget(6)
    budget.admit("a0", chain("a", 3), 0)
    budget.admit("b0", chain("b", 3), 0)
    budget.touch(["a1"])  # a was used: b is now the least recently used
    got = budget.admit("c0", ["c0"], 0)
    assert got.victims == ("b2",)
    budget.forget(["a0", "a1", "a2", "missing"])
    assert "a0" not in budget
    assert budget.admit("d0", chain("d", 3), 0).victims == ()
    assert budget.depth("d2") == 2
    assert budget.depth("a0") is None


def test_pages_already_held_are_touched_not_counted_twice() -> None:
    budget: ChainBudget[str] = ChainBudget(4)
    budget.admit("a0", chain("a", 4), 0)
    got = budget.admit("a0", chain("a", 4), 0)
    assert got == type(got)(4, ())
    assert len(budget) == 4
    budget.clear()
    assert len(budget) == 0
