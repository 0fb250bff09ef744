"""The façade an inference engine embeds: `KVOffloader`.

``async with KVOffloader(config, gpu_kv=kv_tensors) as off:`` allocates the host buffer
(in a worker thread), starts the completion poller in a task group it owns, and picks a
copy engine: CUDA streams when the KV tensors are on a GPU, worker threads otherwise.
Inside, the engine's step loop calls the synchronous methods (``lookup``, ``load``,
``update``, ``store``, ``finish``, ``preempt``); the returned tasks may be awaited, but
completions are processed whether or not anyone does.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Protocol, final, overload

import anyio
import anyio.abc
import torch

from kvoffload._logging import get_logger
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ClosedError, ConfigError, ForkedProcessError
from kvoffload.hashing import BlockHash, HashNamespace, hash_prompt
from kvoffload.pool.block_pool import CpuBlockPool, PoolEvent, PoolStatistics
from kvoffload.request import OffloadRequest
from kvoffload.scheduler import GpuCacheView, OffloadScheduler, SchedulerStatistics
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.tiers.build import build_tier
from kvoffload.tiers.manager import TierManager
from kvoffload.tiers.stats import TierManagerStatistics
from kvoffload.transfer.cuda_engine import CudaCopyEngine
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.plan import StorePlan, TransferPlan
from kvoffload.transfer.poller import CompletionPoller, PollerStatistics
from kvoffload.transfer.task import TransferStatus, TransferTask
from kvoffload.transfer.thread_engine import ThreadCopyEngine

__all__ = ["GpuBlockPinner", "KVOffloader", "NoOpPinner", "OffloaderStatistics"]

_log = get_logger("offloader")


class GpuBlockPinner(Protocol):
    """How the engine keeps GPU blocks alive while a copy reads or writes them.

    ``pin`` is called with a transfer's GPU block ids right before it is submitted and
    ``unpin`` with the same ids once its completion was observed (success or not). The
    engine must not hand a pinned block to another request (a pin count per block is the
    usual implementation: the same block may be pinned by two transfers).
    """

    def pin(self, gpu_block_ids: Sequence[int]) -> None:
        """Keep these blocks from being reused."""

    def unpin(self, gpu_block_ids: Sequence[int]) -> None:
        """Release one pin on each of these blocks."""


@final
class NoOpPinner:
    """The default `GpuBlockPinner`: does nothing.

    Correct only when the engine itself never reuses a GPU block that a transfer in
    flight names, for example because it frees blocks of finished or preempted requests
    only after awaiting their tasks, or because it never reuses blocks within a step.
    """

    def pin(self, gpu_block_ids: Sequence[int]) -> None:
        """Do nothing."""

    def unpin(self, gpu_block_ids: Sequence[int]) -> None:
        """Do nothing."""


@dataclass(frozen=True, slots=True)
class OffloaderStatistics:
    """Counters of every part of one `KVOffloader`."""

    pool: PoolStatistics
    scheduler: SchedulerStatistics
    poller: PollerStatistics
    tiers: TierManagerStatistics | None = None


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


@final
class KVOffloader:
    """Offloads an engine's KV blocks to a CPU pool and loads them back.

    Args:
        config: the settings.
        gpu_kv: the engine's per-layer KV tensors (CUDA or CPU).
        layout: their layout; inferred with `KVLayout.from_tensors()` when omitted.
        copy_engine: moves the bytes; by default a `CudaCopyEngine` for CUDA
            tensors, else a `ThreadCopyEngine`, built on entry. A given engine is
            owned too: it is closed on exit.
        pinner: keeps GPU blocks of transfers in flight from being reused; see
            `GpuBlockPinner` (default `NoOpPinner`).

    Raises:
        LayoutMismatchError: the tensors disagree with ``layout`` or with each other.
        ConfigError: the pool size or block size does not fit the layout.
    """

    def __init__(
        self,
        config: OffloadConfig,
        gpu_kv: Sequence[torch.Tensor],
        *,
        layout: KVLayout | None = None,
        copy_engine: CopyEngine | None = None,
        pinner: GpuBlockPinner | None = None,
    ) -> None:
        if layout is None:
            layout = KVLayout.from_tensors(gpu_kv, block_size=config.block_size)
        self._num_gpu_blocks = layout.num_gpu_blocks(gpu_kv)
        num_cpu_blocks = config.resolve_num_cpu_blocks(layout)
        self._config = config
        self._layout = layout
        self._gpu_kv = tuple(gpu_kv)
        self._pool = CpuBlockPool(
            num_cpu_blocks, enable_events=config.enable_events, policy=config.eviction_policy
        )
        self._scheduler = OffloadScheduler(
            config, self._pool, bytes_per_block=layout.bytes_per_block
        )
        self._namespace = HashNamespace.from_layout(
            layout, model_id=config.model_id, salt=config.hash_salt
        )
        self._engine = copy_engine
        self._pinner: GpuBlockPinner = pinner if pinner is not None else NoOpPinner()
        self._poller = CompletionPoller(self._on_complete, poll_interval_s=config.poll_interval_s)
        self._tasks: dict[int, TransferTask] = {}
        self._host: HostKVBuffer | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._tiers: TierManager | None = None
        self._state = _State.CREATED
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return (
            f"KVOffloader(state={self._state.value}, cpu_blocks={self._pool.num_blocks}, "
            f"in_flight={len(self._tasks)})"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> KVOffloader:
        self._state = self._state.to(_State.OPEN)
        try:
            if self._engine is None:
                self._host = await HostKVBuffer.create(
                    self._layout,
                    self._pool.num_blocks,
                    pin_memory=self._config.pin_memory,
                    pin_chunk_bytes=int(self._config.pin_chunk_bytes),
                )
                if self._gpu_kv[0].is_cuda:
                    self._engine = CudaCopyEngine(self._layout, self._gpu_kv, self._host)
                else:
                    self._engine = ThreadCopyEngine(self._layout, self._gpu_kv, self._host)
            self._task_group = anyio.create_task_group()
            await self._task_group.__aenter__()
            await self._task_group.start(self._poller.run)
            if self._config.tiers:
                self._tiers = self._make_tiers()
                await self._task_group.start(self._tiers.run)
        except BaseException:
            self._state = _State.CLOSING
            await self._shutdown()
            raise
        _log.info(
            "offloader_opened",
            cpu_blocks=self._pool.num_blocks,
            bytes_per_block=self._layout.bytes_per_block,
            engine=type(self._engine).__name__,
            pinned=self._host.is_pinned if self._host is not None else None,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop taking work, wait for every copy in flight, release everything. Idempotent.

        Call it from the task that entered the offloader (``async with`` does). The wait
        is shielded: a cancellation while closing takes effect only after the copies
        finished and their references were released (freeing host memory under a running
        DMA would corrupt it).
        """
        if self._state in {_State.CLOSING, _State.CLOSED}:
            return
        if self._state is _State.CREATED:
            self._state = self._state.to(_State.CLOSED)
            return
        self._state = self._state.to(_State.CLOSING)
        await self._shutdown()

    async def _shutdown(self) -> None:
        try:
            with anyio.CancelScope(shield=True):
                if self._engine is not None:
                    await self._engine.aclose()
                if self._task_group is not None:
                    await self._poller.drain()
                if self._tiers is not None:
                    await self._tiers.aclose()
        finally:
            try:
                if self._task_group is not None:
                    task_group, self._task_group = self._task_group, None
                    task_group.cancel_scope.cancel()
                    await task_group.__aexit__(None, None, None)
            finally:
                if self._host is not None:
                    self._host.close()
                self._state = _State.CLOSED
                _log.info("offloader_closed", **_counts(self._scheduler.statistics()))

    def _make_tiers(self) -> TierManager:
        if self._host is None:
            raise ConfigError(
                "tiers need the host buffer this offloader makes; they cannot be used with "
                "a copy_engine given by the caller"
            )
        digest = self._namespace.root
        nbytes = self._layout.bytes_per_block
        tiers = [
            (build_tier(s, i, namespace=digest, block_nbytes=nbytes), s)
            for i, s in enumerate(self._config.tiers)
        ]
        return TierManager(tiers, scheduler=self._scheduler, host=self._host, namespace=digest)

    @property
    def tiers(self) -> TierManager | None:
        """The tier manager, when ``config.tiers`` is set (for inspection)."""
        return self._tiers

    def _check(self) -> CopyEngine:
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"KVOffloader was created in process {self._pid} and used in forked process "
                f"{os.getpid()}; create a new one in the child"
            )
        if self._state is not _State.OPEN or self._engine is None:
            raise ClosedError(f"KVOffloader is {self._state.value}; use it inside 'async with'")
        self._poller.check_health()
        return self._engine

    # -- properties --------------------------------------------------------------------------

    @property
    def config(self) -> OffloadConfig:
        """The settings."""
        return self._config

    @property
    def layout(self) -> KVLayout:
        """The KV layout."""
        return self._layout

    @property
    def namespace(self) -> HashNamespace:
        """The hash namespace made of the layout, ``model_id`` and ``hash_salt``."""
        return self._namespace

    @property
    def scheduler(self) -> OffloadScheduler:
        """The scheduler (for inspection; drive it through this object)."""
        return self._scheduler

    @property
    def pool(self) -> CpuBlockPool:
        """The CPU block pool."""
        return self._pool

    @property
    def host(self) -> HostKVBuffer | None:
        """The host buffer, when this object made the copy engine."""
        return self._host

    def hash_prompt(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hash a prompt's full blocks in this offloader's namespace."""
        return hash_prompt(token_ids, self._config.block_size, self._namespace)

    def request(
        self, request_id: str, prompt_token_ids: Sequence[int], *, num_computed_tokens: int = 0
    ) -> OffloadRequest:
        """A handle for one request: its tokens, incremental block hashes and step calls.

        Use it as ``with off.request(rid, prompt) as req:``; leaving the block finishes the
        request. See `OffloadRequest`.

        Args:
            request_id: the engine's id for the request (unique among live requests).
            prompt_token_ids: the prompt; its full blocks are hashed now.
            num_computed_tokens: tokens of the prompt the engine's own prefix cache holds
                (a multiple of the block size); the lookup starts after them.

        Raises:
            ClosedError: not open.
            RequestStateError: ``request_id`` is still in use.
            ValueError: ``num_computed_tokens`` out of range, or a token is not an int.
        """
        self._check()
        return OffloadRequest._create(self, request_id, prompt_token_ids, num_computed_tokens)

    # -- the engine's step loop ----------------------------------------------------------------

    @overload
    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: Literal[False] = False,
        no_read: bool = False,
    ) -> int: ...

    @overload
    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: bool,
        no_read: bool = False,
    ) -> int | None: ...

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: bool = False,
        no_read: bool = False,
    ) -> int | None:
        """Tokens loadable from CPU past the engine's own prefix; pins the hit.

        See `OffloadScheduler.lookup()`. With ``config.tiers``, the blocks after the CPU hit
        that a tier holds are promoted into CPU blocks in the background (see
        `TierManager.after_lookup()`); with ``allow_defer=True`` this returns ``None`` until
        that promotion has landed.

        Raises:
            ClosedError: not open. ForkedProcessError: used in a forked child.
        """
        self._check()
        hit = self._scheduler.lookup(
            request_id,
            block_hashes,
            num_tokens,
            num_computed_tokens,
            allow_defer=allow_defer,
            no_read=no_read,
        )
        if self._tiers is None or no_read:
            return hit
        return self._tiers.after_lookup(
            request_id,
            block_hashes,
            num_tokens,
            num_computed_tokens,
            hit,
            allow_defer=allow_defer,
        )

    def load(
        self, request_id: str, gpu_block_ids: Sequence[int], num_tokens: int
    ) -> TransferTask | None:
        """Start loading the accepted part of the last lookup's hit into the engine's blocks.

        Args:
            request_id: the request.
            gpu_block_ids: its whole GPU block table (see `OffloadScheduler.plan_load()`).
            num_tokens: tokens to load (a multiple of the block size, at most the hit).

        Returns:
            The transfer (compute must wait on it: ``await`` it, or ``task.wait_on(stream)``
            on CUDA), or ``None`` when ``num_tokens`` is 0. A failed load raises
            `TransferError` when awaited; the engine then
            recomputes those tokens.

        Raises:
            ClosedError: not open.
        """
        engine = self._check()
        plan = self._scheduler.plan_load(request_id, gpu_block_ids, num_tokens)
        if plan is None:
            return None
        return self._submit(engine, plan, None)

    def update(
        self,
        request_id: str,
        gpu_block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
    ) -> None:
        """Tell the offloader what the engine holds for a request after a step.

        See `OffloadScheduler.update()`.
        """
        self._check()
        self._scheduler.update(request_id, gpu_block_ids, block_hashes, num_computed_tokens)

    def store(
        self, *, after: object | None = None, gpu_cache: GpuCacheView | None = None
    ) -> list[TransferTask]:
        """Plan and start this step's stores (one batched transfer, or none).

        Args:
            after: what the copy must wait for: a CUDA event recorded after the compute
                that wrote the blocks (default: the current stream at this call), or a
                ``threading.Event`` / future for the thread engine.
            gpu_cache: the engine's cache view, for ``store_mode="lazy"``.

        Returns:
            The started transfers; awaiting them is optional.
        """
        engine = self._check()
        plan = self._scheduler.plan_stores(gpu_cache)
        if plan is None:
            return []
        return [self._submit(engine, plan, after)]

    def finish(self, request_id: str) -> None:
        """The engine finished a request. See `OffloadScheduler.finish()`."""
        self._check()
        self._scheduler.finish(request_id)

    def preempt(self, request_id: str) -> None:
        """The engine preempted a request. See `OffloadScheduler.preempt()`."""
        self._check()
        self._scheduler.preempt(request_id)

    def release(self, request_id: str) -> None:
        """Drop a lookup pin the engine will not load. See `OffloadScheduler.release()`."""
        self._check()
        self._scheduler.release(request_id)

    async def drain(self) -> None:
        """Wait until every transfer in flight has completed and been processed.

        Cancellation cancels only the wait.
        """
        self._check()
        await self._poller.drain()

    async def reset(self) -> bool:
        """Empty the CPU prefix cache and wait for the transfers in flight to end.

        Published blocks are dropped at once and transfers in flight are abandoned: they
        publish nothing, and awaiting one raises `TransferError`.
        Work the engine starts while this waits is not affected.

        Returns:
            Whether, on return, nothing is cached and nothing is in flight (``False`` only
            when the engine stored or loaded again during the wait).

        Cancellation cancels only the wait; the reset itself has happened.
        """
        self._check()
        self._scheduler.reset()
        if self._tiers is not None:
            self._tiers.reset()
        for task in self._tasks.values():
            task._abandon()  # the owner's reset is what _abandon is for
        await self._poller.drain()
        return self._pool.num_cached == 0 and self._scheduler.num_in_flight == 0

    def statistics(self) -> OffloaderStatistics:
        """Counters of the pool, the scheduler and the poller."""
        return OffloaderStatistics(
            pool=self._pool.statistics(),
            scheduler=self._scheduler.statistics(),
            poller=self._poller.statistics(),
            tiers=self._tiers.statistics() if self._tiers is not None else None,
        )

    def take_events(self) -> list[PoolEvent]:
        """Pool events since the last call (``enable_events=True``), for KV-aware routers."""
        return self._pool.take_events()

    # -- internals -------------------------------------------------------------------------

    def _submit(self, engine: CopyEngine, plan: TransferPlan, after: object | None) -> TransferTask:
        self._pinner.pin(plan.gpu_block_ids)
        try:
            task = engine.submit(plan, after=after)
        except BaseException:
            self._pinner.unpin(plan.gpu_block_ids)
            self._scheduler.complete(plan, ok=False)
            raise
        self._tasks[plan.plan_id] = task
        self._poller.track(task)
        return task

    def _on_complete(self, task: TransferTask) -> None:
        self._tasks.pop(task.plan.plan_id, None)
        try:
            ok = task.status is TransferStatus.DONE
            self._scheduler.complete(task, ok=ok)
            if ok and self._tiers is not None and isinstance(task.plan, StorePlan):
                self._tiers.on_stored(task.plan)
        finally:
            self._pinner.unpin(task.gpu_block_ids)


def _counts(stats: SchedulerStatistics) -> dict[str, int]:
    return {
        "stored_blocks": stats.stored_blocks,
        "loaded_blocks": stats.loaded_blocks,
        "deferred_blocks": stats.deferred_blocks,
        "failed_stores": stats.failed_stores,
        "failed_loads": stats.failed_loads,
    }
