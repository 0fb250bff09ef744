"""KVOffloadConnector against vLLM's real Scheduler on CPU, with a fake model."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import BLOCK_SIZE, Harness, kv_cache_config, make_request, vllm_config

from kvoffload.errors import ConfigError


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


def test_prefix_stored_by_a_is_loaded_by_b_after_gpu_reset(model_dir: Path) -> None:
    h = make(model_dir)
    a = make_request("a", prompt(4, 5, seed=1), max_tokens=2)
    h.run(a)
    h.settle()
    h.check()
    stats = h.side.scheduler.statistics()
    assert stats.stored_blocks >= 4
    assert h.scheduler.reset_prefix_cache()  # vLLM's own prefix cache forgets the prefix

    b = make_request("b", prompt(4, 7, seed=2), max_tokens=2)
    h.scheduler.add_request(b)
    out = h.step()
    # Only the tail is computed; the 4 prefix blocks came from the CPU pool.
    assert out.num_scheduled_tokens["b"] == len(b.prompt_token_ids) - 4 * BLOCK_SIZE
    assert h.loaded_tokens["b"] == 4 * BLOCK_SIZE
    assert h.wrong_slots(b) == []
    layout = h.side.layout
    worker = h.workers[0].connector.worker_side
    assert worker is not None
    assert worker.bytes_loaded == 4 * layout.bytes_per_block
    assert worker.bytes_stored >= worker.bytes_loaded
    for _ in range(10):
        if b.is_finished():
            break
        h.step()
    h.settle()
    h.check()
    after = h.side.scheduler.statistics()
    assert after.loaded_blocks == 4
    assert after.bytes_loaded == 4 * layout.bytes_per_block
    assert after.live_requests == 0
    assert h.side.pinned_gpu_block_ids() == []


def test_unknown_setting_is_rejected_by_name(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="num_cpu_blokcs"):
        make(model_dir, num_cpu_blokcs=4)


def test_two_kv_cache_groups_are_refused(model_dir: Path) -> None:
    config = vllm_config(model_dir, {"num_cpu_blocks": 8}, num_gpu_blocks=16)
    with pytest.raises(ConfigError, match="group 1"):
        Harness(config, kv_cache_config(16, groups=2))
