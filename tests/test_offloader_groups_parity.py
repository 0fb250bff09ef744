"""Every feature of `KVOffloader` on two full-attention groups of identical geometry
behaves as on one full group: the seeded workload of
`tests/test_offloader_groups_differential.py` (shared prefixes, retention priorities,
lookups that defer or not, loads, stores, finishes, preemptions, a pool small enough to
evict and defer), with retention (`retain_prefix()`, `release_retained()`), session
hints, abandoned loads, events and each store setting mixed in, compares after every
step every `SchedulerStatistics` field (each group's against the one group's, and the
whole model's where its meaning says it adds up or counts once), the events of each
group against the one group's, and every value the calls return."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import anyio
import pytest
import torch

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import InvalidInputError, TransferError
from kvoffload.groups import KVCacheGroup
from kvoffload.request import OffloadRequest
from kvoffload.scheduler import SchedulerStatistics
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import ControllableCopyEngine
from tests.test_offloader_groups import ATTN, BS
from tests.test_offloader_groups_differential import CPU_BLOCKS, NUM_GPU

NAMES = ("a", "b")

# What each whole-model counter of two identical groups is, against the one group's:
# counted once per lookup, request or step ("once"), or every group's added up ("sum").
ONCE = (
    "lookups",
    "hit_tokens",
    "miss_tokens",
    "deferred_lookups",
    "live_requests",
    "loaded_tokens",
    "prompt_tokens",
    "abandoned_loads",
    "deferrals_bounded",
    "lookup_misses",
    "miss_reason_tokens",
)
SUM = (
    "stored_blocks",
    "deferred_blocks",
    "evicted_while_live",
    "restored_blocks",
    "loaded_blocks",
    "bytes_stored",
    "bytes_loaded",
    "concurrent_load_blocks",
    "held_blocks",
    "hold_expired_blocks",
)


@dataclass(frozen=True)
class Mix:
    """What the workload mixes in besides lookups, loads, stores, finishes, preemptions."""

    settings: Mapping[str, object] = field(default_factory=dict)
    retain: bool = False  # retain_prefix() / release_retained()
    hints: bool = False  # hints.retain_for() / release(), finish(retain_for_s=)
    abandon: bool = False  # abandon_load() of loads in flight


@dataclass
class Req:
    tokens: list[int]
    prompt: int
    one: OffloadRequest
    two: OffloadRequest
    table: list[int] = field(default_factory=list)
    computed: int = 0
    waiting: bool = True


class Pair:
    """One full group and two of its geometry, each engine's copies ended by the test."""

    def __init__(self, **settings: object) -> None:
        self.hosts: list[HostKVBuffer] = []
        config = OffloadConfig.model_validate(
            {"num_cpu_blocks": CPU_BLOCKS, "block_size": BS, **settings}
        )
        kv = [_zeros() for _ in range(ATTN.num_layers)]
        self.engine = self._eng(kv)
        self.one = KVOffloader(config, kv, copy_engine=self.engine)
        groups = [KVCacheGroup.from_layout(ATTN, name=n) for n in NAMES]
        kvs = {n: [_zeros() for _ in range(ATTN.num_layers)] for n in NAMES}
        self.engines = {n: self._eng(t) for n, t in kvs.items()}
        self.two = KVOffloader(config, kvs, groups=groups, copy_engine=dict(self.engines))

    def _eng(self, kv: list[torch.Tensor]) -> ControllableCopyEngine:
        host = HostKVBuffer(ATTN, CPU_BLOCKS, pin_memory="never")
        self.hosts.append(host)
        return ControllableCopyEngine(layout=ATTN, gpu_kv=kv, host=host)

    def complete_all(self) -> None:
        for engine in (self.engine, *self.engines.values()):
            for task in list(engine.pending):
                engine.complete(task)

    def close(self) -> None:
        for host in self.hosts:
            host.close()


def _zeros() -> torch.Tensor:
    return torch.zeros(ATTN.tensor_shape(NUM_GPU))


def same(one: object, two: object, what: object) -> None:
    assert one == two, (what, one, two)


def call(what: object, fn1: Any, fn2: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Both calls with the same arguments, which return or raise alike (the error's
    type)."""
    out: list[Any] = []
    for fn in (fn1, fn2):
        try:
            out.append(fn(*args, **kwargs))
        except InvalidInputError as exc:
            out.append(type(exc))
    if out[0] is InvalidInputError or out[1] is InvalidInputError:
        same(out[0], out[1], what)
    return out[0], out[1]


def compare_statistics(one: KVOffloader, two: KVOffloader, what: object) -> None:
    """Every `SchedulerStatistics` field: each group's counter as the one group's, the
    whole model's counted once or added up as its meaning says."""
    want = one.statistics().scheduler
    stats = two.statistics()
    whole = stats.scheduler
    groups = stats.groups
    assert groups is not None
    per = {f.name for f in fields(next(iter(groups.values())))}
    for f in fields(SchedulerStatistics):
        name = f.name
        value = getattr(want, name)
        if name in per and name != "lookup_misses":
            for n in NAMES:
                same(value, getattr(groups[n], name), (what, "group", n, name))
        if name in ONCE:
            same(value, getattr(whole, name), (what, "whole", name))
        elif name in SUM:
            same(len(NAMES) * value, getattr(whole, name), (what, "whole", name))
        else:  # a transfer or a step's plan over every group counts once
            same(value, getattr(whole, name), (what, "whole", name))


def compare_events(one: KVOffloader, two: KVOffloader, what: object) -> None:
    """Each group's events are the one group's (block ids and kinds), each naming its
    group."""
    e1 = [(type(e).__name__, getattr(e, "block_id", None)) for e in one.take_events()]
    e2 = two.take_events()
    assert all(e.group in NAMES for e in e2), (what, e2)
    for n in NAMES:
        mine = [(type(e).__name__, getattr(e, "block_id", None)) for e in e2 if e.group == n]
        same(e1, mine, (what, "events", n))


async def _wait(task: Any) -> None:
    if task is not None:
        with contextlib.suppress(TransferError):
            await task


async def run(seed: int, mix: Mix, steps: int = 40) -> dict[str, int]:
    pair = Pair(**mix.settings)
    try:
        return await _run(pair, seed, mix, steps)
    finally:
        pair.close()


async def _run(pair: Pair, seed: int, mix: Mix, steps: int) -> dict[str, int]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((8, 12, 16)))] for _ in range(3)]
    free = list(range(NUM_GPU))
    reqs: dict[str, Req] = {}
    seen = dict.fromkeys(("hits", "retained", "released", "hinted", "abandoned", "events"), 0)
    owners: list[object] = []
    sessions: list[object] = []
    now = [0.0]
    events = bool(mix.settings.get("enable_events"))
    async with pair.one as one, pair.two as two:
        one.scheduler._loads.clock = lambda: 0.0
        assert two._groups is not None
        two._groups.scheduler.clock = lambda: 0.0
        one.hints.clock = two.hints.clock = lambda: now[0]
        try:
            for step in range(steps):
                now[0] += 1.0
                loads: list[tuple[Req, Any, Any]] = []
                if mix.retain and rng.random() < 0.2:
                    prefix = rng.choice(prefixes)
                    owner = ("owner", step)
                    n1, n2 = call(
                        (seed, step, "retain_prefix"),
                        one.retain_prefix,
                        two.retain_prefix,
                        prefix,
                        owner=owner,
                    )
                    if isinstance(n1, int):
                        same(len(NAMES) * n1, n2, (seed, step, "retain_prefix"))
                        owners.append(owner)
                        seen["retained"] += n1
                if mix.retain and owners and rng.random() < 0.1:
                    owner = owners.pop(rng.randrange(len(owners)))
                    r1, r2 = call(
                        (seed, step, "release_retained"),
                        one.release_retained,
                        two.release_retained,
                        owner,
                    )
                    if isinstance(r1, int):
                        same(len(NAMES) * r1, r2, (seed, step, "release_retained"))
                        seen["released"] += r1
                if mix.hints and rng.random() < 0.15:
                    prefix = rng.choice(prefixes)
                    session = ("s", rng.randrange(3))
                    secs = rng.choice((1.5, 4.0, 20.0))
                    h1 = one.hints.retain_for(prefix, secs, session=session)
                    h2 = two.hints.retain_for(prefix, secs, session=session)
                    same(len(NAMES) * h1, h2, (seed, step, "retain_for"))
                    sessions.append(session)
                    seen["hinted"] += h1
                if mix.hints and sessions and rng.random() < 0.1:
                    session = sessions.pop(rng.randrange(len(sessions)))
                    h1 = one.hints.release(session)
                    same(len(NAMES) * h1, two.hints.release(session), (seed, step, "hint"))
                if len(reqs) < 4 and rng.random() < 0.6:
                    prefix = rng.choice(prefixes) if rng.random() < 0.8 else []
                    prompt = prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
                    tokens = prompt + [rng.randrange(1000) for _ in range(rng.randrange(0, 10))]
                    rid, priority = f"r{step}", rng.choice((0, 0, 3))
                    reqs[rid] = Req(
                        tokens,
                        len(prompt),
                        one.request(rid, prompt, priority=priority),
                        two.request(rid, prompt, priority=priority),
                    )
                for rid, r in list(reqs.items()):
                    if r.waiting:
                        defer = rng.random() < 0.5
                        hit = r.one.lookup(allow_defer=defer)
                        same(hit, r.two.lookup(allow_defer=defer), (seed, step, rid, "hit"))
                        if hit is None:
                            continue
                        seen["hits"] += hit
                        r.waiting = False
                        need = -(-len(r.tokens) // BS)
                        r.table, free[:] = free[:need], free[need:]
                        if hit and rng.random() < 0.8:
                            t1 = r.one.load(r.table)
                            t2 = r.two.load(dict.fromkeys(NAMES, r.table))
                            loads.append((r, t1, t2))
                            r.computed = hit
                        elif hit:
                            r.one.release()
                            r.two.release()
                        continue
                    if r.computed < len(r.tokens):
                        if r.one.num_tokens < len(r.tokens):
                            more = r.tokens[r.one.num_tokens :]
                            r.one.extend(more)
                            r.two.extend(more)
                        r.computed = min(len(r.tokens), r.computed + rng.randrange(1, 9))
                        r.one.advance(r.table, r.computed)
                        r.two.advance(dict.fromkeys(NAMES, r.table), r.computed)
                if mix.abandon:
                    for r, _, _ in loads:
                        if rng.random() < 0.4:
                            a1 = r.one.abandon_load()
                            a2 = r.two.abandon_load()
                            assert isinstance(a2, dict)
                            same({n: a1 for n in NAMES} if a1 else {}, a2, (seed, step, "ab"))
                            seen["abandoned"] += 1
                            r.computed = 0
                one.store()
                two.store()
                for rid, r in list(reqs.items()):
                    if r.waiting:
                        continue
                    x = rng.random()
                    if r.computed >= len(r.tokens) or x < 0.05:
                        if mix.hints and rng.random() < 0.5:
                            session = ("s", rng.randrange(3))
                            r.one.finish(retain_for_s=3.0, session=session)
                            r.two.finish(retain_for_s=3.0, session=session)
                            sessions.append(session)
                        else:
                            r.one.finish()
                            r.two.finish()
                        free.extend(r.table)
                        del reqs[rid]
                    elif x > 0.95:
                        r.one.preempt()
                        r.two.preempt()
                        free.extend(r.table)
                        r.table, r.computed, r.waiting = [], 0, True
                compare_statistics(one, two, (seed, step, "in flight"))
                pair.complete_all()
                await one.drain()
                await two.drain()
                for _, t1, t2 in loads:
                    await _wait(t1)
                    await _wait(t2)
                one.check_invariants()
                two.check_invariants()
                compare_statistics(one, two, (seed, step))
                if events:
                    compare_events(one, two, (seed, step))
                    seen["events"] += 1
            for r in reqs.values():
                r.one.finish()
                r.two.finish()
            pair.complete_all()
            await one.drain()
            await two.drain()
            compare_statistics(one, two, (seed, "end"))
            stats = one.statistics().scheduler
            seen.update(
                deferred_blocks=stats.deferred_blocks,
                evicted_while_live=stats.evicted_while_live,
                restored_blocks=stats.restored_blocks,
                held_blocks_max=0,
                hold_expired_blocks=stats.hold_expired_blocks,
                abandoned_loads=stats.abandoned_loads,
                deferred_lookups=stats.deferred_lookups,
            )
            return seen
        finally:
            pair.complete_all()


MIXES = {
    "plain": Mix(),
    "events": Mix({"enable_events": True}),
    "retention": Mix(retain=True, hints=True),
    "abandon": Mix(abandon=True),
    "store-settings": Mix({"max_store_blocks_per_step": 2, "store_admission": "seen_twice"}),
    "restore": Mix({"restore_evicted": True}),
    "holds": Mix({"hold_blocks_on_finish": True, "hold_max_blocks": 3, "hold_max_steps": 1}),
    "all": Mix(
        {"enable_events": True, "restore_evicted": True, "max_store_blocks_per_step": 3},
        retain=True,
        hints=True,
        abandon=True,
    ),
}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mix", list(MIXES))
def test_two_full_groups_are_one_group_with_every_feature(mix: str, seed: int) -> None:
    anyio.run(run, seed, MIXES[mix])
