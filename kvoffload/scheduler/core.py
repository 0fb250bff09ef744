"""The offload scheduler: synchronous, deterministic decisions about what to copy.

`OffloadScheduler` is the scheduler of a model with one full-attention KV cache group: one
*lane* of a `GroupedScheduler` (``groups.py``), the scheduler of any list of groups, so one
group and several run the same code: the lane's `BlockLedger` (``ledger.py``: every
CPU-block reference, plans in flight, pending hashes), its request states
(``group_state.py``), lookups and pins (``group_lookup.py``), store planner
(``group_stores.py``: scans, deferral, cursors, holds) and loads in flight
(``group_flight.py``). It keeps one group's API: one block table and hash list per call,
plans of the one group. It never awaits and never touches a tensor: it returns plans for
a copy engine and hears each outcome through `complete()`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Literal, Protocol, final, overload

from kvoffload.config import OffloadConfig
from kvoffload.errors import InputTypeError, InvalidInputError
from kvoffload.groups import KVCacheGroup
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler.group_promote import GroupPromotions, GroupTierPart
from kvoffload.scheduler.group_state import GroupedRequest, Lane
from kvoffload.scheduler.groups import GroupedScheduler
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.misses import MissReason
from kvoffload.scheduler.requests import FINISHED_IDS_REMEMBERED
from kvoffload.scheduler.state import RequestPhase
from kvoffload.scheduler.stats import SchedulerStatistics
from kvoffload.scheduler.stores import GpuCacheView
from kvoffload.transfer.plan import LoadPlan, StorePlan, TransferPlan

__all__ = [
    "FINISHED_IDS_REMEMBERED",
    "LANE",
    "GpuCacheView",
    "OffloadScheduler",
    "RequestOffloadState",
    "SchedulerStatistics",
    "TransferLike",
]


class TransferLike(Protocol):
    """Anything that carries the plan it executes (a `TransferTask`)."""

    @property
    def plan(self) -> TransferPlan:
        """The plan the transfer executes."""


LANE = "g0"
"""The name of the one group."""


@final
class RequestOffloadState:
    """What the scheduler knows of one request of one group: a live, read-only view of
    the request's state (`GroupedRequest`, the one request state of every shape) and its
    lane, as `OffloadScheduler.request_state()` returns it.

    Args:
        state: the scheduler's request state.
        block_size: tokens per block (the request state keeps tier hits in tokens).

    Attributes read through: ``request_id``; ``block_hashes`` (its full blocks' hashes);
    ``gpu_block_ids`` and ``gpu_block_set`` (its GPU block table); ``num_computed_tokens``;
    ``num_stored_blocks`` (the store cursor); ``in_flight`` (plan ids serving it);
    ``pinned`` and ``pin_start_block`` (its last lookup's pin); ``held_gpu_block_ids`` and
    ``hold_deadline`` (``hold_blocks_on_finish``); ``phase`` (`RequestPhase`, changed only
    through `GroupedRequest.move_to()`), ``finished``, ``preempted``; ``admitted``,
    ``priority``, ``deferrals``, ``deferred_since``, ``miss_reason`` and ``tier_hits``
    (blocks per tier).
    """

    __slots__ = ("_bs", "_state")

    def __init__(self, state: GroupedRequest, block_size: int) -> None:
        self._state = state
        self._bs = block_size

    @property
    def _lane(self) -> Lane:
        return self._state.lanes[LANE]

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def block_hashes(self) -> list[BlockHash]:
        return self._lane.hashes

    @property
    def gpu_block_ids(self) -> list[int]:
        return [b for b in self._lane.table if b is not None]

    @property
    def gpu_block_set(self) -> set[int]:
        return self._lane.ids

    @property
    def num_computed_tokens(self) -> int:
        return self._state.num_computed_tokens

    @property
    def num_stored_blocks(self) -> int:
        return self._lane.cursor

    @property
    def in_flight(self) -> set[int]:
        return {pid for _, pid in self._state.in_flight}

    @property
    def pinned(self) -> list[CpuBlock]:
        return list(self._lane.pin or ())

    @property
    def pin_start_block(self) -> int:
        return self._lane.pin_start

    @property
    def held_gpu_block_ids(self) -> list[int]:
        return self._lane.held

    @property
    def phase(self) -> RequestPhase:
        return self._state.phase

    @property
    def finished(self) -> bool:
        return self._state.finished

    @property
    def preempted(self) -> bool:
        return self._state.preempted

    @property
    def hold_deadline(self) -> int:
        return self._state.hold_deadline

    @property
    def admitted(self) -> bool:
        return self._state.admitted

    @property
    def priority(self) -> int:
        return self._state.priority

    @property
    def deferrals(self) -> int:
        return self._state.deferrals

    @property
    def deferred_since(self) -> float:
        return self._state.deferred_since

    @property
    def miss_reason(self) -> MissReason:
        return self._state.miss_reason

    @property
    def tier_hits(self) -> dict[str, int] | None:
        """Per tier, the blocks of the last hit it promoted (the lane keeps tokens)."""
        hits = self._state.tier_hits
        return None if hits is None else {name: n // self._bs for name, n in hits.items()}

    def __repr__(self) -> str:
        return (
            f"RequestOffloadState(request_id={self.request_id!r}, phase={self.phase.value!r}, "
            f"num_computed_tokens={self.num_computed_tokens}, "
            f"num_stored_blocks={self.num_stored_blocks})"
        )


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
        group = KVCacheGroup(
            name=LANE,
            kind="full",
            block_size=config.block_size,
            num_layers=1,
            bytes_per_layer_block=max(1, bytes_per_block),
        )
        limits = None if num_gpu_blocks is None else {LANE: num_gpu_blocks}
        self._g = GroupedScheduler(
            [group], {LANE: pool}, num_gpu_blocks=limits, config=config, store_at_finish=False
        )
        # the group's bytes per block is at least 1; one group's 0 counts no bytes
        counters = self._counters = self._g.counters(LANE)
        counters.bytes_per_block = bytes_per_block
        self._update = self._g.request_table.update_one

    def __repr__(self) -> str:
        return (
            f"OffloadScheduler(requests={len(self._g.request_ids)}, "
            f"in_flight={self._g.num_in_flight}, pool={self._pool!r})"
        )

    @property
    def grouped(self) -> GroupedScheduler:
        """The grouped scheduler underneath."""
        return self._g

    @property
    def pool(self) -> CpuBlockPool:
        """The CPU block pool."""
        return self._pool

    @property
    def ledger(self) -> BlockLedger:
        """The block ledger, the one owner of every CPU-block reference (the tiers')."""
        return self._g.ledger(LANE)

    @property
    def config(self) -> OffloadConfig:
        """The settings."""
        return self._config

    @property
    def clock(self) -> Callable[[], float]:
        """The clock of the deferral deadline (`GroupedScheduler.clock`)."""
        return self._g.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._g.clock = clock

    @property
    def num_in_flight(self) -> int:
        """Transfers planned and not yet completed."""
        return self._g.num_in_flight

    def add_ref_holder(self, holder: Callable[[], Mapping[int, int]]) -> None:
        """Count the references ``holder()`` (CPU block id → refs) holds outside the
        ledger in `check_invariants()`."""
        self.ledger.add_ref_holder(holder)

    def set_lookup_extension(self, extension: GroupTierPart | None) -> None:
        """The tier manager's hook after every lookup (``None``: none); see
        `LookupExtension`."""
        g = self._g
        g.extension = None if extension is None else GroupPromotions(g, {LANE: extension})

    def request_state(self, request_id: str) -> RequestOffloadState:
        """The state kept for ``request_id`` (read it, do not change it).

        Raises:
            UnknownRequestError: no state for that id.
        """
        state = self._g.request_table.known(request_id)
        return RequestOffloadState(state, self._config.block_size)

    def has_request(self, request_id: str) -> bool:
        """Whether state is kept for ``request_id`` (finished requests with transfers in
        flight included)."""
        return self._g.has_request(request_id)

    def was_finished(self, request_id: str) -> bool:
        """Whether ``request_id`` is one of the last ``FINISHED_IDS_REMEMBERED`` finished."""
        return self._g.was_finished(request_id)

    def set_priority(self, request_id: str, priority: int) -> None:
        """Give ``request_id`` (registered on first use) a retention priority, 0 by
        default; what it does and raises: `GroupedScheduler.set_priority()`."""
        self._g.set_priority(request_id, priority)

    def reserve(self, request_id: str) -> None:
        """Register ``request_id`` before its first call (`OffloadRequest` does), so a
        second handle for it is refused instead of sharing its state.

        Raises:
            RequestStateError: the id is in use (registered and not dropped yet) or
                finished.
        """
        self._g.reserve(request_id)

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
        self._update(request_id, gpu_block_ids, block_hashes, num_computed_tokens)

    def finish(self, request_id: str) -> tuple[int, ...]:
        """The engine finished ``request_id``: schedule nothing more for it.

        Its pin is released; its state is dropped once its last transfer completes. With
        ``hold_blocks_on_finish`` (eager mode), its computed blocks not stored yet are
        held (see `HeldBlocks`): the engine keeps them until `take_released_holds()`
        returns them.

        Returns:
            The GPU block ids the engine must not free yet (empty unless holding).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it was already finished.
        """
        self._g.finish(request_id)
        return tuple(self._g.held_blocks(request_id).get(LANE, ()))

    def take_released_holds(self) -> list[int]:
        """GPU blocks whose ``finish()`` hold ended since the last call (free them once no
        transfer in flight names them)."""
        return list(self._g.take_released_holds().get(LANE, ()))

    def cancel_hold(self, request_id: str) -> None:
        """Undo the hold ``finish()`` just returned (the engine could not keep the blocks)."""
        self._g.cancel_hold(request_id)

    def release_all_holds(self) -> None:
        """Give up every ``finish()`` hold now (on close); their blocks stay unstored."""
        self._g.release_all_holds()

    def preempt(self, request_id: str) -> None:
        """The engine preempted ``request_id`` and freed its GPU blocks: its cursor goes
        back to 0 (stores in flight run on, pinned by the ``GpuBlockPinner``).

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: it is finished.
        """
        self._g.preempt(request_id)

    def release(self, request_id: str) -> None:
        """Drop the pin of ``request_id``'s last lookup.

        Raises:
            UnknownRequestError: no state for that id.
            RequestStateError: the request finished and was forgotten.
        """
        self._g.release(request_id)

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
        if type(block_hashes) is not list and isinstance(block_hashes, Mapping):
            raise _mapping(request_id, block_hashes)  # (a list skips the ABC check)
        return self._g.lookup(
            request_id,
            {LANE: block_hashes},
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
        if type(gpu_block_ids) is not list and isinstance(gpu_block_ids, Mapping):
            raise _mapping(request_id, gpu_block_ids)
        plan = self._g.plan_load(request_id, {LANE: gpu_block_ids}, num_tokens)
        return None if plan is None else plan.plans[LANE]  # type: ignore[return-value]

    def abandon_load(self, request_id: str) -> list[LoadPlan]:
        """Stop waiting for ``request_id``'s loads in flight (see
        `GroupedScheduler.abandon_load()`); their CPU blocks stay referenced until
        `complete()`, which counts nothing for them. Returns the plans abandoned; raises as
        `release()` does."""
        return list(self._g.abandon_load(request_id).get(LANE, ()))

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
        if isinstance(gpu_cache, Mapping):
            raise InputTypeError(
                f"gpu_cache={type(gpu_cache).__name__}: one KV cache group takes its "
                "GpuCacheView, not a mapping of group names"
            )
        views = None if gpu_cache is None else {LANE: gpu_cache}
        plan = self._g.plan_stores(views)
        return None if plan is None else plan.plans[LANE]  # type: ignore[return-value]

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
        plan = transfer if isinstance(transfer, TransferPlan) else transfer.plan
        return self._g.complete(LANE, plan, ok)

    def cancel(self, transfer: TransferLike | TransferPlan) -> bool:
        """Undo a plan whose copy never started, as if it had not been planned: a store's
        cursors go back (planned again next step); a load's blocks become its request's
        pin again (load again, or ``release()``).

        Returns:
            ``False`` when the plan is unknown or already completed (the call is ignored).
        """
        plan = transfer if isinstance(transfer, TransferPlan) else transfer.plan
        return self._g.cancel(LANE, plan)

    def reset(self) -> bool:
        """Empty the CPU prefix cache: unpublish every block, abandon transfers in flight
        (they publish nothing), release pins and retained blocks, put cursors back to 0.
        After new weights, use a new namespace (``model_id`` / ``hash_salt``) instead.

        Returns:
            ``True`` when no transfer is in flight any more (the cache stays empty until
            new stores complete); ``False`` while abandoned transfers are still running.
        """
        return self._g.reset()

    def in_flight_plans(self) -> list[TransferPlan]:
        """Plans not yet completed, oldest first."""
        return [rec.plan for rec in self.ledger.plans()]

    # -- observation -----------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        """A snapshot of the counters."""
        g = self._g
        held = g.statistics()[LANE].held_blocks
        lane = self._counters.snapshot(
            live_requests=len(g.request_ids),
            in_flight_transfers=g.num_in_flight,
            held_blocks=held,
        )
        c = g.totals
        return replace(
            lane,
            lookups=c.lookups,
            hit_tokens=c.hit_tokens,
            miss_tokens=c.miss_tokens,
            deferred_lookups=c.deferred_lookups,
            prompt_tokens=c.prompt_tokens,
            lookup_misses=dict(c.lookup_misses),
            miss_reason_tokens=dict(c.miss_reason_tokens),
            deferrals_bounded=g.deferrals_bounded,
            abandoned_loads=g.abandoned_loads,
        )

    def check_invariants(self) -> None:
        """Check every DESIGN.md invariant the scheduler, ledger and pool can see.

        Raises:
            InvariantError: naming the breach.
        """
        self._g.check_invariants()


def _mapping(request_id: str, value: Mapping[str, object]) -> InvalidInputError:
    """One group's calls take one table and one hash list, never a mapping of group names."""
    return InvalidInputError(
        f"request {request_id!r}: one KV cache group takes one list, not a mapping of group "
        f"names ({sorted(value)})"
    )
