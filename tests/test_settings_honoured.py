"""No setting is silently ignored: every `OffloadConfig` field, for each `KVOffloader`
entry point (one full-attention group; several KV cache groups), is either honoured (a
non-default value has an effect observed here) or refused at construction with a
`ConfigError` naming the field, its value and the entry point.

The table below must name every field of `OffloadConfig.model_fields`: a field added
later fails `test_every_field_has_a_decision` until it gets a value and an observation
(or a refusal in `kvoffload.build.REFUSED`). The vLLM connector's half is
``tests_vllm/test_settings_honoured.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from kvoffload import KVOffloader, OffloadConfig
from kvoffload.build import ENTRY_POINTS, REFUSED, EntryPoint
from kvoffload.errors import ConfigError, InvalidInputError
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHash, hash_block_tokens
from kvoffload.layout import KVLayout
from kvoffload.pinner import RefCountPinner
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler
from kvoffload.scheduler.groups import GroupedScheduler
from kvoffload.storage.host_buffer import HostKVBuffer

pytestmark = pytest.mark.anyio

BS = 4
NUM_GPU = 24
BASE: dict[str, Any] = {"num_cpu_blocks": 8, "block_size": BS}
PATHS: tuple[EntryPoint, ...] = ("offloader", "offloader_groups")


def layout(block_size: int = BS) -> KVLayout:
    return KVLayout(
        num_layers=2, num_kv_heads=1, head_size=4, dtype="float32", block_size=block_size
    )


GROUPS = (
    KVCacheGroup.from_layout(layout(), name="full"),
    KVCacheGroup.from_layout(layout(), name="swa", kind="sliding_window", window=9),
)
FULL_GROUPS = (
    KVCacheGroup.from_layout(layout(), name="a"),
    KVCacheGroup.from_layout(layout(), name="b"),
)
"""Two full-attention groups: the shape lazy stores serve."""

SHAPES: dict[str, tuple[KVCacheGroup, ...]] = {
    "full+sliding_window": GROUPS,
    "full+full": FULL_GROUPS,
    "full+recurrent": (
        GROUPS[0],
        KVCacheGroup.from_layout(layout(), name="rec", kind="recurrent"),
    ),
    "full+chunked": (
        GROUPS[0],
        KVCacheGroup.from_layout(layout(), name="loc", kind="chunked", chunk=2 * BS),
    ),
}
"""The model shapes every setting is checked on with several groups."""

LAZY_FIELDS = frozenset({"store_mode", "lazy_offload_blocks"})
SHAPE_REFUSES: dict[str, frozenset[str]] = {
    "full+sliding_window": LAZY_FIELDS,
    "full+full": frozenset(),
    "full+recurrent": LAZY_FIELDS,
    "full+chunked": LAZY_FIELDS,
}
"""Per shape, the fields `KVOffloader` refuses for it beyond `REFUSED` (lazy stores need
every group to be full attention: docs/groups.md)."""


def make(
    config: OffloadConfig, path: EntryPoint, groups: tuple[KVCacheGroup, ...] = GROUPS
) -> KVOffloader:
    lay = layout(config.block_size)
    kv = [torch.zeros(lay.tensor_shape(NUM_GPU)) for _ in range(lay.num_layers)]
    if path == "offloader":
        return KVOffloader(config, kv, layout=lay)
    group_kv = {g.name: [torch.zeros(lay.tensor_shape(NUM_GPU)) for _ in range(2)] for g in groups}
    return KVOffloader(config, group_kv, groups=groups)


def chain(n: int, seed: int = 0) -> list[BlockHash]:
    hashes, parent = [], BlockHash(bytes([seed]) * 32)
    for i in range(n):
        parent = hash_block_tokens(parent, list(range(i * BS, (i + 1) * BS)))
        hashes.append(parent)
    return hashes


def stored_now(sched: OffloadScheduler, rid: str, n: int, seed: int = 0) -> int:
    """Blocks one ``plan_stores()`` plans for a request of ``n`` computed blocks."""
    sched.update(rid, list(range(seed * n, seed * n + n)), chain(n, seed), n * BS)
    plan = sched.plan_stores()
    return 0 if plan is None else plan.num_blocks


@dataclass
class Seen:
    """What `HostKVBuffer.create` was asked for (pinning settings)."""

    calls: list[dict[str, Any]] = field(default_factory=list)


# -- observations: each opens its offloader and returns a fact the setting changes ----------

Observe = Callable[[Callable[[], KVOffloader], Seen], Awaitable[object]]


def _sched(off: KVOffloader) -> OffloadScheduler:
    return off.scheduler


def _pools(off: KVOffloader) -> list[CpuBlockPool]:
    groups = off._life.front if off.groups is not None else None
    if groups is None:
        return [off.pool]
    return [groups.scheduler.ledger(n).pool for n in groups.scheduler.statistics()]


async def hashes_of_a_prompt(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        return len(off.hash_prompt(list(range(32))))


async def pool_size(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        return off.statistics().pool.num_blocks


async def lazy_needs_a_view(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        try:
            _sched(off).plan_stores()
        except InvalidInputError:
            return "lazy"
        return "eager"


class _View:
    def __init__(self, n: int) -> None:
        self.blocks = list(zip(range(n), chain(n), strict=True))

    def iter_eviction_order(self) -> Iterable[tuple[int, BlockHash]]:
        return iter(self.blocks)


async def lazy_window(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        plan = _sched(off).plan_stores(_View(5))
        return 0 if plan is None else plan.num_blocks


def _grouped(off: KVOffloader) -> GroupedScheduler:
    assert off._life.front is not None
    return off._life.front.scheduler


async def group_lazy_needs_views(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        try:
            _grouped(off).plan_stores()
        except InvalidInputError:
            return "lazy"
        return "eager"


def _names(off: KVOffloader) -> list[str]:
    assert off.groups is not None
    return [g.name for g in off.groups if g.cacheable]


async def group_lazy_window(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    """Per group, the blocks one lazy plan takes from a view of 5 blocks."""
    async with make_off() as off:
        plan = _grouped(off).plan_stores({n: _View(5) for n in _names(off)})
        return {} if plan is None else {n: p.num_blocks for n, p in plan.plans.items()}


async def restores_evicted(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        sched = _sched(off)
        for rid, seed in (("a", 1), ("b", 2)):  # b's 8 blocks evict a's 8
            sched.update(rid, list(range(seed * 8, seed * 8 + 8)), chain(8, seed), 8 * BS)
            plan = sched.plan_stores()
            assert plan is not None
            sched.complete(plan, True)
        plan = sched.plan_stores()  # a is live, its GPU blocks still hold its KV
        return 0 if plan is None else plan.num_blocks


async def group_restores_evicted(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    """As `restores_evicted`, per group: blocks stored again after b evicted a's."""
    async with make_off() as off:
        assert off._life.front is not None
        sched = off._life.front.scheduler
        for rid, seed in (("a", 1), ("b", 2)):
            table: list[int | None] = list(range(seed * 8, seed * 8 + 8))
            tables = {n: table for n in _names(off)}
            sched.update(rid, tables, {n: chain(8, seed) for n in _names(off)}, 8 * BS)
            plan = sched.plan_stores()
            assert plan is not None
            sched.complete_all(plan, True)
        plan = sched.plan_stores()
        return 0 if plan is None else plan.num_blocks


async def stores_per_step(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        return stored_now(_sched(off), "r", 4)


async def group_stores_per_step(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    """Blocks each group's plan holds for a request of 4 computed blocks per group."""
    async with make_off() as off:
        assert off._life.front is not None
        sched = off._life.front.scheduler
        tables: dict[str, list[int | None]] = {n: list(range(4)) for n in _names(off)}
        sched.update("r", tables, {n: chain(4) for n in _names(off)}, 4 * BS)
        plan = sched.plan_stores()
        return {} if plan is None else {n: p.num_blocks for n, p in plan.plans.items()}


async def host_buffer_request(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off():
        return [(c["pin_memory"], c["pin_chunk_bytes"]) for c in seen.calls]


async def poll_interval(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        life = off._life
        poller = life.launcher.poller
        return poller._interval


async def namespace(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        return off.hash_prompt(list(range(8)))


async def events(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        for pool in _pools(off):
            pool.publish(pool.allocate(1)[0], chain(1, 9)[0])
        return len(off.take_events())


async def policy(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        return [p.policy.name for p in _pools(off)]


async def tiers(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        stats = off.statistics().tiers
        return None if stats is None else len(stats.tiers)


async def held_on_finish(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        sched = _sched(off)
        stored_now(sched, "r", 11)  # 8 planned, 3 deferred: the pool is full
        return len(sched.finish("r"))


async def hold_released(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        sched = _sched(off)
        stored_now(sched, "r", 11)
        sched.finish("r")
        sched.plan_stores()
        sched.plan_stores()
        return len(sched.take_released_holds())


def _grouped_stored_now(off: KVOffloader, n: int) -> Any:
    """As `stored_now()` on every group: a request of ``n`` computed blocks per group."""
    assert off._life.front is not None
    sched = off._life.front.scheduler
    tables: dict[str, list[int | None]] = {g: list(range(n)) for g in _names(off)}
    sched.update("r", tables, {g: chain(n) for g in _names(off)}, n * BS)
    sched.plan_stores()
    return sched


async def group_held_on_finish(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        sched = _grouped_stored_now(off, 11)  # the full group: 8 planned, 3 deferred
        sched.finish("r")
        return {name: len(ids) for name, ids in sched.held_blocks("r").items()}


async def group_hold_released(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        sched = _grouped_stored_now(off, 11)
        sched.finish("r")
        sched.plan_stores()
        sched.plan_stores()
        return {name: len(ids) for name, ids in sched.take_released_holds().items()}


async def retains_a_prefix(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    """What ``retain_prefix()`` holds of a stored prompt (every group's blocks)."""
    async with make_off() as off:
        prompt = list(range(9))  # 8 tokens stored: 2 full blocks (and a window of 2)
        with off.request("r", prompt) as req:
            req.lookup()
            table = list(range(req.blocks_for(len(prompt))))
            req.advance(table if off.groups is None else dict.fromkeys(_names(off), table), 9)
            off.store()
        await off.drain()
        try:
            return off.retain_prefix(prompt, owner="sys")
        except InvalidInputError:  # over the bound (0 blocks of 8 by default)
            return "refused"


async def prefetch_bound(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        assert off.tiers is not None
        return off.tiers.max_prefetch_blocks


async def group_prefetched(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    """Per group, the blocks one prefetch brings back from the tier into an emptied CPU
    pool (each group's pool bounds its own prefetches)."""
    async with make_off() as off:
        prompt = list(range(17))  # 16 tokens stored: 4 full blocks (a window of 2)
        with off.request("r", prompt) as req:
            req.lookup()
            table = list(range(req.blocks_for(len(prompt))))
            req.advance(dict.fromkeys(_names(off), table), 17)
            off.store()
        await off.drain()
        assert off.tiers is not None
        while off.tiers.statistics().refs_held:  # the write-downs
            await anyio.sleep(0.01)
        assert await off.reset()
        await off.hints.prefetch(prompt)
        assert off._life.front is not None
        assert off._life.front.tiers is not None
        stats = off._life.front.tiers.group_statistics()
        return {name: s.prefetch_blocks_promoted for name, s in stats.items()}


async def store_points(make_off: Callable[[], KVOffloader], seen: Seen) -> object:
    async with make_off() as off:
        assert off._life.front is not None
        return off._life.front.scheduler.checkpoint_tokens


BLOCK_SIZE_CHECKED = "refused unless every group has that block size"


@dataclass(frozen=True)
class Decision:
    """A field's non-default ``value`` (plus ``with_`` settings, in both configs), and
    per entry point the observation that sees it."""

    value: dict[str, Any]
    observe: dict[EntryPoint, Observe | str]
    with_: dict[str, Any] = field(default_factory=dict)


def _tier(tmp: Path) -> dict[str, Any]:
    return {"kind": "disk", "name": "d", "path": str(tmp / "t.bin"), "capacity_bytes": 1 << 20}


def _both(observe: Observe) -> dict[EntryPoint, Observe | str]:
    return {"offloader": observe, "offloader_groups": observe}


TABLE: dict[str, Decision] = {
    "block_size": Decision(
        {"block_size": 8},
        {"offloader": hashes_of_a_prompt, "offloader_groups": BLOCK_SIZE_CHECKED},
    ),
    "num_cpu_blocks": Decision({"num_cpu_blocks": 12}, _both(pool_size)),
    "cpu_bytes": Decision(
        {"num_cpu_blocks": None, "cpu_bytes": 400 * layout().bytes_per_block}, _both(pool_size)
    ),
    "store_mode": Decision(
        {"store_mode": "lazy"},
        {"offloader": lazy_needs_a_view, "offloader_groups": group_lazy_needs_views},
    ),
    "lazy_offload_blocks": Decision(
        {"lazy_offload_blocks": 2},
        {"offloader": lazy_window, "offloader_groups": group_lazy_window},
        with_={"store_mode": "lazy"},
    ),
    "restore_evicted": Decision(
        {"restore_evicted": True},
        {"offloader": restores_evicted, "offloader_groups": group_restores_evicted},
    ),
    "max_store_blocks_per_step": Decision(
        {"max_store_blocks_per_step": 2},
        {"offloader": stores_per_step, "offloader_groups": group_stores_per_step},
    ),
    "pin_memory": Decision({"pin_memory": "never"}, _both(host_buffer_request)),
    "pin_chunk_bytes": Decision({"pin_chunk_bytes": 1 << 21}, _both(host_buffer_request)),
    "poll_interval_s": Decision({"poll_interval_s": 0.003}, _both(poll_interval)),
    "model_id": Decision({"model_id": "m"}, _both(namespace)),
    "hash_salt": Decision({"hash_salt": "s"}, _both(namespace)),
    "enable_events": Decision({"enable_events": True}, _both(events)),
    "eviction_policy": Decision({"eviction_policy": "arc"}, _both(policy)),
    "store_admission": Decision(
        {"store_admission": "seen_twice"},
        {"offloader": stores_per_step, "offloader_groups": group_stores_per_step},
    ),
    "tiers": Decision({"tiers": "TIER"}, _both(tiers)),
    "hold_blocks_on_finish": Decision(
        {"hold_blocks_on_finish": True},
        {"offloader": held_on_finish, "offloader_groups": group_held_on_finish},
    ),
    "hold_max_blocks": Decision(
        {"hold_max_blocks": 1},
        {"offloader": held_on_finish, "offloader_groups": group_held_on_finish},
        with_={"hold_blocks_on_finish": True},
    ),
    "hold_max_steps": Decision(
        {"hold_max_steps": 1},
        {"offloader": hold_released, "offloader_groups": group_hold_released},
        with_={"hold_blocks_on_finish": True},
    ),
    "max_retained_fraction": Decision({"max_retained_fraction": 0.5}, _both(retains_a_prefix)),
    "max_prefetch_fraction": Decision(
        {"max_prefetch_fraction": 0.5},
        {"offloader": prefetch_bound, "offloader_groups": group_prefetched},
        with_={"tiers": "TIER"},
    ),
    "checkpoint_tokens": Decision({"checkpoint_tokens": 8}, {"offloader_groups": store_points}),
}
"""Per `OffloadConfig` field: a non-default value and, per entry point, how its effect is
seen (an entry point missing here must refuse the field: `REFUSED`)."""


def test_every_field_has_a_decision() -> None:
    assert sorted(TABLE) == sorted(OffloadConfig.model_fields), (
        "every OffloadConfig field needs a row in TABLE: a value, and per entry point an "
        "observation of its effect or a refusal in kvoffload.build.REFUSED"
    )


def test_the_refusal_table_names_only_fields() -> None:
    for path, refused in REFUSED.items():
        assert set(refused) <= set(OffloadConfig.model_fields), path


def _config(values: dict[str, Any], tmp: Path) -> OffloadConfig:
    values = {k: (_tier(tmp),) if v == "TIER" else v for k, v in values.items()}
    return OffloadConfig(**{**BASE, **values})


CASES: list[tuple[EntryPoint, str]] = [("offloader", "full")] + [
    ("offloader_groups", shape) for shape in SHAPES
]
"""Every entry point with every model shape it takes."""


def _refused(name: str, path: EntryPoint, shape: str) -> bool:
    return name in REFUSED[path] or (path == "offloader_groups" and name in SHAPE_REFUSES[shape])


@pytest.mark.parametrize(("path", "shape"), CASES)
@pytest.mark.parametrize("name", sorted(OffloadConfig.model_fields))
async def test_each_field_is_honoured_or_refused(
    name: str, path: EntryPoint, shape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decision = TABLE.get(name)
    if decision is None:
        pytest.fail(f"OffloadConfig.{name} has no row in TABLE")
    groups = SHAPES.get(shape, GROUPS)
    seen = Seen()
    create = HostKVBuffer.create

    async def spy(*args: Any, **kwargs: Any) -> HostKVBuffer:
        seen.calls.append(kwargs)
        return await create(*args, **kwargs)

    monkeypatch.setattr(HostKVBuffer, "create", staticmethod(spy))
    changed = _config({**decision.with_, **decision.value}, tmp_path)
    observe = decision.observe.get(path)
    if _refused(name, path, shape) or observe == BLOCK_SIZE_CHECKED:
        with pytest.raises(ConfigError) as info:
            make(changed, path, groups)
        message = str(info.value)
        assert f"{name}=" in message or (name in LAZY_FIELDS and "store_mode='lazy'" in message)
        assert ENTRY_POINTS[path] in message
        if path == "offloader_groups" and name in SHAPE_REFUSES[shape]:
            kinds = [g for g in groups if g.kind != "full"]
            assert all(f"group {g.name!r} ({g.kind})" in message for g in kinds), message
        return
    assert observe is not None, f"{name} is not refused on {path} and has no observation"
    if isinstance(observe, str):
        pytest.fail(f"OffloadConfig.{name} is neither observed nor refused on {path}")
    base = _config(decision.with_, tmp_path)
    before = await observe(lambda: make(base, path, groups), seen)
    seen.calls.clear()
    after = await observe(lambda: make(changed, path, groups), seen)
    assert before != after, f"{name}={decision.value} had no effect on {path} ({shape}): {before!r}"


def test_observed_fields_are_not_refused() -> None:
    for name, decision in TABLE.items():
        for path, observe in decision.observe.items():
            if observe != BLOCK_SIZE_CHECKED:
                assert name not in REFUSED[path], f"{name} is both refused on {path} and observed"


DOCS_TABLE = Path(__file__).parent.parent / "docs" / "groups.md"
DOCS_COLUMNS: dict[str, EntryPoint] = {
    "`KVOffloader`, one group": "offloader",
    "`KVOffloader`, several groups": "offloader_groups",
    "vLLM connector, one group": "vllm",
    "vLLM connector, several groups": "vllm_groups",
}
KIND_WORDS = {"sliding_window": "sliding-window", "chunked": "chunked", "recurrent": "recurrent"}


def _docs_settings_table() -> dict[str, dict[EntryPoint, str]]:
    """docs/groups.md's settings table: per field, per entry point, its cell."""
    lines = DOCS_TABLE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| setting |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    paths = [DOCS_COLUMNS[c] for c in header[1:]]
    rows: dict[str, dict[EntryPoint, str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        name = cells[0].strip("`").split("=")[0]
        assert name not in rows, f"docs/groups.md names {name} in two rows"
        rows[name] = dict(zip(paths, cells[1:], strict=True))
    return rows


def test_the_docs_table_has_one_row_per_setting_as_the_code_decides() -> None:
    rows = _docs_settings_table()
    assert sorted(rows) == sorted(OffloadConfig.model_fields)
    for name, cells in rows.items():
        for path, cell in cells.items():
            refused = name in REFUSED[path]
            assert cell.startswith("refused") == refused, (
                f"docs/groups.md says {cell!r} for {name} on {path}; the code "
                f"{'refuses' if refused else 'honours'} it"
            )
        refusing = [s for s, fields in SHAPE_REFUSES.items() if name in fields]
        kinds = {g.kind for s in refusing for g in SHAPES[s] if g.kind != "full"}
        text = cells["offloader_groups"]
        if name == "lazy_offload_blocks":
            text = rows["store_mode"]["offloader_groups"]
        for kind in kinds:
            assert KIND_WORDS[kind] in text, (name, kind, text)
            assert "refused" in text, (name, kind, text)


async def test_defaults_are_accepted_on_every_path(tmp_path: Path) -> None:
    defaults = {
        name: f.default
        for name, f in OffloadConfig.model_fields.items()
        if name not in ("num_cpu_blocks", "cpu_bytes", "block_size")
    }
    for path in PATHS:
        async with make(OffloadConfig(**BASE, **defaults), path):
            pass


def test_a_groups_block_size_is_accepted_when_every_group_has_it() -> None:
    make(OffloadConfig(num_cpu_blocks=8, block_size=BS), "offloader_groups")
    with pytest.raises(ConfigError, match=r"block_size=8 .*here \[4\]"):
        make(OffloadConfig(num_cpu_blocks=8, block_size=8), "offloader_groups")


def test_every_refused_field_is_named_at_once() -> None:
    config = OffloadConfig(**BASE, store_mode="lazy", lazy_offload_blocks=2)
    with pytest.raises(ConfigError) as info:
        make(config, "offloader_groups")
    message = str(info.value)
    assert "KVOffloader with several KV cache groups cannot honour" in message
    for named in ("store_mode='lazy'", "lazy_offload_blocks=2"):
        assert named in message


# -- pinners (regression: a misspelt group name left that group's blocks unpinned) ------------


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("full", "sw"), r"pinner must name exactly the cacheable groups \['full', 'swa'\]; "
         r"missing \['swa'\], unknown \['sw'\]"),
        (("full",), r"missing \['swa'\], unknown \[\]"),
        (("full", "swa", "x"), r"missing \[\], unknown \['x'\]"),
    ],
)  # fmt: skip
def test_a_pinner_mapping_must_name_exactly_the_cacheable_groups(
    names: tuple[str, ...], message: str
) -> None:
    config = OffloadConfig(**BASE)
    kv = {g.name: [torch.zeros(layout().tensor_shape(NUM_GPU)) for _ in range(2)] for g in GROUPS}
    pinners = {n: RefCountPinner() for n in names}
    with pytest.raises(ConfigError, match=message):
        KVOffloader(config, kv, groups=GROUPS, pinner=pinners)
    KVOffloader(config, kv, groups=GROUPS, pinner={g.name: RefCountPinner() for g in GROUPS})
    KVOffloader(config, kv, groups=GROUPS)  # no pinner: none of them pinned, as before
