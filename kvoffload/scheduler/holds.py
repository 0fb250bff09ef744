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
from kvoffload.scheduler.requests import RequestTable, finished_again
from kvoffload.scheduler.state import RequestOffloadState, RequestPhase
from kvoffload.scheduler.stats import Counters
from kvoffload.scheduler.stores import StorePlanner, StoreUndo
from kvoffload.transfer.plan import StorePlan

__all__ = ["FinishHolds", "HeldBlocks"]

_log = get_logger("scheduler")


@final
class HeldBlocks:
    """The GPU blocks finished requests hold in one pool's blocks (one group's), under
    one budget: how many are held, and those released since last asked. The one place of
    the hold rules every shape shares: a hold takes at most `room()` blocks, lasts
    ``hold_max_steps`` store plans (`deadline()`), reports its blocks when it ends (or not,
    when the engine could not keep them), and is given back by a cancelled plan only if
    its blocks were not reported yet (`give_back()`).

    Args:
        config: ``hold_max_blocks``, ``hold_max_steps``.
        counters: where ``hold_expired_blocks`` is counted.
    """

    __slots__ = ("_counters", "_max_blocks", "_max_steps", "_released", "total")

    def __init__(self, config: OffloadConfig, counters: Counters) -> None:
        self._max_blocks = config.hold_max_blocks
        self._max_steps = config.hold_max_steps
        self._counters = counters
        self.total = 0
        """GPU blocks held now."""
        self._released: list[int] = []

    def room(self) -> int:
        """How many more blocks a new hold may take."""
        return self._max_blocks - self.total

    def deadline(self, plan_calls: int) -> int:
        """The ``plan_stores`` call after which a hold begun now is given up."""
        return plan_calls + self._max_steps

    def take(self, held: list[int]) -> None:
        """A hold of ``held`` begins."""
        self.total += len(held)

    def end(self, held: list[int], *, report: bool = True, expired: bool = False) -> None:
        """A hold of ``held`` ends (``expired``: given up unstored, counted in
        ``hold_expired_blocks``); ``report``: the engine is told the blocks are free."""
        if expired:
            self._counters.hold_expired_blocks += len(held)
        self.total -= len(held)
        if report:
            self._released.extend(held)

    def give_back(self, held: list[int]) -> bool:
        """Begin again a hold of ``held`` a cancelled plan ended, unless the engine was
        already told the blocks are free (then ``False``: they stay unstored)."""
        released = self._released
        if Counter(held) - Counter(released):
            return False
        for g in held:
            released.remove(g)
        self.total += len(held)
        return True

    def take_released(self) -> list[int]:
        """GPU blocks whose hold ended since the last call."""
        released, self._released = self._released, []
        return released


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
        self.book = HeldBlocks(config, counters)
        """The held blocks of all finished requests."""

    @property
    def total(self) -> int:
        """GPU blocks held now, by all finished requests."""
        return self.book.total

    def begin(self, state: RequestOffloadState) -> list[int]:
        """Hold what a finishing request has computed and not stored (its prefix first,
        within ``hold_max_blocks``); returns the held GPU block ids (empty: none)."""
        config = self._config
        if (
            not config.hold_blocks_on_finish
            or config.store_mode != "eager"
            or state.preempted
            or state.recheck_table  # after a reset, a table not compared again: no block
        ):
            return []
        i = state.num_stored_blocks
        end = min(
            state.num_computed_tokens // self._block_size,
            len(state.block_hashes),
            len(state.gpu_block_ids),
        )
        book = self.book
        n = min(end - i, book.room())
        if n <= 0:
            return []
        state.num_computed_tokens = (i + n) * self._block_size
        held = state.gpu_block_ids[i : i + n]
        state.held_gpu_block_ids = held
        state.hold_deadline = book.deadline(self._stores.plan_calls)
        book.take(held)
        _log.debug("blocks_held_on_finish", request_id=state.request_id, blocks=len(held))
        return held

    def end(
        self, state: RequestOffloadState, *, report: bool = True, expired: bool = False
    ) -> None:
        """A finished request's held blocks are planned or given up: release them."""
        held, state.held_gpu_block_ids = state.held_gpu_block_ids, []
        self.book.end(held, report=report, expired=expired)
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
        self.end(state, report=report, expired=True)

    def restore(self, state: RequestOffloadState, held: list[int], cursor: int) -> None:
        """Undo the end of a hold whose store plan is cancelled, unless the engine was
        already told the blocks are free (then they stay unstored)."""
        if not self.book.give_back(held):
            return
        state.held_gpu_block_ids = held
        state.move_to(RequestPhase.HOLDING)
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
            raise finished_again(state.request_id)
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
        return self.book.take_released()

    def release_all(self) -> None:
        """Give up every hold now (on close or reset); their blocks stay unstored."""
        for state in [s for s in self._table.requests.values() if s.held_gpu_block_ids]:
            self.expire(state)
