"""`TierBridge`: kvoffload's tiers, called from an engine's own threads.

The tiers are asynchronous and run on an event loop; vLLM's secondary tiers and SGLang's
HiCache backends call from the engine's own threads (a scheduler thread, prefetch and
backup threads). The bridge runs the tiers on a private event loop in a thread of its
own and offers every operation twice: blocking (``exists``, ``get``, ``put``, ``delete``)
and non-blocking (``submit_*``, returning a `concurrent.futures.Future`).

Every operation goes through `kvoffload.tiers.ops`, as the tier manager's do: each tier
call runs within the tier's ``op_timeout_s`` and its `PriorityGate`; a failure marks the
tier unhealthy (it is skipped, so lookups are misses at once, and pinged back with
backoff: `TierHealth`); every block read is verified (header, namespace, hash, length,
checksum) and a block that fails is a miss and is deleted from its tier.

Keys: an engine's own key bytes become a 32-byte `BlockHash` under the bridge's namespace
(`engine_namespace()`: model, layout, dtype, rank), and every block's header carries the
namespace, so a block written under another one is never served.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, final

import anyio
import anyio.abc

from kvoffload._logging import get_logger
from kvoffload.errors import ClosedError, ConfigError, WrongContextError
from kvoffload.hashing import BlockHash, HashNamespace
from kvoffload.tiers.build import build_tier
from kvoffload.tiers.health import TierHealth, TierState
from kvoffload.tiers.ops import probe, read_verified, write_blocks

if TYPE_CHECKING:
    from kvoffload.tier_config import AnyTierSettings
    from kvoffload.tiers.base import SecondaryTier
    from kvoffload.tiers.stats import TierStatistics

__all__ = ["TierBridge", "engine_namespace"]

_log = get_logger("tiers.bridge")
_R = TypeVar("_R")
_AnyFuture = concurrent.futures.Future[Any]


def engine_namespace(*, model: str, layout: str, dtype: str, rank: int) -> bytes:
    """The 32-byte namespace of an engine's blocks: its model, its KV layout (any text that
    changes with the geometry), its KV dtype and its rank (tensor/pipeline position)."""
    return HashNamespace(model_id=model, dtype=dtype, layout=layout, salt=f"rank={rank}").root


@final
class TierBridge:
    """Runs tiers on a private event loop thread; callable from any other thread.

    Args:
        tiers: ``(tier, settings)`` pairs, in lookup order (fastest first), not opened;
            `from_settings()` builds them from tier settings.
        namespace: the 32-byte namespace of every key and header (`engine_namespace()`).
        block_nbytes: bytes of one block.
        name: the loop thread's name.

    The tiers are opened before the constructor returns (each within its
    ``op_timeout_s``; one that fails starts unhealthy and is retried with backoff).
    `close()` ends the thread; use after close raises `ClosedError`.

    Raises:
        ConfigError: the namespace is not 32 bytes or ``block_nbytes`` is below 1.
    """

    def __init__(
        self,
        tiers: Sequence[tuple[SecondaryTier, AnyTierSettings]],
        *,
        namespace: bytes,
        block_nbytes: int,
        name: str = "kvoffload-tier-bridge",
    ) -> None:
        if len(namespace) != 32:
            raise ConfigError(f"namespace: {len(namespace)} bytes, a namespace has 32")
        if block_nbytes < 1:
            raise ConfigError(f"block_nbytes={block_nbytes}: a block has at least one byte")
        self._pairs = tuple(tiers)
        self._namespace = namespace
        self._nbytes = block_nbytes
        self._health = TierHealth(None)
        self._states: list[TierState] = []
        self._lock = threading.Lock()
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._active = 0
        self._drain = True
        self._stop: anyio.Event | None = None
        self._idle: anyio.Event | None = None
        self._queue: asyncio.Queue[tuple[Callable[[], Awaitable[Any]], _AnyFuture]] = (
            asyncio.Queue()
        )
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._main(started),), name=name, daemon=True
        )
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self._thread.join()
            raise

    @classmethod
    def from_settings(
        cls,
        settings: Sequence[AnyTierSettings],
        *,
        namespace: bytes,
        block_nbytes: int,
        name: str = "kvoffload-tier-bridge",
    ) -> TierBridge:
        """A bridge over the tiers ``settings`` describe (validated, e.g. by
        `kvoffload.tier_config.parse_tier_settings`), built by `build_tier()`.

        Raises:
            ConfigError: a tier cannot be built (see `build_tier()`).
        """
        pairs = [
            (build_tier(s, i, namespace=namespace, block_nbytes=block_nbytes), s)
            for i, s in enumerate(settings)
        ]
        return cls(pairs, namespace=namespace, block_nbytes=block_nbytes, name=name)

    def __repr__(self) -> str:
        names = ",".join(tier.name for tier, _ in self._pairs)
        return f"TierBridge(tiers=[{names}], closed={self._closing})"

    @property
    def namespace(self) -> bytes:
        """The 32-byte namespace of every key and block header."""
        return self._namespace

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block."""
        return self._nbytes

    def key(self, raw: bytes) -> BlockHash:
        """The tier key of an engine's own key bytes, under this bridge's namespace."""
        return BlockHash(hashlib.sha256(self._namespace + raw).digest())

    # -- the loop thread -------------------------------------------------------------------

    async def _main(self, started: concurrent.futures.Future[None]) -> None:
        try:
            self._states = [TierState.from_settings(tier, s) for tier, s in self._pairs]
            self._stop = anyio.Event()
            self._idle = anyio.Event()
            async with anyio.create_task_group() as tg:
                for t in self._states:
                    try:
                        with anyio.fail_after(t.timeout_s):
                            await t.tier.open()
                    except Exception as exc:
                        self._health.fault(t, exc, "open")
                    else:
                        t.opened = t.healthy = True
                    tg.start_soon(self._health.watch, t)
                tg.start_soon(self._dispatch, tg)
                self._loop = asyncio.get_running_loop()
                self._tg = tg
                started.set_result(None)
                await self._stop.wait()
                while self._drain and self._active:
                    self._idle = anyio.Event()
                    await self._idle.wait()
                tg.cancel_scope.cancel()
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise
        finally:
            self._tg = None
            while not self._queue.empty():  # cancelled before they started
                _, future = self._queue.get_nowait()
                if future.set_running_or_notify_cancel():
                    future.set_exception(ClosedError("the tier bridge closed before the job"))
                self._done_one()
            with anyio.CancelScope(shield=True):
                for tier, s in self._pairs:
                    with anyio.move_on_after(s.op_timeout_s):
                        try:
                            await tier.close()
                        except Exception as exc:
                            _log.warning("tier_close_failed", tier=tier.name, error=repr(exc))

    async def _dispatch(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the submitted jobs in the task group, in submission order."""
        queue = self._queue
        while True:
            fn, future = await queue.get()
            tg.start_soon(self._job, fn, future)

    async def _job(
        self, fn: Callable[[], Awaitable[_R]], future: concurrent.futures.Future[_R]
    ) -> None:
        try:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = await fn()
            except anyio.get_cancelled_exc_class():
                future.set_exception(ClosedError("the tier bridge closed during the job"))
                raise
            except Exception as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
        finally:
            self._done_one()

    def _done_one(self) -> None:
        with self._lock:
            self._active -= 1
            idle = not self._active
        if idle and self._idle is not None:
            self._idle.set()

    def _submit(self, fn: Callable[[], Awaitable[_R]]) -> concurrent.futures.Future[_R]:
        future: concurrent.futures.Future[_R] = concurrent.futures.Future()
        with self._lock:
            if self._closing or self._loop is None:
                raise ClosedError(f"{self!r} is closed")
            self._active += 1
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (fn, future))
        return future

    def _wait(self, future: concurrent.futures.Future[_R]) -> _R:
        if threading.current_thread() is self._thread:
            raise WrongContextError("a blocking tier bridge call from its own loop thread")
        return future.result()

    # -- operations ------------------------------------------------------------------------

    def submit_exists(self, hashes: Sequence[BlockHash]) -> concurrent.futures.Future[int]:
        """Start a probe: how many of ``hashes``, from the first, the healthy tiers hold
        together (a leading run; an unhealthy or slow tier's blocks count as absent)."""
        hashes = tuple(hashes)

        async def run() -> int:
            sources = await probe(self._states, self._health, hashes)
            return sources[-1][2] if sources else 0

        return self._submit(run)

    def exists(self, hashes: Sequence[BlockHash]) -> int:
        """`submit_exists()` and wait for it."""
        return self._wait(self.submit_exists(hashes))

    def submit_get(
        self, hashes: Sequence[BlockHash], into: Sequence[memoryview]
    ) -> concurrent.futures.Future[list[bool]]:
        """Start reading blocks into ``into`` (one ``block_nbytes`` buffer each, kept alive
        and untouched by the caller until the future is done): each tier in order is asked
        for the blocks the ones before it missed.

        The future's result: per block, whether it arrived and passed verification. A
        block that is not good left undefined bytes in its buffer; one that failed a check
        was deleted from its tier.

        Raises:
            ValueError: the numbers of hashes and buffers differ, or a buffer is not one
                block long.
        """
        hashes = tuple(hashes)
        views = tuple(into)
        if len(hashes) != len(views):
            raise ValueError(f"{len(hashes)} hashes but {len(views)} buffers")
        for i, view in enumerate(views):
            if view.nbytes != self._nbytes:
                raise ValueError(f"into[{i}] has {view.nbytes} bytes, a block {self._nbytes}")

        async def run() -> list[bool]:
            good = [False] * len(hashes)
            for t in self._states:
                left = [i for i, ok in enumerate(good) if not ok]
                for at in range(0, len(left), t.max_batch):
                    if not t.healthy:
                        break
                    chunk = left[at : at + t.max_batch]
                    got = await read_verified(
                        t,
                        self._health,
                        [hashes[i] for i in chunk],
                        [views[i] for i in chunk],
                        namespace=self._namespace,
                        nbytes=self._nbytes,
                    )
                    for i, ok in zip(chunk, got, strict=True):
                        good[i] = ok
            return good

        return self._submit(run)

    def get(self, hashes: Sequence[BlockHash], into: Sequence[memoryview]) -> list[bool]:
        """`submit_get()` and wait for it."""
        return self._wait(self.submit_get(hashes, into))

    def submit_put(
        self, hashes: Sequence[BlockHash], payloads: Sequence[memoryview]
    ) -> concurrent.futures.Future[int]:
        """Start writing blocks to every healthy, writable tier (the payloads stay alive
        and unchanged until the future is done).

        The future's result: the most blocks any one tier reported stored (0: none
        landed anywhere).

        Raises:
            ValueError: the numbers differ, or a payload is not one block long.
        """
        run = self._put_job(hashes, payloads)

        async def best() -> int:
            return max(await run(), default=0)

        return self._submit(best)

    def submit_put_each(
        self, hashes: Sequence[BlockHash], payloads: Sequence[memoryview]
    ) -> concurrent.futures.Future[tuple[int, ...]]:
        """`submit_put()`, whose future's result is, per tier in lookup order, the blocks
        that tier reported stored (a tier's count equal to ``len(hashes)``: every block
        landed there)."""
        return self._submit(self._put_job(hashes, payloads))

    def _put_job(
        self, hashes: Sequence[BlockHash], payloads: Sequence[memoryview]
    ) -> Callable[[], Awaitable[tuple[int, ...]]]:
        hashes = tuple(hashes)
        views = tuple(payloads)
        if len(hashes) != len(views):
            raise ValueError(f"{len(hashes)} hashes but {len(views)} payloads")
        for i, view in enumerate(views):
            if view.nbytes != self._nbytes:
                raise ValueError(f"payloads[{i}] has {view.nbytes} bytes, a block {self._nbytes}")

        async def run() -> tuple[int, ...]:
            counts = []
            for t in self._states:
                stored = 0
                for at in range(0, len(hashes), t.max_batch):
                    stored += await write_blocks(
                        t,
                        self._health,
                        hashes[at : at + t.max_batch],
                        views[at : at + t.max_batch],
                        namespace=self._namespace,
                        nbytes=self._nbytes,
                    )
                counts.append(stored)
            return tuple(counts)

        return run

    def put(self, hashes: Sequence[BlockHash], payloads: Sequence[memoryview]) -> int:
        """`submit_put()` and wait for it."""
        return self._wait(self.submit_put(hashes, payloads))

    def submit_delete(self, hashes: Sequence[BlockHash]) -> concurrent.futures.Future[None]:
        """Start removing blocks from every healthy tier (absent ones are ignored)."""
        hashes = tuple(hashes)

        async def run() -> None:
            for t in self._states:
                if not t.healthy or not hashes:
                    continue
                await t.gate.acquire(read=False)
                try:
                    with anyio.fail_after(t.timeout_s):
                        await t.tier.delete(hashes)
                except Exception as exc:
                    self._health.fault(t, exc, "delete")
                finally:
                    t.gate.release()

        return self._submit(run)

    def delete(self, hashes: Sequence[BlockHash]) -> None:
        """`submit_delete()` and wait for it."""
        self._wait(self.submit_delete(hashes))

    def submit_statistics(self) -> concurrent.futures.Future[tuple[TierStatistics, ...]]:
        """Start taking every tier's counters (`TierStatistics`), in lookup order."""

        async def run() -> tuple[TierStatistics, ...]:
            return tuple(t.snapshot() for t in self._states)

        return self._submit(run)

    def statistics(self) -> tuple[TierStatistics, ...]:
        """`submit_statistics()` and wait for it."""
        return self._wait(self.submit_statistics())

    # -- lifecycle -------------------------------------------------------------------------

    def close(self, *, drain: bool = True) -> None:
        """Stop: with ``drain``, wait for the jobs submitted so far (each bounded by its
        tiers' ``op_timeout_s``); without, cancel them (their futures raise `ClosedError`;
        a copy already running in a worker thread finishes first). Then close the tiers
        and end the loop thread. Idempotent; blocks until the thread has ended.
        """
        if threading.current_thread() is self._thread:
            raise WrongContextError("TierBridge.close() from its own loop thread")
        with self._lock:
            loop, first = self._loop, not self._closing
            self._closing = True
            if first and loop is not None:
                # RuntimeError: the loop already ended (it failed)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._begin_stop, drain)
        self._thread.join()

    def _begin_stop(self, drain: bool) -> None:
        self._drain = drain
        if not drain and self._tg is not None:
            self._tg.cancel_scope.cancel()
        if self._stop is not None:
            self._stop.set()

    def __enter__(self) -> TierBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
