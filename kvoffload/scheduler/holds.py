"""Finish holds: GPU blocks of finished requests kept until a store plan reads them.

With ``hold_blocks_on_finish`` (eager mode), ``finish()`` of a request whose computed
blocks are not all stored yet (deferred for lack of space) keeps them: the engine must
not free those GPU blocks until a later ``plan_stores`` has planned them (or
``hold_max_steps`` calls passed); at most ``hold_max_blocks`` are held in all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import final

from kvoffload._logging import get_logger
from kvoffload.config import OffloadConfig
from kvoffload.errors import RequestStateError
from kvoffload.scheduler.requests import RequestTable
from kvoffload.scheduler.state import RequestOffloadState, RequestPhase
from kvoffload.scheduler.stats import Counters
from kvoffload.scheduler.stores import StorePlanner, StoreUndo
from kvoffload.transfer.plan import StorePlan

__all__ = ["FinishHolds"]

_log = get_logger("scheduler")


@final
class FinishHolds:
    """The held GPU blocks of finished requests, and those released since last asked.

    Args:
        config: the settings (``hold_blocks_on_finish``, ``hold_max_steps``,
            ``hold_max_blocks``, store mode).
        table: the registered requests.
        stores: the store planner (its cursors and its ``plan_stores`` clock).
        counters: the statistics this part adds to.
    """

    def __init__(
        self,
        config: OffloadConfig,
        table: RequestTable,
        stores: StorePlanner,
        counters: Counters,
    ) -> None:
        self._config = config
        self._block_size = config.block_size
        self._table = table
        self._stores = stores
        self._counters = counters
        self.total = 0
        """GPU blocks held now, by all finished requests."""
        self._released: list[int] = []

    def begin(self, state: RequestOffloadState) -> list[int]:
        """Hold what a finishing request has computed and not stored (its prefix first,
        within ``hold_max_blocks``); returns the held GPU block ids (empty: none)."""
        config = self._config
        if not config.hold_blocks_on_finish or config.store_mode != "eager" or state.preempted:
            return []
        i = state.num_stored_blocks
        end = min(
            state.num_computed_tokens // self._block_size,
            len(state.block_hashes),
            len(state.gpu_block_ids),
        )
        n = min(end - i, config.hold_max_blocks - self.total)
        if n <= 0:
            return []
        state.num_computed_tokens = (i + n) * self._block_size
        held = state.gpu_block_ids[i : i + n]
        state.held_gpu_block_ids = held
        state.hold_deadline = self._stores.plan_calls + config.hold_max_steps
        self.total += len(held)
        _log.debug("blocks_held_on_finish", request_id=state.request_id, blocks=len(held))
        return held

    def end(self, state: RequestOffloadState, *, report: bool = True) -> None:
        """A finished request's held blocks are planned or given up: release them."""
        held, state.held_gpu_block_ids = state.held_gpu_block_ids, []
        self.total -= len(held)
        if report:
            self._released.extend(held)
        state.move_to(RequestPhase.DRAINING)
        self._stores.reset_cursor(state)
        self._table.drop_if_done(state)

    def end_planned(
        self,
        done: list[RequestOffloadState],
        plan: StorePlan | None,
        undo: Mapping[int, StoreUndo],
    ) -> None:
        """End the holds a ``plan_stores`` call finished with (planned or expired); a
        plan that read held blocks records how to give the holds back if cancelled."""
        holds = []
        for state in done:
            held, cursor = state.held_gpu_block_ids, state.num_stored_blocks
            self.end(state)
            if plan is not None and plan.plan_id in state.in_flight:
                holds.append((state, held, cursor))
        if holds and plan is not None:
            undo[plan.plan_id].holds = holds

    def expire(self, state: RequestOffloadState, *, report: bool = True) -> None:
        """Give a hold up unstored (counted in ``hold_expired_blocks``)."""
        self._counters.hold_expired_blocks += len(state.held_gpu_block_ids)
        self.end(state, report=report)

    def restore(self, state: RequestOffloadState, held: list[int], cursor: int) -> None:
        """Undo the end of a hold whose store plan is cancelled, unless the engine was
        already told the blocks are free (then they stay unstored)."""
        released = self._released
        if Counter(held) - Counter(released):
            return
        for g in held:
            released.remove(g)
        state.held_gpu_block_ids = held
        state.move_to(RequestPhase.HOLDING)
        self.total += len(held)
        self._stores.set_cursor(state, cursor)

    def finish(
        self, state: RequestOffloadState, release_pin: Callable[[RequestOffloadState], None]
    ) -> tuple[int, ...]:
        """For `OffloadScheduler.finish()`: hold what ``state`` computed and did not store
        (if holding), mark it finished, release its pin, drop it when nothing is left.

        Raises:
            RequestStateError: it was already finished.
        """
        if state.finished:
            raise RequestStateError(f"request {state.request_id!r} is already finished")
        held = self.begin(state)
        state.move_to(RequestPhase.HOLDING if held else RequestPhase.DRAINING)
        table = self._table
        table.remember_finished(state.request_id)
        release_pin(state)
        if held:
            return tuple(held)
        self._stores.reset_cursor(state)
        table.drop_if_done(state)
        return ()

    def cancel(self, request_id: str) -> None:
        """Undo the hold ``finish()`` just returned for ``request_id`` (not reported)."""
        state = self._table.requests.get(request_id)
        if state is not None and state.held_gpu_block_ids:
            self.expire(state, report=False)

    def reset_requests(self, release_pin: Callable[[RequestOffloadState], None]) -> None:
        """For `OffloadScheduler.reset()`: end every hold; release every other request's
        pin and put its cursor back to 0 (its next ``update()`` compares its whole table)."""
        stores = self._stores
        for state in list(self._table.requests.values()):
            if state.held_gpu_block_ids:
                self.expire(state)
                continue
            release_pin(state)
            if state.num_stored_blocks:
                state.recheck_table = True
            stores.reset_cursor(state)

    def take_released(self) -> list[int]:
        """GPU blocks whose hold ended since the last call."""
        released, self._released = self._released, []
        return released

    def release_all(self) -> None:
        """Give up every hold now (on close or reset); their blocks stay unstored."""
        for state in [s for s in self._table.requests.values() if s.held_gpu_block_ids]:
            self.expire(state)
