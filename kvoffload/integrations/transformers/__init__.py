"""Hugging Face ``transformers`` integration: a paged-KV engine that offloads with kvoffload.

Install from a kvoffload clone with ``pip install '.[transformers]'``. Public API::

    from kvoffload.integrations.transformers import PagedEngine

    engine = PagedEngine(model, num_gpu_blocks=256, block_size=16, max_batch_tokens=512)
    config = OffloadConfig(block_size=16, num_cpu_blocks=4096, model_id="my-model@rev")
    async with KVOffloader(config, engine.kv, layout=engine.layout, pinner=engine.pinner) as off:
        engine.attach(off)
        engine.add_request("r1", prompt_ids, max_new_tokens=64)  # any number of requests
        while engine.has_work:
            for out in await engine.step():  # one forward pass over several requests
                ...  # out.token_id; out.result (a GenerationResult) when the request ended
        # or: results = await engine.run_until_done()
        engine.abort("r2")  # ends a request now or right after the step in progress

- `PagedEngine`: continuous batching (decodes, chunked prefills and admissions packed into
  one forward pass per `PagedEngine.step`), greedy sampling, preemption when blocks run
  out; ``engine.kv`` / ``engine.layout`` / ``engine.pinner`` are what `KVOffloader` takes;
  `PagedEngine.statistics` returns `EngineStatistics`.
- `GpuBlockAllocator`: reference-counted blocks with an LRU GPU prefix cache, never handing
  out a block a transfer pins (`kvoffload.RefCountPinner`).
- `paged_attention`: the glue, registered with ``transformers.AttentionInterface`` as
  ``"kvoffload_paged"``: writes each step's keys and values into the blocks and attends
  over each request's block table.

Supported: decoder-only models whose ``config.model_type`` is in `SUPPORTED_MODEL_TYPES`:
Llama (full attention, grouped-query attention included; offloaded), Gemma 3 text
(sliding-window and full attention) and Qwen3-Next (linear attention and full attention).
The cache is per KV cache group (``engine.groups``,
`kvoffload.integrations.transformers.groups`); a model with other groups than one of full
attention runs without offload (``attach`` refuses, naming the groups). Other layer types,
encoder-decoder and multimodal models are refused with a `kvoffload.ConfigError`.
"""

from __future__ import annotations

from kvoffload._extras import needs_extra

try:
    import transformers as _transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(needs_extra("kvoffload.integrations.transformers", "transformers")) from exc

from kvoffload.integrations.transformers.allocator import AllocatorStatistics, GpuBlockAllocator
from kvoffload.integrations.transformers.attention import (
    ATTENTION_NAME,
    PagedBatch,
    Segment,
    paged_attention,
)
from kvoffload.integrations.transformers.engine import SUPPORTED_MODEL_TYPES, PagedEngine
from kvoffload.integrations.transformers.results import (
    EngineStatistics,
    FinishReason,
    GenerationResult,
    StepOutput,
)

__all__ = [
    "ATTENTION_NAME",
    "SUPPORTED_MODEL_TYPES",
    "AllocatorStatistics",
    "EngineStatistics",
    "FinishReason",
    "GenerationResult",
    "GpuBlockAllocator",
    "PagedBatch",
    "PagedEngine",
    "Segment",
    "StepOutput",
    "paged_attention",
]
