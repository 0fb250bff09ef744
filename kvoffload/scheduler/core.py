"""The offload scheduler: synchronous, deterministic decisions about what to copy.

`OffloadScheduler` is the face over the parts that each own one kind of state: the
`BlockLedger` (``ledger.py``: every CPU-block reference, plans in flight, pending
hashes), the `RequestTable` (``requests.py``), the `StorePlanner` (``stores.py``: scans,
deferral, cursors), the `LoadPlanner` (``loads.py``: lookups, pins), the `FinishHolds`
(``holds.py``), the `PlanOutcomes` (``outcomes.py``: how each plan ends) and the
`Counters` (``stats.py``); ``checks.py`` compares their records. It never awaits and
never touches a tensor: it returns plans for a copy engine and hears each outcome through
`complete()`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal, final, overload

from kvoffload.config import OffloadConfig
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.scheduler.checks import check_parts
from kvoffload.scheduler.holds import FinishHolds
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.loads import LoadPlanner, LookupExtension
from kvoffload.scheduler.outcomes import PlanOutcomes, TransferLike
from kvoffload.scheduler.requests import FINISHED_IDS_REMEMBERED, RequestTable
from kvoffload.scheduler.state import RequestOffloadState
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


@final
class OffloadScheduler:
    """Decides which blocks to store and load; keeps the pool's references exact.

    Args:
        config: the offloader's settings (block size, store mode, restore policy).
        pool: the CPU block pool this scheduler owns the references of.
        bytes_per_block: size of one CPU block, for the byte counters (0: not counted).
        num_gpu_blocks: the engine's GPU block count; block table entries must lie in
            ``[0, num_gpu_blocks)`` (``None``: only negative ids are refused).

    Every method is synchronous; call them from one thread. A call refused with an error
    changes nothing. Request ids are never reused: a call naming one of the last
    `FINISHED_IDS_REMEMBERED` finished ids raises `RequestStateError`.
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
        counters = self._counters = Counters(config.block_size, bytes_per_block)
        ledger = self._ledger = BlockLedger(pool)
        table = self._table = RequestTable(
            num_gpu_blocks=num_gpu_blocks,
            restore_evicted=config.restore_evicted,
            block_size=config.block_size,
        )
        self._requests = table.requests
        stores = self._stores = StorePlanner(config, ledger, table, counters)
        loads = self._loads = LoadPlanner(config.block_size, ledger, table, counters)
        holds = self._holds = FinishHolds(config, table, stores, counters)
        self._outcomes = PlanOutcomes(ledger, table, stores, loads, holds, counters)

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
        """The block ledger, the one owner of every CPU-block reference (the tiers')."""
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
        """Count the references ``holder()`` (CPU block id → refs) holds outside the
        ledger in `check_invariants()`."""
        self._ledger.add_ref_holder(holder)

    @property
    def clock(self) -> Callable[[], float]:
        """The clock of the deferral deadline (``time.monotonic``; a test may drive its
        own), as `GroupedScheduler.clock`."""
        return self._loads.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._loads.clock = clock

    def set_lookup_extension(self, extension: LookupExtension | None) -> None:
        """The tier manager's hook after every lookup (``None``: none); see
        `LookupExtension`."""
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
        """Whether ``request_id`` is one of the last ``FINISHED_IDS_REMEMBERED`` finished."""
        return self._table.was_finished(request_id)

    def set_priority(self, request_id: str, priority: int) -> None:
        """Give ``request_id`` (registered on first use) a retention priority, 0 by
        default; what it does and raises: `RequestTable.set_priority()`."""
        self._table.set_priority(request_id, priority)

    def reserve(self, request_id: str) -> None:
        """Register ``request_id`` before its first call (`OffloadRequest` does), so a
        second handle for it is refused instead of sharing its state.

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

        Registers the request on first use; repeating a call changes nothing. Lists only
        grow while the request runs. Checked in O(new entries + entries not stored yet):
        the table did not shrink, new entries are unique ints in ``[0, num_gpu_blocks)``,
        the entries from the store cursor on are unchanged (every entry after a `reset()`
        or with ``restore_evicted``). An `UnhashedBlocksWarning` is issued once when
        ``num_computed_tokens`` runs more than one block past the hashes.

        Args:
            request_id: the engine's id.
            gpu_block_ids: the request's whole GPU block table.
            block_hashes: hashes of the request's full blocks so far.
            num_computed_tokens: tokens whose KV is computed (only blocks below are stored).

        Raises:
            RequestStateError: the request is finished.
            BlockTableError: the table shrank, changed, or holds a bad id (named).
            InvalidInputError: a negative count, or hashes that shrank or changed.
            InputTypeError: a count, table, hash list or hash of the wrong type.
        """
        self._table.update(request_id, gpu_block_ids, block_hashes, num_computed_tokens)

    def finish(self, request_id: str) -> tuple[int, ...]:
        """The engine finished ``request_id``: schedule nothing more for it.

        Its pin is released; its state is dropped once its last transfer completes. With
        ``hold_blocks_on_finish`` (eager mode), its computed blocks not stored yet are
        held (see `FinishHolds`): the engine keeps them until `take_released_holds()`
        returns them.

        Returns:
            The GPU block ids the engine must not free yet (empty unless holding).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it was already finished.
        """
        return self._holds.finish(self._table.get(request_id), self._loads.release_pin)

    def take_released_holds(self) -> list[int]:
        """GPU blocks whose ``finish()`` hold ended since the last call (free them once no
        transfer in flight names them)."""
        return self._holds.take_released()

    def cancel_hold(self, request_id: str) -> None:
        """Undo the hold ``finish()`` just returned (the engine could not keep the blocks)."""
        self._holds.cancel(request_id)

    def release_all_holds(self) -> None:
        """Give up every ``finish()`` hold now (on close); their blocks stay unstored."""
        self._holds.release_all()

    def preempt(self, request_id: str) -> None:
        """The engine preempted ``request_id`` and freed its GPU blocks: its cursor goes
        back to 0 (stores in flight run on, pinned by the ``GpuBlockPinner``).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it is finished.
        """
        state = self._table.live(request_id)
        self._loads.release_pin(state)
        self._stores.reset_cursor(state)
        self._table.preempted(state)

    def release(self, request_id: str) -> None:
        """Drop the pin of ``request_id``'s last lookup.

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

        The hit is the longest run of published blocks from the engine's prefix, never
        covering the prompt's last token; it is pinned until `plan_load()` or `release()`
        (a new lookup drops the previous pin).

        Args:
            request_id: the engine's id (registered on first use).
            block_hashes: hashes of the prompt's full blocks.
            num_tokens: prompt length in tokens.
            num_computed_tokens: tokens the engine holds already, block aligned.
            allow_defer: may answer ``None``, "ask again later": when the block after
                the hit is being filled (stored, or promoted from a tier), or a hit block
                is being loaded for another request (its GPU copy will serve this one),
                instead of a shorter hit or a second load (counted in
                ``concurrent_load_blocks``); nothing is pinned then. Once the copies in
                flight have landed (``await off.drain()``), the lookup may find a longer
                hit. `KVOffloader.lookup()` and `OffloadRequest.lookup()` take it too.
            no_read: the request must not read the cache: returns 0, pins nothing.

        Returns:
            Loadable tokens (a multiple of the block size), or ``None`` (only with
            ``allow_defer``). Why the hit stopped there: ``request_state(request_id)
            .miss_reason``, a `MissReason`.

        Raises:
            RequestStateError: the request is finished.
            InvalidInputError: token counts out of range or not block aligned.
            InputTypeError: a count not an int, hashes not a sequence of bytes.
        """
        return self._loads.lookup(
            request_id,
            block_hashes,
            num_tokens,
            num_computed_tokens,
            allow_defer=allow_defer,
            no_read=no_read,
        )

    def plan_load(
        self, request_id: str, gpu_block_ids: Sequence[int], num_tokens: int
    ) -> LoadPlan | None:
        """Plan the load of the part of the last lookup's hit that the engine accepted.

        Args:
            request_id: the request.
            gpu_block_ids: the request's whole GPU block table (unique ints in range,
                agreeing with what `update()` was given); loaded blocks go to the entries
                after the engine's own prefix.
            num_tokens: tokens to load, block aligned, at most the hit; the rest of the
                pin is released.

        Returns:
            The plan (its CPU blocks referenced until `complete()`), or ``None`` for 0.

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: the request finished.
            InvalidInputError: ``num_tokens`` not block aligned or above the hit.
            BlockTableError: a table too short, an id out of range or twice, or a
                destination unlike the known table.
            InputTypeError: ``num_tokens`` or an entry not an int, a table not a sequence.
        """
        return self._loads.plan_load(request_id, gpu_block_ids, num_tokens)

    def abandon_load(self, request_id: str) -> list[LoadPlan]:
        """Stop waiting for ``request_id``'s loads in flight (see `LoadPlanner.abandon()`);
        their CPU blocks stay referenced until `complete()`, which counts nothing for them.
        Returns the plans abandoned; raises as `release()` does."""
        return self._loads.abandon(self._table.get(request_id))

    # -- stores ----------------------------------------------------------------------------

    def plan_stores(self, gpu_cache: GpuCacheView | None = None) -> StorePlan | None:
        """Plan this step's stores for every live request, as one batch.

        Eager mode scans each request from its cursor; lazy mode walks ``gpu_cache``
        from the block closest to eviction. Cached or in-flight blocks are skipped; when
        no block is free the rest is deferred (cursors stay, ``store_deferred`` logged).

        Args:
            gpu_cache: the engine's cache view; required in lazy mode, ignored in eager.

        Returns:
            The plan (its CPU blocks hold a reference until `complete()`), or ``None``.

        Raises:
            InvalidInputError: lazy mode without ``gpu_cache``.
        """
        return self._stores.plan(gpu_cache, self._holds.end_planned)

    # -- completion ------------------------------------------------------------------------

    def complete(self, transfer: TransferLike | TransferPlan, ok: bool) -> bool:
        """Record the outcome of a transfer, once per plan.

        A successful store publishes its hashes; a failed or abandoned one publishes
        nothing; a failed load unpublishes its blocks. Every reference is released (see
        `BlockLedger.close()` for the order blocks return to the pool).

        Args:
            transfer: the `TransferTask`, or its plan.
            ok: whether the copy succeeded.

        Returns:
            ``False`` when the plan is unknown or already completed (the call is ignored).
        """
        return self._outcomes.complete(transfer, ok)

    def cancel(self, transfer: TransferLike | TransferPlan) -> bool:
        """Undo a plan whose copy never started, as if it had not been planned: a store's
        cursors go back (planned again next step); a load's blocks become its request's
        pin again (load again, or ``release()``).

        Returns:
            ``False`` when the plan is unknown or already completed (the call is ignored).
        """
        return self._outcomes.cancel(transfer)

    def reset(self) -> bool:
        """Empty the CPU prefix cache: unpublish every block, abandon transfers in flight
        (they publish nothing), release pins and retained blocks, put cursors back to 0.
        After new weights, use a new namespace (``model_id`` / ``hash_salt``) instead.

        Returns:
            ``True`` when no transfer is in flight any more (the cache stays empty until
            new stores complete); ``False`` while abandoned transfers are still running.
        """
        return self._outcomes.reset()

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
        """Check every DESIGN.md invariant the scheduler, ledger and pool can see.

        Raises:
            InvariantError: naming the breach.
        """
        check_parts(self._ledger, self._table, self._stores, self._holds, self._outcomes)
