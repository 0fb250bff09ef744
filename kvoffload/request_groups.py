"""A request handle's per-group part, for a model with several KV cache groups.

`GroupLanes` keeps one `BlockHasher` per cacheable group (each in the group's own
namespace and with its own block size), the hashes each group reported to ``update``,
and the checks of the per-group tables an `OffloadRequest` is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, final

from kvoffload.errors import BlockTableError, InvalidInputError
from kvoffload.hashing import BlockHash, BlockHasher

if TYPE_CHECKING:
    from kvoffload.scheduler.misses import MissReason
    from kvoffload.transfer.task import TransferTask

__all__ = ["GroupCalls", "GroupLanes"]


class GroupCalls(Protocol):
    """The per-group step calls a handle makes on a multi-group offloader."""

    def lookup(
        self,
        request_id: str,
        block_hashes: Mapping[str, Sequence[BlockHash]],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: bool = False,
    ) -> int | None: ...

    def load(
        self, request_id: str, tables: Mapping[str, Sequence[int | None]], num_tokens: int
    ) -> TransferTask | None: ...

    def miss_reason(self, request_id: str) -> MissReason: ...

    def update(
        self,
        request_id: str,
        tables: Mapping[str, Sequence[int | None]],
        block_hashes: Mapping[str, Sequence[BlockHash]],
        num_computed_tokens: int,
    ) -> None: ...


@final
class GroupLanes:
    """One request's hashes per group, and the checks of its per-group tables.

    Args:
        off: the offloader's per-group calls.
        groups: per cacheable group, ``(name, block_size, namespace root)``, in order.
        names: every group's name (the ones a table may name).
        who: ``"request 'id': "``, to start error messages with.
    """

    __slots__ = ("_names", "_reported", "_who", "block_sizes", "hashers", "off")

    def __init__(
        self,
        off: GroupCalls,
        groups: Sequence[tuple[str, int, BlockHash]],
        names: Sequence[str],
        who: str,
    ) -> None:
        self.off = off
        """The offloader's per-group calls."""
        self.hashers = {name: BlockHasher(root, bs) for name, bs, root in groups}
        """Per cacheable group, its hasher (its ``block_hashes`` grow as tokens come)."""
        self.block_sizes = {name: bs for name, bs, _ in groups}
        """Per cacheable group, its block size."""
        self._names = tuple(names)
        self._reported = dict.fromkeys(self.hashers, 0)
        self._who = who

    @property
    def first_hasher(self) -> BlockHasher:
        """The first cacheable group's hasher (the handle's own `block_hashes`)."""
        return next(iter(self.hashers.values()))

    def load(self, request_id: str, tables: object, num_tokens: int) -> TransferTask | None:
        """The offloader's load of ``tables`` (checked by `tables()`)."""
        return self.off.load(request_id, self.tables(tables), num_tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Hash the blocks ``token_ids`` fill, in every group (the first group's hasher
        checks every token first, so a bad one changes nothing)."""
        for hasher in self.hashers.values():
            hasher.extend(token_ids)

    def hashes(self) -> dict[str, Sequence[BlockHash]]:
        """Per group, the hashes of its full blocks so far."""
        return {name: h.block_hashes for name, h in self.hashers.items()}

    def block_size(self, group: str) -> int:
        """The block size of ``group``.

        Raises:
            InvalidInputError: no cacheable group of that name (the message names them).
        """
        bs = self.block_sizes.get(group)
        if bs is None:
            raise InvalidInputError(
                f"{self._who}no cacheable KV cache group {group!r} "
                f"(groups {sorted(self.block_sizes)})"
            )
        return bs

    def tables(self, value: object) -> Mapping[str, Sequence[int | None]]:
        """``value`` as per-group tables.

        Raises:
            InvalidInputError: not a mapping (a plain table names the groups expected),
                or a group name the model does not have.
        """
        if not isinstance(value, Mapping):
            raise InvalidInputError(
                f"{self._who}this offloader has several KV cache groups: give one block "
                f"table per group, {{name: table}} for the groups {list(self.hashers)}, "
                f"not a {type(value).__name__}"
            )
        unknown = sorted(set(value) - set(self._names))
        if unknown:
            raise InvalidInputError(
                f"{self._who}block tables for unknown groups {unknown} (groups {list(self._names)})"
            )
        return value

    def lookup(
        self, request_id: str, num_tokens: int, num_computed_tokens: int, allow_defer: bool
    ) -> int | None:
        """The offloader's lookup over every group's hashes (``None``: ask again later,
        with ``allow_defer`` only)."""
        return self.off.lookup(
            request_id, self.hashes(), num_tokens, num_computed_tokens, allow_defer=allow_defer
        )

    def miss_reason(self, request_id: str) -> MissReason:
        """Why the request's last lookup's hit stopped where it did."""
        return self.off.miss_reason(request_id)

    def advance(self, request_id: str, tables: object, num_computed_tokens: int) -> None:
        """Report a step: per group, its table and the hashes of its blocks that are full
        and computed (at least those reported before: after a preemption the scheduler
        keeps them).

        Raises:
            InvalidInputError: see `tables()`.
            BlockTableError: a table shorter than the group's full computed blocks.
        """
        checked = self.tables(tables)
        for name, bs in self.block_sizes.items():
            table = checked.get(name)
            need = num_computed_tokens // bs
            if table is not None and len(table) < need:
                raise BlockTableError(
                    f"{self._who}group {name!r}: the block table has {len(table)} entries, "
                    f"{num_computed_tokens} computed tokens fill {need} blocks (None marks a "
                    "block not held)"
                )
        hashes: dict[str, Sequence[BlockHash]] = {}
        for name, h in self.hashers.items():
            full = h.block_hashes
            n = max(num_computed_tokens // self.block_sizes[name], self._reported[name])
            hashes[name] = full[:n] if n < len(full) else full
        self.off.update(request_id, checked, hashes, num_computed_tokens)
        for name, reported in hashes.items():
            self._reported[name] = len(reported)
