"""`ChainBudget`: the deepest page goes first, never one shallower than the newcomer."""

from __future__ import annotations

import pytest

from kvoffload.errors import ConfigError, InvalidInputError
from kvoffload.tiers.chain_budget import Admission, ChainBudget


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
        ChainBudget[str](4).admit(["a0"], -1)


def test_pressure_takes_the_deepest_pages_and_cuts_chains_to_a_common_depth() -> None:
    budget: ChainBudget[str] = ChainBudget(12)
    a, b = chain("a", 8), chain("b", 8)
    assert budget.admit(a, 0) == Admission(8, ())
    got = budget.admit(b, 0)
    # b4 and b5 took a7 and a6; b6 finds nothing as deep as itself and is refused
    assert got == Admission(6, ("a7", "a6"))
    assert leading(budget, a) == leading(budget, b) == 6
    assert len(budget) == 12


def test_requests_progressing_together_keep_every_head() -> None:
    # 40 chains of 12 pages written in rounds (the first 4 pages of each, then the next
    # 4 ...) through room for 100: a recency order would keep the last rounds' tails
    budget: ChainBudget[str] = ChainBudget(100)
    chains = [chain(f"c{j}-", 12) for j in range(40)]
    for start in range(0, 12, 4):
        for keys in chains:
            budget.admit(keys[start : start + 4], start)
    assert sum(leading(budget, keys) for keys in chains) == len(budget) == 100
    assert all(leading(budget, keys) >= 2 for keys in chains)


def test_a_chain_alone_refuses_its_tail_rather_than_evicting_its_head() -> None:
    budget: ChainBudget[str] = ChainBudget(5)
    keys = chain("a", 9)
    assert budget.admit(keys, 0) == Admission(5, ())
    assert leading(budget, keys) == 5


def test_equal_depth_replaces_the_least_recently_used() -> None:
    budget: ChainBudget[str] = ChainBudget(3)
    for name in "xyz":
        budget.admit([f"{name}0"], 0)
    budget.touch(["x0"])  # y0 is now the least recently used head
    assert budget.admit(["w0"], 0) == Admission(1, ("y0",))
    assert budget.depth("w0") == 0
    assert budget.depth("y0") is None


def test_forget_frees_room_and_held_pages_are_not_counted_twice() -> None:
    budget: ChainBudget[str] = ChainBudget(4)
    budget.admit(chain("a", 4), 0)
    assert budget.admit(chain("a", 4), 0) == Admission(4, ())
    budget.forget(["a2", "a3", "missing"])
    assert budget.admit(chain("b", 2), 0) == Admission(2, ())
    assert sorted(budget.keys()) == ["a0", "a1", "b0", "b1"]
    budget.clear()
    assert len(budget) == 0
    assert budget.admit(chain("c", 4), 3) == Admission(4, ())
    assert budget.depth("c3") == 6
