"""Count maps (key → how many), kept without zero entries."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["count_down", "count_up"]

K = TypeVar("K")


def count_up(counts: dict[K, int], key: K) -> int:
    """Add one to ``counts[key]``; return the count before."""
    before = counts.get(key, 0)
    counts[key] = before + 1
    return before


def count_down(counts: dict[K, int], key: K) -> None:
    """Take one from ``counts[key]``, dropping the entry at zero.

    Raises:
        KeyError: ``key`` is not counted (a release without its take).
    """
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
