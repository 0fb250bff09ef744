"""The tier manager's per-tier state and the gate that puts reads before writes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, final

import anyio

from kvoffload.tiers.base import SecondaryTier

if TYPE_CHECKING:
    from kvoffload.pool.free_queue import CpuBlock

__all__ = ["PriorityGate", "TierState"]


@final
class PriorityGate:
    """At most ``limit`` operations at once; reads go first and writes leave one slot free."""

    __slots__ = ("_active", "_limit", "_reads_waiting", "_waiters")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._active = 0
        self._reads_waiting = 0
        self._waiters: list[anyio.Event] = []

    @property
    def limit(self) -> int:
        """Operations allowed at once."""
        return self._limit

    def _can(self, read: bool) -> bool:
        if read:
            return self._active < self._limit
        write_limit = self._limit - 1 if self._limit > 1 else 1
        return self._reads_waiting == 0 and self._active < write_limit

    async def acquire(self, read: bool) -> None:
        if read:
            self._reads_waiting += 1
        try:
            while not self._can(read):
                event = anyio.Event()
                self._waiters.append(event)
                try:
                    await event.wait()
                finally:
                    if event in self._waiters:
                        self._waiters.remove(event)
        finally:
            if read:
                self._reads_waiting -= 1
        self._active += 1
        if read:
            self._wake()  # a write may have been held back only by this read waiting

    def release(self) -> None:
        self._active -= 1
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()


@dataclass(slots=True, eq=False)
class TierState:
    tier: SecondaryTier
    kind: str
    max_queued: int
    max_batch: int
    timeout_s: float
    retry_initial_s: float
    retry_max_s: float
    gate: PriorityGate
    queue: deque[CpuBlock] = field(default_factory=deque)
    wake: anyio.Event = field(default_factory=anyio.Event)
    sick: anyio.Event = field(default_factory=anyio.Event)
    opened: bool = False
    healthy: bool = False
    # Healthy but unable to write (a full disk): reads are served, write-downs skipped.
    writable: bool = True
    backoff_s: float = 0.0
    retry_at: float = 0.0
    held: int = 0
    max_held: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    skipped_full: int = 0
    skipped_unhealthy: int = 0
    writes_failed: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    promoted: int = 0
    read_misses: int = 0
    failed_checks: int = 0
    errors: int = 0
    unhealthy_events: int = 0
    recoveries: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    last_error: str = ""
