"""A `GroupedScheduler` takes a load shorter than the lookup's hit as `OffloadScheduler`
does, when every cacheable group is full attention: a full group's shorter hit is a
prefix of its pin, so the load is those blocks and the rest of the pin is released.

Side by side on the same calls (one full group, and two identical ones): the same plans,
the same references and eviction order left in the pools, the same statistics; a
cancelled shorter load gives back the shorter hit in both; a bad ``num_tokens`` is
refused with the same message. With a sliding-window, chunked or recurrent group a
shorter hit needs other blocks: refused, naming the group. Invariants are checked after
every step."""

from __future__ import annotations

import random

import pytest
import torch
from scheduler_helpers import BS, hashes, tokens

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import InvalidInputError
from kvoffload.groups import KVCacheGroup, needed
from kvoffload.hashing import BlockHasher
from kvoffload.layout import KVLayout
from kvoffload.pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler
from kvoffload.scheduler.groups import GroupedPlan, GroupedScheduler
from kvoffload.transfer.plan import TransferPlan
from tests import test_groups_differential as differential
from tests.groups_helpers import group

CPU_BLOCKS = 16
TOKS = tokens(14, 6, extra=2)  # 6 full blocks and 2 tokens
PREFIX = 2 * BS  # the engine holds blocks 0-1 itself
HIT = 4 * BS  # blocks 2-5 on CPU
TABLE = [30, 31, 32, 33, 34, 35, 36]
# The counters both schedulers keep with the same meaning (per group when grouped).
COUNTERS = (
    "stored_blocks",
    "loaded_blocks",
    "store_plans",
    "load_plans",
    "failed_stores",
    "failed_loads",
    "concurrent_load_blocks",
    "cancelled_plans",
    "ignored_completions",
    "evicted_while_live",
)


class Pair:
    """`OffloadScheduler` and a `GroupedScheduler` of identical full groups, driven with
    the same calls and the same hashes."""

    def __init__(self, names: tuple[str, ...]) -> None:
        config = OffloadConfig(block_size=BS, num_cpu_blocks=CPU_BLOCKS)
        self.names = names
        self.one = OffloadScheduler(config, CpuBlockPool(CPU_BLOCKS))
        self.grouped = GroupedScheduler(
            [group(n, "full", BS) for n in names],
            {n: CpuBlockPool(CPU_BLOCKS) for n in names},
            config=config,
        )
        self.check()

    def tables(self, table: list[int]) -> dict[str, list[int | None]]:
        return {n: list(table) for n in self.names}

    def check(self) -> None:
        """Invariants of both, and every group's pool as the one pool: each block's
        references, what is cached, the free blocks in eviction order, the pins."""
        self.one.check_invariants()
        self.grouped.check_invariants()
        want = pool_state(self.one.pool)
        pins = sorted(b.block_id for p in self.one.ledger.pins() for b in p)
        for n in self.names:
            ledger = self.grouped.ledger(n)
            assert pool_state(ledger.pool) == want, n
            assert sorted(b.block_id for p in ledger.pins() for b in p) == pins, n

    def same_plans(self, one: TransferPlan | None, grouped: GroupedPlan | None) -> None:
        assert one is not None
        assert grouped is not None
        assert set(grouped.plans) == set(self.names)
        for n in self.names:
            sub = grouped.plans[n]
            assert (sub.kind, sub.gpu_block_ids, sub.cpu_block_ids) == (
                one.kind,
                one.gpu_block_ids,
                one.cpu_block_ids,
            ), n

    def complete(self, one: TransferPlan, grouped: GroupedPlan, ok: bool = True) -> None:
        assert self.one.complete(one, ok)
        self.grouped.complete_all(grouped, ok)
        self.check()

    def stored(self) -> None:
        """Request "a" computes and stores ``TOKS`` (blocks 0-5), then finishes."""
        hs = hashes(TOKS)
        ids = list(range(6))
        self.one.update("a", ids, hs, len(TOKS))
        self.grouped.update("a", self.tables(ids), {n: hs for n in self.names}, len(TOKS))
        one, grouped = self.one.plan_stores(), self.grouped.plan_stores()
        self.same_plans(one, grouped)
        assert one is not None
        assert grouped is not None
        self.complete(one, grouped)
        self.one.finish("a")
        assert self.grouped.finish("a") is None
        self.check()

    def lookup(self, rid: str, computed: int = PREFIX) -> int:
        hs = hashes(TOKS)
        hit = self.one.lookup(rid, hs, len(TOKS), computed)
        assert self.grouped.lookup(rid, {n: hs for n in self.names}, len(TOKS), computed) == hit
        self.check()
        return hit

    def load(self, rid: str, n: int) -> tuple[TransferPlan, GroupedPlan]:
        one = self.one.plan_load(rid, TABLE, n)
        grouped = self.grouped.plan_load(rid, self.tables(TABLE), n)
        self.same_plans(one, grouped)
        assert one is not None
        assert grouped is not None
        self.check()
        return one, grouped

    def refusals(self, rid: str, n: int) -> tuple[str, str]:
        """Both schedulers' messages refusing a load of ``n`` tokens."""
        with pytest.raises(InvalidInputError) as one:
            self.one.plan_load(rid, TABLE, n)
        with pytest.raises(InvalidInputError) as grouped:
            self.grouped.plan_load(rid, self.tables(TABLE), n)
        self.check()
        return str(one.value), str(grouped.value)

    def same_statistics(self) -> None:
        want = self.one.statistics()
        got = self.grouped.statistics()
        for n in self.names:
            for name in COUNTERS:
                assert getattr(got[n], name) == getattr(want, name), (n, name)


def pool_state(pool: CpuBlockPool) -> tuple[object, ...]:
    refs = [pool.block(i).ref_cnt for i in range(pool.num_blocks)]
    order = [b.block_id for b in pool._free]  # the LRU free queue: evicted first first
    return refs, order, pool.num_cached, pool.num_free


NAMES = [("f",), ("f", "g")]


@pytest.mark.parametrize("names", NAMES, ids=["one full group", "two full groups"])
@pytest.mark.parametrize("n", [BS, 2 * BS, 3 * BS])
@pytest.mark.parametrize("ok", [True, False], ids=["done", "failed"])
def test_a_shorter_load_is_what_one_group_loads(names: tuple[str, ...], n: int, ok: bool) -> None:
    pair = Pair(names)
    pair.stored()
    assert pair.lookup("b") == HIT
    one, grouped = pair.load("b", n)
    # the first n // BS blocks above the engine's prefix, the rest of the pin released
    assert one.gpu_block_ids == tuple(TABLE[2 : 2 + n // BS])
    cached = [pair.one.pool.get_cached(h) for h in hashes(TOKS)[2 : 2 + n // BS]]
    assert one.cpu_block_ids == tuple(b.block_id for b in cached if b is not None)
    assert len(one.cpu_block_ids) == n // BS
    assert one.num_tokens == n
    assert all(sub.num_tokens == n for sub in grouped.plans.values())
    assert pair.one.pool.num_free == CPU_BLOCKS - n // BS  # only the load's blocks held
    pair.complete(one, grouped, ok)
    pair.same_statistics()
    assert pair.one.pool.num_free == CPU_BLOCKS
    # the request goes on from the loaded tokens: its next stores agree too
    hs = hashes(TOKS)
    done = PREFIX + n if ok else PREFIX
    pair.one.update("b", TABLE, hs, done)
    pair.grouped.update("b", pair.tables(TABLE), {g: hs for g in names}, done)
    stores = pair.one.plan_stores(), pair.grouped.plan_stores()
    if stores[0] is None:
        assert stores[1] is None
    else:
        pair.same_plans(*stores)
        pair.complete(stores[0], stores[1])  # type: ignore[arg-type]
    pair.one.finish("b")
    pair.grouped.finish("b")
    pair.check()
    pair.same_statistics()


@pytest.mark.parametrize("names", NAMES, ids=["one full group", "two full groups"])
def test_a_shorter_load_without_an_engine_prefix(names: tuple[str, ...]) -> None:
    pair = Pair(names)
    pair.stored()
    assert pair.lookup("b", 0) == 6 * BS
    one, grouped = pair.load("b", 5 * BS)
    assert one.gpu_block_ids == tuple(TABLE[:5])
    pair.complete(one, grouped)
    pair.same_statistics()


@pytest.mark.parametrize("names", NAMES, ids=["one full group", "two full groups"])
def test_a_cancelled_shorter_load_gives_back_the_shorter_hit(names: tuple[str, ...]) -> None:
    """One group's cancelled load pins the blocks it took again (the rest stays
    released): both schedulers then take that shorter hit, and refuse the old one alike."""
    pair = Pair(names)
    pair.stored()
    assert pair.lookup("b") == HIT
    one, grouped = pair.load("b", 2 * BS)
    assert pair.one.cancel(one)
    for name, sub in grouped.plans.items():
        assert pair.grouped.cancel(name, sub)
    pair.check()  # the pins: the two loaded blocks, in both
    assert pair.one.request_state("b").pinned
    one_msg, grouped_msg = pair.refusals("b", HIT)
    assert one_msg == grouped_msg
    assert "the lookup's hit 8" in one_msg
    one, grouped = pair.load("b", BS)
    pair.complete(one, grouped)
    pair.same_statistics()


@pytest.mark.parametrize("names", NAMES, ids=["one full group", "two full groups"])
@pytest.mark.parametrize("n", [-BS, BS + 1, HIT + BS, HIT - 2])
def test_a_bad_num_tokens_is_refused_alike_and_changes_nothing(
    names: tuple[str, ...], n: int
) -> None:
    pair = Pair(names)
    pair.stored()
    assert pair.lookup("b") == HIT
    one_msg, grouped_msg = pair.refusals("b", n)
    assert one_msg == grouped_msg
    assert one_msg.startswith(f"request 'b': num_tokens={n} must be 0 or the lookup's hit {HIT}")
    assert f"a multiple of {BS} below it" in one_msg
    # nothing changed: the pins stay, and the whole hit loads
    one, grouped = pair.load("b", HIT)
    pair.complete(one, grouped)
    pair.same_statistics()


def test_zero_releases_alike() -> None:
    pair = Pair(("f", "g"))
    pair.stored()
    assert pair.lookup("b") == HIT
    assert pair.one.plan_load("b", TABLE, 0) is None
    assert pair.grouped.plan_load("b", pair.tables(TABLE), 0) is None
    pair.check()
    assert not list(pair.one.ledger.pins())


def test_full_groups_of_two_block_sizes_load_a_shorter_hit_in_each() -> None:
    """The alignment is the LCM of the block sizes (8): a shorter hit of 8 tokens is the
    first 2 blocks of the 4-token group's pin and the first one of the 8-token group's."""
    groups = [group("small", "full", 4), group("big", "full", 8)]
    pools = {g.name: CpuBlockPool(CPU_BLOCKS) for g in groups}
    sched = GroupedScheduler(groups, pools, config=OffloadConfig(num_cpu_blocks=CPU_BLOCKS))
    toks = list(range(33))  # 32 tokens stored: 8 small blocks, 4 big ones
    hs = {"small": hashes(toks), "big": [bytes([i]) * 32 for i in range(4)]}
    tables: dict[str, list[int | None]] = {"small": list(range(8)), "big": list(range(4))}
    sched.update("a", tables, hs, 32)
    plan = sched.plan_stores()
    assert plan is not None
    sched.complete_all(plan, True)
    sched.finish("a")
    sched.check_invariants()
    assert sched.lookup("b", hs, 33, 8) == 24
    pins = {n: [b.block_id for b in sched._requests["b"].lanes[n].pin or ()] for n in pools}
    with pytest.raises(InvalidInputError, match=r"num_tokens=4 must be 0 .* a multiple of 8"):
        sched.plan_load("b", {"small": list(range(20, 28)), "big": list(range(20, 24))}, 4)
    sched.check_invariants()
    load = sched.plan_load("b", {"small": list(range(20, 28)), "big": list(range(20, 24))}, 8)
    assert load is not None
    small, big = load.plans["small"], load.plans["big"]
    assert (small.gpu_block_ids, small.cpu_block_ids) == ((22, 23), tuple(pins["small"][:2]))
    assert (big.gpu_block_ids, big.cpu_block_ids) == ((21,), tuple(pins["big"][:1]))
    sched.check_invariants()
    assert {n: p.num_free for n, p in pools.items()} == {
        "small": CPU_BLOCKS - 2,
        "big": CPU_BLOCKS - 1,
    }
    sched.complete_all(load, True)
    sched.check_invariants()
    stats = sched.statistics()
    assert (stats["small"].loaded_blocks, stats["big"].loaded_blocks) == (2, 1)


def test_a_group_of_kind_none_does_not_stop_a_shorter_load() -> None:
    """Only cacheable groups load: a full group beside one of kind none loads part of
    its hit."""
    groups = [group("attn", "full", BS), group("enc", "none", BS)]
    sched = GroupedScheduler(
        groups, {"attn": CpuBlockPool(CPU_BLOCKS)}, config=OffloadConfig(num_cpu_blocks=16)
    )
    hs = {"attn": hashes(TOKS)}
    sched.update("a", {"attn": list(range(6))}, hs, len(TOKS))
    plan = sched.plan_stores()
    assert plan is not None
    sched.complete_all(plan, True)
    sched.finish("a")
    assert sched.lookup("b", hs, len(TOKS), PREFIX) == HIT
    load = sched.plan_load("b", {"attn": TABLE}, BS)
    assert load is not None
    assert load.plans["attn"].gpu_block_ids == (TABLE[2],)
    sched.check_invariants()
    sched.complete_all(load, True)
    sched.check_invariants()
    assert sched.ledger("attn").pool.num_free == CPU_BLOCKS


HYBRID = {
    "sliding_window": {"window": 9},
    "chunked": {"chunk": 8},
    "recurrent": {},
}


@pytest.mark.parametrize("kind", sorted(HYBRID))
def test_a_shorter_load_with_another_kind_of_group_is_refused_naming_it(kind: str) -> None:
    groups = [group("attn", "full", BS), group("other", kind, BS, **HYBRID[kind])]
    pools = {g.name: CpuBlockPool(CPU_BLOCKS) for g in groups}
    sched = GroupedScheduler(
        groups, pools, config=OffloadConfig(num_cpu_blocks=CPU_BLOCKS), checkpoint_tokens=8
    )
    toks = list(range(17))
    hs = {"attn": hashes(toks), "other": hashes([t + 1 for t in toks])}
    tables: dict[str, list[int | None]] = {g.name: list(range(4)) for g in groups}
    sched.update("a", tables, hs, 16)
    plan = sched.plan_stores()
    assert plan is not None
    sched.complete_all(plan, True)
    assert sched.finish("a") is None
    sched.check_invariants()
    hit = sched.lookup("b", hs, 17)
    assert hit == 16
    dest: dict[str, list[int | None]] = {g.name: list(range(20, 24)) for g in groups}
    with pytest.raises(InvalidInputError) as refused:
        sched.plan_load("b", dest, 8)
    msg = str(refused.value)
    assert msg.startswith("request 'b': cannot load num_tokens=8 of the lookup's hit 16: ")
    assert f"group 'other' (kind {kind!r}) takes no load shorter than the hit" in msg
    assert "look up again with fewer tokens (num_tokens=9 finds a hit of at most 8)" in msg
    sched.check_invariants()
    # a bad count is refused as one group refuses it, without offering a shorter load
    for bad in (-4, 5, 20):
        with pytest.raises(InvalidInputError) as refused:
            sched.plan_load("b", dest, bad)
        assert str(refused.value) == (
            f"request 'b': num_tokens={bad} must be 0 or the lookup's hit 16 "
            "(the pinned hit is 16 tokens)"
        )
    sched.check_invariants()
    # nothing changed: the whole hit loads; and a lookup with fewer tokens finds 8
    load = sched.plan_load("b", dest, hit)
    assert load is not None
    sched.complete_all(load, True)
    sched.check_invariants()
    assert sched.lookup("c", hs, 9) == 8
    sched.release("c")
    sched.check_invariants()


def admit_shorter(
    pair: differential.Pair, req: differential.Req, rng: random.Random, log: list[object]
) -> None:
    """The differential workload's admission, loading a random part of each hit."""
    one_h, grouped_h = pair.hashes(req)
    defer = rng.random() < 0.3
    hit = pair.one.lookup(req.rid, one_h, req.prompt, allow_defer=defer)
    assert pair.grouped.lookup(req.rid, grouped_h, req.prompt, allow_defer=defer) == hit
    log.append(("lookup", req.rid, hit))
    if hit is None:
        return
    req.waiting = False
    if hit:
        n = rng.randrange(1, hit // BS + 1) * BS
        pair.grow_table(req, n + 1)
        plan = pair.one.plan_load(req.rid, req.table, n)
        gplan = pair.grouped.plan_load(req.rid, pair.tables(req), n)
        pair.pair(plan, gplan, f"load {req.rid}")
        req.computed = n
        log.append(("load", req.rid, n))
    else:
        pair.one.release(req.rid)
        pair.grouped.release(req.rid)
        req.computed = 0


@pytest.mark.parametrize("seed", range(12))
def test_two_full_groups_load_random_parts_of_their_hits_as_one(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seeded workload of `tests/test_groups_differential.py` (same hits, plans,
    pools and counters per step, invariants after each), each hit loaded in part."""
    monkeypatch.setattr(differential, "admit", admit_shorter)
    log, _, _ = differential.run(seed)
    hits: dict[str, int] = {}
    shorter = 0
    for what, rid, n in log:  # type: ignore[misc]
        if what == "lookup":
            hits[rid] = n
        elif what == "load":
            shorter += n < hits[rid]
    assert shorter, "the workload loads no shorter hit"


LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)


@pytest.mark.anyio
async def test_an_offloader_and_a_handle_with_two_full_groups_load_a_shorter_hit() -> None:
    """`KVOffloader.load()` and `OffloadRequest.load()` take the shorter load through a
    `GroupedScheduler`: the bytes of the loaded blocks, and only they, arrive in each
    group, and ``loaded_tokens`` counts what was loaded."""
    groups = (
        KVCacheGroup.from_layout(LAYOUT, name="x"),
        KVCacheGroup.from_layout(LAYOUT, name="y"),
    )
    num_gpu = 32
    kv = {g.name: [torch.zeros(LAYOUT.tensor_shape(num_gpu))] for g in groups}

    def fill(table: list[int], salt: int) -> None:
        for gi, g in enumerate(groups):
            for pos, b in enumerate(table):
                kv[g.name][0][b].fill_(float(gi * 100 + pos + salt))

    config = OffloadConfig(num_cpu_blocks=CPU_BLOCKS, block_size=BS)
    async with KVOffloader(config, kv, groups=groups) as off:
        toks = list(range(6 * BS + 1))
        with off.request("a", toks) as req:
            assert req.lookup() == 0
            fill(list(range(6)), 0)
            req.advance({g.name: list(range(6)) for g in groups}, 6 * BS)
            off.store()
        await off.drain()
        for t in kv.values():
            t[0].fill_(-1.0)
        table = list(range(10, 17))
        tables: dict[str, list[int | None]] = {g.name: list(table) for g in groups}
        with off.request("b", toks) as req:
            assert req.lookup() == 6 * BS
            task = req.load(tables, 3 * BS)
            assert task is not None
            await task
            for gi, g in enumerate(groups):
                for pos in needed(g, 3 * BS):
                    assert bool((kv[g.name][0][table[pos]] == gi * 100 + pos).all())
                assert bool((kv[g.name][0][table[3]] == -1.0).all())  # not loaded
        await off.drain()
        cfg = off.config
        hs = {}
        for g in groups:
            hasher = BlockHasher(g.namespace(model_id=cfg.model_id, salt=cfg.hash_salt).root, BS)
            hasher.extend(toks)
            hs[g.name] = list(hasher.block_hashes)
        assert off.lookup("c", hs, len(toks)) == 6 * BS
        assert off.load("c", tables, 2 * BS) is not None
        await off.drain()
        off.finish("c")
        stats = off.statistics()
        assert stats.scheduler.loaded_tokens == 5 * BS
        assert stats.groups is not None
        assert {n: s.loaded_blocks for n, s in stats.groups.items()} == {"x": 5, "y": 5}
        off._life.front.scheduler.check_invariants()  # type: ignore[union-attr]
