"""The offload scheduler: synchronous, deterministic decisions about what to copy.

`GroupedScheduler` (``groups.py``) is the one scheduler, for any number of KV cache
groups: one pool and one `BlockLedger` (every CPU-block reference, plans in flight,
pending hashes) per group, a request's lanes, lookups, loads in flight, the store planner
and the statistics. `OffloadScheduler` (``core.py``) is one lane of it with one group's
API. See ``docs/design.md`` for which part owns which state and where each invariant is
enforced.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvoffload.scheduler.core import (
    FINISHED_IDS_REMEMBERED,
    GpuCacheView,
    OffloadScheduler,
    RequestOffloadState,
    SchedulerStatistics,
    TransferLike,
)
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.loads import LookupExtension
from kvoffload.scheduler.misses import MissReason
from kvoffload.scheduler.state import RequestPhase

if TYPE_CHECKING:
    from kvoffload.scheduler.groups import GroupedPlan, GroupedScheduler, GroupStatistics

__all__ = [
    "FINISHED_IDS_REMEMBERED",
    "BlockLedger",
    "GpuCacheView",
    "GroupStatistics",
    "GroupedPlan",
    "GroupedScheduler",
    "LookupExtension",
    "MissReason",
    "OffloadScheduler",
    "RequestOffloadState",
    "RequestPhase",
    "SchedulerStatistics",
    "TransferLike",
]

# The group names are imported on first use: a single-group model never loads them (the
# objects a module import creates cost every later garbage collection a little).
_GROUPED = frozenset({"GroupStatistics", "GroupedPlan", "GroupedScheduler"})


def __getattr__(name: str) -> Any:
    if name not in _GROUPED:
        raise AttributeError(f"module 'kvoffload.scheduler' has no attribute {name!r}")
    value = getattr(importlib.import_module("kvoffload.scheduler.groups"), name)
    globals()[name] = value
    return value
