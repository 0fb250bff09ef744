"""The connector's scheduler side builds its core with `build_core()`: every core field of
`OffloadConfig` reaches the same objects as through `KVOffloader` (``tests/test_build.py``
checks that path against `build_core()`)."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.build import CORE_FIELDS, build_core
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.hashing import BlockHash, HashNamespace, hash_block_tokens
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler import OffloadScheduler

BS = 4
BASE: dict[str, Any] = {"num_cpu_blocks": 8, "block_size": BS}


def layout(block_size: int = BS) -> KVLayout:
    return KVLayout(
        num_layers=2, num_kv_heads=1, head_size=4, dtype="float16", block_size=block_size
    )


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
    config = scheduler.config
    facts: dict[str, object] = {
        "pool.num_blocks": pool.num_blocks,
        "pool.policy": pool.policy.name,
        "pool.max_retained_blocks": pool.max_retained_blocks,
        "scheduler.pool_is_the_pool": scheduler.pool is pool,
        "scheduler.config": {f: getattr(config, f) for f in sorted(CORE_FIELDS)},
    }
    bs = config.block_size
    first = hash_block_tokens(BlockHash(bytes(32)), list(range(bs)))
    if config.store_mode == "eager":
        scheduler.update("probe", [0], [first], bs)
        facts["scheduler.stores_first_offer"] = scheduler.plan_stores() is not None
    pool.take_events()
    block = pool.allocate(1)[0]
    pool.publish(block, hash_block_tokens(first, list(range(bs))))
    facts["pool.events"] = bool(pool.take_events())
    return facts


def side(config: OffloadConfig, world_size: int = 1) -> SchedulerSide:
    lay = layout(config.block_size)
    return SchedulerSide(config, lay, HashNamespace.from_layout(lay), world_size=world_size)


@pytest.mark.parametrize("field", sorted(CORE_FIELDS))
def test_the_scheduler_side_builds_what_build_core_builds(field: str) -> None:
    if field not in CHANGED:
        pytest.fail(f"core field {field!r} has no changed value in CHANGED; add one")
    config = OffloadConfig(**{**BASE, **CHANGED[field]})
    s = side(config)
    core = build_core(config, layout(config.block_size), host_buffer=False)
    assert describe(s.pool, s.scheduler) == describe(core.pool, core.scheduler)


def test_the_scheduler_side_honours_the_eviction_policy() -> None:
    """Regression: the connector built its pool without the policy, so it was always LRU."""
    for name in ("arc", "s3fifo", "prefix-freq"):
        s = side(OffloadConfig(**BASE, eviction_policy=name))
        assert s.pool.policy.name == name


def test_the_byte_counters_count_every_rank() -> None:
    s = side(OffloadConfig(**BASE), world_size=2)
    h = hash_block_tokens(BlockHash(bytes(32)), list(range(BS)))
    s.scheduler.update("r", [0], [h], BS)
    plan = s.scheduler.plan_stores()
    assert plan is not None
    s.scheduler.complete(plan, True)
    assert s.scheduler.statistics().bytes_stored == 2 * layout().bytes_per_block
