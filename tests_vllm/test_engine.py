"""End to end: a real vLLM engine on CPU (tiny Llama, random weights) with kvoffload."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import faulty_connector
import prometheus_client
import pytest
from engine_runs import (
    ENGINE_BLOCK_SIZE,
    RunResult,
    connector_of,
    conversation_turns,
    engine,
    kvoffload_config,
    load_workload,
    run_conversations,
)
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.engine

FIRST_ROUND = len(conversation_turns()) // 3


workload = load_workload()


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> Iterator[RunResult]:
    """The conversations without any connector."""
    with engine(model_dir, None) as llm:
        yield run_conversations(llm)


def test_eager_offload_gives_identical_tokens_and_serves_evicted_prefixes(
    model_dir: Path, baseline: RunResult
) -> None:
    with engine(model_dir, kvoffload_config({"num_cpu_blocks": 128})) as llm:
        result = run_conversations(llm)
    assert result.tokens == baseline.tokens
    # Later turns: the engine's own cache lost the history, kvoffload served it.
    later_cached = sum(result.cached[FIRST_ROUND:])
    assert later_cached > sum(baseline.cached[FIRST_ROUND:])
    stats = result.stats
    assert stats.loaded_blocks > 0
    assert stats.failed_loads == 0
    assert result.worker_bytes_loaded == stats.bytes_loaded
    assert result.worker_bytes_loaded > 0


def test_lazy_mode_gives_identical_tokens(model_dir: Path, baseline: RunResult) -> None:
    config = kvoffload_config(
        {"num_cpu_blocks": 128, "store_mode": "lazy", "lazy_offload_blocks": 16}
    )
    with engine(model_dir, config) as llm:
        result = run_conversations(llm)
    assert result.tokens == baseline.tokens
    assert result.stats.stored_blocks > 0
    assert result.stats.loaded_blocks > 0
    assert sum(result.cached[FIRST_ROUND:]) > sum(baseline.cached[FIRST_ROUND:])


def test_pool_small_enough_to_defer_gives_identical_tokens(
    model_dir: Path, baseline: RunResult
) -> None:
    with engine(model_dir, kvoffload_config({"num_cpu_blocks": 4})) as llm:
        result = run_conversations(llm)
    assert result.tokens == baseline.tokens
    assert result.stats.deferred_blocks > 0
    assert result.stats.stored_blocks > 0


def test_injected_copy_failures_give_identical_tokens(model_dir: Path, baseline: RunResult) -> None:
    config = kvoffload_config(
        {"num_cpu_blocks": 128},
        connector="FaultyKVOffloadConnector",
        module="faulty_connector",
    )
    with engine(model_dir, config) as llm:
        result = run_conversations(llm)
    assert result.tokens == baseline.tokens
    stats = result.stats
    assert faulty_connector.failures["store"] > 0
    assert faulty_connector.failures["load"] > 0  # vLLM recomputed those blocks
    assert stats.failed_stores == faulty_connector.failures["store"]
    assert stats.failed_loads == faulty_connector.failures["load"]
    assert stats.loaded_blocks > 0


class InProcessServer:
    """What ``scripts/vllm_workload.py`` asks of a vLLM server, from an in-process engine:
    its Prometheus metrics (the registry vLLM's ``/metrics`` serves) and completions."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def metrics(self) -> str:
        return prometheus_client.generate_latest().decode()

    def complete(self, prompt: Sequence[int], max_tokens: int) -> int:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)
        return len(prompt)


def test_vllms_metrics_count_the_prompt_tokens_kvoffload_served(model_dir: Path) -> None:
    """The recipe's workload (scripts/vllm_cpu_serve.sh) with 32-token blocks: 8 prompts of
    5 full blocks outgrow vLLM's 16 blocks, and the 3 sent again are served by kvoffload,
    as vLLM's own counters say."""
    prompt_tokens = 5 * ENGINE_BLOCK_SIZE + 10
    config = kvoffload_config({"num_cpu_blocks": 64})
    with engine(model_dir, config, 16, disable_log_stats=False) as llm:
        server = InProcessServer(llm)
        before = workload.parse_counters(server.metrics())
        status = workload.run(
            server, prompts=8, prompt_tokens=prompt_tokens, repeat=3, max_tokens=4
        )
        served = workload.parse_counters(server.metrics()) - before
        stats = connector_of(llm).scheduler_side.statistics().scheduler
    assert status == 0
    assert served.prompt_tokens == 11 * prompt_tokens
    assert served.external_kv_transfer == 3 * 5 * ENGINE_BLOCK_SIZE
    assert served.external_kv_transfer == stats.loaded_tokens
    assert served.external_hits == served.external_kv_transfer
    assert served.local_cache_hit == 0
