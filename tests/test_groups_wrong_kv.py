"""`GroupedScheduler` never serves KV it was not given: nothing is stored from the GPU
blocks of a preempted request, nor from table entries below what a load or the engine's
prefix wrote (a window, chunk or state above them), and a table naming one GPU block
twice is refused as with one group. Each test has an engine that writes other KV into
the blocks it may reuse, and checks what a later request loads byte for byte."""

from __future__ import annotations

import pytest
import torch

from kvoffload.errors import BlockTableError
from tests.groups_helpers import PAGE, Rig, content, group

FULL4 = group("attn", "full", 4)
WIN = group("win", "sliding_window", 4, window=9)  # a hit at N needs blocks N/4-2, N/4-1
JUNK = torch.full((PAGE,), 0xAB, dtype=torch.uint8)


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 1000 + i) % 50_000 for i in range(n)]


def junk(rig: Rig, name: str, blocks: list[int | None]) -> None:
    """The engine writes something else (another request's KV) into ``blocks``."""
    for b in blocks:
        if b is not None:
            rig.gpu[name][:, b] = JUNK


# -- preempt -------------------------------------------------------------------------------


def test_preempt_stores_nothing_from_the_blocks_the_engine_freed() -> None:
    rig = Rig([FULL4, WIN], checkpoint_tokens=16)
    table: dict[str, list[int | None]] = {"attn": list(range(6)), "win": list(range(10, 16))}
    rig.fill(table)
    h = rig.hashes(tokens(25))
    rig.sched.update("a", table, h, 24)
    rig.run(rig.sched.plan_stores())  # point 16 (and the full group's blocks 0..5)
    stored = {n: s.stored_blocks for n, s in rig.sched.statistics().items()}
    rig.sched.preempt("a")
    assert rig.sched.num_in_flight == 0  # nothing planned from the freed blocks
    # the engine hands a's blocks to another request at once, which writes its KV there
    junk(rig, "attn", table["attn"])
    junk(rig, "win", table["win"])
    rig.run(rig.sched.plan_stores())
    assert {n: s.stored_blocks for n, s in rig.sched.statistics().items()} == stored
    rig.sched.check_invariants()
    # a later request with the same prompt gets what was stored before the preemption
    assert rig.sched.lookup("b", h, 25) == 16
    fresh: dict[str, list[int | None]] = {"attn": list(range(20, 26)), "win": list(range(30, 36))}
    rig.run(rig.sched.plan_load("b", fresh, 16))
    rig.check_bytes(fresh, {"attn": range(4), "win": range(2, 4)})
    # "a" starts over: its next tables are new, its cursors rescan
    assert rig.sched.lookup("a", h, 25) == 16
    rig.sched.release("a")
    rig.sched.check_invariants()


# -- entries below a loaded window ----------------------------------------------------------


def _store_a_with_the_window_nulled(rig: Rig) -> dict[str, list[bytes]]:
    """Request "a" computes 33 tokens in one step; its engine nulls the entries out of
    the window (as vLLM does), so only the blocks of the point at 32 are stored."""
    h = rig.hashes(tokens(33))
    table: dict[str, list[int | None]] = {
        "attn": list(range(8)),
        "win": [None] * 6 + [6, 7],
    }
    rig.fill(table)
    rig.sched.update("a", table, h, 33)
    rig.run(rig.sched.plan_stores())
    rig.run(rig.sched.finish("a"))
    assert not rig.pools["win"].is_cached(h["win"][2])  # point 16 was never stored
    return h


def test_entries_below_a_loaded_window_are_never_stored() -> None:
    rig = Rig([FULL4, WIN], checkpoint_tokens=16)
    h = _store_a_with_the_window_nulled(rig)
    # "b": the same prompt and more; a hit at 32 loads full 0..7 and window blocks 6, 7
    hb = rig.hashes([*tokens(33), 7, 7, 7, 7])
    assert rig.sched.lookup("b", hb, 37) == 32
    # its engine names GPU blocks below the window it never wrote (they hold other KV)
    table: dict[str, list[int | None]] = {
        "attn": list(range(40, 49)),
        "win": list(range(50, 59)),
    }
    junk(rig, "win", table["win"])
    rig.run(rig.sched.plan_load("b", table, 32))
    rig.check_bytes(table, {"attn": range(8), "win": range(6, 8)})
    # the engine computes tokens 32..36 (block 8) and reports them with the same table
    for gi, name in enumerate(("attn", "win")):
        for layer in range(2):
            rig.gpu[name][layer, table[name][8]] = content(gi, layer, 8)
    rig.sched.update("b", table, hb, 37)
    rig.run(rig.sched.plan_stores())  # point 16 needs window blocks 2, 3: not known valid
    rig.run(rig.sched.finish("b"))
    assert not rig.pools["win"].is_cached(h["win"][2])
    assert not rig.pools["win"].is_cached(h["win"][3])
    assert rig.sched.statistics()["win"].skipped_null_blocks >= 2
    # a third request, whose hit at 16 would need window blocks 2 and 3, gets nothing wrong
    hc = rig.hashes(tokens(17))
    assert rig.sched.lookup("c", hc, 17) == 0
    rig.sched.check_invariants()


def test_entries_below_the_engines_own_prefix_window_are_never_stored() -> None:
    rig = Rig([FULL4, WIN], checkpoint_tokens=8)
    h = rig.hashes(tokens(17))
    # the engine has a prefix of 16 tokens of its own: its window blocks 2, 3 hold KV,
    # the entries below name blocks holding something else
    assert rig.sched.lookup("a", h, 17, 16) == 0
    table: dict[str, list[int | None]] = {"attn": list(range(4)), "win": list(range(10, 14))}
    rig.fill(table)
    junk(rig, "win", table["win"][:2])
    rig.sched.update("a", table, h, 17)
    rig.run(rig.sched.plan_stores())  # points 8 (window blocks 0, 1) and 16 (2, 3)
    rig.run(rig.sched.finish("a"))
    assert not rig.pools["win"].is_cached(h["win"][0])
    assert rig.pools["win"].is_cached(h["win"][2])
    assert rig.sched.lookup("b", rig.hashes(tokens(9)), 9) == 0  # 8 would need blocks 0, 1
    fresh: dict[str, list[int | None]] = {"attn": list(range(20, 24)), "win": list(range(30, 34))}
    assert rig.sched.lookup("c", h, 17) == 16
    rig.run(rig.sched.plan_load("c", fresh, 16))
    rig.check_bytes(fresh, {"attn": range(4), "win": range(2, 4)})
    rig.sched.check_invariants()


# -- one GPU block twice --------------------------------------------------------------------


def test_a_group_table_naming_one_gpu_block_twice_is_refused() -> None:
    rig = Rig([FULL4, WIN], checkpoint_tokens=16)
    h = rig.hashes(tokens(17))
    twice: dict[str, list[int | None]] = {"attn": [0, 1, 2, 3], "win": [None, 5, 6, 5]}
    with pytest.raises(
        BlockTableError,
        match=r"request 'a': GPU block 5 appears twice in the block table of group 'win', "
        r"at positions 1 and 3",
    ):
        rig.sched.update("a", twice, h, 16)
    assert not rig.sched.has_request("a")  # nothing registered
    # None entries name no block: they may repeat
    table: dict[str, list[int | None]] = {"attn": [0, 1, 2, 3], "win": [None, None, 6, 7]}
    rig.fill(table)
    rig.sched.update("a", table, h, 16)
    rig.run(rig.sched.plan_stores())
    rig.run(rig.sched.finish("a"))
    # a load into a table naming a block twice is refused too; the pins are kept
    assert rig.sched.lookup("b", h, 17) == 16
    bad: dict[str, list[int | None]] = {"attn": [8, 9, 8, 11], "win": [None, None, 12, 13]}
    with pytest.raises(BlockTableError, match=r"'b': GPU block 8 .*group 'attn'.* 0 and 2"):
        rig.sched.plan_load("b", bad, 16)
    rig.sched.check_invariants()
    good: dict[str, list[int | None]] = {"attn": [8, 9, 10, 11], "win": [None, None, 12, 13]}
    rig.run(rig.sched.plan_load("b", good, 16))
    rig.check_bytes(good, {"attn": range(4), "win": range(2, 4)})
    rig.sched.check_invariants()
