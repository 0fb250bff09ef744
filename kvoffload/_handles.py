"""Making a request handle for `KVOffloader.request()`: the checks, the reservation of its
id and its retention priority.

The handle is made first and the id reserved last, once nothing can be refused any more:
the id is the handle's until it finishes, so a second handle for it (a client's retry) is
refused at the reservation, before either makes a call. With several KV cache groups the
handle gets the request's per-group lanes; its priority applies in every group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvoffload._session import Session
from kvoffload.config import OffloadConfig
from kvoffload.hashing import HashNamespace
from kvoffload.request import OffloadRequest
from kvoffload.scheduler.requests import check_request_priority

if TYPE_CHECKING:  # the group code is imported on first use: one group never loads it
    from kvoffload._group_session import GroupSession

__all__ = ["open_handle"]


class _Offloader(Protocol):
    """What `open_handle()` reads of the offloader the handle calls."""

    @property
    def config(self) -> OffloadConfig: ...
    @property
    def namespace(self) -> HashNamespace: ...


def open_handle(  # noqa: PLR0917 - the offloader, its session, then request()'s arguments
    off: _Offloader,
    life: Session | GroupSession,
    request_id: str,
    prompt_token_ids: Sequence[int],
    num_computed_tokens: int,
    priority: int,
) -> OffloadRequest:
    """`KVOffloader.request()`: a handle on ``off`` for ``request_id``, its id reserved
    in ``life`` (the offloader's session) and its ``priority`` set.

    Args:
        off: the offloader, which the handle calls; its block size and namespace root
            are the handle's with one group (with several, the groups' alignment and
            the lanes' own roots).
        life: the offloader's session (one group) or group session.
        request_id, prompt_token_ids, num_computed_tokens, priority: as `request()`.

    Raises:
        What `KVOffloader.request()` raises.
    """
    life.check("request")
    check_request_priority(request_id, priority)
    block_size = off.config.block_size
    if isinstance(life, Session):
        lanes = None
    else:
        lanes = life.lanes_for(request_id)
        block_size = life.alignment
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
    if isinstance(life, Session):
        life.scheduler.reserve(request_id)
    else:
        life.reserve(request_id)
    if priority:
        life.scheduler.set_priority(request_id, priority)
    return handle
