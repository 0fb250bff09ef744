"""The cluster tier's view of one node: its circuit breaker, its limits and its counters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import final

import anyio

from kvoffload._logging import get_logger
from kvoffload.errors import InvariantError

__all__ = ["BreakerState", "NodeState"]

_log = get_logger("tiers.redis_cluster")


class BreakerState(enum.Enum):
    """A node's circuit breaker: closed (in use), open (skipped), half-open (one probe)."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


_ALLOWED = {
    BreakerState.CLOSED: {BreakerState.OPEN},
    BreakerState.OPEN: {BreakerState.HALF_OPEN},
    BreakerState.HALF_OPEN: {BreakerState.CLOSED, BreakerState.OPEN},
}


@final
@dataclass(slots=True, eq=False)
class NodeState:
    """One node (``host:port``) as the tier sees it; lives across slot map refreshes.

    The breaker opens after ``failures_to_open`` consecutive failures (a connection
    error, a timeout, the budget running out while the node was still busy). While open,
    the node's keys are misses at once. After ``backoff_s`` one operation goes through as
    a probe (half-open): success closes the breaker, failure opens it again with the
    backoff doubled (up to ``backoff_max_s``).
    """

    name: str
    failures_to_open: int
    backoff_initial_s: float
    backoff_max_s: float
    reads: anyio.Semaphore
    writes: anyio.Semaphore
    tier: str = ""
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    backoff_s: float = 0.0
    probe_at: float = 0.0
    probing: bool = False
    writes_in_flight: int = 0
    hits: int = 0
    misses: int = 0
    timeouts: int = 0
    errors: int = 0
    cluster_down: int = 0
    breaker_trips: int = 0
    redirections: int = 0
    skipped_open: int = 0
    write_waits: int = 0
    blocks_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    pipelines: int = 0
    latency_s: float = 0.0
    latency_max_s: float = 0.0
    last_error: str = field(default="")

    def _move(self, to: BreakerState) -> None:
        if to not in _ALLOWED[self.state]:
            raise InvariantError(f"node {self.name}: breaker {self.state.name} -> {to.name}")
        self.state = to

    def allow(self) -> bool:
        """Whether an operation may go to the node now (taking the probe when due)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if time.monotonic() < self.probe_at:
                return False
            self._move(BreakerState.HALF_OPEN)
            self.probing = False
        if self.probing:
            return False
        self.probing = True
        return True

    def succeeded(self, seconds: float) -> None:
        """A pipeline to the node came back (whatever its replies said)."""
        self._account(seconds)
        self.consecutive_failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self.probing = False
            self.backoff_s = 0.0
            self._move(BreakerState.CLOSED)
            _log.info("node_breaker_closed", tier=self.tier, node=self.name)

    def failed(self, seconds: float, error: str, *, timeout: bool) -> None:
        """A pipeline to the node failed, or was still running when the budget ran out."""
        self._account(seconds)
        if timeout:
            self.timeouts += 1
        else:
            self.errors += 1
        self.last_error = error
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self.probing = False
            self.backoff_s = min(self.backoff_s * 2, self.backoff_max_s)
            self._open()
        elif (
            self.state is BreakerState.CLOSED and self.consecutive_failures >= self.failures_to_open
        ):
            self.backoff_s = self.backoff_initial_s
            self._open()

    def _open(self) -> None:
        self._move(BreakerState.OPEN)
        self.probe_at = time.monotonic() + self.backoff_s
        self.breaker_trips += 1
        _log.warning(
            "node_breaker_opened",
            tier=self.tier,
            node=self.name,
            failures=self.consecutive_failures,
            probe_in_s=round(self.backoff_s, 3),
            error=self.last_error,
        )

    def reset_breaker(self) -> None:
        """The node answered a direct check (``ping``): close the breaker."""
        self.consecutive_failures = 0
        self.probing = False
        self.backoff_s = 0.0
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            _log.info("node_breaker_closed", tier=self.tier, node=self.name)

    def _account(self, seconds: float) -> None:
        self.pipelines += 1
        self.latency_s += seconds
        self.latency_max_s = max(self.latency_max_s, seconds)

    def figures(self) -> dict[str, int | float | str | bool]:
        """The node's counters, for `RedisClusterTier.statistics()`."""
        return {
            "breaker_state": self.state.value,
            "breaker_open": self.state is not BreakerState.CLOSED,
            "breaker_trips": self.breaker_trips,
            "hits": self.hits,
            "misses": self.misses,
            "timeouts": self.timeouts,
            "errors": self.errors,
            "cluster_down": self.cluster_down,
            "redirections": self.redirections,
            "skipped_open": self.skipped_open,
            "write_waits": self.write_waits,
            "blocks_written": self.blocks_written,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "pipelines": self.pipelines,
            "latency_seconds": self.latency_s,
            "latency_max_seconds": self.latency_max_s,
        }
