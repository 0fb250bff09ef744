"""Least recently used: the pool's own free queue, in the order blocks were freed."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, final

if TYPE_CHECKING:
    from kvoffload.pool.block import CpuBlock
    from kvoffload.pool.free_queue import LruFreeQueue

__all__ = ["LruPolicy"]


@final
class LruPolicy:
    """Evict the block that was freed longest ago (the default).

    The free queue already holds the blocks in that order, so this policy keeps no state.
    `CpuBlockPool` recognises it and runs its inlined fast path instead of calling these
    methods; they exist so that the policy also works through the generic protocol (and
    is tested that way against the fast path).
    """

    __slots__ = ("_free",)

    def __init__(self) -> None:
        self._free: LruFreeQueue | None = None

    @property
    def name(self) -> str:
        """``"lru"``."""
        return "lru"

    def __repr__(self) -> str:
        return "LruPolicy()"

    def attach(self, blocks: Sequence[CpuBlock], free: LruFreeQueue) -> None:
        """Bind to a pool's free queue.

        Raises:
            ValueError: already attached.
        """
        if self._free is not None:
            raise ValueError("this LruPolicy is already attached to a pool")
        self._free = free

    def on_touch(self, block: CpuBlock) -> None:
        """Nothing to record: the pool unlinks the block from its queue."""

    def on_free(self, blocks: Sequence[CpuBlock]) -> None:
        """Nothing to record: the pool appends the blocks at the most recently used end."""

    def victims(self, n: int, protect: Collection[CpuBlock]) -> list[CpuBlock]:
        """The ``n`` least recently freed blocks not in ``protect``."""
        out: list[CpuBlock] = []
        if n <= 0 or self._free is None:
            return out
        for block in self._free:
            if block not in protect:
                out.append(block)
                if len(out) == n:
                    break
        return out

    def check(self) -> None:
        """Nothing of its own to check (the pool checks its free queue)."""
