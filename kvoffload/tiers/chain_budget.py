"""`ChainBudget`: a page budget for a tier that an engine reads as leading runs of chains.

An engine that counts a hit as the leading run of a chain of pages (SGLang's HiCache
does) gets nothing from a chain whose head is gone, however many of its later pages are
kept. A tier that evicts by recency alone (the disk tier's slots, Redis under an LRU or
LFU ``maxmemory-policy``) takes heads first: they were written first and, on a read, are
touched first. This budget makes the choice instead, before the tier has to: it holds at
most ``capacity`` pages, each with its depth in its chain (0: a head), and when a write
needs room it takes the **deepest** page held (the least recently used of that depth),
and never one shallower than the page it makes room for. Chains therefore lose tails
before heads, and under pressure they are cut to a common depth instead of some keeping
tails whose heads are gone.

It does no I/O and is not thread-safe: the owner deletes the victims from its tiers and
serialises the calls.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, final

from kvoffload.errors import ConfigError, InvalidInputError

__all__ = ["Admission", "ChainBudget"]

K = TypeVar("K", bound=Hashable)


@final
@dataclass(frozen=True, slots=True)
class Admission(Generic[K]):
    """What `ChainBudget.admit()` decided.

    Attributes:
        admitted: how many of the pages asked for, from the first, may be written (a
            leading run: a page that finds no room ends it, and the pages after it, deeper
            in the same chain, are refused with it).
        victims: pages to delete from the tiers before writing (already forgotten here).
    """

    admitted: int
    victims: tuple[K, ...]


@final
class ChainBudget(Generic[K]):
    """At most ``capacity`` pages; room is made by evicting the deepest page first.

    Args:
        capacity: the most pages held at once (at least 1).

    Raises:
        ConfigError: ``capacity`` is below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"capacity={capacity}: the budget holds at least one page")
        self._capacity = capacity
        self._depth: dict[K, int] = {}
        # depth -> its pages, least recently used first
        self._levels: dict[int, OrderedDict[K, None]] = {}
        self._deepest: list[int] = []  # a max-heap (negated) of the depths in _levels
        self._in_heap: set[int] = set()

    def __len__(self) -> int:
        return len(self._depth)

    def __contains__(self, key: object) -> bool:
        return key in self._depth

    @property
    def capacity(self) -> int:
        """The most pages held at once."""
        return self._capacity

    def depth(self, key: K) -> int | None:
        """The depth recorded for ``key`` (0: a head), or ``None`` when it is not held."""
        return self._depth.get(key)

    def keys(self) -> list[K]:
        """Every page held."""
        return list(self._depth)

    def admit(self, keys: Sequence[K], first_depth: int) -> Admission[K]:
        """Make room for ``keys``, consecutive pages of one chain at depths
        ``first_depth``, ``first_depth + 1`` ..., and record them as held.

        Pages already held are only touched. A new page takes a free place, else the
        place of the deepest page held if that is at least as deep as the new one;
        otherwise it is refused, and so is the rest of ``keys``.

        Raises:
            InvalidInputError: ``first_depth`` is negative.
        """
        if first_depth < 0:
            raise InvalidInputError(f"first_depth={first_depth}: depths start at 0")
        victims: list[K] = []
        admitted = 0
        for offset, key in enumerate(keys):
            depth = first_depth + offset
            if key in self._depth:
                self.touch((key,))
                admitted += 1
                continue
            if len(self._depth) >= self._capacity:
                victim = self._victim(depth)
                if victim is None:
                    break
                self.forget((victim,))
                victims.append(victim)
            self._add(key, depth)
            admitted += 1
        return Admission(admitted, tuple(victims))

    def touch(self, keys: Iterable[K]) -> None:
        """``keys`` (those held) were used: among pages of their depth, they go last."""
        for key in keys:
            depth = self._depth.get(key)
            if depth is not None:
                self._levels[depth].move_to_end(key)

    def forget(self, keys: Iterable[K]) -> None:
        """``keys`` are gone from the tiers (deleted, failed a check, or missed)."""
        for key in keys:
            depth = self._depth.pop(key, None)
            if depth is None:
                continue
            level = self._levels[depth]
            del level[key]
            if not level:
                del self._levels[depth]

    def clear(self) -> None:
        """Forget every page."""
        self._depth.clear()
        self._levels.clear()
        self._deepest.clear()
        self._in_heap.clear()

    # -- internals ----------------------------------------------------------------------------

    def _add(self, key: K, depth: int) -> None:
        self._depth[key] = depth
        level = self._levels.get(depth)
        if level is None:
            level = self._levels[depth] = OrderedDict()
            if depth not in self._in_heap:
                self._in_heap.add(depth)
                heapq.heappush(self._deepest, -depth)
        level[key] = None

    def _victim(self, depth: int) -> K | None:
        """The least recently used page of the greatest depth held, if not shallower
        than ``depth``."""
        heap = self._deepest
        while heap:
            deepest = -heap[0]
            level = self._levels.get(deepest)
            if level:
                return next(iter(level)) if deepest >= depth else None
            heapq.heappop(heap)  # a depth whose pages are all gone
            self._in_heap.discard(deepest)
        return None  # pragma: no cover - only asked when full
