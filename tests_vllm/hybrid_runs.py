"""Interleaved multi-turn conversations on the tiny hybrid models of ``models.py``, with
vLLM's hybrid KV cache manager on, without and with kvoffload's connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_runs import connector_of, conversation_turns, worker_connector_of
from models import ModelCase, engine_kwargs, kv_cache_config_of, started
from vllm import LLM, SamplingParams

from kvoffload.integrations.vllm.groups import GroupDescription, describe_groups
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide


@dataclass
class HybridRun:
    """What one engine produced over the conversations."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    groups: tuple[GroupDescription, ...] = ()
    hma_off: bool = True
    loaded_tokens: int = 0
    group_stats: dict[str, Any] = field(default_factory=dict)
    bytes_loaded: dict[int, int] = field(default_factory=dict)
    bytes_stored: dict[int, int] = field(default_factory=dict)


def converse(llm: LLM, *, turn_tokens: int, answer_tokens: int = 4) -> HybridRun:
    """Three conversations of three turns, round-robin; greedy, with log-probabilities."""
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True, logprobs=0)
    history: dict[int, list[int]] = {}
    run = HybridRun()
    for conv, user in conversation_turns(turn_tokens=turn_tokens):
        prompt = history.get(conv, []) + user
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        completion = out.outputs[0]
        answer = list(completion.token_ids)
        run.tokens.append(answer)
        run.logprobs.append(
            [
                step[token].logprob
                for step, token in zip(completion.logprobs or [], answer, strict=True)
            ]
        )
        run.cached.append(out.num_cached_tokens or 0)
        history[conv] = prompt + answer
    return run


def run_case(
    model_dir: Path,
    case: ModelCase,
    *,
    gpu_blocks: int,
    turn_tokens: int,
    kv_transfer_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> HybridRun:
    """Start ``case`` (hybrid manager on), play the conversations, shut it down."""
    extra: dict[str, Any] = dict(overrides)
    if kv_transfer_config is not None:
        extra["kv_transfer_config"] = kv_transfer_config
    kwargs = engine_kwargs(model_dir, case, gpu_blocks=gpu_blocks, **extra)
    with started(**kwargs) as llm:
        run = converse(llm, turn_tokens=turn_tokens)
        run.groups = describe_groups(kv_cache_config_of(llm))
        scheduler_config = llm.llm_engine.vllm_config.scheduler_config
        run.hma_off = bool(scheduler_config.disable_hybrid_kv_cache_manager)
        connector = connector_of(llm)
        if connector is not None:
            side = connector.scheduler_side
            worker = worker_connector_of(llm).worker_side
            assert isinstance(side, SchedulerSide)
            run.bytes_loaded = dict(worker.bytes_loaded)
            run.bytes_stored = dict(worker.bytes_stored)
            if len(side.groups) > 1:
                run.group_stats = side.scheduler.statistics()
                run.loaded_tokens = side.loaded_tokens
            else:  # one full-attention group
                own = side.statistics().scheduler  # the whole model's counters
                assert own is not None
                run.group_stats = {"g0": own}
                run.loaded_tokens = own.loaded_tokens
    return run
