"""Multi-turn conversations on a real vLLM engine on CPU, with and without kvoffload.

Used by the end-to-end tests and, as a script, to measure prefill time:

    .venv-vllm/bin/python tests_vllm/engine_runs.py

prints, per configuration, the median time of the turns after the first round (one answer
token, so a turn's time is its prefill), whose history the engine's own deliberately small
KV cache had evicted, and the ratio against no offload measured in the same run.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm import LLM, SamplingParams

ENGINE_BLOCK_SIZE = 32  # vLLM's CPU attention backend wants multiples of 32
GPU_BLOCKS = 20  # 640 tokens: too few to keep three conversations' earlier turns


@dataclass
class RunResult:
    """What one configuration produced."""

    tokens: list[list[int]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stats: Any = None
    worker_bytes_loaded: int = 0
    worker_bytes_stored: int = 0


def conversation_turns(
    num_conversations: int = 3, num_turns: int = 3, turn_tokens: int = 150, seed: int = 0
) -> list[tuple[int, list[int]]]:
    """``(conversation, new user tokens)`` in the order they are sent: round-robin, so
    each conversation's context was pushed out of the small engine cache by the others."""
    order = []
    for turn in range(num_turns):
        for conv in range(num_conversations):
            user = [
                (seed * 41 + conv * 97 + turn * 13 + i * 7) % 500 + 2 for i in range(turn_tokens)
            ]
            order.append((conv, user))
    return order


def new_llm(
    model_dir: Path,
    kv_transfer_config: dict[str, Any] | None,
    gpu_blocks: int = GPU_BLOCKS,
    **overrides: Any,
) -> LLM:
    """A tiny Llama with random weights, a small KV cache, eager mode, token-id prompts
    (``overrides``: further `vllm.LLM` arguments)."""
    kwargs: dict[str, Any] = dict(overrides)
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return LLM(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=ENGINE_BLOCK_SIZE,
        num_gpu_blocks_override=gpu_blocks,
        max_model_len=(gpu_blocks - 1) * ENGINE_BLOCK_SIZE,  # one block is vLLM's null block
        max_num_seqs=4,
        max_num_batched_tokens=gpu_blocks * ENGINE_BLOCK_SIZE,
        enable_prefix_caching=True,
        dtype="float32",
        seed=0,
        **kwargs,
    )


def connector_of(llm: LLM) -> Any:
    """The scheduler-side connector of an in-process engine (``None`` without one)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector


def worker_connector_of(llm: LLM) -> Any:
    """The worker-side connector of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

    return get_kv_transfer_group()


def run_conversations(
    llm: LLM, *, answer_tokens: int = 8, seed: int = 0, turn_tokens: int = 150
) -> RunResult:
    """Play the conversations turn by turn; each turn's prompt is the conversation so far."""
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    history: dict[int, list[int]] = {}
    result = RunResult()
    for conv, user in conversation_turns(seed=seed, turn_tokens=turn_tokens):
        prompt = history.get(conv, []) + user
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        result.seconds.append(time.perf_counter() - start)
        answer = list(out.outputs[0].token_ids)
        result.tokens.append(answer)
        result.cached.append(out.num_cached_tokens or 0)
        history[conv] = prompt + answer
    connector = connector_of(llm)
    if connector is not None:
        result.stats = connector.scheduler_side.statistics().scheduler
        worker = worker_connector_of(llm).worker_side
        result.worker_bytes_loaded = worker.bytes_loaded[0]
        result.worker_bytes_stored = worker.bytes_stored[0]
    return result


@contextmanager
def engine(
    model_dir: Path,
    kv_transfer_config: dict[str, Any] | None,
    gpu_blocks: int = GPU_BLOCKS,
    **overrides: Any,
) -> Iterator[LLM]:
    """An engine that is shut down, with vLLM's process-wide state, on exit."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (  # noqa: PLC0415
        ensure_kv_transfer_shutdown,
    )
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: PLC0415

    llm = new_llm(model_dir, kv_transfer_config, gpu_blocks, **overrides)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
        gc.collect()


def kvoffload_config(
    extra: dict[str, Any], *, connector: str = "KVOffloadConnector", module: str | None = None
) -> dict[str, Any]:
    """A ``kv_transfer_config`` that enables kvoffload."""
    return {
        "kv_load_failure_policy": "recompute",
        "kv_connector": connector,
        "kv_connector_module_path": module or "kvoffload.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def load_workload() -> ModuleType:
    """``scripts/vllm_workload.py``, the workload of ``scripts/vllm_cpu_serve.sh`` (and its
    parser of vLLM's prompt-token counters)."""
    name = "kvoffload_vllm_workload"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "scripts" / "vllm_workload.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _bench(model_dir: Path, rounds: int = 2, turn_tokens: int = 500, gpu_blocks: int = 64) -> None:
    later = len(conversation_turns()) // 3  # the first round has no history to reuse
    rows = []
    configs: list[tuple[str, dict[str, Any] | None]] = [
        ("no offload", None),
        ("kvoffload eager", kvoffload_config({"num_cpu_blocks": 256})),
    ]
    for name, config in configs:
        seconds: list[float] = []
        cached = 0
        with engine(model_dir, config, gpu_blocks) as llm:
            # Warm-up (code paths, allocator), then rounds of fresh conversations. One answer
            # token: a turn's time is its prefill.
            run_conversations(llm, answer_tokens=1, seed=1, turn_tokens=turn_tokens)
            for seed in range(2, 2 + rounds):
                result = run_conversations(llm, answer_tokens=1, seed=seed, turn_tokens=turn_tokens)
                seconds += result.seconds[later:]
                cached += sum(result.cached[later:])
        rows.append((name, statistics.median(seconds), len(seconds), cached))
    base = rows[0][1]
    for name, median_s, count, cached in rows:
        print(
            f"{name:16s} median prefill of a later turn {median_s * 1e3:8.1f} ms "
            f"(n={count})  ratio {median_s / base:5.2f}  cached prompt tokens {cached}"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    import tempfile

    from harness import write_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        # Larger than the tests' model, so that prefill compute dominates a turn.
        model = write_tiny_llama(
            Path(tmp) / "small-llama",
            hidden_size=512,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=64,
            num_hidden_layers=8,
        )
        _bench(model)
