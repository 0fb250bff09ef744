"""Admission filters: whether a computed block is worth a CPU block at all.

A filter is consulted once per block the scheduler is about to plan a store for (eager
mode), before any CPU block is allocated. ``always`` stores everything (the default).
``seen_twice`` (and ``seen:N``) stores a block only the N-th time its hash is offered
within a window, so one-off prompt tails never push reused prefixes out of the pool.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol, final, runtime_checkable

from kvoffload.errors import ConfigError
from kvoffload.hashing import BlockHash

__all__ = [
    "ADMISSION_HELP",
    "AdmissionFilter",
    "AlwaysAdmit",
    "SeenCountAdmission",
    "make_admission",
    "parse_admission",
]

ADMISSION_HELP = (
    "'always', 'seen_twice', or 'seen:N[:WINDOW]' (store a block the N-th time its hash is "
    "offered within the last WINDOW offers; WINDOW defaults to 100000 and bounds the memory)"
)
_DEFAULT_WINDOW = 100_000
_MAX_WINDOW = 1 << 26
_SEEN = re.compile(r"seen:(\d+)(?::(\d+))?")


@runtime_checkable
class AdmissionFilter(Protocol):
    """Decides whether a block offered for a store is stored."""

    @property
    def name(self) -> str:
        """The spec this filter was made from (``"always"``, ``"seen:2:100000"``...)."""
        ...

    def admit(self, block_hash: BlockHash) -> bool:
        """Record one offer of ``block_hash``; return whether to store it now."""
        ...

    def undo(self, admitted: Iterable[BlockHash], refused: Iterable[BlockHash]) -> None:
        """The store these offers were made for was undone before it started (pinning its
        GPU blocks or submitting it raised): the offers count as never made, and the
        ``admitted`` hashes are admitted again at their next offer."""
        ...


@final
class AlwaysAdmit:
    """Store every block offered (kvoffload's behaviour without a filter)."""

    __slots__ = ()

    @property
    def name(self) -> str:
        """``"always"``."""
        return "always"

    def __repr__(self) -> str:
        return "AlwaysAdmit()"

    def admit(self, block_hash: BlockHash) -> bool:
        """Always ``True``."""
        return True

    def undo(self, admitted: Iterable[BlockHash], refused: Iterable[BlockHash]) -> None:
        """Nothing to undo: every offer is admitted."""


@final
class SeenCountAdmission:
    """Store a block the ``threshold``-th time its hash is offered within a window.

    The filter remembers, per hash not yet admitted, how often and when (in offers) it was
    last offered. An entry older than ``window`` offers is forgotten, and at most
    ``window`` entries are kept, so memory is bounded whatever the traffic. An admitted
    hash is forgotten too: the block is in the pool from then on, and if it is evicted it
    has to earn its place again.

    Args:
        threshold: offers needed, >= 1 (1 admits everything).
        window: how many of the latest offers count; also the most hashes remembered.

    Raises:
        ValueError: ``threshold`` or ``window`` out of range.
    """

    __slots__ = ("_clock", "_seen", "threshold", "window")

    def __init__(self, threshold: int = 2, window: int = _DEFAULT_WINDOW) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        if not 1 <= window <= _MAX_WINDOW:
            raise ValueError(f"window must be in [1, {_MAX_WINDOW}], got {window}")
        self.threshold = threshold
        self.window = window
        self._clock = 0
        self._seen: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()

    @property
    def name(self) -> str:
        """``"seen:THRESHOLD:WINDOW"``."""
        return f"seen:{self.threshold}:{self.window}"

    def __repr__(self) -> str:
        return (
            f"SeenCountAdmission(threshold={self.threshold}, window={self.window}, "
            f"remembered={len(self._seen)})"
        )

    def __len__(self) -> int:
        """Hashes remembered now (at most ``window``)."""
        return len(self._seen)

    def admit(self, block_hash: BlockHash) -> bool:
        """Count this offer; ``True`` once the hash reached ``threshold`` in the window."""
        self._clock += 1
        clock = self._clock
        seen = self._seen
        oldest = clock - self.window
        entry = seen.pop(block_hash, None)
        count = entry[0] + 1 if entry is not None and entry[1] > oldest else 1
        if count >= self.threshold:
            return True
        seen[block_hash] = (count, clock)
        # Entries are in the order of their last offer: expire from the front.
        while seen:
            first = next(iter(seen.values()))
            if first[1] > oldest and len(seen) <= self.window:
                break
            seen.popitem(last=False)
        return False

    def undo(self, admitted: Iterable[BlockHash], refused: Iterable[BlockHash]) -> None:
        """Void offers of a store that was undone before it started: an ``admitted`` hash
        is remembered one offer short of ``threshold`` (its next offer admits it), and a
        ``refused`` hash loses the offer it was counted for."""
        if self.threshold <= 1:
            return
        seen = self._seen
        for block_hash in refused:
            entry = seen.get(block_hash)
            if entry is not None:
                if entry[0] > 1:
                    seen[block_hash] = (entry[0] - 1, entry[1])
                else:
                    del seen[block_hash]
        for block_hash in admitted:
            seen.pop(block_hash, None)
            seen[block_hash] = (self.threshold - 1, self._clock)
        while len(seen) > self.window:
            seen.popitem(last=False)


def parse_admission(spec: str) -> tuple[int, int] | None:
    """``None`` for ``"always"``, else ``(threshold, window)``.

    Raises:
        ValueError: not a known spec (the message says what is accepted).
    """
    text = spec.strip().lower()
    if text == "always":
        return None
    if text == "seen_twice":
        return (2, _DEFAULT_WINDOW)
    match = _SEEN.fullmatch(text)
    if match is not None:
        threshold = int(match.group(1))
        window = int(match.group(2)) if match.group(2) else _DEFAULT_WINDOW
        if threshold >= 1 and 1 <= window <= _MAX_WINDOW:
            return (threshold, window)
    raise ValueError(f"unknown store admission {spec!r}; expected {ADMISSION_HELP}")


def make_admission(spec: str | AdmissionFilter | None) -> AdmissionFilter:
    """A fresh filter for a spec (see `ADMISSION_HELP`), or the filter itself.

    Raises:
        ConfigError: an unknown spec.
    """
    if spec is None:
        return AlwaysAdmit()
    if not isinstance(spec, str):
        return spec
    try:
        parsed = parse_admission(spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if parsed is None:
        return AlwaysAdmit()
    return SeenCountAdmission(*parsed)
