"""The store settings with several KV cache groups, on full + sliding window and full +
recurrent: ``max_store_blocks_per_step`` (per group pool and plan) and ``store_admission``
(one filter per group) take effect as with one group, and a limit below a group's store
point is refused naming the setting, the group and its kind."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvoffload import KVOffloader
from kvoffload.build import check_settings
from kvoffload.config import OffloadConfig
from kvoffload.errors import (
    ConfigError,
    InputTypeError,
    InvalidInputError,
    InvariantError,
    PinnerError,
)
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHash
from kvoffload.layout import KVLayout
from kvoffload.pinner import RefCountPinner
from kvoffload.scheduler.state import RequestPhase
from tests.groups_helpers import Rig, group

BS = 4
CHECKPOINT = 8
SHAPES = {
    "full+swa": [group("full", "full", BS), group("swa", "sliding_window", BS, window=9)],
    "full+recurrent": [group("full", "full", BS), group("rec", "recurrent", BS)],
}
_ids = itertools.count()


def config(**settings: object) -> OffloadConfig:
    return OffloadConfig.model_validate({"num_cpu_blocks": 64, **settings})


def rig(shape: str, **settings: object) -> Rig:
    return Rig(SHAPES[shape], checkpoint_tokens=CHECKPOINT, config=config(**settings))


def run_request(r: Rig, rid: str, n_tokens: int, seed: int = 0) -> None:
    """Register ``rid`` with ``n_tokens`` computed (tokens depend on ``seed`` only)."""
    toks = [seed * 1000 + i for i in range(n_tokens)]
    tables: dict[str, list[int | None]] = {
        g.name: [next(_ids) % 256 for _ in range(n_tokens // g.block_size)] for g in r.groups
    }
    r.sched.update(rid, tables, r.hashes(toks), n_tokens)


def drain_steps(r: Rig, steps: int) -> list[dict[str, int]]:
    """Plan and complete ``steps`` store steps; blocks planned per group per step."""
    out = []
    for _ in range(steps):
        plan = r.sched.plan_stores()
        out.append({} if plan is None else {n: p.num_blocks for n, p in plan.plans.items()})
        r.run(plan)
        r.sched.check_invariants()
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_the_step_limit_bounds_each_groups_plan_and_defers_the_rest(shape: str) -> None:
    limited, free = rig(shape, max_store_blocks_per_step=3), rig(shape)
    for r in (limited, free):
        run_request(r, "a", 32)
    steps = drain_steps(limited, 4)
    assert all(n <= 3 for step in steps for n in step.values()), steps
    assert steps[0] != drain_steps(free, 1)[0]  # the limit cut the first step
    stats = limited.sched.statistics()
    assert stats["full"].deferred_blocks > 0
    assert stats["full"].deferred_steps > 0
    # every block is stored in the end, as without the limit
    drain_steps(limited, 2)
    want = free.sched.statistics()
    got = limited.sched.statistics()
    for name in want:
        assert got[name].stored_blocks == want[name].stored_blocks, name
    # and the lookup finds the whole prefix
    toks = list(range(33))
    assert limited.sched.lookup("b", limited.hashes(toks), 33) == 32
    assert free.sched.lookup("b", free.hashes(toks), 33) == 32


@pytest.mark.parametrize("shape", SHAPES)
def test_admission_stores_a_block_the_second_time_it_is_offered(shape: str) -> None:
    r = rig(shape, store_admission="seen_twice")
    run_request(r, "a", 32)
    assert r.sched.plan_stores() is None  # every block offered once: refused
    r.sched.finish("a")
    toks = list(range(33))
    assert r.sched.lookup("x", r.hashes(toks), 33) == 0
    run_request(r, "b", 32)  # the same tokens: offered a second time
    plan = r.sched.plan_stores()
    assert plan is not None
    assert set(plan.plans) == {g.name for g in r.groups}
    r.run(plan)
    r.sched.check_invariants()
    assert r.sched.lookup("y", r.hashes(toks), 33) == 32


@pytest.mark.parametrize("shape", SHAPES)
def test_a_cancelled_store_gives_its_admissions_back(shape: str) -> None:
    """Regression: a cancelled grouped store must undo its admission offers, else its
    blocks (admitted, so forgotten by the filter) are refused when planned again."""
    r = rig(shape, store_admission="seen_twice")
    run_request(r, "a", 16)
    assert r.sched.plan_stores() is None
    r.sched.finish("a")
    run_request(r, "b", 16)
    plan = r.sched.plan_stores()
    assert plan is not None
    for name, sub in plan.plans.items():
        assert r.sched.cancel(name, sub)
    again = r.sched.plan_stores()
    assert again is not None
    assert {n: p.num_blocks for n, p in again.plans.items()} == {
        n: p.num_blocks for n, p in plan.plans.items()
    }


def test_a_limit_below_a_store_point_is_refused_naming_the_group() -> None:
    with pytest.raises(ConfigError, match=r"max_store_blocks_per_step=1: group 'swa' "
                       r"\(sliding_window\) needs 2 blocks for one store point"):  # fmt: skip
        rig("full+swa", max_store_blocks_per_step=1)
    rig("full+swa", max_store_blocks_per_step=2)
    rig("full+recurrent", max_store_blocks_per_step=1)  # one block per point
    chunked = [group("full", "full", BS), group("ch", "chunked", BS, chunk=16)]
    with pytest.raises(ConfigError, match=r"group 'ch' \(chunked\) needs 3 blocks"):
        Rig(chunked, checkpoint_tokens=CHECKPOINT, config=config(max_store_blocks_per_step=2))


def test_the_offloader_refuses_such_a_limit_when_built() -> None:
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
    groups = [
        KVCacheGroup.from_layout(lay, name="full"),
        KVCacheGroup.from_layout(lay, name="swa", kind="sliding_window", window=9),
    ]
    kv = {g.name: [torch.zeros(lay.tensor_shape(16)) for _ in range(2)] for g in groups}
    with pytest.raises(ConfigError, match=r"max_store_blocks_per_step=1: group 'swa'"):
        KVOffloader(config(max_store_blocks_per_step=1, num_cpu_blocks=8), kv, groups=groups)


def restore_rig(shape: str, **settings: object) -> tuple[Rig, dict[str, list[int | None]]]:
    """Request "a" (16 tokens) stored, then "b" (16 other tokens) evicting it: "a" is live
    and its GPU blocks still hold its KV. Returns the rig and "a"'s tables."""
    groups = SHAPES[shape]
    # each group's pool holds one request's blocks (a recurrent group: 2 snapshots)
    sizes = {g.name: 2 if g.kind == "recurrent" else 4 for g in groups}
    r = Rig(
        groups,
        cpu_blocks=sizes,
        checkpoint_tokens=CHECKPOINT,
        config=config(num_cpu_blocks=4, **settings),
    )
    tables: dict[str, list[int | None]] = {}
    for rid, seed in (("a", 0), ("b", 1)):
        toks = [seed * 1000 + i for i in range(16)]
        tables[rid] = list(range(seed * 4, seed * 4 + 4))  # type: ignore[assignment]
        r.sched.update(rid, {g.name: list(tables[rid]) for g in r.groups}, r.hashes(toks), 16)
        r.run(r.sched.plan_stores())
        r.sched.check_invariants()
    return r, {g.name: list(tables["a"]) for g in r.groups}


def a_hit(r: Rig) -> int | None:
    return r.sched.lookup("x", r.hashes(list(range(17))), 17)


@pytest.mark.parametrize("shape", SHAPES)
def test_restore_evicted_stores_a_live_requests_evicted_blocks_again(shape: str) -> None:
    r, _ = restore_rig(shape, restore_evicted=True)
    assert all(s.evicted_while_live for s in r.sched.statistics().values())
    assert a_hit(r) == 0
    r.sched.release("x")
    r.run(r.sched.plan_stores())
    r.sched.check_invariants()
    stats = r.sched.statistics()
    assert all(s.restored_blocks for s in stats.values()), stats
    assert a_hit(r) == 16
    # without the setting the evicted blocks stay evicted (counted all the same)
    off, _ = restore_rig(shape)
    off.run(off.sched.plan_stores())
    assert all(s.evicted_while_live for s in off.sched.statistics().values())
    assert not any(s.restored_blocks for s in off.sched.statistics().values())
    assert a_hit(off) == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_restore_reads_the_table_as_it_is_now(shape: str) -> None:
    """An entry the engine nulled is not restored; one it changed below the cursor is
    read from the new table (every entry is compared with ``restore_evicted``: the
    O(new entries) check would keep the old id and copy a stale GPU block)."""
    r, tables = restore_rig(shape, restore_evicted=True)
    toks = list(range(16))
    changed = {n: [None, 100, *t[2:]] for n, t in tables.items()}
    r.sched.update("a", changed, r.hashes(toks), 16)
    plan = r.sched.plan_stores()
    assert plan is not None
    for sub in plan.plans.values():
        assert 0 not in sub.gpu_block_ids  # nulled: not stored
        assert 1 not in sub.gpu_block_ids  # the old id of a changed entry: never read
    r.run(plan)
    r.sched.check_invariants()


# -- finish holds --------------------------------------------------------------------------


def hold_rig(shape: str, **settings: object) -> tuple[Rig, dict[str, list[int | None]]]:
    """Request "a" of 32 tokens whose first step stores only part (each pool: 4 blocks, 2
    for a recurrent group; the first plan is left in flight), then finished."""
    groups = SHAPES[shape]
    sizes = {g.name: 2 if g.kind == "recurrent" else 4 for g in groups}
    r = Rig(
        groups,
        cpu_blocks=sizes,
        checkpoint_tokens=CHECKPOINT,
        config=config(num_cpu_blocks=4, hold_blocks_on_finish=True, **settings),
    )
    tables: dict[str, list[int | None]] = {g.name: list(range(8)) for g in groups}
    r.sched.update("a", tables, r.hashes(list(range(32))), 32)
    return r, tables


@pytest.mark.parametrize("shape", SHAPES)
def test_finish_holds_each_groups_unstored_points_until_a_plan_reads_them(shape: str) -> None:
    r, _tables = hold_rig(shape)
    first = r.sched.plan_stores()  # the pools fill up: the rest is deferred
    assert first is not None
    assert r.sched.finish("a") is None  # held, not planned at finish
    held = r.sched.held_blocks("a")
    assert held["full"] == [4, 5, 6, 7]
    other = next(g for g in r.groups if g.kind != "full")
    assert held[other.name]  # its last points: the window's blocks, or the snapshots
    stats = r.sched.statistics()
    assert {n: s.held_blocks for n, s in stats.items()} == {n: len(i) for n, i in held.items()}
    r.sched.check_invariants()
    assert r.sched.plan_stores() is None  # every pool block is in flight: still held
    assert r.sched.take_released_holds() == {}
    r.run(first)
    plan = r.sched.plan_stores()  # now the held points are planned
    assert plan is not None
    assert plan.plans["full"].gpu_block_ids == (4, 5, 6, 7)
    assert r.sched.take_released_holds() == held
    r.sched.check_invariants()
    r.run(plan)
    assert not r.sched.has_request("a")
    r.sched.check_invariants()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_hold_is_given_up_after_hold_max_steps(shape: str) -> None:
    r, _ = hold_rig(shape, hold_max_steps=1)
    first = r.sched.plan_stores()
    r.sched.finish("a")
    held = r.sched.held_blocks("a")
    assert r.sched.plan_stores() is None  # deferred (call 2: within the step)
    assert r.sched.take_released_holds() == {}
    assert r.sched.plan_stores() is None  # call 3: given up unstored
    assert r.sched.take_released_holds() == held
    stats = r.sched.statistics()
    assert {n: s.hold_expired_blocks for n, s in stats.items()} == {
        n: len(i) for n, i in held.items()
    }
    assert all(s.held_blocks == 0 for s in stats.values())
    r.run(first)
    assert not r.sched.has_request("a")
    r.sched.check_invariants()


def test_hold_max_blocks_bounds_each_group_at_whole_store_points() -> None:
    r, _ = hold_rig("full+swa", hold_max_blocks=3)
    r.sched.plan_stores()
    r.sched.finish("a")
    held = r.sched.held_blocks("a")
    assert held["full"] == [4, 5, 6]  # a prefix within the budget, as one group
    assert len(held["swa"]) == 2  # one store point (2 blocks); the next would be 4
    r.sched.check_invariants()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_cancelled_plan_gives_the_hold_it_ended_back(shape: str) -> None:
    r, _ = hold_rig(shape)
    first = r.sched.plan_stores()
    assert first is not None
    r.sched.finish("a")
    held = r.sched.held_blocks("a")
    r.run(first)
    plan = r.sched.plan_stores()
    assert plan is not None
    assert r.sched.held_blocks("a") == {}
    for name, sub in plan.plans.items():
        assert r.sched.cancel(name, sub)
    # the engine was not told yet: the hold is back, and planned again
    assert r.sched.held_blocks("a") == held
    r.sched.check_invariants()
    again = r.sched.plan_stores()
    assert again is not None
    assert {n: p.gpu_block_ids for n, p in again.plans.items()} == {
        n: p.gpu_block_ids for n, p in plan.plans.items()
    }
    assert r.sched.take_released_holds() == held
    r.run(again)
    r.sched.check_invariants()


class Pinner:
    """A `RefCountPinner` whose ``pin`` raises (pinning nothing) while ``refuse``."""

    def __init__(self) -> None:
        self.inner = RefCountPinner()
        self.refuse = False

    def pin(self, gpu_block_ids: Sequence[int]) -> None:
        if self.refuse:
            raise RuntimeError("no")
        self.inner.pin(gpu_block_ids)

    def unpin(self, gpu_block_ids: Sequence[int]) -> None:
        self.inner.unpin(gpu_block_ids)

    def is_pinned(self, gpu_block_id: int) -> bool:
        return self.inner.is_pinned(gpu_block_id)

    @property
    def num_pinned(self) -> int:
        return self.inner.num_pinned


def _offloader(**settings: object) -> tuple[KVOffloader, dict[str, Pinner]]:
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
    groups = [
        KVCacheGroup.from_layout(lay, name="full"),
        KVCacheGroup.from_layout(lay, name="swa", kind="sliding_window", window=9),
    ]
    kv = {g.name: [torch.zeros(lay.tensor_shape(16)) for _ in range(2)] for g in groups}
    pinners = {g.name: Pinner() for g in groups}
    settings = {"hold_blocks_on_finish": True, **settings}
    cfg = config(num_cpu_blocks=4, checkpoint_tokens=8, **settings)
    return KVOffloader(cfg, kv, groups=groups, pinner=pinners), pinners


@pytest.mark.anyio
async def test_the_offloader_pins_held_blocks_until_their_store_is_planned() -> None:
    off, pinners = _offloader()
    async with off:
        tables: dict[str, list[int | None]] = {"full": list(range(6)), "swa": list(range(6))}
        req = off.request("a", list(range(25)))
        req.lookup()
        req.advance(tables, 24)
        off.store()  # the pools (4 blocks each) are full: the rest deferred
        req.finish()
        assert pinners["full"].is_pinned(4)
        assert pinners["full"].is_pinned(5)
        assert off.statistics().scheduler.held_blocks > 0
        await off.drain()
        assert pinners["full"].is_pinned(5)  # held: the store that read them is to come
        off.store()
        await off.drain()
        assert all(p.num_pinned == 0 for p in pinners.values())
        stats = off.statistics().scheduler
        assert stats.held_blocks == 0
        assert stats.stored_blocks == 4 + 4 + 2 + 2  # a step: 4 each; then the holds


@pytest.mark.anyio
async def test_a_hold_the_pinner_refuses_is_cancelled() -> None:
    off, pinners = _offloader()
    async with off:
        tables: dict[str, list[int | None]] = {"full": list(range(6)), "swa": list(range(6))}
        req = off.request("a", list(range(25)))
        req.lookup()
        req.advance(tables, 24)
        off.store()

        refusing = pinners["swa"]
        refusing.refuse = True
        with pytest.raises(PinnerError, match=r"holds on finish"):
            req.finish()
        refusing.refuse = False
        assert off.statistics().scheduler.held_blocks == 0
        assert not pinners["full"].is_pinned(4)
        await off.drain()
        off.store()
        await off.drain()
        assert all(p.num_pinned == 0 for p in pinners.values())


@pytest.mark.anyio
async def test_closing_the_offloader_releases_the_holds() -> None:
    off, pinners = _offloader()
    async with off:
        tables: dict[str, list[int | None]] = {"full": list(range(6)), "swa": list(range(6))}
        req = off.request("a", list(range(25)))
        req.lookup()
        req.advance(tables, 24)
        off.store()
        req.finish()
    assert all(p.num_pinned == 0 for p in pinners.values())


# -- lazy stores: refused for a group not full attention, with the reason of its kind -----


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ("full+swa", r"group 'swa' \(sliding_window\): a lazy store copies a block only when"),
        ("full+recurrent", r"group 'rec' \(recurrent\): its state is one snapshot per checkpoint"),
        ("full+chunked", r"group 'ch' \(chunked\): a lazy store copies a block only when"),
    ],
)
def test_lazy_stores_are_refused_naming_each_group_and_why(shape: str, reason: str) -> None:
    groups = {
        **SHAPES,
        "full+chunked": [group("full", "full", BS), group("ch", "chunked", BS, chunk=16)],
    }[shape]
    for settings in ({"store_mode": "lazy"}, {"store_mode": "lazy", "lazy_offload_blocks": 2}):
        with pytest.raises(ConfigError) as info:
            check_settings(config(**settings), "offloader_groups", groups=groups)
        message = str(info.value)
        assert "store_mode='lazy'" in message
        assert "KVOffloader with several KV cache groups" in message
        assert re.search(reason, message)
        assert "a hit needs every group's blocks" in message
        assert "group 'full'" not in message  # a full group stores lazily
        # the scheduler refuses them itself, whichever entry point builds it
        with pytest.raises(ConfigError, match=r"store_mode='lazy' cannot serve these groups"):
            Rig(groups, checkpoint_tokens=CHECKPOINT, config=config(**settings))
    with pytest.raises(ConfigError, match=r"lazy_offload_blocks=2 \(a setting of store_mode"):
        check_settings(config(lazy_offload_blocks=2), "offloader_groups", groups=groups)


def test_the_offloader_refuses_lazy_stores_naming_the_groups() -> None:
    with pytest.raises(ConfigError, match=r"store_mode='lazy' .*group 'swa' \(sliding_window\)"):
        _offloader(store_mode="lazy", hold_blocks_on_finish=False)


@pytest.mark.parametrize("shape", SHAPES)
def test_restored_blocks_are_published_with_their_requests_priority(shape: str) -> None:
    """A re-store (``restore_evicted``) of a request with a retention priority publishes
    its blocks with that priority, as every other store of it does and as one group's
    re-stores do (the planner once raised only the blocks its store points passed)."""
    r, _ = restore_rig(shape, restore_evicted=True)
    r.sched.set_priority("a", 3)
    plan = r.sched.plan_stores()
    assert plan is not None
    restored = {name: set(sub.block_hashes) for name, sub in plan.plans.items()}
    r.run(plan)
    r.sched.check_invariants()
    for name, hashes in restored.items():
        pool = r.sched.ledger(name).pool
        for h in hashes:
            block = pool.get_cached(h)
            assert block is not None, (name, h)
            assert block.priority == 3, (name, block)


def test_lazy_stores_are_accepted_when_every_group_is_full_attention() -> None:
    full = [group("a", "full", BS), group("b", "full", BS)]
    check_settings(
        config(store_mode="lazy", lazy_offload_blocks=2), "offloader_groups", groups=full
    )
    Rig(full, config=config(store_mode="lazy"))


# -- lazy stores with every group full attention ---------------------------------------------

FULL = [group("a", "full", BS), group("b", "full", BS)]


class View:
    """An engine's cache view: ``(gpu block, hash)`` pairs, next to be evicted first."""

    def __init__(self, items: Sequence[tuple[int, bytes]]) -> None:
        self.items = list(items)

    def iter_eviction_order(self) -> Iterator[tuple[int, BlockHash]]:
        return iter((i, BlockHash(h)) for i, h in self.items)


def lazy_rig(**settings: object) -> Rig:
    return Rig(FULL, config=config(store_mode="lazy", **settings))


def views(r: Rig, tokens: Sequence[int], ids: Sequence[int]) -> dict[str, View]:
    """Per group, a view of the blocks of ``tokens`` in GPU blocks ``ids`` (each group's
    hashes), in that order."""
    hashes = r.hashes(tokens)
    return {n: View(list(zip(ids, hs, strict=False))) for n, hs in hashes.items()}


def test_each_full_group_stores_lazily_from_its_own_view() -> None:
    r = lazy_rig(lazy_offload_blocks=3)
    toks = list(range(20))  # 5 blocks
    r.sched.update("a", {"a": list(range(5)), "b": list(range(5))}, r.hashes(toks), 20)
    with pytest.raises(InvalidInputError, match=r"needs the engine's gpu_cache view"):
        r.sched.plan_stores()
    # group b's view holds other blocks: each group walks its own order
    gv = views(r, toks, [4, 3, 2, 1, 0])
    gv["b"] = View(list(zip([0, 1], r.hashes(toks)["b"], strict=False)))
    plan = r.sched.plan_stores(gv)
    assert plan is not None
    assert plan.plans["a"].gpu_block_ids == (4, 3, 2)  # lazy_offload_blocks of its order
    assert plan.plans["b"].gpu_block_ids == (0, 1)
    assert plan.plans["a"].request_ids == ()  # no request's cursor moves
    r.run(plan)
    r.sched.check_invariants()
    assert r.sched.finish("a") is None  # lazy: nothing planned at finish, as one group
    # a hit needs every group's blocks: b holds the first two only
    assert r.sched.lookup("x", r.hashes(list(range(21))), 21) == 2 * BS
    r.sched.release("x")
    r.run(r.sched.plan_stores(views(r, toks, [0, 1, 2, 3, 4])))
    r.sched.check_invariants()
    # the first 3 of each order: b stores its third block now
    assert r.sched.lookup("y", r.hashes(list(range(21))), 21) == 3 * BS


@pytest.mark.parametrize(
    ("given", "error", "message"),
    [
        ({"a": View([])}, InvalidInputError, r"missing \['b'\], unknown \[\]"),
        (
            {"a": View([]), "b": View([]), "c": View([])},
            InvalidInputError,
            r"missing \[\], unknown \['c'\]",
        ),
        (View([]), InputTypeError, r"gpu_cache=View: .*one GpuCacheView per group name"),
    ],
)
def test_lazy_views_must_name_exactly_the_groups(
    given: object, error: type[Exception], message: str
) -> None:
    r = lazy_rig()
    with pytest.raises(error, match=message):
        r.sched.plan_stores(given)  # type: ignore[arg-type]
    r.sched.check_invariants()
    assert r.sched.statistics()["a"].store_plans == 0


def test_eager_stores_ignore_the_views_as_one_group_does() -> None:
    r = Rig(FULL, config=config())
    toks = list(range(8))
    r.sched.update("a", {"a": [0, 1], "b": [0, 1]}, r.hashes(toks), 8)
    plan = r.sched.plan_stores(views(r, toks, [5, 6]))
    assert plan is not None
    assert plan.plans["a"].gpu_block_ids == (0, 1)  # the request's table, not the view


@pytest.mark.anyio
async def test_the_offloader_stores_two_full_groups_lazily() -> None:
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
    groups = [KVCacheGroup.from_layout(lay, name=n) for n in ("a", "b")]
    kv = {g.name: [torch.zeros(lay.tensor_shape(16)) for _ in range(2)] for g in groups}
    cfg = config(store_mode="lazy", lazy_offload_blocks=2, num_cpu_blocks=8)
    async with KVOffloader(cfg, kv, groups=groups) as off:
        prompt = list(range(3 * BS + 1))
        assert off._life.front is not None
        hashes = off._life.front.hash_prompt(prompt)
        order = {n: View([(9, hs[2]), (8, hs[1]), (7, hs[0])]) for n, hs in hashes.items()}
        with pytest.raises(InputTypeError, match=r"one GpuCacheView per group name"):
            off.store(gpu_cache=order["a"])
        with pytest.raises(InvalidInputError, match=r"missing \['b'\]"):
            off.store(gpu_cache={"a": order["a"]})
        (task,) = off.store(gpu_cache=order)
        await task
        stats = off.statistics().groups
        assert stats is not None
        assert {n: s.stored_blocks for n, s in stats.items()} == {"a": 2, "b": 2}
        with off.request("x", prompt) as req:
            assert req.lookup() == 0  # blocks 2 and 1 only: no leading run
        (task,) = off.store(gpu_cache={n: View([(7, hs[0])]) for n, hs in hashes.items()})
        await task
        with off.request("y", prompt) as req:
            assert req.lookup() == 3 * BS


def test_a_finished_full_lane_holding_nothing_passes_no_live_block() -> None:
    """With finish holds, a full lane that holds nothing (its blocks past the cursor are
    ``None``) while another lane holds: its live blocks were dropped at finish, and the
    plans that store the other lane's hold make none of its blocks live again."""
    full = group("attn", "full", 4)
    win = group("win", "sliding_window", 4, window=9)
    rig = Rig([full, win], checkpoint_tokens=8, config=config(hold_blocks_on_finish=True))
    sched = rig.sched
    h = rig.hashes([i % 50_000 for i in range(16)])
    sched.update("a", {"attn": [0, 1], "win": [2, 3]}, {k: v[:2] for k, v in h.items()}, 8)
    rig.run(sched.plan_stores())
    sched.update("a", {"attn": [0, 1, None, None], "win": [2, 3, 4, 5]}, h, 16)
    assert sched.finish("a") is None
    assert sched.held_blocks("a") == {"win": [4, 5]}
    sched.check_invariants()
    plan = sched.plan_stores()  # stores the window's hold, passes the full lane's Nones
    sched.check_invariants()
    rig.run(plan)
    sched.check_invariants()
    assert sched.held_blocks("a") == {}


@pytest.mark.parametrize("deferred", [True, False])
def test_a_finish_after_a_full_groups_deferral_stores_no_point_past_it(deferred: bool) -> None:
    """A step that deferred a full group's blocks left them unstored, and a finish retries
    nothing (as with one group); the window group's finish stored its points up to the
    computed length all the same, filling its pool with blocks no hit can use (a hybrid
    model then hit less than one group). It stops where the full group's stores went.
    Without a deferral the finish plans its last point as before."""
    r = Rig(
        [group("full", "full", 4), group("win", "sliding_window", 4, window=8)],
        cpu_blocks=64,
        checkpoint_tokens=8,
        config=config(max_store_blocks_per_step=4 if deferred else 64),
    )
    toks = list(range(32))
    tables = {"full": list(range(8)), "win": list(range(100, 108))}
    r.sched.update("a", tables, r.hashes(toks), 32)
    r.run(r.sched.plan_stores())
    full = r.sched._requests["a"].lanes["full"]
    assert full.cursor == (4 if deferred else 8)
    plan = r.sched.finish("a")
    if deferred:
        # the window's points up to 16 tokens (the full group's 4 blocks) were stored by
        # the step; nothing past them is planned at finish
        assert plan is None or "win" not in plan.plans
    else:
        assert plan is None  # the step stored every point, the last one included
    r.run(plan)
    r.sched.check_invariants()
    hit = r.sched.lookup("b", r.hashes([*toks, 99]), 33)
    assert hit == (16 if deferred else 32)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_request_phase_follows_it_on_every_shape(shape: str) -> None:
    """`GroupedRequest.phase`, the one place a request's phase is read (one group's
    `request_state().phase` is it): live, preempted until its next update, holding
    while a finished request holds blocks, draining once its holds ended."""
    r, tables = hold_rig(shape)
    state = r.sched.request_table.known("a")
    assert state.phase is RequestPhase.LIVE
    r.sched.preempt("a")
    assert state.phase is RequestPhase.PREEMPTED
    r.sched.lookup("a", r.hashes(list(range(32))), 32)  # a lookup is not an update
    assert state.phase is RequestPhase.PREEMPTED
    r.sched.update("a", tables, r.hashes(list(range(32))), 32)
    assert state.phase is RequestPhase.LIVE
    first = r.sched.plan_stores()
    assert first is not None
    r.sched.finish("a")
    assert state.phase is RequestPhase.HOLDING
    r.run(first)
    r.sched.release_all_holds()
    assert state.phase is RequestPhase.DRAINING
    r.sched.check_invariants()


def test_a_preempted_request_that_kept_a_table_breaks_an_invariant() -> None:
    """`check_invariants()` holds a preempted request to what `preempt()` left: no table
    and no cursor in any group until its next update."""
    r, _tables = hold_rig(next(iter(SHAPES)))
    r.sched.preempt("a")
    r.sched.check_invariants()
    state = r.sched.request_table.known("a")
    lane = next(iter(state.lanes.values()))
    lane.table = [7]
    lane.ids = {7}
    with pytest.raises(InvariantError, match="'a': preempted"):
        r.sched.check_invariants()
