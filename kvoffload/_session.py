"""The parts of a `KVOffloader` and their lifecycle: what ``async with`` starts and stops.

A `Session` builds the core (`CorePlan.build()`: pool and scheduler) and the
`TransferLauncher`, at once or, for a large pool, in a worker thread on entering. It owns
the offloader's lifecycle (created, open, closing, closed), who may call it (the process
that made it, the event loop's thread, the task that entered), and the parts that exist
only while it is open: the host buffer, the copy engine, the task group that runs the
completion poller and the tiers, and the tier manager. `KVOffloader` is the face: it
checks each call here and hands it to the scheduler, the launcher or the tiers.
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Hashable, Sequence
from typing import final

import anyio
import anyio.abc
import anyio.to_thread
import torch

from kvoffload._logging import get_logger
from kvoffload.build import CorePlan, build_tiers
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ClosedError, ForkedProcessError, WrongContextError
from kvoffload.hashing import BlockHash, HashNamespace
from kvoffload.launcher import OneGroup, TransferLauncher
from kvoffload.pinner import GpuBlockPinner
from kvoffload.pool.block import CpuBlock
from kvoffload.pool.block_pool import CpuBlockPool, PoolEvent, PoolStatistics
from kvoffload.pool.hints import RetentionHints, leading_runs
from kvoffload.scheduler import GpuCacheView, OffloadScheduler, SchedulerStatistics
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.tiers.manager import TierManager
from kvoffload.tiers.stats import TierManagerStatistics
from kvoffload.transfer.cuda_engine import CudaCopyEngine
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.poller import PollerStatistics
from kvoffload.transfer.task import TransferTask
from kvoffload.transfer.thread_engine import ThreadCopyEngine

__all__ = ["Lifecycle", "Session"]

_log = get_logger("offloader")

_GROUP = "g0"
"""The name of the one group, for the launcher (`KVCacheGroup.from_layout()`'s default)."""


class _State(enum.Enum):
    CREATED = "created"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"

    def to(self, target: _State) -> _State:
        allowed = {
            _State.CREATED: {_State.OPEN, _State.CLOSED},
            _State.OPEN: {_State.CLOSING},
            _State.CLOSING: {_State.CLOSED},
            _State.CLOSED: set(),
        }[self]
        if target not in allowed:
            raise ClosedError(
                f"KVOffloader cannot go from {self.value} to {target.value}"
                + (" (it can be entered once)" if target is _State.OPEN else "")
            )
        return target


class Lifecycle:
    """The lifecycle and owner checks that `Session` and `GroupSession` share: the
    state (created, open, closing, closed), the process that made it, the event loop's
    thread and the task that entered it, and the task group that runs while open."""

    __slots__ = ("_loop_thread", "_owner_task", "_pid", "_state", "_task_group")

    _state: _State
    _pid: int
    _loop_thread: int | None
    _owner_task: int | None
    _task_group: anyio.abc.TaskGroup | None

    def _init_lifecycle(self) -> None:
        self._state = _State.CREATED
        self._pid = os.getpid()
        self._loop_thread = None
        self._owner_task = None
        self._task_group = None

    def _check_open(self, what: str) -> None:
        """Refuse a step-loop call named ``what`` unless open, in this process, on the
        loop's thread."""
        self._check_process()
        if self._state is not _State.OPEN:
            raise self._closed()
        self._check_thread(what)

    def _closed(self) -> ClosedError:
        return ClosedError(f"KVOffloader is {self._state.value}; use it inside 'async with'")

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"KVOffloader was created in process {self._pid} and used in forked process "
                f"{os.getpid()}; create a new one in the child"
            )

    def _check_thread(self, what: str) -> None:
        if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
            raise WrongContextError(
                f"KVOffloader.{what}() called from thread {threading.current_thread().name!r}; "
                "the step loop runs on the event loop's thread (from a worker thread, use "
                "anyio.from_thread.run_sync)"
            )

    def begin_close(self) -> bool:
        """Whether `shutdown` must run now: ``False`` when closing or closed already, or
        never entered (then it is closed at once).

        Raises:
            ForkedProcessError: called in a forked child.
            WrongContextError: called from another thread, or from a task other than the
                one that entered; nothing changed.
        """
        if self._state in {_State.CLOSING, _State.CLOSED}:
            return False
        if self._state is _State.CREATED:
            self._state = self._state.to(_State.CLOSED)
            return False
        self._check_process()
        self._check_thread("aclose")
        if anyio.get_current_task().id != self._owner_task:
            raise WrongContextError(
                "KVOffloader.aclose() must be called from the task that entered it "
                "(a task group's exit needs its own task); close it there, e.g. by leaving "
                "'async with'"
            )
        self._state = self._state.to(_State.CLOSING)
        return True

    async def _close_task_group(self) -> None:
        """Cancel and leave the task group the session runs while open (if any)."""
        if self._task_group is not None:
            task_group, self._task_group = self._task_group, None
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)


@final
class Session(Lifecycle):
    """The parts, the lifecycle and the owner checks of one `KVOffloader`.

    Args:
        plan: the core, sized and checked (its pool is built now when small enough, else
            on `open`).
        layout: the KV layout.
        gpu_kv: the engine's per-layer KV tensors.
        namespace: the hash namespace (the tiers' too).
        pinner: the engine's pinner, for the launcher.
        engine: the caller's copy engine; ``None`` makes a host buffer and an engine on
            `open`.
    """

    __slots__ = (
        "_config",
        "_engines",
        "_gpu_kv",
        "_layout",
        "_namespace",
        "_pinner",
        "_plan",
        "built",
        "engine",
        "hints",
        "host",
        "launcher",
        "pool",
        "scheduler",
        "tiers",
    )

    def __init__(  # noqa: PLR0917 - one positional per part, named at the only call
        self,
        plan: CorePlan,
        layout: KVLayout,
        gpu_kv: Sequence[torch.Tensor],
        namespace: HashNamespace,
        pinner: GpuBlockPinner,
        engine: CopyEngine | None,
    ) -> None:
        self._plan = plan
        self._config: OffloadConfig = plan.config
        self._layout = layout
        self._gpu_kv = tuple(gpu_kv)
        self._namespace = namespace
        self._pinner = pinner
        self._init_lifecycle()
        self.engine = engine
        """The copy engine (made on `start` unless the caller gave one)."""
        self._engines: dict[str, CopyEngine] = {}
        self.host: HostKVBuffer | None = None
        """The host buffer, when this session made the copy engine."""
        self.tiers: TierManager | None = None
        """The tier manager, when ``config.tiers`` is set."""
        self.pool: CpuBlockPool
        self.scheduler: OffloadScheduler
        self.launcher: TransferLauncher
        self.built = False
        """Whether `pool`, `scheduler` and `launcher` exist."""
        self.hints: RetentionHints[Sequence[BlockHash]] = RetentionHints(
            leading_runs(self._hint_retain), self._hint_release
        )
        """The session hints (``retain_for_s``), retained through the scheduler's ledger."""
        if plan.builds_inline:
            self.build()

    def build(self) -> None:
        """Build the core and the launcher (on `open` in a worker thread for large pools)."""
        core = self._plan.build()
        self.pool, self.scheduler = core.pool, core.scheduler
        self.launcher = TransferLauncher(
            OneGroup(core.scheduler, _GROUP),
            self._engines,
            {_GROUP: self._pinner},
            poll_interval_s=self._config.poll_interval_s,
        )
        self.built = True

    def check_built(self) -> None:
        """Raises ClosedError while a large pool is not built yet."""
        if not self.built:
            raise ClosedError(
                f"KVOffloader's pool of {self._plan.num_cpu_blocks} blocks is built on entering "
                "'async with' (off the event loop); use it inside"
            )

    @property
    def num_in_flight(self) -> int:
        """Transfers launched whose completion was not processed yet (once built)."""
        return self.launcher.num_in_flight

    @property
    def state(self) -> str:
        """``created``, ``open``, ``closing`` or ``closed``."""
        return self._state.value

    # -- opening -----------------------------------------------------------------------

    async def open(self) -> None:
        """Become open, owned by this thread and the current task; build what is not
        built yet, make the host buffer and copy engine, start the poller and the tiers.

        Raises:
            ClosedError: entered before (a session opens once).
            HostMemoryError: the host buffer could not be allocated or pinned.
            ConfigError: tiers with a copy engine given by the caller, or a tier's
                settings that do not fit.

        On an error (also a cancellation) whatever was made is released again.
        """
        self._state = self._state.to(_State.OPEN)
        self._loop_thread = threading.get_ident()
        self._owner_task = anyio.get_current_task().id
        try:
            await self._start()
        except BaseException:
            await self.shutdown()
            raise

    async def _start(self) -> None:
        if not self.built:
            await anyio.to_thread.run_sync(self.build)
        config, layout, launcher = self._config, self._layout, self.launcher
        if self.engine is None:
            self.host = await HostKVBuffer.create(
                layout,
                self._plan.num_cpu_blocks,
                pin_memory=config.pin_memory,
                pin_chunk_bytes=int(config.pin_chunk_bytes),
            )
            engine_cls = CudaCopyEngine if self._gpu_kv[0].is_cuda else ThreadCopyEngine
            self.engine = engine_cls(layout, self._gpu_kv, self.host)
        self._engines[_GROUP] = self.engine
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        await self._task_group.start(launcher.poller.run)
        if config.tiers:
            self.tiers = build_tiers(config, layout, self.scheduler, self.host, self._namespace)
            on_stored = self.tiers.on_stored
            launcher.on_stored = lambda _group, plan: on_stored(plan)
            await self._task_group.start(self.tiers.run)
        _log.info(
            "offloader_opened",
            cpu_blocks=self._plan.num_cpu_blocks,
            bytes_per_block=layout.bytes_per_block,
            engine=type(self.engine).__name__,
            pinned=self.host.is_pinned if self.host is not None else None,
        )

    # -- what the offloader asks of its parts ------------------------------------------

    async def reset(self) -> bool:
        """`KVOffloader.reset()`: empty the pool (and tiers), abandon the transfers in
        flight and wait for them; whether nothing is cached or in flight on return."""
        self.check("reset")
        self.scheduler.reset()
        self.hints.clear()  # the reset released every retained block
        if self.tiers is not None:
            self.tiers.reset()
        launcher = self.launcher
        launcher.unpin_released_holds()
        launcher.abandon_all()
        await launcher.poller.drain()
        return self.pool.num_cached == 0 and self.scheduler.num_in_flight == 0

    def finish(self, request_id: str) -> None:
        """`KVOffloader.finish()`: finish the request, hold its unstored blocks, then raise
        an earlier pinner error (the request is finished first)."""
        self.check("finish", pinner_error=False)
        held = self.scheduler.finish(request_id)
        if held:
            self.launcher.hold(request_id, {_GROUP: held})
        self.launcher.raise_pinner_error()

    def preempt(self, request_id: str) -> None:
        """`KVOffloader.preempt()`."""
        self.check("preempt")
        self.scheduler.preempt(request_id)

    def has_request(self, request_id: str) -> bool:
        """`KVOffloader.has_request()`."""
        return self.scheduler.has_request(request_id)

    def release(self, request_id: str) -> None:
        """`KVOffloader.release()`."""
        self.check("release")
        self.scheduler.release(request_id)

    async def drain(self) -> None:
        """`KVOffloader.drain()`: wait for every transfer in flight."""
        self.check("drain")
        await self.launcher.poller.drain()

    def load(
        self, request_id: str, gpu_block_ids: Sequence[int], num_tokens: int
    ) -> TransferTask | None:
        """`KVOffloader.load()`: plan the load, then launch it (``None`` for 0 tokens)."""
        self.check("load")
        plan = self.scheduler.plan_load(request_id, gpu_block_ids, num_tokens)
        if plan is None:
            return None
        return self.launcher.launch_one(_GROUP, plan, None)

    def abandon_load(self, request_id: str) -> tuple[int, ...]:
        """`KVOffloader.abandon_load()`: the GPU blocks the abandoned copies still write."""
        self.check("abandon_load", pinner_error=False)
        plans = self.scheduler.abandon_load(request_id)
        return self.launcher.abandon_loads({_GROUP: plans})[_GROUP]

    def update(
        self,
        request_id: str,
        gpu_block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
    ) -> None:
        """`KVOffloader.update()`."""
        self.check("update")
        self.scheduler.update(request_id, gpu_block_ids, block_hashes, num_computed_tokens)

    def store(self, after: object | None, gpu_cache: GpuCacheView | None) -> list[TransferTask]:
        """`KVOffloader.store()`: plan this step's stores and launch them as one transfer;
        the holds that ended are unpinned whatever happens."""
        self.check("store")
        hints = self.hints
        if hints:  # lazy expiry; nothing to do while no hint is live
            hints.expire()
            hints.retry()
        plan = self.scheduler.plan_stores(gpu_cache)
        try:
            if plan is None:
                return []
            return [self.launcher.launch_one(_GROUP, plan, after)]
        finally:
            self.launcher.unpin_released_holds()

    def retain(self, block_hashes: Sequence[BlockHash], owner: Hashable) -> int:
        """`KVOffloader.retain_prefix()` of a hashed prompt: how many blocks are retained."""
        self.check("retain_prefix")
        return len(self.scheduler.ledger.retain(block_hashes, owner))

    def release_retained(self, owner: Hashable) -> int:
        """`KVOffloader.release_retained()`."""
        self.check("release_retained")
        return self.scheduler.ledger.release_retained(owner)

    def retain_for(
        self, block_hashes: Sequence[BlockHash], retain_for_s: float, session: Hashable
    ) -> int:
        """`KVOffloader.retain_for()` of a hashed prompt: how many blocks are retained now."""
        self.check("retain_for")
        return self.hints.hint(session, tuple(block_hashes), retain_for_s)

    async def prefetch(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """`SessionHints.prefetch()` of a hashed prompt: leading blocks on CPU on return
        (one group: its full blocks are the prefix, whatever ``num_tokens``)."""
        del num_tokens
        self.check("prefetch")
        tiers = self.tiers
        if tiers is None:
            is_cached = self.scheduler.pool.is_cached
            return next(
                (i for i, h in enumerate(block_hashes) if not is_cached(h)), len(block_hashes)
            )
        return await tiers.prefetch(block_hashes)

    def release_hint(self, session: Hashable) -> int:
        """`KVOffloader.release_hint()`."""
        self.check("release_hint")
        return self.hints.release(session)

    def _hint_retain(
        self, block_hashes: Sequence[BlockHash], owner: Hashable, fit: bool
    ) -> list[CpuBlock]:
        return self.scheduler.ledger.retain(block_hashes, owner, fit=fit)

    def _hint_release(self, owner: Hashable) -> int:
        return self.scheduler.ledger.release_retained(owner)

    def take_events(self) -> list[PoolEvent]:
        """`KVOffloader.take_events()`: the pool's events since the last call."""
        self.check_built()
        return self.pool.take_events()

    def statistics(
        self,
    ) -> tuple[PoolStatistics, SchedulerStatistics, PollerStatistics, TierManagerStatistics | None]:
        """The parts' statistics, for `OffloaderStatistics`."""
        self.check_built()
        tiers = self.tiers
        return (
            self.pool.statistics(),
            self.scheduler.statistics(),
            self.launcher.poller.statistics(),
            tiers.statistics() if tiers is not None else None,
        )

    # -- checks ------------------------------------------------------------------------

    def check(self, what: str, *, pinner_error: bool = True) -> CopyEngine:
        """The copy engine, for a step-loop call named ``what``.

        Raises:
            ForkedProcessError: called in a forked child.
            ClosedError: not open.
            WrongContextError: called from a thread other than the event loop's.
            TransferError: the completion poller failed (see `CompletionPoller`).
            PinnerError: with ``pinner_error``, an earlier ``unpin`` raised (once).
        """
        self._check_open(what)
        engine = self.engine
        if engine is None:  # a session is open only with its engine; this keeps it so
            raise self._closed()
        launcher = self.launcher
        launcher.poller.check_health()
        if pinner_error:
            launcher.raise_pinner_error()
        return engine

    async def shutdown(self) -> None:
        """Close the copy engine, process the last completions, release every hold, close
        the tiers, the task group and the host buffer; shielded from cancellation."""
        self._state = _State.CLOSING
        try:
            with anyio.CancelScope(shield=True):
                if self.engine is not None:
                    await self.engine.aclose()
                if self.built:
                    # Every copy has ended now. Deliver what the poller has not (it may
                    # have been cancelled with the scope around 'async with').
                    await self.launcher.collect(self._config.poll_interval_s)
                    self.scheduler.release_all_holds()
                    self.launcher.unpin_released_holds()
                    # retain_prefix() owners and session hints end with the offloader
                    self.hints.clear()
                    self.scheduler.ledger.release_all_retained()
                if self.tiers is not None:
                    await self.tiers.aclose()
        finally:
            try:
                await self._close_task_group()
            finally:
                if self.host is not None:
                    self.host.close()
                self._state = _State.CLOSED
                if self.built:
                    _log.info("offloader_closed", **_counts(self.scheduler.statistics()))


def _counts(stats: SchedulerStatistics) -> dict[str, int]:
    return {
        "stored_blocks": stats.stored_blocks,
        "loaded_blocks": stats.loaded_blocks,
        "deferred_blocks": stats.deferred_blocks,
        "failed_stores": stats.failed_stores,
        "failed_loads": stats.failed_loads,
    }
