"""`KVOffloadSecondaryTier`: kvoffload's tiers as a secondary tier of vLLM's OffloadingConnector.

vLLM's multi-tier offloading (``vllm/v1/kv_offload/tiering``) keeps a CPU primary region
and loads secondary tiers by class name and module path from
``kv_connector_extra_config["secondary_tiers"]``::

    {"type": "KVOffloadSecondaryTier",
     "module_path": "kvoffload.integrations.vllm.secondary_tier",
     "tiers": [{"kind": "redis", "url": "redis://cache:6379/0"}]}

``tiers`` takes the entries of ``OffloadConfig.tiers`` (disk, Redis, Redis Cluster), with
the same validation and errors. The tiers run on a `kvoffload.tiers.TierBridge` thread;
every method here runs in vLLM's scheduler thread and never waits on a tier: lookups of
keys this tier has not seen land are probed in the background (``RETRY`` until the probe
answers), stores and loads copy raw chunk rows of the primary region (one kvoffload block
per chunk row) in the bridge, and `get_finished_jobs()` reports them. Every block read is
verified; one that fails is a miss, is deleted, and is reported as not loaded.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvoffload._logging import get_logger
from kvoffload.errors import ConfigError
from kvoffload.hashing import BlockHash
from kvoffload.tier_config import DiskTierSettings, parse_tier_settings
from kvoffload.tiers.bridge import TierBridge, engine_namespace
from kvoffload.tiers.promote import RecentBlocks

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KVOffloadSecondaryTier"]

_log = get_logger("integrations.vllm.tier")

_OWNER = "KVOffloadSecondaryTier settings (secondary_tiers entry)"
_KNOWN_MAX = 1 << 20
"""Most keys remembered as held by the tier (answered HIT without a probe)."""
_ABSENT_MAX = 1 << 16
"""Most keys remembered as absent (a probe found nothing: MISS without probing again for
`kvoffload.tiers.promote.ABSENT_TTL_S`)."""

_M = "vllm:kvoffload_tier_"
METRICS: dict[str, OffloadingMetricMetadata] = {
    _M + "blocks_stored": OffloadingCounterMetadata("Blocks stored into kvoffload's tiers."),
    _M + "store_failures": OffloadingCounterMetadata(
        "Blocks of store jobs that landed in no kvoffload tier."
    ),
    _M + "blocks_loaded": OffloadingCounterMetadata(
        "Blocks loaded from kvoffload's tiers and verified."
    ),
    _M + "load_failures": OffloadingCounterMetadata(
        "Blocks of load jobs not loaded: gone, unreachable, or failing verification (deleted)."
    ),
    _M + "lookup_hits": OffloadingCounterMetadata("Lookups answered HIT."),
    _M + "lookup_misses": OffloadingCounterMetadata("Lookups answered MISS."),
    _M + "lookup_retries": OffloadingCounterMetadata(
        "Lookups answered RETRY (a probe of the tiers in flight)."
    ),
    _M + "failed_checks": OffloadingGaugeMetadata(
        "Blocks that failed verification since start (never served; deleted)."
    ),
    _M + "healthy_tiers": OffloadingGaugeMetadata("kvoffload tiers in use now."),
}


@dataclass(slots=True, eq=False)
class _Job:
    job: TransferJob
    keys: tuple[OffloadKey, ...]
    load: bool
    future: concurrent.futures.Future[Any]
    start: float


class KVOffloadSecondaryTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier over kvoffload's disk, Redis and Redis Cluster tiers.

    Args:
        offloading_spec: vLLM's offloading spec (model, dtype, layout, parallelism:
            the namespace of every key).
        primary_kv_view: the primary region, one chunk per row.
        tier_type: the class name vLLM loaded this tier by.
        backpressure_detector: vLLM's back-pressure detector, if configured.
        tiers: kvoffload tier settings (``OffloadConfig.tiers`` entries), at least one.
        locality: ``"LOCAL"`` or ``"REMOTE"`` (default: ``REMOTE`` when a tier is a Redis
            server or cluster, else ``LOCAL``).

    Raises:
        ConfigError: a setting is missing, unknown or invalid (named).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        *,
        backpressure_detector: BackpressureDetector | None = None,
        tiers: Sequence[object] | None = None,
        locality: Literal["LOCAL", "REMOTE"] | None = None,
        **unknown: object,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        if unknown:
            raise ConfigError(
                f"{_OWNER}: unknown setting(s) {sorted(unknown)} (known: tiers, locality, "
                "backpressure, type, module_path)"
            )
        if tiers is None:
            raise ConfigError(f"{_OWNER}: 'tiers' is missing (a list of kvoffload tier settings)")
        settings = parse_tier_settings(tiers, owner=_OWNER)
        if locality is None:
            local = all(isinstance(s, DiskTierSettings) for s in settings)
            self.locality = Locality.LOCAL if local else Locality.REMOTE
        elif locality in ("LOCAL", "REMOTE"):
            self.locality = Locality[locality]
        else:
            raise ConfigError(f"{_OWNER}: locality={locality!r} is not 'LOCAL' or 'REMOTE'")
        nbytes = self.block_size_bytes
        self._rows = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
        self._events_on = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        self._bridge = TierBridge.from_settings(
            settings,
            namespace=_namespace(offloading_spec, nbytes),
            block_nbytes=nbytes,
            name=f"kvoffload-vllm-{tier_type}",
        )
        self._known: OrderedDict[OffloadKey, None] = OrderedDict()
        self._absent = RecentBlocks(max_blocks=_ABSENT_MAX)
        self._probes: dict[OffloadKey, concurrent.futures.Future[int]] = {}
        self._jobs: list[_Job] = []
        self._events: list[OffloadingEvent] = []
        self._counts: dict[str, int] = dict.fromkeys(METRICS, 0)
        self._health: concurrent.futures.Future[Any] | None = None

    # -- keys ------------------------------------------------------------------------------

    def _hash(self, key: OffloadKey) -> BlockHash:
        return self._bridge.key(bytes(key))

    def _row(self, chunk_id: int) -> memoryview:
        n = self.block_size_bytes
        return self._rows[chunk_id * n : (chunk_id + 1) * n]

    def _remember(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        known = self._known
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        self._absent.forget(keys)
        while len(known) > _KNOWN_MAX:
            known.popitem(last=False)

    def _forget(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        return [key for key in keys if self._known.pop(key, False) is None]

    # -- the SecondaryTierManager contract -----------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT for a key this tier stored or a probe found; MISS for one a probe did not
        find (remembered `ABSENT_TTL_S`); RETRY while a probe of the tiers is in flight.
        Never waits."""
        if key in self._known:
            self._known.move_to_end(key)
            return self._count(LookupResult.HIT)
        probe = self._probes.get(key)
        if probe is None:
            if key in self._absent:
                return self._count(LookupResult.MISS)
            self._probes[key] = self._bridge.submit_exists([self._hash(key)])
            return self._count(LookupResult.RETRY)
        if not probe.done():
            return self._count(LookupResult.RETRY)
        del self._probes[key]
        try:
            found = probe.result() > 0
        except Exception as exc:
            _log.warning("vllm_tier_probe_failed", error=repr(exc))
            found = False
        if found:
            self._remember([key])
            return self._count(LookupResult.HIT)
        self._absent.add(key)
        return self._count(LookupResult.MISS)

    def _count(self, result: LookupResult) -> LookupResult:
        name = {LookupResult.HIT: "hits", LookupResult.MISS: "misses"}.get(result, "retries")
        self._counts[_M + "lookup_" + name] += 1
        return result

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's chunk rows to the tiers in the bridge (rows of keys the tier
        already holds are skipped)."""
        keys = tuple(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        todo = [(k, c) for k, c in zip(keys, rows, strict=True) if k not in self._known]
        future = self._bridge.submit_put(
            [self._hash(k) for k, _ in todo], [self._row(c) for _, c in todo]
        )
        want = len(todo)
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.add_done_callback(lambda f: _settle_store(f, done, want))
        self._jobs.append(_Job(job_metadata, keys, False, done, time.monotonic()))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's keys into their chunk rows in the bridge, each verified."""
        keys = tuple(job_metadata.keys)
        rows = [self._row(int(c)) for c in job_metadata.chunk_ids]
        future = self._bridge.submit_get([self._hash(k) for k in keys], rows)
        self._jobs.append(_Job(job_metadata, keys, True, future, time.monotonic()))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs done since the last call: a store lists all its keys landed or fails;
        a load names the keys that arrived and passed verification."""
        if not self._jobs:
            return []
        finished: list[JobResult] = []
        running: list[_Job] = []
        for job in self._jobs:
            if job.future.done():
                finished.append(self._finish(job))
            else:
                running.append(job)
        self._jobs = running
        return finished

    def _finish(self, job: _Job) -> JobResult:
        seconds = time.monotonic() - job.start
        nbytes = self.block_size_bytes
        try:
            result = job.future.result()
        except Exception as exc:
            _log.warning("vllm_tier_job_failed", load=job.load, error=repr(exc))
            result = None
        if not job.load:
            ok = result is True
            if ok:
                self._remember(job.keys)
                self._counts[_M + "blocks_stored"] += len(job.keys)
                self._event(list(job.keys), removed=False)
            else:
                self._counts[_M + "store_failures"] += len(job.keys)
            return JobResult(
                job_id=job.job.job_id,
                success=ok,
                transfer_time=seconds,
                transfer_bytes=len(job.keys) * nbytes if ok else 0,
            )
        good = list(result) if result is not None else [False] * len(job.keys)
        landed = [k for k, ok in zip(job.keys, good, strict=True) if ok]
        lost = [k for k, ok in zip(job.keys, good, strict=True) if not ok]
        self._counts[_M + "blocks_loaded"] += len(landed)
        self._counts[_M + "load_failures"] += len(lost)
        if lost:
            # Gone, unreachable or failing verification (deleted): never HIT again.
            self._event(self._forget(lost), removed=True)
        return JobResult(
            job_id=job.job.job_id,
            success=not lost,
            successful_keys=None if not lost else landed,
            transfer_time=seconds,
            transfer_bytes=len(landed) * nbytes,
        )

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> None:
        if self._events_on and keys:
            self._events.append(
                OffloadingEvent(
                    keys=keys,
                    medium=Medium.STORAGE,
                    removed=removed,
                    locality=self.locality,
                    ownership=self.tier_type,
                )
            )

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Blocks stored into and removed from the tiers since the last call."""
        events, self._events = self._events, []
        return events

    def has_pending_work(self) -> bool:
        """Jobs still in flight: vLLM keeps polling `get_finished_jobs()`."""
        return bool(self._jobs)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """The default per-chunk offloading."""
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Wait until every submitted job is done (each tier call is bounded by its
        ``op_timeout_s``); their results stay for `get_finished_jobs()`."""
        concurrent.futures.wait([job.future for job in self._jobs])

    def shutdown(self) -> None:
        """Wait for the jobs in flight, close the tiers and end the bridge's thread."""
        self._bridge.close(drain=True)

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The tier's counters and gauges (`METRICS`)."""
        return dict(METRICS)

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The counters since the last call, and the tiers' health and failed checks as
        of the last snapshot (taken in the background, never waited for)."""
        stats = OffloadingConnectorStats()
        for name, value in self._counts.items():
            if value and isinstance(METRICS[name], OffloadingCounterMetadata):
                stats.increase_counter(name, value)
                self._counts[name] = 0
        health = self._health
        if health is not None and health.done():
            try:
                snapshot = health.result()
            except Exception:
                snapshot = ()
            stats.set_gauge(_M + "failed_checks", sum(t.failed_checks for t in snapshot))
            stats.set_gauge(_M + "healthy_tiers", sum(1 for t in snapshot if t.healthy))
            health = None
        if health is None:
            try:
                self._health = self._bridge.submit_statistics()
            except Exception:  # closed
                self._health = None
        return None if stats.is_empty() else stats


def _settle_store(
    future: concurrent.futures.Future[int], done: concurrent.futures.Future[Any], want: int
) -> None:
    """A store landed when every block it wrote was stored (in at least one tier)."""
    try:
        stored = future.result()
    except Exception as exc:
        done.set_exception(exc)
    else:
        done.set_result(stored >= want)


def _namespace(spec: OffloadingSpec, row_nbytes: int) -> bytes:
    """The namespace of every key: model, KV dtype, layout (cache layout, block and chunk
    geometry, the row's bytes, the parallel shape) and rank."""
    config = spec.config
    par = config.parallel
    groups = ",".join(f"{g.group_id}:{g.tokens_per_block}" for g in config.groups)
    layout = (
        f"vllm-row:{row_nbytes}:{config.kv_cache_layout}:groups[{groups}]:"
        f"hash{config.cache.tokens_per_hash}:chunk{config.cache.blocks_per_chunk}:"
        f"tp{par.tp_size}:pp{par.pp_size}:pcp{par.pcp_size}:dcp{par.dcp_size}:"
        f"world{par.world_size}:canonical{config.canonical_layout}:"
        f"replicated{config.replicated_layout}"
    )
    return engine_namespace(
        model=config.model.name, layout=layout, dtype=str(config.model.dtype), rank=par.rank
    )
