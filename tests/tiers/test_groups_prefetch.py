"""`off.hints.prefetch()` with several KV cache groups: every group's tiers bring back what
a lookup of the prompt needs (a full group's run, a window or a state at each store
point, and at a finish point), concurrently; the next lookup is a CPU hit, bytes exact;
a cancelled prefetch leaks nothing in any group; each group's pool keeps its own bound."""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from test_groups_offloader import TURN1, TURN2, settle, tiered, tiers_of
from test_offloader_groups import Model, Tables, groups_of, serve

from kvoffload import KVOffloader
from kvoffload.tiers.groups import GroupTiers

pytestmark = pytest.mark.anyio

KINDS = ["sliding", "recurrent"]


def group_tiers(off: KVOffloader) -> GroupTiers:
    session = off._life.front
    assert session is not None
    assert session.tiers is not None
    return session.tiers


async def written_then_emptied(off: KVOffloader, model: Model, prompt: list[int]) -> None:
    """``prompt`` served and written to every group's tier, then every CPU pool reset."""
    await serve(off, model, Tables(model), "a", prompt)
    await settle(off)
    assert await off.reset()
    assert all(s.cached_cpu_blocks == 0 for s in off.statistics().groups.values())  # type: ignore[union-attr]
    model.wipe()


async def hit_now(off: KVOffloader, model: Model, rid: str, prompt: list[int]) -> int:
    """A lookup that may wait answers at once (no promotion to wait for); then the load,
    bytes checked in every group (`serve()`)."""
    with off.request(f"{rid}-probe", prompt) as req:
        hit = req.lookup(allow_defer=True)
        assert hit is not None  # nothing to wait for: the prefetch brought it all
    served, _ = await serve(off, model, Tables(model), rid, prompt)
    assert served == hit
    return hit


@pytest.mark.parametrize("kind", KINDS)
async def test_a_prefetch_makes_the_next_grouped_lookup_a_cpu_hit(
    kind: str, tmp_path: Path
) -> None:
    model = Model(groups_of(kind))
    async with KVOffloader(tiered(tmp_path / "kv.bin"), model.kv, groups=model.groups) as off:
        await written_then_emptied(off, model, TURN1)
        assert await off.hints.prefetch(TURN2) == 16
        per_group = group_tiers(off).group_statistics()
        for name, stats in per_group.items():
            assert stats.prefetch_blocks_promoted > 0, name
            assert stats.prefetches_completed >= 1, name
        assert await hit_now(off, model, "b", TURN2) == 16
        await settle(off)
        assert tiers_of(off).refs_held == 0
        assert off.tiers is not None
        assert off.tiers.prefetch_blocks == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_prefetch_brings_a_finish_point_once_the_full_group_is_back(
    kind: str, tmp_path: Path
) -> None:
    turn1 = list(range(1, 23))  # 22 tokens: store points 8, 16 and the finish at 20
    turn2 = [*turn1, 50, 51, 52]
    model = Model(groups_of(kind))
    async with KVOffloader(tiered(tmp_path / "kv.bin"), model.kv, groups=model.groups) as off:
        await written_then_emptied(off, model, turn1)
        assert await off.hints.prefetch(turn2) == 20  # one call: the snapshot at 20 too
        assert await hit_now(off, model, "b", turn2) == 20
        await settle(off)


async def test_a_new_offloader_prefetches_from_the_persistent_files(tmp_path: Path) -> None:
    cfg = tiered(tmp_path / "kv.bin", persist=True)
    model = Model(groups_of("recurrent"))
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        await serve(off, model, Tables(model), "a", TURN1)
        await settle(off)
    model = Model(groups_of("recurrent"))  # a new process: nothing on GPU or CPU
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        assert await off.hints.prefetch(TURN2) == 16
        assert await hit_now(off, model, "b", TURN2) == 16
        await settle(off)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancelled_grouped_prefetch_leaks_nothing_in_any_group(
    kind: str, tmp_path: Path
) -> None:
    model = Model(groups_of(kind))
    async with KVOffloader(tiered(tmp_path / "kv.bin"), model.kv, groups=model.groups) as off:
        await written_then_emptied(off, model, TURN1)
        front = group_tiers(off)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(off.hints.prefetch, TURN2)
                while front.prefetch_blocks == 0:  # some group's read is under way
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
        assert scope.cancelled_caught
        await settle(off)  # check_invariants() of the offloader and every group's tiers
        stats = tiers_of(off)
        assert stats.refs_held == 0
        assert stats.prefetches_cancelled >= 1
        assert front.prefetch_blocks == 0
        # Nothing half-read was published: a prefetch now brings the rest, bytes exact.
        assert await off.hints.prefetch(TURN2) == 16
        assert await hit_now(off, model, "b", TURN2) == 16
        await settle(off)


@pytest.mark.parametrize("kind", KINDS)
async def test_the_prefetch_bound_limits_each_groups_pool(kind: str, tmp_path: Path) -> None:
    model = Model(groups_of(kind))
    cfg = tiered(tmp_path / "kv.bin").model_copy(update={"max_prefetch_fraction": 0.0625})
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        bounds = {n: m.max_prefetch_blocks for n, m in group_tiers(off).managers.items()}
        assert bounds["full"] == 2  # 2 of the full group's 32 blocks
        await written_then_emptied(off, model, TURN1)
        # The full group brings 2 of its 4 blocks back: a hit of 8 tokens, not 16.
        assert await off.hints.prefetch(TURN2) == 8
        per_group = group_tiers(off).group_statistics()
        assert per_group["full"].prefetch_blocks_promoted == 2
        assert per_group["full"].prefetches_bounded == 1
        for name, stats in per_group.items():
            assert stats.prefetch_blocks_promoted <= bounds[name] * stats.prefetches, name
        off.check_invariants()
        with off.request("b", TURN2) as req:
            assert req.lookup() == 8  # (and its promotions ask for the rest)
        await settle(off)
