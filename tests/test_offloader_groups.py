"""`KVOffloader` and `OffloadRequest` with several KV cache groups: full + sliding window
and full + recurrent state, through real `ThreadCopyEngine`s (one host buffer per group),
the bytes of every group checked on every load, faults in one group, bad input."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.errors import (
    BlockTableError,
    ClosedError,
    ConfigError,
    HostMemoryError,
    InputTypeError,
    InvalidInputError,
    LayoutMismatchError,
    RequestStateError,
    TransferError,
    WrongContextError,
)
from kvoffload.groups import KVCacheGroup, needed, page_layout
from kvoffload.layout import KVLayout
from kvoffload.pinner import RefCountPinner
from kvoffload.pool import BlockRemoved, BlockStored
from kvoffload.scheduler import OffloadScheduler
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.testing import ControllableCopyEngine, CopyFaults
from kvoffload.transfer import ThreadCopyEngine
from kvoffload.transfer.grouped import GroupedTransferPlan
from kvoffload.transfer.plan import StorePlan

pytestmark = pytest.mark.anyio

BS = 4
NUM_GPU = 24
ATTN = KVLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
STATE_SHAPE = (3, 2)  # one recurrent layer's state snapshot: 6 float32 = 24 bytes


def groups_of(kind: str) -> tuple[KVCacheGroup, ...]:
    full = KVCacheGroup.from_layout(ATTN, name="full")
    if kind == "sliding":
        other = KVCacheGroup.from_layout(ATTN, name="swa", kind="sliding_window", window=9)
    else:
        other = KVCacheGroup(
            name="rec", kind="recurrent", block_size=BS, num_layers=2, bytes_per_layer_block=24
        )
    return (full, other)


@dataclass
class Model:
    """The engine side: per group, its tensors (a block's value says what it holds)."""

    groups: tuple[KVCacheGroup, ...]
    kv: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for g in self.groups:
            if g.kind == "recurrent":
                shape: tuple[int, ...] = (NUM_GPU, *STATE_SHAPE)
            else:
                shape = ATTN.tensor_shape(NUM_GPU)
            self.kv[g.name] = [torch.zeros(shape) for _ in range(g.num_layers)]

    @staticmethod
    def value(gi: int, layer: int, tokens: Sequence[int], pos: int) -> float:
        """What block ``pos`` of a conversation holds: a function of its prefix."""
        return float(gi * 1000 + layer * 100 + sum(tokens[: (pos + 1) * BS]) % 97 + pos)

    def fill(self, tables: dict[str, list[int | None]], tokens: Sequence[int]) -> None:
        for gi, g in enumerate(self.groups):
            for pos, b in enumerate(tables[g.name]):
                if b is not None and (pos + 1) * BS <= len(tokens):
                    for layer, t in enumerate(self.kv[g.name]):
                        t[b].fill_(self.value(gi, layer, tokens, pos))

    def check(self, tables: dict[str, list[int | None]], tokens: Sequence[int], n: int) -> None:
        """Every block a hit at ``n`` needs, in every group, holds what it should."""
        for gi, g in enumerate(self.groups):
            for pos in needed(g, n):
                b = tables[g.name][pos]
                assert b is not None
                for layer, t in enumerate(self.kv[g.name]):
                    want = self.value(gi, layer, tokens, pos)
                    assert bool((t[b] == want).all()), (g.name, layer, pos)

    def wipe(self) -> None:
        for tensors in self.kv.values():
            for t in tensors:
                t.fill_(-1.0)


def engines_for(
    model: Model, faults: dict[str, CopyFaults], num_cpu: int
) -> tuple[dict[str, ThreadCopyEngine], dict[str, HostKVBuffer]]:
    engines, hosts = {}, {}
    for g in model.groups:
        lay, views = page_layout(g, model.kv[g.name])
        hosts[g.name] = HostKVBuffer(lay, num_cpu, pin_memory="never")
        engines[g.name] = ThreadCopyEngine(
            lay, views, hosts[g.name], copy_hook=faults.get(g.name), copy_threads=1
        )
    return engines, hosts


def config(num_cpu: int = 32, checkpoint: int | None = 8) -> OffloadConfig:
    return OffloadConfig(num_cpu_blocks=num_cpu, block_size=BS, checkpoint_tokens=checkpoint)


class Tables:
    """The engine's GPU block allocators, one per group (no reuse within a test)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.free = {g.name: list(range(NUM_GPU)) for g in model.groups}

    def new(self, n_blocks: int) -> dict[str, list[int | None]]:
        out: dict[str, list[int | None]] = {}
        for g in self.model.groups:
            out[g.name] = [self.free[g.name].pop(0) for _ in range(n_blocks)]
        return out

    def give_back(self, tables: dict[str, list[int | None]]) -> None:
        for name, t in tables.items():
            self.free[name].extend(b for b in t if b is not None)


async def serve(
    off: KVOffloader, model: Model, alloc: Tables, rid: str, tokens: list[int]
) -> tuple[int, dict[str, list[int | None]]]:
    """One request: look up, load (bytes checked), compute the rest, store, finish."""
    with off.request(rid, tokens) as req:
        hit = req.lookup()
        tables = alloc.new(req.blocks_for(len(tokens)))
        if hit:
            task = req.load(tables)
            assert task is not None
            await task
            model.check(tables, tokens, hit)
        model.fill(tables, tokens)  # the engine computes the rest
        req.advance(tables, len(tokens))
        off.store()
    await off.drain()
    return hit, tables


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
async def test_a_second_turn_loads_every_group_bytes_exact(kind: str) -> None:
    model = Model(groups_of(kind))
    alloc = Tables(model)
    async with KVOffloader(config(), model.kv, groups=model.groups) as off:
        turn1 = list(range(1, 19))  # 18 tokens: points 8, 16 and the finish at 16
        hit, _ = await serve(off, model, alloc, "a", turn1)
        assert hit == 0
        model.wipe()
        turn2 = [*turn1, 50, 51, 52]
        hit, _ = await serve(off, model, alloc, "b", turn2)
        assert hit == 16
        stats = off.statistics()
        assert stats.groups is not None
        assert set(stats.groups) == {g.name for g in model.groups}
        assert all(s.loaded_blocks > 0 for s in stats.groups.values())
        assert stats.scheduler.loaded_blocks == sum(s.loaded_blocks for s in stats.groups.values())
        off._life.front.scheduler.check_invariants()  # type: ignore[union-attr]


async def test_a_failed_copy_of_one_group_publishes_nothing_in_any_group() -> None:
    model = Model(groups_of("sliding"))
    alloc = Tables(model)
    faults = {"swa": CopyFaults(fail_copies={0})}
    engines, hosts = engines_for(model, faults, 32)
    try:
        async with KVOffloader(
            config(checkpoint=16), model.kv, groups=model.groups, copy_engine=engines
        ) as off:
            tokens = list(range(1, 18))
            with off.request("a", tokens) as req:
                req.lookup()
                tables = alloc.new(5)
                model.fill(tables, tokens)
                req.advance(tables, len(tokens))
                (task,) = off.store()
                with pytest.raises(TransferError):
                    await task
            await off.drain()
            sched = off._life.front.scheduler  # type: ignore[union-attr]
            sched.check_invariants()
            assert faults["swa"].calls == 1
            full = sched.statistics()["full"]
            assert full.cached_cpu_blocks == 0  # the full group's part succeeded, unpublished
            assert full.free_cpu_blocks == full.num_cpu_blocks  # every ref released
            with off.request("b", [*tokens, 9]) as req:
                assert req.lookup() == 0
            assert off.statistics().scheduler.failed_stores == 1
    finally:
        for host in hosts.values():
            host.close()


async def test_a_step_that_stores_in_one_group_is_submitted_to_its_engine_as_itself() -> None:
    """A store plan that touches one group goes to that group's engine as its own task (no
    one-part grouped transfer); the step at a store point of both groups runs as one task
    over both engines, and a failed part fails it whole: nothing is published in either
    group, every reference and pin is released."""
    model = Model(groups_of("recurrent"))
    alloc = Tables(model)
    engines = {g.name: ControllableCopyEngine(num_gpu_blocks=NUM_GPU) for g in model.groups}
    pinners = {g.name: RefCountPinner() for g in model.groups}
    async with KVOffloader(
        config(checkpoint=16),
        model.kv,
        groups=model.groups,
        pinner=pinners,
        copy_engine=engines,
    ) as off:
        sched = off._life.front.scheduler  # type: ignore[union-attr]
        try:
            tokens = list(range(1, 30))
            with off.request("a", tokens) as req:
                req.lookup()
                tables = alloc.new(8)
                req.advance(tables, 8)  # two full blocks, no recurrent store point yet
                (task,) = off.store()
                assert engines["full"].submitted == [task]
                assert engines["rec"].submitted == []
                assert isinstance(task.plan, StorePlan)
                assert not isinstance(task.plan, GroupedTransferPlan)
                assert task.plan.gpu_block_ids == tuple(tables["full"][:2])
                assert pinners["full"].num_pinned == 2
                engines["full"].complete(task)
                await task
                await off.drain()
                assert pinners["full"].num_pinned == 0
                assert sched.statistics()["full"].stored_blocks == 2
                req.advance(tables, 16)  # the store point of both groups
                (both,) = off.store()
                plan = both.plan
                assert isinstance(plan, GroupedTransferPlan)
                assert set(plan.parts) == {"full", "rec"}
                (full_part,) = engines["full"].pending
                (rec_part,) = engines["rec"].pending
                engines["full"].complete(full_part)
                off._life.launcher.poller.poll()  # type: ignore[union-attr]
                assert not both.done()  # waits for every part
                engines["rec"].fail(rec_part)
                with pytest.raises(TransferError):
                    await both
                await off.drain()
        finally:  # an assertion above must not leave copies pending on closing
            for engine in engines.values():
                engine.complete_all()
        sched.check_invariants()
        stats = sched.statistics()
        assert stats["full"].stored_blocks == 2  # the full part's blocks 2, 3: unpublished
        assert stats["rec"].stored_blocks == 0
        assert stats["full"].cached_cpu_blocks == 2  # the first step's blocks only
        assert stats["rec"].cached_cpu_blocks == 0
        for name in ("full", "rec"):
            assert stats[name].free_cpu_blocks == stats[name].num_cpu_blocks  # refs released
            assert pinners[name].num_pinned == 0
        assert off.statistics().scheduler.failed_stores == 1


async def test_pinners_per_group_hold_the_blocks_of_copies_in_flight() -> None:
    model = Model(groups_of("recurrent"))
    alloc = Tables(model)
    pinners = {g.name: RefCountPinner() for g in model.groups}
    async with KVOffloader(config(), model.kv, groups=model.groups, pinner=pinners) as off:
        tokens = list(range(1, 10))
        with off.request("a", tokens) as req:
            req.lookup()
            tables = alloc.new(3)
            model.fill(tables, tokens)
            req.advance(tables, len(tokens))
            off.store()  # point 8: full blocks 0, 1 and the snapshot at 8 (block 1)
            assert pinners["full"].num_pinned == 2
            assert pinners["rec"].pinned_blocks() == (tables["rec"][1],)
        await off.drain()
        assert all(p.num_pinned == 0 for p in pinners.values())


async def test_bad_input_names_the_request_the_group_and_the_value() -> None:
    model = Model(groups_of("sliding"))
    async with KVOffloader(config(), model.kv, groups=model.groups) as off:
        with off.request("r1", list(range(12))) as req:
            with pytest.raises(InvalidInputError, match=r"'r1'.*\['full', 'swa'\]"):
                req.advance([0, 1, 2], 12)
            with pytest.raises(InvalidInputError, match=r"'r1'.*unknown groups \['nope'\]"):
                req.advance({"full": [0, 1, 2], "swa": [3, 4, 5], "nope": []}, 12)
            with pytest.raises(BlockTableError, match=r"'r1'.*'swa'"):
                req.advance({"full": [0, 1, 2]}, 12)
            with pytest.raises(BlockTableError, match=r"'r1'.*'swa'.*has 1 entries.*fill 3"):
                req.advance({"full": [0, 1, 2], "swa": [None]}, 12)
            with pytest.raises(BlockTableError, match=r"'r1'.*'swa'.*999"):
                req.advance({"full": [0, 1, 2], "swa": [3, 999, 5]}, 12)
            with pytest.raises(InvalidInputError, match=r"'r1'.*'nope'"):
                req.blocks_for(8, group="nope")
            assert req.blocks_for(9, group="swa") == 3
            assert req.lookup() == 0
            with pytest.raises(InvalidInputError, match=r"'r1'.*several KV cache groups"):
                req.load([0, 1, 2])
        with pytest.raises(InvalidInputError, match=r"lookup\(\).*\['full', 'swa'\]"):
            off.lookup("x", [], 8)
        assert off.retain_prefix([1, 2], owner="sys") == 0  # no full block: nothing held
        with pytest.raises(InvalidInputError, match=r"'sys' retains no block.*\['full', 'swa'\]"):
            off.release_retained("sys")
        with pytest.raises(InvalidInputError, match=r"request 'p': priority must be"):
            off.request("p", [1, 2], priority=-1)
        assert await off.hints.prefetch([1, 2, 3, 4]) == 0  # no tiers: what CPU holds
        assert off.groups == model.groups
        with off.request("r4", list(range(9))) as req:
            assert off.hash_prompt(list(range(9))) == list(req.block_hashes)
        assert not off.has_request("r1")  # finished, nothing in flight
        with off.request("r3", [1, 2]):
            assert off.has_request("r3")
        with (
            pytest.raises(RequestStateError, match="'r2'"),
            off.request("r2", [1, 2]),
            off.request("r2", [1, 2]),
        ):
            pass


async def test_a_load_into_a_short_table_names_the_request_the_group_and_the_position() -> None:
    model = Model(groups_of("recurrent"))
    alloc = Tables(model)
    async with KVOffloader(config(), model.kv, groups=model.groups) as off:
        tokens = list(range(1, 19))
        await serve(off, model, alloc, "a", tokens)
        with off.request("b", [*tokens, 5]) as req:
            assert req.lookup() == 16
            short: dict[str, list[int | None]] = {"full": [0, 1, 2, 3], "rec": [0, 1, 2, None]}
            with pytest.raises(BlockTableError, match=r"'b'.*'rec'.*position 3"):
                req.load(short)
            task = req.load(alloc.new(5))  # nothing changed: the hit is still pinned
            assert task is not None
            await task
        off.check_invariants()


async def test_a_multi_group_offloader_has_the_owner_checks_of_one() -> None:
    model = Model(groups_of("sliding"))
    off = KVOffloader(config(), model.kv, groups=model.groups)
    with pytest.raises(ClosedError, match="created"):
        off.store()
    async with off:
        with pytest.raises(WrongContextError, match="thread"):
            await anyio.to_thread.run_sync(off.store)
        assert off.store() == []
    with pytest.raises(ClosedError, match="closed"):
        off.request("late", [1, 2, 3])
    await off.aclose()  # idempotent


def test_the_groups_host_memory_is_checked_all_together(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvoffload._front as gs  # noqa: PLC0415

    model = Model(groups_of("sliding"))
    one_group = 32 * ATTN.bytes_per_block  # each group alone fits, both do not
    monkeypatch.setattr(gs, "available_host_memory", lambda: one_group + 32 * 144 + 1)
    with pytest.raises(HostMemoryError, match=r"\{'full': 32, 'swa': 32\}"):
        KVOffloader(config(), model.kv, groups=model.groups)


async def test_one_full_group_is_the_single_group_offloader() -> None:
    group = KVCacheGroup.from_layout(ATTN, name="only")
    kv = [torch.zeros(ATTN.tensor_shape(8)) for _ in range(2)]
    one = OffloadConfig(num_cpu_blocks=32, block_size=BS)
    async with KVOffloader(one, {"only": kv}, groups=(group,)) as off:
        assert isinstance(off.scheduler, OffloadScheduler)
        assert off.layout == ATTN
        assert off.statistics().groups is None


async def test_a_float_hit_never_reaches_the_statistics() -> None:
    """A load of ``float(hit)`` passed the grouped scheduler (16.0 == 16) and its token count
    reached the statistics as a float; now it is refused like any count."""
    model = Model(groups_of("sliding"))
    alloc = Tables(model)
    async with KVOffloader(config(), model.kv, groups=model.groups) as off:
        turn1 = list(range(1, 19))
        await serve(off, model, alloc, "a", turn1)
        with off.request("b", [*turn1, 50]) as req:
            hit = req.lookup()
            assert hit == 16
            tables = alloc.new(req.blocks_for(req.num_tokens))
            with pytest.raises(InputTypeError, match=r"request 'b': num_tokens=16.0 is not an int"):
                req.load(tables, float(hit))  # type: ignore[arg-type]
            task = req.load(tables)  # the pin was kept: the int load goes through
            assert task is not None
            await task
            model.check(tables, [*turn1, 50], hit)
        stats = off.statistics().scheduler
        assert type(stats.loaded_tokens) is int
        assert stats.loaded_tokens == 16
        assert stats.load_plans == 1


def test_groups_of_kind_none_only_are_refused_naming_them() -> None:
    """Every group of kind ``none`` raised a bare IndexError."""
    none = [
        KVCacheGroup(name=n, kind="none", block_size=BS, num_layers=1, bytes_per_layer_block=8)
        for n in ("enc", "cross")
    ]
    for kv in ({}, {"enc": [torch.zeros(4, 8)]}):
        with pytest.raises(ConfigError, match=r"no group is cacheable.*\['enc', 'cross'\]"):
            KVOffloader(config(), kv, groups=none)


def test_block_sizes_whose_lcm_allows_no_hit_are_refused() -> None:
    """Block sizes 31607 and 30727 (LCM 971,188,289 tokens) were accepted: no hit could
    ever happen."""
    big = [
        KVCacheGroup(name=n, kind="full", block_size=bs, num_layers=1, bytes_per_layer_block=8)
        for n, bs in (("a", 31607), ("b", 30727))
    ]
    kv = {n: [torch.zeros(4, 8, dtype=torch.uint8)] for n in ("a", "b")}
    with pytest.raises(
        ConfigError, match=r"hit alignment 971188289 tokens .*\{'a': 31607, 'b': 30727\}"
    ):
        KVOffloader(OffloadConfig(num_cpu_blocks=4, block_size=BS), kv, groups=big)


MLA_LATENT = 6  # a latent of 6 bfloat16 per token (DeepSeek's is 576)


def mla_group(**fields: object) -> KVCacheGroup:
    return KVCacheGroup.model_validate(
        {
            "name": "mla",
            "kind": "full",
            "block_size": BS,
            "num_layers": 2,
            "bytes_per_layer_block": BS * MLA_LATENT * 2,
            "dtype": "bfloat16",
            **fields,
        }
    )


async def test_one_group_of_opaque_pages_is_offloaded_bytes_exact() -> None:
    """One full group of MLA latent pages (no K/V layout) was refused with "expected a 5-d
    tensor"; it is the single-group offloader over the pages as bytes."""
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(NUM_GPU, BS, MLA_LATENT, generator=gen).to(torch.bfloat16) for _ in range(2)]
    written = [t.clone() for t in kv]
    prompt = list(range(1, 14))  # 3 full blocks and one token
    async with KVOffloader(config(checkpoint=None), kv, groups=(mla_group(),)) as off:
        assert isinstance(off.scheduler, OffloadScheduler)
        assert off.layout.block_size == BS
        with off.request("a", prompt) as req:
            assert req.lookup() == 0
            req.advance([0, 1, 2, 3], len(prompt))
            off.store()
        await off.drain()
        for t in kv:
            t.zero_()
        with off.request("b", prompt) as req:
            assert req.lookup() == 12
            task = req.load([7, 9, 11, 13])
            assert task is not None
            await task
        for t, w in zip(kv, written, strict=True):
            assert torch.equal(t[[7, 9, 11]], w[[0, 1, 2]])
            assert not t[13].any()  # the last block was not loaded
        off.check_invariants()


def test_one_group_of_opaque_pages_that_cannot_be_split_names_the_page() -> None:
    group = mla_group(bytes_per_layer_block=BS * MLA_LATENT * 2 + 2)
    kv = [torch.zeros(NUM_GPU, BS * MLA_LATENT * 2 + 2, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(LayoutMismatchError, match=r"page of 50 bytes .* multiple of 8 bytes"):
        KVOffloader(config(checkpoint=None), kv, groups=(group,))


async def test_tiers_with_given_engines_and_unknown_tensors_are_refused() -> None:
    model = Model(groups_of("sliding"))
    with pytest.raises(ConfigError, match=r"checkpoint_tokens=6 must be a positive multiple"):
        KVOffloader(config(checkpoint=6), model.kv, groups=model.groups)
    with pytest.raises(ConfigError, match="checkpoint_tokens"):
        config(checkpoint=0)
    tier = {"kind": "disk", "name": "d0", "path": "/nonexistent/t.bin", "capacity_bytes": 1 << 20}
    with_tiers = OffloadConfig(num_cpu_blocks=8, block_size=BS, tiers=[tier])
    with pytest.raises(ConfigError, match=r"gpu_kv must name.*unknown \['x'\]"):
        KVOffloader(config(), {**model.kv, "x": []}, groups=model.groups)
    engines, hosts = engines_for(model, {}, 4)
    with pytest.raises(ConfigError, match=r"tiers need the host buffers.*\['full', 'swa'\]"):
        KVOffloader(with_tiers, model.kv, groups=model.groups, copy_engine=engines)
    with pytest.raises(ConfigError, match=r"copy_engine must name.*missing \['swa'\]"):
        KVOffloader(config(), model.kv, groups=model.groups, copy_engine={"full": engines["full"]})
    for host in hosts.values():
        host.close()
    with pytest.raises(InvalidInputError, match="one value per group"):
        KVOffloader(config(), model.kv["full"], groups=model.groups)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(["sliding", "recurrent"]),
    turns=st.lists(st.integers(1, 9), min_size=2, max_size=5),
    fail=st.sets(st.integers(0, 6), max_size=2),
    fail_group=st.sampled_from([0, 1]),
    num_cpu=st.integers(3, 12),
)
def test_conversations_with_faults_load_exact_bytes_in_every_group(
    kind: str, turns: list[int], fail: set[int], fail_group: int, num_cpu: int
) -> None:
    """Random multi-turn conversations over a small pool, with failed copies in one
    group: every load's bytes are right in every group, the scheduler's invariants hold
    after every request, and nothing leaks."""

    async def main() -> None:
        model = Model(groups_of(kind))
        name = model.groups[fail_group].name
        faults = {name: CopyFaults(fail_copies=fail)}
        engines, hosts = engines_for(model, faults, num_cpu)
        try:
            async with KVOffloader(
                config(num_cpu, checkpoint=8), model.kv, groups=model.groups, copy_engine=engines
            ) as off:
                sched = off._life.front.scheduler  # type: ignore[union-attr]
                tokens: list[int] = []
                for i, extra in enumerate(turns):
                    tokens = [*tokens, *range(100 + 10 * i, 100 + 10 * i + extra)]
                    alloc = Tables(model)
                    model.wipe()
                    with contextlib.suppress(TransferError):  # a failed load: recomputed
                        await serve(off, model, alloc, f"r{i}", list(tokens))
                    sched.check_invariants()
                await off.drain()
                sched.check_invariants()
                for s in sched.statistics().values():
                    assert s.pinned_blocks == 0
                    assert s.in_flight_plans == 0
        finally:
            for host in hosts.values():
                host.close()

    anyio.run(main)


@pytest.mark.parametrize("kind", ["sliding", "recurrent"])
async def test_events_carry_their_group_and_never_collide(kind: str) -> None:
    """With several groups, every pool event names its group; the stored blocks a router
    sees are exactly each group's published blocks, keyed by (group, block id)."""
    model = Model(groups_of(kind))
    alloc = Tables(model)
    cfg = OffloadConfig(num_cpu_blocks=32, block_size=BS, checkpoint_tokens=8, enable_events=True)
    async with KVOffloader(cfg, model.kv, groups=model.groups) as off:
        await serve(off, model, alloc, "a", list(range(1, 19)))
        events = off.take_events()
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert {e.group for e in events} == {g.name for g in model.groups}
        keys = [(e.group, e.block_id) for e in stored]
        assert len(keys) == len(set(keys))
        # two groups' pools both start at block 0: the ids alone would collide
        assert len({e.block_id for e in stored}) < len(keys)
        for g in model.groups:
            pool = off._life.front.scheduler.ledger(g.name).pool  # type: ignore[union-attr]
            mine = {(e.block_hash, e.block_id) for e in stored if e.group == g.name}
            assert len(mine) == pool.num_cached
            for block_hash, block_id in mine:
                cached = pool.get_cached(block_hash)
                assert cached is not None
                assert cached.block_id == block_id
        await off.reset()
        removed = [e for e in off.take_events() if isinstance(e, BlockRemoved)]
        assert {(e.group, e.block_id) for e in removed} == set(keys)


@pytest.mark.parametrize("named", [True, False])
async def test_one_named_full_group_names_its_events_as_several_groups_do(named: bool) -> None:
    """A model of one full-attention group given as ``groups=[...]`` runs the one-group
    offloader; its events carry the group's name as each group's do with several (given
    as plain tensors, there is no name: ``None``)."""
    attn = KVCacheGroup.from_layout(ATTN, name="attn")
    kv = [torch.zeros(ATTN.tensor_shape(16)) for _ in range(ATTN.num_layers)]
    cfg = OffloadConfig(num_cpu_blocks=8, block_size=BS, enable_events=True)
    off = KVOffloader(cfg, kv, groups=[attn]) if named else KVOffloader(cfg, kv)
    async with off:
        with off.request("r", list(range(1, 10))) as req:
            req.lookup()
            req.advance([0, 1, 2], 9)
            off.store()
            await off.drain()
        events = off.take_events()
        assert any(isinstance(e, BlockStored) for e in events)
        assert {e.group for e in events} == {"attn" if named else None}
        await off.reset()
        removed = [e for e in off.take_events() if isinstance(e, BlockRemoved)]
        assert removed
        assert {e.group for e in removed} == {"attn" if named else None}
