"""One rule, one message: bad input to one group's `OffloadScheduler` and to a
`GroupedScheduler` over one full group of the same geometry is refused by the same
check, with the same error and the same message but for how it names the table (one
group: ``gpu_block_ids``; several: ``tables['g']``) and the unit of a hit (one group's
``block_size``, several groups' ``hit_alignment``). A table with two such groups is
refused the same way, naming the group at fault."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from groups_helpers import Rig, group

from kvoffload.config import OffloadConfig
from kvoffload.errors import BlockTableError, InputTypeError, InvalidInputError
from kvoffload.hashing import BlockHasher, HashNamespace
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler

TOKENS = list(range(16))
TABLE = [0, 1, 2, 3]


def one_group() -> tuple[Any, list[bytes]]:
    config = OffloadConfig(num_cpu_blocks=16, block_size=4)
    sched = OffloadScheduler(config, CpuBlockPool(16), num_gpu_blocks=32)
    hasher = BlockHasher(HashNamespace(model_id="t").root, 4)
    hasher.extend(TOKENS)
    return sched, list(hasher.block_hashes)


def grouped() -> tuple[Any, list[bytes]]:
    rig = Rig([group("g", "full", 4)], cpu_blocks=16, gpu_blocks=32)
    return rig.sched, rig.hashes(TOKENS)["g"]


Call = Callable[[Any, Callable[[object], object], list[bytes]], object]

CASES: dict[str, tuple[type[Exception], Call]] = {
    "computed past the prompt": (
        InvalidInputError,
        lambda s, w, h: s.lookup("a", w(h), 8, 12),
    ),
    "a negative prompt": (InvalidInputError, lambda s, w, h: s.lookup("a", w(h), -4, 0)),
    "computed not a whole block": (
        InvalidInputError,
        lambda s, w, h: s.lookup("a", w(h), 16, 3),
    ),
    "a count that is not an int": (
        InputTypeError,
        lambda s, w, h: s.lookup("a", w(h), 16.0, 0),
    ),
    "a negative GPU block": (
        BlockTableError,
        lambda s, w, h: s.update("a", w([0, -1, 2, 3]), w(h), 16),
    ),
    "a GPU block past the cache": (
        BlockTableError,
        lambda s, w, h: s.update("a", w([0, 1, 2, 32]), w(h), 16),
    ),
    "an entry that is not an int": (
        InputTypeError,
        lambda s, w, h: s.update("a", w([0, 1, "2", 3]), w(h), 16),
    ),
    "a GPU block named twice": (
        BlockTableError,
        lambda s, w, h: s.update("a", w([0, 1, 1, 3]), w(h), 16),
    ),
    "a new entry past the cache": (
        BlockTableError,
        lambda s, w, h: (
            s.update("a", w(TABLE[:2]), w(h), 8),
            s.update("a", w([*TABLE[:2], 7, 40]), w(h), 16),
        ),
    ),
    "a computed count that is negative": (
        InvalidInputError,
        lambda s, w, h: s.update("a", w(TABLE), w(h), -4),
    ),
}


def hit(s: Any, w: Callable[[object], object], h: list[bytes]) -> None:
    """Request "a" stores its 4 blocks and finishes; "b" looks the prompt up (a hit of
    3 blocks: the last token is always computed)."""
    s.update("a", w(TABLE), w(h), 16)
    plan = s.plan_stores()
    if hasattr(s, "complete_all"):  # a GroupedScheduler's plan has a part per group
        s.complete_all(plan, True)
    else:
        s.complete(plan, True)
    s.finish("a")
    assert s.lookup("b", w(h), 16, 0) == 12


CASES.update(
    {
        "a load table too short": (
            BlockTableError,
            lambda s, w, h: (hit(s, w, h), s.plan_load("b", w([5]), 12)),
        ),
        "a load table naming a block twice": (
            BlockTableError,
            lambda s, w, h: (hit(s, w, h), s.plan_load("b", w([5, 5, 7, 8]), 12)),
        ),
        "a table that is not a sequence": (
            InputTypeError,
            lambda s, w, h: s.update("a", w(5), w(h), 16),
        ),
        "hashes that are not a sequence": (
            InputTypeError,
            lambda s, w, h: s.update("a", w(TABLE), w(5), 16),
        ),
        "hashes that shrank": (
            InvalidInputError,
            lambda s, w, h: (
                s.update("a", w(TABLE), w(h), 16),
                s.update("a", w(TABLE), w(h[:2]), 16),
            ),
        ),
    }
)

ONE_GROUP_NAMES = (
    ("the block table of group 'g' has", "block table has"),
    ("tables['g']", "gpu_block_ids"),
    ("the block table of group 'g'", "gpu_block_ids"),
    ("block_hashes['g']", "block_hashes"),
    ("hit_alignment", "block_size"),
)


def refusal(
    make: Callable[[], tuple[Any, list[bytes]]], wrap: Callable[[object], object], call: Call
) -> tuple[type[Exception], str]:
    sched, hashes = make()
    with pytest.raises(Exception) as info:
        call(sched, wrap, hashes)
    sched.check_invariants()  # refused: nothing half-done
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", CASES)
def test_one_group_and_a_grouped_scheduler_refuse_alike(case: str) -> None:
    kind, call = CASES[case]
    one_kind, one_text = refusal(one_group, lambda x: x, call)
    g_kind, g_text = refusal(grouped, lambda x: {"g": x}, call)
    assert one_kind is kind
    assert g_kind is kind
    assert re.match(r"request '[ab]': ", one_text), one_text  # names the request
    for grouped_name, one_name in ONE_GROUP_NAMES:
        g_text = g_text.replace(grouped_name, one_name)
    assert g_text == one_text


def test_two_groups_name_the_group_whose_table_is_wrong() -> None:
    rig = Rig([group("f", "full", 4), group("w", "sliding_window", 4, window=8)], gpu_blocks=32)
    hashes = rig.hashes(TOKENS)
    with pytest.raises(
        BlockTableError, match=r"request 'a': tables\['w'\]\[2\]=32 is out of range \[0, 32\)"
    ):
        rig.sched.update("a", {"f": TABLE, "w": [4, 5, 32, 7]}, hashes, 16)
    with pytest.raises(
        InputTypeError, match=r"request 'a': tables\['f'\]\[0\]=0.0 is not an int \(got float\)"
    ):
        rig.sched.update("a", {"f": [0.0, 1, 2, 3], "w": [4, 5, 6, 7]}, hashes, 16)
    # ``None`` names no block, in any group's table
    rig.sched.update("a", {"f": TABLE, "w": [None, 5, 6, 7]}, hashes, 16)
    rig.sched.check_invariants()
