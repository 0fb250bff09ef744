"""The bridge between HTTP handlers and the engine's step loop.

`PagedEngine` batches continuously: every `PagedEngine.step` admits what fits, runs one
forward pass over the new tokens of every running request and reports them to kvoffload.
`EngineLoop` drives it from one task and hands each request's tokens to the handler that
submitted it:

* `EngineLoop.submit` queues a request (``engine.add_request``) and yields a stream of its
  token ids, then its `GenerationResult`. Leaving the ``async with`` early (the client went
  away, the handler was cancelled) aborts the request (``engine.abort``): the engine frees
  its blocks and finishes its kvoffload handle, at once or right after the step in
  progress.
* `EngineLoop.run` steps while there is work and sleeps while there is none. Cancelling it
  (shutdown) lets a forward pass in progress finish in its thread, then aborts every
  request left; the offloader, closed after it, waits for the copies in flight.
  `EngineLoop.close` ends every open request at once (the server's grace period is over).

Nothing here knows how the engine computes; an engine with ``add_request``, ``abort``,
``step``, ``has_work`` and ``statistics`` fits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvoffload import KVOffloader
from kvoffload.integrations.transformers import GenerationResult, PagedEngine

Event = int | GenerationResult
"""What a request's stream carries: each generated token id, then the result."""


class ServerClosed(Exception):
    """The loop no longer takes requests (the server is shutting down)."""


def prompt_sources(r: GenerationResult) -> dict[str, int]:
    """Where ``r``'s prompt tokens came from: ``gpu_cache`` (the engine's prefix cache),
    ``cpu_pool`` (loaded from kvoffload's CPU pool, where they were already),
    ``tier:<name>`` (loaded from the CPU pool after that secondary tier promoted them for
    this request) and ``computed`` (the rest); they add up to ``r.prompt_tokens``."""
    tiers = sum(r.tier_tokens.values())
    sources = {"gpu_cache": r.gpu_cached_tokens, "cpu_pool": r.loaded_tokens - tiers}
    for name, n in sorted(r.tier_tokens.items()):
        sources[f"tier:{name}"] = n
    sources["computed"] = r.prompt_tokens - r.gpu_cached_tokens - r.loaded_tokens
    return sources


@dataclass(frozen=True, slots=True)
class LoopStatistics:
    """Counters of an `EngineLoop`: requests by how they ended, and the completed
    requests' prompt tokens by source and their lookups' miss reasons.

    Attributes:
        prompt_tokens_by_source: over the completed requests, `prompt_sources()` added
            up (what their ``usage`` said).
        miss_reasons: completed requests by the `MissReason` value of the lookup that
            admitted each (``GenerationResult.miss_reason``; ``none``: nothing missed).
    """

    submitted: int
    completed: int
    aborted: int
    failed: int
    live: int
    prompt_tokens_by_source: dict[str, int] = field(default_factory=dict)
    miss_reasons: dict[str, int] = field(default_factory=dict)


class EngineLoop:
    """Runs `PagedEngine.step` in one task and streams results to the submitters.

    Args:
        engine: the engine, with the offloader attached (``engine.attach(off)``).
    """

    def __init__(self, engine: PagedEngine) -> None:
        self.engine = engine
        self._streams: dict[str, MemoryObjectSendStream[Event]] = {}
        self._ids = itertools.count()
        self._wake = anyio.Event()
        self._closed = False
        self._submitted = self._completed = self._aborted = self._failed = 0
        self._sources: dict[str, int] = {}
        self._reasons: dict[str, int] = {}

    @asynccontextmanager
    async def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        retain_for_s: float | None = None,
        session: str | None = None,
    ) -> AsyncIterator[MemoryObjectReceiveStream[Event]]:
        """Queue a request; yield the stream of its token ids, then its result.

        With ``retain_for_s``, its blocks are retained that long after it ends, for
        ``session`` (`PagedEngine.add_request`).

        Raises:
            ServerClosed: the server is shutting down.
            ValueError: the engine refused the request (an empty prompt, a token outside
                the vocabulary, a request that can never fit the cache); the message says
                which.
        """
        if self._closed:
            raise ServerClosed("the server is shutting down")
        rid = f"req-{next(self._ids)}"
        self.engine.add_request(
            rid, prompt, max_new_tokens=max_tokens, retain_for_s=retain_for_s, session=session
        )
        send, receive = anyio.create_memory_object_stream[Event](math.inf)
        self._streams[rid] = send
        self._submitted += 1
        self._wake.set()
        try:
            with receive:
                yield receive
        finally:
            if self._streams.pop(rid, None) is not None:
                # Left before the result: the client went away, or the handler failed.
                send.close()
                self.engine.abort(rid)  # its result, now or after this step, is dropped
                self._aborted += 1
                self._wake.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Step the engine until cancelled; start with ``await tg.start(loop.run)``."""
        task_status.started()
        try:
            while True:
                if not self.engine.has_work:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    continue
                steps = self.engine.statistics().steps
                for out in await self.engine.step():
                    self._deliver(out.request_id, out.token_id, out.result)
                if self.engine.statistics().steps == steps:
                    await anyio.sleep(0.001)  # waiting for blocks: do not spin
        finally:
            self.close()

    def close(self) -> None:
        """Take no more requests and end every open one now (idempotent).

        Each open request is aborted (``engine.abort``) and its stream ends, with its
        ``"aborted"`` result when the engine has it at once (not during a step): its
        handler answers 503, or ends its event stream with an error, and returns. The
        server calls this when its grace period at shutdown is over, so that no handler is
        left for uvicorn to cancel; cancelling `run` calls it too.
        """
        self._closed = True
        for rid, send in list(self._streams.items()):
            result = self.engine.abort(rid)
            self._aborted += 1
            if result is not None:
                send.send_nowait(result)  # finish_reason "aborted"
            send.close()
        self._streams.clear()
        self._wake.set()

    def _deliver(self, rid: str, token: int | None, result: GenerationResult | None) -> None:
        send = self._streams.get(rid)
        if send is None:
            return  # aborted by its submitter
        if token is not None:
            send.send_nowait(token)
        if result is not None:
            del self._streams[rid]
            if result.finish_reason == "error":
                self._failed += 1
            elif result.finish_reason == "aborted":
                self._aborted += 1
            else:
                self._completed += 1
                for source, n in prompt_sources(result).items():
                    self._sources[source] = self._sources.get(source, 0) + n
                if result.miss_reason is not None:
                    reason = result.miss_reason
                    self._reasons[reason] = self._reasons.get(reason, 0) + 1
            send.send_nowait(result)
            send.close()

    def statistics(self) -> LoopStatistics:
        """A snapshot of the counters."""
        return LoopStatistics(
            submitted=self._submitted,
            completed=self._completed,
            aborted=self._aborted,
            failed=self._failed,
            live=len(self._streams),
            prompt_tokens_by_source=dict(self._sources),
            miss_reasons=dict(self._reasons),
        )


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """What shutdown found once every request ended and every copy completed.

    Attributes:
        offload: whether an offloader was attached (the CPU-side counts are 0 without).
        requests: how the server's requests ended, shutdown included.
        in_flight_at_shutdown: transfers in flight when shutdown began.
        invariant_error: what a ``check_invariants()`` raised, or ``None``.
        cpu_blocks_referenced: CPU blocks still referenced (0 when whole).
        live_requests: requests the offloader still holds state for (0 when whole).
        in_flight_transfers: transfers not completed (0 when whole).
        gpu_blocks_pinned: GPU blocks a copy still pins (0 when whole).
        gpu_blocks_in_use: GPU blocks a request still holds, or that wait for a pin to go
            (0 when whole).
    """

    offload: bool
    requests: LoopStatistics
    in_flight_at_shutdown: int
    invariant_error: str | None
    cpu_blocks_referenced: int
    live_requests: int
    in_flight_transfers: int
    gpu_blocks_pinned: int
    gpu_blocks_in_use: int

    @property
    def whole(self) -> bool:
        """Whether every check passed and every reference came back."""
        return self.invariant_error is None and not any(
            (
                self.cpu_blocks_referenced,
                self.live_requests,
                self.in_flight_transfers,
                self.gpu_blocks_pinned,
                self.gpu_blocks_in_use,
            )
        )

    def describe(self) -> str:
        """One line for a log."""
        r = self.requests
        state = "whole" if self.whole else "NOT whole"
        parts = "engine and offloader" if self.offload else "engine (no offloader)"
        return (
            f"{parts} {state}: invariants "
            f"{'hold' if self.invariant_error is None else 'broken: ' + self.invariant_error}, "
            f"{self.cpu_blocks_referenced} CPU blocks referenced, "
            f"{self.gpu_blocks_pinned} GPU blocks pinned, {self.gpu_blocks_in_use} in use, "
            f"{self.in_flight_at_shutdown} transfers were in flight at shutdown; "
            f"requests: {r.completed} completed, {r.aborted} aborted, {r.failed} failed"
        )

    @classmethod
    def check(cls, off: KVOffloader | None, loop: EngineLoop, in_flight: int) -> ShutdownReport:
        """Check a closed offloader (if any) and the engine of a stopped loop."""
        engine = loop.engine
        error = None
        try:
            if off is not None:
                off.pool.check_invariants()
                off.scheduler.check_invariants()
            engine.allocator.check_invariants()
        except Exception as exc:
            error = repr(exc)
        alloc = engine.allocator.statistics()
        referenced = live = transfers = 0
        if off is not None:
            stats = off.statistics()
            referenced = stats.pool.num_blocks - stats.pool.num_free
            live = stats.scheduler.live_requests
            transfers = stats.scheduler.in_flight_transfers
        return cls(
            offload=off is not None,
            requests=loop.statistics(),
            in_flight_at_shutdown=in_flight,
            invariant_error=error,
            cpu_blocks_referenced=referenced,
            live_requests=live + loop.statistics().live,
            in_flight_transfers=transfers,
            gpu_blocks_pinned=engine.pinner.num_pinned,
            gpu_blocks_in_use=alloc.num_used + alloc.num_held,
        )
