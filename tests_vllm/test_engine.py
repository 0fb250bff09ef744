"""End to end: a real vLLM engine on CPU (tiny Llama, random weights) with kvoffload."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import faulty_connector
import pytest
from engine_runs import RunResult, conversation_turns, engine, kvoffload_config, run_conversations

pytestmark = pytest.mark.engine

FIRST_ROUND = len(conversation_turns()) // 3


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
