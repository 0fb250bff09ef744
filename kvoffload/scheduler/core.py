"""The offload scheduler: synchronous, deterministic decisions about what to copy.

`OffloadScheduler` is a façade over the parts that each own one kind of state:

* `BlockLedger` (``ledger.py``): every reference on a CPU block, the plans in flight,
  the hashes being filled (pending stores and promotions), the blocks being loaded;
* `RequestTable` (``requests.py``): the requests by id, finished ids, the input checks;
* `StorePlanner` (``stores.py``): the store scans, admission, deferral, the cursors;
* `LoadPlanner` (``loads.py``): lookups, their pins, load plans, the tiers' hook;
* `FinishHolds` (``holds.py``): GPU blocks of finished requests kept for their stores;
* `Counters` (``stats.py``): the counters behind `SchedulerStatistics`.

The scheduler never awaits and never touches a tensor: it returns `StorePlan` and
`LoadPlan` objects for a copy engine, and is told of each transfer's outcome through
`OffloadScheduler.complete()`.

A store for which the pool has no free block is *deferred*: the request's cursor stays
where it is and the blocks are planned again on a later step. A block whose copy is in
flight holds a reference, so it is never evicted to make room (DESIGN.md invariant 2).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol, final, overload

from kvoffload._logging import get_logger
from kvoffload.config import OffloadConfig
from kvoffload.errors import (
    InvalidInputError,
    InvariantError,
    RequestStateError,
    UnhashedBlocksWarning,
)
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler.holds import FinishHolds
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.loads import LoadPlanner, LookupExtension
from kvoffload.scheduler.requests import FINISHED_IDS_REMEMBERED, RequestTable
from kvoffload.scheduler.state import RequestOffloadState, RequestPhase
from kvoffload.scheduler.stats import Counters, SchedulerStatistics
from kvoffload.scheduler.stores import GpuCacheView, StorePlanner
from kvoffload.transfer.plan import LoadPlan, StorePlan, TransferPlan

__all__ = [
    "FINISHED_IDS_REMEMBERED",
    "GpuCacheView",
    "OffloadScheduler",
    "SchedulerStatistics",
    "TransferLike",
]

_log = get_logger("scheduler")


class TransferLike(Protocol):
    """Anything that carries the plan it executes (a `TransferTask`)."""

    @property
    def plan(self) -> TransferPlan:
        """The plan the transfer executes."""


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
        self._warned_unhashed = False
        counters = self._counters = Counters(config.block_size, bytes_per_block)
        ledger = self._ledger = BlockLedger(pool)
        table = self._table = RequestTable(
            num_gpu_blocks=num_gpu_blocks, restore_evicted=config.restore_evicted
        )
        self._requests = table.requests
        stores = self._stores = StorePlanner(config, ledger, table, counters)
        self._loads = LoadPlanner(config.block_size, ledger, table, counters)
        self._holds = FinishHolds(config, table, stores, counters)

    def __repr__(self) -> str:
        return (
            f"OffloadScheduler(requests={len(self._requests)}, "
            f"in_flight={self._ledger.num_plans}, pool={self._pool!r})"
        )

    @property
    def pool(self) -> CpuBlockPool:
        """The CPU block pool."""
        return self._pool

    @property
    def ledger(self) -> BlockLedger:
        """The block ledger: the one owner of every CPU-block reference (the tiers take,
        publish and release CPU blocks through it)."""
        return self._ledger

    @property
    def config(self) -> OffloadConfig:
        """The settings."""
        return self._config

    @property
    def num_in_flight(self) -> int:
        """Transfers planned and not yet completed."""
        return self._ledger.num_plans

    def add_ref_holder(self, holder: Callable[[], Mapping[int, int]]) -> None:
        """Count references taken outside the ledger in `check_invariants()`.

        The tier manager needs none: it takes its references through `ledger`.

        Args:
            holder: returns CPU block id → references it holds now.
        """
        self._ledger.add_ref_holder(holder)

    def set_lookup_extension(self, extension: LookupExtension | None) -> None:
        """Ask ``extension`` after every lookup whether to bring in what follows the hit
        and whether to answer "ask again later" (the tier manager; ``None``: no one)."""
        self._loads.extension = extension

    def request_state(self, request_id: str) -> RequestOffloadState:
        """The state kept for ``request_id`` (read it, do not change it).

        Raises:
            UnknownRequestError: no state for that id.
        """
        return self._table.get(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether state is kept for ``request_id`` (finished requests with transfers in
        flight included)."""
        return request_id in self._requests

    def was_finished(self, request_id: str) -> bool:
        """Whether ``request_id`` belongs to a finished request (ids are never reused; the
        last ``FINISHED_IDS_REMEMBERED`` finished ids are remembered)."""
        return self._table.was_finished(request_id)

    def reserve(self, request_id: str) -> None:
        """Register ``request_id`` now, before its first call, so no one else can use it.

        `OffloadRequest` reserves its id when it is made; `finish()` gives it up (for
        good: ids are not reused). A second handle for an id in use is refused here
        instead of sharing (and mixing up) one request's state.

        Raises:
            RequestStateError: the id is in use (registered and not dropped yet) or
                finished.
        """
        self._table.reserve(request_id)

    # -- requests --------------------------------------------------------------------------

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
        state = self._table.update(rid, gpu_block_ids, block_hashes, num_computed_tokens)
        num_computed_tokens = state.num_computed_tokens
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
        state = self._table.get(request_id)
        if state.finished:
            raise RequestStateError(f"request {request_id!r} is already finished")
        held = self._holds.begin(state)
        state.move_to(RequestPhase.HOLDING if held else RequestPhase.DRAINING)
        self._table.remember_finished(request_id)
        self._loads.release_pin(state)
        if held:
            return tuple(held)
        self._stores.reset_cursor(state)
        self._table.drop_if_done(state)
        return ()

    def take_released_holds(self) -> list[int]:
        """GPU blocks whose ``finish()`` hold ended since the last call (the engine may free
        them once no transfer in flight names them: the copy that stores them is pinned
        by its own transfer)."""
        return self._holds.take_released()

    def cancel_hold(self, request_id: str) -> None:
        """Undo the hold ``finish()`` just returned for ``request_id`` (the engine could not
        keep those blocks); they are not reported by `take_released_holds()`."""
        state = self._requests.get(request_id)
        if state is not None and state.held_gpu_block_ids:
            self._holds.expire(state, report=False)

    def release_all_holds(self) -> None:
        """Give up every ``finish()`` hold now (on close); their blocks stay unstored."""
        self._holds.release_all()

    def preempt(self, request_id: str) -> None:
        """The engine preempted ``request_id`` and freed its GPU blocks.

        The cursor goes back to 0 so a re-admitted request rescans its blocks; stores in
        flight run on (their GPU blocks stay pinned through the ``GpuBlockPinner``).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it is finished.
        """
        state = self._table.live(request_id)
        self._loads.release_pin(state)
        self._stores.reset_cursor(state)
        state.gpu_block_ids = []
        state.gpu_block_set = set()
        state.num_computed_tokens = 0
        state.move_to(RequestPhase.PREEMPTED)
        state.admitted = False

    def release(self, request_id: str) -> None:
        """Drop the pin of ``request_id``'s last lookup (the engine will not load it).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: the request finished and was forgotten.
        """
        self._loads.release_pin(self._table.get(request_id))

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
        return self._loads.lookup(
            request_id,
            block_hashes,
            num_tokens,
            num_computed_tokens,
            allow_defer=allow_defer,
            no_read=no_read,
        )

    def lookup_or_defer(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        no_read: bool = False,
    ) -> int | None:
        """`lookup()` with ``allow_defer=True``: ``None`` means "ask again later"."""
        return self._loads.lookup(
            request_id,
            block_hashes,
            num_tokens,
            num_computed_tokens,
            allow_defer=True,
            no_read=no_read,
        )

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
        return self._loads.plan_load(request_id, gpu_block_ids, num_tokens)

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
        stores = self._stores
        hold_done: list[RequestOffloadState] = []
        batch = stores.scan(gpu_cache, hold_done)
        plan: StorePlan | None = None
        try:
            plan = stores.make_plan(batch)
            return plan
        finally:
            if hold_done:
                self._holds.end_planned(hold_done, plan, self._stores.undo)

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
        ledger = self._ledger
        rec = ledger.close(plan.plan_id, ok)
        counters = self._counters
        if rec is None:
            counters.ignored_completions += 1
            _log.debug("completion_ignored", plan_id=plan.plan_id, kind=plan.kind)
            return False
        current = rec.epoch == ledger.epoch
        if plan.kind == "store":
            del self._stores.undo[plan.plan_id]
        else:
            del self._loads.starts[plan.plan_id]
        counters.completed(rec, ok=ok, current=current)
        if current and not ok:
            # The poller already warned with the cause; this records what was released.
            _log.debug(
                "failed_transfer_released",
                kind=plan.kind,
                plan_id=plan.plan_id,
                blocks=len(rec.blocks),
                request_ids=",".join(plan.request_ids),
            )
        self._table.detach(plan)
        return True

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
        ledger = self._ledger
        rec = ledger.cancel(plan.plan_id)
        counters = self._counters
        if rec is None:
            counters.ignored_completions += 1
            return False
        counters.cancelled_plans += 1
        current = rec.epoch == ledger.epoch
        if plan.kind == "store":
            self._stores.cancel_plan(rec, current, self._holds.restore)
        else:
            self._loads.cancel_plan(rec, current)
        _log.debug("plan_cancelled", plan_id=plan.plan_id, kind=plan.kind)
        self._table.detach(plan)
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
        holds = self._holds
        stores = self._stores
        release_pin = self._loads.release_pin
        for state in list(self._requests.values()):
            if state.held_gpu_block_ids:
                holds.expire(state)
                continue
            release_pin(state)
            if state.num_stored_blocks:
                state.recheck_table = True
            stores.reset_cursor(state)
        stores.reset()
        self._ledger.reset()
        _log.info("cache_reset", in_flight=self._ledger.num_plans)
        return not self._ledger.num_plans

    def in_flight_plans(self) -> list[TransferPlan]:
        """Plans not yet completed, oldest first."""
        return [rec.plan for rec in self._ledger.plans()]

    # -- observation -----------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        """A snapshot of the counters."""
        return self._counters.snapshot(
            live_requests=len(self._requests),
            in_flight_transfers=self._ledger.num_plans,
            held_blocks=self._holds.total,
        )

    def check_invariants(self) -> None:
        """Check every DESIGN.md invariant the scheduler, its ledger and its pool can see
        (O(blocks)).

        Raises:
            InvariantError: naming the breach.
        """
        ledger = self._ledger
        ledger.check_invariants()
        live_refs, held = self._table.check_invariants(
            {id(p) for p in ledger.pins()}, ledger.has_plan
        )
        if live_refs != self._stores.live_refs:
            raise InvariantError("live-request block counts disagree with the cursors")
        if held != self._holds.total:
            raise InvariantError(f"held GPU blocks: {held} counted {self._holds.total}")
        plans = {rec.plan.plan_id: rec.plan.kind for rec in ledger.plans()}
        stores = {p for p, kind in plans.items() if kind == "store"}
        if stores != set(self._stores.undo) or plans.keys() - stores != set(self._loads.starts):
            raise InvariantError("the planners' records disagree with the ledger's plans")
