"""KVOffloadConnector against vLLM's real Scheduler on CPU, with a fake model."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import (
    BLOCK_SIZE,
    Harness,
    TestConnector,
    kv_cache_config,
    make_request,
    vllm_config,
)
from vllm.distributed import kv_events
from vllm.v1.kv_cache_interface import SinkFullAttentionSpec
from vllm.v1.request import RequestStatus

from kvoffload.errors import ConfigError
from kvoffload.hashing import BlockHash, hash_block_tokens
from kvoffload.integrations.vllm.metadata import GroupTransfer, KVOffloadConnectorMetadata


def prompt(prefix_blocks: int, tail: int, seed: int) -> list[int]:
    """Shared-prefix tokens (``prefix_blocks`` full blocks) then a distinct tail."""
    shared = [(7 * i) % 500 + 2 for i in range(prefix_blocks * BLOCK_SIZE)]
    return shared + [(seed * 31 + i) % 500 + 2 for i in range(tail)]


def make(model_dir: Path, *, gpu_blocks: int = 64, world: int = 1, **extra: object) -> Harness:
    extra.setdefault("num_cpu_blocks", 32)
    config = vllm_config(
        model_dir,
        dict(extra),
        num_gpu_blocks=gpu_blocks,
        world_size=world,
        connector="TestConnector",
        module="harness",
    )
    return Harness(config, kv_cache_config(gpu_blocks), world_size=world)


def test_one_group_plans_travel_as_group_0_transfers_with_waited_loads(model_dir: Path) -> None:
    """The one metadata format: a one-group step's plans are `GroupTransfer`s of vLLM's
    group 0, reported under their plan id, with loads waited for (``async_loads`` off)."""
    h = make(model_dir)
    h.run(make_request("a", prompt(4, 5, seed=1), max_tokens=2))
    h.settle()
    assert h.scheduler.reset_prefix_cache()
    h.scheduler.add_request(make_request("b", prompt(4, 7, seed=2), max_tokens=2))
    h.step()
    metas = [o.kv_connector_metadata for o in h.outputs]
    assert all(isinstance(m, KVOffloadConnectorMetadata) for m in metas)
    stores = [t for m in metas for t in m.group_stores]  # type: ignore[union-attr]
    loads = [t for m in metas for t in m.group_loads]  # type: ignore[union-attr]
    assert stores
    assert len(loads) == 1
    assert loads[0].plan.request_id == "b"
    for t in stores + loads:
        assert isinstance(t, GroupTransfer)
        assert (t.group, t.key) == (0, t.plan.plan_id)
    assert not any(m.async_loads for m in metas)  # type: ignore[union-attr]
    assert len({t.key for t in stores + loads}) == len(stores) + len(loads)


def test_prefix_stored_by_a_is_loaded_by_b_after_gpu_reset(model_dir: Path) -> None:
    h = make(model_dir)
    a = make_request("a", prompt(4, 5, seed=1), max_tokens=2)
    h.run(a)
    h.settle()
    h.check()
    stats = h.stats()
    assert stats.stored_blocks >= 4
    assert h.scheduler.reset_prefix_cache()  # vLLM's own prefix cache forgets the prefix

    b = make_request("b", prompt(4, 7, seed=2), max_tokens=2)
    h.scheduler.add_request(b)
    out = h.step()
    # Only the tail is computed; the 4 prefix blocks came from the CPU pool.
    assert out.num_scheduled_tokens["b"] == len(b.prompt_token_ids) - 4 * BLOCK_SIZE
    assert h.loaded_tokens["b"] == 4 * BLOCK_SIZE
    assert h.wrong_slots(b) == []
    layout = h.connector.layout
    worker = h.workers[0].connector.worker_side
    assert worker is not None
    assert worker.bytes_loaded[0] == 4 * layout.bytes_per_block
    assert worker.bytes_stored[0] >= worker.bytes_loaded[0]
    for _ in range(10):
        if b.is_finished():
            break
        h.step()
    h.settle()
    h.check()
    after = h.stats()
    assert after.loaded_blocks == 4
    assert after.bytes_loaded == 4 * layout.bytes_per_block
    assert after.live_requests == 0
    assert h.side.pinned_gpu_block_ids() == []


def test_unknown_setting_is_rejected_by_name(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="num_cpu_blokcs"):
        make(model_dir, num_cpu_blokcs=4)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"store_mode": "sometimes"}, "store_mode"),
        ({"num_cpu_blocks": 0}, "num_cpu_blocks"),
        ({"num_cpu_blocks": None}, "exactly one of num_cpu_blocks"),
        ({"block_size": 32}, "block_size=32"),
    ],
)
def test_invalid_settings_are_refused_with_the_field_named(
    model_dir: Path, extra: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        make(model_dir, **extra)


def test_every_offload_config_field_is_accepted(model_dir: Path) -> None:
    h = make(
        model_dir,
        num_cpu_blocks=None,
        cpu_bytes="1MiB",
        store_mode="lazy",
        lazy_offload_blocks=8,
        restore_evicted=False,  # an eager-only setting: refused with lazy stores
        max_store_blocks_per_step=16,
        pin_memory="never",
        pin_chunk_bytes="64MiB",
        poll_interval_s=0.001,
        model_id="tiny-llama@test",
        hash_salt="tenant-a",
        enable_events=True,
    )
    config = h.side.config
    assert config.store_mode == "lazy"
    assert config.model_id == "tiny-llama@test"
    assert h.pool.num_blocks == (1 << 20) // h.connector.layout.bytes_per_block


def test_a_group_kvoffload_cannot_restore_is_refused_by_name(model_dir: Path) -> None:
    kv_config = kv_cache_config(16)
    group = kv_config.kv_cache_groups[0]
    group.kv_cache_spec = SinkFullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32, sink_len=4
    )
    config = vllm_config(model_dir, {"num_cpu_blocks": 8}, num_gpu_blocks=16)
    with pytest.raises(ConfigError, match="group 0: SinkFullAttentionSpec .*kind full"):
        Harness(config, kv_config)


@pytest.fixture(autouse=True)
def _no_injected_failures() -> Iterator[None]:
    yield
    TestConnector.fail_kinds = set()
    if TestConnector.store_gate is not None:
        TestConnector.store_gate.set()
    TestConnector.store_gate = None


def gpu_refs(h: Harness, block_ids: list[int]) -> list[int]:
    pool = h.scheduler.kv_cache_manager.block_pool
    return [pool.blocks[i].ref_cnt for i in block_ids]


def test_small_cpu_pool_defers_stores_without_evicting_in_flight_blocks(model_dir: Path) -> None:
    h = make(model_dir, num_cpu_blocks=3)
    h.workers[0].hold_reports = True  # every store stays in flight
    a = make_request("a", prompt(6, 3, seed=1), max_tokens=2)
    h.scheduler.add_request(a)
    h.step()
    stats = h.stats()
    assert stats.store_plans == 1
    assert stats.deferred_blocks == 3  # 6 full blocks computed, 3 CPU blocks
    assert h.pool.num_free == 0
    h.check()  # in-flight blocks keep their references: nothing evicted, nothing lost
    for _ in range(3):
        h.step()
        h.check()
        # The pool stays full of the in-flight store; later steps defer again.
        assert h.stats().store_plans == 1
    h.workers[0].hold_reports = False
    h.settle()
    h.check()
    after = h.stats()
    assert after.stored_blocks >= 3
    assert after.deferred_steps >= 2
    assert after.failed_stores == 0


def test_preemption_resets_the_store_cursor(model_dir: Path) -> None:
    h = make(model_dir)
    sched = h.side.scheduler
    cursors: list[tuple[int, bool]] = []
    original = sched.preempt

    def lane(request_id: str) -> Any:
        return sched._requests[request_id].lanes["g0"]  # the one group's lane

    def preempt(request_id: str) -> None:
        original(request_id)
        state = lane(request_id)
        cursors.append((state.cursor, not state.table))  # started over: no table kept

    sched.preempt = preempt  # type: ignore[method-assign]
    a = make_request("a", prompt(3, 4, seed=3), max_tokens=6)
    h.scheduler.add_request(a)
    h.step()
    assert lane("a").cursor == 3
    # vLLM's reset refuses while any GPU block is referenced, stores in flight included.
    h.drain_copies()
    h.step()
    assert h.side.pinned_gpu_block_ids() == []
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts "a"
    h.step()
    assert cursors == [(0, True)]
    # Re-admitted, it rescans from block 0 (its blocks are already on CPU: skipped).
    assert lane("a").cursor == 3
    assert h.wrong_slots(a) == []
    h.check()


def test_finished_request_keeps_gpu_blocks_until_its_store_completes(model_dir: Path) -> None:
    h = make(model_dir)
    h.workers[0].hold_reports = True
    a = make_request("a", prompt(4, 3, seed=4), max_tokens=1)
    h.scheduler.add_request(a)
    out = h.step()
    blocks = list(out.scheduled_new_reqs[0].block_ids[0][:4])
    assert len(blocks) == 4
    assert a.is_finished()
    assert "a" not in h.scheduler.requests  # vLLM is done with it...
    assert all(ref >= 1 for ref in gpu_refs(h, blocks))  # ...but the store still reads these
    free = h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    h.drain_copies()
    h.step()  # the report is held: still pinned
    assert all(ref >= 1 for ref in gpu_refs(h, blocks))
    h.workers[0].hold_reports = False
    h.settle()
    assert gpu_refs(h, blocks) == [0, 0, 0, 0]
    assert h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free + 4
    assert h.side.pinned_gpu_block_ids() == []
    h.check()


def test_failed_load_makes_vllm_recompute_exactly_those_blocks(model_dir: Path) -> None:
    h = make(model_dir)
    a = make_request("a", prompt(4, 5, seed=5), max_tokens=1)
    h.run(a)
    h.settle()
    assert h.scheduler.reset_prefix_cache()
    # Put block 0 back into vLLM's own cache, so that B hits it locally and loads 1..3.
    c = make_request("c", prompt(1, 3, seed=11), max_tokens=1)
    h.run(c)
    h.settle()
    TestConnector.fail_kinds = {"load"}
    b = make_request("b", prompt(4, 9, seed=6), max_tokens=3)
    h.scheduler.add_request(b)
    out = h.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK_SIZE  # 1 local + 3 loaded
    assert h.loaded_tokens["b"] == 3 * BLOCK_SIZE
    assert out.num_scheduled_tokens["b"] == len(b.prompt_token_ids) - 4 * BLOCK_SIZE
    TestConnector.fail_kinds = set()
    recomputed = 0
    for _ in range(5):
        if b.num_computed_tokens >= len(b.prompt_token_ids):
            break
        out = h.step()
        recomputed += out.num_scheduled_tokens.get("b", 0)
    # vLLM recomputes from the first block that failed to load: block 0 (its own) is kept.
    assert recomputed == len(b.prompt_token_ids) - BLOCK_SIZE
    assert h.wrong_slots(b) == []
    stats = h.stats()
    assert stats.failed_loads == 1
    assert h.side.load_failures == 1
    h.settle()
    h.check()
    # The blocks that failed were unpublished: a new lookup stops before them.
    d = make_request("d", prompt(4, 2, seed=12), max_tokens=1)
    assert h.side.get_num_new_matched_tokens(d, 0) == (BLOCK_SIZE, False)
    h.side.scheduler.release("d")


def test_abort_mid_load_leaks_nothing(model_dir: Path) -> None:
    h = make(model_dir)
    a = make_request("a", prompt(4, 5, seed=7), max_tokens=1)
    h.run(a)
    h.settle()
    assert h.scheduler.reset_prefix_cache()
    h.workers[0].hold_reports = True  # the load's completion has not reached the scheduler
    b = make_request("b", prompt(4, 6, seed=8), max_tokens=8)
    h.scheduler.add_request(b)
    h.step()
    assert h.loaded_tokens["b"] == 4 * BLOCK_SIZE
    assert h.side.in_flight_plan_ids()
    h.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    h.check()
    h.workers[0].hold_reports = False
    h.settle()
    h.check()
    sched = h.side.scheduler
    assert h.stats().live_requests == 0
    assert sched.num_in_flight == 0
    assert all(h.pool.block(i).ref_cnt == 0 for i in range(h.pool.num_blocks))
    assert h.side.pinned_gpu_block_ids() == []
    pool = h.scheduler.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks if not block.is_null)


def test_two_tensor_parallel_workers_publish_only_when_both_finished(model_dir: Path) -> None:
    h = make(model_dir, world=2)
    h.workers[1].hold_reports = True  # rank 1 is slower
    a = make_request("a", prompt(3, 2, seed=9), max_tokens=1)
    h.run(a)
    h.drain_copies()
    h.step()
    h.step()
    stats = h.stats()
    assert stats.stored_blocks == 0  # rank 0 finished long ago; rank 1 has not reported
    assert h.side.in_flight_plan_ids()
    h.workers[1].hold_reports = False
    h.settle()
    assert h.stats().stored_blocks == 3
    # Each rank holds its own shard: a later load brings each rank its own bytes back.
    assert h.scheduler.reset_prefix_cache()
    b = make_request("b", prompt(3, 5, seed=10), max_tokens=3)
    h.scheduler.add_request(b)
    h.step()
    assert h.loaded_tokens["b"] == 3 * BLOCK_SIZE
    assert h.wrong_slots(b) == []
    h.settle()
    h.check()


def test_kv_events_reach_vllm_with_the_cpu_medium(model_dir: Path) -> None:
    h = make(model_dir, enable_events=True)
    published: list[object] = []

    class Publisher:
        def publish(self, batch: kv_events.KVEventBatch) -> None:
            published.extend(batch.events)

    h.scheduler.kv_event_publisher = Publisher()
    a = make_request("a", prompt(2, 3, seed=13), max_tokens=1)
    h.run(a)
    h.settle()
    events = [e for e in published if getattr(e, "medium", None) == kv_events.MEDIUM_CPU]
    stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
    assert len(stored) == 2
    assert all(e.medium == kv_events.MEDIUM_CPU for e in stored)
    assert stored[0].token_ids == a.prompt_token_ids[:BLOCK_SIZE]
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    published.clear()
    assert h.scheduler.reset_prefix_cache(reset_connector=True)  # reaches reset_cache()
    h.step()
    after = [e for e in published if not isinstance(e, kv_events.BlockStored)]
    assert after
    assert h.pool.num_cached == 0
    assert h.side.get_num_new_matched_tokens(make_request("b", prompt(2, 3, seed=14)), 0) == (
        0,
        False,
    )


def test_blocks_of_a_preempted_request_stay_referenced_while_stalled_stores_read_them(
    model_dir: Path,
) -> None:
    h = make(model_dir, gpu_blocks=14)
    gate = threading.Event()
    TestConnector.store_gate = gate  # store copies wait: they read their blocks late
    a = make_request("a", prompt(4, 2, seed=15), max_tokens=80)
    other = [(11 * i) % 500 + 3 for i in range(4 * BLOCK_SIZE + 2)]
    b = make_request("b", other, max_tokens=80)
    h.scheduler.add_request(a)
    h.scheduler.add_request(b)
    pool = h.scheduler.kv_cache_manager.block_pool
    for _ in range(60):
        h.step()
        pinned = h.side.pinned_gpu_block_ids()
        # Blocks a copy still reads are never free, whoever else needs room.
        assert all(pool.blocks[i].ref_cnt >= 1 for i in pinned)
        h.check()
        if a.num_preemptions or b.num_preemptions:
            break
    # The GPU cache ran full and vLLM preempted a request whose blocks a stalled store
    # still reads (completing it would free no block, so vLLM does not wait for it).
    assert a.num_preemptions + b.num_preemptions >= 1
    assert pinned
    for _ in range(3):
        h.step()
        assert all(pool.blocks[i].ref_cnt >= 1 for i in pinned)
        h.check()
    gate.set()
    for _ in range(400):
        if a.is_finished() and b.is_finished():
            break
        if not h.step().num_scheduled_tokens:
            # Nothing ran: the waiting request's lookup is deferred until the stores of
            # its next blocks complete. Wait for the copies, so that how many steps this
            # loop needs does not depend on how soon the copy thread gets the CPU.
            h.drain_copies()
    assert a.is_finished()
    assert b.is_finished()
    h.settle()
    h.check()
    # What was stored is what the forward wrote: later loads bring back the right KV.
    assert h.scheduler.reset_prefix_cache()
    c = make_request("c", prompt(4, 9, seed=16), max_tokens=2)
    d = make_request("d", [*other[: 4 * BLOCK_SIZE], 9, 9, 9], max_tokens=2)
    for request in (c, d):
        h.scheduler.add_request(request)
    h.step()
    assert h.loaded_tokens["c"] == 4 * BLOCK_SIZE
    assert h.loaded_tokens["d"] == 4 * BLOCK_SIZE
    assert h.wrong_slots(c) == []
    assert h.wrong_slots(d) == []


def _chain(root: BlockHash, tokens: list[int], extra: bytes) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block_tokens(parent, tokens[start : start + BLOCK_SIZE], extra)
        hashes.append(parent)
    return hashes


def test_a_salted_request_is_hashed_block_by_block_with_its_salt(model_dir: Path) -> None:
    h = make(model_dir)
    root = h.side._roots["g0"]
    tokens = prompt(3, 5, seed=21)
    # Hashed in the chunks vLLM asks for, each block's hash mixes in the salt.
    b = make_request("b", tokens, max_tokens=1, cache_salt="tenant-z")
    want = _chain(root, tokens, b"salt:tenant-z")
    assert len(want) == 3
    for upto in (5, BLOCK_SIZE, 2 * BLOCK_SIZE + 3, len(tokens), 2 * BLOCK_SIZE):
        assert list(h.side._hashes(b, upto)["g0"]) == want[: upto // BLOCK_SIZE]
    assert want != _chain(root, tokens, b"")

    a = make_request("a", tokens, max_tokens=BLOCK_SIZE + 2, cache_salt="tenant-z")
    h.run(a)
    h.settle()
    h.check()
    stored = _chain(root, list(a.all_token_ids), b"salt:tenant-z")
    assert len(stored) == 4  # the prompt's three blocks and one of generated tokens
    assert [h.pool.is_cached(x) for x in stored[:3]] == [True] * 3
    assert not any(h.pool.is_cached(x) for x in _chain(root, tokens, b""))
