"""What a `Session` asks of its scheduler, for any number of KV cache groups: `Front`.

A `Session` owns, for any number of groups, the lifecycle, the host buffers, copy
engines and pinners (keyed by group name), the launcher's poller, the tiers' lifecycle,
the hints, events and statistics. The front turns the session's calls into the calls of
the one scheduler, a `GroupedScheduler` (one group runs as its one lane, ``"g0"``), and
the launcher's launches: every rule (a handle's id, a finish and its hold, a lookup and
its counting, an abandoned load, the events) is written here once.

What the shape changes is only how a call is *spelled*. A model of one full-attention
group keeps one group's API: one table and one hash list per call, through its
`OffloadScheduler` (the lane's face, which names one group's inputs in one group's
words), a pool built in a worker thread when it is large, a `TierManager`, counters that
are its lane's. Several groups (or one that is not ``full``) take one table and one hash
list per group name, count the whole model once per transfer (`GroupCounters`) and run
`GroupTiers`. The session checks every call first (open, owner, poller, pinner error).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any, final

import anyio.abc

from kvoffload.build import (
    POOL_BOOKKEEPING_BYTES_PER_BLOCK,
    CorePlan,
    build_grouped_scheduler,
    build_tiers,
)
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import HostMemoryError, InvalidInputError
from kvoffload.groups import KVCacheGroup, hit_alignment
from kvoffload.hashing import BlockHash, HashNamespace, hash_prompt
from kvoffload.launcher import TransferLauncher
from kvoffload.pinner import GpuBlockPinner
from kvoffload.pool.block import CpuBlock
from kvoffload.pool.block_pool import PoolEvent, PoolStatistics
from kvoffload.pool.hints import RetentionHints, leading_runs
from kvoffload.request_groups import GroupLanes, check_group_mapping
from kvoffload.scheduler import GpuCacheView, OffloadScheduler, SchedulerStatistics
from kvoffload.scheduler.core import LANE
from kvoffload.scheduler.group_loads import find_hit
from kvoffload.scheduler.group_totals import pool_statistics
from kvoffload.scheduler.groups import GroupedScheduler, GroupStatistics
from kvoffload.scheduler.misses import MissReason
from kvoffload.storage.host_buffer import HostKVBuffer, available_host_memory
from kvoffload.tiers.groups import GroupTiers
from kvoffload.tiers.manager import TierManager
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.task import TransferTask

__all__ = ["GROUP", "Front"]

GROUP = LANE
"""The name of one group's lane (`KVCacheGroup.from_layout()`'s default)."""


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
class Front:
    """The scheduler and launcher of a `Session`, for one KV cache group or several.

    Made by `for_one_group()` (one full-attention group, one group's API) or
    `for_groups()`.
    """

    __slots__ = (
        "_config",
        "_event_names",
        "_face",
        "_layout",
        "_name_set",
        "_names",
        "_plan",
        "alignment",
        "groups",
        "hash_block_size",
        "lanes",
        "launcher",
        "namespaces",
        "scheduler",
        "tiers",
        "update",
    )

    def __init__(
        self,
        config: OffloadConfig,
        groups: tuple[KVCacheGroup, ...] | None,
        namespaces: dict[str, HashNamespace],
        *,
        plan: CorePlan | None = None,
        layout: KVLayout | None = None,
        event_names: dict[str, str] | None = None,
    ) -> None:
        self._config = config
        self.groups = groups
        """The model's groups; ``None`` for one group's API (no `KVCacheGroup` to name)."""
        self._plan = plan
        self._layout = layout
        self._face: OffloadScheduler | None = None
        """One group's `OffloadScheduler` (built with the pool), ``None`` with several."""
        self.namespaces = namespaces
        """Per cacheable group, its hash namespace (the tiers' too)."""
        self._names = tuple(namespaces)
        self._name_set = frozenset(self._names)
        self._event_names = event_names
        """Per lane, the group name its events carry (``None``: one unnamed group's)."""
        self.lanes: list[tuple[str, int, BlockHash]] = []
        """Per cacheable group, what a handle hashes with: name, block size, root (none
        for one group's API: the handle hashes one list)."""
        self.alignment = config.block_size
        """Hits are multiples of this many tokens (the LCM of the block sizes)."""
        self.hash_block_size = config.block_size
        self.tiers: TierManager | GroupTiers | None = None
        self.scheduler: GroupedScheduler
        self.launcher: TransferLauncher
        self.update: Callable[[str, Any, Any, int], None] = self._update

    @classmethod
    def for_one_group(
        cls, plan: CorePlan, layout: KVLayout, namespace: HashNamespace, name: str | None
    ) -> Front:
        """The front of one full-attention group: one group's API over its lane; the pool
        is built by `build()` (in a worker thread when it is large).

        Args:
            plan: the core, sized and checked (built by `build`).
            layout: the KV layout.
            namespace: the hash namespace (the tiers' too).
            name: the group's name when the offloader was given one (``groups=[...]``):
                its events carry it, as each group's do with several.
        """
        names = None if name is None else {GROUP: name}
        return cls(
            plan.config, None, {GROUP: namespace}, plan=plan, layout=layout, event_names=names
        )

    @classmethod
    def for_groups(
        cls,
        config: OffloadConfig,
        groups: Sequence[KVCacheGroup],
        layouts: Mapping[str, KVLayout],
        num_gpu_blocks: Mapping[str, int],
        *,
        host_buffer: bool,
    ) -> Front:
        """The front of several KV cache groups (or one that is not ``full``), its
        scheduler built at once.

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
        groups = tuple(groups)
        cacheable = [g for g in groups if g.cacheable]
        spaces = {
            g.name: g.namespace(model_id=config.model_id, salt=config.hash_salt) for g in cacheable
        }
        front = cls(config, groups, spaces, event_names={n: n for n in spaces})
        front.scheduler = build_grouped_scheduler(config, groups, num_gpu_blocks=num_gpu_blocks)
        _check_host_memory(front.pool_blocks(), layouts, host_buffer=host_buffer)
        front.alignment = hit_alignment(groups)
        front.lanes = [(g.name, g.block_size, spaces[g.name].root) for g in cacheable]
        front.hash_block_size = cacheable[0].block_size
        return front

    @property
    def builds_inline(self) -> bool:
        """Whether the pools are small enough to build at once (several groups' are
        built already)."""
        return self._plan is None or self._plan.builds_inline

    def build(
        self,
        engines: Mapping[str, CopyEngine],
        pinners: Mapping[str, GpuBlockPinner],
        poll_interval_s: float,
    ) -> TransferLauncher:
        """Build one group's pool and scheduler (several groups' exist), then the launcher."""
        if self._plan is not None:
            face = self._face = self._plan.build().scheduler
            self.scheduler = face.grouped
            self.update = face.update  # the hot path: no layer in between
        launcher = self.launcher = TransferLauncher(
            self.scheduler, engines, pinners, poll_interval_s=poll_interval_s
        )
        if self._face is None:  # one group's lane counts its transfers itself
            launcher.on_ended = self.scheduler.totals.ended
        return launcher

    def pool_blocks(self) -> dict[str, int]:
        """Per cacheable group, its pool's blocks."""
        if self._plan is not None:
            return {GROUP: self._plan.num_cpu_blocks}
        return {n: p.num_cpu_blocks for n, p in self.scheduler.statistics().items()}

    async def start_tiers(
        self, task_group: anyio.abc.TaskGroup, hosts: Mapping[str, HostKVBuffer]
    ) -> None:
        """The tiers (`tiers`) over the host buffers, started in ``task_group``: one
        group's `TierManager`, several groups' `GroupTiers`."""
        face = self._face
        if face is None:
            tiers = GroupTiers(self._config, self.scheduler, hosts, self.namespaces)
            self.launcher.on_stored = tiers.on_stored
            self.tiers = tiers  # before starting: a start that fails is closed with the rest
            await tiers.start(task_group)
            return
        assert self._layout is not None
        manager = build_tiers(
            self._config, self._layout, face, hosts.get(GROUP), self.namespaces[GROUP]
        )
        on_stored = manager.on_stored
        self.launcher.on_stored = lambda _group, plan: on_stored(plan)
        self.tiers = manager
        await task_group.start(manager.run)

    def make_hints(self) -> RetentionHints[Any]:
        """Hints retained through the scheduler (made before a large pool is built: the
        scheduler is found when a hint is given); one group's are its leading runs."""
        if self._plan is None:
            scheduler = self.scheduler

            def retain_all(
                hashes: Mapping[str, Sequence[BlockHash]], owner: Hashable, fit: bool
            ) -> tuple[int, bool]:
                return scheduler.retain(hashes, owner, fit=fit)

            return RetentionHints(retain_all, scheduler.release_retained)

        def retain(hashes: Sequence[BlockHash], owner: Hashable, fit: bool) -> list[CpuBlock]:
            return self.scheduler.ledger(GROUP).retain(hashes, owner, fit=fit)

        def release(owner: Hashable) -> int:
            return self.scheduler.ledger(GROUP).release_retained(owner)

        return RetentionHints(leading_runs(retain), release)

    def one_group(self, what: str) -> OffloadScheduler:
        """One group's `OffloadScheduler`; refused with several groups."""
        if self._face is None:
            raise InvalidInputError(
                f"KVOffloader.{what} is one group's; this offloader has the KV cache groups "
                f"{list(self._names)}: see statistics().groups"
            )
        return self._face

    # -- the step calls --------------------------------------------------------------------

    def _lanes(self, request_id: str, what: str, value: Any) -> Mapping[str, Any]:
        """A call's per-group argument, checked (`check_group_mapping()`)."""
        return check_group_mapping(value, what, self._names, request_id)

    def handle_shape(self, request_id: str) -> tuple[int, GroupLanes | None]:
        """The hit alignment and the request's per-group lanes (none for one group's API)."""
        if self._face is not None:
            return self.alignment, None
        return self.alignment, GroupLanes(self.lanes, self._names, request_id)

    def reserve(self, request_id: str) -> None:
        """Hold ``request_id`` for a new handle until it finishes (`GroupedScheduler.reserve()`)."""
        self.scheduler.reserve(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` has a live handle or copies in flight."""
        return self.scheduler.has_request(request_id)

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
        face = self._face
        if face is not None:  # one group's face refuses a mapping in one group's words
            return face.lookup(
                request_id,
                block_hashes,  # type: ignore[arg-type]
                num_tokens,
                num_computed_tokens,
                allow_defer=allow_defer,
                no_read=no_read,
            )
        return self.scheduler.lookup(
            request_id,
            self._lanes(request_id, "lookup()'s block_hashes", block_hashes),
            num_tokens,
            num_computed_tokens,
            allow_defer=allow_defer,
            no_read=no_read,
        )

    def lookup_outcome(self, request_id: str) -> tuple[MissReason, dict[str, int]]:
        """The last lookup's `MissReason` and, per tier, the tokens of its hit it promoted."""
        reason, _, tier_hits = self.scheduler.lookup_outcome(request_id)
        return reason, {} if tier_hits is None else dict(tier_hits)

    def load(
        self,
        request_id: str,
        tables: Sequence[int] | Mapping[str, Sequence[int | None]],
        num_tokens: int,
    ) -> TransferTask | None:
        """Load the last lookup's hit into the tables (`GroupedScheduler.plan_load()`)."""
        face = self._face
        if face is not None:
            one = face.plan_load(request_id, tables, num_tokens)  # type: ignore[arg-type]
            return None if one is None else self.launcher.launch_one(GROUP, one, None)
        tables = self._lanes(request_id, "load()'s block tables", tables)
        plan = self.scheduler.plan_load(request_id, tables, num_tokens)
        if plan is None:
            return None
        return self.launcher.launch(plan.plans, None, tokens=num_tokens)

    def abandon_load(self, request_id: str) -> tuple[int, ...] | dict[str, tuple[int, ...]]:
        """Every group's part of the request's loads in flight at once; per group (one
        group's API: of its group), the GPU blocks its copies still write."""
        blocks = self.launcher.abandon_loads(self.scheduler.abandon_load(request_id))
        return blocks.get(GROUP, ()) if self._face is not None else blocks

    def _update(
        self,
        request_id: str,
        tables: Sequence[int] | Mapping[str, Sequence[int | None]],
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_computed_tokens: int,
    ) -> None:
        """Several groups' `GroupedScheduler.update()` (the step's hot path: two dicts
        naming only the model's groups, as a handle gives them, are taken without a call;
        one group's is its face's ``update``, bound by `build()`)."""
        names = self._name_set  # what `check_group_mapping()` accepts first, inline
        if not (
            type(tables) is dict
            and type(block_hashes) is dict
            and tables.keys() <= names
            and block_hashes.keys() <= names
        ):
            tables = self._lanes(request_id, "update()'s block tables", tables)
            block_hashes = self._lanes(request_id, "update()'s block_hashes", block_hashes)
        self.scheduler.update(request_id, tables, block_hashes, num_computed_tokens)

    def store(
        self, after: object | None, gpu_cache: GpuCacheView | Mapping[str, GpuCacheView] | None
    ) -> list[TransferTask]:
        """This step's stores as one transfer, or none; with ``store_mode="lazy"``, from
        the engine's view (one per group name with several)."""
        face = self._face
        if face is not None:
            one = face.plan_stores(gpu_cache)  # type: ignore[arg-type]
            return [] if one is None else [self.launcher.launch_one(GROUP, one, after)]
        plan = self.scheduler.plan_stores(gpu_cache)
        return [] if plan is None else [self.launcher.launch(plan.plans, after)]

    def finish(self, request_id: str) -> None:
        """Finish the request: launch its last store (several groups store the last
        point now; one group's engine frees its blocks), pin the blocks it holds."""
        scheduler = self.scheduler
        plan = scheduler.finish(request_id)
        if plan is not None:
            self.launcher.launch(plan.plans, None)
        held = scheduler.held_blocks(request_id)
        if held:
            self.launcher.hold(request_id, held)

    def preempt(self, request_id: str) -> None:
        """`GroupedScheduler.preempt()`."""
        self.scheduler.preempt(request_id)

    def release(self, request_id: str) -> None:
        """`GroupedScheduler.release()`."""
        self.scheduler.release(request_id)

    # -- retention and session hints -------------------------------------------------------

    def hash_prompt(self, token_ids: Sequence[int]) -> list[BlockHash] | dict[str, list[BlockHash]]:
        """The hashes of the prompt's full blocks (per cacheable group with several).

        Raises:
            InputTypeError: a token is not a 64-bit int.
        """
        spaces = self.namespaces
        if self._plan is not None:
            return hash_prompt(token_ids, self.hash_block_size, spaces[GROUP])
        return {name: hash_prompt(token_ids, bs, spaces[name]) for name, bs, _ in self.lanes}

    def retain(self, block_hashes: Any, owner: Hashable) -> int:
        """How many blocks are retained (all groups together): one group's leading run
        (`BlockLedger.retain()`), several groups' `GroupedScheduler.retain()`."""
        if self._face is not None:
            return len(self.scheduler.ledger(GROUP).retain(block_hashes, owner))
        return self.scheduler.retain(block_hashes, owner)[0]

    def release_retained(self, owner: Hashable) -> int:
        """What ``owner`` retains, released (one group's message names no group)."""
        if self._face is not None:
            return self.scheduler.ledger(GROUP).release_retained(owner)
        return self.scheduler.release_retained(owner)

    def hint_prefix(self, block_hashes: Any) -> Any:
        """The hashes, frozen (per group with several)."""
        if self._face is not None:
            return tuple(block_hashes)
        return {name: tuple(hashes) for name, hashes in block_hashes.items()}

    async def prefetch(self, block_hashes: Any, num_tokens: int) -> int:
        """What a lookup finds on CPU on return: one group's leading blocks (its full
        blocks are the prefix, whatever ``num_tokens``), several groups' tokens
        (`GroupTiers.prefetch()`). Without tiers, at once: what the CPU pools hold."""
        tiers = self.tiers
        if isinstance(tiers, TierManager):
            return await tiers.prefetch(block_hashes)
        if self._face is not None:
            is_cached = self._face.pool.is_cached
            return next(
                (i for i, h in enumerate(block_hashes) if not is_cached(h)), len(block_hashes)
            )
        lanes = {name: block_hashes[name] for name, _, _ in self.lanes}
        if tiers is None:
            pools = {name: self.scheduler.ledger(name).pool for name in lanes}
            cacheable = [g for g in self.groups or () if g.cacheable]
            return find_hit(cacheable, pools, lanes, num_tokens, computed=0, align=self.alignment)
        return await tiers.prefetch(lanes, num_tokens)

    def release_all_retained(self) -> None:
        """Every group's ledger's `release_all_retained()`."""
        for name in self._names:
            self.scheduler.ledger(name).release_all_retained()

    def is_empty(self) -> bool:
        """Nothing cached in any group, nothing in flight."""
        stats = self.scheduler.statistics().values()
        return not self.scheduler.num_in_flight and not any(s.cached_cpu_blocks for s in stats)

    # -- observation -----------------------------------------------------------------------

    def take_events(self) -> list[PoolEvent]:
        """Every group's pool events since the last call, group by group, each carrying
        its group's name (block ids are per group: ``(group, block_id)`` is unique); one
        unnamed group's carry none."""
        ledger, names = self.scheduler.ledger, self._event_names
        if names is None:
            return ledger(GROUP).pool.take_events()
        return [
            replace(e, group=names[n]) for n in self._names for e in ledger(n).pool.take_events()
        ]

    def statistics(
        self,
    ) -> tuple[PoolStatistics, SchedulerStatistics, dict[str, GroupStatistics] | None]:
        """The pools added up, the whole model's counters and, with several groups, each
        group's statistics (one group's counters are its lane's: `OffloadScheduler`)."""
        face = self._face
        if face is not None:
            return face.pool.statistics(), face.statistics(), None
        scheduler = self.scheduler
        counters = scheduler.totals.statistics(
            scheduler,
            live_requests=len(scheduler.request_ids),
            in_flight_transfers=self.launcher.num_in_flight,
        )
        return pool_statistics(scheduler), counters, scheduler.statistics()
