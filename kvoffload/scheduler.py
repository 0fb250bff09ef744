"""The offload scheduler: synchronous, deterministic decisions about what to copy.

The scheduler owns the CPU block pool's references. It never awaits and never touches a
tensor: it returns `StorePlan` and
`LoadPlan` objects for a copy engine, and is told of each
transfer's outcome through `OffloadScheduler.complete()`.

A store for which the pool has no free block is *deferred*: the request's cursor stays
where it is and the blocks are planned again on a later step. A block whose copy is in
flight holds a reference, so it is never evicted to make room (DESIGN.md invariant 2).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, final, overload

from kvoffload._logging import get_logger
from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError, RequestStateError, UnknownRequestError
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.pool.policies.admission import AlwaysAdmit, make_admission
from kvoffload.request_state import RequestOffloadState
from kvoffload.transfer.plan import LoadPlan, StorePlan, TransferPlan

__all__ = ["GpuCacheView", "OffloadScheduler", "SchedulerStatistics", "TransferLike"]

_log = get_logger("scheduler")
_T = TypeVar("_T")


class GpuCacheView(Protocol):
    """The engine's cached GPU blocks, for lazy offloading."""

    def iter_eviction_order(self) -> Iterable[tuple[int, BlockHash]]:
        """Yield ``(gpu_block_id, block_hash)`` of cached, fully computed GPU blocks,
        the one the engine will evict next first."""


class TransferLike(Protocol):
    """Anything that carries the plan it executes (a `TransferTask`)."""

    @property
    def plan(self) -> TransferPlan:
        """The plan the transfer executes."""


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """Counters of an `OffloadScheduler` since it was made.

    Attributes:
        lookups: calls to ``lookup``.
        hit_tokens: tokens those lookups found on CPU.
        miss_tokens: prompt tokens past the engine's own prefix that were not found.
        deferred_lookups: lookups answered "ask again" because the next block was in flight.
        store_plans: store plans made.
        stored_blocks: blocks whose store completed and were published.
        deferred_blocks: blocks that a ``plan_stores`` call could not allocate (counted per call).
        deferred_steps: ``plan_stores`` calls that deferred anything.
        evicted_while_live: CPU blocks evicted while a live request's cursor was past them.
        restored_blocks: such blocks stored again (``restore_evicted=True``).
        load_plans: load plans made.
        loaded_blocks: blocks whose load completed.
        failed_stores: store transfers that failed (nothing published).
        failed_loads: load transfers that failed (their CPU blocks were unpublished).
        abandoned_transfers: transfers that completed after a ``reset`` (nothing published).
        ignored_completions: completions of unknown or already completed plans.
        bytes_stored: bytes of completed stores.
        bytes_loaded: bytes of completed loads.
        live_requests: requests the scheduler holds state for.
        in_flight_transfers: plans not yet completed.
    """

    lookups: int
    hit_tokens: int
    miss_tokens: int
    deferred_lookups: int
    store_plans: int
    stored_blocks: int
    deferred_blocks: int
    deferred_steps: int
    evicted_while_live: int
    restored_blocks: int
    load_plans: int
    loaded_blocks: int
    failed_stores: int
    failed_loads: int
    abandoned_transfers: int
    ignored_completions: int
    bytes_stored: int
    bytes_loaded: int
    live_requests: int
    in_flight_transfers: int


@dataclass(slots=True, eq=False)
class _InFlight:
    plan: TransferPlan
    blocks: list[CpuBlock]
    hashes: tuple[BlockHash, ...]
    epoch: int


class _StoreBatch:
    """The store plan being built by one ``plan_stores`` call."""

    __slots__ = (
        "deferred",
        "deferred_request",
        "free",
        "get_cached",
        "gpu_ids",
        "hashes",
        "left",
        "owners",
        "pending",
        "planned",
        "protect",
    )

    def __init__(self, pool: CpuBlockPool, pending: dict[BlockHash, CpuBlock], limit: int) -> None:
        self.get_cached = pool.get_cached
        self.pending = pending
        self.free = pool.num_free
        self.left = limit
        self.gpu_ids: list[int] = []
        self.hashes: list[BlockHash] = []
        self.owners: list[str] = []
        self.planned: set[BlockHash] = set()
        self.protect: set[CpuBlock] = set()
        self.deferred = 0
        self.deferred_request: str | None = None

    def offer(self, block_hash: BlockHash, gpu_block_id: int, owner: str | None) -> bool:
        """Add a block unless it is cached or in flight; ``False`` when it needs a CPU
        block and none is left (the caller defers)."""
        block = self.get_cached(block_hash)
        if block is not None:
            # Cached: skip it, and keep this plan's own allocation from evicting it while
            # a free block is left to spare (blocks planned before already counted on the
            # rest, so protecting it then would make the plan unallocatable).
            if block.ref_cnt == 0 and self.free > 0 and block not in self.protect:
                self.protect.add(block)
                self.free -= 1
            return True
        if block_hash in self.pending or block_hash in self.planned:
            return True
        if self.free <= 0 or self.left <= 0:
            return False
        self.free -= 1
        self.left -= 1
        self.planned.add(block_hash)
        self.hashes.append(block_hash)
        self.gpu_ids.append(gpu_block_id)
        if owner is not None:
            self.owners.append(owner)
        return True


@final
class OffloadScheduler:
    """Decides which blocks to store and load; keeps the pool's references exact.

    Args:
        config: the offloader's settings (block size, store mode, restore policy).
        pool: the CPU block pool this scheduler owns the references of.
        bytes_per_block: size of one CPU block, for the byte counters (0: not counted).

    Every method is synchronous and returns promptly; call them from one thread (the
    engine's scheduler loop or the event loop).
    """

    def __init__(
        self, config: OffloadConfig, pool: CpuBlockPool, *, bytes_per_block: int = 0
    ) -> None:
        self._config = config
        self._pool = pool
        self._block_size = config.block_size
        self._bytes_per_block = bytes_per_block
        self._requests: dict[str, RequestOffloadState] = {}
        self._pending: dict[BlockHash, CpuBlock] = {}
        admission = make_admission(config.store_admission)
        self._admit = None if isinstance(admission, AlwaysAdmit) else admission.admit
        self._plans: dict[int, _InFlight] = {}
        self._live_refs: dict[BlockHash, int] = {}
        self._restore_needed = False
        self._ref_holders: list[Callable[[], Mapping[int, int]]] = []
        self._plan_ids = itertools.count()
        self._epoch = 0
        self._lookups = 0
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._deferred_lookups = 0
        self._store_plans = 0
        self._stored_blocks = 0
        self._deferred_blocks = 0
        self._deferred_steps = 0
        self._evicted_while_live = 0
        self._restored_blocks = 0
        self._load_plans = 0
        self._loaded_blocks = 0
        self._failed_stores = 0
        self._failed_loads = 0
        self._abandoned = 0
        self._ignored = 0
        self._bytes_stored = 0
        self._bytes_loaded = 0

    def __repr__(self) -> str:
        return (
            f"OffloadScheduler(requests={len(self._requests)}, in_flight={len(self._plans)}, "
            f"pool={self._pool!r})"
        )

    @property
    def pool(self) -> CpuBlockPool:
        """The CPU block pool."""
        return self._pool

    @property
    def config(self) -> OffloadConfig:
        """The settings."""
        return self._config

    @property
    def num_in_flight(self) -> int:
        """Transfers planned and not yet completed."""
        return len(self._plans)

    def add_ref_holder(self, holder: Callable[[], Mapping[int, int]]) -> None:
        """Count references taken outside the scheduler in `check_invariants()`.

        Args:
            holder: returns CPU block id → references it holds now (the tier manager's
                write-downs and promotions).
        """
        self._ref_holders.append(holder)

    def request_state(self, request_id: str) -> RequestOffloadState:
        """The state kept for ``request_id`` (read it, do not change it).

        Raises:
            UnknownRequestError: no state for that id.
        """
        return self._get(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether state is kept for ``request_id`` (finished requests with transfers in
        flight included)."""
        return request_id in self._requests

    # -- requests --------------------------------------------------------------------------

    def _get(self, request_id: str) -> RequestOffloadState:
        state = self._requests.get(request_id)
        if state is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return state

    def _live(self, request_id: str) -> RequestOffloadState:
        state = self._requests.get(request_id)
        if state is None:
            state = RequestOffloadState(request_id)
            self._requests[request_id] = state
        elif state.finished:
            raise RequestStateError(f"request {request_id!r} is finished")
        return state

    def _release_pin(self, state: RequestOffloadState) -> None:
        if state.pinned:
            pinned, state.pinned = state.pinned, []
            self._pool.free(pinned[::-1])

    def _reset_cursor(self, state: RequestOffloadState) -> None:
        live_refs = self._live_refs
        for block_hash in state.block_hashes[: state.num_stored_blocks]:
            left = live_refs[block_hash] - 1
            if left:
                live_refs[block_hash] = left
            else:
                del live_refs[block_hash]
        state.num_stored_blocks = 0

    def _drop(self, state: RequestOffloadState) -> None:
        del self._requests[state.request_id]
        _log.debug("request_dropped", request_id=state.request_id)

    @staticmethod
    def _extend(dst: list[_T], src: Sequence[_T], what: str, rid: str) -> None:
        old = len(dst)
        if len(src) < old:
            raise ValueError(
                f"request {rid!r}: {what} shrank from {old} to {len(src)} entries "
                "(preempt the request to start over)"
            )
        if old and src[old - 1] != dst[old - 1]:
            raise ValueError(f"request {rid!r}: {what}[{old - 1}] changed since the last call")
        dst.extend(src[old:])

    def update(
        self,
        request_id: str,
        gpu_block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
    ) -> None:
        """Tell the scheduler what the engine holds for a request after a step.

        Registers the request on first use; calling it again with the same values changes
        nothing. Lists only grow while the request runs (a preempted request starts over).

        Args:
            request_id: the engine's id.
            gpu_block_ids: the request's whole GPU block table.
            block_hashes: hashes of the request's full blocks so far.
            num_computed_tokens: tokens whose KV is computed; only blocks entirely below
                it are ever stored.

        Raises:
            RequestStateError: the request is finished.
            ValueError: a negative token count, or a list that shrank or changed.
        """
        if num_computed_tokens < 0:
            raise ValueError(
                f"request {request_id!r}: num_computed_tokens={num_computed_tokens} is negative"
            )
        state = self._live(request_id)
        if state.preempted:
            state.preempted = False
            state.gpu_block_ids = []
        self._extend(state.gpu_block_ids, gpu_block_ids, "gpu_block_ids", request_id)
        self._extend(state.block_hashes, block_hashes, "block_hashes", request_id)
        state.num_computed_tokens = num_computed_tokens

    def finish(self, request_id: str) -> None:
        """The engine finished ``request_id``: schedule nothing more for it.

        Its lookup pin is released; its state is dropped now, or when its last transfer
        completes.

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it was already finished.
        """
        state = self._get(request_id)
        if state.finished:
            raise RequestStateError(f"request {request_id!r} is already finished")
        state.finished = True
        self._release_pin(state)
        self._reset_cursor(state)
        if not state.in_flight:
            self._drop(state)

    def preempt(self, request_id: str) -> None:
        """The engine preempted ``request_id`` and freed its GPU blocks.

        The cursor goes back to 0 so a re-admitted request rescans its blocks; stores in
        flight run on (their GPU blocks stay pinned through the ``GpuBlockPinner``).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it is finished.
        """
        state = self._get(request_id)
        if state.finished:
            raise RequestStateError(f"request {request_id!r} is finished")
        self._release_pin(state)
        self._reset_cursor(state)
        state.gpu_block_ids = []
        state.num_computed_tokens = 0
        state.preempted = True

    def release(self, request_id: str) -> None:
        """Drop the pin of ``request_id``'s last lookup (the engine will not load it).

        Raises:
            UnknownRequestError: no state for that id.
        """
        self._release_pin(self._get(request_id))

    # -- loads -----------------------------------------------------------------------------

    @overload
    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: Literal[False] = False,
        no_read: bool = False,
    ) -> int: ...

    @overload
    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: bool,
        no_read: bool = False,
    ) -> int | None: ...

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: bool = False,
        no_read: bool = False,
    ) -> int | None:
        """How many tokens past the engine's own prefix can be loaded from CPU.

        The hit is the longest run of published blocks starting at the engine's prefix,
        and never covers the prompt's last token (a prompt of exactly N full blocks hits
        at most N-1). The hit blocks are pinned until `plan_load()` or
        `release()`; a repeated lookup for the same request drops its previous pin.

        Args:
            request_id: the engine's id (registered on first use).
            block_hashes: hashes of the prompt's full blocks.
            num_tokens: prompt length in tokens.
            num_computed_tokens: tokens the engine already holds (its own prefix cache), a
                multiple of the block size.
            allow_defer: return ``None`` ("ask again later") when the block after the hit
                is being stored right now, instead of a shorter hit.
            no_read: the request must not read the cache: returns 0 and pins nothing.

        Returns:
            Loadable tokens (a multiple of the block size), or ``None`` as above.

        Raises:
            RequestStateError: the request is finished.
            ValueError: token counts out of range or not block aligned.
        """
        bs = self._block_size
        if num_tokens < 0 or not 0 <= num_computed_tokens <= num_tokens:
            raise ValueError(
                f"request {request_id!r}: need 0 <= num_computed_tokens "
                f"({num_computed_tokens}) <= num_tokens ({num_tokens})"
            )
        if num_computed_tokens % bs:
            raise ValueError(
                f"request {request_id!r}: num_computed_tokens={num_computed_tokens} is not a "
                f"multiple of block_size={bs}"
            )
        state = self._live(request_id)
        self._release_pin(state)
        self._lookups += 1
        start = num_computed_tokens // bs
        limit = min(len(block_hashes), (num_tokens - 1) // bs) if num_tokens else 0
        if no_read or start >= limit:
            self._miss_tokens += num_tokens - num_computed_tokens
            return 0
        hits = self._pool.lookup(itertools.islice(block_hashes, start, limit))
        end = start + len(hits)
        if allow_defer and end < limit and block_hashes[end] in self._pending:
            self._deferred_lookups += 1
            _log.debug("lookup_deferred", request_id=request_id, block=end)
            return None
        if hits:
            self._pool.touch(hits)
            state.pinned = hits
            state.pin_start_block = start
        hit_tokens = len(hits) * bs
        self._hit_tokens += hit_tokens
        self._miss_tokens += num_tokens - num_computed_tokens - hit_tokens
        return hit_tokens

    def plan_load(
        self, request_id: str, gpu_block_ids: Sequence[int], num_tokens: int
    ) -> LoadPlan | None:
        """Plan the load of the part of the last lookup's hit that the engine accepted.

        Args:
            request_id: the request.
            gpu_block_ids: the request's whole GPU block table; the block holding request
                block ``i`` is ``gpu_block_ids[i]``. Loaded blocks go to the entries
                after the engine's own prefix.
            num_tokens: tokens to load, a multiple of the block size and at most the
                lookup's hit; the rest of the pin is released.

        Returns:
            The plan (its CPU blocks stay referenced until `complete()`), or ``None``
            when ``num_tokens`` is 0.

        Raises:
            UnknownRequestError: no state for that id.
            ValueError: ``num_tokens`` not block aligned or above the hit, or a block
                table too short for the destination blocks.
        """
        state = self._get(request_id)
        bs = self._block_size
        pinned = state.pinned
        if num_tokens < 0 or num_tokens % bs or num_tokens > len(pinned) * bs:
            raise ValueError(
                f"request {request_id!r}: cannot load {num_tokens} tokens: the pinned hit "
                f"is {len(pinned) * bs} tokens and loads are whole blocks of {bs}"
            )
        n = num_tokens // bs
        start = state.pin_start_block
        if len(gpu_block_ids) < start + n:
            raise ValueError(
                f"request {request_id!r}: block table has {len(gpu_block_ids)} GPU blocks, "
                f"loading blocks {start}..{start + n - 1} needs {start + n}"
            )
        take, rest = pinned[:n], pinned[n:]
        state.pinned = []
        if rest:
            self._pool.free(rest[::-1])
        if not n:
            return None
        plan = LoadPlan(
            plan_id=next(self._plan_ids),
            kind="load",
            gpu_block_ids=tuple(gpu_block_ids[start : start + n]),
            cpu_block_ids=tuple(b.block_id for b in take),
            request_ids=(request_id,),
            request_id=request_id,
            num_tokens=num_tokens,
        )
        self._plans[plan.plan_id] = _InFlight(plan, take, (), self._epoch)
        state.in_flight.add(plan.plan_id)
        self._load_plans += 1
        return plan

    # -- stores ----------------------------------------------------------------------------

    def plan_stores(self, gpu_cache: GpuCacheView | None = None) -> StorePlan | None:
        """Plan the stores of this step for every live request, as one batch.

        Eager mode scans each request from its cursor over newly computed full blocks;
        lazy mode walks ``gpu_cache`` from the block closest to eviction. Blocks already
        cached or in flight are skipped. When the pool runs out of free blocks the rest is
        deferred: cursors stay, nothing referenced is evicted, and a ``store_deferred``
        event is logged.

        Args:
            gpu_cache: the engine's cache view; required in lazy mode, ignored in eager.

        Returns:
            The plan (its CPU blocks hold a reference until `complete()`), or ``None``.

        Raises:
            ValueError: lazy mode without ``gpu_cache``.
        """
        batch = _StoreBatch(self._pool, self._pending, self._config.max_store_blocks_per_step)
        if self._config.store_mode == "lazy":
            if gpu_cache is None:
                raise ValueError("store_mode='lazy' needs the engine's gpu_cache view")
            self._scan_lazy(gpu_cache, batch)
        else:
            if self._restore_needed and self._config.restore_evicted:
                self._scan_restore(batch)
            self._scan_eager(batch)
        if batch.deferred:
            self._deferred_blocks += batch.deferred
            self._deferred_steps += 1
            _log.debug(
                "store_deferred",
                request_id=batch.deferred_request,
                needed=batch.deferred,
                free=self._pool.num_free,
                protected=len(batch.protect),
                planned=len(batch.hashes),
            )
        if not batch.hashes:
            return None
        evicted: list[BlockHash] = []
        blocks = self._pool.allocate(len(batch.hashes), protect=batch.protect, evicted=evicted)
        live_refs = self._live_refs
        for block_hash in evicted:
            if block_hash in live_refs:
                self._evicted_while_live += 1
                self._restore_needed = True
        pending = self._pending
        for block, block_hash in zip(blocks, batch.hashes, strict=True):
            pending[block_hash] = block
        request_ids = tuple(dict.fromkeys(batch.owners))
        plan = StorePlan(
            plan_id=next(self._plan_ids),
            kind="store",
            gpu_block_ids=tuple(batch.gpu_ids),
            cpu_block_ids=tuple(b.block_id for b in blocks),
            request_ids=request_ids,
            block_hashes=tuple(batch.hashes),
        )
        self._plans[plan.plan_id] = _InFlight(plan, blocks, plan.block_hashes, self._epoch)
        for rid in request_ids:
            self._requests[rid].in_flight.add(plan.plan_id)
        self._store_plans += 1
        return plan

    def _scan_eager(self, batch: _StoreBatch) -> None:
        # The hot loop: _StoreBatch.offer() inlined, with its state in locals.
        bs = self._block_size
        live_refs = self._live_refs
        get_cached = batch.get_cached
        pending = batch.pending
        planned = batch.planned
        protect = batch.protect
        out_hashes = batch.hashes
        out_gpu = batch.gpu_ids
        owners = batch.owners
        free, left = batch.free, batch.left
        admit = self._admit
        for state in self._requests.values():
            if state.finished or state.preempted:
                continue
            hashes = state.block_hashes
            end = min(state.num_computed_tokens // bs, len(hashes), len(state.gpu_block_ids))
            i = state.num_stored_blocks
            if batch.deferred:
                batch.deferred += max(0, end - i)
                continue
            gpu_ids = state.gpu_block_ids
            rid = state.request_id
            while i < end:
                block_hash = hashes[i]
                block = get_cached(block_hash)
                if block is not None:
                    if block.ref_cnt == 0 and free > 0 and block not in protect:
                        protect.add(block)
                        free -= 1
                elif block_hash not in pending and block_hash not in planned:
                    if free <= 0 or left <= 0:
                        batch.deferred = end - i
                        batch.deferred_request = rid
                        break
                    if admit is not None and not admit(block_hash):
                        live_refs[block_hash] = live_refs.get(block_hash, 0) + 1
                        i += 1
                        continue  # refused by OffloadConfig.store_admission
                    free -= 1
                    left -= 1
                    planned.add(block_hash)
                    out_hashes.append(block_hash)
                    out_gpu.append(gpu_ids[i])
                    owners.append(rid)
                live_refs[block_hash] = live_refs.get(block_hash, 0) + 1
                i += 1
            state.num_stored_blocks = i
        batch.free, batch.left = free, left

    def _scan_restore(self, batch: _StoreBatch) -> None:
        """Re-store blocks below live cursors that were evicted (``restore_evicted``)."""
        before = len(batch.hashes)
        for state in self._requests.values():
            if state.finished or state.preempted:
                continue
            gpu_ids = state.gpu_block_ids
            rid = state.request_id
            for i, block_hash in enumerate(state.block_hashes[: state.num_stored_blocks]):
                if not batch.offer(block_hash, gpu_ids[i], rid):
                    batch.deferred = 1
                    batch.deferred_request = rid
                    self._restored_blocks += len(batch.hashes) - before
                    return
        self._restored_blocks += len(batch.hashes) - before
        self._restore_needed = False

    def _scan_lazy(self, gpu_cache: GpuCacheView, batch: _StoreBatch) -> None:
        window = itertools.islice(gpu_cache.iter_eviction_order(), self._config.lazy_offload_blocks)
        for gpu_block_id, block_hash in window:
            if not batch.offer(block_hash, gpu_block_id, None):
                batch.deferred = 1
                return

    # -- completion ------------------------------------------------------------------------

    def complete(self, transfer: TransferLike | TransferPlan, ok: bool) -> bool:
        """Record the outcome of a transfer; called exactly once per plan.

        A successful store publishes its hashes (only now are they findable); a failed
        or abandoned one publishes nothing. A failed load unpublishes its CPU blocks (their
        next user recomputes). Every reference the plan held is released, and a finished
        request whose last transfer this was is dropped.

        Args:
            transfer: the `TransferTask`, or its plan.
            ok: whether the copy succeeded.

        Returns:
            ``False`` when the plan is unknown or already completed (the call is ignored).
        """
        plan = transfer if isinstance(transfer, TransferPlan) else transfer.plan
        rec = self._plans.pop(plan.plan_id, None)
        if rec is None:
            self._ignored += 1
            _log.debug("completion_ignored", plan_id=plan.plan_id, kind=plan.kind)
            return False
        pool = self._pool
        blocks = rec.blocks
        current = rec.epoch == self._epoch
        nbytes = len(blocks) * self._bytes_per_block
        if plan.kind == "store":
            pending = self._pending
            publish = ok and current
            for block, block_hash in zip(blocks, rec.hashes, strict=True):
                if pending.get(block_hash) is block:
                    del pending[block_hash]
                if publish:
                    pool.publish(block, block_hash)
            if publish:
                self._stored_blocks += len(blocks)
                self._bytes_stored += nbytes
        elif ok and current:
            self._loaded_blocks += len(blocks)
            self._bytes_loaded += nbytes
        elif not ok:
            for block in blocks:
                pool.unpublish(block)
        if not current:
            self._abandoned += 1
        elif not ok:
            if plan.kind == "store":
                self._failed_stores += 1
            else:
                self._failed_loads += 1
            # The poller already warned with the cause; this records what was released.
            _log.debug(
                "failed_transfer_released",
                kind=plan.kind,
                plan_id=plan.plan_id,
                blocks=len(blocks),
                request_ids=",".join(plan.request_ids),
            )
        pool.free(blocks[::-1])
        for rid in plan.request_ids:
            state = self._requests.get(rid)
            if state is None:
                continue
            state.in_flight.discard(plan.plan_id)
            if state.finished and not state.in_flight:
                self._drop(state)
        return True

    def reset(self) -> bool:
        """Empty the CPU prefix cache.

        Every published block is unpublished now; transfers in flight are abandoned
        (they release their references without publishing when they complete); lookup
        pins are released and cursors go back to 0, so live requests store their blocks
        again. When the KV itself changed (new weights), use a new namespace instead (an
        offloader whose ``model_id`` or ``hash_salt`` names them): old keys never match.

        Returns:
            ``True`` when no transfer is in flight any more (the cache stays empty until
            new stores complete); ``False`` while abandoned transfers are still running.
        """
        self._epoch += 1
        for state in self._requests.values():
            self._release_pin(state)
            self._reset_cursor(state)
        self._pending.clear()
        self._restore_needed = False
        self._pool.unpublish_all()
        _log.info("cache_reset", in_flight=len(self._plans))
        return not self._plans

    def in_flight_plans(self) -> list[TransferPlan]:
        """Plans not yet completed, oldest first."""
        return [rec.plan for rec in self._plans.values()]

    # -- observation -----------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        """A snapshot of the counters."""
        return SchedulerStatistics(
            lookups=self._lookups,
            hit_tokens=self._hit_tokens,
            miss_tokens=self._miss_tokens,
            deferred_lookups=self._deferred_lookups,
            store_plans=self._store_plans,
            stored_blocks=self._stored_blocks,
            deferred_blocks=self._deferred_blocks,
            deferred_steps=self._deferred_steps,
            evicted_while_live=self._evicted_while_live,
            restored_blocks=self._restored_blocks,
            load_plans=self._load_plans,
            loaded_blocks=self._loaded_blocks,
            failed_stores=self._failed_stores,
            failed_loads=self._failed_loads,
            abandoned_transfers=self._abandoned,
            ignored_completions=self._ignored,
            bytes_stored=self._bytes_stored,
            bytes_loaded=self._bytes_loaded,
            live_requests=len(self._requests),
            in_flight_transfers=len(self._plans),
        )

    def check_invariants(self) -> None:
        """Check every DESIGN.md invariant the scheduler and its pool can see (O(blocks)).

        Raises:
            InvariantError: naming the breach.
        """
        pool = self._pool
        pool.check_invariants()
        expected_refs: dict[int, int] = {}
        for rec in self._plans.values():
            for block in rec.blocks:
                if block.ref_cnt < 1:
                    raise InvariantError(
                        f"block {block.block_id} of in-flight plan {rec.plan.plan_id} has "
                        f"ref_cnt {block.ref_cnt}"
                    )
                expected_refs[block.block_id] = expected_refs.get(block.block_id, 0) + 1
        for holder in self._ref_holders:
            for block_id, n in holder().items():
                expected_refs[block_id] = expected_refs.get(block_id, 0) + n
        live_refs: dict[BlockHash, int] = {}
        for rid, state in self._requests.items():
            if state.request_id != rid:
                raise InvariantError(f"request {rid!r} is filed under another id")
            for block in state.pinned:
                expected_refs[block.block_id] = expected_refs.get(block.block_id, 0) + 1
            if state.finished and (state.pinned or not state.in_flight):
                raise InvariantError(
                    f"finished request {rid!r} kept a pin or outlived its transfers"
                )
            if state.preempted and state.num_stored_blocks:
                raise InvariantError(
                    f"preempted request {rid!r} has cursor {state.num_stored_blocks}"
                )
            if not 0 <= state.num_stored_blocks <= len(state.block_hashes):
                raise InvariantError(
                    f"request {rid!r}: cursor {state.num_stored_blocks} outside "
                    f"[0, {len(state.block_hashes)}]"
                )
            for plan_id in state.in_flight:
                if plan_id not in self._plans:
                    raise InvariantError(f"request {rid!r} waits on unknown plan {plan_id}")
            for block_hash in state.block_hashes[: state.num_stored_blocks]:
                live_refs[block_hash] = live_refs.get(block_hash, 0) + 1
        if live_refs != self._live_refs:
            raise InvariantError("live-request block counts disagree with the cursors")
        for block_id in range(pool.num_blocks):
            block = pool.block(block_id)
            if block.ref_cnt != expected_refs.get(block_id, 0):
                raise InvariantError(
                    f"block {block_id}: ref_cnt {block.ref_cnt} but plans and pins hold "
                    f"{expected_refs.get(block_id, 0)}"
                )
        for block_hash, block in self._pending.items():
            if pool.is_cached(block_hash):
                raise InvariantError(
                    f"hash of in-flight block {block.block_id} is already published"
                )
            if block.ref_cnt < 1:
                raise InvariantError(f"in-flight block {block.block_id} has no reference")
