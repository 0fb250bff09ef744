"""The connector's statistics and KV events against vLLM's real Scheduler on CPU.

Statistics: every step's connector statistics are what vLLM's scheduler hands its stat
loggers (the workers' aggregated by vLLM's `KVOutputAggregator`, then the scheduler
side's added); fed to vLLM's stats logger and to kvoffload's Prometheus metrics (the
connector's `build_prom_metrics`, on a private registry) they must add up to the
connector's own statistics, under kvoffload.metrics' names and help texts.

Events: with vLLM's ``kv_events_config``, the CPU pool's ``BlockStored`` events carry the
hashes vLLM's own ``BlockStored`` events gave the same blocks (one group, and two groups
with their group index).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from harness import BLOCK_SIZE, Harness, TestConnector, kv_cache_config, make_request, vllm_config
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from test_scheduler_groups import GroupHarness
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed import kv_events
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

from kvoffload.hashing import BlockHash
from kvoffload.integrations.vllm import KVOffloadConnector
from kvoffload.integrations.vllm.events import TierWrites, tier_medium
from kvoffload.integrations.vllm.stats import KVOffloadConnectorStats
from kvoffload.metrics import METRICS
from kvoffload.scheduler.misses import MissReason

LABELS = {"model_name": "tiny", "engine": "0"}


def prompt(prefix_blocks: int, tail: int, seed: int) -> list[int]:
    shared = [(7 * i) % 500 + 2 for i in range(prefix_blocks * BLOCK_SIZE)]
    return shared + [(seed * 31 + i) % 500 + 2 for i in range(tail)]


def harness(model_dir: Path, *, world: int = 1, kv_events_on: bool = False) -> Harness:
    config = vllm_config(
        model_dir,
        {"num_cpu_blocks": 32},
        num_gpu_blocks=64,
        world_size=world,
        connector="TestConnector",
        module="harness",
    )
    if kv_events_on:
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return Harness(config, kv_cache_config(64), world_size=world)


def prometheus(stats: list[dict[str, Any]], config: Any) -> CollectorRegistry:
    """A private registry holding the connector's metrics after vLLM's Prometheus logger
    observed ``stats``."""
    registry = CollectorRegistry()
    types: dict[Any, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)
    }
    prom = KVOffloadConnector.build_prom_metrics(
        config, types, list(LABELS), {0: list(LABELS.values())}
    )
    for data in stats:
        prom.observe(data, 0)
    return registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, {**LABELS, **labels})
    return 0.0 if got is None else got


def b_after_a(h: Harness | GroupHarness) -> None:
    """Request a, vLLM's cache reset, then b with a's prefix (loaded from CPU), settled."""
    h.run(make_request("a", prompt(4, 5, seed=1), max_tokens=2))
    h.settle()
    assert h.scheduler.reset_prefix_cache()
    h.run(make_request("b", prompt(4, 7, seed=2), max_tokens=2))
    h.settle()


@pytest.fixture(autouse=True)
def _reset_test_connector() -> Iterator[None]:
    yield
    TestConnector.fail_kinds = set()


def test_vllm_s_logger_and_prometheus_carry_the_connector_s_figures(model_dir: Path) -> None:
    h = harness(model_dir, world=2)
    b_after_a(h)
    own = h.stats()
    assert own.loaded_tokens == 4 * BLOCK_SIZE
    assert own.stored_blocks >= 4
    assert own.lookup_misses  # a's first lookup missed everything (never stored)
    assert h.connector_stats

    registry = prometheus(h.connector_stats, h.config)
    counter = functools.partial(value, registry)
    assert counter("kvoffload_scheduler_loaded_tokens_total") == own.loaded_tokens
    assert counter("kvoffload_scheduler_loaded_blocks_total") == own.loaded_blocks
    assert counter("kvoffload_scheduler_stored_blocks_total") == own.stored_blocks
    assert counter("kvoffload_scheduler_hit_tokens_total") == own.hit_tokens
    assert counter("kvoffload_scheduler_miss_tokens_total") == own.miss_tokens
    assert counter("kvoffload_scheduler_deferred_lookups_total") == own.deferred_lookups
    for reason in MissReason:
        assert counter("kvoffload_lookup_misses_total", reason=reason.value) == (
            own.lookup_misses.get(reason, 0)
        ), reason
    pool = h.pool.statistics()
    assert counter("kvoffload_pool_blocks") == pool.num_blocks
    assert counter("kvoffload_pool_cached_blocks") == pool.num_cached
    # Each worker's poller, by rank: vLLM's aggregator added the two ranks' statistics.
    for worker in h.workers:
        side = worker.connector.worker_side
        assert side is not None
        polled = side._poller.statistics()
        assert polled.completed > 0
        rank = str(worker.rank)
        assert counter("kvoffload_poller_completed_total", rank=rank) == polled.completed
    # The same names and help texts as kvoffload.metrics.
    families = {f.name: f for f in registry.collect()}
    for spec in METRICS:
        assert families[f"kvoffload_{spec.name}"].documentation == spec.documentation

    lines: list[str] = []
    logging = KVConnectorLogging(h.config.kv_transfer_config)
    for data in h.connector_stats:
        logging.observe(data)
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert f"kvoffload_scheduler_loaded_tokens={own.loaded_tokens}" in line
    rate = round(own.hit_tokens / (own.hit_tokens + own.miss_tokens), 4)
    assert f"kvoffload_cpu_hit_rate={rate}" in line


def test_the_statistics_are_increments_that_aggregate_as_vllm_adds_them(model_dir: Path) -> None:
    h = harness(model_dir)
    h.run(make_request("a", prompt(3, 5, seed=3), max_tokens=2))
    h.settle()
    assert h.side.take_stats() is None  # nothing changed since the last step's report
    total = KVOffloadConnectorStats()
    for data in h.connector_stats:
        total.aggregate(KVOffloadConnector.build_kv_connector_stats(data))
    reduced = total.reduce()
    stored = h.stats().stored_blocks
    assert reduced["kvoffload_scheduler_stored_blocks"] == stored
    with pytest.raises(TypeError, match="KVOffloadConnectorStats cannot aggregate"):
        total.aggregate(offloading_stats())


def offloading_stats() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: PLC0415
        OffloadingConnectorStats,
    )

    return OffloadingConnectorStats()


def test_a_multi_group_model_reports_each_group_and_the_whole_model(model_dir: Path) -> None:
    h = GroupHarness(model_dir)
    b_after_a(h)
    per_group = h.side.scheduler.statistics()
    own = h.side.statistics().scheduler
    assert own is not None
    assert own.loaded_tokens == 4 * BLOCK_SIZE
    assert own.lookups >= 2
    assert own.lookup_misses
    registry = prometheus(h.connector_stats, h.config)
    counter = functools.partial(value, registry)
    for name, group in per_group.items():
        assert counter("kvoffload_group_stored_blocks_total", group=name) == group.stored_blocks
        assert counter("kvoffload_group_loaded_blocks_total", group=name) == group.loaded_blocks
        assert counter("kvoffload_group_cpu_blocks", group=name) == group.num_cpu_blocks
    assert counter("kvoffload_scheduler_loaded_tokens_total") == own.loaded_tokens
    assert counter("kvoffload_scheduler_stored_blocks_total") == own.stored_blocks
    assert counter("kvoffload_scheduler_hit_tokens_total") == own.hit_tokens
    for reason, count in own.lookup_misses.items():
        assert counter("kvoffload_lookup_misses_total", reason=reason.value) == count


def published(h: Harness | GroupHarness) -> list[Any]:
    events: list[Any] = []

    class Publisher:
        def publish(self, batch: kv_events.KVEventBatch) -> None:
            events.extend(batch.events)

    h.scheduler.kv_event_publisher = Publisher()  # type: ignore[assignment]
    return events


def by_medium(events: list[Any], medium: str) -> dict[tuple[int | None, Any], Any]:
    """``(group, hash)`` -> the BlockStored of ``medium`` that named it."""
    out = {}
    for event in events:
        if isinstance(event, kv_events.BlockStored) and event.medium == medium:
            for i, block_hash in enumerate(event.block_hashes):
                out[event.group_idx, block_hash] = (event, i)
    return out


def test_cpu_events_carry_vllm_s_own_hashes_of_the_same_blocks(model_dir: Path) -> None:
    h = harness(model_dir, kv_events_on=True)
    events = published(h)
    a = make_request("a", prompt(3, 5, seed=5), max_tokens=2)
    h.run(a)
    h.settle()
    gpu = by_medium(events, kv_events.MEDIUM_GPU)
    cpu = by_medium(events, kv_events.MEDIUM_CPU)
    assert len(cpu) == 3
    assert set(cpu) <= set(gpu)  # the GPU events of the same blocks had these hashes
    for key, (event, _) in cpu.items():
        gpu_event, i = gpu[key]
        assert event.group_idx == 0
        start = i * BLOCK_SIZE
        assert event.token_ids == gpu_event.token_ids[start : start + BLOCK_SIZE]
        assert event.block_size == gpu_event.block_size == BLOCK_SIZE
    # Removals name the same hashes.
    events.clear()
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    h.step()
    assert any(isinstance(e, kv_events.AllBlocksCleared) for e in events)
    assert len(h.side.events) == 0


def test_a_two_group_model_publishes_each_group_s_blocks_under_its_index(model_dir: Path) -> None:
    h = GroupHarness(model_dir, kv_events=True)
    events = published(h)
    a = make_request("a", prompt(6, 5, seed=6), max_tokens=2)
    h.run(a)
    h.settle()
    gpu = by_medium(events, kv_events.MEDIUM_GPU)
    cpu = by_medium(events, kv_events.MEDIUM_CPU)
    stats = h.side.scheduler.statistics()
    groups = {g for g, _ in cpu}
    assert groups == {0, 1}
    for index, name in ((0, "g0"), (1, "g1")):
        assert sum(1 for g, _ in cpu if g == index) == stats[name].stored_blocks
    # The full group's blocks: every one matches vLLM's own event of that group.
    assert set(cpu) <= set(gpu)
    # Same tokens in both groups, one hash each: told apart by the group index only.
    assert {h_ for g, h_ in cpu if g == 0} <= {h_ for g, h_ in cpu if g == 1}


@contextmanager
def tier_harness(model_dir: Path, tmp_path: Path, *, world: int) -> Iterator[Harness]:
    """KV events on and a disk tier; the workers' tiers closed on exit."""
    tiers = [{"kind": "disk", "path": str(tmp_path / "kv.bin"), "capacity_bytes": 4 << 20}]
    config = vllm_config(
        model_dir,
        {"num_cpu_blocks": 32, "tiers": tiers},
        num_gpu_blocks=64,
        world_size=world,
        connector="TestConnector",
        module="harness",
    )
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    h = Harness(config, kv_cache_config(64), world_size=world)
    try:
        yield h
    finally:
        for w in h.workers:
            w.connector.shutdown()


def written_down(h: Harness) -> int:
    """Blocks every rank's tiers reported written (each rank writes its own shard)."""
    counts = []
    for w in h.workers:
        (tiers,) = w.connector.worker_side.tiers.parts.values()  # type: ignore[union-attr]
        (tier,) = tiers.statistics()
        counts.append(tier.blocks_written)
    return min(counts)


def step_until_written(h: Harness, blocks: int) -> None:
    """Step (empty steps too, as vLLM's engine loop does) until every rank wrote
    ``blocks`` down, then once more: the writes' reports reach the scheduler side."""
    for _ in range(2000):
        if written_down(h) >= blocks:
            break
        h.step()
        time.sleep(0.002)
    else:
        raise AssertionError("the write-downs did not end")
    for _ in range(3):
        h.step()


@pytest.mark.parametrize("world", [1, 2])
def test_blocks_written_down_to_a_tier_are_published_with_its_medium(
    model_dir: Path, tmp_path: Path, world: int
) -> None:
    with tier_harness(model_dir, tmp_path, world=world) as h:
        events = published(h)
        h.run(make_request("a", prompt(3, 5, seed=7), max_tokens=2))
        h.settle()
        step_until_written(h, 3)
    cpu = by_medium(events, kv_events.MEDIUM_CPU)
    disk = by_medium(events, tier_medium("disk"))
    assert tier_medium("disk") == "DISK"
    assert tier_medium("redis-cluster") == "REDIS_CLUSTER"
    assert len(cpu) == 3
    # Every block the CPU pool published went down to the disk tier on every rank: the
    # same vLLM hashes, tokens and group, medium "DISK".
    assert set(disk) == set(cpu)
    for key, (event, _) in disk.items():
        cpu_event, _ = cpu[key]
        assert event.group_idx == 0
        assert event.token_ids == cpu_event.token_ids
        assert event.parent_block_hash == cpu_event.parent_block_hash
    # The tier's events follow the CPU pool's event of the same block.
    order = [(e.medium, e.block_hashes[0]) for e in events if isinstance(e, kv_events.BlockStored)]
    for _, block_hash in disk:
        assert order.index(("CPU", block_hash)) < order.index(("DISK", block_hash))


def test_a_block_one_rank_did_not_report_written_is_not_published(
    model_dir: Path, tmp_path: Path
) -> None:
    with tier_harness(model_dir, tmp_path, world=2) as h:
        (rank1,) = h.workers[1].connector.worker_side.tiers.parts.values()  # type: ignore[union-attr]
        rank1.on_written = None  # rank 1 writes its shard but never says so
        events = published(h)
        h.run(make_request("a", prompt(3, 5, seed=8), max_tokens=2))
        h.settle()
        step_until_written(h, 3)
    assert len(by_medium(events, kv_events.MEDIUM_CPU)) == 3
    assert by_medium(events, "DISK") == {}


def test_a_write_down_a_tier_stored_in_part_names_no_block() -> None:
    writes = TierWrites()
    a, b = BlockHash(b"a" * 32), BlockHash(b"b" * 32)
    writes.note((a, b), (2, 1, 0))  # tier 0 stored both, tier 1 one of them, tier 2 none
    assert writes.take() == {(0, 0): (a, b)}
    writes.note((a,), (1,), group=2)  # a group's tiers: keyed by its vLLM index
    assert writes.take() == {(2, 0): (a,)}
    assert writes.take() == {}
