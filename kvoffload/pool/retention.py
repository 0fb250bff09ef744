"""Retention: which owners hold which published blocks of a `CpuBlockPool`, and the bound.

`CpuBlockPool.retain()` takes one reference per owner and block (however often the same
owner retains it), so a retained block is never evicted, whatever its priority, until
`CpuBlockPool.release_retained()`. `RetainedBlocks` keeps the owners' records and refuses a
retain that would hold more distinct blocks than the bound; the pool takes and drops the
references.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, final

from kvoffload.errors import InputTypeError, InvalidInputError, InvariantError
from kvoffload.pool.priority import default_max_retained

if TYPE_CHECKING:
    from kvoffload.hashing import BlockHash
    from kvoffload.pool.block import CpuBlock

__all__ = ["RetainedBlocks", "check_owner"]


def check_owner(owner: object, name: str = "owner") -> None:
    """Refuse an owner that cannot key the records (a list, a dict); the message names
    the argument ``name``."""
    try:
        hash(owner)
    except TypeError:
        raise InputTypeError(
            f"{name}={owner!r} must be hashable (a str, an int, a tuple), "
            f"got {type(owner).__name__}"
        ) from None


@final
class RetainedBlocks:
    """The retained blocks of one pool, by owner.

    Args:
        num_blocks: the pool's size.
        max_retained: the most distinct blocks all owners together may hold; ``None``
            for `default_max_retained()`.

    Raises:
        ValueError: ``max_retained`` outside [0, num_blocks - 1].
    """

    __slots__ = ("_by_owner", "_holds", "max_retained")

    def __init__(self, num_blocks: int, max_retained: int | None) -> None:
        if max_retained is None:
            max_retained = default_max_retained(num_blocks)
        if not 0 <= max_retained < num_blocks:
            raise ValueError(
                f"max_retained_blocks must be in [0, {num_blocks - 1}] for a pool of "
                f"{num_blocks} blocks, got {max_retained}"
            )
        self.max_retained = max_retained
        # owner -> its blocks, in the order retained; block_id -> how many owners hold it.
        self._by_owner: dict[Hashable, list[CpuBlock]] = {}
        self._holds: dict[int, int] = {}

    def __len__(self) -> int:
        """Distinct blocks held, all owners together."""
        return len(self._holds)

    @property
    def owners(self) -> tuple[Hashable, ...]:
        """The owners that retain blocks now."""
        return tuple(self._by_owner)

    def refs(self) -> dict[int, int]:
        """Block id → owners that hold it (a copy)."""
        return dict(self._holds)

    def held(self, owner: Hashable) -> tuple[CpuBlock, ...]:
        """The blocks ``owner`` retains, in the order retained (empty: none)."""
        return tuple(self._by_owner.get(owner, ()))

    def retain(
        self,
        block_hashes: Iterable[BlockHash],
        owner: Hashable,
        get: Callable[[BlockHash], CpuBlock | None],
        touch: Callable[[list[CpuBlock]], None],
        free: Callable[[list[CpuBlock]], None],
        *,
        fit: bool = False,
    ) -> list[CpuBlock]:
        """`CpuBlockPool.retain()`: hold the leading run of ``block_hashes`` that ``get``
        finds, taking one reference with ``touch`` on each block ``owner`` does not hold
        yet.

        A retained block is never evicted, whatever its priority, until
        `release()` (one reference per owner and block, however often it is retained).
        Hashes past the first one not published are ignored: a prefix hit cannot reach
        them. The pool's lookup counters are not changed.

        With ``fit`` (a hint, `RetentionHints`: its owner holds one prefix), ``owner``
        holds exactly the run afterwards: what it held outside the run is released with
        ``free`` (tail first), what it held of the run is kept and not touched again, and
        a run that would exceed the bound (counting ``owner``'s released blocks as room)
        is cut to its longest leading part that does not instead of being refused.

        Returns:
            The run (every block of it is now held by ``owner``).

        Raises:
            InvalidInputError: holding the run would exceed the bound (not with ``fit``);
                nothing changed.
            InputTypeError: ``owner`` is not hashable; nothing changed.
        """
        check_owner(owner)
        run = _leading_run(block_hashes, get)
        if fit:
            run = self._fit(owner, run, replace=True)
            self._drop_outside(owner, run, free)
        new = self._admit(owner, run)
        if new:
            touch(new)
            self._record(owner, new)
        return run

    def retainable(
        self,
        block_hashes: Iterable[BlockHash],
        owner: Hashable,
        get: Callable[[BlockHash], CpuBlock | None],
        *,
        fit: bool = True,
    ) -> int:
        """How many blocks of the published leading run `retain()` could hold for
        ``owner`` now; nothing changes. With ``fit`` what `retain()` with ``fit`` would
        hold (``owner``'s other blocks released, cut to the bound); without, the longest
        leading part that could be added to what ``owner`` holds within the bound
        (`retain()` without ``fit`` refuses a run longer than that)."""
        return len(self._fit(owner, _leading_run(block_hashes, get), replace=fit))

    def _fit(self, owner: Hashable, run: list[CpuBlock], *, replace: bool) -> list[CpuBlock]:
        """The longest leading part of ``run`` that ``owner`` may hold within the bound;
        with ``replace``, as if ``owner`` released what it holds first."""
        holds = self._holds
        mine = {b.block_id for b in self._by_owner.get(owner, ())}
        room = self.max_retained - len(holds)
        if replace:  # the blocks only ``owner`` holds would be free again
            room += sum(1 for block_id in mine if holds[block_id] == 1)
        seen: set[int] = set()
        for i, block in enumerate(run):
            block_id = block.block_id
            if block_id in seen:
                continue
            # Held already (by another owner; without ``replace``, by ``owner`` too).
            if holds.get(block_id, 0) > (replace and block_id in mine):
                continue
            if room == 0:
                return run[:i]
            room -= 1
            seen.add(block_id)
        return run

    def _drop_outside(
        self, owner: Hashable, run: Sequence[CpuBlock], free: Callable[[list[CpuBlock]], None]
    ) -> None:
        """Release the blocks ``owner`` holds that ``run`` does not name (tail first);
        keep the others held, untouched."""
        held = self._by_owner.get(owner)
        if not held:
            return
        keep = {b.block_id for b in run}
        drop = [b for b in held if b.block_id not in keep]
        if not drop:
            return
        kept = [b for b in held if b.block_id in keep]
        if kept:
            self._by_owner[owner] = kept
        else:
            del self._by_owner[owner]
        self._unhold(drop, free)

    def _admit(self, owner: Hashable, run: Sequence[CpuBlock]) -> list[CpuBlock]:
        held = self._by_owner.get(owner, ())
        have = {b.block_id for b in held}
        new = [b for b in dict.fromkeys(run) if b.block_id not in have]
        holds = self._holds
        more = sum(1 for b in new if b.block_id not in holds)
        if len(holds) + more > self.max_retained:
            raise InvalidInputError(
                f"retain for owner {owner!r} would hold {len(holds) + more} blocks, "
                f"over max_retained_blocks={self.max_retained} "
                f"({len(holds)} held, {more} more asked)"
            )
        return new

    def _record(self, owner: Hashable, new: list[CpuBlock]) -> None:
        holds = self._holds
        for block in new:
            holds[block.block_id] = holds.get(block.block_id, 0) + 1
        self._by_owner[owner] = self._by_owner.get(owner, []) + new

    def release(self, owner: Hashable, free: Callable[[list[CpuBlock]], None]) -> int:
        """`CpuBlockPool.release_retained()`: forget ``owner``'s blocks and drop their
        references with ``free``, tail first (as a request frees: the prefix's head is
        kept longest); return how many. The blocks join the free set (most recently used
        end of their level) unless something else still holds them.

        Raises:
            InvalidInputError: ``owner`` retains nothing (released twice, or never).
            InputTypeError: ``owner`` is not hashable.
        """
        check_owner(owner)
        held = self._by_owner.pop(owner, None)
        if held is None:
            raise InvalidInputError(f"owner {owner!r} retains no block in this pool")
        self._unhold(held, free)
        return len(held)

    def _unhold(self, blocks: list[CpuBlock], free: Callable[[list[CpuBlock]], None]) -> None:
        """Drop one hold of each of ``blocks`` (an owner's, just forgotten) and their
        references with ``free``, tail first (the prefix's head is kept longest)."""
        holds = self._holds
        for block in blocks:
            left = holds[block.block_id] - 1
            if left:
                holds[block.block_id] = left
            else:
                del holds[block.block_id]
        blocks.reverse()
        free(blocks)

    def check(self, blocks: Sequence[CpuBlock]) -> None:
        """Check the records against each other, the bound and the blocks' references.

        Raises:
            InvariantError: naming the breach.
        """
        holds: dict[int, int] = {}
        for owner, held in self._by_owner.items():
            ids = [b.block_id for b in held]
            if not ids or len(set(ids)) != len(ids):
                raise InvariantError(f"owner {owner!r} retains {ids} (empty or repeated)")
            for block_id in ids:
                holds[block_id] = holds.get(block_id, 0) + 1
        if holds != self._holds:
            raise InvariantError("retained blocks disagree with the owners' records")
        if len(holds) > self.max_retained:
            raise InvariantError(
                f"{len(holds)} blocks retained, over max_retained_blocks={self.max_retained}"
            )
        for held_id, count in holds.items():
            block = blocks[held_id]
            if block.ref_cnt < count:
                raise InvariantError(
                    f"block {held_id} is retained {count} time(s) but has ref_cnt {block.ref_cnt}"
                )


def _leading_run(
    block_hashes: Iterable[BlockHash], get: Callable[[BlockHash], CpuBlock | None]
) -> list[CpuBlock]:
    """The blocks ``get`` finds for ``block_hashes``, up to the first it does not."""
    run: list[CpuBlock] = []
    for block_hash in block_hashes:
        block = get(block_hash)
        if block is None:
            break
        run.append(block)
    return run
