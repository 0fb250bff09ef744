"""The request handle's input checks: each refuses a value with an error naming the request.

`OffloadRequest` runs them where a call's argument can be wrong in a way the offloader
would not say in the request's terms: the engine's prefix when the handle is made, the
computed tokens `advance()` reports, and a group named for the block-table arithmetic.

Every count argument of the handle (``num_computed_tokens``, ``num_tokens``, ``have``,
token positions), with one group or several, is checked by `as_int`, the schedulers' own
check: a float or a bool raises `InputTypeError` naming the argument, the value and the
request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.errors import InvalidInputError
from kvoffload.scheduler.requests import as_int

if TYPE_CHECKING:
    from kvoffload.request_groups import GroupLanes

__all__ = ["as_int", "check_prefix", "computed_past_tokens", "group_block_size"]


def check_prefix(
    num_computed_tokens: int, num_prompt_tokens: int, block_size: int, request_id: str
) -> int:
    """Check the engine's own prefix given to `KVOffloader.request()`; return it.

    Raises:
        InputTypeError: not an int (`as_int`).
        InvalidInputError: negative, not a multiple of ``block_size``, or past the prompt's
            ``num_prompt_tokens`` (the message names the request).
    """
    num_computed_tokens = as_int(num_computed_tokens, "num_computed_tokens", request_id)
    who = f"request {request_id!r}: "
    if num_computed_tokens < 0 or num_computed_tokens % block_size:
        raise InvalidInputError(
            f"{who}num_computed_tokens={num_computed_tokens} must be "
            f">= 0 and a multiple of block_size={block_size}"
        )
    if num_computed_tokens > num_prompt_tokens:
        raise InvalidInputError(
            f"{who}num_computed_tokens={num_computed_tokens} exceeds "
            f"the prompt's {num_prompt_tokens} tokens"
        )
    return num_computed_tokens


def computed_past_tokens(num_computed_tokens: int, num_tokens: int, who: str) -> InvalidInputError:
    """The error `OffloadRequest.advance()` raises for computed tokens past its tokens."""
    return InvalidInputError(
        f"{who}num_computed_tokens={num_computed_tokens} exceeds its {num_tokens} tokens"
    )


def group_block_size(lanes: GroupLanes | None, group: str, who: str) -> int:
    """The block size of ``group`` (`OffloadRequest.blocks_for()`).

    Raises:
        InvalidInputError: the offloader has one group (``lanes`` is ``None``), or no
            cacheable group of that name (`GroupLanes.block_size()`).
    """
    if lanes is None:
        raise InvalidInputError(f"{who}group={group!r}: the offloader has one group")
    return lanes.block_size(group)
