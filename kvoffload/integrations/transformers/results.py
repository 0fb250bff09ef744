"""What `PagedEngine` reports: per request, per step and for the whole engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvoffload.integrations.transformers.allocator import AllocatorStatistics

__all__ = ["EngineStatistics", "FinishReason", "GenerationResult", "StepOutput"]

FinishReason = Literal["length", "stop", "aborted", "error"]


@dataclass(slots=True)
class GenerationResult:
    """How one request went.

    Attributes:
        request_id: the request.
        prompt_tokens: tokens of its prompt.
        output_token_ids: the tokens generated.
        computed_tokens: prompt tokens the model computed (the rest came from a cache).
        gpu_cached_tokens: prompt tokens taken from the engine's GPU prefix cache.
        loaded_tokens: prompt tokens loaded from kvoffload's CPU pool.
        tier_tokens: of ``loaded_tokens``, those a secondary tier (by its name) promoted
            into the CPU pool for this request (the request's first lookup waited for
            them, or a prefetch brought them); the rest was in the CPU pool already.
        miss_reason: why the cached prefix (GPU cache and CPU pool) stopped where it did:
            the `MissReason` value of the lookup that admitted the request (``None``
            without an offloader); docs/misses.md.
        ttft_s: seconds from `PagedEngine.add_request` to the first token
            (``None`` when none was produced).
        total_s: seconds from `PagedEngine.add_request` to the end.
        load_wait_s: seconds the steps waited for this request's loads, up to its first
            token.
        forward_s: seconds of the forward passes this request took part in, up to its
            first token (the passes are shared with the other requests of each step).
        preemptions: how often the request was preempted.
        finish_reason: ``"length"`` (``max_new_tokens``), ``"stop"`` (the end token),
            ``"aborted"`` or ``"error"``.
        error: what failed, for ``"error"``; with another reason, what kvoffload raised
            that the engine contained: a `PinnerError` one of the request's calls surfaced
            (``kvoffload lookup raised …``; the call was made again, see
            `EngineStatistics.pinner_errors`) or its handle's ``finish()`` raising
            (``kvoffload finish failed: …``; the tokens are complete and its blocks were
            released); else ``None``. Several are joined with ``"; "``.
    """

    request_id: str
    prompt_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    computed_tokens: int = 0
    gpu_cached_tokens: int = 0
    loaded_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)
    miss_reason: str | None = None
    ttft_s: float | None = None
    total_s: float = 0.0
    load_wait_s: float = 0.0
    forward_s: float = 0.0
    preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        token_id: the token it generated this step, or ``None``.
        result: set when the request ended this step.
    """

    request_id: str
    token_id: int | None
    result: GenerationResult | None = None


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """Counters of a `PagedEngine`.

    Attributes:
        steps: forward passes run.
        waiting: requests not admitted yet (or preempted).
        running: admitted requests.
        computed_tokens: tokens the model computed.
        gpu_cached_tokens: prompt tokens taken from the GPU prefix cache.
        loaded_tokens: prompt tokens loaded from the CPU pool.
        preemptions: running requests preempted for lack of blocks.
        failed_loads: loads that failed (their tokens were recomputed).
        finish_errors: requests whose kvoffload handle raised while they ended (each
            result names the error; its blocks were released all the same).
        pinner_errors: how often a step's other calls on kvoffload (``request``,
            ``lookup``, ``load``, ``release``, ``preempt``, ``advance``, ``store``,
            ``drain``) raised a `PinnerError`: each was logged (``offload_call_failed``,
            with its cause) and the call made again, so no request or step result was
            lost; a request's own call is also named in its `GenerationResult.error`.
        allocator: the block allocator's counters.
        abandoned_loads: loads given up at ``load_deadline_s`` (their tokens were
            recomputed in other GPU blocks; the late copy's blocks were reused only once
            it ended).
        tier_loaded_tokens: of ``loaded_tokens``, those a secondary tier (by its name)
            promoted into the CPU pool for the request that loaded them
            (`GenerationResult.tier_tokens`, counted as the loads complete).
    """

    steps: int
    waiting: int
    running: int
    computed_tokens: int
    gpu_cached_tokens: int
    loaded_tokens: int
    preemptions: int
    failed_loads: int
    finish_errors: int
    pinner_errors: int
    allocator: AllocatorStatistics
    abandoned_loads: int = 0
    tier_loaded_tokens: dict[str, int] = field(default_factory=dict)
