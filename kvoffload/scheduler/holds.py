"""`HeldBlocks`: GPU blocks of finished requests kept until a store plan reads them.

With ``hold_blocks_on_finish`` (eager mode), ``finish()`` of a request whose computed
blocks are not all stored yet (deferred for lack of space) keeps them: the engine must
not free those GPU blocks until a later ``plan_stores`` has planned them (or
``hold_max_steps`` calls passed); at most ``hold_max_blocks`` are held per group.
"""

from __future__ import annotations

from collections import Counter
from typing import final

from kvoffload._logging import get_logger
from kvoffload.config import OffloadConfig
from kvoffload.scheduler.stats import Counters

__all__ = ["HeldBlocks"]

_log = get_logger("scheduler")


@final
class HeldBlocks:
    """The GPU blocks finished requests hold in one pool's blocks (one group's), under
    one budget: how many are held, and those released since last asked. The one place of
    the hold rules every shape shares: a hold takes at most `room()` blocks, lasts
    ``hold_max_steps`` store plans (`deadline()`), reports its blocks when it ends (or not,
    when the engine could not keep them), and is given back by a cancelled plan only if
    its blocks were not reported yet (`give_back()`).

    Args:
        config: ``hold_max_blocks``, ``hold_max_steps``.
        counters: where ``hold_expired_blocks`` is counted.
    """

    __slots__ = ("_counters", "_max_blocks", "_max_steps", "_released", "total")

    def __init__(self, config: OffloadConfig, counters: Counters) -> None:
        self._max_blocks = config.hold_max_blocks
        self._max_steps = config.hold_max_steps
        self._counters = counters
        self.total = 0
        """GPU blocks held now."""
        self._released: list[int] = []

    def room(self) -> int:
        """How many more blocks a new hold may take."""
        return self._max_blocks - self.total

    def deadline(self, plan_calls: int) -> int:
        """The ``plan_stores`` call after which a hold begun now is given up."""
        return plan_calls + self._max_steps

    def take(self, held: list[int]) -> None:
        """A hold of ``held`` begins."""
        self.total += len(held)

    def end(self, held: list[int], *, report: bool = True, expired: bool = False) -> None:
        """A hold of ``held`` ends (``expired``: given up unstored, counted in
        ``hold_expired_blocks``); ``report``: the engine is told the blocks are free."""
        if expired:
            self._counters.hold_expired_blocks += len(held)
        self.total -= len(held)
        if report:
            self._released.extend(held)

    def give_back(self, held: list[int]) -> bool:
        """Begin again a hold of ``held`` a cancelled plan ended, unless the engine was
        already told the blocks are free (then ``False``: they stay unstored)."""
        released = self._released
        if Counter(held) - Counter(released):
            return False
        for g in held:
            released.remove(g)
        self.total += len(held)
        return True

    def take_released(self) -> list[int]:
        """GPU blocks whose hold ended since the last call."""
        released, self._released = self._released, []
        return released
