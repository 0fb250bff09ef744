"""The `CopyEngine` protocol, and the in-flight bookkeeping engines share.

An engine turns a `TransferPlan` into a running copy and a
`TransferTask`. ``submit`` is synchronous and never blocks the
event loop. Tasks finish only through a `CompletionPoller`:
the owner passes every submitted task to ``poller.track``.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol, TypeVar, final, runtime_checkable

import anyio

from kvoffload.errors import ClosedError
from kvoffload.transfer.plan import TransferPlan
from kvoffload.transfer.task import CompletionHandle, TransferTask

if TYPE_CHECKING:
    from kvoffload.transfer.gather import BlockMover

__all__ = ["CopyEngine"]

_E = TypeVar("_E", bound="_EngineBase")


@runtime_checkable
class CopyEngine(Protocol):
    """Moves the blocks a plan names and reports completion through a task."""

    def submit(self, plan: TransferPlan, *, after: object | None = None) -> TransferTask:
        """Start the copy ``plan`` describes; return its task without blocking.

        Args:
            plan: a store (GPU → CPU) or load (CPU → GPU) plan.
            after: what the copy must be ordered after (a CUDA event for the CUDA
                engine); ``None`` orders it after the caller's current work.

        Returns:
            A task; ``FAILED`` already when the copy could not be launched.

        Raises:
            InvalidInputError: the plan is malformed (the message names the field and id).
            InputTypeError: ``after`` is of a type the engine does not take.
            ClosedError: the engine was closed.
        """
        ...

    @property
    def closed(self) -> bool:
        """Whether `aclose()` was called."""
        ...

    async def aclose(self) -> None:
        """Wait (shielded) for every in-flight copy to end, then release the engine.

        Idempotent. Cancellation cannot interrupt the wait: freeing memory under a
        running copy is worse than a late close.
        """
        ...


@final
class _InFlight:
    """Completion handles of submitted copies, for ``aclose`` to wait on."""

    __slots__ = ("_handles", "_interval")

    def __init__(self, poll_interval_s: float) -> None:
        self._handles: deque[CompletionHandle] = deque()
        self._interval = poll_interval_s

    def add(self, handle: CompletionHandle) -> None:
        self._prune()
        self._handles.append(handle)

    def _prune(self) -> None:
        handles = self._handles
        while handles and _finished(handles[0]):
            handles.popleft()

    def __len__(self) -> int:
        self._prune()
        return len(self._handles)

    async def wait_all(self) -> None:
        """Wait, shielded, until every handle reports finished (non-blocking queries)."""
        with anyio.CancelScope(shield=True):
            while True:
                pending = deque(h for h in self._handles if not _finished(h))
                self._handles = pending
                if not pending:
                    break
                await anyio.sleep(self._interval)


def _finished(handle: CompletionHandle) -> bool:
    try:
        return handle.query()
    except Exception:
        return True


def check_open(closed: bool, name: str) -> None:
    """Raise `ClosedError` for use after close."""
    if closed:
        raise ClosedError(f"{name} is closed")


class _EngineBase:
    """What the built-in engines share: their data path, in-flight copies, closing."""

    __slots__ = ("_closed", "_in_flight", "_mover")

    _closed: bool
    _in_flight: _InFlight
    _mover: BlockMover

    @property
    def closed(self) -> bool:
        """Whether `aclose()` was called."""
        return self._closed

    @property
    def mover(self) -> BlockMover:
        """The data path."""
        return self._mover

    def in_flight(self) -> int:
        """Copies submitted and not finished."""
        return len(self._in_flight)

    async def aclose(self) -> None:
        """Wait for the copies in flight, then release the engine's resources."""
        raise NotImplementedError

    async def __aenter__(self: _E) -> _E:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
