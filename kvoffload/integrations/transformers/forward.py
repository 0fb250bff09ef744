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
        kv: list[torch.Tensor | None],
        device: torch.device,
        *,
        layer_group: list[int],
        snapshots: bool,
        block_size: int,
        allocator: GpuBlockAllocator,
        batcher: _Batcher,
        calls: _OffloadCalls,
        counters: _Counters,
    ) -> None:
        self._model = model
        self._kv = kv
        self._layer_group = layer_group
        self._has_recurrent = -1 in layer_group
        self._snapshots = snapshots
        self._device = device
        self._block_size = block_size
        self._allocator = allocator
        self._batcher = batcher
        self._calls = calls
        self._counters = counters

    def run(self, segs: _Segments) -> torch.Tensor:
        """The logits of each request's last new token (runs in a worker thread)."""
        bs, dev, b = self._block_size, self._device, self._batcher
        attn = [g for g in b.groups if g.kind != "recurrent"]
        ids: list[int] = []
        pos: list[int] = []
        segments: list[Segment] = []
        slot_blocks: list[list[torch.Tensor]] = [[] for _ in attn]
        for r, q in segs:
            start = r.num_computed
            ids.extend(r.tokens[start : start + q])
            pos.extend(range(start, start + q))
            p = torch.arange(start, start + q)
            blocks: list[torch.Tensor] = []
            firsts: list[int] = []
            for gi, (g, t) in enumerate(zip(attn, r.tables, strict=True)):
                first = 0 if g.window is None else max(0, (start - g.window + 1) // bs)
                held = t[first : -(-(start + q) // bs)]
                table = torch.tensor(held, dtype=torch.long)
                slot_blocks[gi].append(table[p // bs - first])
                blocks.append(table.to(dev))
                firsts.append(first)
            segments.append(Segment(len(ids) - q, q, start, blocks, firsts))
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        batch = PagedBatch(
            kv=self._kv,
            segments=segments,
            slot_blocks=[torch.cat(s).to(dev) for s in slot_blocks],
            slot_offsets=positions % bs,
            layer_group=self._layer_group,
            windows=[g.window for g in attn],
            states=[r.state for r, _ in segs] if self._has_recurrent else None,
            snapshot_every=bs if self._snapshots else 0,
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
            cap = getattr(self._model.config, "final_logit_softcapping", None)
            if cap:
                logits = torch.tanh(logits / cap) * cap
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
            hashes = r.hashes
            full = min(r.num_computed // bs, len(hashes))
            for alloc, t in zip(batcher.allocators, r.tables, strict=False):
                for i in range(r.num_cached_blocks, full):
                    b = t[i]
                    if b is not None:
                        alloc.cache(hashes[i], b)
            r.num_cached_blocks = max(r.num_cached_blocks, full)
            batcher.store_snapshots(r)
            batcher.trim(r)
            # After the trim: a block freed here is never named to kvoffload afterwards.
            calls.advance(r, r.num_computed)
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
