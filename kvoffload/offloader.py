"""The façade an inference engine embeds: `KVOffloader`.

``async with KVOffloader(config, gpu_kv=kv_tensors) as off:`` allocates the host buffer
(in a worker thread), starts the completion poller in a task group it owns, and picks a
copy engine: CUDA streams when the KV tensors are on a GPU, worker threads otherwise.
Inside, the engine's step loop calls the synchronous methods (``lookup``, ``load``,
``update``, ``store``, ``finish``, ``preempt``); the returned tasks may be awaited, but
completions are processed whether or not anyone does.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, final, overload

import torch

from kvoffload._handles import open_handle
from kvoffload._session import Session
from kvoffload._setup import make_session
from kvoffload.build import POOL_BOOKKEEPING_BYTES_PER_BLOCK
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.hashing import BlockHash, HashNamespace, hash_prompt
from kvoffload.hints import SessionHints
from kvoffload.pinner import GpuBlockPinner
from kvoffload.pool.block_pool import CpuBlockPool, PoolEvent, PoolStatistics
from kvoffload.request import OffloadRequest
from kvoffload.scheduler import GpuCacheView, OffloadScheduler, SchedulerStatistics
from kvoffload.scheduler.misses import MissReason
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.tiers.front import TierFront
from kvoffload.tiers.stats import TierManagerStatistics
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.poller import PollerStatistics
from kvoffload.transfer.task import TransferTask

if TYPE_CHECKING:  # the group code is imported on first use: one group never loads it
    from kvoffload.groups import KVCacheGroup
    from kvoffload.scheduler.groups import GroupStatistics

__all__ = ["POOL_BOOKKEEPING_BYTES_PER_BLOCK", "KVOffloader", "OffloaderStatistics"]


@dataclass(frozen=True, slots=True)
class OffloaderStatistics:
    """Counters of every part of one `KVOffloader`.

    With several KV cache groups, ``pool`` adds up the groups' pools, ``scheduler`` counts
    for the whole model, ``groups`` holds each cacheable group's `GroupStatistics`
    (``None`` for one group), and ``tiers`` holds every group's tiers, each named
    ``<tier>.<group>``, with the promotion counters added up over the groups.
    """

    pool: PoolStatistics
    scheduler: SchedulerStatistics
    poller: PollerStatistics
    tiers: TierManagerStatistics | None = None
    groups: Mapping[str, GroupStatistics] | None = None


@final
class KVOffloader:
    """Offloads an engine's KV blocks to a CPU pool and loads them back.

    Args:
        config: the settings.
        gpu_kv: the engine's per-layer KV tensors (CUDA or CPU); with ``groups``, one
            list per cacheable group name.
        layout: their layout; inferred with `KVLayout.from_tensors()` when omitted.
        copy_engine: moves the bytes; by default a `CudaCopyEngine` for CUDA
            tensors, else a `ThreadCopyEngine`, built on entry. A given engine is
            owned too: it is closed on exit. With several groups, one per group name.
        pinner: keeps GPU blocks of transfers in flight from being reused; see
            `GpuBlockPinner` (default `NoOpPinner`). With several groups, one per group
            name (their block ids are separate).
        groups: the model's KV cache groups (docs/groups.md). Several (or one that is not
            ``full``) are offloaded by a `GroupedScheduler`, one host buffer and copy
            engine per group; the handles of `request()` then take a table per group.

    Raises:
        LayoutMismatchError: the tensors disagree with ``layout`` or with each other, or
            hold no GPU block.
        ConfigError: the pool size or block size does not fit the layout; with several
            groups, also tiers, or ``gpu_kv`` not naming exactly the cacheable groups.
        InvalidInputError: one value where several groups need one per name, or the reverse.
        HostMemoryError: the host buffer plus the pool's bookkeeping
            (`POOL_BOOKKEEPING_BYTES_PER_BLOCK` per block) exceed the memory this process
            can still use; checked before anything is allocated.

    A pool of more than 65,536 blocks is built on entering ``async with``, in a worker
    thread; until then `pool` and `scheduler` raise `ClosedError`.
    """

    def __init__(
        self,
        config: OffloadConfig,
        gpu_kv: Sequence[torch.Tensor] | Mapping[str, Sequence[torch.Tensor]],
        *,
        layout: KVLayout | None = None,
        copy_engine: CopyEngine | Mapping[str, CopyEngine] | None = None,
        pinner: GpuBlockPinner | Mapping[str, GpuBlockPinner] | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        life, self._layout, self._namespace, self._num_cpu_blocks = make_session(
            config, gpu_kv, layout, copy_engine, pinner, groups
        )
        self._config = config
        self._life: Session = life

    def __repr__(self) -> str:
        life = self._life
        return (
            f"KVOffloader(state={life.state}, cpu_blocks={self._num_cpu_blocks}, "
            f"in_flight={life.num_in_flight if life.built else 0})"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> KVOffloader:
        await self._life.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop taking work, wait for every copy in flight, release everything. Idempotent.

        Call it from the task that entered the offloader (``async with`` does). The wait
        is shielded: a cancellation while closing takes effect only after the copies
        finished and their references were released (freeing host memory under a running
        DMA would corrupt it), also when the scope around ``async with`` was cancelled
        (completions are then collected here, not by the cancelled poller).

        Raises:
            ForkedProcessError: called in a process forked after the offloader was made
                (the copies belong to the parent).
            WrongContextError: called from another thread or from a task other than the
                one that entered; nothing was closed.
        """
        if self._life.begin_close():
            await self._life.shutdown()

    # -- properties --------------------------------------------------------------------------

    @property
    def tiers(self) -> TierFront | None:
        """The secondary tiers, when ``config.tiers`` is set (for inspection): the
        `TierManager`, or with several KV cache groups `GroupTiers` (one manager per
        group, the same read API over the whole model, each group's manager in
        ``managers``). See `TierFront`."""
        return self._life.tiers

    @property
    def hints(self) -> SessionHints[Any]:
        """Session hints: retain for a pause, release, prefetch (docs/hints.md); with
        several KV cache groups, retained in every group."""
        return SessionHints(self._life)

    @property
    def groups(self) -> tuple[KVCacheGroup, ...] | None:
        """The KV cache groups of a multi-group offloader (``None``: one group)."""
        return self._life.front.groups

    def check_invariants(self) -> None:
        """Check the scheduler's invariants (every group's, and the cross-group rules),
        then, with tiers, the tier manager's (every group's); raises `InvariantError`
        naming what does not hold."""
        self._life.check_invariants()

    def has_request(self, request_id: str) -> bool:
        """Whether state is kept for ``request_id`` (a live handle, or copies in flight)."""
        return self._life.has_request(request_id)

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
        life = self._life
        life.check_built()
        return life.front.one_group("scheduler")

    @property
    def pool(self) -> CpuBlockPool:
        """The CPU block pool."""
        life = self._life
        life.check_built()
        return life.front.one_group("pool").pool

    @property
    def host(self) -> HostKVBuffer | None:
        """The host buffer, when this object made the copy engine (one group only)."""
        return self._life.host

    def hash_prompt(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hash a prompt's full blocks in this offloader's (first group's) namespace."""
        return hash_prompt(token_ids, self._life.front.hash_block_size, self._namespace)

    def request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        num_computed_tokens: int = 0,
        priority: int = 0,
    ) -> OffloadRequest:
        """A handle for one request: its tokens, incremental block hashes and step calls.

        Use it as ``with off.request(rid, prompt) as req:``; leaving the block finishes the
        request. See `OffloadRequest`.

        Args:
            request_id: the engine's id for the request (unique among live requests).
            prompt_token_ids: the prompt; its full blocks are hashed now.
            num_computed_tokens: tokens of the prompt the engine's own prefix cache holds
                (a multiple of the block size); the lookup starts after them.
            priority: its retention priority (`OffloadScheduler.set_priority()`).

        Raises:
            ClosedError: not open.
            RequestStateError: ``request_id`` is in use (by a handle not finished yet,
                also one that made no call: the id is reserved when its handle is made), or
                finished (ids are never reused).
            InvalidInputError: ``num_computed_tokens`` out of range or not block aligned,
                or a bad ``priority``.
            InputTypeError: a token is not a 64-bit int.
        """
        return open_handle(
            self, self._life, request_id, prompt_token_ids, num_computed_tokens, priority
        )

    def retain_prefix(self, token_ids: Sequence[int], *, owner: Hashable) -> int:
        """`SessionHints.retain_prefix()`: keep a stored prefix until released (with
        several KV cache groups, in every group)."""
        return self.hints.retain_prefix(token_ids, owner=owner)

    def release_retained(self, owner: Hashable) -> int:
        """`SessionHints.release_retained()`."""
        return self.hints.release_retained(owner)

    # -- the engine's step loop ----------------------------------------------------------------

    @overload
    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
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
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_tokens: int,
        num_computed_tokens: int = 0,
        *,
        allow_defer: bool,
        no_read: bool = False,
    ) -> int | None: ...

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
        """Tokens loadable from CPU past the engine's own prefix; pins the hit.

        See `OffloadScheduler.lookup()`. With ``config.tiers``, the blocks after the CPU hit
        that a tier holds are promoted into CPU blocks in the background (see
        `TierManager.extend_lookup()`). ``allow_defer=True`` may answer ``None``, "ask
        again later" (when: see `OffloadScheduler.lookup()`). With several KV cache groups,
        ``block_hashes`` maps each cacheable group's name to its hashes
        (`GroupedScheduler.lookup()`: one hit valid for every group). Why the hit stopped
        where it did: `miss_reason()`.

        Raises:
            ClosedError: not open. ForkedProcessError: used in a forked child.
            WrongContextError: called from a thread other than the event loop's (every
                step-loop call checks this). PinnerError: the pinner's ``unpin`` raised
                after an earlier completion (once).
        """
        life = self._life
        life.check("lookup")  # with tiers, the scheduler asks the tier manager next
        return life.front.lookup(
            request_id,
            block_hashes,
            num_tokens,
            num_computed_tokens,
            allow_defer=allow_defer,
            no_read=no_read,
        )

    def miss_reason(self, request_id: str) -> MissReason:
        """Why ``request_id``'s last lookup's hit stopped where it did (`MissReason`; the
        same rules for one group and several: docs/misses.md).

        Raises:
            UnknownRequestError: no lookup state for that id (none yet, or finished).
        """
        return self._lookup_outcome(request_id)[0]

    def tier_hit_tokens(self, request_id: str) -> dict[str, int]:
        """Of ``request_id``'s last lookup's hit, the tokens each secondary tier (by name)
        brought into the CPU pool; empty when the CPU pool held the whole hit. With
        several KV cache groups, per tier the most any one group's blocks of the hit
        came from it. Raises as `miss_reason()`.
        """
        return self._lookup_outcome(request_id)[1]

    def _lookup_outcome(self, request_id: str) -> tuple[MissReason, dict[str, int]]:
        return self._life.front.lookup_outcome(request_id)

    def load(
        self,
        request_id: str,
        gpu_block_ids: Sequence[int] | Mapping[str, Sequence[int | None]],
        num_tokens: int,
    ) -> TransferTask | None:
        """Start loading the accepted part of the last lookup's hit into the engine's blocks.

        Args:
            request_id: the request.
            gpu_block_ids: its whole GPU block table (see `OffloadScheduler.plan_load()`);
                with several KV cache groups, one table per group name (``None`` for a
                block the group does not hold; `GroupedScheduler.plan_load()`).
            num_tokens: tokens to load (a multiple of the block size, at most the hit;
                with several groups, a multiple of the hit alignment, and less than the
                hit only when every cacheable group is full attention:
                `GroupedScheduler.plan_load()`).

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
        return self._life.load(request_id, gpu_block_ids, num_tokens)

    def abandon_load(self, request_id: str) -> tuple[int, ...] | dict[str, tuple[int, ...]]:
        """Stop waiting for the request's loads in flight; see `OffloadRequest.abandon_load()`.

        Returns the GPU blocks their copies still write (pinned until each ends); with
        several KV cache groups, every group's part is abandoned at once and the blocks
        come per group name. Raises `UnknownRequestError` for an unknown id,
        `ClosedError` when not open.
        """
        return self._life.abandon_load(request_id)

    def update(
        self,
        request_id: str,
        gpu_block_ids: Sequence[int] | Mapping[str, Sequence[int | None]],
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_computed_tokens: int,
    ) -> None:
        """Tell the offloader what the engine holds for a request after a step.

        See `OffloadScheduler.update()`; with several KV cache groups, the tables and the
        hashes per group name (`GroupedScheduler.update()`).
        """
        self._life.update(request_id, gpu_block_ids, block_hashes, num_computed_tokens)

    def store(
        self,
        *,
        after: object | None = None,
        gpu_cache: GpuCacheView | Mapping[str, GpuCacheView] | None = None,
    ) -> list[TransferTask]:
        """Plan and start this step's stores (one batched transfer, or none).

        Args:
            after: what the copy must wait for: a CUDA event recorded after the compute
                that wrote the blocks (default: the current stream at this call), or a
                ``threading.Event`` / future for the thread engine.
            gpu_cache: the engine's cache view, for ``store_mode="lazy"``; with several
                KV cache groups (all full attention), one view per group name.

        Returns:
            The started transfers; awaiting them is optional.

        Raises:
            InputTypeError: ``after`` is of a type the copy engine does not take. The
                plan is undone (cursors go back), so nothing of this step is lost: the
                same blocks are planned by the next call.
            PinnerError: the pinner's ``pin`` raised; the plan is undone the same way.
            InvalidInputError: lazy mode without ``gpu_cache``, or (several groups) views
                that do not name exactly the cacheable groups (InputTypeError: not a
                mapping).
        """
        return self._life.store(after, gpu_cache)

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
        self._life.finish(request_id)

    def preempt(self, request_id: str) -> None:
        """The engine preempted a request. See `OffloadScheduler.preempt()`."""
        self._life.preempt(request_id)

    def release(self, request_id: str) -> None:
        """Drop a lookup pin the engine will not load. See `OffloadScheduler.release()`."""
        self._life.release(request_id)

    async def drain(self) -> None:
        """Wait until every transfer in flight has completed and been processed;
        cancellation cancels only the wait."""
        await self._life.drain()

    async def reset(self) -> bool:
        """Empty the CPU prefix cache and wait for the transfers in flight to end.

        Published blocks are dropped at once (retained ones released) and transfers in
        flight are abandoned: they publish nothing, and awaiting one raises `TransferError`.
        Work the engine starts while this waits is not affected.

        Returns:
            Whether, on return, nothing is cached and nothing is in flight (``False`` only
            when the engine stored or loaded again during the wait).

        Cancellation cancels only the wait; the reset itself has happened.
        """
        return await self._life.reset()

    def statistics(self) -> OffloaderStatistics:
        """Counters of the pool, the scheduler and the poller (and each KV cache group)."""
        return OffloaderStatistics(*self._life.statistics())

    def take_events(self) -> list[PoolEvent]:
        """Pool events since the last call (``enable_events=True``), for KV-aware routers."""
        return self._life.take_events()
