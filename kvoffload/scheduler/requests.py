"""The rules of a request's input, one place for every lane: block-table entries
(`check_entry()`, `check_distinct()`, `grown_table()`), hashes (`grown_hashes()`), counts
(`as_int()`, `as_count()`), priorities, the unhashed-blocks warning and the finished ids
(`FinishedIds`). A refused call raises before anything changes.
"""

from __future__ import annotations

import operator
import warnings
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol, final

from kvoffload._logging import get_logger
from kvoffload.errors import (
    BlockTableError,
    InputTypeError,
    InvalidInputError,
    InvariantError,
    RequestStateError,
    UnhashedBlocksWarning,
)
from kvoffload.hashing import BlockHash
from kvoffload.pool.priority import MAX_PRIORITY

__all__ = [
    "FINISHED_IDS_REMEMBERED",
    "FinishedIds",
    "Prioritized",
    "PriorityCount",
    "as_count",
    "as_int",
    "check_agrees",
    "check_distinct",
    "check_entry",
    "check_known_entries",
    "check_load_span",
    "check_reservable",
    "check_hash",
    "finished_again",
    "fresh_ids",
    "grown_hashes",
    "grown_table",
    "hashes_lag",
    "length",
    "warn_unhashed",
]

_log = get_logger("scheduler")


_INTS = frozenset((int,))
_BYTES = frozenset((bytes,))

FINISHED_IDS_REMEMBERED = 65536
"""How many finished request ids a scheduler remembers to refuse their reuse."""


@final
class FinishedIds:
    """The last `FINISHED_IDS_REMEMBERED` finished request ids: the one owner of the rule
    that a finished request's id is never reused (`GroupRequests`, every scheduler's).

    Args:
        limit: how many ids it remembers (``None``: `FINISHED_IDS_REMEMBERED`); an older
            one is forgotten, and accepted again.
    """

    __slots__ = ("_ids", "_limit", "_order")

    def __init__(self, limit: int | None = None) -> None:
        self._ids: set[str] = set()
        self._order: deque[str] = deque()
        self._limit = FINISHED_IDS_REMEMBERED if limit is None else limit

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, request_id: str) -> None:
        """Refuse ``request_id`` from now on (forgetting the oldest past the limit)."""
        if request_id in self._ids:
            return
        self._ids.add(request_id)
        self._order.append(request_id)
        if len(self._order) > self._limit:
            self._ids.discard(self._order.popleft())

    def was_finished(self, request_id: str) -> bool:
        """Whether ``request_id`` belongs to a (remembered) finished request."""
        return request_id in self._ids

    def refuse(self, request_id: str) -> None:
        """Raise unless ``request_id`` is free of a finished request.

        Raises:
            RequestStateError: it is a remembered finished id.
        """
        if request_id in self._ids:
            raise RequestStateError(
                f"request {request_id!r} is finished (request ids are not reused)"
            )


def check_reservable(request_id: str, in_use: bool, finished: FinishedIds) -> None:
    """The one rule of a new handle's id, every path's (`GroupRequests.reserve()`, and
    the several groups' front): neither in use nor finished.

    Raises:
        RequestStateError: the id is in use (``in_use``) or finished.
    """
    if in_use:
        raise RequestStateError(
            f"request id {request_id!r} is in use (a request with that id has not "
            "finished, or its last transfer is still in flight)"
        )
    finished.refuse(request_id)


def as_int(value: object, what: str, rid: str | None) -> int:
    """``value`` as an int (numpy and torch integers too); floats and bools are refused.

    The one check of a count argument: both schedulers' and the request handle's
    (`kvoffload.request_checks`).

    Raises:
        InputTypeError: naming ``what``, the value and the request ``rid`` (if any).
    """
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    who = "" if rid is None else f"request {rid!r}: "
    raise InputTypeError(f"{who}{what}={value!r} is not an int (got {type(value).__name__})")


def as_count(value: object, what: str, rid: str) -> int:
    """``value`` as an int >= 0 (`as_int()`): the one check of a token count of every
    path (one group's `update()`, a `GroupedScheduler`'s).

    Raises:
        InputTypeError: not an int.
        InvalidInputError: negative; the message names the request, ``what`` and the value.
    """
    if type(value) is int and value >= 0:
        return value
    count = as_int(value, what, rid)
    if count < 0:
        raise InvalidInputError(f"request {rid!r}: {what}={count} is negative")
    return count


def length(value: object, what: str, rid: str) -> int:
    """``len(value)`` of a sequence argument; iterators, generators and mappings (one
    per group name: several KV cache groups' shape) are refused."""
    if not hasattr(value, "__getitem__") or isinstance(value, Mapping):
        several = " (one per group name is for several KV cache groups)"
        raise InputTypeError(
            f"request {rid!r}: {what} must be a sequence (list, tuple, array), got "
            f"{type(value).__name__}{several if isinstance(value, Mapping) else ''}"
        )
    try:
        return len(value)  # type: ignore[arg-type]
    except TypeError:
        raise InputTypeError(
            f"request {rid!r}: {what} must be a sequence with a length, got {type(value).__name__}"
        ) from None


def check_hash(value: object, what: str, rid: str) -> None:
    """Refuse a block hash that is not bytes."""
    if type(value) is not bytes and not isinstance(value, bytes):
        raise InputTypeError(
            f"request {rid!r}: {what} must be a block hash (bytes), got {type(value).__name__}"
        )


def grown_hashes(
    old: Sequence[BlockHash],
    block_hashes: Sequence[BlockHash],
    rid: str,
    what: str = "block_hashes",
) -> Sequence[BlockHash]:
    """Check a request's hash list against the ``old`` one it must have grown from; its
    new entries. The one rule of every path: one group's `update()`, each group's hashes
    of a `GroupedScheduler`'s `update()` and `lookup()` (``what`` names them).

    Raises:
        InvalidInputError: it shrank, or its last known entry changed.
        InputTypeError: not a sequence, or a new entry not bytes.
    """
    n = len(block_hashes) if type(block_hashes) is list else length(block_hashes, what, rid)
    n_old = len(old)
    if n < n_old:
        raise InvalidInputError(
            f"request {rid!r}: {what} shrank from {n_old} to {n} entries "
            "(preempt the request to start over)"
        )
    if n_old and block_hashes[n_old - 1] != old[n_old - 1]:
        raise InvalidInputError(f"request {rid!r}: {what}[{n_old - 1}] changed since the last call")
    new = block_hashes[n_old:]
    if new and set(map(type, new)) != _BYTES:
        for k, h in enumerate(new):
            check_hash(h, f"{what}[{n_old + k}]", rid)
    return new


def hashes_lag(num_computed_tokens: int, block_size: int, hashes: Sequence[BlockHash]) -> bool:
    """The rule of `UnhashedBlocksWarning`, every path's (one group's `update()`, each
    group's hashes of a `GroupedScheduler`'s): ``num_computed_tokens`` covers more than
    one full block of ``block_size`` tokens past the ``hashes`` given. The caller then
    calls `warn_unhashed()`, once per scheduler."""
    return num_computed_tokens // block_size > len(hashes) + 1


def warn_unhashed(  # noqa: PLR0917 - the counts of `hashes_lag()` and how to name them
    rid: str,
    num_computed_tokens: int,
    block_size: int,
    num_hashes: int,
    group: str | None,
    stacklevel: int,
) -> None:
    """Issue the `UnhashedBlocksWarning` `hashes_lag()` called for, naming the request (and
    ``group``, with several groups: ``None`` reads as one group's).

    Args:
        stacklevel: the frame the warning names, counted from the caller (1: the caller).
    """
    of = "" if group is None else f" of group {group!r}"
    warnings.warn(
        f"request {rid!r}: num_computed_tokens={num_computed_tokens} covers "
        f"{num_computed_tokens // block_size} full blocks{of} but only {num_hashes} block "
        "hashes were given: blocks without a hash are never stored (hash each new full "
        "block, generated tokens too); this warning is issued once",
        UnhashedBlocksWarning,
        stacklevel=stacklevel + 1,
    )


def finished_again(request_id: str) -> RequestStateError:
    """The refusal of a second ``finish()`` of a request whose state is still kept (its
    copies in flight or its blocks held), one wording on every path."""
    return RequestStateError(
        f"request {request_id!r} is finished (already finished by an earlier finish())"
    )


def check_request_priority(request_id: str, priority: object) -> int:
    """``priority`` if it is an int in [0, `MAX_PRIORITY`].

    Raises:
        InputTypeError: not an int (a float, a bool).
        InvalidInputError: out of range; the message names the request and the value.
    """
    priority = as_int(priority, "priority", request_id)
    if not 0 <= priority <= MAX_PRIORITY:
        raise InvalidInputError(
            f"request {request_id!r}: priority must be an integer in [0, {MAX_PRIORITY}], "
            f"got {priority!r}"
        )
    return priority


class Prioritized(Protocol):
    """A request's state that carries a retention priority (one group's or several's)."""

    priority: int


@final
class PriorityCount:
    """How many requests have a retention priority other than 0: the one place a
    request's priority is set (`GroupRequests.set_priority()`). While the count is 0 the
    store planners do no priority work at all."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def set(self, state: Prioritized, priority: int) -> None:
        """Give ``state`` ``priority`` (checked by `check_request_priority()`)."""
        self.count += (priority != 0) - (state.priority != 0)
        state.priority = priority

    def drop(self, state: Prioritized) -> None:
        """``state``'s request is forgotten."""
        if state.priority:
            self.count -= 1

    def check(self, states: Iterable[Prioritized]) -> None:
        """Raise `InvariantError` unless the count is that of ``states``."""
        counted = sum(1 for state in states if state.priority)
        if counted != self.count:
            raise InvariantError(f"{counted} requests have a priority, {self.count} counted")


def check_entry(value: object, j: int, rid: str, limit: int | None, what: str) -> int:
    """One entry of a block table: an int (`as_int()`) in ``[0, limit)`` (``None``: no
    upper bound). The rule of every path (one group's `update()` and `plan_load()`, each
    group's table of a `GroupedScheduler`); ``what`` names the table.

    Raises:
        InputTypeError: not an int.
        BlockTableError: out of range; both naming the request, the table and the entry.
    """
    g = value if type(value) is int else as_int(value, f"{what}[{j}]", rid)
    if g < 0 or (limit is not None and g >= limit):
        raise BlockTableError(
            f"request {rid!r}: {what}[{j}]={g} is out of range "
            f"[0, {limit if limit is not None else 'inf'})"
        )
    return g


def check_load_span(table_len: int, start: int, n: int, rid: str, group: str | None) -> None:
    """A load's block table reaches the blocks it loads into (``[start, start + n)``):
    the rule of every path (one group's `plan_load()`, each group's of a
    `GroupedScheduler`, which names its ``group``).

    Raises:
        BlockTableError: naming the request, the group and both lengths.
    """
    if table_len < start + n:
        table = "block table" if group is None else f"the block table of group {group!r}"
        raise BlockTableError(
            f"request {rid!r}: {table} has {table_len} GPU blocks, "
            f"loading blocks {start}..{start + n - 1} needs {start + n}"
        )


def fresh_ids(new: list[Any], seen: Collection[int], limit: int | None) -> bool:
    """The fast check of a block table's new entries, every path's (one group's
    `update()`, each group's table of a `GroupedScheduler`), all at C speed: whether
    ``new`` (not empty) holds only plain ints in ``[0, limit)``, none twice and none in
    ``seen``. ``False`` asks the caller for the entry-by-entry check that names the fault."""
    fresh = set(new)
    return (
        set(map(type, new)) == _INTS
        and min(new) >= 0
        and (limit is None or max(new) < limit)
        and len(fresh) == len(new)
        and fresh.isdisjoint(seen)
    )


def grown_table(
    table: object, old: list[Any], seen: Collection[int], read_from: int, limit: int | None
) -> list[Any] | None:
    """The one table-growth rule of every path (one group's `update()`, each group's
    table of a `GroupedScheduler`'s): ``table``'s new entries when it is a list that only
    grew from ``old``, with the known entries a store may still read (from ``read_from``
    on, and always the last one) unchanged, and new entries that `fresh_ids()` accepts
    (none in ``seen``, the int entries of ``old``; ids below ``limit``). ``None`` asks
    the caller for its full check, which names the fault or takes the table as it is."""
    if type(table) is not list:
        return None
    n_old = len(old)
    if n_old:
        start = read_from if read_from < n_old else n_old - 1
        if len(table) < n_old or table[start:n_old] != old[start:]:
            return None
    new = table[n_old:]
    if new and not fresh_ids(new, seen, limit):
        return None
    return new


def check_known_entries(
    table: Sequence[int | None],
    old: Sequence[int | None],
    check_from: int,
    rid: str,
    what: str = "gpu_block_ids",
    *,
    may_drop: bool = False,
) -> None:
    """Refuse a block table that shrank from ``old``, or whose known entries a store may
    still read (from ``check_from`` on, and always the last one) changed: the rule of
    every path (one group's `update()`, each group's table of a `GroupedScheduler`).

    Args:
        table: the table given now (a sequence).
        old: the table known.
        check_from: the first entry a store may still read.
        rid: the request id, for the message.
        what: how the message names the table.
        may_drop: an entry may become ``None`` (several groups: the engine no longer
            holds that block, which is then never stored); an entry that was ``None``
            names no block and may become one.

    Raises:
        BlockTableError: naming the request, the table, the entry and both values.
    """
    n, n_old = len(table), len(old)
    if n < n_old:
        raise BlockTableError(
            f"request {rid!r}: {what} shrank from {n_old} to {n} entries "
            "(preempt the request to start over)"
        )
    check_from = min(check_from, n_old - 1) if n_old else 0
    for i in range(check_from, n_old):
        was, now = old[i], table[i]
        if now != was and not (may_drop and (now is None or was is None)):
            raise BlockTableError(
                f"request {rid!r}: {what}[{i}] changed from {was} to {now!r} since the "
                "last call (preempt the request to start over)"
            )


def check_agrees(
    known: Sequence[int | None],
    table: Sequence[int | None],
    span: range,
    rid: str,
    what: str = "gpu_block_ids",
) -> None:
    """Refuse a load whose destinations (``table``'s entries in ``span``) differ from the entries
    `update()` was given there (``known``; a ``None`` or missing one names no block): the
    rule of every path (one group's `plan_load()`, each group's of a `GroupedScheduler`),
    so a load never writes blocks the stores to come do not read.

    Raises:
        BlockTableError: naming the request, the table, the entry and both ids.
    """
    for j in span:
        if j >= len(known):
            break
        was = known[j]
        if was is not None and table[j] != was:
            raise BlockTableError(
                f"request {rid!r}: {what}[{j}]={table[j]} differs from the table given "
                f"to update() ({was})"
            )


def check_distinct(
    entries: Sequence[int | None],
    rid: str,
    *,
    earlier: Sequence[int | None] = (),
    earlier_set: Collection[int] | None = None,
    group: str | None = None,
) -> None:
    """Refuse a block table that names one GPU block twice: the rule of every path (one
    group's `update()` and `plan_load()`, each group's table of a `GroupedScheduler`).

    ``None`` entries name no block and may repeat.

    Args:
        entries: the entries to check, at positions ``len(earlier)`` on.
        rid: the request id, for the message.
        earlier: the table's entries before them (known distinct already).
        earlier_set: the int entries of ``earlier`` as a set, when the caller keeps one.
        group: the group whose table this is (several KV cache groups), for the message.

    Raises:
        BlockTableError: naming the request, the group, the GPU block and both positions.
    """
    seen = earlier_set if earlier_set is not None else {e for e in earlier if e is not None}
    offset = len(earlier)
    first_at: dict[int, int] = {}
    for k, g in enumerate(entries):
        if g is None:
            continue
        if g in seen or g in first_at:
            first = earlier.index(g) if g in seen else first_at[g]
            where = "gpu_block_ids" if group is None else f"the block table of group {group!r}"
            raise BlockTableError(
                f"request {rid!r}: GPU block {g} appears twice in {where}, at positions "
                f"{first} and {offset + k}"
            )
        first_at[g] = offset + k
