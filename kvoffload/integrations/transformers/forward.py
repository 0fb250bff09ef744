"""`PagedEngine`'s forward pass and what follows it.

`_ForwardPass.run` packs a step's batch into one `PagedBatch` and runs the model over it (in
a worker thread); `_ForwardPass.apply` takes the logits back on the event loop: it samples
greedily, appends each sampled token, reports the step to kvoffload (``advance`` per
request, then one ``store``, so the blocks the step completed are stored too), registers
full blocks in the GPU prefix cache, and ends the requests that stopped.
"""

from __future__ import annotations

import time
from typing import Any, final

import torch

from kvoffload.integrations.transformers.allocator import GpuBlockAllocator
from kvoffload.integrations.transformers.attention import BATCH_KWARG, PagedBatch, Segment
from kvoffload.integrations.transformers.batching import _Batcher, _Segments
from kvoffload.integrations.transformers.offload import _OffloadCalls
from kvoffload.integrations.transformers.results import FinishReason, StepOutput
from kvoffload.integrations.transformers.state import _Counters, _Req

__all__: list[str] = []


@final
class _ForwardPass:
    """The model, its paged KV cache, and what one step does with its logits."""

    def __init__(
        self,
        model: Any,
        kv: list[torch.Tensor],
        device: torch.device,
        *,
        block_size: int,
        allocator: GpuBlockAllocator,
        batcher: _Batcher,
        calls: _OffloadCalls,
        counters: _Counters,
    ) -> None:
        self._model = model
        self._kv = kv
        self._device = device
        self._block_size = block_size
        self._allocator = allocator
        self._batcher = batcher
        self._calls = calls
        self._counters = counters

    def run(self, segs: _Segments) -> torch.Tensor:
        """The logits of each request's last new token (runs in a worker thread)."""
        bs, dev = self._block_size, self._device
        ids: list[int] = []
        pos: list[int] = []
        segments: list[Segment] = []
        slot_blocks: list[torch.Tensor] = []
        for r, q in segs:
            start = r.num_computed
            ids.extend(r.tokens[start : start + q])
            pos.extend(range(start, start + q))
            table = torch.tensor(r.table[: -(-(start + q) // bs)], dtype=torch.long)
            p = torch.arange(start, start + q)
            slot_blocks.append(table[p // bs])
            segments.append(Segment(len(ids) - q, q, start, table.to(dev)))
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        batch = PagedBatch(
            kv=self._kv,
            segments=segments,
            slot_blocks=torch.cat(slot_blocks).to(dev),
            slot_offsets=positions % bs,
        )
        last = torch.tensor([s.q_start + s.q_len - 1 for s in segments], device=dev)
        with torch.inference_mode():
            hidden = self._model.model(
                input_ids=torch.tensor([ids], device=dev),
                position_ids=positions[None],
                use_cache=False,
                **{BATCH_KWARG: batch},
            ).last_hidden_state
            logits: torch.Tensor = self._model.lm_head(hidden[0, last])
        return logits

    def apply(self, segs: _Segments, logits: torch.Tensor, outputs: list[StepOutput]) -> None:
        """Sample, report the step to kvoffload, and end the requests that stopped."""
        counters, calls, batcher = self._counters, self._calls, self._batcher
        counters.steps += 1
        bs = self._block_size
        next_ids = logits.argmax(dim=-1).tolist()
        ending: list[tuple[_Req, FinishReason, int]] = []
        now = time.perf_counter()
        for (r, q), tok in zip(segs, next_ids, strict=True):
            if r.result.ttft_s is None:
                r.result.computed_tokens += q
            r.num_computed += q
            counters.computed += q
            sampled: int | None = None
            if r.num_computed == len(r.tokens):
                sampled = int(tok)
                r.tokens.append(sampled)
                if r.handle is not None:
                    r.handle.extend((sampled,))
                elif r.hasher is not None:
                    r.hasher.update(r.tokens)
                r.result.output_token_ids.append(sampled)
                if r.result.ttft_s is None:
                    r.result.ttft_s = now - r.t0
            calls.advance(r, r.table, r.num_computed)
            hashes = r.hashes
            full = min(r.num_computed // bs, len(hashes))
            for i in range(r.num_cached_blocks, full):
                self._allocator.cache(hashes[i], r.table[i])
            r.num_cached_blocks = max(r.num_cached_blocks, full)
            if sampled is not None:
                reason: FinishReason | None = None
                if r.eos is not None and sampled == r.eos:
                    reason = "stop"
                elif len(r.result.output_token_ids) >= r.max_new:
                    reason = "length"
                if reason is not None and not r.aborted:
                    ending.append((r, reason, sampled))
                else:
                    outputs.append(StepOutput(r.request_id, sampled))
        # advance -> store -> finish: the blocks the last step completed are stored too.
        calls.store()
        for r, reason, sampled in ending:
            batcher.running.remove(r)
            outputs.append(StepOutput(r.request_id, sampled, batcher.end(r, reason)))
