"""Every feature of `KVOffloader` on heterogeneous models (full + sliding window, full +
recurrent, full + chunked, block sizes 4 and 8), through the calls users make: request
handles, ``off.hints``, ``off.tiers``, ``statistics()`` and ``take_events()``. Each
scenario states what one full group does and checks that the hybrid model does the same,
by exact outcomes: the bytes a load serves, the hits, the counters.

The engine side is `Hybrid`: per group, its tensors (a block's value is a function of its
group, layer and token prefix), `ControllableCopyEngine`s that copy real bytes when the
test ends them, and one GPU block allocator per group."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.groups import KVCacheGroup, needed, page_layout
from kvoffload.hashing import BlockHash, hash_prompt
from kvoffload.layout import KVLayout
from kvoffload.pinner import RefCountPinner
from kvoffload.pool import BlockRemoved, BlockStored
from kvoffload.request import OffloadRequest
from kvoffload.scheduler.misses import MissReason
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import ControllableCopyEngine

pytestmark = pytest.mark.anyio

NUM_GPU = 48
STATE_SHAPE = (3, 2)  # one recurrent layer's snapshot: 6 float32 = 24 bytes
KINDS = ("sliding_window", "recurrent", "chunked")
SHAPES = [(kind, bs) for kind in KINDS for bs in (4, 8)]
IDS = [f"full+{kind}-bs{bs}" for kind, bs in SHAPES]

Tables = dict[str, list[int | None]]


def attn(bs: int) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32", block_size=bs)


def groups_of(kind: str, bs: int) -> tuple[KVCacheGroup, ...]:
    """A full group and one of ``kind``: a window of two blocks and one token, a chunk of
    two blocks, or a recurrent state. With a store point at every block boundary, a turn
    of five blocks stores five blocks of each group but the chunked one (0, 2 and 4: a
    point at a chunk boundary needs none), and a hit at 5 blocks needs `NEEDED_AT_5`."""
    full = KVCacheGroup.from_layout(attn(bs), name="full")
    if kind == "sliding_window":
        other = KVCacheGroup.from_layout(attn(bs), name="swa", kind=kind, window=2 * bs + 1)
    elif kind == "chunked":
        other = KVCacheGroup.from_layout(attn(bs), name="loc", kind=kind, chunk=2 * bs)
    else:
        other = KVCacheGroup(
            name="rec", kind="recurrent", block_size=bs, num_layers=2, bytes_per_layer_block=24
        )
    return (full, other)


NEEDED_AT_5 = {"full": 5, "sliding_window": 2, "chunked": 1, "recurrent": 1}
"""Blocks of each kind a hit at five blocks needs (blocks 0-4; 3-4; 4; the snapshot 4)."""


def value(gi: int, layer: int, tokens: Sequence[int], pos: int, bs: int) -> float:
    """What block ``pos`` of group ``gi`` holds after ``tokens``: a function of its prefix."""
    return float(gi * 1000 + layer * 100 + sum(tokens[: (pos + 1) * bs]) % 97 + pos)


class Hybrid:
    """The engine side of one offloader over ``groups``: tensors, allocators, copies."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        num_cpu: int = 32,
        engines: bool = True,
        **settings: Any,
    ) -> None:
        self.groups = tuple(groups)
        self.bs = groups[0].block_size
        self.kv: dict[str, list[torch.Tensor]] = {}
        for g in self.groups:
            shape = (
                (NUM_GPU, *STATE_SHAPE)
                if g.kind == "recurrent"
                else attn(self.bs).tensor_shape(NUM_GPU)
            )
            self.kv[g.name] = [torch.zeros(shape) for _ in range(g.num_layers)]
        if len(self.groups) > 1:
            settings.setdefault("checkpoint_tokens", self.bs)
        self.config = OffloadConfig.model_validate(
            {"num_cpu_blocks": num_cpu, "block_size": self.bs, **settings}
        )
        self.free = {g.name: list(range(NUM_GPU)) for g in self.groups}
        self.pinners = {g.name: RefCountPinner() for g in self.groups}
        self.hosts: list[HostKVBuffer] = []
        self.engines: dict[str, ControllableCopyEngine] = {}
        kw: dict[str, Any] = {"groups": self.groups, "pinner": dict(self.pinners)}
        self.one = len(self.groups) == 1  # one full group: the single-group offloader
        if engines:
            for g in self.groups:
                lay, views = page_layout(g, self.kv[g.name])
                host = HostKVBuffer(lay, num_cpu, pin_memory="never")
                self.hosts.append(host)
                self.engines[g.name] = ControllableCopyEngine(layout=lay, gpu_kv=views, host=host)
            kw["copy_engine"] = dict(self.engines)
        if self.one:
            kw = {k: next(iter(v.values())) for k, v in kw.items() if k != "groups"}
            self.off = KVOffloader(self.config, self.kv["full"], layout=attn(self.bs), **kw)
        else:
            self.off = KVOffloader(self.config, self.kv, **kw)

    def t(self, tables: Tables) -> Any:
        """``tables`` as the handle takes them: one plain table for one group."""
        return tables["full"] if self.one else tables

    # -- the engine's GPU side ---------------------------------------------------------------

    def new(self, n_blocks: int) -> Tables:
        return {g.name: [self.free[g.name].pop(0) for _ in range(n_blocks)] for g in self.groups}

    def give_back(self, tables: Tables) -> None:
        for name, table in tables.items():
            self.free[name].extend(b for b in table if b is not None)

    def fill(self, tables: Tables, tokens: Sequence[int], start: int = 0) -> None:
        """The engine computes every block from ``start`` that ``tokens`` fill."""
        for gi, g in enumerate(self.groups):
            for pos, b in enumerate(tables[g.name]):
                if b is not None and pos >= start and (pos + 1) * self.bs <= len(tokens):
                    for layer, t in enumerate(self.kv[g.name]):
                        t[b].fill_(value(gi, layer, tokens, pos, self.bs))

    def served(self, tables: Tables, tokens: Sequence[int], n: int) -> dict[str, list[int]]:
        """Per group, the positions of ``needed(g, n)`` that hold exactly their bytes; the
        test compares it with every position."""
        out: dict[str, list[int]] = {}
        for gi, g in enumerate(self.groups):
            good = []
            for pos in needed(g, n):
                b = tables[g.name][pos]
                assert b is not None
                if all(
                    bool((t[b] == value(gi, layer, tokens, pos, self.bs)).all())
                    for layer, t in enumerate(self.kv[g.name])
                ):
                    good.append(pos)
            out[g.name] = good
        return out

    def wipe(self) -> None:
        for tensors in self.kv.values():
            for t in tensors:
                t.fill_(-1.0)

    def complete_all(self) -> None:
        for engine in self.engines.values():
            engine.complete_all()

    def close(self) -> None:
        for host in self.hosts:
            host.close()

    # -- a whole request ---------------------------------------------------------------------

    async def serve(
        self, rid: str, tokens: list[int], *, priority: int = 0, defer: bool = False
    ) -> tuple[int, Tables]:
        """Look up, load (its bytes checked), compute the rest, store, finish."""
        off = self.off
        with off.request(rid, tokens, priority=priority) as req:
            hit = await self.lookup(req, defer)
            tables = self.new(req.blocks_for(len(tokens)))
            if hit:
                task = req.load(self.t(tables))
                assert task is not None
                self.complete_all()
                await task
                want = {g.name: list(needed(g, hit)) for g in self.groups}
                assert self.served(tables, tokens, hit) == want
            self.fill(tables, tokens, start=hit // self.bs)
            req.advance(self.t(tables), len(tokens))
            off.store()
            self.complete_all()
        self.complete_all()
        await self.settle()
        self.give_back(tables)
        return hit, tables

    async def settle(self) -> None:
        """Wait until no copy, and with tiers no write-down or promotion, runs."""
        tiers = self.off.tiers
        with anyio.fail_after(30):
            while True:
                await self.off.drain()
                stats = tiers.statistics() if tiers is not None else None
                if stats is None or not (stats.refs_held or stats.promotions_in_flight):
                    return
                await anyio.sleep(0.002)

    async def lookup(self, req: OffloadRequest, defer: bool) -> int:
        if not defer:
            return req.lookup()
        while (hit := req.lookup(allow_defer=True)) is None:
            self.complete_all()
            await self.off.drain()
        return hit


def conversation(seed: int, n: int) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


@pytest.fixture(params=SHAPES, ids=IDS)
def shape(request: pytest.FixtureRequest) -> tuple[str, int]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


# -- the scenarios -------------------------------------------------------------------------


async def test_a_second_turn_is_served_with_every_groups_bytes(shape: tuple[str, int]) -> None:
    kind, bs = shape
    rig = Hybrid(groups_of(kind, bs))
    try:
        async with rig.off as off:
            turn1 = conversation(1, 5 * bs + 2)
            assert (await rig.serve("a", turn1))[0] == 0
            rig.wipe()
            hit, _ = await rig.serve("b", [*turn1, 7, 8, 9])
            assert hit == 5 * bs
            off.check_invariants()
    finally:
        rig.close()


def _other(rig: Hybrid) -> KVCacheGroup:
    return rig.groups[1]


async def _pressure(rig: Hybrid, seeds: Sequence[int]) -> None:
    """Conversations of five blocks that fill the pools (priority 0)."""
    for seed in seeds:
        assert (await rig.serve(f"p{seed}", conversation(seed, 5 * rig.bs + 2)))[0] == 0


async def _hit_of(rig: Hybrid, rid: str, tokens: list[int]) -> int:
    """The hit a new turn gets, served (bytes checked) when there is one."""
    return (await rig.serve(rid, tokens))[0]


@pytest.mark.parametrize("priority", [0, 3])
async def test_a_prioritized_request_outlives_pressure_in_every_group(
    shape: tuple[str, int], priority: int
) -> None:
    """One group: a priority-3 request's blocks go after every priority-0 block, so three
    conversations that overflow a pool of 15 blocks evict another's; at priority 0 the
    oldest (this one) goes. A hybrid model does the same in each group's pool."""
    kind, bs = shape
    rig = Hybrid(groups_of(kind, bs), num_cpu=15)
    try:
        async with rig.off as off:
            sys = conversation(1, 5 * bs + 2)
            with off.request("s", sys, priority=priority) as req:
                req.lookup()
                tables = rig.new(req.blocks_for(len(sys)))
                rig.fill(tables, sys)
                req.advance(tables, len(sys))
                off.store()
                rig.complete_all()
            rig.complete_all()
            await off.drain()
            rig.give_back(tables)
            await _pressure(rig, (2, 3, 4))
            assert await _hit_of(rig, "t", [*sys, 5]) == (5 * bs if priority else 0)
            off.check_invariants()
    finally:
        rig.close()


async def test_a_retained_prefix_outlives_pressure_until_released(shape: tuple[str, int]) -> None:
    """One group: `retain_prefix()` holds the stored blocks of the prompt (5), which then
    survive any pressure and are served; `release_retained()` lets them go, and the next
    pressure evicts them. A hybrid model retains, in every group, what a lookup of the
    prefix needs, and returns the count of all groups' blocks."""
    kind, bs = shape
    rig = Hybrid(groups_of(kind, bs), num_cpu=15, max_retained_fraction=0.5)
    try:
        async with rig.off as off:
            sys = conversation(1, 5 * bs + 2)
            await rig.serve("s", sys)
            count = 5 + NEEDED_AT_5[kind]
            assert off.retain_prefix(sys, owner="sys") == count
            await _pressure(rig, (2, 3, 4, 5))
            assert await _hit_of(rig, "t", [*sys, 5]) == 5 * bs
            assert off.release_retained("sys") == count
            await _pressure(rig, (6, 7, 8, 9))
            assert await _hit_of(rig, "u", [*sys, 5]) == 0
            off.check_invariants()
    finally:
        rig.close()


def _cpu_free(off: KVOffloader) -> dict[str, int]:
    groups = off.statistics().groups
    assert groups is not None
    return {n: s.free_cpu_blocks for n, s in groups.items()}


async def test_an_abandoned_load_is_recomputed_and_its_refs_go_when_the_copy_lands(
    shape: tuple[str, int],
) -> None:
    """One group: `abandon_load()` resolves the load at once, returns the GPU blocks the
    copy still writes (pinned until it lands), the request recomputes into other blocks,
    and once the copy lands every CPU reference and pin is released; it counts one
    abandoned load and no loaded block, and a later request is served the same bytes."""
    kind, bs = shape
    rig = Hybrid(groups_of(kind, bs))
    try:
        async with rig.off as off:
            sys = conversation(1, 5 * bs + 2)
            await rig.serve("s", sys)
            idle = _cpu_free(off)
            tokens = [*sys, 5]
            with off.request("r", tokens) as req:
                assert req.lookup() == 5 * bs
                tables = rig.new(req.blocks_for(len(tokens)))
                task = req.load(tables)
                assert task is not None
                late = req.abandon_load()
                want = {
                    g.name: tuple(tables[g.name][p] for p in needed(g, 5 * bs)) for g in rig.groups
                }
                assert late == want
                assert req.hit_tokens == 0
                for g in rig.groups:
                    assert rig.pinners[g.name].pinned_blocks() == want[g.name]
                assert _cpu_free(off) != idle  # the copy still reads its CPU blocks
                fresh = rig.new(req.blocks_for(len(tokens)))
                rig.fill(fresh, tokens)
                req.advance(fresh, len(tokens))
                off.store()
                rig.complete_all()  # the late copy lands, the stores too
                await off.drain()
                assert all(p.num_pinned == 0 for p in rig.pinners.values())
                assert rig.served(fresh, tokens, 5 * bs) == {
                    g.name: list(needed(g, 5 * bs)) for g in rig.groups
                }
            await off.drain()
            assert _cpu_free(off) == idle  # nothing new to store: refs back, same cache
            stats = off.statistics().scheduler
            assert (stats.abandoned_loads, stats.loaded_blocks, stats.loaded_tokens) == (1, 0, 0)
            rig.give_back(tables)
            rig.give_back(fresh)
            rig.wipe()
            assert await _hit_of(rig, "t", tokens) == 5 * bs
            off.check_invariants()
    finally:
        rig.close()


ONCE = (
    "lookups",
    "hit_tokens",
    "miss_tokens",
    "deferred_lookups",
    "live_requests",
    "loaded_tokens",
    "prompt_tokens",
    "abandoned_loads",
    "lookup_misses",
    "miss_reason_tokens",
)
"""Whole-model counters of a lookup, request or token: one group's meaning, counted once."""


async def _workload(rig: Hybrid) -> list[object]:
    """Conversations that hit, miss, evict and defer stores; what each lookup returned and
    the counters after each request."""
    bs, out = rig.bs, []
    for rid, seed, n, extra in (
        ("a", 1, 5, [1]),
        ("b", 2, 5, [2]),
        ("c", 1, 5, [3, 4]),
        ("d", 3, 6, [5]),
        ("e", 2, 5, [6]),
        ("f", 4, 5, [7]),
        ("g", 1, 5, [8]),
    ):
        out.append((rid, await _hit_of(rig, rid, [*conversation(seed, n * bs), *extra])))
        stats = rig.off.statistics()
        out.append({name: getattr(stats.scheduler, name) for name in ONCE})
    return out


SETTINGS = {
    "default": {},
    "step_limit": {"max_store_blocks_per_step": 3},
    "admission": {"store_admission": "seen_twice"},
}


@pytest.mark.parametrize(
    ("kind", "bs", "settings"),
    [
        pytest.param(
            kind,
            bs,
            SETTINGS[name],
            id=f"full+{kind}-bs{bs}-{name}",
        )
        for kind, bs in SHAPES
        for name in SETTINGS
    ],
)
async def test_statistics_mean_what_they_mean_with_one_group(
    kind: str, bs: int, settings: dict[str, Any]
) -> None:
    """The same workload on one full group and on a hybrid model (each pool the one
    group's size): the same hits; every lookup, token and request counter (misses and
    their reasons too) the one group's; the full group's own counters (blocks stored,
    deferred, loaded, evicted) the one group's, ``deferred_blocks`` counting blocks."""
    one = Hybrid(groups_of(kind, bs)[:1], num_cpu=12, **settings)
    rig = Hybrid(groups_of(kind, bs), num_cpu=12, **settings)
    try:
        async with one.off, rig.off:
            want = await _workload(one)
            assert await _workload(rig) == want
            base = one.off.statistics().scheduler
            groups = rig.off.statistics().groups
            assert groups is not None
            full = groups["full"]
            for name in (
                "stored_blocks",
                "deferred_blocks",
                "deferred_steps",
                "loaded_blocks",
                "evicted_while_live",
                "store_plans",
                "load_plans",
            ):
                assert getattr(full, name) == getattr(base, name), name
            assert rig.off.statistics().scheduler.loaded_blocks == sum(
                g.loaded_blocks for g in groups.values()
            )
            rig.off.check_invariants()
    finally:
        one.close()
        rig.close()


WORKLOAD_PROMPTS = [(1, 5), (2, 5), (3, 6), (4, 5)]
"""(seed, blocks) of `_workload`'s conversations, whose blocks its events name."""


def _group_hashes(rig: Hybrid, g: KVCacheGroup) -> set[BlockHash]:
    space = g.namespace(model_id=rig.config.model_id, salt=rig.config.hash_salt)
    out: set[BlockHash] = set()
    for seed, n in WORKLOAD_PROMPTS:
        out.update(hash_prompt(conversation(seed, n * g.block_size), g.block_size, space))
    return out


async def test_every_event_names_its_group_and_its_own_blocks(shape: tuple[str, int]) -> None:
    """One group: `take_events()` gives a `BlockStored` per published block and a
    `BlockRemoved` per eviction, in order. A hybrid model gives the full group's events
    exactly as the one group's (block ids, kinds, order), every event names its group,
    every hash is one of that group's own (its namespace), a removal names a block its
    group stored, and ``(group, block_id)`` names one live block at a time."""
    kind, bs = shape
    one = Hybrid(groups_of(kind, bs)[:1], num_cpu=12, enable_events=True)
    rig = Hybrid(groups_of(kind, bs), num_cpu=12, enable_events=True)
    try:
        async with one.off, rig.off:
            await _workload(one)
            await _workload(rig)
            want = [(type(e).__name__, e.block_id) for e in one.off.take_events()]
            events = rig.off.take_events()
            assert {e.group for e in events} == {g.name for g in rig.groups}
            full = [(type(e).__name__, e.block_id) for e in events if e.group == "full"]
            assert full == want
            for g in rig.groups:
                own = _group_hashes(rig, g)
                live: dict[int, BlockHash] = {}
                for e in (e for e in events if e.group == g.name):
                    assert isinstance(e, BlockStored | BlockRemoved)
                    assert e.block_hash in own, (g.name, e)
                    if isinstance(e, BlockStored):
                        assert e.block_id not in live, (g.name, e)  # never two at once
                        live[e.block_id] = e.block_hash
                    else:
                        assert live.pop(e.block_id) == e.block_hash, (g.name, e)
                groups = rig.off.statistics().groups
                assert groups is not None
                assert len(live) == groups[g.name].cached_cpu_blocks
    finally:
        one.close()
        rig.close()


async def test_a_lookup_asks_again_while_a_block_it_needs_is_being_stored(
    shape: tuple[str, int],
) -> None:
    """One group: while the store of the blocks the next longer hit needs is in flight,
    `lookup(allow_defer=True)` answers `None` (nothing pinned, counted in
    ``deferred_lookups``), a plain lookup answers from the pool now; once the store
    landed it answers the whole hit, which is served exactly."""
    kind, bs = shape
    rig = Hybrid(groups_of(kind, bs))
    try:
        async with rig.off as off:
            sys = conversation(1, 5 * bs + 2)
            with off.request("a", sys) as a:
                a.lookup()
                tables = rig.new(a.blocks_for(len(sys)))
                rig.fill(tables, sys)
                a.advance(tables, len(sys))
                (task,) = off.store()
                with off.request("b", [*sys, 5]) as b:
                    assert b.lookup(allow_defer=True) is None
                    assert b.lookup(allow_defer=True) is None
                    assert b.lookup() == 0  # nothing published yet
                    stats = off.statistics()
                    assert stats.scheduler.deferred_lookups == 2
                    rig.complete_all()
                    await task
                    assert b.lookup(allow_defer=True) == 5 * bs
                    fresh = rig.new(b.blocks_for(len(sys) + 1))
                    load = b.load(fresh)
                    assert load is not None
                    rig.complete_all()
                    await load
                    assert rig.served(fresh, sys, 5 * bs) == {
                        g.name: list(needed(g, 5 * bs)) for g in rig.groups
                    }
            await off.drain()
            off.check_invariants()
    finally:
        rig.close()


async def _through_the_tier(rig: Hybrid) -> list[object]:
    """A prompt stored, its CPU blocks evicted by two more, then looked up again: what the
    lookups said (the second served, bytes checked)."""
    off, bs, out = rig.off, rig.bs, []
    assert off.tiers is not None
    sys = conversation(1, 5 * bs + 2)
    await rig.serve("s", sys)
    await _pressure(rig, (2, 3))  # 10 more blocks in each group's pool of 10
    with off.request("x", [*sys, 5]) as req:
        out.append((req.lookup(), req.miss_reason))  # the CPU pools lack some of them
    await rig.settle()  # the promotions that lookup started land
    rig.wipe()
    with off.request("t", [*sys, 6]) as req:
        hit = await rig.lookup(req, defer=True)
        out.append((hit, dict(req.tier_hit_tokens)))
        tables = rig.new(req.blocks_for(len(sys) + 1))
        task = req.load(rig.t(tables))
        assert task is not None
        await task
        want = {g.name: list(needed(g, hit)) for g in rig.groups}
        assert rig.served(tables, sys, hit) == want
    await off.drain()
    off.check_invariants()
    return out


async def test_a_block_evicted_from_cpu_comes_back_through_the_disk_tier(
    shape: tuple[str, int], tmp: Path
) -> None:
    """One group: with a disk tier, `off.tiers` is the tier front; a prompt whose CPU
    blocks were evicted is promoted back from disk (a plain lookup meanwhile misses with
    `MissReason.IN_FLIGHT`), `lookup(allow_defer=True)` then answers the whole hit, served
    with its exact bytes, and `tier_hit_tokens` names the tier. A hybrid model does the
    same, every group's blocks of the hit included."""
    kind, bs = shape
    out = []
    for n, name in ((1, "one"), (2, "two")):
        disk = {
            "kind": "disk",
            "name": "d",
            "path": str(tmp / f"{name}.bin"),
            "capacity_bytes": "1MiB",
        }
        rig = Hybrid(groups_of(kind, bs)[:n], num_cpu=10, engines=False, tiers=[disk])
        try:
            async with rig.off:
                out.append(await _through_the_tier(rig))
        finally:
            rig.close()
    # The pressure evicted the prompt's first two blocks; the tier brought them back.
    assert out[0] == [(0, MissReason.IN_FLIGHT), (5 * bs, {"d": 2 * bs})]
    assert out[1] == out[0]


def _counters(off: KVOffloader, *names: str) -> dict[str, tuple[int, ...]]:
    """Per group (``"full"`` for one group), the named counters."""
    groups = off.statistics().groups
    if groups is None:
        stats = off.statistics().scheduler
        return {"full": tuple(getattr(stats, n) for n in names)}
    return {g: tuple(getattr(s, n) for n in names) for g, s in groups.items()}


async def _restores(rig: Hybrid) -> list[object]:
    """A live request's blocks evicted by another's stores, then stored again or not."""
    off, bs, out = rig.off, rig.bs, []
    ta = conversation(1, 5 * bs + 2)
    with off.request("a", ta) as a:
        a.lookup()
        tables = rig.new(a.blocks_for(len(ta)))
        rig.fill(tables, ta)
        a.advance(rig.t(tables), len(ta))
        off.store()
        rig.complete_all()
        await off.drain()
        await rig.serve("b", conversation(2, 5 * bs + 2))  # evicts two of a's blocks
        out.append(_counters(off, "evicted_while_live", "restored_blocks"))
        off.store()  # a is live and its GPU blocks hold its KV
        rig.complete_all()
        await off.drain()
        out.append(_counters(off, "evicted_while_live", "restored_blocks"))
    rig.give_back(tables)
    rig.wipe()
    out.append(await _hit_of(rig, "c", [*ta, 1]))
    return out


async def _holds(rig: Hybrid) -> list[object]:
    """A request finished while its stores were deferred by the step limit (2)."""
    off, bs, out = rig.off, rig.bs, []
    ta = conversation(1, 5 * bs + 2)
    req = off.request("a", ta)
    req.lookup()
    tables = rig.new(req.blocks_for(len(ta)))
    rig.fill(tables, ta)
    req.advance(rig.t(tables), len(ta))
    off.store()
    rig.complete_all()
    await off.drain()
    req.finish()
    out.append({n: p.pinned_blocks() for n, p in rig.pinners.items()})
    for _ in range(3):
        off.store()
        rig.complete_all()
        await off.drain()
        out.append({n: p.num_pinned for n, p in rig.pinners.items()})
    out.append(_counters(off, "stored_blocks", "held_blocks"))
    rig.give_back(tables)
    rig.wipe()
    out.append(await _hit_of(rig, "c", [*ta, 1]))
    return out


STORE_CASES = {
    "restore_evicted": (_restores, {"num_cpu": 8}, {"restore_evicted": True}),
    "hold_blocks_on_finish": (
        _holds,
        {"max_store_blocks_per_step": 2},
        {"hold_blocks_on_finish": True},
    ),
}


@pytest.mark.parametrize("setting", STORE_CASES)
async def test_a_store_setting_has_its_one_group_effect(
    shape: tuple[str, int], setting: str
) -> None:
    """``restore_evicted`` (a live request's evicted blocks are stored again, so the next
    turn hits all five blocks instead of three) and ``hold_blocks_on_finish`` (a finished
    request's deferred blocks stay pinned and are stored by the next steps, so the next
    turn hits five blocks instead of two): on a hybrid model the hits are the one group's,
    with and without the setting, and the full group's pins and counters are the one
    group's."""
    kind, bs = shape
    scenario, base, on = STORE_CASES[setting]
    seen: dict[tuple[int, bool], list[Any]] = {}
    for n in (1, 2):
        for enabled in (False, True):
            kw = {**base, **(on if enabled else {})}
            rig = Hybrid(groups_of(kind, bs)[:n], **kw)
            try:
                async with rig.off:
                    seen[n, enabled] = await scenario(rig)
                    rig.off.check_invariants()
            finally:
                rig.close()
    for enabled in (False, True):
        one, two = seen[1, enabled], seen[2, enabled]
        assert two[-1] == one[-1], ("hit", enabled)
        for a, b in zip(one[:-1], two[:-1], strict=True):
            assert isinstance(a, dict)
            assert isinstance(b, dict)
            assert b["full"] == a["full"], (enabled, a, b)
    assert seen[1, True][-1] == 5 * bs
    assert seen[1, False][-1] == (3 if setting == "restore_evicted" else 2) * bs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", [{"store_mode": "lazy"}, {"lazy_offload_blocks": 8}])
def test_lazy_stores_are_refused_naming_the_setting_the_group_and_why(
    kind: str, setting: dict[str, Any]
) -> None:
    """One group stores lazily; a model with a group whose blocks lazy stores cannot keep
    is refused when the offloader is built, naming the setting, the group, its kind."""
    groups = groups_of(kind, 4)
    kv = Hybrid(groups, engines=False).kv
    config = OffloadConfig.model_validate(
        {"num_cpu_blocks": 8, "block_size": 4, "checkpoint_tokens": 4, **setting}
    )
    name = next(iter(setting))
    with pytest.raises(ConfigError) as err:
        KVOffloader(config, kv, groups=groups)
    message = str(err.value)
    assert name in message
    assert repr(groups[1].name) in message or groups[1].name in message
    assert kind in message


async def _hinted(rig: Hybrid) -> list[object]:
    """A request finished with ``retain_for_s=10`` while its stores were in flight, then
    pressure before and after the hint's deadline."""
    off, bs, out, now = rig.off, rig.bs, [], [0.0]
    off.hints.clock = lambda: now[0]
    sys = conversation(1, 5 * bs + 2)
    with off.request("s", sys) as req:
        req.lookup()
        tables = rig.new(req.blocks_for(len(sys)))
        rig.fill(tables, sys)
        req.advance(rig.t(tables), len(sys))
        off.store()
        req.finish(retain_for_s=10, session="u")  # retained once stored
        rig.complete_all()
        await rig.settle()
    rig.give_back(tables)
    off.store()
    await _pressure(rig, (2, 3, 4, 5))
    out.append(await _hit_of(rig, "t", [*sys, 5]))
    now[0] = 11.0  # past the deadline: the next store() ends the hint
    off.store()
    await _pressure(rig, (6, 7, 8, 9))
    out.append(await _hit_of(rig, "v", [*sys, 5]))
    out.append(off.hints.release("u"))  # expired: nothing left to release
    return out


async def _preempted(rig: Hybrid) -> list[object]:
    """A request preempted after its first store, re-admitted: it looks up its own stored
    prefix again, loads it into fresh blocks (bytes checked), computes the rest."""
    off, bs, out = rig.off, rig.bs, []
    tokens = conversation(1, 5 * bs + 2)
    with off.request("a", tokens) as req:
        req.lookup()
        tables = rig.new(req.blocks_for(len(tokens)))
        rig.fill(tables, tokens[: 3 * bs + 1])
        req.advance(rig.t(tables), 3 * bs + 1)
        off.store()
        rig.complete_all()
        await rig.settle()
        rig.fill(tables, tokens)
        req.advance(rig.t(tables), len(tokens))  # computed, not stored yet
        req.preempt()  # the engine freed its blocks: nothing is stored from them
        rig.give_back(tables)
        off.store()
        out.append(off.statistics().scheduler.stored_blocks)
        rig.wipe()
        hit = req.lookup()
        out.append(hit)
        fresh = rig.new(req.blocks_for(len(tokens)))
        task = req.load(rig.t(fresh))
        assert task is not None
        rig.complete_all()
        await task
        want = {g.name: list(needed(g, hit)) for g in rig.groups}
        assert rig.served(fresh, tokens, hit) == want
        rig.fill(fresh, tokens, start=hit // bs)
        req.advance(rig.t(fresh), len(tokens))
        off.store()
        rig.complete_all()
    await rig.settle()
    rig.give_back(fresh)
    rig.wipe()
    out.append(await _hit_of(rig, "b", [*tokens, 1]))
    stats = off.statistics().scheduler
    out.append((stats.prompt_tokens, stats.loaded_tokens, stats.lookups))
    return out


@pytest.mark.parametrize("scenario", [_hinted, _preempted], ids=["hint", "preempt"])
async def test_hints_and_preemption_as_with_one_group(
    shape: tuple[str, int], scenario: Any
) -> None:
    """A session hint keeps a finished request's blocks (stored after it finished) through
    pressure until its deadline, then lets them go; a preempted request stores nothing
    from its freed blocks, looks up and loads its own stored prefix again and counts its
    prompt once more. The hybrid model's hits and counters are the one group's (a hit,
    with one group and several: the longest stored prefix every group serves)."""
    kind, bs = shape
    seen = []
    for n in (1, 2):
        rig = Hybrid(groups_of(kind, bs)[:n], num_cpu=15, max_retained_fraction=0.5)
        try:
            async with rig.off:
                seen.append(await scenario(rig))
                rig.off.check_invariants()
        finally:
            rig.close()
    if scenario is _hinted:
        assert seen[0] == [5 * bs, 0, 0]
        assert seen[1] == seen[0]
    else:
        one, two = seen
        assert one[1:] == [3 * bs, 5 * bs, (3 * len(conversation(1, 5 * bs + 2)) + 1, 8 * bs, 3)]
        assert two[1:] == one[1:]
        assert one[0] == 3  # blocks 0-2, stored before the preemption


async def test_a_prefetch_brings_a_prompt_back_from_the_disk_tier(
    shape: tuple[str, int], tmp: Path
) -> None:
    """`hints.prefetch()` promotes a prompt evicted from CPU back from the disk tier, so
    the next turn's plain lookup is a CPU hit served exactly. One group returns the
    prompt's leading blocks on CPU (5), several groups the tokens a lookup finds (5
    blocks' worth: docs/hints.md)."""
    kind, bs = shape
    seen = []
    for n in (1, 2):
        disk = {
            "kind": "disk",
            "name": "d",
            "path": str(tmp / f"{n}.bin"),
            "capacity_bytes": "1MiB",
        }
        rig = Hybrid(
            groups_of(kind, bs)[:n],
            num_cpu=10,
            engines=False,
            tiers=[disk],
            max_prefetch_fraction=1.0,
        )
        try:
            async with rig.off as off:
                sys = conversation(1, 5 * bs + 2)
                await rig.serve("s", sys)
                await _pressure(rig, (2, 3))
                got = await off.hints.prefetch(sys)
                await rig.settle()
                rig.wipe()
                seen.append((got, await _hit_of(rig, "t", [*sys, 5])))
                off.check_invariants()
        finally:
            rig.close()
    assert seen == [(5, 5 * bs), (5 * bs, 5 * bs)]
