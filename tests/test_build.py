"""One way to build the core: every `OffloadConfig` field that configures the pool, the
eviction policy, the admission filter or the scheduler reaches the same objects whether
`KVOffloader` builds them or `build_core()` does the way the vLLM scheduler side calls it
(``tests_vllm/test_build.py`` checks the connector itself)."""

from __future__ import annotations

import ast
import inspect
from typing import Any

import pytest
import torch

import kvoffload.request
from kvoffload.build import (
    CORE_FIELDS,
    ENTRY_POINT_FIELDS,
    GROUP_FIELDS,
    INLINE_POOL_BLOCKS,
    TIER_FIELDS,
    Core,
    build_core,
    plan_core,
)
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.hashing import BlockHash, hash_block_tokens
from kvoffload.offloader import KVOffloader
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler

BS = 4
BASE: dict[str, Any] = {"num_cpu_blocks": 8, "block_size": BS}


def layout(block_size: int = BS) -> KVLayout:
    return KVLayout(
        num_layers=2, num_kv_heads=1, head_size=4, dtype="float16", block_size=block_size
    )


def make_kv(block_size: int = BS) -> list[torch.Tensor]:
    shape = layout(block_size).tensor_shape(8)
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(2)]


# A value other than the default for every core field, as the overrides it needs.
CHANGED: dict[str, dict[str, Any]] = {
    "num_cpu_blocks": {"num_cpu_blocks": 12},
    "cpu_bytes": {"num_cpu_blocks": None, "cpu_bytes": 5 * layout().bytes_per_block},
    "eviction_policy": {"eviction_policy": "arc"},
    "enable_events": {"enable_events": True},
    "block_size": {"block_size": 8},
    "store_mode": {"store_mode": "lazy"},
    "lazy_offload_blocks": {"lazy_offload_blocks": 3},
    "restore_evicted": {"restore_evicted": True},
    "max_store_blocks_per_step": {"max_store_blocks_per_step": 2},
    "store_admission": {"store_admission": "seen_twice"},
    "hold_blocks_on_finish": {"hold_blocks_on_finish": True},
    "hold_max_blocks": {"hold_max_blocks": 7},
    "hold_max_steps": {"hold_max_steps": 5},
    "max_retained_fraction": {"max_retained_fraction": 0.5},
}


def describe(pool: CpuBlockPool, scheduler: OffloadScheduler) -> dict[str, object]:
    """What the built objects do with the settings (probes the pool and the scheduler,
    so call it once per core)."""
    config = scheduler.config
    facts: dict[str, object] = {
        "pool.num_blocks": pool.num_blocks,
        "pool.policy": pool.policy.name,
        "pool.max_retained_blocks": pool.max_retained_blocks,
        "scheduler.pool_is_the_pool": scheduler.pool is pool,
        "scheduler.config": {f: getattr(config, f) for f in sorted(CORE_FIELDS)},
    }
    # The admission filter (eager mode): is a block offered for the first time stored?
    bs = config.block_size
    first = hash_block_tokens(BlockHash(bytes(32)), list(range(bs)))
    if config.store_mode == "eager":
        scheduler.update("probe", [0], [first], bs)
        facts["scheduler.stores_first_offer"] = scheduler.plan_stores() is not None
    # Events: does publishing a block record one?
    pool.take_events()
    block = pool.allocate(1)[0]
    pool.publish(block, hash_block_tokens(first, list(range(bs))))
    facts["pool.events"] = bool(pool.take_events())
    return facts


def via_offloader(config: OffloadConfig) -> dict[str, object]:
    off = KVOffloader(config, make_kv(config.block_size))
    return describe(off.pool, off.scheduler)


def via_builder(config: OffloadConfig) -> dict[str, object]:
    # The call the vLLM connector's scheduler side makes.
    core = build_core(config, layout(config.block_size), world_size=1, host_buffer=False)
    return describe(core.pool, core.scheduler)


def test_every_config_field_is_classified_once() -> None:
    fields = set(OffloadConfig.model_fields)
    classes = {
        "core": CORE_FIELDS,
        "tiers": TIER_FIELDS,
        "entry point": ENTRY_POINT_FIELDS,
        "groups": GROUP_FIELDS,
    }
    unclassified = fields - set().union(*classes.values())
    assert not unclassified, (
        f"OffloadConfig fields {sorted(unclassified)} are in none of kvoffload.build's "
        "CORE_FIELDS, TIER_FIELDS, ENTRY_POINT_FIELDS and GROUP_FIELDS: say which part reads "
        "each"
    )
    names = list(classes)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not classes[a] & classes[b], f"in both {a} and {b}: {classes[a] & classes[b]}"
    assert set().union(*classes.values()) <= fields, "a class names a field that does not exist"


@pytest.mark.parametrize("field", sorted(CORE_FIELDS))
def test_a_core_field_reaches_the_same_objects_on_every_path(field: str) -> None:
    if field not in CHANGED:
        pytest.fail(f"core field {field!r} has no changed value in CHANGED; add one")
    base = OffloadConfig(**BASE)
    changed = OffloadConfig(**{**BASE, **CHANGED[field]})
    assert getattr(changed, field) != getattr(base, field)
    facts = via_builder(changed)
    assert via_offloader(changed) == facts
    assert facts != via_builder(base), f"{field} changed nothing the core does"


@pytest.mark.parametrize(
    ("field", "fact", "value"),
    [
        ("eviction_policy", "pool.policy", "arc"),
        ("enable_events", "pool.events", True),
        ("store_admission", "scheduler.stores_first_offer", False),
        ("num_cpu_blocks", "pool.num_blocks", 12),
        ("cpu_bytes", "pool.num_blocks", 5),
        ("max_retained_fraction", "pool.max_retained_blocks", 4),
    ],
)
def test_the_pool_and_admission_settings_reach_the_objects_themselves(
    field: str, fact: str, value: object
) -> None:
    """Not only the config the scheduler holds: the pool's policy, its events and the
    admission filter are what the settings say (the vLLM side once kept LRU)."""
    config = OffloadConfig(**{**BASE, **CHANGED[field]})
    assert via_builder(config)[fact] == value
    assert via_offloader(config)[fact] == value


def test_build_core_returns_the_pool_its_policy_and_the_scheduler() -> None:
    config = OffloadConfig(**{**BASE, "eviction_policy": "s3fifo"})
    core = build_core(config, layout(), host_buffer=False)
    assert isinstance(core, Core)
    assert core.policy is core.pool.policy
    assert core.policy.name == "s3fifo"
    assert core.scheduler.pool is core.pool
    assert core.scheduler.config is config


def test_plan_core_sizes_without_building() -> None:
    config = OffloadConfig(num_cpu_blocks=INLINE_POOL_BLOCKS + 1, block_size=BS)
    plan = plan_core(config, layout(), world_size=2, host_buffer=False)
    assert plan.num_cpu_blocks == INLINE_POOL_BLOCKS + 1
    assert not plan.builds_inline
    assert plan.bytes_per_block == 2 * layout().bytes_per_block
    assert plan_core(OffloadConfig(**BASE), layout(), host_buffer=True).builds_inline


def test_the_request_handle_does_not_import_the_offloader() -> None:
    """request.py depends on a protocol of the calls it makes; offloader.py imports it, so
    an import back would be a circle."""
    tree = ast.parse(inspect.getsource(kvoffload.request))
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert "kvoffload.offloader" not in imported
