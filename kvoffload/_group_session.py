"""The parts of a `KVOffloader` for a model with several KV cache groups.

`GroupSession` is the counterpart of `Session` (same lifecycle: created, open, closing,
closed; same owner checks) for a model whose cache is several groups (docs/groups.md).
It owns the `GroupedScheduler` (built by `build_grouped_scheduler()`), one host buffer
and one copy engine per cacheable group (a group's copies touch only that group's
tensors), the completion poller, and the step calls with per-group tables and hashes.
Its transfers run through the `TransferLauncher` one group uses too: a step that touches
one group is submitted to that group's engine as itself; several groups' parts run as one
`TransferTask` that completes once every part did, a failure in any part completing
every part as failed (a store publishes nothing, its references are released).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any, final

import anyio
import anyio.abc
import torch

from kvoffload._logging import get_logger
from kvoffload._session import Lifecycle, _State
from kvoffload.build import POOL_BOOKKEEPING_BYTES_PER_BLOCK, build_grouped_scheduler
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ConfigError, HostMemoryError, RequestStateError
from kvoffload.groups import KVCacheGroup, check_groups, hit_alignment, page_layout
from kvoffload.hashing import BlockHash, HashNamespace, hash_prompt
from kvoffload.launcher import TransferLauncher
from kvoffload.pinner import GpuBlockPinner
from kvoffload.pool.block_pool import PoolEvent, PoolStatistics
from kvoffload.pool.hints import RetentionHints
from kvoffload.request_groups import GroupLanes, check_group_mapping
from kvoffload.scheduler import GpuCacheView, SchedulerStatistics
from kvoffload.scheduler.group_loads import find_hit
from kvoffload.scheduler.group_totals import GroupCounters, pool_statistics
from kvoffload.scheduler.groups import GroupedScheduler, GroupStatistics
from kvoffload.scheduler.misses import MissReason
from kvoffload.storage.host_buffer import HostKVBuffer, available_host_memory
from kvoffload.tiers.groups import GroupTiers
from kvoffload.tiers.stats import TierManagerStatistics
from kvoffload.transfer.cuda_engine import CudaCopyEngine
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.poller import PollerStatistics
from kvoffload.transfer.task import TransferTask
from kvoffload.transfer.thread_engine import ThreadCopyEngine

__all__ = ["GroupSession", "page_layout"]

_log = get_logger("offloader")


def _check_host_memory(
    blocks: Mapping[str, int], layouts: Mapping[str, KVLayout], *, host_buffer: bool
) -> None:
    """Refuse pools whose host buffers and bookkeeping, all groups together, exceed the
    memory left (see `check_host_memory()`).

    Raises:
        HostMemoryError: naming each group's blocks.
    """
    available = available_host_memory()
    if available is None:
        return
    host = sum(n * layouts[g].bytes_per_block for g, n in blocks.items()) if host_buffer else 0
    total = host + sum(blocks.values()) * POOL_BOOKKEEPING_BYTES_PER_BLOCK
    if total > available:
        raise HostMemoryError(
            f"the groups' CPU pools {dict(blocks)} (blocks) need {host} bytes of host buffer "
            f"and {total - host} bytes of bookkeeping, {total} in all, but this process can "
            f"still use {available} bytes; lower num_cpu_blocks or cpu_bytes"
        )


@final
class GroupSession(Lifecycle):
    """The parts, the lifecycle and the step calls of a multi-group `KVOffloader`.

    Args:
        config: the settings (``cpu_bytes`` is split across the groups by need).
        groups: the model's groups, in order.
        gpu_kv: per cacheable group name, its layer tensors.
        pinners: per cacheable group name, the pinner of that group's GPU blocks
            (``None``: no group is pinned).
        engines: per cacheable group, a copy engine given by the caller (then no host
            buffer is made), or ``None``.

    Raises:
        ConfigError: groups refused by `check_groups()` (no cacheable group, names not
            unique, an alignment that allows no hit), tiers with copy engines given by
            the caller, a tensor, pinner or copy engine mapping that misses a group or
            names an unknown one, or a pool that does not fit (see
            `build_grouped_scheduler()`); on opening, a group's share of a tier that does
            not fit (see `GroupTiers`).
        LayoutMismatchError: a group's tensors disagree with it.
        HostMemoryError: the host buffers exceed the memory left.
    """

    def __init__(
        self,
        config: OffloadConfig,
        groups: Sequence[KVCacheGroup],
        gpu_kv: Mapping[str, Sequence[torch.Tensor]],
        pinners: Mapping[str, GpuBlockPinner] | None,
        engines: Mapping[str, CopyEngine] | None,
    ) -> None:
        if config.tiers and engines is not None:
            raise ConfigError(
                "tiers need the host buffers this offloader makes; they cannot be used with "
                f"a copy_engine given by the caller (groups {[g.name for g in groups]})"
            )
        check_groups(groups)  # first: a model with no cacheable group has nothing to name
        self.groups = tuple(groups)
        cacheable = [g for g in self.groups if g.cacheable]
        names = {g.name for g in cacheable}
        for what, given in (("gpu_kv", gpu_kv), ("copy_engine", engines), ("pinner", pinners)):
            if given is not None and set(given) != names:
                raise ConfigError(
                    f"{what} must name exactly the cacheable groups {sorted(names)}; missing "
                    f"{sorted(names - set(given))}, unknown {sorted(set(given) - names)}"
                )
        self.config = config
        self._layouts: dict[str, KVLayout] = {}
        self._kv: dict[str, list[torch.Tensor]] = {}
        num_gpu: dict[str, int] = {}
        for g in cacheable:
            self._layouts[g.name], self._kv[g.name] = page_layout(g, gpu_kv[g.name])
            num_gpu[g.name] = self._layouts[g.name].num_gpu_blocks(self._kv[g.name])
        self.scheduler: GroupedScheduler = build_grouped_scheduler(
            config, self.groups, num_gpu_blocks=num_gpu
        )
        self.layout_group = cacheable[0].name
        """The first cacheable group (its layout and namespace are the offloader's)."""
        self.layout = self._layouts[self.layout_group]
        self.alignment = hit_alignment(self.groups)
        """Hits are multiples of this many tokens (the LCM of the block sizes)."""
        self.names = [g.name for g in self.groups]
        pools = {n: p.num_cpu_blocks for n, p in self.scheduler.statistics().items()}
        self.num_cpu_blocks = sum(pools.values())
        _check_host_memory(pools, self._layouts, host_buffer=engines is None)
        self.namespaces: dict[str, HashNamespace] = {
            g.name: g.namespace(model_id=config.model_id, salt=config.hash_salt) for g in cacheable
        }
        """Per cacheable group, its hash namespace."""
        self.lanes = [(g.name, g.block_size, self.namespaces[g.name].root) for g in cacheable]
        """Per cacheable group, what a handle hashes with: name, block size, root."""
        self.engines: dict[str, CopyEngine] = dict(engines or {})
        self._own_engines = engines is None
        self.hosts: dict[str, HostKVBuffer] = {}
        """Per cacheable group, its host buffer (when this session made the engines)."""
        self.launcher = TransferLauncher(
            self.scheduler, self.engines, pinners or {}, poll_interval_s=config.poll_interval_s
        )
        self.poller = self.launcher.poller
        self.counters = GroupCounters()
        """The whole model's counters (per group: `GroupedScheduler.statistics()`)."""
        self.launcher.on_ended = self.counters.ended
        self._live: set[str] = set()
        self._init_lifecycle()
        self.group_tiers: GroupTiers | None = None
        """Per cacheable group, its tier stack (when ``config.tiers`` is set)."""
        self.host = None
        """No single host buffer: one per group (`hosts`)."""
        self.hints: RetentionHints[Mapping[str, Sequence[BlockHash]]] = RetentionHints(
            self._hint_retain, self.scheduler.release_retained
        )
        """The session hints (``retain_for_s``), retained in every group."""
        self.built = True

    @property
    def tiers(self) -> GroupTiers | None:
        """The tiers' front (`GroupTiers`: one tier manager per group), when
        ``config.tiers`` is set and the session is open."""
        return self.group_tiers

    # -- lifecycle (as `Session`) --------------------------------------------------------

    @property
    def state(self) -> str:
        """``created``, ``open``, ``closing`` or ``closed``."""
        return self._state.value

    @property
    def num_in_flight(self) -> int:
        """Transfers launched and not completed yet."""
        return self.launcher.num_in_flight

    def check_built(self) -> None:
        """Nothing to wait for: the pools are built at once."""

    async def open(self) -> None:
        """Become open, make the host buffers and copy engines, start the poller; on an
        error (also a cancellation) whatever was made is released again."""
        self._state = self._state.to(_State.OPEN)
        self._loop_thread = threading.get_ident()
        self._owner_task = anyio.get_current_task().id
        try:
            if self._own_engines:
                stats = self.scheduler.statistics()
                for name, lay in self._layouts.items():
                    self.hosts[name] = await HostKVBuffer.create(
                        lay,
                        stats[name].num_cpu_blocks,
                        pin_memory=self.config.pin_memory,
                        pin_chunk_bytes=int(self.config.pin_chunk_bytes),
                    )
                    kv = self._kv[name]
                    cls = CudaCopyEngine if kv[0].is_cuda else ThreadCopyEngine
                    self.engines[name] = cls(lay, kv, self.hosts[name])
            self._task_group = anyio.create_task_group()
            await self._task_group.__aenter__()
            await self._task_group.start(self.poller.run)
            if self.config.tiers:
                self.group_tiers = GroupTiers(
                    self.config, self.scheduler, self.hosts, self.namespaces
                )
                self.launcher.on_stored = self.group_tiers.on_stored
                await self.group_tiers.start(self._task_group)
        except BaseException:
            await self.shutdown()
            raise
        _log.info("offloader_opened", groups=sorted(self._layouts), engines=len(self.engines))

    def check(self, what: str, *, pinner_error: bool = True) -> None:
        """Refuse a step-loop call named ``what`` unless open, in this process, on the
        loop's thread, with a healthy poller (and, with ``pinner_error``, raise an earlier
        ``unpin`` failure once). Raises as `Session.check()`."""
        self._check_open(what)
        self.poller.check_health()
        if pinner_error:
            self.launcher.raise_pinner_error()

    async def shutdown(self) -> None:
        """Close the engines, process the last completions, stop the poller, free the
        host buffers; shielded from cancellation."""
        self._state = _State.CLOSING
        try:
            with anyio.CancelScope(shield=True):
                self.scheduler.release_all_holds()
                self.launcher.unpin_released_holds()
                for engine in self.engines.values():
                    await engine.aclose()
                await self.launcher.collect(self.config.poll_interval_s)
                # retain_prefix() owners and session hints end with the offloader
                self.hints.clear()
                for name in self._layouts:
                    self.scheduler.ledger(name).release_all_retained()
                if self.group_tiers is not None:
                    await self.group_tiers.aclose()
        finally:
            try:
                await self._close_task_group()
            finally:
                for host in self.hosts.values():
                    host.close()
                self._state = _State.CLOSED
                _log.info("offloader_closed", stored_blocks=self.counters_now().stored_blocks)

    # -- the step calls (per-group tables and hashes) ----------------------------------------

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` has a live handle or copies in flight."""
        return request_id in self._live or self.scheduler.has_request(request_id)

    def reserve(self, request_id: str) -> None:
        """Hold ``request_id`` for a new handle until it finishes."""
        if request_id in self._live or self.scheduler.has_request(request_id):
            raise RequestStateError(
                f"request {request_id!r} is in use (a live handle, or copies in flight)"
            )
        self._live.add(request_id)

    def lanes_for(self, request_id: str) -> GroupLanes:
        """The per-group part of a new handle for ``request_id``."""
        return GroupLanes(self.lanes, self.names, f"request {request_id!r}: ")

    def _check_names(self, rid: str, what: str, value: object) -> Mapping[str, Any]:
        return check_group_mapping(value, what, self.names, f"request {rid!r}: ")

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: bool = False,
        no_read: bool = False,
    ) -> int | None:
        """The hit valid for every group, pinned (see `GroupedScheduler.lookup()`); with
        ``allow_defer``, ``None`` ("ask again later") by the single-group rule."""
        self.check("lookup")
        block_hashes = self._check_names(request_id, "lookup()'s block_hashes", block_hashes)
        scheduler = self.scheduler
        hit = scheduler.lookup(
            request_id,
            block_hashes,
            num_tokens,
            num_computed_tokens,
            allow_defer=allow_defer,
            no_read=no_read,
        )
        reason, new_prompt, _ = scheduler.lookup_outcome(request_id)
        self.counters.count_lookup(
            hit, num_tokens, num_computed_tokens, reason, new_prompt=new_prompt
        )
        return hit

    def lookup_outcome(self, request_id: str) -> tuple[MissReason, dict[str, int]]:
        """Of ``request_id``'s last lookup: its `MissReason` and the tokens of its hit
        each tier brought in (see `GroupedScheduler.lookup_outcome()`)."""
        reason, _, tier_hits = self.scheduler.lookup_outcome(request_id)
        return reason, {} if tier_hits is None else dict(tier_hits)

    def load(
        self,
        request_id: str,
        tables: Sequence[int] | Mapping[str, Sequence[int | None]],
        num_tokens: int,
    ) -> TransferTask | None:
        """Start loading the last lookup's hit into every group's table (see
        `GroupedScheduler.plan_load()`)."""
        self.check("load")
        tables = self._check_names(request_id, "load()'s block tables", tables)
        plan = self.scheduler.plan_load(request_id, tables, num_tokens)
        if plan is None:
            return None
        self.counters.load_plans += 1
        return self.launcher.launch(plan.plans, None, tokens=num_tokens)

    def abandon_load(self, request_id: str) -> dict[str, tuple[int, ...]]:
        """`KVOffloader.abandon_load()` with several groups: every group's part of the
        request's loads in flight at once; per group, the GPU blocks its copies still
        write (none for a live handle that has not looked up yet)."""
        self.check("abandon_load", pinner_error=False)
        if request_id in self._live and not self.scheduler.has_request(request_id):
            return {}
        return self.launcher.abandon_loads(self.scheduler.abandon_load(request_id))

    def update(
        self,
        request_id: str,
        tables: Sequence[int] | Mapping[str, Sequence[int | None]],
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_computed_tokens: int,
    ) -> None:
        """See `GroupedScheduler.update()`."""
        self.check("update")
        tables = self._check_names(request_id, "update()'s block tables", tables)
        block_hashes = self._check_names(request_id, "update()'s block_hashes", block_hashes)
        self.scheduler.update(request_id, tables, block_hashes, num_computed_tokens)

    def store(
        self,
        after: object | None = None,
        gpu_cache: Mapping[str, GpuCacheView] | GpuCacheView | None = None,
    ) -> list[TransferTask]:
        """Plan and start this step's stores (one grouped transfer, or none); with
        ``store_mode="lazy"``, from ``gpu_cache``, one view per group name (see
        `GroupedScheduler.plan_stores()`)."""
        self.check("store")
        hints = self.hints
        if hints:  # lazy expiry; nothing to do while no hint is live
            hints.expire()
            hints.retry()
        plan = self.scheduler.plan_stores(gpu_cache)
        try:
            if plan is None:
                return []
            self.counters.store_plans += 1
            return [self.launcher.launch(plan.plans, after)]
        finally:
            self.launcher.unpin_released_holds()

    def release(self, request_id: str) -> None:
        """Drop the lookup's pins in every group."""
        self.check("release")
        self.scheduler.release(request_id)

    def preempt(self, request_id: str) -> None:
        """The engine freed the request's GPU blocks: store nothing from them, reset its
        tables and cursors (see `GroupedScheduler.preempt()`)."""
        self.check("preempt")
        if self.scheduler.has_request(request_id):
            self.scheduler.preempt(request_id)

    def finish(self, request_id: str) -> None:
        """Store the request's last point now (its GPU blocks stay pinned through each
        group's pinner until copied) and give up its id; with ``hold_blocks_on_finish``,
        pin the blocks it holds instead (see `GroupedScheduler.finish()`)."""
        self.check("finish", pinner_error=False)
        self._live.discard(request_id)
        if self.scheduler.has_request(request_id):
            plan = self.scheduler.finish(request_id)
            if plan is not None:
                self.launcher.launch(plan.plans, None)
            held = self.scheduler.held_blocks(request_id)
            if held:
                self.launcher.hold(request_id, held)
        self.check("finish")

    async def drain(self) -> None:
        """Wait for every transfer in flight. Cancellation cancels only the wait."""
        self.check("drain")
        await self.poller.drain()

    async def reset(self) -> bool:
        """Empty every group's pool and abandon the transfers in flight (see
        `KVOffloader.reset()`); whether nothing is cached or in flight on return."""
        self.check("reset")
        self.scheduler.reset()
        self.hints.clear()  # the reset released every retained block
        self.launcher.unpin_released_holds()
        if self.group_tiers is not None:
            self.group_tiers.reset()
        self.launcher.abandon_all()
        await self.poller.drain()
        stats = self.scheduler.statistics().values()
        return not self.scheduler.num_in_flight and not any(s.cached_cpu_blocks for s in stats)

    # -- retention and session hints (as `Session`'s, in every group) -------------------------

    def hash_prompt(self, token_ids: Sequence[int]) -> dict[str, list[BlockHash]]:
        """Per cacheable group, the hashes of the prompt's full blocks in its namespace.

        Raises:
            InputTypeError: a token is not a 64-bit int.
        """
        spaces = self.namespaces
        return {name: hash_prompt(token_ids, bs, spaces[name]) for name, bs, _ in self.lanes}

    def retain(self, block_hashes: Mapping[str, Sequence[BlockHash]], owner: Hashable) -> int:
        """`KVOffloader.retain_prefix()` of a hashed prompt: how many blocks are retained,
        all groups together (`GroupedScheduler.retain()`)."""
        self.check("retain_prefix")
        return self.scheduler.retain(block_hashes, owner)[0]

    def release_retained(self, owner: Hashable) -> int:
        """`KVOffloader.release_retained()`, in every group."""
        self.check("release_retained")
        return self.scheduler.release_retained(owner)

    def retain_for(
        self,
        block_hashes: Mapping[str, Sequence[BlockHash]],
        retain_for_s: float,
        session: Hashable,
    ) -> int:
        """`SessionHints.retain_for()` of a hashed prompt: blocks retained now."""
        self.check("retain_for")
        prefix = {name: tuple(hashes) for name, hashes in block_hashes.items()}
        return self.hints.hint(session, prefix, retain_for_s)

    def release_hint(self, session: Hashable) -> int:
        """`SessionHints.release()`."""
        self.check("release_hint")
        return self.hints.release(session)

    async def prefetch(
        self, block_hashes: Mapping[str, Sequence[BlockHash]], num_tokens: int
    ) -> int:
        """`SessionHints.prefetch()` of a hashed prompt of ``num_tokens`` tokens, in every
        group (`GroupTiers.prefetch()`): the tokens a lookup finds on CPU on return
        (without tiers, at once: what the CPU pools hold)."""
        self.check("prefetch")
        lanes = {name: block_hashes[name] for name, _, _ in self.lanes}
        tiers = self.group_tiers
        if tiers is None:
            pools = {name: self.scheduler.ledger(name).pool for name in lanes}
            groups = [g for g in self.groups if g.cacheable]
            return find_hit(groups, pools, lanes, num_tokens, computed=0, align=self.alignment)
        return await tiers.prefetch(lanes, num_tokens)

    def _hint_retain(
        self, block_hashes: Mapping[str, Sequence[BlockHash]], owner: Hashable, fit: bool
    ) -> tuple[int, bool]:
        return self.scheduler.retain(block_hashes, owner, fit=fit)

    # -- observation -------------------------------------------------------------------------

    def counters_now(self) -> SchedulerStatistics:
        """The whole model's counters (see `GroupCounters.statistics()`)."""
        return self.counters.statistics(
            self.scheduler,
            # as one group counts them: every request the scheduler keeps state for
            # (finished ones whose copies run or whose blocks are held too), and live
            # handles that have not looked up yet
            live_requests=len(self._live.union(self.scheduler.request_ids)),
            in_flight_transfers=self.launcher.num_in_flight,
        )

    def statistics(
        self,
    ) -> tuple[
        PoolStatistics,
        SchedulerStatistics,
        PollerStatistics,
        TierManagerStatistics | None,
        dict[str, GroupStatistics],
    ]:
        """The parts' statistics, for `OffloaderStatistics` (the tiers: every group's,
        see `GroupTiers.statistics()`; per group last)."""
        tiers = self.group_tiers
        return (
            pool_statistics(self.scheduler),
            self.counters_now(),
            self.poller.statistics(),
            tiers.statistics() if tiers is not None else None,
            self.scheduler.statistics(),
        )

    def check_invariants(self) -> None:
        """Check the scheduler's invariants, then every group's tier manager's."""
        self.scheduler.check_invariants()
        if self.group_tiers is not None:
            self.group_tiers.check_invariants()

    def take_events(self) -> list[PoolEvent]:
        """Every group's pool events since the last call, group by group, each carrying
        its group's name (block ids are per group: ``(group, block_id)`` is unique)."""
        return [
            replace(e, group=n)
            for n in self._layouts
            for e in self.scheduler.ledger(n).pool.take_events()
        ]
