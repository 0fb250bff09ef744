"""A multi-group `KVOffloader` with a disk tier: one tier stack per group, keyed by that
group's namespace; write-downs of every group's stores, promotions that bring back every
group's blocks (bytes exact on load), a block served under another group's namespace
refused, and a group whose tier fails giving no hit for that prefix."""

from __future__ import annotations

import errno
import uuid
from pathlib import Path
from typing import Any, NoReturn

import anyio
import anyio.to_thread
import pytest
from test_offloader_groups import ATTN, BS, Model, Tables, groups_of, serve
from tier_helpers import wait_until

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import IntegrityError
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHasher
from kvoffload.scheduler import loads
from kvoffload.tiers import ops
from kvoffload.tiers.base import BlockWrite
from kvoffload.tiers.promote import Promoter
from kvoffload.tiers.stats import TierManagerStatistics, TierStatistics

pytestmark = pytest.mark.anyio


def tiered(path: Path, num_cpu: int = 32, **disk: object) -> OffloadConfig:
    tier: dict[str, object] = {"kind": "disk", "name": "d", "path": str(path)}
    tier.update({"capacity_bytes": "4MiB", **disk})
    return OffloadConfig(num_cpu_blocks=num_cpu, block_size=BS, checkpoint_tokens=8, tiers=[tier])


def tiers_of(off: KVOffloader) -> TierManagerStatistics:
    stats = off.statistics().tiers
    assert stats is not None
    return stats


def group_tiers(off: KVOffloader) -> dict[str, TierManagerStatistics]:
    """Per group, its tier manager's statistics."""
    session = off._life.front
    assert session is not None
    assert session.tiers is not None
    return session.tiers.group_statistics()


def tier_stats(off: KVOffloader) -> dict[str, TierStatistics]:
    """Per group, its one tier's statistics (every group's tier is named ``<tier>.<group>``)."""
    return {t.name.split(".", 1)[1]: t for t in tiers_of(off).tiers}


async def settle(off: KVOffloader) -> None:
    """Wait for every store, write-down and promotion of every group to end."""
    await off.drain()
    await wait_until(
        lambda: tiers_of(off).refs_held == 0 and not tiers_of(off).promotions_in_flight
    )
    off.check_invariants()


def probe(off: KVOffloader, rid: str, tokens: list[int]) -> int:
    """A lookup that answers from CPU and starts the promotions; its pins released."""
    with off.request(rid, tokens) as req:
        hit = req.lookup()
        off.check_invariants()
    return hit


TURN1 = list(range(1, 19))  # 18 tokens: store points 8, 16 and the finish at 16
TURN2 = [*TURN1, 50, 51, 52]


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
async def test_every_group_is_written_down_and_promoted_back_bytes_exact(
    kind: str, tmp_path: Path
) -> None:
    model = Model(groups_of(kind))
    alloc = Tables(model)
    names = [g.name for g in model.groups]
    async with KVOffloader(tiered(tmp_path / "kv.bin"), model.kv, groups=model.groups) as off:
        hit, _ = await serve(off, model, alloc, "a", TURN1)
        assert hit == 0
        await settle(off)
        written = {n: s.blocks_written for n, s in tier_stats(off).items()}
        stored = {n: s.stored_blocks for n, s in off.statistics().groups.items()}  # type: ignore[union-attr]
        assert written == stored  # each group's stores, each to its own tier
        assert all(written[n] > 0 for n in names)
        files = await anyio.to_thread.run_sync(lambda: sorted(p.name for p in tmp_path.iterdir()))
        assert files == sorted(f"kv.{n}.bin" for n in names)
        assert [t.name for t in tiers_of(off).tiers] == [f"d.{n}" for n in names]
        assert await off.reset()
        assert all(s.cached_cpu_blocks == 0 for s in off.statistics().groups.values())  # type: ignore[union-attr]
        model.wipe()
        # Nothing on CPU: this lookup misses and asks every group's tier.
        assert probe(off, "b", TURN2) == 0
        await settle(off)
        # The promotions landed in every group: the hit is back, loaded bytes exact
        # (serve() checks every block of every group the hit needs).
        hit, _ = await serve(off, model, alloc, "c", TURN2)
        assert hit == 16
        await settle(off)
        for n, s in tier_stats(off).items():
            assert s.blocks_promoted > 0, n
            assert s.failed_checks == 0, n
        session = off._life.front
        assert session is not None
        assert session.tiers is not None
        per_group = session.tiers.group_statistics()
        total = tiers_of(off)
        assert total.promotions == sum(p.promotions for p in per_group.values()) >= 2
        assert total.promotion_errors == 0


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
async def test_a_finish_point_between_checkpoints_comes_back_once_the_full_group_did(
    kind: str, tmp_path: Path
) -> None:
    model = Model(groups_of(kind))
    alloc = Tables(model)
    turn1 = list(range(1, 23))  # 22 tokens: store points 8, 16 and the finish at 20
    turn2 = [*turn1, 50, 51, 52]
    async with KVOffloader(tiered(tmp_path / "kv.bin"), model.kv, groups=model.groups) as off:
        await serve(off, model, alloc, "a", turn1)
        await settle(off)
        assert await off.reset()
        model.wipe()
        assert probe(off, "b", turn2) == 0  # promotes the full run and the points 8, 16
        await settle(off)
        # The full group reaches 20 on CPU now. The window of 20 lies within those of the
        # points 16 and 24, so the sliding group has it already; the snapshot at 20 is not
        # at a store point: it is asked for now.
        assert probe(off, "c", turn2) == (20 if kind == "sliding" else 16)
        await settle(off)
        hit, _ = await serve(off, model, alloc, "d", turn2)
        assert hit == 20


async def test_persistent_files_serve_every_group_to_a_new_offloader(tmp_path: Path) -> None:
    cfg = tiered(tmp_path / "kv.bin", persist=True)
    model = Model(groups_of("recurrent"))
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        await serve(off, model, Tables(model), "a", TURN1)
        await settle(off)
    model = Model(groups_of("recurrent"))  # a new process: nothing on GPU or CPU
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        assert probe(off, "b", TURN2) == 0
        await settle(off)
        hit, _ = await serve(off, model, Tables(model), "c", TURN2)
        assert hit == 16
        assert all(s.blocks_promoted > 0 for s in tier_stats(off).values())


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
async def test_redis_keys_every_group_apart_on_one_server(kind: str, redis_url: str) -> None:
    aioredis = pytest.importorskip("redis.asyncio")
    prefix = f"kvo-groups-{uuid.uuid4().hex[:12]}:"
    tier = {"kind": "redis", "name": "r", "url": redis_url, "key_prefix": prefix}
    cfg = OffloadConfig(num_cpu_blocks=32, block_size=BS, checkpoint_tokens=8, tiers=[tier])
    model = Model(groups_of(kind))
    alloc = Tables(model)
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
            await serve(off, model, alloc, "a", TURN1)
            await settle(off)
            written = sum(s.blocks_written for s in tier_stats(off).values())
            keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
            assert len(keys) == written  # one server, one prefix: no key shared by groups
            assert len({k[len(prefix) : len(prefix) + 16] for k in keys}) == 2  # namespaces
            assert await off.reset()
            model.wipe()
            assert probe(off, "b", TURN2) == 0
            await settle(off)
            hit, _ = await serve(off, model, alloc, "c", TURN2)
            assert hit == 16  # bytes exact in every group (serve() checks them)
            await settle(off)
    finally:
        async for k in client.scan_iter(match=f"{prefix}*"):
            await client.delete(k)
        await client.aclose()


async def test_a_small_pool_evicted_by_other_prompts_is_served_from_the_tiers(
    tmp_path: Path,
) -> None:
    model = Model(groups_of("recurrent"))
    async with KVOffloader(
        tiered(tmp_path / "kv.bin", num_cpu=6), model.kv, groups=model.groups
    ) as off:
        await serve(off, model, Tables(model), "a", TURN1)
        await settle(off)
        for i in range(3):  # other conversations push TURN1 out of both CPU pools
            await serve(off, model, Tables(model), f"o{i}", list(range(200 + 20 * i, 218 + 20 * i)))
            await settle(off)
        assert probe(off, "b", TURN2) == 0
        await settle(off)
        model.wipe()
        hit, _ = await serve(off, model, Tables(model), "c", TURN2)
        assert hit == 16, (off.statistics().groups, tier_stats(off))
        await settle(off)


def copy_over(source: Path, target: Path) -> None:
    """Write ``source``'s bytes over ``target``'s, in place (the same file, new bytes)."""
    assert target.stat().st_size == source.stat().st_size
    with open(target, "r+b") as f:
        f.write(source.read_bytes())


async def swap_in_other_group_blocks(off: KVOffloader, how: str, tmp_path: Path) -> None:
    """Make the full group's tier hold the swa group's blocks of TURN1: its file's bytes
    replaced by the swa group's file (``file``), or each block of the swa group put, with
    its header, under the full group's key (``header``)."""
    full, swa = tmp_path / "kv.full.bin", tmp_path / "kv.swa.bin"
    if how == "file":
        await anyio.to_thread.run_sync(copy_over, swa, full)
        return
    session = off._life.front
    assert session is not None
    assert session.tiers is not None
    tiers = {n: m.tiers[0] for n, m in session.tiers.managers.items()}
    keys = {}
    for n, ns in session.namespaces.items():
        hasher = BlockHasher(ns.root, BS)
        hasher.extend(TURN1)
        keys[n] = list(hasher.block_hashes)
    nbytes = off._life.hosts["swa"].layout.bytes_per_block
    await tiers["full"].delete(keys["full"])
    for mine, theirs in zip(keys["full"], keys["swa"], strict=True):
        buf = memoryview(bytearray(nbytes))
        (read,) = await tiers["swa"].get([theirs], [buf])
        assert read is not None
        assert await tiers["full"].put([BlockWrite(mine, read.header, buf)]) == 1


@pytest.mark.parametrize("how", ["file", "header"])
async def test_a_block_of_another_group_is_refused_counted_and_never_served(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reasons: list[str] = []
    real = ops.verify_block

    def spy(*args: object, **kw: object) -> None:
        try:
            real(*args, **kw)  # type: ignore[arg-type]
        except IntegrityError as exc:
            reasons.append(exc.reason)
            raise

    monkeypatch.setattr(ops, "verify_block", spy)
    model = Model(groups_of("sliding"))  # both groups: the same bytes per block
    alloc = Tables(model)
    async with KVOffloader(tiered(tmp_path / "kv.bin"), model.kv, groups=model.groups) as off:
        await serve(off, model, alloc, "a", TURN1)
        await settle(off)
        await swap_in_other_group_blocks(off, how, tmp_path)
        assert await off.reset()
        model.wipe()
        assert probe(off, "b", TURN2) == 0
        await settle(off)
        hit, _ = await serve(off, model, alloc, "c", TURN2)
        assert hit == 0  # the full group has nothing valid: no hit for any group
        await settle(off)
        stats = tier_stats(off)
        assert stats["full"].failed_checks >= 1
        assert stats["full"].blocks_promoted == 0
        assert stats["swa"].failed_checks == 0
        # The headers are the full group's own (the file's payload changed: its checksum
        # fails) or the swa group's (its namespace fails): every block is refused.
        assert reasons == ["checksum" if how == "file" else "namespace"] * 4
        # The swa group's own blocks came back, and no hit used them without the full
        # group's.
        assert stats["swa"].blocks_promoted == 4


async def test_a_failing_tier_of_one_group_gives_no_hit_and_corrupts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Model(groups_of("recurrent"))
    alloc = Tables(model)
    cfg = tiered(tmp_path / "kv.bin", retry_initial_s=0.02, retry_max_s=0.05)
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        await serve(off, model, alloc, "a", TURN1)
        await settle(off)
        session = off._life.front
        assert session is not None
        assert session.tiers is not None
        rec = session.tiers.managers["rec"].tiers[0]

        async def broken(*args: object) -> NoReturn:
            raise OSError(errno.EIO, "Input/output error")

        for op in ("exists", "get", "ping"):  # the rec group's disk fails every read
            monkeypatch.setattr(rec, op, broken)
        assert await off.reset()
        model.wipe()
        assert probe(off, "b", TURN2) == 0
        await settle(off)
        stats = tier_stats(off)
        assert stats["full"].blocks_promoted > 0  # the full group's blocks are back
        assert stats["rec"].blocks_promoted == 0
        # ... but a hit needs a snapshot too: none for this prefix, and the engine
        # recomputes it (serve() stores it again).
        hit, _ = await serve(off, model, alloc, "c", TURN2)
        assert hit == 0
        await settle(off)
        model.wipe()
        hit, _ = await serve(off, model, alloc, "d", [*TURN2, 60])
        assert hit == 20  # served from CPU, bytes exact
        assert not tier_stats(off)["rec"].healthy
        assert tier_stats(off)["rec"].errors >= 1
        monkeypatch.undo()
        await wait_until(lambda: tier_stats(off)["rec"].healthy)
        off.check_invariants()


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
async def test_off_tiers_is_the_groups_tier_front(kind: str, tmp_path: Path) -> None:
    """``off.tiers`` with several groups: the same read API as one group's tier manager,
    over the whole model (every group's tiers, the counters added up, every group's
    invariants, a promotion in flight in any group)."""
    model = Model(groups_of(kind))
    alloc = Tables(model)
    cfg = tiered(tmp_path / "kv.bin").model_copy(update={"max_prefetch_fraction": 0.25})
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        front = off.tiers
        assert front is not None
        session = off._life.front
        assert session is not None
        assert session.tiers is front
        managers = session.tiers.managers
        assert [t.name for t in front.tiers] == [f"d.{g.name}" for g in model.groups]
        assert (
            front.max_prefetch_blocks
            == sum(m.max_prefetch_blocks for m in managers.values())
            == sum(s.num_cpu_blocks // 4 for s in off.statistics().groups.values())
        )  # type: ignore[union-attr]
        assert front.defer_deadline_s == max(m.defer_deadline_s for m in managers.values()) > 0
        await serve(off, model, alloc, "a", TURN1)
        await settle(off)
        assert front.statistics() == tiers_of(off)
        front.check_invariants()
        assert await off.reset()
        hashes = session.hash_prompt(TURN2)
        assert probe(off, "b", TURN2) == 0
        assert front.is_promoting(hashes["full"][0])
        assert front.prefetch_blocks == 0
        await settle(off)
        assert not front.is_promoting(hashes["full"][0])
        assert front.statistics().promotions >= 2


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
async def test_a_grouped_lookup_asks_again_while_a_promotion_runs(
    kind: str, tmp_path: Path
) -> None:
    """``lookup(allow_defer=True)`` with several groups: "ask again" while the promotions
    of the blocks a longer hit needs run (the lookup that started them included), then
    the whole hit from CPU; counted in the tiers' ``deferred_lookups``."""
    model = Model(groups_of(kind))
    alloc = Tables(model)
    async with KVOffloader(tiered(tmp_path / "kv.bin"), model.kv, groups=model.groups) as off:
        await serve(off, model, alloc, "a", TURN1)
        await settle(off)
        assert await off.reset()
        model.wipe()
        with off.request("b", TURN2) as req:
            assert req.lookup(allow_defer=True) is None  # the lookup started the promotions
            off.check_invariants()
            await settle(off)
            hit = req.lookup(allow_defer=True)
            assert hit == 16
            # the whole hit came from the tier "d" (every group's blocks of it)
            assert req.tier_hit_tokens == {"d": 16} == off.tier_hit_tokens("b")
            tables = alloc.new(req.blocks_for(len(TURN2)))
            task = req.load(tables)
            assert task is not None
            await task
            model.check(tables, TURN2, hit)
        assert tiers_of(off).deferred_lookups == 1
        # both groups' blocks were promoted: each group's tiers count the lookup
        assert {n: s.deferred_lookups for n, s in group_tiers(off).items()} == {
            g.name: 1 for g in model.groups
        }
        await settle(off)


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
async def test_a_deferred_lookup_counts_in_each_group_it_waits_for_and_once_in_all(
    kind: str, tmp_path: Path
) -> None:
    """A lookup that asks again counts one ``deferred_lookups`` in each group whose
    promotion it waits for (a promotion of a block the lookup asked that group's tiers
    for), and one in the whole model's: the full group's blocks alone dropped from CPU,
    only the full group waits; every group's dropped, each group and the model one more."""
    model = Model(groups_of(kind))
    alloc = Tables(model)
    other = model.groups[1].name
    async with KVOffloader(tiered(tmp_path / "kv.bin"), model.kv, groups=model.groups) as off:
        session = off._life.front
        assert session is not None
        await serve(off, model, alloc, "a", TURN1)
        await settle(off)
        pool = session.scheduler.ledger("full").pool
        for block_hash in session.hash_prompt(TURN2)["full"]:
            block = pool.get_cached(block_hash)
            if block is not None:
                pool.unpublish(block)
        with off.request("b", TURN2) as req:
            assert req.lookup(allow_defer=True) is None
            off.check_invariants()
        assert {n: s.deferred_lookups for n, s in group_tiers(off).items()} == {
            "full": 1,
            other: 0,
        }
        assert tiers_of(off).deferred_lookups == 1
        await settle(off)
        assert await off.reset()
        with off.request("c", TURN2) as req:
            assert req.lookup(allow_defer=True) is None
        assert {n: s.deferred_lookups for n, s in group_tiers(off).items()} == {
            "full": 2,
            other: 1,
        }
        assert tiers_of(off).deferred_lookups == 2  # a lookup, not a group's lookup
        await settle(off)


async def test_one_lane_counts_its_deferred_lookups_as_one_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grouped offloader of one cacheable group (a full group beside one of kind
    ``none``: a `GroupedScheduler` of one lane) behind a probe that never answers: each
    "ask again" counts in its group's tier manager and in the whole model's, the bound's
    worth of them, as one group counts (`tests/tiers/test_deferral_bound.py`)."""
    bound = 8
    monkeypatch.setattr(loads, "MAX_LOOKUP_DEFERRALS", bound)
    full = KVCacheGroup.from_layout(ATTN, name="full")
    enc = KVCacheGroup.from_layout(ATTN, name="enc", kind="none")
    model = Model((full,))
    alloc = Tables(model)
    release = anyio.Event()
    real_probe = Promoter._probe

    async def stuck(self: Promoter, *args: Any) -> Any:
        await release.wait()
        return await real_probe(self, *args)

    async with KVOffloader(tiered(tmp_path / "kv.bin"), model.kv, groups=(full, enc)) as off:
        session = off._life.front
        assert session is not None
        session.scheduler.clock = lambda: 0.0  # no deadline: the count bounds it
        await serve(off, model, alloc, "a", TURN1)
        await settle(off)
        assert await off.reset()
        monkeypatch.setattr(Promoter, "_probe", stuck)
        with off.request("b", TURN2) as req:
            for _ in range(bound):
                assert req.lookup(allow_defer=True) is None
            assert req.lookup(allow_defer=True) == 0  # the bound: what is on CPU
        assert group_tiers(off)["full"].deferred_lookups == bound
        assert tiers_of(off).deferred_lookups == bound
        assert off.statistics().scheduler.deferrals_bounded == 1
        off.check_invariants()
        release.set()
        await settle(off)


async def test_a_grouped_lookup_asks_again_at_most_until_the_tiers_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion whose probe never answers: a grouped lookup asks again until the
    groups' tiers' deadline (their `defer_deadline_s`, longer than one second here), then
    answers with what is on CPU (counted in ``deferrals_bounded``); nothing leaks."""
    release = anyio.Event()
    real_probe = Promoter._probe

    async def stuck(self: Promoter, *args: Any) -> Any:
        await release.wait()
        return await real_probe(self, *args)

    model = Model(groups_of("sliding"))
    alloc = Tables(model)
    cfg = tiered(tmp_path / "kv.bin", op_timeout_s=3)
    now = [50.0]
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        session = off._life.front
        assert session is not None
        assert off.tiers is not None
        session.scheduler.clock = lambda: now[0]
        deadline = off.tiers.defer_deadline_s
        assert deadline > 1.0  # longer than the deadline without tiers
        await serve(off, model, alloc, "a", TURN1)
        await settle(off)
        assert await off.reset()
        monkeypatch.setattr(Promoter, "_probe", stuck)
        with off.request("b", TURN2) as req:
            assert req.lookup(allow_defer=True) is None
            now[0] += deadline - 0.5
            assert req.lookup(allow_defer=True) is None
            now[0] += 0.5
            assert req.lookup(allow_defer=True) == 0  # what is on CPU: nothing
            assert session.scheduler.deferrals_bounded == 1
            assert off.tiers.is_promoting(session.hash_prompt(TURN2)["full"][0])
        release.set()
        await settle(off)
        assert tiers_of(off).refs_held == 0
