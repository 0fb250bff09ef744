"""A request handle's per-group part, for a model with several KV cache groups.

`GroupLanes` keeps one `BlockHasher` per cacheable group (each in the group's own
namespace and with its own block size), the hashes each group reported to ``update``,
and the checks of the per-group tables an `OffloadRequest` is given. It calls nothing:
the handle makes every call on the offloader, for one group and several alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, final

from kvoffload.errors import BlockTableError, InvalidInputError
from kvoffload.hashing import BlockHash, BlockHasher

__all__ = ["GroupLanes", "check_group_mapping"]


def check_group_mapping(
    value: object, what: str, names: Sequence[str], request_id: str
) -> Mapping[str, Any]:
    """``value`` (a step call's tables or hashes with several KV cache groups) as a mapping
    of group names: the one check of every per-group argument, for the handle and the
    offloader alike.

    Args:
        value: what the caller gave.
        what: the argument's name, for the message.
        names: the model's group names (the ones it may name).
        request_id: the request, for the message.

    Raises:
        InvalidInputError: not a mapping (the message names the groups expected), or a
            group name the model does not have.
    """
    if type(value) is dict or isinstance(value, Mapping):
        unknown = value.keys() - names
        if not unknown:
            return value
        raise InvalidInputError(
            f"request {request_id!r}: {what} names unknown groups {sorted(unknown)} "
            f"(groups {list(names)})"
        )
    raise InvalidInputError(
        f"request {request_id!r}: this offloader has several KV cache groups: {what} must "
        f"map each group name to its list ({{name: ...}} for the groups {list(names)}), "
        f"not a {type(value).__name__}"
    )


@final
class GroupLanes:
    """One request's hashes per group, and the checks of its per-group tables.

    Args:
        groups: per cacheable group, ``(name, block_size, namespace root)``, in order.
        names: every group's name (the ones a table may name).
        request_id: the request, for error messages.
    """

    __slots__ = (
        "_lanes",
        "_name_set",
        "_names",
        "_reported",
        "_rid",
        "_who",
        "block_sizes",
        "hashers",
    )

    def __init__(
        self,
        groups: Sequence[tuple[str, int, BlockHash]],
        names: Sequence[str],
        request_id: str,
    ) -> None:
        self.hashers = {name: BlockHasher(root, bs) for name, bs, root in groups}
        """Per cacheable group, its hasher (its ``block_hashes`` grow as tokens come)."""
        self.block_sizes = {name: bs for name, bs, _ in groups}
        """Per cacheable group, its block size."""
        self._lanes = tuple((name, bs, self.hashers[name]) for name, bs, _ in groups)
        self._names = names
        self._name_set = frozenset(names)
        self._reported = dict.fromkeys(self.hashers, 0)
        self._rid = request_id
        self._who = f"request {request_id!r}: "

    @property
    def first_hasher(self) -> BlockHasher:
        """The first cacheable group's hasher (the handle's own `block_hashes`)."""
        return next(iter(self.hashers.values()))

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
        """``value`` as per-group tables (see `check_group_mapping()`)."""
        return check_group_mapping(value, "block_table", self._names, self._rid)

    def step(
        self, tables: object, num_computed_tokens: int
    ) -> tuple[Mapping[str, Sequence[int | None]], dict[str, Sequence[BlockHash]]]:
        """A step's per-group tables, checked, and per group the hashes of its blocks that
        are full and computed (at least those reported before: after a preemption the
        scheduler keeps them), for the offloader's ``update``; `reported()` once it took
        them.

        Raises:
            InvalidInputError: see `tables()`.
            BlockTableError: a table shorter than the group's full computed blocks.
        """
        if type(tables) is dict and tables.keys() <= self._name_set:
            # what `check_group_mapping()` accepts first, without the call (every step)
            checked: Mapping[str, Sequence[int | None]] = tables
        else:
            checked = self.tables(tables)
        reported = self._reported
        hashes: dict[str, Sequence[BlockHash]] = {}
        for name, bs, hasher in self._lanes:  # one pass (a refusal discards ``hashes``)
            need = num_computed_tokens // bs
            table = checked.get(name)
            if table is not None and len(table) < need:
                raise BlockTableError(
                    f"{self._who}group {name!r}: the block table has {len(table)} entries, "
                    f"{num_computed_tokens} computed tokens fill {need} blocks (None marks a "
                    "block not held)"
                )
            full = hasher.block_hashes
            n = reported[name]
            if n < need:  # noqa: PLR1730 - cheaper than max() on the per-step path
                n = need
            hashes[name] = full[:n] if n < len(full) else full
        return checked, hashes

    def reported(self, hashes: Mapping[str, Sequence[BlockHash]]) -> None:
        """The offloader took ``hashes`` (a `step()`'s)."""
        for name, given in hashes.items():
            self._reported[name] = len(given)
