"""The connector's secondary tiers (``tiers`` in ``kv_connector_extra_config``).

vLLM splits the connector in two: the scheduler side (`SchedulerTiers`) keeps the CPU
pool's bookkeeping and decides, the workers (`WorkerTiers`, one per rank) hold the host
buffer's bytes and run the tiers, each on a `kvoffload.tiers.TierBridge` thread. So a
promotion is a conversation carried by the step's metadata:

1. A lookup misses on CPU after its hit: `SchedulerTiers.extend_lookup` queues a *probe*
   of the blocks after the hit and answers "ask again" (``None`` to vLLM).
2. Every worker asks its tiers how many of those blocks they hold (a leading run) and
   reports it; the scheduler side takes the shortest run of all ranks and opens a
   promotion in the ledger (free CPU blocks only, marked pending, as `Promoter` does).
3. The workers read the blocks into those host blocks, each verified (header, namespace,
   hash, length, checksum: `kvoffload.tiers.ops.read_verified`), and report per block
   whether it arrived; the scheduler side publishes the blocks every rank read. A block
   that failed is a miss, never a failed request.

The scheduler's lookups answer "ask again" for at most the tiers' lookup budget
(`kvoffload.tiers.promote.tiers_defer_deadline_s`, as `KVOffloader`'s); after it they
answer with the CPU hit: a slow, paused or dead tier is a miss, never a stalled request.

Write-downs: when a worker's store copy ends, it copies the stored host blocks into a
bounded staging area (``max_queued_writes`` blocks; a block that does not fit is dropped
and counted) and writes them to every tier from there, so the CPU block is free for reuse
as soon as the store is reported.

Keys are the CPU pool's block hashes under the namespace `KVOffloader` uses (the root of
the `HashNamespace` of the layout, ``model_id`` and ``hash_salt``): with one rank, a
`KVOffloader` of the same model and layout shares a tier with the engine. With several
ranks each rank holds its shard under a namespace of its own (`rank_namespace`), and a
disk tier's file gets the rank as a suffix (``kv.bin.rank1``).

With several KV cache groups there is one `SchedulerTiers` and one `WorkerTiers` per
group, each under its group's namespace (`kvoffload.integrations.vllm.group_tiers`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, final

from kvoffload._logging import get_logger
from kvoffload.errors import ClosedError
from kvoffload.hashing import BlockHash
from kvoffload.scheduler.loads import DEFER_DEADLINE_S
from kvoffload.scheduler.misses import MissReason
from kvoffload.tier_config import AnyTierSettings, DiskTierSettings
from kvoffload.tiers.build import build_tier
from kvoffload.tiers.promote import (
    PROMOTION_MAX_BLOCKS,
    LandedBlocks,
    RecentBlocks,
    tiers_defer_deadline_s,
)
from kvoffload.tiers.stats import TierManagerStatistics

if TYPE_CHECKING:
    import torch

    from kvoffload.pool.free_queue import CpuBlock
    from kvoffload.scheduler.ledger import Promotion
    from kvoffload.storage import HostKVBuffer
    from kvoffload.tiers.bridge import TierBridge
    from kvoffload.tiers.manager import TierScheduler
    from kvoffload.tiers.stats import TierStatistics
    from kvoffload.transfer.plan import StorePlan

__all__ = [
    "SchedulerTiers",
    "TierProbe",
    "TierRead",
    "VllmTierStatistics",
    "WorkerTiers",
    "open_worker_tiers",
    "rank_namespace",
    "rank_tier_settings",
]

_log = get_logger("integrations.vllm.tiers")


# -- what travels in the step's metadata --------------------------------------------------


@final
@dataclass(frozen=True, slots=True)
class TierProbe:
    """Scheduler → workers: how many of ``hashes``, from the first, do your tiers hold?
    (``group``: vLLM's KV cache group whose tiers are asked; 0 with one group.)"""

    key: int
    hashes: tuple[BlockHash, ...]
    group: int = 0


@final
@dataclass(frozen=True, slots=True)
class TierRead:
    """Scheduler → workers: read ``hashes[k]`` into CPU block ``cpu_block_ids[k]`` (of
    group ``group``'s host buffer, from its tiers; 0 with one group)."""

    key: int
    hashes: tuple[BlockHash, ...]
    cpu_block_ids: tuple[int, ...]
    group: int = 0


# -- keys ------------------------------------------------------------------------------------


def rank_namespace(root: bytes, rank: int, world_size: int) -> bytes:
    """The 32-byte namespace of one rank's blocks: ``root`` itself with one rank (what a
    `KVOffloader` of the same model and layout uses), else one of its own per rank."""
    if world_size == 1:
        return bytes(root)
    return hashlib.sha256(bytes(root) + f"|rank={rank}/{world_size}".encode()).digest()


def rank_tier_settings(
    settings: Sequence[AnyTierSettings], rank: int, world_size: int
) -> list[AnyTierSettings]:
    """The tiers of one rank: with several ranks, a disk tier's file gets the suffix
    ``.rank<r>`` (each rank holds its own shard; a file belongs to one tier)."""
    if world_size == 1:
        return list(settings)
    out: list[AnyTierSettings] = []
    for s in settings:
        if isinstance(s, DiskTierSettings):
            path = s.path.with_name(f"{s.path.name}.rank{rank}")
            out.append(s.model_copy(update={"path": path}))
        else:
            out.append(s)
    return out


def check_tier_settings(
    settings: Sequence[AnyTierSettings], *, namespace: bytes, block_nbytes: int
) -> None:
    """Build every tier once, unopened, so that settings no tier accepts stop start-up in
    the scheduler process (a `ConfigError` naming the tier)."""
    for i, s in enumerate(settings):
        build_tier(s, i, namespace=namespace, block_nbytes=block_nbytes)


# -- the scheduler side ------------------------------------------------------------------


@final
@dataclass(frozen=True, slots=True)
class VllmTierStatistics:
    """The scheduler side's tier counters.

    Attributes:
        probes: probes sent to the workers.
        promotions: promotions opened (CPU blocks taken for blocks the tiers hold).
        promotions_no_space: probes that found blocks but no CPU block was free.
        blocks_promoted: blocks read on every rank, verified and published.
        blocks_failed: blocks a promotion could not read on some rank (missing, a tier
            error, a failed check): misses.
        deferred_lookups: lookups answered "ask again" while a probe ran.
        probes_dropped: probes some rank left unanswered past the lookup budget
            (forgotten: their lookups answered with the CPU hit).
        probes_in_flight: probes not yet answered by every rank.
        promotions_in_flight: promotions not yet reported by every rank.
    """

    probes: int
    promotions: int
    promotions_no_space: int
    blocks_promoted: int
    blocks_failed: int
    deferred_lookups: int
    probes_dropped: int
    probes_in_flight: int
    promotions_in_flight: int


@dataclass(slots=True, eq=False)
class _Probe:
    probe: TierProbe
    protect: tuple[CpuBlock, ...]
    started: float
    runs: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Read:
    read: TierRead
    promotion: Promotion
    good: dict[int, tuple[bool, ...]] = field(default_factory=dict)


@final
class SchedulerTiers:
    """The tiers' part of the scheduler side: a `LookupExtension` of its
    `OffloadScheduler` that sends probes and promotions to the workers and publishes what
    they read. Runs in vLLM's scheduler thread only. With several KV cache groups there
    is one per group, over that group's ledger (`GroupedSchedulerTiers`).

    Args:
        scheduler: the scheduler side's `OffloadScheduler`, or one group's part of a
            `GroupedScheduler` (the extension installs itself).
        settings: the tiers (``OffloadConfig.tiers``; a group's: `group_tier_settings`).
        world_size: ranks that must all answer a probe and read a promoted block.
        group: vLLM's index of the group whose tiers the probes and reads name.
        keys: where probe and read keys come from (shared by the groups of one scheduler
            side, so a worker's reports name one probe or read each).
    """

    def __init__(
        self,
        scheduler: TierScheduler,
        settings: Sequence[AnyTierSettings],
        *,
        world_size: int,
        group: int = 0,
        keys: Iterator[int] | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._ledger = scheduler.ledger
        self._pool = scheduler.pool
        self._world_size = world_size
        self._deadline = tiers_defer_deadline_s(settings)
        # A probe unanswered for as long as a lookup may defer is dropped (the scheduler's
        # own bound is the longer of its default and the tiers' budget).
        self._stale_s = max(DEFER_DEADLINE_S, self._deadline)
        self._group = group
        self._keys = itertools.count(1) if keys is None else keys
        self._probing: dict[BlockHash, _Probe] = {}  # every hash of a probe -> the probe
        self._probes: dict[int, _Probe] = {}
        self._reads: dict[int, _Read] = {}
        self._out_probes: list[TierProbe] = []
        self._out_reads: list[TierRead] = []
        self._absent = RecentBlocks()
        self._failed = RecentBlocks(math.inf)
        # Promoted blocks until a lookup pins them (`hit_sources()`). The workers do not
        # say which tier each block came from: with one tier it is named, with several
        # the source is their names joined.
        self._landed = LandedBlocks(self._pool.num_blocks)
        names = [t.name or f"{t.kind}{i}" for i, t in enumerate(settings)]
        self._source = "+".join(names)
        self._counts = dict.fromkeys(
            ("probes", "promotions", "no_space", "promoted", "failed", "deferred", "dropped"), 0
        )
        scheduler.set_lookup_extension(self)

    # -- LookupExtension -----------------------------------------------------------------

    @property
    def defer_deadline_s(self) -> float:
        """The tiers' lookup budget (`tiers_defer_deadline_s`)."""
        return self._deadline

    def extend_lookup(
        self,
        block_hashes: Sequence[BlockHash],
        end: int,
        limit: int,
        pinned: Sequence[CpuBlock],
        *,
        allow_defer: bool,
    ) -> bool:
        """Queue a probe of what follows a CPU hit (unless one runs, or one recently found
        nothing there); ``True`` (ask again) while the probe of the next block runs."""
        self._landed.forget(pinned)
        if end >= limit:
            return False
        first = block_hashes[end]
        probe = self._probing.get(first)
        if probe is not None and time.monotonic() - probe.started >= self._stale_s:
            # Unanswered past the budget (a rank that never reports): a miss, and no
            # later request waits for it again.
            self._drop_probe(probe)
            probe = None
        if probe is None and first not in self._ledger.pending and first not in self._absent:
            hashes = tuple(block_hashes[end : min(limit, end + PROMOTION_MAX_BLOCKS)])
            key = next(self._keys)
            probe = _Probe(TierProbe(key, hashes, self._group), tuple(pinned), time.monotonic())
            for block_hash in hashes:
                self._probing.setdefault(block_hash, probe)
            self._probes[key] = probe
            self._out_probes.append(probe.probe)
            self._counts["probes"] += 1
        if probe is not None and allow_defer:
            self._counts["deferred"] += 1
            return True
        return False

    def hit_sources(self, pinned: Sequence[CpuBlock]) -> dict[str, int] | None:
        """Of a lookup's CPU hit ``pinned``, the blocks a promotion brought in since a
        lookup last pinned them, under the tiers' name (see `LookupExtension`)."""
        return self._landed.sources(pinned)

    def miss_reason(self, block_hash: BlockHash) -> MissReason | None:
        """``IN_FLIGHT`` while a probe of ``block_hash`` runs, ``TIER_FAILED`` when a
        recent read of it failed on some rank, else ``None``."""
        if block_hash in self._probing:
            return MissReason.IN_FLIGHT
        if block_hash in self._failed:
            return MissReason.TIER_FAILED
        return None

    def is_promoting(self, block_hash: BlockHash) -> bool:
        """Whether a probe covering ``block_hash`` runs (a promotion it opened is in the
        ledger's pending hashes)."""
        return block_hash in self._probing

    def lookup_deferred(self) -> None:
        """A grouped lookup waited for a probe of this group's tiers (`GroupPromotions`
        decides): counted in ``deferred_lookups``, where `extend_lookup()` counts its own."""
        self._counts["deferred"] += 1

    def _unprobe(self, probe: _Probe) -> None:
        """The probe no longer runs: its hashes are not being probed by it any more."""
        probing = self._probing
        for block_hash in probe.probe.hashes:
            if probing.get(block_hash) is probe:
                del probing[block_hash]

    # -- the step --------------------------------------------------------------------------

    def take_work(self) -> tuple[tuple[TierProbe, ...], tuple[TierRead, ...]]:
        """The probes and reads for this step's metadata (every worker gets them)."""
        probes, self._out_probes = tuple(self._out_probes), []
        reads, self._out_reads = tuple(self._out_reads), []
        return probes, reads

    def on_reports(
        self,
        probes: Mapping[int, Mapping[int, int]],
        reads: Mapping[int, Mapping[int, Sequence[bool]]],
    ) -> None:
        """Take the workers' answers: open a promotion once every rank answered a probe;
        publish the blocks every rank read once every rank reported a read."""
        for key, ranks in probes.items():
            probe = self._probes.get(key)
            if probe is None:
                continue
            probe.runs.update(ranks)
            if len(probe.runs) >= self._world_size:
                del self._probes[key]
                self._probed(probe)
        for key, goods in reads.items():
            read = self._reads.get(key)
            if read is None:
                continue
            for rank, good in goods.items():
                read.good[rank] = tuple(good)
            if len(read.good) >= self._world_size:
                del self._reads[key]
                self._read_done(read)

    def _drop_probe(self, probe: _Probe) -> None:
        """Forget an unanswered probe (its answers are ignored) and skip its first block
        for a while."""
        self._counts["dropped"] += 1
        self._unprobe(probe)
        self._probes.pop(probe.probe.key, None)
        self._absent.add(probe.probe.hashes[0])

    def _probed(self, probe: _Probe) -> None:
        hashes = probe.probe.hashes
        self._unprobe(probe)
        run = min(probe.runs.values(), default=0)
        run = max(0, min(run, len(hashes)))
        if run < len(hashes) and not self._pool.is_cached(hashes[run]):
            # Where the next lookup's run stops: do not probe it again for a while.
            self._absent.add(hashes[run])
        if run == 0:
            return
        ledger = self._ledger
        wanted = ledger.promotable(list(enumerate(hashes[:run])))
        if not wanted:
            return
        protect = {b for b in probe.protect if b.block_hash is not None}
        promotion = ledger.open_promotion(wanted, protect)
        if promotion is None:
            self._counts["no_space"] += 1
            _log.debug("vllm_promotion_no_space", blocks=len(wanted), free=self._pool.num_free)
            return
        if not promotion.blocks:
            return
        read = TierRead(
            next(self._keys),
            tuple(h for _, h in promotion.wanted),
            tuple(b.block_id for b in promotion.blocks),
            self._group,
        )
        self._reads[read.key] = _Read(read, promotion)
        self._out_reads.append(read)
        self._counts["promotions"] += 1

    def _read_done(self, read: _Read) -> None:
        n = len(read.read.hashes)
        good = [all(len(g) == n and g[k] for g in read.good.values()) for k in range(n)]
        published = self._ledger.close_promotion(read.promotion, good)
        blocks = read.promotion.blocks
        for block_hash, block, done in zip(read.read.hashes, blocks, published, strict=True):
            if done:
                self._counts["promoted"] += 1
                self._landed.add(block_hash, block, self._source)
            else:
                self._counts["failed"] += 1
                self._failed.add(block_hash)

    def forget_absent(self, hashes: Sequence[BlockHash]) -> None:
        """These blocks were just stored: a later lookup may probe for them again."""
        self._absent.forget(hashes)

    def reset(self) -> None:
        """The CPU cache was reset: forget what probes found missing (promotions in
        flight publish nothing: the ledger's epoch moved)."""
        self._absent.clear()
        self._failed.clear()
        self._landed.clear()

    def statistics(self) -> VllmTierStatistics:
        """A snapshot of the counters."""
        c = self._counts
        return VllmTierStatistics(
            probes=c["probes"],
            promotions=c["promotions"],
            promotions_no_space=c["no_space"],
            blocks_promoted=c["promoted"],
            blocks_failed=c["failed"],
            deferred_lookups=c["deferred"],
            probes_dropped=c["dropped"],
            probes_in_flight=len(self._probes),
            promotions_in_flight=len(self._reads),
        )

    def manager_statistics(self) -> TierManagerStatistics:
        """The counters as the ``kvoffload_tiers_*`` metrics read them (vLLM's
        ``/metrics``, `kvoffload.integrations.vllm.stats`): ``promotions``,
        ``promotions_no_space`` and ``deferred_lookups`` as in `statistics()`;
        ``promotions_in_flight``: probes and promotions not yet answered by every rank.
        Each tier's figures come from the workers (`WorkerTiers.manager_statistics`), so
        ``tiers`` is empty. Always 0 here: ``promotion_errors`` (a read that fails on a
        rank is a miss, ``blocks_failed``), ``refs_held`` (a promotion holds its CPU blocks
        as pending in the ledger, not as references) and the prefetch counters (vLLM gives
        no prefetch hints)."""
        c = self._counts
        return TierManagerStatistics(
            tiers=(),
            promotions=c["promotions"],
            promotions_no_space=c["no_space"],
            deferred_lookups=c["deferred"],
            promotion_errors=0,
            promotions_in_flight=len(self._probes) + len(self._reads),
            refs_held=0,
        )


# -- the worker side ---------------------------------------------------------------------


@final
class WorkerTiers:
    """One rank's tiers: answers probes, reads promotions into the host buffer, and
    writes stored blocks down. Runs in vLLM's worker thread; the tiers run on the bridge's.

    Args:
        bridge: the rank's tiers (namespace: `rank_namespace`), opened.
        host: the rank's host buffer (its blocks are read into and written from).
        staging_blocks: most blocks being written down at once (the rest are dropped).
    """

    def __init__(self, bridge: TierBridge, host: HostKVBuffer, *, staging_blocks: int) -> None:
        import torch  # noqa: PLC0415

        self._bridge = bridge
        self._host = host
        nbytes = host.layout.bytes_per_block
        self._nbytes = nbytes
        self._staging: torch.Tensor = torch.empty((staging_blocks, nbytes), dtype=torch.uint8)
        self._free_slots = list(range(staging_blocks - 1, -1, -1))
        self._probes: list[tuple[int, concurrent.futures.Future[int]]] = []
        self._reads: list[tuple[int, int, concurrent.futures.Future[list[bool]]]] = []
        self._writes: list[
            tuple[list[int], tuple[BlockHash, ...], concurrent.futures.Future[tuple[int, ...]]]
        ] = []
        self.on_written: Callable[[tuple[BlockHash, ...], tuple[int, ...]], None] | None = None
        """Called by `take()` for each write-down that ended: its blocks' hashes and, per
        tier in order, how many of them that tier stored (``None``: nobody asks)."""
        self.writes_submitted = 0
        self.writes_dropped = 0
        self.writes_failed = 0
        self.blocks_read = 0
        self.blocks_missed = 0
        self._tier_stats: tuple[TierStatistics, ...] = ()
        self._stats_pending: concurrent.futures.Future[tuple[TierStatistics, ...]] | None = None

    @property
    def bridge(self) -> TierBridge:
        """The rank's tiers."""
        return self._bridge

    def _view(self, tensor: torch.Tensor) -> memoryview:
        array: Any = tensor.numpy()
        return memoryview(array).cast("B")

    def submit(self, probes: Sequence[TierProbe], reads: Sequence[TierRead]) -> None:
        """Start the step's probes and reads on the bridge (never waits)."""
        bridge = self._bridge
        for probe in probes:
            self._probes.append((probe.key, bridge.submit_exists(probe.hashes)))
        host = self._host
        for read in reads:
            views = [self._view(host.block_bytes(i)) for i in read.cpu_block_ids]
            self._reads.append((read.key, len(views), bridge.submit_get(read.hashes, views)))

    def on_stored(self, plan: StorePlan) -> None:
        """A store copy ended on this rank: stage its blocks and write them down (those
        the staging area has no room for are dropped and counted)."""
        free = self._free_slots
        n = min(len(free), len(plan.cpu_block_ids))
        self.writes_dropped += len(plan.cpu_block_ids) - n
        if not n:
            return
        slots = [free.pop() for _ in range(n)]
        host = self._host
        views = []
        for slot, cpu_id in zip(slots, plan.cpu_block_ids[:n], strict=True):
            row = self._staging[slot]
            row.copy_(host.block_bytes(cpu_id))
            views.append(self._view(row))
        try:
            hashes = tuple(plan.block_hashes[:n])
            future = self._bridge.submit_put_each(hashes, views)
        except Exception as exc:  # closed
            _log.warning("vllm_tier_write_failed", error=repr(exc))
            free.extend(slots)
            self.writes_failed += n
            return
        self.writes_submitted += n
        self._writes.append((slots, hashes, future))

    def take(self) -> tuple[dict[int, int], dict[int, tuple[bool, ...]]]:
        """The probes and reads that ended since the last call (a failed one is a run
        of 0, or no block read); frees the staging of finished write-downs."""
        probes: dict[int, int] = {}
        running_p = []
        for key, future in self._probes:
            if not future.done():
                running_p.append((key, future))
                continue
            try:
                probes[key] = int(future.result())
            except Exception as exc:
                _log.warning("vllm_tier_probe_failed", error=repr(exc))
                probes[key] = 0
        self._probes = running_p
        reads: dict[int, tuple[bool, ...]] = {}
        running_r = []
        for key, n, rfuture in self._reads:
            if not rfuture.done():
                running_r.append((key, n, rfuture))
                continue
            try:
                good = tuple(bool(g) for g in rfuture.result())
            except Exception as exc:
                _log.warning("vllm_tier_read_failed", error=repr(exc))
                good = (False,) * n
            self.blocks_read += sum(good)
            self.blocks_missed += n - sum(good)
            reads[key] = good
        self._reads = running_r
        running_w = []
        for slots, written, wfuture in self._writes:
            if not wfuture.done():
                running_w.append((slots, written, wfuture))
                continue
            try:
                counts = wfuture.result()
            except Exception:
                counts = ()
            stored = max(counts, default=0)
            self.writes_failed += len(slots) - min(stored, len(slots))
            if self.on_written is not None and counts:
                self.on_written(written, counts)
            self._free_slots.extend(slots)
        self._writes = running_w
        return probes, reads

    def statistics(self) -> tuple[TierStatistics, ...]:
        """Every tier's counters (waits for the bridge)."""
        return self._bridge.statistics()

    def manager_statistics(self) -> TierManagerStatistics:
        """This rank's tiers as the ``kvoffload_tier_*`` metrics read them (vLLM's
        ``/metrics``, labelled ``rank``); never waits for the bridge.

        ``tiers``: each tier's counters as the bridge last answered (this call asks for
        the next answer, so the figures trail the bridge by one call; none before its
        first answer), with ``writes_skipped_full`` counting too the blocks the staging
        area had no room for (``writes_dropped`` here: skipped for every tier).
        ``blocks_promoted`` and ``writes_held`` of a tier are 0: the scheduler side
        publishes promoted blocks (`SchedulerTiers.manager_statistics`) and a write-down
        holds a staging slot, not a CPU block. The promotion counters are the scheduler
        side's, so every other field is 0 here.
        """
        pending = self._stats_pending
        if pending is None or pending.done():
            if pending is not None and pending.exception() is None:
                self._tier_stats = pending.result()
            try:
                self._stats_pending = self._bridge.submit_statistics()
            except ClosedError:
                self._stats_pending = None
        dropped = self.writes_dropped
        tiers = tuple(
            replace(t, writes_skipped_full=t.writes_skipped_full + dropped)
            for t in self._tier_stats
        )
        return TierManagerStatistics(
            tiers=tiers,
            promotions=0,
            promotions_no_space=0,
            deferred_lookups=0,
            promotion_errors=0,
            promotions_in_flight=0,
            refs_held=0,
        )

    def close(self) -> None:
        """Wait for the tier jobs in flight (each within its tier's bounds), close the
        tiers and end the bridge's thread."""
        self._bridge.close(drain=True)


def open_worker_tiers(
    settings: Sequence[AnyTierSettings],
    *,
    root: bytes,
    host: HostKVBuffer,
    rank: int,
    world_size: int,
    name: str,
) -> WorkerTiers:
    """Open one rank's tiers over ``host``: ``settings`` as that rank holds them
    (`rank_tier_settings`), keyed under `rank_namespace` of ``root``, on a bridge thread
    called ``name``; staging for the most ``max_queued_writes`` of any tier.

    Raises:
        ConfigError: a tier cannot be built (see `build_tier()`).
    """
    from kvoffload.tiers.bridge import TierBridge  # noqa: PLC0415

    mine = rank_tier_settings(settings, rank, world_size)
    bridge = TierBridge.from_settings(
        mine,
        namespace=rank_namespace(root, rank, world_size),
        block_nbytes=host.layout.bytes_per_block,
        name=name,
    )
    return WorkerTiers(bridge, host, staging_blocks=max(s.max_queued_writes for s in mine))
