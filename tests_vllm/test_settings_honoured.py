"""No setting is silently ignored by the vLLM connector: every `OffloadConfig` field, for
a model of one full-attention group and one of several KV cache groups, is honoured (a
non-default value has an effect observed here, on the side that reads it) or refused
when the connector is built, with a `ConfigError` naming the field, its value and the
connector. The `KVOffloader` half is ``tests/test_settings_honoured.py``.

A field added to `OffloadConfig` later fails `test_every_field_has_a_decision` until it
gets a row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from harness import TestConnector, vllm_config
from test_groups import attn, config, full
from test_worker_groups import TWO_AND_ONE
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvoffload.build import ENTRY_POINTS, REFUSED, EntryPoint
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ConfigError, InvalidInputError
from kvoffload.hashing import BlockHash, hash_block_tokens
from kvoffload.integrations.vllm import worker_side
from kvoffload.scheduler.groups import GroupedScheduler

BS = 32  # the specs' block size
NUM_BLOCKS = 256
ONE_GROUP = config(([attn("0"), attn("1")], full()))
MODELS: dict[EntryPoint, KVCacheConfig] = {"vllm": ONE_GROUP, "vllm_groups": TWO_AND_ONE}
BASE: dict[str, Any] = {"num_cpu_blocks": 8}


def build(model_dir: Path, extra: dict[str, Any], path: EntryPoint, role: Any) -> TestConnector:
    vllm = vllm_config(
        model_dir,
        {**BASE, **extra},
        num_gpu_blocks=NUM_BLOCKS,
        connector="TestConnector",
        module="harness",
    )
    vllm.cache_config.block_size = BS
    TestConnector.next_rank = 0
    return TestConnector(vllm, role, MODELS[path])


def chain(n: int, seed: int = 0) -> list[BlockHash]:
    hashes, parent = [], BlockHash(bytes([seed]) * 32)
    for i in range(n):
        parent = hash_block_tokens(parent, list(range(i * BS, (i + 1) * BS)))
        hashes.append(parent)
    return hashes


# -- observations: each takes a connector factory (role) and returns a fact --------------

Make = Callable[[Any], TestConnector]
S, W = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER


def pool_size(make: Make) -> object:
    side = make(S).scheduler_side
    assert side is not None
    sched = side.scheduler
    return sum(s.num_cpu_blocks for s in sched.statistics().values())


def lazy_needs_a_view(make: Make) -> object:
    try:
        _grouped(make(S)).plan_stores()
    except InvalidInputError:
        return "lazy"
    return "eager"


class _View:
    def iter_eviction_order(self) -> list[tuple[int, BlockHash]]:
        return list(zip(range(5), chain(5), strict=True))


def lazy_window(make: Make) -> object:
    sched = _grouped(make(S))
    plan = sched.plan_stores({g.name: _View() for g in sched.groups})
    return 0 if plan is None else sum(p.num_blocks for p in plan.plans.values())


def _grouped(conn: TestConnector) -> GroupedScheduler:
    side = conn.scheduler_side
    assert side is not None
    sched = side.scheduler
    assert isinstance(sched, GroupedScheduler)
    return sched


def _update(sched: GroupedScheduler, rid: str, n: int, seed: int = 0) -> None:
    """``rid`` with ``n`` computed blocks in every group (GPU blocks ``seed * n`` on)."""
    names = [g.name for g in sched.groups if g.cacheable]
    table: list[int | None] = list(range(seed * n + 1, seed * n + n + 1))
    sched.update(rid, dict.fromkeys(names, table), dict.fromkeys(names, chain(n, seed)), n * BS)


def group_stores_per_step(make: Make) -> object:
    """Per group, the blocks one step's plan holds for a request of 4 computed blocks (the
    window group: the blocks of its store points' windows)."""
    sched = _grouped(make(S))
    _update(sched, "r", 4)
    plan = sched.plan_stores()
    return {} if plan is None else {n: p.num_blocks for n, p in plan.plans.items()}


def group_restores_evicted(make: Make) -> object:
    """Per group, the blocks stored again after b's blocks evicted a's (a is live)."""
    sched = _grouped(make(S))
    for rid, seed in (("a", 1), ("b", 2)):
        _update(sched, rid, 8, seed)
        plan = sched.plan_stores()
        assert plan is not None
        sched.complete_all(plan, True)
    plan = sched.plan_stores()
    return {} if plan is None else {n: p.num_blocks for n, p in plan.plans.items()}


def policy(make: Make) -> object:
    side = make(S).scheduler_side
    assert side is not None
    sched = side.scheduler
    return [sched.ledger(n).pool.policy.name for n in sched.statistics()]


def events(make: Make) -> object:
    """The events each CPU pool keeps for the connector's `take_events()` (which hands
    vLLM those of blocks whose store it planned: tests_vllm/test_stats_events.py)."""
    side = make(S).scheduler_side
    assert side is not None
    sched = side.scheduler
    pools = [sched.ledger(n).pool for n in sched.statistics()]
    for pool in pools:
        pool.publish(pool.allocate(1)[0], chain(1, 9)[0])
    return [len(pool.take_events()) for pool in pools]


def namespace(make: Make) -> object:
    side = make(S).scheduler_side
    assert side is not None
    roots = getattr(side, "_roots", None)
    return dict(roots) if roots is not None else side._root  # type: ignore[union-attr]


def tiers_built(make: Make) -> object:
    """The scheduler side's tiers: their lookup budget and, per group, the tiers each
    group's lookups ask (named ``<tier>.<group>``, each group's disk file its own)."""
    side = make(S).scheduler_side
    assert side is not None
    tiers = getattr(side, "tiers", None)
    if tiers is None:
        return None
    parts = getattr(tiers, "parts", None)
    names = None if parts is None else {n: p._source for n, p in parts.items()}
    return tiers.defer_deadline_s, names


def poll_interval(make: Make) -> object:
    conn = make(W)
    try:
        return conn.worker_side._poller._interval  # type: ignore[union-attr]
    finally:
        conn.shutdown()


@dataclass
class _Seen:
    calls: list[dict[str, Any]] = field(default_factory=list)


def host_buffer_request(make: Make) -> object:
    conn = make(W)
    seen = _Seen()
    real = worker_side.HostKVBuffer

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.calls.append(kwargs)
        return real(*args, **kwargs)

    lay = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", block_size=BS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_side, "HostKVBuffer", spy)
        side = conn.worker_side
        assert side is not None
        side._host_buffer(lay, 1).close()
    conn.shutdown()
    return seen.calls


CHECKED = "checked against vLLM's block size"


@dataclass(frozen=True)
class Decision:
    value: dict[str, Any]
    observe: dict[EntryPoint, Callable[[Make], object] | str]
    with_: dict[str, Any] = field(default_factory=dict)


def _both(observe: Callable[[Make], object]) -> dict[EntryPoint, Callable[[Make], object] | str]:
    return {"vllm": observe, "vllm_groups": observe}


TIER = {"kind": "disk", "name": "d", "path": "/nonexistent/t.bin", "capacity_bytes": 1 << 20}

TABLE: dict[str, Decision] = {
    "block_size": Decision({"block_size": 16}, {"vllm": CHECKED, "vllm_groups": CHECKED}),
    "num_cpu_blocks": Decision({"num_cpu_blocks": 12}, _both(pool_size)),
    "cpu_bytes": Decision({"num_cpu_blocks": None, "cpu_bytes": "4MiB"}, _both(pool_size)),
    "store_mode": Decision({"store_mode": "lazy"}, {"vllm": lazy_needs_a_view}),
    "lazy_offload_blocks": Decision(
        {"lazy_offload_blocks": 2}, {"vllm": lazy_window}, with_={"store_mode": "lazy"}
    ),
    "restore_evicted": Decision(
        {"restore_evicted": True},
        _both(group_restores_evicted),
    ),
    "max_store_blocks_per_step": Decision(
        {"max_store_blocks_per_step": 2},
        _both(group_stores_per_step),
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
        _both(group_stores_per_step),
    ),
    "tiers": Decision({"tiers": [TIER]}, _both(tiers_built)),
    "hold_blocks_on_finish": Decision({"hold_blocks_on_finish": True}, {}),
    "hold_max_blocks": Decision({"hold_max_blocks": 1}, {}),
    "hold_max_steps": Decision({"hold_max_steps": 1}, {}),
    "max_retained_fraction": Decision({"max_retained_fraction": 0.5}, {}),
    "max_prefetch_fraction": Decision({"max_prefetch_fraction": 0.5}, {}),
    "checkpoint_tokens": Decision({"checkpoint_tokens": 64}, {}),
}


def test_every_field_has_a_decision() -> None:
    assert sorted(TABLE) == sorted(OffloadConfig.model_fields)


@pytest.mark.parametrize("path", ["vllm", "vllm_groups"])
@pytest.mark.parametrize("name", sorted(OffloadConfig.model_fields))
def test_each_field_is_honoured_or_refused(name: str, path: EntryPoint, model_dir: Path) -> None:
    decision = TABLE.get(name)
    if decision is None:
        pytest.fail(f"OffloadConfig.{name} has no row in TABLE")
    changed = {**decision.with_, **decision.value}
    observe = decision.observe.get(path)
    if name in REFUSED[path] or observe == CHECKED:
        assert observe is None or observe == CHECKED, f"{name} refused on {path} and observed"
        for role in (S, W):
            with pytest.raises(ConfigError) as info:
                build(model_dir, changed, path, role)
            assert f"{name}=" in str(info.value)
            if observe is None:
                assert ENTRY_POINTS[path] in str(info.value)
        return
    if observe is None or isinstance(observe, str):
        pytest.fail(f"OffloadConfig.{name} is neither observed nor refused on {path}")
    before = observe(lambda role: build(model_dir, decision.with_, path, role))
    after = observe(lambda role: build(model_dir, changed, path, role))
    assert before != after, f"{name}={decision.value} had no effect on {path} ({before!r})"


def test_tiers_pass_the_check_before_the_model_loads(model_dir: Path) -> None:
    """``tiers`` are honoured with one group and with several, so the check made before
    the groups are known lets them through."""
    vllm = vllm_config(model_dir, {**BASE, "tiers": [TIER]}, num_gpu_blocks=NUM_BLOCKS)
    TestConnector.get_required_kvcache_layout(vllm)


def test_a_tier_setting_no_tier_accepts_stops_start_up_before_the_model_loads(
    model_dir: Path,
) -> None:
    bad = {**TIER, "capacity_bytes": "lots"}
    vllm = vllm_config(model_dir, {**BASE, "tiers": [bad]}, num_gpu_blocks=NUM_BLOCKS)
    with pytest.raises(ConfigError, match=r"tiers\.0\.disk\.capacity_bytes"):
        TestConnector.get_required_kvcache_layout(vllm)


def test_groups_whose_hit_alignment_reaches_the_context_are_refused(model_dir: Path) -> None:
    """Block sizes whose LCM is not below vLLM's ``max_model_len`` allow no hit: the
    connector refuses them when built, naming the alignment and the context, instead of
    offloading blocks it can never serve."""
    vllm = vllm_config(
        model_dir,
        dict(BASE),
        num_gpu_blocks=NUM_BLOCKS,
        connector="TestConnector",
        module="harness",
    )
    vllm.cache_config.block_size = BS
    vllm.model_config.max_model_len = 96  # the LCM of 32 and 96 is 96: no hit below it
    wide = config(([attn("0")], full()), ([attn("1")], full(block_size=96)))
    TestConnector.next_rank = 0
    with pytest.raises(ConfigError, match=r"hit alignment 96 tokens .* max_model_len=96"):
        TestConnector(vllm, S, wide)
