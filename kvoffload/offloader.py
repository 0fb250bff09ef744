"""The façade an inference engine embeds: `KVOffloader`.

``async with KVOffloader(config, gpu_kv=kv_tensors) as off:`` allocates the host buffer
(in a worker thread), starts the completion poller in a task group it owns, and picks a
copy engine: CUDA streams when the KV tensors are on a GPU, worker threads otherwise.
Inside, the engine's step loop calls the synchronous methods (``lookup``, ``load``,
``update``, ``store``, ``finish``, ``preempt``); the returned tasks may be awaited, but
completions are processed whether or not anyone does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, final, overload

import torch

from kvoffload._session import Session
from kvoffload.build import POOL_BOOKKEEPING_BYTES_PER_BLOCK, CorePlan, plan_core
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import LayoutMismatchError
from kvoffload.hashing import BlockHash, HashNamespace, hash_prompt
from kvoffload.pinner import GpuBlockPinner, NoOpPinner
from kvoffload.pool.block_pool import CpuBlockPool, PoolEvent, PoolStatistics
from kvoffload.request import OffloadRequest
from kvoffload.scheduler import GpuCacheView, OffloadScheduler, SchedulerStatistics
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.tiers.manager import TierManager
from kvoffload.tiers.stats import TierManagerStatistics
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.poller import PollerStatistics
from kvoffload.transfer.task import TransferTask

__all__ = ["POOL_BOOKKEEPING_BYTES_PER_BLOCK", "KVOffloader", "OffloaderStatistics"]


@dataclass(frozen=True, slots=True)
class OffloaderStatistics:
    """Counters of every part of one `KVOffloader`."""

    pool: PoolStatistics
    scheduler: SchedulerStatistics
    poller: PollerStatistics
    tiers: TierManagerStatistics | None = None


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
        layout, plan = _plan_core(config, gpu_kv, layout, host_buffer=copy_engine is None)
        self._num_cpu_blocks = plan.num_cpu_blocks
        self._config = config
        self._layout = layout
        self._namespace = HashNamespace.from_layout(
            layout, model_id=config.model_id, salt=config.hash_salt
        )
        self._session = Session(
            plan,
            layout,
            gpu_kv,
            self._namespace,
            pinner if pinner is not None else NoOpPinner(),
            copy_engine,
        )

    def __repr__(self) -> str:
        session = self._session
        return (
            f"KVOffloader(state={session.state}, cpu_blocks={self._num_cpu_blocks}, "
            f"in_flight={session.launcher.num_in_flight if session.built else 0})"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> KVOffloader:
        await self._session.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
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
        if self._session.begin_close():
            await self._session.shutdown()

    @property
    def tiers(self) -> TierManager | None:
        """The tier manager, when ``config.tiers`` is set (for inspection)."""
        return self._session.tiers

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
        self._session.check_built()
        return self._session.scheduler

    @property
    def pool(self) -> CpuBlockPool:
        """The CPU block pool."""
        self._session.check_built()
        return self._session.pool

    @property
    def host(self) -> HostKVBuffer | None:
        """The host buffer, when this object made the copy engine."""
        return self._session.host

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
        session = self._session
        session.check("request")
        handle: OffloadRequest = OffloadRequest._create(
            self,
            request_id,
            prompt_token_ids,
            num_computed_tokens,
            block_size=self._config.block_size,
            root=self._namespace.root,
        )
        # Last, once nothing can be refused any more: the id is the handle's until it
        # finishes, so a second handle for it (a client's retry) is refused here, before
        # either makes a call.
        session.scheduler.reserve(request_id)
        return handle

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
        `TierManager.extend_lookup()`). ``allow_defer=True`` is `lookup_or_defer()`.

        Raises:
            ClosedError: not open. ForkedProcessError: used in a forked child.
            WrongContextError: called from a thread other than the event loop's (every
                step-loop call checks this). PinnerError: the pinner's ``unpin`` raised
                after an earlier completion (once).
        """
        if allow_defer:
            return self.lookup_or_defer(
                request_id, block_hashes, num_tokens, num_computed_tokens, no_read=no_read
            )
        self._session.check("lookup")  # with tiers, the scheduler asks the tier manager next
        return self._session.scheduler.lookup(
            request_id, block_hashes, num_tokens, num_computed_tokens, no_read=no_read
        )

    def lookup_or_defer(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        no_read: bool = False,
    ) -> int | None:
        """`lookup()` that may answer ``None`` ("ask again later"): when, see
        `OffloadScheduler.lookup_or_defer()`. Raises as `lookup()` does.
        """
        self._session.check("lookup")
        return self._session.scheduler.lookup_or_defer(
            request_id, block_hashes, num_tokens, num_computed_tokens, no_read=no_read
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
        session = self._session
        engine = session.check("load")
        plan = session.scheduler.plan_load(request_id, gpu_block_ids, num_tokens)
        if plan is None:
            return None
        return session.launcher.launch(engine, plan, None)

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
        self._session.check("update")
        self._session.scheduler.update(request_id, gpu_block_ids, block_hashes, num_computed_tokens)

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
        session = self._session
        engine = session.check("store")
        plan = session.scheduler.plan_stores(gpu_cache)
        try:
            if plan is None:
                return []
            return [session.launcher.launch(engine, plan, after)]
        finally:
            session.launcher.unpin_released_holds()

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
        session = self._session
        session.check("finish", pinner_error=False)
        held = session.scheduler.finish(request_id)
        if held:
            session.launcher.hold(request_id, held)
        session.launcher.raise_pinner_error()

    def preempt(self, request_id: str) -> None:
        """The engine preempted a request. See `OffloadScheduler.preempt()`."""
        self._session.check("preempt")
        self._session.scheduler.preempt(request_id)

    def release(self, request_id: str) -> None:
        """Drop a lookup pin the engine will not load. See `OffloadScheduler.release()`."""
        self._session.check("release")
        self._session.scheduler.release(request_id)

    async def drain(self) -> None:
        """Wait until every transfer in flight has completed and been processed.

        Cancellation cancels only the wait.
        """
        session = self._session
        session.check("drain")
        await session.launcher.poller.drain()

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
        session = self._session
        session.check("reset")
        session.scheduler.reset()
        if session.tiers is not None:
            session.tiers.reset()
        launcher = session.launcher
        launcher.unpin_released_holds()
        launcher.abandon_all()
        await launcher.poller.drain()
        return session.pool.num_cached == 0 and session.scheduler.num_in_flight == 0

    def statistics(self) -> OffloaderStatistics:
        """Counters of the pool, the scheduler and the poller."""
        session = self._session
        session.check_built()
        tiers = session.tiers
        return OffloaderStatistics(
            pool=session.pool.statistics(),
            scheduler=session.scheduler.statistics(),
            poller=session.launcher.poller.statistics(),
            tiers=tiers.statistics() if tiers is not None else None,
        )

    def take_events(self) -> list[PoolEvent]:
        """Pool events since the last call (``enable_events=True``), for KV-aware routers."""
        self._session.check_built()
        return self._session.pool.take_events()


def _plan_core(
    config: OffloadConfig,
    gpu_kv: Sequence[torch.Tensor],
    layout: KVLayout | None,
    *,
    host_buffer: bool,
) -> tuple[KVLayout, CorePlan]:
    """The layout of ``gpu_kv`` (inferred when ``None``) and the core sized for it.

    Raises:
        LayoutMismatchError: the tensors disagree with ``layout`` or with each other, or
            hold no GPU block.
        ConfigError, HostMemoryError: see `plan_core()`.
    """
    if layout is None:
        layout = KVLayout.from_tensors(gpu_kv, block_size=config.block_size)
    num_gpu_blocks = layout.num_gpu_blocks(gpu_kv)
    if num_gpu_blocks < 1:
        raise LayoutMismatchError(
            f"the KV tensors hold no GPU block (shape {tuple(gpu_kv[0].shape)})"
        )
    return layout, plan_core(config, layout, num_gpu_blocks=num_gpu_blocks, host_buffer=host_buffer)
