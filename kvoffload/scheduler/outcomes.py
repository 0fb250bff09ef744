"""`PlanOutcomes`: how a plan in flight ends, once: completed (ok or failed), cancelled,
or abandoned by a reset.

The ledger releases the plan's references (`BlockLedger.close()` / `cancel()`); this part
then drops the planners' record of the plan (a store's undo, a load's start block), counts
the outcome and detaches the plan from its requests, or, for a cancelled plan, has the
planner put back what planning it moved (cursors and holds, or the request's pin).
"""

from __future__ import annotations

from typing import Protocol, final

from kvoffload._logging import get_logger
from kvoffload.errors import InvariantError
from kvoffload.scheduler.holds import FinishHolds
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.loads import LoadPlanner
from kvoffload.scheduler.requests import RequestTable
from kvoffload.scheduler.stats import Counters
from kvoffload.scheduler.stores import StorePlanner
from kvoffload.transfer.plan import TransferPlan

__all__ = ["PlanOutcomes", "TransferLike"]

_log = get_logger("scheduler")


class TransferLike(Protocol):
    """Anything that carries the plan it executes (a `TransferTask`)."""

    @property
    def plan(self) -> TransferPlan:
        """The plan the transfer executes."""


@final
class PlanOutcomes:
    """The end of every plan an `OffloadScheduler` made (`complete()`, `cancel()` and
    the abandoning `reset()`).

    Args:
        ledger: the block ledger that holds the plans.
        table: the request table the plans are detached from.
        stores: the store planner (its ``undo`` records, and what a cancel puts back).
        loads: the load planner (its ``starts`` records, and what a cancel puts back).
        holds: the finish holds a cancelled store plan gives back.
        counters: the scheduler's counters.
    """

    __slots__ = ("_counters", "_holds", "_ledger", "_loads", "_stores", "_table")

    def __init__(  # noqa: PLR0917 - one positional per part, named at the only call
        self,
        ledger: BlockLedger,
        table: RequestTable,
        stores: StorePlanner,
        loads: LoadPlanner,
        holds: FinishHolds,
        counters: Counters,
    ) -> None:
        self._ledger = ledger
        self._table = table
        self._stores = stores
        self._loads = loads
        self._holds = holds
        self._counters = counters

    def complete(self, transfer: TransferLike | TransferPlan, ok: bool) -> bool:
        """`OffloadScheduler.complete()`: ``False`` for an unknown or ended plan."""
        plan = transfer if isinstance(transfer, TransferPlan) else transfer.plan
        ledger = self._ledger
        rec = ledger.close(plan.plan_id, ok, plan)
        counters = self._counters
        if rec is None:
            counters.ignored_completions += 1
            _log.debug("completion_ignored", plan_id=plan.plan_id, kind=plan.kind)
            return False
        current = rec.epoch == ledger.epoch
        records = self._stores.undo if plan.kind == "store" else self._loads.starts
        del records[plan.plan_id]
        counters.completed(rec, ok=ok, current=current)
        if current and not ok:
            # The poller already warned with the cause; this records what was released.
            _log.debug(
                "failed_transfer_released",
                kind=plan.kind,
                plan_id=plan.plan_id,
                blocks=len(rec.blocks),
                request_ids=",".join(plan.request_ids),
            )
        self._table.detach(plan)
        return True

    def cancel(self, transfer: TransferLike | TransferPlan) -> bool:
        """`OffloadScheduler.cancel()`: ``False`` for an unknown or ended plan."""
        plan = transfer if isinstance(transfer, TransferPlan) else transfer.plan
        ledger = self._ledger
        rec = ledger.cancel(plan.plan_id, plan)
        counters = self._counters
        if rec is None:
            counters.ignored_completions += 1
            return False
        counters.cancelled_plans += 1
        current = rec.epoch == ledger.epoch
        if plan.kind == "store":
            self._stores.cancel_plan(rec, current, self._holds.restore)
        else:
            self._loads.cancel_plan(rec, current)
        _log.debug("plan_cancelled", plan_id=plan.plan_id, kind=plan.kind)
        self._table.detach(plan)
        return True

    def reset(self) -> bool:
        """`OffloadScheduler.reset()`: every plan in flight is abandoned (it publishes
        nothing when it ends), pins and holds are released, cursors go back to 0 and the
        ledger empties the cache; return whether no plan is in flight any more."""
        ledger = self._ledger
        self._holds.reset_requests(self._loads.release_pin)
        self._stores.reset()
        ledger.reset()
        _log.info("cache_reset", in_flight=ledger.num_plans)
        return not ledger.num_plans

    def check(self) -> None:
        """Check that the planners' records name exactly the ledger's plans of their kind.

        Raises:
            InvariantError: they disagree.
        """
        plans = {rec.plan.plan_id: rec.plan.kind for rec in self._ledger.plans()}
        stores = {p for p, kind in plans.items() if kind == "store"}
        if stores != set(self._stores.undo) or plans.keys() - stores != set(self._loads.starts):
            raise InvariantError("the planners' records disagree with the ledger's plans")
