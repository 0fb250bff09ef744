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
current value; a boolean is 1 or 0). `METRICS` lists them; ``docs/metrics.md`` documents
each. A metric's help text is its field's entry in the ``Attributes:`` section of the
statistics class's docstring (`attribute_docs`), read once at import.

With tiers (``OffloadConfig.tiers``), the `TierManagerStatistics` fields become
``kvoffload_tiers_<field>`` and each tier's `TierStatistics` fields
``kvoffload_tier_<field>``, one sample per tier labelled ``tier`` (its name) and ``kind``
(``disk``, ``redis`` ...). A tier's own figures (`TierStatistics.details`) that are numbers
or booleans are the samples of the gauge ``kvoffload_tier_detail``, labelled ``detail``.
Without tiers these families have no samples.

With several KV cache groups, each group's `GroupStatistics` fields become
``kvoffload_group_<field>``, one sample per group labelled ``group`` (its name); for one
group these families have no samples and the rest is unchanged.

`KVOffloader.statistics()` is not thread-safe, so collect on the thread that drives the
offloader (an ASGI ``/metrics`` route on the event loop does). To serve metrics from another
thread (``prometheus_client.start_http_server``), give the collector a function that
returns the latest snapshot, and refresh that snapshot from the event loop.
"""

from __future__ import annotations

import inspect
import re
import sys
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
from kvoffload.pool import PoolStatistics
from kvoffload.scheduler import SchedulerStatistics
from kvoffload.scheduler.groups import GroupStatistics
from kvoffload.tiers.stats import TierManagerStatistics, TierStatistics
from kvoffload.transfer import PollerStatistics

__all__ = [
    "GROUP_LABELS",
    "METRICS",
    "REASON_LABELS",
    "TIER_LABELS",
    "TIER_TEXT_FIELDS",
    "MetricSpec",
    "OffloaderCollector",
    "Source",
    "StatisticsParts",
    "StatisticsSource",
    "attribute_docs",
    "label_names",
    "samples",
]

Part = Literal["pool", "scheduler", "poller", "tiers", "tier", "group"]
"""Where a metric's value comes from: a field of `OffloaderStatistics` (``tiers`` is the
`TierManagerStatistics`), ``tier``, one `TierStatistics` of ``tiers.tiers``, or ``group``,
one `GroupStatistics` of ``groups`` (a model with several KV cache groups)."""

GROUP_LABELS: tuple[str, ...] = ("group",)
"""Labels of every ``group`` metric: the KV cache group's name."""

TIER_LABELS: tuple[str, ...] = ("tier", "kind")
"""Labels of every ``tier`` metric: the `TierStatistics` ``name`` and ``kind``."""

REASON_LABELS: tuple[str, ...] = ("reason",)
"""Labels of the per-reason counters (``kvoffload_lookup_misses_total`` ...): the
`MissReason` value; docs/misses.md."""

_BY_REASON = frozenset({"lookup_misses", "miss_reason_tokens"})

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
        documentation: the HELP text: the field's entry in the ``Attributes:`` section
            of its statistics class's docstring.
    """

    name: str
    kind: Literal["counter", "gauge"]
    part: Part
    field: str
    documentation: str


_STATISTICS: Mapping[Part, type] = {
    "pool": PoolStatistics,
    "scheduler": SchedulerStatistics,
    "poller": PollerStatistics,
    "tiers": TierManagerStatistics,
    "tier": TierStatistics,
    "group": GroupStatistics,
}
"""The statistics class each part's fields belong to; their docstrings are the help texts."""

_ENTRY = re.compile(r"(\w+)(?: \(.*?\))?: (.*)")
_MARKUP = re.compile(r"``?([^`]*)``?")


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` section of a statistics dataclass's docstring, as help texts.

    Each entry (a field's name, a colon, its text and any indented continuation lines)
    becomes one line: whitespace runs joined, the backticks of code and cross-references
    dropped, the first letter upper case (unless the text starts with code). Under
    ``python -OO`` (no docstrings) the result is empty, and each help text is the part
    and field name.

    Raises:
        ValueError: the docstring has no ``Attributes:`` section, or a line of it is not
            an entry (``name: text``) or an indented continuation.
    """
    if sys.flags.optimize >= 2:  # python -OO stripped the docstrings
        return {}
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Attributes:" not in lines:
        raise ValueError(f"{cls.__qualname__}'s docstring has no 'Attributes:' section")
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines[lines.index("Attributes:") + 1 :]:
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent == 0:
            break  # the next section
        if indent >= 8 and current is not None:  # a continuation line
            current.append(line.strip())
            continue
        match = _ENTRY.fullmatch(line.strip()) if indent == 4 else None
        if match is None:
            raise ValueError(f"{cls.__qualname__}'s Attributes: cannot read {line.strip()!r}")
        current = entries[match[1]] = [match[2]]
    return {name: _help(" ".join(words)) for name, words in entries.items()}


def _help(text: str) -> str:
    plain = _MARKUP.sub(r"\1", " ".join(text.split()))
    if text.startswith("`"):  # a name in code keeps its case
        return plain
    return plain[:1].upper() + plain[1:]


_DOCS: Mapping[Part, Mapping[str, str]] = {
    part: attribute_docs(cls) for part, cls in _STATISTICS.items()
}


def _help_of(part: Part, field: str) -> str:
    docs = _DOCS[part]
    if not docs:  # python -OO
        return f"{part} {field}"
    if field not in docs:
        raise ValueError(
            f"{_STATISTICS[part].__qualname__}.{field} has no entry in the class's "
            "'Attributes:' docstring section, which is its metric's help text"
        )
    return docs[field]


def _spec(kind: Literal["counter", "gauge"], part: Part, field: str, name: str) -> MetricSpec:
    return MetricSpec(f"{part}_{name}", kind, part, field, _help_of(part, field))


def _c(part: Part, field: str, name: str) -> MetricSpec:
    return _spec("counter", part, field, name)


def _g(part: Part, field: str, name: str) -> MetricSpec:
    return _spec("gauge", part, field, name)


METRICS: tuple[MetricSpec, ...] = (
    # -- the CPU block pool (PoolStatistics) --
    _g("pool", "num_blocks", "blocks"),
    _g("pool", "num_free", "free_blocks"),
    _g("pool", "num_cached", "cached_blocks"),
    _c("pool", "lookups", "lookups"),
    _c("pool", "hit_blocks", "hit_blocks"),
    _c("pool", "evictions", "evictions"),
    # -- the scheduler (SchedulerStatistics) --
    _c("scheduler", "lookups", "lookups"),
    _c("scheduler", "hit_tokens", "hit_tokens"),
    _c("scheduler", "miss_tokens", "miss_tokens"),
    _c("scheduler", "deferred_lookups", "deferred_lookups"),
    _c("scheduler", "deferrals_bounded", "deferrals_bounded"),
    MetricSpec(
        "lookup_misses",
        "counter",
        "scheduler",
        "lookup_misses",
        _help_of("scheduler", "lookup_misses"),
    ),
    MetricSpec(
        "lookup_miss_tokens",
        "counter",
        "scheduler",
        "miss_reason_tokens",
        _help_of("scheduler", "miss_reason_tokens"),
    ),
    _c("scheduler", "store_plans", "store_plans"),
    _c("scheduler", "stored_blocks", "stored_blocks"),
    _c("scheduler", "deferred_blocks", "deferred_blocks"),
    _c("scheduler", "deferred_steps", "deferred_steps"),
    _c("scheduler", "evicted_while_live", "evicted_while_live_blocks"),
    _c("scheduler", "restored_blocks", "restored_blocks"),
    _c("scheduler", "load_plans", "load_plans"),
    _c("scheduler", "loaded_blocks", "loaded_blocks"),
    _c("scheduler", "loaded_tokens", "loaded_tokens"),
    _c("scheduler", "prompt_tokens", "prompt_tokens"),
    _c("scheduler", "failed_stores", "failed_stores"),
    _c("scheduler", "failed_loads", "failed_loads"),
    _c("scheduler", "abandoned_transfers", "abandoned_transfers"),
    _c("scheduler", "abandoned_loads", "abandoned_loads"),
    _c("scheduler", "ignored_completions", "ignored_completions"),
    _c("scheduler", "bytes_stored", "stored_bytes"),
    _c("scheduler", "bytes_loaded", "loaded_bytes"),
    _g("scheduler", "live_requests", "live_requests"),
    _g("scheduler", "in_flight_transfers", "in_flight_transfers"),
    _c("scheduler", "concurrent_load_blocks", "concurrent_load_blocks"),
    _c("scheduler", "cancelled_plans", "cancelled_plans"),
    _g("scheduler", "held_blocks", "held_blocks"),
    _c("scheduler", "hold_expired_blocks", "hold_expired_blocks"),
    # -- the completion poller (PollerStatistics) --
    _g("poller", "in_flight", "in_flight_tasks"),
    _c("poller", "completed", "completed"),
    _c("poller", "failed", "failed"),
    _c("poller", "abandoned", "abandoned"),
    _c("poller", "callback_errors", "callback_errors"),
    _c("poller", "polls", "polls"),
    _g("poller", "observe_latency_median_s", "observe_latency_median_seconds"),
    _g("poller", "observe_latency_p99_s", "observe_latency_p99_seconds"),
    # -- the tier manager (TierManagerStatistics) --
    _c("tiers", "promotions", "promotions"),
    _c("tiers", "promotions_no_space", "promotions_no_space"),
    _c("tiers", "deferred_lookups", "deferred_lookups"),
    _c("tiers", "promotion_errors", "promotion_errors"),
    _g("tiers", "promotions_in_flight", "promotions_in_flight"),
    _g("tiers", "refs_held", "held_refs"),
    _c("tiers", "prefetches", "prefetches"),
    _c("tiers", "prefetches_completed", "prefetches_completed"),
    _c("tiers", "prefetches_cancelled", "prefetches_cancelled"),
    _c("tiers", "prefetch_blocks_promoted", "prefetch_promoted_blocks"),
    _c("tiers", "prefetches_bounded", "prefetches_bounded"),
    # -- each tier (TierStatistics), labelled tier and kind --
    _g("tier", "healthy", "healthy"),
    _g("tier", "writable", "writable"),
    _c("tier", "blocks_written", "written_blocks"),
    _c("tier", "bytes_written", "written_bytes"),
    _c("tier", "writes_skipped_full", "writes_skipped_full"),
    _c("tier", "writes_skipped_unhealthy", "writes_skipped_unhealthy"),
    _c("tier", "writes_failed", "writes_failed"),
    _c("tier", "writes_dropped", "writes_dropped"),
    _g("tier", "writes_held", "held_writes"),
    _g("tier", "max_writes_held", "max_held_writes"),
    _c("tier", "blocks_read", "read_blocks"),
    _c("tier", "bytes_read", "read_bytes"),
    _c("tier", "blocks_promoted", "promoted_blocks"),
    _c("tier", "read_misses", "read_misses"),
    _c("tier", "failed_checks", "failed_checks"),
    _c("tier", "errors", "errors"),
    _c("tier", "unhealthy_events", "unhealthy_events"),
    _c("tier", "recoveries", "recoveries"),
    _c("tier", "write_seconds", "write_seconds"),
    _c("tier", "read_seconds", "read_seconds"),
    _g("tier", "details", "detail"),
    # -- each KV cache group (GroupStatistics), labelled group --
    _c("group", "stored_blocks", "stored_blocks"),
    _c("group", "loaded_blocks", "loaded_blocks"),
    _c("group", "skipped_null_blocks", "skipped_null_blocks"),
    _c("group", "deferred_blocks", "deferred_blocks"),
    _c("group", "deferred_steps", "deferred_steps"),
    _g("group", "pinned_blocks", "pinned_blocks"),
    _g("group", "in_flight_plans", "in_flight_plans"),
    _g("group", "num_cpu_blocks", "cpu_blocks"),
    _g("group", "free_cpu_blocks", "free_cpu_blocks"),
    _g("group", "cached_cpu_blocks", "cached_cpu_blocks"),
    _c("group", "lookup_misses", "lookup_misses"),
    _c("group", "store_plans", "store_plans"),
    _c("group", "load_plans", "load_plans"),
    _c("group", "failed_stores", "failed_stores"),
    _c("group", "failed_loads", "failed_loads"),
    _c("group", "abandoned_transfers", "abandoned_transfers"),
    _c("group", "ignored_completions", "ignored_completions"),
    _c("group", "cancelled_plans", "cancelled_plans"),
    _c("group", "concurrent_load_blocks", "concurrent_load_blocks"),
    _c("group", "evicted_while_live", "evicted_while_live_blocks"),
    _c("group", "restored_blocks", "restored_blocks"),
    _g("group", "held_blocks", "held_blocks"),
    _c("group", "hold_expired_blocks", "hold_expired_blocks"),
)
"""Every exported metric, in exposition order. Names and kinds are fixed here; each help
text is the field's entry in its statistics class's docstring (`attribute_docs`)."""


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
            if label in (*TIER_LABELS, "detail", *GROUP_LABELS, *REASON_LABELS):
                raise ValueError(
                    f"label name {label!r} is taken by the tier or group metrics; choose another"
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
                for labels, value in samples(spec, stats):
                    family.add_metric([*values, *labels], value)
            yield family

    def _family(self, spec: MetricSpec) -> CounterMetricFamily | GaugeMetricFamily:
        name = f"{self._namespace}_{spec.name}"
        labels = [*self._label_names, *label_names(spec)]
        if spec.kind == "counter":
            return CounterMetricFamily(name, spec.documentation, labels=labels)
        return GaugeMetricFamily(name, spec.documentation, labels=labels)


def label_names(spec: MetricSpec) -> list[str]:
    """The labels of ``spec``'s samples (past a collector's own): `TIER_LABELS` (and
    ``detail``) for a tier metric, `GROUP_LABELS` for a group metric, then
    `REASON_LABELS` for a per-reason counter."""
    labels: list[str] = []
    if spec.part == "tier":
        labels += TIER_LABELS
        if spec.field == "details":
            labels.append("detail")
    elif spec.part == "group":
        labels += GROUP_LABELS
    if spec.field in _BY_REASON:
        labels += REASON_LABELS
    return labels


class StatisticsParts(Protocol):
    """The parts of a statistics snapshot that `samples` reads: `OffloaderStatistics`,
    or a snapshot where a part is missing (``None``: its metrics have no sample), such as
    the vLLM connector's scheduler side (no poller) or worker side (only a poller)."""

    @property
    def pool(self) -> PoolStatistics | None:
        """The CPU block pool's statistics."""
        ...

    @property
    def scheduler(self) -> SchedulerStatistics | None:
        """The scheduler's statistics."""
        ...

    @property
    def poller(self) -> PollerStatistics | None:
        """The completion poller's statistics."""
        ...

    @property
    def tiers(self) -> TierManagerStatistics | None:
        """The tier manager's statistics (``None`` without tiers)."""
        ...

    @property
    def groups(self) -> Mapping[str, GroupStatistics] | None:
        """Each KV cache group's statistics (``None`` for one group)."""
        ...


def samples(spec: MetricSpec, stats: StatisticsParts) -> Iterator[tuple[list[str], float]]:
    """The label values (those of `label_names`) and value of each sample of ``spec`` in
    ``stats``; none where its part is missing or its value is unknown."""
    if spec.part == "tier":
        for tier in stats.tiers.tiers if stats.tiers is not None else ():
            yield from _tier_samples(spec.field, tier)
        return
    if spec.part == "group":
        for name, group in (stats.groups or {}).items():
            value = getattr(group, spec.field)
            if spec.field in _BY_REASON:
                for reason, count in sorted(value.items()):
                    yield [name, reason.value], float(count)
            else:
                yield [name], float(value)
        return
    part = getattr(stats, spec.part)
    if part is None:
        return
    value = getattr(part, spec.field)
    if spec.field in _BY_REASON:
        for reason, count in sorted(value.items()):
            yield [reason.value], float(count)
        return
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
