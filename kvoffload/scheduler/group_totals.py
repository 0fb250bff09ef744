"""The whole model's totals over several KV cache groups: `GroupCounters` and
`pool_statistics()`.

Each group's pool and plans are counted by its group (`GroupStatistics`); what belongs
to the model as a whole (a lookup, a step's plan, a transfer over every group's parts) is
counted once, in a `GroupCounters`: the same `Counters` as one group's, so each counter
has one name, one meaning and one way of counting a miss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Protocol, final

from kvoffload.errors import InvariantError
from kvoffload.pool.events import PoolStatistics
from kvoffload.scheduler.misses import MissReason
from kvoffload.scheduler.stats import Counters, SchedulerStatistics
from kvoffload.transfer.plan import TransferPlan
from kvoffload.transfer.task import TransferStatus, TransferTask

if TYPE_CHECKING:
    from kvoffload.scheduler.group_state import GroupStatistics
    from kvoffload.scheduler.ledger import BlockLedger


class GroupedScheduler(Protocol):
    """What the totals read of a `kvoffload.scheduler.groups.GroupedScheduler`."""

    @property
    def deferrals_bounded(self) -> int: ...

    @property
    def deferred_steps(self) -> int: ...

    @property
    def abandoned_loads(self) -> int: ...

    def ledger(self, group: str) -> BlockLedger: ...

    def statistics(self) -> Mapping[str, GroupStatistics]: ...


__all__ = ["GroupCounters", "PlanParts", "pool_statistics"]

_PER_GROUP = (
    "stored_blocks",
    "deferred_blocks",
    "evicted_while_live",
    "restored_blocks",
    "loaded_blocks",
    "ignored_completions",
    "cancelled_plans",
    "concurrent_load_blocks",
    "hold_expired_blocks",
)
"""The counters of `SchedulerStatistics` that are every group's added up."""


@final
class GroupCounters(Counters):
    """The whole-model counters of a model with several groups (per group:
    `GroupStatistics`): its lookups (`count_lookup()`), the plans its callers count,
    and its transfers (`ended()`)."""

    __slots__ = ()

    def __init__(self) -> None:
        # A transfer's blocks are counted per group; its bytes and tokens by `ended()`.
        super().__init__(block_size=0, bytes_per_block=0)

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
            self.missed(reason, missed)

    def ended(self, task: TransferTask, tokens: int) -> None:
        """Count a transfer (every group's part of it) that ended; ``tokens``: what a
        load brings in."""
        status = task.status
        store = task.plan.kind == "store"
        if status is TransferStatus.DONE:
            self.loaded_tokens += tokens
            if store:
                self.bytes_stored += task.nbytes
            else:
                self.bytes_loaded += task.nbytes
        elif status is TransferStatus.ABANDONED:
            self.abandoned_transfers += 1
        elif store:
            self.failed_stores += 1
        else:
            self.failed_loads += 1

    def statistics(
        self, scheduler: GroupedScheduler, *, live_requests: int, in_flight_transfers: int
    ) -> SchedulerStatistics:
        """The whole model's counters, as `SchedulerStatistics` (the blocks: every
        group's added up; per group, see `GroupedScheduler.statistics()`)."""
        per = scheduler.statistics().values()
        whole = self.snapshot(
            live_requests=live_requests,
            in_flight_transfers=in_flight_transfers,
            held_blocks=sum(s.held_blocks for s in per),
        )
        return replace(
            whole,
            deferrals_bounded=scheduler.deferrals_bounded,
            deferred_steps=scheduler.deferred_steps,
            abandoned_loads=scheduler.abandoned_loads,
            **{name: sum(getattr(s, name) for s in per) for name in _PER_GROUP},
        )


@final
class _Parts:
    """One plan of the whole model: its kind and its parts not cancelled yet."""

    __slots__ = ("kind", "left")

    def __init__(self, kind: str, left: int) -> None:
        self.kind = kind
        self.left = left


@final
class PlanParts:
    """The whole model's count of plans (``load_plans``, ``store_plans`` of `totals`): a
    plan is counted once however many groups' parts it has, and uncounted once every
    part was cancelled (its copy never started), as one group's plan is.

    Args:
        totals: the counters it counts in.
    """

    __slots__ = ("_parts", "totals")

    def __init__(self, totals: GroupCounters) -> None:
        self.totals = totals
        self._parts: dict[tuple[str, int], _Parts] = {}

    def opened(self, kind: str, plans: Mapping[str, TransferPlan]) -> None:
        """A plan of ``kind`` (``"load"`` or ``"store"``) with one part per group."""
        parts = _Parts(kind, len(plans))
        for group, plan in plans.items():
            self._parts[group, plan.plan_id] = parts
        if kind == "store":
            self.totals.store_plans += 1
        else:
            self.totals.load_plans += 1

    def ended(self, group: str, plan_id: int) -> None:
        """``group``'s part completed (or failed): the plan stays counted."""
        parts = self._parts.pop((group, plan_id), None)
        if parts is not None:
            parts.left = -1  # a part ran: no cancel uncounts the plan any more

    def cancelled(self, group: str, plan_id: int) -> None:
        """``group``'s part was cancelled: the last part of a plan none of whose parts ran
        uncounts it."""
        parts = self._parts.pop((group, plan_id), None)
        if parts is None or parts.left < 0:
            return
        parts.left -= 1
        if parts.left:
            return
        if parts.kind == "store":
            self.totals.store_plans -= 1
        else:
            self.totals.load_plans -= 1

    def check_invariants(self, ledgers: Mapping[str, BlockLedger]) -> None:
        """Every part it keeps is a plan in flight in its group's ledger.

        Raises:
            InvariantError: naming the part.
        """
        for group, plan_id in self._parts:
            if not ledgers[group].has_plan(plan_id):
                raise InvariantError(
                    f"group {group!r}: plan {plan_id} is counted as in flight, but its "
                    "ledger does not know it"
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
