"""Tiny random-weight configurations of hybrid and MLA model families, for vLLM on CPU.

Each `ModelCase` is a ``config.json`` (no weights, no tokenizer: engines load them with
``load_format="dummy"`` and take token-id prompts) small enough that an engine starts in
well under a minute on a 2-core machine: 2 to 4 layers, hidden size 64 to 128, a vocabulary of
512 tokens. The layer patterns keep what makes each family's KV cache special:

- ``gemma3``: three sliding-window layers (window 64) and one full-attention layer;
- ``gpt_oss``: sliding-window (window 64) and full-attention layers alternating, with
  attention sinks and a mixture of experts;
- ``llama4``: Llama 4 text, three chunked local attention layers (chunk 64) and one
  full-attention (NoPE) layer;
- ``qwen3_next``: three gated delta net (linear attention, a recurrent state) layers and
  one full-attention layer;
- ``deepseek_v3``: DeepSeek V3 with MLA (a latent of ``kv_lora_rank + qk_rope_head_dim``
  per token).

`write_model` saves one as a model directory; `engine_kwargs` are the `vllm.LLM`
arguments the tests use with it.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.v1.kv_cache_interface import KVCacheConfig

VOCAB = 512
EOS = 1
ENGINE_BLOCK_SIZE = 32
WINDOW = 64  # sliding window and attention chunk, in tokens: two engine blocks

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": EOS,
    "pad_token_id": 0,
}


@dataclass(frozen=True)
class ModelCase:
    """One tiny model family.

    Attributes:
        name: short name (test ids, directory names).
        config: the ``config.json`` contents.
        kwargs: `vllm.LLM` arguments that differ from `engine_kwargs`' defaults.
    """

    name: str
    config: dict[str, Any]
    kwargs: dict[str, Any] = field(default_factory=dict)


GEMMA3 = ModelCase(
    "gemma3",
    {
        **_COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "sliding_window": WINDOW,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
)

GPT_OSS = ModelCase(
    "gpt_oss",
    {
        **_COMMON,
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        # vLLM's gpt-oss reads the YaRN parameters of the released models.
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
        },
    },
)

LLAMA4 = ModelCase(
    "llama4",
    {
        **_COMMON,
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "hidden_size": 64,
        "intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "attention_chunk_size": WINDOW,
        "no_rope_layers": [1, 1, 1, 0],
        "layer_types": [
            "chunked_attention",
            "chunked_attention",
            "chunked_attention",
            "full_attention",
        ],
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    },
)

QWEN3_NEXT = ModelCase(
    "qwen3_next",
    {
        **_COMMON,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        # vLLM's CPU gated delta rule kernel takes head dimensions of 64 or more.
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    },
    # vLLM's CPU gated delta net kernels need bfloat16 ("CPU GDN attention requires BF16").
    kwargs={"dtype": "bfloat16"},
)

DEEPSEEK_V3 = ModelCase(
    "deepseek_v3",
    {
        **_COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 128,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        # The latent is kv_lora_rank + qk_rope_head_dim = 576 wide, the only width
        # vLLM's MLA kernels take (as DeepSeek V2/V3/R1).
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # vLLM's CPU MLA kernels (AMX) take bfloat16 weights only.
    kwargs={"dtype": "bfloat16"},
)

CASES: dict[str, ModelCase] = {
    case.name: case for case in (GEMMA3, GPT_OSS, LLAMA4, QWEN3_NEXT, DEEPSEEK_V3)
}


def write_model(directory: Path, case: ModelCase, **overrides: Any) -> Path:
    """A model directory holding only ``case``'s ``config.json`` (random weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**case.config, **overrides}))
    return directory


def engine_kwargs(
    model_dir: Path, case: ModelCase, *, gpu_blocks: int = 256, **overrides: Any
) -> dict[str, Any]:
    """`vllm.LLM` arguments: eager, float32, prefix caching on, a small KV cache."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": ENGINE_BLOCK_SIZE,
        "num_gpu_blocks_override": gpu_blocks,
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 1024,
        "enable_prefix_caching": True,
        "dtype": "float32",
        "seed": 0,
    }
    kwargs.update(case.kwargs)
    kwargs.update(overrides)
    return kwargs


@contextmanager
def started(**kwargs: Any) -> Iterator[LLM]:
    """A `vllm.LLM` built from ``kwargs``, shut down with vLLM's process-wide state on
    exit (also when it fails to start, so the next engine in the process starts clean)."""
    from vllm import LLM  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_transfer_state import (  # noqa: PLC0415
        ensure_kv_transfer_shutdown,
    )
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: PLC0415

    llm = None
    try:
        llm = LLM(**kwargs)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
        gc.collect()


def kv_cache_config_of(llm: LLM) -> KVCacheConfig:
    """The KV cache configuration the scheduler of an in-process engine got."""
    config: KVCacheConfig = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return config
