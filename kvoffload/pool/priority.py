"""Retention priorities: the checks and the per-level view `CpuBlockPool` gives a policy.

A free block of a lower priority is evicted before any of a higher one. Under LRU the pool
keeps one free queue per priority level present (level 0 is the pool's own free queue, so a
pool that uses no priority runs the single-queue path unchanged). Other policies see every
free block, as before, and are asked for victims one level at a time, lowest first, with a
`LevelGuard` as ``protect``: it hides every block of another level, so a policy ranks only
candidates of the level being evicted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, final

from kvoffload.errors import InvalidInputError

if TYPE_CHECKING:
    from kvoffload.pool.block import CpuBlock

__all__ = ["MAX_PRIORITY", "LevelGuard", "check_priority", "default_max_retained"]

MAX_PRIORITY = 1 << 16
"""The highest retention priority a block may carry."""

DEFAULT_RETAINED_FRACTION = 0.1
"""The share of a pool `CpuBlockPool.retain` may hold unless told otherwise."""


def check_priority(priority: object) -> int:
    """``priority`` if it is an int in [0, `MAX_PRIORITY`].

    Raises:
        InvalidInputError: anything else; the message names the value.
    """
    if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
        raise InvalidInputError(
            f"priority must be an integer in [0, {MAX_PRIORITY}], got {priority!r}"
        )
    return priority


def default_max_retained(num_blocks: int) -> int:
    """The retention bound of a pool of ``num_blocks`` built without one."""
    return int(num_blocks * DEFAULT_RETAINED_FRACTION)


@final
class LevelGuard(Collection["CpuBlock"]):
    """``protect`` for one level: holds the caller's protected blocks and every block of
    another priority (membership is tested, never enumerated for the latter)."""

    __slots__ = ("level", "protect")

    def __init__(self, level: int, protect: Collection[CpuBlock]) -> None:
        self.level = level
        self.protect = protect

    def __contains__(self, block: object) -> bool:
        return getattr(block, "priority", None) != self.level or block in self.protect

    def __iter__(self) -> Iterator[CpuBlock]:
        return iter(self.protect)

    def __len__(self) -> int:
        return len(self.protect)
