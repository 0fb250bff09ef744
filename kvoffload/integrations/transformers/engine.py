"""`PagedEngine`: continuous batching over a paged KV cache for a ``transformers`` causal LM.

Each `PagedEngine.step` packs the new tokens of several requests (decodes first, then
chunks of prefill, then newly admitted requests, up to ``max_batch_tokens``) into one
forward pass, samples greedily, and reports what it computed to kvoffload through each
request's `OffloadRequest` handle. Admission takes the longest prefix from the engine's
GPU prefix cache, then looks the rest up in the CPU pool and loads the hit; a request
that cannot get blocks waits, and a running request that runs out of blocks is preempted
and re-admitted later. Every request ends with a `GenerationResult`, also when it is
aborted or its step fails.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, final

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
from transformers import AttentionInterface

from kvoffload.config import KVLayout
from kvoffload.errors import ClosedError, ConfigError, TransferError
from kvoffload.hashing import BlockHash, HashNamespace
from kvoffload.integrations.transformers.allocator import GpuBlockAllocator
from kvoffload.integrations.transformers.attention import (
    ATTENTION_NAME,
    BATCH_KWARG,
    PagedBatch,
    Segment,
    paged_attention,
)
from kvoffload.integrations.transformers.results import (
    EngineStatistics,
    FinishReason,
    GenerationResult,
    StepOutput,
)
from kvoffload.offloader import KVOffloader
from kvoffload.pinner import RefCountPinner
from kvoffload.request import OffloadRequest, hash_new_blocks
from kvoffload.transfer.task import TransferTask

__all__ = ["SUPPORTED_MODEL_TYPES", "PagedEngine"]

SUPPORTED_MODEL_TYPES = frozenset({"llama"})
"""``config.model_type`` values the engine accepts: decoder-only, rotary, full attention."""


class _Hasher:
    """Incremental block hashes for a request when no offloader gives a handle."""

    __slots__ = ("_block_size", "_root", "block_hashes")

    def __init__(self, root: BlockHash, block_size: int) -> None:
        self._root, self._block_size = root, block_size
        self.block_hashes: list[BlockHash] = []

    def update(self, tokens: Sequence[int]) -> None:
        hash_new_blocks(self.block_hashes, tokens, self._block_size, self._root)


class _Req:
    __slots__ = (
        "aborted",
        "eos",
        "handle",
        "hasher",
        "load_task",
        "max_new",
        "num_cached_blocks",
        "num_computed",
        "result",
        "t0",
        "table",
        "tokens",
    )

    def __init__(
        self, rid: str, prompt: list[int], max_new: int, eos: int | None, hasher: _Hasher | None
    ) -> None:
        self.tokens = prompt
        self.max_new, self.eos = max_new, eos
        self.handle: OffloadRequest | None = None
        self.hasher = hasher
        self.table: list[int] = []
        self.num_computed = 0
        self.num_cached_blocks = 0  # blocks registered in the GPU prefix cache
        self.load_task: TransferTask | None = None
        self.aborted = False
        self.t0 = time.perf_counter()
        self.result = GenerationResult(rid, len(prompt))

    @property
    def hashes(self) -> Sequence[BlockHash]:
        if self.handle is not None:
            return self.handle.block_hashes
        return self.hasher.block_hashes if self.hasher is not None else ()


def _register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, paged_attention)


@final
class PagedEngine:
    """A continuous-batching engine over a paged KV cache for a ``transformers`` causal LM.

    The model's attention is switched to kvoffload's paged attention (registered with
    ``transformers.AttentionInterface``); its weights are not touched. The KV cache is one
    ``blocks_first`` tensor per layer, in the model's dtype and on its device, so
    ``KVOffloader(config, engine.kv, layout=engine.layout, pinner=engine.pinner)``
    offloads it directly.

    Args:
        model: a causal LM whose ``config.model_type`` is in `SUPPORTED_MODEL_TYPES`.
        num_gpu_blocks: blocks in the KV cache.
        block_size: tokens per block (the offloader's ``block_size`` must match).
        max_batch_tokens: new tokens per step, all requests together (chunked prefill).
        max_running: requests admitted at once.
        enable_prefix_caching: keep full blocks of finished requests for later prompts.

    Raises:
        ConfigError: an unsupported architecture or a bad size (the message says which).
    """

    def __init__(
        self,
        model: Any,
        *,
        num_gpu_blocks: int,
        block_size: int = 16,
        max_batch_tokens: int = 512,
        max_running: int = 16,
        enable_prefix_caching: bool = True,
    ) -> None:
        cfg = model.config
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r} is not supported: the engine handles decoder-only "
                f"models with rotary embeddings and full causal attention "
                f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))}); sliding-window, "
                "encoder-decoder, multimodal and state-space models are not"
            )
        if max_batch_tokens < 1 or max_running < 1 or block_size < 1:
            raise ConfigError(
                f"max_batch_tokens={max_batch_tokens}, max_running={max_running} and "
                f"block_size={block_size} must all be >= 1"
            )
        _register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        model.eval()
        param = next(model.parameters())
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layout = KVLayout(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_size=head_dim,
            dtype=str(param.dtype).removeprefix("torch."),
            block_size=block_size,
        )
        """The cache's `KVLayout`."""
        self.kv = [
            torch.zeros(
                self.layout.tensor_shape(num_gpu_blocks), dtype=param.dtype, device=param.device
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        """Per layer, ``[num_gpu_blocks, 2, block_size, kv_heads, head_dim]``."""
        self.allocator = GpuBlockAllocator(
            num_gpu_blocks, enable_prefix_caching=enable_prefix_caching
        )
        """The block allocator and GPU prefix cache."""
        self._model = model
        self._device = param.device
        self._block_size = block_size
        self._max_tokens = max_batch_tokens
        self._max_running = max_running
        self._vocab = int(cfg.vocab_size)
        self._root = HashNamespace.from_layout(self.layout).root
        self._off: KVOffloader | None = None
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._ids: set[str] = set()
        self._in_step = False
        self._steps = self._computed = self._gpu_cached = self._loaded = 0
        self._preemptions = self._failed_loads = 0

    @property
    def pinner(self) -> RefCountPinner:
        """The `GpuBlockPinner` to give `KVOffloader` (it tells the allocator when a block
        a transfer pinned is free again)."""
        return self.allocator.pinner

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    def attach(self, offloader: KVOffloader | None) -> None:
        """Offload through ``offloader`` from now on (``None``: stop offloading).

        Raises:
            ConfigError: its block size or layout differs from the engine's.
            RuntimeError: requests are in progress.
        """
        if self._running or self._waiting:
            raise RuntimeError("attach an offloader while no request is in progress")
        if offloader is not None and offloader.layout != self.layout:
            raise ConfigError(
                f"the offloader's layout {offloader.layout!r} differs from the engine's "
                f"{self.layout!r} (block_size and dtype must match)"
            )
        self._off = offloader

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_new_tokens: int,
        eos_token_id: int | None = None,
    ) -> None:
        """Queue a request; `step` admits it when blocks allow.

        Raises:
            ValueError: an id in use, an empty prompt, a token outside the vocabulary, a
                ``max_new_tokens`` below 1, or a request that can never fit the cache.
        """
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is in use")
        if self._off is not None and self._off.scheduler.has_request(request_id):
            raise ValueError(
                f"request id {request_id!r} is in use: the offloader still copies blocks of "
                "an earlier request with that id"
            )
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        bad = next((t for t in prompt if not 0 <= t < self._vocab), None)
        if bad is not None:
            raise ValueError(
                f"request {request_id!r}: token id {bad} is outside the vocabulary "
                f"[0, {self._vocab})"
            )
        if max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens={max_new_tokens} < 1")
        need = -(-(len(prompt) + max_new_tokens) // self._block_size)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"request {request_id!r} needs {need} blocks; the cache has "
                f"{self.allocator.num_blocks}"
            )
        hasher = None if self._off is not None else _Hasher(self._root, self._block_size)
        self._waiting.append(_Req(request_id, prompt, max_new_tokens, eos_token_id, hasher))
        self._ids.add(request_id)

    def abort(self, request_id: str) -> GenerationResult | None:
        """End a request now (or right after the step in progress).

        Returns:
            Its result when it ended now; ``None`` when unknown or ending after the step.
        """
        for r in self._waiting:
            if r.result.request_id == request_id:
                self._waiting.remove(r)
                return self._end(r, "aborted")
        for r in self._running:
            if r.result.request_id == request_id:
                if self._in_step:
                    r.aborted = True
                    return None
                self._running.remove(r)
                return self._end(r, "aborted")
        return None

    @property
    def has_work(self) -> bool:
        """Whether a request waits or runs."""
        return bool(self._waiting or self._running)

    async def run_until_done(self) -> list[GenerationResult]:
        """Step until every request ended; their results, in the order they ended."""
        done: list[GenerationResult] = []
        while self.has_work:
            done.extend(o.result for o in await self.step() if o.result is not None)
        return done

    def statistics(self) -> EngineStatistics:
        """The counters."""
        return EngineStatistics(
            steps=self._steps,
            waiting=len(self._waiting),
            running=len(self._running),
            computed_tokens=self._computed,
            gpu_cached_tokens=self._gpu_cached,
            loaded_tokens=self._loaded,
            preemptions=self._preemptions,
            failed_loads=self._failed_loads,
            allocator=self.allocator.statistics(),
        )

    # -- the step ------------------------------------------------------------------------------

    async def step(self) -> list[StepOutput]:
        """Run one forward pass over the running requests; admit and end requests.

        Returns:
            One `StepOutput` per request that generated a token or ended.

        Cancelling it while the forward pass runs lets the pass finish in its thread; the
        step's requests are then ended as ``"aborted"``, so no block or pin leaks.
        """
        if self._in_step:
            raise RuntimeError("PagedEngine.step() is already running")
        self._in_step = True
        outputs: list[StepOutput] = []
        try:
            self._admit(outputs)
            await self._await_loads()
            segs = self._schedule(outputs)
            if not segs:
                if self._running or self._waiting:
                    await self._wait_for_blocks()
                return outputs
            t0 = time.perf_counter()
            try:
                logits_rows = await anyio.to_thread.run_sync(self._forward, segs)
            except BaseException as exc:
                # The pass ran to its end in its thread; end its requests (no await here).
                reason: FinishReason = (
                    "aborted" if isinstance(exc, anyio.get_cancelled_exc_class()) else "error"
                )
                for r, _ in segs:
                    if r in self._running:
                        self._running.remove(r)
                        res = self._end(r, reason, error=repr(exc))
                        outputs.append(StepOutput(r.result.request_id, None, res))
                if reason == "aborted":
                    raise
                return outputs
            elapsed = time.perf_counter() - t0
            for r, _ in segs:
                if r.result.ttft_s is None:
                    r.result.forward_s += elapsed
            self._after_forward(segs, logits_rows, outputs)
        finally:
            self._in_step = False
            for r in [r for r in self._running if r.aborted]:
                self._running.remove(r)
                outputs.append(StepOutput(r.result.request_id, None, self._end(r, "aborted")))
        return outputs

    # -- internals -----------------------------------------------------------------------------

    def _admit(self, outputs: list[StepOutput]) -> None:
        bs = self._block_size
        while self._waiting and len(self._running) < self._max_running:
            r = self._waiting[0]
            n = len(r.tokens)
            if r.handle is None and self._off is not None:
                r.handle = self._off.request(r.result.request_id, r.tokens)
            elif r.hasher is not None:
                r.hasher.update(r.tokens)
            matched = self.allocator.match(r.hashes, (n - 1) // bs)
            hit = 0
            if r.handle is not None:
                # With secondary tiers, a lookup that started a promotion answers None (its
                # pin released): the request waits, and a later step loads what the tier
                # had instead of computing it (each tier operation within its own budget).
                defer = self._off is not None and self._off.tiers is not None
                got = r.handle.lookup(num_computed_tokens=len(matched) * bs, allow_defer=defer)
                if got is None:
                    self.allocator.free(matched)
                    return
                hit = got
            need = -(-n // bs) - len(matched)
            fresh = self.allocator.allocate(need)
            if fresh is None:
                self.allocator.free(matched)
                if r.handle is not None:
                    r.handle.release()
                return  # wait until running requests free blocks
            self._waiting.popleft()
            r.table = matched + fresh
            r.num_cached_blocks = len(matched)
            r.num_computed = len(matched) * bs + hit
            if r.result.ttft_s is None:  # a first admission, not a re-admission
                r.result.gpu_cached_tokens = len(matched) * bs
                r.result.loaded_tokens = hit
            self._gpu_cached += len(matched) * bs
            if r.handle is not None and hit:
                r.load_task = r.handle.load(r.table)
            self._running.append(r)

    async def _await_loads(self) -> None:
        bs = self._block_size
        for r in self._running:
            task, r.load_task = r.load_task, None
            if task is None:
                continue
            t0 = time.perf_counter()
            try:
                await task
                self._loaded += task.plan.num_blocks * bs
            except TransferError:
                # Recompute what failed to load; the blocks are the request's own.
                self._failed_loads += 1
                r.num_computed = r.num_cached_blocks * bs
                if r.result.ttft_s is None:
                    r.result.loaded_tokens = 0
            finally:
                if r.result.ttft_s is None:
                    r.result.load_wait_s += time.perf_counter() - t0

    def _schedule(self, outputs: list[StepOutput]) -> list[tuple[_Req, int]]:
        budget = self._max_tokens
        segs: list[tuple[_Req, int]] = []
        decoding = [r for r in self._running if r.num_computed == len(r.tokens) - 1]
        prefilling = [r for r in self._running if r.num_computed < len(r.tokens) - 1]
        for r in decoding + prefilling:
            if budget <= 0:
                break
            q = min(len(r.tokens) - r.num_computed, budget)
            if not self._grow(r, r.num_computed + q, [s for s, _ in segs]):
                continue
            segs.append((r, q))
            budget -= q
        return segs

    def _grow(self, r: _Req, num_tokens: int, scheduled: list[_Req]) -> bool:
        """Give ``r`` blocks for ``num_tokens``, preempting the newest others if needed."""
        need = -(-num_tokens // self._block_size) - len(r.table)
        while need > self.allocator.num_free:
            victim = next(
                (v for v in reversed(self._running) if v is not r and v not in scheduled), None
            )
            if victim is None:
                return False
            self._preempt(victim)
        if need > 0:
            r.table += self.allocator.allocate(need) or []
        return True

    def _preempt(self, r: _Req) -> None:
        self._running.remove(r)
        self.allocator.free(r.table)
        r.table, r.num_computed, r.num_cached_blocks = [], 0, 0
        if r.handle is not None:
            r.handle.preempt()
        r.result.preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(r)

    async def _wait_for_blocks(self) -> None:
        if self._off is not None and self.allocator.statistics().num_held:
            await self._off.drain()  # blocks wait for transfers to release their pins
        else:
            await anyio.lowlevel.checkpoint()

    def _forward(self, segs: list[tuple[_Req, int]]) -> torch.Tensor:
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
            kv=self.kv,
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

    def _after_forward(
        self, segs: list[tuple[_Req, int]], logits: torch.Tensor, outputs: list[StepOutput]
    ) -> None:
        self._steps += 1
        bs = self._block_size
        next_ids = logits.argmax(dim=-1).tolist()
        ending: list[tuple[_Req, FinishReason, int]] = []
        now = time.perf_counter()
        for (r, q), tok in zip(segs, next_ids, strict=True):
            if r.result.ttft_s is None:
                r.result.computed_tokens += q
            r.num_computed += q
            self._computed += q
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
            if r.handle is not None:
                r.handle.advance(r.table, r.num_computed)
            hashes = r.hashes
            full = min(r.num_computed // bs, len(hashes))
            for i in range(r.num_cached_blocks, full):
                self.allocator.cache(hashes[i], r.table[i])
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
                    outputs.append(StepOutput(r.result.request_id, sampled))
        # advance -> store -> finish: the blocks the last step completed are stored too.
        if self._off is not None:
            self._off.store()
        for r, reason, sampled in ending:
            self._running.remove(r)
            outputs.append(StepOutput(r.result.request_id, sampled, self._end(r, reason)))

    def _end(self, r: _Req, reason: FinishReason, error: str | None = None) -> GenerationResult:
        if r.table:
            self.allocator.free(r.table)
            r.table = []
        if r.handle is not None and not r.handle.finished:
            with contextlib.suppress(ClosedError):  # a closed offloader let go of it already
                r.handle.finish()
        r.result.finish_reason = reason
        r.result.error = error
        r.result.total_s = time.perf_counter() - r.t0
        self._ids.discard(r.result.request_id)
        return r.result
