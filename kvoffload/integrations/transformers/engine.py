"""`PagedEngine`: continuous batching over a paged KV cache for a ``transformers`` causal LM.

Each `PagedEngine.step` packs the new tokens of several requests (decodes first, then
chunks of prefill, then newly admitted requests, up to ``max_batch_tokens``) into one
forward pass, samples greedily, and reports what it computed to kvoffload through each
request's `OffloadRequest` handle. Admission takes the longest prefix from the engine's
GPU prefix cache, then looks the rest up in the CPU pool and loads the hit; a request
that cannot get blocks waits, and a running request that runs out of blocks is preempted
and re-admitted later. Every request ends with a `GenerationResult`, also when it is
aborted or its step fails.

This module is the façade; its parts are the batching (waiting and running requests,
admission, scheduling, preemption: `kvoffload.integrations.transformers.batching`), the
forward pass and what follows it (`kvoffload.integrations.transformers.forward`) and the
calls on kvoffload with their containment of a `PinnerError`
(`kvoffload.integrations.transformers.offload`).

A request is in one place at a time: waiting (it holds no GPU block) or running (it holds
its table). A request preempted during a step's scheduling is not scheduled again in that
step; it goes back to the waiting queue with its blocks freed and its handle preempted, and
its next admission starts from there. `PagedEngine.check_invariants` checks that every GPU
block is counted once.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Any, final

import anyio
import anyio.to_thread
import torch
from transformers import AttentionInterface

from kvoffload.config import KVLayout
from kvoffload.errors import ConfigError
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHasher, HashNamespace
from kvoffload.integrations.transformers.allocator import GpuBlockAllocator
from kvoffload.integrations.transformers.attention import ATTENTION_NAME, paged_attention
from kvoffload.integrations.transformers.batching import _Batcher
from kvoffload.integrations.transformers.forward import _ForwardPass
from kvoffload.integrations.transformers.groups import EngineGroup, groups_of
from kvoffload.integrations.transformers.offload import _OffloadCalls
from kvoffload.integrations.transformers.recurrent import (
    StatePool,
    install_mixers,
    probe_states,
)
from kvoffload.integrations.transformers.results import (
    EngineStatistics,
    FinishReason,
    GenerationResult,
    StepOutput,
)
from kvoffload.integrations.transformers.state import _Counters, _Req
from kvoffload.offloader import KVOffloader
from kvoffload.pinner import RefCountPinner
from kvoffload.pool.hints import check_retain_for_s
from kvoffload.pool.retention import check_owner

__all__ = ["SUPPORTED_MODEL_TYPES", "PagedEngine"]

SUPPORTED_MODEL_TYPES = frozenset({"gemma3_text", "llama", "qwen3_next"})
"""``config.model_type`` values the engine accepts: decoder-only with rotary attention
(Llama: full attention; Gemma 3 text: sliding-window and full attention; Qwen3-Next: gated
delta net linear attention and full attention)."""


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
        enable_prefix_caching: keep full blocks of finished requests for later prompts
            (and, for recurrent layers, a state snapshot at every block boundary).
        num_state_blocks: state snapshots the recurrent layers' pool holds (default
            ``num_gpu_blocks``).
        load_deadline_s: how long a step waits for a request's load from the CPU pool
            before it abandons it (`OffloadRequest.abandon_load`) and recomputes those
            tokens, in fresh GPU blocks (the late copy's are reused only once it ended);
            counted in `EngineStatistics.abandoned_loads`. ``None`` (default): wait.
            With several KV cache groups every group's part of the load is abandoned
            at once, each group recomputing into fresh blocks of its own.

    Raises:
        ConfigError: an unsupported architecture or a bad size (the message says which).

    A kvoffload error raised while a request ends (its handle's ``finish()``, e.g. a
    once-only `PinnerError` about an earlier transfer) does not stop the step or the
    engine: the request's GPU blocks and id are released all the same, its result keeps
    its finish reason and names the error in `GenerationResult.error`, the error is logged
    (``request_finish_failed``) and `EngineStatistics.finish_errors` counts it.

    The same once-only `PinnerError` raised by any other call a step makes on kvoffload
    (``request``, ``lookup``, ``load``, ``release``, ``preempt``, ``advance``, ``store``,
    ``drain``) is raised before the offloader did anything, so the engine logs it
    (``offload_call_failed``, with its cause), counts it in
    `EngineStatistics.pinner_errors`, names it in the result of the request the call was
    for, and makes the call again: the step goes on and delivers its outputs. A load or
    store whose retry raises too (a pinner whose ``pin`` keeps raising) is given up: the
    load's tokens are recomputed (`EngineStatistics.failed_loads`), the stores are planned
    again by the next step.
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
        num_state_blocks: int | None = None,
        load_deadline_s: float | None = None,
    ) -> None:
        cfg = model.config
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r} is not supported: the engine handles decoder-only "
                f"models with rotary attention, sliding-window and linear-attention layers "
                f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))}); encoder-decoder, "
                "multimodal and other state-space models are not"
            )
        if max_batch_tokens < 1 or max_running < 1 or block_size < 1:
            raise ConfigError(
                f"max_batch_tokens={max_batch_tokens}, max_running={max_running} and "
                f"block_size={block_size} must all be >= 1"
            )
        if load_deadline_s is not None and not load_deadline_s >= 0:
            raise ConfigError(f"load_deadline_s={load_deadline_s!r} must be >= 0 or None")
        self.groups = groups_of(cfg, block_size)
        """The KV cache groups (`EngineGroup`): attention groups first, recurrent last."""
        _register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        model.eval()
        param = next(model.parameters())
        attn = [g for g in self.groups if g.kind != "recurrent"]
        rec = [g for g in self.groups if g.kind == "recurrent"]
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layouts = [
            KVLayout(
                num_layers=len(g.layers),
                num_kv_heads=cfg.num_key_value_heads,
                head_size=head_dim,
                dtype=str(param.dtype).removeprefix("torch."),
                block_size=block_size,
            )
            for g in attn
        ]
        self.layout = layouts[0]
        """The first attention group's `KVLayout` (a Llama model's whole cache)."""
        layer_kv: list[torch.Tensor | None] = [None] * cfg.num_hidden_layers
        layer_group = [-1] * cfg.num_hidden_layers
        self.group_kv: dict[str, list[torch.Tensor]] = {}
        """Per attention group, one cache tensor per layer of it."""
        for gi, (g, lay) in enumerate(zip(attn, layouts, strict=True)):
            tensors = []
            for li in g.layers:
                t = torch.zeros(
                    lay.tensor_shape(num_gpu_blocks), dtype=param.dtype, device=param.device
                )
                layer_kv[li], layer_group[li] = t, gi
                tensors.append(t)
            self.group_kv[g.name] = tensors
        self.kv = self.group_kv[attn[0].name]
        """The first attention group's tensors, per layer ``[num_gpu_blocks, 2, block_size,
        kv_heads, head_dim]`` (a Llama model's whole cache)."""
        self.allocators: dict[str, GpuBlockAllocator] = {
            g.name: GpuBlockAllocator(
                num_state_blocks or num_gpu_blocks if g.kind == "recurrent" else num_gpu_blocks,
                enable_prefix_caching=enable_prefix_caching,
            )
            for g in self.groups
        }
        """Per group, its block allocator and GPU prefix cache (a recurrent group's holds
        state snapshots)."""
        self.allocator = self.allocators[attn[0].name]
        """The first attention group's block allocator and GPU prefix cache."""
        state_pool = None
        if rec:
            install_mixers(model, rec[0].layers)
            example = probe_states(model, rec[0].layers, param.device, param.dtype)
            state_pool = StatePool(self.allocators[rec[0].name].num_blocks, rec[0].layers, example)
        self.kv_groups = _kv_groups(self.groups, layouts, state_pool)
        """The KV cache groups as kvoffload describes them (`KVCacheGroup`), for
        ``KVOffloader(..., groups=engine.kv_groups)``: one per `groups` entry, the
        recurrent group's page being one state block (conv and recurrent state) per layer."""
        self.offload_kv: dict[str, list[torch.Tensor]] = dict(self.group_kv)
        """Per group, the tensors to give `KVOffloader` (a recurrent group's: the state
        pool's byte rows, one per layer)."""
        if state_pool is not None:
            self.offload_kv[rec[0].name] = state_pool.rows
        self._model = model
        self._block_size = block_size
        self._vocab = int(cfg.vocab_size)
        self._root = HashNamespace.from_layout(self.layout).root
        self._counters = _Counters()
        self._calls = _OffloadCalls(self._counters)
        self._batch = _Batcher(
            [self.allocators[g.name] for g in self.groups],
            self._calls,
            self._counters,
            groups=self.groups,
            state_pool=state_pool,
            block_size=block_size,
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            load_deadline_s=load_deadline_s,
        )
        self._pass = _ForwardPass(
            model,
            layer_kv,
            param.device,
            layer_group=layer_group,
            snapshots=enable_prefix_caching,
            block_size=block_size,
            allocator=self.allocator,
            batcher=self._batch,
            calls=self._calls,
            counters=self._counters,
        )
        self._in_step = False

    @property
    def pinner(self) -> RefCountPinner:
        """The `GpuBlockPinner` to give `KVOffloader` (it tells the allocator when a block
        a transfer pinned is free again)."""
        return self.allocator.pinner

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def pinners(self) -> dict[str, RefCountPinner]:
        """Per group, the `GpuBlockPinner` of its allocator, for
        ``KVOffloader(..., pinner=engine.pinners)``."""
        return {name: alloc.pinner for name, alloc in self.allocators.items()}

    def attach(self, offloader: KVOffloader | None) -> None:
        """Offload through ``offloader`` from now on (``None``: stop offloading).

        A model with several KV cache groups (Gemma 3, Qwen3-Next) needs an offloader
        made with them: ``KVOffloader(config, engine.offload_kv, groups=engine.kv_groups,
        pinner=engine.pinners)`` (that spelling works for one group too). A hit then
        loads every group: the full group's blocks, the sliding window's blocks before
        it, and the recurrent state snapshot at it.

        Raises:
            ConfigError: its block size or layout differs from the engine's, or its KV
                cache groups are not the engine's `kv_groups`.
            RuntimeError: requests are in progress.
        """
        if self.has_work:
            raise RuntimeError("attach an offloader while no request is in progress")
        many = len(self.kv_groups) != 1 or self.kv_groups[0].kind != "full"
        if offloader is not None and (many or offloader.groups is not None):
            if tuple(offloader.groups or ()) != self.kv_groups:
                names = ", ".join(
                    f"{g.name!r} ({g.kind}, layers {list(g.layers)})" for g in self.groups
                )
                raise ConfigError(
                    f"this model's KV cache has the groups {names}; offload needs every "
                    "group of a hit: make the offloader with groups=engine.kv_groups, "
                    "engine.offload_kv and pinner=engine.pinners"
                )
        elif offloader is not None and offloader.layout != self.layout:
            raise ConfigError(
                f"the offloader's layout {offloader.layout!r} differs from the engine's "
                f"{self.layout!r} (block_size and dtype must match)"
            )
        self._calls.off = offloader

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_new_tokens: int,
        eos_token_id: int | None = None,
        retain_for_s: float | None = None,
        session: Hashable = None,
    ) -> None:
        """Queue a request; `step` admits it when blocks allow.

        With ``retain_for_s`` (a session hint, docs/hints.md) its handle is finished with
        ``finish(retain_for_s=..., session=...)``: its blocks are retained for that long
        for ``session`` (the request id when ``None``).

        Raises:
            ValueError: an id in use, an empty prompt, a token outside the vocabulary, a
                ``max_new_tokens`` below 1, or a request that can never fit the cache;
                a ``retain_for_s`` that is not a number of seconds in (0, one year]
                (`InvalidInputError`).
            InputTypeError: ``session`` is not hashable.
        """
        off = self._calls.off
        if request_id in self._batch.ids:
            raise ValueError(f"request id {request_id!r} is in use")
        if off is not None and off.has_request(request_id):
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
        hint = None
        if retain_for_s is not None:
            check_owner(session, "session")
            hint = (check_retain_for_s(retain_for_s, f"request {request_id!r}: "), session)
        hasher = None if off is not None else BlockHasher(self._root, self._block_size)
        r = _Req(request_id, prompt, max_new_tokens, eos_token_id, hasher)
        r.hint = hint
        self._batch.add(r)

    def abort(self, request_id: str) -> GenerationResult | None:
        """End a request now (or right after the step in progress).

        Returns:
            Its result when it ended now; ``None`` when unknown or ending after the step.
        """
        batch = self._batch
        for r in batch.waiting:
            if r.request_id == request_id:
                batch.waiting.remove(r)
                return batch.end(r, "aborted")
        for r in batch.running:
            if r.request_id == request_id:
                if self._in_step:
                    r.aborted = True
                    return None
                batch.running.remove(r)
                return batch.end(r, "aborted")
        return None

    @property
    def has_work(self) -> bool:
        """Whether a request waits or runs."""
        return bool(self._batch.waiting or self._batch.running)

    async def run_until_done(self) -> list[GenerationResult]:
        """Step until every request ended; their results, in the order they ended."""
        done: list[GenerationResult] = []
        while self.has_work:
            done.extend(o.result for o in await self.step() if o.result is not None)
        return done

    def statistics(self) -> EngineStatistics:
        """The counters."""
        c = self._counters
        return EngineStatistics(
            steps=c.steps,
            waiting=len(self._batch.waiting),
            running=len(self._batch.running),
            computed_tokens=c.computed,
            gpu_cached_tokens=c.gpu_cached,
            loaded_tokens=c.loaded,
            preemptions=c.preemptions,
            failed_loads=c.failed_loads,
            finish_errors=c.finish_errors,
            pinner_errors=c.pinner_errors,
            allocator=self.allocator.statistics(),
            abandoned_loads=c.abandoned_loads,
            tier_loaded_tokens=dict(c.tier_loaded),
        )

    def check_invariants(self) -> None:
        """Check that every GPU block is accounted for once.

        Each block's reference count in the allocator equals the number of running
        requests' tables that name it; a waiting request holds no block and no load; every
        request is either waiting or running, once, under an id in use; and the allocator's
        own bookkeeping holds (`GpuBlockAllocator.check_invariants`).

        Raises:
            BlockStateError: what does not add up, with the block or request.
        """
        self._batch.check_invariants()

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
        batch = self._batch
        outputs: list[StepOutput] = []
        try:
            batch.admit()
            await batch.await_loads()
            segs = batch.schedule()
            if not segs:
                if batch.running or batch.waiting:
                    await batch.wait_for_blocks()
                return outputs
            t0 = time.perf_counter()
            try:
                logits_rows = await anyio.to_thread.run_sync(self._pass.run, segs)
            except BaseException as exc:
                # The pass ran to its end in its thread; end its requests (no await here).
                reason: FinishReason = (
                    "aborted" if isinstance(exc, anyio.get_cancelled_exc_class()) else "error"
                )
                for r, _ in segs:
                    if r in batch.running:
                        batch.running.remove(r)
                        res = batch.end(r, reason, error=repr(exc))
                        outputs.append(StepOutput(r.request_id, None, res))
                if reason == "aborted":
                    raise
                return outputs
            elapsed = time.perf_counter() - t0
            for r, _ in segs:
                if r.result.ttft_s is None:
                    r.result.forward_s += elapsed
            self._pass.apply(segs, logits_rows, outputs)
        finally:
            self._in_step = False
            for r in [r for r in batch.running if r.aborted]:
                batch.running.remove(r)
                outputs.append(StepOutput(r.request_id, None, batch.end(r, "aborted")))
        return outputs


def _kv_groups(
    groups: Sequence[EngineGroup], layouts: Sequence[KVLayout], state_pool: StatePool | None
) -> tuple[KVCacheGroup, ...]:
    """The engine's groups as `KVCacheGroup`s: the attention groups with their K/V
    layouts, the recurrent one with the state pool's page."""
    out: list[KVCacheGroup] = []
    attn = iter(layouts)
    for g in groups:
        if g.kind == "recurrent":
            if state_pool is None:
                raise ConfigError(f"group {g.name!r} is recurrent but has no state pool")
            out.append(
                KVCacheGroup(
                    name=g.name,
                    kind="recurrent",
                    block_size=g.block_size,
                    num_layers=len(g.layers),
                    bytes_per_layer_block=state_pool.page_bytes,
                )
            )
        else:
            out.append(
                KVCacheGroup.from_layout(next(attn), name=g.name, kind=g.kind, window=g.window)
            )
    return tuple(out)
