"""What a `Session` asks of its scheduler, in the shape of the model's KV cache groups.

A `Session` owns, for any number of groups, the lifecycle, the host buffers, copy
engines and pinners (keyed by group name), the launcher's poller, the tiers' lifecycle,
the hints, events and statistics. What truly differs with the shape sits in one *front*
with the same methods either way: the scheduler's call signatures (one group's flat lists
for an `OffloadScheduler`, a mapping per group name for a `GroupedScheduler`), how a plan
is launched, how a prompt is hashed, how the tiers are built and wired, how the pools are
counted. Both run the one scheduler (`OffloadScheduler` is one lane of a
`GroupedScheduler`). `OneGroupFront` (here) serves one full-attention group with one
group's API; `GroupsFront` (`kvoffload._group_front`) serves several. The session
checks every call first (open, owner, poller, pinner error); a front only turns it into
the scheduler's calls and the launcher's launches.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, final

import anyio.abc

from kvoffload.build import CorePlan, build_tiers
from kvoffload.config import KVLayout
from kvoffload.errors import InputTypeError, InvalidInputError
from kvoffload.hashing import BlockHash, HashNamespace, hash_prompt
from kvoffload.launcher import OneGroup, TransferLauncher
from kvoffload.pinner import GpuBlockPinner
from kvoffload.pool.block import CpuBlock
from kvoffload.pool.block_pool import CpuBlockPool, PoolEvent, PoolStatistics
from kvoffload.pool.hints import RetentionHints, leading_runs
from kvoffload.scheduler import GpuCacheView, OffloadScheduler, SchedulerStatistics
from kvoffload.scheduler.misses import MissReason
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.tiers.manager import TierManager
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.task import TransferTask

if TYPE_CHECKING:
    from kvoffload.request_groups import GroupLanes

__all__ = ["GROUP", "OneGroupFront"]

GROUP = "g0"
"""The name of the one group, for the launcher (`KVCacheGroup.from_layout()`'s default)."""


@final
class OneGroupFront:
    """The front of one full-attention group: an `OffloadScheduler` over one pool.

    Args:
        plan: the core, sized and checked (built by `build`).
        layout: the KV layout.
        namespace: the hash namespace (the tiers' too).
    """

    __slots__ = (
        "_layout",
        "_name",
        "_namespace",
        "_plan",
        "launcher",
        "pool",
        "scheduler",
        "tiers",
        "update",
    )

    groups = None
    """One group: no `KVCacheGroup`s to name."""

    def __init__(
        self, plan: CorePlan, layout: KVLayout, namespace: HashNamespace, name: str | None = None
    ) -> None:
        self._plan = plan
        self._name = name
        """The group's name when the offloader was given one (``groups=[...]``): its
        events carry it, as each group's do with several."""
        self._layout = layout
        self._namespace = namespace
        self.tiers: TierManager | None = None
        self.pool: CpuBlockPool
        self.scheduler: OffloadScheduler
        self.launcher: TransferLauncher
        self.update: Callable[[str, Any, Any, int], None]

    @property
    def builds_inline(self) -> bool:
        """Whether the pool is small enough to build at once."""
        return self._plan.builds_inline

    @property
    def hash_block_size(self) -> int:
        """The block size."""
        return self._plan.config.block_size

    def build(
        self,
        engines: Mapping[str, CopyEngine],
        pinners: Mapping[str, GpuBlockPinner],
        poll_interval_s: float,
    ) -> TransferLauncher:
        """Build the pool, the scheduler and the launcher."""
        core = self._plan.build()
        self.pool, self.scheduler = core.pool, core.scheduler
        self.update = core.scheduler.update  # the hot path: no layer in between
        self.launcher = TransferLauncher(
            OneGroup(core.scheduler, GROUP), engines, pinners, poll_interval_s=poll_interval_s
        )
        return self.launcher

    def pool_blocks(self) -> dict[str, int]:
        """The one pool's blocks."""
        return {GROUP: self._plan.num_cpu_blocks}

    async def start_tiers(
        self, task_group: anyio.abc.TaskGroup, hosts: Mapping[str, HostKVBuffer]
    ) -> None:
        """The `TierManager` over the host buffer (`tiers`), started in ``task_group``."""
        tiers = build_tiers(
            self._plan.config, self._layout, self.scheduler, hosts.get(GROUP), self._namespace
        )
        on_stored = tiers.on_stored
        self.launcher.on_stored = lambda _group, plan: on_stored(plan)
        self.tiers = tiers  # before starting: a start that fails is closed with the rest
        await task_group.start(tiers.run)

    def make_hints(self) -> RetentionHints[Sequence[BlockHash]]:
        """Hints retained through the scheduler's ledger, leading runs only (made before
        a large pool is built: the ledger is found when a hint is given)."""

        def retain(hashes: Sequence[BlockHash], owner: Hashable, fit: bool) -> list[CpuBlock]:
            return self.scheduler.ledger.retain(hashes, owner, fit=fit)

        def release(owner: Hashable) -> int:
            return self.scheduler.ledger.release_retained(owner)

        return RetentionHints(leading_runs(retain), release)

    def one_group(self, what: str) -> OffloadScheduler:
        """The scheduler."""
        return self.scheduler

    def handle_shape(self, request_id: str) -> tuple[int, GroupLanes | None]:
        """The block size, no lanes."""
        return self._plan.config.block_size, None

    def reserve(self, request_id: str) -> None:
        """`OffloadScheduler.reserve()`."""
        self.scheduler.reserve(request_id)

    def has_request(self, request_id: str) -> bool:
        """`OffloadScheduler.has_request()`."""
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
        """`OffloadScheduler.lookup()` of one hash list."""
        if isinstance(block_hashes, Mapping):
            raise _mapping(request_id, block_hashes)
        return self.scheduler.lookup(
            request_id,
            block_hashes,
            num_tokens,
            num_computed_tokens,
            allow_defer=allow_defer,
            no_read=no_read,
        )

    def lookup_outcome(self, request_id: str) -> tuple[MissReason, dict[str, int]]:
        """The request state's miss reason and tier hits (in tokens)."""
        state = self.scheduler.request_state(request_id)
        tier_hits = state.tier_hits
        if tier_hits is None:
            return state.miss_reason, {}
        bs = self._plan.config.block_size
        return state.miss_reason, {name: n * bs for name, n in tier_hits.items()}

    def load(
        self,
        request_id: str,
        tables: Sequence[int] | Mapping[str, Sequence[int | None]],
        num_tokens: int,
    ) -> TransferTask | None:
        """Plan the load of one table, then launch it."""
        if isinstance(tables, Mapping):
            raise _mapping(request_id, tables)
        plan = self.scheduler.plan_load(request_id, tables, num_tokens)
        if plan is None:
            return None
        return self.launcher.launch_one(GROUP, plan, None)

    def abandon_load(self, request_id: str) -> tuple[int, ...]:
        """The GPU blocks the abandoned copies still write."""
        plans = self.scheduler.abandon_load(request_id)
        return self.launcher.abandon_loads({GROUP: plans})[GROUP]

    def store(
        self, after: object | None, gpu_cache: GpuCacheView | Mapping[str, GpuCacheView] | None
    ) -> list[TransferTask]:
        """Plan this step's stores and launch them as one transfer."""
        if isinstance(gpu_cache, Mapping):
            raise InputTypeError(
                f"gpu_cache={type(gpu_cache).__name__}: this offloader has one KV cache "
                "group; give its GpuCacheView, not a mapping of group names"
            )
        plan = self.scheduler.plan_stores(gpu_cache)
        if plan is None:
            return []
        return [self.launcher.launch_one(GROUP, plan, after)]

    def finish(self, request_id: str) -> None:
        """Finish the request; pin the blocks it holds."""
        held = self.scheduler.finish(request_id)
        if held:
            self.launcher.hold(request_id, {GROUP: held})

    def preempt(self, request_id: str) -> None:
        """`OffloadScheduler.preempt()`."""
        self.scheduler.preempt(request_id)

    def release(self, request_id: str) -> None:
        """`OffloadScheduler.release()`."""
        self.scheduler.release(request_id)

    def hash_prompt(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The prompt's full blocks' hashes."""
        return hash_prompt(token_ids, self._plan.config.block_size, self._namespace)

    def retain(self, block_hashes: Sequence[BlockHash], owner: Hashable) -> int:
        """`BlockLedger.retain()`: how many blocks."""
        return len(self.scheduler.ledger.retain(block_hashes, owner))

    def release_retained(self, owner: Hashable) -> int:
        """`BlockLedger.release_retained()`."""
        return self.scheduler.ledger.release_retained(owner)

    def hint_prefix(self, block_hashes: Sequence[BlockHash]) -> tuple[BlockHash, ...]:
        """The hashes, frozen."""
        return tuple(block_hashes)

    async def prefetch(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """Leading blocks on CPU on return (its full blocks are the prefix, whatever
        ``num_tokens``)."""
        del num_tokens
        tiers = self.tiers
        if tiers is None:
            is_cached = self.pool.is_cached
            return next(
                (i for i, h in enumerate(block_hashes) if not is_cached(h)), len(block_hashes)
            )
        return await tiers.prefetch(block_hashes)

    def release_all_retained(self) -> None:
        """`BlockLedger.release_all_retained()`."""
        self.scheduler.ledger.release_all_retained()

    def is_empty(self) -> bool:
        """Nothing cached, nothing in flight."""
        return self.pool.num_cached == 0 and self.scheduler.num_in_flight == 0

    def take_events(self) -> list[PoolEvent]:
        """The pool's events, each naming the group when it has a name."""
        events = self.pool.take_events()
        if self._name is None:
            return events
        return [replace(e, group=self._name) for e in events]

    def statistics(self) -> tuple[PoolStatistics, SchedulerStatistics, None]:
        """The pool's and the scheduler's statistics."""
        return self.pool.statistics(), self.scheduler.statistics(), None


def _mapping(request_id: str, value: Mapping[str, object]) -> InvalidInputError:
    """One group takes one table and one hash list, never a mapping of group names."""
    return InvalidInputError(
        f"request {request_id!r}: this offloader has one KV cache group: give one list, "
        f"not a mapping of group names ({sorted(value)})"
    )
