"""Awaitable transfers: `TransferTask`, its `TransferStatus` and result.

A copy engine creates one task per submitted plan. The task keeps everything the copy
touches (completion event or future, streams, index and staging tensors) alive until the
copy has finished. A `CompletionPoller` notices the finish,
settles the status, hands the task to its completion callback once and then wakes every
coroutine that awaits the task.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, final

import anyio
import anyio.lowlevel

from kvoffload.errors import (
    InvariantError,
    LoadAbandonedError,
    TransferError,
    TransferNotFinishedError,
)
from kvoffload.transfer.plan import TransferKind, TransferPlan

__all__ = ["CompletionHandle", "TransferResult", "TransferStatus", "TransferTask"]

_T = TypeVar("_T")


class TransferStatus(enum.Enum):
    """Lifecycle of a `TransferTask`.

    ``PENDING`` (created, not launched) → ``RUNNING`` (queued on its copy stream or
    worker) → ``DONE`` | ``FAILED`` | ``ABANDONED``. A launch failure goes straight from
    ``PENDING`` to ``FAILED``. The last three are final. A load its request abandoned
    (``abandon_load()``) is ``ABANDONED`` at once, while its copy may still run: its
    completion is delivered (references released, GPU blocks unpinned) once it ended.
    """

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    ABANDONED = "abandoned"

    @property
    def is_final(self) -> bool:
        """Whether no further transition is possible."""
        return self in _FINAL

    def advance(self, target: TransferStatus) -> TransferStatus:
        """Return ``target`` if this status may move to it.

        Raises:
            InvariantError: the transition is not allowed; the message names both states.
        """
        if target not in _ALLOWED[self]:
            raise InvariantError(
                f"a transfer cannot go from {self.name} to {target.name} "
                f"(allowed from {self.name}: {sorted(s.name for s in _ALLOWED[self]) or 'none'})"
            )
        return target


_FINAL = frozenset({TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.ABANDONED})
_ALLOWED: dict[TransferStatus, frozenset[TransferStatus]] = {
    TransferStatus.PENDING: frozenset(
        {TransferStatus.RUNNING, TransferStatus.FAILED, TransferStatus.ABANDONED}
    ),
    TransferStatus.RUNNING: _FINAL,
    TransferStatus.DONE: frozenset(),
    TransferStatus.FAILED: frozenset(),
    TransferStatus.ABANDONED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What a successful transfer moved.

    Attributes:
        kind: ``"store"`` (GPU → CPU) or ``"load"`` (CPU → GPU).
        num_blocks: blocks moved.
        nbytes: bytes moved.
        seconds: from submission until the completion was observed.
    """

    kind: TransferKind
    num_blocks: int
    nbytes: int
    seconds: float


class CompletionHandle(Protocol):
    """How a copy reports its end: a CUDA event, a thread future, a test switch.

    ``query()`` must never block. Once it returned ``True``, ``error()`` says whether the
    copy failed. ``query()`` may itself raise (a CUDA error); that fails the task.
    """

    def query(self) -> bool:
        """Whether the copy has finished, successfully or not."""
        ...

    def error(self) -> BaseException | None:
        """The copy's failure, or ``None``; only meaningful after ``query()`` is true."""
        ...


def _fresh_copy(error: TransferError) -> TransferError:
    """A new error of the type of ``error`` with its message and cause, no traceback."""
    copy = type(error)(*error.args)
    copy.__cause__ = error.__cause__
    return copy


@final
class _Finished:
    """A completion that is already there (empty plans, launch failures)."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException | None) -> None:
        self._error = error

    def query(self) -> bool:
        return True

    def error(self) -> BaseException | None:
        return self._error


class _NoPublicConstructor(type):
    """Metaclass that hides the constructor; the package creates instances via ``_create``."""

    def __call__(cls, *args: object, **kwargs: object) -> Any:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor; "
            "tasks come from CopyEngine.submit()"
        )

    def _create(cls: type[_T], *args: object, **kwargs: object) -> _T:
        return super().__call__(*args, **kwargs)  # type: ignore[misc, no-any-return]


@final
class TransferTask(metaclass=_NoPublicConstructor):
    """One submitted store or load; ``await task`` for its `TransferResult`.

    Many coroutines may await the same task. The task strongly references its completion
    handle and whatever the copy uses (events, streams, tensors) until the copy finished.
    Tasks have no public constructor: a `CopyEngine` makes them.

    Attributes:
        plan: the plan this task carries out.
    """

    __slots__ = (
        "_abandoned",
        "_completion",
        "_copy_ok",
        "_delivered",
        "_event",
        "_exception",
        "_finished_at",
        "_keepalive",
        "_nbytes",
        "_queue",
        "_result",
        "_status",
        "_submitted_at",
        "_wait_on",
        "_woken",
        "plan",
    )

    def __init__(
        self,
        plan: TransferPlan,
        *,
        nbytes: int,
        completion: CompletionHandle,
        queue: object | None = None,
        keepalive: tuple[object, ...] = (),
        wait_on: Callable[[object], None] | None = None,
        status: TransferStatus = TransferStatus.RUNNING,
    ) -> None:
        self.plan = plan
        self._nbytes = nbytes
        self._completion: CompletionHandle | None = completion
        self._queue = queue
        self._keepalive = keepalive
        self._wait_on = wait_on
        self._status = status
        self._abandoned = False
        self._copy_ok = False
        self._delivered = False
        self._woken = False
        self._event: anyio.Event | None = None
        self._result: TransferResult | None = None
        self._exception: TransferError | None = None
        self._submitted_at = time.perf_counter()
        self._finished_at: float | None = None

    @classmethod
    def _failed_launch(cls, plan: TransferPlan, nbytes: int, exc: BaseException) -> TransferTask:
        """A task whose launch failed: its completion is already there, and it becomes
        ``FAILED`` when it is delivered (after its references were released), like every
        other task; until then ``done()`` is ``False``."""
        error = TransferError(
            f"{plan.kind} of plan {plan.plan_id} ({plan.num_blocks} blocks) failed to "
            f"launch: {exc!r}"
        )
        error.__cause__ = exc
        task: TransferTask = cls._create(
            plan, nbytes=nbytes, completion=_Finished(error), status=TransferStatus.PENDING
        )
        return task

    def __repr__(self) -> str:
        return (
            f"<TransferTask plan_id={self.plan.plan_id} kind={self.plan.kind} "
            f"blocks={self.plan.num_blocks} status={self._status.value}>"
        )

    @property
    def kind(self) -> TransferKind:
        """``"store"`` (GPU → CPU) or ``"load"`` (CPU → GPU)."""
        return self.plan.kind

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The requests the transfer serves."""
        return self.plan.request_ids

    @property
    def gpu_block_ids(self) -> tuple[int, ...]:
        """Engine KV block ids, paired position by position with `cpu_block_ids`."""
        return self.plan.gpu_block_ids

    @property
    def cpu_block_ids(self) -> tuple[int, ...]:
        """CPU pool block ids."""
        return self.plan.cpu_block_ids

    @property
    def nbytes(self) -> int:
        """Bytes the transfer moves."""
        return self._nbytes

    @property
    def status(self) -> TransferStatus:
        """Where the task is in its lifecycle."""
        return self._status

    def done(self) -> bool:
        """Whether the task reached a final status (done, failed or abandoned)."""
        return self._status.is_final

    def result(self) -> TransferResult:
        """The result of a finished task.

        Raises:
            TransferNotFinishedError: the task has not finished.
            TransferError: the copy failed or was abandoned (cause chained). Each call
                raises a new `TransferError` equal to `exception()` (same message and
                cause): raising the stored one would attach this frame, which holds the
                task, to an exception the task holds, a reference cycle only the cycle
                collector could free.
        """
        if not self._status.is_final:
            raise TransferNotFinishedError(f"{self!r} has not finished")
        if self._exception is not None:
            raise _fresh_copy(self._exception)  # no local may hold it: see above
        if self._result is None:
            raise InvariantError(f"{self!r} finished without a result")
        return self._result

    def exception(self) -> TransferError | None:
        """The failure of a finished task, or ``None`` if it succeeded.

        Raises:
            TransferNotFinishedError: the task has not finished.
        """
        if not self._status.is_final:
            raise TransferNotFinishedError(f"{self!r} has not finished")
        return self._exception

    def wait_on(self, stream: object) -> None:
        """Make ``stream`` wait for this transfer (a load's data) without blocking the host.

        With the CUDA engine this enqueues a wait for the copy's event on ``stream``; with
        engines that have no device streams, and once the task is done, it does nothing.
        """
        if self._wait_on is not None and not self._status.is_final:
            self._wait_on(stream)

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return self._wait().__await__()

    async def _wait(self) -> TransferResult:
        """Wait until the completion was delivered, then return or raise the result.

        Cancellation cancels only this wait: the copy runs on and is still delivered.
        """
        if self._woken:
            await anyio.lowlevel.checkpoint()
        else:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        return self.result()

    def _abandon(self) -> None:
        """Mark the task abandoned (owner reset): it finishes ``ABANDONED`` whatever happens.

        The copy is not stopped; blocks stay referenced until it ends. No effect once final
        (except on a task whose launch failed and that was not delivered yet).
        """
        if not self._delivered:
            self._abandoned = True

    def _give_up(self) -> bool:
        """Resolve the task as ``ABANDONED`` now (`LoadAbandonedError`), while its copy
        runs on: awaiters wake at once and `wait_on()` does nothing any more. The copy's
        completion is still watched and delivered once it ends (that is when its
        references and GPU pins go).

        Returns:
            ``False`` when the task had already finished (nothing changed).
        """
        if self._status.is_final:
            return False
        self._abandoned = True
        self._status = self._status.advance(TransferStatus.ABANDONED)
        self._exception = LoadAbandonedError(
            f"{self.plan.kind} of plan {self.plan.plan_id} ({self.plan.num_blocks} blocks) "
            f"was abandoned (requests {', '.join(self.plan.request_ids)}); its copy may "
            "still be running"
        )
        self._woken = True
        if self._event is not None:
            self._event.set()
        return True

    def _fired_at(self) -> float | None:
        """When the copy itself finished, if the engine knows (thread engine)."""
        getter = getattr(self._completion, "finished_at", None)
        if getter is None:
            return self._finished_at
        value = getter()
        return value if isinstance(value, float) else None

    def _settle(self, error: BaseException | None) -> None:
        """Move to the final status for a copy that ended with ``error`` (or success)."""
        self._finished_at = self._fired_at() or time.perf_counter()
        self._copy_ok = error is None and self._status is not TransferStatus.PENDING
        if self._status.is_final:  # launch failure or given up; may have been abandoned since
            if self._abandoned and self._status is TransferStatus.FAILED:
                self._status = TransferStatus.ABANDONED
                self._exception = self._abandoned_error(self._exception)
            return
        if self._abandoned:
            self._status = self._status.advance(TransferStatus.ABANDONED)
            self._exception = self._abandoned_error(error)
        elif error is not None:
            self._status = self._status.advance(TransferStatus.FAILED)
            if isinstance(error, TransferError):
                self._exception = error
            else:
                exc = TransferError(
                    f"{self.plan.kind} of plan {self.plan.plan_id} ({self.plan.num_blocks} "
                    f"blocks) failed: {error!r}"
                )
                exc.__cause__ = error
                self._exception = exc
        else:
            self._status = self._status.advance(TransferStatus.DONE)
            self._result = TransferResult(
                kind=self.plan.kind,
                num_blocks=self.plan.num_blocks,
                nbytes=self._nbytes,
                seconds=time.perf_counter() - self._submitted_at,
            )

    def _abandoned_error(self, cause: BaseException | None) -> TransferError:
        exc = TransferError(
            f"{self.plan.kind} of plan {self.plan.plan_id} was abandoned by its owner"
        )
        exc.__cause__ = cause
        return exc

    def _deliver(
        self, error: BaseException | None, on_complete: Callable[[TransferTask], None] | None
    ) -> Exception | None:
        """Settle, call ``on_complete`` exactly once, then wake awaiters.

        Returns:
            The exception ``on_complete`` raised, if any (the caller reports it).

        Raises:
            InvariantError: the task was already delivered.
        """
        if self._delivered:
            raise InvariantError(f"{self!r} was already delivered to its completion callback")
        self._delivered = True
        callback_error: Exception | None = None
        try:
            self._settle(error)
            self._completion = None
            self._keepalive = ()
            self._wait_on = None
            if on_complete is not None:
                try:
                    on_complete(self)
                except Exception as exc:
                    callback_error = exc
        finally:
            self._woken = True
            if self._event is not None:
                self._event.set()
        return callback_error
