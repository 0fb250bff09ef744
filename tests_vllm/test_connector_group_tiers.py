"""The connector's tiers with several KV cache groups (a sliding-window group and a
full-attention group, vLLM's hybrid KV cache manager on), with vLLM's real `Scheduler`
and simulated workers: a prompt one engine stored is promoted from a persistent disk
tier by the next one in every group (each group's blocks in a file of its own, under its
own namespace; with two ranks, a file per group and rank), the lookup answering "ask
again" while promotions run; a corrupted block is never served; a tier that never
answers holds no request beyond the lookup budget; each group's tiers are labelled by
group in the connector statistics vLLM hands its loggers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_files import corrupt_every_slot
from harness import BLOCK_SIZE, Stepping, TestConnector, make_request, real_scheduler, vllm_config
from test_scheduler_groups import FULL_LAYER, HEAD, HEADS, SW_LAYER, kv_config, prompt, value
from test_stats_events import by_medium, prometheus, published
from test_stats_events import value as metric
from vllm.config import KVEventsConfig
from vllm.distributed import kv_events
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from kvoffload.integrations.vllm import tiers as vllm_tiers
from kvoffload.integrations.vllm.group_tiers import GroupedSchedulerTiers, GroupedWorkerTiers
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.integrations.vllm.worker_side import WorkerSide

DISK_BYTES = 4 << 20
PREFIX = 6  # blocks of the shared prefix
PAGE = 2 * BLOCK_SIZE * HEADS * HEAD * 4  # one block of one layer (float32)


def disk(path: Path, **more: Any) -> dict[str, Any]:
    return {"kind": "disk", "path": str(path), "capacity_bytes": DISK_BYTES, "persist": True,
            **more}  # fmt: skip


class TieredGroups(Stepping):
    """vLLM's `Scheduler` with two groups and ``world`` simulated workers, each with one
    allocation for both groups' layers (groups overlay each other from byte 0); rank
    ``r`` writes its own values (``value() + r / 8``), so a rank that got another rank's
    shard back shows wrong slots."""

    def __init__(
        self, model_dir: Path, tiers: list[dict[str, Any]], *, world: int = 1, events: bool = False
    ) -> None:
        config = vllm_config(
            model_dir,
            {"num_cpu_blocks": 32, "tiers": tiers},
            num_gpu_blocks=64,
            world_size=world,
            connector="TestConnector",
            module="harness",
        )
        assert not config.scheduler_config.disable_hybrid_kv_cache_manager
        if events:
            config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        self.config = config
        self.scheduler = real_scheduler(config, kv_config(64))
        side = self.scheduler.connector.scheduler_side  # type: ignore[union-attr]
        assert isinstance(side, SchedulerSide)
        self.side = side
        self.workers: list[tuple[TestConnector, torch.Tensor]] = []
        for rank in range(world):
            TestConnector.next_rank = rank
            conn = TestConnector(config, KVConnectorRole.WORKER, kv_config(64))
            kv = torch.full((64, 2, BLOCK_SIZE, HEADS, HEAD), -1.0)
            conn.register_kv_caches({SW_LAYER: kv, FULL_LAYER: kv})
            self.workers.append((conn, kv))
        self.aggregator = KVOutputAggregator(world)
        self.connector_stats: list[dict[str, Any]] = []
        self.outputs: list[SchedulerOutput] = []

    def blocks(self, rid: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(rid)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.outputs.append(out)
        meta = out.kv_connector_metadata
        req_ids = list(out.num_scheduled_tokens)
        runner_outputs = []
        for rank, (conn, kv) in enumerate(self.workers):
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)  # type: ignore[arg-type]
            for rid, n in out.num_scheduled_tokens.items():
                request = self.scheduler.requests[rid]
                start = request.num_computed_tokens - n
                tokens = request.all_token_ids
                for group, ids in enumerate(self.blocks(rid)):
                    for pos in range(start, start + n):
                        kv[ids[pos // BLOCK_SIZE], :, pos % BLOCK_SIZE] = (
                            value(tokens[pos], pos, group) + rank / 8
                        )
            conn.wait_for_save()
            results = conn.get_transfer_results(set())
            kv_out = KVConnectorOutput(
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=conn.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=conn.build_connector_worker_meta(),
                kv_connector_stats=conn.get_kv_connector_stats(),
            )
            conn.clear_connector_metadata()
            runner_outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[[7 + i] for i in range(len(req_ids))],
                    kv_connector_output=kv_out,
                )
            )
        merged = self.aggregator.aggregate(runner_outputs)
        assert merged is not None
        self.record_stats(self.scheduler.update_from_output(out, merged))
        self.side.scheduler.check_invariants()
        return out

    def drain_copies(self) -> None:
        for conn, _ in self.workers:
            worker = conn.worker_side
            assert isinstance(worker, WorkerSide)
            worker.wait_idle()

    def wrong_slots(self, request: Request) -> list[tuple[int, int, int]]:
        """``(rank, group, position)`` of every slot a group holds with a wrong value."""
        tokens = request.all_token_ids
        wrong = []
        for rank, (_, kv) in enumerate(self.workers):
            for group, ids in enumerate(self.blocks(request.request_id)):
                for pos in range(request.num_computed_tokens):
                    block = ids[pos // BLOCK_SIZE]
                    if block == 0:
                        continue
                    want = value(tokens[pos], pos, group) + rank / 8
                    if not bool((kv[block, :, pos % BLOCK_SIZE] == want).all()):
                        wrong.append((rank, group, pos))
        return wrong

    @property
    def tiers(self) -> GroupedSchedulerTiers:
        tiers = self.side.tiers
        assert isinstance(tiers, GroupedSchedulerTiers)
        return tiers

    def worker_tiers(self) -> list[GroupedWorkerTiers]:
        out = []
        for conn, _ in self.workers:
            tiers = conn.worker_side.tiers  # type: ignore[union-attr]
            assert isinstance(tiers, GroupedWorkerTiers)
            out.append(tiers)
        return out


@contextmanager
def engine(
    model_dir: Path, tiers: list[dict[str, Any]], *, world: int = 1, events: bool = False
) -> Iterator[TieredGroups]:
    """An engine whose workers' tiers are closed (write-downs drained) on exit."""
    h = TieredGroups(model_dir, tiers, world=world, events=events)
    try:
        yield h
    finally:
        for conn, _ in h.workers:
            conn.shutdown()


def step_until(h: TieredGroups, done: Callable[[], bool], *, max_steps: int = 2000) -> int:
    """Step (empty steps too, as vLLM's engine loop does) until ``done()``."""
    for n in range(max_steps):
        if done():
            return n
        h.step()
        time.sleep(0.002)
    raise AssertionError("condition not reached")


def scheduled(h: TieredGroups, rid: str) -> Callable[[], bool]:
    return lambda: bool(h.outputs) and rid in h.outputs[-1].num_scheduled_tokens


def first_engine(model_dir: Path, tiers: list[dict[str, Any]], *, world: int = 1) -> None:
    """Run a prompt of ``PREFIX`` full blocks; its blocks are written down in each group."""
    with engine(model_dir, tiers, world=world) as h:
        h.run(make_request("a", prompt(PREFIX, 5, seed=1), max_tokens=2))
        h.settle()
        stats = h.side.scheduler.statistics()
        assert stats["g1"].stored_blocks == PREFIX
        assert stats["g0"].stored_blocks >= 2


@pytest.mark.parametrize("world", [1, 2])
def test_the_next_engine_promotes_a_prompt_from_the_disk_tier_in_every_group(
    model_dir: Path, tmp_path: Path, world: int
) -> None:
    tiers = [disk(tmp_path / "kv.bin")]
    first_engine(model_dir, tiers, world=world)
    # one file per group (and per rank with several), each under its group's namespace
    files = sorted(p.name for p in tmp_path.iterdir())
    if world == 1:
        assert files == ["kv.g0.bin", "kv.g1.bin"]
    else:
        assert files == [f"kv.g{g}.bin.rank{r}" for g in (0, 1) for r in (0, 1)]

    with engine(model_dir, tiers, world=world) as h:
        b = make_request("b", prompt(PREFIX, 9, seed=2), max_tokens=2)
        h.scheduler.add_request(b)
        out = h.step()
        # Both CPU pools are empty: each group's tiers are probed, the lookup asks again.
        assert "b" not in out.num_scheduled_tokens
        stats = h.tiers.group_statistics()
        assert stats["g0"].probes >= 1
        assert stats["g1"].probes == 1
        waited = step_until(h, scheduled(h, "b"))
        assert waited >= 1
        # Only the tail is computed: the prefix came from the disk tier in both groups
        # (the full group every block, the window group its window's).
        assert h.outputs[-1].num_scheduled_tokens["b"] == len(b.prompt_token_ids) - 96
        assert h.side.loaded_tokens == PREFIX * BLOCK_SIZE
        assert h.wrong_slots(b) == []  # every rank got its own shard of every group back
        stats = h.tiers.group_statistics()
        assert stats["g1"].blocks_promoted == PREFIX
        assert stats["g0"].blocks_promoted >= 2
        assert stats["g0"].blocks_failed == stats["g1"].blocks_failed == 0
        assert h.side.scheduler.statistics()["g1"].loaded_blocks == PREFIX
        assert h.tiers.manager_statistics().deferred_lookups >= 1
        step_until(h, b.is_finished)
        h.settle()
        # each rank read its blocks from each group's own tier, named after the group
        for wt in h.worker_tiers():
            by_name = {t.name: t for t in wt.statistics()}
            assert set(by_name) == {"disk0.g0", "disk0.g1"}
            assert by_name["disk0.g1"].blocks_read == PREFIX
            assert by_name["disk0.g0"].blocks_read >= 2

        # vLLM's loggers: the tiers labelled by group (and rank), the promotions added up
        def reported() -> bool:
            registry = prometheus(h.connector_stats, h.config)
            return all(
                metric(
                    registry,
                    "kvoffload_tier_read_blocks_total",
                    tier="disk0.g1",
                    kind="disk",
                    rank=str(r),
                )
                == PREFIX
                for r in range(world)
            )

        step_until(h, reported)
        registry = prometheus(h.connector_stats, h.config)
        promotions = sum(s.promotions for s in h.tiers.group_statistics().values())
        assert metric(registry, "kvoffload_tiers_promotions_total") == promotions >= 2


def test_a_corrupted_block_is_a_miss_never_served(model_dir: Path, tmp_path: Path) -> None:
    """The full group's file is corrupted in place: its blocks fail their check, so no
    hit is served (a hit needs every group), though the window group's blocks are fine."""
    tiers = [disk(tmp_path / "kv.bin")]
    first_engine(model_dir, tiers)
    # the two groups' pools are alike: each gets half of capacity_bytes
    assert corrupt_every_slot(tmp_path / "kv.g1.bin", DISK_BYTES // 2, PAGE) >= PREFIX

    with engine(model_dir, tiers) as h:
        b = make_request("b", prompt(PREFIX, 9, seed=2), max_tokens=2)
        h.scheduler.add_request(b)
        step_until(h, scheduled(h, "b"))
        # nothing published in the full group: vLLM computes the whole prompt
        assert h.outputs[-1].num_scheduled_tokens["b"] == len(b.prompt_token_ids)
        assert h.side.loaded_tokens == 0
        assert h.wrong_slots(b) == []
        stats = h.tiers.group_statistics()
        assert stats["g1"].blocks_promoted == 0
        assert stats["g1"].blocks_failed >= 1
        step_until(h, b.is_finished)
        h.settle()
        (wt,) = h.worker_tiers()
        by_name = {t.name: t for t in wt.statistics()}
        assert by_name["disk0.g1"].failed_checks >= 1
        assert by_name["disk0.g0"].failed_checks == 0


def test_a_tier_that_never_answers_delays_no_request_beyond_the_budget(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes are never answered (a tier stuck forever): the lookup asks again until the
    budget is spent, then answers the CPU hit of every group, which is loaded."""
    tiers = [disk(tmp_path / "kv.bin", op_timeout_s=0.05, max_batch_blocks=256)]
    with engine(model_dir, tiers) as h:
        h.run(make_request("c", prompt(2, 3, seed=3), max_tokens=1))
        h.settle()  # two prefix blocks of each group reach the CPU pools
        assert h.scheduler.reset_prefix_cache()
        monkeypatch.setattr(vllm_tiers.WorkerTiers, "submit", lambda *a, **k: None)

        b = make_request("b", prompt(PREFIX, 9, seed=2), max_tokens=2)
        h.scheduler.add_request(b)
        waited = step_until(h, scheduled(h, "b"))
        assert waited >= 2  # asked again while the probes were out, then loaded
        stats = h.tiers.group_statistics()
        dropped = sum(s.probes_dropped for s in stats.values())
        assert h.side.scheduler.deferrals_bounded + dropped >= 1
        assert h.side.loaded_tokens == 2 * BLOCK_SIZE  # the CPU hit, no more
        step_until(h, lambda: b.num_computed_tokens >= len(b.prompt_token_ids))
        assert h.wrong_slots(b) == []
        step_until(h, b.is_finished)
        h.settle()


@pytest.mark.parametrize("world", [1, 2])
def test_each_groups_write_downs_are_published_with_the_tiers_medium_and_its_group(
    model_dir: Path, tmp_path: Path, world: int
) -> None:
    """KV events with several groups: a block every rank wrote down to its group's disk
    file gets a ``"DISK"`` ``BlockStored`` under that group's vLLM index, after the CPU
    pool's event of the same block (same vLLM hash, tokens and group)."""
    with engine(model_dir, [disk(tmp_path / "kv.bin")], world=world, events=True) as h:
        events = published(h)  # type: ignore[arg-type]
        h.run(make_request("a", prompt(PREFIX, 5, seed=3), max_tokens=2))
        h.settle()

        def all_written() -> bool:
            cpu = by_medium(events, kv_events.MEDIUM_CPU)
            return bool(cpu) and set(by_medium(events, "DISK")) >= set(cpu)

        step_until(h, all_written)
    cpu = by_medium(events, kv_events.MEDIUM_CPU)
    disk_events = by_medium(events, "DISK")
    assert {group for group, _ in cpu} == {0, 1}  # both groups stored blocks
    assert set(disk_events) == set(cpu)
    for key, (event, _) in disk_events.items():
        cpu_event, _ = cpu[key]
        assert event.group_idx == cpu_event.group_idx == key[0]
        assert event.token_ids == cpu_event.token_ids
    order = [
        (e.medium, e.group_idx, e.block_hashes[0])
        for e in events
        if isinstance(e, kv_events.BlockStored)
    ]
    for group, block_hash in disk_events:
        assert order.index(("CPU", group, block_hash)) < order.index(("DISK", group, block_hash))
