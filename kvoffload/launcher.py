"""`TransferLauncher`: how `KVOffloader` starts a plan's copy and ends it.

A plan the scheduler made is launched in four steps, and each has its way back:

1. **pin** its GPU blocks through the engine's `GpuBlockPinner` (a raising ``pin``
   cancels the plan and raises `PinnerError`);
2. **submit** it to the copy engine (a raising ``submit`` unpins and cancels the plan);
3. **track** the task with the `CompletionPoller`;
4. once the copy ended, **complete** it in the scheduler (a successful store is also
   handed to the tiers) and **unpin** its GPU blocks. A raising ``unpin`` is kept and
   raised once, as `PinnerError`, by the next step-loop call (`raise_pinner_error()`).

Blocks a finished request holds (``hold_blocks_on_finish``) are pinned and unpinned here
too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import final

import anyio

from kvoffload._logging import get_logger
from kvoffload.errors import PinnerError
from kvoffload.pinner import GpuBlockPinner
from kvoffload.scheduler import OffloadScheduler
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.plan import StorePlan, TransferPlan
from kvoffload.transfer.poller import CompletionPoller
from kvoffload.transfer.task import TransferStatus, TransferTask

__all__ = ["TransferLauncher"]

_log = get_logger("offloader")


@final
class TransferLauncher:
    """Pins, submits, tracks, completes and unpins the transfers of one scheduler.

    Args:
        scheduler: makes the plans and is told how each ended.
        pinner: the engine's pinner.
        poll_interval_s: the completion poller's sleep while transfers are in flight.

    Use it from the event loop's thread.
    """

    __slots__ = ("_pinner", "_pinner_error", "_scheduler", "_tasks", "on_stored", "poller")

    def __init__(
        self, scheduler: OffloadScheduler, pinner: GpuBlockPinner, *, poll_interval_s: float
    ) -> None:
        self._scheduler = scheduler
        self._pinner = pinner
        self._tasks: dict[int, TransferTask] = {}
        self._pinner_error: BaseException | None = None
        self.poller = CompletionPoller(self._on_complete, poll_interval_s=poll_interval_s)
        """Delivers each completion to this launcher (run it in a task group)."""
        self.on_stored: Callable[[StorePlan], None] | None = None
        """Told of each store that completed successfully (the tiers' write-downs)."""

    @property
    def num_in_flight(self) -> int:
        """Transfers launched whose completion was not processed yet."""
        return len(self._tasks)

    def launch(self, engine: CopyEngine, plan: TransferPlan, after: object | None) -> TransferTask:
        """Pin the plan's GPU blocks, submit it and track its task.

        Raises:
            PinnerError: the pinner's ``pin`` raised; the plan is cancelled.
            Exception: whatever ``engine.submit`` raised; the blocks are unpinned and the
                plan is cancelled.
        """
        try:
            self._pinner.pin(plan.gpu_block_ids)
        except Exception as exc:
            self._scheduler.cancel(plan)
            _log.error("pinner_failed", call="pin", plan_id=plan.plan_id, error=repr(exc))
            raise PinnerError(
                f"the GpuBlockPinner's pin raised for {plan.kind} plan {plan.plan_id}: "
                f"{exc!r} (the transfer was not started; nothing is lost)"
            ) from exc
        try:
            task = engine.submit(plan, after=after)
        except BaseException:
            self._unpin(plan.gpu_block_ids, plan.plan_id)
            self._scheduler.cancel(plan)
            raise
        self._tasks[plan.plan_id] = task
        self.poller.track(task)
        return task

    def hold(self, request_id: str, gpu_block_ids: Sequence[int]) -> None:
        """Pin the blocks a finished request holds until their store is planned.

        Raises:
            PinnerError: the pinner's ``pin`` raised; the hold is cancelled.
        """
        try:
            self._pinner.pin(gpu_block_ids)
        except Exception as exc:
            self._scheduler.cancel_hold(request_id)
            raise PinnerError(
                f"the GpuBlockPinner's pin raised for the blocks request {request_id!r} "
                f"holds on finish: {exc!r}"
            ) from exc

    def unpin_released_holds(self) -> None:
        """Unpin the held blocks the scheduler let go of since the last call."""
        released = self._scheduler.take_released_holds()
        if released:
            self._unpin(released, None)

    def raise_pinner_error(self) -> None:
        """Raise, once, the error an earlier ``unpin`` raised.

        Raises:
            PinnerError: an ``unpin`` raised since the last call (its cause is chained).
        """
        error = self._pinner_error
        if error is not None:
            self._pinner_error = None
            raise PinnerError(
                f"the GpuBlockPinner's unpin raised after a transfer completed: {error!r} "
                "(the transfer was recorded and its references released)"
            ) from error

    def abandon_loads(self, plans: Sequence[TransferPlan]) -> tuple[int, ...]:
        """Resolve the tasks of loads the scheduler just abandoned (their awaiters get
        `LoadAbandonedError` now); their completion still arrives once the copy ended,
        and only then are their GPU blocks unpinned.

        Returns:
            The GPU blocks those copies still write, in plan order.
        """
        gpu_block_ids: list[int] = []
        for plan in plans:
            task = self._tasks.get(plan.plan_id)
            if task is not None:
                task._give_up()  # the owner abandoning its load is what _give_up is for
            gpu_block_ids.extend(plan.gpu_block_ids)
        return tuple(gpu_block_ids)

    def abandon_all(self) -> None:
        """Abandon every transfer in flight (a reset): each publishes nothing."""
        for task in self._tasks.values():
            task._abandon()  # the owner's reset is what _abandon is for

    async def collect(self, interval_s: float) -> None:
        """Process every completion the poller has not delivered yet, polling every
        ``interval_s`` until none is in flight (the copy engine must be closed: every copy
        has ended). For closing, when the poller's own loop may have been cancelled."""
        poller = self.poller
        while poller.in_flight:
            poller.poll()
            if poller.in_flight:
                await anyio.sleep(interval_s)

    def _unpin(self, gpu_block_ids: Sequence[int], plan_id: int | None) -> None:
        try:
            self._pinner.unpin(gpu_block_ids)
        except Exception as exc:
            _log.error("pinner_failed", call="unpin", plan_id=plan_id, error=repr(exc))
            self._pinner_error = exc

    def _on_complete(self, task: TransferTask) -> None:
        self._tasks.pop(task.plan.plan_id, None)
        try:
            ok = task.status is TransferStatus.DONE
            # An abandoned copy that ended well is no failure (its CPU blocks stay cached).
            self._scheduler.complete(task, ok=ok or task._copy_ok)
            if ok and self.on_stored is not None and isinstance(task.plan, StorePlan):
                self.on_stored(task.plan)
        finally:
            self._unpin(task.gpu_block_ids, task.plan.plan_id)
