"""`GroupsFront`: the front of a `Session` for a model with several KV cache groups.

It turns the session's calls into a `GroupedScheduler`'s (built by
`build_grouped_scheduler()`): tables and hashes one per group name, a hit valid for
every group, a finish that stores the request's last point, the whole model's counters
(`GroupCounters`), and tiers per group (`GroupTiers`). The session owns everything
else (see `kvoffload._front`). Transfers run through the same `TransferLauncher` as one
group's: a step that touches one group is submitted as itself; several groups' parts
run as one `TransferTask` that completes once every part did.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any, final

import anyio.abc

from kvoffload.build import POOL_BOOKKEEPING_BYTES_PER_BLOCK, build_grouped_scheduler
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import HostMemoryError, InvalidInputError
from kvoffload.groups import KVCacheGroup, hit_alignment
from kvoffload.hashing import BlockHash, HashNamespace, hash_prompt
from kvoffload.launcher import TransferLauncher
from kvoffload.pinner import GpuBlockPinner
from kvoffload.pool.block_pool import PoolEvent, PoolStatistics
from kvoffload.pool.hints import RetentionHints
from kvoffload.request_groups import GroupLanes, check_group_mapping
from kvoffload.scheduler import GpuCacheView, OffloadScheduler, SchedulerStatistics
from kvoffload.scheduler.group_loads import find_hit
from kvoffload.scheduler.group_totals import GroupCounters, pool_statistics
from kvoffload.scheduler.groups import GroupStatistics
from kvoffload.scheduler.misses import MissReason
from kvoffload.storage.host_buffer import HostKVBuffer, available_host_memory
from kvoffload.tiers.groups import GroupTiers
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.task import TransferTask

__all__ = ["GroupsFront"]


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
class GroupsFront:
    """The front of several KV cache groups (or one that is not ``full``).

    Args:
        config: the settings (``cpu_bytes`` is split across the groups by need).
        groups: the model's groups, in order (checked by `check_groups()`).
        layouts: per cacheable group, its page layout.
        num_gpu_blocks: per cacheable group, its GPU blocks.
        host_buffer: whether the session makes host buffers (no copy engines given).

    Raises:
        ConfigError: a pool that does not fit (see `build_grouped_scheduler()`).
        HostMemoryError: the host buffers exceed the memory left.
    """

    __slots__ = (
        "_config",
        "_live",
        "_name_set",
        "_names",
        "alignment",
        "counters",
        "groups",
        "hash_block_size",
        "lanes",
        "launcher",
        "namespaces",
        "scheduler",
        "tiers",
        "update",
    )

    builds_inline = True
    """The pools are built at once."""

    def __init__(
        self,
        config: OffloadConfig,
        groups: Sequence[KVCacheGroup],
        layouts: Mapping[str, KVLayout],
        num_gpu_blocks: Mapping[str, int],
        *,
        host_buffer: bool,
    ) -> None:
        self._config = config
        self.groups = tuple(groups)
        self.scheduler = build_grouped_scheduler(config, self.groups, num_gpu_blocks=num_gpu_blocks)
        self.alignment = hit_alignment(self.groups)
        """Hits are multiples of this many tokens (the LCM of the block sizes)."""
        self._names = tuple(g.name for g in self.groups)
        self._name_set = frozenset(self._names)
        _check_host_memory(self.pool_blocks(), layouts, host_buffer=host_buffer)
        cacheable = [g for g in self.groups if g.cacheable]
        self.namespaces: dict[str, HashNamespace] = {
            g.name: g.namespace(model_id=config.model_id, salt=config.hash_salt) for g in cacheable
        }
        """Per cacheable group, its hash namespace."""
        self.lanes = [(g.name, g.block_size, self.namespaces[g.name].root) for g in cacheable]
        """Per cacheable group, what a handle hashes with: name, block size, root."""
        self.hash_block_size = cacheable[0].block_size
        self.counters = GroupCounters()
        """The whole model's counters (per group: `GroupedScheduler.statistics()`)."""
        self._live: set[str] = set()
        self.tiers: GroupTiers | None = None
        self.launcher: TransferLauncher
        self.update: Callable[[str, Any, Any, int], None] = self._update

    def build(
        self,
        engines: Mapping[str, CopyEngine],
        pinners: Mapping[str, GpuBlockPinner],
        poll_interval_s: float,
    ) -> TransferLauncher:
        """The launcher over the scheduler (built already)."""
        self.launcher = TransferLauncher(
            self.scheduler, engines, pinners, poll_interval_s=poll_interval_s
        )
        self.launcher.on_ended = self.counters.ended
        return self.launcher

    def pool_blocks(self) -> dict[str, int]:
        """Per cacheable group, its pool's blocks."""
        return {n: p.num_cpu_blocks for n, p in self.scheduler.statistics().items()}

    async def start_tiers(
        self, task_group: anyio.abc.TaskGroup, hosts: Mapping[str, HostKVBuffer]
    ) -> None:
        """`GroupTiers` over the groups' host buffers (`tiers`), started in ``task_group``."""
        tiers = GroupTiers(self._config, self.scheduler, hosts, self.namespaces)
        self.launcher.on_stored = tiers.on_stored
        self.tiers = tiers  # before starting: a start that fails is closed with the rest
        await tiers.start(task_group)

    def make_hints(self) -> RetentionHints[Mapping[str, Sequence[BlockHash]]]:
        """Hints retained in every group."""
        scheduler = self.scheduler

        def retain(
            hashes: Mapping[str, Sequence[BlockHash]], owner: Hashable, fit: bool
        ) -> tuple[int, bool]:
            return scheduler.retain(hashes, owner, fit=fit)

        return RetentionHints(retain, scheduler.release_retained)

    def one_group(self, what: str) -> OffloadScheduler:
        """Refused: this is several groups' offloader."""
        raise InvalidInputError(
            f"KVOffloader.{what} is one group's; this offloader has the KV cache groups "
            f"{list(self._names)}: see statistics().groups"
        )

    # -- the step calls (per-group tables and hashes) ----------------------------------------

    def handle_shape(self, request_id: str) -> tuple[int, GroupLanes]:
        """The hit alignment and the request's per-group lanes."""
        return self.alignment, GroupLanes(self.lanes, self._names, request_id)

    def reserve(self, request_id: str) -> None:
        """Hold ``request_id`` for a new handle until it finishes (refused in use or
        finished: `GroupRequests.reserve()`, one group's rule)."""
        self.scheduler.request_table.reserve(request_id, in_use=request_id in self._live)
        self._live.add(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` has a live handle or copies in flight."""
        return request_id in self._live or self.scheduler.has_request(request_id)

    def _check_names(self, rid: str, what: str, value: object) -> Mapping[str, Any]:
        return check_group_mapping(value, what, self._names, rid)

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_tokens: int,
        num_computed_tokens: int,
        *,
        allow_defer: bool,
        no_read: bool,
    ) -> int | None:
        """The hit valid for every group, pinned (see `GroupedScheduler.lookup()`)."""
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
        """See `GroupedScheduler.lookup_outcome()`."""
        reason, _, tier_hits = self.scheduler.lookup_outcome(request_id)
        return reason, {} if tier_hits is None else dict(tier_hits)

    def load(
        self,
        request_id: str,
        tables: Sequence[int] | Mapping[str, Sequence[int | None]],
        num_tokens: int,
    ) -> TransferTask | None:
        """Load the last lookup's hit into every group's table (`GroupedScheduler.plan_load()`)."""
        tables = self._check_names(request_id, "load()'s block tables", tables)
        plan = self.scheduler.plan_load(request_id, tables, num_tokens)
        if plan is None:
            return None
        self.counters.load_plans += 1
        return self.launcher.launch(plan.plans, None, tokens=num_tokens)

    def abandon_load(self, request_id: str) -> dict[str, tuple[int, ...]]:
        """Every group's part of the request's loads in flight at once; per group, the GPU
        blocks its copies still write (none for a live handle that has not looked up yet)."""
        if self._unseen(request_id):
            return {}
        return self.launcher.abandon_loads(self.scheduler.abandon_load(request_id))

    def _update(
        self,
        request_id: str,
        tables: Sequence[int] | Mapping[str, Sequence[int | None]],
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_computed_tokens: int,
    ) -> None:
        """See `GroupedScheduler.update()` (the step's hot path: two dicts naming only
        the model's groups, as a handle gives them, are taken without a call)."""
        names = self._name_set  # what `check_group_mapping()` accepts first, inline
        if not (
            type(tables) is dict
            and type(block_hashes) is dict
            and tables.keys() <= names
            and block_hashes.keys() <= names
        ):
            tables = self._check_names(request_id, "update()'s block tables", tables)
            block_hashes = self._check_names(request_id, "update()'s block_hashes", block_hashes)
        self.scheduler.update(request_id, tables, block_hashes, num_computed_tokens)

    def store(
        self, after: object | None, gpu_cache: Mapping[str, GpuCacheView] | GpuCacheView | None
    ) -> list[TransferTask]:
        """This step's stores as one grouped transfer, or none; with ``store_mode="lazy"``,
        from one view per group name (see `GroupedScheduler.plan_stores()`)."""
        plan = self.scheduler.plan_stores(gpu_cache)
        if plan is None:
            return []
        self.counters.store_plans += 1
        return [self.launcher.launch(plan.plans, after)]

    def finish(self, request_id: str) -> None:
        """Store the request's last point now and give up its id; with
        ``hold_blocks_on_finish``, pin the blocks it holds instead (a handle that made no
        call gives up its id for good; an id neither live nor known raises what
        `GroupedScheduler.finish()` raises)."""
        scheduler = self.scheduler
        if request_id in self._live:
            self._live.discard(request_id)
            if not scheduler.has_request(request_id):
                scheduler.request_table.retire(request_id)
                return
        plan = scheduler.finish(request_id)
        if plan is not None:
            self.launcher.launch(plan.plans, None)
        held = scheduler.held_blocks(request_id)
        if held:
            self.launcher.hold(request_id, held)

    def preempt(self, request_id: str) -> None:
        """Store nothing from the request's GPU blocks, reset its tables and cursors
        (nothing for a live handle that made no call yet; otherwise what
        `GroupedScheduler.preempt()` raises)."""
        if not self._unseen(request_id):
            self.scheduler.preempt(request_id)

    def release(self, request_id: str) -> None:
        """`GroupedScheduler.release()` (nothing for a live handle that made no call yet)."""
        if not self._unseen(request_id):
            self.scheduler.release(request_id)

    def _unseen(self, request_id: str) -> bool:
        """Whether ``request_id`` has a live handle that made no scheduler call yet."""
        return request_id in self._live and not self.scheduler.has_request(request_id)

    # -- retention and session hints, in every group ----------------------------------------

    def hash_prompt(self, token_ids: Sequence[int]) -> dict[str, list[BlockHash]]:
        """Per cacheable group, the hashes of the prompt's full blocks in its namespace.

        Raises:
            InputTypeError: a token is not a 64-bit int.
        """
        spaces = self.namespaces
        return {name: hash_prompt(token_ids, bs, spaces[name]) for name, bs, _ in self.lanes}

    def retain(self, block_hashes: Mapping[str, Sequence[BlockHash]], owner: Hashable) -> int:
        """How many blocks are retained, all groups together (`GroupedScheduler.retain()`)."""
        return self.scheduler.retain(block_hashes, owner)[0]

    def release_retained(self, owner: Hashable) -> int:
        """`GroupedScheduler.release_retained()`."""
        return self.scheduler.release_retained(owner)

    def hint_prefix(
        self, block_hashes: Mapping[str, Sequence[BlockHash]]
    ) -> dict[str, tuple[BlockHash, ...]]:
        """Per group, its hashes frozen."""
        return {name: tuple(hashes) for name, hashes in block_hashes.items()}

    async def prefetch(
        self, block_hashes: Mapping[str, Sequence[BlockHash]], num_tokens: int
    ) -> int:
        """The tokens a lookup finds on CPU on return (`GroupTiers.prefetch()`; without
        tiers, at once: what the CPU pools hold)."""
        lanes = {name: block_hashes[name] for name, _, _ in self.lanes}
        tiers = self.tiers
        if tiers is None:
            pools = {name: self.scheduler.ledger(name).pool for name in lanes}
            groups = [g for g in self.groups if g.cacheable]
            return find_hit(groups, pools, lanes, num_tokens, computed=0, align=self.alignment)
        return await tiers.prefetch(lanes, num_tokens)

    def release_all_retained(self) -> None:
        """Every group's ledger's `release_all_retained()`."""
        for name, _, _ in self.lanes:
            self.scheduler.ledger(name).release_all_retained()

    def is_empty(self) -> bool:
        """Nothing cached in any group, nothing in flight."""
        stats = self.scheduler.statistics().values()
        return not self.scheduler.num_in_flight and not any(s.cached_cpu_blocks for s in stats)

    # -- observation -------------------------------------------------------------------------

    def take_events(self) -> list[PoolEvent]:
        """Every group's pool events since the last call, group by group, each carrying
        its group's name (block ids are per group: ``(group, block_id)`` is unique)."""
        ledger = self.scheduler.ledger
        return [replace(e, group=n) for n, _, _ in self.lanes for e in ledger(n).pool.take_events()]

    def statistics(
        self,
    ) -> tuple[PoolStatistics, SchedulerStatistics, dict[str, GroupStatistics]]:
        """The pools added up, the whole model's counters (`GroupCounters.statistics()`),
        and each group's statistics."""
        counters = self.counters.statistics(
            self.scheduler,
            # as one group counts them: every request the scheduler keeps state for
            # (finished ones whose copies run or whose blocks are held too), and live
            # handles that have not looked up yet
            live_requests=len(self._live.union(self.scheduler.request_ids)),
            in_flight_transfers=self.launcher.num_in_flight,
        )
        return pool_statistics(self.scheduler), counters, self.scheduler.statistics()
