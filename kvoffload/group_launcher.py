"""`GroupLauncher`: how a multi-group `KVOffloader` starts a grouped plan and ends it.

As `TransferLauncher` for one group: each group's GPU blocks are pinned through that
group's pinner, every part is submitted to its group's copy engine as one `TransferTask`
(`submit_grouped()`), the task is tracked by the completion poller, and once every part's
copy ended each part is completed in the `GroupedScheduler` with the same outcome (a
failure in any part fails them all: nothing is published, every reference is released)
and its GPU blocks are unpinned. A raising ``unpin`` is kept and raised once, as
`PinnerError`, by the next step-loop call. Blocks a finished request holds in each group
(``hold_blocks_on_finish``) are pinned and unpinned here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import final

from kvoffload._logging import get_logger
from kvoffload.errors import PinnerError
from kvoffload.pinner import GpuBlockPinner
from kvoffload.pool.block_pool import PoolStatistics
from kvoffload.scheduler import SchedulerStatistics
from kvoffload.scheduler.groups import GroupedPlan, GroupedScheduler
from kvoffload.scheduler.misses import MissReason
from kvoffload.scheduler.stats import add_miss
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.grouped import GroupedTransferPlan, submit_grouped
from kvoffload.transfer.plan import StorePlan, TransferKind, TransferPlan
from kvoffload.transfer.poller import CompletionPoller
from kvoffload.transfer.task import TransferStatus, TransferTask

__all__ = ["GroupCounters", "GroupLauncher", "plan_kind", "pool_statistics"]

_log = get_logger("offloader")


@dataclass(slots=True)
class GroupCounters:
    """The whole-model counters of a `GroupSession` (per group: `GroupStatistics`)."""

    lookups: int = 0
    deferred_lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    store_plans: int = 0
    load_plans: int = 0
    failed_stores: int = 0
    failed_loads: int = 0
    abandoned: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    loaded_tokens: int = 0
    prompt_tokens: int = 0
    lookup_misses: dict[MissReason, int] = field(default_factory=dict)
    miss_reason_tokens: dict[MissReason, int] = field(default_factory=dict)

    def count_lookup(
        self,
        hit: int | None,
        num_tokens: int,
        num_computed_tokens: int,
        reason: MissReason,
        *,
        new_prompt: bool,
    ) -> None:
        """Count one lookup of `GroupedScheduler.lookup()`: ``hit`` (``None``: "ask
        again"), the request's tokens and prefix, the lookup's `MissReason`, and whether
        it is the request's first since it was registered or preempted (``new_prompt``:
        its tokens count in ``prompt_tokens`` once, as with one group)."""
        self.lookups += 1
        if new_prompt:
            self.prompt_tokens += num_tokens
        if hit is None:
            self.deferred_lookups += 1
            return
        self.hit_tokens += hit
        missed = max(0, num_tokens - num_computed_tokens - hit)
        self.miss_tokens += missed
        if reason is not MissReason.NONE:
            add_miss(self.lookup_misses, self.miss_reason_tokens, reason, missed)

    def statistics(
        self, scheduler: GroupedScheduler, *, live_requests: int, in_flight_transfers: int
    ) -> SchedulerStatistics:
        """The whole model's counters, as `SchedulerStatistics` (0 where a field has no
        meaning for groups; per group, see `GroupedScheduler.statistics()`)."""
        per = scheduler.statistics().values()
        return SchedulerStatistics(
            lookups=self.lookups,
            hit_tokens=self.hit_tokens,
            miss_tokens=self.miss_tokens,
            deferred_lookups=self.deferred_lookups,
            deferrals_bounded=scheduler.deferrals_bounded,
            store_plans=self.store_plans,
            stored_blocks=sum(s.stored_blocks for s in per),
            deferred_blocks=sum(s.deferred_blocks for s in per),
            deferred_steps=scheduler.deferred_steps,
            evicted_while_live=sum(s.evicted_while_live for s in per),
            restored_blocks=sum(s.restored_blocks for s in per),
            load_plans=self.load_plans,
            loaded_blocks=sum(s.loaded_blocks for s in per),
            failed_stores=self.failed_stores,
            failed_loads=self.failed_loads,
            abandoned_transfers=self.abandoned,
            abandoned_loads=scheduler.abandoned_loads,
            ignored_completions=sum(s.ignored_completions for s in per),
            cancelled_plans=sum(s.cancelled_plans for s in per),
            concurrent_load_blocks=sum(s.concurrent_load_blocks for s in per),
            bytes_stored=self.bytes_stored,
            bytes_loaded=self.bytes_loaded,
            live_requests=live_requests,
            in_flight_transfers=in_flight_transfers,
            held_blocks=sum(s.held_blocks for s in per),
            hold_expired_blocks=sum(s.hold_expired_blocks for s in per),
            loaded_tokens=self.loaded_tokens,
            prompt_tokens=self.prompt_tokens,
            lookup_misses=dict(self.lookup_misses),
            miss_reason_tokens=dict(self.miss_reason_tokens),
        )


@final
class GroupLauncher:
    """Pins, submits, tracks, completes and unpins the grouped transfers of a
    `GroupedScheduler`.

    Args:
        scheduler: makes the plans and is told how each part ended.
        engines: per cacheable group, its copy engine (filled in on opening).
        pinners: per group name, its pinner (groups not named are not pinned).
        poll_interval_s: the completion poller's sleep while transfers are in flight.
    """

    __slots__ = (
        "_engines",
        "_load_tokens",
        "_next_id",
        "_pinners",
        "_scheduler",
        "counters",
        "on_stored",
        "pinner_error",
        "poller",
        "tasks",
    )

    def __init__(
        self,
        scheduler: GroupedScheduler,
        engines: Mapping[str, CopyEngine],
        pinners: Mapping[str, GpuBlockPinner],
        *,
        poll_interval_s: float,
    ) -> None:
        self._scheduler = scheduler
        self._engines = engines
        self._pinners = dict(pinners)
        self.poller = CompletionPoller(self._on_complete, poll_interval_s=poll_interval_s)
        """Delivers each completion to this launcher (run it in a task group)."""
        self.counters = GroupCounters()
        self.tasks: dict[int, TransferTask] = {}
        """Grouped transfers launched and not completed yet, by id."""
        self._load_tokens: dict[int, int] = {}
        self._next_id = 0
        self.pinner_error: BaseException | None = None
        """What an ``unpin`` raised since it was last reported."""
        self.on_stored: Callable[[str, StorePlan], None] | None = None
        """Told of each group's part of a successful store, once completed (the tiers)."""

    def launch(self, plan: GroupedPlan, after: object | None, load_tokens: int = 0) -> TransferTask:
        """Pin each group's GPU blocks, submit every part, track the one task.

        Raises:
            PinnerError: a pinner's ``pin`` raised; every part is cancelled.
            Exception: what the first part's ``submit`` raised; unpinned and cancelled.
        """
        pinned: list[tuple[str, Sequence[int]]] = []
        try:
            for name, sub in plan.plans.items():
                pinner = self._pinners.get(name)
                if pinner is not None:
                    pinner.pin(sub.gpu_block_ids)
                    pinned.append((name, sub.gpu_block_ids))
        except Exception as exc:
            self._undo(plan, pinned)
            raise PinnerError(
                f"the GpuBlockPinner's pin raised for a {plan.kind} of groups "
                f"{sorted(plan.plans)}: {exc!r} (the transfer was not started; nothing is lost)"
            ) from exc
        self._next_id += 1
        try:
            task = submit_grouped(
                self._engines, plan.plans, plan_id=self._next_id, kind=plan_kind(plan), after=after
            )
        except BaseException:
            self._undo(plan, pinned)
            raise
        self.tasks[task.plan.plan_id] = task
        if load_tokens:
            self._load_tokens[task.plan.plan_id] = load_tokens
        self.poller.track(task)
        return task

    def abandon_loads(
        self, abandoned: Mapping[str, Sequence[TransferPlan]]
    ) -> dict[str, tuple[int, ...]]:
        """Resolve the tasks of loads the scheduler just abandoned, per group (their
        awaiters get `LoadAbandonedError` now, as with one group: `TransferLauncher.
        abandon_loads()`); their completion still arrives once every part's copy ended,
        and only then are their GPU blocks unpinned.

        Returns:
            Per group in ``abandoned``, the GPU blocks those copies still write, in plan
            order.
        """
        parts = {(name, p.plan_id) for name, plans in abandoned.items() for p in plans}
        for task in self.tasks.values():
            plan = task.plan
            if (
                plan.kind == "load"
                and isinstance(plan, GroupedTransferPlan)
                and any((name, sub.plan_id) in parts for name, sub in plan.parts.items())
            ):
                task._give_up()  # the owner abandoning its load is what _give_up is for
        return {
            name: tuple(b for p in plans for b in p.gpu_block_ids)
            for name, plans in abandoned.items()
        }

    def hold(self, request_id: str, held: Mapping[str, Sequence[int]]) -> None:
        """Pin the blocks a finished request holds in each group until their stores are
        planned.

        Raises:
            PinnerError: a pinner's ``pin`` raised; the hold is cancelled (what was
                pinned is unpinned).
        """
        pinned: list[tuple[str, Sequence[int]]] = []
        try:
            for name, ids in held.items():
                pinner = self._pinners.get(name)
                if pinner is not None:
                    pinner.pin(ids)
                    pinned.append((name, ids))
        except Exception as exc:
            for name, ids in pinned:
                self._unpin(name, ids)
            self._scheduler.cancel_hold(request_id)
            raise PinnerError(
                f"the GpuBlockPinner's pin raised for the blocks request {request_id!r} "
                f"holds on finish in groups {sorted(held)}: {exc!r}"
            ) from exc

    def unpin_released_holds(self) -> None:
        """Unpin the held blocks the scheduler let go of since the last call."""
        for name, ids in self._scheduler.take_released_holds().items():
            self._unpin(name, ids)

    def _undo(self, plan: GroupedPlan, pinned: Sequence[tuple[str, Sequence[int]]]) -> None:
        for name, ids in pinned:
            self._unpin(name, ids)
        for name, sub in plan.plans.items():
            self._scheduler.cancel(name, sub)

    def _unpin(self, name: str, ids: Sequence[int]) -> None:
        pinner = self._pinners.get(name)
        if pinner is None:
            return
        try:
            pinner.unpin(ids)
        except Exception as exc:
            _log.error("pinner_failed", call="unpin", group=name, error=repr(exc))
            self.pinner_error = exc

    def _on_complete(self, task: TransferTask) -> None:
        self.tasks.pop(task.plan.plan_id, None)
        plan = task.plan
        if not isinstance(plan, GroupedTransferPlan):
            return
        ok = task.status is TransferStatus.DONE
        c = self.counters
        tokens = self._load_tokens.pop(plan.plan_id, 0)
        if ok:
            c.loaded_tokens += tokens
        if task.status is TransferStatus.ABANDONED:
            c.abandoned += 1
        elif not ok and plan.kind == "store":
            c.failed_stores += 1
        elif not ok:
            c.failed_loads += 1
        elif plan.kind == "store":
            c.bytes_stored += task.nbytes
        else:
            c.bytes_loaded += task.nbytes
        try:
            # An abandoned copy that ended well is no failure (its CPU blocks stay cached).
            copied = ok or task._copy_ok
            for name, sub in plan.parts.items():
                self._scheduler.complete(name, sub, copied)
            if ok and self.on_stored is not None:
                for name, sub in plan.parts.items():
                    if isinstance(sub, StorePlan):
                        self.on_stored(name, sub)
        finally:
            for name, sub in plan.parts.items():
                self._unpin(name, sub.gpu_block_ids)

    def scheduler_statistics(self, live_requests: int) -> SchedulerStatistics:
        """The whole model's counters (`GroupCounters.statistics()`)."""
        return self.counters.statistics(
            self._scheduler, live_requests=live_requests, in_flight_transfers=len(self.tasks)
        )


def pool_statistics(scheduler: GroupedScheduler) -> PoolStatistics:
    """Every group's pool statistics added up, field by field."""
    parts = [scheduler.ledger(name).pool.statistics() for name in scheduler.statistics()]
    values = {
        f.name: sum(getattr(p, f.name) for p in parts)
        if all(isinstance(getattr(p, f.name), int) for p in parts)
        else getattr(parts[0], f.name)
        for f in fields(PoolStatistics)
    }
    return PoolStatistics(**values)


def plan_kind(plan: GroupedPlan) -> TransferKind:
    """The direction of a grouped plan."""
    return "store" if plan.kind == "store" else "load"
