"""Making a request handle for `KVOffloader.request()`: the checks, the reservation of its
id and its retention priority.

The handle is made first and the id reserved last, once nothing can be refused any more:
the id is the handle's until it finishes, so a second handle for it (a client's retry) is
refused at the reservation, before either makes a call. With several KV cache groups the
handle gets the request's per-group lanes; its priority applies in every group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvoffload._session import Session
from kvoffload.hashing import HashNamespace
from kvoffload.request import OffloadRequest
from kvoffload.scheduler.requests import check_request_priority

__all__ = ["open_handle"]


class _Offloader(Protocol):
    """What `open_handle()` reads of the offloader the handle calls."""

    @property
    def namespace(self) -> HashNamespace: ...


def open_handle(  # noqa: PLR0917 - the offloader, its session, then request()'s arguments
    off: _Offloader,
    life: Session,
    request_id: str,
    prompt_token_ids: Sequence[int],
    num_computed_tokens: int,
    priority: int,
) -> OffloadRequest:
    """`KVOffloader.request()`: a handle on ``off`` for ``request_id``, its id reserved
    in ``life`` (the offloader's session) and its ``priority`` set.

    Args:
        off: the offloader, which the handle calls; its namespace root is the handle's
            with one group (with several, the lanes' own roots).
        life: the offloader's session; its front gives the handle's block size (the
            hit alignment) and, with several groups, its lanes.
        request_id, prompt_token_ids, num_computed_tokens, priority: as `request()`.

    Raises:
        What `KVOffloader.request()` raises.
    """
    life.check("request")
    check_request_priority(request_id, priority)
    front = life.front
    block_size, lanes = front.handle_shape(request_id)
    handle: OffloadRequest = OffloadRequest._create(
        off,
        request_id,
        prompt_token_ids,
        num_computed_tokens,
        block_size=block_size,
        root=off.namespace.root,
        lanes=lanes,
    )
    # Last, once nothing can be refused any more (see the module's docstring).
    front.reserve(request_id)
    if priority:
        front.scheduler.set_priority(request_id, priority)
    return handle
