"""`TransferLauncher`: how `KVOffloader` starts a plan's copy and ends it, for one KV
cache group or several.

A step's transfer is made of parts, one plan per group it touches (one group: one part).
It is launched in four steps, and each has its way back:

1. **pin** each part's GPU blocks through its group's `GpuBlockPinner` (a raising ``pin``
   unpins what was pinned, cancels every part and raises `PinnerError`);
2. **submit** it: a one-part transfer is submitted to its group's copy engine as itself;
   several parts are submitted each to its group's engine as one `TransferTask`
   (`submit_grouped()`) that completes once every part did, a failure in any part
   failing all of them (a raising first ``submit`` unpins and cancels every part);
3. **track** the task with the `CompletionPoller`;
4. once the copy ended, **complete** every part in the scheduler with the same outcome
   (a successful store is also handed to the tiers) and **unpin** its GPU blocks. A
   raising ``unpin`` is kept and raised once, as `PinnerError`, by the next step-loop
   call (`raise_pinner_error()`).

Blocks a finished request holds (``hold_blocks_on_finish``) are pinned and unpinned here
too. The scheduler is reached through `Outcomes` (per group): a `GroupedScheduler`, of one
group's lane or several groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypeAlias, final

import anyio

from kvoffload._logging import get_logger
from kvoffload.errors import PinnerError
from kvoffload.pinner import GpuBlockPinner
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.plan import StorePlan, TransferKind, TransferPlan
from kvoffload.transfer.poller import CompletionPoller
from kvoffload.transfer.task import TransferStatus, TransferTask

__all__ = ["Outcomes", "TransferLauncher"]

_log = get_logger("offloader")

_Parts: TypeAlias = tuple[tuple[str, TransferPlan], ...]
"""Per group, its plan: the parts of a transfer over several groups."""


class Outcomes(Protocol):
    """What the launcher tells the scheduler, per group (`GroupedScheduler` is one)."""

    def complete(self, group: str, plan: TransferPlan, ok: bool, /) -> object:
        """Record how ``group``'s plan ended."""
        ...

    def cancel(self, group: str, plan: TransferPlan, /) -> object:
        """Undo ``group``'s plan whose copy never started."""
        ...

    def cancel_hold(self, request_id: str, /) -> None:
        """Undo the hold the request's finish just made."""
        ...

    def take_released_holds(self) -> Mapping[str, Sequence[int]]:
        """Per group, the held GPU blocks let go of since the last call."""
        ...


@final
class TransferLauncher:
    """Pins, submits, tracks, completes and unpins the transfers of one scheduler.

    Args:
        outcomes: the scheduler, told how each part ended (or that it never started).
        engines: per group, its copy engine (the caller may fill it in on opening).
        pinners: per group, its pinner (a group not named is not pinned).
        poll_interval_s: the completion poller's sleep while transfers are in flight.

    Use it from the event loop's thread.
    """

    __slots__ = (
        "_engines",
        "_next_id",
        "_outcomes",
        "_pinners",
        "_tasks",
        "_tokens",
        "on_ended",
        "on_stored",
        "pinner_error",
        "poller",
    )

    def __init__(
        self,
        outcomes: Outcomes,
        engines: Mapping[str, CopyEngine],
        pinners: Mapping[str, GpuBlockPinner],
        *,
        poll_interval_s: float,
    ) -> None:
        self._outcomes = outcomes
        self._engines = engines
        self._pinners = dict(pinners)
        self._tasks: dict[TransferTask, str | _Parts] = {}
        """Tasks in flight: the group of a one-part transfer, or the parts of one over
        several groups."""
        self._tokens: dict[TransferTask, int] = {}
        self._next_id = 0
        self.pinner_error: BaseException | None = None
        """What an ``unpin`` raised, not raised yet (read it; `raise_pinner_error()` raises
        it once)."""
        self.poller = CompletionPoller(self._on_complete, poll_interval_s=poll_interval_s)
        """Delivers each completion to this launcher (run it in a task group)."""
        self.on_stored: Callable[[str, StorePlan], None] | None = None
        """Told of each group's part of a store that completed successfully (the tiers)."""
        self.on_ended: Callable[[TransferTask, int], None] | None = None
        """Told of each transfer that ended, with the tokens its launch named."""

    @property
    def num_in_flight(self) -> int:
        """Transfers launched whose completion was not processed yet."""
        return len(self._tasks)

    @property
    def tasks(self) -> tuple[TransferTask, ...]:
        """The transfers in flight, in launch order."""
        return tuple(self._tasks)

    def launch(
        self, parts: Mapping[str, TransferPlan], after: object | None, *, tokens: int = 0
    ) -> TransferTask:
        """Pin every part's GPU blocks, submit the parts and track the one task (a single
        part is submitted as itself: `launch_one()`).

        Args:
            parts: per group, its plan (at least one).
            after: what every copy must wait for (see `CopyEngine.submit()`).
            tokens: the tokens a load brings in (given to `on_ended`).

        Raises:
            PinnerError: a pinner's ``pin`` raised; every part is cancelled.
            Exception: what the first part's ``submit`` raised; unpinned and cancelled.
        """
        if len(parts) == 1:
            ((group, plan),) = parts.items()
            return self.launch_one(group, plan, after, tokens=tokens)
        kind: TransferKind = "store" if next(iter(parts.values())).kind == "store" else "load"
        try:
            self._pin_each([(group, plan.gpu_block_ids) for group, plan in parts.items()])
        except Exception as exc:
            what = f"a {kind} of groups {sorted(parts)}"
            raise self._pin_failed(parts.items(), what, exc) from exc
        # only a step of several groups' parts needs the composite task
        from kvoffload.transfer.grouped import submit_grouped  # noqa: PLC0415

        self._next_id += 1
        try:
            task = submit_grouped(
                self._engines, parts, plan_id=self._next_id, kind=kind, after=after
            )
        except BaseException:
            self._undo(parts.items())
            raise
        self._track(task, tuple(parts.items()), tokens)
        return task

    def launch_one(
        self, group: str, plan: TransferPlan, after: object | None, *, tokens: int = 0
    ) -> TransferTask:
        """Pin ``group``'s plan's GPU blocks, submit it to that group's engine, track it.

        Raises:
            PinnerError: the pinner's ``pin`` raised; the plan is cancelled.
            Exception: whatever ``submit`` raised; the blocks are unpinned and the plan
                is cancelled.
        """
        pinner = self._pinners.get(group)
        if pinner is not None:
            try:
                pinner.pin(plan.gpu_block_ids)
            except Exception as exc:
                what = f"{plan.kind} plan {plan.plan_id}"
                raise self._pin_failed(((group, plan),), what, exc) from exc
        try:
            task = self._engines[group].submit(plan, after=after)
        except BaseException:
            self._undo(((group, plan),))
            raise
        self._track(task, group, tokens)
        return task

    def _track(self, task: TransferTask, parts: str | _Parts, tokens: int) -> None:
        self._tasks[task] = parts
        if tokens:
            self._tokens[task] = tokens
        self.poller.track(task)

    def _pin_each(self, parts: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Pin each group's blocks; when a ``pin`` raises, unpin what was pinned, re-raise."""
        pinned: list[tuple[str, Sequence[int]]] = []
        try:
            for group, ids in parts:
                pinner = self._pinners.get(group)
                if pinner is not None:
                    pinner.pin(ids)
                    pinned.append((group, ids))
        except Exception:
            for group, ids in pinned:
                self._unpin(group, ids, None)
            raise

    def _pin_failed(
        self, parts: Iterable[tuple[str, TransferPlan]], what: str, exc: Exception
    ) -> PinnerError:
        """Cancel every part of a transfer whose ``pin`` raised; the error to raise."""
        self._undo(parts, unpin=False)
        _log.error("pinner_failed", call="pin", what=what, error=repr(exc))
        return PinnerError(
            f"the GpuBlockPinner's pin raised for {what}: {exc!r} "
            "(the transfer was not started; nothing is lost)"
        )

    def _undo(
        self,
        parts: Iterable[tuple[str, TransferPlan]],
        *,
        unpin: bool = True,
    ) -> None:
        for group, plan in parts:
            if unpin:
                self._unpin(group, plan.gpu_block_ids, plan.plan_id)
            self._outcomes.cancel(group, plan)

    def hold(self, request_id: str, held: Mapping[str, Sequence[int]]) -> None:
        """Pin the blocks a finished request holds in each group until their stores are
        planned.

        Raises:
            PinnerError: a pinner's ``pin`` raised; the hold is cancelled (what was
                pinned is unpinned).
        """
        try:
            self._pin_each(held.items())
        except Exception as exc:
            self._outcomes.cancel_hold(request_id)
            where = f" in groups {sorted(held)}" if len(held) > 1 else ""
            raise PinnerError(
                f"the GpuBlockPinner's pin raised for the blocks request {request_id!r} "
                f"holds on finish{where}: {exc!r}"
            ) from exc

    def unpin_released_holds(self) -> None:
        """Unpin the held blocks the scheduler let go of since the last call."""
        for group, ids in self._outcomes.take_released_holds().items():
            self._unpin(group, ids, None)

    def raise_pinner_error(self) -> None:
        """Raise, once, the error an earlier ``unpin`` raised.

        Raises:
            PinnerError: an ``unpin`` raised since the last call (its cause is chained).
        """
        error = self.pinner_error
        if error is not None:
            self.pinner_error = None
            raise PinnerError(
                f"the GpuBlockPinner's unpin raised after a transfer completed: {error!r} "
                "(the transfer was recorded and its references released)"
            ) from error

    def abandon_loads(
        self, abandoned: Mapping[str, Sequence[TransferPlan]]
    ) -> dict[str, tuple[int, ...]]:
        """Resolve the tasks of loads the scheduler just abandoned, per group (their
        awaiters get `LoadAbandonedError` now); their completion still arrives once the
        copy (every part's) ended, and only then are their GPU blocks unpinned.

        Returns:
            Per group in ``abandoned``, the GPU blocks those copies still write, in plan
            order.
        """
        if abandoned:
            wanted = {(g, p.plan_id) for g, plans in abandoned.items() for p in plans}
            for task, parts in self._tasks.items():
                if task.plan.kind == "load" and any(
                    (g, p.plan_id) in wanted for g, p in _parts(task, parts)
                ):
                    task._give_up()  # the owner abandoning its load is what _give_up is for
        return {
            group: tuple(b for p in plans for b in p.gpu_block_ids)
            for group, plans in abandoned.items()
        }

    def abandon_all(self) -> None:
        """Abandon every transfer in flight (a reset): each publishes nothing."""
        for task in self._tasks:
            task._abandon()  # the owner's reset is what _abandon is for

    async def collect(self, interval_s: float) -> None:
        """Process every completion the poller has not delivered yet, polling every
        ``interval_s`` until none is in flight (the copy engines must be closed: every
        copy has ended). For closing, when the poller's own loop may have been cancelled."""
        poller = self.poller
        while poller.in_flight:
            poller.poll()
            if poller.in_flight:
                await anyio.sleep(interval_s)

    def _unpin(self, group: str, gpu_block_ids: Sequence[int], plan_id: int | None) -> None:
        pinner = self._pinners.get(group)
        if pinner is None:
            return
        try:
            pinner.unpin(gpu_block_ids)
        except Exception as exc:
            _log.error("pinner_failed", call="unpin", group=group, plan_id=plan_id, error=repr(exc))
            self.pinner_error = exc

    def _on_complete(self, task: TransferTask) -> None:
        parts = _parts(task, self._tasks.pop(task, ()))
        tokens = self._tokens.pop(task, 0) if self._tokens else 0
        status = task.status
        ok = status is TransferStatus.DONE
        try:
            if self.on_ended is not None:
                self.on_ended(task, tokens)
            # An abandoned copy that ended well is no failure (its CPU blocks stay cached).
            copied = ok or task._copy_ok
            outcomes = self._outcomes
            for group, plan in parts:
                outcomes.complete(group, plan, copied)
            on_stored = self.on_stored
            if ok and on_stored is not None:
                for group, plan in parts:
                    if isinstance(plan, StorePlan):
                        on_stored(group, plan)
        finally:
            for group, plan in parts:
                self._unpin(group, plan.gpu_block_ids, plan.plan_id)


def _parts(task: TransferTask, parts: str | _Parts) -> _Parts:
    """Per group, the plan of each part of ``task`` (a group's name: its one part)."""
    return ((parts, task.plan),) if isinstance(parts, str) else parts
