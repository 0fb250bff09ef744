"""Block-table arithmetic: how many blocks hold some tokens, and which entries hold a range.

`blocks_for()` and `table_slice()` are the functions (re-exported by `kvoffload.request`);
`BlockTableArithmetic` gives `OffloadRequest` the same as methods in its own block size,
with errors that name the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvoffload.errors import BlockTableError, InvalidInputError
from kvoffload.request_checks import as_int, group_block_size

if TYPE_CHECKING:
    from kvoffload.request_groups import GroupLanes

__all__ = ["BlockTableArithmetic", "blocks_for", "table_slice"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens (a partial last block counts).

    Raises:
        InvalidInputError: a negative ``num_tokens`` or a ``block_size`` below 1 (also a
            ``ValueError``).
        InputTypeError: either is not an int (a float, a bool).
    """
    return _blocks_for(num_tokens, block_size, None)


def _who(rid: str | None) -> str:
    return "" if rid is None else f"request {rid!r}: "


def _blocks_for(num_tokens: int, block_size: int, rid: str | None) -> int:
    num_tokens = as_int(num_tokens, "num_tokens", rid)
    block_size = as_int(block_size, "block_size", rid)
    if num_tokens < 0 or block_size < 1:
        who = _who(rid)
        raise InvalidInputError(
            f"{who}need num_tokens >= 0 and block_size >= 1, got num_tokens={num_tokens} "
            f"and block_size={block_size}"
        )
    return -(-num_tokens // block_size)


def table_slice(
    block_table: Sequence[int], start_token: int, end_token: int, block_size: int
) -> Sequence[int]:
    """The entries of ``block_table`` that hold tokens ``[start_token, end_token)``.

    Returns:
        A slice of the table (empty when the range is).

    Raises:
        InvalidInputError: a bad range (also a ``ValueError``).
        InputTypeError: a token position or ``block_size`` that is not an int.
        BlockTableError: a table too short for the range (the message names both).
    """
    return _table_slice(block_table, start_token, end_token, block_size, None)


def _table_slice(
    block_table: Sequence[int], start_token: int, end_token: int, block_size: int, rid: str | None
) -> Sequence[int]:
    start_token = as_int(start_token, "start_token", rid)
    end_token = as_int(end_token, "end_token", rid)
    who = _who(rid)
    if not 0 <= start_token <= end_token:
        raise InvalidInputError(
            f"{who}need 0 <= start_token ({start_token}) <= end_token ({end_token})"
        )
    if start_token == end_token:
        return block_table[0:0]
    first, last = start_token // block_size, _blocks_for(end_token, block_size, rid)
    if last > len(block_table):
        raise BlockTableError(
            f"{who}tokens [{start_token}, {end_token}) need {last} blocks; "
            f"the block table has {len(block_table)}"
        )
    return block_table[first:last]


class BlockTableArithmetic:
    """`OffloadRequest`'s block-table methods, over the handle's block size, tokens and
    per-group lanes (a base with no state of its own: the handle's slots hold it)."""

    __slots__ = ()

    _block_size: int
    _lanes: GroupLanes | None
    _request_id: str
    _tokens: list[int]
    _who: str

    def blocks_for(self, num_tokens: int, *, group: str | None = None) -> int:
        """How many blocks hold ``num_tokens`` tokens (of ``group``, with several KV cache
        groups; default the handle's block size). See `blocks_for()`.

        Raises:
            InvalidInputError: a negative ``num_tokens``, or a group the offloader does
                not have (the message names the request).
            InputTypeError: ``num_tokens`` is not an int (a float, a bool).
        """
        who = self._who
        bs = self._block_size if group is None else group_block_size(self._lanes, group, who)
        return _blocks_for(num_tokens, bs, self._request_id)

    def blocks_needed(self, num_tokens: int | None = None, *, have: int = 0) -> int:
        """How many blocks a table of ``have`` blocks must gain to hold ``num_tokens``.

        Args:
            num_tokens: tokens the table must hold (default: `num_tokens`).
            have: blocks the table has.

        Raises:
            InvalidInputError: a negative ``num_tokens`` (the message names the request).
            InputTypeError: ``num_tokens`` or ``have`` is not an int (a float, a bool).
        """
        rid = self._request_id
        n = len(self._tokens) if num_tokens is None else num_tokens
        have = as_int(have, "have", rid)
        return max(0, _blocks_for(n, self._block_size, rid) - have)

    def table_slice(
        self, block_table: Sequence[int], start_token: int, end_token: int
    ) -> Sequence[int]:
        """The blocks of ``block_table`` holding tokens ``[start_token, end_token)``.

        Raises:
            InvalidInputError: a bad range. BlockTableError: a table too short for it
                (both name the request and the values). InputTypeError: a token position
                that is not an int.
        """
        return _table_slice(block_table, start_token, end_token, self._block_size, self._request_id)
