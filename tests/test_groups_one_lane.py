"""A `GroupedScheduler` with one cacheable group checks `update()` as one group does.

Its `update()` takes the common case (every table and hash list only grew) without the
loop over the lanes; whatever that shortcut does not take goes to the full checks. A
seeded run of updates (good ones, and each kind of fault) through one full group's
`OffloadScheduler`, a `GroupedScheduler` with that group alone (the shortcut) and one
with two identical full groups (the loop) must accept and refuse the same calls (the two
grouped runs with the same error) and leave the same table, hashes, cursor and computed
tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_helpers import BS, hashes, make, tokens

from kvoffload.config import OffloadConfig
from kvoffload.errors import KvOffloadError
from kvoffload.groups import KVCacheGroup
from kvoffload.pool import CpuBlockPool
from kvoffload.scheduler.groups import GroupedScheduler

GPU_BLOCKS = 64
FAULTS = ("grow", "grow", "grow", "store", "changed", "shrank", "twice", "range", "hash", "tuple")


def _group(name: str, kind: str = "full") -> KVCacheGroup:
    return KVCacheGroup(name=name, kind=kind, block_size=BS, num_layers=1, bytes_per_layer_block=8)


def _grouped(names: list[str], extra: list[KVCacheGroup] = ()) -> GroupedScheduler:  # type: ignore[assignment]
    config = OffloadConfig(block_size=BS, num_cpu_blocks=64)
    return GroupedScheduler(
        [_group(n) for n in names] + list(extra),
        {n: CpuBlockPool(64) for n in names},
        num_gpu_blocks={n: GPU_BLOCKS for n in names},
        config=config,
    )


def _outcome(call: Callable[..., object], *args: object) -> str:
    try:
        call(*args)
    except KvOffloadError as exc:
        return type(exc).__name__
    return "ok"


def _lane_state(sched: GroupedScheduler, name: str) -> tuple[object, ...]:
    if not sched.has_request("r"):
        return ()
    state = sched._requests["r"]  # the state the calls changed
    lane = state.lanes[name]
    return (list(lane.table), list(lane.hashes), lane.cursor, state.num_computed_tokens)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), none_group=st.booleans())
def test_one_lane_accepts_and_refuses_as_one_group_and_the_loop(
    seed: int, none_group: bool
) -> None:
    rng = random.Random(seed)
    one = make(64, num_gpu_blocks=GPU_BLOCKS)
    # a group that caches nothing does not make a second lane: the shortcut still serves
    lone = _grouped(["f"], [_group("n", "none")] if none_group else [])
    loop = _grouped(["f", "g"])
    ids = rng.sample(range(GPU_BLOCKS), 32)
    ids, spare = ids[:24], ids[24:]
    chain = hashes(tokens(seed % 1000, 24))
    table: list[object] = []
    hs: list[object] = []
    for _ in range(40):
        fault = rng.choice(FAULTS)
        if fault == "store":
            plans = (one.plan_stores(), lone.plan_stores(), loop.plan_stores())
            if plans[0] is not None:
                one.complete(plans[0], ok=True)
            for sched, plan in ((lone, plans[1]), (loop, plans[2])):
                if plan is not None:
                    sched.complete_all(plan, ok=True)
            continue
        n = len(table)
        grow = min(rng.randint(0, 3), len(ids) - n)
        cand = table + ids[n : n + grow]
        cand_h = hs + chain[n : n + grow]
        stored = one.request_state("r").num_stored_blocks if one.has_request("r") else 0
        if fault == "changed" and stored < n:
            # an entry a store may still read, to a block the request never names
            cand[rng.randrange(stored, n)] = rng.choice(spare)
        elif fault == "shrank" and n:
            cand, cand_h = cand[:-1], cand_h[:-1]
        elif fault == "twice" and n:
            cand.append(cand[rng.randrange(n)])
        elif fault == "range":
            cand.append(GPU_BLOCKS + rng.randrange(3))
        elif fault == "hash" and n:
            cand_h[n - 1] = b"x" * 32
        elif fault == "tuple":
            cand = tuple(cand)  # type: ignore[assignment]
        computed = min(len(cand), len(cand_h)) * BS
        one_table = cand if fault == "tuple" else list(cand)
        got = (
            _outcome(one.update, "r", one_table, cand_h, computed),
            _outcome(lone.update, "r", {"f": cand}, {"f": cand_h}, computed),
            _outcome(
                loop.update,
                "r",
                {"f": cand, "g": list(cand)},
                {"f": cand_h, "g": list(cand_h)},
                computed,
            ),
        )
        assert got[1] == got[2], (fault, got)
        assert _lane_state(lone, "f") == _lane_state(loop, "f") == _lane_state(loop, "g")
        # refused alike (a shrunk call may be refused for its table or for its hashes,
        # whichever a path checks first); an entry a store may still read that changed
        # is refused by every path (the one rule, `check_known_entries()`)
        assert (got[0] == "ok") == (got[1] == "ok"), (fault, got)
        if fault == "changed" and stored < n:
            assert got == ("BlockTableError",) * 3, got
        if got[0] == "ok":
            table, hs = list(cand), list(cand_h)
        if not one.has_request("r"):
            assert not lone.has_request("r")
            assert not loop.has_request("r")
            continue
        st_one = one.request_state("r")
        expect = (
            list(st_one.gpu_block_ids),
            list(st_one.block_hashes),
            st_one.num_stored_blocks,
            st_one.num_computed_tokens,
        )
        assert _lane_state(lone, "f") == expect
        assert _lane_state(loop, "f") == _lane_state(loop, "g") == expect
    one.check_invariants()
    lone.check_invariants()
    loop.check_invariants()


def test_one_lane_refusals_name_the_group_and_change_nothing() -> None:
    sched = _grouped(["f"])
    chain = hashes(tokens(1, 4))
    sched.update("r", {"f": [1, 2]}, {"f": chain[:2]}, 2 * BS)
    before = _lane_state(sched, "f")
    # one cacheable group: its table is named as one group's (`InputNames`)
    with pytest.raises(
        KvOffloadError, match=r"appears twice in gpu_block_ids, at positions 0 and 2"
    ):
        sched.update("r", {"f": [1, 2, 1]}, {"f": chain[:3]}, 3 * BS)
    with pytest.raises(KvOffloadError, match="changed"):
        sched.update("r", {"f": [1, 2, 3]}, {"f": [chain[0], b"y" * 32, chain[2]]}, 3 * BS)
    with pytest.raises(KvOffloadError, match="'f'"):
        sched.update("r", {}, {"f": chain[:3]}, 3 * BS)
    assert _lane_state(sched, "f") == before
    sched.update("r", {"f": [1, 2, 3]}, {"f": chain[:3]}, 3 * BS)
    assert _lane_state(sched, "f") == ([1, 2, 3], chain[:3], 0, 3 * BS)
