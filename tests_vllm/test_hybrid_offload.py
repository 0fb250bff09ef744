"""End to end: hybrid models on a real vLLM engine on CPU, hybrid KV cache manager on,
with kvoffload's connector driving every KV cache group.

Each tiny model of ``models.py`` plays three interleaved conversations of three turns
with a KV cache too small to keep their history (``GPU_BLOCKS``), once without a
connector and once with kvoffload. The tokens and log-probabilities must be the same,
and kvoffload must serve prompt tokens that vLLM's own cache no longer holds, loading
blocks of every group. A negative control corrupts one group's loaded block and shows
that the output then diverges, so the comparison would catch a wrong group's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faulty_connector
import pytest
from engine_runs import kvoffload_config
from hybrid_runs import HybridRun, run_case
from models import CASES, write_model

pytestmark = pytest.mark.engine

# Blocks of vLLM's KV cache (shared by every group): enough for one conversation's
# longest turn, too few for the three conversations' history.
GPU_BLOCKS = {"gemma3": 48, "gpt_oss": 32, "llama4": 48, "qwen3_next": 16}
TURN_TOKENS = {"gemma3": 150, "gpt_oss": 150, "llama4": 150, "qwen3_next": 200}
# A prefill chunk reserves its blocks in every window group at once: small chunks keep
# one turn within the small cache. Qwen3-Next's blocks are 288 tokens (see models.py).
OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3": {"max_model_len": 640, "max_num_batched_tokens": 128},
    "gpt_oss": {"max_model_len": 640, "max_num_batched_tokens": 128},
    "llama4": {"max_model_len": 640, "max_num_batched_tokens": 128},
    "qwen3_next": {"max_model_len": 1024, "max_num_batched_tokens": 576},
}
KINDS = {
    "gemma3": ["sliding_window"] * 3 + ["full"],
    "gpt_oss": ["sliding_window", "full"],
    "llama4": ["chunked"] * 3 + ["full"],
    "qwen3_next": ["recurrent"] * 3 + ["full"],
}
OFFLOAD = {"num_cpu_blocks": 64}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-offload")


def _run(models_dir: Path, name: str, config: dict[str, Any] | None = None) -> HybridRun:
    case = CASES[name]
    return run_case(
        write_model(models_dir / name, case),
        case,
        gpu_blocks=GPU_BLOCKS[name],
        turn_tokens=TURN_TOKENS[name],
        kv_transfer_config=config,
        **OVERRIDES[name],
    )


_baselines: dict[str, HybridRun] = {}


@pytest.fixture(scope="module")
def baseline(models_dir: Path) -> Iterator[Any]:
    """The conversations without a connector, per model (run once, on first use)."""

    def get(name: str) -> HybridRun:
        if name not in _baselines:
            _baselines[name] = _run(models_dir, name)
        return _baselines[name]

    yield get
    _baselines.clear()


def _same_logprobs(a: HybridRun, b: HybridRun) -> bool:
    return all(
        len(x) == len(y)
        and all(math.isclose(p, q, rel_tol=0, abs_tol=1e-4) for p, q in zip(x, y, strict=False))
        for x, y in zip(a.logprobs, b.logprobs, strict=True)
    )


@pytest.mark.parametrize("name", list(GPU_BLOCKS))
def test_offload_of_every_group_gives_identical_tokens_and_logprobs(
    models_dir: Path, baseline: Any, name: str
) -> None:
    base: HybridRun = baseline(name)
    run = _run(models_dir, name, kvoffload_config(OFFLOAD))
    print(f"{name}: cached without {base.cached}, with kvoffload {run.cached}")
    print(f"{name}: loaded tokens {run.loaded_tokens}, bytes per group {run.bytes_loaded}")
    assert not run.hma_off  # the connector declares HMA support: vLLM keeps its groups
    assert [g.kind for g in run.groups] == KINDS[name]
    assert run.tokens == base.tokens
    assert _same_logprobs(run, base), (run.logprobs, base.logprobs)
    # kvoffload served prompt tokens vLLM's own cache had lost, in every group.
    assert run.loaded_tokens >= 3 * run.groups[-1].block_size
    assert sum(run.cached) >= sum(base.cached) + run.loaded_tokens // 2
    assert sum(run.cached) > sum(base.cached)
    for index, group in enumerate(run.groups):
        stats = run.group_stats[f"g{index}"]
        assert stats.stored_blocks > 0, group.name
        assert stats.loaded_blocks > 0, group.name
        assert run.bytes_loaded[index] == stats.loaded_blocks * group.bytes_per_block
    windowed = [i for i, g in enumerate(run.groups) if g.kind in ("sliding_window", "chunked")]
    full = len(run.groups) - 1
    for index in windowed:  # only the window's blocks are loaded
        assert (
            run.group_stats[f"g{index}"].loaded_blocks < run.group_stats[f"g{full}"].loaded_blocks
        )


@pytest.mark.parametrize(("name", "group"), [("gemma3", 1), ("qwen3_next", 0)])
def test_a_corrupted_block_of_one_group_changes_the_output(
    models_dir: Path, baseline: Any, name: str, group: int
) -> None:
    base: HybridRun = baseline(name)
    faulty_connector.corrupt.update(group=group, loads=0)
    try:
        config = kvoffload_config(
            OFFLOAD, connector="CorruptingKVOffloadConnector", module="faulty_connector"
        )
        run = _run(models_dir, name, config)
    finally:
        corrupted = faulty_connector.corrupt["loads"]
        faulty_connector.corrupt.update(group=None, loads=0)
    assert corrupted > 0
    assert run.loaded_tokens > 0
    assert run.tokens != base.tokens or not _same_logprobs(run, base)


def test_mla_latent_pages_are_offloaded_with_identical_tokens(
    models_dir: Path, baseline: Any
) -> None:
    # vLLM's CPU platform keeps prefix caching on for MLA only where its AMX kernels run;
    # with it off (as elsewhere), every later turn's history comes from kvoffload.
    off = {"enable_prefix_caching": False}
    case = CASES["deepseek_v3"]
    model = write_model(models_dir / "deepseek_v3", case)
    kwargs: dict[str, Any] = {"max_model_len": 640, "max_num_batched_tokens": 128, **off}
    # 48 blocks hold the 640-token context at the smallest MLA block size vLLM's CPU
    # platform picks (16 tokens where its AMX kernels do not run, 32 where they do)
    base = run_case(model, case, gpu_blocks=48, turn_tokens=150, **kwargs)
    run = run_case(
        model,
        case,
        gpu_blocks=48,
        turn_tokens=150,
        kv_transfer_config=kvoffload_config(OFFLOAD),
        **kwargs,
    )
    (group,) = run.groups
    # one 576-element bfloat16 latent per token, at the block size vLLM chose on this CPU
    latent_page = group.block_size * 576 * 2
    assert (group.kind, group.page_format, group.page_bytes) == ("full", "mla", (latent_page,) * 2)
    assert sum(base.cached) == 0
    assert run.tokens == base.tokens
    assert _same_logprobs(run, base)
    assert run.loaded_tokens > 0
    assert sum(run.cached) == run.loaded_tokens
    stats = run.group_stats["g0"]
    assert run.bytes_loaded[0] == stats.bytes_loaded == stats.loaded_blocks * group.bytes_per_block


def test_pools_small_enough_to_defer_every_group_give_identical_tokens(
    models_dir: Path, baseline: Any
) -> None:
    base: HybridRun = baseline("gemma3")
    run = _run(models_dir, "gemma3", kvoffload_config({"num_cpu_blocks": 4}))
    assert run.tokens == base.tokens
    assert _same_logprobs(run, base)
    for index in range(4):  # every group's pool ran full: its stores were deferred
        stats = run.group_stats[f"g{index}"]
        assert stats.deferred_blocks > 0
        assert stats.stored_blocks > 0
