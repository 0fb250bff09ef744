"""The scheduler's cross-part checks: each part's own records against the others'.

`OffloadScheduler.check_invariants()` runs `check_parts()`: the ledger's audit first
(`BlockLedger.check_invariants()`, the pool's included), then the request table's
(each request's phase, pin, table, cursor and plans), then the counts the table finds
against the store planner's and the finish holds', and the planners' records against the
ledger's plans (`PlanOutcomes.check()`).
"""

from __future__ import annotations

from kvoffload.errors import InvariantError
from kvoffload.scheduler.holds import FinishHolds
from kvoffload.scheduler.ledger import BlockLedger
from kvoffload.scheduler.outcomes import PlanOutcomes
from kvoffload.scheduler.requests import RequestTable
from kvoffload.scheduler.stores import StorePlanner

__all__ = ["check_parts"]


def check_parts(
    ledger: BlockLedger,
    table: RequestTable,
    stores: StorePlanner,
    holds: FinishHolds,
    outcomes: PlanOutcomes,
) -> None:
    """Check every DESIGN.md invariant an `OffloadScheduler`'s parts can see.

    Raises:
        InvariantError: naming the breach.
    """
    ledger.check_invariants()
    live_refs, held = table.check_invariants({id(p) for p in ledger.pins()}, ledger.has_plan)
    if live_refs != stores.live_refs:
        raise InvariantError("live-request block counts disagree with the cursors")
    if held != holds.total:
        raise InvariantError(f"held GPU blocks: {held} counted {holds.total}")
    outcomes.check()
