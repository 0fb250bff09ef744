"""Tier health: the per-tier state, the gate that puts reads before writes, and what a
tier error does (fault, backoff, recovery, the read-only state).

* A tier error (refused connection, timeout, I/O error ...) marks the tier unhealthy;
  write-downs to it are skipped (its queue is dropped), lookups ignore it, and it is
  pinged with exponential backoff until it answers. No tier error reaches the engine's
  step loop.
* A tier that cannot write but can still read (a full disk: its ``reads_ok()`` says so)
  is marked read-only instead: write-downs are skipped, lookups keep reading the blocks
  it holds, and it is pinged the same way until it can write again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, final

import anyio

from kvoffload._logging import get_logger
from kvoffload.errors import InvariantError
from kvoffload.tiers.base import SecondaryTier
from kvoffload.tiers.stats import TierStatistics

if TYPE_CHECKING:
    from kvoffload.pool.block_pool import CpuBlockPool
    from kvoffload.pool.free_queue import CpuBlock
    from kvoffload.scheduler.ledger import BlockLedger

__all__ = ["PriorityGate", "TierHealth", "TierPart", "TierState"]

_log = get_logger("tiers")


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
    """One tier as the manager drives it: settings, write-down queue, health, counters."""

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

    def snapshot(self) -> TierStatistics:
        """The tier's counters now (`TierStatistics`)."""
        return TierStatistics(
            name=self.tier.name,
            kind=self.kind,
            healthy=self.healthy,
            writable=self.healthy and self.writable,
            blocks_written=self.blocks_written,
            bytes_written=self.bytes_written,
            writes_skipped_full=self.skipped_full,
            writes_skipped_unhealthy=self.skipped_unhealthy,
            writes_failed=self.writes_failed,
            writes_held=self.held,
            max_writes_held=self.max_held,
            blocks_read=self.blocks_read,
            bytes_read=self.bytes_read,
            blocks_promoted=self.promoted,
            read_misses=self.read_misses,
            failed_checks=self.failed_checks,
            errors=self.errors,
            unhealthy_events=self.unhealthy_events,
            recoveries=self.recoveries,
            write_seconds=self.write_seconds,
            read_seconds=self.read_seconds,
            last_error=self.last_error,
            details=dict(self.tier.statistics()),
        )


@final
class TierHealth:
    """Marks a tier unhealthy or read-only when an operation fails, and pings it back.

    Args:
        ledger: the scheduler's ledger; a tier that falls drops its queued write-downs,
            whose references are released through it. ``None`` where nothing is queued
            (`kvoffload.tiers.bridge.TierBridge`: its callers own their buffers).
    """

    __slots__ = ("_ledger",)

    def __init__(self, ledger: BlockLedger | None) -> None:
        self._ledger = ledger

    def drop_queue(self, t: TierState) -> int:
        """Drop the tier's queued write-downs (releasing their references); return how many."""
        dropped = list(t.queue)
        t.queue.clear()
        t.held -= len(dropped)
        if dropped:
            if self._ledger is None:
                raise InvariantError(
                    f"tier {t.tier.name!r}: {len(dropped)} write-downs queued without a ledger"
                )
            self._ledger.close_write_down(dropped[::-1])
        return len(dropped)

    def fault(self, t: TierState, exc: BaseException, op: str) -> None:
        """Operation ``op`` failed with ``exc``: mark the tier unhealthy (a new episode
        starts the backoff, a failed retry doubles it) and drop its queue."""
        t.errors += 1
        t.last_error = f"{op}: {type(exc).__name__}: {exc}"
        now = time.monotonic()
        # Healthy until now, or never opened and failing its first open: a new episode.
        fell = t.healthy or not t.backoff_s
        if fell:
            t.backoff_s = t.retry_initial_s
            t.retry_at = now + t.backoff_s
        elif op in {"ping", "open"}:  # a retry failed: wait longer (other ops keep the wait)
            t.backoff_s = min(t.backoff_s * 2, t.retry_max_s)
            t.retry_at = now + t.backoff_s
        if fell:
            t.healthy = False
            t.unhealthy_events += 1
            _log.warning(
                "tier_unhealthy",
                tier=t.tier.name,
                op=op,
                error=t.last_error,
                retry_in_s=round(t.backoff_s, 3),
            )
        t.sick.set()
        t.skipped_unhealthy += self.drop_queue(t)

    @staticmethod
    def reads_ok(t: TierState) -> bool:
        """Whether the tier's failure affects writes only (its optional ``reads_ok()``)."""
        reads_ok = getattr(t.tier, "reads_ok", None)
        return t.opened and callable(reads_ok) and bool(reads_ok())

    def fault_write(self, t: TierState, exc: BaseException, op: str) -> None:
        """A write (or a retry of a read-only tier) failed, and reads still work: stop
        writing to the tier, keep reading from it."""
        t.errors += 1
        t.last_error = f"{op}: {type(exc).__name__}: {exc}"
        if t.writable:
            t.writable = False
            t.backoff_s = t.retry_initial_s
            t.unhealthy_events += 1
            _log.warning(
                "tier_read_only",
                tier=t.tier.name,
                op=op,
                error=t.last_error,
                retry_in_s=round(t.backoff_s, 3),
            )
        elif op == "ping":
            t.backoff_s = min(t.backoff_s * 2, t.retry_max_s)
        t.retry_at = time.monotonic() + t.backoff_s
        t.sick.set()
        t.skipped_unhealthy += self.drop_queue(t)

    async def watch(self, t: TierState) -> None:
        """The tier's health loop: while it is unhealthy or read-only, ping it (open it,
        if it never opened) with backoff until it answers. Runs until cancelled."""
        while True:
            if t.healthy and t.writable:
                await t.sick.wait()
                t.sick = anyio.Event()
                continue
            await anyio.sleep(max(0.0, t.retry_at - time.monotonic()))
            try:
                with anyio.fail_after(t.timeout_s):
                    if t.opened:
                        await t.tier.ping()
                    else:
                        await t.tier.open()
            except Exception as exc:
                if self.reads_ok(t):  # it answers, but cannot write: read-only
                    if not t.healthy:
                        t.healthy = True
                        t.writable = True  # so that fault_write starts a new episode
                        t.recoveries += 1
                        _log.info("tier_recovered", tier=t.tier.name, writable=False)
                    self.fault_write(t, exc, "ping")
                else:
                    self.fault(t, exc, "ping" if t.opened else "open")
                continue
            t.opened = t.healthy = t.writable = True
            t.backoff_s = 0.0
            t.recoveries += 1
            t.sick = anyio.Event()
            _log.info("tier_recovered", tier=t.tier.name)


class TierPart:
    """What the tier manager's moving parts (`Cascade`, `Promoter`) are built with.

    Args:
        tiers: the tiers' states, in lookup order.
        ledger: the scheduler's ledger (write-down and promotion references).
        pool: the CPU block pool.
        health: marks a tier whose operation failed.
        namespace: the 32-byte namespace digest of every block header.
        nbytes: bytes per CPU block.
        block_view: CPU block id -> its bytes (no copy).
    """

    __slots__ = ("_block_view", "_health", "_ledger", "_namespace", "_nbytes", "_pool", "_tiers")

    def __init__(
        self,
        tiers: Sequence[TierState],
        *,
        ledger: BlockLedger,
        pool: CpuBlockPool,
        health: TierHealth,
        namespace: bytes,
        nbytes: int,
        block_view: Callable[[int], memoryview],
    ) -> None:
        self._tiers = tiers
        self._ledger = ledger
        self._pool = pool
        self._health = health
        self._namespace = namespace
        self._nbytes = nbytes
        self._block_view = block_view
