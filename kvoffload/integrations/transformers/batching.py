"""`PagedEngine`'s batching: which requests wait, which run, and what each step computes.

`_Batcher` owns the waiting queue, the running list and the ids in use. Each step it admits
waiting requests (the GPU prefix cache's match, then kvoffload's lookup and load of the
rest), waits for their loads, and schedules the running ones (decodes first, then chunks of
prefill, up to ``max_batch_tokens``), growing their tables and preempting the newest others
when blocks run out. A request is in one place at a time: waiting (it holds no GPU block
and no load) or running (it holds its table). A request preempted during a step's
scheduling is not scheduled again in that step; it goes back to the front of the waiting
queue with its blocks freed and its handle preempted. `_Batcher.end` is the one way a
request ends: its blocks and id are released and its result closed, whatever kvoffload says.
"""

from __future__ import annotations

import time
from collections import deque
from typing import final

import anyio.lowlevel

from kvoffload.errors import BlockStateError, TransferError
from kvoffload.integrations.transformers.allocator import GpuBlockAllocator
from kvoffload.integrations.transformers.offload import _OffloadCalls
from kvoffload.integrations.transformers.results import FinishReason, GenerationResult
from kvoffload.integrations.transformers.state import _Counters, _Req

__all__: list[str] = []

_Segments = list[tuple[_Req, int]]
"""A step's batch: each scheduled request with its number of new tokens."""


@final
class _Batcher:
    """The requests of one `PagedEngine` and the decisions of its steps."""

    def __init__(
        self,
        allocator: GpuBlockAllocator,
        calls: _OffloadCalls,
        counters: _Counters,
        *,
        block_size: int,
        max_batch_tokens: int,
        max_running: int,
    ) -> None:
        self._allocator = allocator
        self._calls = calls
        self._counters = counters
        self._block_size = block_size
        self._max_tokens = max_batch_tokens
        self._max_running = max_running
        self.waiting: deque[_Req] = deque()
        """Requests not admitted yet, or preempted (the first is admitted first)."""
        self.running: list[_Req] = []
        """Admitted requests, oldest first."""
        self.ids: set[str] = set()
        """The ids of every waiting and running request."""

    def add(self, r: _Req) -> None:
        """Queue a new request."""
        self.waiting.append(r)
        self.ids.add(r.request_id)

    # -- a step, in order ----------------------------------------------------------------------

    def admit(self) -> None:
        """Admit waiting requests while blocks and ``max_running`` allow, starting loads."""
        bs, calls, alloc = self._block_size, self._calls, self._allocator
        while self.waiting and len(self.running) < self._max_running:
            r = self.waiting[0]
            if r.table:  # never after a `preempt`; reset rather than leak the old table
                self.reset(r)
            n = len(r.tokens)
            if r.handle is None and calls.off is not None:
                calls.open(r)
            elif r.hasher is not None:
                r.hasher.update(r.tokens)
            matched = alloc.match(r.hashes, (n - 1) // bs)
            hit = calls.lookup(r, len(matched) * bs)
            if hit is None:  # a tier is promoting the prefix: ask again next step
                alloc.free(matched)
                return
            fresh = alloc.allocate(-(-n // bs) - len(matched))
            if fresh is None:
                alloc.free(matched)
                calls.release(r)
                return  # wait until running requests free blocks
            self.waiting.popleft()
            r.table = matched + fresh
            r.num_cached_blocks = len(matched)
            r.num_computed = len(matched) * bs + hit
            if r.result.ttft_s is None:  # a first admission, not a re-admission
                r.result.gpu_cached_tokens = len(matched) * bs
                r.result.loaded_tokens = hit
            self._counters.gpu_cached += len(matched) * bs
            if hit:
                r.load_task = calls.load(r)
                if r.load_task is None:  # it could not start: recompute those tokens
                    self._load_failed(r)
            self.running.append(r)

    def _load_failed(self, r: _Req) -> None:
        self._counters.failed_loads += 1
        r.num_computed = r.num_cached_blocks * self._block_size
        if r.result.ttft_s is None:
            r.result.loaded_tokens = 0

    async def await_loads(self) -> None:
        """Wait for the loads admission started (a failed one is recomputed)."""
        bs = self._block_size
        for r in self.running:
            task, r.load_task = r.load_task, None
            if task is None:
                continue
            t0 = time.perf_counter()
            try:
                await task
                self._counters.loaded += task.plan.num_blocks * bs
            except TransferError:
                # Recompute what failed to load; the blocks are the request's own.
                self._load_failed(r)
            finally:
                if r.result.ttft_s is None:
                    r.result.load_wait_s += time.perf_counter() - t0

    def schedule(self) -> _Segments:
        """This step's batch: decodes first, then prefill chunks, within the token budget."""
        budget = self._max_tokens
        segs: _Segments = []
        decoding = [r for r in self.running if r.num_computed == len(r.tokens) - 1]
        prefilling = [r for r in self.running if r.num_computed < len(r.tokens) - 1]
        for r in decoding + prefilling:
            if budget <= 0:
                break
            if r not in self.running:
                continue  # preempted by an earlier request's `grow` in this loop
            q = min(len(r.tokens) - r.num_computed, budget)
            if not self.grow(r, r.num_computed + q, [s for s, _ in segs]):
                continue
            segs.append((r, q))
            budget -= q
        return segs

    def grow(self, r: _Req, num_tokens: int, scheduled: list[_Req]) -> bool:
        """Give ``r`` blocks for ``num_tokens``, preempting the newest others if needed."""
        need = -(-num_tokens // self._block_size) - len(r.table)
        while need > self._allocator.num_free:
            victim = next(
                (v for v in reversed(self.running) if v is not r and v not in scheduled), None
            )
            if victim is None:
                return False
            self.preempt(victim)
        if need > 0:
            r.table += self._allocator.allocate(need) or []
        return True

    def preempt(self, r: _Req) -> None:
        """Move a running request back to the front of the waiting queue, reset."""
        self.running.remove(r)
        r.result.preemptions += 1
        self._counters.preemptions += 1
        self.waiting.appendleft(r)
        self.reset(r)

    def reset(self, r: _Req) -> None:
        """Free ``r``'s GPU blocks and rewind it and its handle to nothing computed."""
        table, r.table, r.num_computed, r.num_cached_blocks = r.table, [], 0, 0
        self._allocator.free(table)
        self._calls.preempt(r)

    async def wait_for_blocks(self) -> None:
        """Nothing could be scheduled: wait for transfers to release their pins, or yield."""
        if self._calls.off is not None and self._allocator.statistics().num_held:
            await self._calls.drain()
        else:
            await anyio.lowlevel.checkpoint()

    # -- the end of a request --------------------------------------------------------------

    def end(self, r: _Req, reason: FinishReason, error: str | None = None) -> GenerationResult:
        """Release everything ``r`` holds and close its result; never raises for kvoffload.

        ``r`` must be out of `waiting` and `running` already.
        """
        table, r.table = r.table, []
        self.ids.discard(r.request_id)
        res = r.result
        res.finish_reason = reason
        res.total_s = time.perf_counter() - r.t0
        if table:
            self._allocator.free(table)
        notes = [error] if error is not None else []
        notes += r.notes
        finish_note = self._calls.finish(r)
        if finish_note is not None:
            notes.append(finish_note)
        res.error = "; ".join(notes) if notes else None
        return res

    def check_invariants(self) -> None:
        """See `PagedEngine.check_invariants`."""
        alloc = self._allocator
        alloc.check_invariants()
        counts = [0] * alloc.num_blocks
        for r in self.running:
            for b in r.table:
                counts[b] += 1
        for b, n in enumerate(counts):
            refs = alloc.ref_count(b)
            if refs != n:
                raise BlockStateError(
                    f"GPU block {b}: {refs} references in the allocator, {n} in running "
                    "requests' tables"
                )
        for r in self.waiting:
            if r.table or r.load_task is not None:
                raise BlockStateError(
                    f"request {r.request_id!r} waits but holds {len(r.table)} GPU "
                    f"blocks{' and a load' if r.load_task is not None else ''}"
                )
        ids = [r.request_id for r in (*self.waiting, *self.running)]
        if len(set(ids)) != len(ids) or set(ids) != self.ids:
            raise BlockStateError(
                f"requests {sorted(ids)} do not match the ids in use {sorted(self.ids)}"
            )
