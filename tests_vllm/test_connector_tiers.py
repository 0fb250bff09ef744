"""The connector's tiers (``tiers`` in ``kv_connector_extra_config``) with vLLM's real
`Scheduler` and simulated workers (`harness.Harness`): a prompt one engine stored is
promoted from a persistent disk tier by the next one (probe pending: "ask again";
promotion read and verified: loaded), a corrupted block is never served, and a tier that
never answers holds no request beyond the lookup budget (the CPU hit is answered). The
connector statistics vLLM hands its loggers carry the promotions and each rank's tiers,
under kvoffload.metrics' names (read from a private Prometheus registry).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from disk_files import corrupt_every_slot
from harness import BLOCK_SIZE, Harness, kv_cache_config, make_request, vllm_config
from prometheus_client import CollectorRegistry
from test_stats_events import prometheus, value

from kvoffload.integrations.vllm import KVOffloadConnector
from kvoffload.integrations.vllm import tiers as vllm_tiers
from kvoffload.integrations.vllm.group_tiers import GroupedSchedulerTiers
from kvoffload.integrations.vllm.stats import KVOffloadConnectorStats
from kvoffload.integrations.vllm.tiers import WorkerTiers

DISK_BYTES = 4 << 20
PREFIX_BLOCKS = 4


def prompt(prefix_blocks: int, tail: int, seed: int) -> list[int]:
    shared = [(7 * i) % 500 + 2 for i in range(prefix_blocks * BLOCK_SIZE)]
    return shared + [(seed * 31 + i) % 500 + 2 for i in range(tail)]


def disk(path: Path, **more: Any) -> dict[str, Any]:
    return {"kind": "disk", "path": str(path), "capacity_bytes": DISK_BYTES, "persist": True,
            **more}  # fmt: skip


@contextmanager
def engine(model_dir: Path, tiers: list[dict[str, Any]], *, world: int = 1) -> Iterator[Harness]:
    """A scheduler and ``world`` workers; the workers' tiers are closed (write-downs
    drained) on exit, as vLLM's shutdown does."""
    config = vllm_config(
        model_dir,
        {"num_cpu_blocks": 32, "tiers": tiers},
        num_gpu_blocks=64,
        world_size=world,
        connector="TestConnector",
        module="harness",
    )
    h = Harness(config, kv_cache_config(64), world_size=world)
    try:
        yield h
    finally:
        for w in h.workers:
            w.connector.shutdown()


def sched_tiers(h: Harness) -> GroupedSchedulerTiers:
    tiers = h.side.tiers  # type: ignore[union-attr]
    assert isinstance(tiers, GroupedSchedulerTiers)
    return tiers


def step_until(h: Harness, done: Callable[[], bool], *, max_steps: int = 2000) -> int:
    """Step (empty steps too: vLLM's engine loop does) until ``done()``; the steps taken."""
    for n in range(max_steps):
        if done():
            return n
        h.step()
        time.sleep(0.002)
    raise AssertionError("condition not reached")


def reported(h: Harness) -> CollectorRegistry:
    """The connector's metrics after vLLM's Prometheus logger observed every step's
    connector statistics so far."""
    return prometheus(h.connector_stats, h.config)


def worker_tiers(h: Harness) -> list[WorkerTiers]:
    out = []
    for w in h.workers:
        (wt,) = w.connector.worker_side.tiers.parts.values()  # type: ignore[union-attr]
        assert isinstance(wt, WorkerTiers)
        out.append(wt)
    return out


def tier_reported(h: Harness, name: str, field: str) -> Callable[[], bool]:
    """Whether every rank's ``kvoffload_tier_<name>`` reached its tier's ``field`` (a
    worker reports what its tiers answered at its previous report: empty steps carry it)."""

    def done() -> bool:
        registry = reported(h)
        return all(
            value(registry, f"kvoffload_tier_{name}", tier="disk0", kind="disk", rank=str(r))
            == getattr(wt.statistics()[0], field)
            for r, wt in enumerate(worker_tiers(h))
        )

    return done


def first_engine(model_dir: Path, tiers: list[dict[str, Any]], *, world: int = 1) -> int:
    """Run a prompt of ``PREFIX_BLOCKS`` full blocks and write it down; its bytes per block."""
    with engine(model_dir, tiers, world=world) as h:
        a = make_request("a", prompt(PREFIX_BLOCKS, 5, seed=1), max_tokens=2)
        h.run(a)
        h.settle()
        assert h.stats().stored_blocks >= PREFIX_BLOCKS  # type: ignore[union-attr]
        return h.connector.layout.bytes_per_block  # type: ignore[union-attr]


@pytest.mark.parametrize("world", [1, 2])
def test_the_next_engine_promotes_a_prompt_from_the_disk_tier(
    model_dir: Path, tmp_path: Path, world: int
) -> None:
    tiers = [disk(tmp_path / "kv.bin")]
    first_engine(model_dir, tiers, world=world)
    if world == 2:  # each rank keeps its shard in a file of its own
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.bin.rank0", "kv.bin.rank1"]

    with engine(model_dir, tiers, world=world) as h:
        b = make_request("b", prompt(PREFIX_BLOCKS, 7, seed=2), max_tokens=2)
        h.scheduler.add_request(b)
        out = h.step()
        # The CPU pool is empty: the tiers are probed and the lookup says "ask again".
        assert "b" not in out.num_scheduled_tokens
        assert sched_tiers(h).statistics().probes == 1
        step_until(h, lambda: "b" in h.outputs[-1].num_scheduled_tokens)
        out = h.outputs[-1]
        # Only the tail is computed; the prefix came from the disk tier through the pool.
        assert out.num_scheduled_tokens["b"] == len(b.prompt_token_ids) - 4 * BLOCK_SIZE
        assert h.loaded_tokens["b"] == PREFIX_BLOCKS * BLOCK_SIZE
        assert h.wrong_slots(b) == []  # every rank got its own shard back
        # the hit names the tier its blocks came from (the miss reasons' sources)
        _, _, tier_hits = h.side.scheduler.lookup_outcome("b")  # type: ignore[union-attr]
        assert tier_hits == {"disk0": PREFIX_BLOCKS * BLOCK_SIZE}  # in tokens
        stats = sched_tiers(h).statistics()
        assert stats.promotions == 1
        assert stats.blocks_promoted == PREFIX_BLOCKS
        assert stats.blocks_failed == 0
        assert h.stats().deferred_lookups >= 1  # type: ignore[union-attr]
        step_until(h, b.is_finished)
        h.settle()
        h.check()
        for wt in worker_tiers(h):
            assert wt.blocks_read == PREFIX_BLOCKS

        # vLLM's stats logger and /metrics: the promotions (the scheduler side's) and
        # each rank's tier, under kvoffload.metrics' names.
        step_until(h, tier_reported(h, "read_blocks_total", "blocks_read"))
        registry = reported(h)
        counter = functools.partial(value, registry)
        stats = sched_tiers(h).statistics()
        assert counter("kvoffload_tiers_promotions_total") == stats.promotions == 1
        assert counter("kvoffload_tiers_deferred_lookups_total") == stats.deferred_lookups >= 1
        assert counter("kvoffload_tiers_promotions_no_space_total") == 0
        assert counter("kvoffload_tiers_promotions_in_flight") == 0
        assert stats.probes_in_flight == stats.promotions_in_flight == 0
        for rank, wt in enumerate(worker_tiers(h)):
            (tier,) = wt.statistics()
            labels = {"tier": "disk0", "kind": "disk", "rank": str(rank)}
            assert counter("kvoffload_tier_read_blocks_total", **labels) == PREFIX_BLOCKS
            assert tier.blocks_read == wt.blocks_read == PREFIX_BLOCKS
            assert counter("kvoffload_tier_failed_checks_total", **labels) == 0
            assert counter("kvoffload_tier_healthy", **labels) == 1
            assert counter("kvoffload_tier_writes_skipped_full_total", **labels) == (
                wt.writes_dropped
            )
        # the log line: each tier's hit rate, every rank's reads together
        total = KVOffloadConnectorStats()
        for data in h.connector_stats:
            total.aggregate(KVOffloadConnector.build_kv_connector_stats(data))
        reduced = total.reduce()
        assert reduced["kvoffload_tier_hit_rate{tier=disk0}"] == 1.0
        assert reduced["kvoffload_tiers_promotions"] == 1


@pytest.mark.parametrize(("world", "corrupt"), [(1, "kv.bin"), (2, "kv.bin.rank1")])
def test_a_corrupted_block_is_a_miss_never_served(
    model_dir: Path, tmp_path: Path, world: int, corrupt: str
) -> None:
    """With two ranks only rank 1's file is corrupted: rank 0 reads its shard fine, but a
    block is published only when every rank read it."""
    path = tmp_path / "kv.bin"
    nbytes = first_engine(model_dir, [disk(path)], world=world)
    assert corrupt_every_slot(tmp_path / corrupt, DISK_BYTES, nbytes) >= PREFIX_BLOCKS

    with engine(model_dir, [disk(path)], world=world) as h:
        b = make_request("b", prompt(PREFIX_BLOCKS, 7, seed=2), max_tokens=2)
        h.scheduler.add_request(b)
        step_until(h, lambda: "b" in h.outputs[-1].num_scheduled_tokens if h.outputs else False)
        out = h.outputs[-1]
        # The promotion read blocks that failed their check: nothing published, the
        # lookup answered the (empty) CPU hit and vLLM computes the whole prompt.
        assert out.num_scheduled_tokens["b"] == len(b.prompt_token_ids)
        assert "b" not in h.loaded_tokens
        stats = sched_tiers(h).statistics()
        assert stats.blocks_promoted == 0
        assert stats.blocks_failed >= 1
        assert h.wrong_slots(b) == []
        step_until(h, b.is_finished)
        (wt,) = h.workers[-1].connector.worker_side.tiers.parts.values()  # type: ignore[union-attr]
        assert isinstance(wt, WorkerTiers)
        (tier,) = wt.statistics()
        assert tier.failed_checks >= 1
        h.settle()
        h.check()
        # vLLM's /metrics: the failed checks of the corrupted rank's tier, nothing promoted.
        step_until(h, tier_reported(h, "failed_checks_total", "failed_checks"))
        registry = reported(h)
        rank = str(world - 1)
        labels = {"tier": "disk0", "kind": "disk", "rank": rank}
        assert value(registry, "kvoffload_tier_failed_checks_total", **labels) == (
            tier.failed_checks
        )
        assert value(registry, "kvoffload_tiers_promotions_total") == stats.promotions >= 1


def test_a_tier_that_never_answers_delays_no_request_beyond_the_budget(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes sent to the workers are never answered (a tier stuck forever): the lookup
    asks again until the budget is spent, then answers the CPU hit, which is loaded."""
    tiers = [disk(tmp_path / "kv.bin", op_timeout_s=0.05, max_batch_blocks=256)]
    with engine(model_dir, tiers) as h:
        c = make_request("c", prompt(2, 3, seed=3), max_tokens=1)
        h.run(c)  # two prefix blocks reach the CPU pool
        h.settle()
        assert h.scheduler.reset_prefix_cache()
        monkeypatch.setattr(vllm_tiers.WorkerTiers, "submit", lambda *a, **k: None)

        b = make_request("b", prompt(PREFIX_BLOCKS, 7, seed=2), max_tokens=2)
        h.scheduler.add_request(b)
        waited = step_until(h, lambda: "b" in h.outputs[-1].num_scheduled_tokens)
        assert waited >= 1  # asked again while the probe was out
        stats = h.stats()  # type: ignore[union-attr]
        # The wait ended at the budget, by one of its two ends (same deadline): the
        # request's run of "ask again" was spent, or the probe was dropped as stale
        # first (which of the two is a matter of the lookup's microseconds).
        assert stats.deferrals_bounded + sched_tiers(h).statistics().probes_dropped >= 1
        assert h.loaded_tokens["b"] == 2 * BLOCK_SIZE  # the CPU hit, no more
        # The unanswered probe is dropped at the budget: no later request waits for it.
        assert sched_tiers(h).statistics().probes_in_flight == 0
        assert h.wrong_slots(b) == []
        step_until(h, b.is_finished)
        h.settle()
        h.check()
