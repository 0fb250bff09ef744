"""One transfer over several KV cache groups: `GroupedTransferPlan` and `submit_grouped()`.

A model with several groups has one copy engine per group (each over that group's own
layer tensors and host buffer). A grouped plan (one store or load plan per group) is
submitted part by part, each to its group's engine, and tracked as **one** `TransferTask`
whose completion fires once every part's copy ended: it succeeds only when every part
did, and fails with the first part's error otherwise (the scheduler then completes every
group's part as failed: a multi-group store publishes nothing unless all of it arrived).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import final

from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.plan import TransferKind, TransferPlan
from kvoffload.transfer.task import CompletionHandle, TransferTask, _Finished

__all__ = ["GroupedTransferPlan", "submit_grouped"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupedTransferPlan(TransferPlan):
    """One transfer made of one plan per group.

    Its own ``gpu_block_ids`` and ``cpu_block_ids`` are empty: the ids of a part address
    that group's tensors and pool only (``parts[name]``).

    Attributes:
        parts: per group name, the plan its copy engine runs.
    """

    parts: Mapping[str, TransferPlan]

    @property
    def num_blocks(self) -> int:
        """Blocks moved, all groups together."""
        return sum(p.num_blocks for p in self.parts.values())


@final
class _AllDone:
    """The completion of every part: finished once all are, failed if any failed."""

    __slots__ = ("_handles",)

    def __init__(self, handles: tuple[CompletionHandle, ...]) -> None:
        self._handles = handles

    def query(self) -> bool:
        return all(h.query() for h in self._handles)

    def error(self) -> BaseException | None:
        return next((e for h in self._handles if (e := h.error()) is not None), None)

    def notify_on_done(self, callback: Callable[[], None]) -> None:
        for h in self._handles:
            notify = getattr(h, "notify_on_done", None)
            if notify is not None:
                notify(callback)

    def finished_at(self) -> float | None:
        times: list[float] = []
        for h in self._handles:
            getter = getattr(h, "finished_at", None)
            value = getter() if getter is not None else None
            if not isinstance(value, float):
                return None
            times.append(value)
        return max(times) if times else None


def submit_grouped(
    engines: Mapping[str, CopyEngine],
    parts: Mapping[str, TransferPlan],
    *,
    plan_id: int,
    kind: TransferKind,
    after: object | None = None,
) -> TransferTask:
    """Submit each group's part to its engine; one task for all of them.

    Args:
        engines: per group name, its copy engine.
        parts: per group name, the plan of that group (at least one).
        plan_id: the grouped transfer's id.
        kind: ``"store"`` or ``"load"`` (every part's).
        after: what every part's copy must wait for (see `CopyEngine.submit()`).

    Returns:
        A task that finishes once every part's copy ended; ``FAILED`` when any failed.

    Raises:
        Exception: whatever the first part's ``submit`` raised (nothing was started).
            When a later part's ``submit`` raises, the parts already submitted run on and
            the task fails with that error once they ended.
    """
    tasks: dict[str, TransferTask] = {}
    late: BaseException | None = None
    for name, sub in parts.items():
        try:
            tasks[name] = engines[name].submit(sub, after=after)
        except Exception as exc:
            if not tasks:
                raise
            late = exc
            break
    handles: tuple[CompletionHandle, ...] = tuple(
        t._completion for t in tasks.values() if t._completion is not None
    )
    if late is not None:
        handles = (*handles, _Finished(late))
    rids = dict.fromkeys(r for p in parts.values() for r in p.request_ids)
    plan = GroupedTransferPlan(
        plan_id=plan_id,
        kind=kind,
        gpu_block_ids=(),
        cpu_block_ids=(),
        request_ids=tuple(rids),
        parts=dict(parts),
    )
    task: TransferTask = TransferTask._create(
        plan,
        nbytes=sum(t.nbytes for t in tasks.values()),
        completion=_AllDone(handles),
        keepalive=tuple(tasks.values()),
    )
    return task
