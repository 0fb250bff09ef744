"""Per-request bookkeeping kept by the scheduler, and the one phase a request is in.

Plain data: it decides nothing, except which phase may follow which
(`RequestOffloadState.move_to()`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvoffload.errors import RequestStateError
from kvoffload.hashing import BlockHash
from kvoffload.pool.free_queue import CpuBlock
from kvoffload.scheduler.misses import MissReason

__all__ = ["RequestOffloadState", "RequestPhase"]


class RequestPhase(enum.Enum):
    """Where a request is in its life, as the scheduler sees it.

    Attributes:
        LIVE: running: its blocks are stored and looked up.
        PREEMPTED: the engine freed its GPU blocks; the next ``update`` makes it live
            again, with a new block table.
        HOLDING: finished, and the engine keeps some of its unstored GPU blocks until a
            store plan reads them (``hold_blocks_on_finish``).
        DRAINING: finished; its state is dropped once its last transfer completes.
    """

    LIVE = "live"
    PREEMPTED = "preempted"
    HOLDING = "holding"
    DRAINING = "draining"


_LIVE = RequestPhase.LIVE
_PREEMPTED = RequestPhase.PREEMPTED
_HOLDING = RequestPhase.HOLDING
_DRAINING = RequestPhase.DRAINING

# Keyed by value, and tuples: an Enum member's hash is a Python-level call.
_NEXT: dict[str, tuple[RequestPhase, ...]] = {
    "live": (_PREEMPTED, _HOLDING, _DRAINING),
    "preempted": (_LIVE, _PREEMPTED, _HOLDING, _DRAINING),
    "holding": (_DRAINING,),
    # A store plan cancelled after it ended a hold gives the hold back.
    "draining": (_HOLDING,),
}


@dataclass(slots=True, eq=False)
class RequestOffloadState:
    """What the scheduler knows of one request.

    Attributes:
        request_id: the engine's id for the request.
        block_hashes: hashes of the request's full blocks so far, in order.
        gpu_block_ids: the request's GPU block table (block ``i`` holds tokens
            ``[i * block_size, (i + 1) * block_size)``).
        num_computed_tokens: tokens whose KV the engine has computed (or loaded).
        num_stored_blocks: the store cursor: blocks below it are stored, in flight, or
            were already cached when the cursor passed them. Never moves back except to
            0 on preemption or reset.
        in_flight: ``plan_id`` of every transfer that still serves this request.
        pinned: CPU blocks pinned by the last lookup, waiting for ``plan_load``.
        pin_start_block: index of the request block the first pinned block holds.
        phase: the request's `RequestPhase` (changed only through `move_to()`).
        gpu_block_set: the entries of ``gpu_block_ids``, to refuse a duplicate in O(1).
        recheck_table: entries below the cursor must be compared on the next ``update``
            (set by a reset, which moves the cursor back over entries not compared since).
        held_gpu_block_ids: GPU blocks of a finished request the engine keeps until their
            deferred stores are planned (``hold_blocks_on_finish``).
        hold_deadline: the ``plan_stores`` call after which a finished request's hold is
            given up.
        admitted: a lookup counted the request's tokens in ``prompt_tokens`` since it
            was registered or last preempted.
        priority: the retention priority its stored blocks are published with and its
            lookup hits are touched with (0: the default; see
            `OffloadScheduler.set_priority()`).
        deferrals: "ask again" answers its lookups gave in a row (0 after any other
            answer); bounded, see `LoadPlanner`.
        deferred_since: the scheduler clock's time of the first of those answers.
        miss_reason: why its last lookup's hit stopped where it did (`MissReason`).
        tier_hits: of its last lookup's hit, the blocks a secondary tier (by name)
            promoted into the CPU pool just before (``None``: none; the rest of the hit
            was in the pool).
    """

    request_id: str
    block_hashes: list[BlockHash] = field(default_factory=list)
    gpu_block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_stored_blocks: int = 0
    in_flight: set[int] = field(default_factory=set)
    pinned: list[CpuBlock] = field(default_factory=list)
    pin_start_block: int = 0
    phase: RequestPhase = RequestPhase.LIVE
    gpu_block_set: set[int] = field(default_factory=set)
    recheck_table: bool = False
    held_gpu_block_ids: list[int] = field(default_factory=list)
    hold_deadline: int = 0
    admitted: bool = False
    priority: int = 0
    deferrals: int = 0
    deferred_since: float = 0.0
    miss_reason: MissReason = MissReason.NONE
    tier_hits: dict[str, int] | None = None

    @property
    def finished(self) -> bool:
        """The engine finished the request (phase holding or draining)."""
        phase = self.phase
        return phase is _DRAINING or phase is _HOLDING

    @property
    def preempted(self) -> bool:
        """The engine preempted the request and freed its GPU blocks."""
        return self.phase is _PREEMPTED

    def move_to(self, phase: RequestPhase) -> None:
        """Enter ``phase``.

        Raises:
            RequestStateError: ``phase`` may not follow the current one (the message
                names both).
        """
        if phase not in _NEXT[self.phase._value_]:
            raise RequestStateError(
                f"request {self.request_id!r} cannot go from phase {self.phase.value!r} "
                f"to {phase.value!r}"
            )
        self.phase = phase
