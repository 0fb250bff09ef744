"""`TierManager`: cascades stored CPU blocks down to the tiers and promotes them back.

Decisions are synchronous and made on the event loop thread, like the scheduler's: which
blocks to write down (and which to skip because a tier's queue is full or the tier is
unhealthy), which lookups start a promotion, which CPU blocks a promotion may take. Bytes
move in tasks of the manager's own task group: one or more writers and one health loop per
tier, and one task per promotion.

The rules, extending DESIGN.md's invariants to tiers:

* A CPU block queued for or being written to a tier holds a reference (invariant 2), so
  it is neither evicted nor reused while a write reads it; each tier holds at most
  ``max_queued_writes`` such blocks, and write-downs beyond that are skipped and counted.
* CPU blocks are taken, published and released only through the scheduler's
  `BlockLedger`, which also owns the pending stores: a promotion allocates like a store
  (only free blocks, never one with a copy in flight, never the blocks of the prefix it
  extends), skips every hash being stored or promoted right now, and marks its own
  hashes pending, so no store plans them meanwhile. If no block is free it is skipped
  (the lookup is answered from the CPU pool).
* Every block read from a tier is checked by `verify_block()` before it is published; a
  block that fails is a miss, is deleted from its tier and is counted (invariant 3).
* Reads (promotions) take precedence over write-downs: a write waits while a read waits,
  and writes never fill a tier's last operation slot.
* A tier error (refused connection, timeout, I/O error ...) marks the tier unhealthy;
  write-downs to it are skipped, lookups ignore it, and it is pinged with exponential
  backoff until it answers. No tier error reaches the engine's step loop.
* A tier that cannot write but can still read (a full disk: its ``reads_ok()`` says so)
  is marked read-only instead: write-downs are skipped, lookups keep reading the blocks
  it holds, and it is pinged the same way until it can write again.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, final

import anyio
import anyio.abc
import anyio.to_thread

from kvoffload._logging import get_logger
from kvoffload.errors import IntegrityError, InvariantError
from kvoffload.hashing import BlockHash
from kvoffload.tiers._state import PriorityGate, TierState
from kvoffload.tiers.base import BlockRead, BlockWrite, SecondaryTier
from kvoffload.tiers.format import encode_header, verify_block
from kvoffload.tiers.settings import AnyTierSettings
from kvoffload.tiers.stats import TierManagerStatistics, TierStatistics

if TYPE_CHECKING:
    from kvoffload.pool.block_pool import CpuBlockPool
    from kvoffload.pool.free_queue import CpuBlock
    from kvoffload.scheduler import OffloadScheduler
    from kvoffload.scheduler.ledger import Promotion
    from kvoffload.storage.host_buffer import HostKVBuffer
    from kvoffload.transfer.plan import StorePlan

__all__ = ["TierManager"]

_log = get_logger("tiers")

_ABSENT_TTL_S = 1.0
"""How long a probe that found nothing keeps lookups from probing the same block again."""
_ABSENT_MAX = 4096
_PROMOTION_MAX_BLOCKS = 256


@dataclass(slots=True, eq=False)
class _Promotion:
    hashes: tuple[BlockHash, ...]
    protect: tuple[CpuBlock, ...]
    epoch: int


@final
class TierManager:
    """Moves blocks between the CPU pool and the secondary tiers.

    Built and driven by `KVOffloader` when ``OffloadConfig.tiers`` is set; tests may build
    one directly around their own tiers.

    Args:
        tiers: ``(tier, settings)`` pairs, in lookup order (fastest first).
        scheduler: the offloader's scheduler: CPU blocks are taken and published through
            its ledger, and its lookups ask `extend_lookup()` (the manager installs itself).
        host: the host buffer whose blocks are read and written.
        namespace: the 32-byte namespace digest written into every block header.

    Call `run()` through ``task_group.start`` and `aclose()` before the host buffer is
    freed. The synchronous methods must be called on the event loop thread.
    """

    def __init__(
        self,
        tiers: Sequence[tuple[SecondaryTier, AnyTierSettings]],
        *,
        scheduler: OffloadScheduler,
        host: HostKVBuffer,
        namespace: bytes,
    ) -> None:
        self._scheduler = scheduler
        self._ledger = scheduler.ledger
        self._pool: CpuBlockPool = scheduler.pool
        self._block_size = scheduler.config.block_size
        self._namespace = namespace
        self._nbytes = host.layout.bytes_per_block
        raw = host.raw
        buffer = (ctypes.c_ubyte * (raw.numel() * raw.element_size())).from_address(raw.data_ptr())
        self._host = host  # keeps the memory the view below points at alive
        self._memory = memoryview(buffer).cast("B")
        self._tiers = [
            TierState(
                tier=tier,
                kind=getattr(s, "kind", type(tier).__name__),
                max_queued=s.max_queued_writes,
                max_batch=s.max_batch_blocks,
                timeout_s=s.op_timeout_s,
                retry_initial_s=s.retry_initial_s,
                retry_max_s=max(s.retry_max_s, s.retry_initial_s),
                gate=PriorityGate(s.max_in_flight),
            )
            for tier, s in tiers
        ]
        self._jobs: dict[BlockHash, _Promotion] = {}
        self._num_jobs = 0
        self._absent: OrderedDict[BlockHash, float] = OrderedDict()
        self._landed: OrderedDict[BlockHash, CpuBlock] = OrderedDict()
        self._epoch = 0
        self._promotions = 0
        self._no_space = 0
        self._deferred_lookups = 0
        self._promotion_errors = 0
        self._task_group: anyio.abc.TaskGroup | None = None
        self._stopped = anyio.Event()
        self._closing = False
        scheduler.set_lookup_extension(self)

    def __repr__(self) -> str:
        names = ",".join(t.tier.name for t in self._tiers)
        return f"TierManager(tiers=[{names}], refs={sum(self._ledger.tier_refs().values())})"

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        """The tiers, in lookup order."""
        return tuple(t.tier for t in self._tiers)

    def block_view(self, block_id: int) -> memoryview:
        """The bytes of CPU block ``block_id`` (no copy)."""
        n = self._nbytes
        return self._memory[block_id * n : (block_id + 1) * n]

    # -- references ------------------------------------------------------------------------

    def held_refs(self) -> Mapping[int, int]:
        """CPU block id → references the tiers hold (write-downs and promotions; the
        scheduler's ledger keeps them)."""
        return self._ledger.tier_refs()

    # -- lifecycle -------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Open the tiers and run the writers and health loops until `aclose()`.

        A tier that cannot be opened starts unhealthy and is retried with backoff.
        """
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                for t in self._tiers:
                    try:
                        with anyio.fail_after(t.timeout_s):
                            await t.tier.open()
                    except Exception as exc:
                        self._fault(t, exc, "open")
                    else:
                        t.opened = t.healthy = True
                    tg.start_soon(self._health_loop, t)
                    for _ in range(max(1, t.gate.limit - 1)):
                        tg.start_soon(self._writer, t)
                task_status.started()
        finally:
            self._task_group = None
            with anyio.CancelScope(shield=True):
                self._drop_all_queues()
                for t in self._tiers:
                    try:
                        await t.tier.close()
                    except Exception as exc:
                        _log.warning("tier_close_failed", tier=t.tier.name, error=repr(exc))
            self._stopped.set()

    async def aclose(self) -> None:
        """Stop: drop queued write-downs, end running operations, close the tiers.

        Shielded; safe to call more than once. References the manager held are all
        released on return.
        """
        self._closing = True
        self._drop_all_queues()
        tg = self._task_group
        if tg is not None:
            tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._stopped.wait()

    def _drop_all_queues(self) -> None:
        for t in self._tiers:
            self._drop_queue(t)

    def _drop_queue(self, t: TierState) -> int:
        dropped = list(t.queue)
        t.queue.clear()
        t.held -= len(dropped)
        if dropped:
            self._ledger.close_write_down(dropped[::-1])
        return len(dropped)

    def reset(self) -> None:
        """The CPU cache was reset: promotions in flight publish nothing."""
        self._epoch += 1
        self._absent.clear()
        self._landed.clear()

    # -- health ----------------------------------------------------------------------------

    def _fault(self, t: TierState, exc: BaseException, op: str) -> None:
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
        t.skipped_unhealthy += self._drop_queue(t)

    @staticmethod
    def _reads_ok(t: TierState) -> bool:
        """Whether the tier's failure affects writes only (its optional ``reads_ok()``)."""
        reads_ok = getattr(t.tier, "reads_ok", None)
        return t.opened and callable(reads_ok) and bool(reads_ok())

    def _fault_write(self, t: TierState, exc: BaseException, op: str) -> None:
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
        t.skipped_unhealthy += self._drop_queue(t)

    async def _health_loop(self, t: TierState) -> None:
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
                if self._reads_ok(t):  # it answers, but cannot write: read-only
                    if not t.healthy:
                        t.healthy = True
                        t.writable = True  # so that _fault_write starts a new episode
                        t.recoveries += 1
                        _log.info("tier_recovered", tier=t.tier.name, writable=False)
                    self._fault_write(t, exc, "ping")
                else:
                    self._fault(t, exc, "ping" if t.opened else "open")
                continue
            t.opened = t.healthy = t.writable = True
            t.backoff_s = 0.0
            t.recoveries += 1
            t.sick = anyio.Event()
            _log.info("tier_recovered", tier=t.tier.name)

    # -- cascade on store -------------------------------------------------------------------

    def on_stored(self, plan: StorePlan) -> None:
        """A CPU store completed: queue its newly published blocks for every tier.

        Each queued block takes a reference. A full queue or an unhealthy tier skips the
        block for that tier (counted); nothing waits.
        """
        if self._closing or not self._tiers:
            return
        get_cached = self._pool.get_cached
        blocks = []
        for block_id, block_hash in zip(plan.cpu_block_ids, plan.block_hashes, strict=True):
            block = get_cached(block_hash)
            if block is not None and block.block_id == block_id:
                blocks.append(block)
                self._absent.pop(block_hash, None)
        if not blocks:
            return
        for t in self._tiers:
            if not (t.healthy and t.writable):
                t.skipped_unhealthy += len(blocks)
                continue
            room = max(0, t.max_queued - t.held)
            take = blocks[:room]
            t.skipped_full += len(blocks) - len(take)
            if not take:
                continue
            self._ledger.open_write_down(take)
            t.queue.extend(take)
            t.held += len(take)
            t.max_held = max(t.max_held, t.held)
            t.wake.set()

    async def _writer(self, t: TierState) -> None:
        while True:
            while not t.queue:
                # One event shared by every idle writer of the tier: a writer replacing
                # it with its own would leave the others waiting on events never set.
                if t.wake.is_set():
                    t.wake = anyio.Event()
                await t.wake.wait()
            batch = [t.queue.popleft() for _ in range(min(t.max_batch, len(t.queue)))]
            try:
                await self._write(t, batch)
            finally:
                t.held -= len(batch)
                self._ledger.close_write_down(batch[::-1])

    async def _write(self, t: TierState, batch: list[CpuBlock]) -> None:
        hashes: list[BlockHash] = []
        views: list[memoryview] = []
        for block in batch:
            # A reference is held, so the block cannot be reused; it can be unpublished
            # (a reset, a failed load) - then it is not written.
            if block.block_hash is not None:
                hashes.append(block.block_hash)
                views.append(self.block_view(block.block_id))
        if not hashes:
            return
        namespace = self._namespace
        # The tier builds each header (the payload's checksum) in the worker thread that
        # writes the block: no extra hand-off, and no checksum on the event loop.
        writes = [
            BlockWrite(h, b"", v, seal=functools.partial(encode_header, namespace, h, v))
            for h, v in zip(hashes, views, strict=True)
        ]
        await t.gate.acquire(read=False)
        start = time.perf_counter()
        try:
            if not (t.healthy and t.writable):
                t.skipped_unhealthy += len(hashes)
                return
            with anyio.fail_after(t.timeout_s):
                stored = await t.tier.put(writes)
        except Exception as exc:
            t.writes_failed += len(hashes)
            if self._reads_ok(t):
                self._fault_write(t, exc, "put")
            else:
                self._fault(t, exc, "put")
        else:
            t.blocks_written += stored
            t.bytes_written += stored * self._nbytes
        finally:
            t.write_seconds += time.perf_counter() - start
            t.gate.release()

    # -- promotion on lookup ----------------------------------------------------------------

    def extend_lookup(
        self,
        block_hashes: Sequence[BlockHash],
        end: int,
        limit: int,
        pinned: Sequence[CpuBlock],
        *,
        allow_defer: bool,
    ) -> bool:
        """Extend a CPU lookup with the tiers: start a promotion of what follows the hit
        (the scheduler's lookups call this, see `LookupExtension`).

        Args:
            block_hashes: the lookup's block hashes.
            end: index of the first block after the CPU hit.
            limit: the blocks ``block_hashes[:limit]`` may be loaded.
            pinned: the hit's CPU blocks (pinned; a promotion does not evict them).
            allow_defer: ask the caller to come back later while a promotion of the
                block after the hit is in flight.

        Returns:
            ``True`` when the lookup should answer "ask again later".
        """
        if not self._tiers or self._task_group is None or self._closing:
            return False
        landed = self._landed
        if landed:
            for block in pinned:
                if block.block_hash is not None:
                    landed.pop(block.block_hash, None)
        if end >= limit:
            return False
        first = block_hashes[end]
        job = self._jobs.get(first)
        if (
            job is None
            and first not in self._ledger.pending
            and not self._is_absent(first)
            and any(t.healthy for t in self._tiers)
        ):
            job = _Promotion(
                hashes=tuple(block_hashes[end : min(limit, end + _PROMOTION_MAX_BLOCKS)]),
                protect=tuple(pinned),
                epoch=self._epoch,
            )
            for block_hash in job.hashes:
                self._jobs.setdefault(block_hash, job)
            self._promotions += 1
            self._num_jobs += 1
            self._task_group.start_soon(self._promote, job)
        if job is not None and allow_defer:
            self._deferred_lookups += 1
            return True
        return False

    def is_promoting(self, block_hash: BlockHash) -> bool:
        """Whether a promotion covering ``block_hash`` is in flight."""
        return block_hash in self._jobs

    def _is_absent(self, block_hash: BlockHash) -> bool:
        expiry = self._absent.get(block_hash)
        if expiry is None:
            return False
        if expiry > time.monotonic():
            return True
        del self._absent[block_hash]
        return False

    def _mark_absent(self, block_hash: BlockHash) -> None:
        self._absent[block_hash] = time.monotonic() + _ABSENT_TTL_S
        self._absent.move_to_end(block_hash)
        while len(self._absent) > _ABSENT_MAX:
            self._absent.popitem(last=False)

    async def _promote(self, job: _Promotion) -> None:
        opened: list[Promotion] = []
        try:
            await self._promote_job(job, opened)
        except Exception as exc:  # never let a bug here end the offloader's task group
            self._promotion_errors += 1
            _log.error("promotion_failed", error=repr(exc), blocks=len(job.hashes))
        finally:
            for block_hash in job.hashes:
                if self._jobs.get(block_hash) is job:
                    del self._jobs[block_hash]
            self._num_jobs -= 1
            if opened:  # cancelled or failed while reading: publish nothing
                self._ledger.close_promotion(opened.pop(), None)

    async def _promote_job(self, job: _Promotion, opened: list[Promotion]) -> None:
        """Probe, open a promotion in the ledger (``opened`` holds it while the read runs;
        the caller closes it if this ends early), read, verify, close it (publish)."""
        sources = await self._probe(job.hashes)
        run = sources[-1][2] if sources else 0
        if run < len(job.hashes):
            self._mark_absent(job.hashes[run])  # where the next lookup's run will stop
        if run == 0:
            return
        if job.epoch != self._epoch or self._closing:
            return
        promotion = self._open(job, run)
        if promotion is None or not promotion.blocks:
            return
        opened.append(promotion)
        ok = await self._read_into(sources, promotion.wanted, promotion.blocks)
        opened.pop()
        current = job.epoch == self._epoch and not self._closing
        published = self._ledger.close_promotion(promotion, ok if current else None)
        for (i, block_hash), block, done in zip(
            promotion.wanted, promotion.blocks, published, strict=True
        ):
            if done:
                self._landed[block_hash] = block
                self._tier_of(sources, i).promoted += 1
        while len(self._landed) > max(1, self._pool.num_blocks // 4):
            self._landed.popitem(last=False)

    @staticmethod
    def _tier_of(sources: list[tuple[TierState, int, int]], i: int) -> TierState:
        for t, lo, hi in sources:
            if lo <= i < hi:
                return t
        raise IndexError(i)  # pragma: no cover - wanted blocks all lie in a source

    async def _probe(self, hashes: tuple[BlockHash, ...]) -> list[tuple[TierState, int, int]]:
        """Find, tier by tier, the leading run of ``hashes`` the tiers hold together."""
        sources: list[tuple[TierState, int, int]] = []
        run = 0
        progress = True
        while progress and run < len(hashes):
            progress = False
            for t in self._tiers:
                if not t.healthy or run >= len(hashes):
                    continue
                await t.gate.acquire(read=True)
                try:
                    with anyio.fail_after(t.timeout_s):
                        k = await t.tier.exists(hashes[run:])
                except Exception as exc:
                    self._fault(t, exc, "exists")
                    continue
                finally:
                    t.gate.release()
                k = max(0, min(k, len(hashes) - run))
                if k:
                    sources.append((t, run, run + k))
                    run += k
                    progress = True
        return sources

    def _open(self, job: _Promotion, run: int) -> Promotion | None:
        """Open a promotion of the part of the run neither cached nor being filled (a
        store or another promotion in flight), in free CPU blocks only: never a
        referenced block, the prefix being extended or a block just promoted."""
        ledger = self._ledger
        wanted = ledger.promotable(list(enumerate(job.hashes[:run])))
        if not wanted:
            return None
        protect = {b for b in job.protect if b.block_hash is not None}
        protect.update(b for h, b in self._landed.items() if b.block_hash == h)
        promotion = ledger.open_promotion(wanted, protect)
        if promotion is None:
            self._no_space += 1
            _log.debug("promotion_deferred", blocks=len(wanted), free=self._pool.num_free)
        return promotion

    async def _read_into(
        self,
        sources: list[tuple[TierState, int, int]],
        wanted: list[tuple[int, BlockHash]],
        blocks: list[CpuBlock],
    ) -> list[bool]:
        ok = [False] * len(wanted)
        for t, lo, hi in sources:
            picks = [j for j, (i, _) in enumerate(wanted) if lo <= i < hi]
            for at in range(0, len(picks), t.max_batch):
                chunk = picks[at : at + t.max_batch]
                if not t.healthy:
                    break
                hashes = [wanted[j][1] for j in chunk]
                views = [self.block_view(blocks[j].block_id) for j in chunk]
                for j, good in zip(chunk, await self._read_chunk(t, hashes, views), strict=True):
                    ok[j] = good
        return ok

    async def _read_chunk(
        self, t: TierState, hashes: list[BlockHash], views: list[memoryview]
    ) -> list[bool]:
        await t.gate.acquire(read=True)
        start = time.perf_counter()
        try:
            with anyio.fail_after(t.timeout_s):
                reads = await t.tier.get(hashes, views)
        except Exception as exc:
            self._fault(t, exc, "get")
            return [False] * len(hashes)
        finally:
            t.read_seconds += time.perf_counter() - start
            t.gate.release()
        if all(r is None or r.payload_checksum is not None for r in reads):
            # The payload checksums were taken by the thread that read them: what is left
            # (header crc, namespace, hash, length, comparing checksums) is cheap.
            reasons = self._verify_all(hashes, views, reads)
        else:
            reasons = await anyio.to_thread.run_sync(self._verify_all, hashes, views, reads)
        good: list[bool] = []
        bad: list[BlockHash] = []
        for block_hash, reason in zip(hashes, reasons, strict=True):
            if reason is None:
                t.blocks_read += 1
                t.bytes_read += self._nbytes
                good.append(True)
                continue
            good.append(False)
            if reason == "miss":
                t.read_misses += 1
                continue
            t.failed_checks += 1
            bad.append(block_hash)
            _log.warning(
                "tier_block_rejected",
                tier=t.tier.name,
                block_hash=block_hash.hex()[:16],
                reason=reason,
            )
        if bad:
            await t.gate.acquire(read=True)
            try:
                with anyio.fail_after(t.timeout_s):
                    await t.tier.delete(bad)
            except Exception as exc:
                self._fault(t, exc, "delete")
            finally:
                t.gate.release()
        return good

    def _verify_all(
        self,
        hashes: list[BlockHash],
        views: list[memoryview],
        reads: list[BlockRead | None],
    ) -> list[str | None]:
        if len(reads) != len(hashes):
            return ["length"] * len(hashes)
        reasons: list[str | None] = []
        for block_hash, view, read in zip(hashes, views, reads, strict=True):
            if read is None:
                reasons.append("miss")
                continue
            try:
                verify_block(
                    read.header,
                    namespace=self._namespace,
                    block_hash=block_hash,
                    expected_length=self._nbytes,
                    received_length=read.payload_length,
                    payload=view,
                    payload_checksum=read.payload_checksum,
                )
            except IntegrityError as exc:
                reasons.append(exc.reason)
            else:
                reasons.append(None)
        return reasons

    # -- observation -------------------------------------------------------------------------

    def statistics(self) -> TierManagerStatistics:
        """A snapshot of every tier's counters and the promotion counters."""
        return TierManagerStatistics(
            tiers=tuple(
                TierStatistics(
                    name=t.tier.name,
                    kind=t.kind,
                    healthy=t.healthy,
                    writable=t.healthy and t.writable,
                    blocks_written=t.blocks_written,
                    bytes_written=t.bytes_written,
                    writes_skipped_full=t.skipped_full,
                    writes_skipped_unhealthy=t.skipped_unhealthy,
                    writes_failed=t.writes_failed,
                    writes_held=t.held,
                    max_writes_held=t.max_held,
                    blocks_read=t.blocks_read,
                    bytes_read=t.bytes_read,
                    blocks_promoted=t.promoted,
                    read_misses=t.read_misses,
                    failed_checks=t.failed_checks,
                    errors=t.errors,
                    unhealthy_events=t.unhealthy_events,
                    recoveries=t.recoveries,
                    write_seconds=t.write_seconds,
                    read_seconds=t.read_seconds,
                    last_error=t.last_error,
                    details=dict(t.tier.statistics()),
                )
                for t in self._tiers
            ),
            promotions=self._promotions,
            promotions_no_space=self._no_space,
            deferred_lookups=self._deferred_lookups,
            promotion_errors=self._promotion_errors,
            promotions_in_flight=self._num_jobs,
            refs_held=sum(self._ledger.tier_refs().values()),
        )

    def check_invariants(self) -> None:
        """Check the manager's own bookkeeping (queues within bounds, refs consistent).

        Raises:
            InvariantError: naming the breach.
        """
        queued: Counter[int] = Counter()
        for t in self._tiers:
            if t.held > t.max_queued or t.held < len(t.queue):
                raise InvariantError(
                    f"tier {t.tier.name!r}: {t.held} write-downs held, {len(t.queue)} queued, "
                    f"bound {t.max_queued}"
                )
            for block in t.queue:
                queued[block.block_id] += 1
        refs = self._ledger.tier_refs()
        for block_id, n in queued.items():
            if refs.get(block_id, 0) < n:
                raise InvariantError(f"queued block {block_id} holds fewer refs than queued")
        for block_id, n in refs.items():
            if n < 1 or self._pool.block(block_id).ref_cnt < n:
                raise InvariantError(
                    f"tier manager holds {n} refs on block {block_id} with ref_cnt "
                    f"{self._pool.block(block_id).ref_cnt}"
                )
