"""The phase a request is in (`RequestPhase`) and which phase may follow which
(`check_move()`, the rule `GroupedRequest.move_to()` applies at every change).
"""

from __future__ import annotations

import enum

from kvoffload.errors import RequestStateError

__all__ = ["RequestPhase", "check_move"]


class RequestPhase(enum.Enum):
    """Where a request is in its life, as the scheduler sees it.

    Attributes:
        LIVE: running: its blocks are stored and looked up.
        PREEMPTED: the engine freed its GPU blocks; the next ``update`` makes it live
            again, with a new block table.
        HOLDING: finished, and the engine keeps some of its unstored GPU blocks until a
            store plan reads them (``hold_blocks_on_finish``).
        DRAINING: finished; its state is dropped once its last transfer completes.
    """

    LIVE = "live"
    PREEMPTED = "preempted"
    HOLDING = "holding"
    DRAINING = "draining"


_LIVE = RequestPhase.LIVE
_PREEMPTED = RequestPhase.PREEMPTED
_HOLDING = RequestPhase.HOLDING
_DRAINING = RequestPhase.DRAINING

# Keyed by value, and tuples: an Enum member's hash is a Python-level call.
_NEXT: dict[str, tuple[RequestPhase, ...]] = {
    "live": (_PREEMPTED, _HOLDING, _DRAINING),
    "preempted": (_LIVE, _PREEMPTED, _HOLDING, _DRAINING),
    "holding": (_DRAINING,),
    # A store plan cancelled after it ended a hold gives the hold back.
    "draining": (_HOLDING,),
}


def check_move(request_id: str, source: RequestPhase, target: RequestPhase) -> None:
    """The one rule of which phase may follow which (`GroupedRequest.move_to()`).

    Raises:
        RequestStateError: ``target`` may not follow ``source`` (the message names both).
    """
    if target not in _NEXT[source._value_]:
        raise RequestStateError(
            f"request {request_id!r} cannot go from phase {source.value!r} to {target.value!r}"
        )
