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
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Protocol, final, overload

import anyio
import anyio.abc
import anyio.to_thread
import torch

from kvoffload._logging import get_logger
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import (
    ClosedError,
    ConfigError,
    ForkedProcessError,
    HostMemoryError,
    LayoutMismatchError,
    PinnerError,
    WrongContextError,
)
from kvoffload.hashing import BlockHash, HashNamespace, hash_prompt
from kvoffload.pool.block_pool import CpuBlockPool, PoolEvent, PoolStatistics
from kvoffload.request import OffloadRequest
from kvoffload.scheduler import GpuCacheView, OffloadScheduler, SchedulerStatistics
from kvoffload.storage.host_buffer import HostKVBuffer, available_host_memory
from kvoffload.tiers.build import build_tier
from kvoffload.tiers.manager import TierManager
from kvoffload.tiers.stats import TierManagerStatistics
from kvoffload.transfer.cuda_engine import CudaCopyEngine
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.plan import StorePlan, TransferPlan
from kvoffload.transfer.poller import CompletionPoller, PollerStatistics
from kvoffload.transfer.task import TransferStatus, TransferTask
from kvoffload.transfer.thread_engine import ThreadCopyEngine

__all__ = [
    "POOL_BOOKKEEPING_BYTES_PER_BLOCK",
    "GpuBlockPinner",
    "KVOffloader",
    "NoOpPinner",
    "OffloaderStatistics",
]

_log = get_logger("offloader")

POOL_BOOKKEEPING_BYTES_PER_BLOCK = 128
"""Python memory the CPU block pool needs per block, rounded up (about 112 bytes measured:
see ``python -m kvoffload.bench pool``), counted with the host buffer before anything is
allocated."""

_INLINE_POOL_BLOCKS = 1 << 16
"""Pools up to this many blocks are built at once; larger ones in a worker thread on entry."""


class GpuBlockPinner(Protocol):
    """How the engine keeps GPU blocks alive while a copy reads or writes them.

    ``pin`` is called with a transfer's GPU block ids right before it is submitted and
    ``unpin`` with the same ids once its completion was observed (success or not). The
    engine must not hand a pinned block to another request (a pin count per block is the
    usual implementation: the same block may be pinned by two transfers). With
    ``hold_blocks_on_finish``, ``finish()`` also pins the blocks a finished request still
    has to store, and unpins them once their store is planned (or given up).

    A pinner that raises is contained: when ``pin`` raises, the transfer is not started
    and its plan is undone (`PinnerError` is raised from the call that started it); when
    ``unpin`` raises, the completion is still recorded and every reference released, and
    the next step-loop call raises `PinnerError` once.
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
        LayoutMismatchError: the tensors disagree with ``layout`` or with each other, or
            hold no GPU block.
        ConfigError: the pool size or block size does not fit the layout.
        HostMemoryError: the host buffer plus the pool's bookkeeping
            (`POOL_BOOKKEEPING_BYTES_PER_BLOCK` per block) exceed the memory this process
            can still use; checked before anything is allocated.

    A pool of more than 65,536 blocks is built on entering ``async with``, in a worker
    thread; until then `pool` and `scheduler` raise `ClosedError`.
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
        if self._num_gpu_blocks < 1:
            raise LayoutMismatchError(
                f"the KV tensors hold no GPU block (shape {tuple(gpu_kv[0].shape)})"
            )
        _check_host_memory(num_cpu_blocks, layout, host_buffer=copy_engine is None)
        self._config = config
        self._layout = layout
        self._gpu_kv = tuple(gpu_kv)
        self._num_cpu_blocks = num_cpu_blocks
        self._pool: CpuBlockPool
        self._scheduler: OffloadScheduler
        self._built = False
        if num_cpu_blocks <= _INLINE_POOL_BLOCKS:
            self._build_parts()
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
        self._loop_thread: int | None = None
        self._owner_task: int | None = None
        self._pinner_error: BaseException | None = None

    def _build_parts(self) -> None:
        self._pool = CpuBlockPool(
            self._num_cpu_blocks,
            enable_events=self._config.enable_events,
            policy=self._config.eviction_policy,
        )
        self._scheduler = OffloadScheduler(
            self._config,
            self._pool,
            bytes_per_block=self._layout.bytes_per_block,
            num_gpu_blocks=self._num_gpu_blocks,
        )
        self._built = True

    def _parts(self) -> None:
        if not self._built:
            raise ClosedError(
                f"KVOffloader's pool of {self._num_cpu_blocks} blocks is built on entering "
                "'async with' (off the event loop); use it inside"
            )

    def __repr__(self) -> str:
        return (
            f"KVOffloader(state={self._state.value}, cpu_blocks={self._num_cpu_blocks}, "
            f"in_flight={len(self._tasks)})"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> KVOffloader:
        self._state = self._state.to(_State.OPEN)
        self._loop_thread = threading.get_ident()
        self._owner_task = anyio.get_current_task().id
        try:
            if not self._built:
                await anyio.to_thread.run_sync(self._build_parts)
            if self._engine is None:
                self._host = await HostKVBuffer.create(
                    self._layout,
                    self._num_cpu_blocks,
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
            cpu_blocks=self._num_cpu_blocks,
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
        DMA would corrupt it). It lasts as long as the copies in flight, also when the
        scope around ``async with`` was cancelled (completions are then collected here,
        not by the cancelled poller).

        Raises:
            ForkedProcessError: called in a process forked after the offloader was made
                (the copies belong to the parent).
            WrongContextError: called from another thread or from a task other than the
                one that entered; nothing was closed.
        """
        if self._state in {_State.CLOSING, _State.CLOSED}:
            return
        if self._state is _State.CREATED:
            self._state = self._state.to(_State.CLOSED)
            return
        self._check_process()
        self._check_thread("aclose")
        if anyio.get_current_task().id != self._owner_task:
            raise WrongContextError(
                "KVOffloader.aclose() must be called from the task that entered it "
                "(a task group's exit needs its own task); close it there, e.g. by leaving "
                "'async with'"
            )
        self._state = self._state.to(_State.CLOSING)
        await self._shutdown()

    async def _shutdown(self) -> None:
        try:
            with anyio.CancelScope(shield=True):
                if self._engine is not None:
                    await self._engine.aclose()
                # Every copy has ended now. Deliver what the poller has not (it may have
                # been cancelled with the scope around 'async with').
                poller = self._poller
                while poller.in_flight:
                    poller.poll()
                    if poller.in_flight:
                        await anyio.sleep(self._config.poll_interval_s)
                if self._built:
                    self._scheduler.release_all_holds()
                    self._unpin_released_holds()
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
                if self._built:
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

    def _check(self, what: str, *, pinner_error: bool = True) -> CopyEngine:
        self._check_process()
        if self._state is not _State.OPEN or self._engine is None:
            raise ClosedError(f"KVOffloader is {self._state.value}; use it inside 'async with'")
        self._check_thread(what)
        self._poller.check_health()
        if pinner_error:
            self._raise_pinner_error()
        return self._engine

    def _raise_pinner_error(self) -> None:
        """Raise, once, the error an earlier ``unpin`` raised."""
        error = self._pinner_error
        if error is not None:
            self._pinner_error = None
            raise PinnerError(
                f"the GpuBlockPinner's unpin raised after a transfer completed: {error!r} "
                "(the transfer was recorded and its references released)"
            ) from error

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
        self._parts()
        return self._scheduler

    @property
    def pool(self) -> CpuBlockPool:
        """The CPU block pool."""
        self._parts()
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
            RequestStateError: ``request_id`` is in use (by a handle not finished yet,
                also one that made no call: the id is reserved when its handle is made), or
                finished (ids are never reused).
            InvalidInputError: ``num_computed_tokens`` out of range or not block aligned.
            InputTypeError: a token is not a 64-bit int.
        """
        self._check("request")
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
        `TierManager.extend_lookup()`); with ``allow_defer=True`` this returns ``None`` until
        that promotion has landed.

        Raises:
            ClosedError: not open. ForkedProcessError: used in a forked child.
            WrongContextError: called from a thread other than the event loop's (every
                step-loop call checks this). PinnerError: the pinner's ``unpin`` raised
                after an earlier completion (once).
        """
        self._check("lookup")
        # With tiers, the scheduler asks the tier manager after the CPU lookup.
        return self._scheduler.lookup(
            request_id,
            block_hashes,
            num_tokens,
            num_computed_tokens,
            allow_defer=allow_defer,
            no_read=no_read,
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
            BlockTableError: the table is malformed; nothing changed (the hit stays
                pinned). See `OffloadScheduler.plan_load()`.
            PinnerError: the pinner's ``pin`` raised; the load was not started and the
                hit stays pinned.
        """
        engine = self._check("load")
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
        self._check("update")
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

        Raises:
            InputTypeError: ``after`` is of a type the copy engine does not take. The
                plan is undone (cursors go back), so nothing of this step is lost: the
                same blocks are planned by the next call.
            PinnerError: the pinner's ``pin`` raised; the plan is undone the same way.
        """
        engine = self._check("store")
        plan = self._scheduler.plan_stores(gpu_cache)
        try:
            if plan is None:
                return []
            return [self._submit(engine, plan, after)]
        finally:
            self._unpin_released_holds()

    def finish(self, request_id: str) -> None:
        """The engine finished a request. See `OffloadScheduler.finish()`.

        With ``hold_blocks_on_finish``, blocks the request computed but could not store
        yet are pinned through the `GpuBlockPinner` (the engine must not reuse them) and
        unpinned once a later `store()` planned them, or after ``hold_max_steps`` calls.

        A `PinnerError` raised here never leaves the request behind: the request is
        finished first (pin released, id given up), then the error is raised. Do not call
        ``finish`` again for it.

        Raises:
            PinnerError: the pinner raised while pinning held blocks (the request is
                finished without holding them), or its ``unpin`` raised after an earlier
                completion (once; the request is finished all the same).
        """
        self._check("finish", pinner_error=False)
        held = self._scheduler.finish(request_id)
        if held:
            try:
                self._pinner.pin(held)
            except Exception as exc:
                self._scheduler.cancel_hold(request_id)
                raise PinnerError(
                    f"the GpuBlockPinner's pin raised for the blocks request {request_id!r} "
                    f"holds on finish: {exc!r}"
                ) from exc
        self._raise_pinner_error()

    def preempt(self, request_id: str) -> None:
        """The engine preempted a request. See `OffloadScheduler.preempt()`."""
        self._check("preempt")
        self._scheduler.preempt(request_id)

    def release(self, request_id: str) -> None:
        """Drop a lookup pin the engine will not load. See `OffloadScheduler.release()`."""
        self._check("release")
        self._scheduler.release(request_id)

    async def drain(self) -> None:
        """Wait until every transfer in flight has completed and been processed.

        Cancellation cancels only the wait.
        """
        self._check("drain")
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
        self._check("reset")
        self._scheduler.reset()
        if self._tiers is not None:
            self._tiers.reset()
        self._unpin_released_holds()
        for task in self._tasks.values():
            task._abandon()  # the owner's reset is what _abandon is for
        await self._poller.drain()
        return self._pool.num_cached == 0 and self._scheduler.num_in_flight == 0

    def statistics(self) -> OffloaderStatistics:
        """Counters of the pool, the scheduler and the poller."""
        self._parts()
        return OffloaderStatistics(
            pool=self._pool.statistics(),
            scheduler=self._scheduler.statistics(),
            poller=self._poller.statistics(),
            tiers=self._tiers.statistics() if self._tiers is not None else None,
        )

    def take_events(self) -> list[PoolEvent]:
        """Pool events since the last call (``enable_events=True``), for KV-aware routers."""
        self._parts()
        return self._pool.take_events()

    # -- internals -------------------------------------------------------------------------

    def _submit(self, engine: CopyEngine, plan: TransferPlan, after: object | None) -> TransferTask:
        try:
            self._pinner.pin(plan.gpu_block_ids)
        except Exception as exc:
            self._scheduler.cancel(plan)
            _log.error("pinner_failed", call="pin", plan_id=plan.plan_id, error=repr(exc))
            raise PinnerError(
                f"the GpuBlockPinner's pin raised for {plan.kind} plan {plan.plan_id}: "
                f"{exc!r} (the transfer was not started; nothing is lost)"
            ) from exc
        try:
            task = engine.submit(plan, after=after)
        except BaseException:
            self._unpin(plan.gpu_block_ids, plan.plan_id)
            self._scheduler.cancel(plan)
            raise
        self._tasks[plan.plan_id] = task
        self._poller.track(task)
        return task

    def _unpin(self, gpu_block_ids: Sequence[int], plan_id: int | None) -> None:
        try:
            self._pinner.unpin(gpu_block_ids)
        except Exception as exc:
            _log.error("pinner_failed", call="unpin", plan_id=plan_id, error=repr(exc))
            self._pinner_error = exc

    def _unpin_released_holds(self) -> None:
        released = self._scheduler.take_released_holds()
        if released:
            self._unpin(released, None)

    def _on_complete(self, task: TransferTask) -> None:
        self._tasks.pop(task.plan.plan_id, None)
        try:
            ok = task.status is TransferStatus.DONE
            self._scheduler.complete(task, ok=ok)
            if ok and self._tiers is not None and isinstance(task.plan, StorePlan):
                self._tiers.on_stored(task.plan)
        finally:
            self._unpin(task.gpu_block_ids, task.plan.plan_id)


def _check_host_memory(num_blocks: int, layout: KVLayout, *, host_buffer: bool) -> None:
    """Refuse a pool whose host buffer and bookkeeping exceed the memory left."""
    available = available_host_memory()
    if available is None:
        return
    host = num_blocks * layout.bytes_per_block if host_buffer else 0
    bookkeeping = num_blocks * POOL_BOOKKEEPING_BYTES_PER_BLOCK
    if host + bookkeeping > available:
        raise HostMemoryError(
            f"a CPU pool of {num_blocks} blocks needs {host} bytes of host buffer "
            f"({layout.bytes_per_block} per block) and about {bookkeeping} bytes of "
            f"bookkeeping ({POOL_BOOKKEEPING_BYTES_PER_BLOCK} per block), {host + bookkeeping} "
            f"in all, but this process can still use {available} bytes (MemAvailable and the "
            "cgroup limit); lower num_cpu_blocks or cpu_bytes"
        )


def _counts(stats: SchedulerStatistics) -> dict[str, int]:
    return {
        "stored_blocks": stats.stored_blocks,
        "loaded_blocks": stats.loaded_blocks,
        "deferred_blocks": stats.deferred_blocks,
        "failed_stores": stats.failed_stores,
        "failed_loads": stats.failed_loads,
    }
