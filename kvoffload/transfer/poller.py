"""The one service task that notices finished copies: `CompletionPoller`.

It queries each in-flight task's completion handle without blocking (``event.query()``,
``future.done()``), never ``synchronize()``. Copies on one queue (one CUDA stream, one
worker thread) finish in order, so per queue it stops at the first pending one. While
anything is in flight it sleeps up to ``poll_interval_s`` between rounds; while idle it
waits on an event that `CompletionPoller.track()` sets.

A completion that can signal its end from another thread (a worker thread's future: its
handle has ``notify_on_done(callback)``) cuts the sleep short: the callback hands a wake-up
to the event loop thread-safely, so the poller sees the copy within microseconds instead of
at the next round. (Event loops sleep in whole milliseconds, so polling alone costs about a
millisecond per completion.) CUDA events cannot signal without a host callback that would
take the GIL on a driver thread, so they are polled.
"""

from __future__ import annotations

import asyncio
import statistics as _stats
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import final

import anyio
import anyio.abc
import anyio.lowlevel

from kvoffload._logging import get_logger
from kvoffload.errors import InvariantError, KvOffloadError
from kvoffload.transfer.task import TransferStatus, TransferTask

__all__ = ["CompletionPoller", "PollerStatistics"]

_log = get_logger("transfer.poller")
_LATENCY_SAMPLES = 4096

_Threadsafe = Callable[[Callable[[], None]], object]
"""Schedules a callable on the event loop thread from any thread, without blocking."""


def _threadsafe_scheduler() -> _Threadsafe | None:
    """How to run a callback on the current event loop from another thread, if known."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:
        pass  # not asyncio
    try:
        import trio.lowlevel  # noqa: PLC0415 - trio is optional

        run_sync_soon: _Threadsafe = trio.lowlevel.current_trio_token().run_sync_soon
    except (ImportError, RuntimeError):
        return None
    return run_sync_soon


@dataclass(frozen=True, slots=True)
class PollerStatistics:
    """A snapshot of a `CompletionPoller`.

    Each entry is also the help text of the poller's metric (`kvoffload.metrics`).

    Attributes:
        in_flight: transfers tracked and not delivered yet.
        completed: transfers delivered as done.
        failed: transfers delivered as failed.
        abandoned: transfers delivered as abandoned.
        callback_errors: times the completion callback raised.
        polls: query rounds the poller made.
        observe_latency_median_s: median time from a copy's end to the poller seeing it,
            over recent copies whose end time is known (``None`` if none is).
        observe_latency_p99_s: 99th percentile of the time from a copy's end to the
            poller seeing it, over the same copies (``None`` if none is known).
    """

    in_flight: int
    completed: int
    failed: int
    abandoned: int
    callback_errors: int
    polls: int
    observe_latency_median_s: float | None
    observe_latency_p99_s: float | None


@final
class CompletionPoller:
    """Delivers every finished `TransferTask` to ``on_complete`` exactly once.

    Start it with ``await task_group.start(poller.run)``. For each finished task it sets
    the final status, calls ``on_complete(task)`` (on success, failure or abandonment)
    and then wakes the task's awaiters. Completion happens whether or not anyone awaits.

    Args:
        on_complete: synchronous callback, run on the event loop thread. If it raises,
            the error is logged, the poller keeps going, and `check_health()` raises.
        poll_interval_s: sleep between query rounds while copies are in flight.

    Raises:
        ValueError: ``poll_interval_s`` is not positive.
    """

    __slots__ = (
        "_abandoned",
        "_callback_errors",
        "_completed",
        "_drained",
        "_failed",
        "_in_flight",
        "_interval",
        "_kick",
        "_kicked",
        "_latencies",
        "_on_complete",
        "_polls",
        "_queues",
        "_running",
        "_threadsafe",
        "_wakeup",
        "callback_error",
    )

    def __init__(
        self, on_complete: Callable[[TransferTask], None], *, poll_interval_s: float
    ) -> None:
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self._on_complete = on_complete
        self._interval = poll_interval_s
        self._queues: dict[object, deque[TransferTask]] = {}
        self._in_flight = 0
        self._completed = 0
        self._failed = 0
        self._abandoned = 0
        self._callback_errors = 0
        self.callback_error: Exception | None = None
        """The completion callback's last error (read it; `check_health()` raises it)."""
        self._polls = 0
        self._latencies: deque[float] = deque(maxlen=_LATENCY_SAMPLES)
        self._wakeup: anyio.Event | None = None
        self._drained: anyio.Event | None = None
        self._running = False
        self._threadsafe: _Threadsafe | None = None
        self._kick: anyio.Event | None = None
        self._kicked = False

    def track(self, task: TransferTask) -> None:
        """Watch ``task`` until its copy ends. Synchronous; call it on the loop thread.

        Raises:
            InvariantError: the task is already tracked or delivered.
        """
        if task._delivered or task._completion is None:
            raise InvariantError(f"{task!r} was already delivered")
        key = task._queue if task._queue is not None else task
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        elif task in queue:
            raise InvariantError(f"{task!r} is already tracked")
        queue.append(task)
        self._in_flight += 1
        notify = getattr(task._completion, "notify_on_done", None)
        if notify is not None:
            notify(self._wake_from_any_thread)
        if self._wakeup is not None:
            self._wakeup.set()

    def _wake_from_any_thread(self) -> None:
        """A copy ended (called on whatever thread ended it): wake the loop's poller."""
        threadsafe = self._threadsafe
        if threadsafe is None:
            return  # not running: the next run() polls anyway
        try:
            threadsafe(self._on_kick)
        except Exception:  # the loop is gone; polling covers it
            return

    def _on_kick(self) -> None:
        self._kicked = True
        if self._kick is not None:
            self._kick.set()

    @property
    def in_flight(self) -> int:
        """Tracked tasks not delivered yet."""
        return self._in_flight

    def check_health(self) -> None:
        """Raise if the completion callback ever failed.

        Raises:
            KvOffloadError: chained to the callback's last exception.
        """
        if self.callback_error is not None:
            raise KvOffloadError(
                f"the completion callback failed {self._callback_errors} time(s); "
                f"last error: {self.callback_error!r}"
            ) from self.callback_error

    def statistics(self) -> PollerStatistics:
        """A snapshot of counters and observation latency."""
        lat = sorted(self._latencies)
        median = _stats.median(lat) if lat else None
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
        return PollerStatistics(
            in_flight=self._in_flight,
            completed=self._completed,
            failed=self._failed,
            abandoned=self._abandoned,
            callback_errors=self._callback_errors,
            polls=self._polls,
            observe_latency_median_s=median,
            observe_latency_p99_s=p99,
        )

    def poll(self) -> int:
        """Query every queue once and deliver what finished; return how many were delivered.

        Never blocks. `run()` calls this; tests may call it directly.
        """
        self._polls += 1
        delivered = 0
        for key in list(self._queues):
            queue = self._queues[key]
            while queue:
                task = queue[0]
                completion = task._completion
                error: BaseException | None
                try:
                    if completion is None:  # delivered elsewhere (inline test engine)
                        finished, error = True, None
                    else:
                        finished = completion.query()
                        error = completion.error() if finished else None
                except Exception as exc:
                    finished, error = True, exc
                if not finished:
                    break
                queue.popleft()
                self._in_flight -= 1
                if not task._delivered:
                    self._deliver(task, error)
                    delivered += 1
            if not queue:
                del self._queues[key]
        if self._in_flight == 0 and self._drained is not None:
            self._drained.set()
            self._drained = None
        return delivered

    def _deliver(self, task: TransferTask, error: BaseException | None) -> None:
        callback_error = task._deliver(error, self._on_complete)
        fired = task._finished_at
        if fired is not None:
            self._latencies.append(max(0.0, time.perf_counter() - fired))
        status = task.status
        if status is TransferStatus.DONE:
            self._completed += 1
        elif status is TransferStatus.FAILED:
            self._failed += 1
            _log.warning(
                "transfer_failed",
                plan_id=task.plan.plan_id,
                kind=task.kind,
                blocks=task.plan.num_blocks,
                error=repr(task._exception.__cause__ if task._exception else error),
            )
        else:
            self._abandoned += 1
        if callback_error is not None:
            self._callback_errors += 1
            self.callback_error = callback_error
            _log.error(
                "completion_callback_failed",
                plan_id=task.plan.plan_id,
                kind=task.kind,
                error=repr(callback_error),
                exc_info=callback_error,
            )

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled: deliver finished tasks, sleep while busy, wait while idle.

        Start with ``await task_group.start(poller.run)``. Cancellation stops the service;
        tasks still in flight stay tracked and a later ``run()`` delivers them.

        Raises:
            InvariantError: ``run()`` is already running.
        """
        if self._running:
            raise InvariantError("CompletionPoller.run() is already running")
        self._running = True
        self._threadsafe = _threadsafe_scheduler()
        try:
            task_status.started()
            while True:
                if not self._queues:
                    self._wakeup = anyio.Event()
                    await self._wakeup.wait()
                    self._wakeup = None
                self._kicked = False
                self.poll()
                if self._queues and not self._kicked:
                    self._kick = anyio.Event()
                    with anyio.move_on_after(self._interval):
                        await self._kick.wait()
                    self._kick = None
        finally:
            self._wakeup = None
            self._kick = None
            self._threadsafe = None
            self._running = False

    async def drain(self) -> None:
        """Wait until nothing is in flight (needs `run()` to be serving).

        Cancellation cancels only the wait.
        """
        while self._in_flight:
            if self._drained is None:
                self._drained = anyio.Event()
            await self._drained.wait()
        await anyio.lowlevel.checkpoint()
