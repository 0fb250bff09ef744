"""KVOffloadConnector with several KV cache groups against vLLM's real Scheduler on CPU
(hybrid KV cache manager), with a fake model.

The KV cache has a sliding-window group and a full-attention group whose layers share one
allocation, as vLLM lays them out. The fake forward writes, for every token a step
computes and every group, a value of the token, its position and the group into that
group's block; after any sequence of steps every slot a group holds must hold its value.
`check_invariants()` of the `GroupedScheduler` runs after every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import (
    BLOCK_SIZE,
    Stepping,
    TestConnector,
    make_request,
    real_scheduler,
    vllm_config,
)
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from kvoffload.hashing import BlockHash, hash_block_tokens
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide, tables_of
from kvoffload.integrations.vllm.worker_side import WorkerSide

WINDOW = 32  # two blocks of 16 tokens: cdiv(W - 1, 16) = 2 blocks per hit
HEADS, HEAD = 2, 32
SW_LAYER, FULL_LAYER = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"


def kv_config(num_blocks: int) -> KVCacheConfig:
    args: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": HEADS,
        "head_size": HEAD,
        "dtype": torch.float32,
    }
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([SW_LAYER], SlidingWindowSpec(sliding_window=WINDOW, **args)),
            KVCacheGroupSpec([FULL_LAYER], FullAttentionSpec(**args)),
        ],
    )


def value(token: int, position: int, group: int) -> float:
    return float(token * 4096 + position) + group * 0.5


class GroupHarness(Stepping):
    """vLLM's `Scheduler` with two groups and one simulated worker whose two layers (one
    per group) are views of one tensor."""

    def __init__(
        self,
        model_dir: Path,
        *,
        gpu_blocks: int = 64,
        extra: dict[str, Any] | None = None,
        kv_events: bool = False,
    ) -> None:
        config = vllm_config(
            model_dir,
            {"num_cpu_blocks": 32, **(extra or {})},
            num_gpu_blocks=gpu_blocks,
            connector="TestConnector",
            module="harness",
        )
        if kv_events:
            config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        assert not config.scheduler_config.disable_hybrid_kv_cache_manager
        kv = kv_config(gpu_blocks)
        self.config = config
        self.scheduler = real_scheduler(config, kv)
        side = self.scheduler.connector.scheduler_side  # type: ignore[union-attr]
        assert isinstance(side, SchedulerSide)
        self.side = side
        TestConnector.next_rank = 0
        self.worker = TestConnector(config, KVConnectorRole.WORKER, kv)
        # One allocation for both groups (groups overlay each other from byte 0).
        self.kv = torch.full((gpu_blocks, 2, BLOCK_SIZE, HEADS, HEAD), -1.0)
        self.worker.register_kv_caches({SW_LAYER: self.kv, FULL_LAYER: self.kv})
        self.aggregator = KVOutputAggregator(1)
        self.connector_stats = []
        self.loads: list[Any] = []

    def blocks(self, rid: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(rid)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.loads += list(getattr(meta, "group_loads", ()))
        conn = self.worker
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)  # type: ignore[arg-type]
        for rid, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            start = request.num_computed_tokens - n
            tokens = request.all_token_ids
            for group, ids in enumerate(self.blocks(rid)):
                for pos in range(start, start + n):
                    self.kv[ids[pos // BLOCK_SIZE], :, pos % BLOCK_SIZE] = value(
                        tokens[pos], pos, group
                    )
        conn.wait_for_save()
        results = conn.get_transfer_results(set())
        kv_out = KVConnectorOutput(
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=conn.build_connector_worker_meta(),
            kv_connector_stats=conn.get_kv_connector_stats(),  # as vLLM's runner
        )
        conn.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7 + i] for i in range(len(req_ids))],
            kv_connector_output=kv_out,
        )
        merged = self.aggregator.aggregate([runner])
        assert merged is not None
        self.record_stats(self.scheduler.update_from_output(out, merged))
        self.side.scheduler.check_invariants()
        return out

    def drain_copies(self) -> None:
        worker = self.worker.worker_side
        assert isinstance(worker, WorkerSide)
        worker.wait_idle()

    def wrong_slots(self, request: Request) -> list[tuple[int, int]]:
        """``(group, position)`` of every slot a group holds for ``request`` with a wrong
        value (null entries, the blocks a window group freed, are skipped)."""
        tokens = request.all_token_ids
        wrong = []
        for group, ids in enumerate(self.blocks(request.request_id)):
            for pos in range(request.num_computed_tokens):
                block = ids[pos // BLOCK_SIZE]
                if block == 0:
                    continue
                want = value(tokens[pos], pos, group)
                if not bool((self.kv[block, :, pos % BLOCK_SIZE] == want).all()):
                    wrong.append((group, pos))
        return wrong


def prompt(blocks: int, tail: int, seed: int) -> list[int]:
    shared = [(7 * i) % 500 + 2 for i in range(blocks * BLOCK_SIZE)]
    return shared + [(seed * 31 + i) % 500 + 2 for i in range(tail)]


def test_null_block_ids_become_none_entries_of_the_cacheable_groups() -> None:
    tables = tables_of(([0, 0, 5, 6], [1, 2, 3], [9]), ["g0", "g1", None])
    assert tables == {"g0": [None, None, 5, 6], "g1": [1, 2, 3]}


def test_a_prefix_is_loaded_in_every_group_with_only_the_window_s_blocks(
    model_dir: Path,
) -> None:
    h = GroupHarness(model_dir)
    a = make_request("a", prompt(6, 5, seed=1), max_tokens=2)
    h.run(a)
    h.settle()
    stats = h.side.scheduler.statistics()
    # Full: every full block; window: the blocks of its window at each store point that
    # vLLM still held (it frees the rest as the prefill moves on).
    assert stats["g1"].stored_blocks == 6
    assert 2 <= stats["g0"].stored_blocks <= 6
    assert h.scheduler.reset_prefix_cache()

    b = make_request("b", prompt(6, 9, seed=2), max_tokens=2)
    h.scheduler.add_request(b)
    out = h.step()  # b waits for its loads (asynchronous)
    assert "b" not in out.num_scheduled_tokens
    assert h.side.loaded_tokens == 6 * BLOCK_SIZE
    out = h.step()
    assert out.num_scheduled_tokens["b"] == len(b.prompt_token_ids) - 6 * BLOCK_SIZE
    by_group = {t.group: t.plan for t in h.loads}
    assert by_group[1].num_blocks == 6  # the full group: every block of the hit
    assert by_group[0].num_blocks == 2  # the window group: the two blocks ending at 96
    sw_table = h.blocks("b")[0]
    assert list(by_group[0].gpu_block_ids) == sw_table[4:6]
    assert sw_table[:4] == [0, 0, 0, 0]  # vLLM holds nothing of the window group below it
    assert h.wrong_slots(b) == []
    while not b.is_finished():
        h.step()
    h.settle()
    after = h.side.scheduler.statistics()
    assert (after["g0"].loaded_blocks, after["g1"].loaded_blocks) == (2, 6)
    assert after["g0"].pinned_blocks == after["g1"].pinned_blocks == 0


def test_a_hit_stored_in_one_group_only_is_not_served(model_dir: Path) -> None:
    h = GroupHarness(model_dir)
    a = make_request("a", prompt(6, 5, seed=1), max_tokens=2)
    h.run(a)
    h.settle()
    assert h.scheduler.reset_prefix_cache()
    h.side.scheduler.ledger("g0").reset()  # the window group forgets everything
    b = make_request("b", prompt(6, 9, seed=2), max_tokens=2)
    h.scheduler.add_request(b)
    out = h.step()
    assert out.num_scheduled_tokens["b"] == len(b.prompt_token_ids)  # all recomputed
    assert h.loads == []
    assert h.side.loaded_tokens == 0
    assert h.wrong_slots(b) == []


@pytest.mark.parametrize("fail", ["store", "load"])
def test_failed_copies_publish_nothing_or_recompute_every_group(model_dir: Path, fail: str) -> None:
    h = GroupHarness(model_dir)
    TestConnector.fail_kinds = {fail} if fail == "store" else set()
    try:
        h.run(make_request("a", prompt(6, 5, seed=1), max_tokens=2))
        h.settle()
        assert h.scheduler.reset_prefix_cache()
        TestConnector.fail_kinds = {fail}
        b = make_request("b", prompt(6, 9, seed=2), max_tokens=8)
        h.scheduler.add_request(b)
        h.step()  # the load (asynchronous): it fails with fail="load"
        TestConnector.fail_kinds = set()
        for _ in range(10):  # vLLM recomputes what did not load
            if b.num_computed_tokens > len(b.prompt_token_ids):
                break
            h.step()
        assert h.wrong_slots(b) == []
        while not b.is_finished():
            h.step()
        h.settle()
    finally:
        TestConnector.fail_kinds = set()
    stats = h.side.scheduler.statistics()
    assert stats["g0"].loaded_blocks == stats["g1"].loaded_blocks == 0
    if fail == "store":
        assert h.loads == []
    else:
        assert h.side.load_failures == 2  # one plan per group


def test_a_preempted_request_restarts_from_what_every_group_stored(model_dir: Path) -> None:
    h = GroupHarness(model_dir)
    a = make_request("a", prompt(6, 4, seed=3), max_tokens=8)
    h.scheduler.add_request(a)
    h.step()  # the prompt's prefill: store points 16 ... 96
    worker = h.worker.worker_side
    assert isinstance(worker, WorkerSide)
    worker.wait_idle()
    h.step()  # collects the stores; their GPU blocks are no longer referenced
    assert h.side.in_flight_plan_ids() == []
    stored = {n: s.stored_blocks for n, s in h.side.scheduler.statistics().items()}
    assert stored["g1"] == 6
    # vLLM's reset preempts "a" and frees its blocks before the connector hears of it:
    # the last store point preempt() plans would read freed blocks, so it is cancelled.
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
    out = h.step()  # re-admitted: it hits kvoffload and waits for its loads
    assert "a" not in out.num_scheduled_tokens
    assert h.side.loaded_tokens == 6 * BLOCK_SIZE
    h.step()
    assert h.wrong_slots(a) == []
    while not a.is_finished():
        h.step()
    h.settle()
    after = h.side.scheduler.statistics()
    assert (after["g0"].loaded_blocks, after["g1"].loaded_blocks) == (2, 6)


def test_the_pools_are_built_from_the_connector_settings(model_dir: Path) -> None:
    h = GroupHarness(
        model_dir, extra={"num_cpu_blocks": None, "cpu_bytes": 1 << 20, "eviction_policy": "arc"}
    )
    sched = h.side.scheduler
    assert h.side.alignment == h.side.checkpoint_tokens == BLOCK_SIZE
    for name in ("g0", "g1"):
        assert type(sched.ledger(name).pool.policy).__name__ == "ArcPolicy"
    # cpu_bytes split by need: with store points at every block, a window group stores
    # a block per block of tokens, as the full group does (the same page): equal halves.
    page = 2 * BLOCK_SIZE * HEADS * HEAD * 4
    sizes = {n: s.num_cpu_blocks for n, s in sched.statistics().items()}
    assert sizes == {"g0": (1 << 19) // page, "g1": (1 << 19) // page}
    worker = h.worker.worker_side
    assert isinstance(worker, WorkerSide)
    assert {i: g.num_cpu_blocks for i, g in worker.groups.items()} == {
        0: sizes["g0"],
        1: sizes["g1"],
    }


def test_a_request_that_skips_reading_the_cache_is_stored_but_not_served(
    model_dir: Path,
) -> None:
    h = GroupHarness(model_dir)
    a = make_request("a", prompt(6, 5, seed=1), max_tokens=2)
    a.skip_reading_prefix_cache = True
    h.run(a)
    h.settle()
    assert h.side.scheduler.statistics()["g1"].stored_blocks == 6  # stored all the same
    assert h.scheduler.reset_prefix_cache()
    b = make_request("b", prompt(6, 9, seed=2), max_tokens=2)
    b.skip_reading_prefix_cache = True
    h.scheduler.add_request(b)
    out = h.step()
    assert out.num_scheduled_tokens["b"] == len(b.prompt_token_ids)  # not served
    assert h.loads == []


def test_a_salted_request_is_hashed_with_its_salt_in_every_group(model_dir: Path) -> None:
    h = GroupHarness(model_dir)
    tokens = prompt(3, 5, seed=21)
    b = make_request("b", tokens, max_tokens=1, cache_salt="tenant-z")
    hashes = h.side._hashes(b, len(tokens))
    for name, root in h.side._roots.items():
        want: list[BlockHash] = []
        parent = root
        for start in range(0, 3 * BLOCK_SIZE, BLOCK_SIZE):
            parent = hash_block_tokens(parent, tokens[start : start + BLOCK_SIZE], b"salt:tenant-z")
            want.append(parent)
        assert hashes[name] == want, name
    assert hashes["g0"] != hashes["g1"]  # each group hashes in its own namespace


def test_a_prefix_stored_under_one_salt_is_served_only_under_that_salt(model_dir: Path) -> None:
    h = GroupHarness(model_dir)
    h.run(make_request("a", prompt(6, 5, seed=1), max_tokens=2, cache_salt="tenant-a"))
    h.settle()
    assert h.scheduler.reset_prefix_cache()
    h.run(make_request("b", prompt(6, 9, seed=2), max_tokens=2, cache_salt="tenant-b"))
    h.settle()
    assert h.loads == []
    assert h.side.loaded_tokens == 0
    assert h.scheduler.reset_prefix_cache()
    c = make_request("c", prompt(6, 7, seed=3), max_tokens=2, cache_salt="tenant-a")
    h.scheduler.add_request(c)
    h.step()  # c waits for its loads (asynchronous)
    assert h.side.loaded_tokens == 6 * BLOCK_SIZE
    out = h.step()
    assert out.num_scheduled_tokens["c"] == len(c.prompt_token_ids) - 6 * BLOCK_SIZE
    assert h.wrong_slots(c) == []


# -- the store settings, honoured with several groups as with one ------------------------------


def test_max_store_blocks_per_step_bounds_each_groups_plan(model_dir: Path) -> None:
    """Each group's plan of one step holds at most ``max_store_blocks_per_step`` blocks;
    the rest is deferred to later steps, and every block is stored in the end."""
    h = GroupHarness(model_dir, extra={"max_store_blocks_per_step": 2})
    sched = h.side.scheduler
    sizes: list[dict[str, int]] = []
    plan_stores = sched.plan_stores

    def spy(*args: Any) -> Any:
        plan = plan_stores(*args)
        if plan is not None:
            sizes.append({n: p.num_blocks for n, p in plan.plans.items()})
        return plan

    sched.plan_stores = spy  # type: ignore[method-assign]
    h.run(make_request("a", prompt(6, 5, seed=1), max_tokens=6))
    h.settle()
    assert sizes
    assert max(n for step in sizes for n in step.values()) == 2, sizes
    stats = sched.statistics()
    assert stats["g1"].deferred_blocks > 0
    assert stats["g1"].stored_blocks == 6  # every full block, over several steps


def test_store_admission_stores_a_prefix_the_second_time_it_is_computed(model_dir: Path) -> None:
    h = GroupHarness(model_dir, extra={"store_admission": "seen_twice"})
    sched = h.side.scheduler
    h.run(make_request("a", prompt(6, 5, seed=1), max_tokens=2))
    h.settle()
    assert {n: s.stored_blocks for n, s in sched.statistics().items()} == {"g0": 0, "g1": 0}
    assert h.scheduler.reset_prefix_cache()
    h.run(make_request("b", prompt(6, 9, seed=2), max_tokens=2))  # no hit: computed again
    h.settle()
    assert h.loads == []
    stats = sched.statistics()
    assert stats["g1"].stored_blocks == 6  # offered a second time: admitted
    assert stats["g0"].stored_blocks >= 2
    assert h.scheduler.reset_prefix_cache()
    c = make_request("c", prompt(6, 3, seed=3), max_tokens=2)
    h.scheduler.add_request(c)
    h.step()  # c waits for its loads (asynchronous)
    assert h.side.loaded_tokens == 6 * BLOCK_SIZE
    h.step()
    assert h.wrong_slots(c) == []
    while not c.is_finished():
        h.step()


def _evicting_run(model_dir: Path, restore: bool) -> tuple[GroupHarness, Request]:
    """Request "a" stored, then "b" (other tokens) evicting its blocks from pools of 4
    blocks while "a" still decodes; the harness after both finished, and "a"."""
    h = GroupHarness(model_dir, extra={"num_cpu_blocks": 4, "restore_evicted": restore})
    a = make_request("a", [(3 * i) % 500 + 2 for i in range(4 * BLOCK_SIZE + 3)], max_tokens=12)
    b = make_request("b", [(5 * i) % 500 + 7 for i in range(4 * BLOCK_SIZE + 3)], max_tokens=3)
    h.scheduler.add_request(a)
    h.step()  # a's prefill: its blocks stored
    h.drain_copies()
    h.step()
    h.scheduler.add_request(b)
    for _ in range(40):
        h.drain_copies()
        h.step()
        if a.is_finished() and b.is_finished():
            break
    h.settle()
    return h, a


def test_restore_evicted_stores_a_running_requests_evicted_blocks_again(model_dir: Path) -> None:
    h, _ = _evicting_run(model_dir, restore=True)
    stats = h.side.scheduler.statistics()
    assert stats["g1"].evicted_while_live > 0
    assert stats["g1"].restored_blocks > 0
    off, _ = _evicting_run(model_dir, restore=False)
    stats = off.side.scheduler.statistics()
    assert stats["g1"].evicted_while_live > 0
    assert stats["g1"].restored_blocks == 0
