"""Retention with several KV cache groups: what `GroupedScheduler.retain()` holds.

A retained prefix must stay a usable hit. So for the longest ``N`` every group holds of
a prefix (`find_hit()`, the lookup's own rule), each group retains exactly the blocks of
``needed(g, N)``: every block of a full group's run, only the window of a sliding-window
group, only the snapshot at ``N`` of a recurrent one. Each group's pool keeps its own
bound (``max_retained_fraction`` of that pool): a retain that one pool cannot hold is
refused whole, and a hint (``fit``) is cut to the longest ``N`` every pool can hold.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from kvoffload.errors import InvalidInputError
from kvoffload.groups import KVCacheGroup, needed
from kvoffload.hashing import BlockHash
from kvoffload.pool.block_pool import CpuBlockPool
from kvoffload.pool.retention import check_owner
from kvoffload.scheduler.group_loads import find_hit
from kvoffload.scheduler.ledger import BlockLedger

__all__ = ["release_groups", "retain_groups"]


def retain_groups(
    groups: Sequence[KVCacheGroup],
    ledgers: Mapping[str, BlockLedger],
    lanes: Mapping[str, Sequence[BlockHash]],
    owner: Hashable,
    *,
    align: int,
    fit: bool,
) -> tuple[int, bool]:
    """Retain for ``owner``, in every group, the blocks of ``needed(g, N)`` for the
    longest ``N`` the groups hold of the prefix hashed in ``lanes``.

    With ``fit`` (a session hint: its owner holds one prefix), ``N`` is cut to the longest
    every pool can hold within its bound, and ``owner`` then holds exactly those blocks in
    every group: what it held that they do not name is released, what it keeps is not
    touched again (`CpuBlockPool.retain()` with ``fit``, as one group's hint does).

    Returns:
        The blocks ``owner`` now holds for the prefix, all groups together, and whether
        that is the whole prefix (``N`` is its length, aligned down).

    Raises:
        InvalidInputError: without ``fit``, a group's pool cannot hold its blocks within
            its bound (the message names the group); nothing is retained in any group.
        InputTypeError: ``owner`` is not hashable.
    """
    check_owner(owner)
    pools = {g.name: ledgers[g.name].pool for g in groups}
    cap = min(len(lanes[g.name]) * g.block_size for g in groups) // align * align
    n = find_hit(groups, pools, lanes, cap + 1, computed=0, align=align)
    if fit:
        n = _fit(groups, pools, lanes, owner, n, align)
    runs = {g.name: [lanes[g.name][i] for i in needed(g, n)] for g in groups}
    if not fit:
        for name, run in runs.items():
            pool = pools[name]
            if pool.retainable(run, owner, fit=False) < len(run):
                raise InvalidInputError(
                    f"retain for owner {owner!r}: group {name!r} needs {len(run)} blocks for "
                    f"the prefix's {n} tokens, over its pool's max_retained_blocks="
                    f"{pool.max_retained_blocks} ({pool.num_retained} held); nothing retained"
                )
    held = 0
    for name, run in runs.items():
        if run or fit:  # a hint's empty run releases what the group held for it
            held += len(ledgers[name].retain(run, owner, fit=fit))
    return held, n == cap


def _fit(  # noqa: PLR0917 - the prefix and its pools, in `retain_groups()`'s order
    groups: Sequence[KVCacheGroup],
    pools: Mapping[str, CpuBlockPool],
    lanes: Mapping[str, Sequence[BlockHash]],
    owner: Hashable,
    n: int,
    align: int,
) -> int:
    """The longest hit at most ``n`` (valid for every group) whose blocks every pool can
    retain for ``owner`` within its bound, what ``owner`` holds outside them counted as
    released (0: none)."""
    for g in groups:
        if g.kind == "full":  # a leading run: its longest part that fits bounds n
            k = pools[g.name].retainable(lanes[g.name][: n // g.block_size], owner)
            n = min(n, k * g.block_size // align * align)
    others = [g for g in groups if g.kind != "full"]
    while n > 0:
        n = find_hit(others, pools, lanes, n + 1, computed=0, align=align)
        if all(
            pools[g.name].retainable(run, owner) == len(run)
            for g in others
            for run in ([lanes[g.name][i] for i in needed(g, n)],)
        ):
            return n
        n -= align
    return 0


def release_groups(ledgers: Mapping[str, BlockLedger], owner: Hashable) -> int:
    """Release what ``owner`` retains in every group; how many blocks, all together.

    Raises:
        InvalidInputError: ``owner`` retains nothing in any group.
        InputTypeError: ``owner`` is not hashable.
    """
    check_owner(owner)
    holders = [ledger for ledger in ledgers.values() if owner in ledger.pool.retained_owners]
    if not holders:
        raise InvalidInputError(
            f"owner {owner!r} retains no block in any KV cache group's pool "
            f"(groups {list(ledgers)})"
        )
    return sum(ledger.release_retained(owner) for ledger in holders)
