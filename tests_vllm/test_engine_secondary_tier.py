"""End to end: vLLM's own OffloadingConnector in the vLLM CPU engine, with kvoffload's disk
or Redis tier as the secondary tier of vLLM's tiering framework.

vLLM's tiering spec refuses a CPU engine (its copy worker needs device streams), so the
spec is `cpu_tiering_spec.CPUTieringOffloadingSpec`, loaded through vLLM's own
``spec_name`` / ``spec_module_path``: vLLM's spec with a CPU copy worker, nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cpu_tiering_spec
import prometheus_client
import pytest
from disk_files import corrupt_every_slot
from engine_runs import ENGINE_BLOCK_SIZE, connector_of, engine, load_workload
from redis_server import RedisServer, require_redis_client
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.engine

workload = load_workload()

PROMPT_TOKENS = 516
ANSWER_TOKENS = 4
CHUNK_BYTES = 32 * 1024  # the tiny Llama's KV of one 32-token block (2 layers, fp32)
DISK_BYTES = 4 << 20
PROMPT = [(i * 37 + 11) % 500 + 2 for i in range(PROMPT_TOKENS)]
OP_TIMEOUT_S = 2.0  # the Redis tier's budget of one operation (a loaded 2-core machine
# running the engine has taken more than 0.5 s for the first write)


def disk_tiers(disk: Path) -> list[dict[str, Any]]:
    return [{"kind": "disk", "path": str(disk), "capacity_bytes": DISK_BYTES}]


def tiering_config(tiers: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's OffloadingConnector: a CPU primary tier and kvoffload's ``tiers`` below it."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "CPUTieringOffloadingSpec",
            "spec_module_path": "cpu_tiering_spec",
            "cpu_bytes_to_use": 64 * CHUNK_BYTES,
            "secondary_tiers": [
                {
                    "type": "KVOffloadSecondaryTier",
                    "module_path": "kvoffload.integrations.vllm.secondary_tier",
                    "tiers": tiers,
                }
            ],
        },
    }


@dataclass
class Turn:
    tokens: list[int]
    seconds: float
    external: float  # vLLM's prompt_tokens_by_source{source="external_kv_transfer"}
    local_hit: float
    cached: int


def generate(llm: LLM) -> Turn:
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    before = workload.parse_counters(prometheus_client.generate_latest().decode())
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = workload.parse_counters(prometheus_client.generate_latest().decode())
    return Turn(
        tokens=list(out.outputs[0].token_ids),
        seconds=seconds,
        external=after.external_kv_transfer - before.external_kv_transfer,
        local_hit=after.local_cache_hit - before.local_cache_hit,
        cached=out.num_cached_tokens or 0,
    )


def reset_engine_and_primary_tier(llm: LLM) -> None:
    """Empty vLLM's own prefix cache and the connector's CPU primary tier (vLLM drains the
    secondary tier's jobs first); kvoffload's disk tier keeps its blocks."""
    assert llm.reset_prefix_cache(reset_connector=True)


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> Turn:
    """The prompt's turn in the engine without connector."""
    with engine(model_dir, None, disable_log_stats=False) as llm:
        turn = generate(llm)
    assert turn.external == 0
    return turn


def test_a_prompt_comes_back_from_kvoffloads_tier_and_corrupted_bytes_are_never_served(
    model_dir: Path, tmp_path: Path, baseline: Turn
) -> None:
    disk = tmp_path / "kv.bin"
    with engine(model_dir, tiering_config(disk_tiers(disk)), disable_log_stats=False) as llm:
        manager = connector_of(llm).connector_scheduler.manager
        (tier,) = manager.secondary_tiers
        loads_before = cpu_tiering_spec.copies["load_blocks"]
        first = generate(llm)
        reset_engine_and_primary_tier(llm)
        second = generate(llm)
        (stats,) = tier._bridge.statistics()
        blocks_read = stats.blocks_read

        reset_engine_and_primary_tier(llm)
        assert (
            corrupt_every_slot(disk, DISK_BYTES, tier._bridge.block_nbytes, offset=1000)
            >= blocks_read
        )
        third = generate(llm)
        (after,) = tier._bridge.statistics()
        engine_blocks_loaded = cpu_tiering_spec.copies["load_blocks"] - loads_before

    # Run 1 computed the whole prompt; its tokens are those of the engine without connector.
    assert first.tokens == baseline.tokens
    assert first.external == 0
    # Run 2: vLLM's own prefix cache and primary tier were empty, so the prompt's full
    # blocks came from kvoffload's disk tier through vLLM's primary tier.
    full_blocks = PROMPT_TOKENS // ENGINE_BLOCK_SIZE * ENGINE_BLOCK_SIZE
    assert second.local_hit == 0
    assert second.external >= 480
    assert second.external == full_blocks
    assert second.cached == full_blocks
    assert blocks_read == PROMPT_TOKENS // ENGINE_BLOCK_SIZE
    assert stats.failed_checks == 0
    assert second.tokens == baseline.tokens
    # Run 3: every stored block of the file is corrupted. None is served: vLLM recomputes
    # the prompt, the tier counts the failed checks, the tokens are still the baseline's.
    assert third.external == 0
    assert third.tokens == baseline.tokens
    assert after.failed_checks >= 1
    assert after.blocks_read == blocks_read
    # Only run 2's blocks were copied into vLLM's KV cache by the connector's worker.
    assert engine_blocks_loaded == PROMPT_TOKENS // ENGINE_BLOCK_SIZE
    print(
        f"\nfirst run {first.seconds * 1e3:.0f} ms; after the primary tier was reset "
        f"{second.external:.0f}/{PROMPT_TOKENS} prompt tokens from kvoffload's disk tier "
        f"({blocks_read} blocks) in {second.seconds * 1e3:.0f} ms; corrupted: "
        f"{third.external:.0f} served, {after.failed_checks} failed checks, "
        f"{third.seconds * 1e3:.0f} ms"
    )


def test_a_paused_redis_node_turns_into_misses_within_the_budget(
    model_dir: Path, baseline: Turn
) -> None:
    require_redis_client()
    with RedisServer() as server:
        tiers = [{"kind": "redis", "url": server.url, "op_timeout_s": OP_TIMEOUT_S,
                  "retry_initial_s": 30}]  # fmt: skip
        with engine(model_dir, tiering_config(tiers), disable_log_stats=False) as llm:
            manager = connector_of(llm).connector_scheduler.manager
            (tier,) = manager.secondary_tiers
            first = generate(llm)
            reset_engine_and_primary_tier(llm)  # drains the stores into Redis
            (stored,) = tier._bridge.statistics()
            server.pause()
            try:
                paused = generate(llm)
                (after,) = tier._bridge.statistics()
            finally:
                server.resume()

    assert first.tokens == baseline.tokens
    assert stored.healthy
    assert stored.blocks_written == PROMPT_TOKENS // ENGINE_BLOCK_SIZE
    assert stored.errors == 0
    # The paused server: vLLM asked the tier for the prompt's blocks (it stored them), the
    # read failed within the tier's op_timeout_s, the tier marked itself unhealthy and the
    # keys were reported not landed. vLLM recomputed the prompt: no token came from the
    # tier, and the tokens are the baseline's.
    assert paused.external == 0
    assert paused.local_hit == 0
    assert paused.tokens == baseline.tokens
    assert after.blocks_read == 0
    assert after.errors >= 1
    assert after.unhealthy_events == 1
    assert not after.healthy
    assert "TimeoutError" in after.last_error, after.last_error
    # Every read of the tier ends within its budget (a generous margin for a loaded
    # machine); the generate call is not held up by the paused server.
    waited = after.read_seconds - stored.read_seconds
    assert waited <= after.errors * OP_TIMEOUT_S + 5.0
    assert paused.seconds < 30.0
    print(
        f"\nRedis paused: {paused.external:.0f}/{PROMPT_TOKENS} prompt tokens from the tier, "
        f"{after.errors} tier errors, {waited * 1e3:.0f} ms in tier reads, generate "
        f"{paused.seconds * 1e3:.0f} ms (first run {first.seconds * 1e3:.0f} ms)"
    )
