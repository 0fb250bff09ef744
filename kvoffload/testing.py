"""Public test doubles for code built on kvoffload. The library never imports this module.

* `ControllableCopyEngine`: a `CopyEngine` whose copies
  stay pending until the test completes or fails them (or never does).
* `FaultyCopyEngine`: wraps any engine so that chosen submissions fail to launch.
* `CopyFaults`: a ``copy_hook`` for `ThreadCopyEngine`
  that makes chosen copies raise (in the worker) or run slowly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import final

import anyio
import torch

from kvoffload.errors import ClosedError, InvariantError
from kvoffload.layout import KVLayout
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.gather import BlockMover, validate_plan
from kvoffload.transfer.plan import TransferPlan
from kvoffload.transfer.task import TransferTask

__all__ = ["ControllableCopyEngine", "CopyFaults", "FaultyCopyEngine", "TestCompletion"]


@final
class TestCompletion:
    """A completion handle that a test flips: pending until `finish()`."""

    __test__ = False  # not a pytest test class
    __slots__ = ("_error", "_finished", "query_count")

    def __init__(self) -> None:
        self._finished = False
        self._error: BaseException | None = None
        self.query_count = 0

    def finish(self, error: BaseException | None = None) -> None:
        """Mark the copy ended, successfully or with ``error``."""
        self._finished = True
        self._error = error

    def query(self) -> bool:
        """Whether `finish()` was called (counts calls)."""
        self.query_count += 1
        return self._finished

    def error(self) -> BaseException | None:
        """The error given to `finish()`."""
        return self._error


@final
class ControllableCopyEngine:
    """A copy engine whose copies end only when the test says so.

    Every submitted task is ``RUNNING`` and listed in `pending` until
    `complete()` or `fail()`. With ``on_complete`` the completion is delivered on
    the spot (status, callback, awaiters), so it works with no event loop at all; without
    it the test tracks tasks with a `CompletionPoller`, which
    delivers them. Given ``layout``, ``gpu_kv`` and ``host``, `complete()` also really
    copies the bytes first.

    Args:
        num_gpu_blocks: GPU ids must be below this (``None``: no check unless tensors given).
        num_cpu_blocks: CPU ids must be below this (``None``: no check unless host given).
        layout: with ``gpu_kv`` and ``host``: copy real bytes on completion.
        gpu_kv: per-layer KV tensors (CPU).
        host: the host buffer.
        on_complete: deliver completions inline to this callback.
        launch_failures: 0-based submission numbers whose launch fails.
    """

    __slots__ = (
        "_closed",
        "_handles",
        "_launch_failures",
        "_mover",
        "_num_cpu",
        "_num_gpu",
        "_on_complete",
        "callback_errors",
        "pending",
        "submitted",
    )

    def __init__(
        self,
        *,
        num_gpu_blocks: int | None = None,
        num_cpu_blocks: int | None = None,
        layout: KVLayout | None = None,
        gpu_kv: Sequence[torch.Tensor] | None = None,
        host: HostKVBuffer | None = None,
        on_complete: Callable[[TransferTask], None] | None = None,
        launch_failures: Collection[int] = (),
    ) -> None:
        self._mover: BlockMover | None = None
        if layout is not None and gpu_kv is not None and host is not None:
            self._mover = BlockMover(layout, gpu_kv, host)
            num_gpu_blocks = self._mover.num_gpu_blocks
            num_cpu_blocks = self._mover.num_cpu_blocks
        self._num_gpu = num_gpu_blocks
        self._num_cpu = num_cpu_blocks
        self._on_complete = on_complete
        self._launch_failures = frozenset(launch_failures)
        self._handles: dict[int, TestCompletion] = {}
        self._closed = False
        self.pending: list[TransferTask] = []
        """Tasks submitted and neither completed nor failed, in submission order."""
        self.submitted: list[TransferTask] = []
        """Every task, in submission order (``submitted[k]`` is submission ``k``)."""
        self.callback_errors: list[Exception] = []
        """Exceptions ``on_complete`` raised during inline delivery."""

    @property
    def closed(self) -> bool:
        """Whether `aclose()` was called."""
        return self._closed

    def submit(self, plan: TransferPlan, *, after: object | None = None) -> TransferTask:
        """Register the copy; it stays pending until the test ends it.

        Raises:
            ValueError: the plan is malformed.
            ClosedError: the engine was closed.
        """
        if self._closed:
            raise ClosedError("ControllableCopyEngine is closed")
        validate_plan(plan, self._num_gpu if self._num_gpu is not None else 1 << 62, self._num_cpu)
        nbytes = self._mover.nbytes(plan) if self._mover is not None else 0
        index = len(self.submitted)
        if index in self._launch_failures:
            task = TransferTask._failed_launch(
                plan, nbytes, RuntimeError(f"injected launch failure of submission {index}")
            )
            self.submitted.append(task)
            if self._on_complete is not None:
                completion = task._completion
                launch_error = completion.error() if completion is not None else None
                self._record(task._deliver(launch_error, self._on_complete))
            return task
        handle = TestCompletion()
        task = TransferTask._create(plan, nbytes=nbytes, completion=handle)
        self._handles[id(task)] = handle
        self.submitted.append(task)
        self.pending.append(task)
        return task

    def _record(self, error: Exception | None) -> None:
        if error is not None:
            self.callback_errors.append(error)

    def _take(self, task: TransferTask | int) -> tuple[TransferTask, TestCompletion]:
        if isinstance(task, int):
            task = self.submitted[task]
        handle = self._handles.pop(id(task), None)
        if handle is None:
            raise InvariantError(f"{task!r} is not pending in this engine")
        self.pending.remove(task)
        return task, handle

    def complete(self, task: TransferTask | int) -> TransferTask:
        """End a pending copy successfully (copying real bytes when configured).

        Args:
            task: the task, or its submission number.

        Returns:
            The task.

        Raises:
            InvariantError: the task is not pending here.
        """
        task, handle = self._take(task)
        error: BaseException | None = None
        if self._mover is not None:
            try:
                self._mover.copy_segments(self._mover.segments(task.plan))
            except Exception as exc:
                error = exc
        self._end(task, handle, error)
        return task

    def fail(self, task: TransferTask | int, exc: BaseException | None = None) -> TransferTask:
        """End a pending copy with ``exc`` (default: a ``RuntimeError``).

        Raises:
            InvariantError: the task is not pending here.
        """
        task, handle = self._take(task)
        if exc is None:
            exc = RuntimeError(f"injected copy failure of plan {task.plan.plan_id}")
        self._end(task, handle, exc)
        return task

    def complete_all(self) -> list[TransferTask]:
        """Complete every pending task in submission order; return them."""
        return [self.complete(t) for t in list(self.pending)]

    def _end(self, task: TransferTask, handle: TestCompletion, error: BaseException | None) -> None:
        handle.finish(error)
        if self._on_complete is not None:
            self._record(task._deliver(error, self._on_complete))

    async def aclose(self) -> None:
        """Wait (shielded) until the test ended every pending copy. Idempotent."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            while True:
                if not self.pending:
                    break
                await anyio.sleep(0.001)


@final
class FaultyCopyEngine:
    """Wraps a copy engine so that chosen submissions fail to launch.

    Args:
        inner: the engine that runs the other submissions.
        fail_submits: 0-based submission numbers that return an already ``FAILED`` task
            (the inner engine never sees them).
        error: the launch error to chain.
    """

    __slots__ = ("_count", "_error", "_fail", "_inner")

    def __init__(
        self,
        inner: CopyEngine,
        *,
        fail_submits: Collection[int],
        error: Callable[[int], BaseException] | None = None,
    ) -> None:
        self._inner = inner
        self._fail = frozenset(fail_submits)
        self._error = error or (lambda k: RuntimeError(f"injected launch failure {k}"))
        self._count = 0

    @property
    def closed(self) -> bool:
        """Whether the inner engine is closed."""
        return self._inner.closed

    def submit(self, plan: TransferPlan, *, after: object | None = None) -> TransferTask:
        """Fail submission ``k`` if chosen, else forward to the inner engine."""
        k = self._count
        self._count += 1
        if k in self._fail:
            if self._inner.closed:
                raise ClosedError("the wrapped copy engine is closed")
            return TransferTask._failed_launch(plan, 0, self._error(k))
        return self._inner.submit(plan, after=after)

    async def aclose(self) -> None:
        """Close the inner engine."""
        await self._inner.aclose()


@final
class CopyFaults:
    """A ``copy_hook`` that fails or slows chosen copies inside the worker thread.

    Args:
        fail_copies: 0-based copy numbers (in hook call order) that raise.
        delay_s: seconds each copy sleeps before moving bytes (the GIL is released).
        gate: when given, every copy waits for this event first (a copy that "never
            completes" until the test sets it).
        error: builds the exception for copy ``k``.
    """

    __slots__ = ("_delay", "_error", "_fail", "_gate", "_lock", "calls")

    def __init__(
        self,
        *,
        fail_copies: Collection[int] = (),
        delay_s: float = 0.0,
        gate: threading.Event | None = None,
        error: Callable[[int], BaseException] | None = None,
    ) -> None:
        self._fail = frozenset(fail_copies)
        self._delay = delay_s
        self._gate = gate
        self._error = error or (lambda k: RuntimeError(f"injected copy failure {k}"))
        self._lock = threading.Lock()
        self.calls = 0
        """Copies the hook has seen."""

    def __call__(self, plan: TransferPlan) -> None:
        """Run before a copy (in the worker)."""
        with self._lock:
            k = self.calls
            self.calls += 1
        if self._gate is not None:
            self._gate.wait()
        if self._delay:
            time.sleep(self._delay)
        if k in self._fail:
            raise self._error(k)
