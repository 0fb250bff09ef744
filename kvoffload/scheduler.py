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
import operator
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, final, overload

from kvoffload._logging import get_logger
from kvoffload.config import OffloadConfig
from kvoffload.errors import (
    BlockTableError,
    InputTypeError,
    InvalidInputError,
    InvariantError,
    RequestStateError,
    UnhashedBlocksWarning,
    UnknownRequestError,
)
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.pool.policies.admission import AlwaysAdmit, make_admission
from kvoffload.request_state import RequestOffloadState
from kvoffload.transfer.plan import LoadPlan, StorePlan, TransferPlan

__all__ = [
    "FINISHED_IDS_REMEMBERED",
    "GpuCacheView",
    "OffloadScheduler",
    "SchedulerStatistics",
    "TransferLike",
]

_log = get_logger("scheduler")

FINISHED_IDS_REMEMBERED = 65536
"""How many finished request ids a scheduler remembers to refuse their reuse."""


def _as_int(value: object, what: str, rid: str) -> int:
    """``value`` as an int (numpy and torch integers too); floats and bools are refused."""
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise InputTypeError(
        f"request {rid!r}: {what}={value!r} is not an int (got {type(value).__name__})"
    )


def _length(value: object, what: str, rid: str) -> int:
    """``len(value)`` of a sequence argument; iterators and generators are refused."""
    if not hasattr(value, "__getitem__"):
        raise InputTypeError(
            f"request {rid!r}: {what} must be a sequence (list, tuple, array), got "
            f"{type(value).__name__}"
        )
    try:
        return len(value)  # type: ignore[arg-type]
    except TypeError:
        raise InputTypeError(
            f"request {rid!r}: {what} must be a sequence with a length, got {type(value).__name__}"
        ) from None


def _check_hash(value: object, what: str, rid: str) -> None:
    if type(value) is not bytes and not isinstance(value, bytes):
        raise InputTypeError(
            f"request {rid!r}: {what} must be a block hash (bytes), got {type(value).__name__}"
        )


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
        hit_tokens: tokens those lookups offered from CPU (counted at every lookup: a
            request looked up again, after a release or a deferral, counts again); what
            was used is ``loaded_tokens``.
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
        concurrent_load_blocks: blocks planned for a load while another load of the same
            CPU block was in flight (the lookup had no ``allow_defer``).
        cancelled_plans: plans undone because their launch raised (`cancel()`).
        held_blocks: GPU blocks finished requests hold now (``hold_blocks_on_finish``).
        hold_expired_blocks: held GPU blocks given up unstored after ``hold_max_steps``.
        loaded_tokens: tokens whose load completed successfully (tokens the offload tiers
            served); ``loaded_tokens / prompt_tokens`` is the prefix hit rate.
        prompt_tokens: tokens of the requests looked up, counted once per admission (at
            a request's first lookup, and again at its first lookup after a preemption),
            the engine's own prefix included.
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
    concurrent_load_blocks: int = 0
    cancelled_plans: int = 0
    held_blocks: int = 0
    hold_expired_blocks: int = 0
    loaded_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(slots=True, eq=False)
class _InFlight:
    plan: TransferPlan
    blocks: list[CpuBlock]
    hashes: tuple[BlockHash, ...]
    epoch: int
    # Where each request's run of a store ends in ``blocks`` (None: one run).
    ends: tuple[int, ...] | None = None
    # Store: (request, cursor before the plan) of every cursor it moved, for cancel().
    # Load: the request block its first CPU block holds.
    rollback: list[tuple[RequestOffloadState, int]] | None = None
    pin_start: int = 0
    # Store: finished requests whose hold this plan ended (state, held ids, cursor).
    holds: list[tuple[RequestOffloadState, list[int], int]] | None = None
    # Store: hashes the admission filter refused while this plan was built, for cancel().
    refused: tuple[BlockHash, ...] = ()


class _StoreBatch:
    """The store plan being built by one ``plan_stores`` call."""

    __slots__ = (
        "deferred",
        "deferred_request",
        "ends",
        "free",
        "get_cached",
        "gpu_ids",
        "hashes",
        "left",
        "owners",
        "pending",
        "planned",
        "protect",
        "refused",
        "rollback",
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
        self.ends: list[int] = []
        self.rollback: list[tuple[RequestOffloadState, int]] = []
        self.refused: list[BlockHash] = []

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
        num_gpu_blocks: the engine's GPU block count; block table entries must lie in
            ``[0, num_gpu_blocks)`` (``None``: only negative ids are refused).

    Every method is synchronous and returns promptly; call them from one thread (the
    engine's scheduler loop or the event loop). A call refused with an error changes
    nothing.

    Request ids are never reused: a call naming an id that finished raises
    `RequestStateError` (the last `FINISHED_IDS_REMEMBERED` finished ids are remembered;
    an older id would be taken as a new request).
    """

    def __init__(
        self,
        config: OffloadConfig,
        pool: CpuBlockPool,
        *,
        bytes_per_block: int = 0,
        num_gpu_blocks: int | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._block_size = config.block_size
        self._bytes_per_block = bytes_per_block
        self._num_gpu_blocks = num_gpu_blocks
        self._finished_ids: set[str] = set()
        self._finished_order: deque[str] = deque()
        self._loading: dict[int, int] = {}
        self._held_total = 0
        self._released_holds: list[int] = []
        self._plan_calls = 0
        self._warned_unhashed = False
        self._concurrent_load_blocks = 0
        self._cancelled = 0
        self._hold_expired = 0
        self._requests: dict[str, RequestOffloadState] = {}
        self._pending: dict[BlockHash, CpuBlock] = {}
        admission = make_admission(config.store_admission)
        self._admit = None if isinstance(admission, AlwaysAdmit) else admission.admit
        self._undo_admission = None if isinstance(admission, AlwaysAdmit) else admission.undo
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
        self._loaded_tokens = 0
        self._prompt_tokens = 0
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

    def was_finished(self, request_id: str) -> bool:
        """Whether ``request_id`` belongs to a finished request (ids are never reused; the
        last ``FINISHED_IDS_REMEMBERED`` finished ids are remembered)."""
        return request_id in self._finished_ids

    def reserve(self, request_id: str) -> None:
        """Register ``request_id`` now, before its first call, so no one else can use it.

        `OffloadRequest` reserves its id when it is made; `finish()` gives it up (for
        good: ids are not reused). A second handle for an id in use is refused here
        instead of sharing (and mixing up) one request's state.

        Raises:
            RequestStateError: the id is in use (registered and not dropped yet) or
                finished.
        """
        if request_id in self._requests:
            raise RequestStateError(
                f"request id {request_id!r} is in use (a request with that id has not "
                "finished, or its last transfer is still in flight)"
            )
        if request_id in self._finished_ids:
            raise RequestStateError(
                f"request {request_id!r} is finished (request ids are not reused)"
            )
        self._register(request_id)

    # -- requests --------------------------------------------------------------------------

    def _get(self, request_id: str) -> RequestOffloadState:
        state = self._requests.get(request_id)
        if state is None:
            if request_id in self._finished_ids:
                raise RequestStateError(
                    f"request {request_id!r} is finished (request ids are not reused)"
                )
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return state

    def _known(self, request_id: str) -> RequestOffloadState | None:
        """The state of a request that may be registered; ``None`` for a new one."""
        state = self._requests.get(request_id)
        if state is None:
            if request_id in self._finished_ids:
                raise RequestStateError(
                    f"request {request_id!r} is finished (request ids are not reused)"
                )
        elif state.finished:
            raise RequestStateError(f"request {request_id!r} is finished")
        return state

    def _register(self, request_id: str) -> RequestOffloadState:
        state = RequestOffloadState(request_id)
        self._requests[request_id] = state
        return state

    def _remember_finished(self, request_id: str) -> None:
        self._finished_ids.add(request_id)
        self._finished_order.append(request_id)
        if len(self._finished_order) > FINISHED_IDS_REMEMBERED:
            self._finished_ids.discard(self._finished_order.popleft())

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

    def _new_table_entries(
        self, state: RequestOffloadState | None, table: Sequence[int], rid: str
    ) -> list[int]:
        """Validate a block table against what is known; return its new entries.

        Checked: the table did not shrink; each new entry is an int in range and not
        already in the table; the known entries a store may still read (from the store
        cursor on, or all of them after a reset or under ``restore_evicted``) are unchanged.
        Entries below the cursor are read by nothing any more and are not compared.
        """
        n = _length(table, "gpu_block_ids", rid)
        old: list[int] = []
        seen: set[int] = set()
        check_from = 0
        if state is not None and not state.preempted:
            old, seen = state.gpu_block_ids, state.gpu_block_set
            if not (state.recheck_table or self._config.restore_evicted):
                check_from = min(state.num_stored_blocks, len(old) - 1) if old else 0
        n_old = len(old)
        if n < n_old:
            raise BlockTableError(
                f"request {rid!r}: gpu_block_ids shrank from {n_old} to {n} entries "
                "(preempt the request to start over)"
            )
        if check_from < n_old and (
            type(table) is not list or table[check_from:n_old] != old[check_from:]
        ):
            for i in range(check_from, n_old):
                if table[i] != old[i]:
                    raise BlockTableError(
                        f"request {rid!r}: gpu_block_ids[{i}] changed from {old[i]} to "
                        f"{table[i]!r} since the last call (preempt the request to start over)"
                    )
        limit = self._num_gpu_blocks
        if type(table) is list and n > n_old:
            # Fast path, all at C speed: plain ints, in range, distinct, not known yet.
            new = table[n_old:]
            fresh = set(new)
            if (
                set(map(type, new)) == {int}
                and min(new) >= 0
                and (limit is None or max(new) < limit)
                and len(fresh) == len(new)
                and fresh.isdisjoint(seen)
            ):
                return new
        new = []
        fresh = set()
        for j in range(n_old, n):
            g = _as_int(table[j], f"gpu_block_ids[{j}]", rid)
            if g < 0 or (limit is not None and g >= limit):
                raise BlockTableError(
                    f"request {rid!r}: gpu_block_ids[{j}]={g} is out of range "
                    f"[0, {limit if limit is not None else 'inf'})"
                )
            if g in seen or g in fresh:
                first = old.index(g) if g in seen else n_old + new.index(g)
                raise BlockTableError(
                    f"request {rid!r}: GPU block {g} appears twice in gpu_block_ids, at "
                    f"positions {first} and {j}"
                )
            fresh.add(g)
            new.append(g)
        return new

    @staticmethod
    def _new_hashes(
        state: RequestOffloadState | None, block_hashes: Sequence[BlockHash], rid: str
    ) -> Sequence[BlockHash]:
        n = _length(block_hashes, "block_hashes", rid)
        old = state.block_hashes if state is not None else []
        n_old = len(old)
        if n < n_old:
            raise InvalidInputError(
                f"request {rid!r}: block_hashes shrank from {n_old} to {n} entries "
                "(preempt the request to start over)"
            )
        if n_old and block_hashes[n_old - 1] != old[n_old - 1]:
            raise InvalidInputError(
                f"request {rid!r}: block_hashes[{n_old - 1}] changed since the last call"
            )
        new = block_hashes[n_old:]
        if new and set(map(type, new)) != {bytes}:
            for k, h in enumerate(new):
                _check_hash(h, f"block_hashes[{n_old + k}]", rid)
        return new

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
        Everything is checked before anything changes, so a refused call leaves the
        request (and every other) as it was.

        What is checked, in O(new entries + entries not stored yet) per call: the table
        did not shrink; every new entry is an int in ``[0, num_gpu_blocks)`` that the table
        does not hold yet; the known entries from the store cursor on (those a store still
        reads) are unchanged; after a `reset()`, or with ``restore_evicted``, every known
        entry is compared. Entries below the cursor are never read again otherwise.

        When ``num_computed_tokens`` runs more than one block past the hashed blocks, an
        `UnhashedBlocksWarning` is issued once per scheduler: blocks without a hash are
        never stored (hash generated tokens too, block by block).

        Args:
            request_id: the engine's id.
            gpu_block_ids: the request's whole GPU block table.
            block_hashes: hashes of the request's full blocks so far.
            num_computed_tokens: tokens whose KV is computed; only blocks entirely below
                it are ever stored.

        Raises:
            RequestStateError: the request is finished.
            BlockTableError: the table shrank, changed where a store still reads it, or
                holds an id out of range or twice (the message names id and positions).
            InvalidInputError: a negative token count, or hashes that shrank or changed.
            InputTypeError: a count that is not an int, a table or hash list that is not a
                sequence, a hash that is not bytes.
        """
        rid = request_id
        num_computed_tokens = _as_int(num_computed_tokens, "num_computed_tokens", rid)
        if num_computed_tokens < 0:
            raise InvalidInputError(
                f"request {rid!r}: num_computed_tokens={num_computed_tokens} is negative"
            )
        state = self._known(rid)
        new_ids = self._new_table_entries(state, gpu_block_ids, rid)
        new_hashes = self._new_hashes(state, block_hashes, rid)
        if state is None:
            state = self._register(rid)
        if state.preempted:
            state.preempted = False
            state.gpu_block_ids = []
            state.gpu_block_set = set()
        state.recheck_table = False
        state.gpu_block_ids.extend(new_ids)
        state.gpu_block_set.update(new_ids)
        state.block_hashes.extend(new_hashes)
        state.num_computed_tokens = num_computed_tokens
        if (
            num_computed_tokens // self._block_size > len(state.block_hashes) + 1
            and not self._warned_unhashed
        ):
            self._warned_unhashed = True
            warnings.warn(
                f"request {rid!r}: num_computed_tokens={num_computed_tokens} covers "
                f"{num_computed_tokens // self._block_size} full blocks but only "
                f"{len(state.block_hashes)} block hashes were given: blocks without a hash "
                "are never stored (hash each new full block, generated tokens too); "
                "this warning is issued once",
                UnhashedBlocksWarning,
                stacklevel=3,
            )

    def finish(self, request_id: str) -> tuple[int, ...]:
        """The engine finished ``request_id``: schedule nothing more for it.

        Its lookup pin is released; its state is dropped now, or when its last transfer
        completes. Its id may not be used again.

        With ``hold_blocks_on_finish`` (eager mode), computed blocks that are not stored
        yet (deferred for lack of space) are kept: the returned GPU blocks must stay
        allocated until a later ``plan_stores`` has planned them (`take_released_holds()`
        returns them then), at most ``hold_max_steps`` calls; at most ``hold_max_blocks``
        blocks are held by all finished requests together (a request's prefix first).

        Returns:
            The GPU block ids the engine must not free yet (empty unless holding).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it was already finished.
        """
        state = self._get(request_id)
        if state.finished:
            raise RequestStateError(f"request {request_id!r} is already finished")
        held = self._hold_unstored(state)
        state.finished = True
        self._remember_finished(request_id)
        self._release_pin(state)
        if held:
            state.held_gpu_block_ids = held
            state.hold_deadline = self._plan_calls + self._config.hold_max_steps
            self._held_total += len(held)
            _log.debug("blocks_held_on_finish", request_id=request_id, blocks=len(held))
            return tuple(held)
        self._reset_cursor(state)
        if not state.in_flight:
            self._drop(state)
        return ()

    def _hold_unstored(self, state: RequestOffloadState) -> list[int]:
        config = self._config
        if not config.hold_blocks_on_finish or config.store_mode != "eager" or state.preempted:
            return []
        i = state.num_stored_blocks
        end = min(
            state.num_computed_tokens // self._block_size,
            len(state.block_hashes),
            len(state.gpu_block_ids),
        )
        n = min(end - i, config.hold_max_blocks - self._held_total)
        if n <= 0:
            return []
        state.num_computed_tokens = (i + n) * self._block_size
        return state.gpu_block_ids[i : i + n]

    def _end_hold(self, state: RequestOffloadState, *, report: bool = True) -> None:
        """A finished request's held blocks are planned or given up: release them."""
        held, state.held_gpu_block_ids = state.held_gpu_block_ids, []
        self._held_total -= len(held)
        if report:
            self._released_holds.extend(held)
        self._reset_cursor(state)
        if not state.in_flight:
            self._drop(state)

    def _restore_hold(self, state: RequestOffloadState, held: list[int], cursor: int) -> None:
        """Undo the end of a hold whose store plan is cancelled, unless the engine was
        already told the blocks are free (then they stay unstored)."""
        released = self._released_holds
        counts: dict[int, int] = {}
        for g in released:
            counts[g] = counts.get(g, 0) + 1
        if any(counts.get(g, 0) < 1 for g in held):
            return
        for g in held:
            released.remove(g)
        state.held_gpu_block_ids = held
        self._held_total += len(held)
        live_refs = self._live_refs
        for block_hash in state.block_hashes[:cursor]:
            live_refs[block_hash] = live_refs.get(block_hash, 0) + 1
        state.num_stored_blocks = cursor

    def take_released_holds(self) -> list[int]:
        """GPU blocks whose ``finish()`` hold ended since the last call (the engine may free
        them once no transfer in flight names them: the copy that stores them is pinned
        by its own transfer)."""
        released, self._released_holds = self._released_holds, []
        return released

    def cancel_hold(self, request_id: str) -> None:
        """Undo the hold ``finish()`` just returned for ``request_id`` (the engine could not
        keep those blocks); they are not reported by `take_released_holds()`."""
        state = self._requests.get(request_id)
        if state is not None and state.held_gpu_block_ids:
            self._hold_expired += len(state.held_gpu_block_ids)
            self._end_hold(state, report=False)

    def release_all_holds(self) -> None:
        """Give up every ``finish()`` hold now (on close); their blocks stay unstored."""
        for state in [s for s in self._requests.values() if s.held_gpu_block_ids]:
            self._hold_expired += len(state.held_gpu_block_ids)
            self._end_hold(state)

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
        state.gpu_block_set = set()
        state.num_computed_tokens = 0
        state.preempted = True
        state.admitted = False

    def release(self, request_id: str) -> None:
        """Drop the pin of ``request_id``'s last lookup (the engine will not load it).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: the request finished and was forgotten.
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
                is being stored right now, or a hit block is being loaded for another
                request (once it landed, the engine's own GPU prefix cache serves it),
                instead of a shorter hit or a second load of the same block. Without it,
                the same CPU block may be loaded twice at once (correct, counted in
                ``concurrent_load_blocks``).
            no_read: the request must not read the cache: returns 0 and pins nothing.

        Returns:
            Loadable tokens (a multiple of the block size), or ``None`` as above.

        Raises:
            RequestStateError: the request is finished.
            InvalidInputError: token counts out of range or not block aligned.
            InputTypeError: a count that is not an int, hashes that are not a sequence of
                bytes.
        """
        bs = self._block_size
        rid = request_id
        num_tokens = _as_int(num_tokens, "num_tokens", rid)
        num_computed_tokens = _as_int(num_computed_tokens, "num_computed_tokens", rid)
        if num_tokens < 0 or not 0 <= num_computed_tokens <= num_tokens:
            raise InvalidInputError(
                f"request {rid!r}: need 0 <= num_computed_tokens "
                f"({num_computed_tokens}) <= num_tokens ({num_tokens})"
            )
        if num_computed_tokens % bs:
            raise InvalidInputError(
                f"request {rid!r}: num_computed_tokens={num_computed_tokens} is not a "
                f"multiple of block_size={bs}"
            )
        num_hashes = _length(block_hashes, "block_hashes", rid)
        start = num_computed_tokens // bs
        limit = min(num_hashes, (num_tokens - 1) // bs) if num_tokens else 0
        if not no_read:
            for k in range(start, limit):
                _check_hash(block_hashes[k], f"block_hashes[{k}]", rid)
        state = self._known(rid)
        if state is None:
            state = self._register(rid)
        self._release_pin(state)
        self._lookups += 1
        if not state.admitted:
            state.admitted = True
            self._prompt_tokens += num_tokens
        if no_read or start >= limit:
            self._miss_tokens += num_tokens - num_computed_tokens
            return 0
        hits = self._pool.lookup(itertools.islice(block_hashes, start, limit))
        end = start + len(hits)
        if allow_defer:
            loading = self._loading
            if (end < limit and block_hashes[end] in self._pending) or (
                loading and any(b.block_id in loading for b in hits)
            ):
                # The next block is being stored, or the hit is being loaded for another
                # request (its GPU copy will serve this one): ask again later.
                self._deferred_lookups += 1
                _log.debug("lookup_deferred", request_id=rid, block=end)
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

        The block table is checked before anything is planned (a refused call changes
        nothing, the pin included): entries must be ints in ``[0, num_gpu_blocks)``, no id
        may appear twice, and the destination entries must agree with a table the request
        gave to `update()` before.

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
            RequestStateError: the request finished.
            InvalidInputError: ``num_tokens`` not block aligned or above the hit.
            BlockTableError: a table too short for the destination blocks, an id out of
                range or named twice, or a destination that differs from the known table.
            InputTypeError: ``num_tokens`` or an entry is not an int, or the table is not
                a sequence.
        """
        rid = request_id
        state = self._get(rid)
        if state.finished:
            raise RequestStateError(f"request {rid!r} is finished")
        bs = self._block_size
        num_tokens = _as_int(num_tokens, "num_tokens", rid)
        pinned = state.pinned
        if num_tokens < 0 or num_tokens % bs or num_tokens > len(pinned) * bs:
            raise InvalidInputError(
                f"request {rid!r}: cannot load {num_tokens} tokens: the pinned hit "
                f"is {len(pinned) * bs} tokens and loads are whole blocks of {bs}"
            )
        n = num_tokens // bs
        start = state.pin_start_block
        table_len = _length(gpu_block_ids, "gpu_block_ids", rid)
        if table_len < start + n:
            raise BlockTableError(
                f"request {rid!r}: block table has {table_len} GPU blocks, "
                f"loading blocks {start}..{start + n - 1} needs {start + n}"
            )
        dst = self._check_load_table(state, gpu_block_ids, table_len, start, n) if n else []
        take, rest = pinned[:n], pinned[n:]
        state.pinned = []
        if rest:
            self._pool.free(rest[::-1])
        if not n:
            return None
        loading = self._loading
        for block in take:
            block_id = block.block_id
            count = loading.get(block_id, 0)
            if count:
                self._concurrent_load_blocks += 1
            loading[block_id] = count + 1
        plan = LoadPlan(
            plan_id=next(self._plan_ids),
            kind="load",
            gpu_block_ids=tuple(dst),
            cpu_block_ids=tuple(b.block_id for b in take),
            request_ids=(rid,),
            request_id=rid,
            num_tokens=num_tokens,
        )
        self._plans[plan.plan_id] = _InFlight(plan, take, (), self._epoch, pin_start=start)
        state.in_flight.add(plan.plan_id)
        self._load_plans += 1
        return plan

    def _check_load_table(
        self,
        state: RequestOffloadState,
        table: Sequence[int],
        table_len: int,
        start: int,
        n: int,
    ) -> list[int]:
        rid = state.request_id
        limit = self._num_gpu_blocks
        ids = [_as_int(table[j], f"gpu_block_ids[{j}]", rid) for j in range(table_len)]
        if len(set(ids)) != table_len:
            first_at: dict[int, int] = {}
            for j, g in enumerate(ids):
                if g in first_at:
                    raise BlockTableError(
                        f"request {rid!r}: GPU block {g} appears twice in gpu_block_ids, at "
                        f"positions {first_at[g]} and {j}"
                    )
                first_at[g] = j
        known = state.gpu_block_ids if not state.preempted else []
        for j in range(start, start + n):
            g = ids[j]
            if g < 0 or (limit is not None and g >= limit):
                raise BlockTableError(
                    f"request {rid!r}: gpu_block_ids[{j}]={g} is out of range "
                    f"[0, {limit if limit is not None else 'inf'})"
                )
            if j < len(known) and known[j] != g:
                raise BlockTableError(
                    f"request {rid!r}: gpu_block_ids[{j}]={g} differs from the table given "
                    f"to update() ({known[j]})"
                )
        return ids[start : start + n]

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
            InvalidInputError: lazy mode without ``gpu_cache``.
        """
        if self._config.store_mode == "lazy" and gpu_cache is None:
            raise InvalidInputError("store_mode='lazy' needs the engine's gpu_cache view")
        self._plan_calls += 1
        batch = _StoreBatch(self._pool, self._pending, self._config.max_store_blocks_per_step)
        hold_done: list[RequestOffloadState] = []
        if gpu_cache is not None and self._config.store_mode == "lazy":
            self._scan_lazy(gpu_cache, batch)
        else:
            if self._restore_needed and self._config.restore_evicted:
                self._scan_restore(batch)
            self._scan_eager(batch, hold_done)
        plan: StorePlan | None = None
        try:
            plan = self._make_store_plan(batch)
            return plan
        finally:
            holds = []
            for state in hold_done:
                held, cursor = state.held_gpu_block_ids, state.num_stored_blocks
                self._end_hold(state)
                if plan is not None and plan.plan_id in state.in_flight:
                    holds.append((state, held, cursor))
            if holds and plan is not None:
                self._plans[plan.plan_id].holds = holds

    def _make_store_plan(self, batch: _StoreBatch) -> StorePlan | None:
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
        ends = tuple(batch.ends) if len(batch.ends) > 1 else None
        self._plans[plan.plan_id] = _InFlight(
            plan,
            blocks,
            plan.block_hashes,
            self._epoch,
            ends,
            batch.rollback,
            refused=tuple(batch.refused),
        )
        for rid in request_ids:
            self._requests[rid].in_flight.add(plan.plan_id)
        self._store_plans += 1
        return plan

    def _scan_eager(self, batch: _StoreBatch, hold_done: list[RequestOffloadState]) -> None:
        # The hot loop: _StoreBatch.offer() inlined, with its state in locals.
        bs = self._block_size
        ends = batch.ends
        rollback = batch.rollback
        calls = self._plan_calls
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
        refused = batch.refused
        for state in self._requests.values():
            if state.finished:
                if not state.held_gpu_block_ids:
                    continue
                if calls > state.hold_deadline:
                    self._hold_expired += len(state.held_gpu_block_ids)
                    hold_done.append(state)
                    continue
            elif state.preempted or state.recheck_table:
                continue  # a table to check again first (after a reset)
            hashes = state.block_hashes
            end = min(state.num_computed_tokens // bs, len(hashes), len(state.gpu_block_ids))
            i = start = state.num_stored_blocks
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
                        refused.append(block_hash)
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
            if i != start:
                state.num_stored_blocks = i
                rollback.append((state, start))
                if len(out_hashes) > (ends[-1] if ends else 0):
                    ends.append(len(out_hashes))
            if i >= end and state.finished:
                hold_done.append(state)
        batch.free, batch.left = free, left

    def _scan_restore(self, batch: _StoreBatch) -> None:
        """Re-store blocks below live cursors that were evicted (``restore_evicted``)."""
        before = len(batch.hashes)
        for state in self._requests.values():
            if state.finished or state.preempted or state.recheck_table:
                continue
            gpu_ids = state.gpu_block_ids
            rid = state.request_id
            for i, block_hash in enumerate(state.block_hashes[: state.num_stored_blocks]):
                if not batch.offer(block_hash, gpu_ids[i], rid):
                    batch.deferred = 1
                    batch.deferred_request = rid
                    self._restored_blocks += len(batch.hashes) - before
                    self._end_run(batch)
                    return
            self._end_run(batch)
        self._restored_blocks += len(batch.hashes) - before
        self._restore_needed = False

    @staticmethod
    def _end_run(batch: _StoreBatch) -> None:
        n = len(batch.hashes)
        if n > (batch.ends[-1] if batch.ends else 0):
            batch.ends.append(n)

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

        A store's blocks return to the pool request by request in plan order, each
        request's run tail first: within a request the prefix is evicted last, and across
        requests the one the engine scheduled later stays longer.

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
        else:
            self._unmark_loading(blocks)
            if ok and current:
                self._loaded_blocks += len(blocks)
                self._loaded_tokens += len(blocks) * self._block_size
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
        pool.free(self._free_order(rec))
        self._detach(plan)
        return True

    @staticmethod
    def _free_order(rec: _InFlight) -> list[CpuBlock]:
        blocks, ends = rec.blocks, rec.ends
        if ends is None:
            return blocks[::-1]
        order: list[CpuBlock] = []
        begin = 0
        for end in ends:
            order.extend(blocks[end - 1 : begin - 1 if begin else None : -1])
            begin = end
        if begin < len(blocks):
            order.extend(blocks[: begin - 1 : -1])
        return order

    def _unmark_loading(self, blocks: list[CpuBlock]) -> None:
        loading = self._loading
        for block in blocks:
            left = loading[block.block_id] - 1
            if left:
                loading[block.block_id] = left
            else:
                del loading[block.block_id]

    def _detach(self, plan: TransferPlan) -> None:
        for rid in plan.request_ids:
            state = self._requests.get(rid)
            if state is None:
                continue
            state.in_flight.discard(plan.plan_id)
            if state.finished and not state.in_flight and not state.held_gpu_block_ids:
                self._drop(state)

    def cancel(self, transfer: TransferLike | TransferPlan) -> bool:
        """Undo a plan whose copy was never started (submitting it, or pinning its GPU
        blocks, raised): as if it had not been planned.

        A store's cursors go back where they were, so its blocks are planned again on
        the next step; its CPU blocks are released unpublished. A load's CPU blocks become
        its request's lookup pin again (load again, or ``release()``), and stay published.

        Returns:
            ``False`` when the plan is unknown or already completed (the call is ignored).
        """
        plan = transfer if isinstance(transfer, TransferPlan) else transfer.plan
        rec = self._plans.pop(plan.plan_id, None)
        if rec is None:
            self._ignored += 1
            return False
        self._cancelled += 1
        blocks = rec.blocks
        current = rec.epoch == self._epoch
        if plan.kind == "store":
            pending = self._pending
            for block, block_hash in zip(blocks, rec.hashes, strict=True):
                if pending.get(block_hash) is block:
                    del pending[block_hash]
            self._pool.free(blocks[::-1])
            self._store_plans -= 1
            if self._undo_admission is not None:
                self._undo_admission(rec.hashes, rec.refused)
            if self._config.restore_evicted:
                self._restore_needed = True  # the plan may have held re-stores
            for state, held, cursor in rec.holds or ():
                self._restore_hold(state, held, cursor)
            for state, old in rec.rollback or ():
                live = self._requests.get(state.request_id) is state
                if live and current and not state.preempted and state.num_stored_blocks > old:
                    live_refs = self._live_refs
                    for block_hash in state.block_hashes[old : state.num_stored_blocks]:
                        left = live_refs[block_hash] - 1
                        if left:
                            live_refs[block_hash] = left
                        else:
                            del live_refs[block_hash]
                    state.num_stored_blocks = old
        else:
            self._unmark_loading(blocks)
            self._load_plans -= 1
            owner = self._requests.get(plan.request_ids[0])
            if owner is not None and current and not owner.finished and not owner.pinned:
                owner.pinned = blocks
                owner.pin_start_block = rec.pin_start
            else:
                self._pool.free(blocks[::-1])
        _log.debug("plan_cancelled", plan_id=plan.plan_id, kind=plan.kind)
        self._detach(plan)
        return True

    def reset(self) -> bool:
        """Empty the CPU prefix cache.

        Every published block is unpublished now; transfers in flight are abandoned
        (they release their references without publishing when they complete); lookup
        pins are released and cursors go back to 0, so live requests store their blocks
        again, from their next `update()` on (which compares their whole block table again,
        since stores will read it from the start). When the KV itself changed (new
        weights), use a new namespace instead (an offloader whose ``model_id`` or
        ``hash_salt`` names them): old keys never match.

        Returns:
            ``True`` when no transfer is in flight any more (the cache stays empty until
            new stores complete); ``False`` while abandoned transfers are still running.
        """
        self._epoch += 1
        for state in list(self._requests.values()):
            if state.held_gpu_block_ids:
                self._hold_expired += len(state.held_gpu_block_ids)
                self._end_hold(state)
                continue
            self._release_pin(state)
            if state.num_stored_blocks:
                state.recheck_table = True
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
            concurrent_load_blocks=self._concurrent_load_blocks,
            cancelled_plans=self._cancelled,
            held_blocks=self._held_total,
            hold_expired_blocks=self._hold_expired,
            loaded_tokens=self._loaded_tokens,
            prompt_tokens=self._prompt_tokens,
        )

    def check_invariants(self) -> None:
        """Check every DESIGN.md invariant the scheduler and its pool can see (O(blocks)).

        Raises:
            InvariantError: naming the breach.
        """
        pool = self._pool
        pool.check_invariants()
        expected_refs: dict[int, int] = {}
        loading: dict[int, int] = {}
        for rec in self._plans.values():
            if rec.plan.kind == "load":
                for block in rec.blocks:
                    loading[block.block_id] = loading.get(block.block_id, 0) + 1
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
        held = 0
        for rid, state in self._requests.items():
            if state.request_id != rid:
                raise InvariantError(f"request {rid!r} is filed under another id")
            for block in state.pinned:
                expected_refs[block.block_id] = expected_refs.get(block.block_id, 0) + 1
            if state.finished and (
                state.pinned or not (state.in_flight or state.held_gpu_block_ids)
            ):
                raise InvariantError(
                    f"finished request {rid!r} kept a pin or outlived its transfers"
                )
            if state.held_gpu_block_ids and not state.finished:
                raise InvariantError(f"live request {rid!r} holds GPU blocks")
            held += len(state.held_gpu_block_ids)
            if len(state.gpu_block_set) != len(state.gpu_block_ids) or not (
                state.gpu_block_set.issuperset(state.gpu_block_ids)
            ):
                raise InvariantError(f"request {rid!r}: its block table holds an id twice")
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
        if held != self._held_total:
            raise InvariantError(f"held GPU blocks: {held} counted {self._held_total}")
        if loading != self._loading:
            raise InvariantError("blocks marked as loading disagree with the load plans")
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
