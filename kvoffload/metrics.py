"""Prometheus metrics for a `KVOffloader`: `OffloaderCollector`.

Needs the optional extra ``prometheus`` (from a kvoffload clone, ``pip install
'.[prometheus]'``, which brings ``prometheus_client``)::

    from prometheus_client import CollectorRegistry, generate_latest
    from kvoffload.metrics import OffloaderCollector

    registry = CollectorRegistry()
    registry.register(OffloaderCollector(off))
    body = generate_latest(registry)  # text exposition format, on the offloader's thread

The collector reads `KVOffloader.statistics()` at every scrape and nothing else: it holds
no counters of its own and never reaches into the pool, scheduler or poller. Each field of
`OffloaderStatistics` becomes one metric named ``kvoffload_<part>_<field>``: counters
(monotonic since the offloader was made, exposed with a ``_total`` suffix) and gauges (a
current value). `METRICS` lists them; ``docs/metrics.md`` documents each.

With tiers (``OffloadConfig.tiers``), the `TierManagerStatistics` fields become
``kvoffload_tiers_<field>`` and each tier's `TierStatistics` fields
``kvoffload_tier_<field>``, one sample per tier labelled ``tier`` (its name) and ``kind``
(``disk``, ``redis`` ...). A tier's own figures (`TierStatistics.details`) that are numbers
or booleans are the samples of the gauge ``kvoffload_tier_detail``, labelled ``detail``.
Without tiers these families have no samples.

`KVOffloader.statistics()` is not thread-safe, so collect on the thread that drives the
offloader (an ASGI ``/metrics`` route on the event loop does). To serve metrics from another
thread (``prometheus_client.start_http_server``), give the collector a function that
returns the latest snapshot, and refresh that snapshot from the event loop.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, final, runtime_checkable

from kvoffload._extras import needs_extra

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the module
    raise ImportError(
        needs_extra("kvoffload.metrics", "prometheus") + " (prometheus_client is not installed)"
    ) from exc

from kvoffload.offloader import OffloaderStatistics
from kvoffload.tiers.stats import TierStatistics

__all__ = [
    "METRICS",
    "TIER_LABELS",
    "TIER_TEXT_FIELDS",
    "MetricSpec",
    "OffloaderCollector",
    "Source",
    "StatisticsSource",
]

Part = Literal["pool", "scheduler", "poller", "tiers", "tier"]
"""Where a metric's value comes from: a field of `OffloaderStatistics` (``tiers`` is the
`TierManagerStatistics`) or ``tier``, one `TierStatistics` of ``tiers.tiers``."""

TIER_LABELS: tuple[str, ...] = ("tier", "kind")
"""Labels of every ``tier`` metric: the `TierStatistics` ``name`` and ``kind``."""

TIER_TEXT_FIELDS: frozenset[str] = frozenset({"last_error"})
"""`TierStatistics` fields that are free text, not numbers: not exported (a label of
unbounded values would churn series). Read them from ``statistics()`` or the logs
(``tier_unhealthy`` names the error)."""


_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@runtime_checkable
class StatisticsSource(Protocol):
    """Anything with a ``statistics()`` like `KVOffloader.statistics()`."""

    def statistics(self) -> OffloaderStatistics:
        """A snapshot of the offloader's counters."""
        ...


@final
@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric and the statistics field it reads.

    Attributes:
        name: the metric family's name without the ``kvoffload_`` prefix (and, for a
            counter, without the ``_total`` suffix the exposition adds).
        kind: ``"counter"`` (never decreases) or ``"gauge"`` (a current value).
        part: the field of `OffloaderStatistics` it reads: ``pool``, ``scheduler``,
            ``poller`` or ``tiers``; or ``tier``: each `TierStatistics` of
            ``tiers.tiers``, one sample per tier labelled `TIER_LABELS`.
        field: the attribute of that part's statistics (``details`` of a tier: one
            sample per numeric entry, labelled ``detail`` too).
        documentation: the HELP text.
    """

    name: str
    kind: Literal["counter", "gauge"]
    part: Part
    field: str
    documentation: str


def _c(part: Part, field: str, name: str, doc: str) -> MetricSpec:
    return MetricSpec(f"{part}_{name}", "counter", part, field, doc)


def _g(part: Part, field: str, name: str, doc: str) -> MetricSpec:
    return MetricSpec(f"{part}_{name}", "gauge", part, field, doc)


METRICS: tuple[MetricSpec, ...] = (
    # -- the CPU block pool (PoolStatistics) --
    _g("pool", "num_blocks", "blocks", "CPU blocks in the pool."),
    _g("pool", "num_free", "free_blocks", "CPU blocks with no reference (evictable or empty)."),
    _g("pool", "num_cached", "cached_blocks", "CPU blocks whose hash is published for lookup."),
    _c("pool", "lookups", "lookups", "Prefix lookups the pool answered."),
    _c("pool", "hit_blocks", "hit_blocks", "Blocks those pool lookups returned."),
    _c("pool", "evictions", "evictions", "Published blocks unpublished to be reused."),
    # -- the scheduler (SchedulerStatistics) --
    _c("scheduler", "lookups", "lookups", "Calls to lookup."),
    _c(
        "scheduler",
        "hit_tokens",
        "hit_tokens",
        "Tokens lookups offered from CPU, counted at every lookup (a repeated lookup counts "
        "again); loaded_tokens is what was used.",
    ),
    _c(
        "scheduler",
        "miss_tokens",
        "miss_tokens",
        "Prompt tokens past the engine's own prefix that lookups did not find.",
    ),
    _c(
        "scheduler",
        "deferred_lookups",
        "deferred_lookups",
        "Lookups answered 'ask again' because the next block was still in flight.",
    ),
    _c("scheduler", "store_plans", "store_plans", "Store plans made."),
    _c("scheduler", "stored_blocks", "stored_blocks", "Blocks stored and published."),
    _c(
        "scheduler",
        "deferred_blocks",
        "deferred_blocks",
        "Blocks a store step could not allocate CPU space for (counted per step).",
    ),
    _c("scheduler", "deferred_steps", "deferred_steps", "Store steps that deferred a block."),
    _c(
        "scheduler",
        "evicted_while_live",
        "evicted_while_live_blocks",
        "CPU blocks evicted while a running request's store cursor was past them.",
    ),
    _c(
        "scheduler",
        "restored_blocks",
        "restored_blocks",
        "Evicted blocks of running requests stored again (restore_evicted).",
    ),
    _c("scheduler", "load_plans", "load_plans", "Load plans made."),
    _c("scheduler", "loaded_blocks", "loaded_blocks", "Blocks loaded from CPU."),
    _c(
        "scheduler",
        "loaded_tokens",
        "loaded_tokens",
        "Tokens whose load from CPU completed successfully (served by the offload tiers).",
    ),
    _c(
        "scheduler",
        "prompt_tokens",
        "prompt_tokens",
        "Tokens of the requests looked up, once per admission (the engine's own prefix included).",
    ),
    _c("scheduler", "failed_stores", "failed_stores", "Store transfers that failed."),
    _c("scheduler", "failed_loads", "failed_loads", "Load transfers that failed."),
    _c(
        "scheduler",
        "abandoned_transfers",
        "abandoned_transfers",
        "Transfers that completed after a reset (nothing published).",
    ),
    _c(
        "scheduler",
        "ignored_completions",
        "ignored_completions",
        "Completions of unknown or already completed plans, ignored.",
    ),
    _c("scheduler", "bytes_stored", "stored_bytes", "Bytes of completed stores."),
    _c("scheduler", "bytes_loaded", "loaded_bytes", "Bytes of completed loads."),
    _g("scheduler", "live_requests", "live_requests", "Requests the scheduler holds state for."),
    _g(
        "scheduler",
        "in_flight_transfers",
        "in_flight_transfers",
        "Transfer plans not completed yet.",
    ),
    _c(
        "scheduler",
        "concurrent_load_blocks",
        "concurrent_load_blocks",
        "Blocks planned for a load while another load of the same CPU block was in flight.",
    ),
    _c(
        "scheduler",
        "cancelled_plans",
        "cancelled_plans",
        "Plans undone because their launch (pinning or submitting) raised.",
    ),
    _g(
        "scheduler",
        "held_blocks",
        "held_blocks",
        "GPU blocks finished requests hold for stores still to come (hold_blocks_on_finish).",
    ),
    _c(
        "scheduler",
        "hold_expired_blocks",
        "hold_expired_blocks",
        "Held GPU blocks given up unstored after hold_max_steps store steps.",
    ),
    # -- the completion poller (PollerStatistics) --
    _g("poller", "in_flight", "in_flight_tasks", "Transfers the poller waits on."),
    _c("poller", "completed", "completed", "Transfers delivered as done."),
    _c("poller", "failed", "failed", "Transfers delivered as failed."),
    _c("poller", "abandoned", "abandoned", "Transfers delivered as abandoned."),
    _c("poller", "callback_errors", "callback_errors", "Completion callbacks that raised."),
    _c("poller", "polls", "polls", "Query rounds the poller made."),
    _g(
        "poller",
        "observe_latency_median_s",
        "observe_latency_median_seconds",
        "Median time from a copy's end to the poller seeing it, over recent copies.",
    ),
    _g(
        "poller",
        "observe_latency_p99_s",
        "observe_latency_p99_seconds",
        "99th percentile of the time from a copy's end to the poller seeing it.",
    ),
    # -- the tier manager (TierManagerStatistics) --
    _c("tiers", "promotions", "promotions", "Promotions from the tiers started by lookups."),
    _c(
        "tiers",
        "promotions_no_space",
        "promotions_no_space",
        "Promotions that found blocks in a tier but no free CPU block.",
    ),
    _c(
        "tiers",
        "deferred_lookups",
        "deferred_lookups",
        "Lookups answered 'ask again' because a promotion was in flight.",
    ),
    _c(
        "tiers",
        "promotion_errors",
        "promotion_errors",
        "Promotions ended by an unexpected error (nothing published).",
    ),
    _g("tiers", "promotions_in_flight", "promotions_in_flight", "Promotions running now."),
    _g("tiers", "refs_held", "held_refs", "CPU block references the tier manager holds now."),
    # -- each tier (TierStatistics), labelled tier and kind --
    _g("tier", "healthy", "healthy", "1 while the tier is in use, 0 while it is unhealthy."),
    _c("tier", "blocks_written", "written_blocks", "Blocks the tier reported stored."),
    _c("tier", "bytes_written", "written_bytes", "Payload bytes of those blocks."),
    _c(
        "tier",
        "writes_skipped_full",
        "writes_skipped_full",
        "Write-downs skipped because the tier's queue was full (back-pressure).",
    ),
    _c(
        "tier",
        "writes_skipped_unhealthy",
        "writes_skipped_unhealthy",
        "Write-downs skipped or dropped from the queue because the tier was unhealthy.",
    ),
    _c("tier", "writes_failed", "writes_failed", "Blocks of write operations that failed."),
    _g(
        "tier",
        "writes_held",
        "held_writes",
        "Write-downs queued or running now (each holds a CPU block).",
    ),
    _g(
        "tier",
        "max_writes_held",
        "max_held_writes",
        "The most write-downs ever held at once (never above the queue bound).",
    ),
    _c("tier", "blocks_read", "read_blocks", "Blocks read from the tier and verified."),
    _c("tier", "bytes_read", "read_bytes", "Payload bytes of those blocks."),
    _c(
        "tier", "blocks_promoted", "promoted_blocks", "Verified blocks published into the CPU pool."
    ),
    _c(
        "tier",
        "read_misses",
        "read_misses",
        "Blocks the probe found but the read did not (evicted meanwhile).",
    ),
    _c(
        "tier",
        "failed_checks",
        "failed_checks",
        "Blocks that failed verification (never published; deleted from the tier).",
    ),
    _c("tier", "errors", "errors", "Tier operations that failed (each marks the tier unhealthy)."),
    _c(
        "tier",
        "unhealthy_events",
        "unhealthy_events",
        "Times the tier went from healthy to unhealthy.",
    ),
    _c("tier", "recoveries", "recoveries", "Times the tier came back after being unhealthy."),
    _c("tier", "write_seconds", "write_seconds", "Time spent in the tier's write operations."),
    _c("tier", "read_seconds", "read_seconds", "Time spent in the tier's read operations."),
    _g(
        "tier",
        "details",
        "detail",
        "The tier's own figures (slots, I/O counts ...), one sample per numeric entry.",
    ),
)


Source = StatisticsSource | Callable[[], OffloaderStatistics]
"""What a collector reads: an offloader, or a function returning its statistics."""


@final
class OffloaderCollector(Collector):
    """A Prometheus collector over offloaders' `statistics()`.

    Register it with a ``prometheus_client`` registry; every scrape calls each source's
    ``statistics()`` once and yields one family per entry of `METRICS`. A gauge whose
    value is unknown (the poller's latencies before any copy) has no sample.

    Several offloaders in one process (one per engine or GPU) go into one collector, told
    apart by a label: ``OffloaderCollector({"0": off0, "1": off1}, label="engine")``. A
    registry refuses two collectors that export the same metric names.

    Args:
        sources: the offloader (anything with ``statistics() -> OffloaderStatistics``,
            or a function returning the statistics), or a mapping from a label value to
            such a source.
        label: the label name that tells the sources of a mapping apart.
        namespace: the prefix of every metric name.

    Raises:
        ValueError: ``label`` is not a valid Prometheus label name (or is one of the
            tier metrics' labels, ``tier``, ``kind`` or ``detail``), ``namespace`` is not
            a valid metric name prefix, or the mapping is empty.
    """

    __slots__ = ("_label_names", "_namespace", "_sources")

    def __init__(
        self,
        sources: Source | Mapping[str, Source],
        *,
        label: str = "engine",
        namespace: str = "kvoffload",
    ) -> None:
        if not _NAME.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} is not a valid Prometheus metric name")
        if isinstance(sources, Mapping):
            if not _NAME.fullmatch(label) or label.startswith("__"):
                raise ValueError(f"label name {label!r} is not a valid Prometheus label name")
            if label in (*TIER_LABELS, "detail"):
                raise ValueError(
                    f"label name {label!r} is taken by the tier metrics; choose another"
                )
            if not sources:
                raise ValueError("sources is an empty mapping: give at least one offloader")
            self._label_names = [label]
            items = [([str(value)], source) for value, source in sources.items()]
        else:
            self._label_names = []
            items = [([], sources)]
        self._sources = [(values, _reader(source)) for values, source in items]
        self._namespace = namespace

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples (registration does not read statistics)."""
        for spec in METRICS:
            yield self._family(spec)

    def collect(self) -> Iterator[Metric]:
        """Read each source's statistics once and yield every metric family."""
        snapshots = [(values, read()) for values, read in self._sources]
        for spec in METRICS:
            family = self._family(spec)
            for values, stats in snapshots:
                for labels, value in _samples(spec, stats):
                    family.add_metric([*values, *labels], value)
            yield family

    def _family(self, spec: MetricSpec) -> CounterMetricFamily | GaugeMetricFamily:
        name = f"{self._namespace}_{spec.name}"
        labels = list(self._label_names)
        if spec.part == "tier":
            labels += TIER_LABELS
            if spec.field == "details":
                labels.append("detail")
        if spec.kind == "counter":
            return CounterMetricFamily(name, spec.documentation, labels=labels)
        return GaugeMetricFamily(name, spec.documentation, labels=labels)


def _samples(spec: MetricSpec, stats: OffloaderStatistics) -> Iterator[tuple[list[str], float]]:
    """The label values (past the collector's own) and value of each sample of ``spec``."""
    if spec.part == "tier":
        for tier in stats.tiers.tiers if stats.tiers is not None else ():
            yield from _tier_samples(spec.field, tier)
        return
    if spec.part == "tiers":
        if stats.tiers is None:
            return
        value = getattr(stats.tiers, spec.field)
    else:
        value = getattr(getattr(stats, spec.part), spec.field)
    if value is not None:
        yield [], float(value)


def _tier_samples(field: str, tier: TierStatistics) -> Iterator[tuple[list[str], float]]:
    labels = [tier.name, tier.kind]
    if field != "details":
        yield labels, float(getattr(tier, field))
        return
    for key, value in sorted(tier.details.items()):
        # Text (a path, a URL) is not a sample; booleans are 0 or 1.
        if isinstance(value, int | float):
            yield [*labels, key], float(value)


def _reader(source: Source) -> Callable[[], OffloaderStatistics]:
    return source.statistics if isinstance(source, StatisticsSource) else source
