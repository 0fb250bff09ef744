"""`ChainBudget`: a page budget for a tier that an engine reads as leading runs of chains.

An engine that counts a hit as the leading run of a chain of pages (SGLang's HiCache
does) gets nothing from a chain whose head is gone, however many of its later pages are
kept. A tier that evicts by recency alone (the disk tier's slots, Redis under an LRU or
LFU ``maxmemory-policy``) takes heads first: they were written first and, on a read, are
touched first. This budget makes the choice instead, before the tier has to: it holds at
most ``capacity`` pages, and when a write needs room it takes the **deepest** page of the
**least recently used** chain (a chain being a tree of pages under one head: prompts that
share a prefix share it). A chain therefore loses its tail before its head, and the chains
used recently keep theirs.

It does no I/O and is not thread-safe: the owner deletes the victims from its tiers and
serialises the calls.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, final

from kvoffload.errors import ConfigError, InvalidInputError

__all__ = ["Admission", "ChainBudget"]

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class _Chain(Generic[K]):
    """The pages of one chain held, deepest first through a heap with lazy deletion."""

    depths: dict[K, int] = field(default_factory=dict)
    heap: list[tuple[int, int, K]] = field(default_factory=list)


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
    """At most ``capacity`` pages, evicted tail-first from the least recently used chain.

    Args:
        capacity: the most pages held at once (at least 1).

    Raises:
        ConfigError: ``capacity`` is below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"capacity={capacity}: the budget holds at least one page")
        self._capacity = capacity
        self._chains: OrderedDict[K, _Chain[K]] = OrderedDict()  # least recently used first
        self._root: dict[K, K] = {}  # page -> the head of its chain
        self._seq = 0

    def __len__(self) -> int:
        return len(self._root)

    def __contains__(self, key: object) -> bool:
        return key in self._root

    @property
    def capacity(self) -> int:
        """The most pages held at once."""
        return self._capacity

    def depth(self, key: K) -> int | None:
        """The depth recorded for ``key`` (0: a head), or ``None`` when it is not held."""
        root = self._root.get(key)
        return None if root is None else self._chains[root].depths[key]

    def admit(self, root: K, keys: Sequence[K], first_depth: int) -> Admission[K]:
        """Make room for ``keys``, consecutive pages of the chain headed by ``root`` at
        depths ``first_depth``, ``first_depth + 1`` ..., and record them as held.

        Pages already held are only touched. A new page takes a free place, else the
        deepest page of the least recently used chain; a page of its own chain is taken
        only when it is deeper than the new one (a chain never gives its head for its
        tail), so when that is all there is, the page is refused and so is the rest.

        Raises:
            InvalidInputError: ``first_depth`` is negative.
        """
        if first_depth < 0:
            raise InvalidInputError(f"first_depth={first_depth}: depths start at 0")
        self._touch_chain(root)
        victims: list[K] = []
        admitted = 0
        for offset, key in enumerate(keys):
            depth = first_depth + offset
            if key in self._root:
                self._touch_chain(self._root[key])
                admitted += 1
                continue
            if len(self._root) >= self._capacity:
                victim = self._take_victim(root, depth)
                if victim is None:
                    break
                victims.append(victim)
            self._add(root, key, depth)
            admitted += 1
        return Admission(admitted, tuple(victims))

    def touch(self, keys: Iterable[K]) -> None:
        """The chains of ``keys`` (those held) were used: they are evicted last."""
        for key in keys:
            root = self._root.get(key)
            if root is not None:
                self._touch_chain(root)

    def forget(self, keys: Iterable[K]) -> None:
        """``keys`` are gone from the tiers (deleted, failed a check, or missed)."""
        for key in keys:
            root = self._root.pop(key, None)
            if root is None:
                continue
            chain = self._chains[root]
            del chain.depths[key]
            if not chain.depths:
                del self._chains[root]

    def clear(self) -> None:
        """Forget every page."""
        self._chains.clear()
        self._root.clear()

    # -- internals ----------------------------------------------------------------------------

    def _touch_chain(self, root: K) -> None:
        if root in self._chains:
            self._chains.move_to_end(root)

    def _add(self, root: K, key: K, depth: int) -> None:
        chain = self._chains.get(root)
        if chain is None:
            chain = self._chains[root] = _Chain()
        chain.depths[key] = depth
        self._seq += 1
        heapq.heappush(chain.heap, (-depth, self._seq, key))
        self._root[key] = root

    def _take_victim(self, root: K, depth: int) -> K | None:
        found: K | None = None
        for victim_root, chain in self._chains.items():
            key = self._deepest(chain)
            if victim_root == root and chain.depths[key] <= depth:
                continue  # its own chain holds nothing deeper than the new page
            found = key
            break
        if found is not None:
            self.forget((found,))
        return found

    @staticmethod
    def _deepest(chain: _Chain[K]) -> K:
        heap, depths = chain.heap, chain.depths
        while True:
            neg_depth, _, key = heap[0]
            if depths.get(key) == -neg_depth:
                return key
            heapq.heappop(heap)  # a page forgotten (or re-added) since it was pushed
