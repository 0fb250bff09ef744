"""Session hints: a prefix retained for a while (``retain_for_s``), then let go by itself.

An agent that pauses for a tool call comes back to the same, longer context; under LRU the
pause evicts it. A hint says "keep this prefix for the next N seconds": `RetentionHints`
retains the prefix's blocks (`CpuBlockPool.retain()`, within ``max_retained_fraction``)
under an owner of its own, `HintOwner`, and releases them once the hint's deadline has
passed on its clock, or when the application ends the hint early. Expiry is lazy: nothing
runs in the background; each call (and `expire()`, which the step loop calls while any hint
is live) first releases the hints whose time is up. While no hint is live that is one
truthiness test.

A hint retains the leading run of its prefix that is stored now and fits within the bound
(a hint is best effort: it is cut, never refused). Blocks whose stores are still in flight
are picked up later: `retry()` retains the rest of a hint's prefix once it is stored.

The prefix is opaque here (``P``): one group's block hashes, or one list per KV cache group
(`GroupedScheduler.retain()`); ``retain`` says how many blocks it holds and whether that is
the whole prefix.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Hashable, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar, final

from kvoffload.errors import InvalidInputError
from kvoffload.pool.retention import check_owner

if TYPE_CHECKING:
    from kvoffload.hashing import BlockHash

__all__ = ["HintOwner", "RetentionHints", "check_retain_for_s", "leading_runs"]

P = TypeVar("P")
"""A hint's prefix: what ``retain`` is given (kept as given: pass an immutable one)."""

MAX_RETAIN_FOR_S = 86_400.0 * 365
"""The longest a hint may ask for (a year): longer is a mistake, not a hint."""


def check_retain_for_s(value: object, who: str = "") -> float:
    """``value`` as a float if it is a finite number of seconds in (0, `MAX_RETAIN_FOR_S`].

    Raises:
        InvalidInputError: anything else (a bool, NaN, 0, a negative number, a string);
            the message names ``retain_for_s``, the value and ``who`` (a request).
    """
    if (
        type(value) not in (int, float)
        or not math.isfinite(value)  # type: ignore[arg-type]
        or not 0 < value <= MAX_RETAIN_FOR_S  # type: ignore[operator]
    ):
        raise InvalidInputError(
            f"{who}retain_for_s must be a number of seconds in (0, {MAX_RETAIN_FOR_S:g}], "
            f"got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def leading_runs(
    retain: Callable[[Sequence[BlockHash], Hashable, bool], Sized],
) -> Callable[[Sequence[BlockHash], Hashable, bool], tuple[int, bool]]:
    """``retain`` of one pool (``(hashes, owner, fit) -> run``, the leading run held) as
    `RetentionHints` calls it: the prefix is whole once the run is every hash."""

    def held(hashes: Sequence[BlockHash], owner: Hashable, fit: bool) -> tuple[int, bool]:
        n = len(retain(hashes, owner, fit))
        return n, n == len(hashes)

    return held


@final
@dataclass(frozen=True, slots=True)
class HintOwner:
    """The retention owner of the hint of ``session`` (kept apart from the owners of
    `KVOffloader.retain_prefix()`, so that releasing one never touches the other)."""

    session: Hashable


@dataclass(slots=True)
class _Hint(Generic[P]):
    prefix: P
    deadline: float
    complete: bool
    token: int


@final
class RetentionHints(Generic[P]):
    """The live hints of one pool (or of every group's pool), by session.

    Args:
        retain: ``(prefix, owner, fit) -> (held, whole)``: retain through the pools' one
            owner of references (a `BlockLedger`'s or a `CpuBlockPool`'s ``retain``);
            how many blocks ``owner`` holds for the prefix now, and whether that is the
            whole prefix.
        release: ``owner -> blocks``: release an owner (``release_retained``).
        clock: seconds, monotonic; `time.monotonic` by default (tests and the trace
            replay drive their own).
    """

    __slots__ = ("_heap", "_hints", "_order", "_pending", "_release", "_retain", "clock")

    def __init__(
        self,
        retain: Callable[[P, Hashable, bool], tuple[int, bool]],
        release: Callable[[Hashable], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._retain = retain
        self._release = release
        self.clock = clock
        self._hints: dict[Hashable, _Hint[P]] = {}
        self._heap: list[tuple[float, int, Hashable]] = []  # (deadline, order, session), lazy
        self._pending: set[Hashable] = set()
        self._order = 0

    def __bool__(self) -> bool:
        """Whether any hint is live (not expired at the last call)."""
        return bool(self._hints)

    def __len__(self) -> int:
        return len(self._hints)

    @property
    def sessions(self) -> tuple[Hashable, ...]:
        """The sessions with a live hint."""
        return tuple(self._hints)

    def deadline(self, session: Hashable) -> float | None:
        """When ``session``'s hint ends on `clock` (``None``: it has none)."""
        hint = self._hints.get(session)
        return hint.deadline if hint is not None else None

    def hint(
        self,
        session: Hashable,
        prefix: P,
        retain_for_s: float,
        *,
        now: float | None = None,
    ) -> int:
        """Retain the stored leading run of ``prefix`` for ``session`` until
        ``retain_for_s`` seconds from now; replace the session's earlier hint. Return how
        many blocks are retained now (the rest of the prefix is retained by `retry()`
        once stored, within the bound).

        Raises:
            InvalidInputError: a bad ``retain_for_s``; nothing changed.
            InputTypeError: ``session`` is not hashable; nothing changed.
        """
        retain_for_s = check_retain_for_s(retain_for_s)
        check_owner(session, "session")
        now = self.clock() if now is None else now
        self.expire(now)
        owner = HintOwner(session)
        if session in self._hints:
            self._drop(session)
        held, complete = self._retain(prefix, owner, True)
        deadline = now + retain_for_s
        self._order += 1
        self._hints[session] = _Hint(prefix, deadline, complete, self._order)
        if not complete:
            self._pending.add(session)
        heapq.heappush(self._heap, (deadline, self._order, session))
        if len(self._heap) > 4 * len(self._hints) + 16:  # replaced hints left stale entries
            live = {h.token for h in self._hints.values()}
            self._heap = [e for e in self._heap if e[1] in live]
            heapq.heapify(self._heap)
        return held

    def release(self, session: Hashable) -> int:
        """End ``session``'s hint early: its blocks may be evicted again. Return how many
        blocks it retained (0: no live hint, it expired or was never given).

        Raises:
            InputTypeError: ``session`` is not hashable.
        """
        check_owner(session, "session")
        self.expire()
        if session not in self._hints:
            return 0
        return self._drop(session)

    def expire(self, now: float | None = None) -> int:
        """Release every hint whose deadline is at or before ``now`` (default `clock`);
        return how many hints ended."""
        heap = self._heap
        if not heap:
            return 0
        now = self.clock() if now is None else now
        ended = 0
        while heap and heap[0][0] <= now:
            _, token, session = heapq.heappop(heap)
            hint = self._hints.get(session)
            if hint is not None and hint.token == token:
                self._drop(session)
                ended += 1
        return ended

    def retry(self) -> None:
        """Retain what each incomplete hint's prefix has stored since (within the bound)."""
        for session in tuple(self._pending):
            hint = self._hints[session]
            _, complete = self._retain(hint.prefix, HintOwner(session), True)
            if complete:
                hint.complete = True
                self._pending.discard(session)

    def clear(self) -> None:
        """Forget every hint without releasing (the pool released everything: a reset)."""
        self._hints.clear()
        self._heap.clear()
        self._pending.clear()

    def _drop(self, session: Hashable) -> int:
        self._hints.pop(session)
        self._pending.discard(session)
        try:
            return self._release(HintOwner(session))
        except InvalidInputError:  # nothing of the prefix was stored: nothing retained
            return 0
