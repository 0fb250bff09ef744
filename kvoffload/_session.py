"""The parts of a `KVOffloader` and their lifecycle: what ``async with`` starts and stops.

One `Session` serves one KV cache group and several. It owns the offloader's lifecycle
(created, open, closing, closed), who may call it (the process that made it, the event
loop's thread, the task that entered), and, keyed by group name (one group: a mapping of
one), the layouts, the GPU tensors, the pinners and the parts that exist only while it
is open: the host buffers and copy engines, the task group that runs the completion
poller and the tiers. It checks every step-loop call, then hands it to its front: the
one object that turns a call into the scheduler's and the launcher's (`Front`, for any
number of groups; one group's API spells a call with one list). The front builds the
scheduler and the `TransferLauncher`, at once or, for a large one-group pool, in a
worker thread on entering. `KVOffloader` is the face.
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, final

import anyio
import anyio.abc
import anyio.to_thread
import torch

from kvoffload._front import GROUP, Front
from kvoffload._logging import get_logger
from kvoffload.config import KVLayout, OffloadConfig
from kvoffload.errors import ClosedError, ForkedProcessError, WrongContextError
from kvoffload.hashing import BlockHash
from kvoffload.launcher import TransferLauncher
from kvoffload.pinner import GpuBlockPinner
from kvoffload.pool.block_pool import PoolEvent, PoolStatistics
from kvoffload.pool.hints import RetentionHints
from kvoffload.scheduler import GpuCacheView, SchedulerStatistics
from kvoffload.storage.host_buffer import HostKVBuffer
from kvoffload.tiers.stats import TierManagerStatistics
from kvoffload.transfer.cuda_engine import CudaCopyEngine
from kvoffload.transfer.engine import CopyEngine
from kvoffload.transfer.poller import PollerStatistics
from kvoffload.transfer.task import TransferTask
from kvoffload.transfer.thread_engine import ThreadCopyEngine

if TYPE_CHECKING:
    from kvoffload.scheduler.groups import GroupStatistics
    from kvoffload.tiers.groups import GroupTiers
    from kvoffload.tiers.manager import TierManager

__all__ = ["Lifecycle", "Session"]

_log = get_logger("offloader")


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


_OPEN = _State.OPEN
_getpid = os.getpid
_get_ident = threading.get_ident


class Lifecycle:
    """The lifecycle and owner checks of a `Session`: the state (created, open,
    closing, closed), the process that made it, the event loop's thread and the task
    that entered it, and the task group that runs while open."""

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
        config: the settings.
        front: the scheduler in the shape of the groups (built now when it
            `builds_inline`, else on `open`).
        layouts: per cacheable group, its layout.
        gpu_kv: per cacheable group, the engine's layer tensors.
        pinners: per group, its pinner (a group not named is not pinned).
        engines: per cacheable group, a copy engine given by the caller (then no host
            buffer is made), or ``None``: a host buffer and an engine per group are made
            on `open`.
    """

    __slots__ = (
        "_config",
        "_kv",
        "_layouts",
        "_own_engines",
        "_pinners",
        "built",
        "engines",
        "front",
        "hints",
        "hosts",
        "launcher",
    )

    def __init__(  # noqa: PLR0917 - one positional per part, named at the only call
        self,
        config: OffloadConfig,
        front: Front,
        layouts: Mapping[str, KVLayout],
        gpu_kv: Mapping[str, Sequence[torch.Tensor]],
        pinners: Mapping[str, GpuBlockPinner],
        engines: Mapping[str, CopyEngine] | None,
    ) -> None:
        self._config = config
        self.front = front
        self._layouts = dict(layouts)
        self._kv = {name: tuple(kv) for name, kv in gpu_kv.items()}
        self._pinners = dict(pinners)
        self._init_lifecycle()
        self._own_engines = engines is None
        self.engines: dict[str, CopyEngine] = dict(engines or {})
        """Per cacheable group, its copy engine (made on `open` unless the caller gave them)."""
        self.hosts: dict[str, HostKVBuffer] = {}
        """Per cacheable group, its host buffer, when this session made the copy engines."""
        self.launcher: TransferLauncher
        self.hints: RetentionHints[Any] = front.make_hints()
        """The session hints (``retain_for_s``), retained through the scheduler."""
        self.built = False
        """Whether the scheduler and the launcher exist."""
        if front.builds_inline:
            self.build()

    def build(self) -> None:
        """Build the scheduler and the launcher (on `open` in a worker thread for large
        pools)."""
        self.launcher = self.front.build(self.engines, self._pinners, self._config.poll_interval_s)
        self.built = True

    def check_built(self) -> None:
        """Raises ClosedError while a large pool is not built yet."""
        if not self.built:
            raise ClosedError(
                f"KVOffloader's pool of {sum(self.front.pool_blocks().values())} blocks is "
                "built on entering 'async with' (off the event loop); use it inside"
            )

    @property
    def tiers(self) -> TierManager | GroupTiers | None:
        """The tiers' front, when ``config.tiers`` is set and the session is open."""
        return self.front.tiers

    @property
    def host(self) -> HostKVBuffer | None:
        """The host buffer of one group, when this session made the copy engine."""
        return self.hosts.get(GROUP) if self.front.groups is None else None

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
        built yet, make the host buffers and copy engines, start the poller and the tiers.

        Raises:
            ClosedError: entered before (a session opens once).
            HostMemoryError: a host buffer could not be allocated or pinned.
            ConfigError: tiers with copy engines given by the caller, or a tier's
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
        config, front = self._config, self.front
        if self._own_engines:
            blocks = front.pool_blocks()
            for name, layout in self._layouts.items():
                host = self.hosts[name] = await HostKVBuffer.create(
                    layout,
                    blocks[name],
                    pin_memory=config.pin_memory,
                    pin_chunk_bytes=int(config.pin_chunk_bytes),
                )
                kv = self._kv[name]
                engine_cls = CudaCopyEngine if kv[0].is_cuda else ThreadCopyEngine
                self.engines[name] = engine_cls(layout, kv, host)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        await self._task_group.start(self.launcher.poller.run)
        if config.tiers:
            await front.start_tiers(self._task_group, self.hosts)
        _log.info(
            "offloader_opened",
            cpu_blocks=front.pool_blocks(),
            bytes_per_block={n: lay.bytes_per_block for n, lay in self._layouts.items()},
            engines={n: type(e).__name__ for n, e in self.engines.items()},
            pinned={n: h.is_pinned for n, h in self.hosts.items()},
        )

    # -- what the offloader asks of its parts ------------------------------------------

    async def reset(self) -> bool:
        """`KVOffloader.reset()`: empty the pools (and tiers), abandon the transfers in
        flight and wait for them; whether nothing is cached or in flight on return."""
        self.check("reset")
        front = self.front
        front.scheduler.reset()
        self.hints.clear()  # the reset released every retained block
        if front.tiers is not None:
            front.tiers.reset()
        launcher = self.launcher
        launcher.unpin_released_holds()
        launcher.abandon_all()
        await launcher.poller.drain()
        return front.is_empty()

    def finish(self, request_id: str) -> None:
        """`KVOffloader.finish()`: finish the request, launch its last store, hold its
        unstored blocks, then raise an earlier pinner error (the request is finished
        first)."""
        self.check("finish", pinner_error=False)
        self.front.finish(request_id)
        self.launcher.raise_pinner_error()

    def preempt(self, request_id: str) -> None:
        """`KVOffloader.preempt()`."""
        self.check("preempt")
        self.front.preempt(request_id)

    def has_request(self, request_id: str) -> bool:
        """`KVOffloader.has_request()`."""
        self.check_built()
        return self.front.has_request(request_id)

    def release(self, request_id: str) -> None:
        """`KVOffloader.release()`."""
        self.check("release")
        self.front.release(request_id)

    async def drain(self) -> None:
        """`KVOffloader.drain()`: wait for every transfer in flight."""
        self.check("drain")
        await self.launcher.poller.drain()

    def load(
        self,
        request_id: str,
        tables: Sequence[int] | Mapping[str, Sequence[int | None]],
        num_tokens: int,
    ) -> TransferTask | None:
        """`KVOffloader.load()`: plan the load, then launch it (``None`` for 0 tokens)."""
        self.check("load")
        return self.front.load(request_id, tables, num_tokens)

    def abandon_load(self, request_id: str) -> tuple[int, ...] | dict[str, tuple[int, ...]]:
        """`KVOffloader.abandon_load()`: the GPU blocks the abandoned copies still write."""
        self.check("abandon_load", pinner_error=False)
        return self.front.abandon_load(request_id)

    def update(
        self,
        request_id: str,
        tables: Sequence[int] | Mapping[str, Sequence[int | None]],
        block_hashes: Sequence[BlockHash] | Mapping[str, Sequence[BlockHash]],
        num_computed_tokens: int,
    ) -> None:
        """`KVOffloader.update()`."""
        self.check("update")
        self.front.update(request_id, tables, block_hashes, num_computed_tokens)

    def store(
        self, after: object | None, gpu_cache: GpuCacheView | Mapping[str, GpuCacheView] | None
    ) -> list[TransferTask]:
        """`KVOffloader.store()`: plan this step's stores and launch them as one transfer;
        the holds that ended are unpinned whatever happens."""
        self.check("store")
        hints = self.hints
        if hints:  # lazy expiry; nothing to do while no hint is live
            hints.expire()
            hints.retry()
        try:
            return self.front.store(after, gpu_cache)
        finally:
            self.launcher.unpin_released_holds()

    def hash_prompt(self, token_ids: Sequence[int]) -> Any:
        """A prompt's hashes, as the hints take them (per group with several)."""
        return self.front.hash_prompt(token_ids)

    def retain(self, block_hashes: Any, owner: Hashable) -> int:
        """`KVOffloader.retain_prefix()` of a hashed prompt: how many blocks are retained."""
        self.check("retain_prefix")
        return self.front.retain(block_hashes, owner)

    def release_retained(self, owner: Hashable) -> int:
        """`KVOffloader.release_retained()`."""
        self.check("release_retained")
        return self.front.release_retained(owner)

    def retain_for(self, block_hashes: Any, retain_for_s: float, session: Hashable) -> int:
        """`KVOffloader.retain_for()` of a hashed prompt: how many blocks are retained now."""
        self.check("retain_for")
        return self.hints.hint(session, self.front.hint_prefix(block_hashes), retain_for_s)

    async def prefetch(self, block_hashes: Any, num_tokens: int) -> int:
        """`SessionHints.prefetch()` of a hashed prompt of ``num_tokens`` tokens: the
        leading blocks (several groups: the tokens) a lookup finds on CPU on return."""
        self.check("prefetch")
        return await self.front.prefetch(block_hashes, num_tokens)

    def release_hint(self, session: Hashable) -> int:
        """`KVOffloader.release_hint()`."""
        self.check("release_hint")
        return self.hints.release(session)

    def take_events(self) -> list[PoolEvent]:
        """`KVOffloader.take_events()`: the pools' events since the last call."""
        self.check_built()
        return self.front.take_events()

    def statistics(
        self,
    ) -> tuple[
        PoolStatistics,
        SchedulerStatistics,
        PollerStatistics,
        TierManagerStatistics | None,
        dict[str, GroupStatistics] | None,
    ]:
        """The parts' statistics, for `OffloaderStatistics`."""
        self.check_built()
        pool, scheduler, groups = self.front.statistics()
        tiers = self.front.tiers
        return (
            pool,
            scheduler,
            self.launcher.poller.statistics(),
            tiers.statistics() if tiers is not None else None,
            groups,
        )

    def check_invariants(self) -> None:
        """The scheduler's invariants, then the tiers' (see `KVOffloader.check_invariants()`)."""
        self.check_built()
        self.front.scheduler.check_invariants()
        tiers = self.front.tiers
        if tiers is not None:
            tiers.check_invariants()

    # -- checks ------------------------------------------------------------------------

    def check(self, what: str, *, pinner_error: bool = True) -> None:
        """Refuse a step-loop call named ``what`` unless it may run now.

        Raises:
            ForkedProcessError: called in a forked child.
            ClosedError: not open.
            WrongContextError: called from a thread other than the event loop's.
            TransferError: the completion poller failed (see `CompletionPoller`).
            PinnerError: with ``pinner_error``, an earlier ``unpin`` raised (once).
        """
        if (  # every step call's path: each condition read inline, no call but the two
            self._state is _OPEN
            and _getpid() == self._pid
            and (self._loop_thread is None or _get_ident() == self._loop_thread)
        ):
            launcher = self.launcher
            if launcher.poller.callback_error is None and (
                launcher.pinner_error is None or not pinner_error
            ):
                return
        # something to refuse: the checks in their order name it
        self._check_open(what)
        launcher = self.launcher
        launcher.poller.check_health()
        if pinner_error:
            launcher.raise_pinner_error()

    async def shutdown(self) -> None:
        """Close the copy engines, process the last completions, release every hold and
        every retained block, close the tiers, the task group and the host buffers;
        shielded from cancellation."""
        self._state = _State.CLOSING
        front = self.front
        try:
            with anyio.CancelScope(shield=True):
                for engine in self.engines.values():
                    await engine.aclose()
                if self.built:
                    # Every copy has ended now. Deliver what the poller has not (it may
                    # have been cancelled with the scope around 'async with').
                    await self.launcher.collect(self._config.poll_interval_s)
                    front.scheduler.release_all_holds()
                    self.launcher.unpin_released_holds()
                    # retain_prefix() owners and session hints end with the offloader
                    self.hints.clear()
                    front.release_all_retained()
                if front.tiers is not None:
                    await front.tiers.aclose()
        finally:
            try:
                await self._close_task_group()
            finally:
                for host in self.hosts.values():
                    host.close()
                self._state = _State.CLOSED
                if self.built:
                    _log.info("offloader_closed", **_counts(front.statistics()[1]))


def _counts(stats: SchedulerStatistics) -> dict[str, int]:
    return {
        "stored_blocks": stats.stored_blocks,
        "loaded_blocks": stats.loaded_blocks,
        "deferred_blocks": stats.deferred_blocks,
        "failed_stores": stats.failed_stores,
        "failed_loads": stats.failed_loads,
    }
