"""The connector's scheduler side builds a one-group model's pool and scheduler as
`build_core()` does: every core field of `OffloadConfig` has the same effect as through
`KVOffloader` (``tests/test_build.py`` checks that path against `build_core()`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.outputs import KVConnectorOutput

from kvoffload.build import CORE_FIELDS, build_core
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHash, HashNamespace, hash_block_tokens
from kvoffload.integrations.vllm.metadata import KVOffloadWorkerMetadata
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.pool.block_pool import CpuBlockPool

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


GROUP = "g0"


def facts(pool: CpuBlockPool, first_offer: Callable[[BlockHash, int], bool]) -> dict[str, object]:
    """What the config made of a one-group pool and its scheduler: the pool's size,
    policy, retention bound and events, and whether an eager store of one block is
    offered (``first_offer(hash, block_size)``)."""
    facts: dict[str, object] = {
        "pool.num_blocks": pool.num_blocks,
        "pool.policy": pool.policy.name,
        "pool.max_retained_blocks": pool.max_retained_blocks,
    }
    bs = pool_block_size[id(pool)]
    first = hash_block_tokens(BlockHash(bytes(32)), list(range(bs)))
    facts["scheduler.stores_first_offer"] = first_offer(first, bs)
    pool.take_events()
    block = pool.allocate(1)[0]
    pool.publish(block, hash_block_tokens(first, list(range(bs))))
    facts["pool.events"] = bool(pool.take_events())
    return facts


pool_block_size: dict[int, int] = {}


def core_facts(config: OffloadConfig) -> dict[str, object]:
    core = build_core(config, layout(config.block_size), host_buffer=False)
    pool_block_size[id(core.pool)] = config.block_size

    def offer(first: BlockHash, bs: int) -> bool:
        if config.store_mode != "eager":
            return False
        core.scheduler.update("probe", [0], [first], bs)
        return core.scheduler.plan_stores() is not None

    return facts(core.pool, offer)


def side_facts(s: SchedulerSide) -> dict[str, object]:
    pool = s.scheduler.ledger(GROUP).pool
    pool_block_size[id(pool)] = s.config.block_size

    def offer(first: BlockHash, bs: int) -> bool:
        if s.config.store_mode != "eager":
            return False
        s.scheduler.update("probe", {GROUP: [0]}, {GROUP: [first]}, bs)
        return s.scheduler.plan_stores() is not None

    return facts(pool, offer)


def side(config: OffloadConfig, world_size: int = 1) -> SchedulerSide:
    lay = layout(config.block_size)
    group = KVCacheGroup(
        name=GROUP,
        kind="full",
        block_size=lay.block_size,
        num_layers=lay.num_layers,
        bytes_per_layer_block=lay.bytes_per_layer_block,
    )
    root = HashNamespace.from_layout(lay).root
    return SchedulerSide(config, [group], {GROUP: root}, world_size=world_size, num_gpu_blocks=16)


@pytest.mark.parametrize("field", sorted(CORE_FIELDS))
def test_the_scheduler_side_builds_what_build_core_builds(field: str) -> None:
    if field not in CHANGED:
        pytest.fail(f"core field {field!r} has no changed value in CHANGED; add one")
    config = OffloadConfig(**{**BASE, **CHANGED[field]})
    assert side_facts(side(config)) == core_facts(config)


def test_the_scheduler_side_honours_the_eviction_policy() -> None:
    """Regression: the connector built its pool without the policy, so it was always LRU."""
    for name in ("arc", "s3fifo", "prefix-freq"):
        s = side(OffloadConfig(**BASE, eviction_policy=name))
        assert s.scheduler.ledger(GROUP).pool.policy.name == name


def test_the_byte_counters_count_every_rank() -> None:
    s = side(OffloadConfig(**BASE), world_size=2)
    h = hash_block_tokens(BlockHash(bytes(32)), list(range(BS)))
    s.scheduler.update("r", {GROUP: [0]}, {GROUP: [h]}, BS)
    s._track_stores(s.scheduler.plan_stores())
    (key,) = s.in_flight_plan_ids()
    s.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=KVOffloadWorkerMetadata({key: {0: True, 1: True}})
        )
    )
    own = s.statistics().scheduler
    assert own is not None
    assert own.bytes_stored == 2 * layout().bytes_per_block
