"""Hybrid and MLA models on a real vLLM engine on CPU, without and with kvoffload.

Without a connector, each tiny model of ``models.py`` starts with prefix caching on and
vLLM's hybrid KV cache manager on, gets the KV cache groups recorded in `EXPECTED_GROUPS`
(kinds, and the block size vLLM chose for this machine, checked through kvoffload's
neutral `describe_groups`), and serves a two-turn conversation deterministically: greedy,
turn 2's answer with vLLM's prefix hit on turn 1 is the same as with turn 2 recomputed from
scratch.

With kvoffload's connector and the hybrid manager turned off
(``disable_hybrid_kv_cache_manager``), windowed models run as one full-attention group
and a recurrent hybrid is refused at start-up (`test_with_the_hybrid_manager_off`); with
it on, ``test_hybrid_offload.py`` offloads every group.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runs import kvoffload_config
from models import CASES, ModelCase, engine_kwargs, kv_cache_config_of, started, write_model
from vllm import LLM, SamplingParams

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm.groups import describe_groups

pytestmark = pytest.mark.engine

# What vLLM 0.32 (CPU) builds for each model, hybrid manager on: (kind, block size) per
# group. Qwen3-Next's block size is raised from 32 to 288 so that one attention page
# (288 tokens x 64 x bfloat16) covers a gated delta net state (35072 bytes, padded).
EXPECTED_GROUPS: dict[str, list[tuple[str, int]]] = {
    "gemma3": [("sliding_window", 32)] * 3 + [("full", 32)],
    "gpt_oss": [("sliding_window", 32), ("full", 32)],
    "llama4": [("chunked", 32)] * 3 + [("full", 32)],
    "qwen3_next": [("recurrent", 288)] * 3 + [("full", 288)],
    "deepseek_v3": [("full", 32)],
}

TURN_1 = [(i * 7) % 500 + 2 for i in range(400)]
TURN_2_USER = [(i * 11) % 500 + 2 for i in range(100)]


def _amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def _generate(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float], int]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    completion = out.outputs[0]
    logprobs = [
        step[token].logprob
        for step, token in zip(completion.logprobs or [], completion.token_ids, strict=True)
    ]
    return list(completion.token_ids), logprobs, out.num_cached_tokens or 0


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-models")


def _model(models_dir: Path, case: ModelCase) -> Path:
    return write_model(models_dir / case.name, case)


@pytest.mark.parametrize("name", list(EXPECTED_GROUPS))
def test_serves_a_two_turn_conversation_deterministically(models_dir: Path, name: str) -> None:
    case = CASES[name]
    with started(**engine_kwargs(_model(models_dir, case), case)) as llm:
        vllm_config = llm.llm_engine.vllm_config
        groups = describe_groups(kv_cache_config_of(llm))
        answer_1, _, _ = _generate(llm, TURN_1)
        turn_2 = TURN_1 + answer_1 + TURN_2_USER
        answer_2, logprobs_2, cached_2 = _generate(llm, turn_2)
        assert llm.reset_prefix_cache()
        recomputed, recomputed_logprobs, cached_again = _generate(llm, turn_2)
    for group in groups:
        print(
            f"{name} {group.name}: {group.kind} {group.spec} block_size={group.block_size} "
            f"page_bytes={group.page_bytes} dtype={group.dtype} layers={group.layer_names}"
        )
    assert not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    # The kinds are the model's; the block size is the one vLLM's CPU platform chose for
    # this machine (it depends on the CPU: MLA pages and the size raised to cover a
    # recurrent state differ with the kernels available), the same in every group.
    chosen = vllm_config.cache_config.block_size
    assert [(g.kind, g.block_size) for g in groups] == [
        (kind, chosen) for kind, _ in EXPECTED_GROUPS[name]
    ]
    mla_without_amx = name == "deepseek_v3" and not _amx()
    # vLLM's CPU platform turns prefix caching off for MLA unless its AMX kernels run.
    assert vllm_config.cache_config.enable_prefix_caching is not mla_without_amx
    if not mla_without_amx:
        assert cached_2 > 0  # vLLM's own prefix cache served part of turn 1
    assert cached_again == 0
    assert answer_2 == recomputed
    assert all(
        math.isclose(a, b, rel_tol=0.05, abs_tol=0.05)
        for a, b in zip(logprobs_2, recomputed_logprobs, strict=True)
    ), (logprobs_2, recomputed_logprobs)


# -- with kvoffload's connector and the hybrid manager turned off ---------------------------
# (with it on, test_hybrid_offload.py offloads every group)

HMA_OFF: dict[str, Any] = {"disable_hybrid_kv_cache_manager": True}
CONNECTOR: dict[str, Any] = {"kv_transfer_config": kvoffload_config({"num_cpu_blocks": 64})}


@pytest.mark.parametrize(
    ("name", "window"), [("gemma3", (64, None)), ("llama4", (None, 64))], ids=["gemma3", "llama4"]
)
def test_with_the_hybrid_manager_off_windowed_models_run_as_one_full_group(
    models_dir: Path, name: str, window: tuple[int | None, int | None]
) -> None:
    case = CASES[name]
    model = _model(models_dir, case)
    answers = []
    for extra in ({}, CONNECTOR):
        with started(**engine_kwargs(model, case, **HMA_OFF, **extra)) as llm:
            groups = describe_groups(kv_cache_config_of(llm))
            answer_1, _, _ = _generate(llm, TURN_1)
            answer_2, _, _ = _generate(llm, TURN_1 + answer_1 + TURN_2_USER)
            answers.append((answer_1, answer_2))
    # Windowed layers are promoted to full attention: one group, every block kept.
    assert [
        (g.kind, g.sliding_window, g.attention_chunk_size, len(g.layer_names)) for g in groups
    ] == [("full", *window, 4)]
    assert answers[0] == answers[1]


def test_with_the_hybrid_manager_off_a_recurrent_hybrid_is_refused_at_start_up(
    models_dir: Path,
) -> None:
    case = CASES["qwen3_next"]
    kwargs = engine_kwargs(_model(models_dir, case), case, **HMA_OFF, **CONNECTOR)
    with (
        pytest.raises(ConfigError, match=r"cannot offload Qwen3NextForCausalLM with vLLM's hybrid"),
        started(**kwargs),
    ):
        pass
