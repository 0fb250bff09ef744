"""The connector's statistics in vLLM: its stats logger and its Prometheus ``/metrics``.

vLLM asks every connector for the statistics of the last interval
(``get_kv_connector_stats()``): each worker after its step, and the scheduler side after
each step's output; it adds the workers' and the scheduler's together with
`KVOffloadConnectorStats.aggregate()`, carries the result to its stat loggers as
``to_dict()``, and rebuilds it there with ``build_kv_connector_stats()``. The logger
prints `KVOffloadConnectorStats.reduce()`; the Prometheus logger hands the dict to
`KVOffloadPromMetrics.observe()`.

The figures are kvoffload's own metrics, `kvoffload.metrics.METRICS`, under the same
names (``kvoffload_<part>_<field>``, a counter with ``_total``) and help texts, with
vLLM's labels (``model_name``, ``engine``) first: the scheduler side reports the CPU
pool (``pool``), the scheduler (``scheduler``: loaded tokens and blocks, stored blocks,
hit and miss tokens, deferrals, lookup misses by ``reason``), with several KV cache groups
each group (``group``, labelled by group), and with tiers the promotions (``tiers``:
`kvoffload.integrations.vllm.tiers.SchedulerTiers.manager_statistics`); each worker reports
its completion poller (``poller``) and, with tiers, each of its tiers (``tier``, labelled
``tier`` and ``kind``: `kvoffload.integrations.vllm.tiers.WorkerTiers.manager_statistics`),
labelled ``rank`` (`WORKER_PARTS`). Counters travel as increments since the last report
(so adding intervals and ranks is a sum); gauges as their value when it changed, per label
set.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvoffload.metrics import METRICS, MetricSpec, StatisticsParts, label_names, samples

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

    from kvoffload.pool import PoolStatistics
    from kvoffload.scheduler import SchedulerStatistics
    from kvoffload.scheduler.groups import GroupStatistics
    from kvoffload.tiers.stats import TierManagerStatistics
    from kvoffload.transfer import PollerStatistics

__all__ = [
    "NAMESPACE",
    "WORKER_PARTS",
    "ConnectorStatistics",
    "KVOffloadConnectorStats",
    "KVOffloadPromMetrics",
    "StatsReporter",
    "metric_labels",
]

NAMESPACE = "kvoffload"
"""The prefix of every metric name, as `kvoffload.metrics.OffloaderCollector`'s default."""

RANK_LABELS: tuple[str, ...] = ("rank",)
"""The label of a worker's figures (the `WORKER_PARTS` metrics): the worker's rank."""

WORKER_PARTS: frozenset[str] = frozenset({"poller", "tier"})
"""The parts each worker reports, labelled `RANK_LABELS`: its completion poller and each of
its tiers. The scheduler side reports the others (pool, scheduler, groups, and ``tiers``:
the promotions, which it alone runs)."""

_COUNTERS = "counters"
_GAUGES = "gauges"
_SPECS: Mapping[str, MetricSpec] = {spec.name: spec for spec in METRICS}


def metric_labels(spec: MetricSpec) -> list[str]:
    """The labels of ``spec`` in vLLM, past vLLM's own: `kvoffload.metrics.label_names`,
    then ``rank`` for a worker's metric (`WORKER_PARTS`)."""
    return [*label_names(spec), *(RANK_LABELS if spec.part in WORKER_PARTS else ())]


@final
@dataclass(frozen=True, slots=True)
class ConnectorStatistics:
    """One side's statistics snapshot (`kvoffload.metrics.StatisticsParts`): the parts
    that side has, ``None`` for the others (their metrics get no sample from it)."""

    pool: PoolStatistics | None = None
    scheduler: SchedulerStatistics | None = None
    poller: PollerStatistics | None = None
    tiers: TierManagerStatistics | None = None
    groups: Mapping[str, GroupStatistics] | None = None


@dataclass
class KVOffloadConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """kvoffload's figures of one interval, as vLLM carries connector statistics.

    ``data`` is ``{"counters": {name: {labels: increment}}, "gauges": {name: {labels:
    value}}}``: ``name`` a `kvoffload.metrics.METRICS` name (without ``kvoffload_``),
    ``labels`` the JSON list of its label values (`metric_labels`). Only strings and
    numbers, so it crosses vLLM's process boundaries as is.
    """

    def __post_init__(self) -> None:
        if _COUNTERS not in self.data or _GAUGES not in self.data:
            self.reset()

    def reset(self) -> None:
        """Forget every figure."""
        self.data: dict[str, Any] = {_COUNTERS: {}, _GAUGES: {}}

    @property
    def counters(self) -> dict[str, dict[str, float]]:
        """Per metric name and label values, the counter's increment."""
        counters: dict[str, dict[str, float]] = self.data[_COUNTERS]
        return counters

    @property
    def gauges(self) -> dict[str, dict[str, float]]:
        """Per metric name and label values, the gauge's latest value."""
        gauges: dict[str, dict[str, float]] = self.data[_GAUGES]
        return gauges

    def add(self, spec: MetricSpec, labels: list[str], value: float) -> None:
        """Add ``value`` to a counter's increment, or set a gauge's value."""
        key = json.dumps(labels)
        if spec.kind == "counter":
            row = self.counters.setdefault(spec.name, {})
            row[key] = row.get(key, 0) + value
        else:
            self.gauges.setdefault(spec.name, {})[key] = value

    def aggregate(self, other: KVConnectorStats) -> KVOffloadConnectorStats:
        """Add ``other`` (another rank, or a later interval): counters add up, a gauge
        takes ``other``'s value (a worker's gauges are told apart by ``rank``)."""
        if not isinstance(other, KVOffloadConnectorStats):
            raise TypeError(
                f"KVOffloadConnectorStats cannot aggregate {type(other).__name__}: "
                "both must come from KVOffloadConnector"
            )
        for name, row in other.counters.items():
            mine = self.counters.setdefault(name, {})
            for key, value in row.items():
                mine[key] = mine.get(key, 0) + value
        for name, row in other.gauges.items():
            self.gauges.setdefault(name, {}).update(row)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's figures for vLLM's log line: each counter's increment and each
        gauge's value, named ``kvoffload_<name>`` with its labels in braces, and
        ``kvoffload_cpu_hit_rate``: hit tokens over queried tokens (hit and missed past
        vLLM's own prefix) in the interval, when any was queried."""
        out: dict[str, int | float] = {}
        for table in (self.counters, self.gauges):
            for name, row in table.items():
                spec = _SPECS.get(name)
                names = metric_labels(spec) if spec is not None else []
                for key, value in sorted(row.items()):
                    values = json.loads(key)
                    shown = ",".join(f"{n}={v}" for n, v in zip(names, values, strict=False))
                    out[f"{NAMESPACE}_{name}" + (f"{{{shown}}}" if shown else "")] = value
        hit = sum(self.counters.get("scheduler_hit_tokens", {}).values())
        miss = sum(self.counters.get("scheduler_miss_tokens", {}).values())
        if hit + miss:
            out[f"{NAMESPACE}_cpu_hit_rate"] = round(hit / (hit + miss), 4)
        for tier, (read, asked) in sorted(self._tier_reads().items()):
            out[f"{NAMESPACE}_tier_hit_rate{{tier={tier}}}"] = round(read / asked, 4)
        return out

    def _tier_reads(self) -> dict[str, tuple[float, float]]:
        """Per tier name, of every rank in the interval: blocks read and verified, and
        blocks a promotion asked it for (read, missing, or failing their check)."""
        reads: dict[str, list[float]] = {}
        for name, slot in (("tier_read_blocks", 0), ("tier_read_misses", 1)):
            for key, value in self.counters.get(name, {}).items():
                row = reads.setdefault(json.loads(key)[0], [0.0, 0.0])
                row[slot] += value
        for key, value in self.counters.get("tier_failed_checks", {}).items():
            reads.setdefault(json.loads(key)[0], [0.0, 0.0])[1] += value
        return {t: (r, r + other) for t, (r, other) in reads.items() if r + other}

    def is_empty(self) -> bool:
        """Whether no figure changed in the interval."""
        return not self.counters and not self.gauges


@final
class StatsReporter:
    """Turns a side's cumulative statistics into vLLM's interval statistics: a counter's
    increment since the last report, a gauge's value when it changed.

    Args:
        rank: a worker's rank: the reporter takes only the `WORKER_PARTS` metrics and
            labels them with it. ``None`` (the scheduler side): every other metric.
    """

    __slots__ = ("_last", "_previous", "_rank", "_worker")

    def __init__(self, *, rank: int | None = None) -> None:
        self._rank: tuple[str, ...] = () if rank is None else (str(rank),)
        self._worker = rank is not None
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}
        self._previous: object = None

    def take(self, stats: StatisticsParts) -> KVOffloadConnectorStats | None:
        """What changed since the last call (``None``: nothing)."""
        if stats == self._previous:  # an idle step: compare the snapshots only
            return None
        self._previous = stats
        out = KVOffloadConnectorStats()
        last = self._last
        worker = self._worker
        for spec in _specs_of(stats):
            if (spec.part in WORKER_PARTS) is not worker:
                continue
            for labels, value in samples(spec, stats):
                values = (*labels, *self._rank)
                key = (spec.name, values)
                before = last.get(key)
                if before == value:
                    continue
                last[key] = value
                if spec.kind == "counter":
                    delta = value - (before or 0)
                    if delta > 0:
                        out.add(spec, list(values), delta)
                else:
                    out.add(spec, list(values), value)
        return None if out.is_empty() else out


_HOLDER: Mapping[str, str] = {"tier": "tiers", "group": "groups"}
"""The snapshot attribute a part's metrics read, where it is not the part's name."""

_BY_PART: Mapping[str, tuple[MetricSpec, ...]] = {
    part: tuple(spec for spec in METRICS if _HOLDER.get(spec.part, spec.part) == part)
    for part in ("pool", "scheduler", "poller", "tiers", "groups")
}


def _specs_of(stats: StatisticsParts) -> Iterator[MetricSpec]:
    """The metrics of the parts ``stats`` has (none of a missing part)."""
    for part, specs in _BY_PART.items():
        if getattr(stats, part) is not None:
            yield from specs


_REGISTERED: list[Any] = []
"""The metrics the last `KVOffloadPromMetrics` created (unregistered by the next: a
process that starts a second engine, as tests do, would otherwise hit Prometheus's
duplicate-name error; vLLM does the same for its own metrics)."""


@final
class KVOffloadPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kvoffload's metrics in vLLM's Prometheus registry, one family per
    `kvoffload.metrics.METRICS` entry (its name and help text), labelled by vLLM's
    labels then `metric_labels`.

    Args:
        vllm_config: vLLM's configuration.
        metric_types: vLLM's Gauge, Counter and Histogram classes.
        labelnames: vLLM's label names (``model_name``, ``engine``).
        per_engine_labelvalues: per engine index, vLLM's label values.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        while _REGISTERED:
            with contextlib.suppress(KeyError):  # registered elsewhere, or already gone
                REGISTRY.unregister(_REGISTERED.pop())
        self.metrics: dict[str, Counter | Gauge] = {}
        # vLLM's wrappers of prometheus_client's classes (its gauge class takes
        # ``multiprocess_mode``; vLLM types both as a union of its metric types)
        counter_cls: Any = self._counter_cls
        gauge_cls: Any = self._gauge_cls
        for spec in METRICS:
            kwargs: dict[str, Any] = {
                "name": f"{NAMESPACE}_{spec.name}",
                "documentation": spec.documentation,
                "labelnames": [*labelnames, *metric_labels(spec)],
            }
            metric: Counter | Gauge
            if spec.kind == "counter":
                metric = counter_cls(**kwargs)
            else:
                metric = gauge_cls(multiprocess_mode="mostrecent", **kwargs)
            self.metrics[spec.name] = metric
            _REGISTERED.append(metric)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add the interval's counter increments and set its gauges (a name this
        version does not know is skipped)."""
        engine = self.per_engine_labelvalues[engine_idx]
        for name, row in transfer_stats_data.get(_COUNTERS, {}).items():
            metric = self.metrics.get(name)
            if metric is None:
                continue
            for key, value in row.items():
                metric.labels(*engine, *json.loads(key)).inc(value)  # type: ignore[union-attr]
        for name, row in transfer_stats_data.get(_GAUGES, {}).items():
            metric = self.metrics.get(name)
            if metric is None:
                continue
            for key, value in row.items():
                metric.labels(*engine, *json.loads(key)).set(value)  # type: ignore[union-attr]
