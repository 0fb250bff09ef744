"""What a copy engine is asked to move: plans made by the scheduler.

A plan pairs GPU block ids with CPU block ids, position by position. The scheduler makes
plans synchronously; a `CopyEngine` turns one into an awaitable
`TransferTask`; the completion goes back to the scheduler with
the plan, which it recognises by ``plan_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvoffload.hashing import BlockHash

__all__ = ["LoadPlan", "StorePlan", "TransferKind", "TransferPlan"]

TransferKind = Literal["store", "load"]
"""``"store"``: GPU → CPU. ``"load"``: CPU → GPU."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferPlan:
    """Blocks to copy in one transfer.

    Attributes:
        plan_id: unique per scheduler; identifies the transfer's bookkeeping.
        kind: direction.
        gpu_block_ids: engine KV block ids; entry ``i`` pairs with ``cpu_block_ids[i]``.
        cpu_block_ids: CPU pool block ids.
        request_ids: the requests the transfer serves (a store may batch several).
    """

    plan_id: int
    kind: TransferKind
    gpu_block_ids: tuple[int, ...]
    cpu_block_ids: tuple[int, ...]
    request_ids: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        """Number of blocks moved."""
        return len(self.cpu_block_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class StorePlan(TransferPlan):
    """A GPU → CPU transfer; on success block ``i`` is published under ``block_hashes[i]``."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadPlan(TransferPlan):
    """A CPU → GPU transfer of a request's cached prefix.

    Attributes:
        request_id: the request the blocks are loaded for.
        num_tokens: tokens the loaded blocks cover.
    """

    request_id: str
    num_tokens: int
