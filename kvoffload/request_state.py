"""Per-request bookkeeping kept by the scheduler. Plain data: it decides nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.hashing import BlockHash
from kvoffload.pool.free_queue import CpuBlock

__all__ = ["RequestOffloadState"]


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
        finished: the engine finished the request; its state is dropped after its last
            transfer completes.
        preempted: the engine preempted the request and freed its GPU blocks.
        gpu_block_set: the entries of ``gpu_block_ids``, to refuse a duplicate in O(1).
        recheck_table: entries below the cursor must be compared on the next ``update``
            (set by a reset, which moves the cursor back over entries not compared since).
        held_gpu_block_ids: GPU blocks of a finished request the engine keeps until their
            deferred stores are planned (``hold_blocks_on_finish``).
        hold_deadline: the ``plan_stores`` call after which a finished request's hold is
            given up.
        admitted: a lookup counted the request's tokens in ``prompt_tokens`` since it
            was registered or last preempted.
    """

    request_id: str
    block_hashes: list[BlockHash] = field(default_factory=list)
    gpu_block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_stored_blocks: int = 0
    in_flight: set[int] = field(default_factory=set)
    pinned: list[CpuBlock] = field(default_factory=list)
    pin_start_block: int = 0
    finished: bool = False
    preempted: bool = False
    gpu_block_set: set[int] = field(default_factory=set)
    recheck_table: bool = False
    held_gpu_block_ids: list[int] = field(default_factory=list)
    hold_deadline: int = 0
    admitted: bool = False
