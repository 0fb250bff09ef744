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

import anyio
import anyio.lowlevel

from kvoffload.errors import BlockStateError, TransferError
from kvoffload.integrations.transformers.allocator import GpuBlockAllocator
from kvoffload.integrations.transformers.groups import EngineGroup, hit_point, needed
from kvoffload.integrations.transformers.offload import _OffloadCalls
from kvoffload.integrations.transformers.recurrent import RecurrentState, StatePool
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
        allocators: list[GpuBlockAllocator],
        calls: _OffloadCalls,
        counters: _Counters,
        *,
        groups: tuple[EngineGroup, ...],
        state_pool: StatePool | None,
        block_size: int,
        max_batch_tokens: int,
        max_running: int,
        load_deadline_s: float | None = None,
    ) -> None:
        self.groups = groups
        """The KV cache groups, attention groups first (see `groups_of`)."""
        self.allocators = allocators
        """Per group, its block allocator (a recurrent group's: of state blocks)."""
        self._attn = [i for i, g in enumerate(groups) if g.kind != "recurrent"]
        self._rec = next((i for i, g in enumerate(groups) if g.kind == "recurrent"), None)
        self._state_pool = state_pool
        self._allocator = allocators[0]
        self._calls = calls
        self._counters = counters
        self._block_size = block_size
        self._max_tokens = max_batch_tokens
        self._max_running = max_running
        self._load_deadline = load_deadline_s
        self.waiting: deque[_Req] = deque()
        """Requests not admitted yet, or preempted (the first is admitted first)."""
        self.running: list[_Req] = []
        """Admitted requests, oldest first."""
        self.ids: set[str] = set()
        """The ids of every waiting and running request."""
        calls.tables_of = self.offload_tables

    def offload_tables(self, r: _Req) -> object:
        """What ``r``'s handle is given as its table: the first attention group's table,
        or with a multi-group offloader one table per group name (the recurrent group's:
        the state blocks of its snapshots)."""
        if not self._calls.grouped:
            return r.table
        tables: dict[str, list[int | None]] = {
            self.groups[gi].name: list(t) for gi, t in zip(self._attn, r.tables, strict=True)
        }
        if self._rec is not None:
            width = max(len(r.tables[0]) if r.tables else 0, len(r.rec_table))
            tables[self.groups[self._rec].name] = r.rec_table + [None] * (width - len(r.rec_table))
        return tables

    def add(self, r: _Req) -> None:
        """Queue a new request."""
        self.waiting.append(r)
        self.ids.add(r.request_id)

    # -- a step, in order ----------------------------------------------------------------------

    def admit(self) -> None:
        """Admit waiting requests while blocks and ``max_running`` allow, starting loads."""
        bs, calls = self._block_size, self._calls
        while self.waiting and len(self.running) < self._max_running:
            r = self.waiting[0]
            if r.tables:  # never after a `preempt`; reset rather than leak the old tables
                self.reset(r)
            n = len(r.tokens)
            if r.handle is None and calls.off is not None:
                calls.open(r)
            elif r.hasher is not None:
                r.hasher.update(r.tokens)
            tables = self._take_prefix(r, n)
            cached = len(tables[0]) if tables else 0
            hit = calls.lookup(r, cached * bs)
            if hit is None:  # a tier is promoting the prefix: ask again next step
                for gi, t in zip(self._attn, tables, strict=True):
                    self.allocators[gi].free([b for b in t if b is not None])
                return
            for gi, t in zip(self._attn, tables, strict=True):
                fresh = self.allocators[gi].allocate(-(-n // bs) - len(t))
                if fresh is None:
                    for gj, tj in zip(self._attn, tables, strict=True):
                        self.allocators[gj].free([b for b in tj if b is not None])
                    calls.release(r)
                    return  # wait until running requests free blocks
                t.extend(fresh)
            if hit and not self._load_into_state(r, cached * bs + hit):
                calls.release(r)  # no state block to load the snapshot into: compute
                hit = 0
            self.waiting.popleft()
            r.tables = tables
            r.num_cached_blocks = cached
            r.num_computed = cached * bs + hit
            r.tier_hit, reason = calls.explain(r, hit)
            if r.result.ttft_s is None:  # a first admission, not a re-admission
                r.result.gpu_cached_tokens = cached * bs
                r.result.loaded_tokens = hit
                r.result.tier_tokens = dict(r.tier_hit)
                r.result.miss_reason = reason
            self._counters.gpu_cached += cached * bs
            if hit:
                r.load_task = calls.load(r)
                if r.load_task is None:  # it could not start: recompute those tokens
                    self._load_failed(r)
            self.running.append(r)

    def _take_prefix(self, r: _Req, n: int) -> list[list[int | None]]:
        """The GPU prefix cache's hit for ``r``: per attention group, a table with one ref
        on each block the hit needs (``None`` before a sliding window's first), and the
        recurrent state started from its snapshot (`groups.hit_point` picks the hit)."""
        groups, allocs, hashes = self.groups, self.allocators, r.hashes
        if self._rec is not None:
            r.state = RecurrentState(groups[self._rec].layers)

        def has(gi: int, i: int) -> bool:
            return i < len(hashes) and allocs[gi].cached_block(hashes[i]) is not None

        if len(groups) == 1 and groups[0].kind == "full":  # the longest cached run
            return [list(allocs[0].match(hashes, (n - 1) // self._block_size))]
        point = hit_point(groups, n, has)
        tables = []
        for gi in self._attn:
            rng = needed(groups[gi], point)
            ids = [allocs[gi].cached_block(hashes[i]) for i in rng]
            allocs[gi].take([b for b in ids if b is not None])
            table: list[int | None] = [None] * rng.start
            tables.append(table + ids)
        if self._rec is not None and point and r.state is not None and self._state_pool:
            (i,) = needed(groups[self._rec], point)
            b = allocs[self._rec].cached_block(hashes[i])
            if b is not None:
                allocs[self._rec].take([b])
                self._state_pool.load(b, r.state)
                allocs[self._rec].free([b])
        return tables

    def _load_into_state(self, r: _Req, n: int) -> bool:
        """With a recurrent group and a multi-group offloader, give the load of a hit at
        ``n`` tokens a state block for the snapshot at ``n`` (``r.rec_table``); whether
        the load can go on."""
        if self._rec is None or not self._calls.grouped:
            return True
        got = self.allocators[self._rec].allocate(1)
        if got is None:
            return False
        r.rec_table = [None] * (n // self._block_size - 1) + got
        return True

    def _load_failed(self, r: _Req) -> None:
        self._counters.failed_loads += 1
        self._recompute(r)

    def _recompute(self, r: _Req) -> None:
        """``r`` computes what its load was to bring."""
        r.num_computed = r.num_cached_blocks * self._block_size
        r.tier_hit = {}
        if r.result.ttft_s is None:
            r.result.loaded_tokens = 0
            r.result.tier_tokens = {}
        held = [b for b in r.rec_table if b is not None]
        if held and self._rec is not None:  # a snapshot that did not arrive
            self.allocators[self._rec].free(held)
        r.rec_table = []

    def _loaded(self, r: _Req) -> None:
        """A load arrived: start the recurrent state from the loaded snapshot (kept in
        the GPU prefix cache), and free the sliding-window blocks below the loaded window
        (allocated for the prompt, never written)."""
        n = r.num_computed
        if self._rec is not None and r.rec_table and r.state is not None and self._state_pool:
            b = r.rec_table[n // self._block_size - 1]
            if b is not None:
                self._state_pool.load(b, r.state)
                self.allocators[self._rec].cache(r.hashes[n // self._block_size - 1], b)
        self.trim(r)

    async def await_loads(self) -> None:
        """Wait for the loads admission started (a failed one is recomputed; one past
        ``load_deadline_s`` is abandoned and recomputed, see `abandon_load`)."""
        bs, deadline = self._block_size, self._load_deadline
        for r in list(self.running):
            task, r.load_task = r.load_task, None
            if task is None:
                continue
            t0 = time.perf_counter()
            try:
                if deadline is None:
                    await task
                else:
                    with anyio.move_on_after(deadline):
                        await task
                    if not task.done():
                        self.abandon_load(r)
                        continue
                    task.result()  # a failed load raises here
                self._counters.loaded += r.num_computed - r.num_cached_blocks * bs
                tier_loaded = self._counters.tier_loaded
                for name, n in r.tier_hit.items():
                    tier_loaded[name] = tier_loaded.get(name, 0) + n
                self._loaded(r)
            except TransferError:
                # Recompute what failed to load; the blocks are the request's own.
                self._load_failed(r)
            finally:
                if r.result.ttft_s is None:
                    r.result.load_wait_s += time.perf_counter() - t0

    def abandon_load(self, r: _Req) -> None:
        """Give up ``r``'s load (every group's part of it): its copy runs on into blocks
        no computation may use until it ended, so those leave ``r``'s tables for fresh
        ones of the same group (each allocator holds them until its pinner's release
        hook; a recurrent group's state block is dropped by `_recompute`); ``r``
        recomputes the tokens, and never loads again. Without enough free blocks ``r`` is
        preempted (it starts over later)."""
        self._counters.abandoned_loads += 1
        self._recompute(r)
        r.no_load = True
        late = self._calls.abandon_load(r)
        if not late:
            return
        per_group = late if isinstance(late, dict) else {self.groups[self._attn[0]].name: late}
        swaps: list[tuple[int, list[int], list[int]]] = []
        for k, gi in enumerate(self._attn):
            ids = list(per_group.get(self.groups[gi].name, ()))
            fresh = self.allocators[gi].allocate(len(ids)) if ids else []
            if fresh is None:
                for gj, _, got in swaps:
                    self.allocators[gj].free(got)
                self.preempt(r)
                return
            swaps.append((gi, ids, fresh))
            swap = dict(zip(ids, fresh, strict=True))
            r.tables[k] = [b if b is None else swap.get(b, b) for b in r.tables[k]]
        for gi, ids, _ in swaps:
            self.allocators[gi].free(ids)

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
        """Give ``r`` blocks for ``num_tokens`` in every attention group, preempting the
        newest others if needed."""
        want = -(-num_tokens // self._block_size)
        needs = [(gi, want - len(t)) for gi, t in zip(self._attn, r.tables, strict=True)]
        while any(k > self.allocators[gi].num_free for gi, k in needs):
            victim = next(
                (v for v in reversed(self.running) if v is not r and v not in scheduled), None
            )
            if victim is None:
                return False
            self.preempt(victim)
        for (gi, k), t in zip(needs, r.tables, strict=True):
            if k > 0:
                t.extend(self.allocators[gi].allocate(k) or [])
        return True

    def trim(self, r: _Req) -> None:
        """Free the blocks of ``r``'s sliding-window groups that no later token sees (the
        table keeps ``None`` there)."""
        bs = self._block_size
        for gi, t in zip(self._attn, r.tables, strict=True):
            w = self.groups[gi].window
            if w is None:
                continue
            # block i's last position (i + 1) * bs - 1 is out of every later query's window
            # once it is <= num_computed - w
            stale = max(0, (r.num_computed - w + 1) // bs)
            gone = [t[i] for i in range(min(stale, len(t))) if t[i] is not None]
            for i in range(min(stale, len(t))):
                t[i] = None
            if gone:
                self.allocators[gi].free(gone)  # type: ignore[arg-type]

    def store_snapshots(self, r: _Req) -> None:
        """Copy the state snapshots ``r``'s step captured into the state pool, registered
        under each boundary's prefix hash (skipped when no state block is free)."""
        state, pool, gi = r.state, self._state_pool, self._rec
        if state is None or pool is None or gi is None:
            return
        snaps, state.snaps = state.snaps, {}
        alloc, hashes = self.allocators[gi], r.hashes
        layers = len(self.groups[gi].layers)
        keep = self._calls.grouped  # the request's table holds a ref on each snapshot
        rec = r.rec_table
        for i, snap in sorted(snaps.items()):
            if i >= len(hashes) or len(snap) != layers:
                continue
            if keep and i < len(rec) and rec[i] is not None:
                continue
            b = alloc.cached_block(hashes[i])
            if b is None:
                got = alloc.allocate(1)
                if got is None:
                    return
                b = got[0]
                pool.store(b, snap)
                alloc.cache(hashes[i], b)
                if not keep:
                    alloc.free(got)
            elif keep:
                alloc.take([b])
            else:
                continue
            if keep:
                rec.extend([None] * (i + 1 - len(rec)))
                rec[i] = b

    def preempt(self, r: _Req) -> None:
        """Move a running request back to the front of the waiting queue, reset."""
        self.running.remove(r)
        r.result.preemptions += 1
        self._counters.preemptions += 1
        self.waiting.appendleft(r)
        self.reset(r)

    def _free_tables(self, r: _Req) -> None:
        tables, r.tables, r.state = r.tables, [], None
        for gi, t in zip(self._attn, tables, strict=False):
            held = [b for b in t if b is not None]
            if held:
                self.allocators[gi].free(held)
        rec, r.rec_table = [b for b in r.rec_table if b is not None], []
        if rec and self._rec is not None:
            self.allocators[self._rec].free(rec)

    def reset(self, r: _Req) -> None:
        """Free ``r``'s GPU blocks and rewind it and its handle to nothing computed."""
        self._free_tables(r)
        r.num_computed, r.num_cached_blocks = 0, 0
        self._calls.preempt(r)

    async def wait_for_blocks(self) -> None:
        """Nothing could be scheduled: wait for transfers to release their pins, or yield."""
        held = any(a.statistics().num_held for a in self.allocators)
        if self._calls.off is not None and held:
            await self._calls.drain()
        else:
            await anyio.lowlevel.checkpoint()

    # -- the end of a request --------------------------------------------------------------

    def end(self, r: _Req, reason: FinishReason, error: str | None = None) -> GenerationResult:
        """Release everything ``r`` holds and close its result; never raises for kvoffload.

        ``r`` must be out of `waiting` and `running` already.
        """
        self.ids.discard(r.request_id)
        res = r.result
        res.finish_reason = reason
        res.total_s = time.perf_counter() - r.t0
        self._free_tables(r)
        notes = [error] if error is not None else []
        notes += r.notes
        finish_note = self._calls.finish(r)
        if finish_note is not None:
            notes.append(finish_note)
        res.error = "; ".join(notes) if notes else None
        return res

    def check_invariants(self) -> None:
        """See `PagedEngine.check_invariants`."""
        for gi, (g, alloc) in enumerate(zip(self.groups, self.allocators, strict=True)):
            alloc.check_invariants()
            counts = [0] * alloc.num_blocks
            pos = self._attn.index(gi) if gi in self._attn else None
            for r in self.running:
                table = r.tables[pos] if pos is not None and pos < len(r.tables) else []
                table = r.rec_table if gi == self._rec else table
                for b in table:
                    if b is not None:
                        counts[b] += 1
            for b, n in enumerate(counts):
                refs = alloc.ref_count(b)
                if refs != n:
                    raise BlockStateError(
                        f"GPU block {b}: {refs} references in the allocator, {n} in running "
                        f"requests' tables (group {g.name!r})"
                    )
        for r in self.waiting:
            held = sum(b is not None for t in (*r.tables, r.rec_table) for b in t)
            if held or r.load_task is not None:
                raise BlockStateError(
                    f"request {r.request_id!r} waits but holds {held} GPU "
                    f"blocks{' and a load' if r.load_task is not None else ''}"
                )
        ids = [r.request_id for r in (*self.waiting, *self.running)]
        if len(set(ids)) != len(ids) or set(ids) != self.ids:
            raise BlockStateError(
                f"requests {sorted(ids)} do not match the ids in use {sorted(self.ids)}"
            )
