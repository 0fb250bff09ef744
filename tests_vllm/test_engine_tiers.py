"""End to end: kvoffload's connector in the vLLM CPU engine with ``tiers`` below its CPU
pool. Two engines one after the other (the second a fresh engine): the second serves
its first turn's prompt from the tier with the tokens of an engine without connector; a
value corrupted in place in the tier is never served; a paused Redis server turns into a
miss, not a stalled request.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from disk_files import corrupt_every_slot
from engine_runs import ENGINE_BLOCK_SIZE, connector_of, engine, kvoffload_config
from engine_runs import worker_connector_of as worker_of
from redis_server import RedisServer, require_redis_client
from test_engine_secondary_tier import (
    DISK_BYTES,
    PROMPT_TOKENS,
    Turn,
    baseline,
    generate,
)
from vllm import LLM

from kvoffload.integrations.vllm.group_tiers import GroupedSchedulerTiers
from kvoffload.integrations.vllm.tiers import WorkerTiers

pytestmark = pytest.mark.engine

__all__ = ["baseline"]  # the fixture, shared with test_engine_secondary_tier

OP_TIMEOUT_S = 2.0  # the Redis tier's budget of one operation (a loaded 2-core machine
# running the engine has taken more than 0.5 s for the first write)
FULL_BLOCKS = PROMPT_TOKENS // ENGINE_BLOCK_SIZE


def config(tiers: list[dict[str, Any]]) -> dict[str, Any]:
    return kvoffload_config({"num_cpu_blocks": 64, "tiers": tiers})


def disk_tier(path: Path) -> dict[str, Any]:
    return {"kind": "disk", "path": str(path), "capacity_bytes": DISK_BYTES, "persist": True}


def redis_tier(url: str) -> dict[str, Any]:
    return {"kind": "redis", "url": url, "op_timeout_s": OP_TIMEOUT_S,
            "max_batch_blocks": 256, "retry_initial_s": 30}  # fmt: skip


def sides(llm: LLM) -> tuple[GroupedSchedulerTiers, WorkerTiers]:
    sched = connector_of(llm).scheduler_side.tiers
    (worker,) = worker_of(llm).worker_side.tiers.parts.values()
    assert isinstance(sched, GroupedSchedulerTiers)
    assert isinstance(worker, WorkerTiers)
    return sched, worker


def first_engine(model_dir: Path, tiers: list[dict[str, Any]]) -> Turn:
    """An engine computes the prompt and writes it down (drained on shutdown)."""
    with engine(model_dir, config(tiers), disable_log_stats=False) as llm:
        turn = generate(llm)
        _, worker = sides(llm)
        assert worker.writes_submitted >= FULL_BLOCKS
    assert turn.external == 0
    return turn


def second_engine(model_dir: Path, tiers: list[dict[str, Any]]) -> tuple[Turn, Any, Any]:
    """A fresh engine runs the same prompt first; its tier statistics after."""
    with engine(model_dir, config(tiers), disable_log_stats=False) as llm:
        turn = generate(llm)
        sched, worker = sides(llm)
        return turn, sched.statistics(), worker.statistics()


def test_a_fresh_engine_serves_its_first_prompt_from_the_redis_tier(
    model_dir: Path, baseline: Turn
) -> None:
    require_redis_client()
    with RedisServer() as server:
        tiers = [redis_tier(server.url)]
        first = first_engine(model_dir, tiers)
        second, stats, (tier,) = second_engine(model_dir, tiers)

    assert first.tokens == baseline.tokens
    assert second.tokens == baseline.tokens
    assert second.local_hit == 0
    assert second.external >= PROMPT_TOKENS / 2
    assert second.external == FULL_BLOCKS * ENGINE_BLOCK_SIZE
    assert stats.blocks_promoted == FULL_BLOCKS
    assert stats.blocks_failed == 0
    assert tier.blocks_read == FULL_BLOCKS
    assert tier.failed_checks == 0
    print(
        f"\nsecond engine: {second.external:.0f}/{PROMPT_TOKENS} prompt tokens from Redis in "
        f"{second.seconds * 1e3:.0f} ms (first engine computed it in {first.seconds * 1e3:.0f} ms)"
    )


def test_a_restarted_engine_serves_from_the_persistent_disk_tier_and_never_a_corrupt_block(
    model_dir: Path, tmp_path: Path, baseline: Turn
) -> None:
    path = tmp_path / "kv.bin"
    tiers = [disk_tier(path)]
    first = first_engine(model_dir, tiers)
    second, stats, (tier,) = second_engine(model_dir, tiers)
    block_nbytes = tier.bytes_read // max(tier.blocks_read, 1)
    assert corrupt_every_slot(path, DISK_BYTES, block_nbytes, offset=1000) >= FULL_BLOCKS
    third, bad_stats, (bad_tier,) = second_engine(model_dir, tiers)

    assert first.tokens == baseline.tokens
    # A fresh engine on the file the first one left: the prompt's full blocks come back.
    assert second.tokens == baseline.tokens
    assert second.external >= PROMPT_TOKENS / 2
    assert second.external == FULL_BLOCKS * ENGINE_BLOCK_SIZE
    assert stats.blocks_promoted == FULL_BLOCKS
    # Every slot corrupted in place: nothing is served, the checks fail, same tokens.
    assert third.external == 0
    assert third.tokens == baseline.tokens
    assert bad_stats.blocks_promoted == 0
    assert bad_stats.blocks_failed >= 1
    assert bad_tier.failed_checks >= 1
    print(
        f"\nrestart on disk: {second.external:.0f}/{PROMPT_TOKENS} prompt tokens from the file "
        f"in {second.seconds * 1e3:.0f} ms; corrupted: {third.external:.0f} served, "
        f"{bad_tier.failed_checks} failed checks"
    )


def test_a_paused_redis_server_is_a_miss_not_a_stalled_request(
    model_dir: Path, baseline: Turn
) -> None:
    require_redis_client()
    with RedisServer() as server:
        tiers = [redis_tier(server.url)]
        first_engine(model_dir, tiers)
        with engine(model_dir, config(tiers), disable_log_stats=False) as llm:
            sched, worker = sides(llm)
            server.pause()
            try:
                start = time.perf_counter()
                paused = generate(llm)
                seconds = time.perf_counter() - start
                stats = sched.statistics()
                (tier,) = worker.statistics()
                lookups = connector_of(llm).scheduler_side.statistics().scheduler
            finally:
                server.resume()

    # The probe timed out within op_timeout_s, the tier went unhealthy, the lookup
    # answered the (empty) CPU hit: vLLM computed the prompt, with the baseline's tokens.
    assert paused.external == 0
    assert paused.tokens == baseline.tokens
    assert stats.blocks_promoted == 0
    assert not tier.healthy
    assert "TimeoutError" in tier.last_error, tier.last_error
    assert stats.deferred_lookups >= 1  # asked again while the probe was out
    assert lookups.hit_tokens == 0
    print(
        f"\nRedis paused: {paused.external:.0f} prompt tokens from the tier, generate "
        f"{seconds * 1e3:.0f} ms (lookup budget {sched.defer_deadline_s:.1f} s)"
    )
